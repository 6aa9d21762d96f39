// silu.cuh: fp32 SwiGLU arithmetic shared by Kernel-1 and Kernel-2.
//
// silu(g) * u = g * u / (1 + exp(-g)), all in fp32. __fdividef returns 0 once the denominator passes
// 2^126 (g < about -87), which is the correct limit, so very negative g gives (-)0 instead of NaN.
#pragma once

#include <cuda_runtime.h>

namespace tilevox {

__device__ __forceinline__ float silu(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

__device__ __forceinline__ float silu_mul(float g, float u) { return silu(g) * u; }

}  // namespace tilevox
