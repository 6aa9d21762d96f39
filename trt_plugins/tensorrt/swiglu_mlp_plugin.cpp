/*
 * swiglu_mlp_plugin.cpp: IPluginV3 `tilevox::swiglu_mlp` (plugin version 1), the TensorRT twin of the torch op:
 * inputs x (..., K), w_packed (2N, K), w_down (H, N), all bf16; output y (..., H) bf16.
 * enqueue calls tilevox_swiglu_gateup_launch into the workspace (h, (M, N) bf16) and then
 * tilevox_gemm_bf16_launch for the down projection; it allocates nothing and never synchronizes.
 */
#include "swiglu_plugin_common.h"

#include <exception>

#include "tilevox_kernels.h"

using namespace nvinfer1;

namespace tilevox_trt {
namespace {

constexpr int64_t kWorkspaceAlign = 256;

class SwigluMlpPlugin final : public SwigluPluginBase {
 public:
  explicit SwigluMlpPlugin(SwigluFields const& fields) : SwigluPluginBase(fields, /*hasDown=*/true) {}

  char const* getPluginName() const noexcept override { return "swiglu_mlp"; }

  IPluginV3* clone() noexcept override {
    try {
      return new SwigluMlpPlugin(fields_);
    } catch (std::exception const& e) {
      logError(std::string("clone: ") + e.what());
      return nullptr;
    }
  }

  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (nbInputs != 3 || nbOutputs != 1 || inputs[2].nbDims != 2) return -1;
    outputs[0] = inputs[0];  // (..., K) -> (..., H) with H = w_down rows
    outputs[0].d[inputs[0].nbDims - 1] = inputs[2].d[0];
    return 0;
  }

  size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept override {
    if (nbInputs != 3) return 0;
    // h (M, N) bf16 at the profile's largest M; must cover every shape the profile allows.
    int64_t m = 0, n = 0, k = 0;
    gemmSizes(inputs[0].max, inputs[1].max, m, n, k);
    return static_cast<size_t>(workspaceBytes(m, n));
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /*outputDesc*/,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override {
    int64_t m = 0, n = 0, k = 0;
    gemmSizes(inputDesc[0].dims, inputDesc[1].dims, m, n, k);
    if (m == 0) return 0;
    if (workspace == nullptr) {
      logError("swiglu_mlp needs a workspace for h");
      return -1;
    }
    int64_t const hidden = inputDesc[2].dims.d[0];
    if (!launchGateup(inputs[0], inputs[1], workspace, m, n, k, stream)) return -1;
    tilevox_gemm_bf16_params down{};
    down.a = workspace;
    down.b = inputs[2];
    down.d = outputs[0];
    down.m = m;
    down.n = hidden;
    down.k = n;
    down.lda = n;
    down.ldd = hidden;
    down.tile_config = fields_.down_tile_config;
    int const status = tilevox_gemm_bf16_launch(&down, stream);
    if (status != TILEVOX_OK) {
      logError("tilevox_gemm_bf16_launch failed (status " + std::to_string(status) + "): " + tilevox_last_error());
      return -1;
    }
    return 0;
  }

  static int64_t workspaceBytes(int64_t m, int64_t n) {
    return (m * n * 2 + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  }
};

class SwigluMlpCreator final : public IPluginCreatorV3One {
 public:
  char const* getPluginName() const noexcept override { return "swiglu_mlp"; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return swigluFieldNames(true); }

  IPluginV3* createPlugin(char const* /*name*/, PluginFieldCollection const* fc, TensorRTPhase /*phase*/) noexcept override {
    SwigluFields fields;
    if (!parseSwigluFields(fc, /*hasDownField=*/true, fields)) return nullptr;
    try {
      return new SwigluMlpPlugin(fields);
    } catch (std::exception const& e) {
      logError(std::string("createPlugin: ") + e.what());
      return nullptr;
    }
  }
};

}  // namespace

IPluginCreatorV3One* swigluMlpCreator() noexcept {
  static SwigluMlpCreator creator;
  return &creator;
}

}  // namespace tilevox_trt
