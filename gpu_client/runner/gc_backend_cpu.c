/*
 * gc_backend_cpu.c - the CPU backend of the model runner (backend.h).
 *
 * "Device" memory is host memory. Projections and lm_head are kn_linear (the kernels'
 * packed layouts and per-ISA GEMV/GEMM, which stream weights near the memory-bandwidth
 * limit at decode); hot experts are kn_layer + kn_moe_forward; everything else (norms,
 * RoPE, attention, routing) is plain fp32 C, parallel over rows or (token, head) items on
 * the same engine's workers through kn_engine_run, so that one pool of threads serves the
 * whole process. All calls are synchronous; sync is a no-op.
 *
 * Attention scratch: each worker gets max_seq floats for one (token, head)'s scores, so
 * the per-call working set is bounded whatever T is.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gpu_client/runner/backend.h"

typedef struct cpu_backend {
  gc_backend base;
  uint32_t max_seq;
  uint32_t n_workers;
  float *scores; /* [n_workers, max_seq] attention scratch */
  float *mla;    /* [n_workers, 2 * mla_lora] MLA scratch (q_lat, o_lat), grown on use */
  uint32_t mla_lora;
  float *route_buf; /* [2 * route_cap] noaux_tc scores */
  uint32_t route_cap;
  mr_arena scratch;
} cpu_backend;

struct gc_bk_linear {
  kn_linear *lin;
};
struct gc_bk_table {
  uint32_t rows, dim;
  mr_dtype dt; /* f32 or bf16 (f16 tables are widened to f32) */
  void *data;
  bool borrowed; /* data is the caller's (table_borrow): not freed here */
};
struct gc_bk_experts {
  kn_layer *L;
};

static cpu_backend *cpu(gc_backend *b) { return (cpu_backend *)b; }

/* Rows per parallel item for the elementwise ops: big enough to amortise the claim. */
#define CPU_ROWS_MIN_ITEM_FLOATS 4096u

/* ---- memory ------------------------------------------------------------------------------ */

static void *cpu_alloc(gc_backend *b, size_t bytes) {
  (void)b;
  return mr_malloc_aligned(bytes ? bytes : 64, 64);
}
static void cpu_free(gc_backend *b, void *p) {
  (void)b;
  mr_free_aligned(p);
}
static int cpu_upload(gc_backend *b, float *dev, const float *host, size_t n, mr_err *e) {
  (void)b, (void)e;
  if (dev != host) memcpy(dev, host, n * sizeof *dev);
  return 0;
}
static int cpu_to_host(gc_backend *b, void *host, mr_dtype dt, const float *dev, size_t n,
                       mr_err *e) {
  (void)b;
  if (!mr_dtype_size(dt)) return mr_err_set(e, MR_EINVAL, "to_host: dtype %d unknown", (int)dt);
  mr_convert_from_f32(host, dt, dev, n);
  return 0;
}
static int cpu_add_host(gc_backend *b, float *dev, const float *host, size_t n, mr_err *e) {
  (void)b, (void)e;
  for (size_t i = 0; i < n; i++) dev[i] += host[i];
  return 0;
}
static int cpu_sync(gc_backend *b, mr_err *e) {
  (void)b, (void)e;
  return 0;
}

/* ---- weights ----------------------------------------------------------------------------- */

static int cpu_linear_new(gc_backend *b, gc_bk_linear **out, uint32_t n_out, uint32_t n_in,
                          kn_format fmt, uint32_t group, mr_err *e) {
  gc_bk_linear *w = mr_calloc(1, sizeof *w);
  if (!w) return mr_err_set(e, MR_ENOMEM, "linear %ux%u: out of memory", n_out, n_in);
  int rc = kn_linear_new(&w->lin, b->eng, n_out, n_in, fmt, group, e);
  if (rc) {
    mr_free(w);
    return rc;
  }
  *out = w;
  return 0;
}
static int cpu_linear_load(gc_backend *b, gc_bk_linear *w, uint32_t row0, uint32_t n_rows,
                           const void *src, mr_dtype dt, mr_err *e) {
  (void)b;
  return kn_linear_load_rows(w->lin, row0, n_rows, src, dt, e);
}
static int cpu_linear_borrow(gc_backend *b, gc_bk_linear **out, uint32_t n_parts,
                             const void *const *w, const uint32_t *rows, uint32_t n_in, mr_dtype dt,
                             mr_err *e) {
  gc_bk_linear *x = mr_calloc(1, sizeof *x);
  if (!x) return mr_err_set(e, MR_ENOMEM, "linear in place: out of memory");
  int rc = kn_linear_borrow(&x->lin, b->eng, n_parts, w, rows, n_in, dt, e);
  if (rc) {
    mr_free(x);
    return rc;
  }
  *out = x;
  return 0;
}
static int cpu_linear_load_fp8(gc_backend *b, gc_bk_linear *w, uint32_t row0, uint32_t n_rows,
                               const uint8_t *q, const float *scale_inv, uint32_t first_row, mr_err *e) {
  (void)b;
  return kn_linear_load_rows_fp8(w->lin, row0, n_rows, q, scale_inv, first_row, e);
}
static int cpu_linear_borrow_fp8(gc_backend *b, gc_bk_linear **out, uint32_t n_parts,
                                 const uint8_t *const *q, const uint32_t *rows, uint32_t n_in,
                                 const float *const *scale_inv, const uint32_t *first_row, mr_err *e) {
  gc_bk_linear *x = mr_calloc(1, sizeof *x);
  if (!x) return mr_err_set(e, MR_ENOMEM, "linear in place: out of memory");
  int rc = kn_linear_borrow_fp8(&x->lin, b->eng, n_parts, q, rows, n_in, scale_inv, first_row, e);
  if (rc) {
    mr_free(x);
    return rc;
  }
  *out = x;
  return 0;
}
static void cpu_linear_free(gc_backend *b, gc_bk_linear *w) {
  (void)b;
  if (!w) return;
  kn_linear_free(w->lin);
  mr_free(w);
}
static uint64_t cpu_linear_bytes(const gc_bk_linear *w) { return kn_linear_bytes(w->lin); }

static int cpu_table_new(gc_backend *b, gc_bk_table **out, uint32_t rows, uint32_t dim,
                         const void *src, mr_dtype dt, mr_err *e) {
  (void)b;
  gc_bk_table *t = mr_calloc(1, sizeof *t);
  if (!t) return mr_err_set(e, MR_ENOMEM, "embedding table: out of memory");
  t->rows = rows;
  t->dim = dim;
  t->dt = dt == MR_DTYPE_BF16 ? MR_DTYPE_BF16 : MR_DTYPE_F32;
  size_t n = (size_t)rows * dim;
  t->data = mr_malloc_aligned(n * mr_dtype_size(t->dt), 64);
  if (!t->data) {
    mr_free(t);
    return mr_err_set(e, MR_ENOMEM, "embedding table %ux%u: out of memory", rows, dim);
  }
  if (dt == t->dt) memcpy(t->data, src, n * mr_dtype_size(dt));
  else mr_convert_to_f32(t->data, src, dt, n);
  *out = t;
  return 0;
}
static int cpu_table_borrow(gc_backend *b, gc_bk_table **out, uint32_t rows, uint32_t dim,
                            const void *src, mr_dtype dt, mr_err *e) {
  (void)b;
  if (dt != MR_DTYPE_BF16 && dt != MR_DTYPE_F32)
    return mr_err_set(e, MR_ENOTSUP, "embedding table of %s: kept as f32 (widened), not in place",
                      mr_dtype_name(dt));
  if ((uintptr_t)src % mr_dtype_size(dt))
    return mr_err_set(e, MR_ENOTSUP, "embedding table at %p is not %zu-byte aligned: not in place",
                      src, mr_dtype_size(dt));
  gc_bk_table *t = mr_calloc(1, sizeof *t);
  if (!t) return mr_err_set(e, MR_ENOMEM, "embedding table: out of memory");
  *t = (gc_bk_table){.rows = rows, .dim = dim, .dt = dt, .data = (void *)src, .borrowed = true};
  *out = t;
  return 0;
}
static void cpu_table_free(gc_backend *b, gc_bk_table *t) {
  (void)b;
  if (!t) return;
  if (!t->borrowed) mr_free_aligned(t->data);
  mr_free(t);
}

static int cpu_experts_new(gc_backend *b, gc_bk_experts **out, const kn_layer_desc *d,
                           mr_err *e) {
  gc_bk_experts *x = mr_calloc(1, sizeof *x);
  if (!x) return mr_err_set(e, MR_ENOMEM, "hot experts: out of memory");
  int rc = kn_layer_new(&x->L, b->eng, d, e);
  if (rc) {
    mr_free(x);
    return rc;
  }
  *out = x;
  return 0;
}
static int cpu_experts_load(gc_backend *b, gc_bk_experts *x, uint32_t expert, const void *gate,
                            const void *up, const void *down, mr_dtype src, mr_err *e) {
  (void)b;
  return kn_layer_load_expert(x->L, expert, gate, up, down, src, e);
}
static int cpu_experts_load_st(gc_backend *b, gc_bk_experts *x, uint32_t expert,
                               const mr_st_tensor *const t[3],
                               const mr_st_tensor *const scales[3], mr_err *e) {
  (void)b;
  return kn_layer_load_expert_st(x->L, expert, t, scales, e);
}
static int cpu_experts_borrow_st(gc_backend *b, gc_bk_experts *x, uint32_t expert,
                                 const mr_st_tensor *const t[3],
                                 const mr_st_tensor *const scales[3], mr_err *e) {
  (void)b;
  return kn_layer_borrow_expert_st(x->L, expert, t, scales, e);
}
static void cpu_experts_free(gc_backend *b, gc_bk_experts *x) {
  (void)b;
  if (!x) return;
  kn_layer_free(x->L);
  mr_free(x);
}
static uint64_t cpu_experts_expert_bytes(const gc_bk_experts *x) {
  return kn_layer_expert_bytes(x->L);
}

/* ---- compute ----------------------------------------------------------------------------- */

static int cpu_matmul(gc_backend *b, const gc_bk_linear *w, uint32_t T, const float *x,
                      const float *bias, float *y, mr_err *e) {
  cpu_backend *cb = cpu(b);
  int rc = kn_linear_forward(b->eng, w->lin, T, x, y, &cb->scratch, e);
  mr_arena_reset(&cb->scratch);
  if (rc || !bias) return rc;
  const uint32_t N = kn_linear_n_out(w->lin);
  for (uint32_t t = 0; t < T; t++) {
    float *r = y + (size_t)t * N;
    for (uint32_t i = 0; i < N; i++) r[i] += bias[i];
  }
  return 0;
}

static int cpu_embed(gc_backend *b, const gc_bk_table *t, uint32_t T, const int32_t *ids,
                     float *out, mr_err *e) {
  (void)b;
  for (uint32_t i = 0; i < T; i++) {
    if (ids[i] < 0 || (uint32_t)ids[i] >= t->rows)
      return mr_err_set(e, MR_ERANGE, "embed: ids[%u] = %d, must be in 0..%u", i, ids[i],
                        t->rows - 1);
    size_t off = (size_t)ids[i] * t->dim;
    if (t->dt == MR_DTYPE_F32)
      memcpy(out + (size_t)i * t->dim, (const float *)t->data + off, t->dim * sizeof *out);
    else
      mr_convert_to_f32(out + (size_t)i * t->dim, (const uint16_t *)t->data + off, t->dt, t->dim);
  }
  return 0;
}

/* Elementwise ops run over row blocks on the pool. */
typedef struct rows_job {
  uint32_t rows, per_item;
  void (*row)(const struct rows_job *j, uint32_t r);
  uint32_t dim;
  const float *x, *w;
  size_t ldx, ldy;
  float *y;
  float eps;
  /* rope */
  const gc_bk_rope *rp;
  /* silu_mul */
  const float *gu;
} rows_job;

static void rows_item(void *arg, uint32_t item, uint32_t worker) {
  (void)worker;
  const rows_job *j = arg;
  uint32_t r0 = item * j->per_item, r1 = r0 + j->per_item;
  if (r1 > j->rows) r1 = j->rows;
  for (uint32_t r = r0; r < r1; r++) j->row(j, r);
}

static void rows_run(gc_backend *b, rows_job *j, uint32_t floats_per_row) {
  if (j->rows == 0) return;
  uint32_t per = floats_per_row ? CPU_ROWS_MIN_ITEM_FLOATS / floats_per_row : 1;
  j->per_item = per ? per : 1;
  uint32_t items = (j->rows + j->per_item - 1) / j->per_item;
  if (items == 1) {
    rows_item(j, 0, 0); /* not worth waking the pool */
    return;
  }
  kn_engine_run(b->eng, items, rows_item, j);
}

static void rmsnorm_row(const rows_job *j, uint32_t r) {
  const float *x = j->x + (size_t)r * j->ldx;
  float *y = j->y + (size_t)r * j->ldy;
  double ss = 0; /* fp64 sum: the mean of squares is exact to fp32 whatever dim is */
  for (uint32_t i = 0; i < j->dim; i++) ss += (double)x[i] * x[i];
  float inv = (float)(1.0 / sqrt(ss / j->dim + (double)j->eps));
  for (uint32_t i = 0; i < j->dim; i++) y[i] = (x[i] * inv) * j->w[i];
}

static int cpu_rmsnorm(gc_backend *b, uint32_t rows, uint32_t dim, const float *x, size_t ldx,
                       const float *w, float eps, float *y, size_t ldy, mr_err *e) {
  (void)e;
  rows_job j = {.rows = rows, .row = rmsnorm_row, .dim = dim, .x = x, .w = w, .ldx = ldx,
                .ldy = ldy, .y = y, .eps = eps};
  rows_run(b, &j, dim);
  return 0;
}

static void rope_row(const rows_job *j, uint32_t t) {
  const gc_bk_rope *r = j->rp;
  const uint32_t half = r->dim / 2;
  const float p = (float)r->pos[t];
  float *row = r->x + (size_t)t * r->ld + r->offset;
  /* pair i: (i, i + half) rotate-half, or (2i, 2i + 1) interleaved */
  const uint32_t lo_step = r->interleave ? 2 : 1, hi_off = r->interleave ? 1 : half;
  for (uint32_t i = 0; i < half; i++) {
    /* transformers forms the angle in fp32 (inv_freq * position) and then takes cos/sin,
     * scaling both by the attention factor */
    float ang = p * r->inv_freq[i];
    float c = (float)cos((double)ang) * r->scale, s = (float)sin((double)ang) * r->scale;
    for (uint32_t h = 0; h < r->n_heads; h++) {
      float *x = row + (size_t)h * r->head_stride + (size_t)i * lo_step;
      float a = x[0], bb = x[hi_off];
      x[0] = a * c - bb * s;
      x[hi_off] = bb * c + a * s;
    }
  }
}

static int cpu_rope(gc_backend *b, const gc_bk_rope *r, mr_err *e) {
  if (r->dim % 2 || r->offset + r->dim > r->head_stride)
    return mr_err_set(e, MR_EINVAL, "rope: %u dims at offset %u of heads of %u floats, must be "
                      "even and inside the head", r->dim, r->offset, r->head_stride);
  rows_job j = {.rows = r->n_tokens, .row = rope_row, .rp = r};
  rows_run(b, &j, r->n_heads * r->dim);
  return 0;
}

static float silu(float g) { return g / (1.0f + expf(-g)); }

static void silu_mul_row(const rows_job *j, uint32_t t) {
  const float *g = j->gu + (size_t)t * 2 * j->dim, *u = g + j->dim;
  float *h = j->y + (size_t)t * j->dim;
  for (uint32_t i = 0; i < j->dim; i++) h[i] = silu(g[i]) * u[i];
}

static int cpu_silu_mul(gc_backend *b, uint32_t T, uint32_t n, const float *gu, float *h,
                        mr_err *e) {
  (void)e;
  rows_job j = {.rows = T, .row = silu_mul_row, .dim = n, .gu = gu, .y = h};
  rows_run(b, &j, 2 * n);
  return 0;
}

static int cpu_zero(gc_backend *b, float *dev, size_t n, mr_err *e) {
  (void)b, (void)e;
  memset(dev, 0, n * sizeof *dev);
  return 0;
}

static int cpu_gather_rows(gc_backend *b, float *dst, const float *src, uint32_t dim,
                           const uint32_t *rows, uint32_t n, mr_err *e) {
  (void)b, (void)e;
  for (uint32_t i = 0; i < n; i++)
    memcpy(dst + (size_t)i * dim, src + (size_t)rows[i] * dim, dim * sizeof *dst);
  return 0;
}

static int cpu_add(gc_backend *b, float *y, const float *x, size_t n, mr_err *e) {
  (void)b, (void)e;
  for (size_t i = 0; i < n; i++) y[i] += x[i];
  return 0;
}

/* ---- attention --------------------------------------------------------------------------- */

/* Dot product and axpy on GCC vector types: 4 lanes, which every x86-64 has (SSE2), so that
 * this file needs no per-ISA build and still runs the inner loops 4 x 4 wide. Four
 * accumulators keep the adds independent. The order of the sum differs from a serial loop
 * by rounding only (checked against the reference in test_gc_model.c). */
typedef float v4f __attribute__((vector_size(16), aligned(4), may_alias));

static inline float dot_f32(const float *a, const float *b, uint32_t n) {
  v4f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += *(const v4f *)(a + i) * *(const v4f *)(b + i);
    s1 += *(const v4f *)(a + i + 4) * *(const v4f *)(b + i + 4);
    s2 += *(const v4f *)(a + i + 8) * *(const v4f *)(b + i + 8);
    s3 += *(const v4f *)(a + i + 12) * *(const v4f *)(b + i + 12);
  }
  v4f s = (s0 + s1) + (s2 + s3);
  float r = (s[0] + s[1]) + (s[2] + s[3]);
  for (; i < n; i++) r += a[i] * b[i];
  return r;
}

/* y[0..n) += w * x[0..n) */
static inline void axpy_f32(float *y, float w, const float *x, uint32_t n) {
  uint32_t i = 0;
  const v4f wv = {w, w, w, w};
  for (; i + 8 <= n; i += 8) {
    *(v4f *)(y + i) += wv * *(const v4f *)(x + i);
    *(v4f *)(y + i + 4) += wv * *(const v4f *)(x + i + 4);
  }
  for (; i < n; i++) y[i] += w * x[i];
}

typedef struct attn_job {
  const gc_bk_attn *a;
  cpu_backend *cb;
} attn_job;

/* One (token, head): scores over the keys of its slot, softmax, weighted sum of values. */
static void attn_item(void *arg, uint32_t item, uint32_t worker) {
  const attn_job *j = arg;
  const gc_bk_attn *a = j->a;
  const uint32_t t = item / a->n_heads, h = item % a->n_heads;
  const uint32_t hd = a->head_dim, kvw = a->n_kv_heads * hd;
  const uint32_t g = h / (a->n_heads / a->n_kv_heads); /* the kv head this q head reads */
  const uint32_t pos = a->pos[t];
  const uint32_t first = a->window && pos + 1 > a->window ? pos + 1 - a->window : 0;
  const size_t slot = (size_t)a->seq[t] * a->max_seq;
  const float *q = a->q + (size_t)t * a->ld + (size_t)h * hd;
  const float *kc = a->k_cache + slot * kvw + g * hd;
  const float *vc = a->v_cache + slot * kvw + g * hd;
  float *sc = j->cb->scores + (size_t)worker * j->cb->max_seq;
  float mx = -INFINITY;
  for (uint32_t p = first; p <= pos; p++) {
    float s = dot_f32(q, kc + (size_t)p * kvw, hd) * a->scale;
    sc[p - first] = s;
    if (s > mx) mx = s;
  }
  double sum = 0;
  for (uint32_t p = first; p <= pos; p++) {
    float w = expf(sc[p - first] - mx);
    sc[p - first] = w;
    sum += w;
  }
  const float inv = (float)(1.0 / sum);
  float *o = a->out + (size_t)t * a->n_heads * hd + (size_t)h * hd;
  for (uint32_t i = 0; i < hd; i++) o[i] = 0;
  for (uint32_t p = first; p <= pos; p++) axpy_f32(o, sc[p - first] * inv, vc + (size_t)p * kvw, hd);
}

static int cpu_attention(gc_backend *b, const gc_bk_attn *a, mr_err *e) {
  cpu_backend *cb = cpu(b);
  const uint32_t kvw = a->n_kv_heads * a->head_dim;
  if (a->n_kv_heads == 0 || a->n_heads % a->n_kv_heads)
    return mr_err_set(e, MR_EINVAL, "attention: %u heads over %u kv heads", a->n_heads,
                      a->n_kv_heads);
  if (a->max_seq > cb->max_seq)
    return mr_err_set(e, MR_ERANGE, "attention: max_seq %u exceeds the backend's %u",
                      a->max_seq, cb->max_seq);
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    if (a->pos[t] >= a->max_seq)
      return mr_err_set(e, MR_ERANGE, "attention: token %u at position %u, must be < max_seq %u",
                        t, a->pos[t], a->max_seq);
    size_t at = ((size_t)a->seq[t] * a->max_seq + a->pos[t]) * kvw;
    memcpy(a->k_cache + at, a->k + (size_t)t * a->ld, kvw * sizeof(float));
    memcpy(a->v_cache + at, a->v + (size_t)t * a->ld, kvw * sizeof(float));
  }
  attn_job j = {.a = a, .cb = cb};
  uint32_t items = a->n_tokens * a->n_heads;
  if (items == 1) attn_item(&j, 0, 0);
  else kn_engine_run(b->eng, items, attn_item, &j);
  return 0;
}

typedef struct mla_job {
  const gc_bk_mla *a;
  cpu_backend *cb;
} mla_job;

/* One (token, head) of MLA in the absorbed form (backend.h gc_bk_mla). */
static void mla_item(void *arg, uint32_t item, uint32_t worker) {
  const mla_job *j = arg;
  const gc_bk_mla *a = j->a;
  const uint32_t t = item / a->n_heads, h = item % a->n_heads;
  const uint32_t R = a->kv_lora, lw = R + a->rope, qh = a->nope + a->rope;
  const uint32_t pos = a->pos[t];
  const float *cache = a->cache + (size_t)a->seq[t] * a->max_seq * lw;
  const float *q = a->q + (size_t)t * a->ldq + (size_t)h * qh;
  const float *w = a->w_kv_b + (size_t)h * (a->nope + a->v_dim) * R; /* W_uk, then W_uv */
  float *sc = j->cb->scores + (size_t)worker * j->cb->max_seq;
  float *q_lat = j->cb->mla + (size_t)worker * 2 * R, *o_lat = q_lat + R;
  /* q_lat = W_uk^T q_nope */
  for (uint32_t r = 0; r < R; r++) q_lat[r] = 0;
  for (uint32_t i = 0; i < a->nope; i++) axpy_f32(q_lat, q[i], w + (size_t)i * R, R);
  float mx = -INFINITY;
  for (uint32_t p = 0; p <= pos; p++) {
    const float *l = cache + (size_t)p * lw;
    float s = (dot_f32(q_lat, l, R) + dot_f32(q + a->nope, l + R, a->rope)) * a->scale;
    sc[p] = s;
    if (s > mx) mx = s;
  }
  double sum = 0;
  for (uint32_t p = 0; p <= pos; p++) {
    float e = expf(sc[p] - mx);
    sc[p] = e;
    sum += e;
  }
  const float inv = (float)(1.0 / sum);
  for (uint32_t r = 0; r < R; r++) o_lat[r] = 0;
  for (uint32_t p = 0; p <= pos; p++) axpy_f32(o_lat, sc[p] * inv, cache + (size_t)p * lw, R);
  /* out_h = W_uv o_lat */
  const float *wv = w + (size_t)a->nope * R;
  float *o = a->out + (size_t)t * a->n_heads * a->v_dim + (size_t)h * a->v_dim;
  for (uint32_t d = 0; d < a->v_dim; d++) o[d] = dot_f32(wv + (size_t)d * R, o_lat, R);
}

static int cpu_mla_attention(gc_backend *b, const gc_bk_mla *a, mr_err *e) {
  cpu_backend *cb = cpu(b);
  const uint32_t lw = a->kv_lora + a->rope;
  if (a->max_seq > cb->max_seq)
    return mr_err_set(e, MR_ERANGE, "mla attention: max_seq %u exceeds the backend's %u",
                      a->max_seq, cb->max_seq);
  if (a->kv_lora > cb->mla_lora) {
    float *m = mr_malloc((size_t)cb->n_workers * 2 * a->kv_lora * sizeof *m);
    if (!m)
      return mr_err_set(e, MR_ENOMEM, "mla attention: scratch of %u x %u: out of memory",
                        cb->n_workers, 2 * a->kv_lora);
    mr_free(cb->mla);
  mr_free(cb->route_buf);
    cb->mla = m;
    cb->mla_lora = a->kv_lora;
  }
  for (uint32_t t = 0; t < a->n_tokens; t++) {
    if (a->pos[t] >= a->max_seq)
      return mr_err_set(e, MR_ERANGE, "mla attention: token %u at position %u, must be < "
                        "max_seq %u", t, a->pos[t], a->max_seq);
    size_t at = ((size_t)a->seq[t] * a->max_seq + a->pos[t]) * lw;
    memcpy(a->cache + at, a->kv + (size_t)t * a->ldkv, lw * sizeof(float));
  }
  mla_job j = {.a = a, .cb = cb};
  uint32_t items = a->n_tokens * a->n_heads;
  if (items == 1) mla_item(&j, 0, 0);
  else kn_engine_run(b->eng, items, mla_item, &j);
  return 0;
}

/* ---- routing and experts ----------------------------------------------------------------- */

/* Inserts candidate x with key v into the descending top list ids/keys of n <= k entries
 * (ties: the lower id first, as x arrives in increasing order). */
static void topk_insert(int32_t *ids, float *keys, uint32_t *n, uint32_t k, int32_t x, float v) {
  uint32_t j = *n;
  while (j > 0 && v > keys[j - 1]) j--;
  if (j >= k) return;
  uint32_t last = *n < k ? *n : k - 1;
  memmove(ids + j + 1, ids + j, (last - j) * sizeof *ids);
  memmove(keys + j + 1, keys + j, (last - j) * sizeof *keys);
  ids[j] = x;
  keys[j] = v;
  if (*n < k) (*n)++;
}

/* DeepSeek-V3's noaux_tc for one token (transformers DeepseekV3TopkRouter): s = sigmoid,
 * choice = s + bias; a group scores the sum of its top-2 choices; the topk_group best
 * groups stay; the k best choices among them are taken, weighted by s. choice, s: [E]
 * scratch. */
static void route_noaux_tc(const gc_bk_route *r, const float *l, int32_t *ids, float *w,
                           float *choice, float *s) {
  const uint32_t E = r->num_experts, k = r->top_k, G = r->n_group, per = E / G;
  for (uint32_t x = 0; x < E; x++) {
    s[x] = 1.0f / (1.0f + expf(-l[x]));
    choice[x] = s[x] + (r->bias ? r->bias[x] : 0.0f);
  }
  uint8_t keep[GC_ROUTE_MAX_GROUPS];
  memset(keep, G > 1 ? 0 : 1, G);
  if (G > 1) {
    int32_t gid[GC_ROUTE_MAX_GROUPS];
    float gkey[GC_ROUTE_MAX_GROUPS];
    uint32_t ng = 0;
    for (uint32_t g = 0; g < G; g++) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (uint32_t x = g * per; x < (g + 1) * per; x++) {
        float v = choice[x];
        if (v > b1) b2 = b1, b1 = v;
        else if (v > b2) b2 = v;
      }
      topk_insert(gid, gkey, &ng, r->topk_group, (int32_t)g, b1 + b2);
    }
    for (uint32_t i = 0; i < ng; i++) keep[gid[i]] = 1;
  }
  float key[GC_ROUTE_MAX_TOP_K];
  uint32_t n = 0;
  for (uint32_t x = 0; x < E; x++)
    if (keep[x / per]) topk_insert(ids, key, &n, k, (int32_t)x, choice[x]);
  /* the weights are the unbiased scores; order the k by them (the contract: by weight) */
  for (uint32_t j = 0; j < k; j++) key[j] = s[ids[j]];
  for (uint32_t a = 1; a < k; a++)
    for (uint32_t b = a; b > 0 && (key[b] > key[b - 1] ||
                                   (key[b] == key[b - 1] && ids[b] < ids[b - 1])); b--) {
      float tk = key[b]; key[b] = key[b - 1]; key[b - 1] = tk;
      int32_t ti = ids[b]; ids[b] = ids[b - 1]; ids[b - 1] = ti;
    }
  float sum = 0;
  for (uint32_t j = 0; j < k; j++) sum += (w[j] = key[j]);
  if (r->norm_topk)
    for (uint32_t j = 0; j < k; j++) w[j] /= sum + 1e-20f;
}

static int cpu_route(gc_backend *b, const gc_bk_route *r, mr_err *e) {
  cpu_backend *cb = cpu(b);
  const uint32_t E = r->num_experts, k = r->top_k;
  int rc0 = gc_bk_route_check(r, e);
  if (rc0) return rc0;
  if (r->method == MR_TOPK_NOAUX_TC && cb->route_cap < E) {
    float *p = mr_malloc(2 * (size_t)E * sizeof *p);
    if (!p) return mr_err_set(e, MR_ENOMEM, "route: scratch of %u: out of memory", 2 * E);
    mr_free(cb->route_buf);
    cb->route_buf = p;
    cb->route_cap = E;
  }
  for (uint32_t t = 0; t < r->n_tokens; t++) {
    const float *l = r->logits + (size_t)t * E;
    int32_t *ids = r->ids + (size_t)t * k;
    float *w = r->weights + (size_t)t * k;
    if (r->method == MR_TOPK_NOAUX_TC) {
      route_noaux_tc(r, l, ids, w, cb->route_buf, cb->route_buf + E);
    } else {
      float mx = -INFINITY;
      for (uint32_t x = 0; x < E; x++) mx = l[x] > mx ? l[x] : mx;
      double sum = 0;
      if (r->scoring == MR_SCORE_SOFTMAX)
        for (uint32_t x = 0; x < E; x++) sum += expf(l[x] - mx);
      /* top-k of the logits = top-k of softmax or sigmoid (monotone) */
      float key[GC_ROUTE_MAX_TOP_K];
      uint32_t n = 0;
      for (uint32_t x = 0; x < E; x++) topk_insert(ids, key, &n, k, (int32_t)x, l[x]);
      float s = 0;
      for (uint32_t j = 0; j < k; j++) {
        w[j] = r->scoring == MR_SCORE_SOFTMAX ? (float)(expf(l[ids[j]] - mx) / sum)
                                              : 1.0f / (1.0f + expf(-l[ids[j]]));
        s += w[j];
      }
      if (r->norm_topk)
        for (uint32_t j = 0; j < k; j++) w[j] /= r->scoring == MR_SCORE_SOFTMAX ? s : s + 1e-20f;
    }
    if (r->scale != 1.0f)
      for (uint32_t j = 0; j < k; j++) w[j] *= r->scale;
  }
  return 0;
}

static int cpu_experts(gc_backend *b, const gc_bk_experts *x, uint32_t T, uint32_t k,
                       const int32_t *ids, const float *w, const float *in, float *out,
                       mr_err *e) {
  cpu_backend *cb = cpu(b);
  kn_moe_args a = {.n_tokens = T, .top_k = k, .ids = ids, .weights = w, .x = in,
                   .x_dtype = MR_DTYPE_F32, .out = out};
  int rc = kn_moe_forward(b->eng, x->L, &a, &cb->scratch, e);
  mr_arena_reset(&cb->scratch);
  return rc;
}

static void cpu_destroy(gc_backend *b) {
  cpu_backend *cb = cpu(b);
  if (!cb) return;
  mr_arena_close(&cb->scratch);
  mr_free(cb->scores);
  mr_free(cb->mla);
  mr_free(cb->route_buf);
  mr_free(cb);
}

static void *cpu_native_stream(gc_backend *b) { return NULL; }

static const gc_bk_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .native_stream = cpu_native_stream,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .upload = cpu_upload,
    .to_host = cpu_to_host,
    .add_host = cpu_add_host,
    .sync = cpu_sync,
    .linear_new = cpu_linear_new,
    .linear_load = cpu_linear_load,
    .linear_borrow = cpu_linear_borrow,
    .linear_load_fp8 = cpu_linear_load_fp8,
    .linear_borrow_fp8 = cpu_linear_borrow_fp8,
    .linear_free = cpu_linear_free,
    .linear_bytes = cpu_linear_bytes,
    .table_new = cpu_table_new,
    .table_borrow = cpu_table_borrow,
    .table_free = cpu_table_free,
    .experts_new = cpu_experts_new,
    .experts_load = cpu_experts_load,
    .experts_load_st = cpu_experts_load_st,
    .experts_borrow_st = cpu_experts_borrow_st,
    .experts_free = cpu_experts_free,
    .experts_expert_bytes = cpu_experts_expert_bytes,
    .matmul = cpu_matmul,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .mla_attention = cpu_mla_attention,
    .silu_mul = cpu_silu_mul,
    .zero = cpu_zero,
    .gather_rows = cpu_gather_rows,
    .add = cpu_add,
    .route = cpu_route,
    .experts = cpu_experts,
    .host_memory = true,
};

/* Arena block for kernel scratch (grows and keeps the largest block). */
#define CPU_SCRATCH_BLOCK (4u << 20)

int gc_bk_cpu_new(gc_backend **out, kn_engine *eng, uint32_t max_seq, mr_err *e) {
  cpu_backend *cb = mr_calloc(1, sizeof *cb);
  if (!cb) return mr_err_set(e, MR_ENOMEM, "cpu backend: out of memory");
  cb->base.ops = &cpu_ops;
  cb->base.eng = eng;
  cb->max_seq = max_seq;
  cb->n_workers = kn_engine_threads(eng);
  cb->scores = mr_malloc((size_t)cb->n_workers * max_seq * sizeof *cb->scores);
  if (!cb->scores) {
    mr_free(cb);
    return mr_err_set(e, MR_ENOMEM, "cpu backend: attention scratch of %u x %u: out of memory",
                      cb->n_workers, max_seq);
  }
  mr_arena_init(&cb->scratch, CPU_SCRATCH_BLOCK);
  *out = &cb->base;
  return 0;
}
