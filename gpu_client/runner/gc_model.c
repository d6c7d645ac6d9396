/*
 * gc_model.c - the whole-model runner (model.h): loading, the placement of experts, the
 * forward step and generation.
 *
 * Checkpoint names (HF layout; the Mixtral names in brackets):
 *   model.embed_tokens.weight                       [V, H]
 *   model.layers.L.input_layernorm.weight           [H]
 *   model.layers.L.self_attn.{q,k,v,o}_proj.weight  [nh*hd, H] [kv*hd, H] [kv*hd, H] [H, nh*hd]
 *   model.layers.L.self_attn.{q,k,v,o}_proj.bias    with attention_bias (o optional)
 *   model.layers.L.self_attn.{q,k}_norm.weight      [hd] (Qwen3)
 *   model.layers.L.post_attention_layernorm.weight  [H]
 *   model.layers.L.mlp.gate.weight                  [E, H] router (block_sparse_moe.gate)
 *   model.layers.L.mlp.experts.X.{gate,up,down}_proj.weight   (block_sparse_moe.experts.X.w1/w3/w2)
 *   model.layers.L.mlp.{gate,up,down}_proj.weight   dense layers (mlp_only_layers, sparse step)
 *   model.norm.weight                               [H]
 *   lm_head.weight                                  [V, H] (absent when tied)
 *
 * q, k and v are packed into one linear (rows q | k | v) and a dense MLP's gate and up
 * into one (rows gate | up), so that one pass over the weights serves them.
 *
 * Tensor parallelism (--tp G, comm.h): rank r holds heads [r*nh/G, (r+1)*nh/G) of q/k/v
 * (q_b and kv_b with MLA), the matching columns of o_proj, rows [r*I/G, ...) of each dense
 * or shared MLP's gate and up and those columns of down, and every G-th of a layer's hot
 * experts; router, norms and embedding are replicated, lm_head is rank 0's. Each layer's
 * attention and its MLP/MoE end in a partial sum y_r that one all-reduce joins before
 * x += y. Rank 0 alone talks to the servers and adds their sum into its y.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "gpu_client/runner/comm.h"
#include "gpu_client/runner/model.h"

#define MODEL_DEFAULT_MAX_SEQ 4096u
#define MODEL_MAX_SEQ (1u << 20)
#define MODEL_MAX_BATCH 4096u
/* Loading progress: a line at most this often. */
#define MODEL_PROGRESS_NS 2000000000ull

typedef struct model_layer {
  bool moe;
  /* qkv: q | k | v rows; with MLA q_a | kv_a (q_lora_rank) or q | kv_a (no q_lora_rank) */
  gc_bk_linear *qkv, *o;
  gc_bk_linear *q_b;              /* MLA with q_lora_rank: [nh * (nope + rope), q_lora] */
  float *q_a_norm, *kv_a_norm;    /* MLA: device [q_lora], [kv_lora] */
  float *w_kv_b;                  /* MLA: device [nh * (nope + v), kv_lora] fp32 kv_b_proj */
  float *e_bias;                  /* noaux_tc: device [E] e_score_correction_bias */
  gc_bk_linear *sh_gate_up, *sh_down; /* shared experts (DeepSeek): one MLP of width Is */
  float *qkv_bias, *o_bias;       /* device, or NULL */
  float *ln1, *ln2;               /* device [H] */
  float *q_norm, *k_norm;         /* device [hd], Qwen3 */
  gc_bk_linear *router;           /* MoE: [E, H] */
  gc_bk_experts *hot;             /* MoE: the local experts, or NULL when none */
  uint32_t n_hot;
  gc_bk_linear *gate_up, *down;   /* dense MLP */
  float *k_cache, *v_cache;       /* device [max_batch, max_seq, kv*hd]; MLA: k_cache holds
                                   * [max_batch, max_seq, kv_lora + rope] latents, no v_cache */
} model_layer;

/* Per-step buffers of one rank, grown to the largest T seen. */
typedef struct model_bufs {
  uint32_t cap;                   /* tokens they hold */
  float *x, *h, *qkv, *attn, *y, *router, *gu, *mh;   /* device */
  float *q, *qa, *y2;             /* device, MLA [T, nh * qh], [T, q_lora]; shared [T, H] */
  int32_t *ids;                   /* host [T * k] routed ids */
  float *w;                       /* host [T * k] */
  int32_t *hot_ids;               /* host [T * k] ids with the cold ones -1 */
  void *wire;                     /* host [T, H] hidden states in the wire dtype */
  float *cold;                    /* host [T, H] fp32 sum of the servers' parts */
  uint32_t *pos, *seq;            /* host [T] */
} model_bufs;

/* One tensor-parallel rank: its backend, its slices of the weights, its buffers; rank 0
 * is the thread that calls gc_model_step, ranks 1.. are threads of the model's own. */
typedef struct model_rank {
  uint32_t id;
  kn_engine *eng;                 /* rank 0: the model's; others their own (cpu) or it */
  bool own_eng;
  gc_backend *bk;
  model_layer *layer;             /* [L] */
  model_bufs b;
  gc_bk_table *embed;
  gc_bk_linear *head;             /* rank 0 */
  float *final_norm, *inv_freq, *head_x, *head_out;
  uint32_t head_cap;
  pthread_t th;
  bool th_started;
  int rc;                         /* of its part of the last step */
  mr_err err;
} model_rank;

struct gc_model {
  mr_model_config cfg;
  gc_model_opts o;
  char model_dir[1024];
  kn_engine *eng;
  uint32_t tp;                    /* ranks (1 = no tensor parallelism) */
  model_rank *rk;                 /* [tp] */
  gc_comm *comm;                  /* tp > 1 */
  /* Per-rank widths: heads, kv heads, dense and shared MLP columns, rows of the fused
   * qkv linear (q_a | kv_a stay whole with MLA: every rank computes the latent). */
  uint32_t lnh, lnkv, lId, lIs, ln_qkv, ln_qa;
  uint8_t *owner;                 /* [L * E] rank that computes a local expert */
  /* Worker ranks' step hand-off: rank 0 bumps st_gen and waits for st_pending == 0. */
  pthread_mutex_t st_mu;
  pthread_cond_t st_cv, st_done_cv;
  bool st_inited, st_stop;
  uint64_t st_gen;
  uint32_t st_pending;
  const gc_step *st_step;
  gc_cluster *cluster;
  gc_moe *moe;
  uint32_t H, V, nh, nkv, hd, E, k, L, Id, Ie;
  uint32_t n_qkv;                 /* rows of the qkv linear */
  /* MLA (DeepSeek-V3 family) */
  bool mla;
  uint32_t q_lora, kv_lora, nope, rope, vd, qh; /* qh = nope + rope, a query head's width */
  uint32_t n_qa;                  /* rows of the qkv linear before the kv_a part */
  uint32_t Is;                    /* shared experts' intermediate width (0 = none) */
  uint32_t rot_dim;               /* RoPE width: hd, or rope with MLA */
  float attn_scale, rope_scale;   /* softmax scale; cos/sin factor (yarn) */
  uint32_t max_seq, max_batch;
  uint32_t last_moe;              /* index of the last MoE layer */
  mr_dtype wire;
  kn_format dense_fmt, expert_fmt;
  uint32_t expert_group;
  uint8_t *local;                 /* [L * E] the client computes it */
  uint32_t *seq_len;              /* [max_batch] */
  uint64_t dense_bytes, expert_bytes_one, hot_bytes;
  uint64_t n_mapped;              /* hot experts served in place (o.map_weights) */
  uint64_t dense_mapped_bytes;    /* dense linears and embedding tables served in place,
                                   * summed over ranks (o.map_weights) */
  uint64_t embed_mapped_bytes;    /* the embedding tables' part of it */
  uint64_t n_dense_packed;        /* dense linears packed under o.map_weights, and why the
                                   * first was (the model-open line) */
  char dense_packed_why[256];
  uint64_t n_dense_fp8;           /* dense linears kept in fp8-b128 (an FP8 checkpoint's codes) */
  uint32_t fp8_slow_said;         /* fp8_fast said once why FP8 dense weights go to bf16 */
  mr_st *st_kept;                 /* the mapping they read: closed after the ranks */
  uint64_t *seen;                 /* [ceil(E / 64)] experts activated in a step */
  gc_model_stats st;
  gc_layer_stats *lst;
  gc_layer_stats *lst_snap; /* [L] what gc_model_stats_get handed out last */
  /* Metrics for gc_model_metrics_render: written by the stepping thread with __atomic
   * builtins, read by the metrics responder thread; never reset. */
  mr_hist step_hist;              /* wall time of gc_model_step, ns */
  mr_hist rpc_hist;               /* a MoE layer's immediate call: requests queued -> last reply, ns */
  uint64_t mx_steps, mx_tokens, mx_generated, mx_local_slots;
  /* Live placement (--watch-placement, docs/DESIGN.md section 15). The stepping thread
   * checks the file at each step boundary and swaps cluster and moe under cl_lock, which
   * the metrics responder holds while it reads the cluster; pl_* under pl_lock. */
  mr_cluster_file *cf;            /* the parsed cluster file, kept for reopening */
  pthread_mutex_t cl_lock, pl_lock;
  bool locks_inited;
  struct stat pl_stat;            /* of the file last looked at (dev, ino, mtime, size) */
  uint64_t pl_gen;                /* 1 = the placement opened with, +1 per switch */
  uint64_t pl_hash;               /* FNV-1a 64 of the active file's bytes */
  double pl_switched_at;          /* Unix time of the last switch (or of open) */
  char client_name[64];           /* its Hello's and Forward streams' name: "moerpc-client
                                   * model pid=N", one per process (apply reports it) */
  uint64_t pl_rejected;           /* new files refused (the old placement stayed) */
  char pl_error[512];             /* why the last one was refused, "" = none */
  /* Routing counters without a cluster (with one, the cluster's count every slot). */
  gc_routing *routing_own;
  char fingerprint[64];           /* the model's (the servers' with a cluster) */
};

void gc_model_opts_init(gc_model_opts *o) {
  memset(o, 0, sizeof *o);
  o->local_experts = -1;
  o->engine.isa = KN_ISA_COUNT;
  o->expert_format = KN_FMT_COUNT;
  o->dense_format = KN_FMT_COUNT;
}

const mr_model_config *gc_model_config(const gc_model *m) { return &m->cfg; }
uint32_t gc_model_max_seq(const gc_model *m) { return m->max_seq; }
uint32_t gc_model_max_batch(const gc_model *m) { return m->max_batch; }
gc_cluster *gc_model_cluster(gc_model *m) { return m->cluster; }
gc_routing *gc_model_routing(gc_model *m) {
  return m->cluster ? gc_cluster_routing(m->cluster) : m->routing_own;
}
/* Both may run on the metrics responder's thread: cl_lock keeps a placement switch from
 * closing the cluster (and its counters) under them. A switch starts the counters afresh
 * (they belong to the cluster). */
int gc_model_routing_json(gc_model *m, gc_routing_span span, mr_buf *out, mr_err *e) {
  pthread_mutex_lock(&m->cl_lock);
  int rc = gc_routing_json(gc_model_routing(m), span, m->fingerprint, out, e);
  pthread_mutex_unlock(&m->cl_lock);
  return rc;
}
int gc_model_routing_save(gc_model *m, gc_routing_span span, const char *path, mr_err *e) {
  pthread_mutex_lock(&m->cl_lock);
  int rc = gc_routing_save(gc_model_routing(m), span, m->fingerprint, path, e);
  pthread_mutex_unlock(&m->cl_lock);
  return rc;
}
kn_engine *gc_model_engine(gc_model *m) { return m->eng; }
uint64_t gc_model_dense_bytes(const gc_model *m) { return m->dense_bytes; }
uint64_t gc_model_expert_bytes(const gc_model *m) { return m->expert_bytes_one; }
bool gc_model_is_local(const gc_model *m, uint32_t l, uint32_t x) {
  return l < m->L && x < m->E && m->local[(size_t)l * m->E + x];
}
bool gc_model_local_rule(uint32_t layer, uint32_t expert, uint32_t n, uint32_t E) {
  if (n >= E) return true;
  uint32_t first = (uint32_t)(((uint64_t)layer * n) % E);
  uint32_t d = (expert + E - first) % E; /* distance from the layer's first local expert */
  return d < n;
}

/* ---- loading ----------------------------------------------------------------------------- */

typedef struct loader {
  gc_model *m;
  model_rank *r;                  /* the rank being loaded */
  const mr_st *st;
  uint64_t bytes_total, bytes_done, tensors_done, tensors_total;
  uint64_t t0, t_last;
} loader;

static void load_progress(loader *ld, bool final) {
  if (ld->m->o.quiet) return;
  uint64_t now = mr_now_ns();
  if (!final && now - ld->t_last < MODEL_PROGRESS_NS) return;
  ld->t_last = now;
  double s = (double)(now - ld->t0) / 1e9, gb = (double)ld->bytes_done / 1e9;
  double rate = s > 0 ? gb / s : 0;
  double eta = rate > 0 ? ((double)ld->bytes_total / 1e9 - gb) / rate : 0;
  if (final)
    mr_log(MR_LOG_INFO, "model: loaded %llu/%llu tensors, %.2f/%.2f GB, %.2f GB/s, took %.3f s",
           (unsigned long long)ld->tensors_done, (unsigned long long)ld->tensors_total, gb,
           (double)ld->bytes_total / 1e9, rate, s);
  else
    mr_log(MR_LOG_INFO, "model: loading %llu/%llu tensors, %.2f/%.2f GB, %.2f GB/s, ETA %.0f s",
           (unsigned long long)ld->tensors_done, (unsigned long long)ld->tensors_total, gb,
           (double)ld->bytes_total / 1e9, rate, eta);
}

static void load_count(loader *ld, const mr_st_tensor *t) {
  if (ld->r->id != 0) return; /* progress counts rank 0's pass (the others read the same) */
  ld->bytes_done += t->nbytes;
  ld->tensors_done++;
  load_progress(ld, false);
}

static int get_tensor(loader *ld, const char *name, uint32_t ndim, uint64_t d0, uint64_t d1,
                      const mr_st_tensor **out, mr_err *e) {
  const uint64_t shape[2] = {d0, d1};
  int rc = mr_st_expect(ld->st, name, ndim, shape, out, e);
  if (rc) return mr_err_prefix(e, rc, "model %s", ld->m->model_dir);
  return 0;
}

/* get_tensor for a weight matrix that may also be F8_E4M3 (an FP8 checkpoint). */
static int get_weight(loader *ld, const char *name, uint64_t d0, uint64_t d1,
                      const mr_st_tensor **out, mr_err *e) {
  const mr_st_tensor *t = mr_st_find(ld->st, name);
  if (!t || !mr_st_is_f8e4m3(t)) return get_tensor(ld, name, 2, d0, d1, out, e);
  const uint64_t shape[2] = {d0, d1};
  int rc = mr_st_expect_as(ld->st, name, "F8_E4M3", 2, shape, out, e);
  if (rc) return mr_err_prefix(e, rc, "model %s", ld->m->model_dir);
  return 0;
}

/* Uploads n host floats into a new device vector *out of rank r. */
static int dev_vec(gc_model *m, model_rank *r, const float *host, size_t n, float **out,
                   mr_err *e) {
  float *dev = r->bk->ops->alloc(r->bk, n * sizeof *dev);
  if (!dev) return mr_err_set(e, MR_ENOMEM, "a vector of %zu floats: out of memory", n);
  int rc = r->bk->ops->upload(r->bk, dev, host, n, e);
  if (rc) {
    r->bk->ops->free(r->bk, dev);
    return rc;
  }
  m->dense_bytes += (uint64_t)n * sizeof(float);
  *out = dev;
  return 0;
}

/* Reads 1-D tensor name of n elements as fp32 into host[0..n). */
static int read_vec(loader *ld, const char *name, uint32_t n, float *host, mr_err *e) {
  const mr_st_tensor *t;
  int rc = get_tensor(ld, name, 1, n, 0, &t, e);
  if (rc) return rc;
  mr_convert_to_f32(host, t->data, t->dtype, n);
  load_count(ld, t);
  return 0;
}

/* A 1-D fp32 device vector from tensor name of n elements (optional: absent -> *out NULL). */
static int load_vec(loader *ld, const char *name, uint32_t n, bool optional, float **out,
                    mr_err *e) {
  *out = NULL;
  if (optional && !mr_st_find(ld->st, name)) return 0;
  float *host = mr_malloc((size_t)n * sizeof *host);
  if (!host) return mr_err_set(e, MR_ENOMEM, "%s: out of memory", name);
  int rc = read_vec(ld, name, n, host, e);
  if (!rc) rc = dev_vec(ld->m, ld->r, host, n, out, e);
  mr_free(host);
  return rc;
}

/* The kn format that keeps weights of dtype dt as they are. */
static kn_format dense_format_of_dtype(mr_dtype dt) {
  return dt == MR_DTYPE_F32 ? KN_FMT_F32 : dt == MR_DTYPE_F16 ? KN_FMT_F16 : KN_FMT_BF16;
}

/* The format a dense weight of dtype dt is kept in. */
static kn_format dense_format_of(const gc_model *m, mr_dtype dt) {
  if (m->dense_fmt != KN_FMT_COUNT) return m->dense_fmt;
  return dense_format_of_dtype(dt);
}

/* The block scales of F8_E4M3 tensor name ([N, K]: FP8 checkpoints, every linear of
 * DeepSeek-V3's decoder layers), its "<name>_scale_inv" [ceil(N/128), ceil(K/128)] (F32 or
 * BF16), as a new fp32 array (the caller frees it), checked finite and > 0; *scale_t: that
 * tensor, for the caller's load_count once the weight is kept. */
static int fp8_scales(loader *ld, const char *name, uint32_t N, uint32_t K, float **out,
                      const mr_st_tensor **scale_t, mr_err *e) {
  gc_model *m = ld->m;
  *out = NULL;
  if (!m->cfg.fp8)
    return mr_err_set(e, MR_EFORMAT, "model %s: %s is F8_E4M3 but config.json has no fp8 "
                      "quantization_config", m->model_dir, name);
  char sn[160];
  snprintf(sn, sizeof sn, "%s_scale_inv", name);
  const uint32_t R = (N + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK, C = (K + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
  const mr_st_tensor *st;
  int rc = get_tensor(ld, sn, 2, R, C, &st, e);
  if (rc) return rc;
  float *sc = mr_malloc((size_t)R * C * sizeof *sc);
  if (!sc) return mr_err_set(e, MR_ENOMEM, "%s: %u x %u floats: out of memory", sn, R, C);
  mr_convert_to_f32(sc, st->data, st->dtype, (size_t)R * C);
  if ((rc = kn_fp8_check_scales(sc, N, K, sn, e))) {
    mr_free(sc);
    return mr_err_prefix(e, rc, "model %s", m->model_dir);
  }
  *scale_t = st;
  *out = sc;
  return 0;
}

/* Dequantizes rows [row0, row0 + n) of an F8_E4M3 [N, K] tensor with its block scales into
 * dst ([n, K] fp32): w = e4m3(q) * scale_inv[row / 128, k / 128], exactly (docs/DESIGN.md
 * section 17), on the rank's engine workers. */
static int fp8_dequant(loader *ld, const char *name, const mr_st_tensor *t, uint32_t N,
                       uint32_t K, uint32_t row0, uint32_t n, float *dst, mr_err *e) {
  float *sc;
  const mr_st_tensor *st;
  int rc = fp8_scales(ld, name, N, K, &sc, &st, e);
  if (rc) return rc;
  rc = kn_fp8_dequant_b128(ld->r->eng, t->data, sc, N, K, row0, n, dst, e);
  mr_free(sc);
  if (rc) return mr_err_prefix(e, rc, "model %s: %s", ld->m->model_dir, name);
  load_count(ld, st);
  return 0;
}

/* One part of a linear: rows [row0, row0 + n) of tensor name ([rows, n_in]). */
typedef struct lin_part {
  const char *name;
  uint32_t rows, row0, n;
} lin_part;

/* Notes why a dense weight is packed under --map-weights (the first reason is logged). */
static void dense_packed(gc_model *m, const char *name, const char *why) {
  if (m->n_dense_packed++ == 0)
    snprintf(m->dense_packed_why, sizeof m->dense_packed_why, "%.60s: %.180s", name, why);
}

/* Frees the n fp32 block-scale arrays of an FP8 linear's parts. */
static void free_scales(float **sc, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) mr_free(sc[i]);
}

/* Rows of part p (tensor t [p->rows, n_in], columns [col0, col0 + n_cols)) into rows row0..
 * of w through linear_load: as stored, or dequantized to fp32 when F8_E4M3 (FP8 weights kept
 * in a float format: an engine without an fp8 kernel, --dense-format, a column slice that is
 * not whole blocks, parts beside float ones). A band of about 2M elements at a time, so that
 * the fp32 copy and a column slice's gather reuse one buffer of a few MB rather than taking
 * new memory the size of the tensor (the VMs give new memory slowly). */
static int load_float_part(loader *ld, const lin_part *p, const mr_st_tensor *t, uint32_t n_in,
                           uint32_t col0, uint32_t n_cols, gc_bk_linear *w, uint32_t row0,
                           mr_err *e) {
  gc_backend *bk = ld->r->bk;
  const bool f8 = mr_st_is_f8e4m3(t), gather = n_cols != n_in;
  const mr_dtype dt = f8 ? MR_DTYPE_F32 : t->dtype;
  const size_t es = mr_dtype_size(dt);
  const uint32_t band = n_in >= (1u << 21) ? 1u : (1u << 21) / n_in;
  const uint32_t nb = band < p->n ? band : p->n;
  float *sc = NULL, *conv = NULL;
  uint8_t *slice = NULL;
  const mr_st_tensor *st = NULL;
  int rc = f8 ? fp8_scales(ld, p->name, p->rows, n_in, &sc, &st, e) : 0;
  if (rc) return rc;
  if ((f8 && !(conv = mr_malloc((size_t)nb * n_in * sizeof *conv))) ||
      (gather && !(slice = mr_malloc((size_t)nb * n_cols * es))))
    rc = mr_err_set(e, MR_ENOMEM, "%u rows of %u floats: out of memory", nb, n_in);
  for (uint32_t r = 0; r < p->n && !rc; r += nb) {
    const uint32_t n = p->n - r < nb ? p->n - r : nb;
    const uint8_t *src = (const uint8_t *)t->data + (size_t)(p->row0 + r) * n_in * es;
    if (f8) {
      if ((rc = kn_fp8_dequant_b128(ld->r->eng, t->data, sc, p->rows, n_in, p->row0 + r, n, conv, e)))
        break; /* named by the caller (the part's tensor) */
      src = (const uint8_t *)conv;
    }
    if (gather) { /* a column slice: gathered row by row */
      for (uint32_t row = 0; row < n; row++)
        memcpy(slice + (size_t)row * n_cols * es, src + ((size_t)row * n_in + col0) * es,
               (size_t)n_cols * es);
      src = slice;
    }
    rc = bk->ops->linear_load(bk, w, row0 + r, n, src, dt, e);
  }
  if (!rc && st) load_count(ld, st);
  mr_free(sc);
  mr_free(conv);
  mr_free(slice);
  return rc;
}

/* A linear served in place from the mapping (--map-weights, as the hot experts): where the
 * parts are whole rows of tensors stored in the format served (no column slice, no
 * conversion, no --dense-format of another format; FP8 codes served as fp8-b128) and the
 * backend can. Each part is read through the huge-page-advised mapping first
 * (MADV_POPULATE_READ: 2 MiB folios, mapped 2 MiB at a time), then checked finite and
 * kept. Returns MR_ENOTSUP (nothing made, nothing said) where it is packed instead;
 * another error fails the load. */
static int borrow_linear(loader *ld, const lin_part *p, const mr_st_tensor *const *t,
                         uint32_t n_parts, uint32_t n_in, uint32_t n_cols, bool mixed, kn_format fmt,
                         gc_bk_linear **out, mr_err *e) {
  gc_model *m = ld->m;
  gc_backend *bk = ld->r->bk;
  const mr_dtype dt = t[0]->dtype;
  const bool f8 = fmt == KN_FMT_FP8 && mr_st_is_f8e4m3(t[0]) && !mixed;
  const char *why = NULL;
  if (f8 ? !bk->ops->linear_borrow_fp8 : !bk->ops->linear_borrow) why = "the backend copies weights";
  else if (!f8 && (mr_st_is_f8e4m3(t[0]) || mixed)) why = "dequantized or widened at load";
  else if (!f8 && fmt != dense_format_of_dtype(dt)) why = "--dense-format converts it";
  else if (n_cols != n_in) why = "a column slice (tensor parallel)";
  if (why) {
    dense_packed(m, p[0].name, why);
    return MR_ENOTSUP;
  }
  const void *w[KN_LINEAR_MAX_BANDS];
  uint32_t rows[KN_LINEAR_MAX_BANDS], first[KN_LINEAR_MAX_BANDS];
  float *sc[KN_LINEAR_MAX_BANDS] = {0};
  const mr_st_tensor *sct[KN_LINEAR_MAX_BANDS] = {0};
  MR_ASSERT(n_parts <= KN_LINEAR_MAX_BANDS);
  const size_t esz = f8 ? 1 : mr_dtype_size(dt);
  int rc = 0;
  for (uint32_t i = 0; i < n_parts && !rc; i++) {
    mr_st_populate(t[i]);
    w[i] = (const uint8_t *)t[i]->data + (size_t)p[i].row0 * n_in * esz;
    rows[i] = p[i].n;
    first[i] = p[i].row0;
    if (f8) rc = fp8_scales(ld, p[i].name, p[i].rows, n_in, &sc[i], &sct[i], e);
  }
  if (rc) {
    free_scales(sc, n_parts);
    return rc;
  }
  mr_err e2 = {0};
  rc = f8 ? bk->ops->linear_borrow_fp8(bk, out, n_parts, (const uint8_t *const *)w, rows, n_in,
                                       (const float *const *)sc, first, &e2)
          : bk->ops->linear_borrow(bk, out, n_parts, w, rows, n_in, dt, &e2);
  free_scales(sc, n_parts);
  if (rc == MR_ENOTSUP) {
    dense_packed(m, p[0].name, e2.msg);
    return rc;
  }
  if (rc) { /* named by its parts (the message's "part i" is the i-th) */
    char names[4 * 128 + 16];
    size_t at = 0;
    for (uint32_t i = 0; i < n_parts && at < sizeof names; i++)
      at += (size_t)snprintf(names + at, sizeof names - at, "%s%s", i ? " | " : "", p[i].name);
    return mr_err_set(e, rc, "%s: %s", names, e2.msg);
  }
  for (uint32_t i = 0; i < n_parts; i++) {
    load_count(ld, t[i]);
    if (sct[i]) load_count(ld, sct[i]);
  }
  const uint64_t bytes = bk->ops->linear_bytes(*out);
  m->dense_bytes += bytes;
  m->dense_mapped_bytes += bytes;
  if (f8) m->n_dense_fp8++;
  return 0;
}

/* Part p of an FP8 linear from its codes, kept as they are (fp8-b128): rows [p->row0,
 * p->row0 + p->n) of tensor t, over columns [col0, col0 + n_cols) (col0 a multiple of 128:
 * the slice's blocks are whole blocks of the tensor), into rows row0.. of w. */
static int load_fp8_part(loader *ld, const lin_part *p, const mr_st_tensor *t, uint32_t n_in,
                         uint32_t col0, uint32_t n_cols, gc_bk_linear *w, uint32_t row0, mr_err *e) {
  gc_backend *bk = ld->r->bk;
  float *sc = NULL, *ssl = NULL;
  uint8_t *qsl = NULL;
  const mr_st_tensor *st;
  int rc = fp8_scales(ld, p->name, p->rows, n_in, &sc, &st, e);
  if (rc) return rc;
  const uint8_t *q = (const uint8_t *)t->data + (size_t)p->row0 * n_in;
  const float *s = sc;
  if (n_cols != n_in) { /* a column slice: its codes gathered, its block columns cut out */
    MR_ASSERT(col0 % KN_FP8_BLOCK == 0);
    const uint32_t R = (p->rows + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK, C = (n_in + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK;
    const uint32_t Cs = (n_cols + KN_FP8_BLOCK - 1) / KN_FP8_BLOCK, c0 = col0 / KN_FP8_BLOCK;
    qsl = mr_malloc((size_t)p->n * n_cols);
    ssl = mr_malloc((size_t)R * Cs * sizeof *ssl);
    if (!qsl || !ssl) {
      rc = mr_err_set(e, MR_ENOMEM, "%s: out of memory", p->name);
      goto out;
    }
    for (uint32_t r = 0; r < p->n; r++) memcpy(qsl + (size_t)r * n_cols, q + (size_t)r * n_in + col0, n_cols);
    for (uint32_t r = 0; r < R; r++) memcpy(ssl + (size_t)r * Cs, sc + (size_t)r * C + c0, Cs * sizeof *ssl);
    q = qsl;
    s = ssl;
  }
  rc = bk->ops->linear_load_fp8(bk, w, row0, p->n, q, s, p->row0, e);
  if (!rc) load_count(ld, st);
out:
  mr_free(sc);
  mr_free(ssl);
  mr_free(qsl);
  return rc;
}

/* Whether the engine has a fast fp8-b128 kernel (AVX-512 with BF16, or AVX2's fp32 FMA),
 * or computes bf16 on the reference too (then fp8 keeps the exact weights at no cost).
 * Else (an fp8 kernel that failed its start-up self-test) an FP8 checkpoint's dense weights
 * are dequantized into bf16, and the first time says so. */
static bool fp8_fast(gc_model *m) {
  if (kn_engine_isa(m->eng, KN_FMT_FP8) != KN_ISA_REF || kn_engine_isa(m->eng, KN_FMT_BF16) == KN_ISA_REF)
    return true;
  if (!m->fp8_slow_said++)
    mr_log(MR_LOG_INFO, "FP8 dense weights are dequantized into bf16: this engine has no fast fp8 "
           "kernel (bf16 runs on %s), the reference would be slower than bf16",
           kn_isa_name(kn_engine_isa(m->eng, KN_FMT_BF16)));
  return false;
}

/* One linear of the parts' row ranges stacked, over input columns [col0, col0 + n_cols) of
 * the tensors' n_in (a tensor-parallel slice; everything: 0, rows / 0, n_in). */
static int load_linear_parts(loader *ld, const lin_part *p, uint32_t n_parts, uint32_t n_in,
                             uint32_t col0, uint32_t n_cols, gc_bk_linear **out, mr_err *e) {
  gc_model *m = ld->m;
  gc_backend *bk = ld->r->bk;
  const mr_st_tensor *t[4];
  uint32_t n_out = 0;
  MR_ASSERT(n_parts <= 4 && col0 + n_cols <= n_in);
  for (uint32_t i = 0; i < n_parts; i++) {
    int rc = get_weight(ld, p[i].name, p[i].rows, n_in, &t[i], e);
    if (rc) return rc;
    MR_ASSERT(p[i].row0 + p[i].n <= p[i].rows);
    n_out += p[i].n;
  }
  /* As stored: FP8 codes as fp8-b128 where the backend keeps them (cuda: dequantized at
   * load and kept in bf16); a tensor-parallel column slice that cuts a 128-column block
   * (toy shapes only: DeepSeek-V3's slices are whole blocks) has no block scales of its
   * own, so it is dequantized exactly into f32, the weights fp8-b128 holds; parts of
   * different dtypes (an FP8 checkpoint's q_a_proj beside a bf16 kv_a_proj_with_mqa) in
   * the widest. --dense-format overrides all of it (fp8: other weights quantized at load). */
  bool mixed = false, any_f32 = false;
  for (uint32_t i = 0; i < n_parts; i++) {
    mixed |= t[i]->dtype != t[0]->dtype || mr_st_is_f8e4m3(t[i]) != mr_st_is_f8e4m3(t[0]);
    any_f32 |= t[i]->dtype == MR_DTYPE_F32;
  }
  /* whole blocks on every rank (their slices are n_cols wide at multiples of n_cols) */
  const bool f8_cols = n_cols == n_in || (n_cols % KN_FP8_BLOCK == 0 && col0 % KN_FP8_BLOCK == 0);
  kn_format fmt = dense_format_of(m, t[0]->dtype);
  if (m->dense_fmt == KN_FMT_COUNT && (mixed || mr_st_is_f8e4m3(t[0])))
    fmt = !mixed && bk->ops->linear_load_fp8 && fp8_fast(m) ? (f8_cols ? KN_FMT_FP8 : KN_FMT_F32)
                                                            : any_f32 ? KN_FMT_F32 : KN_FMT_BF16;
  if (m->o.map_weights) {
    int rc = borrow_linear(ld, p, t, n_parts, n_in, n_cols, mixed, fmt, out, e);
    if (rc != MR_ENOTSUP) return rc;
  }
  int rc = bk->ops->linear_new(bk, out, n_out, n_cols, fmt, 64, e);
  if (rc) return mr_err_prefix(e, rc, "%s", p[0].name);
  uint32_t row0 = 0;
  for (uint32_t i = 0; i < n_parts; i++) {
    if (fmt == KN_FMT_FP8 && mr_st_is_f8e4m3(t[i]) && f8_cols && bk->ops->linear_load_fp8) {
      rc = load_fp8_part(ld, &p[i], t[i], n_in, col0, n_cols, *out, row0, e);
      if (rc) return mr_err_prefix(e, rc, "%s", p[i].name);
      row0 += p[i].n;
      load_count(ld, t[i]);
      continue;
    }
    rc = load_float_part(ld, &p[i], t[i], n_in, col0, n_cols, *out, row0, e);
    if (rc) return mr_err_prefix(e, rc, "%s", p[i].name);
    row0 += p[i].n;
    load_count(ld, t[i]);
  }
  m->dense_bytes += bk->ops->linear_bytes(*out);
  if (fmt == KN_FMT_FP8) m->n_dense_fp8++;
  return 0;
}

/* One linear from n_parts whole tensors stacked by rows (each [rows_i, n_in]). */
static int load_linear(loader *ld, const char *const *names, const uint32_t *rows,
                       uint32_t n_parts, uint32_t n_in, gc_bk_linear **out, mr_err *e) {
  lin_part p[4];
  MR_ASSERT(n_parts <= 4);
  for (uint32_t i = 0; i < n_parts; i++) p[i] = (lin_part){names[i], rows[i], 0, rows[i]};
  return load_linear_parts(ld, p, n_parts, n_in, 0, n_in, out, e);
}

/* A dense MLP of width I (gate | up rows, down columns: rank r's 1/tp of them). */
static int load_mlp(loader *ld, const char *g, const char *u, const char *d, uint32_t I,
                    gc_bk_linear **gate_up, gc_bk_linear **down, mr_err *e) {
  gc_model *m = ld->m;
  const uint32_t n = I / m->tp, off = n * ld->r->id;
  const lin_part gu[2] = {{g, I, off, n}, {u, I, off, n}};
  int rc = load_linear_parts(ld, gu, 2, m->H, 0, m->H, gate_up, e);
  if (rc) return rc;
  const lin_part dn[1] = {{d, m->H, 0, m->H}};
  return load_linear_parts(ld, dn, 1, I, off, n, down, e);
}

/* kv_b_proj [n_heads * (nope + v), kv_lora] as the fp32 device array the absorbed MLA reads:
 * the rows of the rank's heads (from head h0), converted once, on the engine's workers when
 * FP8, straight into the device buffer where that is host memory (cpu), else staged and
 * uploaded. */
static int load_kv_b(loader *ld, const char *name, uint32_t h0, float **out, mr_err *e) {
  gc_model *m = ld->m;
  gc_backend *bk = ld->r->bk;
  const uint32_t N = m->nh * (m->nope + m->vd), K = m->kv_lora;
  const uint32_t row0 = h0 * (m->nope + m->vd), rows = m->lnh * (m->nope + m->vd);
  const size_t n = (size_t)rows * K;
  const mr_st_tensor *t;
  int rc = get_weight(ld, name, N, K, &t, e);
  if (rc) return rc;
  float *dev = bk->ops->alloc(bk, n * sizeof *dev);
  float *host = bk->ops->host_memory ? dev : mr_malloc(n * sizeof *host);
  if (!dev || !host) {
    rc = mr_err_set(e, MR_ENOMEM, "%s: %u x %u floats: out of memory", name, rows, K);
    goto out;
  }
  if (mr_st_is_f8e4m3(t))
    rc = fp8_dequant(ld, name, t, N, K, row0, rows, host, e);
  else
    mr_convert_to_f32(host, (const uint8_t *)t->data + (size_t)row0 * K * mr_dtype_size(t->dtype),
                      t->dtype, n);
  if (!rc && host != dev) rc = bk->ops->upload(bk, dev, host, n, e);
  if (rc) goto out;
  load_count(ld, t);
  m->dense_bytes += n * sizeof *dev;
  *out = dev;
  dev = NULL;
out:
  if (!bk->ops->host_memory) mr_free(host);
  if (dev) bk->ops->free(bk, dev);
  return rc;
}

/* MLA attention (DeepSeek-V3): q_a_proj | kv_a_proj_with_mqa (or q_proj | kv_a_...) as one
 * linear, q_b_proj, the two latent norms, kv_b_proj as fp32 for the absorbed form. */
static int load_attention_mla(loader *ld, uint32_t l, model_layer *ly, mr_err *e) {
  gc_model *m = ld->m;
  char qn[128], kvn[128], qbn[128], kvbn[128], on[128], nm[128];
  const char *pre = "model.layers";
  snprintf(kvn, sizeof kvn, "%s.%u.self_attn.kv_a_proj_with_mqa.weight", pre, l);
  snprintf(on, sizeof on, "%s.%u.self_attn.o_proj.weight", pre, l);
  snprintf(kvbn, sizeof kvbn, "%s.%u.self_attn.kv_b_proj.weight", pre, l);
  if (m->q_lora)
    snprintf(qn, sizeof qn, "%s.%u.self_attn.q_a_proj.weight", pre, l);
  else
    snprintf(qn, sizeof qn, "%s.%u.self_attn.q_proj.weight", pre, l);
  /* q_a (whole: every rank needs the latent) or q_proj (rank r's heads), then kv_a whole */
  const uint32_t h0 = m->lnh * ld->r->id; /* the rank's first head */
  const lin_part qkv[2] = {
      {qn, m->n_qa, m->q_lora ? 0 : h0 * m->qh, m->ln_qa},
      {kvn, m->kv_lora + m->rope, 0, m->kv_lora + m->rope}};
  int rc = load_linear_parts(ld, qkv, 2, m->H, 0, m->H, &ly->qkv, e);
  if (rc) return rc;
  if (m->q_lora) {
    snprintf(qbn, sizeof qbn, "%s.%u.self_attn.q_b_proj.weight", pre, l);
    const lin_part qb[1] = {{qbn, m->nh * m->qh, h0 * m->qh, m->lnh * m->qh}};
    if ((rc = load_linear_parts(ld, qb, 1, m->q_lora, 0, m->q_lora, &ly->q_b, e))) return rc;
    snprintf(nm, sizeof nm, "%s.%u.self_attn.q_a_layernorm.weight", pre, l);
    if ((rc = load_vec(ld, nm, m->q_lora, false, &ly->q_a_norm, e))) return rc;
  }
  snprintf(nm, sizeof nm, "%s.%u.self_attn.kv_a_layernorm.weight", pre, l);
  if ((rc = load_vec(ld, nm, m->kv_lora, false, &ly->kv_a_norm, e))) return rc;
  if ((rc = load_kv_b(ld, kvbn, h0, &ly->w_kv_b, e))) return rc;
  const lin_part op[1] = {{on, m->H, 0, m->H}};
  if ((rc = load_linear_parts(ld, op, 1, m->nh * m->vd, h0 * m->vd, m->lnh * m->vd, &ly->o, e)))
    return rc;
  snprintf(nm, sizeof nm, "%s.%u.input_layernorm.weight", pre, l);
  if ((rc = load_vec(ld, nm, m->H, false, &ly->ln1, e))) return rc;
  snprintf(nm, sizeof nm, "%s.%u.post_attention_layernorm.weight", pre, l);
  return load_vec(ld, nm, m->H, false, &ly->ln2, e);
}

static int load_attention(loader *ld, uint32_t l, model_layer *ly, mr_err *e) {
  gc_model *m = ld->m;
  char qn[128], kn[128], vn[128], on[128], nm[128];
  snprintf(qn, sizeof qn, "model.layers.%u.self_attn.q_proj.weight", l);
  snprintf(kn, sizeof kn, "model.layers.%u.self_attn.k_proj.weight", l);
  snprintf(vn, sizeof vn, "model.layers.%u.self_attn.v_proj.weight", l);
  snprintf(on, sizeof on, "model.layers.%u.self_attn.o_proj.weight", l);
  /* rank r's heads of q, k and v, and those columns of o */
  const uint32_t r = ld->r->id, qw = m->lnh * m->hd, kvw = m->lnkv * m->hd;
  const uint32_t rows[3] = {m->nh * m->hd, m->nkv * m->hd, m->nkv * m->hd};
  const lin_part qkv[3] = {{qn, rows[0], r * qw, qw}, {kn, rows[1], r * kvw, kvw},
                           {vn, rows[2], r * kvw, kvw}};
  int rc = load_linear_parts(ld, qkv, 3, m->H, 0, m->H, &ly->qkv, e);
  if (rc) return rc;
  const lin_part op[1] = {{on, m->H, 0, m->H}};
  if ((rc = load_linear_parts(ld, op, 1, m->nh * m->hd, r * qw, qw, &ly->o, e))) return rc;
  if (m->cfg.attention_bias) {
    /* q | k | v biases (the rank's heads) into one device vector, like the weights. */
    static const char *const which[3] = {"q", "k", "v"};
    const uint32_t own[3] = {qw, kvw, kvw};
    float *host = mr_malloc((size_t)m->n_qkv * sizeof *host);
    if (!host) return mr_err_set(e, MR_ENOMEM, "layer %u: q/k/v biases: out of memory", l);
    size_t off = 0;
    for (int i = 0; i < 3 && !rc; i++) {
      snprintf(nm, sizeof nm, "model.layers.%u.self_attn.%s_proj.bias", l, which[i]);
      rc = read_vec(ld, nm, rows[i], host + off, e);
      if (!rc) memmove(host + off, host + off + (size_t)r * own[i], own[i] * sizeof *host);
      off += own[i];
    }
    if (!rc) rc = dev_vec(m, ld->r, host, m->ln_qkv, &ly->qkv_bias, e);
    mr_free(host);
    if (rc) return rc;
    /* o's bias is added once: by rank 0 */
    snprintf(nm, sizeof nm, "model.layers.%u.self_attn.o_proj.bias", l);
    if (r == 0 && (rc = load_vec(ld, nm, m->H, true, &ly->o_bias, e))) return rc;
  }
  if (m->cfg.qk_norm) {
    snprintf(nm, sizeof nm, "model.layers.%u.self_attn.q_norm.weight", l);
    if ((rc = load_vec(ld, nm, m->hd, false, &ly->q_norm, e))) return rc;
    snprintf(nm, sizeof nm, "model.layers.%u.self_attn.k_norm.weight", l);
    if ((rc = load_vec(ld, nm, m->hd, false, &ly->k_norm, e))) return rc;
  }
  snprintf(nm, sizeof nm, "model.layers.%u.input_layernorm.weight", l);
  if ((rc = load_vec(ld, nm, m->H, false, &ly->ln1, e))) return rc;
  snprintf(nm, sizeof nm, "model.layers.%u.post_attention_layernorm.weight", l);
  return load_vec(ld, nm, m->H, false, &ly->ln2, e);
}

static int load_moe(loader *ld, uint32_t l, model_layer *ly, mr_err *e) {
  gc_model *m = ld->m;
  char nm[128];
  const char *blk = m->cfg.arch == MR_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
  snprintf(nm, sizeof nm, "model.layers.%u.%s.gate.weight", l, blk);
  const char *names[1] = {nm};
  const uint32_t rows[1] = {m->E};
  int rc = load_linear(ld, names, rows, 1, m->H, &ly->router, e);
  if (rc) return rc;
  if (m->cfg.topk_method == MR_TOPK_NOAUX_TC) {
    /* the selection bias of noaux_tc: without it the routing would silently differ */
    snprintf(nm, sizeof nm, "model.layers.%u.mlp.gate.e_score_correction_bias", l);
    if (!mr_st_find(ld->st, nm))
      return mr_err_set(e, MR_ENOTFOUND, "model %s: %s is missing (topk_method noaux_tc "
                        "selects experts by score + this bias; shape [%u])", m->model_dir, nm,
                        m->E);
    if ((rc = load_vec(ld, nm, m->E, false, &ly->e_bias, e))) return rc;
  }
  if (m->Is) {
    char g[128], u[128], d[128];
    snprintf(g, sizeof g, "model.layers.%u.mlp.shared_experts.gate_proj.weight", l);
    snprintf(u, sizeof u, "model.layers.%u.mlp.shared_experts.up_proj.weight", l);
    snprintf(d, sizeof d, "model.layers.%u.mlp.shared_experts.down_proj.weight", l);
    if ((rc = load_mlp(ld, g, u, d, m->Is, &ly->sh_gate_up, &ly->sh_down, e))) return rc;
  }
  /* the rank's hot experts: every tp-th of the layer's local ones (owner, at open) */
  const uint32_t me = ld->r->id;
  const size_t base = (size_t)l * m->E;
  for (uint32_t x = 0; x < m->E; x++) ly->n_hot += m->local[base + x] && m->owner[base + x] == me;
  if (ly->n_hot == 0) return 0;
  gc_backend *bk = ld->r->bk;
  kn_layer_desc d = {.hidden = m->H, .inter = m->Ie, .num_experts = m->E,
                     .format = m->expert_fmt, .group = m->expert_group};
  if ((rc = bk->ops->experts_new(bk, &ly->hot, &d, e)))
    return mr_err_prefix(e, rc, "layer %u: hot experts", l);
  for (uint32_t x = 0; x < m->E; x++) {
    if (!m->local[base + x] || m->owner[base + x] != me) continue;
    const mr_st_tensor *t[3], *sc[3];
    rc = mr_config_expert_tensors_q(&m->cfg, ld->st, l, x, t, sc, e);
    if (rc) return mr_err_prefix(e, rc, "model %s", m->model_dir);
    rc = MR_ENOTSUP;
    if (m->o.map_weights && bk->ops->experts_borrow_st) {
      /* In place (as the server's --map-weights): read through the huge-page-advised
       * mapping first, so that the pages come in 2 MiB folios, then checked and kept. */
      for (int p = 0; p < 3; p++) mr_st_populate(t[p]);
      rc = bk->ops->experts_borrow_st(bk, ly->hot, x, t, sc, e);
      if (!rc) m->n_mapped++;
    }
    if (rc == MR_ENOTSUP) rc = bk->ops->experts_load_st(bk, ly->hot, x, t, sc, e);
    if (rc) return mr_err_prefix(e, rc, "layer %u expert %u", l, x);
    for (int p = 0; p < 3; p++) {
      load_count(ld, t[p]);
      if (sc[p]) load_count(ld, sc[p]);
    }
  }
  m->expert_bytes_one = bk->ops->experts_expert_bytes(ly->hot);
  m->hot_bytes += (uint64_t)ly->n_hot * m->expert_bytes_one;
  return 0;
}

static int load_dense_mlp(loader *ld, uint32_t l, model_layer *ly, mr_err *e) {
  gc_model *m = ld->m;
  char g[128], u[128], d[128];
  snprintf(g, sizeof g, "model.layers.%u.mlp.gate_proj.weight", l);
  snprintf(u, sizeof u, "model.layers.%u.mlp.up_proj.weight", l);
  snprintf(d, sizeof d, "model.layers.%u.mlp.down_proj.weight", l);
  if (m->Id == 0)
    return mr_err_set(e, MR_EFORMAT, "model %s: layer %u is dense but config.json has no "
                      "intermediate_size", m->model_dir, l);
  return load_mlp(ld, g, u, d, m->Id, &ly->gate_up, &ly->down, e);
}

/* Bytes that loading will read: every tensor we keep. */
static void load_plan(loader *ld) {
  gc_model *m = ld->m;
  const size_t n = mr_st_count(ld->st);
  for (size_t i = 0; i < n; i++) {
    const mr_st_tensor *t = mr_st_at(ld->st, i);
    unsigned l, x;
    char tail[64];
    /* layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer 61) are
     * not read */
    if (sscanf(t->name, "model.layers.%u.", &l) == 1 && l >= m->L) continue;
    if (sscanf(t->name, "model.layers.%u.mlp.experts.%u.%63s", &l, &x, tail) == 3 ||
        sscanf(t->name, "model.layers.%u.block_sparse_moe.experts.%u.%63s", &l, &x, tail) == 3) {
      if (l < m->L && x < m->E && m->local[(size_t)l * m->E + x]) {
        ld->bytes_total += t->nbytes;
        ld->tensors_total++;
      }
      continue;
    }
    ld->bytes_total += t->nbytes;
    ld->tensors_total++;
  }
}

/* Rank r's weights (its slices; rank 0 also the final norm and lm_head). */
static int load_weights(gc_model *m, model_rank *r, const mr_st *st, mr_err *e) {
  loader ld = {.m = m, .r = r, .st = st, .t0 = mr_now_ns()};
  ld.t_last = ld.t0;
  load_plan(&ld);
  const mr_st_tensor *t;
  int rc = get_tensor(&ld, "model.embed_tokens.weight", 2, m->V, m->H, &t, e);
  if (rc) return rc;
  rc = MR_ENOTSUP;
  if (m->o.map_weights && r->bk->ops->table_borrow) {
    mr_err e2 = {0};
    mr_st_populate(t); /* read now, in 2 MiB folios, not at the first steps' lookups */
    if ((rc = r->bk->ops->table_borrow(r->bk, &r->embed, m->V, m->H, t->data, t->dtype, &e2)) == 0) {
      m->dense_mapped_bytes += t->nbytes;
      m->embed_mapped_bytes += t->nbytes;
    } else if (rc == MR_ENOTSUP) {
      dense_packed(m, t->name, e2.msg);
    } else {
      return mr_err_set(e, rc, "%s: %s", t->name, e2.msg);
    }
  }
  if (rc && (rc = r->bk->ops->table_new(r->bk, &r->embed, m->V, m->H, t->data, t->dtype, e)))
    return rc;
  load_count(&ld, t);
  for (uint32_t l = 0; l < m->L; l++) {
    model_layer *ly = &r->layer[l];
    ly->moe = m->cfg.is_moe[l];
    rc = m->mla ? load_attention_mla(&ld, l, ly, e) : load_attention(&ld, l, ly, e);
    if (rc) return rc;
    rc = ly->moe ? load_moe(&ld, l, ly, e) : load_dense_mlp(&ld, l, ly, e);
    if (rc) return rc;
  }
  if (r->id != 0) {
    if (!m->o.quiet)
      mr_log(MR_LOG_INFO, "model: rank %u loaded its slices (%.1f s)", r->id,
             (double)(mr_now_ns() - ld.t0) / 1e9);
    return 0;
  }
  if ((rc = load_vec(&ld, "model.norm.weight", m->H, false, &r->final_norm, e))) return rc;
  const char *head = mr_st_find(st, "lm_head.weight") && !m->cfg.tie_word_embeddings
                         ? "lm_head.weight" : "model.embed_tokens.weight";
  if (!m->cfg.tie_word_embeddings && !mr_st_find(st, "lm_head.weight"))
    return mr_err_set(e, MR_ENOTFOUND, "model %s: lm_head.weight is missing and "
                      "tie_word_embeddings is false", m->model_dir);
  const char *hn[1] = {head};
  const uint32_t hrows[1] = {m->V};
  if (m->cfg.tie_word_embeddings) ld.tensors_total++, ld.bytes_total += t->nbytes;
  if ((rc = load_linear(&ld, hn, hrows, 1, m->H, &r->head, e))) return rc;
  load_progress(&ld, true);
  return 0;
}

/* gc-map-read (--map-weights, as the server's es-map-read): reads the local experts'
 * tensors in load order through the huge-page-advised mapping, ahead of the loader, which
 * checks each expert on the engine's workers once it is read (its own mr_st_populate then
 * finds the pages there): from a cold page cache the disk reads overlap the checks and
 * come in 2 MiB folios. Stops at the end of the load, or early when it fails. */
typedef struct map_reader {
  const gc_model *m;
  const mr_st *st;
  atomic_bool stop;
} map_reader;

static void *map_read_main(void *arg) {
  map_reader *r = arg;
  const gc_model *m = r->m;
  pthread_setname_np(pthread_self(), "gc-map-read");
  for (uint32_t l = 0; l < m->L; l++) {
    if (!m->cfg.is_moe[l]) continue;
    for (uint32_t x = 0; x < m->E && !atomic_load(&r->stop); x++) {
      if (!m->local[(size_t)l * m->E + x]) continue;
      const mr_st_tensor *t[3], *sc[3];
      if (mr_config_expert_tensors_q(&m->cfg, r->st, l, x, t, sc, NULL) != 0) return NULL;
      for (int p = 0; p < 3; p++) mr_st_populate(t[p]);
    }
  }
  return NULL;
}

/* ---- placement --------------------------------------------------------------------------- */

/* Largest placement file read (a 61 x 256 model's file is ~200 KB). */
#define PLACEMENT_MAX_FILE_BYTES ((size_t)64 << 20)

/* FNV-1a 64 of a placement file's bytes: what GET /placement reports, and what
 * moerpc-place apply compares with the hash of the file it wrote. */
static uint64_t placement_hash(const char *b, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) {
    h ^= (uint8_t)b[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

static int placement_parse(gc_model *m, const mr_cluster_file *cf, const char *json, size_t len,
                           uint8_t *local, int32_t **route, mr_err *e);
static int placement_cluster_local(gc_model *m, const mr_cluster_file *cf, mr_err *e);

/* Fills m->local from the options; route (L * E, cluster-file server indices) from a
 * placement file's "remote". */
static int placement_make(gc_model *m, const mr_cluster_file *cf, int32_t **route, mr_err *e) {
  *route = NULL;
  if (!m->o.cluster_path) { /* every expert local */
    for (uint32_t l = 0; l < m->L; l++)
      if (m->cfg.is_moe[l]) memset(m->local + (size_t)l * m->E, 1, m->E);
    if (m->o.local_experts >= 0 || m->o.placement_path)
      mr_log(MR_LOG_WARN, "model: no cluster: every expert is local (--local-experts / "
             "--placement ignored)");
    return 0;
  }
  if (m->o.local_experts >= 0 && m->o.placement_path)
    return mr_err_set(e, MR_EINVAL, "--local-experts and --placement are exclusive");
  if (m->o.local_experts >= 0) {
    if ((uint32_t)m->o.local_experts > m->E)
      return mr_err_set(e, MR_ERANGE, "--local-experts = %d, must be 0..num_experts %u",
                        m->o.local_experts, m->E);
    for (uint32_t l = 0; l < m->L; l++) {
      if (!m->cfg.is_moe[l]) continue;
      for (uint32_t x = 0; x < m->E; x++)
        m->local[(size_t)l * m->E + x] =
            gc_model_local_rule(l, x, (uint32_t)m->o.local_experts, m->E);
    }
    return 0;
  }
  if (m->o.placement_path) {
    char *json = NULL;
    size_t len = 0;
    int rc = mr_file_read(m->o.placement_path, PLACEMENT_MAX_FILE_BYTES, &json, &len, e);
    if (rc) return rc;
    m->pl_hash = placement_hash(json, len);
    rc = placement_parse(m, cf, json, len, m->local, route, e);
    mr_free(json);
    return rc;
  }
  /* The cluster file's "local" section: the runner computes those experts itself. */
  return placement_cluster_local(m, cf, e);
}

static int placement_parse(gc_model *m, const mr_cluster_file *cf, const char *json, size_t len,
                           uint8_t *local, int32_t **route, mr_err *e) {
  const size_t pairs = (size_t)m->L * m->E;
  {
    mr_placement p;
    int rc = mr_placement_parse(&p, json, len, m->o.placement_path, e);
    if (rc) {
      mr_placement_close(&p);
      return rc;
    }
    if (p.num_layers != m->L || p.num_experts != m->E) {
      rc = mr_err_set(e, MR_EMISMATCH, "%s: num_layers = %u, num_experts = %u, the model has "
                      "%u and %u", m->o.placement_path, p.num_layers, p.num_experts, m->L, m->E);
      goto out_placement;
    }
    int32_t map[MR_PLACEMENT_MAX_SERVERS];
    for (uint32_t i = 0; i < p.n_servers; i++) {
      map[i] = -1;
      for (uint32_t s = 0; s < cf->n_servers; s++)
        if (strcmp(cf->servers[s].name, p.server[i]) == 0) map[i] = (int32_t)s;
      if (map[i] < 0) {
        rc = mr_err_set(e, MR_ENOTFOUND, "%s: server \"%s\" is not in the cluster file %s",
                        m->o.placement_path, p.server[i], m->o.cluster_path);
        goto out_placement;
      }
    }
    *route = mr_malloc(pairs * sizeof **route);
    if (!*route) {
      rc = mr_err_set(e, MR_ENOMEM, "placement: out of memory");
      goto out_placement;
    }
    for (size_t i = 0; i < pairs; i++) {
      uint32_t l = (uint32_t)(i / m->E);
      if (p.local[i] && !m->cfg.is_moe[l]) {
        rc = mr_err_set(e, MR_EINVAL, "%s: layer %u is a dense layer and has no experts to "
                        "place", m->o.placement_path, l);
        goto out_placement;
      }
      local[i] = p.local[i];
      (*route)[i] = p.route[i] >= 0 ? map[p.route[i]] : -1;
    }
  out_placement:
    mr_placement_close(&p);
    if (rc) {
      mr_free(*route);
      *route = NULL;
    }
    return rc;
  }
}

static int placement_cluster_local(gc_model *m, const mr_cluster_file *cf, mr_err *e) {
  if (cf->local_layers[0] && cf->local_experts[0]) {
    mr_idset ls, xs;
    int rc = mr_idset_parse(&ls, cf->local_layers, m->L, "cluster file local.layers", e);
    if (rc) return rc;
    rc = mr_idset_parse(&xs, cf->local_experts, m->E, "cluster file local.experts", e);
    if (rc) {
      mr_idset_close(&ls);
      return rc;
    }
    for (uint32_t l = 0; l < m->L; l++)
      for (uint32_t x = 0; x < m->E; x++)
        m->local[(size_t)l * m->E + x] = m->cfg.is_moe[l] && mr_idset_has(&ls, l) &&
                                         mr_idset_has(&xs, x);
    mr_idset_close(&ls);
    mr_idset_close(&xs);
  }
  return 0;
}

static int cluster_open_into(gc_model *m, const mr_cluster_file *cf, const int32_t *route,
                             gc_cluster **out_cl, gc_moe **out_moe, mr_err *e);
static int cluster_open(gc_model *m, const mr_cluster_file *cf, const int32_t *route,
                        mr_err *e) {
  return cluster_open_into(m, cf, route, &m->cluster, &m->moe, e);
}

static int cluster_open_into(gc_model *m, const mr_cluster_file *cf, const int32_t *route,
                             gc_cluster **out_cl, gc_moe **out_moe, mr_err *e) {
  gc_options co;
  gc_options_init(&co);
  if (!m->client_name[0])
    snprintf(m->client_name, sizeof m->client_name, "moerpc-client model pid=%ld",
             (long)getpid());
  co.client_name = m->client_name;
  co.model_dir = m->model_dir;
  co.no_local = true; /* the runner computes its hot experts itself */
  co.shared_engine = m->eng;
  co.deadline_ms = m->o.deadline_ms;
  co.connect_timeout_ms = m->o.connect_timeout_ms;
  co.wait_spin_us = m->o.wait_spin_us;
  co.caller_local = m->local;
  co.caller_local_len = (size_t)m->L * m->E;
  co.route = route;
  co.route_len = route ? (size_t)m->L * m->E : 0;
  co.routing_window = m->o.routing_window;
  int rc = gc_cluster_open_parsed(out_cl, cf, &co, e);
  if (rc) return rc;
  gc_cluster_info ci;
  gc_cluster_info_get(*out_cl, &ci);
  if (ci.num_layers != m->L || ci.num_experts != m->E || ci.hidden_size != m->H)
    return mr_err_set(e, MR_EMISMATCH, "cluster %s serves a model of %u layers x %u experts, "
                      "hidden %u; %s has %u x %u, hidden %u", m->o.cluster_path, ci.num_layers,
                      ci.num_experts, ci.hidden_size, m->model_dir, m->L, m->E, m->H);
  if (m->o.expert_format == KN_FMT_COUNT) {
    kn_format f;
    uint32_t g;
    if ((rc = gc_weight_format_parse(ci.weight_format, &f, &g, e))) return rc;
    m->expert_fmt = f;
    m->expert_group = g ? g : 64;
  }
  return gc_moe_new(out_moe, *out_cl, m->o.max_deferred, e);
}

/* ---- open / close ------------------------------------------------------------------------ */

static int config_check(gc_model *m, mr_err *e) {
  const mr_model_config *c = &m->cfg;
  if (c->arch == MR_ARCH_DEEPSEEK_V3) {
    if (strcmp(c->arch_name, "DeepseekV3ForCausalLM") != 0)
      return mr_err_set(e, MR_ENOTSUP, "model %s: %s is not supported by the runner (its "
                        "routing and attention are not checked against transformers); "
                        "supported: Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
                        "MixtralForCausalLM, DeepseekV3ForCausalLM", m->model_dir, c->arch_name);
    if (!c->kv_lora_rank || !c->qk_rope_dim || !c->qk_nope_dim || !c->v_head_dim)
      return mr_err_set(e, MR_EFORMAT, "model %s: DeepseekV3ForCausalLM needs kv_lora_rank, "
                        "qk_rope_head_dim, qk_nope_head_dim and v_head_dim (MLA)", m->model_dir);
    if (c->num_kv_heads != c->num_heads)
      return mr_err_set(e, MR_EFORMAT, "model %s: num_key_value_heads = %u, MLA needs it equal "
                        "to num_attention_heads = %u", m->model_dir, c->num_kv_heads,
                        c->num_heads);
    if (c->topk_method == MR_TOPK_GROUP_LIMITED_GREEDY)
      return mr_err_set(e, MR_ENOTSUP, "model %s: topk_method group_limited_greedy is not "
                        "supported by the runner (supported: noaux_tc, greedy)", m->model_dir);
    if (c->attention_bias)
      return mr_err_set(e, MR_ENOTSUP, "model %s: attention_bias with MLA is not supported",
                        m->model_dir);
    if (c->n_group > GC_ROUTE_MAX_GROUPS)
      return mr_err_set(e, MR_ERANGE, "model %s: n_group = %u, the runner's router takes at "
                        "most %u", m->model_dir, c->n_group, GC_ROUTE_MAX_GROUPS);
  }
  if (c->top_k > GC_ROUTE_MAX_TOP_K)
    return mr_err_set(e, MR_ERANGE, "model %s: num_experts_per_tok = %u, the runner's router "
                      "takes at most %u", m->model_dir, c->top_k, GC_ROUTE_MAX_TOP_K);
  if (strcmp(c->rope_type, "default") != 0) {
    if (strcmp(c->rope_type, "yarn") != 0 || c->arch != MR_ARCH_DEEPSEEK_V3)
      return mr_err_set(e, MR_ENOTSUP, "model %s: rope type \"%s\" is not supported for %s "
                        "(supported: default; yarn with DeepseekV3ForCausalLM)", m->model_dir,
                        c->rope_type, c->arch_name);
    if (!(c->yarn_factor > 0) || !c->yarn_original_max_position)
      return mr_err_set(e, MR_EFORMAT, "model %s: rope type yarn needs factor and "
                        "original_max_position_embeddings (or max_position_embeddings)",
                        m->model_dir);
  }
  if (c->head_dim % 2)
    return mr_err_set(e, MR_EFORMAT, "model %s: head_dim = %u, RoPE needs an even head_dim",
                      m->model_dir, c->head_dim);
  return 0;
}

static int alloc_state(gc_model *m, mr_err *e) {
  const size_t pairs = (size_t)m->L * m->E;
  m->rk = mr_calloc(m->tp, sizeof *m->rk);
  for (uint32_t r = 0; m->rk && r < m->tp; r++) {
    m->rk[r].id = r;
    if (!(m->rk[r].layer = mr_calloc(m->L, sizeof *m->rk[r].layer)))
      return mr_err_set(e, MR_ENOMEM, "model: out of memory");
  }
  m->owner = mr_calloc(pairs, 1);
  m->local = mr_calloc(pairs, 1);
  m->seq_len = mr_calloc(m->max_batch, sizeof *m->seq_len);
  m->lst = mr_calloc(m->L, sizeof *m->lst);
  m->lst_snap = mr_calloc(m->L, sizeof *m->lst_snap);
  m->seen = mr_calloc((m->E + 63) / 64, sizeof *m->seen);
  if (!m->rk || !m->owner || !m->local || !m->seq_len || !m->lst || !m->lst_snap || !m->seen)
    return mr_err_set(e, MR_ENOMEM, "model: out of memory");
  m->st.layer = m->lst;
  return 0;
}

/* inv_freq[i] of RoPE over dim dims as transformers computes it in fp32: the default
 * 1 / theta^(2i / dim), or yarn's blend of it with its interpolation by factor
 * (_compute_yarn_parameters: a linear ramp between the correction dims of beta_fast and
 * beta_slow rotations at original_max_position_embeddings). */
static void rope_inv_freq(const mr_model_config *c, uint32_t dim, float *out) {
  const uint32_t half = dim / 2;
  const double base = c->rope_theta;
  bool yarn = strcmp(c->rope_type, "yarn") == 0;
  double low = 0, high = 0;
  if (yarn) {
    const double orig = c->yarn_original_max_position, tp = 2 * M_PI;
    low = dim * log(orig / (c->yarn_beta_fast * tp)) / (2 * log(base));
    high = dim * log(orig / (c->yarn_beta_slow * tp)) / (2 * log(base));
    if (c->yarn_truncate) low = floor(low), high = ceil(high);
    if (low < 0) low = 0;
    if (high > dim - 1) high = dim - 1;
    if (low == high) high += 0.001;
  }
  for (uint32_t i = 0; i < half; i++) {
    float pos_freq = (float)pow(base, (double)(float)(2.0f * i / dim));
    float extra = 1.0f / pos_freq;
    if (!yarn) {
      out[i] = extra;
      continue;
    }
    float inter = 1.0f / (c->yarn_factor * pos_freq);
    float ramp = (float)(((float)i - low) / (high - low));
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    float extra_factor = 1.0f - ramp;
    out[i] = inter * (1.0f - extra_factor) + extra * extra_factor;
  }
}

/* Rank r's KV cache (its kv heads; the whole latent with MLA) and RoPE table. */
static int alloc_caches(gc_model *m, model_rank *r, mr_err *e) {
  const size_t width = m->mla ? (size_t)m->kv_lora + m->rope : (size_t)m->lnkv * m->hd;
  const size_t n = (size_t)m->max_batch * m->max_seq * width;
  for (uint32_t l = 0; l < m->L; l++) {
    model_layer *ly = &r->layer[l];
    ly->k_cache = r->bk->ops->alloc(r->bk, n * sizeof(float));
    if (!m->mla) ly->v_cache = r->bk->ops->alloc(r->bk, n * sizeof(float));
    if (!ly->k_cache || (!m->mla && !ly->v_cache))
      return mr_err_set(e, MR_ENOMEM, "KV cache of layer %u (%u sequences x %u positions x %zu "
                        "floats): out of memory; lower --max-seq or --batch", l, m->max_batch,
                        m->max_seq, m->mla ? width : 2 * width);
  }
  const uint32_t half = m->rot_dim / 2;
  float *host = mr_malloc(half * sizeof *host);
  if (!host) return mr_err_set(e, MR_ENOMEM, "RoPE table: out of memory");
  rope_inv_freq(&m->cfg, m->rot_dim, host);
  int rc = dev_vec(m, r, host, half, &r->inv_freq, e);
  mr_free(host);
  return rc;
}

/* --tp G: every split width must divide (heads, kv heads, MLP columns). */
static int tp_check(gc_model *m, mr_err *e) {
  const uint32_t G = m->tp;
  const mr_model_config *c = &m->cfg;
  if (G < 1 || G > GC_COMM_MAX_RANKS)
    return mr_err_set(e, MR_ERANGE, "--tp = %u, must be 1..%u", G, GC_COMM_MAX_RANKS);
  struct {
    const char *what;
    uint32_t n;
  } split[] = {{"num_attention_heads", m->nh},
               {m->mla ? NULL : "num_key_value_heads", m->nkv},
               {mr_config_num_moe_layers(c) < m->L ? "intermediate_size" : NULL, m->Id},
               {m->Is ? "moe_intermediate_size x n_shared_experts" : NULL, m->Is}};
  for (size_t i = 0; i < sizeof split / sizeof split[0]; i++)
    if (split[i].what && split[i].n % G)
      return mr_err_set(e, MR_EINVAL, "--tp %u: %s = %u is not a multiple of it (each rank "
                        "takes an equal share)", G, split[i].what, split[i].n);
  m->lnh = m->nh / G, m->lnkv = m->mla ? m->nkv : m->nkv / G;
  m->lId = m->Id / G, m->lIs = m->Is / G;
  if (m->mla) {
    m->ln_qa = m->q_lora ? m->q_lora : m->lnh * m->qh;
    m->ln_qkv = m->ln_qa + m->kv_lora + m->rope;
  } else {
    m->ln_qkv = (m->lnh + 2 * m->lnkv) * m->hd;
  }
  return 0;
}

/* Rank 0's engine is the model's; on the CPU backend the others get their own (threads
 * split), on a device they share it (it packs on the host only). */
static int ranks_open(gc_model *m, mr_err *e) {
  const gc_model_opts *o = &m->o;
  const bool cpu = !o->backend || strcmp(o->backend, "cpu") == 0;
  kn_engine_opts eo = o->engine;
  if (m->tp > 1 && cpu) {
    uint32_t total = eo.threads;
    if (!total) {
      long n = sysconf(_SC_NPROCESSORS_ONLN);
      total = n > 0 ? (uint32_t)n : 1;
    }
    eo.threads = total / m->tp ? total / m->tp : 1;
  }
  int rc = kn_engine_new(&m->eng, &eo, e);
  if (rc) return rc;
  if (o->pin_caller) {
    mr_err pe;
    if (kn_engine_pin_caller(m->eng, &pe) != 0)
      mr_log(MR_LOG_WARN, "model: could not pin the calling thread (%s); running unpinned",
             pe.msg);
  }
  for (uint32_t r = 0; r < m->tp; r++) {
    model_rank *rk = &m->rk[r];
    rk->eng = m->eng;
    if (r > 0 && cpu) {
      if ((rc = kn_engine_new(&rk->eng, &eo, e))) return mr_err_prefix(e, rc, "rank %u", r);
      rk->own_eng = true;
    }
    if ((rc = gc_bk_open(&rk->bk, o->backend, (int)(o->device + r), rk->eng, m->max_seq, e)))
      return m->tp > 1 ? mr_err_prefix(e, rc, "rank %u", r) : rc;
  }
  if (m->tp > 1) {
    if (cpu) {
      rc = gc_comm_cpu_new(&m->comm, m->tp, e);
    } else {
      const gc_cuda_lib *lib;
      int devs[GC_COMM_MAX_RANKS];
      for (uint32_t r = 0; r < m->tp; r++) devs[r] = (int)(o->device + r);
      if (!(rc = gc_cuda_lib_load(&lib, e))) {
        if (!lib->comm_nccl_new)
          rc = mr_err_set(e, MR_ENOTSUP, "--tp %u: libmoerpc-cuda.so has no NCCL", m->tp);
        else
          rc = lib->comm_nccl_new(&m->comm, m->tp, devs, e);
      }
    }
    if (rc) return mr_err_prefix(e, rc, "--tp %u", m->tp);
  }
  return 0;
}

static int ranks_start(gc_model *m, mr_err *e);

int gc_model_open(gc_model **out, const gc_model_opts *o, mr_err *e) {
  MR_ASSERT(out && o);
  *out = NULL;
  mr_st *st = NULL;
  int32_t *route = NULL;
  mr_cluster_file *cf = NULL;
  if (!o->model_dir || !*o->model_dir) return mr_err_set(e, MR_EINVAL, "--model is required");
  gc_model *m = mr_calloc(1, sizeof *m);
  if (!m) return mr_err_set(e, MR_ENOMEM, "model: out of memory");
  m->o = *o;
  pthread_mutex_init(&m->cl_lock, NULL);
  pthread_mutex_init(&m->pl_lock, NULL);
  m->locks_inited = true;
  if (o->watch_placement && (!o->placement_path || !o->cluster_path)) {
    mr_free(m);
    return mr_err_set(e, MR_EINVAL, "--watch-placement needs --placement FILE and --cluster");
  }
  mr_hist_init_latency(&m->step_hist);
  mr_hist_init_latency(&m->rpc_hist);
  snprintf(m->model_dir, sizeof m->model_dir, "%s", o->model_dir);
  int rc = mr_config_load(&m->cfg, m->model_dir, e);
  if (rc) goto out;
  if ((rc = config_check(m, e))) goto out;
  const mr_model_config *c = &m->cfg;
  m->H = c->hidden_size, m->V = c->vocab_size, m->nh = c->num_heads, m->nkv = c->num_kv_heads;
  m->hd = c->head_dim, m->E = c->num_experts, m->k = c->top_k, m->L = c->num_layers;
  m->Id = c->dense_intermediate, m->Ie = c->moe_intermediate;
  m->n_qkv = (m->nh + 2 * m->nkv) * m->hd;
  m->rot_dim = m->hd;
  m->attn_scale = 1.0f / sqrtf((float)m->hd);
  m->rope_scale = 1.0f;
  if (c->arch == MR_ARCH_DEEPSEEK_V3) {
    m->mla = true;
    m->q_lora = c->q_lora_rank, m->kv_lora = c->kv_lora_rank;
    m->nope = c->qk_nope_dim, m->rope = c->qk_rope_dim, m->vd = c->v_head_dim;
    m->qh = m->nope + m->rope;
    m->n_qa = m->q_lora ? m->q_lora : m->nh * m->qh;
    m->n_qkv = m->n_qa + m->kv_lora + m->rope;
    m->rot_dim = m->rope;
    m->Is = c->n_shared_experts * m->Ie;
    /* transformers: scaling = qk_head_dim^-0.5, times yarn_get_mscale(factor,
     * mscale_all_dim)^2 with yarn and a non-zero mscale_all_dim (yarn_apply_mscale) */
    m->attn_scale = (float)pow((double)m->qh, -0.5);
    if (strcmp(c->rope_type, "yarn") == 0 && c->yarn_mscale_all_dim != 0 && c->yarn_factor > 1) {
      double ms = 0.1 * c->yarn_mscale_all_dim * log(c->yarn_factor) + 1.0;
      m->attn_scale = (float)(m->attn_scale * ms * ms);
    }
  }
  if (strcmp(c->rope_type, "yarn") == 0) m->rope_scale = c->yarn_attention_factor;
  for (uint32_t l = 0; l < m->L; l++)
    if (c->is_moe[l]) m->last_moe = l;
  m->max_batch = o->max_batch ? o->max_batch : 1;
  if (m->max_batch > MODEL_MAX_BATCH) {
    rc = mr_err_set(e, MR_ERANGE, "--batch = %u, must be 1..%u", m->max_batch, MODEL_MAX_BATCH);
    goto out;
  }
  m->max_seq = o->max_seq ? o->max_seq : MODEL_DEFAULT_MAX_SEQ;
  if (!o->max_seq && c->max_position && c->max_position < m->max_seq) m->max_seq = c->max_position;
  if (m->max_seq > MODEL_MAX_SEQ) {
    rc = mr_err_set(e, MR_ERANGE, "--max-seq = %u, must be 1..%u", m->max_seq, MODEL_MAX_SEQ);
    goto out;
  }
  m->tp = o->tp ? o->tp : 1;
  if ((rc = tp_check(m, e))) goto out;
  m->wire = o->wire ? o->wire : MR_DTYPE_BF16;
  m->dense_fmt = o->dense_format;
  m->expert_fmt = o->expert_format == KN_FMT_COUNT ? KN_FMT_BF16 : o->expert_format;
  m->expert_group = o->expert_group ? o->expert_group : 64;
  if ((rc = alloc_state(m, e))) goto out;

  if (o->cluster_path) {
    cf = mr_malloc(sizeof *cf);
    if (!cf) {
      rc = mr_err_set(e, MR_ENOMEM, "cluster file: out of memory");
      goto out;
    }
    if ((rc = mr_cluster_load(cf, o->cluster_path, e))) goto out;
  }
  if (o->watch_placement && stat(o->placement_path, &m->pl_stat) != 0) {
    rc = mr_err_set(e, MR_ENOTFOUND, "--placement %s: cannot stat it", o->placement_path);
    goto out;
  }
  if ((rc = placement_make(m, cf, &route, e))) goto out;
  m->pl_gen = 1;
  {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    m->pl_switched_at = (double)tv.tv_sec + tv.tv_usec / 1e6;
  }
  /* hot experts go to the ranks in turn, per layer */
  for (uint32_t l = 0; l < m->L; l++)
    for (uint32_t x = 0, i = 0; x < m->E; x++)
      if (m->local[(size_t)l * m->E + x]) m->owner[(size_t)l * m->E + x] = (uint8_t)(i++ % m->tp);
  if ((rc = ranks_open(m, e))) goto out;
  if (cf && (rc = cluster_open(m, cf, route, e))) goto out;
  if ((rc = mr_st_open(&st, m->model_dir, e))) goto out;
  if (m->cluster) {
    gc_cluster_info ci;
    gc_cluster_info_get(m->cluster, &ci);
    snprintf(m->fingerprint, sizeof m->fingerprint, "%s", ci.model_fingerprint);
  } else {
    char fp[17];
    if ((rc = mr_model_fingerprint(m->model_dir, st, fp, e))) goto out;
    snprintf(m->fingerprint, sizeof m->fingerprint, "%s", fp);
    if ((rc = gc_routing_new(&m->routing_own, m->L, m->E, o->routing_window, m->last_moe, e)))
      goto out;
  }
  if (!m->cluster && o->expert_format == KN_FMT_COUNT) {
    /* all local: keep the experts as stored, as the servers do by default */
    char key[256];
    mr_config_expert_key(&m->cfg, m->last_moe, 0, MR_PROJ_GATE, key, sizeof key);
    const mr_st_tensor *t = mr_st_find(st, key);
    if (t) m->expert_fmt = mr_st_is_f8e4m3(t) ? KN_FMT_FP8 : dense_format_of_dtype(t->dtype);
  }
  if (o->map_weights) mr_st_advise_hugepage(st);
  {
    pthread_t reader;
    map_reader mr = {.m = m, .st = st};
    atomic_init(&mr.stop, false);
    const bool read_ahead = o->map_weights && m->rk[0].bk->ops->experts_borrow_st &&
                            pthread_create(&reader, NULL, map_read_main, &mr) == 0;
    for (uint32_t r = 0; r < m->tp && !rc; r++) {
      if ((rc = load_weights(m, &m->rk[r], st, e))) break;
      rc = alloc_caches(m, &m->rk[r], e);
    }
    if (read_ahead) {
      atomic_store(&mr.stop, true); /* done, or failed: it stops after its expert */
      pthread_join(reader, NULL);
    }
    if (rc) goto out;
  }
  if ((rc = ranks_start(m, e))) goto out;
  if (!m->expert_bytes_one) { /* no hot expert: size one from its shape and format */
    kn_layer *tmp = NULL;
    kn_layer_desc d = {.hidden = m->H, .inter = m->Ie, .num_experts = 1,
                       .format = m->expert_fmt, .group = m->expert_group};
    if (kn_layer_new(&tmp, m->eng, &d, NULL) == 0) m->expert_bytes_one = kn_layer_expert_bytes(tmp);
    kn_layer_free(tmp);
  }
  uint64_t n_local = 0;
  for (size_t i = 0; i < (size_t)m->L * m->E; i++) n_local += m->local[i];
  if (o->map_weights && n_local && !m->n_mapped)
    mr_log(MR_LOG_WARN, "--map-weights: no hot expert is served in place (backend %s, format "
           "%s; only the cpu backend serves experts stored as served, on one NUMA node): all "
           "packed", m->rk[0].bk->ops->name, kn_format_name(m->expert_fmt));
  char mapped[64] = "", dmapped[160] = "";
  if (m->n_mapped) snprintf(mapped, sizeof mapped, ", %llu in place", (unsigned long long)m->n_mapped);
  size_t at = 0;
  if (m->n_dense_fp8)
    at = (size_t)snprintf(dmapped, sizeof dmapped, ", %llu linears in fp8-b128",
                          (unsigned long long)m->n_dense_fp8);
  if (o->map_weights)
    snprintf(dmapped + at, sizeof dmapped - at, " (%.2f GB in place, %llu packed; embeddings %.2f GB in place)",
             (double)(m->dense_mapped_bytes - m->embed_mapped_bytes) / 1e9,
             (unsigned long long)m->n_dense_packed, (double)m->embed_mapped_bytes / 1e9);
  if (o->map_weights && m->n_dense_packed)
    mr_log(MR_LOG_INFO, "--map-weights: %llu dense weight(s) packed, the first %s",
           (unsigned long long)m->n_dense_packed, m->dense_packed_why);
  mr_log(MR_LOG_INFO, "model open: %s %s, %u layers (%u MoE), H=%u E=%u k=%u, dense %.2f GB%s, "
         "%llu hot experts (%.2f GB, %s%s), %s, backend %s, tp %u, %u threads, max_seq %u, "
         "batch %u, max_deferred %u", c->arch_name, m->model_dir, m->L,
         mr_config_num_moe_layers(c), m->H, m->E, m->k, (double)m->dense_bytes / 1e9, dmapped,
         (unsigned long long)n_local, (double)m->hot_bytes / 1e9, kn_format_name(m->expert_fmt), mapped,
         m->cluster ? "cold experts on the cluster" : "all experts local",
         m->rk[0].bk->ops->name, m->tp, kn_engine_threads(m->eng), m->max_seq, m->max_batch,
         m->moe ? o->max_deferred : 0);
  if (o->watch_placement) {
    m->cf = cf; /* kept to reopen the cluster on a switch */
    cf = NULL;
  }
  if (m->n_mapped || m->dense_mapped_bytes) { /* weights in place read it until gc_model_close */
    m->st_kept = st;
    st = NULL;
  }
  *out = m;
  m = NULL;
out:
  mr_st_close(st);
  mr_free(route);
  mr_free(cf);
  gc_model_close(m);
  return rc;
}

static void bufs_free(model_rank *r) {
  model_bufs *b = &r->b;
  float *dev[] = {b->x, b->h, b->qkv, b->attn, b->y, b->router, b->gu, b->mh, b->q, b->qa, b->y2};
  for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
    if (dev[i]) r->bk->ops->free(r->bk, dev[i]);
  void *host[] = {b->ids, b->w, b->hot_ids, b->wire, b->cold, b->pos, b->seq};
  for (size_t i = 0; i < sizeof host / sizeof host[0]; i++)
    if (host[i]) r->bk->ops->host_free(r->bk, host[i]);
  memset(b, 0, sizeof *b);
}

static void rank_free(gc_model *m, model_rank *r) {
  if (r->bk) {
    const gc_bk_ops *op = r->bk->ops;
    for (uint32_t l = 0; r->layer && l < m->L; l++) {
      model_layer *ly = &r->layer[l];
      op->linear_free(r->bk, ly->qkv);
      op->linear_free(r->bk, ly->o);
      op->linear_free(r->bk, ly->router);
      op->linear_free(r->bk, ly->gate_up);
      op->linear_free(r->bk, ly->down);
      op->linear_free(r->bk, ly->q_b);
      op->linear_free(r->bk, ly->sh_gate_up);
      op->linear_free(r->bk, ly->sh_down);
      op->experts_free(r->bk, ly->hot);
      float *v[] = {ly->qkv_bias, ly->o_bias, ly->ln1, ly->ln2, ly->q_norm, ly->k_norm,
                    ly->k_cache, ly->v_cache, ly->q_a_norm, ly->kv_a_norm, ly->w_kv_b,
                    ly->e_bias};
      for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (v[i]) op->free(r->bk, v[i]);
    }
    op->table_free(r->bk, r->embed);
    op->linear_free(r->bk, r->head);
    float *v[] = {r->final_norm, r->inv_freq, r->head_x, r->head_out};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
      if (v[i]) op->free(r->bk, v[i]);
    bufs_free(r);
    op->destroy(r->bk);
  }
  if (r->own_eng) kn_engine_free(r->eng);
  mr_free(r->layer);
}

static void ranks_stop(gc_model *m);

uint64_t gc_model_mapped_experts(const gc_model *m) { return m ? m->n_mapped : 0; }
uint64_t gc_model_mapped_dense_bytes(const gc_model *m) { return m ? m->dense_mapped_bytes : 0; }
uint64_t gc_model_fp8_linears(const gc_model *m) { return m ? m->n_dense_fp8 : 0; }

void gc_model_close(gc_model *m) {
  if (!m) return;
  ranks_stop(m);
  gc_moe_free(m->moe);
  gc_cluster_close(m->cluster);
  gc_routing_free(m->routing_own);
  for (uint32_t r = 0; m->rk && r < m->tp; r++) rank_free(m, &m->rk[r]);
  if (m->comm) m->comm->ops->destroy(m->comm);
  kn_engine_free(m->eng);
  mr_free(m->rk);
  mr_free(m->owner);
  mr_free(m->local);
  mr_free(m->seq_len);
  mr_free(m->lst);
  mr_free(m->lst_snap);
  mr_free(m->seen);
  mr_free(m->cf);
  mr_st_close(m->st_kept); /* after the ranks: their in-place experts read it */
  if (m->locks_inited) {
    pthread_mutex_destroy(&m->cl_lock);
    pthread_mutex_destroy(&m->pl_lock);
  }
  mr_free(m);
}

/* ---- live placement ---------------------------------------------------------------------- */

static void placement_refuse(gc_model *m, const char *why) {
  pthread_mutex_lock(&m->pl_lock);
  m->pl_rejected++;
  snprintf(m->pl_error, sizeof m->pl_error, "%s", why);
  pthread_mutex_unlock(&m->pl_lock);
  mr_log(MR_LOG_ERROR, "placement: %s: new file refused, the active placement (generation %llu) "
         "stays: %s", m->o.placement_path, (unsigned long long)m->pl_gen, why);
}

/* At a step boundary (no call in flight): if the placement file changed, validate it against
 * fresh Hellos of every server (a new gc_cluster: every routed pair must be announced by its
 * server, every pair covered) and switch to it; a file that fails is logged and ignored. */
static void placement_poll(gc_model *m) {
  struct stat st;
  if (stat(m->o.placement_path, &st) != 0) return; /* mid-rename or gone: look again later */
  if (st.st_ino == m->pl_stat.st_ino && st.st_dev == m->pl_stat.st_dev &&
      st.st_size == m->pl_stat.st_size && st.st_mtim.tv_sec == m->pl_stat.st_mtim.tv_sec &&
      st.st_mtim.tv_nsec == m->pl_stat.st_mtim.tv_nsec)
    return;
  m->pl_stat = st; /* a refused file is not retried until it changes again */
  uint64_t t0 = mr_now_ns();
  mr_err e;
  mr_err_clear(&e);
  char *json = NULL;
  size_t len = 0;
  uint8_t *local = NULL;
  int32_t *route = NULL;
  gc_cluster *cl = NULL;
  gc_moe *moe = NULL;
  if (mr_file_read(m->o.placement_path, PLACEMENT_MAX_FILE_BYTES, &json, &len, &e) != 0) {
    placement_refuse(m, e.msg);
    return;
  }
  uint64_t hash = placement_hash(json, len);
  if (hash == m->pl_hash) goto out_free; /* touched, same content */
  local = mr_calloc((size_t)m->L * m->E, 1);
  if (!local) {
    placement_refuse(m, "out of memory");
    goto out_free;
  }
  if (placement_parse(m, m->cf, json, len, local, &route, &e) != 0) {
    placement_refuse(m, e.msg);
    goto out_free;
  }
  if (memcmp(local, m->local, (size_t)m->L * m->E) != 0) {
    placement_refuse(m, "its local (hot) experts differ from the active placement's: the client "
                     "cannot change its local experts while running (restart it with the new "
                     "file)");
    goto out_free;
  }
  if (cluster_open_into(m, m->cf, route, &cl, &moe, &e) != 0) {
    placement_refuse(m, e.msg);
    gc_moe_free(moe);
    gc_cluster_close(cl);
    goto out_free;
  }
  pthread_mutex_lock(&m->cl_lock);
  gc_cluster *old_cl = m->cluster;
  gc_moe *old_moe = m->moe;
  /* The routing counters (GET /routing, --routing-stats) carry on across the switch: the
   * new cluster takes the old one's, which then closes with the new one's empty set. */
  gc_cluster_routing_exchange(cl, old_cl);
  m->cluster = cl;
  m->moe = moe;
  pthread_mutex_unlock(&m->cl_lock);
  gc_moe_free(old_moe);
  gc_cluster_close(old_cl);
  struct timeval tv;
  gettimeofday(&tv, NULL);
  pthread_mutex_lock(&m->pl_lock);
  m->pl_gen++;
  m->pl_hash = hash;
  m->pl_switched_at = (double)tv.tv_sec + tv.tv_usec / 1e6;
  m->pl_error[0] = '\0';
  pthread_mutex_unlock(&m->pl_lock);
  mr_log(MR_LOG_INFO, "placement: switched to %s (generation %llu, hash %016llx) in %.1f ms, "
         "between two steps", m->o.placement_path, (unsigned long long)m->pl_gen,
         (unsigned long long)hash, (double)(mr_now_ns() - t0) / 1e6);
out_free:
  mr_free(json);
  mr_free(local);
  mr_free(route);
}

void gc_model_placement_get(gc_model *m, gc_model_placement *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&m->pl_lock);
  out->watching = m->o.watch_placement;
  out->generation = m->pl_gen;
  out->hash = m->pl_hash;
  out->switched_at = m->pl_switched_at;
  out->rejected = m->pl_rejected;
  snprintf(out->error, sizeof out->error, "%s", m->pl_error);
  pthread_mutex_unlock(&m->pl_lock);
}

void gc_model_placement_render(gc_model *m, mr_buf *p) {
  gc_model_placement pl;
  gc_model_placement_get(m, &pl);
  mr_buf_append(p, "{\"file\": ", 9);
  mr_buf_json_str(p, m->o.placement_path ? m->o.placement_path : "");
  mr_buf_append(p, ", \"client_name\": ", 17);
  mr_buf_json_str(p, m->client_name);
  mr_buf_printf(p, ", \"watching\": %s, \"generation\": %llu, \"hash\": \"%016llx\", "
                 "\"switched_at\": %.3f, \"rejected\": %llu, \"last_error\": ",
                 pl.watching ? "true" : "false", (unsigned long long)pl.generation,
                 (unsigned long long)pl.hash, pl.switched_at, (unsigned long long)pl.rejected);
  mr_buf_json_str(p, pl.error);
  mr_buf_append(p, "}\n", 2);
}

void gc_model_seq_reset(gc_model *m, uint32_t seq) {
  if (seq < m->max_batch) m->seq_len[seq] = 0;
}
uint32_t gc_model_seq_len(const gc_model *m, uint32_t seq) {
  return seq < m->max_batch ? m->seq_len[seq] : 0;
}

void gc_model_stats_get(gc_model *m, gc_model_stats *out, bool reset) {
  *out = m->st;
  memcpy(m->lst_snap, m->lst, (size_t)m->L * sizeof *m->lst);
  out->layer = m->lst_snap;
  if (reset) {
    memset(&m->st, 0, sizeof m->st);
    memset(m->lst, 0, (size_t)m->L * sizeof *m->lst);
    m->st.layer = m->lst;
  }
}

/* ---- the forward step -------------------------------------------------------------------- */

static int bufs_grow(gc_model *m, model_rank *r, uint32_t T, mr_err *e) {
  model_bufs *b = &r->b;
  if (T <= b->cap) return 0;
  bufs_free(r);
  gc_backend *bk = r->bk;
  const size_t t = T, H = m->H;
  const size_t wide = m->lId > m->lIs ? m->lId : m->lIs; /* dense MLP or shared experts */
  const size_t gu = wide ? 2 * wide : 1, mh = wide ? wide : 1;
  const size_t attn_w = m->mla ? (size_t)m->lnh * m->vd : (size_t)m->lnh * m->hd;
  b->x = bk->ops->alloc(bk, t * H * 4);
  b->h = bk->ops->alloc(bk, t * H * 4);
  b->qkv = bk->ops->alloc(bk, t * m->ln_qkv * 4);
  b->attn = bk->ops->alloc(bk, t * attn_w * 4);
  if (m->mla) {
    b->q = bk->ops->alloc(bk, t * m->lnh * m->qh * 4);
    b->qa = bk->ops->alloc(bk, t * (m->q_lora ? m->q_lora : 1) * 4);
  }
  if (m->Is) b->y2 = bk->ops->alloc(bk, t * H * 4);
  b->y = bk->ops->alloc(bk, t * H * 4);
  b->router = bk->ops->alloc(bk, t * m->E * 4);
  b->gu = bk->ops->alloc(bk, t * gu * 4);
  b->mh = bk->ops->alloc(bk, t * mh * 4);
  b->ids = bk->ops->host_alloc(bk, t * m->k * 4);
  b->w = bk->ops->host_alloc(bk, t * m->k * 4);
  b->hot_ids = bk->ops->host_alloc(bk, t * m->k * 4);
  b->wire = bk->ops->host_alloc(bk, t * H * mr_dtype_size(m->wire));
  b->cold = bk->ops->host_alloc(bk, t * H * 4);
  b->pos = bk->ops->host_alloc(bk, t * 4);
  b->seq = bk->ops->host_alloc(bk, t * 4);
  if (!b->x || !b->h || !b->qkv || !b->attn || !b->y || !b->router || !b->gu || !b->mh ||
      !b->ids || !b->w || !b->hot_ids || !b->wire || !b->cold || !b->pos || !b->seq ||
      (m->mla && (!b->q || !b->qa)) || (m->Is && !b->y2)) {
    bufs_free(r);
    return mr_err_set(e, MR_ENOMEM, "step buffers for %u tokens: out of memory", T);
  }
  b->cap = T;
  return 0;
}

static int step_validate(gc_model *m, const gc_step *s, uint32_t *n_want, mr_err *e) {
  if (!s || !s->ids || !s->seq || !s->pos || !s->logits)
    return mr_err_set(e, MR_EINVAL, "step: ids, seq, pos and logits are required");
  uint64_t cap = (uint64_t)m->max_batch * m->max_seq;
  if (s->n_tokens < 1 || s->n_tokens > cap)
    return mr_err_set(e, MR_ERANGE, "step: %u tokens, must be 1..%llu (batch x max_seq)",
                      s->n_tokens, (unsigned long long)cap);
  /* Positions must continue each slot's cache in order; check on a copy of the lengths. */
  uint32_t *l2 = mr_malloc(m->max_batch * sizeof *l2);
  if (!l2) return mr_err_set(e, MR_ENOMEM, "step: out of memory");
  memcpy(l2, m->seq_len, m->max_batch * sizeof *l2);
  int rc = 0;
  *n_want = 0;
  for (uint32_t t = 0; t < s->n_tokens && !rc; t++) {
    if (s->ids[t] < 0 || (uint32_t)s->ids[t] >= m->V)
      rc = mr_err_set(e, MR_ERANGE, "token %u: id %d is out of the vocabulary (0..%u)", t,
                      s->ids[t], m->V - 1);
    else if (s->seq[t] >= m->max_batch)
      rc = mr_err_set(e, MR_ERANGE, "token %u: sequence slot %u, must be < batch %u", t,
                      s->seq[t], m->max_batch);
    else if (s->pos[t] >= m->max_seq)
      rc = mr_err_set(e, MR_ERANGE, "token %u: position %u, must be < --max-seq %u (the "
                      "sequence is too long)", t, s->pos[t], m->max_seq);
    else if (s->pos[t] != l2[s->seq[t]])
      rc = mr_err_set(e, MR_EINVAL, "token %u: position %u in sequence slot %u, which holds %u "
                      "tokens: positions must continue the cache in order", t, s->pos[t],
                      s->seq[t], l2[s->seq[t]]);
    else
      l2[s->seq[t]]++;
    if (!s->want_logits || s->want_logits[t]) (*n_want)++;
  }
  mr_free(l2);
  return rc;
}

/* Counts the distinct experts a MoE layer's routing activated (for decode_bw_ratio). */
static void count_experts(gc_model *m, model_rank *r, uint32_t T) {
  memset(m->seen, 0, ((m->E + 63) / 64) * sizeof *m->seen);
  uint32_t n = 0;
  for (size_t i = 0; i < (size_t)T * m->k; i++) {
    int32_t x = r->b.ids[i];
    if (x < 0) continue;
    uint64_t bit = 1ull << (x & 63);
    if (!(m->seen[x >> 6] & bit)) {
      m->seen[x >> 6] |= bit;
      n++;
    }
  }
  m->st.expert_bytes_read += (uint64_t)n * m->expert_bytes_one;
}

/* Attention of rank r (its heads): y = o_proj(attention(rope(qk_norm(qkv(rmsnorm(x)))))),
 * a partial sum over the heads when tp > 1. */
static int layer_attention(gc_model *m, model_rank *r, uint32_t l, uint32_t T, mr_err *e) {
  model_layer *ly = &r->layer[l];
  const gc_bk_ops *op = r->bk->ops;
  gc_backend *bk = r->bk;
  model_bufs *b = &r->b;
  const uint32_t qw = m->lnh * m->hd, kvw = m->lnkv * m->hd, ld = m->ln_qkv;
  int rc;
  if ((rc = op->rmsnorm(bk, T, m->H, b->x, m->H, ly->ln1, m->cfg.rms_norm_eps, b->h, m->H, e)))
    return rc;
  if ((rc = op->matmul(bk, ly->qkv, T, b->h, ly->qkv_bias, b->qkv, e))) return rc;
  float *q = b->qkv, *k = b->qkv + qw, *v = b->qkv + qw + kvw;
  if (ly->q_norm) {
    /* per-head RMSNorm: the rows are T * heads vectors of hd floats */
    for (uint32_t t = 0; t < T; t++) {
      float *row = b->qkv + (size_t)t * ld;
      if ((rc = op->rmsnorm(bk, m->lnh, m->hd, row, m->hd, ly->q_norm, m->cfg.rms_norm_eps, row,
                            m->hd, e)))
        return rc;
      if ((rc = op->rmsnorm(bk, m->lnkv, m->hd, row + qw, m->hd, ly->k_norm,
                            m->cfg.rms_norm_eps, row + qw, m->hd, e)))
        return rc;
    }
  }
  gc_bk_rope rq = {.n_tokens = T, .n_heads = m->lnh, .head_stride = m->hd, .dim = m->hd,
                   .scale = m->rope_scale, .x = q, .ld = ld, .pos = b->pos,
                   .inv_freq = r->inv_freq};
  if ((rc = op->rope(bk, &rq, e))) return rc;
  gc_bk_rope rk = rq;
  rk.n_heads = m->lnkv, rk.x = k;
  if ((rc = op->rope(bk, &rk, e))) return rc;
  gc_bk_attn a = {.n_tokens = T, .seq = b->seq, .pos = b->pos, .n_heads = m->lnh,
                  .n_kv_heads = m->lnkv, .head_dim = m->hd, .max_seq = m->max_seq,
                  .window = m->cfg.sliding_window, .scale = m->attn_scale,
                  .q = q, .k = k, .v = v, .ld = ld, .k_cache = ly->k_cache,
                  .v_cache = ly->v_cache, .out = b->attn};
  if ((rc = op->attention(bk, &a, e))) return rc;
  return op->matmul(bk, ly->o, T, b->attn, ly->o_bias, b->y, e);
}

/* MLA of rank r (its heads) with the latent cache (backend.h gc_bk_mla): y = o_proj(mla). */
static int layer_attention_mla(gc_model *m, model_rank *r, uint32_t l, uint32_t T, mr_err *e) {
  model_layer *ly = &r->layer[l];
  const gc_bk_ops *op = r->bk->ops;
  gc_backend *bk = r->bk;
  model_bufs *b = &r->b;
  const float eps = m->cfg.rms_norm_eps;
  const size_t ld = m->ln_qkv;
  int rc;
  if ((rc = op->rmsnorm(bk, T, m->H, b->x, m->H, ly->ln1, eps, b->h, m->H, e))) return rc;
  /* one pass over q_a | kv_a (or q | kv_a) */
  if ((rc = op->matmul(bk, ly->qkv, T, b->h, NULL, b->qkv, e))) return rc;
  float *q = b->qkv;
  size_t ldq = ld;
  if (m->q_lora) {
    if ((rc = op->rmsnorm(bk, T, m->q_lora, b->qkv, ld, ly->q_a_norm, eps, b->qa, m->q_lora, e)))
      return rc;
    if ((rc = op->matmul(bk, ly->q_b, T, b->qa, NULL, b->q, e))) return rc;
    q = b->q;
    ldq = (size_t)m->lnh * m->qh;
  }
  float *kv = b->qkv + m->ln_qa; /* c | k_rot of each token */
  if ((rc = op->rmsnorm(bk, T, m->kv_lora, kv, ld, ly->kv_a_norm, eps, kv, ld, e))) return rc;
  gc_bk_rope rq = {.n_tokens = T, .n_heads = m->lnh, .head_stride = m->qh, .offset = m->nope,
                   .dim = m->rope, .interleave = m->cfg.rope_interleave,
                   .scale = m->rope_scale, .x = q, .ld = ldq, .pos = b->pos,
                   .inv_freq = r->inv_freq};
  if ((rc = op->rope(bk, &rq, e))) return rc;
  gc_bk_rope rk = rq;
  rk.n_heads = 1, rk.head_stride = m->kv_lora + m->rope, rk.offset = m->kv_lora, rk.x = kv;
  rk.ld = ld;
  if ((rc = op->rope(bk, &rk, e))) return rc;
  gc_bk_mla a = {.n_tokens = T, .seq = b->seq, .pos = b->pos, .n_heads = m->lnh,
                 .nope = m->nope, .rope = m->rope, .v_dim = m->vd, .kv_lora = m->kv_lora,
                 .max_seq = m->max_seq, .scale = m->attn_scale, .q = q, .ldq = ldq, .kv = kv,
                 .ldkv = ld, .w_kv_b = ly->w_kv_b, .cache = ly->k_cache, .out = b->attn};
  if ((rc = op->mla_attention(bk, &a, e))) return rc;
  return op->matmul(bk, ly->o, T, b->attn, NULL, b->y, e);
}

/* out = down(silu(gate(h)) * up(h)) of width n (b->h in, b->gu and b->mh as scratch). */
static int mlp(model_rank *r, const gc_bk_linear *gate_up, const gc_bk_linear *down, uint32_t n,
               uint32_t T, float *out, mr_err *e) {
  const gc_bk_ops *op = r->bk->ops;
  model_bufs *b = &r->b;
  int rc;
  if ((rc = op->matmul(r->bk, gate_up, T, b->h, NULL, b->gu, e))) return rc;
  if ((rc = op->silu_mul(r->bk, T, n, b->gu, b->mh, e))) return rc;
  return op->matmul(r->bk, down, T, b->mh, NULL, out, e);
}

/* y = the dense MLP of rank r's columns. */
static int layer_dense_mlp(gc_model *m, model_rank *r, uint32_t l, uint32_t T, mr_err *e) {
  model_layer *ly = &r->layer[l];
  model_bufs *b = &r->b;
  int rc = r->bk->ops->rmsnorm(r->bk, T, m->H, b->x, m->H, ly->ln2, m->cfg.rms_norm_eps, b->h,
                               m->H, e);
  return rc ? rc : mlp(r, ly->gate_up, ly->down, m->lId, T, b->y, e);
}

/* y = rank r's part of the MoE layer: its hot experts and its columns of the shared ones,
 * and on rank 0 the servers' sum (and the previous layer's deferred one). Every rank routes
 * (the same ids: x is the same on every rank); rank 0 alone counts and sends. */
static int layer_moe(gc_model *m, model_rank *r, uint32_t l, uint32_t T, mr_err *e) {
  model_layer *ly = &r->layer[l];
  const gc_bk_ops *op = r->bk->ops;
  gc_backend *bk = r->bk;
  model_bufs *b = &r->b;
  gc_layer_stats *ls = &m->lst[l];
  const size_t TK = (size_t)T * m->k, TH = (size_t)T * m->H;
  const bool lead = r->id == 0;
  int rc;
  if ((rc = op->rmsnorm(bk, T, m->H, b->x, m->H, ly->ln2, m->cfg.rms_norm_eps, b->h, m->H, e)))
    return rc;
  if ((rc = op->matmul(bk, ly->router, T, b->h, NULL, b->router, e))) return rc;
  gc_bk_route rt = {.n_tokens = T, .num_experts = m->E, .top_k = m->k,
                    .norm_topk = m->cfg.norm_topk_prob, .scoring = m->cfg.scoring,
                    .method = m->cfg.topk_method, .bias = ly->e_bias,
                    .n_group = m->cfg.n_group, .topk_group = m->cfg.topk_group,
                    .scale = m->cfg.routed_scaling_factor, .logits = b->router,
                    .ids = b->ids, .weights = b->w};
  if ((rc = op->route(bk, &rt, e))) return rc;
  /* With a cluster every MoE layer goes through gc_moe, even one whose experts are all
   * local: its wait collects the previous MoE layer's deferred call. */
  const bool remote = lead && m->moe != NULL;
  bool all_local = true;
  for (uint32_t x = 0; x < m->E && all_local; x++) all_local = m->local[(size_t)l * m->E + x];
  if (remote && !all_local && (rc = op->to_host(bk, b->wire, m->wire, b->h, TH, e))) return rc;
  if ((rc = op->sync(bk, e))) return rc;
  if (lead) count_experts(m, r, T);

  /* The cold slots go out first, so that the servers work while we compute the hot ones. */
  if (lead && !m->moe) gc_routing_count(m->routing_own, l, b->ids, TK, T, true);
  if (remote) {
    gc_layer_req q = {.layer = l, .n_tokens = T, .top_k = m->k, .ids = b->ids, .weights = b->w,
                      .x = b->wire, .dtype = m->wire};
    if ((rc = gc_moe_submit(m->moe, &q, l == m->last_moe, e))) return rc;
  }
  uint64_t t0 = mr_now_ns();
  bool any_hot = false;
  uint64_t n_local = 0;
  for (size_t i = 0; i < TK; i++) {
    int32_t x = b->ids[i];
    bool local = x >= 0 && m->local[(size_t)l * m->E + x];
    bool mine = local && m->owner[(size_t)l * m->E + x] == r->id;
    n_local += local;
    b->hot_ids[i] = mine ? x : -1;
    any_hot |= mine;
  }
  if (lead && n_local) __atomic_fetch_add(&m->mx_local_slots, n_local, __ATOMIC_RELAXED);
  if (any_hot) rc = op->experts(bk, ly->hot, T, m->k, b->hot_ids, b->w, b->h, b->y, e);
  else rc = op->zero(bk, b->y, TH, e);
  /* shared experts: on the backend too, while the servers work on the cold slots */
  if (!rc && ly->sh_gate_up && !(rc = mlp(r, ly->sh_gate_up, ly->sh_down, m->lIs, T, b->y2, e)))
    rc = op->add(bk, b->y, b->y2, TH, e);
  if (lead) ls->local_us += (mr_now_ns() - t0) / 1000u;
  if (rc) {
    if (remote) gc_moe_abort(m->moe);
    return rc;
  }
  if (remote) {
    memset(b->cold, 0, TH * sizeof *b->cold);
    gc_moe_timing tm;
    if ((rc = gc_moe_wait(m->moe, b->cold, &tm, e))) return rc;
    ls->wait_us += tm.now.wait_us + tm.deferred.wait_us;
    ls->rpc_us += tm.now.rpc_us;
    if (tm.now.rpc_us) mr_hist_observe(&m->rpc_hist, tm.now.rpc_us * 1000u);
    ls->submit_us += tm.now.submit_us + tm.deferred.submit_us;
    ls->deferred_rpc_us += tm.deferred.rpc_us;
    ls->deferred_wait_us += tm.deferred.wait_us;
    ls->deferred_slots += tm.deferred_slots;
    if ((rc = op->add_host(bk, b->y, b->cold, TH, e))) return rc;
  }
  return 0;
}

/* x += all_reduce(y): joins the ranks' partial sums (a no-op reduction with tp 1). A rank
 * that failed earlier in the step (failed) still takes part, so that no rank waits for it
 * forever, and adds nothing. */
static int join(gc_model *m, model_rank *r, uint32_t T, bool failed, mr_err *e) {
  const size_t TH = (size_t)T * m->H;
  if (m->comm) {
    int rc = m->comm->ops->all_reduce_sum(m->comm, r->id, r->bk, r->b.y, TH, e);
    if (rc) return rc;
  }
  return failed ? 0 : r->bk->ops->add(r->bk, r->b.x, r->b.y, TH, e);
}

/* Rank r's part of a step: embedding and every layer. With tp 1 it stops at the first
 * error; with tp > 1 a failed rank keeps calling the collectives (computing nothing) to
 * the end of the step, so that the others finish too, and reports its first error. A
 * failed collective aborts the communicator: every rank stops at once. */
static int rank_step(gc_model *m, model_rank *r, const gc_step *s, mr_err *e) {
  const uint32_t T = s->n_tokens;
  const bool lead = r->id == 0;
  int first = r->bk->ops->embed(r->bk, r->embed, T, s->ids, r->b.x, e);
  if (first && !m->comm) return first;
  for (uint32_t l = 0; l < m->L; l++) {
    mr_err le;
    uint64_t ta = mr_now_ns();
    int rc = first;
    if (!first) {
      rc = m->mla ? layer_attention_mla(m, r, l, T, &le) : layer_attention(m, r, l, T, &le);
      if (rc) mr_err_prefix(&le, rc, "layer %u attention", l);
    }
    if (!first && rc) first = rc, *e = le;
    if (first && !m->comm) return first;
    if ((rc = join(m, r, T, first != 0, &le))) {
      if (!first) *e = le;
      if (m->comm) m->comm->ops->abort(m->comm);
      return first ? first : rc;
    }
    if (lead) m->lst[l].attn_us += (mr_now_ns() - ta) / 1000u;
    uint64_t tm = mr_now_ns();
    if (!first) {
      rc = r->layer[l].moe ? layer_moe(m, r, l, T, &le) : layer_dense_mlp(m, r, l, T, &le);
      if (rc) mr_err_prefix(&le, rc, "layer %u %s", l, r->layer[l].moe ? "MoE" : "MLP");
      if (rc) first = rc, *e = le;
    }
    if (first && !m->comm) return first;
    if ((rc = join(m, r, T, first != 0, &le))) {
      if (!first) *e = le;
      if (m->comm) m->comm->ops->abort(m->comm);
      return first ? first : rc;
    }
    if (lead && !r->layer[l].moe) m->lst[l].local_us += (mr_now_ns() - tm) / 1000u;
  }
  return first;
}

static int step_head(gc_model *m, const gc_step *s, uint32_t n_want, mr_err *e) {
  model_rank *r = &m->rk[0];
  const gc_bk_ops *op = r->bk->ops;
  gc_backend *bk = r->bk;
  int rc;
  if (n_want > r->head_cap) {
    if (r->head_x) op->free(bk, r->head_x);
    if (r->head_out) op->free(bk, r->head_out);
    r->head_x = op->alloc(bk, (size_t)n_want * m->H * 4);
    r->head_out = op->alloc(bk, (size_t)n_want * m->V * 4);
    r->head_cap = r->head_x && r->head_out ? n_want : 0;
    if (!r->head_cap) return mr_err_set(e, MR_ENOMEM, "logits of %u tokens: out of memory", n_want);
  }
  /* gather the rows that want logits, then norm + lm_head on them only */
  uint32_t j = 0;
  for (uint32_t t = 0; t < s->n_tokens; t++)
    if (!s->want_logits || s->want_logits[t]) r->b.pos[j++] = t; /* pos is free by now */
  if ((rc = op->gather_rows(bk, r->head_x, r->b.x, m->H, r->b.pos, n_want, e))) return rc;
  if ((rc = op->rmsnorm(bk, n_want, m->H, r->head_x, m->H, r->final_norm, m->cfg.rms_norm_eps,
                        r->head_x, m->H, e)))
    return rc;
  if ((rc = op->matmul(bk, r->head, n_want, r->head_x, NULL, r->head_out, e))) return rc;
  if ((rc = op->to_host(bk, s->logits, MR_DTYPE_F32, r->head_out, (size_t)n_want * m->V, e)))
    return rc;
  return op->sync(bk, e);
}

/* ---- worker ranks ------------------------------------------------------------------------ */

typedef struct rank_arg {
  gc_model *m;
  model_rank *r;
} rank_arg;

static void *rank_main(void *arg) {
  gc_model *m = ((rank_arg *)arg)->m;
  model_rank *r = ((rank_arg *)arg)->r;
  mr_free(arg);
  char name[16];
  snprintf(name, sizeof name, "gc-rank%u", r->id);
  pthread_setname_np(pthread_self(), name);
  uint64_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&m->st_mu);
    while (m->st_gen == seen && !m->st_stop) pthread_cond_wait(&m->st_cv, &m->st_mu);
    if (m->st_stop) {
      pthread_mutex_unlock(&m->st_mu);
      break;
    }
    seen = m->st_gen;
    const gc_step *s = m->st_step;
    pthread_mutex_unlock(&m->st_mu);
    r->rc = rank_step(m, r, s, &r->err);
    pthread_mutex_lock(&m->st_mu);
    if (--m->st_pending == 0) pthread_cond_signal(&m->st_done_cv);
    pthread_mutex_unlock(&m->st_mu);
  }
  return NULL;
}

/* Starts the threads of ranks 1..tp-1 (they wait for steps). */
static int ranks_start(gc_model *m, mr_err *e) {
  if (m->tp == 1) return 0;
  pthread_mutex_init(&m->st_mu, NULL);
  pthread_cond_init(&m->st_cv, NULL);
  pthread_cond_init(&m->st_done_cv, NULL);
  m->st_inited = true;
  for (uint32_t i = 1; i < m->tp; i++) {
    rank_arg *a = mr_malloc(sizeof *a);
    if (!a) return mr_err_set(e, MR_ENOMEM, "rank %u: out of memory", i);
    *a = (rank_arg){m, &m->rk[i]};
    int err = pthread_create(&m->rk[i].th, NULL, rank_main, a);
    if (err) {
      mr_free(a);
      return mr_err_set(e, MR_EEXHAUSTED, "rank %u: could not start its thread: %s", i,
                        strerror(err));
    }
    m->rk[i].th_started = true;
  }
  return 0;
}

static void ranks_stop(gc_model *m) {
  if (!m->st_inited) return;
  pthread_mutex_lock(&m->st_mu);
  m->st_stop = true;
  pthread_cond_broadcast(&m->st_cv);
  pthread_mutex_unlock(&m->st_mu);
  for (uint32_t i = 1; i < m->tp; i++)
    if (m->rk[i].th_started) pthread_join(m->rk[i].th, NULL);
  pthread_cond_destroy(&m->st_cv);
  pthread_cond_destroy(&m->st_done_cv);
  pthread_mutex_destroy(&m->st_mu);
  m->st_inited = false;
}

/* Every rank's part of step s: ranks 1.. on their threads, rank 0 here; the first error
 * by rank wins (a rank that only saw the abort of another reports MR_ECANCELED last). */
static int ranks_step(gc_model *m, const gc_step *s, mr_err *e) {
  if (m->tp == 1) return rank_step(m, &m->rk[0], s, e);
  pthread_mutex_lock(&m->st_mu);
  m->st_step = s;
  m->st_pending = m->tp - 1;
  m->st_gen++;
  pthread_cond_broadcast(&m->st_cv);
  pthread_mutex_unlock(&m->st_mu);
  m->rk[0].rc = rank_step(m, &m->rk[0], s, &m->rk[0].err);
  pthread_mutex_lock(&m->st_mu);
  while (m->st_pending) pthread_cond_wait(&m->st_done_cv, &m->st_mu);
  pthread_mutex_unlock(&m->st_mu);
  int rc = 0;
  for (int pass = 0; pass < 2 && !rc; pass++)
    for (uint32_t i = 0; i < m->tp && !rc; i++) {
      model_rank *r = &m->rk[i];
      if (r->rc && (pass == 1 || r->rc != MR_ECANCELED)) {
        rc = r->rc;
        *e = r->err;
        if (i) mr_err_prefix(e, rc, "rank %u", i);
      }
    }
  return rc;
}

int gc_model_step(gc_model *m, const gc_step *s, mr_err *e) {
  if (m->o.watch_placement) placement_poll(m); /* step boundary: nothing in flight */
  uint32_t n_want = 0;
  int rc = step_validate(m, s, &n_want, e);
  if (rc) return rc;
  const uint32_t T = s->n_tokens;
  for (uint32_t r = 0; r < m->tp; r++) {
    if ((rc = bufs_grow(m, &m->rk[r], T, e))) return rc;
    memcpy(m->rk[r].b.pos, s->pos, T * sizeof *s->pos);
    memcpy(m->rk[r].b.seq, s->seq, T * sizeof *s->seq);
  }
  const uint64_t t0 = mr_now_ns();
  if ((rc = ranks_step(m, s, e))) goto fail;
  /* the last MoE layer defers nothing and collects the deferral before it */
  MR_ASSERT(!m->moe || !gc_moe_has_deferred(m->moe));
  uint64_t th = mr_now_ns();
  if ((rc = step_head(m, s, n_want, e))) goto fail;
  m->st.head_us += (mr_now_ns() - th) / 1000u;
  for (uint32_t t = 0; t < T; t++) m->seq_len[s->seq[t]]++;
  m->st.steps++;
  m->st.tokens += T;
  m->st.step_us += (mr_now_ns() - t0) / 1000u;
  m->st.dense_bytes_read += m->dense_bytes;
  mr_hist_observe(&m->step_hist, mr_now_ns() - t0);
  __atomic_fetch_add(&m->mx_steps, 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&m->mx_tokens, T, __ATOMIC_RELAXED);
  return 0;
fail:
  if (m->moe) gc_moe_abort(m->moe);
  return rc;
}

/* ---- generation -------------------------------------------------------------------------- */

int gc_model_generate(gc_model *m, uint32_t n, const int32_t *const *prompts,
                      const uint32_t *lens, uint32_t max_new, const gc_sampling *smp,
                      int32_t *out, gc_gen_timing *t, mr_err *e) {
  if (n < 1 || n > m->max_batch)
    return mr_err_set(e, MR_ERANGE, "generate: %u sequences, must be 1..--batch %u", n,
                      m->max_batch);
  uint64_t total = 0;
  for (uint32_t b = 0; b < n; b++) {
    if (lens[b] < 1)
      return mr_err_set(e, MR_EINVAL, "generate: prompt %u is empty", b);
    if ((uint64_t)lens[b] + max_new > m->max_seq)
      return mr_err_set(e, MR_ERANGE, "generate: prompt %u has %u tokens + %u new = %llu, more "
                        "than --max-seq %u", b, lens[b], max_new,
                        (unsigned long long)lens[b] + max_new, m->max_seq);
    total += lens[b];
  }
  gc_gen_timing tm = {0};
  int rc = 0;
  const size_t V = m->V;
  int32_t *ids = mr_malloc((total > n ? total : n) * sizeof *ids);
  uint32_t *seq = mr_malloc((total > n ? total : n) * sizeof *seq);
  uint32_t *pos = mr_malloc((total > n ? total : n) * sizeof *pos);
  uint8_t *want = mr_calloc(total > n ? total : n, 1);
  float *logits = mr_malloc((size_t)n * V * sizeof *logits);
  uint64_t *rng = mr_malloc((size_t)n * sizeof *rng);
  if (!ids || !seq || !pos || !want || !logits || !rng) {
    rc = mr_err_set(e, MR_ENOMEM, "generate: out of memory");
    goto out;
  }
  for (uint32_t b = 0; b < n; b++) {
    gc_model_seq_reset(m, b);
    rng[b] = (smp ? smp->seed : 0) ^ (0x632be59bd9b4e019ull * (b + 1));
  }
  /* prefill: every prompt in one step, logits of each prompt's last token */
  size_t i = 0;
  for (uint32_t b = 0; b < n; b++)
    for (uint32_t p = 0; p < lens[b]; p++, i++) {
      ids[i] = prompts[b][p];
      seq[i] = b;
      pos[i] = p;
      want[i] = p + 1 == lens[b];
    }
  uint64_t t0 = mr_now_ns();
  gc_step s = {.n_tokens = (uint32_t)total, .ids = ids, .seq = seq, .pos = pos,
               .want_logits = want, .logits = logits};
  if (max_new == 0) goto out;
  if ((rc = gc_model_step(m, &s, e))) goto out;
  tm.prefill_us = (mr_now_ns() - t0) / 1000u;
  tm.prefill_tokens = total;
  for (uint32_t b = 0; b < n; b++)
    out[(size_t)b * max_new] = gc_sample(logits + b * V, m->V, smp, &rng[b]);
  __atomic_fetch_add(&m->mx_generated, n, __ATOMIC_RELAXED);
  /* decode: one token per sequence per step */
  t0 = mr_now_ns();
  for (uint32_t step = 1; step < max_new; step++) {
    for (uint32_t b = 0; b < n; b++) {
      ids[b] = out[(size_t)b * max_new + step - 1];
      seq[b] = b;
      pos[b] = lens[b] + step - 1;
    }
    s = (gc_step){.n_tokens = n, .ids = ids, .seq = seq, .pos = pos, .want_logits = NULL,
                  .logits = logits};
    if ((rc = gc_model_step(m, &s, e))) {
      mr_err_prefix(e, rc, "decode step %u", step);
      goto out;
    }
    for (uint32_t b = 0; b < n; b++)
      out[(size_t)b * max_new + step] = gc_sample(logits + b * V, m->V, smp, &rng[b]);
    tm.decode_tokens += n;
    __atomic_fetch_add(&m->mx_generated, n, __ATOMIC_RELAXED);
  }
  tm.decode_us = (mr_now_ns() - t0) / 1000u;
out:
  if (t) *t = tm;
  mr_free(ids);
  mr_free(seq);
  mr_free(pos);
  mr_free(want);
  mr_free(logits);
  mr_free(rng);
  return rc;
}

/* ---- metrics ----------------------------------------------------------------------------- */

static void metrics_render_cluster(gc_model *m, mr_buf *p);
void gc_model_metrics_render(gc_model *m, mr_buf *p) {
  mr_host_render(p); /* moerpc_host_advice, moerpc_host_info */
  mr_prom_family(p, "moerpc_client_steps_total", MR_PROM_COUNTER, "Forward steps (gc_model_step).");
  mr_prom_u64(p, "moerpc_client_steps_total", NULL, __atomic_load_n(&m->mx_steps, __ATOMIC_RELAXED));
  mr_prom_family(p, "moerpc_client_step_tokens_total", MR_PROM_COUNTER,
                 "Tokens run through the model (prefill and decode).");
  mr_prom_u64(p, "moerpc_client_step_tokens_total", NULL, __atomic_load_n(&m->mx_tokens, __ATOMIC_RELAXED));
  mr_prom_family(p, "moerpc_client_generated_tokens_total", MR_PROM_COUNTER, "Tokens sampled (generate).");
  mr_prom_u64(p, "moerpc_client_generated_tokens_total", NULL,
              __atomic_load_n(&m->mx_generated, __ATOMIC_RELAXED));
  mr_prom_family(p, "moerpc_client_local_expert_slots_total", MR_PROM_COUNTER,
                 "Token-expert slots computed by the client's local (hot) experts.");
  mr_prom_u64(p, "moerpc_client_local_expert_slots_total", NULL,
              __atomic_load_n(&m->mx_local_slots, __ATOMIC_RELAXED));
  mr_prom_family(p, "moerpc_client_step_seconds", MR_PROM_HISTOGRAM, "Wall time of one forward step.");
  mr_prom_hist(p, "moerpc_client_step_seconds", NULL, &m->step_hist);
  mr_prom_family(p, "moerpc_client_layer_rpc_seconds", MR_PROM_HISTOGRAM,
                 "A MoE layer's server call: requests queued to the last reply (all servers).");
  mr_prom_hist(p, "moerpc_client_layer_rpc_seconds", NULL, &m->rpc_hist);
  pthread_mutex_lock(&m->cl_lock); /* a placement switch swaps the cluster */
  metrics_render_cluster(m, p);
  pthread_mutex_unlock(&m->cl_lock);
}

static void metrics_render_cluster(gc_model *m, mr_buf *p) {
  if (!m->cluster) return;
  gc_cluster_info ci;
  gc_cluster_info_get(m->cluster, &ci);
  static const struct {
    const char *name, *help;
    size_t off;
  } ctr[] = {
      {"moerpc_client_server_requests_total", "ForwardRequests queued to the server.",
       offsetof(gc_server_counters, requests)},
      {"moerpc_client_server_paired_total", "Of those, sent in one batch with the receive of their reply.",
       offsetof(gc_server_counters, paired)},
      {"moerpc_client_server_replies_total", "OK replies from the server.", offsetof(gc_server_counters, replies)},
      {"moerpc_client_server_errors_total", "Error replies, timeouts and stream failures.",
       offsetof(gc_server_counters, errors)},
      {"moerpc_client_server_timeouts_total", "Requests given up at the deadline.",
       offsetof(gc_server_counters, timeouts)},
      {"moerpc_client_server_sent_bytes_total", "Serialized ForwardRequest bytes.",
       offsetof(gc_server_counters, bytes_sent)},
      {"moerpc_client_server_received_bytes_total", "Serialized ForwardReply bytes.",
       offsetof(gc_server_counters, bytes_received)},
      {"moerpc_client_server_failovers_total", "Times the server was marked down (stream broke, failover deadline).",
       offsetof(gc_server_counters, failovers)},
      {"moerpc_client_server_resent_total", "Its requests re-planned onto other replicas and resent.",
       offsetof(gc_server_counters, resent)},
      {"moerpc_client_server_returns_total", "Times it passed a fresh Hello after being down.",
       offsetof(gc_server_counters, returns)},
  };
  gc_server_counters *sc = mr_calloc(ci.n_servers ? ci.n_servers : 1, sizeof *sc);
  gc_server_info *si = mr_calloc(ci.n_servers ? ci.n_servers : 1, sizeof *si);
  if (!sc || !si) {
    p->oom = true;
    goto out_free;
  }
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    gc_server_counters_get(m->cluster, i, false, &sc[i], NULL);
    gc_server_info_get(m->cluster, i, &si[i], NULL);
  }
  for (size_t k = 0; k < sizeof ctr / sizeof ctr[0]; k++) {
    mr_prom_family(p, ctr[k].name, MR_PROM_COUNTER, ctr[k].help);
    for (uint32_t i = 0; i < ci.n_servers; i++) {
      const char *l[] = {"server", si[i].name, NULL};
      mr_prom_u64(p, ctr[k].name, l, *(const uint64_t *)((const char *)&sc[i] + ctr[k].off));
    }
  }
  mr_prom_family(p, "moerpc_client_server_rtt_mean_seconds", MR_PROM_GAUGE,
                 "Mean round trip of OK replies since open (submit to reply).");
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    const char *l[] = {"server", si[i].name, NULL};
    mr_prom_double(p, "moerpc_client_server_rtt_mean_seconds", l, sc[i].mean_rtt_us / 1e6);
  }
  mr_prom_family(p, "moerpc_client_server_down", MR_PROM_GAUGE,
                 "1 while the server is marked down (its slots go to replicas).");
  for (uint32_t i = 0; i < ci.n_servers; i++) {
    const char *l[] = {"server", si[i].name, NULL};
    mr_prom_u64(p, "moerpc_client_server_down", l, sc[i].down ? 1 : 0);
  }
out_free:
  mr_free(sc);
  mr_free(si);
}
