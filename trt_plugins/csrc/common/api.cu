// api.cu: the extern "C" entry points of libtilevox_kernels.so (see ../tilevox_kernels.h).
//
// Validates every argument (unsupported shapes are rejected with a message, never computed wrong),
// resolves kernel/tile_config AUTO through the recorded heuristic below, and calls one internal
// per-config launcher. Holds no CUTLASS code, so it compiles in seconds.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "tilevox_common.h"

namespace tilevox {

namespace {
thread_local std::string g_last_error;

constexpr int kMaxDevices = 64;
int g_sm_count[kMaxDevices] = {0};
int g_is_sm90[kMaxDevices] = {0};  // 0 unknown, 1 yes, 2 no

struct ConfigEntry {
  const char* name;
};

constexpr ConfigEntry kK1Configs[] = {{"k1_dual_pingpong_64x128x64_c1x1"}, {"k1_dual_pingpong_64x64x64_c1x1"}};
constexpr ConfigEntry kK2Configs[] = {{"k2_packed_evt_pingpong_64x128x64_c1x1"},
                                      {"k2_packed_evt_coop_128x256x64_c2x1"},
                                      {"k2_packed_evt_pingpong_64x256x64_c2x1"},
                                      {"k2_packed_evt_pingpong_64x96x64_c1x1"},
                                      {"k2_packed_evt_pingpong_64x64x64_c1x1"}};
constexpr ConfigEntry kGemmConfigs[] = {{"gemm_pingpong_64x128x64_c1x1"},
                                        {"gemm_coop_128x256x64_c2x1"},
                                        {"gemm_pingpong_64x256x64_c2x1"}};


int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Byte ranges [p, p + bytes) overlap?
bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return a != nullptr && b != nullptr && pa < pb + static_cast<uintptr_t>(b_bytes) &&
         pb < pa + static_cast<uintptr_t>(a_bytes);
}

int check_device() {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return fail(TILEVOX_ERR_CUDA, std::string("cudaGetDevice: ") + cudaGetErrorString(err));
  if (dev < 0 || dev >= kMaxDevices) return fail(TILEVOX_ERR_CUDA, "device id out of range");
  if (g_is_sm90[dev] == 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      return fail(TILEVOX_ERR_CUDA, "cudaDeviceGetAttribute(compute capability) failed");
    }
    g_is_sm90[dev] = (major == 9 && minor == 0) ? 1 : 2;
  }
  if (g_is_sm90[dev] != 1) {
    return fail(TILEVOX_ERR_NO_DEVICE_SUPPORT,
                "libtilevox_kernels.so holds sm_90a code only; the current device is not compute capability 9.0");
  }
  return TILEVOX_OK;
}

// Recorded tuning table (benchmarks/swiglu/make_tuning_table.py over a run_swiglu.py JSON measured on an
// H200): per measured (m, n, k) the fastest config of Kernel-1, of Kernel-2 and overall. A query takes the
// entry nearest in log2 space (n and k weigh double: they fix the weight size and the tile grid width).
struct TuneEntry {
  int64_t m, n, k;
  int best_kernel, best_cfg, best_k1_cfg, best_k2_cfg;
};
constexpr TuneEntry kSwigluTable[] = {
#include "tuning_table.inc"
};

double log2_dist(int64_t a, int64_t b) {
  return std::fabs(std::log2(static_cast<double>(a < 1 ? 1 : a)) - std::log2(static_cast<double>(b < 1 ? 1 : b)));
}

const TuneEntry& nearest_entry(int64_t m, int64_t n, int64_t k) {
  const TuneEntry* best = &kSwigluTable[0];
  double best_d = 1e300;
  for (const TuneEntry& e : kSwigluTable) {
    double d = log2_dist(m, e.m) + 2.0 * log2_dist(n, e.n) + 2.0 * log2_dist(k, e.k);
    if (d < best_d) {
      best_d = d;
      best = &e;
    }
  }
  return *best;
}

// Down-projection GEMM (measured on an H200, benchmarks/results/swiglu_h200.json "gemm_down_bench"): the
// 128x256 cooperative tile wins once it has about 3/4 of a wave of CTAs or more (96 of 132 SMs); below
// that the 64x128 pingpong tile, which gives 4x the CTAs, is faster.
int gemm_config_for(int64_t m, int64_t n) { return ceil_div(m, 128) * ceil_div(n, 256) >= 96 ? 1 : 0; }

int check_shape_common(int64_t m, int64_t n, int64_t k, const char* what) {
  if (m < 0 || n < 0 || k < 0) {
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, std::string(what) + ": m, n, k must be >= 0 (got m=" +
                                                   std::to_string(m) + " n=" + std::to_string(n) +
                                                   " k=" + std::to_string(k) + ")");
  }
  if (m > INT32_MAX / 2 || n > INT32_MAX / 2 || k > INT32_MAX / 2) {
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, std::string(what) + ": m, n, k must each be < 2^30");
  }
  if (k == 0) return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, std::string(what) + ": k must be > 0");
  if (k % 8 != 0) {
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE,
                std::string(what) + ": k=" + std::to_string(k) +
                    " is not a multiple of 8 (TMA needs 16-byte aligned rows of bf16)");
  }
  if (n % 8 != 0) {
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE,
                std::string(what) + ": n=" + std::to_string(n) +
                    " is not a multiple of 8 (TMA needs 16-byte aligned rows of bf16)");
  }
  return TILEVOX_OK;
}

int check_ld(int64_t ld, int64_t min_ld, const char* name, const char* what) {
  if (ld < min_ld || ld % 8 != 0) {
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, std::string(what) + ": " + name + "=" + std::to_string(ld) +
                                                   " must be >= " + std::to_string(min_ld) +
                                                   " and a multiple of 8");
  }
  return TILEVOX_OK;
}

int check_ptr(const void* p, const char* name, const char* what) {
  if (p == nullptr) return fail(TILEVOX_ERR_INVALID_ARGUMENT, std::string(what) + ": " + name + " is null");
  if (!aligned16(p)) {
    return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, std::string(what) + ": " + name + " is not 16-byte aligned");
  }
  return TILEVOX_OK;
}

}  // namespace

int fail(int code, const std::string& msg) {
  g_last_error = msg;
  return code;
}

void clear_error() { g_last_error.clear(); }

int sm_count_current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return -1;
  if (g_sm_count[dev] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
    g_sm_count[dev] = count;
  }
  return g_sm_count[dev];
}

}  // namespace tilevox

using namespace tilevox;

extern "C" {

int tilevox_abi_version(void) { return TILEVOX_ABI_VERSION; }

const char* tilevox_last_error(void) { return g_last_error.c_str(); }

int tilevox_swiglu_packing_block(void) { return 1; }

int tilevox_swiglu_gateup_num_configs(int kernel) {
  if (kernel == TILEVOX_KERNEL_DUAL_PINGPONG) return static_cast<int>(sizeof(kK1Configs) / sizeof(kK1Configs[0]));
  if (kernel == TILEVOX_KERNEL_PACKED_EVT) return static_cast<int>(sizeof(kK2Configs) / sizeof(kK2Configs[0]));
  return 0;
}

const char* tilevox_swiglu_gateup_config_name(int kernel, int tile_config) {
  if (tile_config < 0 || tile_config >= tilevox_swiglu_gateup_num_configs(kernel)) return nullptr;
  return kernel == TILEVOX_KERNEL_DUAL_PINGPONG ? kK1Configs[tile_config].name : kK2Configs[tile_config].name;
}

int tilevox_swiglu_gateup_select(int64_t m, int64_t n, int64_t k, int kernel, int* kernel_out,
                                 int* tile_config_out) {
  clear_error();
  if (kernel_out == nullptr || tile_config_out == nullptr) {
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, "tilevox_swiglu_gateup_select: null output pointer");
  }
  if (kernel != TILEVOX_KERNEL_AUTO && kernel != TILEVOX_KERNEL_DUAL_PINGPONG && kernel != TILEVOX_KERNEL_PACKED_EVT) {
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, "tilevox_swiglu_gateup_select: unknown kernel id " + std::to_string(kernel));
  }
  const TuneEntry& e = nearest_entry(m, n, k);
  int kid = kernel == TILEVOX_KERNEL_AUTO ? e.best_kernel : kernel;
  *kernel_out = kid;
  *tile_config_out = kid == TILEVOX_KERNEL_DUAL_PINGPONG ? e.best_k1_cfg : e.best_k2_cfg;
  return TILEVOX_OK;
}

int tilevox_swiglu_gateup_launch(const tilevox_swiglu_gateup_params* p, void* cuda_stream) {
  clear_error();
  const char* what = "tilevox_swiglu_gateup";
  if (p == nullptr) return fail(TILEVOX_ERR_INVALID_ARGUMENT, "tilevox_swiglu_gateup: params is null");
  int rc = check_shape_common(p->m, p->n, p->k, what);
  if (rc != TILEVOX_OK) return rc;
  int kid = 0, cfg = 0;
  rc = tilevox_swiglu_gateup_select(p->m, p->n, p->k, p->kernel, &kid, &cfg);
  if (rc != TILEVOX_OK) return rc;
  if (p->tile_config != TILEVOX_TILE_CONFIG_AUTO) {
    if (p->tile_config < 0 || p->tile_config >= tilevox_swiglu_gateup_num_configs(kid)) {
      return fail(TILEVOX_ERR_INVALID_ARGUMENT, std::string(what) + ": tile_config " +
                                                     std::to_string(p->tile_config) + " out of range for kernel " +
                                                     std::to_string(kid));
    }
    cfg = p->tile_config;
  }
  if ((rc = check_ptr(p->x, "x", what)) != TILEVOX_OK) return rc;
  if ((rc = check_ptr(p->out, "out", what)) != TILEVOX_OK) return rc;
  if (kid == TILEVOX_KERNEL_DUAL_PINGPONG) {
    if ((rc = check_ptr(p->w_gate, "w_gate", what)) != TILEVOX_OK) return rc;
    if ((rc = check_ptr(p->w_up, "w_up", what)) != TILEVOX_OK) return rc;
  } else {
    if ((rc = check_ptr(p->w_packed, "w_packed", what)) != TILEVOX_OK) return rc;
    if (p->n % tilevox_swiglu_packing_block() != 0) {
      return fail(TILEVOX_ERR_UNSUPPORTED_SHAPE, std::string(what) + ": n not a multiple of the packing block");
    }
  }
  if ((rc = check_ld(p->ldx, p->k, "ldx", what)) != TILEVOX_OK) return rc;
  if ((rc = check_ld(p->ldo, p->n, "ldo", what)) != TILEVOX_OK) return rc;
  if (p->m == 0 || p->n == 0) return TILEVOX_OK;
  const int64_t out_bytes = ((p->m - 1) * p->ldo + p->n) * 2;
  const int64_t x_bytes = ((p->m - 1) * p->ldx + p->k) * 2;
  const int64_t w_bytes = p->n * p->k * 2;
  if (overlaps(p->out, out_bytes, p->x, x_bytes) ||
      (kid == TILEVOX_KERNEL_DUAL_PINGPONG &&
       (overlaps(p->out, out_bytes, p->w_gate, w_bytes) || overlaps(p->out, out_bytes, p->w_up, w_bytes))) ||
      (kid == TILEVOX_KERNEL_PACKED_EVT && overlaps(p->out, out_bytes, p->w_packed, 2 * w_bytes))) {
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, std::string(what) + ": out aliases an input");
  }
  if ((rc = check_device()) != TILEVOX_OK) return rc;
  SwigluArgs a{p->x, p->w_gate, p->w_up, p->w_packed, p->out,
               static_cast<int>(p->m), static_cast<int>(p->n), static_cast<int>(p->k), p->ldx, p->ldo};
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  if (kid == TILEVOX_KERNEL_DUAL_PINGPONG) {
    return cfg == 0 ? k1_dual_pingpong_64x128(a, stream) : k1_dual_pingpong_64x64(a, stream);
  }
  switch (cfg) {
    case 0: return k2_packed_evt_pingpong_64x128(a, stream);
    case 1: return k2_packed_evt_coop_128x256(a, stream);
    case 2: return k2_packed_evt_pingpong_64x256(a, stream);
    case 3: return k2_packed_evt_pingpong_64x96(a, stream);
    default: return k2_packed_evt_pingpong_64x64(a, stream);
  }
}

int tilevox_gemm_bf16_num_configs(void) { return static_cast<int>(sizeof(kGemmConfigs) / sizeof(kGemmConfigs[0])); }

const char* tilevox_gemm_bf16_config_name(int tile_config) {
  if (tile_config < 0 || tile_config >= tilevox_gemm_bf16_num_configs()) return nullptr;
  return kGemmConfigs[tile_config].name;
}

int tilevox_gemm_bf16_launch(const tilevox_gemm_bf16_params* p, void* cuda_stream) {
  clear_error();
  const char* what = "tilevox_gemm_bf16";
  if (p == nullptr) return fail(TILEVOX_ERR_INVALID_ARGUMENT, "tilevox_gemm_bf16: params is null");
  int rc = check_shape_common(p->m, p->n, p->k, what);
  if (rc != TILEVOX_OK) return rc;
  int cfg = gemm_config_for(p->m, p->n);
  if (p->tile_config != TILEVOX_TILE_CONFIG_AUTO) {
    if (p->tile_config < 0 || p->tile_config >= tilevox_gemm_bf16_num_configs()) {
      return fail(TILEVOX_ERR_INVALID_ARGUMENT, std::string(what) + ": tile_config " +
                                                     std::to_string(p->tile_config) + " out of range");
    }
    cfg = p->tile_config;
  }
  if ((rc = check_ptr(p->a, "a", what)) != TILEVOX_OK) return rc;
  if ((rc = check_ptr(p->b, "b", what)) != TILEVOX_OK) return rc;
  if ((rc = check_ptr(p->d, "d", what)) != TILEVOX_OK) return rc;
  if ((rc = check_ld(p->lda, p->k, "lda", what)) != TILEVOX_OK) return rc;
  if ((rc = check_ld(p->ldd, p->n, "ldd", what)) != TILEVOX_OK) return rc;
  if (p->m == 0 || p->n == 0) return TILEVOX_OK;
  const int64_t d_bytes = ((p->m - 1) * p->ldd + p->n) * 2;
  if (overlaps(p->d, d_bytes, p->a, ((p->m - 1) * p->lda + p->k) * 2) ||
      overlaps(p->d, d_bytes, p->b, p->n * p->k * 2)) {
    return fail(TILEVOX_ERR_INVALID_ARGUMENT, std::string(what) + ": d aliases an input");
  }
  if ((rc = check_device()) != TILEVOX_OK) return rc;
  GemmArgs a{p->a, p->b, p->d, static_cast<int>(p->m), static_cast<int>(p->n), static_cast<int>(p->k), p->lda, p->ldd};
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  if (cfg == 0) return gemm_pingpong_64x128(a, stream);
  return cfg == 1 ? gemm_coop_128x256(a, stream) : gemm_pingpong_64x256(a, stream);
}

}  // extern "C"
