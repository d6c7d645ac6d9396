/*
 * kernels/x86/common_x86.h - what the x86 kernel files (moe_avx2.c, moe_avx512.c) share:
 * the layout of the prepared activations, the exp approximation of silu and the table
 * entries, in plain C or macros over intrinsics the including file names (so that each
 * file keeps its own ISA flags).
 *
 * "Prepared activations" are the n token vectors of one step converted once into the form
 * a kernel multiplies: the inputs x of gate/up (kn__kernel.prep, written into the task's
 * xq) and the intermediate h of down (converted by each down call into its own tmp).
 * One buffer holds, each array starting on a 64-byte boundary:
 *
 *   [ token 0: stride bytes | token 1 | ... | token n-1 ]   the converted values, each token
 *                                                         zero-padded to Kp elements
 *   [ xs:   n floats  ]   quantized kinds: the token's scale (amax / 127)
 *   [ xsum: n int32   ]   QI8: sum of the token's quantized values
 *   [ x8:   n x ng16 floats ]   QI4: 8 * (sum of the quantized values of group g), zero
 *                               beyond the ng groups of a row
 *
 * The zero padding matters: the weight loads of a row's last partial block are masked to
 * zero (or, for int8/int4, to the offset value of zero), and the padded activations make
 * those lanes contribute exactly nothing whatever the weight lane holds.
 */
#ifndef KN_X86_COMMON_H
#define KN_X86_COMMON_H

#include "kernels/internal.h"

/* How a kernel wants its activations (see each ISA file for the element order). */
typedef enum kn__x86_act_kind {
  KN__ACT_NONE = 0, /* fp32 read in place (t->x, t->h); no buffer */
  KN__ACT_BF16,     /* bf16, natural order */
  KN__ACT_F32EO,    /* fp32, per block of `block` elements: the even ones, then the odd ones */
  KN__ACT_QI8,      /* int8 per token (amax / 127), natural order; + xs, xsum */
  KN__ACT_QI4,      /* int8 per token, per block of `block` elements: even ones, then odd
                     * ones (the order of the low / high nibbles of int4 weights); + xs, x8 */
  KN__ACT_BF16P,    /* bf16, per block of 64 elements in the order of vpunpck{l,h}bw over
                     * 128-bit lanes: [0-7, 16-23, 32-39, 48-55 | 8-15, 24-31, 40-47, 56-63]
                     * (the fp8 LUT kernel's weight order, moe_avx512.c) */
} kn__x86_act_kind;

typedef struct kn__x86_acts {
  kn__x86_act_kind kind;
  uint32_t K;       /* real elements per token */
  uint32_t Kp;      /* padded elements per token (a multiple of quantum) */
  uint32_t block;   /* F32EO / QI4: elements per even/odd block (divides quantum) */
  uint32_t ng;      /* QI4: groups of G per row of K */
  uint32_t ng16;    /* QI4: ng rounded up to 16 */
  size_t stride;    /* bytes per token row */
  size_t off_xs, off_xsum, off_x8; /* byte offsets of the per-token arrays */
  size_t bytes;     /* the whole buffer */
} kn__x86_acts;

static inline size_t kn__x86_align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* The layout for n tokens of K elements padded to a multiple of `quantum` (a multiple of
 * 16), even/odd blocks of `block` elements (F32EO, QI4), INT4 group G (QI4 only). */
static inline kn__x86_acts kn__x86_acts_layout(kn__x86_act_kind kind, uint32_t K, uint32_t quantum,
                                               uint32_t block, uint32_t G, uint32_t n) {
  kn__x86_acts a = {0};
  a.kind = kind;
  a.K = K;
  a.block = block;
  if (kind == KN__ACT_NONE) return a;
  a.Kp = (K + quantum - 1) / quantum * quantum;
  size_t esz = kind == KN__ACT_BF16 || kind == KN__ACT_BF16P ? 2 : kind == KN__ACT_F32EO ? 4 : 1;
  a.stride = kn__x86_align64((size_t)a.Kp * esz);
  /* Token rows a multiple of 1 KiB apart would share L1 sets (H = 2048 bf16: all on one set
   * every 4 KiB), and the C tokens a tile re-reads for every weight row fight the weights
   * streaming through the same sets: one extra line staggers them. */
  if (a.stride % 1024 == 0) a.stride += 64;
  size_t at = a.stride * n;
  if (kind == KN__ACT_QI8 || kind == KN__ACT_QI4) {
    a.off_xs = at;
    at = kn__x86_align64(at + (size_t)n * sizeof(float));
  }
  if (kind == KN__ACT_QI8) {
    a.off_xsum = at;
    at = kn__x86_align64(at + (size_t)n * sizeof(int32_t));
  }
  if (kind == KN__ACT_QI4) {
    a.ng = kn__ngroups(K, G);
    a.ng16 = (a.ng + 15) / 16 * 16;
    a.off_x8 = at;
    at = kn__x86_align64(at + (size_t)n * a.ng16 * sizeof(float));
  }
  a.bytes = at;
  return a;
}

/* Floats of tmp that hold a buffer of `bytes` bytes (tmp is 64-byte aligned). */
static inline size_t kn__x86_floats_for(size_t bytes) { return (bytes + sizeof(float) - 1) / sizeof(float); }

/* Writes n rows of K fp32 values (row r at src + r * src_stride floats) in the F32EO
 * order of layout a: per block of a->block elements, the even-indexed ones then the
 * odd-indexed ones, zero beyond K. Plain C: it runs once per token and step, next to
 * (rows x K) weight work. */
static inline void kn__x86_f32eo_convert(const kn__x86_acts *a, uint32_t n, const float *src,
                                         size_t src_stride, void *dst) {
  const uint32_t B = a->block, half = a->block / 2;
  for (uint32_t r = 0; r < n; r++) {
    const float *x = src + (size_t)r * src_stride;
    float *o = (float *)((char *)dst + (size_t)r * a->stride);
    for (uint32_t k0 = 0; k0 < a->Kp; k0 += B)
      for (uint32_t p = 0; p < half; p++) {
        uint32_t ke = k0 + 2 * p, ko = ke + 1;
        o[k0 + p] = ke < a->K ? x[ke] : 0.0f;
        o[k0 + half + p] = ko < a->K ? x[ko] : 0.0f;
      }
  }
}

/* exp(x) for silu: one approximation for every x86 kernel (the Cephes expf polynomial).
 * x = n ln2 + r with n = round(x log2(e)) and |r| <= ln2 / 2, ln2 split into a part with
 * few mantissa bits (so that n * LN2_HI is exact) and a correction; exp(r) ~ 1 + r +
 * r^2 P(r) with the degree-5 P below, ~1 ulp. Scaling by 2^n is left to each ISA file
 * (AVX-512: vscalefps; AVX2: n written into the exponent field, which bounds x). */
#define KN__EXP_LOG2E 1.44269504088896341f
#define KN__EXP_LN2_HI 0.693359375f
#define KN__EXP_LN2_LO -2.12194440e-4f
#define KN__EXP_P0 1.9875691500e-4f
#define KN__EXP_P1 1.3981999507e-3f
#define KN__EXP_P2 8.3334519073e-3f
#define KN__EXP_P3 4.1665795894e-2f
#define KN__EXP_P4 1.6666665459e-1f
#define KN__EXP_P5 5.0000001201e-1f
/* Defines `V name(V x, V n)` = exp(x - n ln2) by the polynomial above, for the vector type
 * V with its set1 / fmadd / fnmadd / mul / add intrinsics (so each file keeps its own ISA
 * flags and the numbers stay one definition). */
#define KN__X86_EXP_POLY(name, V, set1, fmadd, fnmadd, mul, add)                              \
  static inline __attribute__((always_inline)) V name(V x, V n) {                           \
    V r = fnmadd(n, set1(KN__EXP_LN2_HI), x);                                                \
    r = fnmadd(n, set1(KN__EXP_LN2_LO), r);                                                  \
    V p = set1(KN__EXP_P0);                                                                  \
    p = fmadd(p, r, set1(KN__EXP_P1));                                                       \
    p = fmadd(p, r, set1(KN__EXP_P2));                                                       \
    p = fmadd(p, r, set1(KN__EXP_P3));                                                       \
    p = fmadd(p, r, set1(KN__EXP_P4));                                                       \
    p = fmadd(p, r, set1(KN__EXP_P5));                                                       \
    return fmadd(p, mul(r, r), add(r, set1(1.0f)));                                          \
  }

/* Table entries. Each ISA file defines, for its variant enum V, the static functions
 * gate_up_run / down_run / tmp_floats_of / prep_bytes_of / prep_of; KN__X86_ENTRY(V, id)
 * wraps them into the kn__kernel signatures for one variant, and KN__X86_KERNEL(id, ...)
 * builds the table entry from those wrappers (rnd: its kn__rounding, the input type at the end of label). */
#define KN__X86_ENTRY(V, id)                                                                     \
  static void gate_up_##id(const kn__task *t, uint32_t i0, uint32_t i1) { gate_up_run(V, t, i0, i1); } \
  static void down_##id(const kn__task *t, uint32_t j0, uint32_t j1) { down_run(V, t, j0, j1); }       \
  static size_t tmp_##id(const kn_layer *L, uint32_t s, uint32_t n) { return tmp_floats_of(V, L, s, n); } \
  static size_t prep_bytes_##id(const kn_layer *L, uint32_t n) { return prep_bytes_of(V, L, n); }      \
  static void prep_##id(const kn_layer *L, uint32_t n, const float *x, void *xq) { prep_of(V, L, n, x, xq); }

#define KN__X86_KERNEL(id, with_prep, label, rnd)                                           \
  (kn__kernel) {                                                                            \
    .gate_up = gate_up_##id, .down = down_##id, .prep = (with_prep) ? prep_##id : NULL,     \
    .prep_bytes = (with_prep) ? prep_bytes_##id : NULL, .tmp_floats = tmp_##id, .name = label, \
    .rounding = rnd                                                                         \
  }

#endif /* KN_X86_COMMON_H */
