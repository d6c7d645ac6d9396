/*
 * kn_test.h - what the kernel tests (test_kn_ref.c, test_kn_fast.c, test_kn_linear.c)
 * share: the tolerances of the fast paths against kn_ref (docs/DESIGN.md section 5) and
 * one deterministic generator of inputs, so that every test draws the same kind of data.
 */
#ifndef KN_TEST_H
#define KN_TEST_H

#include <math.h>
#include <stdint.h>

#include "common/mr.h"

/* Fast path vs kn_ref on the same stored weights, relative L2 (DESIGN.md section 5): the
 * tolerances of kernels/internal.h, which belong to a kernel's activation rounding
 * (kn__kernel.rounding, kn__rounding_tol), never to its name. */
#define TOL_FP32 1e-5  /* paths that compute in fp32 on fp32 activations */
#define TOL_BF16X 1e-2 /* bf16 weights x bf16-rounded activations (vdpbf16ps, AMX-BF16) */
#define TOL_Q8X 3e-2   /* int8 / int4 weights x per-token int8 activations (vpdpbusd, AMX-INT8) */

/* For MT_OK's error argument where a call takes a const mr_err *. */
static inline const mr_err *ep(const mr_err *e) { return e; }

/* xorshift64 seeded per test; uniform in [-1, 1) and Box-Muller N(0, 1). */
static uint64_t rng_s;
static inline void rng_seed(uint64_t s) { rng_s = s * 0x9E3779B97F4A7C15ull + 0x1234567ull; }
static inline uint32_t rng_u32(void) {
  rng_s ^= rng_s << 13;
  rng_s ^= rng_s >> 7;
  rng_s ^= rng_s << 17;
  return (uint32_t)(rng_s >> 11);
}
static inline float rng_uniform(void) {
  return (float)((rng_u32() & 0xffffff) / 8388608.0 - 1.0);
}
static inline float rng_normal(void) {
  double u1 = ((rng_u32() & 0xffffff) + 1.0) / 16777217.0, u2 = (rng_u32() & 0xffffff) / 16777216.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#endif /* KN_TEST_H */
