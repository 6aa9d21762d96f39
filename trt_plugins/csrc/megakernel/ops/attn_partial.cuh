// ops/attn_partial.cuh: ATTN_PARTIAL: attention over one key partition (online softmax).
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// q (fp32, shared) . cached key row at element offset `base`.
__device__ __forceinline__ float dot_q_key(const float* q, const Buf& kc, int64_t base, int D) {
  float dot = 0.f;
  if (kc.dt == BF16 && (D % 8) == 0) {
    const uint4* p = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(kc.p) + base);
#pragma unroll 8
    for (int i = 0; i < D / 8; ++i) {
      const uint4 r = __ldcg(p + i);
      const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        dot += q[8 * i + 2 * j] * __uint_as_float(u[j] << 16) + q[8 * i + 2 * j + 1] * __uint_as_float(u[j] & 0xffff0000u);
    }
  } else if (kc.dt == F32 && (D % 4) == 0) {
    const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(kc.p) + base);
#pragma unroll 8
    for (int i = 0; i < D / 4; ++i) {
      const float4 r = __ldcg(p + i);
      dot += q[4 * i] * r.x + q[4 * i + 1] * r.y + q[4 * i + 2] * r.z + q[4 * i + 3] * r.w;
    }
  } else {
    for (int d = 0; d < D; ++d) dot += q[d] * ld_act(kc, base + d);
  }
  return dot;
}

// One warp per (row, query head): keys of the partition 32 at a time, one key per lane for the
// scores, then the 32 weighted value rows accumulated with lanes over head dims (online softmax).
// ATTN_PARTIAL for bf16 caches, G <= kMaxGroup query heads per kv head, D / 8 dividing 32: one warp
// per (row, partition) computes all G heads of the group together, so each key and value row is loaded
// once, not G times. Per 32-key round: lane t scores key t against the G queries (staged in shared
// memory), then lane (kk, cc) accumulates 8 value dims [8cc, 8cc + 8) over keys kk, kk + kpl, ... with
// 16-byte loads; the lanes of one cc are summed at the end (the online-softmax rescale is linear, so it
// commutes with that sum). Same outputs as the general path.
constexpr int kMaxGroup = 8;
constexpr int kGroupedQFloats = 1024;  // per warp: G x D staged queries (8 warps x 1024 = kExtraFloats)

// fresh (split QKV): the newest key and value follow the queries in the warp's staging area.
__device__ __forceinline__ bool attn_grouped_eligible(const Buf& kc, const Buf& vc, int G, int D, bool fresh) {
  return kc.dt == BF16 && vc.dt == BF16 && D % 8 == 0 && 32 % (D / 8) == 0 && G <= kMaxGroup &&
         (G + (fresh ? 2 : 0)) * D <= kGroupedQFloats;
}

// Split QKV (ATTN_PARTIAL with k_new): the operands a warp computes itself instead of reading them from q_buf and
// the cache. Queries of `heads` heads from raw q (B, H x D) at head `head0`, each through norm_rope_in_place (qk_norm_w
// row 0), into q (heads x D floats, shared memory); with kn / vn, the newest key (row 1) and value of kv group
// `group` rounded to the caches' dtypes.
struct Fresh {
  Buf k_new, v_new, qkn, inv_freq;
  bool on, has_qkn;
};

__device__ __forceinline__ Fresh fresh_of(const Ctx& c, const int* inst) {
  const int* in = ins_of(inst);
  Fresh f;
  f.on = in[TILEVOX_MK_ATTN_PARTIAL_IN_K_NEW] >= 0;
  f.has_qkn = in[TILEVOX_MK_ATTN_PARTIAL_IN_QK_NORM_W] >= 0;
  f.k_new = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_K_NEW]);
  f.v_new = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_V_NEW]);
  f.qkn = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_QK_NORM_W]);
  f.inv_freq = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_INV_FREQ]);
  return f;
}

// The split-QKV operands of one (row, kv group) item, into the warp's staging area: the queries of `heads` heads
// from raw q (B, H x D) at head `head0`, each through norm_rope_in_place (qk_norm_w row 0), into q (heads x D
// floats); with kn (not null), the newest key (row 1) and value of kv group `group` rounded to the caches' dtypes
// into kn and vn. T: as in KV_APPEND (Typed<BF16> for the served models). Every raw load is issued before the
// first store (H100, 2026-12-07, typed loads-first with the out-of-place rope: the predictor's split-QKV
// ATTN_PARTIAL 36 against 48 us at batch 1).
template <int T>
__device__ __noinline__ void fresh_operands_t(const Ctx& c, const Fresh& fr, const Buf& q_buf, const Buf& k_cache,
                                              const Buf& v_cache, int b, int group, int head0, int heads, int64_t pos,
                                              float* q, float* kn, float* vn) {
  // Copies in registers: the caller's views sit in its stack frame (local memory), and read through the references
  // each element's load would first wait for a local load of the view's pointer and dtype.
  const Fresh f = fr;
  const Buf qb = q_buf, kc = k_cache, vc = v_cache;
  const int lane = threadIdx.x & 31, D = c.prm.head_dim, H = c.prm.num_heads;
  const float eps = c.prm.rms_norm_eps;
  const int64_t src = (int64_t)b * f.k_new.dims[1] + (int64_t)group * D;
  float kv[kHeadPer], vv[kHeadPer];
#pragma unroll
  for (int j = 0; j < kHeadPer; ++j) {
    const int d = lane + 32 * j;
    kv[j] = kn != nullptr && d < D ? ld_act_t<T>(f.k_new, src + d) : 0.f;
    vv[j] = kn != nullptr && d < D ? rnd_t<T>(ld_act_t<T>(f.v_new, src + d), vc.dt) : 0.f;
  }
  // The heads' raw queries are contiguous: (b * H + head0) * D + h * D + d. Eight per lane in flight at a time.
  const int64_t qsrc = ((int64_t)b * H + head0) * D;
  const int n = heads * D;
  for (int i0 = 0; i0 < n; i0 += 32 * 8) {
    float raw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = i0 + lane + 32 * i;
      raw[i] = idx < n ? ld_act_t<T>(qb, qsrc + idx) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = i0 + lane + 32 * i;
      if (idx < n) q[idx] = raw[i];
    }
  }
  if (kn != nullptr) {
#pragma unroll
    for (int j = 0; j < kHeadPer; ++j) {
      const int d = lane + 32 * j;
      if (d < D) {
        kn[d] = kv[j];
        vn[d] = vv[j];
      }
    }
  }
  __syncwarp();
#pragma unroll 1
  for (int h = 0; h < heads; ++h)
    norm_rope_in_place<T>(q + h * D, f.qkn, f.has_qkn, 0, f.inv_freq, pos, D, qb.dt, eps);
  if (kn != nullptr) {
    norm_rope_in_place<T>(kn, f.qkn, f.has_qkn, 1, f.inv_freq, pos, D, f.k_new.dt, eps);
#pragma unroll 1
    for (int d = lane; d < D; d += 32) kn[d] = rnd_t<T>(kn[d], kc.dt);
    __syncwarp();
  }
}

// Typed<BF16> when q, the newest key and value and both caches are bf16 (the served models; see ld_act_t).
__device__ __forceinline__ void fresh_operands(const Ctx& c, const Fresh& f, const Buf& qb, const Buf& kc,
                                               const Buf& vc, int b, int group, int head0, int heads, int64_t pos,
                                               float* q, float* kn, float* vn) {
  if (qb.dt == BF16 && f.k_new.dt == BF16 && f.v_new.dt == BF16 && kc.dt == BF16 && vc.dt == BF16)
    fresh_operands_t<BF16>(c, f, qb, kc, vc, b, group, head0, heads, pos, q, kn, vn);
  else
    fresh_operands_t<-1>(c, f, qb, kc, vc, b, group, head0, heads, pos, q, kn, vn);
}


// One more key in a warp's online softmax (m, l warp-uniform): returns its weight e relative to the new maximum
// and the factor corr that rescales what was accumulated before; m and l are updated.
__device__ __forceinline__ void online_key(const float* q, const float* kn, int D, float scale, float& m, float& l,
                                           float& corr, float& e) {
  const int lane = threadIdx.x & 31;
  float dot = 0.f;
  for (int d = lane; d < D; d += 32) dot += q[d] * kn[d];
  const float s = warp_sum(dot) * scale;
  const float m_new = fmaxf(m, s);
  corr = expf(m - m_new);  // 0 when nothing was accumulated (m = -inf)
  e = expf(s - m_new);
  l = l * corr + e;
  m = m_new;
}

// Build-time switch (see common.cuh's A/B switches): TILEVOX_MK_ATTN_SPLIT 1 (default) = when an instruction has
// fewer (row, partition) items than warps and a partition spans several 32-key rounds, the warps share each
// item's rounds (warp w takes rounds w, w + 8, ...) with one online softmax each, and their (max, sum, weighted
// values) combine through shared memory by log-sum-exp; 0 = one warp per item; 2 = split only an item whose cached
// keys span several rounds (a one-round item's split gives the same bits as one warp: its combine multiplies by
// exp(0) = 1). Same outputs up to the fp32 order of the sums over keys (the VM sums serially). H100, 2026-12-06,
// Llasa-1B step at batch 1, context 512, 256-key partitions: 2.81 ms against 3.29 without
// (benchmarks/results/megakernel_variants_h100_4266d9f_pt{64,256}.json).
#ifndef TILEVOX_MK_ATTN_SPLIT
#define TILEVOX_MK_ATTN_SPLIT 1
#endif
// Build-time switch: TILEVOX_MK_FRESH_SPREAD 1 = with split QKV, when the warps share one item (the split above), its
// G query heads and its newest key are normed and roped by G + 1 warps side by side, one head each, instead of by
// every warp for all G heads (and warp 0 for the key) one after another; 0 (default) = as before. Same arithmetic per
// head, same outputs. H100, 2026-12-07: with split QKV the predictor's ATTN_PARTIAL took 34 us at batch 1 against
// 20 us with the fused QKV stage (which norms and ropes in its own tiles), so split QKV lost (6.99 against 6.49 ms)
// although its projection tiles are 4x shorter. Compiles; not yet run on a GPU.
#ifndef TILEVOX_MK_FRESH_SPREAD
#define TILEVOX_MK_FRESH_SPREAD 0
#endif

// The split's per-warp (m, l, acc) rows live in the staging area xs, unused by attention.
static_assert(kWarps * kMaxGroup * (2 + TILEVOX_MK_MAX_HEAD_DIM) <= kXsFloats, "split attention scratch overflows xs");
// Per-warp staging in the extra area: the grouped queries, or the general path's query, newest key and value.
static_assert(kWarps * kGroupedQFloats <= kExtraFloats && 3 * TILEVOX_MK_MAX_HEAD_DIM <= kGroupedQFloats,
              "attention staging overflows the extra area");

// One warp's online-softmax state over some rounds of one item, for the G <= GM heads of a kv group: after
// grouped_rounds, acc holds this lane's 8 value dims [8cc, 8cc + 8), summed over the lanes of one cc
// (valid on lanes with kk0 == 0); m and l are warp-uniform.

template <int GM>
struct GroupedState {
  float m[GM], l[GM], acc[GM][8];
};

// Rounds t0 = first + 32 r for r = r0, r0 + rstep, ... below last. Per round every load is issued before
// any is used: lane t's key row (all of it when it is at most 8 x 16 bytes) and the 16-byte value pieces
// lane (kk, cc) accumulates (they do not depend on the scores). VMAX >= cpr bounds the value registers.
template <int VMAX, int GM>
__device__ __forceinline__ void grouped_rounds(GroupedState<GM>& st, const float* q, const uint4* keys,
                                               const unsigned short* vals, int64_t first, int64_t last, int r0,
                                               int rstep, int G, int D, float scale) {
  const int lane = threadIdx.x & 31;
  const int cpr = D / 8, kpl = 32 / cpr, kk0 = lane / cpr;
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    st.m[h] = -INFINITY;
    st.l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) st.acc[h][j] = 0.f;
  }
  for (int64_t t0 = first + 32 * (int64_t)r0; t0 < last; t0 += 32 * (int64_t)rstep) {
    const int64_t t = t0 + lane;
    const bool valid = t < last;
    const int nk = (int)min((int64_t)32, last - t0);
    uint4 vv4[VMAX];
#pragma unroll
    for (int pass = 0; pass < VMAX; ++pass) {
      const int kk = kk0 + pass * kpl;
      vv4[pass] = pass < cpr && kk < nk ? __ldcg(reinterpret_cast<const uint4*>(vals + (t0 + kk) * D))
                                         : make_uint4(0u, 0u, 0u, 0u);
    }
    float sc[GM];
#pragma unroll
    for (int h = 0; h < GM; ++h) sc[h] = 0.f;
    auto score = [&](const uint4 r, int i) {
      const unsigned u[4] = {r.x, r.y, r.z, r.w};
      float kv[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        kv[2 * j] = __uint_as_float(u[j] << 16);
        kv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
      }
#pragma unroll
      for (int h = 0; h < GM; ++h) {
        if (h < G) {
          const float* qh = q + h * D + 8 * i;
#pragma unroll
          for (int j = 0; j < 8; ++j) sc[h] += qh[j] * kv[j];
        }
      }
    };
    if (valid) {
      const uint4* kr = keys + t * cpr;
      if constexpr (VMAX <= 8) {
        uint4 k4[VMAX];
#pragma unroll
        for (int i = 0; i < VMAX; ++i) k4[i] = i < cpr ? __ldcg(kr + i) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int i = 0; i < VMAX; ++i)
          if (i < cpr) score(k4[i], i);
      } else {
#pragma unroll 4
        for (int i = 0; i < cpr; ++i) score(__ldcg(kr + i), i);
      }
    }
    float e[GM];
#pragma unroll
    for (int h = 0; h < GM; ++h) {
      if (h < G) {
        const float s = valid ? sc[h] * scale : -INFINITY;
        const float m_new = fmaxf(st.m[h], warp_max(s));  // finite: key t0 is valid
        const float corr = expf(st.m[h] - m_new);
        e[h] = valid ? expf(s - m_new) : 0.f;
        st.l[h] = st.l[h] * corr + warp_sum(e[h]);
#pragma unroll
        for (int j = 0; j < 8; ++j) st.acc[h][j] *= corr;
        st.m[h] = m_new;
      } else {
        e[h] = 0.f;
      }
    }
#pragma unroll
    for (int pass = 0; pass < VMAX; ++pass) {
      if (pass < cpr) {
        const int kk = kk0 + pass * kpl;
        const unsigned u[4] = {vv4[pass].x, vv4[pass].y, vv4[pass].z, vv4[pass].w};
        float vv[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          vv[2 * j] = __uint_as_float(u[j] << 16);
          vv[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
        }
#pragma unroll
        for (int h = 0; h < GM; ++h) {
          if (h < G) {
            const float ek = __shfl_sync(0xffffffffu, e[h], kk);  // e = 0 past nk
#pragma unroll
            for (int j = 0; j < 8; ++j) st.acc[h][j] += ek * vv[j];
          }
        }
      }
    }
  }
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    if (h < G) {
      for (int off = cpr; off < 32; off <<= 1)
#pragma unroll
        for (int j = 0; j < 8; ++j) st.acc[h][j] += __shfl_xor_sync(0xffffffffu, st.acc[h][j], off);
    }
  }
}

// The newest key and value (split QKV) added to a warp's state after grouped_rounds (acc already summed over kk).
template <int GM>
__device__ __forceinline__ void grouped_new_key(GroupedState<GM>& st, const float* q, const float* kn, const float* vn,
                                                int G, int D, float scale) {
  const int cc = (threadIdx.x & 31) % (D / 8);
#pragma unroll
  for (int h = 0; h < GM; ++h) {
    if (h < G) {
      float corr, e;
      online_key(q + h * D, kn, D, scale, st.m[h], st.l[h], corr, e);
#pragma unroll
      for (int j = 0; j < 8; ++j) st.acc[h][j] = st.acc[h][j] * corr + e * vn[cc * 8 + j];
    }
  }
}

// The grouped path reads its views, the launch constants and its first item's position and cache slot (launch
// inputs, never written by an instruction) before the dependency wait, so that their dependent loads overlap the
// wait instead of following it. Same arithmetic, same outputs. H100, 2026-12-07, against the wait first (the
// former build switch TILEVOX_MK_ATTN_EARLY; benchmarks/results/megakernel_variants_h100_cd86aaf_*.json): the
// Qwen3-TTS predictor loop 6.58 -> 6.20 ms at batch 1 and 13.80 -> 13.70 at 32, the Llama-1B step 2.44 -> 2.40 and
// 5.52 -> 5.43 (2.44 -> 2.39 and 5.51 -> 5.44 in a second run).
// Waits for the instruction's dependencies itself; false when the block must stop.
template <int VMAX, int GM>
__device__ __noinline__ bool attn_partial_grouped(const Ctx c, const int* inst, float* q_smem, float* split_smem,
                                                  int r0, int r1) {
  const int* in = ins_of(inst);
  const Buf qb = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_Q_BUF]), kc = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_K_CACHE]), vc = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_V_CACHE]), positions = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_POSITIONS]),
            slots = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_SLOTS]);
  const Buf po = get_buf(c, outs_of(inst)[TILEVOX_MK_ATTN_PARTIAL_OUT_PART_OUT]), pl = get_buf(c, outs_of(inst)[TILEVOX_MK_ATTN_PARTIAL_OUT_PART_LSE]);
  const int group = args_of(inst)[TILEVOX_MK_ATTN_PARTIAL_ARG_GROUP];
  const int layer = inst[TILEVOX_MK_FIELD_LAYER], step = inst[TILEVOX_MK_FIELD_STEP];
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions, PT = c.prm.partition_tokens;
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = c.prm.attn_scale;
  const int cpr = D / 8, kk0 = lane / cpr, cc = lane % cpr;
  float* q = q_smem + warp * kGroupedQFloats;  // (G, D), then split QKV's newest key and value (D each)
  const Fresh fr = fresh_of(c, inst);
  const int t_start = inst[TILEVOX_MK_FIELD_TILE_START], t_stop = inst[TILEVOX_MK_FIELD_TILE_STOP];
  const int items = (r1 - r0) * (t_stop - t_start);
  const int rounds = (PT + 31) / 32;
  // Split: warps share an item's rounds (block-uniform: items and rounds are the instruction's).
  const bool eligible = TILEVOX_MK_ATTN_SPLIT && items < kWarps && rounds > 1;
  const int item0 = eligible ? 0 : warp, item_step = eligible ? 1 : kWarps;
  // The first item's row position and slot (launch inputs), read before the wait.
  const int b0 = r0 + item0 / (t_stop - t_start);
  const int64_t pos0 = item0 < items ? ld_int(positions, b0) : 0, slot0 = item0 < items ? ld_int(slots, b0) : 0;
  if (!wait_deps(c, inst)) return false;
  for (int item = item0; item < items; item += item_step) {
    const int b = r0 + item / (t_stop - t_start), part = t_start + item % (t_stop - t_start);
    const int64_t first = (int64_t)part * PT;
    const int64_t length = (b == b0 ? pos0 : ld_int(positions, b)) + step + 1;
    // Keys [length - span.count, length), from cache position span.phys; partitions count keys from there.
    const KeySpan span = key_span(c.prm.window, length);
    const int64_t base_bp = ((int64_t)b * KVH + group) * P + part;  // (b, group, part): * G + head
    const int64_t slot = b == b0 ? slot0 : ld_int(slots, b);
    if (span.count > (int64_t)P * PT || span.phys + span.count > c_len) {
      if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)length, (int)min((int64_t)P * PT, c_len));
      continue;
    }
    const int64_t last = min(first + PT, span.count);
    // Split QKV: the newest position (length - 1) comes from k_new / v_new, the cache only below it.
    const bool has_new = fr.on && last == span.count;
    const int64_t cached = has_new ? last - 1 : last;
#if TILEVOX_MK_ATTN_SPLIT == 2
    // Adaptive: an item whose cached keys fit one round goes to one warp (the others have no keys to share).
    const bool split = eligible && cached - first > 32;  // block-uniform: every warp reads the same item
    if (eligible && !split && warp != item % kWarps) continue;
#else
    const bool split = eligible;
#endif
    if (last <= first) {
      if (!split || warp == 0) {
        for (int idx = lane; idx < G * D; idx += 32) st(po, base_bp * G * D + idx, 0.f);
        if (lane < G) st(pl, base_bp * G + lane, -INFINITY);
      }
      continue;
    }
    if (slot < 0 || slot >= c_slots || group >= c_heads) {
      if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)slot, (int)c_slots);
      continue;
    }
    __syncwarp();
    float* qi = q;  // this item's staged queries (then the newest key and value)
#if TILEVOX_MK_FRESH_SPREAD
    if (fr.on && split) {
      // One head per warp, into warp 0's staging area: warp h < G norms and ropes query head h, warp kw the newest
      // key (and rounds the value); every warp then reads them there. Block-uniform: split is the instruction's.
      qi = q_smem;
      __syncthreads();  // warp 0 may still read its area for an item of its own (TILEVOX_MK_ATTN_SPLIT 2)
      const int kw = G < kWarps ? G : 0;
      const bool key_here = has_new && warp == kw;
      if (warp < G || key_here)
        fresh_operands(c, fr, qb, kc, vc, b, group, group * G + (warp < G ? warp : 0), warp < G ? 1 : 0, length - 1,
                       qi + (warp < G ? warp : 0) * D, key_here ? qi + G * D : nullptr, qi + (G + 1) * D);
      __syncthreads();
    } else
#endif
    if (fr.on) {
      const bool with_new = has_new && (!split || warp == 0);
      fresh_operands(c, fr, qb, kc, vc, b, group, group * G, G, length - 1, q, with_new ? q + G * D : nullptr,
                     q + (G + 1) * D);
    } else if (qb.dt == BF16 && (G * D) % 8 == 0) {  // 16-byte loads, all in flight at once
      const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(qb.p) +
                                                        ((int64_t)b * H + group * G) * D);
      for (int i8 = lane; i8 < G * D / 8; i8 += 32) {
        const uint4 r = __ldcg(src + i8);
        const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          q[8 * i8 + 2 * j] = __uint_as_float(u[j] << 16);
          q[8 * i8 + 2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
        }
      }
    } else {
      for (int idx = lane; idx < G * D; idx += 32) q[idx] = ld_act(qb, ((int64_t)b * H + group * G) * D + idx);
    }
    __syncwarp();
    const int64_t cache_base = ((((int64_t)layer * c_slots + slot) * c_heads + group) * c_len + span.phys) * D;
    const uint4* keys = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(kc.p) + cache_base);
    const unsigned short* vals = reinterpret_cast<const unsigned short*>(vc.p) + cache_base + cc * 8;
    GroupedState<GM> gs;
    grouped_rounds<VMAX, GM>(gs, qi, keys, vals, first, cached, split ? warp : 0, split ? kWarps : 1, G, D, scale);
    if (has_new && (!split || warp == 0)) grouped_new_key<GM>(gs, qi, qi + G * D, qi + (G + 1) * D, G, D, scale);
    if (!split) {
#pragma unroll
      for (int h = 0; h < GM; ++h) {
        if (h < G) {
          if (kk0 == 0)
#pragma unroll
            for (int j = 0; j < 8; ++j) st(po, (base_bp * G + h) * D + cc * 8 + j, gs.acc[h][j] / gs.l[h]);
          if (lane == 0) st(pl, base_bp * G + h, gs.m[h] + logf(gs.l[h]));
        }
      }
      continue;
    }
    // Split: each warp's (m, l, acc) to shared memory, then one log-sum-exp combine per (head, dim).
    float* mine = split_smem + warp * GM * (2 + TILEVOX_MK_MAX_HEAD_DIM);  // [h][0]=m, [1]=l, [2..]=acc
#pragma unroll
    for (int h = 0; h < GM; ++h) {
      if (h < G) {
        float* row = mine + h * (2 + TILEVOX_MK_MAX_HEAD_DIM);
        if (lane == 0) {
          row[0] = gs.m[h];
          row[1] = gs.l[h];
        }
        if (kk0 == 0)
#pragma unroll
          for (int j = 0; j < 8; ++j) row[2 + cc * 8 + j] = gs.acc[h][j];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += kThreads) {
      const int h = idx / D, d = idx - h * D;
      float peak = -INFINITY;
      for (int w = 0; w < kWarps; ++w) peak = fmaxf(peak, split_smem[(w * GM + h) * (2 + TILEVOX_MK_MAX_HEAD_DIM)]);
      float num = 0.f, den = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float* row = split_smem + (w * GM + h) * (2 + TILEVOX_MK_MAX_HEAD_DIM);
        if (row[1] > 0.f) {  // a warp with no keys of this item: m = -inf, l = 0
          const float f = expf(row[0] - peak);
          num += f * row[2 + d];
          den += f * row[1];
        }
      }
      st(po, (base_bp * G + h) * D + d, num / den);
      if (d == 0) st(pl, base_bp * G + h, peak + logf(den));
    }
    __syncthreads();
  }
  return true;
}

TILEVOX_MK_OP bool op_attn_partial(const Ctx c, const int* inst, float* q_smem, float* split_smem) {
  const int* in = ins_of(inst);
  const Buf qb = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_Q_BUF]), kc = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_K_CACHE]), vc = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_V_CACHE]), positions = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_POSITIONS]),
            slots = get_buf(c, in[TILEVOX_MK_ATTN_PARTIAL_IN_SLOTS]);
  const Buf po = get_buf(c, outs_of(inst)[TILEVOX_MK_ATTN_PARTIAL_OUT_PART_OUT]), pl = get_buf(c, outs_of(inst)[TILEVOX_MK_ATTN_PARTIAL_OUT_PART_LSE]);
  const int group = args_of(inst)[TILEVOX_MK_ATTN_PARTIAL_ARG_GROUP];
  const int layer = inst[TILEVOX_MK_FIELD_LAYER], step = inst[TILEVOX_MK_FIELD_STEP];
  const int D = c.prm.head_dim, KVH = c.prm.num_kv_heads, G = c.prm.num_heads / KVH, H = c.prm.num_heads;
  const int P = c.prm.num_partitions, PT = c.prm.partition_tokens, B = c.prm.batch_size;
  const int64_t c_slots = kc.dims[1], c_heads = kc.dims[2], c_len = kc.dims[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = c.prm.attn_scale;
  int r0, r1;
  if (!row_range(c, inst, TILEVOX_MK_ATTN_PARTIAL_ARG_ROW_START, B, r0, r1)) return false;
  float* q = q_smem + warp * kGroupedQFloats;  // D floats, then split QKV's newest key and value (D each)
  float *kn = q + TILEVOX_MK_MAX_HEAD_DIM, *vn = kn + TILEVOX_MK_MAX_HEAD_DIM;
  constexpr int kPer = TILEVOX_MK_MAX_HEAD_DIM / 32;
  // bf16 values with D / 8 dividing 32: lane (kk, cc) accumulates 8 dims [8cc, 8cc + 8) over keys
  // kk, kk + kpl, ... of each 32-key round with 16-byte loads, all in flight at once; the lanes of one
  // cc are summed at the end (the online-softmax rescale is linear, so it commutes with that sum).
  const bool vec_v = vc.dt == BF16 && D % 8 == 0 && 32 % (D / 8) == 0;
  const int cpr = vec_v ? D / 8 : 1, kpl = 32 / cpr, kk0 = lane / cpr, cc = lane % cpr;
  const Fresh fr = fresh_of(c, inst);
  if (attn_grouped_eligible(kc, vc, G, D, fr.on)) {  // it waits after its prologue
    // Register arrays sized for the head dim (value pieces) and the group (accumulators), so that the common
    // shapes do not spill: Llama-1B (D 64, G 4), Qwen3-TTS (D 128, G 2).
    if (D <= 64) {
      if (G <= 2)
        return attn_partial_grouped<8, 2>(c, inst, q_smem, split_smem, r0, r1);
      else if (G <= 4)
        return attn_partial_grouped<8, 4>(c, inst, q_smem, split_smem, r0, r1);
      else
        return attn_partial_grouped<8, kMaxGroup>(c, inst, q_smem, split_smem, r0, r1);
    } else if (D <= 128) {
      if (G <= 2)
        return attn_partial_grouped<16, 2>(c, inst, q_smem, split_smem, r0, r1);
      else if (G <= 4)
        return attn_partial_grouped<16, 4>(c, inst, q_smem, split_smem, r0, r1);
      else
        return attn_partial_grouped<16, kMaxGroup>(c, inst, q_smem, split_smem, r0, r1);
    } else {
      return attn_partial_grouped<32, kMaxGroup>(c, inst, q_smem, split_smem, r0, r1);
    }
  }
  if (!wait_deps(c, inst)) return false;
  for (int part = inst[TILEVOX_MK_FIELD_TILE_START]; part < inst[TILEVOX_MK_FIELD_TILE_STOP]; ++part) {
    const int64_t first = (int64_t)part * PT;
    for (int pair = warp; pair < (r1 - r0) * G; pair += kWarps) {
      const int b = r0 + pair / G, i = pair % G;
      const int64_t length = ld_int(positions, b) + step + 1;
      const KeySpan span = key_span(c.prm.window, length);  // as in attn_partial_grouped
      const int64_t out_base = ((((int64_t)b * KVH + group) * P + part) * G + i) * D;
      const int64_t lse_idx = (((int64_t)b * KVH + group) * P + part) * G + i;
      if (span.count > (int64_t)P * PT || span.phys + span.count > c_len) {
        if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)length, (int)min((int64_t)P * PT, c_len));
        continue;
      }
      const int64_t last = min(first + PT, span.count);
      const bool has_new = fr.on && last == span.count;  // split QKV: the newest position from k_new / v_new
      if (last <= first) {
        for (int d = lane; d < D; d += 32) st(po, out_base + d, 0.f);
        if (lane == 0) st(pl, lse_idx, -INFINITY);
        continue;
      }
      const int64_t slot = ld_int(slots, b);
      if (slot < 0 || slot >= c_slots || group >= c_heads) {
        if (lane == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, (int)slot, (int)c_slots);
        continue;
      }
      const int head = group * G + i;
      __syncwarp();
      if (fr.on) {
        fresh_operands(c, fr, qb, kc, vc, b, group, head, 1, length - 1, q, has_new ? kn : nullptr, vn);
      } else {
        for (int d = lane; d < D; d += 32) q[d] = ld_act(qb, ((int64_t)b * H + head) * D + d);
        __syncwarp();
      }
      float acc[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[j] = 0.f;  // kPer >= 8: acc[0..8) are the vec_v lane's dims
      const int64_t cache_base = ((((int64_t)layer * c_slots + slot) * c_heads + group) * c_len + span.phys) * D;
      float m = -INFINITY, l = 0.f;
      const int64_t cached = has_new ? last - 1 : last;
      for (int64_t t0 = first; t0 < cached; t0 += 32) {
        const int64_t t = t0 + lane;
        const bool valid = t < cached;
        const float s = valid ? dot_q_key(q, kc, cache_base + t * D, D) * scale : -INFINITY;
        const float m_new = fmaxf(m, warp_max(s));  // finite: key t0 is valid
        const float corr = expf(m - m_new);
        const float e = valid ? expf(s - m_new) : 0.f;
        l = l * corr + warp_sum(e);
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc[j] *= corr;
        const int nk = (int)min((int64_t)32, cached - t0);
        if (vec_v) {
          const unsigned short* vr = reinterpret_cast<const unsigned short*>(vc.p) + cache_base + t0 * D + cc * 8;
#pragma unroll 8
          for (int pass = 0; pass < cpr; ++pass) {
            const int kk = kk0 + pass * kpl;
            const float ek = __shfl_sync(0xffffffffu, e, kk);
            if (kk < nk) {
              const uint4 r = __ldcg(reinterpret_cast<const uint4*>(vr + (int64_t)kk * D));
              const unsigned u[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                acc[2 * j] += ek * __uint_as_float(u[j] << 16);
                acc[2 * j + 1] += ek * __uint_as_float(u[j] & 0xffff0000u);
              }
            }
          }
        } else if (vc.dt == BF16) {
          const unsigned short* vr = reinterpret_cast<const unsigned short*>(vc.p) + cache_base + t0 * D;
#pragma unroll 4
          for (int kk = 0; kk < nk; ++kk) {
            const float ek = __shfl_sync(0xffffffffu, e, kk);
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
              const int d = lane + 32 * j;
              if (d < D) acc[j] += ek * bf16_bits_to_float(__ldcg(vr + (int64_t)kk * D + d));
            }
          }
        } else {
#pragma unroll 4
          for (int kk = 0; kk < nk; ++kk) {
            const float ek = __shfl_sync(0xffffffffu, e, kk);
            const int64_t vb = cache_base + (t0 + kk) * D;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
              const int d = lane + 32 * j;
              if (d < D) acc[j] += ek * ld_act(vc, vb + d);
            }
          }
        }
        m = m_new;
      }
      if (vec_v)
        for (int off = cpr; off < 32; off <<= 1)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], off);
      if (has_new) {
        float corr, e;
        online_key(q, kn, D, scale, m, l, corr, e);
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int d = vec_v ? cc * 8 + j : lane + 32 * j;
          if ((!vec_v || j < 8) && d < D) acc[j] = acc[j] * corr + e * vn[d];
        }
      }
      if (vec_v) {
        if (kk0 == 0)
#pragma unroll
          for (int j = 0; j < 8; ++j) st(po, out_base + cc * 8 + j, acc[j] / l);
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const int d = lane + 32 * j;
          if (d < D) st(po, out_base + d, acc[j] / l);
        }
      }
      if (lane == 0) st(pl, lse_idx, m + logf(l));
    }
  }
  return true;
}
