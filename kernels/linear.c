/*
 * linear.c - dense linear layers (kn_linear: y = x W^T) and the generic parallel-for
 * kn_engine_run, both on the engine's worker pool.
 *
 * No arithmetic of its own: a kn_linear is packed by kn__pack_row (the packer of the expert
 * loader) into the layout of an expert's down matrix, and computed by the down kernels of
 * the engine's kernel table through a one-expert, one-slice layer view (internal.h
 * section E has the mapping and the work split). So every fast path of kn_moe_forward
 * (AVX-512 bf16 / VNNI int8 / int4, AVX2 fp32 FMA, REF) serves dense layers too, with the
 * same activation handling (the down kernels convert their input rows into their own
 * tmp) and the same tolerances.
 *
 * Threads (STYLE.md 8): like kn.c, the thread that calls kn_linear_load_rows,
 * kn_linear_forward or kn_engine_run prepares a job on its stack and runs it on every
 * worker with kn__pool_run, taking part as worker 0; the pool's run lock serialises such
 * calls on one engine. During a run, workers write only what the items they claimed own
 * (the packed rows of a row block at load; the y rows [j0, j1) of the tokens of a tile at
 * forward; whatever fn's items write in kn_engine_run) and, at load, the job's
 * bad-weight record under its lock. The caller reads the results after kn__pool_run
 * returns, which orders every worker's writes before it.
 */
#include "kernels/internal.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static size_t align_up(size_t n) { return (n + KN_PACK_ALIGN - 1) & ~(size_t)(KN_PACK_ALIGN - 1); }

/* ---- create, free, accessors ------------------------------------------------------- */

/* A linear without weights: the one-expert, one-slice layer view the kernels read
 * (internal.h section E) and an empty loaded bitmap; NULL when out of memory. The caller
 * sets w (kn_linear_new: its memory; kn_linear_borrow: the bands). */
static kn_linear *lin_view_new(kn_engine *eng, uint32_t n_out, uint32_t n_in, kn_format fmt,
                               uint32_t G) {
  kn_linear *lin = mr_calloc(1, sizeof *lin);
  if (!lin) return NULL;
  lin->loaded = mr_calloc(((size_t)n_out + 63) / 64, sizeof *lin->loaded);
  if (!lin->loaded) {
    mr_free(lin);
    return NULL;
  }
  kn_layer *L = &lin->L;
  L->d = (kn_layer_desc){.hidden = n_out, .inter = n_in, .num_experts = 1, .format = fmt, .group = G};
  L->n_slices = 1;
  L->slice_off[0] = 0;
  L->slice_len[0] = n_in;
  L->max_slice_len = n_in;
  L->node[0] = eng->node[0]; /* one slice: on the engine's first node */
  L->eng = eng;
  L->numa_place = eng->numa_place;
  lin->wp = &lin->w;
  L->w = &lin->wp;
  lin->owned = 1;
  L->owned = &lin->owned;
  L->n_owned = 1;
  lin->n_bands = 1;
  lin->band_row0[1] = n_out;
  return lin;
}

int kn_linear_new(kn_linear **out, kn_engine *eng, uint32_t n_out, uint32_t n_in, kn_format fmt,
                  uint32_t group, mr_err *e) {
  *out = NULL;
  if (!eng) return mr_err_set(e, MR_EINVAL, "kn_linear_new: engine is required");
  if (n_out < 1 || n_out > KN_LINEAR_MAX_OUT)
    return mr_err_set(e, MR_EINVAL, "n_out = %u, must be in 1..%u", n_out, KN_LINEAR_MAX_OUT);
  if (n_in < 1 || n_in > KN_LINEAR_MAX_IN)
    return mr_err_set(e, MR_EINVAL, "n_in = %u, must be in 1..%u", n_in, KN_LINEAR_MAX_IN);
  if ((unsigned)fmt >= KN_FMT_COUNT)
    return mr_err_set(e, MR_EINVAL, "format = %d, must be below %d", (int)fmt, KN_FMT_COUNT);
  if (fmt == KN_FMT_INT4 && group != 32 && group != 64 && group != 128)
    return mr_err_set(e, MR_EINVAL, "group = %u, must be 32, 64 or 128 for int4", group);

  const uint32_t G = fmt == KN_FMT_INT4 ? group : fmt == KN_FMT_FP8 ? KN_FP8_BLOCK : 0;
  kn_linear *lin = lin_view_new(eng, n_out, n_in, fmt, G);
  if (!lin) return mr_err_set(e, MR_ENOMEM, "kn_linear_new: out of memory");
  kn_layer *L = &lin->L;

  /* mem: [ W: N rows of row-bytes | pad | scales: N x kn__row_scales floats | pad ] */
  const size_t rb = kn__row_bytes(fmt, n_in, G), sc = kn__row_scales(fmt, n_in, G);
  const size_t w_bytes = (size_t)n_out * rb, s_bytes = (size_t)n_out * sc * sizeof(float);
  const size_t s_off = align_up(w_bytes), total = align_up(s_off + s_bytes);
  char *mem;
  if (L->numa_place || total >= KN__HUGE_BYTES) { /* on its node, huge pages when large */
    mem = kn__mem_map_on_node(total, L->numa_place ? L->node[0] : KN__NO_NODE, &lin->w.map_bytes);
    if (!mem) {
      int err = errno;
      kn_linear_free(lin);
      return mr_err_set(e, MR_ENOMEM, "kn_linear_new: mapping %zu bytes%s failed: %s", total,
                        L->numa_place ? " on the engine's first NUMA node" : "", strerror(err));
    }
  } else {
    mem = mr_malloc_aligned(total, KN_PACK_ALIGN);
    if (!mem) {
      kn_linear_free(lin);
      return mr_err_set(e, MR_ENOMEM, "kn_linear_new: out of memory for %zu bytes of weights (%u x %u %s)",
                        total, n_out, n_in, kn_format_name(fmt));
    }
  }
  lin->w.mem = mem;
  lin->w.mem_bytes = total;
  lin->w.down = mem;
  lin->w.down_scale = sc ? (float *)(mem + s_off) : NULL;
  lin->weight_bytes = w_bytes + s_bytes;
  L->bytes = L->expert_bytes = total;
  *out = lin;
  return 0;
}

bool kn_linear_in_place(const kn_linear *lin) { return lin && lin->w.in_place; }

void kn_linear_free(kn_linear *lin) {
  if (!lin) return;
  if (lin->w.map_bytes)
    kn__mem_unmap(lin->w.mem, lin->w.map_bytes);
  else
    mr_free_aligned(lin->w.mem);
  mr_free(lin->loaded);
  mr_free(lin);
}

uint32_t kn_linear_n_out(const kn_linear *lin) { return lin->L.d.hidden; }
uint32_t kn_linear_n_in(const kn_linear *lin) { return lin->L.d.inter; }
kn_format kn_linear_format(const kn_linear *lin) { return lin->L.d.format; }
uint32_t kn_linear_group(const kn_linear *lin) { return lin->L.d.group; }
uint32_t kn_linear_rows_loaded(const kn_linear *lin) { return lin->n_loaded; }
uint64_t kn_linear_bytes(const kn_linear *lin) { return lin->weight_bytes; }

/* ---- loading ----------------------------------------------------------------------- */

/* Rows per load work item. */
#define LIN_LOAD_BLOCK 32u

/* One kn_linear_load_rows (or kn_linear_borrow's finite check of one band) on the
 * engine's workers. */
typedef struct lin_load_job {
  kn_linear *lin;
  const char *src;      /* [n_rows, K] of dt */
  mr_dtype dt;
  bool check_only;      /* kn_linear_borrow(_fp8): the finite check, no weight written */
  bool src_fp8;         /* src: e4m3fn codes, their scales from bscale */
  const float *bscale;  /* src_fp8: the source tensor's block scales [.., ceil(K / 128)] */
  uint32_t first_row;   /* src_fp8: the tensor row of src's row 0 */
  float *scales;        /* src_fp8: where row row0 + r's scales go (row stride ceil(K / 128)) */
  uint32_t row0;        /* first row of W the band fills */
  uint32_t n_rows;
  float *rows;          /* [n_workers][row_floats]: one fp32 row per worker */
  size_t row_floats;
  bool only_group0;     /* placement: only node 0's workers touch the pages */
  bool skip_caller;     /* ... and not the unpinned caller when group 0 has others */
  pthread_mutex_t lock; /* guards the bad_* fields; taken only when a weight is bad */
  bool bad;             /* the first non-finite weight, in (row, column) order */
  uint32_t bad_row, bad_col;
  float bad_v;
  kn__work work;
} lin_load_job;

static void lin_note_bad(lin_load_job *j, uint32_t r, uint32_t col, float v) {
  pthread_mutex_lock(&j->lock);
  if (!j->bad || r < j->bad_row || (r == j->bad_row && col < j->bad_col)) {
    j->bad = true;
    j->bad_row = r;
    j->bad_col = col;
    j->bad_v = v;
  }
  pthread_mutex_unlock(&j->lock);
}

static void lin_load_fn(void *arg, const kn__pool_ctx *c) {
  lin_load_job *j = arg;
  if (j->only_group0 && c->group != 0) return;
  if (c->worker == 0 && j->skip_caller) return;
  kn_linear *lin = j->lin;
  const kn_format f = lin->L.d.format;
  const uint32_t K = lin->L.d.inter, G = lin->L.d.group;
  const size_t rb = kn__row_bytes(f, K, G), sc = kn__row_scales(f, K, G);
  const size_t esz = j->src_fp8 ? 1 : mr_dtype_size(j->dt);
  float *row = j->rows + (size_t)c->worker * j->row_floats;
  const kn__pack_fns *P = kn__pack();
  const bool same = j->dt == kn__format_dtype(f); /* stored as served: copied, not converted */
  uint32_t g, item;
  while (kn__work_claim(&j->work, c, &g, &item)) {
    const uint32_t r0 = item * LIN_LOAD_BLOCK;
    const uint32_t r1 = r0 + LIN_LOAD_BLOCK < j->n_rows ? r0 + LIN_LOAD_BLOCK : j->n_rows;
    for (uint32_t r = r0; r < r1; r++) {
      const char *src = j->src + (size_t)r * K * esz;
      const size_t at = (size_t)j->row0 + r;
      if (j->src_fp8) { /* codes kept as they are (or only checked), scales spread per row */
        const uint8_t *q = (const uint8_t *)src;
        const uint32_t k = j->check_only ? P->check_fp8(q, K) : P->copy_fp8((uint8_t *)lin->w.down + at * rb, q, K);
        if (k < K) {
          lin_note_bad(j, r, k, NAN);
          continue;
        }
        memcpy(j->scales + at * sc, j->bscale + (size_t)((j->first_row + r) / KN_FP8_BLOCK) * sc,
               sc * sizeof(float));
        continue;
      }
      /* A NaN or inf weight would poison every token's output: refused either way. */
      if (j->check_only) {
        const uint32_t k = P->check(src, j->dt, K);
        if (k < K) {
          float v;
          mr_convert_to_f32(&v, src + (size_t)k * esz, j->dt, 1);
          lin_note_bad(j, r, k, v);
        }
        continue;
      }
      if (same) {
        const uint32_t k = P->copy((char *)lin->w.down + at * rb, src, j->dt, K);
        if (k < K) {
          float v;
          mr_convert_to_f32(&v, src + (size_t)k * esz, j->dt, 1);
          lin_note_bad(j, r, k, v);
        }
        continue;
      }
      const uint32_t k = kn__pack_row_src(f, G, src, j->dt, K, row, (char *)lin->w.down + at * rb,
                                          sc ? lin->w.down_scale + at * sc : NULL);
      if (k < K) {
        float v;
        mr_convert_to_f32(&v, src + (size_t)k * esz, j->dt, 1);
        lin_note_bad(j, r, k, v);
      }
    }
  }
}

/* Sets (or clears) the loaded bits of rows [r0, r1), keeping n_loaded. */
static void lin_mark(kn_linear *lin, uint32_t r0, uint32_t r1, bool set) {
  for (uint32_t r = r0; r < r1; r++) {
    uint64_t *wd = &lin->loaded[r >> 6], bit = 1ull << (r & 63);
    if (set && !(*wd & bit)) {
      *wd |= bit;
      lin->n_loaded++;
    } else if (!set && (*wd & bit)) {
      *wd &= ~bit;
      lin->n_loaded--;
    }
  }
}

/* The checks every load of rows [row0, row0 + n_rows) makes; 1 (no error) when there is
 * nothing to load. */
static int lin_load_args(const kn_linear *lin, uint32_t row0, uint32_t n_rows, const void *w,
                         const char *who, mr_err *e) {
  if (!lin) return mr_err_set(e, MR_EINVAL, "%s: lin is required", who);
  const uint32_t N = lin->L.d.hidden, K = lin->L.d.inter;
  if ((uint64_t)row0 + n_rows > N)
    return mr_err_set(e, MR_ERANGE, "rows [%u, %llu) (row0 = %u, n_rows = %u) must lie within n_out = %u",
                      row0, (unsigned long long)row0 + n_rows, row0, n_rows, N);
  if (n_rows == 0) return 1;
  if (!w) return mr_err_set(e, MR_EINVAL, "%s: w is required", who);
  if (lin->w.in_place)
    return mr_err_set(e, MR_EPRECOND, "%s: this %u x %u linear is served in place "
                      "(kn_linear_borrow): its rows are the caller's, read-only", who, N, K);
  return 0;
}

/* Runs load job j (src and dt, or src_fp8 and its scales, set) over rows [j->row0,
 * j->row0 + j->n_rows) of j->lin on the engine's workers. */
static int lin_load_run(lin_load_job *j, mr_err *e) {
  kn_linear *lin = j->lin;
  kn_engine *eng = lin->L.eng;
  const uint32_t nw = eng->plan.n_workers, K = lin->L.d.inter, row0 = j->row0, n_rows = j->n_rows;
  j->row_floats = ((size_t)K + 15) & ~(size_t)15; /* one row per worker, own cache lines */
  j->rows = mr_malloc_aligned(j->row_floats * nw * sizeof(float), KN_PACK_ALIGN);
  if (!j->rows) return mr_err_set(e, MR_ENOMEM, "kn_linear_load_rows: out of memory");
  /* With placement, node 0's pinned workers do the first touch of every page (the slice's
   * node), the unpinned caller sitting out when group 0 has other workers (as in
   * kn_layer_load_expert). */
  j->only_group0 = lin->L.numa_place;
  j->skip_caller = lin->L.numa_place && eng->plan.group_first[1] > 1;
  j->scales = lin->w.down_scale;
  const uint32_t items = (n_rows + LIN_LOAD_BLOCK - 1) / LIN_LOAD_BLOCK;
  kn__work_init(&j->work, 1, &items);
  pthread_mutex_init(&j->lock, NULL);
  /* The band is not loaded while it is rewritten (a failed load leaves it so). */
  lin_mark(lin, row0, row0 + n_rows, false);
  kn__pool_run(eng->pool, lin_load_fn, j);
  pthread_mutex_destroy(&j->lock);
  int rc = 0;
  if (j->bad && j->src_fp8) {
    rc = mr_err_set(e, MR_EINVAL, "W[row %u, column %u] is a NaN code (row %u of this band of %u "
                    "rows): weights must be finite", row0 + j->bad_row, j->bad_col, j->bad_row, n_rows);
  } else if (j->bad) {
    rc = mr_err_set(e, MR_EINVAL,
                    "W[row %u, column %u] = %g (row %u of this band of %u rows): weights must be finite",
                    row0 + j->bad_row, j->bad_col, (double)j->bad_v, j->bad_row, n_rows);
  } else {
    lin_mark(lin, row0, row0 + n_rows, true);
  }
  mr_free_aligned(j->rows);
  return rc;
}

/* The block scales of tensor rows [first_row, first_row + n_rows) (block rows of
 * scale_inv, each ceil(K / 128) wide): each finite and > 0. part: "" or "part i: ". */
static int lin_check_block_scales(const float *scale_inv, uint32_t first_row, uint32_t n_rows,
                                  uint32_t K, const char *part, mr_err *e) {
  const uint32_t C = kn__ngroups(K, KN_FP8_BLOCK);
  const uint32_t r1 = (uint32_t)(((uint64_t)first_row + n_rows - 1) / KN_FP8_BLOCK);
  for (uint32_t r = first_row / KN_FP8_BLOCK; r <= r1; r++)
    for (uint32_t c = 0; c < C; c++) {
      const float v = scale_inv[(size_t)r * C + c];
      if (!(isfinite(v) && v > 0.0f))
        return mr_err_set(e, MR_EINVAL, "%sscale_inv[%u, %u] = %g: block scales must be finite and > 0",
                          part, r, c, (double)v);
    }
  return 0;
}

static int lin_load_fp8(kn_linear *lin, uint32_t row0, uint32_t n_rows, const uint8_t *q,
                        const float *scale_inv, uint32_t first_row, mr_err *e) {
  int rc = lin_check_block_scales(scale_inv, first_row, n_rows, lin->L.d.inter, "", e);
  if (rc) return rc;
  lin_load_job j = {.lin = lin, .src = (const char *)q, .dt = MR_DTYPE_UNSPECIFIED, .src_fp8 = true,
                    .bscale = scale_inv, .first_row = first_row, .row0 = row0, .n_rows = n_rows};
  return lin_load_run(&j, e);
}

int kn_linear_load_rows(kn_linear *lin, uint32_t row0, uint32_t n_rows, const void *w, mr_dtype src,
                        mr_err *e) {
  int rc = lin_load_args(lin, row0, n_rows, w, "kn_linear_load_rows", e);
  if (rc) return rc > 0 ? 0 : rc;
  if (src != MR_DTYPE_F32 && src != MR_DTYPE_F16 && src != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "src dtype = %d, must be f32, f16 or bf16", (int)src);
  const uint32_t K = lin->L.d.inter;
  if (lin->L.d.format == KN_FMT_FP8) {
    /* Quantized here in 128 x 128 blocks from the band's first row (block scales need
     * whole block rows, which a row-by-row packer does not see), then packed as codes. */
    const size_t ns = (size_t)kn__ngroups(n_rows, KN_FP8_BLOCK) * kn__ngroups(K, KN_FP8_BLOCK);
    uint8_t *q = mr_malloc((size_t)n_rows * K);
    float *sc = mr_malloc(ns * sizeof *sc);
    if (!q || !sc) {
      rc = mr_err_set(e, MR_ENOMEM, "kn_linear_load_rows: out of memory quantizing %u x %u "
                      "weights to fp8", n_rows, K);
    } else if ((rc = kn_fp8_quantize_b128(w, src, n_rows, K, q, sc, e))) {
      lin_mark(lin, row0, row0 + n_rows, false);
      mr_err_prefix(e, rc, "the band from W row %u", row0);
    } else {
      rc = lin_load_fp8(lin, row0, n_rows, q, sc, 0, e);
    }
    mr_free(q);
    mr_free(sc);
    return rc;
  }
  lin_load_job j = {.lin = lin, .src = w, .dt = src, .row0 = row0, .n_rows = n_rows};
  return lin_load_run(&j, e);
}

int kn_linear_load_rows_fp8(kn_linear *lin, uint32_t row0, uint32_t n_rows, const uint8_t *q,
                            const float *scale_inv, uint32_t first_row, mr_err *e) {
  int rc = lin_load_args(lin, row0, n_rows, q, "kn_linear_load_rows_fp8", e);
  if (rc) return rc > 0 ? 0 : rc;
  if (!scale_inv) return mr_err_set(e, MR_EINVAL, "kn_linear_load_rows_fp8: scale_inv is required");
  if (lin->L.d.format != KN_FMT_FP8)
    return mr_err_set(e, MR_EINVAL, "kn_linear_load_rows_fp8: the linear's format is %s, not "
                      "fp8-b128 (kn_linear_load_rows loads it)", kn_format_name(lin->L.d.format));
  if ((uint64_t)first_row + n_rows > UINT32_MAX)
    return mr_err_set(e, MR_ERANGE, "first_row = %u + n_rows = %u overflows", first_row, n_rows);
  return lin_load_fp8(lin, row0, n_rows, q, scale_inv, first_row, e);
}

/* The finite check of one band of a linear served in place, on the engine's workers
 * (all of them: no weight is written, so nothing is placed); j: src and dt, or src_fp8,
 * its scales and where they go, set. Returns true when every weight is finite, else
 * fills j's bad record. */
static bool lin_check_band(lin_load_job *j) {
  j->check_only = true;
  const uint32_t items = (j->n_rows + LIN_LOAD_BLOCK - 1) / LIN_LOAD_BLOCK;
  kn__work_init(&j->work, 1, &items);
  pthread_mutex_init(&j->lock, NULL);
  kn__pool_run(j->lin->L.eng->pool, lin_load_fn, j);
  pthread_mutex_destroy(&j->lock);
  return !j->bad;
}

/* The checks kn_linear_borrow and kn_linear_borrow_fp8 share; *n_out: the parts' rows. */
static int lin_borrow_args(const kn_engine *eng, uint32_t n_parts, const void *const *w,
                           const uint32_t *rows, uint32_t n_in, const char *who, uint32_t *n_out,
                           mr_err *e) {
  if (!eng || !w || !rows)
    return mr_err_set(e, MR_EINVAL, "%s: engine, w and rows are required", who);
  if (n_parts < 1 || n_parts > KN_LINEAR_MAX_BANDS)
    return mr_err_set(e, MR_EINVAL, "n_parts = %u, must be in 1..%u", n_parts, KN_LINEAR_MAX_BANDS);
  uint64_t n = 0;
  for (uint32_t i = 0; i < n_parts; i++) {
    if (!w[i] || rows[i] == 0)
      return mr_err_set(e, MR_EINVAL, "part %u: %s", i, !w[i] ? "w is required" : "rows = 0, must be >= 1");
    n += rows[i];
  }
  if (n > KN_LINEAR_MAX_OUT)
    return mr_err_set(e, MR_EINVAL, "n_out = %llu (the parts' rows), must be in 1..%u",
                      (unsigned long long)n, KN_LINEAR_MAX_OUT);
  if (n_in < 1 || n_in > KN_LINEAR_MAX_IN)
    return mr_err_set(e, MR_EINVAL, "n_in = %u, must be in 1..%u", n_in, KN_LINEAR_MAX_IN);
  if (eng->numa_place)
    return mr_err_set(e, MR_ENOTSUP, "the engine places weights on %u NUMA nodes: a linear "
                      "served in place would stay where the page cache put it", eng->plan.n_groups);
  *n_out = (uint32_t)n;
  return 0;
}

/* A linear over the caller's bands w[0 .. n_parts) (rows[i] rows each), not yet checked. */
static kn_linear *lin_bands_new(kn_engine *eng, uint32_t n_parts, const void *const *w,
                                const uint32_t *rows, uint32_t n_out, uint32_t n_in, kn_format fmt) {
  kn_linear *lin = lin_view_new(eng, n_out, n_in, fmt, fmt == KN_FMT_FP8 ? KN_FP8_BLOCK : 0);
  if (!lin) return NULL;
  lin->n_bands = n_parts;
  for (uint32_t i = 0; i < n_parts; i++) {
    lin->band[i] = (kn__slice_w){.borrowed = true, .in_place = true, .down = (void *)w[i]};
    lin->band_row0[i + 1] = lin->band_row0[i] + rows[i];
  }
  lin->w = lin->band[0];
  return lin;
}

int kn_linear_borrow(kn_linear **out, kn_engine *eng, uint32_t n_parts, const void *const *w,
                     const uint32_t *rows, uint32_t n_in, mr_dtype src, mr_err *e) {
  *out = NULL;
  uint32_t n_out;
  int rc = lin_borrow_args(eng, n_parts, w, rows, n_in, "kn_linear_borrow", &n_out, e);
  if (rc) return rc;
  kn_format fmt;
  switch (src) {
    case MR_DTYPE_F32: fmt = KN_FMT_F32; break;
    case MR_DTYPE_F16: fmt = KN_FMT_F16; break;
    case MR_DTYPE_BF16: fmt = KN_FMT_BF16; break;
    default:
      return mr_err_set(e, MR_ENOTSUP, "src dtype = %s: only f32, f16 and bf16 weights can be "
                        "served in place (their packed layout is the stored one; fp8 codes: "
                        "kn_linear_borrow_fp8)", mr_dtype_name(src));
  }
  const size_t esz = mr_dtype_size(src);
  for (uint32_t i = 0; i < n_parts; i++)
    if ((uintptr_t)w[i] % esz)
      return mr_err_set(e, MR_ENOTSUP, "part %u at %p is not %zu-byte aligned: cannot be served in "
                        "place", i, w[i], esz);
  kn_linear *lin = lin_bands_new(eng, n_parts, w, rows, n_out, n_in, fmt);
  if (!lin) return mr_err_set(e, MR_ENOMEM, "kn_linear_borrow: out of memory");
  kn_layer *L = &lin->L;
  lin->weight_bytes = (uint64_t)n_out * n_in * esz;
  L->bytes = L->expert_bytes = lin->weight_bytes;
  for (uint32_t i = 0; i < n_parts; i++) {
    lin_load_job j = {.lin = lin, .src = w[i], .dt = src, .n_rows = rows[i]};
    if (!lin_check_band(&j)) {
      rc = mr_err_set(e, MR_EINVAL, "W[row %u, column %u] = %g (part %u, its row %u of %u): "
                      "weights must be finite", lin->band_row0[i] + j.bad_row, j.bad_col,
                      (double)j.bad_v, i, j.bad_row, rows[i]);
      kn_linear_free(lin); /* the bands are the caller's: nothing of theirs is freed */
      return rc;
    }
  }
  lin_mark(lin, 0, n_out, true);
  *out = lin;
  return 0;
}

int kn_linear_borrow_fp8(kn_linear **out, kn_engine *eng, uint32_t n_parts, const uint8_t *const *q,
                         const uint32_t *rows, uint32_t n_in, const float *const *scale_inv,
                         const uint32_t *first_row, mr_err *e) {
  *out = NULL;
  uint32_t n_out;
  int rc = lin_borrow_args(eng, n_parts, (const void *const *)q, rows, n_in, "kn_linear_borrow_fp8",
                           &n_out, e);
  if (rc) return rc;
  if (!scale_inv || !first_row)
    return mr_err_set(e, MR_EINVAL, "kn_linear_borrow_fp8: scale_inv and first_row are required");
  for (uint32_t i = 0; i < n_parts; i++) {
    char part[32];
    snprintf(part, sizeof part, "part %u: ", i);
    if (!scale_inv[i]) return mr_err_set(e, MR_EINVAL, "part %u: scale_inv is required", i);
    if ((uint64_t)first_row[i] + rows[i] > UINT32_MAX)
      return mr_err_set(e, MR_ERANGE, "part %u: first_row = %u + rows = %u overflows", i, first_row[i], rows[i]);
    if ((rc = lin_check_block_scales(scale_inv[i], first_row[i], rows[i], n_in, part, e))) return rc;
  }
  kn_linear *lin = lin_bands_new(eng, n_parts, (const void *const *)q, rows, n_out, n_in, KN_FMT_FP8);
  /* the codes are the caller's; the scales, one per (row, 128-column block), are ours */
  const size_t sc = kn__row_scales(KN_FMT_FP8, n_in, KN_FP8_BLOCK);
  const size_t s_bytes = align_up((size_t)n_out * sc * sizeof(float));
  float *scales = lin ? mr_malloc_aligned(s_bytes, KN_PACK_ALIGN) : NULL;
  if (!scales) {
    kn_linear_free(lin);
    return mr_err_set(e, MR_ENOMEM, "kn_linear_borrow_fp8: out of memory (%u x %u)", n_out, n_in);
  }
  lin->w.mem = scales; /* freed with the linear */
  lin->w.mem_bytes = s_bytes;
  lin->w.down_scale = scales;
  for (uint32_t i = 0; i < n_parts; i++) lin->band[i].down_scale = scales + lin->band_row0[i] * sc;
  kn_layer *L = &lin->L;
  lin->weight_bytes = (uint64_t)n_out * (n_in + sc * sizeof(float));
  L->bytes = L->expert_bytes = lin->weight_bytes;
  for (uint32_t i = 0; i < n_parts; i++) {
    lin_load_job j = {.lin = lin, .src = (const char *)q[i], .dt = MR_DTYPE_UNSPECIFIED, .src_fp8 = true,
                      .bscale = scale_inv[i], .first_row = first_row[i], .n_rows = rows[i],
                      .scales = lin->band[i].down_scale};
    if (!lin_check_band(&j)) {
      rc = mr_err_set(e, MR_EINVAL, "W[row %u, column %u] is a NaN code (part %u, its row %u of %u): "
                      "weights must be finite", lin->band_row0[i] + j.bad_row, j.bad_col, i, j.bad_row,
                      rows[i]);
      kn_linear_free(lin);
      return rc;
    }
  }
  lin_mark(lin, 0, n_out, true);
  *out = lin;
  return 0;
}

/* ---- forward ----------------------------------------------------------------------- */

int kn__linear_validate(const kn_linear *lin, uint32_t T, const float *x, const float *y,
                        const char *who, mr_err *e) {
  if (!lin) return mr_err_set(e, MR_EINVAL, "%s: lin is required", who);
  if (T > KN_LINEAR_MAX_TOKENS)
    return mr_err_set(e, MR_ERANGE, "T = %u, must be in 0..%u (tokens per call)", T, KN_LINEAR_MAX_TOKENS);
  if (T == 0) return 0;
  if (!x || !y) return mr_err_set(e, MR_EINVAL, "%s: x and y are required", who);
  const uint32_t N = lin->L.d.hidden;
  if (lin->n_loaded != N) {
    uint32_t r = 0;
    while (r < N && ((lin->loaded[r >> 6] >> (r & 63)) & 1u)) r++;
    return mr_err_set(e, MR_EPRECOND, "%s: row %u of W [%u x %u] is not loaded (%u of %u rows are)", who,
                      r, N, lin->L.d.inter, lin->n_loaded, N);
  }
  return 0;
}

/* One kn_linear_forward on the engine's workers: items (row block b, token tile t), item
 * = b * n_tiles + t (block-major, so that the workers running at one time share a block's
 * weights in the LLC when there are several tiles). Read-only during the run except the
 * work list and the y rows each item owns. */
typedef struct lin_job {
  const kn_linear *lin;
  const kn_layer *L;
  const kn__kernel *kern;
  const float *x;          /* [T, K] */
  float *y;                /* [T, N] */
  uint32_t T, tile, n_tiles; /* tokens per tile (the last may be short), tiles */
  uint32_t n_blocks;       /* output-row blocks */
  const uint32_t *bounds;  /* [n_blocks + 1]: block b is rows bounds[b] .. bounds[b + 1] - 1 */
  float *tmp;              /* [n_workers][tmp_stride]: kernel scratch per worker */
  size_t tmp_stride;
  kn__work work;
} lin_job;

static void lin_fwd_fn(void *arg, const kn__pool_ctx *c) {
  lin_job *j = arg;
  const uint32_t N = j->L->d.hidden, K = j->L->d.inter;
  float *tmp = j->tmp + (size_t)c->worker * j->tmp_stride;
  uint32_t g, it;
  while (kn__work_claim(&j->work, c, &g, &it)) {
    const uint32_t b = it / j->n_tiles, tl = it % j->n_tiles;
    const uint32_t j0 = j->bounds[b], j1 = j->bounds[b + 1];
    const uint32_t t0 = tl * j->tile, n = t0 + j->tile < j->T ? j->tile : j->T - t0;
    const float *xt = j->x + (size_t)t0 * K;
    /* The block's band (blocks never cross one): its rows from its own base, written at
     * the band's offset in y, whose row stride stays N. */
    const kn_linear *lin = j->lin;
    uint32_t band = 0;
    while (j0 >= lin->band_row0[band + 1]) band++;
    const uint32_t r0 = lin->band_row0[band];
    /* The down kernels only read h: x stands in for it (internal.h section E). */
    const kn__task task = {.L = j->L, .slice = 0, .w = lin->w.in_place ? &lin->band[band] : &lin->w,
                           .n = n, .x = xt, .xq = NULL, .h = (float *)xt,
                           .y = j->y + (size_t)t0 * N + r0, .tmp = tmp};
    j->kern->down(&task, j0 - r0, j1 - r0);
  }
}

/* Tokens per tile for T tokens: T itself when it is small; else the most (<= TILE_MAX,
 * >= TILE_MIN) whose activations fit TILE_BYTES, evened out over the tiles and rounded
 * up to whole 4-token blocks (the compute tiles' token count). The kernel's bytes per
 * token are its tmp growth per token, or the fp32 row it reads in place when it converts
 * nothing (f32 / f16 and the REF kernels). */
static uint32_t lin_tile_tokens(const kn__kernel *k, const kn_layer *L, uint32_t T) {
  if (T <= KN__LINEAR_TILE_MIN) return T;
  size_t per = (k->tmp_floats(L, 0, 2) - k->tmp_floats(L, 0, 1)) * sizeof(float);
  if (per == 0) per = (size_t)L->d.inter * sizeof(float);
  size_t tile = KN__LINEAR_TILE_BYTES / per;
  if (tile > KN__LINEAR_TILE_MAX) tile = KN__LINEAR_TILE_MAX;
  if (tile < KN__LINEAR_TILE_MIN) tile = KN__LINEAR_TILE_MIN;
  if (T <= tile) return T;
  const size_t n_tiles = (T + tile - 1) / tile;
  tile = ((T + n_tiles - 1) / n_tiles + 3) & ~(size_t)3;
  return (uint32_t)tile;
}

/* Output-row blocks, guided: each takes about 1 / (KN__LINEAR_GUIDED_DIV * workers) of the
 * rows still left, in multiples of KN__LINEAR_ROW_UNIT rows: big blocks first (long
 * sequential streams through W), small ones last, so that the workers finish together
 * even when one of them started late or runs slower (a shared core). Tiles of more than
 * KN__LINEAR_TILE_MIN tokens (compute-bound) take blocks of at least
 * KN__LINEAR_PREFILL_ROWS rows, or fewer when that would leave fewer than two items per
 * worker: each call converts the tile's activations once (the down kernels' tmp) and
 * restarts its tile pipeline, which small blocks pay too often. Writes the bounds (block
 * b is rows bounds[b] .. bounds[b + 1] - 1) when bounds is not NULL; returns the count. */
static uint32_t lin_blocks(uint32_t N, uint32_t workers, uint32_t tile, uint32_t n_tiles, uint32_t *bounds) {
  const uint64_t unit = KN__LINEAR_ROW_UNIT, div = (uint64_t)KN__LINEAR_GUIDED_DIV * workers;
  uint64_t min_rows = unit;
  if (tile > KN__LINEAR_TILE_MIN) {
    min_rows = (uint64_t)N * n_tiles / (2ull * workers) / unit * unit;
    if (min_rows > KN__LINEAR_PREFILL_ROWS) min_rows = KN__LINEAR_PREFILL_ROWS;
    if (min_rows < unit) min_rows = unit;
  }
  uint32_t nb = 0, at = 0;
  if (bounds) bounds[0] = 0;
  while (at < N) {
    uint64_t bs = workers <= 1 ? N : ((uint64_t)(N - at) + div - 1) / div;
    bs = (bs + unit - 1) / unit * unit;
    if (bs < min_rows) bs = min_rows;
    at = bs >= N - at ? N : at + (uint32_t)bs;
    nb++;
    if (bounds) bounds[nb] = at;
  }
  return nb;
}

/* Cuts the nb blocks of bounds (room for nb + lin->n_bands) at the bands' edges, so that
 * no block crosses one; returns the new count. One band: nothing to cut. */
static uint32_t lin_cut_bands(const kn_linear *lin, uint32_t *bounds, uint32_t nb) {
  for (uint32_t b = 1; b < lin->n_bands; b++) {
    const uint32_t edge = lin->band_row0[b];
    uint32_t i = 0;
    while (bounds[i] < edge) i++; /* bounds[nb] = N > edge */
    if (bounds[i] == edge) continue;
    memmove(&bounds[i + 1], &bounds[i], (size_t)(nb + 1 - i) * sizeof *bounds);
    bounds[i] = edge;
    nb++;
  }
  return nb;
}

int kn_linear_forward(kn_engine *eng, const kn_linear *lin, uint32_t T, const float *x, float *y,
                      mr_arena *scratch, mr_err *e) {
  if (!eng) return mr_err_set(e, MR_EINVAL, "kn_linear_forward: engine is required");
  int rc = kn__linear_validate(lin, T, x, y, "kn_linear_forward", e);
  if (rc || T == 0) return rc;
  const kn_layer *L = &lin->L;
  const uint32_t N = L->d.hidden, nw = eng->plan.n_workers;
  lin_job j = {.lin = lin, .L = L, .kern = eng->kern[L->d.format], .x = x, .y = y, .T = T};
  j.tile = lin_tile_tokens(j.kern, L, T);
  j.n_tiles = (T + j.tile - 1) / j.tile;
  j.n_blocks = lin_blocks(N, nw, j.tile, j.n_tiles, NULL);
  mr_arena *ar = scratch ? scratch : &eng->scratch;
  uint32_t *bounds = mr_arena_alloc(ar, ((size_t)j.n_blocks + lin->n_bands) * sizeof *bounds,
                                    KN_PACK_ALIGN);
  if (!bounds) {
    rc = mr_err_set(e, MR_ENOMEM, "kn_linear_forward: out of scratch memory (%u row blocks)", j.n_blocks);
    goto out_reset;
  }
  lin_blocks(N, nw, j.tile, j.n_tiles, bounds);
  j.n_blocks = lin_cut_bands(lin, bounds, j.n_blocks);
  j.bounds = bounds;
  j.tmp_stride = (j.kern->tmp_floats(L, 0, j.tile) + 15) & ~(size_t)15; /* whole cache lines */
  const size_t tmp_bytes = j.tmp_stride * nw * sizeof(float);
  j.tmp = mr_arena_alloc(ar, tmp_bytes + 1, KN_PACK_ALIGN);
  if (!j.tmp) {
    rc = mr_err_set(e, MR_ENOMEM, "kn_linear_forward: out of scratch memory (%zu bytes)", tmp_bytes);
    goto out_reset;
  }
  const uint32_t items = j.n_blocks * j.n_tiles;
  kn__work_init(&j.work, 1, &items);
  kn__pool_run(eng->pool, lin_fwd_fn, &j);

out_reset:
  if (!scratch) mr_arena_reset(&eng->scratch);
  return rc;
}

/* ---- kn_engine_run ----------------------------------------------------------------- */

typedef struct run_job {
  kn_item_fn fn;
  void *arg;
  kn__work work;
} run_job;

static void run_fn(void *arg, const kn__pool_ctx *c) {
  run_job *j = arg;
  uint32_t g, it;
  while (kn__work_claim(&j->work, c, &g, &it)) j->fn(j->arg, it, c->worker);
}

void kn_engine_run(kn_engine *eng, uint32_t n_items, kn_item_fn fn, void *arg) {
  MR_ASSERT(eng && fn);
  if (n_items == 0) return;
  run_job j = {.fn = fn, .arg = arg};
  kn__work_init(&j.work, 1, &n_items);
  kn__pool_run(eng->pool, run_fn, &j);
}
