/*
 * kernels/internal.h - internals shared by the files of kernels/ (and its unit tests).
 *
 * Nothing here is part of the public contract (kn.h); other folders must not include it.
 * Names shared between files of this folder use the double-underscore prefix kn__.
 *
 * Three things live here:
 *   1. the packed weight layout of every format (the "canonical layout"), which the
 *      loader writes, kn_ref reads and every fast path reads (section A);
 *   2. struct kn_layer, which holds the packed slices of the experts (section B);
 *   3. struct kn_engine and its kernel table: one entry per (format, ISA) holding the
 *      functions that compute one expert slice, so that a fast path only has to fill an
 *      entry to be used (section C).
 */
#ifndef KN_INTERNAL_H
#define KN_INTERNAL_H

#include "kernels/kn.h"

#include <math.h>

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
 * Later phases may add other layouts (e.g. AMX tiles); they then add a layout tag here and
 * a row decoder for it in kn__row_to_f32, so that kn_ref keeps reading every layer.
 */

/* The packed weights of one slice of one expert (all pointers inside mem). */
typedef struct kn__slice_w {
  void *mem;          /* the one allocation holding everything below (mr_malloc_aligned) */
  size_t mem_bytes;   /* its size, including alignment padding */
  void *gate;         /* [I_s rows][H], format layout above */
  void *up;           /* [I_s rows][H] */
  void *down;         /* [H rows][I_s] */
  float *gate_scale;  /* INT8: [I_s]; INT4: [I_s * ng(H)]; NULL for float formats */
  float *up_scale;    /* same shape as gate_scale */
  float *down_scale;  /* INT8: [H]; INT4: [H * ng(I_s)]; NULL for float formats */
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
  uint32_t node[KN_MAX_NODES];      /* NUMA node slice s is meant to live on (phase 2) */
  kn__slice_w **w;                  /* [E]: NULL, or [n_slices] slices of a loaded expert */
  uint64_t *owned;                  /* bitmap of E bits: expert loaded */
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

/* Largest |src[i]| of n values. */
float kn__amax(const float *src, uint32_t n);
/* Quantizes n fp32 values with the INT8 rule of section A and the given scale (amax / 127
 * of the row they belong to). */
void kn__quant_row_int8(const float *src, uint32_t n, float scale, int8_t *dst);
/* Quantizes a row of K fp32 values with the INT4 rule of section A (group G): writes
 * ng * G / 2 bytes at dst and ng scales at scale. */
void kn__quant_row_int4(const float *src, uint32_t K, uint32_t G, uint8_t *dst, float *scale);

/* ---------------------------------------------------------------------------------------
 * C. The engine and its kernel table.
 *
 * kn_moe_forward groups the (token, slot) pairs by expert and then, for each used expert
 * and each slice s, runs two steps over the n tokens routed to that expert:
 *
 *   gate_up:  h[r, i] = silu(gate_s[i, :] . x[r, :]) * (up_s[i, :] . x[r, :])   i < I_s
 *   down:     y[r, j] = down_s[j, :] . h[r, :]                                  j < H
 *
 * Each step takes a half-open range of its output rows, so that a worker pool (phase 2)
 * can cut one step into per-thread row blocks with a barrier between the two steps, the
 * way kt-kernel does; phase 1 calls each step once over the whole range. The caller then
 * adds w[r] * y[r, :] into the slice's fp32 partial output row of token tok[r].
 *
 * A fast path for (format f, ISA i) fills table[f][i] in its registration function; the
 * engine picks for each format the best filled entry at or below its ISA (the REF entries
 * are always filled, by kn__ref_register).
 */
typedef struct kn__task {
  const kn_layer *L;
  uint32_t slice;         /* s */
  const kn__slice_w *w;   /* packed weights of (expert, s) */
  uint32_t n;             /* tokens routed to the expert in this call */
  const float *x;         /* [n, H] fp32 inputs, row r = token tok[r] of the request */
  const void *xq;         /* prepared inputs from kn__kernel.prep (NULL when it has none) */
  float *h;               /* [n, I_s] fp32 intermediate, written by gate_up */
  float *y;               /* [n, H] fp32 slice output, written by down */
  float *tmp;             /* kernel scratch: kn__kernel.tmp_floats(L, s, n) floats */
} kn__task;

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
  /* fp32 scratch floats one task needs in tmp (for decoded rows and the like). */
  size_t (*tmp_floats)(const kn_layer *L, uint32_t slice, uint32_t n);
  const char *name; /* e.g. "ref_bf16_f32": weight type then input type (STYLE.md 2) */
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
  bool amx_tile, amx_bf16, amx_int8;    /* cpuid bits */
  bool os_avx, os_avx512, os_amx;       /* XCR0 enables the register state */
  bool amx_perm;                        /* arch_prctl(ARCH_REQ_XCOMP_PERM) succeeded */
  kn_isa best;
} kn__cpu;
/* Detects once (thread-safe) and returns the process-wide result. */
const kn__cpu *kn__cpu_get(void);

struct kn_engine {
  kn_isa isa;                 /* the ISA asked for (auto resolved), <= detected best */
  kn_isa fmt_isa[KN_FMT_COUNT]; /* the table entry each format runs on */
  const kn__kernel *kern[KN_FMT_COUNT]; /* = &table.k[f][fmt_isa[f]] */
  kn__kernel_table table;
  uint32_t threads;           /* threads asked for (phase 1 computes on the caller thread) */
  uint32_t n_nodes;           /* weight slices per expert */
  uint32_t node[KN_MAX_NODES];/* NUMA node id of slice s */
  bool forced_split;          /* n_nodes came from force_split, not the topology */
  mr_arena scratch;           /* used by kn_moe_forward when the caller passes none */
};

/* Registration of the kernels of each ISA. The REF one lives in kn_ref.c; phase 2 adds
 * kn__avx2_register etc. in kernels/x86/ and lists them in kn.c. */
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

#endif /* KN_INTERNAL_H */
