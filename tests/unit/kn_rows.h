/*
 * kn_rows.h - what test_kn_fast.c and test_kn_amx.c share to check kn__kernel.prep_rows:
 * rows of x in one dtype with the awkward values (zeros, subnormals, large values, a NaN),
 * a gather order with tokens out of order and repeated, and the comparison of the bytes
 * prep_rows writes from the rows in place with those prep writes from their fp32 copy.
 */
#ifndef KN_ROWS_H
#define KN_ROWS_H

#include "kernels/internal.h"
#include "tests/unit/kn_test.h"

#include <stdlib.h>
#include <string.h>

/* T rows of H values in dtype dt (xs) and the same widened to fp32 (wide): N(0, 1), row 3
 * zeros, row 5 subnormals of fp32 and of f16 / bf16, row 8 up to ~6e4 (f16's range), one
 * NaN in row 11. T >= 12. */
typedef struct rows_case {
  uint32_t T, H;
  mr_dtype dt;
  char *xs;
  float *wide;
} rows_case;

static inline rows_case rows_case_make(uint32_t T, uint32_t H, mr_dtype dt, uint64_t seed) {
  rows_case c = {T, H, dt, malloc((size_t)T * H * mr_dtype_size(dt)), malloc((size_t)T * H * 4)};
  float *src = malloc((size_t)T * H * 4);
  rng_seed(seed);
  for (size_t i = 0; i < (size_t)T * H; i++) src[i] = rng_normal();
  for (uint32_t j = 0; j < H; j++) {
    src[(size_t)3 * H + j] = 0.0f;
    src[(size_t)5 * H + j] = (j % 7 ? 1e-40f : -6e-8f) * (float)(j % 5);
    src[(size_t)8 * H + j] = rng_normal() * (j % 3 ? 1e4f : 6e4f);
  }
  src[(size_t)11 * H + H / 2] = NAN;
  mr_convert_from_f32(c.xs, dt, src, (size_t)T * H);
  mr_convert_to_f32(c.wide, c.xs, dt, (size_t)T * H);
  free(src);
  return c;
}
static inline void rows_case_free(rows_case *c) {
  free(c->xs);
  free(c->wide);
}

/* n tokens to gather: 11, 10, .., 0 first (the special rows among them), then a stride
 * through T, the last one again the first. */
static inline void rows_tokens(uint32_t *tok, uint32_t n, uint32_t T) {
  for (uint32_t r = 0; r < n; r++) tok[r] = r < 12 ? 11 - r : (r * 37 + 5) % T;
  if (n > 2) tok[n - 1] = tok[0];
}

/* k's prep_rows on c's rows tok[0..n) against its prep on their fp32 copy: 0 when the
 * bytes are the same (both buffers filled alike first, as layouts have padding prep
 * leaves alone), else the offset + 1 of the first difference. If out is given, the bytes
 * are copied there (prep_bytes(L, n) of them). */
static inline size_t rows_prep_diff(const kn__kernel *k, const kn_layer *L, uint32_t n, const rows_case *c,
                                    const uint32_t *tok, uint8_t *out) {
  const uint32_t H = c->H;
  const size_t pb = k->prep_bytes(L, n);
  float *xf = malloc((size_t)n * H * 4);
  for (uint32_t r = 0; r < n; r++) memcpy(xf + (size_t)r * H, c->wide + (size_t)tok[r] * H, (size_t)H * 4);
  uint8_t *q1 = mr_malloc_aligned(pb + 64, 64), *q2 = mr_malloc_aligned(pb + 64, 64);
  memset(q1, 0x5a, pb);
  memset(q2, 0x5a, pb);
  k->prep(L, n, xf, q1);
  const kn__rows rows = {.base = c->xs, .stride = (size_t)H * mr_dtype_size(c->dt), .tok = tok, .dt = c->dt};
  k->prep_rows(L, n, &rows, q2);
  size_t at = 0;
  for (size_t i = 0; i < pb && !at; i++)
    if (q1[i] != q2[i]) at = i + 1;
  if (out) memcpy(out, q2, pb);
  mr_free_aligned(q1);
  mr_free_aligned(q2);
  free(xf);
  return at;
}

#endif /* KN_ROWS_H */
