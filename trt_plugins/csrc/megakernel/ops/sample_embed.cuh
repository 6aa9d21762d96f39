// ops/sample_embed.cuh: SAMPLE_EMBED: greedy or top-k / top-p draw (the VM's counter-based RNG), then the sampled token's embedding.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// Order-preserving map of a float to uint32 (larger float -> larger key; -inf lowest of non-NaN).
__device__ __forceinline__ unsigned fkey(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

TILEVOX_MK_OP bool op_sample(const Ctx c, const int* inst, float* smem) {
  const int* in = ins_of(inst);
  const Buf logits = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_LOGITS]), temperature = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_TEMPERATURE]), top_k = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_TOP_K]),
            top_p = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_TOP_P]), seed = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_SEED]), rng_offset = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_RNG_OFFSET]),
            table = get_buf(c, in[TILEVOX_MK_SAMPLE_EMBED_IN_TABLE]);
  const bool has_table = in[TILEVOX_MK_SAMPLE_EMBED_IN_TABLE] >= 0;
  const Buf tokens_out = get_buf(c, outs_of(inst)[TILEVOX_MK_SAMPLE_EMBED_OUT_TOKENS_OUT]), x_next = get_buf(c, outs_of(inst)[TILEVOX_MK_SAMPLE_EMBED_OUT_X_NEXT]);
  const int V = args_of(inst)[TILEVOX_MK_SAMPLE_EMBED_ARG_VOCAB_LIMIT], rng_step = args_of(inst)[TILEVOX_MK_SAMPLE_EMBED_ARG_RNG_STEP];
  const int64_t row_len = logits.dims[1];
  float* red = smem;                                          // kWarps floats
  long long* red_ll = reinterpret_cast<long long*>(smem + 16);  // kWarps int64
  float* scan = smem + 64;                                    // kWarps floats
  __shared__ long long s_token;
  if (!wait_deps(c, inst)) return false;
  for (int row = inst[TILEVOX_MK_FIELD_TILE_START]; row < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++row) {
    const int64_t base = (int64_t)row * row_len;
    const float temp = ld_act(temperature, row);
    long long token;
    if (temp == 0.0f) {
      // argmax, first index among equal maxima (torch.argmax). Each thread scans its elements in
      // increasing order; bf16 rows go 8 elements per 16-byte load, several loads in flight.
      float best = -INFINITY;
      long long best_i = V;
      auto consider = [&](float s, int v) {
        if (s > best || best_i == V) {
          best = s;
          best_i = v;
        }
      };
      if (logits.dt == BF16 && row_len % 8 == 0) {
        const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(logits.p) + base);
        const int nv = (V + 7) / 8;  // the last word may pass V, never the row (row_len % 8 == 0)
#pragma unroll 4
        for (int j = threadIdx.x; j < nv; j += kThreads) {
          const uint4 r = __ldcg(p + j);
          const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int v = 8 * j + 2 * e;
            if (v < V) consider(__uint_as_float(u[e] << 16), v);
            if (v + 1 < V) consider(__uint_as_float(u[e] & 0xffff0000u), v + 1);
          }
        }
      } else {
        for (int v = threadIdx.x; v < V; v += kThreads) consider(ld_act(logits, base + v), v);
      }
      const float top = block_max(best, red);
      token = block_min_ll(best == top ? best_i : (long long)V, red_ll);
    } else {
      const int64_t k = ld_int(top_k, row);
      const float p = ld_act(top_p, row);
      // keep(v): key >= kth_key (top-k) and key > drop_key (top-p), maximum always kept.
      unsigned kth_key = 0;
      if (k > 0 && k < V) {
        for (int bit = 31; bit >= 0; --bit) {
          const unsigned cand = kth_key | (1u << bit);
          float cnt = 0.f;
          for (int v = threadIdx.x; v < V; v += kThreads) cnt += fkey(ld_act(logits, base + v) / temp) >= cand;
          if (block_sum(cnt, red) >= (float)k) kth_key = cand;
        }
      }
      float mx = -INFINITY;
      for (int v = threadIdx.x; v < V; v += kThreads) mx = fmaxf(mx, ld_act(logits, base + v) / temp);
      mx = block_max(mx, red);
      const unsigned max_key = fkey(mx);
      float z = 0.f;
      for (int v = threadIdx.x; v < V; v += kThreads) {
        const float s = ld_act(logits, base + v) / temp;
        if (fkey(s) >= kth_key) z += expf(s - mx);
      }
      z = block_sum(z, red);
      long long drop_key = -1;  // drop keys <= drop_key
      if (p < 1.0f) {
        unsigned t = 0;
        bool any = false;
        for (int bit = 31; bit >= 0; --bit) {
          const unsigned cand = t | (1u << bit);
          float mass = 0.f;
          for (int v = threadIdx.x; v < V; v += kThreads) {
            const float s = ld_act(logits, base + v) / temp;
            const unsigned key = fkey(s);
            if (key >= kth_key && key <= cand) mass += expf(s - mx);
          }
          if (block_sum(mass, red) / z <= 1.0f - p) {
            t = cand;
            any = true;
          }
        }
        if (!any) {
          float mass = 0.f;  // t == 0 itself: only NaN-like keys, mass 0
          any = block_sum(mass, red) / z <= 1.0f - p;
        }
        if (any) drop_key = (long long)t;
      }
      auto kept = [&](float s) {
        const unsigned key = fkey(s);
        return key >= kth_key && ((long long)key > drop_key || key == max_key);
      };
      float total = 0.f;
      for (int v = threadIdx.x; v < V; v += kThreads) {
        const float s = ld_act(logits, base + v) / temp;
        if (kept(s)) total += expf(s - mx);
      }
      total = block_sum(total, red);
      // u from the counter-based hash of vm.uniform_from_seed.
      const long long sd = ld_int(seed, row);
      const uint32_t lo = (uint32_t)((unsigned long long)sd & 0xffffffffull);
      const uint32_t hi = (uint32_t)(((unsigned long long)sd >> 32) & 0xffffffffull);
      const uint32_t key = hash32(hash32(lo) ^ hi);
      const uint32_t ctr = (uint32_t)((unsigned long long)(ld_int(rng_offset, row) + rng_step) & 0xffffffffull);
      const uint32_t bits = hash32(key ^ hash32(ctr));
      const float u = (float)((bits >> 9) * 2u + 1u) * 5.9604644775390625e-8f;  // 2^-24
      const float target = u * total;
      // First index whose inclusive prefix sum exceeds target (searchsorted right), chunk by chunk.
      float carry = 0.f;
      token = V - 1;
      const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
      for (int start = 0; start < V; start += kThreads) {
        const int v = start + threadIdx.x;
        float e = 0.f;
        if (v < V) {
          const float s = ld_act(logits, base + v) / temp;
          if (kept(s)) e = expf(s - mx);
        }
        float inc = e;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const float n = __shfl_up_sync(0xffffffffu, inc, o);
          if (lane >= o) inc += n;
        }
        __syncthreads();
        if (lane == 31) scan[warp] = inc;
        __syncthreads();
        float off = carry;
        for (int i = 0; i < warp; ++i) off += scan[i];
        float chunk_total = 0.f;
        for (int i = 0; i < kWarps; ++i) chunk_total += scan[i];
        const long long hit = block_min_ll((v < V && off + inc > target) ? (long long)v : (long long)V, red_ll);
        if (hit < V) {
          token = hit;
          break;
        }
        carry += chunk_total;
      }
    }
    if (threadIdx.x == 0) {
      s_token = token;
      st_int(tokens_out, row, token);
    }
    __syncthreads();
    token = s_token;
    if (has_table) {
      const int64_t width = table.dims[1];
      for (int64_t k2 = threadIdx.x; k2 < width; k2 += kThreads)
        st(x_next, (int64_t)row * width + k2, ld_w(table, token * width + k2));
    }
    __syncthreads();
  }
  return true;
}
