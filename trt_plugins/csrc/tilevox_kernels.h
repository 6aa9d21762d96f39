/*
 * tilevox_kernels.h: the plain C ABI of libtilevox_kernels.so (CUTLASS SM90 kernels for tilevox).
 *
 * Callers (the torch.library ops through ctypes, the TensorRT IPluginV3 shims) pass raw device
 * pointers, shapes, strides and a stream; the library knows nothing of torch or TensorRT.
 * All tensors are bf16 (2 bytes), row-major, on the current CUDA device; accumulation is fp32.
 * Every launcher validates its arguments and returns a TILEVOX_* status; on failure
 * tilevox_last_error() returns a one-line message (thread-local, valid until the next call).
 * Launchers never synchronize; a launch with m == 0 is a no-op that returns TILEVOX_OK.
 */
#ifndef TILEVOX_KERNELS_H_
#define TILEVOX_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct layout or a function signature below changes. */
#define TILEVOX_ABI_VERSION 1

/* Status codes. */
#define TILEVOX_OK 0
#define TILEVOX_ERR_INVALID_ARGUMENT 1 /* null pointer, negative size, bad kernel/tile_config */
#define TILEVOX_ERR_UNSUPPORTED_SHAPE 2 /* shape/stride/alignment the kernels cannot handle */
#define TILEVOX_ERR_CUDA 3 /* a CUDA runtime call or the launch failed */
#define TILEVOX_ERR_CUTLASS 4 /* CUTLASS can_implement/initialize/run refused */
#define TILEVOX_ERR_NO_DEVICE_SUPPORT 5 /* current device is not SM90 (sm_90a cubins only) */

/* Kernel ids for tilevox_swiglu_gateup_params.kernel. */
#define TILEVOX_KERNEL_AUTO 0 /* library picks Kernel-1 or Kernel-2 from (m, n, k) */
#define TILEVOX_KERNEL_DUAL_PINGPONG 1 /* Kernel-1: w_gate and w_up, HF layout (N, K) each */
#define TILEVOX_KERNEL_PACKED_EVT 2 /* Kernel-2: w_packed (2N, K), see packing below */

/* tile_config: -1 = the recorded per-shape heuristic; 0..num_configs(kernel)-1 forces one. */
#define TILEVOX_TILE_CONFIG_AUTO (-1)

/*
 * h = silu(x @ w_gate^T) * (x @ w_up^T), rounded to bf16 once (fp32 accumulate, fp32 activation).
 *   x:   (m, k) bf16, row stride ldx elements (ldx >= k).
 *   out: (m, n) bf16, row stride ldo elements (ldo >= n); must not alias x or the weights.
 *   Kernel-1 (and AUTO when it picks Kernel-1) reads w_gate and w_up: (n, k) bf16, contiguous.
 *   Kernel-2 (and AUTO when it picks Kernel-2) reads w_packed: (2n, k) bf16, contiguous, in the
 *   packed layout below. With kernel == AUTO, pass all three weight pointers.
 * Requirements (else TILEVOX_ERR_UNSUPPORTED_SHAPE with a message): k % 8 == 0, n % 8 == 0,
 * ldx % 8 == 0, ldo % 8 == 0 (16-byte TMA alignment), all pointers 16-byte aligned,
 * n % tilevox_swiglu_packing_block() == 0 for Kernel-2. Any m >= 0 (partial tiles are masked).
 */
typedef struct tilevox_swiglu_gateup_params {
  const void* x;
  const void* w_gate;
  const void* w_up;
  const void* w_packed;
  void* out;
  int64_t m, n, k;
  int64_t ldx, ldo;
  int kernel;      /* TILEVOX_KERNEL_* */
  int tile_config; /* TILEVOX_TILE_CONFIG_AUTO or an index */
} tilevox_swiglu_gateup_params;

/* Packed weight layout of Kernel-2, block size B = tilevox_swiglu_packing_block():
 *   for q in 0 .. n/B - 1:
 *     w_packed[2qB      : 2qB + B ] = w_gate[qB : qB + B]
 *     w_packed[2qB + B  : 2qB + 2B] = w_up  [qB : qB + B]
 * i.e. w_packed = stack([w_gate.view(n/B, B, k), w_up.view(n/B, B, k)], dim=1).reshape(2n, k).
 * B == 1 means plain row interleave (gate_j at row 2j, up_j at row 2j + 1). */
int tilevox_swiglu_packing_block(void);

int tilevox_swiglu_gateup_launch(const tilevox_swiglu_gateup_params* params, void* cuda_stream);

/* Number of tile configurations compiled for a kernel id (1 or 2); 0 for an unknown id. */
int tilevox_swiglu_gateup_num_configs(int kernel);
/* Short static name of a config, e.g. "pingpong_64x128x64_c1x1"; NULL if out of range. */
const char* tilevox_swiglu_gateup_config_name(int kernel, int tile_config);
/* What AUTO resolves to for this shape: writes the kernel id and config index; returns a status. */
int tilevox_swiglu_gateup_select(int64_t m, int64_t n, int64_t k, int kernel, int* kernel_out,
                                 int* tile_config_out);

/*
 * Plain bf16 GEMM for the down projection: d (m, n) = a (m, k) @ b^T, b is (n, k) (HF Linear
 * weight layout, contiguous). Row strides lda >= k, ldd >= n. Same alignment rules as above
 * (k, n, lda, ldd multiples of 8; 16-byte aligned pointers). fp32 accumulate, one bf16 rounding.
 */
typedef struct tilevox_gemm_bf16_params {
  const void* a;
  const void* b;
  void* d;
  int64_t m, n, k;
  int64_t lda, ldd;
  int tile_config; /* TILEVOX_TILE_CONFIG_AUTO or an index */
} tilevox_gemm_bf16_params;

int tilevox_gemm_bf16_launch(const tilevox_gemm_bf16_params* params, void* cuda_stream);
int tilevox_gemm_bf16_num_configs(void);
const char* tilevox_gemm_bf16_config_name(int tile_config);

/* Last error message of this thread ("" if none). */
const char* tilevox_last_error(void);
int tilevox_abi_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TILEVOX_KERNELS_H_ */
