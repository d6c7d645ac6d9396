/*
 * backend_cuda.cu - the CUDA backend of the model runner (gpu_client/backend.h) and the
 * entry point of libmoerpc-cuda.so (gc_cuda_lib_get).
 *
 * One device, one stream (non-blocking), one cuBLAS handle bound to it: every op is
 * enqueued on that stream in call order and none of them waits for the device, except
 *   - sync (an event recorded on the stream and waited for), which then finishes the
 *     deferred host copies (to_host / route outputs staged for pageable destinations);
 *   - the weight loads (linear_load, table_new, experts_load*), which read host tensors
 *     "during the call" and wait for their own copies (loading is not the hot path);
 *   - a pinned H2D staging buffer that is full: the stream is drained once and the buffer
 *     reused (bounded; it grows to the largest per-sync need and stays).
 *
 * Memory:
 *   device   alloc/free are cudaMalloc/cudaFree (cudaFree waits for the device, as the
 *            runner frees at shutdown only). Per-op scratch (bf16 activations, attention
 *            partials, expert buffers, metadata) lives in slots grown stream-ordered
 *            (cudaFreeAsync + cudaMallocAsync), so growing never waits.
 *   weights  bf16 on the device ([n_out, n_in] row-major), f32 for KN_FMT_F32 linears;
 *            hot experts are bf16 whatever the layer's format (fp8 checkpoints are
 *            dequantized on the host, w = e4m3 * scale_inv in fp32 then rounded to bf16,
 *            as the CPU backend's bf16 layers do), one allocation per loaded expert:
 *            gate_up [2I, H] (gate rows first) | down [H, I].
 *   host     metadata (ids, seq, pos, rows, slot weights) is copied into pinned staging
 *            and uploaded before the op returns, so the caller may reuse its arrays.
 *
 * GEMMs: y[T, N] = x[T, K] W^T row-major is, in cuBLAS's column-major terms,
 * y^T (N x T, ld N) = op_T(W as K x N, ld K) * x^T (K x T, ld K): GemmEx(T, N, N, T, K).
 *
 * Threads: one thread drives a backend at a time (backend.h); every entry point makes the
 * backend's device current first, so that ranks on several devices may each run on their
 * own thread.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_client/runner/backend.h"
#include "gpu_client/runner/comm.h"
#include "gpu_client/cuda/internal.h"

/* ---- errors ---------------------------------------------------------------------------- */

static int cuda_code(cudaError_t rc) {
  switch (rc) {
  case cudaErrorMemoryAllocation: return MR_ENOMEM;
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver: return MR_ENOTSUP;
  case cudaErrorInvalidValue: return MR_EINVAL;
  default: return MR_EIO;
  }
}
/* e = "cuda <op>: <CUDA's reason>"; clears the (non-sticky) error state. */
static int cuda_fail(mr_err *e, cudaError_t rc, const char *op) {
  (void)cudaGetLastError();
  return mr_err_set(e, cuda_code(rc), "cuda %s: %s", op, cudaGetErrorString(rc));
}
static int blas_fail(mr_err *e, cublasStatus_t st, const char *op) {
  return mr_err_set(e, st == CUBLAS_STATUS_ALLOC_FAILED ? MR_ENOMEM : MR_EIO, "cuda %s: %s",
                    op, cublasGetStatusString(st));
}
#define CU_TRY(call, op)                                   \
  do {                                                     \
    cudaError_t cu_rc_ = (call);                           \
    if (cu_rc_ != cudaSuccess) return cuda_fail(e, cu_rc_, op); \
  } while (0)
#define BLAS_TRY(call, op)                                 \
  do {                                                     \
    cublasStatus_t bl_st_ = (call);                        \
    if (bl_st_ != CUBLAS_STATUS_SUCCESS) return blas_fail(e, bl_st_, op); \
  } while (0)

/* ---- the backend ----------------------------------------------------------------------- */

/* Device scratch slots, one per use, each grown on demand (stream-ordered). */
enum {
  SL_META = 0, /* uploaded metadata of the current op */
  SL_XB,       /* matmul: x in bf16 */
  SL_CONV,     /* to_host: the converted values */
  SL_ADD,      /* add_host: the host values */
  SL_ATT_O,    /* attention decode: partial outputs */
  SL_ATT_ML,   /* attention decode: partial (max, sum) */
  SL_MLA_QL,   /* MLA: W_uk^T q_nope, [T, heads, kv_lora] */
  SL_MLA_OL,   /* MLA: the weighted latent, [T, heads, kv_lora] */
  SL_RT_WORK,  /* route: scores and keys */
  SL_RT_OUT,   /* route: ids | weights */
  SL_EX_XS,    /* experts: gathered token rows, bf16 [S, H] */
  SL_EX_GU,    /* experts: gate | up, fp32 [S, 2I] */
  SL_EX_H,     /* experts: silu(g) * u, bf16 [S, I] */
  SL_EX_Y,     /* experts: each slot's down output, fp32 [S, H] */
  SL_Y2,       /* matmul (split): the GEMM over hi and lo rows, fp32 [2T, n_out] */
  SL_COUNT
};

typedef struct slot {
  void *p;
  size_t cap;
} slot;

/* Pinned host staging: one buffer, bump-allocated, reset when what was staged is known to
 * be consumed (after sync, or after draining the stream). */
typedef struct pinned {
  char *p;
  size_t cap, used;
} pinned;

/* A host copy sync finishes: dst (the caller's pageable memory) = src (pinned staging). */
typedef struct deferred {
  void *dst;
  const void *src;
  size_t bytes;
} deferred;

typedef struct cu_backend {
  gc_backend base;
  int dev;
  uint32_t max_seq;
  cudaStream_t stream;
  cublasHandle_t blas;
  cudaEvent_t done;
  slot sl[SL_COUNT];
  pinned h2d;   /* uploads and metadata */
  pinned *d2h;  /* [n_d2h] staged device-to-host results waiting for sync */
  uint32_t n_d2h;
  deferred *dq; /* [n_dq] of cap_dq */
  uint32_t n_dq, cap_dq;
  char *load;   /* pinned, CU_LOAD_CHUNK bytes: weight uploads */
  /* experts: host scratch of the counting sort */
  uint32_t *ex_cnt, *ex_off, ex_cap;
  int32_t *ex_tok, *ex_idx;
  float *ex_w;
  size_t ex_slots;
  int32_t *ex_rows; /* [2 * ex_slots]: the split's row map (cu__gather_bf16) */
  cu__qtile *tiles;
  uint32_t tiles_cap;
  bool split; /* activations as two bf16 terms (MOERPC_CUDA_ACT, default split) */
} cu_backend;

struct gc_bk_linear {
  uint32_t n_out, n_in;
  bool f32;  /* fp32 weights (KN_FMT_F32), else bf16 */
  void *w;   /* device [n_out, n_in] */
};
struct gc_bk_table {
  uint32_t rows, dim;
  bool bf16; /* bf16 as stored, else fp32 (f16 tables are widened) */
  void *data;
};
struct gc_bk_experts {
  kn_layer_desc d;
  uint16_t **w; /* [E] device: gate_up [2I, H] | down [H, I] bf16, NULL = not loaded */
};

static cu_backend *cub(gc_backend *b) { return (cu_backend *)b; }

/* Makes the backend's device current (cheap when it already is). */
static int enter(cu_backend *cb, mr_err *e) {
  CU_TRY(cudaSetDevice(cb->dev), "cudaSetDevice");
  return 0;
}

/* Slot i with at least bytes; its old content is not kept. */
static int slot_get(cu_backend *cb, int i, size_t bytes, void **out, mr_err *e) {
  slot *s = &cb->sl[i];
  if (s->cap < bytes) {
    size_t cap = s->cap + s->cap / 2;
    if (cap < bytes) cap = bytes;
    cap = (cap + 255) & ~(size_t)255;
    if (s->p) {
      CU_TRY(cudaFreeAsync(s->p, cb->stream), "cudaFreeAsync (scratch)");
      s->p = NULL;
      s->cap = 0;
    }
    CU_TRY(cudaMallocAsync(&s->p, cap, cb->stream), "cudaMallocAsync (scratch)");
    s->cap = cap;
  }
  *out = s->p;
  return 0;
}

/* Waits for everything enqueued so far (an event on the stream, not the whole device). */
static int drain(cu_backend *cb, mr_err *e) {
  CU_TRY(cudaEventRecord(cb->done, cb->stream), "cudaEventRecord");
  CU_TRY(cudaEventSynchronize(cb->done), "cudaEventSynchronize");
  return 0;
}

#define H2D_MIN_CAP ((size_t)4 << 20)

/* bytes of pinned staging for an upload enqueued now. When the buffer is full the stream
 * is drained first (the copies that read it are then done) and it is reused or grown. */
static int h2d_alloc(cu_backend *cb, size_t bytes, void **out, mr_err *e) {
  pinned *h = &cb->h2d;
  bytes = (bytes + 63) & ~(size_t)63;
  if (h->cap - h->used < bytes) {
    int rc;
    if (h->used && (rc = drain(cb, e))) return rc;
    h->used = 0;
    if (h->cap < bytes) {
      size_t cap = h->cap * 2 > bytes ? h->cap * 2 : bytes;
      if (cap < H2D_MIN_CAP) cap = H2D_MIN_CAP;
      if (h->p) CU_TRY(cudaFreeHost(h->p), "cudaFreeHost (staging)");
      h->p = NULL;
      h->cap = 0;
      CU_TRY(cudaHostAlloc((void **)&h->p, cap, cudaHostAllocPortable), "cudaHostAlloc (staging)");
      h->cap = cap;
    }
  }
  *out = h->p + h->used;
  h->used += bytes;
  return 0;
}

/* bytes of pinned staging for a device-to-host result that sync copies out. Buffers are
 * never reused before sync: a full one is kept and a new, larger one started. */
static int d2h_alloc(cu_backend *cb, size_t bytes, void **out, mr_err *e) {
  bytes = (bytes + 63) & ~(size_t)63;
  pinned *last = cb->n_d2h ? &cb->d2h[cb->n_d2h - 1] : NULL;
  if (!last || last->cap - last->used < bytes) {
    /* the size first: realloc may move the array last points into */
    size_t cap = last && last->cap * 2 > bytes ? last->cap * 2 : bytes;
    if (cap < H2D_MIN_CAP) cap = H2D_MIN_CAP;
    pinned *nd = (pinned *)mr_realloc(cb->d2h, (cb->n_d2h + 1) * sizeof *nd);
    if (!nd) return mr_err_set(e, MR_ENOMEM, "cuda to_host: out of memory");
    cb->d2h = nd;
    pinned *p = &cb->d2h[cb->n_d2h];
    p->used = 0;
    p->cap = 0;
    CU_TRY(cudaHostAlloc((void **)&p->p, cap, cudaHostAllocPortable), "cudaHostAlloc (staging)");
    p->cap = cap;
    cb->n_d2h++;
    last = p;
  }
  *out = last->p + last->used;
  last->used += bytes;
  return 0;
}

static bool is_pinned(const void *p) {
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return at.type == cudaMemoryTypeHost;
}

/* host[0..bytes) = dev[0..bytes) after the next sync: straight into the caller's memory
 * when it is pinned (an async copy), else through staging and a deferred memcpy. */
static int d2h_copy(cu_backend *cb, void *host, const void *dev, size_t bytes, mr_err *e) {
  if (!bytes) return 0;
  if (is_pinned(host)) {
    CU_TRY(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, cb->stream),
           "cudaMemcpyAsync (to host)");
    return 0;
  }
  void *st = NULL;
  int rc = d2h_alloc(cb, bytes, &st, e);
  if (rc) return rc;
  CU_TRY(cudaMemcpyAsync(st, dev, bytes, cudaMemcpyDeviceToHost, cb->stream),
         "cudaMemcpyAsync (to host)");
  if (cb->n_dq == cb->cap_dq) {
    uint32_t cap = cb->cap_dq ? 2 * cb->cap_dq : 16;
    deferred *nd = (deferred *)mr_realloc(cb->dq, cap * sizeof *nd);
    if (!nd) return mr_err_set(e, MR_ENOMEM, "cuda to_host: out of memory");
    cb->dq = nd;
    cb->cap_dq = cap;
  }
  cb->dq[cb->n_dq++] = (deferred){host, st, bytes};
  return 0;
}

/* dev[0..bytes) = host, through staging (host is read before the return). */
static int h2d_copy(cu_backend *cb, void *dev, const void *host, size_t bytes, mr_err *e) {
  if (!bytes) return 0;
  void *st = NULL;
  int rc = h2d_alloc(cb, bytes, &st, e);
  if (rc) return rc;
  memcpy(st, host, bytes);
  CU_TRY(cudaMemcpyAsync(dev, st, bytes, cudaMemcpyHostToDevice, cb->stream),
         "cudaMemcpyAsync (upload)");
  return 0;
}

/* The metadata arrays of one op, uploaded together into SL_META: item i's device copy
 * lands in *out[i]. */
typedef struct meta_item {
  const void *host;
  size_t bytes;
  void **out;
} meta_item;
static int meta_upload(cu_backend *cb, meta_item *it, int n, mr_err *e) {
  size_t total = 0;
  for (int i = 0; i < n; i++) total += (it[i].bytes + 255) & ~(size_t)255;
  if (!total) return 0;
  void *dev = NULL, *st = NULL;
  int rc;
  if ((rc = slot_get(cb, SL_META, total, &dev, e)) || (rc = h2d_alloc(cb, total, &st, e)))
    return rc;
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    if (it[i].bytes) memcpy((char *)st + off, it[i].host, it[i].bytes);
    *it[i].out = (char *)dev + off;
    off += (it[i].bytes + 255) & ~(size_t)255;
  }
  CU_TRY(cudaMemcpyAsync(dev, st, total, cudaMemcpyHostToDevice, cb->stream),
         "cudaMemcpyAsync (metadata)");
  return 0;
}

/* ---- memory ---------------------------------------------------------------------------- */

static void *cu_alloc(gc_backend *b, size_t bytes) {
  cu_backend *cb = cub(b);
  void *p = NULL;
  if (cudaSetDevice(cb->dev) != cudaSuccess || cudaMalloc(&p, bytes ? bytes : 256) != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return p;
}
static void cu_free(gc_backend *b, void *p) {
  if (!p) return;
  if (cudaSetDevice(cub(b)->dev) != cudaSuccess || cudaFree(p) != cudaSuccess) {
    (void)cudaGetLastError();
    mr_log(MR_LOG_ERROR, "cuda cudaFree(%p) failed", p);
  }
}
static void *cu_host_alloc(gc_backend *b, size_t bytes) {
  void *p = NULL;
  if (cudaSetDevice(cub(b)->dev) != cudaSuccess ||
      cudaHostAlloc(&p, bytes ? bytes : 64, cudaHostAllocPortable) != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return p;
}
static void cu_host_free(gc_backend *b, void *p) {
  (void)b;
  if (p && cudaFreeHost(p) != cudaSuccess) {
    (void)cudaGetLastError();
    mr_log(MR_LOG_ERROR, "cuda cudaFreeHost(%p) failed", p);
  }
}

static int cu_upload(gc_backend *b, float *dev, const float *host, size_t n, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  return rc ? rc : h2d_copy(cb, dev, host, n * sizeof *host, e);
}

static int cu_to_host(gc_backend *b, void *host, mr_dtype dt, const float *dev, size_t n,
                      mr_err *e) {
  cu_backend *cb = cub(b);
  int rc;
  if (dt != MR_DTYPE_F32 && dt != MR_DTYPE_BF16 && dt != MR_DTYPE_F16)
    return mr_err_set(e, MR_EINVAL, "to_host: dtype %d unknown", (int)dt);
  if ((rc = enter(cb, e))) return rc;
  if (!n) return 0;
  if (dt == MR_DTYPE_F32) return d2h_copy(cb, host, dev, n * sizeof(float), e);
  void *conv = NULL;
  if ((rc = slot_get(cb, SL_CONV, n * 2, &conv, e))) return rc;
  CU_TRY(cu__f32_to_half(conv, dt, dev, n, cb->stream), "to_host: convert");
  return d2h_copy(cb, host, conv, n * 2, e);
}

static int cu_add_host(gc_backend *b, float *dev, const float *host, size_t n, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc;
  void *tmp = NULL;
  if ((rc = enter(cb, e))) return rc;
  if (!n) return 0;
  if ((rc = slot_get(cb, SL_ADD, n * sizeof(float), &tmp, e)) ||
      (rc = h2d_copy(cb, tmp, host, n * sizeof(float), e)))
    return rc;
  CU_TRY(cu__add(dev, (const float *)tmp, n, cb->stream), "add_host: add");
  return 0;
}

static int cu_sync(gc_backend *b, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc;
  if ((rc = enter(cb, e)) || (rc = drain(cb, e))) return rc;
  for (uint32_t i = 0; i < cb->n_dq; i++) memcpy(cb->dq[i].dst, cb->dq[i].src, cb->dq[i].bytes);
  cb->n_dq = 0;
  cb->h2d.used = 0;
  /* keep the largest d2h buffer for the next round */
  if (cb->n_d2h > 1) {
    for (uint32_t i = 0; i + 1 < cb->n_d2h; i++) CU_TRY(cudaFreeHost(cb->d2h[i].p), "cudaFreeHost");
    cb->d2h[0] = cb->d2h[cb->n_d2h - 1];
    cb->n_d2h = 1;
  }
  if (cb->n_d2h) cb->d2h[0].used = 0;
  return 0;
}

static void *cu_native_stream(gc_backend *b) { return (void *)cub(b)->stream; }

/* ---- weights --------------------------------------------------------------------------- */

/* Bytes of the pinned buffer weight loads convert into (then copy and wait). */
#define CU_LOAD_CHUNK ((size_t)16 << 20)

/* dst (device; bf16, or f32 when f32) [0..n) = src (host, dtype dt) converted; when check,
 * a non-finite value is refused, named by its row and column (ncols per row, rows counted
 * from row0) and `what`. Waits for its copies. */
static int load_converted(cu_backend *cb, void *dst, bool f32, const void *src, mr_dtype dt,
                          size_t n, uint32_t ncols, uint32_t row0, bool check, const char *what,
                          mr_err *e) {
  if (dt != MR_DTYPE_F32 && dt != MR_DTYPE_BF16 && dt != MR_DTYPE_F16)
    return mr_err_set(e, MR_EINVAL, "%s: source dtype %s, must be f32, f16 or bf16", what,
                      mr_dtype_name(dt));
  if (!cb->load) {
    CU_TRY(cudaHostAlloc((void **)&cb->load, CU_LOAD_CHUNK, cudaHostAllocPortable),
           "cudaHostAlloc (load buffer)");
  }
  const size_t es = f32 ? 4 : 2, sz = mr_dtype_size(dt);
  const size_t per = CU_LOAD_CHUNK / 4 / 2; /* fp32 temp then the packed values */
  float *tmp = (float *)cb->load;
  void *pk = cb->load + per * 4;
  for (size_t i0 = 0; i0 < n; i0 += per) {
    const size_t m = n - i0 < per ? n - i0 : per;
    mr_convert_to_f32(tmp, (const char *)src + i0 * sz, dt, m);
    for (size_t i = 0; i < m; i++) {
      if (check && !isfinite(tmp[i])) {
        size_t at = i0 + i;
        return mr_err_set(e, MR_EINVAL, "%s: weight [%zu, %zu] = %g is not finite", what,
                          row0 + at / ncols, at % ncols, (double)tmp[i]);
      }
      if (f32) ((float *)pk)[i] = tmp[i];
      else ((uint16_t *)pk)[i] = mr_f32_to_bf16(tmp[i]);
    }
    CU_TRY(cudaMemcpyAsync((char *)dst + i0 * es, pk, m * es, cudaMemcpyHostToDevice, cb->stream),
           "cudaMemcpyAsync (weights)");
    int rc = drain(cb, e); /* the chunk buffer is reused next */
    if (rc) return rc;
  }
  return 0;
}

static int cu_linear_new(gc_backend *b, gc_bk_linear **out, uint32_t n_out, uint32_t n_in,
                         kn_format fmt, uint32_t group, mr_err *e) {
  cu_backend *cb = cub(b);
  (void)group;
  *out = NULL;
  if (fmt != KN_FMT_F32 && fmt != KN_FMT_BF16 && fmt != KN_FMT_F16)
    return mr_err_set(e, MR_ENOTSUP, "linear %ux%u: format %s is not supported by the cuda "
                      "backend, which keeps dense weights in bf16 (formats bf16 and f16) or f32 "
                      "(f32): use --dense-format bf16", n_out, n_in, kn_format_name(fmt));
  if (n_out < 1 || n_out > 262144 || n_in < 1 || n_in > 65536)
    return mr_err_set(e, MR_EINVAL, "linear %ux%u: n_out must be in 1..262144 and n_in in "
                      "1..65536", n_out, n_in);
  int rc = enter(cb, e);
  if (rc) return rc;
  gc_bk_linear *w = (gc_bk_linear *)mr_calloc(1, sizeof *w);
  if (!w) return mr_err_set(e, MR_ENOMEM, "linear %ux%u: out of memory", n_out, n_in);
  w->n_out = n_out;
  w->n_in = n_in;
  w->f32 = fmt == KN_FMT_F32;
  cudaError_t cr = cudaMalloc(&w->w, (size_t)n_out * n_in * (w->f32 ? 4 : 2));
  if (cr != cudaSuccess) {
    mr_free(w);
    rc = cuda_fail(e, cr, "cudaMalloc (linear weights)");
    return mr_err_prefix(e, rc, "linear %ux%u", n_out, n_in);
  }
  *out = w;
  return 0;
}

static int cu_linear_load(gc_backend *b, gc_bk_linear *w, uint32_t row0, uint32_t n_rows,
                          const void *src, mr_dtype dt, mr_err *e) {
  cu_backend *cb = cub(b);
  if (!n_rows) return 0;
  if (!w || !src) return mr_err_set(e, MR_EINVAL, "linear_load: weights and source are required");
  if ((uint64_t)row0 + n_rows > w->n_out)
    return mr_err_set(e, MR_ERANGE, "linear %ux%u: rows %u..%u go past n_out %u", w->n_out,
                      w->n_in, row0, row0 + n_rows - 1, w->n_out);
  int rc = enter(cb, e);
  if (rc) return rc;
  char what[64];
  snprintf(what, sizeof what, "linear %ux%u", w->n_out, w->n_in);
  const size_t es = w->f32 ? 4 : 2;
  return load_converted(cb, (char *)w->w + (size_t)row0 * w->n_in * es, w->f32, src, dt,
                        (size_t)n_rows * w->n_in, w->n_in, row0, true, what, e);
}

static void cu_linear_free(gc_backend *b, gc_bk_linear *w) {
  if (!w) return;
  cu_free(b, w->w);
  mr_free(w);
}
static uint64_t cu_linear_bytes(const gc_bk_linear *w) {
  return (uint64_t)w->n_out * w->n_in * (w->f32 ? 4 : 2);
}

static int cu_table_new(gc_backend *b, gc_bk_table **out, uint32_t rows, uint32_t dim,
                        const void *src, mr_dtype dt, mr_err *e) {
  cu_backend *cb = cub(b);
  *out = NULL;
  int rc = enter(cb, e);
  if (rc) return rc;
  gc_bk_table *t = (gc_bk_table *)mr_calloc(1, sizeof *t);
  if (!t) return mr_err_set(e, MR_ENOMEM, "embedding table: out of memory");
  t->rows = rows;
  t->dim = dim;
  t->bf16 = dt == MR_DTYPE_BF16;
  cudaError_t cr = cudaMalloc(&t->data, (size_t)rows * dim * (t->bf16 ? 2 : 4) + 1);
  if (cr != cudaSuccess) {
    mr_free(t);
    rc = cuda_fail(e, cr, "cudaMalloc (embedding table)");
    return mr_err_prefix(e, rc, "embedding table %ux%u", rows, dim);
  }
  if ((rc = load_converted(cb, t->data, !t->bf16, src, dt, (size_t)rows * dim, dim, 0, false,
                           "embedding table", e))) {
    cu_free(b, t->data);
    mr_free(t);
    return rc;
  }
  *out = t;
  return 0;
}
static void cu_table_free(gc_backend *b, gc_bk_table *t) {
  if (!t) return;
  cu_free(b, t->data);
  mr_free(t);
}

static int cu_experts_new(gc_backend *b, gc_bk_experts **out, const kn_layer_desc *d,
                          mr_err *e) {
  (void)b;
  *out = NULL;
  if (!d) return mr_err_set(e, MR_EINVAL, "hot experts: desc is required");
  if (d->hidden < 1 || d->hidden > 65536)
    return mr_err_set(e, MR_EINVAL, "hidden = %u, must be in 1..%u", d->hidden, 65536);
  if (d->inter < 1 || d->inter > 65536)
    return mr_err_set(e, MR_EINVAL, "inter = %u, must be in 1..%u", d->inter, 65536);
  if (d->num_experts < 1 || d->num_experts > 65536)
    return mr_err_set(e, MR_EINVAL, "num_experts = %u, must be in 1..%u", d->num_experts, 65536);
  gc_bk_experts *x = (gc_bk_experts *)mr_calloc(1, sizeof *x);
  if (!x || !(x->w = (uint16_t **)mr_calloc(d->num_experts, sizeof *x->w))) {
    mr_free(x);
    return mr_err_set(e, MR_ENOMEM, "hot experts: out of memory");
  }
  x->d = *d;
  *out = x;
  return 0;
}

/* The expert's device block, allocated on first load. */
static int expert_block(cu_backend *cb, gc_bk_experts *x, uint32_t expert, mr_err *e) {
  if (expert >= x->d.num_experts)
    return mr_err_set(e, MR_ERANGE, "expert %u, must be in 0..%u", expert, x->d.num_experts - 1);
  if (x->w[expert]) return 0;
  const size_t n = (size_t)3 * x->d.inter * x->d.hidden;
  cudaError_t cr = cudaMalloc((void **)&x->w[expert], n * 2);
  if (cr != cudaSuccess) {
    x->w[expert] = NULL;
    int rc = cuda_fail(e, cr, "cudaMalloc (expert weights)");
    return mr_err_prefix(e, rc, "expert %u", expert);
  }
  return 0;
}

/* Loads projection p (0 gate, 1 up, 2 down) of expert from host src (dtype dt). */
static int expert_load_proj(cu_backend *cb, gc_bk_experts *x, uint32_t expert, int p,
                            const void *src, mr_dtype dt, mr_err *e) {
  static const char *const nm[3] = {"gate", "up", "down"};
  const size_t I = x->d.inter, H = x->d.hidden;
  const size_t off = p == 0 ? 0 : p == 1 ? I * H : 2 * I * H;
  char what[64];
  snprintf(what, sizeof what, "expert %u %s", expert, nm[p]);
  return load_converted(cb, x->w[expert] + off, false, src, dt, I * H, p == 2 ? (uint32_t)I : (uint32_t)H,
                        0, true, what, e);
}

static int cu_experts_load(gc_backend *b, gc_bk_experts *x, uint32_t expert, const void *gate,
                           const void *up, const void *down, mr_dtype src, mr_err *e) {
  cu_backend *cb = cub(b);
  if (!x || !gate || !up || !down)
    return mr_err_set(e, MR_EINVAL, "experts_load: layer and three projections are required");
  int rc = enter(cb, e);
  if (rc || (rc = expert_block(cb, x, expert, e))) return rc;
  const void *src3[3] = {gate, up, down};
  for (int p = 0; p < 3 && !rc; p++) rc = expert_load_proj(cb, x, expert, p, src3[p], src, e);
  return rc;
}

/* F8_E4M3 checkpoint projections with their 128x128 block scales, dequantized on the host
 * as kn_layer_load_expert_st does for a bf16 layer: w = e4m3(q) * scale_inv (fp32), then
 * bf16. The checks and messages are kn's. */
static int cu_experts_load_st(gc_backend *b, gc_bk_experts *x, uint32_t expert,
                              const mr_st_tensor *const t[3], const mr_st_tensor *const scales[3],
                              mr_err *e) {
  cu_backend *cb = cub(b);
  if (!t || !t[0] || !t[1] || !t[2])
    return mr_err_set(e, MR_EINVAL, "experts_load_st: three tensors are required");
  if (!scales || !scales[0])
    return cu_experts_load(b, x, expert, t[0]->data, t[1]->data, t[2]->data, t[0]->dtype, e);
  if (!x) return mr_err_set(e, MR_EINVAL, "experts_load_st: layer is required");
  int rc = enter(cb, e);
  if (rc || (rc = expert_block(cb, x, expert, e))) return rc;
  const uint32_t H = x->d.hidden, I = x->d.inter;
  float *sc = NULL, *w = (float *)mr_malloc((size_t)I * H * sizeof *w);
  if (!w) return mr_err_set(e, MR_ENOMEM, "expert %u: out of memory for dequantization", expert);
  for (int p = 0; p < 3 && !rc; p++) {
    const mr_st_tensor *s = scales[p];
    const uint32_t N = p == 2 ? H : I, K = p == 2 ? I : H;
    const uint32_t nr = (N + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK, nc = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    const size_t n = (size_t)nr * nc;
    if (!s || (s->dtype != MR_DTYPE_F32 && s->dtype != MR_DTYPE_BF16) ||
        s->nbytes != n * mr_dtype_size(s->dtype) || !mr_st_is_f8e4m3(t[p]) ||
        t[p]->nbytes != (uint64_t)N * K) {
      rc = mr_err_set(e, MR_EFORMAT, "expert %u: tensor \"%.200s\": fp8 weights need F8_E4M3 "
                      "[%u, %u] and F32/BF16 scales [%zu] (found %s)", expert, t[p]->name, N, K,
                      n, s ? s->dtype_name : "none");
      break;
    }
    mr_free(sc);
    if (!(sc = (float *)mr_malloc(n * sizeof *sc))) {
      rc = mr_err_set(e, MR_ENOMEM, "expert %u: out of memory for scales", expert);
      break;
    }
    mr_convert_to_f32(sc, s->data, s->dtype, n);
    char what[256];
    snprintf(what, sizeof what, "tensor \"%.200s\"", s->name);
    if ((rc = kn_fp8_check_scales(sc, N, K, what, e))) break;
    const uint8_t *q = (const uint8_t *)t[p]->data;
    for (uint32_t r = 0; r < N && !rc; r++)
      for (uint32_t c = 0; c < K; c++) {
        float v = kn_fp8_e4m3_to_f32(q[(size_t)r * K + c]);
        if (v != v) {
          static const char *const nm[3] = {"gate", "up", "down"};
          rc = mr_err_set(e, MR_EINVAL, "expert %u %s[%u, %u] = nan", expert, nm[p], r, c);
          break;
        }
        w[(size_t)r * K + c] = v * sc[(size_t)(r / KN_FP8_BLOCK) * nc + c / KN_FP8_BLOCK];
      }
    if (!rc) rc = expert_load_proj(cb, x, expert, p, w, MR_DTYPE_F32, e);
  }
  mr_free(sc);
  mr_free(w);
  return rc;
}

static void cu_experts_free(gc_backend *b, gc_bk_experts *x) {
  if (!x) return;
  for (uint32_t i = 0; i < x->d.num_experts; i++) cu_free(b, x->w[i]);
  mr_free(x->w);
  mr_free(x);
}
static uint64_t cu_experts_expert_bytes(const gc_bk_experts *x) {
  return (uint64_t)3 * x->d.inter * x->d.hidden * 2;
}

/* ---- compute --------------------------------------------------------------------------- */

static const float ONE = 1.0f, ZERO = 0.0f;

static int cu_matmul(gc_backend *b, const gc_bk_linear *w, uint32_t T, const float *x,
                     const float *bias, float *y, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  if (rc || T == 0) return rc;
  const int N = (int)w->n_out, K = (int)w->n_in;
  if (w->f32) {
    BLAS_TRY(cublasSgemm(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, (int)T, K, &ONE,
                         (const float *)w->w, K, x, K, &ZERO, y, N), "matmul: cublasSgemm");
  } else if (cb->split) { /* x = hi + lo: one GEMM over 2T rows, then the fold (+ bias) */
    void *xb = NULL, *y2 = NULL;
    if ((rc = slot_get(cb, SL_XB, (size_t)2 * T * K * 2, &xb, e)) ||
        (rc = slot_get(cb, SL_Y2, (size_t)2 * T * N * sizeof(float), &y2, e)))
      return rc;
    CU_TRY(cu__split_bf16((uint16_t *)xb, x, (size_t)T * K, cb->stream), "matmul: split x");
    BLAS_TRY(cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, (int)(2 * T), K, &ONE, w->w,
                          CUDA_R_16BF, K, xb, CUDA_R_16BF, K, &ZERO, y2, CUDA_R_32F, N,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "matmul: cublasGemmEx");
    CU_TRY(cu__fold(y, (const float *)y2, (size_t)T * N, bias, (uint32_t)N, cb->stream),
           "matmul: fold");
    return 0;
  } else {
    void *xb = NULL;
    if ((rc = slot_get(cb, SL_XB, (size_t)T * K * 2, &xb, e))) return rc;
    CU_TRY(cu__f32_to_bf16((uint16_t *)xb, x, (size_t)T * K, cb->stream), "matmul: convert x");
    BLAS_TRY(cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, (int)T, K, &ONE, w->w,
                          CUDA_R_16BF, K, xb, CUDA_R_16BF, K, &ZERO, y, CUDA_R_32F, N,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "matmul: cublasGemmEx");
  }
  if (bias) CU_TRY(cu__bias_add(y, bias, T, (uint32_t)N, cb->stream), "matmul: bias");
  return 0;
}

static int cu_embed(gc_backend *b, const gc_bk_table *t, uint32_t T, const int32_t *ids,
                    float *out, mr_err *e) {
  cu_backend *cb = cub(b);
  for (uint32_t i = 0; i < T; i++)
    if (ids[i] < 0 || (uint32_t)ids[i] >= t->rows)
      return mr_err_set(e, MR_ERANGE, "embed: ids[%u] = %d, must be in 0..%u", i, ids[i],
                        t->rows - 1);
  int rc = enter(cb, e);
  if (rc || !T) return rc;
  void *dids = NULL;
  meta_item it[] = {{ids, T * sizeof *ids, &dids}};
  if ((rc = meta_upload(cb, it, 1, e))) return rc;
  CU_TRY(cu__embed(out, t->data, t->bf16, t->dim, (const int32_t *)dids, T, cb->stream), "embed");
  return 0;
}

static int cu_rmsnorm(gc_backend *b, uint32_t rows, uint32_t dim, const float *x, size_t ldx,
                      const float *w, float eps, float *y, size_t ldy, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  if (rc) return rc;
  CU_TRY(cu__rmsnorm(y, ldy, x, ldx, w, rows, dim, eps, cb->stream), "rmsnorm");
  return 0;
}

static int cu_rope(gc_backend *b, const gc_bk_rope *r, mr_err *e) {
  cu_backend *cb = cub(b);
  if (r->dim % 2 || r->offset + r->dim > r->head_stride)
    return mr_err_set(e, MR_EINVAL, "rope: %u dims at offset %u of heads of %u floats, must be "
                      "even and inside the head", r->dim, r->offset, r->head_stride);
  int rc = enter(cb, e);
  if (rc || !r->n_tokens) return rc;
  void *dpos = NULL;
  meta_item it[] = {{r->pos, r->n_tokens * sizeof *r->pos, &dpos}};
  if ((rc = meta_upload(cb, it, 1, e))) return rc;
  CU_TRY(cu__rope(r->x, r->ld, r->n_tokens, r->n_heads, r->head_stride, r->offset, r->dim,
                  r->interleave, r->scale, (const uint32_t *)dpos, r->inv_freq, cb->stream),
         "rope");
  return 0;
}

/* Tokens per call from which attention runs the tiled prefill kernel. */
#define CU_PREFILL_MIN_T 8u

static int cu_attention(gc_backend *b, const gc_bk_attn *a, mr_err *e) {
  cu_backend *cb = cub(b);
  const uint32_t T = a->n_tokens, hd = a->head_dim, kvw = a->n_kv_heads * hd;
  if (a->n_kv_heads == 0 || a->n_heads % a->n_kv_heads)
    return mr_err_set(e, MR_EINVAL, "attention: %u heads over %u kv heads", a->n_heads,
                      a->n_kv_heads);
  if (a->n_heads > 65535) /* a grid dimension */
    return mr_err_set(e, MR_EINVAL, "attention: %u heads, at most 65535", a->n_heads);
  if (hd < 1 || hd > 8192)
    return mr_err_set(e, MR_EINVAL, "attention: head_dim %u, must be in 1..8192", hd);
  uint32_t max_pos = 0;
  for (uint32_t t = 0; t < T; t++) {
    if (a->pos[t] >= a->max_seq)
      return mr_err_set(e, MR_ERANGE, "attention: token %u at position %u, must be < max_seq %u",
                        t, a->pos[t], a->max_seq);
    if (a->pos[t] > max_pos) max_pos = a->pos[t];
  }
  int rc = enter(cb, e);
  if (rc || !T) return rc;
  const bool prefill = T >= CU_PREFILL_MIN_T && hd <= CU_PREFILL_MAX_HD;
  uint32_t n_tiles = 0;
  if (prefill) {
    /* tiles of up to QT tokens of one sequence slot, in token order */
    if (cb->tiles_cap < T) {
      cu__qtile *nt = (cu__qtile *)mr_realloc(cb->tiles, T * sizeof *nt);
      if (!nt) return mr_err_set(e, MR_ENOMEM, "attention: out of memory for %u tiles", T);
      cb->tiles = nt;
      cb->tiles_cap = T;
    }
    for (uint32_t t = 0; t < T; t++) {
      const uint32_t p = a->pos[t];
      const uint32_t first = a->window && p + 1 > a->window ? p + 1 - a->window : 0;
      cu__qtile *tl = n_tiles ? &cb->tiles[n_tiles - 1] : NULL;
      if (tl && tl->n < CU_PREFILL_QT && a->seq[tl->t0] == a->seq[t]) {
        tl->n++;
        if (first < tl->kmin) tl->kmin = first;
        if (p > tl->kmax) tl->kmax = p;
      } else {
        cb->tiles[n_tiles++] = (cu__qtile){t, 1, first, p};
      }
    }
  }
  void *dseq = NULL, *dpos = NULL, *dtiles = NULL;
  meta_item it[] = {{a->seq, T * sizeof *a->seq, &dseq},
                    {a->pos, T * sizeof *a->pos, &dpos},
                    {cb->tiles, n_tiles * sizeof *cb->tiles, &dtiles}};
  if ((rc = meta_upload(cb, it, prefill ? 3 : 2, e))) return rc;
  CU_TRY(cu__cache_store(a->k_cache, a->k, a->ld, kvw, (const uint32_t *)dseq,
                         (const uint32_t *)dpos, a->max_seq, T, cb->stream), "attention: store k");
  CU_TRY(cu__cache_store(a->v_cache, a->v, a->ld, kvw, (const uint32_t *)dseq,
                         (const uint32_t *)dpos, a->max_seq, T, cb->stream), "attention: store v");
  cu__attn_args ar = {T, a->n_heads, a->n_kv_heads, hd, a->max_seq, a->window, max_pos,
                      a->scale, a->q, a->ld, a->k_cache, a->v_cache, (const uint32_t *)dseq,
                      (const uint32_t *)dpos, a->out};
  if (prefill) {
    CU_TRY(cu__attn_prefill(&ar, (const cu__qtile *)dtiles, n_tiles, cb->stream),
           "attention: prefill kernel");
    return 0;
  }
  const size_t items = (size_t)T * a->n_heads * (max_pos / CU_ATTN_CHUNK + 1);
  void *po = NULL, *pml = NULL;
  if ((rc = slot_get(cb, SL_ATT_O, items * hd * sizeof(float), &po, e)) ||
      (rc = slot_get(cb, SL_ATT_ML, items * 2 * sizeof(float), &pml, e)))
    return rc;
  CU_TRY(cu__attn_decode(&ar, (float *)po, (float *)pml, cb->stream), "attention: decode kernel");
  return 0;
}

static int cu_mla_attention(gc_backend *b, const gc_bk_mla *a, mr_err *e) {
  cu_backend *cb = cub(b);
  const uint32_t T = a->n_tokens, R = a->kv_lora, nh = a->n_heads, lw = R + a->rope;
  const uint32_t qh = a->nope + a->rope;
  if (nh < 1 || nh > 65535) /* a grid dimension */
    return mr_err_set(e, MR_EINVAL, "mla attention: %u heads, must be in 1..65535", nh);
  if (R < 1 || R > CU_MLA_MAX_R || a->rope > 1024)
    return mr_err_set(e, MR_ENOTSUP, "mla attention: kv_lora_rank %u and rope %u, the cuda "
                      "backend takes kv_lora_rank 1..%u and rope <= 1024", R, a->rope, CU_MLA_MAX_R);
  for (uint32_t t = 0; t < T; t++)
    if (a->pos[t] >= a->max_seq)
      return mr_err_set(e, MR_ERANGE, "mla attention: token %u at position %u, must be < "
                        "max_seq %u", t, a->pos[t], a->max_seq);
  int rc = enter(cb, e);
  if (rc || !T) return rc;
  void *dseq = NULL, *dpos = NULL, *ql = NULL, *ol = NULL;
  meta_item it[] = {{a->seq, T * sizeof *a->seq, &dseq}, {a->pos, T * sizeof *a->pos, &dpos}};
  if ((rc = meta_upload(cb, it, 2, e)) ||
      (rc = slot_get(cb, SL_MLA_QL, (size_t)T * nh * R * sizeof(float), &ql, e)) ||
      (rc = slot_get(cb, SL_MLA_OL, (size_t)T * nh * R * sizeof(float), &ol, e)))
    return rc;
  CU_TRY(cu__cache_store(a->cache, a->kv, a->ldkv, lw, (const uint32_t *)dseq,
                         (const uint32_t *)dpos, a->max_seq, T, cb->stream), "mla: store latent");
  const long long wstride = (long long)(a->nope + a->v_dim) * R;
  /* q_lat[t, h, :] = W_uk_h^T q_nope[t, h]: column-major C (R x T, ld nh R) =
   * W_uk_h (R x nope, ld R; row-major [nope, R]) * q_nope (nope x T, ld ldq) */
  if (a->nope)
    BLAS_TRY(cublasSgemmStridedBatched(cb->blas, CUBLAS_OP_N, CUBLAS_OP_N, (int)R, (int)T,
                                       (int)a->nope, &ONE, a->w_kv_b, (int)R, wstride, a->q,
                                       (int)a->ldq, (long long)qh, &ZERO, (float *)ql,
                                       (int)(nh * R), (long long)R, (int)nh),
             "mla: cublasSgemmStridedBatched (W_uk^T q)");
  else
    CU_TRY(cudaMemsetAsync(ql, 0, (size_t)T * nh * R * sizeof(float), cb->stream), "mla: zero");
  CU_TRY(cu__mla_core((float *)ol, (const float *)ql, a->q, a->ldq, qh, a->nope, a->rope, R, nh,
                      a->cache, a->max_seq, (const uint32_t *)dseq, (const uint32_t *)dpos, T,
                      a->scale, cb->stream), "mla: attention kernel");
  /* out[t, h, :] = W_uv_h o_lat[t, h]: column-major C (v x T, ld nh v) =
   * op_T(W_uv_h as R x v, ld R; row-major [v, R]) * o_lat (R x T, ld nh R) */
  BLAS_TRY(cublasSgemmStridedBatched(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)a->v_dim, (int)T,
                                     (int)R, &ONE, a->w_kv_b + (size_t)a->nope * R, (int)R,
                                     wstride, (const float *)ol, (int)(nh * R), (long long)R,
                                     &ZERO, a->out, (int)(nh * a->v_dim), (long long)a->v_dim,
                                     (int)nh),
           "mla: cublasSgemmStridedBatched (W_uv o)");
  return 0;
}

static int cu_silu_mul(gc_backend *b, uint32_t T, uint32_t n, const float *gu, float *h,
                       mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  if (rc) return rc;
  CU_TRY(cu__silu_mul(h, gu, T, n, cb->stream), "silu_mul");
  return 0;
}

static int cu_zero(gc_backend *b, float *dev, size_t n, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  if (rc || !n) return rc;
  CU_TRY(cudaMemsetAsync(dev, 0, n * sizeof *dev, cb->stream), "zero: cudaMemsetAsync");
  return 0;
}

static int cu_gather_rows(gc_backend *b, float *dst, const float *src, uint32_t dim,
                          const uint32_t *rows, uint32_t n, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  if (rc || !n) return rc;
  void *drows = NULL;
  meta_item it[] = {{rows, n * sizeof *rows, &drows}};
  if ((rc = meta_upload(cb, it, 1, e))) return rc;
  CU_TRY(cu__gather_rows(dst, src, dim, (const uint32_t *)drows, n, cb->stream), "gather_rows");
  return 0;
}

static int cu_add(gc_backend *b, float *y, const float *x, size_t n, mr_err *e) {
  cu_backend *cb = cub(b);
  int rc = enter(cb, e);
  if (rc) return rc;
  CU_TRY(cu__add(y, x, n, cb->stream), "add");
  return 0;
}

static int cu_route(gc_backend *b, const gc_bk_route *r, mr_err *e) {
  cu_backend *cb = cub(b);
  const uint32_t E = r->num_experts, k = r->top_k, T = r->n_tokens;
  int rc0 = gc_bk_route_check(r, e);
  if (rc0) return rc0;
  int rc = enter(cb, e);
  if (rc || !T) return rc;
  void *work = NULL, *outb = NULL;
  const size_t TK = (size_t)T * k;
  if ((rc = slot_get(cb, SL_RT_WORK, (size_t)T * 2 * E * sizeof(float), &work, e)) ||
      (rc = slot_get(cb, SL_RT_OUT, TK * 8, &outb, e)))
    return rc;
  cu__route_args ra = {T, E, k, r->norm_topk, r->scoring == MR_SCORE_SIGMOID,
                       r->method == MR_TOPK_NOAUX_TC, r->bias, r->n_group, r->topk_group,
                       r->scale, r->logits, (float *)work, (int32_t *)outb,
                       (float *)outb + TK};
  CU_TRY(cu__route(&ra, cb->stream), "route kernel");
  if ((rc = d2h_copy(cb, r->ids, outb, TK * sizeof(int32_t), e))) return rc;
  return d2h_copy(cb, r->weights, (float *)outb + TK, TK * sizeof(float), e);
}

/* Grows the experts' host scratch to E experts and TK slots. */
static int ex_scratch(cu_backend *cb, uint32_t E, size_t TK, mr_err *e) {
  if (cb->ex_cap < E) {
    uint32_t *c = (uint32_t *)mr_realloc(cb->ex_cnt, (size_t)E * sizeof *c);
    if (c) cb->ex_cnt = c;
    uint32_t *o = c ? (uint32_t *)mr_realloc(cb->ex_off, ((size_t)E + 1) * sizeof *o) : NULL;
    if (o) cb->ex_off = o;
    if (!c || !o) return mr_err_set(e, MR_ENOMEM, "experts: out of memory");
    cb->ex_cap = E;
  }
  if (cb->ex_slots < TK) {
    int32_t *t = (int32_t *)mr_realloc(cb->ex_tok, TK * sizeof *t);
    if (t) cb->ex_tok = t;
    int32_t *ix = t ? (int32_t *)mr_realloc(cb->ex_idx, TK * sizeof *ix) : NULL;
    if (ix) cb->ex_idx = ix;
    float *w = ix ? (float *)mr_realloc(cb->ex_w, TK * sizeof *w) : NULL;
    if (w) cb->ex_w = w;
    int32_t *r = w ? (int32_t *)mr_realloc(cb->ex_rows, 2 * TK * sizeof *r) : NULL;
    if (r) cb->ex_rows = r;
    if (!t || !ix || !w || !r) return mr_err_set(e, MR_ENOMEM, "experts: out of memory");
    cb->ex_slots = TK;
  }
  return 0;
}

/* Hot experts: the (token, slot) pairs grouped by expert on the host (counting sort over
 * the experts in increasing id, pairs in (token, slot) order), then on the stream:
 *   xs[s]   = bf16(in[tok[s]])                        (gather)
 *   gu[s]   = xs[s] W_gu_e^T    per expert e: one GEMM over its rows
 *   h[s]    = bf16(silu(g) * u)
 *   y[s]    = h[s] W_down_e^T   per expert e
 *   out[t]  = sum_j w[t, j] y[idx[t, j]]  in slot order, no atomics (combine) */
static int cu_experts(gc_backend *b, const gc_bk_experts *x, uint32_t T, uint32_t k,
                      const int32_t *ids, const float *w, const float *in, float *out,
                      mr_err *e) {
  cu_backend *cb = cub(b);
  const uint32_t E = x->d.num_experts, H = x->d.hidden, I = x->d.inter;
  if (T && (k < 1 || k > GC_ROUTE_MAX_TOP_K))
    return mr_err_set(e, MR_EINVAL, "top_k = %u, must be in 1..%u", k, GC_ROUTE_MAX_TOP_K);
  const size_t TK = (size_t)T * k;
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t j = 0; j < k; j++) {
      int32_t id = ids[(size_t)t * k + j];
      if (id == -1) continue;
      if (id < -1 || (uint32_t)id >= E)
        return mr_err_set(e, MR_ERANGE, "expert_ids[token %u, slot %u] = %d, must be -1 (empty) "
                          "or in 0..%u", t, j, id, E - 1);
      if (!x->w[id])
        return mr_err_set(e, MR_EPRECOND, "expert %d (token %u, slot %u) is not held here", id,
                          t, j);
      if (!isfinite(w[(size_t)t * k + j]))
        return mr_err_set(e, MR_EINVAL, "weights[token %u, slot %u] = %g, must be finite", t, j,
                          (double)w[(size_t)t * k + j]);
    }
  int rc = enter(cb, e);
  if (rc || !T) return rc;
  if ((rc = ex_scratch(cb, E, TK, e))) return rc;
  uint32_t *cnt = cb->ex_cnt, *off = cb->ex_off;
  memset(cnt, 0, (size_t)E * sizeof *cnt);
  for (size_t i = 0; i < TK; i++)
    if (ids[i] >= 0) cnt[ids[i]]++;
  off[0] = 0;
  for (uint32_t i = 0; i < E; i++) off[i + 1] = off[i] + cnt[i];
  const uint32_t S = off[E];
  if (S == 0) {
    CU_TRY(cudaMemsetAsync(out, 0, (size_t)T * H * sizeof *out, cb->stream), "experts: zero");
    return 0;
  }
  memcpy(cnt, off, (size_t)E * sizeof *cnt); /* cnt = the next free row of each expert */
  for (size_t i = 0; i < TK; i++) {
    const int32_t id = ids[i];
    if (id < 0) {
      cb->ex_idx[i] = -1;
      cb->ex_w[i] = 0.0f;
      continue;
    }
    const uint32_t s = cnt[id]++;
    cb->ex_tok[s] = (int32_t)(i / k);
    cb->ex_idx[i] = (int32_t)s;
    cb->ex_w[i] = w[i];
  }
  /* the split's row map: expert e's 2n rows start at 2 off[e], hi rows then lo rows */
  const uint32_t R = cb->split ? 2 : 1; /* GEMM rows per slot */
  if (cb->split)
    for (uint32_t id = 0; id < E; id++)
      for (uint32_t s = off[id]; s < off[id + 1]; s++) {
        cb->ex_rows[s] = (int32_t)(s + off[id]);
        cb->ex_rows[S + s] = (int32_t)(s + off[id + 1]);
      }
  void *dtok = NULL, *didx = NULL, *dw = NULL, *drows = NULL, *xs = NULL, *gu = NULL,
       *hb = NULL, *y = NULL;
  meta_item it[] = {{cb->ex_tok, S * sizeof(int32_t), &dtok},
                    {cb->ex_idx, TK * sizeof(int32_t), &didx},
                    {cb->ex_w, TK * sizeof(float), &dw},
                    {cb->ex_rows, 2 * (size_t)S * sizeof(int32_t), &drows}};
  if ((rc = meta_upload(cb, it, cb->split ? 4 : 3, e)) ||
      (rc = slot_get(cb, SL_EX_XS, (size_t)R * S * H * 2, &xs, e)) ||
      (rc = slot_get(cb, SL_EX_GU, (size_t)R * S * 2 * I * sizeof(float), &gu, e)) ||
      (rc = slot_get(cb, SL_EX_H, (size_t)R * S * I * 2, &hb, e)) ||
      (rc = slot_get(cb, SL_EX_Y, (size_t)R * S * H * sizeof(float), &y, e)))
    return rc;
  const int32_t *rows = cb->split ? (const int32_t *)drows : NULL;
  CU_TRY(cu__gather_bf16((uint16_t *)xs, in, (const int32_t *)dtok, rows, S, H, cb->stream),
         "experts: gather");
  for (uint32_t id = 0; id < E; id++) {
    const uint32_t n = off[id + 1] - off[id], r0 = R * off[id];
    if (!n) continue;
    BLAS_TRY(cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)(2 * I), (int)(R * n),
                          (int)H, &ONE, x->w[id], CUDA_R_16BF, (int)H,
                          (uint16_t *)xs + (size_t)r0 * H, CUDA_R_16BF, (int)H, &ZERO,
                          (float *)gu + (size_t)r0 * 2 * I, CUDA_R_32F, (int)(2 * I),
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             "experts: cublasGemmEx (gate_up)");
  }
  CU_TRY(cu__ex_silu_mul((uint16_t *)hb, (const float *)gu, rows, S, I, cb->stream),
         "experts: silu_mul");
  for (uint32_t id = 0; id < E; id++) {
    const uint32_t n = off[id + 1] - off[id], r0 = R * off[id];
    if (!n) continue;
    BLAS_TRY(cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)H, (int)(R * n), (int)I,
                          &ONE, x->w[id] + (size_t)2 * I * H, CUDA_R_16BF, (int)I,
                          (uint16_t *)hb + (size_t)r0 * I, CUDA_R_16BF, (int)I, &ZERO,
                          (float *)y + (size_t)r0 * H, CUDA_R_32F, (int)H,
                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             "experts: cublasGemmEx (down)");
  }
  CU_TRY(cu__moe_combine(out, (const float *)y, (const int32_t *)didx, (const float *)dw, rows,
                         S, T, k, H, cb->stream), "experts: combine");
  return 0;
}

/* ---- lifetime -------------------------------------------------------------------------- */

static void cu_destroy(gc_backend *b) {
  cu_backend *cb = cub(b);
  if (!cb) return;
  if (cudaSetDevice(cb->dev) == cudaSuccess && cb->stream) {
    for (int i = 0; i < SL_COUNT; i++)
      if (cb->sl[i].p) (void)cudaFreeAsync(cb->sl[i].p, cb->stream);
    (void)cudaStreamSynchronize(cb->stream);
  }
  if (cb->blas) cublasDestroy(cb->blas);
  if (cb->done) cudaEventDestroy(cb->done);
  if (cb->stream) cudaStreamDestroy(cb->stream);
  if (cb->h2d.p) cudaFreeHost(cb->h2d.p);
  for (uint32_t i = 0; i < cb->n_d2h; i++) cudaFreeHost(cb->d2h[i].p);
  if (cb->load) cudaFreeHost(cb->load);
  (void)cudaGetLastError();
  mr_free(cb->d2h);
  mr_free(cb->dq);
  mr_free(cb->ex_cnt);
  mr_free(cb->ex_off);
  mr_free(cb->ex_tok);
  mr_free(cb->ex_idx);
  mr_free(cb->ex_w);
  mr_free(cb->ex_rows);
  mr_free(cb->tiles);
  mr_free(cb);
}

static const gc_bk_ops cuda_ops = {
    "cuda",
    cu_destroy,
    cu_native_stream,
    cu_alloc,
    cu_free,
    cu_host_alloc,
    cu_host_free,
    cu_upload,
    cu_to_host,
    cu_add_host,
    cu_sync,
    cu_linear_new,
    cu_linear_load,
    nullptr, /* linear_borrow: weights are copied to the device */
    nullptr, /* linear_load_fp8: dense weights are kept in bf16 or f32 (FP8 ones dequantized) */
    nullptr, /* linear_borrow_fp8: the same */
    cu_linear_free,
    cu_linear_bytes,
    cu_table_new,
    nullptr, /* table_borrow: the same */
    cu_table_free,
    cu_experts_new,
    cu_experts_load,
    cu_experts_load_st,
    nullptr, /* experts_borrow_st: experts are copied to the device */
    cu_experts_free,
    cu_experts_expert_bytes,
    cu_matmul,
    cu_embed,
    cu_rmsnorm,
    cu_rope,
    cu_attention,
    cu_mla_attention,
    cu_silu_mul,
    cu_zero,
    cu_gather_rows,
    cu_add,
    cu_route,
    cu_experts,
    false, /* host_memory: device buffers are GPU memory */
};

/* ---- the library's table --------------------------------------------------------------- */

static int cu_device_count(mr_err *e) {
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc == cudaErrorNoDevice || rc == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();
    /* not an error: the reason rides along for a caller that prints it */
    mr_err_set(e, 0, "cuda: no CUDA device (%s)", cudaGetErrorString(rc));
    return 0;
  }
  if (rc != cudaSuccess) return cuda_fail(e, rc, "cudaGetDeviceCount");
  return n;
}

static int cu_device_name(int dev, char *buf, size_t n, mr_err *e) {
  cudaDeviceProp p;
  int drv = 0, rt = 0;
  CU_TRY(cudaGetDeviceProperties(&p, dev), "cudaGetDeviceProperties");
  CU_TRY(cudaDriverGetVersion(&drv), "cudaDriverGetVersion");
  CU_TRY(cudaRuntimeGetVersion(&rt), "cudaRuntimeGetVersion");
  snprintf(buf, n, "cuda:%d %s, %.1f GiB, sm_%d%d, driver %d.%d, runtime %d.%d", dev, p.name,
           (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), p.major, p.minor, drv / 1000,
           (drv % 1000) / 10, rt / 1000, (rt % 1000) / 10);
  return 0;
}

static int cu_backend_new(gc_backend **out, int dev, kn_engine *eng, uint32_t max_seq,
                          mr_err *e) {
  *out = NULL;
  int n = cu_device_count(e);
  if (n < 0) return n;
  if (n == 0) return mr_err_set(e, MR_ENOTSUP, "backend cuda: no CUDA device on this host");
  if (dev < 0 || dev >= n)
    return mr_err_set(e, MR_ERANGE, "cuda device %d: this host has %d (0..%d)", dev, n, n - 1);
  cu_backend *cb = (cu_backend *)mr_calloc(1, sizeof *cb);
  if (!cb) return mr_err_set(e, MR_ENOMEM, "cuda backend: out of memory");
  cb->base.ops = &cuda_ops;
  cb->base.eng = eng;
  cb->dev = dev;
  cb->max_seq = max_seq;
  /* Activations into the tensor cores: "split" (default) as two bf16 terms, about fp32
   * accuracy (whole-model logits within 6e-6 of the CPU backend's fp32 paths on an H200)
   * for twice the GEMM columns and one fold kernel per matmul: all-local decode of a
   * 4-layer Qwen3-30B-A3B shape 0.83-0.95x of "bf16", which rounds them once, as SGLang
   * and vLLM do (about 2^-9 per element, 1e-2 over a test model). */
  const char *act = getenv("MOERPC_CUDA_ACT");
  if (act && *act && strcmp(act, "split") != 0 && strcmp(act, "bf16") != 0) {
    mr_free(cb);
    return mr_err_set(e, MR_EINVAL, "MOERPC_CUDA_ACT = '%s': must be split or bf16", act);
  }
  cb->split = !(act && strcmp(act, "bf16") == 0);
  int rc = 0;
  cudaError_t cr;
  cublasStatus_t st;
  if ((cr = cudaSetDevice(dev)) != cudaSuccess) rc = cuda_fail(e, cr, "cudaSetDevice");
  else if ((cr = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking)) != cudaSuccess)
    rc = cuda_fail(e, cr, "cudaStreamCreateWithFlags");
  else if ((cr = cudaEventCreateWithFlags(&cb->done, cudaEventDisableTiming)) != cudaSuccess)
    rc = cuda_fail(e, cr, "cudaEventCreate");
  else if ((st = cublasCreate(&cb->blas)) != CUBLAS_STATUS_SUCCESS)
    rc = blas_fail(e, st, "cublasCreate");
  else if ((st = cublasSetStream(cb->blas, cb->stream)) != CUBLAS_STATUS_SUCCESS)
    rc = blas_fail(e, st, "cublasSetStream");
  else if ((st = cublasSetMathMode(cb->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS)
    rc = blas_fail(e, st, "cublasSetMathMode"); /* fp32 GEMMs stay fp32 (no TF32) */
  if (rc) {
    cu_destroy(&cb->base);
    return rc;
  }
  char name[256];
  if (cu_device_name(dev, name, sizeof name, NULL) == 0)
    mr_log(MR_LOG_INFO, "backend cuda: %s, activations %s", name,
           cb->split ? "split into two bf16 terms (about fp32)" : "bf16");
  *out = &cb->base;
  return 0;
}

extern "C" __attribute__((visibility("default"))) int gc_cuda_lib_get(gc_cuda_lib *lib, mr_err *e) {
  if (!lib) return mr_err_set(e, MR_EINVAL, "gc_cuda_lib_get: lib is required");
  memset(lib, 0, sizeof *lib);
  lib->abi = GC_CUDA_ABI;
  lib->device_count = cu_device_count;
  lib->device_name = cu_device_name;
  lib->backend_new = cu_backend_new;
  lib->comm_nccl_new = cu__comm_nccl_new;
  return 0;
}
