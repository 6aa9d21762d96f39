/*
 * swiglu_gateup_plugin.cpp: IPluginV3 `tilevox::swiglu_gateup` (plugin version 1), the TensorRT twin of the
 * torch op of the same name: inputs x (..., K) bf16 and w_packed (2N, K) bf16; output h (..., N) bf16.
 * enqueue only calls tilevox_swiglu_gateup_launch; the packed layout is fixed by the kernel/block fields.
 */
#include "swiglu_plugin_common.h"

#include <exception>

using namespace nvinfer1;

namespace tilevox_trt {
namespace {

class SwigluGateupPlugin final : public SwigluPluginBase {
 public:
  explicit SwigluGateupPlugin(SwigluFields const& fields) : SwigluPluginBase(fields, /*hasDown=*/false) {}

  char const* getPluginName() const noexcept override { return "swiglu_gateup"; }

  IPluginV3* clone() noexcept override {
    try {
      return new SwigluGateupPlugin(fields_);
    } catch (std::exception const& e) {
      logError(std::string("clone: ") + e.what());
      return nullptr;
    }
  }

  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& exprBuilder) noexcept override {
    if (nbInputs != 2 || nbOutputs != 1 || inputs[1].nbDims != 2) return -1;
    // (..., K) -> (..., N) with N = w_packed rows / 2
    outputs[0] = inputs[0];
    outputs[0].d[inputs[0].nbDims - 1] =
        exprBuilder.operation(DimensionOperation::kFLOOR_DIV, *inputs[1].d[0], *exprBuilder.constant(2));
    return 0;
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
                  void const* const* inputs, void* const* outputs, void* /*workspace*/,
                  cudaStream_t stream) noexcept override {
    int64_t m = 0, n = 0, k = 0;
    gemmSizes(inputDesc[0].dims, inputDesc[1].dims, m, n, k);
    return launchGateup(inputs[0], inputs[1], outputs[0], m, n, k, stream) ? 0 : -1;
  }
};

class SwigluGateupCreator final : public IPluginCreatorV3One {
 public:
  char const* getPluginName() const noexcept override { return "swiglu_gateup"; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return swigluFieldNames(false); }

  IPluginV3* createPlugin(char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept override {
    SwigluFields fields;
    if (!parseSwigluFields(fc, /*hasDownField=*/false, fields)) return nullptr;
    try {
      return new SwigluGateupPlugin(fields);
    } catch (std::exception const& e) {
      logError(std::string("createPlugin: ") + e.what());
      return nullptr;
    }
  }
};

}  // namespace

IPluginCreatorV3One* swigluGateupCreator() noexcept {
  static SwigluGateupCreator creator;
  return &creator;
}

}  // namespace tilevox_trt
