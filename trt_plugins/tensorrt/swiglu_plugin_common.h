/*
 * swiglu_plugin_common.h: what the tilevox SwiGLU IPluginV3 shims share (fields, logging, the plugin base).
 *
 * The plugins contain no math: they validate types and shapes, declare output shapes and workspace, serialize
 * their integer fields, and in enqueue turn tensor descriptors into a call of the C launcher of
 * libtilevox_kernels.so (trt_plugins/csrc/tilevox_kernels.h), exactly as the torch op does.
 * Fields and defaults must match trt_plugins/registry.py; the ONNX parser passes INT attributes as kINT32.
 * Compiled only against the TensorRT headers (no TensorRT library is linked).
 */
#ifndef TILEVOX_SWIGLU_PLUGIN_COMMON_H_
#define TILEVOX_SWIGLU_PLUGIN_COMMON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "NvInferRuntime.h"

namespace tilevox_trt {

inline constexpr char const* kPluginNamespace = "tilevox";
inline constexpr char const* kPluginVersion = "1";

/* Logs through the logger that TensorRT hands to setLoggerFinder (stderr if none was set). */
void logError(std::string const& message) noexcept;

/* The creator fields of both SwiGLU plugins (swiglu_mlp adds down_tile_config). */
struct SwigluFields {
  int32_t kernel{1};       /* 1 = Kernel-1 dual Pingpong ([Wg; Wu]), 2 = Kernel-2 packed EVT (blocks) */
  int32_t block{0};        /* interleave block of Kernel-2's packed layout; 0 for Kernel-1 */
  int32_t tile_config{-1}; /* -1 = the kernel library's per-shape heuristic */
  int32_t down_tile_config{-1};
};

/* Parses a PluginFieldCollection (kINT32 from the ONNX parser, kINT64 from API callers); unknown names and
 * wrong types are errors. Returns false (after logging) when the fields are invalid. */
bool parseSwigluFields(nvinfer1::PluginFieldCollection const* fc, bool hasDownField, SwigluFields& out) noexcept;

/* Base class of the two plugins: one object implements the core, build and runtime capabilities. */
class SwigluPluginBase : public nvinfer1::IPluginV3,
                         public nvinfer1::IPluginV3OneCore,
                         public nvinfer1::IPluginV3OneBuild,
                         public nvinfer1::IPluginV3OneRuntime {
 public:
  SwigluPluginBase(SwigluFields const& fields, bool hasDownField);
  ~SwigluPluginBase() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

  // IPluginV3OneCore
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 protected:
  /* Number of tensor inputs: x, w_packed (+ w_down). */
  int32_t nbInputs() const { return hasDown_ ? 3 : 2; }
  /* Checks ranks and the K/N agreement of static dims; dims of -1 (dynamic) pass. */
  bool checkShapes(nvinfer1::Dims const* dims, int32_t nbInputs) const noexcept;
  /* m = product of x's leading dims, k = x's last dim, n = w_packed rows / 2. */
  static void gemmSizes(nvinfer1::Dims const& x, nvinfer1::Dims const& wPacked, int64_t& m, int64_t& n, int64_t& k);
  /* Calls tilevox_swiglu_gateup_launch; logs and returns false on a non-zero status. */
  bool launchGateup(void const* x, void const* wPacked, void* out, int64_t m, int64_t n, int64_t k,
                    cudaStream_t stream) const noexcept;

  SwigluFields fields_;
  bool hasDown_;

 private:
  std::vector<nvinfer1::PluginField> serialized_;
  nvinfer1::PluginFieldCollection serializedCollection_{};
};

/* Field list for getFieldNames(): names and kINT32 types, in registry order. */
nvinfer1::PluginFieldCollection const* swigluFieldNames(bool hasDownField) noexcept;

/* The creators (static objects defined beside each plugin), listed by getCreators(). */
nvinfer1::IPluginCreatorV3One* swigluGateupCreator() noexcept;
nvinfer1::IPluginCreatorV3One* swigluMlpCreator() noexcept;
/* MegakernelRegion (megakernel_region_plugin.cpp): a compiled megakernel program as one plugin. */
nvinfer1::IPluginCreatorV3One* megakernelRegionCreator() noexcept;

}  // namespace tilevox_trt

#endif  // TILEVOX_SWIGLU_PLUGIN_COMMON_H_
