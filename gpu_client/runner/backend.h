/*
 * backend.h - the compute backend of the model runner (prefix gc_bk_): the dense parts of a
 * decoder (projections, norms, RoPE, attention, SiLU*mul, routing) and the hot experts,
 * behind one table of functions so that the runner (gc_model.c) is the same code on the
 * CPU and on a GPU.
 *
 * Memory model. A backend computes on "device" buffers it allocates (gc_bk_ops.alloc): fp32
 * activations, the KV cache, norm weights. Weights live in backend objects (gc_bk_linear,
 * gc_bk_experts) packed at load from host tensors. Host memory for RPC staging comes from
 * host_alloc (pinned on a GPU). Small per-token metadata (ids, positions, sequence slots,
 * slot weights) is passed as HOST arrays; a device backend copies what it needs.
 *
 * Ordering. Every compute call is ordered after the previous ones (one stream). Calls that
 * write host memory (to_host, route) are asynchronous on a device: their host outputs are
 * valid after sync(); on the CPU backend everything is synchronous and sync() is a no-op.
 * The runner's per-layer sequence for a MoE layer is the contract a device backend is
 * built for:
 *
 *   norm -> route (logits -> top-k ids/weights into host memory) -> to_host (the hidden
 *   states in the wire dtype, into pinned host memory) -> sync -> RPCs start (host thread)
 *   -> experts (hot, on the device, overlapping the RPCs) -> wait for the replies ->
 *   add_host (the cold sum, copied in and added on the stream).
 *
 * Errors: int functions return 0 or a negative MR_E* code with e naming the op and limit.
 * Threads: a backend is driven by one thread at a time (the runner's).
 *
 * Implementations: gc_bk_cpu_new (gc_backend_cpu.c: kn kernels on the engine's pool), and
 * the CUDA backend of libmoerpc-cuda.so (kernels/cuda/: cuBLAS and CUDA C on one stream),
 * loaded at run time (gc_cuda_lib_load below). gc_bk_open picks one by name.
 */
#ifndef GC_BACKEND_H
#define GC_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mr.h"
#include "kernels/kn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gc_backend gc_backend;
typedef struct gc_bk_linear gc_bk_linear;   /* y = x W^T, W [n_out, n_in] */
typedef struct gc_bk_table gc_bk_table;     /* an embedding table [rows, dim] */
typedef struct gc_bk_experts gc_bk_experts; /* the hot experts of one MoE layer */

/* One attention call over the tokens of a step (any mix of sequences and positions). */
typedef struct gc_bk_attn {
  uint32_t n_tokens;        /* T */
  const uint32_t *seq;      /* [T] host: KV slot of each token (< slots of the cache) */
  const uint32_t *pos;      /* [T] host: its position; keys 0..pos of its slot are used */
  uint32_t n_heads, n_kv_heads, head_dim;
  uint32_t max_seq;         /* positions per KV slot */
  uint32_t window;          /* sliding window in positions (keys pos-window+1..pos), 0 = none */
  float scale;              /* applied to q.k (head_dim^-0.5) */
  const float *q;           /* [T, n_heads * head_dim], row stride ld */
  const float *k, *v;       /* [T, n_kv_heads * head_dim] new keys / values, row stride ld */
  size_t ld;                /* row stride of q, k, v in floats */
  float *k_cache, *v_cache; /* [slots, max_seq, n_kv_heads * head_dim] of this layer */
  float *out;               /* [T, n_heads * head_dim], contiguous */
} gc_bk_attn;

/* MLA attention (DeepSeek-V2/V3, Kimi-K2) over a cache of compressed latents: a token
 * caches c = kv_a_layernorm(its kv_lora_rank latent) and its rotated shared key k_rot, not
 * the expanded K/V. The absorbed form (docs/DESIGN.md section 18): with kv_b_proj's rows of
 * head h split into W_uk [nope, kv_lora] and W_uv [v, kv_lora],
 *   score(t, s) = scale * ((W_uk^T q_nope) . c_s + q_rot . k_rot_s)
 *   out_h(t)    = W_uv (sum_s p(t, s) c_s)
 * which is q.k and p.v of the expanded keys and values without forming them. */
typedef struct gc_bk_mla {
  uint32_t n_tokens;        /* T */
  const uint32_t *seq, *pos;/* [T] host, as in gc_bk_attn */
  uint32_t n_heads, nope, rope, v_dim, kv_lora;
  uint32_t max_seq;
  float scale;              /* softmax scale ((nope + rope)^-0.5, times yarn's mscale^2) */
  const float *q;           /* [T, n_heads * (nope + rope)], rope parts rotated; stride ldq */
  size_t ldq;
  const float *kv;          /* [T, kv_lora + rope]: c (normed) | k_rot (rotated); stride ldkv */
  size_t ldkv;
  const float *w_kv_b;      /* device [n_heads * (nope + v), kv_lora] fp32 (kv_b_proj) */
  float *cache;             /* [slots, max_seq, kv_lora + rope] of this layer */
  float *out;               /* [T, n_heads * v], contiguous */
} gc_bk_mla;

/* RoPE on one part of every head of T rows. */
typedef struct gc_bk_rope {
  uint32_t n_tokens, n_heads;
  uint32_t head_stride;     /* floats from one head to the next */
  uint32_t offset;          /* of the rotated part inside a head */
  uint32_t dim;             /* rotated floats, even; inv_freq has dim / 2 */
  bool interleave;          /* rotate pairs (2i, 2i+1) in place instead of (i, i + dim/2):
                             * DeepSeek's rope_interleave, whose dot products are the same */
  float scale;              /* cos and sin are multiplied by it (yarn's attention factor) */
  float *x;                 /* device, rows of stride ld */
  size_t ld;
  const uint32_t *pos;      /* [T] host */
  const float *inv_freq;    /* [dim / 2] device */
} gc_bk_rope;

/* Limits of route: top_k (every released MoE is <= 8) and n_group (DeepSeek-V3: 8). */
#define GC_ROUTE_MAX_TOP_K 64u
#define GC_ROUTE_MAX_GROUPS 1024u

/* Routing rule of a MoE layer's router. */
typedef struct gc_bk_route {
  uint32_t n_tokens, num_experts, top_k;
  bool norm_topk;           /* divide the k weights by their sum (+1e-20 with sigmoid) */
  mr_score_func scoring;    /* softmax or sigmoid of the logits */
  mr_topk_method method;    /* GREEDY or NOAUX_TC (mr.h) */
  const float *bias;        /* NOAUX_TC: [E] device, e_score_correction_bias (selection only) */
  uint32_t n_group, topk_group; /* NOAUX_TC groups (1, 1 = ungrouped) */
  float scale;              /* routed_scaling_factor, multiplied into the k weights */
  const float *logits;      /* [T, E] device */
  int32_t *ids;             /* [T, k] host out: expert ids by decreasing weight */
  float *weights;           /* [T, k] host out */
} gc_bk_route;

/* The checks every backend's route makes before computing (shared so that they refuse the
 * same things): top_k 1..E and <= GC_ROUTE_MAX_TOP_K; NOAUX_TC groups that divide E and
 * can hold top_k; a known method. 0, MR_ERANGE or MR_ENOTSUP naming the values. */
static inline int gc_bk_route_check(const gc_bk_route *r, mr_err *e) {
  const uint32_t E = r->num_experts, k = r->top_k;
  if (k == 0 || k > E || k > GC_ROUTE_MAX_TOP_K)
    return mr_err_set(e, MR_ERANGE, "route: top_k = %u, must be 1..%u and <= %u", k, E,
                      GC_ROUTE_MAX_TOP_K);
  if (r->method == MR_TOPK_NOAUX_TC &&
      (r->n_group == 0 || r->n_group > GC_ROUTE_MAX_GROUPS || E % r->n_group ||
       r->topk_group == 0 || r->topk_group > r->n_group ||
       (uint64_t)r->topk_group * (E / r->n_group) < k))
    return mr_err_set(e, MR_ERANGE, "route: %u experts in %u groups keeping %u, top_k %u", E,
                      r->n_group, r->topk_group, k);
  if (r->method != MR_TOPK_GREEDY && r->method != MR_TOPK_NOAUX_TC)
    return mr_err_set(e, MR_ENOTSUP, "route: topk method %d", (int)r->method);
  return 0;
}

typedef struct gc_bk_ops {
  const char *name; /* "cpu", "cuda" */
  void (*destroy)(gc_backend *b);
  /* The native queue the ops are ordered on (a cudaStream_t), for a device communicator
   * (comm.h); NULL on the CPU backend. */
  void *(*native_stream)(gc_backend *b);

  /* -- memory ------------------------------------------------------------------------ */
  void *(*alloc)(gc_backend *b, size_t bytes);      /* device memory, NULL when out */
  void (*free)(gc_backend *b, void *p);
  void *(*host_alloc)(gc_backend *b, size_t bytes); /* pinned host memory for staging */
  void (*host_free)(gc_backend *b, void *p);
  /* dev[0..n) = host (fp32); host is read before the call returns. */
  int (*upload)(gc_backend *b, float *dev, const float *host, size_t n, mr_err *e);
  /* host (dtype dt, n elements) = dev converted; valid after sync. */
  int (*to_host)(gc_backend *b, void *host, mr_dtype dt, const float *dev, size_t n, mr_err *e);
  /* dev[0..n) += host[0..n) (fp32); host is read before the call returns. */
  int (*add_host)(gc_backend *b, float *dev, const float *host, size_t n, mr_err *e);
  int (*sync)(gc_backend *b, mr_err *e);

  /* -- weights (src: host tensors of dtype src, read during the call) ---------------- */
  int (*linear_new)(gc_backend *b, gc_bk_linear **out, uint32_t n_out, uint32_t n_in,
                    kn_format fmt, uint32_t group, mr_err *e);
  /* Rows [row0, row0 + n_rows) of W from src ([n_rows, n_in]); concatenates tensors. */
  int (*linear_load)(gc_backend *b, gc_bk_linear *w, uint32_t row0, uint32_t n_rows,
                     const void *src, mr_dtype dt, mr_err *e);
  /* Optional (NULL: the backend cannot): W served in place, without a copy: the n_parts
   * row bands w[i] (rows[i] rows of n_in elements of dtype dt) stacked in order, which
   * stay mapped and unchanged while the linear lives (cpu: kn_linear_borrow); MR_ENOTSUP
   * where the dtype, an alignment or the placement does not allow it (then linear_new and
   * linear_load). The linear's format is dt's. */
  int (*linear_borrow)(gc_backend *b, gc_bk_linear **out, uint32_t n_parts, const void *const *w,
                       const uint32_t *rows, uint32_t n_in, mr_dtype dt, mr_err *e);
  /* Optional (NULL: the backend keeps no FP8 dense weights; the runner then dequantizes
   * an FP8 checkpoint's): rows [row0, row0 + n_rows) of an fp8-b128 linear (linear_new with
   * KN_FMT_FP8) from e4m3fn codes q ([n_rows, n_in]), rows first_row .. of a tensor whose
   * fp32 block scales are scale_inv ([ceil(rows / 128), ceil(n_in / 128)]); cpu:
   * kn_linear_load_rows_fp8. */
  int (*linear_load_fp8)(gc_backend *b, gc_bk_linear *w, uint32_t row0, uint32_t n_rows,
                         const uint8_t *q, const float *scale_inv, uint32_t first_row, mr_err *e);
  /* Optional: linear_borrow for FP8 codes (cpu: kn_linear_borrow_fp8): the bands q[i] stay
   * mapped; scale_inv[i] is read during the call only. */
  int (*linear_borrow_fp8)(gc_backend *b, gc_bk_linear **out, uint32_t n_parts, const uint8_t *const *q,
                           const uint32_t *rows, uint32_t n_in, const float *const *scale_inv,
                           const uint32_t *first_row, mr_err *e);
  void (*linear_free)(gc_backend *b, gc_bk_linear *w);
  uint64_t (*linear_bytes)(const gc_bk_linear *w);
  int (*table_new)(gc_backend *b, gc_bk_table **out, uint32_t rows, uint32_t dim,
                   const void *src, mr_dtype dt, mr_err *e);
  /* Optional (NULL: the backend cannot): the table served in place from src, which stays
   * mapped and unchanged while the table lives; MR_ENOTSUP where dt is not what the
   * backend keeps (cpu: bf16 and f32; then table_new). */
  int (*table_borrow)(gc_backend *b, gc_bk_table **out, uint32_t rows, uint32_t dim,
                      const void *src, mr_dtype dt, mr_err *e);
  void (*table_free)(gc_backend *b, gc_bk_table *t);
  int (*experts_new)(gc_backend *b, gc_bk_experts **out, const kn_layer_desc *d, mr_err *e);
  int (*experts_load)(gc_backend *b, gc_bk_experts *x, uint32_t expert, const void *gate,
                      const void *up, const void *down, mr_dtype src, mr_err *e);
  /* The same from checkpoint tensors (t[gate, up, down], and for F8_E4M3 ones their block
   * scales; scales NULL or scales[p] NULL for float tensors): kn_layer_load_expert_st. */
  int (*experts_load_st)(gc_backend *b, gc_bk_experts *x, uint32_t expert,
                         const mr_st_tensor *const t[3], const mr_st_tensor *const scales[3],
                         mr_err *e);
  /* Optional (NULL: the backend cannot): serves expert in place from checkpoint tensors
   * t[gate, up, down] (and an FP8 checkpoint's block scales, as experts_load_st) that stay
   * mapped and unchanged while x lives (kn_layer_borrow_expert_st); MR_ENOTSUP where the
   * format or layout does not allow it. */
  int (*experts_borrow_st)(gc_backend *b, gc_bk_experts *x, uint32_t expert,
                           const mr_st_tensor *const t[3], const mr_st_tensor *const scales[3],
                           mr_err *e);
  void (*experts_free)(gc_backend *b, gc_bk_experts *x);
  uint64_t (*experts_expert_bytes)(const gc_bk_experts *x);

  /* -- compute ------------------------------------------------------------------------ */
  /* y[T, n_out] = x[T, n_in] W^T (+ bias[n_out] when bias is not NULL; bias on device). */
  int (*matmul)(gc_backend *b, const gc_bk_linear *w, uint32_t T, const float *x,
                const float *bias, float *y, mr_err *e);
  /* out[t, :] = table[ids[t], :] (fp32); ids host, each < rows (checked by the caller). */
  int (*embed)(gc_backend *b, const gc_bk_table *t, uint32_t T, const int32_t *ids, float *out,
               mr_err *e);
  /* y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w, r < rows, rows of dim floats at
   * strides ldx / ldy (y may equal x). */
  int (*rmsnorm)(gc_backend *b, uint32_t rows, uint32_t dim, const float *x, size_t ldx,
                 const float *w, float eps, float *y, size_t ldy, mr_err *e);
  /* RoPE in place (see gc_bk_rope; rotate-half unless interleave). */
  int (*rope)(gc_backend *b, const gc_bk_rope *r, mr_err *e);
  /* Stores k / v at (seq, pos) in the cache, then causal attention (see gc_bk_attn). */
  int (*attention)(gc_backend *b, const gc_bk_attn *a, mr_err *e);
  /* Stores each token's latent at (seq, pos), then causal MLA attention (gc_bk_mla). */
  int (*mla_attention)(gc_backend *b, const gc_bk_mla *a, mr_err *e);
  /* h[t, i] = silu(gu[t, i]) * gu[t, n + i], i < n (gate columns first, then up). */
  int (*silu_mul)(gc_backend *b, uint32_t T, uint32_t n, const float *gu, float *h, mr_err *e);
  /* dev[0..n) = 0 */
  int (*zero)(gc_backend *b, float *dev, size_t n, mr_err *e);
  /* dst[i, :] = src[rows[i], :], i < n, rows of dim floats (rows host). */
  int (*gather_rows)(gc_backend *b, float *dst, const float *src, uint32_t dim,
                     const uint32_t *rows, uint32_t n, mr_err *e);
  /* y[0..n) += x[0..n) */
  int (*add)(gc_backend *b, float *y, const float *x, size_t n, mr_err *e);
  /* Scores (softmax or sigmoid), top-k (grouped with NOAUX_TC; ties: lower id first),
   * optional renormalisation, times scale; host out (gc_bk_route). */
  int (*route)(gc_backend *b, const gc_bk_route *r, mr_err *e);
  /* out[T, H] (fp32, overwritten) = sum over slots with ids >= 0 of w * expert(x); every
   * non-negative id must be loaded in x (ids / w host [T, k]). */
  int (*experts)(gc_backend *b, const gc_bk_experts *x, uint32_t T, uint32_t k,
                 const int32_t *ids, const float *w, const float *in, float *out, mr_err *e);

  /* -- properties --------------------------------------------------------------------- */
  /* Device buffers (alloc) are host memory (cpu): the loader writes weights it converts
   * (kv_b_proj's fp32 copy) straight into them instead of staging and uploading. */
  bool host_memory;
} gc_bk_ops;

struct gc_backend {
  const gc_bk_ops *ops;
  kn_engine *eng; /* the CPU kernel engine (also used by the client library's local part) */
};

/* The CPU backend over eng (not owned; must outlive the backend). max_seq sizes the
 * attention scratch. MR_ENOMEM only. Free with b->ops->destroy(b). */
int gc_bk_cpu_new(gc_backend **out, kn_engine *eng, uint32_t max_seq, mr_err *e);

/* ---- the CUDA backend: libmoerpc-cuda.so (kernels/cuda/), loaded at run time ------------
 *
 * The client binaries do not link CUDA: `--backend cuda` dlopens libmoerpc-cuda.so, so that
 * one build runs on hosts with and without a GPU. The library exports the symbols below
 * (GC_CUDA_ABI checks that both sides were built from the same header). */
#define GC_CUDA_ABI 2u
typedef struct gc_comm gc_comm;
typedef struct gc_cuda_lib {
  uint32_t abi; /* GC_CUDA_ABI */
  /* CUDA devices visible (0 when none), or a negative MR_E* with e naming the CUDA error. */
  int (*device_count)(mr_err *e);
  /* One line naming device dev (model, memory, compute capability, driver/runtime). */
  int (*device_name)(int dev, char *buf, size_t n, mr_err *e);
  /* The backend on device dev (its own stream, cuBLAS handle, pinned staging); eng (not
   * owned) serves host-side work such as packing. MR_ENOTSUP "no CUDA device" when none. */
  int (*backend_new)(gc_backend **out, int dev, kn_engine *eng, uint32_t max_seq, mr_err *e);
  /* The NCCL communicator over devs[0..n) of this process (comm.h), one rank per device. */
  int (*comm_nccl_new)(gc_comm **out, uint32_t n, const int *devs, mr_err *e);
} gc_cuda_lib;
/* The library's entry point: fills *lib (the symbol gc_cuda_lib_get). */
typedef int (*gc_cuda_lib_get_fn)(gc_cuda_lib *lib, mr_err *e);

/* Loads libmoerpc-cuda.so once per process: $MOERPC_CUDA_LIB if set, else lib/ beside the
 * running binary's bin/ (build/lib, or PREFIX/lib), else the loader's search path. On
 * failure (MR_ENOTSUP) e says which file was tried and dlerror's reason, and that a build
 * without nvcc has no CUDA backend. Thread-safe; the library stays loaded. */
int gc_cuda_lib_load(const gc_cuda_lib **out, mr_err *e);

/* The backend named by name ("cpu" or "cuda") on device dev (cuda only). MR_EINVAL for an
 * unknown name; cuda: gc_cuda_lib_load's errors, then backend_new's. */
int gc_bk_open(gc_backend **out, const char *name, int dev, kn_engine *eng, uint32_t max_seq,
               mr_err *e);

#ifdef __cplusplus
}
#endif
#endif /* GC_BACKEND_H */
