/*
 * swiglu_plugin_common.cpp: field parsing, logging, the shared IPluginV3 base, and the library entry points.
 *
 * The library exports only getCreators and setLoggerFinder (exports.map), the form TensorRT loads with
 * IPluginRegistry::loadLibrary (trtexec --dynamicPlugins) into the full, lean or dispatch runtime.
 */
#include "swiglu_plugin_common.h"

#include <cstdio>
#include <cstring>
#include <mutex>

#include "tilevox_kernels.h"

using namespace nvinfer1;

namespace tilevox_trt {
namespace {

std::mutex gLoggerMutex;
ILoggerFinder* gLoggerFinder = nullptr;

// Field order matches trt_plugins/registry.py; the data pointers are unused by getFieldNames() callers.
PluginField const kSwigluFieldList[] = {
    PluginField("kernel", nullptr, PluginFieldType::kINT32, 1),
    PluginField("block", nullptr, PluginFieldType::kINT32, 1),
    PluginField("tile_config", nullptr, PluginFieldType::kINT32, 1),
    PluginField("down_tile_config", nullptr, PluginFieldType::kINT32, 1),
};
PluginFieldCollection const kGateupFieldNames{3, kSwigluFieldList};
PluginFieldCollection const kMlpFieldNames{4, kSwigluFieldList};

bool readInt(PluginField const& field, int32_t& out) {
  if (field.data == nullptr || field.length != 1) return false;
  if (field.type == PluginFieldType::kINT32) {
    out = *static_cast<int32_t const*>(field.data);
    return true;
  }
  if (field.type == PluginFieldType::kINT64) {
    int64_t const value = *static_cast<int64_t const*>(field.data);
    if (value < INT32_MIN || value > INT32_MAX) return false;
    out = static_cast<int32_t>(value);
    return true;
  }
  return false;
}

}  // namespace

void logError(std::string const& message) noexcept {
  ILogger* logger = nullptr;
  {
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    if (gLoggerFinder != nullptr) logger = gLoggerFinder->findLogger();
  }
  std::string const text = "tilevox plugin: " + message;
  if (logger != nullptr) {
    logger->log(ILogger::Severity::kERROR, text.c_str());
  } else {
    std::fprintf(stderr, "%s\n", text.c_str());
  }
}

bool parseSwigluFields(PluginFieldCollection const* fc, bool hasDownField, SwigluFields& out) noexcept {
  SwigluFields fields;  // fields the node does not carry keep the registry defaults
  for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    int32_t* target = nullptr;
    if (std::strcmp(f.name, "kernel") == 0) target = &fields.kernel;
    else if (std::strcmp(f.name, "block") == 0) target = &fields.block;
    else if (std::strcmp(f.name, "tile_config") == 0) target = &fields.tile_config;
    else if (hasDownField && std::strcmp(f.name, "down_tile_config") == 0) target = &fields.down_tile_config;
    if (target == nullptr) {
      logError(std::string("unknown field '") + f.name + "'");
      return false;
    }
    if (!readInt(f, *target)) {
      logError(std::string("field '") + f.name + "' must be one kINT32 or kINT64 value in int32 range");
      return false;
    }
  }
  if (fields.kernel != TILEVOX_KERNEL_DUAL_PINGPONG && fields.kernel != TILEVOX_KERNEL_PACKED_EVT) {
    logError("field kernel must be 1 (dual Pingpong) or 2 (packed EVT), got " + std::to_string(fields.kernel));
    return false;
  }
  if (fields.kernel == TILEVOX_KERNEL_DUAL_PINGPONG && fields.block != 0) {
    logError("kernel 1 uses the [gate; up] concatenation: block must be 0, got " + std::to_string(fields.block));
    return false;
  }
  if (fields.kernel == TILEVOX_KERNEL_PACKED_EVT && fields.block != tilevox_swiglu_packing_block()) {
    logError("kernel 2 weights must be packed with this library's block " +
             std::to_string(tilevox_swiglu_packing_block()) + ", got " + std::to_string(fields.block));
    return false;
  }
  if (fields.tile_config < -1 || fields.down_tile_config < -1) {
    logError("tile configs must be -1 (heuristic) or an index >= 0");
    return false;
  }
  out = fields;
  return true;
}

PluginFieldCollection const* swigluFieldNames(bool hasDownField) noexcept {
  return hasDownField ? &kMlpFieldNames : &kGateupFieldNames;
}

SwigluPluginBase::SwigluPluginBase(SwigluFields const& fields, bool hasDown) : fields_(fields), hasDown_(hasDown) {}

IPluginCapability* SwigluPluginBase::getCapabilityInterface(PluginCapabilityType type) noexcept {
  switch (type) {
    case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

int32_t SwigluPluginBase::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                             int32_t nbInputs) const noexcept {
  if (nbOutputs != 1 || nbInputs != this->nbInputs()) return -1;
  outputTypes[0] = inputTypes[0];
  return 0;
}

bool SwigluPluginBase::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                                 int32_t nbOutputs) noexcept {
  // The kernels take row-major bf16 only, for every input and the output.
  if (nbInputs != this->nbInputs() || nbOutputs != 1 || pos < 0 || pos >= nbInputs + nbOutputs) return false;
  return inOut[pos].desc.type == DataType::kBF16 && inOut[pos].desc.format == TensorFormat::kLINEAR;
}

bool SwigluPluginBase::checkShapes(Dims const* dims, int32_t nbInputs) const noexcept {
  if (nbInputs != this->nbInputs()) return false;
  Dims const& x = dims[0];
  Dims const& w = dims[1];
  if (x.nbDims < 1 || w.nbDims != 2) {
    logError("x must be (..., K) and w_packed (2N, K)");
    return false;
  }
  int64_t const k = x.d[x.nbDims - 1];
  if (k >= 0 && w.d[1] >= 0 && k != w.d[1]) {
    logError("x's last dim " + std::to_string(k) + " != w_packed's K " + std::to_string(w.d[1]));
    return false;
  }
  if (w.d[0] >= 0 && w.d[0] % 2 != 0) {
    logError("w_packed must have 2N rows, got " + std::to_string(w.d[0]));
    return false;
  }
  if (hasDown_) {
    Dims const& wd = dims[2];
    if (wd.nbDims != 2 || (w.d[0] >= 0 && wd.d[1] >= 0 && wd.d[1] != w.d[0] / 2)) {
      logError("w_down must be (H, N) with N = w_packed rows / 2");
      return false;
    }
  }
  return true;
}

int32_t SwigluPluginBase::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                          DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
  if (nbOutputs != 1 || nbInputs != this->nbInputs()) return -1;
  Dims dims[3];
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].desc.dims;
  return checkShapes(dims, nbInputs) ? 0 : -1;
}

int32_t SwigluPluginBase::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                                        int32_t nbOutputs) noexcept {
  if (nbOutputs != 1 || nbInputs != this->nbInputs()) return -1;
  Dims dims[3];
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].dims;
  return checkShapes(dims, nbInputs) ? 0 : -1;
}

IPluginV3* SwigluPluginBase::attachToContext(IPluginResourceContext* /*context*/) noexcept {
  // No per-context resources: the launchers are stateless and all scratch lives in the workspace.
  return clone();
}

PluginFieldCollection const* SwigluPluginBase::getFieldsToSerialize() noexcept {
  serialized_.clear();
  serialized_.emplace_back("kernel", &fields_.kernel, PluginFieldType::kINT32, 1);
  serialized_.emplace_back("block", &fields_.block, PluginFieldType::kINT32, 1);
  serialized_.emplace_back("tile_config", &fields_.tile_config, PluginFieldType::kINT32, 1);
  if (hasDown_) serialized_.emplace_back("down_tile_config", &fields_.down_tile_config, PluginFieldType::kINT32, 1);
  serializedCollection_.nbFields = static_cast<int32_t>(serialized_.size());
  serializedCollection_.fields = serialized_.data();
  return &serializedCollection_;
}

void SwigluPluginBase::gemmSizes(Dims const& x, Dims const& wPacked, int64_t& m, int64_t& n, int64_t& k) {
  m = 1;
  for (int32_t i = 0; i + 1 < x.nbDims; ++i) m *= x.d[i];
  k = x.d[x.nbDims - 1];
  n = wPacked.d[0] / 2;
}

bool SwigluPluginBase::launchGateup(void const* x, void const* wPacked, void* out, int64_t m, int64_t n, int64_t k,
                                    cudaStream_t stream) const noexcept {
  bool const isDual = fields_.kernel == TILEVOX_KERNEL_DUAL_PINGPONG;
  char const* w = static_cast<char const*>(wPacked);
  tilevox_swiglu_gateup_params params{};
  params.x = x;
  params.w_gate = isDual ? w : nullptr;
  params.w_up = isDual ? w + n * k * 2 : nullptr;  // [Wg; Wu]: Wu starts at row N (bf16 = 2 bytes)
  params.w_packed = isDual ? nullptr : w;
  params.out = out;
  params.m = m;
  params.n = n;
  params.k = k;
  params.ldx = k;
  params.ldo = n;
  params.kernel = fields_.kernel;
  params.tile_config = fields_.tile_config;
  int const status = tilevox_swiglu_gateup_launch(&params, stream);
  if (status != TILEVOX_OK) {
    logError("tilevox_swiglu_gateup_launch failed (status " + std::to_string(status) + "): " + tilevox_last_error());
    return false;
  }
  return true;
}

}  // namespace tilevox_trt

extern "C" __attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static IPluginCreatorInterface* const creators[] = {
      tilevox_trt::swigluGateupCreator(),
      tilevox_trt::swigluMlpCreator(),
#ifdef TILEVOX_MEGAKERNEL_REGION  // build.py --megakernel-region
      tilevox_trt::megakernelRegionCreator(),
#endif
  };
  nbCreators = sizeof(creators) / sizeof(creators[0]);
  return creators;
}

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder* finder) {
  std::lock_guard<std::mutex> lock(tilevox_trt::gLoggerMutex);
  if (tilevox_trt::gLoggerFinder == nullptr) tilevox_trt::gLoggerFinder = finder;
}
