/*
 * kn.h - CPU MoE kernels: the one public header of kernels/.
 *
 * One call computes, for one MoE layer and T tokens,
 *
 *     out[t] = sum_{j < k, id[t,j] >= 0} w[t,j] * expert_{id[t,j]}(x[t])
 *     expert(x) = down( silu(gate(x)) * up(x) )          (no scaling factor inside)
 *
 * over the experts a kn_layer holds. Three objects:
 *
 *   kn_engine  the compute context: which ISA each format runs on (chosen once from cpuid,
 *              XCR0 and the AMX permission, or forced with MOERPC_ISA=ref|avx2|avx512|amx),
 *              and the worker pool (threads pinned per NUMA node).
 *   kn_layer   the packed weights of the experts one process owns for one layer, in the
 *              format it was created with (bf16/f16/f32 as stored, or int8/int4 quantized at
 *              load). Each expert is split along the intermediate dimension into one slice
 *              per NUMA node of the engine; slice n lives on node n.
 *   kn_moe_args  one request: T tokens, k slots each.
 *
 * and, for the dense rest of a model, kn_linear (y = x W^T on the same engine, through
 * the same kernels; end of this file) and kn_engine_run, a parallel-for on its workers.
 *
 * Data flow of kn_moe_forward: group (token, slot) pairs by expert (counting sort), then
 * per expert and per node slice: gate/up GEMM over the tokens of that expert, silu(g) * u,
 * down GEMM, scaled by the slot weight and accumulated into the node's fp32 partial
 * output; finally the node partials are summed in fp32 into out.
 *
 * Weight layout on input (HF nn.Linear): gate, up: [I, H] row-major; down: [H, I].
 *
 * Threads: a kn_engine runs one kn_moe_forward at a time (calls are serialised by the
 * caller, e.g. the server's compute thread); a kn_layer is read-only after loading and
 * may be shared by engines. kn_moe_forward and kn_layer_load_expert both run on the
 * engine's workers, with the calling thread as one of them; two such calls on one engine
 * from different threads queue up (the pool takes one at a time), which is safe as long
 * as they touch different layers and each forward passes its own scratch arena. Idle
 * workers spin briefly (MOERPC_SPIN_US, default 50) and then sleep: an idle engine uses
 * no CPU.
 */
#ifndef KN_H
#define KN_H

#include "common/mr.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kn_engine kn_engine; /* the workers and kernel table (kn_engine_new below) */

typedef enum kn_format {
  KN_FMT_F32 = 0, /* as stored, fp32 */
  KN_FMT_F16,     /* as stored, fp16 */
  KN_FMT_BF16,    /* as stored, bf16 */
  KN_FMT_INT8,    /* symmetric, one fp32 scale per output row */
  KN_FMT_INT4,    /* symmetric, group-wise along K (group 32, 64 or 128) */
  KN_FMT_FP8,     /* "fp8-b128": float8_e4m3fn, one fp32 scale per 128x128 block (DeepSeek-V3,
                   * Qwen3-FP8 checkpoints); experts and dense layers (kn_linear) */
  KN_FMT_COUNT
} kn_format;
/* "f32", "f16", "bf16", "int8", "int4", "fp8-b128" */
const char *kn_format_name(kn_format f);
/* Parses the names above (and "fp8" for "fp8-b128"); MR_EINVAL otherwise. */
int kn_format_parse(const char *s, kn_format *out);
/* Writes the wire name of a format ("bf16", "int8", "int4-g64", "fp8-b128") into buf. */
void kn_format_wire_name(kn_format f, uint32_t group, char *buf, size_t len);

/* ---- FP8 e4m3fn with 128x128 block scales (format "fp8-b128") --------------------------
 * A checkpoint matrix W [N, K] (HF nn.Linear) is stored as N x K e4m3fn codes (1 sign, 4
 * exponent bits with bias 7, 3 mantissa bits; no inf; 0x7f / 0xff are NaN; largest finite
 * 448) and scale_inv [ceil(N / 128), ceil(K / 128)] fp32, row-major:
 *     w[n, k] = e4m3(q[n, k]) * scale_inv[n / 128, k / 128]      (one fp32 multiply)
 * exactly as the DeepSeek-V3 / transformers FineGrainedFP8 "weight_scale_inv" tensors. */
#define KN_FP8_BLOCK 128u
#define KN_FP8_MAX 448.0f
/* The exact value of an e4m3fn code (a 256-entry table; NaN for 0x7f and 0xff). */
float kn_fp8_e4m3_to_f32(uint8_t code);
/* Rounds v to e4m3fn: nearest, ties to even, saturating to +-448 (inf too); NaN -> 0x7f
 * (sign kept); -0 -> 0x80. */
uint8_t kn_fp8_e4m3_from_f32(float v);
/* Quantizes W [N, K] (dtype src: f32, f16 or bf16; finite values) block-wise: per 128x128
 * block scale_inv = amax / 448 (1 for an all-zero block, so that every scale is > 0) and
 * q = e4m3(w / scale_inv). q: N * K bytes, scale_inv: ceil(N/128) * ceil(K/128) floats.
 * MR_EINVAL (naming row and column) for a non-finite weight, MR_ENOMEM. */
int kn_fp8_quantize_b128(const void *w, mr_dtype src, uint32_t N, uint32_t K, uint8_t *q,
                         float *scale_inv, mr_err *e);
/* Dequantizes rows [row0, row0 + n_rows) of an F8_E4M3 matrix q [N, K] (codes as stored,
 * row 0 first) with its block scales scale_inv (as above) into dst [n_rows, K] fp32:
 *     dst[r, k] = e4m3(q[row0 + r, k]) * scale_inv[(row0 + r) / 128, k / 128]
 * bit for bit kn_fp8_e4m3_to_f32(code) * scale. On eng's workers (NULL: the calling thread
 * alone), vectorized where the CPU has AVX2. The scales are not checked here
 * (kn_fp8_check_scales). Errors: MR_EINVAL for a NULL q, scale_inv or dst, rows outside
 * 0..N or K = 0, and for a NaN code (0x7f / 0xff) or a code whose product with a huge
 * scale overflows fp32, named by its [row, column] in the matrix (the first in row-major
 * order; dst is partly written then). Like kn_engine_run,
 * not from inside an item of eng. */
int kn_fp8_dequant_b128(kn_engine *eng, const uint8_t *q, const float *scale_inv, uint32_t N,
                        uint32_t K, uint32_t row0, uint32_t n_rows, float *dst, mr_err *e);
/* Checks the ceil(N/128) x ceil(K/128) block scales of a matrix: each finite and > 0.
 * MR_EINVAL naming `what`, the block [r, c] and the value. */
int kn_fp8_check_scales(const float *scale_inv, uint32_t N, uint32_t K, const char *what,
                        mr_err *e);

typedef enum kn_isa {
  KN_ISA_REF = 0, /* scalar reference kn_ref, always available */
  KN_ISA_AVX2,    /* AVX2 + FMA */
  KN_ISA_AVX512,  /* AVX-512 F/BW/VL (+ BF16, VNNI when present) */
  KN_ISA_AMX,     /* AMX tiles (bf16, int8) for many tokens per expert */
  KN_ISA_COUNT
} kn_isa;
const char *kn_isa_name(kn_isa isa);
int kn_isa_parse(const char *s, kn_isa *out);
/* The best ISA this CPU and OS support (cpuid + XCR0 + AMX permission). */
kn_isa kn_isa_detect(void);

typedef struct kn_engine_opts {
  kn_isa isa;           /* KN_ISA_COUNT = auto (best detected; MOERPC_ISA overrides) */
  uint32_t threads;     /* worker threads in total, the calling thread included (1 = no
                         * extra thread), 0 = one per core of the used nodes */
  const char *numa;     /* "auto", a node count "2", or a node list "0,1"; NULL = auto */
  uint32_t force_split; /* >0: pretend to have this many NUMA nodes (tests on 1-node hosts) */
} kn_engine_opts;
/* Creates an engine (starts its worker threads). The caller frees it with kn_engine_free.
 * Errors name the option and the limit (e.g. a forced ISA the CPU lacks). */
int kn_engine_new(kn_engine **out, const kn_engine_opts *opts, mr_err *e);
void kn_engine_free(kn_engine *eng); /* NULL is a no-op; joins the workers */
/* The ISA that format f runs on in this engine (REF when no fast path exists for it). */
kn_isa kn_engine_isa(const kn_engine *eng, kn_format f);
uint32_t kn_engine_threads(const kn_engine *eng);
uint32_t kn_engine_nodes(const kn_engine *eng); /* number of weight slices per expert */
/* Pins the calling thread to the core the engine keeps for worker 0 (the thread that calls
 * kn_moe_forward, kn_linear_forward or kn_engine_run takes part as worker 0; the pool
 * threads are pinned to the other cores). Optional: unpinned, the OS may put the caller on
 * a pool thread's core and leave its own idle, which halves a call's speed for as long as
 * it stays there (seen on a 2-core VM: 2-4x slower decode passes). Call it once from the
 * thread that will make the calls (a runner's or server's compute thread), not from one
 * that has other work elsewhere. Returns 0, MR_EINVAL for a NULL eng, MR_ENOTSUP when
 * the OS refuses (containers): the engine then works as before. */
int kn_engine_pin_caller(kn_engine *eng, mr_err *e);

typedef struct kn_layer_desc {
  uint32_t hidden;      /* H, 1..65536 */
  uint32_t inter;       /* I of one expert, 1..65536 */
  uint32_t num_experts; /* E: ids are < E, 1..65536 */
  kn_format format;
  uint32_t group;       /* INT4 group size along K: 32, 64 or 128; ignored otherwise (FP8:
                         * set to its block, 128, by kn_layer_new) */
} kn_layer_desc;
typedef struct kn_layer kn_layer;
/* Creates an empty layer for eng (slices per node of eng). Shape/format pairs the packed
 * layout cannot hold are refused here with the field and the limit. Caller frees. The
 * layer keeps eng for loading (packing runs on its workers, each slice on its node): eng
 * must outlive the layer's kn_layer_load_expert calls. */
int kn_layer_new(kn_layer **out, kn_engine *eng, const kn_layer_desc *d, mr_err *e);
void kn_layer_free(kn_layer *L); /* NULL is a no-op */
/* Packs (copies, converts or quantizes) one expert's weights into the layer. gate/up are
 * [I, H], down is [H, I], all of dtype src (f32/f16/bf16). The inputs are not kept. */
int kn_layer_load_expert(kn_layer *L, uint32_t expert, const void *gate, const void *up,
                         const void *down, mr_dtype src, mr_err *e);
/* Packs one expert given as FP8 block-scaled matrices (the layout above): gate/up codes
 * [I, H] with scales [ceil(I/128), ceil(H/128)], down [H, I] with [ceil(H/128),
 * ceil(I/128)]. An FP8 layer keeps the codes and scales as they are (bit-exact); any other
 * format dequantizes (w = e4m3 * scale in fp32) and packs as from an f32 source (bf16
 * rounding, int8 / int4 quantization). Errors: a scale that is not finite and > 0 (named:
 * "expert 3 gate scale_inv[1, 0] = 0"), a NaN code ("expert 3 up[5, 7] = nan"), as
 * kn_layer_load_expert otherwise. kn_layer_load_expert into an FP8 layer quantizes with
 * kn_fp8_quantize_b128 (on the calling thread) and then packs as here. */
int kn_layer_load_expert_fp8(kn_layer *L, uint32_t expert, const uint8_t *gate,
                             const float *gate_scale, const uint8_t *up, const float *up_scale,
                             const uint8_t *down, const float *down_scale, mr_err *e);
/* Loads one expert from checkpoint tensors as mr_config_expert_tensors_q finds them: float
 * projections through kn_layer_load_expert, F8_E4M3 ones (scales[p] != NULL, F32 or BF16)
 * through kn_layer_load_expert_fp8 after converting the scales to fp32 and checking them
 * (the error names the scale tensor: "tensor \"...gate_proj.weight_scale_inv\"
 * scale_inv[0, 1] = 0: block scales must be finite and > 0"). The one loader of the
 * server, the client's local experts and the tests. */
int kn_layer_load_expert_st(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                            const mr_st_tensor *const scales[3], mr_err *e);
/* Serves one expert in place, without a copy (the server's --map-weights): the layer reads
 * gate / up / down ([I, H], [I, H], [H, I], dtype src, row-major as kn_layer_load_expert
 * takes them) where they are, for as long as it or a layer kn_layer_rebuild shares the
 * expert with lives, so the caller keeps them valid and unchanged until then (a model
 * file's read-only mapping kept open; pages of a file can be evicted and re-read, and a
 * file rewritten in place changes the weights or faults with SIGBUS). Every weight is
 * checked finite first, on the engine's workers (MR_EINVAL naming it, as
 * kn_layer_load_expert). Only where kn_layer_can_borrow: the format stores src as it is
 * (bf16 / f16 / f32) and the layer has one slice (one NUMA node); else, or for an array
 * not aligned to its element, MR_ENOTSUP, and the caller packs the expert instead. The
 * layer's kernels and results are those of the packed copy (bit-identical). */
bool kn_layer_can_borrow(const kn_layer *L, mr_dtype src);
int kn_layer_borrow_expert(kn_layer *L, uint32_t expert, const void *gate, const void *up,
                           const void *down, mr_dtype src, mr_err *e);
/* The same for FP8 block-scaled matrices (kn_layer_load_expert_fp8's arguments) into an
 * fp8-b128 layer: the codes are served where they are (checked: a NaN code is MR_EINVAL
 * naming it), the per-row scales the kernels read are made from the block scales (checked
 * finite and > 0) and held by the layer, about 1/32 of the codes' bytes. Only where
 * kn_layer_can_borrow_fp8 (an FP8 layer on one slice), else MR_ENOTSUP. Bit-identical to
 * kn_layer_load_expert_fp8. */
bool kn_layer_can_borrow_fp8(const kn_layer *L);
int kn_layer_borrow_expert_fp8(kn_layer *L, uint32_t expert, const uint8_t *gate,
                               const float *gate_scale, const uint8_t *up, const float *up_scale,
                               const uint8_t *down, const float *down_scale, mr_err *e);
/* Either of the two from an expert's safetensors (t: gate, up, down; scales: their fp8
 * block scales, or NULL / {NULL, ...}, as mr_config_expert_tensors_q finds them): F8_E4M3
 * tensors with scales through kn_layer_borrow_expert_fp8 (scales converted and checked as
 * kn_layer_load_expert_st does), float ones through kn_layer_borrow_expert; MR_ENOTSUP also
 * where the three differ in dtype. The runner's CPU backend op (experts_borrow_st). */
int kn_layer_borrow_expert_st(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                              const mr_st_tensor *const scales[3], mr_err *e);
/* One expert served in place where in_place and kn_layer_borrow_expert_st can (then
 * *borrowed = true, and the caller keeps the tensors' file mapped as long as the layer),
 * else packed (kn_layer_load_expert_st; *borrowed = false). The one "in place or packed"
 * rule of the server's start-up and live apply and the client's local experts. Errors as
 * those two; never MR_ENOTSUP from the in-place attempt. */
int kn_layer_take_expert_st(kn_layer *L, uint32_t expert, const mr_st_tensor *const t[3],
                            const mr_st_tensor *const scales[3], bool in_place, bool *borrowed,
                            mr_err *e);
bool kn_layer_has_expert(const kn_layer *L, uint32_t expert);
const kn_layer_desc *kn_layer_get_desc(const kn_layer *L);
/* Bytes of packed weights held (for load progress and metrics). */
uint64_t kn_layer_bytes(const kn_layer *L);
/* Bytes of weights one expert occupies in this layer's format. */
uint64_t kn_layer_expert_bytes(const kn_layer *L);
/* Live placement (docs/DESIGN.md section 15): a new layer *out with the experts of old for
 * which keep[x] != 0 ([num_experts] bytes; NULL = none) and every expert of add (which
 * wins over old for an expert both hold). No weight is copied: the slices of add move to
 * *out (add is left without them), those of old are shared, *out owns them and old keeps
 * reading them, so old stays valid for calls already running on it, and kn_layer_free(old)
 * later frees only the experts it did not pass on. old or add may be NULL, not both; both
 * must come from one engine with one desc. Neither may be loaded into meanwhile. Errors:
 * MR_EINVAL (mismatch), MR_ENOMEM; on error nothing moved. */
int kn_layer_rebuild(kn_layer **out, kn_layer *old, const uint8_t *keep, kn_layer *add, mr_err *e);
/* Undoes kn_layer_rebuild(&L, old, ...) for a layer that is not used after all: the experts
 * L shares with old are old's again (kn_layer_free(old) frees them), those it took from add
 * are freed, and L goes. NULL L is a no-op. */
void kn_layer_forget(kn_layer *L, kn_layer *old);

/* Packed-weight cache (docs/DESIGN.md section 23). The packed bytes of an expert are, per
 * slice s, one block of kn_layer_slice_bytes(L, s) bytes (internal.h section A), aligned to
 * KN_PACK_ALIGN; they do not depend on the ISA the kernels run on, but on the format, the
 * shape, the slice split and this layout version. A cache written with another version,
 * another split or other slice sizes must never be read back. */
#define KN_PACK_LAYOUT_VERSION 1u
/* Slices per expert (the creating engine's nodes); the first intermediate row, the rows,
 * the packed bytes (0 for an empty slice) and the NUMA node (OS number) of slice s. */
uint32_t kn_layer_slices(const kn_layer *L);
uint32_t kn_layer_slice_off(const kn_layer *L, uint32_t s);
uint32_t kn_layer_slice_len(const kn_layer *L, uint32_t s);
uint64_t kn_layer_slice_bytes(const kn_layer *L, uint32_t s);
/* The packed block of slice s of a loaded expert (kn_layer_slice_bytes(L, s) bytes), NULL
 * when the expert is not loaded or the slice is empty. Read-only; valid while the layer
 * (or a layer that shares the expert) lives. */
const void *kn_layer_expert_slice(const kn_layer *L, uint32_t expert, uint32_t s);
/* Makes expert hold the packed blocks mem[s] (s < kn_layer_slices(L); an empty slice's entry
 * is ignored) without copying them: the layer only borrows them (kn_layer_free does not free
 * them), so the caller keeps them mapped, unchanged, for as long as this layer or any layer
 * kn_layer_rebuild shares the expert with lives. Each must be KN_PACK_ALIGN-aligned and hold
 * kn_layer_slice_bytes(L, s) bytes of this layer's layout. Replaces a loaded expert (the
 * layer must not be in use meanwhile). MR_EINVAL (misaligned, NULL), MR_ERANGE, MR_ENOMEM. */
int kn_layer_adopt_expert(kn_layer *L, uint32_t expert, void *const *mem, mr_err *e);
/* Faults in n_regions read-only regions (region s: base[s], bytes[s]; NULL or 0 = none) on
 * the engine's workers, region s by the workers of group s (slice s's node), in 2 MiB pieces
 * (MADV_POPULATE_READ where the kernel has it, else a read of every page), so that a mapped
 * cache file's page tables exist before the first request. n_regions <= kn_engine_nodes.
 * Serialised with the engine's other calls. Returns the bytes faulted in. */
uint64_t kn_engine_populate(kn_engine *eng, const void *const *base, const uint64_t *bytes,
                            uint32_t n_regions);

typedef struct kn_moe_args {
  uint32_t n_tokens;     /* T */
  uint32_t top_k;        /* k */
  const int32_t *ids;    /* [T * k]; -1 = empty slot */
  const float *weights;  /* [T * k] */
  const void *x;         /* [T, H] of x_dtype */
  mr_dtype x_dtype;
  float *out;            /* [T, H] fp32, overwritten */
} kn_moe_args;
/* Computes one layer (see top of file). Every non-empty id must be held by L: ids that are
 * not are refused with MR_EPRECOND, ids >= E with MR_ERANGE, before anything is computed.
 * scratch: per-request scratch, reset by the caller after the call (may be NULL: the
 * engine then uses its own). Runs on the engine's workers; returns when done. */
int kn_moe_forward(kn_engine *eng, const kn_layer *L, const kn_moe_args *a, mr_arena *scratch,
                   mr_err *e);

/* The scalar reference for one layer, single-threaded, fp32 math over the stored weights
 * (dequantized for int8/int4). Same contract as kn_moe_forward. */
int kn_ref_moe_forward(const kn_layer *L, const kn_moe_args *a, mr_err *e);

/* The textbook expert on fp32 weights, for tests: y[H] = down(silu(gate x) * up x). */
void kn_ref_expert_f32(const float *gate, const float *up, const float *down, uint32_t H,
                       uint32_t I, const float *x, float *y);

/* Relative L2 error ||y - ref|| / ||ref|| (0 when both are zero). */
double kn_rel_l2(const float *y, const float *ref, size_t n);

/* ---- dense layers ---------------------------------------------------------------------
 * y[T, N] = x[T, K] W^T (nn.Linear without bias), W [N, K] row-major as in HF checkpoints.
 * Stored in a kn_format (f32/f16/bf16 as given, int8/int4 quantized per row/group at load,
 * fp8-b128 as an FP8 checkpoint's codes and block scales or quantized so at load), packed
 * like the "down" matrix of an expert (row-major over output rows, K contiguous).
 *
 * A kn_linear is computed by the down kernels of the engine's kernel table (the same fast
 * paths as kn_moe_forward, with the same activation handling: bf16 rounding of x on the
 * AVX-512 bf16 and fp8 paths, per-token int8 quantization of x on the VNNI int8/int4 paths), its
 * output rows cut into blocks that all of the engine's workers claim from one list, and
 * its tokens into tiles of at most 256 (so that per-call scratch stays bounded and each
 * weight row is reused across the tokens of a tile). One weight slice, on the engine's
 * first NUMA node (mapped there when the engine places slices, internal.h section D):
 * workers of other nodes read it remotely.
 *
 * Limits: n_out (N) 1..262144 (an lm_head of a 262144-word vocabulary), n_in (K) 1..65536
 * (the int8 accumulator bound of the VNNI kernels), T 0..65536 per call.
 *
 * Threads: a kn_linear is written by kn_linear_load_rows(_fp8) only and read-only otherwise;
 * forwards on it (from any engines, each with its own scratch) may run concurrently, but
 * not with a load of it. */
typedef struct kn_linear kn_linear;
/* Creates an empty linear of n_out x n_in weights in format fmt (group: INT4 group size
 * along K, 32, 64 or 128; ignored otherwise) and allocates its packed weights (the caller
 * frees it with kn_linear_free). eng packs the rows on its workers: it must outlive the
 * kn_linear_load_rows calls; forwards may use any engine. Errors: MR_EINVAL naming the
 * field and its limit; MR_ENOMEM when the weights (kn_linear_bytes) cannot be allocated. */
int kn_linear_new(kn_linear **out, kn_engine *eng, uint32_t n_out, uint32_t n_in,
                  kn_format fmt, uint32_t group, mr_err *e);
/* Most row bands of a linear served in place (q | k | v and the like: one per tensor). */
#define KN_LINEAR_MAX_BANDS 4u
/* Serves W in place, without a copy (llama.cpp's way; the runner's --map-weights): W is
 * the n_parts (1..KN_LINEAR_MAX_BANDS) bands w[i] stacked in order, band i being rows[i]
 * rows of n_in elements of dtype src, row-major and contiguous (a checkpoint tensor, or a
 * row range of one, in a file mapping). The caller keeps that memory mapped and unchanged
 * until kn_linear_free; kn_linear_free does not free it. The format is src's (f32, f16 or
 * bf16, whose packed layout is the checkpoint's: row-major, unpadded; the kernels load
 * weights unaligned), so every forward gives the bits of a linear packed from the same
 * weights. Every weight is checked finite first, on eng's workers (the caller taking
 * part). Errors: MR_EINVAL (a NULL or empty argument, n_out or n_in out of kn_linear_new's
 * range, a non-finite weight named by row, column and part), MR_ENOTSUP (src not f32,
 * f16 or bf16; a part not aligned to its element; an engine that places memory on NUMA
 * nodes, whose weights must be first-touched there, as kn_layer_can_borrow): then the
 * caller packs instead (kn_linear_new, kn_linear_load_rows), MR_ENOMEM. Such a linear is
 * read-only: kn_linear_load_rows refuses it (MR_EPRECOND). */
int kn_linear_borrow(kn_linear **out, kn_engine *eng, uint32_t n_parts, const void *const *w,
                     const uint32_t *rows, uint32_t n_in, mr_dtype src, mr_err *e);
/* kn_linear_borrow for FP8 codes (DeepSeek-V3 / Kimi-K2 checkpoints): an fp8-b128 linear
 * over the n_parts bands q[i] of rows[i] x n_in e4m3fn codes in the caller's memory (kept
 * mapped and unchanged until kn_linear_free). Band i's codes are rows first_row[i] ..
 * first_row[i] + rows[i] - 1 of a checkpoint tensor whose block scales are scale_inv[i]
 * ([ceil(tensor rows / 128), ceil(n_in / 128)] fp32, kn_fp8_check_scales' rules): the
 * linear keeps its own copy of the scale of each (row, 128-column block) (4 bytes per 128
 * weights, internal.h section A) and none of scale_inv. Every forward gives the bits of
 * the same codes packed (kn_linear_load_rows_fp8). Errors: kn_linear_borrow's, MR_EINVAL
 * for a missing scale_inv or first_row, a scale that is not finite and > 0 (named by part
 * and block) or a NaN code (named by row, column and part); MR_ENOTSUP for an engine that
 * places memory on NUMA nodes. */
int kn_linear_borrow_fp8(kn_linear **out, kn_engine *eng, uint32_t n_parts, const uint8_t *const *q,
                         const uint32_t *rows, uint32_t n_in, const float *const *scale_inv,
                         const uint32_t *first_row, mr_err *e);
/* True for a linear made by kn_linear_borrow or _fp8 (its weights are the caller's). */
bool kn_linear_in_place(const kn_linear *lin);
/* Frees lin and its packed weights (no load or forward may be using it). */
void kn_linear_free(kn_linear *lin);               /* NULL is a no-op */
/* Packs rows [row0, row0 + n_rows) of W from w ([n_rows, n_in] of dtype src), so that
 * several checkpoint tensors (q, k, v) can be concatenated into one linear.
 * Packs (converts or quantizes) on the engine's workers, the caller taking part; w is not
 * kept. Loading a row again replaces it; every row must be loaded before a forward.
 * n_rows = 0 is a no-op. Errors: MR_EINVAL (NULL lin or w, src not f32/f16/bf16, a
 * non-finite weight, named by row and column: then rows of the band may have been
 * overwritten, and the whole band counts as not loaded), MR_ERANGE (the band goes past
 * n_out), MR_EPRECOND (lin is served in place: kn_linear_borrow). */
int kn_linear_load_rows(kn_linear *lin, uint32_t row0, uint32_t n_rows, const void *w,
                        mr_dtype src, mr_err *e);
/* FP8 (fp8-b128) dense weights, kept as the checkpoint stores them: packs rows [row0,
 * row0 + n_rows) of an fp8-b128 linear from e4m3fn codes q ([n_rows, n_in]), the codes
 * copied as they are and each row's block scales spread out per row (internal.h section A).
 * q's row i is row first_row + i of a checkpoint tensor whose block scales are scale_inv
 * ([ceil(tensor rows / 128), ceil(n_in / 128)] fp32): its scale of column block g is
 * scale_inv[((first_row + i) / 128) * ceil(n_in / 128) + g]. A column slice of a tensor
 * is such a tensor when it starts at a multiple of 128 (the caller then passes the block
 * columns of the slice). On the engine's workers; q and scale_inv are not kept. Errors:
 * kn_linear_load_rows' (NULL arguments, MR_ERANGE, MR_EPRECOND), MR_EINVAL for a linear
 * of another format, a scale that is not finite and > 0 (named by its block) or a NaN
 * code (0x7f, 0xff: named by row and column; the band then counts as not loaded).
 * kn_linear_load_rows into an fp8-b128 linear quantizes its f32 / f16 / bf16 rows here
 * first (kn_fp8_quantize_b128, in 128 x 128 blocks from the band's first row, on the
 * calling thread), then packs them so. */
int kn_linear_load_rows_fp8(kn_linear *lin, uint32_t row0, uint32_t n_rows, const uint8_t *q,
                            const float *scale_inv, uint32_t first_row, mr_err *e);
uint32_t kn_linear_n_out(const kn_linear *lin);
uint32_t kn_linear_n_in(const kn_linear *lin);
kn_format kn_linear_format(const kn_linear *lin);
uint32_t kn_linear_group(const kn_linear *lin);      /* INT4 group size; 128 (the block) for
                                                      * fp8-b128; 0 for other formats */
uint32_t kn_linear_rows_loaded(const kn_linear *lin); /* distinct rows loaded so far */
uint64_t kn_linear_bytes(const kn_linear *lin);    /* packed weight bytes (what one call reads) */
/* y (fp32 [T, n_out], overwritten) = x (fp32 [T, n_in]) W^T, on the engine's workers
 * (the caller is one of them). scratch: per-call arena, may be NULL. T = 0 is a no-op.
 * Errors (MR_EINVAL/ERANGE naming the field) before anything is computed.
 * In full: returns when y is written. scratch is not reset (the caller resets it, as for
 * kn_moe_forward); NULL uses the engine's own arena, which is only safe when no other
 * forward with a NULL scratch runs on this engine at the same time. Calls on one engine
 * are serialised by its pool; they must not be made from inside a kn_engine_run item.
 * Errors: MR_EINVAL for a NULL eng, lin, x or y; MR_ERANGE for T > 65536; MR_EPRECOND
 * when some row of W was never loaded (naming the first); MR_ENOMEM for scratch. y is
 * untouched on error. x is not scanned for NaN (a NaN in a token stays in that token's
 * row of y). */
int kn_linear_forward(kn_engine *eng, const kn_linear *lin, uint32_t T, const float *x,
                      float *y, mr_arena *scratch, mr_err *e);
/* The scalar reference: fp32 math over the stored (dequantized) weights, one thread.
 * Same contract and errors as kn_linear_forward (on the calling thread only); x is used
 * as is, in fp32, whatever the format: the fast paths differ from it by their activation
 * rounding and summation order. */
int kn_ref_linear_forward(const kn_linear *lin, uint32_t T, const float *x, float *y, mr_err *e);

/* Runs fn(arg, item, worker) for item = 0 .. n_items-1 on the engine's workers (the caller
 * is worker 0), each item exactly once, claimed dynamically; returns when all are done.
 * worker < kn_engine_threads(eng). Calls on one engine are serialised like kn_moe_forward.
 * Every write fn makes happens-before the return; items run concurrently, so what they
 * write must be disjoint (or synchronised by fn). fn must not call kn_engine_run,
 * kn_linear_forward, kn_moe_forward or kn_layer_load_expert on the same engine: the pool
 * runs one job at a time, so that would deadlock. n_items = 0 returns at once. A NULL eng
 * or fn is a programming error and aborts (MR_ASSERT). */
typedef void (*kn_item_fn)(void *arg, uint32_t item, uint32_t worker);
void kn_engine_run(kn_engine *eng, uint32_t n_items, kn_item_fn fn, void *arg);

#ifdef __cplusplus
}
#endif
#endif /* KN_H */
