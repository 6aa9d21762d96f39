// deps.cuh: Counter waits (acquire loads, __nanosleep backoff, %globaltimer watchdog) and an instruction record's fields.
// Included by megakernel.cu inside its anonymous namespace (one translation unit); not a standalone header.
#pragma once

// Block-wide: thread 0 spin-waits until every awaited counter of `inst` reaches its target (acquire or
// relaxed loads: TILEVOX_MK_ACQUIRE; __nanosleep backoff or a tight poll: TILEVOX_MK_POLL; a %globaltimer
// watchdog). False when the block must stop (a watchdog or an error raised anywhere).
__device__ bool wait_deps(const Ctx& c, const int* inst) {
  if (threadIdx.x == 0) {
    const tilevox_megakernel_params& prm = c.prm;
    // Errors raised elsewhere are polled only while spinning: a satisfied wait costs one acquire load.
    int s = 0;
    const int nw = inst[TILEVOX_MK_FIELD_NUM_WAITS];
#if TILEVOX_MK_EARLY_POLL
    asm volatile("cp.async.wait_all;" ::: "memory");  // the record-time copies of the counters
#endif
    for (int i = 0; i < nw && !s; ++i) {
      const int counter = inst[TILEVOX_MK_FIELD_WAITS + 2 * i], target = inst[TILEVOX_MK_FIELD_WAITS + 2 * i + 1];
      if (counter < 0 || counter >= prm.num_counters) {
        raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], counter, 0, target);
        s = 1;
        break;
      }
      const int* ctr = prm.counters + counter;
#if TILEVOX_MK_EARLY_POLL
      if (i < kEarlyWaits && c.early[i] >= target) continue;
#endif
      int value = ld_poll(ctr);
      if (value >= target) continue;
      const uint64_t t0 = global_ns();
#if TILEVOX_MK_POLL
      int polls = 0;
#else
      unsigned sleep_ns = 32;
#endif
      while ((value = ld_poll(ctr)) < target) {
#if TILEVOX_MK_POLL
        if (++polls < kPollCheckEvery) continue;
        polls = 0;
#endif
        if (ld_volatile(prm.error) != 0) {
          s = 1;
          break;
        }
        if ((int64_t)(global_ns() - t0) > prm.watchdog_ns) {
          raise_error(c, TILEVOX_MK_ERROR_WATCHDOG, inst[0], counter, value, target);
          s = 1;
          break;
        }
#if !TILEVOX_MK_POLL
        __nanosleep(sleep_ns);
        sleep_ns = sleep_ns < 256 ? sleep_ns * 2 : 256;
#endif
      }
    }
    *c.stop = s;
    if (c.prof) c.prof[TILEVOX_MK_PROFILE_WORDS * c.pos + 1] = (int64_t)global_ns();
  }
  __syncthreads();
  return *c.stop == 0;
}

__device__ __forceinline__ const int* args_of(const int* inst) { return inst + TILEVOX_MK_FIELD_ARGS; }
__device__ __forceinline__ const int* ins_of(const int* inst) { return inst + TILEVOX_MK_FIELD_INPUTS; }
__device__ __forceinline__ const int* outs_of(const int* inst) { return inst + TILEVOX_MK_FIELD_OUTPUTS; }

// Batch rows [r0, r1) named by args[first], args[first + 1] (NO_ID: 0 / B); false (error raised by thread 0)
// when the range is empty or outside [0, B).
__device__ __forceinline__ bool row_range(const Ctx& c, const int* inst, int first, int B, int& r0, int& r1) {
  const int* a = args_of(inst);
  r0 = a[first] >= 0 ? a[first] : 0;
  r1 = a[first + 1] >= 0 ? a[first + 1] : B;
  if (r0 < r1 && r1 <= B) return true;
  if (threadIdx.x == 0) raise_error(c, TILEVOX_MK_ERROR_OUT_OF_RANGE, inst[0], -1, r1, B);
  return false;
}
