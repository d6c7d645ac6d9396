/*
 * kernels/internal.h - internals shared by the files of kernels/ (and its unit tests).
 *
 * Nothing here is part of the public contract (kn.h); other folders must not include it.
 * Names shared between files of this folder use the double-underscore prefix kn__.
 *
 * Four things live here:
 *   1. the packed weight layout of every format (the "canonical layout"), which the
 *      loader writes, kn_ref reads and every fast path reads (section A);
 *   2. struct kn_layer, which holds the packed slices of the experts (section B);
 *   3. the kernel table: one entry per (format, ISA) holding the functions that compute
 *      one expert slice, so that a fast path only has to fill an entry to be used
 *      (section C);
 *   4. struct kn_engine with the host topology, the worker plan, the worker pool and the
 *      NUMA placement of slices (section D, pool.c).
 */
#ifndef KN_INTERNAL_H
#define KN_INTERNAL_H

#include "kernels/kn.h"

#include <math.h>
#include <string.h>

/* Limits of a kn_layer_desc (kn.h), checked by kn_layer_new. */
#define KN_MAX_DIM 65536u     /* hidden and inter */
#define KN_MAX_EXPERTS 65536u /* num_experts */
/* Most weight slices per expert (NUMA nodes an engine may use, or force_split). */
#define KN_MAX_NODES 64u
/* Most slots per token kn_moe_forward accepts (every real model uses <= 16). */
#define KN_MAX_TOP_K 1024u
/* Slices start at multiples of this many intermediate rows (see kn__split_inter), so that
 * SIMD kernels see whole 32-row blocks in every slice but the last. */
#define KN_SLICE_ALIGN 32u
/* Alignment of every packed weight and scale array (a cache line; also what AVX-512 and
 * AMX tile loads like best). */
#define KN_PACK_ALIGN 64u

/* ---------------------------------------------------------------------------------------
 * A. Packed layouts (the canonical layout).
 *
 * Each expert is split along the intermediate dimension I into n_slices slices; slice s
 * owns the intermediate rows [off_s, off_s + I_s). One slice of one expert holds three
 * matrices, each "row-major over output rows, K contiguous":
 *
 *            K = H                               K = I_s
 *          <------->                           <------->
 *   gate  [ row 0   ]  I_s rows        down   [ row 0   ]  H rows (output dim)
 *         [ row 1   ]  = gate rows            [ row 1   ]  = down[:, off_s : off_s+I_s]
 *         [  ...    ]  off_s..off_s+I_s-1     [  ...    ]
 *   up    same shape as gate
 *
 * so that gate/up rows of slice s are gate[off_s + i, :] of the HF checkpoint and the
 * down rows of slice s are the I_s-wide column band of the HF down matrix. The three
 * matrices and their scales sit in one KN_PACK_ALIGN-aligned block per (expert, slice)
 * (kn__slice_w.mem), each array starting on a KN_PACK_ALIGN boundary:
 *
 *   mem: [ gate | pad | up | pad | down | pad | gate_scale | pad | up_scale | pad | down_scale ]
 *
 * How one row of K elements is stored, per format:
 *
 *   F32, F16, BF16  K elements as given (after conversion from the source dtype with
 *                   round-to-nearest-even), row stride K * 4 or K * 2 bytes. No scales.
 *
 *   INT8            K int8 values q, row stride K bytes, plus one fp32 scale per row:
 *                     scale = amax(row) / 127,   q = round(w / scale) in -127..127,
 *                     w ~ q * scale.            (amax = 0 -> scale 0, q = 0)
 *                   (round = nearest, ties to even.) Per-element error <= scale / 2 =
 *                   amax / 254. -128 is never produced: the value set is symmetric, so
 *                   there is no zero point and negating a row cannot overflow.
 *                   The scale of a down row is that of the full HF row (amax over all
 *                   I columns), stored with each slice's band of that row, so that the
 *                   packed values do not depend on the slice count.
 *
 *   INT4            group-wise along K with group G in {32, 64, 128}. A row has
 *                   ng = ceil(K / G) groups and is stored in ng * G / 2 bytes: two signed
 *                   4-bit values per byte, element 2j in the LOW nibble and element 2j+1
 *                   in the HIGH nibble, two's complement (nibble 0xF = -1):
 *
 *                     byte b of group g:  [ hi: q[g*G + 2b + 1] | lo: q[g*G + 2b] ]
 *
 *                   One fp32 scale per (row, group), row-major: scale[row * ng + g].
 *                     scale = amax(group) / 7,  q = round(w / scale) in -7..7  (symmetric;
 *                     -8 is never produced), w ~ q * scale; error <= scale / 2.
 *                   Slices are cut at multiples of G, so the groups of a down row are the
 *                   same HF column ranges whatever the slice count.
 *                   A short last group (K % G != 0) is padded with q = 0 nibbles, so that
 *                   every group starts at byte g * G / 2 of its row; readers must stop at
 *                   K (the padding decodes to 0, so a SIMD reader may also read it whole
 *                   as long as it multiplies it by zeros or masks x).
 *
 *   FP8             "fp8-b128": K e4m3fn codes (kn.h), row stride K bytes, plus one fp32
 *                   scale per (row, 128-column block), row-major: scale[row * ceil(K/128) + g]
 *                   is the checkpoint's scale_inv[hf_row / 128, hf_col / 128] of that block
 *                   (the 128x128 block scale repeated on each of its rows: 4 bytes per 128
 *                   weights, +3% over the codes, and a row decodes without knowing its row
 *                   block). w = e4m3(q) * scale in fp32, exactly as the checkpoint defines.
 *                   Slices are cut at multiples of 128, so blocks never straddle a slice.
 *                   No NaN codes (0x7f, 0xff) are stored: the loader refuses them.
 *
 * Later phases may add other layouts; they then add a layout tag here and a row decoder
 * for it in kn__row_to_f32, so that kn_ref keeps reading every layer. (The AMX kernels,
 * kernels/x86/moe_amx.c, read this layout as their A operand and need none.)
 */

/* The packed weights of one slice of one expert (all pointers inside mem). */
typedef struct kn__slice_w {
  void *mem;          /* the one allocation holding everything below: mr_malloc_aligned,
                       * or kn__mem_map_on_node when map_bytes > 0 */
  size_t mem_bytes;   /* its size, including alignment padding */
  size_t map_bytes;   /* > 0: mem is a mapping of this many bytes on the slice's node */
  bool borrowed;      /* mem belongs to someone else (kn_layer_adopt_expert: a mapped
                       * cache file; kn_layer_borrow_expert: the model file itself, mem
                       * NULL, gate / up / down pointing into it); never freed here */
  bool in_place;      /* gate / up / down point into the caller's arrays (a model file's
                       * mapping: kn_layer_borrow_expert, _fp8), not into mem, which then
                       * holds at most the scales (FP8: mem is ours, the codes are not);
                       * such a slice has no packed block to copy out */
  void *gate;         /* [I_s rows][H], format layout above */
  void *up;           /* [I_s rows][H] */
  void *down;         /* [H rows][I_s] */
  float *gate_scale;  /* INT8: [I_s]; INT4 / FP8: [I_s * ng(H)]; NULL for float formats */
  float *up_scale;    /* same shape as gate_scale */
  float *down_scale;  /* INT8: [H]; INT4 / FP8: [H * ng(I_s)]; NULL for float formats */
} kn__slice_w;

/* Which matrix of a slice. */
typedef enum kn__proj { KN__GATE = 0, KN__UP = 1, KN__DOWN = 2 } kn__proj;

/* ---------------------------------------------------------------------------------------
 * B. The layer.
 */
struct kn_layer {
  kn_layer_desc d;
  uint32_t n_slices;                /* = kn_engine_nodes of the creating engine */
  uint32_t slice_off[KN_MAX_NODES]; /* first intermediate row of slice s */
  uint32_t slice_len[KN_MAX_NODES]; /* I_s: rows of slice s (may be 0 when I < n_slices) */
  uint32_t max_slice_len;           /* max over s of slice_len[s] */
  uint32_t node[KN_MAX_NODES];      /* NUMA node (OS number) slice s lives on */
  kn_engine *eng;                   /* the creating engine: loading packs on its workers */
  bool numa_place;                  /* slices are mapped on their node (eng->numa_place) */
  uint32_t misplaced;               /* slices found off their node after loading (WARNed) */
  kn__slice_w **w;                  /* [E]: NULL, or [n_slices] slices of a loaded expert */
  uint64_t *owned;                  /* bitmap of E bits: expert loaded */
  uint64_t *lent;                   /* bitmap of E bits: its slices now belong to a layer
                                     * kn_layer_rebuild made; read here, freed there */
  uint32_t n_owned;                 /* experts loaded */
  uint64_t bytes;                   /* packed bytes held (sum of mem_bytes) */
  uint64_t expert_bytes;            /* packed bytes of one expert (all slices) */
};

static inline bool kn__layer_owns(const kn_layer *L, uint32_t e) {
  return e < L->d.num_experts && ((L->owned[e >> 6] >> (e & 63)) & 1u);
}

/* Number of groups in a row of K elements for INT4 group G. */
static inline uint32_t kn__ngroups(uint32_t K, uint32_t G) { return (K + G - 1) / G; }

/* Bytes of one packed row of K elements in format f (group G for INT4). */
size_t kn__row_bytes(kn_format f, uint32_t K, uint32_t G);
/* fp32 scales of one packed row of K elements: INT8 1, INT4 ceil(K / G), else 0. */
size_t kn__row_scales(kn_format f, uint32_t K, uint32_t G);

/* Splits I rows into n slices as evenly as possible in whole units of `unit` rows
 * (KN_SLICE_ALIGN, or the INT4 group when larger): every slice starts at a multiple of
 * unit and only the last one may end short of one. Writes off[n], len[n]. Slices may be
 * empty when I has fewer units than n. */
void kn__split_inter(uint32_t I, uint32_t n, uint32_t unit, uint32_t *off, uint32_t *len);

/* Decodes row `row` of matrix p of slice s (packed as described in section A) into K fp32
 * values at dst (K = H for gate/up, I_s for down). This is the one decoder of the canonical
 * layout; the reference path and the tests use it. */
void kn__row_to_f32(const kn_layer *L, uint32_t slice, const kn__slice_w *w, kn__proj p,
                    uint32_t row, float *dst);

/* The 256 e4m3fn code values (kn_fp8_e4m3_to_f32), built once, thread-safe. */
const float *kn__fp8_table(void);

/* Largest |src[i]| of n values. */
float kn__amax(const float *src, uint32_t n);
/* Quantizes n fp32 values with the INT8 rule of section A and the given scale (amax / 127
 * of the row they belong to). */
void kn__quant_row_int8(const float *src, uint32_t n, float scale, int8_t *dst);
/* Quantizes a row of K fp32 values with the INT4 rule of section A (group G): writes
 * ng * G / 2 bytes at dst and ng scales at scale. */
void kn__quant_row_int4(const float *src, uint32_t K, uint32_t G, uint8_t *dst, float *scale);
/* Stores one fp32 row of K (finite) elements in format f at dst, its scales at scale
 * (kn__row_scales of them; unused for float formats). For INT8, int8_scale is the row's
 * scale (amax of the full HF row / 127); INT4 computes its group scales itself. The one
 * packer of section A: the expert loader and the dense-layer loader (linear.c) use it. */
void kn__pack_row(kn_format f, uint32_t G, const float *src, uint32_t K, float int8_scale,
                  void *dst, float *scale);
/* The same from K values of dt (F32, F16, BF16) as stored: INT8 (the row's own scale,
 * amax / 127 of these K) and INT4 quantize straight from src; the other formats go through
 * buf (K floats). Returns the index of the first value that is not finite (nothing
 * usable written then), or K. The loaders' packer for rows that are not copied. */
uint32_t kn__pack_row_src(kn_format f, uint32_t G, const void *src, mr_dtype dt, uint32_t K,
                          float *buf, void *dst, float *scale);

/* The scalar rules of the packers, shared by kn.c's scalar set (the definition) and the
 * tails of x86/pack_*.c. Packing runs over every byte of a model, so these avoid libm calls
 * (fmaxf / nearbyintf are not inlined at -O2 without SSE4.1): the weights are finite
 * (checked at load), so plain comparisons give fmaxf's result. */
static inline float kn__max_f(float a, float b) { return a > b ? a : b; }
static inline float kn__min_f(float a, float b) { return a < b ? a : b; }
/* Round to nearest, ties to even, for |x| < 2^22 in the default rounding mode: adding and
 * subtracting 1.5 * 2^23 drops the fraction bits with the FPU's own rounding (the same
 * result as nearbyintf). The quotients rounded here are within +-128. */
static inline float kn__round_even(float x) {
  volatile float m = 12582912.0f; /* volatile: the compiler must not fold (x + m) - m */
  float mm = m;
  return (x + mm) - mm;
}
/* Element k of values of dt (F32, F16, BF16) at src, as fp32. */
static inline float kn__src_f32(const void *src, mr_dtype dt, uint32_t k) {
  switch (dt) {
    case MR_DTYPE_BF16: return mr_bf16_to_f32(((const uint16_t *)src)[k]);
    case MR_DTYPE_F16: return mr_f16_to_f32(((const uint16_t *)src)[k]);
    default: return ((const float *)src)[k];
  }
}
/* The exponent field of dt's bits: a value's bits with the sign cleared are at or above it
 * exactly when it is a NaN or an inf; below it, finite values order as their bits do. */
static inline uint32_t kn__expo_bits(mr_dtype dt) {
  return dt == MR_DTYPE_F32 ? 0x7f800000u : dt == MR_DTYPE_BF16 ? 0x7f80u : 0x7c00u;
}
/* The value of such bits (a finite magnitude) of dt. */
static inline float kn__bits_f32(uint32_t b, mr_dtype dt) {
  if (dt == MR_DTYPE_BF16) return mr_bf16_to_f32((uint16_t)b);
  if (dt == MR_DTYPE_F16) return mr_f16_to_f32((uint16_t)b);
  float f;
  memcpy(&f, &b, 4);
  return f;
}
/* The index of the first of n values of dt at src that is not finite, or n. */
uint32_t kn__first_bad(const void *src, mr_dtype dt, uint32_t n);

/* The loader's row converters, behind kn__pack_row and the loaders' copies: the scalar
 * set in kn.c is the definition; x86/pack_avx2.c has an AVX2 set that gives the same bits
 * for every input (tests/unit/test_kn_pack.c). kn__pack() picks once per process: AVX2
 * where the CPU and the OS have it (cpuid and XCR0, as KN_ISA_AVX2), unless the
 * environment says MOERPC_PACK=scalar (for A/B benchmarks, tests/bench/load_speed.sh); with
 * the AVX-512 quantizers (kn__pack_avx512) where the CPU has AVX-512, unless
 * MOERPC_PACK=avx2. */
typedef struct kn__pack_fns {
  /* n values of dt (F32, F16, BF16) at src to fp32 at dst, all n of them; returns the index
   * of the first value that is not finite, or n. */
  uint32_t (*to_f32)(float *dst, const void *src, mr_dtype dt, uint32_t n);
  /* Copies n values of dt from src to dst as they are; returns as to_f32. */
  uint32_t (*copy)(void *dst, const void *src, mr_dtype dt, uint32_t n);
  /* Reads n values of dt at src (F32, F16, BF16) without writing anything; returns as
   * to_f32 (the finite check of weights served in place: kn_layer_borrow_expert). */
  uint32_t (*check)(const void *src, mr_dtype dt, uint32_t n);
  /* Copies n e4m3fn codes; returns the index of the first NaN code (0x7f, 0xff), or n. */
  uint32_t (*copy_fp8)(uint8_t *dst, const uint8_t *src, uint32_t n);
  /* The same without writing (FP8 codes served in place: kn_layer_borrow_expert_fp8). */
  uint32_t (*check_fp8)(const uint8_t *src, uint32_t n);
  /* n e4m3fn codes times one block scale into fp32: dst[k] = e4m3(q[k]) * scale, the exact
   * product rounded once (kn_fp8_dequant_b128, the loader's FP8 -> other formats); returns
   * the index of the first NaN code, or n (dst is written for all n either way). Callers
   * that need every weight finite add kn__fp8_first_inf. */
  uint32_t (*dequant_fp8)(float *dst, const uint8_t *q, uint32_t n, float scale);
  /* The quantizers read the source as it is stored (dt F32, F16 or BF16: no fp32 copy of
   * the row in between). amax: the largest |value| of n values, *bad the index of the
   * first that is not finite (the amax of those before it is returned then), or n. */
  float (*amax)(const void *src, mr_dtype dt, uint32_t n, uint32_t *bad);
  /* n finite values, INT8 with the given scale (section A). */
  void (*quant_int8)(const void *src, mr_dtype dt, uint32_t n, float scale, int8_t *dst);
  /* A row of K values, INT4 in groups of G (section A): ng * G / 2 bytes at dst, ng scales;
   * returns the index of the first value that is not finite (dst, scale partly written
   * then), or K. */
  uint32_t (*quant_int4)(const void *src, mr_dtype dt, uint32_t K, uint32_t G, uint8_t *dst,
                         float *scale);
  /* n finite fp32 values to dt (F16 or BF16), rounded to nearest even. */
  void (*from_f32)(void *dst, mr_dtype dt, const float *src, uint32_t n);
  const char *name; /* "scalar", "avx2", "avx512" */
} kn__pack_fns;
/* After dequant_fp8: bad (its result) lowered to the first of dst[0..bad) that overflowed
 * to inf, which only a scale above FLT_MAX / 448 can make. */
static inline uint32_t kn__fp8_first_inf(const float *dst, uint32_t bad, float scale) {
  if (scale * KN_FP8_MAX < INFINITY) return bad;
  for (uint32_t i = 0; i < bad; i++)
    if (isinf(dst[i])) return i;
  return bad;
}
extern const kn__pack_fns kn__pack_scalar;
extern const kn__pack_fns kn__pack_avx2; /* only in builds with MR_HAVE_AVX2 (x86) */
/* The AVX2 set with the quantizers of x86/pack_avx512.c (amax, quant_int8, quant_int4),
 * where the build and the CPU have AVX-512 (KN_ISA_AVX512 and AVX2); else NULL. kn__pack()
 * picks it first. */
const kn__pack_fns *kn__pack_avx512(void);
float kn__amax_avx512(const void *src, mr_dtype dt, uint32_t n, uint32_t *bad);
void kn__quant_int8_avx512(const void *src, mr_dtype dt, uint32_t n, float scale, int8_t *dst);
uint32_t kn__quant_int4_avx512(const void *src, mr_dtype dt, uint32_t K, uint32_t G, uint8_t *dst,
                               float *scale);
const kn__pack_fns *kn__pack(void);
/* The mr_dtype whose values format f stores as they are (F32, F16, BF16), else
 * MR_DTYPE_UNSPECIFIED: a source of that dtype is copied, not converted. */
mr_dtype kn__format_dtype(kn_format f);

/* ---------------------------------------------------------------------------------------
 * C. The engine and its kernel table.
 *
 * kn_moe_forward groups the (token, slot) pairs by expert and then, for each used expert
 * and each slice s, runs two steps over the n tokens routed to that expert:
 *
 *   gate_up:  h[r, i] = silu(gate_s[i, :] . x[r, :]) * (up_s[i, :] . x[r, :])   i < I_s
 *   down:     y[r, j] = down_s[j, :] . h[r, :]                                  j < H
 *
 * Each step takes a half-open range of its output rows, so that the worker pool can cut
 * it into row blocks: kn_moe_forward hands out (expert, gate_up row block) items of all
 * used experts, then, after a barrier, (expert, down row block) items, to the workers of
 * the slice's node (section D). Finally the slices' y are summed in fp32 and weighted
 * into out.
 *
 * Thread contract for kernels: gate_up, down and prep are called concurrently from
 * several workers, on different tasks or different row ranges of one task; each call
 * gets its own tmp (one per worker). They must write only their own rows of h / y (or
 * xq) and tmp, and keep no state between calls.
 *
 * A fast path for (format f, ISA i) fills table[f][i] in its registration function; the
 * engine picks for each format the best filled entry at or below its ISA (the REF entries
 * are always filled, by kn__ref_register).
 */
typedef struct kn__task {
  const kn_layer *L;
  uint32_t slice;         /* s (also the group of the workers that compute it) */
  const kn__slice_w *w;   /* packed weights of (expert, s) */
  uint32_t n;             /* tokens routed to the expert in this call */
  const float *x;         /* [n, H] fp32 inputs, row r = token tok[r] of the request; NULL
                           * where the kernel's prep_rows prepared xq from the caller's rows */
  const void *xq;         /* prepared inputs from kn__kernel.prep (NULL when it has none) */
  float *h;               /* [n, I_s] fp32 intermediate, written by gate_up */
  float *y;               /* [n, H] fp32 slice output, written by down */
  float *tmp;             /* kernel scratch: kn__kernel.tmp_floats(L, s, n) floats */
} kn__task;

/* An expert's input rows where the caller keeps them (kn_moe_args.x): row r of the n is
 * token tok[r], at base + tok[r] * stride bytes, of dtype dt (f32, f16 or bf16). */
typedef struct kn__rows {
  const char *base;
  size_t stride;
  const uint32_t *tok; /* NULL: row r is token r */
  mr_dtype dt;
} kn__rows;

/* What a kernel multiplies the weights with: its activation rounding. This, not the
 * kernel's name, decides how far it may be from the REF kernels on the same stored
 * weights (kn__rounding_tol): the self-test (section F) and the unit tests use it. */
typedef enum kn__rounding {
  KN__RND_F32 = 0, /* fp32 x and h: only the summation order differs */
  KN__RND_BF16,    /* x and h rounded to bf16 (vdpbf16ps, AMX-BF16, fp8 via bf16) */
  KN__RND_Q8,      /* x and h quantized per token to int8, amax / 127 (VNNI, AMX-INT8) */
} kn__rounding;

/* Rel L2 tolerance of a kernel against the REF kernels on the same stored weights, by
 * its activation rounding:
 *   F32  1e-5  fp32 math on fp32 activations (8/16 partial sums and a tree instead of
 *              one running sum);
 *   BF16 1e-2  x and h rounded to bf16: relative error <= 2^-9 per element, ~1.5e-3 per
 *              matrix product, three products chained;
 *   Q8   3e-2  x and h quantized per token to int8: ~1% of rms per product for Gaussian
 *              activations. */
#define KN__TOL_F32 1e-5
#define KN__TOL_BF16 1e-2
#define KN__TOL_Q8 3e-2
static inline double kn__rounding_tol(kn__rounding r) {
  return r == KN__RND_Q8 ? KN__TOL_Q8 : r == KN__RND_BF16 ? KN__TOL_BF16 : KN__TOL_F32;
}

typedef struct kn__kernel {
  /* Writes h[r, i] for i in [i0, i1), all r < t->n. */
  void (*gate_up)(const kn__task *t, uint32_t i0, uint32_t i1);
  /* Writes y[r, j] for j in [j0, j1), all r < t->n; reads all of h. */
  void (*down)(const kn__task *t, uint32_t j0, uint32_t j1);
  /* Optional (NULL: none): converts the n fp32 input rows once per (expert, slice) into
   * the form the kernel multiplies (e.g. bf16 for AMX, int8 per row for VNNI), writing
   * prep_bytes(L, n) bytes at xq. */
  void (*prep)(const kn_layer *L, uint32_t n, const float *x, void *xq);
  size_t (*prep_bytes)(const kn_layer *L, uint32_t n);
  /* Optional (NULL: none; used only beside prep): prep reading the caller's rows in place,
   * in their own dtype, for the n where takes_rows(L, n) is true. It writes the bytes prep
   * would write from those rows converted to fp32, and the task then has no fp32 rows (x
   * NULL): kn_moe_forward skips the gathered fp32 copy of the inputs, which at thousands
   * of tokens cost more than the packing itself. */
  bool (*takes_rows)(const kn_layer *L, uint32_t n);
  void (*prep_rows)(const kn_layer *L, uint32_t n, const kn__rows *x, void *xq);
  /* fp32 scratch floats one task needs in tmp (for decoded rows and the like). */
  size_t (*tmp_floats)(const kn_layer *L, uint32_t slice, uint32_t n);
  const char *name; /* e.g. "ref_bf16_f32": weight type then input type (STYLE.md 2) */
  kn__rounding rounding; /* of the activations (the input type of the name) */
  /* Optional (NULL: none), for the start-up self-test: a check the kernel's object can
   * make of itself while on (the AMX tile configuration read back); audit_take returns
   * the number of mismatches since the last take, describes the first in why. */
  void (*audit_on)(bool on);
  uint64_t (*audit_take)(char *why, size_t n);
} kn__kernel;

typedef struct kn__kernel_table {
  kn__kernel k[KN_FMT_COUNT][KN_ISA_COUNT]; /* gate_up == NULL: no kernel registered */
} kn__kernel_table;

/* CPU features behind kn_isa_detect (cpuid + XCR0 + the AMX permission), for fast paths
 * that need more than their ISA level (e.g. AVX-512 BF16 or VNNI). */
typedef struct kn__cpu {
  bool avx2, fma, f16c;                 /* all three make KN_ISA_AVX2 */
  bool avx512f, avx512bw, avx512vl, avx512dq; /* all four make KN_ISA_AVX512 */
  bool avx512_bf16, avx512_vnni;        /* extras, used when present */
  bool avx512_vbmi;                     /* vpermi2b: the fp8 LUT kernel */
  bool amx_tile, amx_bf16, amx_int8;    /* cpuid bits */
  bool os_avx, os_avx512, os_amx;       /* XCR0 enables the register state */
  bool amx_perm;                        /* arch_prctl(ARCH_REQ_XCOMP_PERM) succeeded */
  kn_isa best;
  bool intel;                           /* vendor GenuineIntel (per-vendor tuning) */
  char model[49];                       /* cpuid brand string, trimmed ("unknown CPU") */
} kn__cpu;
/* Detects once (thread-safe) and returns the process-wide result. */
const kn__cpu *kn__cpu_get(void);

/* ---------------------------------------------------------------------------------------
 * D. The engine: topology, worker plan, worker pool and NUMA placement (pool.c).
 *
 * How an engine maps onto the host:
 *
 *   host (hwloc) ---------> kn__topo   NUMA nodes that have allowed cores; the cores of
 *                                      each node; the PUs (hardware threads) of each core
 *   --numa, --threads,  --> kn__plan   groups and workers: group g computes slice g of every
 *   force_split                        expert; each worker belongs to one group and has a
 *                                      core (or its node) to be pinned to
 *                           kn__pool   the threads: worker 0 is whoever calls kn__pool_run
 *                                      (never pinned by us); workers 1..n-1 are pool
 *                                      threads, each pinned to its core at start
 *
 *   workers: [ group 0: caller w1 w2 | group 1: w3 w4 w5 | ... ]   (contiguous per group)
 *   group g <-> slice g of every expert <-> NUMA node plan.group_node[g]
 *
 * Without force_split there is one group per NUMA node used, each with at least one
 * worker, and a worker only ever works on its own group's slices (the weights it reads
 * are local). With force_split = N the N groups are all on the first node used (tests of
 * the multi-node code on a one-node host); workers are dealt out over them and, since no
 * memory is remote, may help the other groups once their own is done ("stealing"), so
 * that a group left with no worker (threads < N) still gets its work done.
 *
 * Threads (STYLE.md 8):
 *   - kn__pool_run may be called from any thread; its callers are serialised by the
 *     pool's run_lock (so a load and a forward on one engine from two threads queue up).
 *     It runs fn on every worker at once (the caller as worker 0) and returns when all of
 *     them have returned. The caller's writes before kn__pool_run happen-before every
 *     worker's fn (the dispatch counter is released by the caller and acquired by the
 *     workers), and every worker's writes in fn happen-before kn__pool_run returns (the
 *     completion counter), so fn's arg needs no other synchronisation.
 *   - kn__pool_barrier: every worker of the run must call it the same number of times;
 *     all writes before it, by any worker, are visible to all workers after it.
 *   - kn__work_claim is lock-free (one atomic counter per group): each item is handed to
 *     exactly one worker. What an item writes must be disjoint from what other items of
 *     the same phase write; phases are separated by kn__pool_barrier.
 *   - Waiting (for work, at a barrier, for the end of a run) spins for the pool's spin
 *     time (KN_POOL_SPIN_US, env MOERPC_SPIN_US) and then sleeps on a futex, so that an
 *     idle engine costs no CPU: the server's gRPC threads share the host.
 */

/* Most workers an engine may have (kn_engine_opts.threads). */
#define KN_MAX_THREADS 4096u
/* Default spin before a waiting worker sleeps, microseconds. Long enough to cover the gap
 * between the phases of one forward and between back-to-back requests, short enough that
 * an idle server is idle. */
#define KN_POOL_SPIN_US 50u
/* Most MOERPC_SPIN_US accepts (100 ms). */
#define KN_POOL_SPIN_MAX_US 100000u

/* What the host offers. Filled by kn__topo_read (from an hwloc topology) or kn__topo_host;
 * closed with kn__topo_close. Nodes are in ascending OS number; the cores of node n are
 * core indices node_core0[n] .. node_core0[n + 1] - 1; the PUs of core c are
 * pu[core_pu0[c]] .. pu[core_pu0[c + 1] - 1] (OS numbers, as in /proc/cpuinfo), so the PUs
 * of a node are contiguous in pu[] too. */
typedef struct kn__topo {
  uint32_t n_nodes;                      /* NUMA nodes with at least one allowed core */
  uint32_t node_os[KN_MAX_NODES];        /* their OS numbers (numactl's), ascending */
  uint32_t node_core0[KN_MAX_NODES + 1]; /* first core index of each node, + end */
  uint32_t n_cores;
  uint32_t *core_pu0;                    /* [n_cores + 1], owned */
  uint32_t *pu;                          /* [n_pus], owned */
  uint32_t n_pus;
  uint32_t n_memonly;                    /* nodes without an allowed core (CXL, HBM, cgroup) */
  uint32_t memonly_os[KN_MAX_NODES];     /* their OS numbers (the first KN_MAX_NODES) */
  uint32_t n_dropped;                    /* nodes with cores beyond KN_MAX_NODES, ignored */
  bool from_hwloc;                       /* false: the sched_getaffinity fallback (1 node) */
  void *hw;                              /* the host's hwloc_topology_t, owned, or NULL */
} kn__topo;

#if MR_HAVE_HWLOC
#include <hwloc.h>
/* Reads nodes, cores and PUs from a loaded hwloc topology (the host's or a synthetic one),
 * keeping only the PUs in allowed (NULL: all). A PU belongs to the first node (by OS
 * number) whose cpuset holds it; PUs with no Core ancestor are their own core. Does not
 * take ownership of topo (t->hw stays NULL). MR_ENOMEM only. */
int kn__topo_read(kn__topo *t, hwloc_topology_t topo, hwloc_const_cpuset_t allowed, mr_err *e);
#endif
/* Reads the host: hwloc restricted to the PUs this process may run on (its affinity and
 * cgroup), or, without hwloc or when it fails to load, one node holding the PUs of
 * sched_getaffinity, each its own core. Keeps the hwloc topology in t->hw for binding. */
int kn__topo_host(kn__topo *t, mr_err *e);
void kn__topo_close(kn__topo *t); /* frees what t owns; a zeroed t is fine */

#define KN__CORE_NODE UINT32_MAX /* kn__worker_spec.core: any core of its node */
typedef struct kn__worker_spec {
  uint32_t group; /* the group (slice) it works for */
  uint32_t node;  /* index into kn__topo of the node it runs on */
  uint32_t core;  /* index into kn__topo of its core, or KN__CORE_NODE when the node has
                   * fewer cores than workers (then pinned to the whole node) */
} kn__worker_spec;

typedef struct kn__plan {
  uint32_t n_groups;                   /* weight slices per expert (engine nodes) */
  uint32_t group_node[KN_MAX_NODES];   /* OS NUMA node of group g */
  uint32_t group_first[KN_MAX_NODES + 1]; /* workers of group g: group_first[g] .. [g+1]-1 */
  uint32_t n_workers;                  /* the caller + pool threads */
  kn__worker_spec *w;                  /* [n_workers], owned; w[0] is the caller */
  uint32_t n_real_nodes;               /* distinct NUMA nodes used */
  bool forced;                         /* groups come from force_split */
  bool steal;                          /* workers may take other groups' items (forced) */
} kn__plan;

/* Decides groups and workers from the host t and the options (pure: no system calls, so
 * that synthetic topologies test it).
 *   numa:    NULL, "" or "auto" = every node of t; "N" = the first N nodes; "a,b,..." = those
 *            nodes in that order (write "3," for node 3 alone: "3" is a count).
 *   threads: workers in total, the caller included; 0 = one per core of the nodes used.
 *            Without force_split each node used needs at least one.
 *   force_split: > 0: that many groups, all on the first node selected by numa.
 * Workers are dealt out to groups as evenly as possible (the first groups get the extra
 * ones); on each node worker i takes core i when the node has enough cores, else the
 * workers of that node float over all of its cores. Errors name the option and the limit:
 * MR_EINVAL for a malformed or out-of-range value, MR_ENOTSUP for a node this host or
 * build cannot serve (a memory-only node; more than one node without hwloc). */
int kn__plan_make(kn__plan *p, const kn__topo *t, const char *numa, uint32_t threads,
                  uint32_t force_split, mr_err *e);
void kn__plan_close(kn__plan *p); /* a zeroed p is fine */
/* Pins the calling thread to the PUs of worker 0's core in t (its node's PUs when the
 * node has fewer cores than workers), the core the plan keeps free of pool threads.
 * Returns 0 or an errno (EPERM, EINVAL, ...). For kn_engine_pin_caller. */
int kn__pin_caller(const kn__plan *plan, const kn__topo *t);

typedef struct kn__pool kn__pool;
typedef struct kn__pool_ctx {
  kn__pool *pool;
  uint32_t worker; /* 0 = the caller of kn__pool_run, 1..n-1 = pool threads */
  uint32_t group;  /* plan.w[worker].group */
} kn__pool_ctx;
typedef void (*kn__pool_fn)(void *arg, const kn__pool_ctx *c);

/* Starts plan->n_workers - 1 threads, each pinned (hwloc, THREAD | STRICT) to the PUs of its
 * core, or of its node, in t; returns once all have tried. A failed pin is a WARN, not an
 * error: containers often forbid it, and the pool works unpinned. t and plan are only read
 * during the call. spin_us: how long a waiting worker spins before it sleeps. The caller
 * frees the pool with kn__pool_free. MR_EEXHAUSTED when a thread cannot be started. */
int kn__pool_new(kn__pool **out, const kn__plan *plan, const kn__topo *t, uint32_t spin_us,
                 mr_err *e);
void kn__pool_free(kn__pool *p); /* NULL is a no-op; stops and joins the threads */
/* Runs fn(arg, ctx) on every worker (see "Threads" above); returns when all are done. */
void kn__pool_run(kn__pool *p, kn__pool_fn fn, void *arg);
/* Waits until every worker of the current run has reached it (no-op for one worker). */
void kn__pool_barrier(const kn__pool_ctx *c);
uint32_t kn__pool_size(const kn__pool *p);

typedef struct kn__pool_stats {
  uint64_t runs;     /* kn__pool_run calls */
  uint64_t sleeps;   /* times a waiting worker went to sleep on a futex */
  uint32_t sleeping; /* pool threads asleep waiting for work right now */
  uint32_t pinned;   /* pool threads whose pinning succeeded */
} kn__pool_stats;
/* Any thread, but not from inside a run (it takes the run lock). */
void kn__pool_get_stats(const kn__pool *p, kn__pool_stats *s);

/* A phase's work list: items 0 .. count[g] - 1 of each group g, handed out one at a time by
 * an atomic counter per group (dynamic claiming, as kt-kernel does). A worker claims from
 * its own group; when that is empty and the plan allows stealing, from the next groups in
 * turn. n_groups = 1 makes one list every worker claims from. Set up by the caller with
 * kn__work_init before kn__pool_run; lives (e.g. on the caller's stack) for the run. */
typedef struct kn__work {
  uint32_t n_groups;
  uint32_t count[KN_MAX_NODES];
  struct {
    _Alignas(64) uint32_t next; /* next item to hand out; own cache line: claimed concurrently */
  } ctr[KN_MAX_NODES];
} kn__work;
/* counts[g] items for each of n_groups groups (1..KN_MAX_NODES). */
void kn__work_init(kn__work *w, uint32_t n_groups, const uint32_t *counts);
/* Hands the calling worker its next item: true with *group, *item set; false when there is
 * nothing left that it may take. */
bool kn__work_claim(kn__work *w, const kn__pool_ctx *c, uint32_t *group, uint32_t *item);

/* NUMA placement of weight slices (used when the engine spans several real nodes and
 * libnuma works), and huge pages for large ones on any host. Maps bytes (rounded up to
 * pages) of anonymous memory with the policy "preferably on node" (mbind MPOL_PREFERRED: a
 * full node spills over instead of failing; none for node KN__NO_NODE) and returns it,
 * untouched, with the mapped length in *mapped; NULL when mmap fails. The pages land on
 * the node at first touch, which the loader does from workers pinned there, so placement
 * holds even where mbind is forbidden (a WARN says so once). From KN__HUGE_BYTES up the
 * mapping starts on a 2 MiB boundary and asks for transparent huge pages (MADV_HUGEPAGE):
 * a 2 MiB fault instead of 512, which was most of a bf16 load's time (docs/DESIGN.md
 * section 6.6). Free with kn__mem_unmap. */
#define KN__NO_NODE UINT32_MAX
#define KN__HUGE_BYTES ((size_t)2 << 20)
void *kn__mem_map_on_node(size_t bytes, uint32_t node, size_t *mapped);
void kn__mem_unmap(void *p, size_t mapped);
/* The NUMA node of the (touched) page holding p; -1 when unknown (no libnuma, untouched). */
int kn__mem_node_of(const void *p);

struct kn_engine {
  kn_isa isa;                 /* the ISA asked for (auto resolved), <= detected best */
  kn_isa fmt_isa[KN_FMT_COUNT]; /* the table entry each format runs on */
  const kn__kernel *kern[KN_FMT_COUNT]; /* = &table.k[f][fmt_isa[f]] */
  kn__kernel_table table;
  uint32_t n_nodes;           /* weight slices per expert = plan.n_groups */
  uint32_t node[KN_MAX_NODES];/* NUMA node (OS number) of slice s = plan.group_node[s] */
  bool forced_split;          /* n_nodes came from force_split, not the topology */
  bool numa_place;            /* slices are mapped on their node (> 1 real node, libnuma) */
  uint32_t spin_us;           /* pool spin before sleeping */
  kn__topo topo;              /* the host, read once */
  kn__plan plan;              /* groups and workers */
  kn__pool *pool;             /* plan.n_workers - 1 threads */
  mr_arena scratch;           /* used by kn_moe_forward when the caller passes none */
};

/* Registration of the kernels of each ISA. The REF one lives in kn_ref.c, the fast paths'
 * (kn__avx2_register, kn__avx512_register) in kernels/x86/; kn.c lists them all. */
void kn__ref_register(kn__kernel_table *t);

/* Checks a request against L (shape, dtype, ids, weights) before anything is computed;
 * shared by kn_moe_forward and kn_ref_moe_forward so that both refuse the same inputs
 * with the same messages. */
int kn__moe_validate(const kn_layer *L, const kn_moe_args *a, mr_err *e);

/* silu(g) = g / (1 + exp(-g)). For finite g this never yields NaN: exp(-g) overflowing to
 * inf for g < -88 gives g / inf = -0, the right limit. */
static inline float kn__silu(float g) {
  return g / (1.0f + expf(-g));
}

/* ---------------------------------------------------------------------------------------
 * Fast-path registrations (kernels/x86/, listed in registrations[] of kn.c).
 *
 * Each fills its ISA's column of the table for the formats it implements (moe_avx2.c: all
 * five; moe_avx512.c: f32, f16, bf16, and int8/int4 when the CPU has AVX512_VNNI).
 * Their kernels follow the thread contract of section C and use tmp as scratch private
 * to the calling worker (down converts h into it); gate_up uses no tmp.
 * moe_amx.c: bf16, int8, int4 on AMX tiles from each format's crossover in tokens per
 * expert (measured defaults, or MOERPC_AMX_MIN_TOKENS; the AVX-512 kernels below),
 * registered only on a CPU with AMX.
 *
 * Every entry a registration fills is a candidate: before an engine uses it, the
 * start-up self-test of section F runs it once in a child process against the REF
 * kernels, so a kernel that faults, hangs or computes wrong numbers on this CPU is
 * refused with one WARN and the next best entry serves.
 */
void kn__avx2_register(kn__kernel_table *t);
void kn__avx512_register(kn__kernel_table *t);
void kn__amx_register(kn__kernel_table *t);
/* The AVX-512 entry of format f for this CPU, NULL where there is none (built once). */
const kn__kernel *kn__avx512_kernel(kn_format f);
/* moe_amx.c's other exports, also built as kn__amx_emu_* over the emulated tiles
 * (-DKN_AMX_EMULATE=1, linked by tests/unit/test_kn_amx.c only):
 *   _kernels(f, &dispatched, &forced): the entries of f (gate_up NULL for formats without
 *        one): dispatched = AVX-512 below the crossover, forced = tiles at every n;
 *   _entries(t): fills t's AMX column with the dispatched entries, unverified (whether
 *        the CPU has AMX is the caller's business: the tests' gate);
 *   _cfg_audit(on): while on, every tile configuration a kernel loads is read back
 *        (STTILECFG) and compared with the one it asked for; _cfg_audit_take(why, n):
 *        the number of loads that differed since the last take (the first one described
 *        in why), and resets the count; _cfg_audit_loads(): loads audited so far. The
 *        self-test runs with it on;
 *   _min_tokens(f): format f's crossover (tokens per expert from which the tiles run),
 *        _set_min_tokens(f, n) sets it (1..4096): kn.c, once, from MOERPC_AMX_MIN_TOKENS
 *        or _crossover's measurement; _usable(): this CPU can run the entries. */
void kn__amx_kernels(kn_format f, kn__kernel *dispatched, kn__kernel *forced);
void kn__amx_entries(kn__kernel_table *t);
void kn__amx_cfg_audit(bool on);
uint64_t kn__amx_cfg_audit_take(char *why, size_t n);
uint64_t kn__amx_cfg_audit_loads(void);
uint32_t kn__amx_min_tokens(kn_format f);
void kn__amx_set_min_tokens(kn_format f, uint32_t n);
/* The bytes of B (prepared activations) one pass over a task's rows takes (moe_amx.c,
 * chunk_blocks); 0 restores the default. For the tests: the results do not depend on it. */
void kn__amx_set_b_chunk(size_t bytes);
/* The crossover of format f measured on this CPU (moe_amx.c, "the crossover, measured"):
 * *min_tokens the tokens per expert from which the tiles are faster, ratio[i] the tiles'
 * time over AVX-512's at the i-th count of KN_XO_NS_INIT. MR_ENOTSUP for a format without
 * AMX entries, MR_ENOMEM. Runs the kernels on the calling thread: only once the self-test
 * has passed them. Sets nothing (kn__amx_set_min_tokens does). */
#define KN_XO_NS 6
#define KN_XO_NS_INIT {2, 4, 8, 16, 32, 64}
int kn__amx_crossover(kn_format f, uint32_t *min_tokens, double ratio[KN_XO_NS]);
bool kn__amx_usable(void);
/* The tile peak loop (moe_amx.c, "the tile peak"): iters iterations of a 2 x 2 block of
 * full-tile dot products (bf16 for bf16 / fp8, int8 for int8 / int4) on the calling thread;
 * returns the operations done. AMX CPUs only (the emulated twin runs anywhere). */
uint64_t kn__amx_peak(kn_format f, uint64_t iters);
uint64_t kn__amx_emu_peak(kn_format f, uint64_t iters);
void kn__amx_emu_kernels(kn_format f, kn__kernel *dispatched, kn__kernel *forced);
void kn__amx_emu_entries(kn__kernel_table *t);
void kn__amx_emu_cfg_audit(bool on);
uint64_t kn__amx_emu_cfg_audit_take(char *why, size_t n);
uint64_t kn__amx_emu_cfg_audit_loads(void);
uint32_t kn__amx_emu_min_tokens(kn_format f);
void kn__amx_emu_set_min_tokens(kn_format f, uint32_t n);
void kn__amx_emu_set_b_chunk(size_t bytes);
int kn__amx_emu_crossover(kn_format f, uint32_t *min_tokens, double ratio[KN_XO_NS]);
bool kn__amx_emu_usable(void);
/* kn__avx512_register for a given feature set (the bf16 variant and int8/int4 depend on
 * AVX512_BF16 / AVX512_VNNI): lets tests run the paths of CPUs they are not on, e.g. the
 * fp32 bf16 kernel of an AVX-512 CPU without BF16. Never pass features the CPU lacks. */
void kn__avx512_register_cpu(kn__kernel_table *t, const kn__cpu *cpu);

/* ---------------------------------------------------------------------------------------
 * E. Dense linear layers (linear.c; API in kn.h).
 *
 * A kn_linear holds W [N = n_out, K = n_in] packed exactly like the down matrix of one
 * expert of a one-slice layer (section A: row-major over the N output rows, K contiguous,
 * INT8 one scale per row, INT4 ceil(K / G) scales per row), and carries that layer as a
 * view, so that the down kernels of the table compute it unchanged:
 *
 *   lin->L:  d.hidden = N, d.inter = slice_len[0] = K, d.num_experts = 1, n_slices = 1,
 *            w[0] = &lin->w (down = W, down_scale = its scales; gate/up NULL, never read)
 *   task:    .h = x + t0 * K   (the "intermediate" rows of a token tile, [n, K], read only)
 *            .y = y + t0 * N   ([n, N]: written at rows [j0, j1) of each token)
 *            .n = tokens of the tile, .tmp = the worker's scratch (tmp_floats(L, 0, n))
 *   kern->down(&task, j0, j1):  y[r, j] = W[j, :] . x[r, :]   for j in [j0, j1), r < n
 *
 * Served in place (kn_linear_borrow): the float formats' packed layout is the checkpoint's,
 * so W stays in the caller's memory as up to KN_LINEAR_MAX_BANDS row bands (q | k | v:
 * three tensors), each a slice of its own (band[b].down, in_place); a row block never
 * crosses a band edge, and its task reads band b's rows from band b's base and writes y
 * at the band's first row (task.y = y + t0 * N + band_row0[b], rows [j0, j1) shifted by
 * band_row0[b]; the stride stays N), so the kernels run unchanged and give the same bits.
 *
 * kn_linear_forward cuts [0, T) into tiles of at most KN__LINEAR_TILE_MAX tokens (fewer
 * when the activations of a tile would exceed KN__LINEAR_TILE_BYTES) and [0, N) into blocks
 * of KN__LINEAR_ROW_UNIT multiples, guided (large first, one unit at the end); items
 * (block, tile), block-major, form one work list (kn__work_init with n_groups = 1) that
 * every worker of every group claims from. The
 * layer view is never passed to kn_layer_free or kn_moe_forward; its limits are those of
 * kn.h (N up to KN_LINEAR_MAX_OUT, above KN_MAX_DIM: nothing in the down kernels limits
 * the output rows, while K <= KN_MAX_DIM keeps the int8 accumulator bound).
 */
#define KN_LINEAR_MAX_OUT 262144u       /* n_out */
#define KN_LINEAR_MAX_IN KN_MAX_DIM     /* n_in */
#define KN_LINEAR_MAX_TOKENS 65536u     /* T per kn_linear_forward */
/* Token tiles: at most this many tokens, and activations of at most this many bytes per
 * tile (about half an L2: the compute tiles re-read them for every 4 weight rows), but
 * never fewer than KN__LINEAR_TILE_MIN tokens (so that each weight row serves enough of
 * them to stay compute-bound). */
#define KN__LINEAR_TILE_MAX 256u
#define KN__LINEAR_TILE_MIN 16u
#define KN__LINEAR_TILE_BYTES (512u << 10)
/* Output-row blocks are multiples of this (the kernels' row tiles are 16, 8 or 4 rows)
 * and, guided, each takes 1 / (KN__LINEAR_GUIDED_DIV * workers) of the rows left. On the
 * 2-core Zen 4 VM, divisors 1..16 and units 32 / 64 read at the same rate at T = 1 (within
 * the host's noise, 4096x2048 and 512x2048 bf16); 2 keeps the first blocks long. */
#define KN__LINEAR_ROW_UNIT 64u
#define KN__LINEAR_GUIDED_DIV 2u
/* Smallest block of a compute-bound call (tiles of more than KN__LINEAR_TILE_MIN tokens),
 * unless N is too small to give every worker two items. 4096x2048 on 2 cores, bf16 / int8
 * / int4 at T = 1024: 0.69 / 1.39 / 1.00 TFLOP/s with it, 0.67 / 1.13 / 0.82 with 64. */
#define KN__LINEAR_PREFILL_ROWS 1024u

struct kn_linear {
  kn_layer L;           /* the one-expert, one-slice view the kernels read (see above) */
  kn__slice_w w;        /* the slice; w.mem holds W and its scales (packed), or nothing
                         * (in place: w.down = band[0].down, w.in_place) */
  kn__slice_w *wp;      /* = &w: L.w points here */
  uint64_t owned;       /* L.owned: expert 0 */
  uint64_t *loaded;     /* bitmap of N bits: row packed (owned) */
  uint32_t n_loaded;    /* rows with their bit set */
  uint64_t weight_bytes;/* N * (row bytes + scale bytes): what one forward reads */
  /* Served in place (kn_linear_borrow): W is n_bands row bands, each in the caller's
   * memory. Band b is rows band_row0[b] .. band_row0[b + 1] - 1 at band[b].down. A packed
   * linear is one band: band_row0 = {0, N}, band[0] = w. */
  uint32_t n_bands;
  uint32_t band_row0[KN_LINEAR_MAX_BANDS + 1];
  kn__slice_w band[KN_LINEAR_MAX_BANDS];
};

/* Checks a forward (lin, T, x, y) before anything is computed; shared by
 * kn_linear_forward and kn_ref_linear_forward so that both refuse the same inputs with
 * the same messages. who: the function name for the messages. */
int kn__linear_validate(const kn_linear *lin, uint32_t T, const float *x, const float *y,
                        const char *who, mr_err *e);

/* ---------------------------------------------------------------------------------------
 * F. Start-up self-tests of the fast kernels (selftest.c).
 *
 * A fast path that has not yet run on this CPU model is a hypothesis: the AMX kernels
 * passed every emulated test and then died with SIGILL at their first real instruction.
 * So no kernel of the table computes for an engine before it has run once, on this CPU,
 * where a fault cannot reach the process:
 *
 *   parent (kn_engine_new, once per process)          child (fork, no locks, no malloc)
 *   ----------------------------------------          ---------------------------------
 *   registrations fill a candidate table
 *   one small problem per format (and int4 group):
 *     weights, x, and h / y of the REF kernels
 *   results page (MAP_SHARED) ------ fork ------->   for each candidate case:
 *                                                      cur = case; prep, gate_up, down;
 *                                                      rel L2 vs REF, finite? -> results
 *   waitpid with a deadline  <------ exit / signal / hang (SIGKILL at the deadline)
 *   a case that killed the child: its entry refused, a new child from the next case
 *   each refused entry: one WARN (kernel, ISA, signal or error, CPU model, who serves)
 *
 * The REF kernels are never tested (they are the oracle, plain C). The child resets the
 * fault signals to their defaults (a host's SIGSEGV handler must not catch the child's
 * fault), disables core dumps and dies with its parent. Set MOERPC_SELFTEST=off to trust
 * the registrations without the child (one WARN says so): only for hosts that forbid
 * fork; a faulting kernel then kills the process.
 */

/* How a guarded call ended. */
typedef enum kn__guard_end {
  KN__GUARD_OK = 0,     /* fn returned (the child exited 0) */
  KN__GUARD_SIGNAL,     /* the child was killed by signal sig */
  KN__GUARD_TIMEOUT,    /* no exit within the deadline; the child was killed */
  KN__GUARD_EXIT,       /* the child exited with status code != 0 */
  KN__GUARD_LOST,       /* the child is gone but its status is unknown (SIGCHLD ignored) */
  KN__GUARD_NOCHILD,    /* no child could be started (fork failed: errno in code) */
} kn__guard_end;
typedef struct kn__guard_result {
  kn__guard_end end;
  int sig;    /* KN__GUARD_SIGNAL */
  int code;   /* KN__GUARD_EXIT: exit status; KN__GUARD_NOCHILD: errno */
  double ms;  /* wall time from fork to the end */
} kn__guard_result;
/* Runs fn(arg) in a child process and waits at most timeout_ms for it. fn runs in a
 * fork of a possibly multi-threaded process: it must not take locks, allocate, log or
 * touch stdio (write results into memory the caller mapped MAP_SHARED). The child
 * returns exit status 0 when fn returns. Thread-safe; blocks the caller. */
void kn__guard_run(void (*fn)(void *), void *arg, uint32_t timeout_ms, kn__guard_result *r);
/* Tests only: the child keeps the parent's fault handlers (a test's SIGILL trap). */
extern bool kn__guard_keep_handlers;

/* Tolerance (rel L2) and outcome of the self-test of one table entry. */
typedef struct kn__selftest_entry {
  const char *name;    /* the kernel's name (static) */
  bool tested;         /* a candidate was there and was run */
  bool passed;
  double worst;        /* the largest rel L2 of its cases (h and y) */
  char why[192];       /* failed: what happened ("killed by SIGILL", "rel L2 ... > ...") */
} kn__selftest_entry;
typedef struct kn__selftest_report {
  kn__selftest_entry e[KN_FMT_COUNT][KN_ISA_COUNT];
  uint32_t tested, refused, children; /* entries tested and refused; child processes */
  double ms;                          /* wall time of the whole self-test */
} kn__selftest_report;
/* Runs every entry of t above the REF column in (kn_isa)1 .. top against the REF kernels
 * (section F), clears the entries that fail, logs one WARN each, and fills rep (NULL: not
 * wanted). tol_scale multiplies every kernel's tolerance (tests: 0 refuses all). The REF
 * column must be registered. Returns the number of entries refused; MR_ENOMEM as a
 * negative code when the problems could not be allocated (then every candidate above REF
 * is refused, with one WARN). */
int kn__selftest_table(kn__kernel_table *t, kn_isa top, double tol_scale, kn__selftest_report *rep);
/* The process-wide table of every kernel this build and CPU run, self-tested once (on
 * the first call; thread-safe); kn_engine_new copies the columns up to its ISA. *rep,
 * when rep is not NULL, points at the report of that self-test. */
const kn__kernel_table *kn__verified_table(const kn__selftest_report **rep);
/* Tests only: called on the candidate table before the process-wide self-test (to add a
 * deliberately faulting kernel). Set it before the first engine of the process. */
extern void (*kn__register_hook)(kn__kernel_table *t);

#endif /* KN_INTERNAL_H */
