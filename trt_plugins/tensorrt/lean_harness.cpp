/*
 * lean_harness.cpp: libtilevox_lean_harness.so, a test harness that drives a tilevox plugin the way TensorRT does.
 *
 * tilevox_harness_run() dlopens the TensorRT lean runtime (libnvinfer_lean.so.11, from the
 * tensorrt-lean-cu13-libs wheel), loads the plugin library through the runtime's plugin registry, finds the
 * creator by (name, version, namespace), creates the plugin from parser-style kINT32 fields, runs the build
 * capability queries, round-trips the serialized fields into a runtime-phase plugin, attaches it, and calls
 * onShapeChange + enqueue on caller-owned device buffers (the Python test passes torch tensors and compares the
 * output with the torch op). tilevox_harness_describe() lists a plugin library's creators without TensorRT.
 * Needs the TensorRT headers only; links no TensorRT or CUDA library.
 */
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "NvInferRuntime.h"

using namespace nvinfer1;

namespace {

constexpr char const* kV3OneKind = "PLUGIN CREATOR_V3ONE";

class CollectingLogger : public ILogger {
 public:
  void log(Severity severity, AsciiChar const* msg) noexcept override {
    if (severity <= Severity::kERROR) errored = true;
    if (severity <= Severity::kWARNING) messages << "[trt " << static_cast<int>(severity) << "] " << msg << "\n";
  }
  std::ostringstream messages;
  bool errored = false;
};

char const* typeName(PluginFieldType type) {
  switch (type) {
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    case PluginFieldType::kCHAR: return "kCHAR";
    case PluginFieldType::kUNKNOWN: return "kUNKNOWN";
    default: return "other";
  }
}

void copyOut(std::string const& text, char* out, int32_t outLen) {
  if (out == nullptr || outLen <= 0) return;
  std::size_t const n = text.size() < static_cast<std::size_t>(outLen - 1) ? text.size() : outLen - 1;
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

Dims makeDims(int64_t const* d, int32_t nbDims) {
  Dims dims{};
  dims.nbDims = nbDims;
  for (int32_t i = 0; i < nbDims; ++i) dims.d[i] = d[i];
  return dims;
}

}  // namespace

extern "C" {

/* One harness case; pointers are device pointers except the descriptors. Mirrored in tests/trt_plugins. */
typedef struct tilevox_harness_case {
  char const* lean_lib;
  char const* plugin_lib;
  char const* plugin_name;
  char const* plugin_version;
  char const* plugin_namespace;
  int32_t nb_fields;
  char const* const* field_names;
  int32_t const* field_values;
  int32_t nb_inputs;
  void const* const* inputs;
  int64_t const* input_dims; /* nb_inputs x 8, row i holds input i's dims */
  int32_t const* input_nb_dims;
  void* output;
  int64_t const* output_dims; /* 8 */
  int32_t output_nb_dims;
  void* workspace;
  int64_t workspace_bytes;
  void* stream;
  /* 1: use the library-global registry (getPluginRegistry), which needs no CUDA; 0: an IRuntime's registry. */
  int32_t use_global_registry;
} tilevox_harness_case;

__attribute__((visibility("default"))) int32_t tilevox_harness_describe(char const* pluginLib, char* out,
                                                                         int32_t outLen) {
  void* handle = dlopen(pluginLib, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    copyOut(std::string("dlopen failed: ") + dlerror(), out, outLen);
    return 1;
  }
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  auto getCreators = reinterpret_cast<GetCreators>(dlsym(handle, "getCreators"));
  if (getCreators == nullptr || dlsym(handle, "setLoggerFinder") == nullptr) {
    copyOut("the library does not export getCreators and setLoggerFinder", out, outLen);
    return 1;
  }
  int32_t nb = 0;
  IPluginCreatorInterface* const* creators = getCreators(nb);
  std::ostringstream json;
  json << "[";
  for (int32_t i = 0; i < nb; ++i) {
    json << (i ? "," : "") << "{\"kind\":\"" << creators[i]->getInterfaceInfo().kind << "\"";
    if (std::strcmp(creators[i]->getInterfaceInfo().kind, kV3OneKind) == 0) {
      auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
      json << ",\"name\":\"" << c->getPluginName() << "\",\"version\":\"" << c->getPluginVersion()
           << "\",\"namespace\":\"" << c->getPluginNamespace() << "\",\"fields\":[";
      PluginFieldCollection const* fc = c->getFieldNames();
      for (int32_t f = 0; fc != nullptr && f < fc->nbFields; ++f) {
        json << (f ? "," : "") << "[\"" << fc->fields[f].name << "\",\"" << typeName(fc->fields[f].type) << "\"]";
      }
      json << "]";
    }
    json << "}";
  }
  json << "]";
  copyOut(json.str(), out, outLen);
  return 0;  // the library stays loaded: its creators are static objects other code may still hold
}

__attribute__((visibility("default"))) int32_t tilevox_harness_run(tilevox_harness_case const* c, char* report,
                                                                    int32_t reportLen) {
  std::ostringstream log;
  int32_t failures = 0;
  auto check = [&](bool ok, std::string const& what) {
    log << (ok ? "PASS " : "FAIL ") << what << "\n";
    if (!ok) ++failures;
    return ok;
  };
  auto finish = [&](CollectingLogger* logger) {
    if (logger != nullptr) log << logger->messages.str();
    copyOut(log.str(), report, reportLen);
    return failures == 0 ? 0 : 1;
  };

  void* lean = dlopen(c->lean_lib, RTLD_NOW | RTLD_GLOBAL);
  if (!check(lean != nullptr, std::string("dlopen lean runtime ") + c->lean_lib)) {
    log << dlerror() << "\n";
    return finish(nullptr);
  }
  static CollectingLogger logger;  // TensorRT keeps the logger for the process lifetime
  logger.messages.str("");
  logger.errored = false;
  IRuntime* runtime = nullptr;
  IPluginRegistry* registryPtr = nullptr;
  if (c->use_global_registry) {
    using GetRegistry = IPluginRegistry* (*)();
    auto getRegistry = reinterpret_cast<GetRegistry>(dlsym(lean, "getPluginRegistry"));
    registryPtr = getRegistry != nullptr ? getRegistry() : nullptr;
    if (!check(registryPtr != nullptr, "lean library's global getPluginRegistry()")) return finish(&logger);
  } else {
    using CreateRuntime = void* (*)(void*, int32_t);
    auto createRuntime = reinterpret_cast<CreateRuntime>(dlsym(lean, "createInferRuntime_INTERNAL"));
    if (!check(createRuntime != nullptr, "lean runtime exports createInferRuntime_INTERNAL")) return finish(nullptr);
    void* created = createRuntime(&logger, NV_TENSORRT_VERSION);
    // Without a usable CUDA driver the lean library logs an error and returns an unusable pointer: trust the log.
    if (!check(created != nullptr && !logger.errored, "createInferRuntime")) return finish(&logger);
    runtime = static_cast<IRuntime*>(created);
    registryPtr = &runtime->getPluginRegistry();
  }
  using LibVersion = int32_t (*)();
  if (auto v = reinterpret_cast<LibVersion>(dlsym(lean, "getInferLibMajorVersion"))) {
    auto minor = reinterpret_cast<LibVersion>(dlsym(lean, "getInferLibMinorVersion"));
    log << "INFO headers " << NV_TENSORRT_MAJOR << "." << NV_TENSORRT_MINOR << ", lean library " << v() << "."
        << (minor ? minor() : -1) << "\n";
  }

  IPluginRegistry& registry = *registryPtr;
  IPluginRegistry::PluginLibraryHandle libHandle = registry.loadLibrary(c->plugin_lib);
  if (!check(libHandle != nullptr, std::string("registry.loadLibrary ") + c->plugin_lib)) {
    delete runtime;
    return finish(&logger);
  }
  check(registry.getCreator(c->plugin_name, c->plugin_version, "no_such_namespace") == nullptr,
        "lookup with a wrong namespace finds nothing");
  IPluginCreatorInterface* iface = registry.getCreator(c->plugin_name, c->plugin_version, c->plugin_namespace);
  IPluginV3* buildPlugin = nullptr;
  IPluginV3* runtimePlugin = nullptr;
  IPluginV3* attached = nullptr;
  do {
    if (!check(iface != nullptr, std::string("getCreator(") + c->plugin_name + ", " + c->plugin_version + ", " +
                                     c->plugin_namespace + ")")) break;
    if (!check(std::strcmp(iface->getInterfaceInfo().kind, kV3OneKind) == 0, "creator is IPluginCreatorV3One")) break;
    auto* creator = static_cast<IPluginCreatorV3One*>(iface);

    // Fields as the ONNX parser builds them from INT attributes: kINT32, one element each.
    std::vector<PluginField> fields;
    for (int32_t i = 0; i < c->nb_fields; ++i) {
      fields.emplace_back(c->field_names[i], &c->field_values[i], PluginFieldType::kINT32, 1);
    }
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    buildPlugin = creator->createPlugin(c->plugin_name, &fc, TensorRTPhase::kBUILD);
    if (!check(buildPlugin != nullptr, "createPlugin(kBUILD) from kINT32 fields")) break;

    auto* core = static_cast<IPluginV3OneCore*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuild*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kBUILD));
    if (!check(core != nullptr && build != nullptr, "core and build capabilities")) break;
    check(std::strcmp(core->getPluginName(), c->plugin_name) == 0 &&
              std::strcmp(core->getPluginVersion(), c->plugin_version) == 0 &&
              std::strcmp(core->getPluginNamespace(), c->plugin_namespace) == 0,
          "core name/version/namespace match the creator");
    check(build->getNbOutputs() == 1, "getNbOutputs == 1");

    int32_t const nbIn = c->nb_inputs;
    std::vector<DataType> inTypes(nbIn, DataType::kBF16);
    DataType outType = DataType::kFLOAT;
    check(build->getOutputDataTypes(&outType, 1, inTypes.data(), nbIn) == 0 && outType == DataType::kBF16,
          "getOutputDataTypes bf16 -> bf16");

    std::vector<DynamicPluginTensorDesc> desc(nbIn + 1);
    for (int32_t i = 0; i <= nbIn; ++i) {
      Dims const dims = i < nbIn ? makeDims(c->input_dims + 8 * i, c->input_nb_dims[i])
                                 : makeDims(c->output_dims, c->output_nb_dims);
      desc[i].desc.dims = dims;
      desc[i].desc.type = DataType::kBF16;
      desc[i].desc.format = TensorFormat::kLINEAR;
      desc[i].desc.scale = 1.0F;
      desc[i].min = desc[i].opt = desc[i].max = dims;
    }
    bool allBf16 = true;
    for (int32_t pos = 0; pos <= nbIn; ++pos) allBf16 &= build->supportsFormatCombination(pos, desc.data(), nbIn, 1);
    check(allBf16, "supportsFormatCombination accepts linear bf16 everywhere");
    std::vector<DynamicPluginTensorDesc> fp32Desc = desc;
    fp32Desc[0].desc.type = DataType::kFLOAT;
    check(!build->supportsFormatCombination(0, fp32Desc.data(), nbIn, 1), "supportsFormatCombination rejects fp32 x");
    check(build->configurePlugin(desc.data(), nbIn, desc.data() + nbIn, 1) == 0, "configurePlugin");
    std::size_t const ws = build->getWorkspaceSize(desc.data(), nbIn, desc.data() + nbIn, 1);
    log << "INFO workspace bytes " << ws << "\n";
    // Only an enqueue needs the buffer; the registry-only (CPU) mode passes none.
    if (c->output != nullptr &&
        !check(static_cast<int64_t>(ws) <= c->workspace_bytes, "workspace fits the caller's buffer")) break;

    // Serialization round trip: what getFieldsToSerialize returns is all a plan stores.
    auto* buildRt = static_cast<IPluginV3OneRuntime*>(buildPlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(buildRt != nullptr, "build-phase object has the runtime capability")) break;
    PluginFieldCollection const* ser = buildRt->getFieldsToSerialize();
    if (!check(ser != nullptr && ser->nbFields >= c->nb_fields, "getFieldsToSerialize")) break;
    std::vector<int32_t> serValues(ser->nbFields);
    std::vector<std::string> serNames(ser->nbFields);
    std::vector<PluginField> serFields;
    bool serOk = true;
    for (int32_t i = 0; i < ser->nbFields; ++i) {
      serOk &= ser->fields[i].type == PluginFieldType::kINT32 && ser->fields[i].length == 1;
      serValues[i] = *static_cast<int32_t const*>(ser->fields[i].data);
      serNames[i] = ser->fields[i].name;
      for (int32_t j = 0; j < c->nb_fields; ++j) {
        if (serNames[i] == c->field_names[j]) serOk &= serValues[i] == c->field_values[j];
      }
    }
    check(serOk, "serialized fields are kINT32 and carry the given values");
    for (int32_t i = 0; i < ser->nbFields; ++i) {
      serFields.emplace_back(serNames[i].c_str(), &serValues[i], PluginFieldType::kINT32, 1);
    }
    PluginFieldCollection serFc{static_cast<int32_t>(serFields.size()), serFields.data()};
    runtimePlugin = creator->createPlugin(c->plugin_name, &serFc, TensorRTPhase::kRUNTIME);
    if (!check(runtimePlugin != nullptr, "createPlugin(kRUNTIME) from the serialized fields")) break;
    auto* rt0 = static_cast<IPluginV3OneRuntime*>(runtimePlugin->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    if (!check(rt0 != nullptr, "runtime capability")) break;
    attached = rt0->attachToContext(nullptr);
    if (!check(attached != nullptr, "attachToContext")) break;
    auto* rt = static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME));

    std::vector<PluginTensorDesc> td(nbIn + 1);
    for (int32_t i = 0; i <= nbIn; ++i) td[i] = desc[i].desc;
    if (!check(rt->onShapeChange(td.data(), nbIn, td.data() + nbIn, 1) == 0, "onShapeChange")) break;
    if (c->output == nullptr) {
      log << "SKIP enqueue: no output buffer given\n";
      break;
    }
    void* outputs[1] = {c->output};
    int32_t const status = rt->enqueue(td.data(), td.data() + nbIn, c->inputs, outputs, c->workspace,
                                       static_cast<cudaStream_t>(c->stream));
    check(status == 0, "enqueue returned 0");
  } while (false);

  delete attached;
  delete runtimePlugin;
  delete buildPlugin;
  registry.deregisterLibrary(libHandle);
  delete runtime;
  return finish(&logger);
}

}  // extern "C"
