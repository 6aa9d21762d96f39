/*
 * megakernel_region_plugin.cpp: IPluginV3 `tilevox::MegakernelRegion` (plugin version 1): a compiled megakernel
 * program (trt_plugins/onnx/megakernel_region.py writes its fields) launched through tilevox_megakernel_launch,
 * the call the torch op `tilevox::megakernel_launch` makes.
 *
 * Fields (kINT32 from the ONNX parser; kINT64 accepted): arrays instructions, queue_lengths, buffer_table,
 * input_buffers, output_buffers; scalars num_queues, max_queue_len, num_buffers, num_counters, the region
 * constants (rms_norm_eps and attn_scale kFLOAT32) and watchdog_ms. Inputs: the buffers input_buffers names;
 * outputs: those output_buffers names, then the error words (int32, TILEVOX_MK_ERROR_WORDS). enqueue copies each
 * STATE input to its output (unless they alias), binds SCRATCH buffers and counters in the workspace, and uploads
 * the packed program once and the pointer table whenever the bindings moved (a pageable copy: run one enqueue
 * before capturing a CUDA graph). Launches without FLAG_SYNC_CHECK: faults show in the error output.
 */
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "megakernel/megakernel.h"
#include "swiglu_plugin_common.h"
#include "tilevox_kernels.h"

using namespace nvinfer1;

namespace tilevox_trt {
namespace {

constexpr char const* kName = "MegakernelRegion";
constexpr int64_t kAlign = 256;

int64_t alignUp(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

/* The packed program and launch scalars, as the node's attributes carry them. */
struct RegionProgram {
  std::vector<int32_t> instructions, queueLengths, inputBuffers, outputBuffers;
  std::vector<int32_t> bufferTable;  // num_buffers rows of `tableWidth()` entries: kind, dtype, ndim, dims...
  int32_t numQueues{0}, maxQueueLen{0}, numBuffers{0}, numCounters{0};
  int32_t batchSize{0}, numHeads{0}, numKvHeads{0}, headDim{0}, partitionTokens{0}, numPartitions{0}, window{0};
  float rmsNormEps{0.F}, attnScale{0.F};
  int32_t watchdogMs{2000};

  int32_t tableWidth() const { return numBuffers > 0 ? static_cast<int32_t>(bufferTable.size()) / numBuffers : 0; }
  int32_t const* row(int32_t buffer) const { return bufferTable.data() + static_cast<size_t>(buffer) * tableWidth(); }
  int32_t kind(int32_t buffer) const { return row(buffer)[0]; }
  int32_t dtype(int32_t buffer) const { return row(buffer)[1]; }
  int64_t bytes(int32_t buffer) const {
    int32_t const* r = row(buffer);
    int64_t n = elementBytes(r[1]);
    for (int32_t d = 0; d < r[2]; ++d) n *= r[3 + d];
    return n;
  }
  static int64_t elementBytes(int32_t dtype) {
    switch (dtype) {
      case TILEVOX_MK_DTYPE_FLOAT32: return sizeof(float);
      case TILEVOX_MK_DTYPE_BFLOAT16: return sizeof(uint16_t);
      case TILEVOX_MK_DTYPE_FLOAT16: return sizeof(uint16_t);
      case TILEVOX_MK_DTYPE_INT64: return sizeof(int64_t);
      case TILEVOX_MK_DTYPE_INT32: return sizeof(int32_t);
      default: return -1;
    }
  }
  /* Workspace layout: SCRATCH buffers in id order, then the counters, each 256-byte aligned. */
  int64_t workspaceBytes() const {
    int64_t total = 0;
    for (int32_t b = 0; b < numBuffers; ++b)
      if (kind(b) == TILEVOX_MK_BUFFER_SCRATCH) total += alignUp(bytes(b));
    return total + alignUp(static_cast<int64_t>(numCounters > 0 ? numCounters : 1) * sizeof(int32_t));
  }

  bool validate(std::string& why) const {
    if (numQueues < 1 || maxQueueLen < 0 || numBuffers < 1 || numCounters < 0) return (why = "invalid sizes"), false;
    if (instructions.size() != static_cast<size_t>(numQueues) * maxQueueLen * TILEVOX_MK_INSTRUCTION_WORDS)
      return (why = "instructions must hold num_queues x max_queue_len x TILEVOX_MK_INSTRUCTION_WORDS words"), false;
    if (queueLengths.size() != static_cast<size_t>(numQueues)) return (why = "queue_lengths must hold num_queues"), false;
    if (bufferTable.size() % numBuffers != 0 || tableWidth() < 3)
      return (why = "buffer_table must hold num_buffers rows [kind, dtype, ndim, dims...]"), false;
    for (int32_t b = 0; b < numBuffers; ++b) {
      if (row(b)[2] < 0 || row(b)[2] > tableWidth() - 3 || row(b)[2] > Dims::MAX_DIMS || elementBytes(dtype(b)) < 0)
        return (why = "buffer " + std::to_string(b) + " has a bad rank or dtype"), false;
    }
    for (int32_t b : inputBuffers)
      if (b < 0 || b >= numBuffers || kind(b) == TILEVOX_MK_BUFFER_SCRATCH || kind(b) == TILEVOX_MK_BUFFER_OUTPUT)
        return (why = "input_buffers must name WEIGHT, INPUT or STATE buffers"), false;
    for (int32_t b : outputBuffers)
      if (b < 0 || b >= numBuffers || (kind(b) != TILEVOX_MK_BUFFER_STATE && kind(b) != TILEVOX_MK_BUFFER_OUTPUT))
        return (why = "output_buffers must name STATE or OUTPUT buffers"), false;
    return true;
  }
};

bool readInts(PluginField const& f, std::vector<int32_t>& out) {
  if (f.length < 0 || (f.length > 0 && f.data == nullptr)) return false;
  out.resize(f.length);
  for (int32_t i = 0; i < f.length; ++i) {
    if (f.type == PluginFieldType::kINT32) {
      out[i] = static_cast<int32_t const*>(f.data)[i];
    } else if (f.type == PluginFieldType::kINT64) {
      int64_t const v = static_cast<int64_t const*>(f.data)[i];
      if (v < INT32_MIN || v > INT32_MAX) return false;
      out[i] = static_cast<int32_t>(v);
    } else {
      return false;
    }
  }
  return true;
}

bool parseFields(PluginFieldCollection const* fc, RegionProgram& p) noexcept {
  try {
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
      PluginField const& f = fc->fields[i];
      std::string const name = f.name;
      std::vector<int32_t>* array = name == "instructions"     ? &p.instructions
                                    : name == "queue_lengths"  ? &p.queueLengths
                                    : name == "buffer_table"   ? &p.bufferTable
                                    : name == "input_buffers"  ? &p.inputBuffers
                                    : name == "output_buffers" ? &p.outputBuffers
                                                               : nullptr;
      if (array != nullptr) {
        if (!readInts(f, *array)) return logError("field '" + name + "' must be a kINT32/kINT64 array"), false;
        continue;
      }
      if (name == "rms_norm_eps" || name == "attn_scale") {
        if (f.type != PluginFieldType::kFLOAT32 || f.length != 1 || f.data == nullptr)
          return logError("field '" + name + "' must be one kFLOAT32"), false;
        (name == "rms_norm_eps" ? p.rmsNormEps : p.attnScale) = *static_cast<float const*>(f.data);
        continue;
      }
      int32_t* scalar = name == "num_queues"         ? &p.numQueues
                        : name == "max_queue_len"    ? &p.maxQueueLen
                        : name == "num_buffers"      ? &p.numBuffers
                        : name == "num_counters"     ? &p.numCounters
                        : name == "batch_size"       ? &p.batchSize
                        : name == "num_heads"        ? &p.numHeads
                        : name == "num_kv_heads"     ? &p.numKvHeads
                        : name == "head_dim"         ? &p.headDim
                        : name == "partition_tokens" ? &p.partitionTokens
                        : name == "num_partitions"   ? &p.numPartitions
                        : name == "window"           ? &p.window
                        : name == "watchdog_ms"      ? &p.watchdogMs
                                                     : nullptr;
      std::vector<int32_t> one;
      if (scalar == nullptr) return logError("unknown field '" + name + "'"), false;
      if (!readInts(f, one) || one.size() != 1) return logError("field '" + name + "' must be one integer"), false;
      *scalar = one[0];
    }
    std::string why;
    if (!p.validate(why)) return logError("MegakernelRegion: " + why), false;
    if (p.watchdogMs < 1) return logError("MegakernelRegion: watchdog_ms must be >= 1"), false;
    return true;
  } catch (std::exception const& e) {
    logError(std::string("MegakernelRegion fields: ") + e.what());
    return false;
  }
}

DataType trtType(int32_t dtype) {
  switch (dtype) {
    case TILEVOX_MK_DTYPE_BFLOAT16: return DataType::kBF16;
    case TILEVOX_MK_DTYPE_FLOAT16: return DataType::kHALF;
    case TILEVOX_MK_DTYPE_INT64: return DataType::kINT64;
    case TILEVOX_MK_DTYPE_INT32: return DataType::kINT32;
    default: return DataType::kFLOAT;
  }
}

class MegakernelRegionPlugin final : public IPluginV3,
                                     public IPluginV3OneCore,
                                     public IPluginV3OneBuild,
                                     public IPluginV3OneRuntime {
 public:
  explicit MegakernelRegionPlugin(RegionProgram program) : p_(std::move(program)) {}
  ~MegakernelRegionPlugin() override {
    for (void* ptr : {static_cast<void*>(dInstructions_), static_cast<void*>(dQueueLengths_),
                      static_cast<void*>(dBufferTable_), static_cast<void*>(dPointers_)})
      if (ptr != nullptr) cudaFree(ptr);
  }

  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override {
    try {
      return new MegakernelRegionPlugin(p_);  // device copies are made again on first enqueue
    } catch (std::exception const& e) {
      logError(std::string("clone: ") + e.what());
      return nullptr;
    }
  }
  char const* getPluginName() const noexcept override { return kName; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  int32_t getNbOutputs() const noexcept override { return static_cast<int32_t>(p_.outputBuffers.size()) + 1; }
  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* /*inputTypes*/,
                             int32_t nbInputs) const noexcept override {
    if (nbOutputs != getNbOutputs() || nbInputs != nbIn()) return -1;
    for (int32_t i = 0; i + 1 < nbOutputs; ++i) outputTypes[i] = trtType(p_.dtype(p_.outputBuffers[i]));
    outputTypes[nbOutputs - 1] = DataType::kINT32;
    return 0;
  }
  int32_t getOutputShapes(DimsExprs const* /*inputs*/, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& exprBuilder) noexcept override {
    if (nbInputs != nbIn() || nbOutputs != getNbOutputs()) return -1;
    for (int32_t i = 0; i + 1 < nbOutputs; ++i) {
      int32_t const* r = p_.row(p_.outputBuffers[i]);
      outputs[i].nbDims = r[2];
      for (int32_t d = 0; d < r[2]; ++d) outputs[i].d[d] = exprBuilder.constant(r[3 + d]);
    }
    outputs[nbOutputs - 1].nbDims = 1;
    outputs[nbOutputs - 1].d[0] = exprBuilder.constant(TILEVOX_MK_ERROR_WORDS);
    return 0;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != nbIn() || nbOutputs != getNbOutputs() || pos < 0 || pos >= nbInputs + nbOutputs) return false;
    return inOut[pos].desc.format == TensorFormat::kLINEAR && inOut[pos].desc.type == expectedType(pos);
  }
  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    if (nbInputs != nbIn() || nbOutputs != getNbOutputs()) return -1;
    for (int32_t i = 0; i < nbInputs; ++i)
      if (!matches(in[i].desc.dims, p_.inputBuffers[i], i)) return -1;
    for (int32_t i = 0; i + 1 < nbOutputs; ++i)
      if (!matches(out[i].desc.dims, p_.outputBuffers[i], nbInputs + i)) return -1;
    return 0;
  }
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                          DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept override {
    return static_cast<size_t>(p_.workspaceBytes());
  }

  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    if (nbInputs != nbIn() || nbOutputs != getNbOutputs()) return -1;
    for (int32_t i = 0; i < nbInputs; ++i)
      if (!matches(in[i].dims, p_.inputBuffers[i], i)) return -1;
    for (int32_t i = 0; i + 1 < nbOutputs; ++i)
      if (!matches(out[i].dims, p_.outputBuffers[i], nbInputs + i)) return -1;
    return 0;
  }
  IPluginV3* attachToContext(IPluginResourceContext* /*context*/) noexcept override { return clone(); }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    auto array = [this](char const* name, std::vector<int32_t> const& v) {
      serialized_.emplace_back(name, v.data(), PluginFieldType::kINT32, static_cast<int32_t>(v.size()));
    };
    auto scalar = [this](char const* name, int32_t const& v) {
      serialized_.emplace_back(name, &v, PluginFieldType::kINT32, 1);
    };
    serialized_.clear();
    array("instructions", p_.instructions);
    array("queue_lengths", p_.queueLengths);
    array("buffer_table", p_.bufferTable);
    array("input_buffers", p_.inputBuffers);
    array("output_buffers", p_.outputBuffers);
    scalar("num_queues", p_.numQueues);
    scalar("max_queue_len", p_.maxQueueLen);
    scalar("num_buffers", p_.numBuffers);
    scalar("num_counters", p_.numCounters);
    scalar("batch_size", p_.batchSize);
    scalar("num_heads", p_.numHeads);
    scalar("num_kv_heads", p_.numKvHeads);
    scalar("head_dim", p_.headDim);
    scalar("partition_tokens", p_.partitionTokens);
    scalar("num_partitions", p_.numPartitions);
    serialized_.emplace_back("rms_norm_eps", &p_.rmsNormEps, PluginFieldType::kFLOAT32, 1);
    serialized_.emplace_back("attn_scale", &p_.attnScale, PluginFieldType::kFLOAT32, 1);
    scalar("window", p_.window);
    scalar("watchdog_ms", p_.watchdogMs);
    collection_.nbFields = static_cast<int32_t>(serialized_.size());
    collection_.fields = serialized_.data();
    return &collection_;
  }

  int32_t enqueue(PluginTensorDesc const* /*inputDesc*/, PluginTensorDesc const* /*outputDesc*/,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override {
    try {
      if (!upload(stream)) return -1;
      std::vector<void*> ptrs(p_.numBuffers, nullptr);
      for (size_t i = 0; i < p_.inputBuffers.size(); ++i) ptrs[p_.inputBuffers[i]] = const_cast<void*>(inputs[i]);
      for (size_t j = 0; j < p_.outputBuffers.size(); ++j) {
        int32_t const b = p_.outputBuffers[j];
        if (p_.kind(b) == TILEVOX_MK_BUFFER_STATE && ptrs[b] != outputs[j]) {  // functional state: copy, then in place
          if (!check(cudaMemcpyAsync(outputs[j], ptrs[b], p_.bytes(b), cudaMemcpyDeviceToDevice, stream), "state copy"))
            return -1;
        }
        ptrs[b] = outputs[j];
      }
      char* ws = static_cast<char*>(workspace);
      for (int32_t b = 0; b < p_.numBuffers; ++b) {
        if (p_.kind(b) != TILEVOX_MK_BUFFER_SCRATCH) continue;
        if (ws == nullptr) return logError("MegakernelRegion needs its workspace"), -1;
        ptrs[b] = ws;
        ws += alignUp(p_.bytes(b));
      }
      if (ws == nullptr) return logError("MegakernelRegion needs its workspace (counters)"), -1;
      for (int32_t b = 0; b < p_.numBuffers; ++b)
        if (ptrs[b] == nullptr) return logError("buffer " + std::to_string(b) + " is not bound"), -1;
      if (ptrs != boundPtrs_) {
        if (!check(cudaMemcpyAsync(dPointers_, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, stream),
                   "pointer table upload"))
          return -1;
        boundPtrs_ = ptrs;
      }
      tilevox_megakernel_params params{};
      params.instructions = dInstructions_;
      params.queue_lengths = dQueueLengths_;
      params.buffer_table = dBufferTable_;
      params.buffer_ptrs = dPointers_;
      params.counters = reinterpret_cast<int32_t*>(ws);
      params.error = static_cast<int32_t*>(outputs[p_.outputBuffers.size()]);
      params.profile = nullptr;
      params.prefetch = nullptr;
      params.num_queues = p_.numQueues;
      params.max_queue_len = p_.maxQueueLen;
      params.num_buffers = p_.numBuffers;
      params.num_counters = p_.numCounters;
      params.batch_size = p_.batchSize;
      params.num_heads = p_.numHeads;
      params.num_kv_heads = p_.numKvHeads;
      params.head_dim = p_.headDim;
      params.partition_tokens = p_.partitionTokens;
      params.num_partitions = p_.numPartitions;
      params.rms_norm_eps = p_.rmsNormEps;
      params.attn_scale = p_.attnScale;
      params.window = p_.window;
      params.watchdog_ns = static_cast<int64_t>(p_.watchdogMs) * 1000000;
      params.flags = 0;
      int const status = tilevox_megakernel_launch(&params, stream);
      if (status != TILEVOX_OK) {
        logError("tilevox_megakernel_launch failed (status " + std::to_string(status) + "): " + tilevox_last_error());
        return -1;
      }
      return 0;
    } catch (std::exception const& e) {
      logError(std::string("MegakernelRegion enqueue: ") + e.what());
      return -1;
    }
  }

 private:
  int32_t nbIn() const { return static_cast<int32_t>(p_.inputBuffers.size()); }
  DataType expectedType(int32_t pos) const {
    int32_t const nIn = nbIn();
    if (pos < nIn) return trtType(p_.dtype(p_.inputBuffers[pos]));
    if (pos - nIn < static_cast<int32_t>(p_.outputBuffers.size())) return trtType(p_.dtype(p_.outputBuffers[pos - nIn]));
    return DataType::kINT32;  // the error words
  }
  bool matches(Dims const& dims, int32_t buffer, int32_t pos) const {
    int32_t const* r = p_.row(buffer);
    bool ok = dims.nbDims == r[2];
    for (int32_t d = 0; ok && d < r[2]; ++d) ok = dims.d[d] == -1 || dims.d[d] == r[3 + d];
    if (!ok) logError("MegakernelRegion tensor " + std::to_string(pos) + " does not have buffer " + std::to_string(buffer) + "'s shape");
    return ok;
  }
  static bool check(cudaError_t err, char const* what) {
    if (err == cudaSuccess) return true;
    logError(std::string("MegakernelRegion ") + what + ": " + cudaGetErrorString(err));
    return false;
  }
  template <typename T>
  bool toDevice(T*& dst, std::vector<T> const& src, cudaStream_t stream) {
    size_t const bytes = (src.empty() ? 1 : src.size()) * sizeof(T);
    if (!check(cudaMalloc(reinterpret_cast<void**>(&dst), bytes), "cudaMalloc")) return false;
    return src.empty() || check(cudaMemcpyAsync(dst, src.data(), bytes, cudaMemcpyHostToDevice, stream), "upload");
  }
  /* The packed program goes to the device once per plugin object (runtime phase, first enqueue). */
  bool upload(cudaStream_t stream) {
    if (dInstructions_ != nullptr) return true;
    std::vector<int64_t> const table(p_.bufferTable.begin(), p_.bufferTable.end());  // the launcher reads int64
    std::vector<void*> const none(p_.numBuffers, nullptr);
    int64_t* table64 = nullptr;
    void** pointers = nullptr;
    bool ok = toDevice(dQueueLengths_, p_.queueLengths, stream) && toDevice(table64, table, stream) &&
              toDevice(pointers, none, stream) && toDevice(dInstructions_, p_.instructions, stream);
    dBufferTable_ = table64;
    dPointers_ = pointers;
    // The pageable source vectors above are staged before cudaMemcpyAsync returns, so they may go out of scope.
    return ok;
  }

  RegionProgram p_;
  int32_t* dInstructions_{nullptr};
  int32_t* dQueueLengths_{nullptr};
  int64_t* dBufferTable_{nullptr};
  void** dPointers_{nullptr};
  std::vector<void*> boundPtrs_;
  std::vector<PluginField> serialized_;
  PluginFieldCollection collection_{};
};

PluginField const kFieldList[] = {
    PluginField("instructions", nullptr, PluginFieldType::kINT32, 0),
    PluginField("queue_lengths", nullptr, PluginFieldType::kINT32, 0),
    PluginField("buffer_table", nullptr, PluginFieldType::kINT32, 0),
    PluginField("input_buffers", nullptr, PluginFieldType::kINT32, 0),
    PluginField("output_buffers", nullptr, PluginFieldType::kINT32, 0),
    PluginField("num_queues", nullptr, PluginFieldType::kINT32, 1),
    PluginField("max_queue_len", nullptr, PluginFieldType::kINT32, 1),
    PluginField("num_buffers", nullptr, PluginFieldType::kINT32, 1),
    PluginField("num_counters", nullptr, PluginFieldType::kINT32, 1),
    PluginField("batch_size", nullptr, PluginFieldType::kINT32, 1),
    PluginField("num_heads", nullptr, PluginFieldType::kINT32, 1),
    PluginField("num_kv_heads", nullptr, PluginFieldType::kINT32, 1),
    PluginField("head_dim", nullptr, PluginFieldType::kINT32, 1),
    PluginField("partition_tokens", nullptr, PluginFieldType::kINT32, 1),
    PluginField("num_partitions", nullptr, PluginFieldType::kINT32, 1),
    PluginField("rms_norm_eps", nullptr, PluginFieldType::kFLOAT32, 1),
    PluginField("attn_scale", nullptr, PluginFieldType::kFLOAT32, 1),
    PluginField("window", nullptr, PluginFieldType::kINT32, 1),
    PluginField("watchdog_ms", nullptr, PluginFieldType::kINT32, 1),
};
PluginFieldCollection const kFieldNames{static_cast<int32_t>(sizeof(kFieldList) / sizeof(kFieldList[0])), kFieldList};

class MegakernelRegionCreator final : public IPluginCreatorV3One {
 public:
  char const* getPluginName() const noexcept override { return kName; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &kFieldNames; }
  IPluginV3* createPlugin(char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept override {
    RegionProgram program;
    if (!parseFields(fc, program)) return nullptr;
    try {
      return new MegakernelRegionPlugin(std::move(program));
    } catch (std::exception const& e) {
      logError(std::string("createPlugin: ") + e.what());
      return nullptr;
    }
  }
};

}  // namespace

IPluginCreatorV3One* megakernelRegionCreator() noexcept {
  static MegakernelRegionCreator creator;
  return &creator;
}

}  // namespace tilevox_trt
