/*
 * moerpc-mkmodel - writes a random, deterministic Qwen3-MoE checkpoint in the Hugging Face
 * layout (config.json + bf16 safetensors, sharded with an index when large), so that tests,
 * benchmarks and demos have a model of any shape without downloading one. transformers'
 * Qwen3MoeForCausalLM loads it as it is.
 *
 *   moerpc-mkmodel --out DIR [--layers 4 --experts 16 --topk 4 --hidden 256 --inter 128
 *                  --vocab 512 --heads 4 --kv-heads 2 --head-dim 64 --seed 1 --shard-mb 0
 *                  --dtype bf16|fp8]
 *
 * --dtype fp8 writes the routed experts' projections as an FP8 checkpoint does (DeepSeek-V3,
 * Qwen3-*-FP8, transformers FineGrainedFP8): "...gate_proj.weight" F8_E4M3 [N, K] codes
 * and "...gate_proj.weight_scale_inv" F32 [ceil(N/128), ceil(K/128)], the quantization of
 * the bf16 values the same seed gives (scale = amax / 448 per 128x128 block, e4m3 round to
 * nearest even, saturating), and config.json gets quantization_config {"quant_method":
 * "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}.
 * Everything else stays bf16 (embeddings, norms, router and lm_head are bf16 in the real
 * checkpoints too; their attention projections are fp8, ours bf16, since the servers only
 * hold experts and the client's dense layers take no fp8), listed in
 * modules_to_not_convert.
 *
 * Determinism: every tensor draws from its own xoshiro256** stream seeded from (--seed,
 * tensor name), so a tensor's values do not depend on sharding, write order or the other
 * flags except its own shape.
 *
 * Memory stays bounded whatever the model size: tensors are declared lazily and their bytes
 * are generated into the writer's 4 MiB output buffer as the file is written
 * (mr__st_writer_write_fill), one shard at a time.
 */
#include "common/internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define MK_AUTO_SHARD_BYTES ((uint64_t)2 << 30)
/* Shard headers are capped at 100 MiB by the reader; at ~150 header bytes per tensor this
 * keeps every shard's header far below that, however small its tensors. */
#define MK_MAX_TENSORS_PER_SHARD 200000u
/* layers * experts: DeepSeek-V3 has 15.6k routed experts, Kimi-K2 23k. */
#define MK_MAX_TOTAL_EXPERTS (1u << 20)

typedef struct mk_args {
  uint32_t layers, experts, topk, hidden, inter, vocab, heads, kv_heads, head_dim;
  uint64_t seed;
  uint64_t shard_mb;
  double router_skew; /* --router-skew S: 0 = plain random routers */
  bool fp8;           /* --dtype fp8: experts as F8_E4M3 + F32 weight_scale_inv */
  const char *out;
} mk_args;

/* ---- PRNG: splitmix64 to seed, xoshiro256** to draw (Blackman & Vigna). ------------- */

static uint64_t mk_splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef struct mk_rng {
  uint64_t s[4];
} mk_rng;

static inline uint64_t mk_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t mk_rng_next(mk_rng *r) {
  uint64_t *s = r->s;
  uint64_t result = mk_rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = mk_rotl(s[3], 45);
  return result;
}

static void mk_rng_seed(mk_rng *r, uint64_t seed, const char *name) {
  /* FNV-1a of the name, mixed with the seed through splitmix64. */
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ull;
  }
  uint64_t x = seed ^ mk_splitmix64(&h);
  for (int i = 0; i < 4; i++) r->s[i] = mk_splitmix64(&x);
}

/* ---- the tensor list ---------------------------------------------------------------- */

/* Tensor i of the model, in checkpoint order: embed, then per layer 9 + 3E tensors, then
 * the final norm and lm_head. Generated from the index so no list is ever held. */
typedef struct mk_tensor {
  char name[160];
  uint32_t ndim;
  uint64_t shape[2];
  /* Values: 2-D weights are uniform with std 1/sqrt(fan_in) (fan_in = shape[1]) so that
   * activations stay O(1) through the layers; the embedding has std 1; 1-D tensors are
   * RMSNorm weights, 1 + uniform noise of +-0.05. */
  float scale; /* half-width of the uniform distribution */
  bool norm;
  int64_t router_layer; /* the layer of a router (mlp.gate) tensor, else -1 */
  enum { MK_BF16 = 0, MK_F8, MK_SCALE } kind; /* F8: e4m3 codes; SCALE: F32 scale_inv */
  uint64_t src_rows, src_cols; /* F8 / SCALE: the shape of the quantized weight */
  char src_name[160];          /* F8 / SCALE: the weight's name (its rng stream) */
} mk_tensor;

static uint64_t mk_per_layer(const mk_args *a) { return 9 + (a->fp8 ? 6 : 3) * (uint64_t)a->experts; }

static uint64_t mk_tensor_count(const mk_args *a) {
  return 1 + (uint64_t)a->layers * mk_per_layer(a) + 2;
}

static void mk_2d(mk_tensor *t, uint64_t rows, uint64_t cols) {
  t->ndim = 2;
  t->shape[0] = rows;
  t->shape[1] = cols;
  t->scale = (float)(sqrt(3.0) / sqrt((double)cols));
  t->norm = false;
  t->router_layer = -1;
  t->kind = MK_BF16;
}

static void mk_1d(mk_tensor *t, uint64_t n) {
  t->ndim = 1;
  t->shape[0] = n;
  t->scale = 0.05f;
  t->norm = true;
  t->router_layer = -1;
  t->kind = MK_BF16;
}

static void mk_tensor_get(const mk_args *a, uint64_t i, mk_tensor *t) {
  uint64_t H = a->hidden, I = a->inter, V = a->vocab, hd = a->head_dim;
  uint64_t q = (uint64_t)a->heads * hd, kv = (uint64_t)a->kv_heads * hd;
  uint64_t n = mk_tensor_count(a);
  MR_ASSERT(i < n);
  if (i == 0) {
    snprintf(t->name, sizeof t->name, "model.embed_tokens.weight");
    mk_2d(t, V, H);
    t->scale = (float)sqrt(3.0);
    return;
  }
  if (i == n - 2) {
    snprintf(t->name, sizeof t->name, "model.norm.weight");
    mk_1d(t, H);
    return;
  }
  if (i == n - 1) {
    snprintf(t->name, sizeof t->name, "lm_head.weight");
    mk_2d(t, V, H);
    return;
  }
  uint64_t l = (i - 1) / mk_per_layer(a), k = (i - 1) % mk_per_layer(a);
  char pre[48];
  snprintf(pre, sizeof pre, "model.layers.%llu.", (unsigned long long)l);
  switch (k) {
  case 0: snprintf(t->name, sizeof t->name, "%sinput_layernorm.weight", pre); mk_1d(t, H); return;
  case 1:
    snprintf(t->name, sizeof t->name, "%spost_attention_layernorm.weight", pre);
    mk_1d(t, H);
    return;
  case 2: snprintf(t->name, sizeof t->name, "%sself_attn.q_proj.weight", pre); mk_2d(t, q, H); return;
  case 3: snprintf(t->name, sizeof t->name, "%sself_attn.k_proj.weight", pre); mk_2d(t, kv, H); return;
  case 4: snprintf(t->name, sizeof t->name, "%sself_attn.v_proj.weight", pre); mk_2d(t, kv, H); return;
  case 5: snprintf(t->name, sizeof t->name, "%sself_attn.o_proj.weight", pre); mk_2d(t, H, q); return;
  case 6: snprintf(t->name, sizeof t->name, "%sself_attn.q_norm.weight", pre); mk_1d(t, hd); return;
  case 7: snprintf(t->name, sizeof t->name, "%sself_attn.k_norm.weight", pre); mk_1d(t, hd); return;
  case 8:
    snprintf(t->name, sizeof t->name, "%smlp.gate.weight", pre);
    mk_2d(t, a->experts, H);
    t->router_layer = (int64_t)l;
    return;
  default: break;
  }
  const uint64_t per = a->fp8 ? 6 : 3;
  uint64_t e = (k - 9) / per, p = (k - 9) % per;
  static const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
  snprintf(t->name, sizeof t->name, "%smlp.experts.%llu.%s.weight", pre, (unsigned long long)e,
           proj[p % 3]);
  if (p % 3 == 2) mk_2d(t, H, I);
  else mk_2d(t, I, H);
  if (!a->fp8) return;
  snprintf(t->src_name, sizeof t->src_name, "%s", t->name);
  t->src_rows = t->shape[0];
  t->src_cols = t->shape[1];
  if (p < 3) {
    t->kind = MK_F8;
  } else { /* the block scales of projection p - 3 */
    t->kind = MK_SCALE;
    /* Names are short (model.layers.L.mlp.experts.E.x_proj.weight); cut, never overrun. */
    int nl = snprintf(t->name, sizeof t->name, "%.140s_scale_inv", t->src_name);
    MR_ASSERT(nl > 0 && (size_t)nl < sizeof t->name);
    t->shape[0] = (t->src_rows + 127) / 128;
    t->shape[1] = (t->src_cols + 127) / 128;
  }
}

static uint64_t mk_tensor_bytes(const mk_tensor *t) {
  uint64_t n = t->kind == MK_F8 ? 1 : t->kind == MK_SCALE ? 4 : 2; /* bf16, e4m3, f32 */
  for (uint32_t d = 0; d < t->ndim; d++) n *= t->shape[d];
  return n;
}

/* ---- writing ------------------------------------------------------------------------ */

typedef struct mk_fill_ctx {
  const mk_args *a;
  uint64_t first;      /* global index of the shard's first tensor */
  size_t cur;          /* shard-local index of the tensor being generated, or SIZE_MAX */
  uint64_t next_off;   /* byte offset expected next in cur */
  mk_tensor t;
  mk_rng rng;
  float *row_scale;    /* [experts]: router skew of the current router tensor, or NULL */
  uint8_t *q8;         /* F8 / SCALE tensor being written: its weight's codes */
  float *s8;           /* and block scales */
  /* progress over the whole model */
  uint64_t bytes_done, bytes_total, tensors_done, tensors_total;
  uint64_t t0_ns, last_report_ns;
} mk_fill_ctx;

static void mk_progress(mk_fill_ctx *c, bool force) {
  uint64_t now = mr_now_ns();
  if (!force && now - c->last_report_ns < 1000000000ull) return;
  c->last_report_ns = now;
  double s = (double)(now - c->t0_ns) / 1e9;
  double gb = (double)c->bytes_done / 1e9, total = (double)c->bytes_total / 1e9;
  double rate = s > 0 ? gb / s : 0;
  double eta = rate > 0 ? (total - gb) / rate : 0;
  mr_log(MR_LOG_INFO, "%llu/%llu tensors, %.2f/%.2f GB, %.2f GB/s, ETA %.0f s",
         (unsigned long long)c->tensors_done, (unsigned long long)c->tensors_total, gb, total,
         rate, eta);
}

/* Router skew (--router-skew S): row e of layer l's router is scaled by (1 + rank)^-S, where
 * rank is e's place in a permutation of the experts drawn for that layer. A row with a
 * larger norm gives logits of a larger spread, so it reaches the top-k more often: popular
 * experts, different ones in every layer, as trained routers have (measured in
 * docs/BENCHMARKS.md). Multiplies the same draws, so S = 0 writes the plain model. */
static void mk_router_skew(const mk_args *a, int64_t layer, float *out) {
  uint32_t E = a->experts;
  uint32_t *perm = (uint32_t *)out; /* the ranks first, in place */
  for (uint32_t e = 0; e < E; e++) perm[e] = e;
  char name[48];
  snprintf(name, sizeof name, "router-skew.%lld", (long long)layer);
  mk_rng r;
  mk_rng_seed(&r, a->seed, name);
  for (uint32_t e = E; e > 1; e--) { /* Fisher-Yates: perm[e] = the expert of rank e */
    uint32_t j = (uint32_t)(mk_rng_next(&r) % e), tmp = perm[e - 1];
    perm[e - 1] = perm[j];
    perm[j] = tmp;
  }
  uint32_t *rank = mr_malloc((size_t)E * sizeof *rank);
  MR_ASSERT(rank);
  for (uint32_t k = 0; k < E; k++) rank[perm[k]] = k;
  for (uint32_t e = 0; e < E; e++) out[e] = (float)pow(1.0 + rank[e], -a->router_skew);
  mr_free(rank);
}

/* The bf16 values of a whole 2-D weight t (as mk_fill draws them for a tensor written in one
 * piece), as fp32, then its fp8 block quantization into c->q8 / c->s8. */
static int mk_fp8_quantize(mk_fill_ctx *c, const mk_tensor *t) {
  const uint64_t R = t->src_rows, K = t->src_cols, n = R * K;
  float *w = mr_malloc((size_t)n * sizeof(float));
  mr_free(c->q8);
  mr_free(c->s8);
  c->q8 = mr_malloc((size_t)n);
  c->s8 = mr_malloc((size_t)((R + 127) / 128) * ((K + 127) / 128) * sizeof(float));
  if (!w || !c->q8 || !c->s8) {
    mr_free(w);
    return MR_ENOMEM;
  }
  mk_rng r;
  mk_rng_seed(&r, c->a->seed, t->src_name);
  const float inv24 = 1.0f / 16777216.0f, sc = (float)(sqrt(3.0) / sqrt((double)K));
  for (uint64_t i = 0; i < n; i += 2) {
    uint64_t x = mk_rng_next(&r);
    float u0 = (float)(x >> 40) * inv24, u1 = (float)((x >> 16) & 0xffffffu) * inv24;
    w[i] = mr_bf16_to_f32(mr_f32_to_bf16(sc * (2.0f * u0 - 1.0f)));
    if (i + 1 < n) w[i + 1] = mr_bf16_to_f32(mr_f32_to_bf16(sc * (2.0f * u1 - 1.0f)));
  }
  const uint64_t nkb = (K + 127) / 128;
  for (uint64_t r0 = 0; r0 < R; r0 += 128)
    mr_f8e4m3_quantize_rows(w + r0 * K, (uint32_t)(R - r0 < 128 ? R - r0 : 128), (uint32_t)K,
                            c->q8 + r0 * K, c->s8 + (r0 / 128) * nkb);
  mr_free(w);
  return 0;
}

static int mk_fill(void *ctx, size_t index, uint64_t offset, size_t n, void *dst) {
  mk_fill_ctx *c = ctx;
  if (index != c->cur) {
    MR_ASSERT(offset == 0);
    mk_tensor_get(c->a, c->first + index, &c->t);
    mk_rng_seed(&c->rng, c->a->seed, c->t.name);
    c->cur = index;
    c->next_off = 0;
    if (c->row_scale && c->t.router_layer >= 0) mk_router_skew(c->a, c->t.router_layer, c->row_scale);
    if (c->t.kind != MK_BF16) {
      int rc = mk_fp8_quantize(c, &c->t);
      if (rc) return rc;
    }
  }
  if (c->t.kind != MK_BF16) { /* codes or scales of the quantized weight */
    memcpy(dst, c->t.kind == MK_F8 ? (const void *)(c->q8 + offset) : (const void *)((const char *)c->s8 + offset), n);
    c->next_off += n;
    c->bytes_done += n;
    if (c->next_off == mk_tensor_bytes(&c->t)) c->tensors_done++;
    mk_progress(c, false);
    return 0;
  }
  MR_ASSERT(offset == c->next_off && n % 2 == 0);
  uint16_t *out = dst;
  size_t count = n / 2;
  float scale = c->t.scale, base = c->t.norm ? 1.0f : 0.0f;
  const float inv24 = 1.0f / 16777216.0f;
  const float *rs = c->t.router_layer >= 0 ? c->row_scale : NULL;
  uint64_t e0 = offset / 2, cols = c->t.ndim == 2 ? c->t.shape[1] : 1;
  for (size_t i = 0; i < count; i += 2) {
    /* Two 24-bit uniforms per draw: u in [0, 1) -> base + scale * (2u - 1). */
    uint64_t r = mk_rng_next(&c->rng);
    float u0 = (float)(r >> 40) * inv24, u1 = (float)((r >> 16) & 0xffffffu) * inv24;
    float s0 = scale, s1 = scale;
    if (rs) {
      s0 *= rs[(e0 + i) / cols];
      s1 *= rs[(e0 + i + 1) / cols];
    }
    out[i] = mr_f32_to_bf16(base + s0 * (2.0f * u0 - 1.0f));
    if (i + 1 < count) out[i + 1] = mr_f32_to_bf16(base + s1 * (2.0f * u1 - 1.0f));
  }
  c->next_off += n;
  c->bytes_done += n;
  if (c->next_off == mk_tensor_bytes(&c->t)) c->tensors_done++;
  mk_progress(c, false);
  return 0;
}

/* Writes text to path atomically (tmp + rename). */
static int mk_write_text(const char *path, const char *text, size_t len, mr_err *e) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return mr_err_set(e, MR_EIO, "%s: cannot create: %s", tmp, strerror(errno));
  size_t off = 0;
  while (off < len) {
    ssize_t k = write(fd, text + off, len - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      int err = errno;
      close(fd);
      unlink(tmp);
      return mr_err_set(e, MR_EIO, "%s: write: %s", tmp, strerror(err));
    }
    off += (size_t)k;
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    unlink(tmp);
    return mr_err_set(e, MR_EIO, "%s: sync: %s", tmp, strerror(errno));
  }
  if (rename(tmp, path) != 0) {
    int err = errno;
    unlink(tmp);
    return mr_err_set(e, MR_EIO, "%s: rename: %s", path, strerror(err));
  }
  return 0;
}

/* A growable string for config.json and the index. */
typedef struct mk_buf {
  char *s;
  size_t len, cap;
} mk_buf;

static int mk_printf(mk_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int mk_printf(mk_buf *b, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = b->cap - b->len;
    int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? room : 0, fmt, ap);
    va_end(ap);
    if (n < 0) return MR_EINTERNAL;
    if (b->s && (size_t)n < room) {
      b->len += (size_t)n;
      return 0;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + (size_t)n + 1) cap *= 2;
    char *g = mr_realloc(b->s, cap);
    if (!g) return MR_ENOMEM;
    b->s = g;
    b->cap = cap;
  }
}

static int mk_write_config(const mk_args *a, mr_err *e) {
  mk_buf b = {0};
  char path[4096];
  /* Recorded only when set, so that a plain model's config (and fingerprint) is unchanged. */
  char skew[512] = "";
  if (a->router_skew > 0) snprintf(skew, sizeof skew, ",\n  \"moerpc_router_skew\": %.17g", a->router_skew);
  if (a->fp8)
    snprintf(skew + strlen(skew), sizeof skew - strlen(skew),
             ",\n  \"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
             "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, 128], "
             "\"modules_to_not_convert\": [\"lm_head\", \"model.embed_tokens\", \"self_attn\", "
             "\"mlp.gate\"]}");
  int rc = mk_printf(
      &b,
      "{\n"
      "  \"architectures\": [\"Qwen3MoeForCausalLM\"],\n"
      "  \"model_type\": \"qwen3_moe\",\n"
      "  \"attention_bias\": false,\n"
      "  \"attention_dropout\": 0.0,\n"
      "  \"bos_token_id\": %u,\n"
      "  \"eos_token_id\": %u,\n"
      "  \"decoder_sparse_step\": 1,\n"
      "  \"head_dim\": %u,\n"
      "  \"hidden_act\": \"silu\",\n"
      "  \"hidden_size\": %u,\n"
      "  \"initializer_range\": 0.02,\n"
      "  \"intermediate_size\": %llu,\n"
      "  \"max_position_embeddings\": 4096,\n"
      "  \"max_window_layers\": %u,\n"
      "  \"mlp_only_layers\": [],\n"
      "  \"moe_intermediate_size\": %u,\n"
      "  \"norm_topk_prob\": true,\n"
      "  \"num_attention_heads\": %u,\n"
      "  \"num_experts\": %u,\n"
      "  \"num_experts_per_tok\": %u,\n"
      "  \"num_hidden_layers\": %u,\n"
      "  \"num_key_value_heads\": %u,\n"
      "  \"output_router_logits\": false,\n"
      "  \"rms_norm_eps\": 1e-06,\n"
      "  \"rope_scaling\": null,\n"
      "  \"rope_theta\": 1000000.0,\n"
      "  \"router_aux_loss_coef\": 0.001,\n"
      "  \"sliding_window\": null,\n"
      "  \"tie_word_embeddings\": false,\n"
      "  \"torch_dtype\": \"bfloat16\",\n"
      "  \"transformers_version\": \"4.51.0\",\n"
      "  \"use_cache\": true,\n"
      "  \"use_sliding_window\": false,\n"
      "  \"vocab_size\": %u,\n"
      "  \"moerpc_seed\": %llu%s\n"
      "}\n",
      a->vocab > 1 ? 1u : 0u, a->vocab > 2 ? 2u : 0u, a->head_dim, a->hidden,
      /* intermediate_size is the dense MLP width; no layer is dense here, but transformers
       * requires the field, so it gets the usual 3x of the expert width. */
      3ull * a->inter, a->layers, a->inter, a->heads, a->experts, a->topk, a->layers,
      a->kv_heads, a->vocab, (unsigned long long)a->seed, skew);
  if (rc) {
    mr_free(b.s);
    return mr_err_set(e, rc, "config.json: out of memory");
  }
  if (mr__path_join(path, sizeof path, a->out, "config.json") != 0) {
    mr_free(b.s);
    return mr_err_set(e, MR_ERANGE, "%s: path too long", a->out);
  }
  rc = mk_write_text(path, b.s, b.len, e);
  mr_free(b.s);
  return rc;
}

/* Removes the model files in dir that a run writing n_shards files does not write. */
static void mk_remove_stale(const char *dir, uint32_t n_shards) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *de;
  char path[4096];
  while ((de = readdir(d)) != NULL) {
    const char *n = de->d_name;
    unsigned k = 0, m = 0;
    int used = 0;
    bool stale = false;
    if (n_shards > 1 && strcmp(n, "model.safetensors") == 0) stale = true;
    if (n_shards == 1 && strcmp(n, "model.safetensors.index.json") == 0) stale = true;
    if (sscanf(n, "model-%5u-of-%5u.safetensors%n", &k, &m, &used) == 2 && n[used] == '\0' &&
        (n_shards == 1 || m != n_shards))
      stale = true;
    if (!stale) continue;
    if (mr__path_join(path, sizeof path, dir, n) == 0 && unlink(path) == 0)
      mr_log(MR_LOG_INFO, "removed stale %s", path);
  }
  closedir(d);
}

static int mk_shard_name(char *buf, size_t len, uint32_t k, uint32_t m) {
  if (m == 1) return snprintf(buf, len, "model.safetensors");
  return snprintf(buf, len, "model-%05u-of-%05u.safetensors", k + 1, m);
}

static int mk_run(const mk_args *a, mr_err *e) {
  int rc = 0;
  uint64_t n = mk_tensor_count(a);
  uint64_t shard_limit = a->shard_mb ? a->shard_mb << 20 : MK_AUTO_SHARD_BYTES;
  uint32_t *shard_first = NULL; /* global index of each shard's first tensor, + sentinel */
  mr_st_writer *w = NULL;
  mk_buf idx = {0};
  mk_tensor t;
  char path[4096], name[64];
  mk_fill_ctx fc = {0}; /* freed at out, whichever goto gets there */

  /* Plan the shards: greedy in checkpoint order, a new shard when the next tensor would
   * push the current one past the limit (HF's rule), or past the tensor cap. */
  uint64_t total = 0;
  for (uint64_t i = 0; i < n; i++) {
    mk_tensor_get(a, i, &t);
    total += mk_tensor_bytes(&t);
  }
  bool sharded = total > shard_limit;
  uint32_t n_shards = 0, cap = 16;
  shard_first = mr_malloc(cap * sizeof *shard_first);
  if (!shard_first) return mr_err_set(e, MR_ENOMEM, "out of memory");
  uint64_t cur = 0, cur_n = 0;
  for (uint64_t i = 0; i < n; i++) {
    mk_tensor_get(a, i, &t);
    uint64_t b = mk_tensor_bytes(&t);
    bool start = i == 0 || (sharded && cur > 0 && cur + b > shard_limit) ||
                 cur_n >= MK_MAX_TENSORS_PER_SHARD;
    if (start) {
      if (n_shards + 1 >= cap) {
        uint32_t *g = mr_realloc(shard_first, 2 * cap * sizeof *g);
        if (!g) {
          rc = mr_err_set(e, MR_ENOMEM, "out of memory");
          goto out;
        }
        shard_first = g;
        cap *= 2;
      }
      shard_first[n_shards++] = (uint32_t)i;
      cur = 0;
      cur_n = 0;
    }
    cur += b;
    cur_n++;
  }
  shard_first[n_shards] = (uint32_t)n;
  if (n_shards > 99999) {
    rc = mr_err_set(e, MR_ERANGE, "%u shards needed, at most 99999: raise --shard-mb", n_shards);
    goto out;
  }

  /* Fail before writing anything if the disk cannot hold the model. */
  struct statvfs vfs;
  if (statvfs(a->out, &vfs) == 0) {
    uint64_t avail = (uint64_t)vfs.f_bavail * vfs.f_frsize;
    if (avail < total + (1u << 20)) {
      rc = mr_err_set(e, MR_EEXHAUSTED, "%s: the model needs %.2f GB, only %.2f GB are free",
                      a->out, (double)total / 1e9, (double)avail / 1e9);
      goto out;
    }
  }
  mr_log(MR_LOG_INFO,
         "writing %s: %u layers, %u experts (top-%u), hidden %u, inter %u, vocab %u, "
         "%llu tensors, %.3f GB in %u file(s), seed %llu",
         a->out, a->layers, a->experts, a->topk, a->hidden, a->inter, a->vocab,
         (unsigned long long)n, (double)total / 1e9, n_shards, (unsigned long long)a->seed);

  /* A stale index next to a new single-file model would make readers open the old shards:
   * remove it before writing. For a sharded model the new index replaces the old one
   * atomically at the end, and leftovers are removed after it. */
  if (n_shards == 1) mk_remove_stale(a->out, n_shards);
  fc = (mk_fill_ctx){.a = a, .bytes_total = total, .tensors_total = n, .t0_ns = mr_now_ns()};
  fc.last_report_ns = fc.t0_ns;
  if (a->router_skew > 0) {
    fc.row_scale = mr_malloc((size_t)a->experts * sizeof *fc.row_scale);
    if (!fc.row_scale) {
      rc = mr_err_set(e, MR_ENOMEM, "out of memory");
      goto out;
    }
  }
  if (n_shards > 1) {
    rc = mk_printf(&idx, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {",
                   (unsigned long long)total);
    if (rc) {
      rc = mr_err_set(e, rc, "out of memory");
      goto out;
    }
  }
  for (uint32_t s = 0; s < n_shards; s++) {
    mk_shard_name(name, sizeof name, s, n_shards);
    if (mr__path_join(path, sizeof path, a->out, name) != 0) {
      rc = mr_err_set(e, MR_ERANGE, "%s: path too long", a->out);
      goto out;
    }
    if ((rc = mr_st_writer_new(&w))) {
      rc = mr_err_set(e, rc, "out of memory");
      goto out;
    }
    for (uint64_t i = shard_first[s]; i < shard_first[s + 1]; i++) {
      mk_tensor_get(a, i, &t);
      rc = t.kind == MK_F8      ? mr__st_writer_add_lazy_f8e4m3(w, t.name, t.ndim, t.shape)
           : t.kind == MK_SCALE ? mr__st_writer_add_lazy(w, t.name, MR_DTYPE_F32, t.ndim, t.shape)
                                : mr__st_writer_add_lazy(w, t.name, MR_DTYPE_BF16, t.ndim, t.shape);
      if (rc) {
        rc = mr_err_set(e, rc, "%s: cannot add tensor %s: %s", path, t.name, mr_strerror(rc));
        goto out;
      }
      if (n_shards > 1) {
        rc = mk_printf(&idx, "%s\n    \"%s\": \"%s\"", i ? "," : "", t.name, name);
        if (rc) {
          rc = mr_err_set(e, rc, "out of memory");
          goto out;
        }
      }
    }
    fc.first = shard_first[s];
    fc.cur = SIZE_MAX;
    uint64_t t0 = mr_now_ns();
    rc = mr__st_writer_write_fill(w, path, mk_fill, &fc, e);
    if (rc) goto out;
    double secs = (double)(mr_now_ns() - t0) / 1e9;
    mr_log(MR_LOG_INFO, "wrote %s: %u tensors, %.3f GB in %.1f s", path,
           shard_first[s + 1] - shard_first[s], (double)mr__st_writer_file_size(w) / 1e9, secs);
    mr_st_writer_free(w);
    w = NULL;
  }
  if (n_shards > 1) {
    rc = mk_printf(&idx, "\n  }\n}\n");
    if (rc) {
      rc = mr_err_set(e, rc, "out of memory");
      goto out;
    }
    if (mr__path_join(path, sizeof path, a->out, "model.safetensors.index.json") != 0) {
      rc = mr_err_set(e, MR_ERANGE, "%s: path too long", a->out);
      goto out;
    }
    if ((rc = mk_write_text(path, idx.s, idx.len, e))) goto out;
  }
  if (n_shards > 1) mk_remove_stale(a->out, n_shards);
  if ((rc = mk_write_config(a, e))) goto out;
  if (total > (256u << 20)) mk_progress(&fc, true);
  mr_log(MR_LOG_INFO, "done: %s in %.1f s", a->out, (double)(mr_now_ns() - fc.t0_ns) / 1e9);
out:
  mr_st_writer_free(w);
  mr_free(fc.row_scale);
  mr_free(fc.q8);
  mr_free(fc.s8);
  mr_free(idx.s);
  mr_free(shard_first);
  return rc;
}

/* ---- flags -------------------------------------------------------------------------- */

static void mk_usage(FILE *f) {
  fprintf(f,
          "usage: moerpc-mkmodel --out DIR [options]\n"
          "Writes a random, deterministic Qwen3-MoE checkpoint (config.json + bf16 safetensors)\n"
          "in the Hugging Face layout.\n"
          "\n"
          "  --out DIR        output directory (created if missing)          required\n"
          "  --layers N       decoder layers, 1..%u                        default 4\n"
          "  --experts N      routed experts per layer, 1..65536              default 16\n"
          "  --topk N         experts per token, 1..--experts                 default 4\n"
          "  --hidden N       hidden size, 1..65536                           default 256\n"
          "  --inter N        expert intermediate size, 1..1048576            default 128\n"
          "  --vocab N        vocabulary size, 1..16777216                    default 512\n"
          "  --heads N        attention heads, 1..4096                        default 4\n"
          "  --kv-heads N     key/value heads, 1..--heads, dividing --heads   default 2\n"
          "  --head-dim N     head dimension, 1..4096                         default 64\n"
          "  --seed N         PRNG seed, 0..2^64-1                            default 1\n"
          "  --shard-mb N     shard into files of at most N MiB of tensor data when the\n"
          "                   model is larger, 0..1048576; 0 = auto: 2 GiB     default 0\n"
          "  --router-skew S  popular experts: router row e of a layer is scaled by\n"
          "                   (1 + rank)^-S, ranks a per-layer permutation, 0..8   default 0\n"
          "  --dtype D        bf16, or fp8: routed experts as F8_E4M3 with F32 128x128 block\n"
          "                   scales (weight_scale_inv) and quantization_config fp8, the rest\n"
          "                   bf16 (DeepSeek-V3 / Qwen3-FP8 layout)            default bf16\n"
          "  --help           this text\n",
          MR_MAX_LAYERS);
}

/* Parses a decimal number in lo..hi for flag; prints the error and returns false. */
static bool mk_num(const char *flag, const char *v, uint64_t lo, uint64_t hi, uint64_t *out) {
  const char *p = v;
  uint64_t x = 0;
  bool ok = *p != '\0';
  for (; ok && *p; p++) {
    if (*p < '0' || *p > '9' || x > (UINT64_MAX - 9) / 10) ok = false;
    else x = x * 10 + (uint64_t)(*p - '0');
  }
  if (!ok || x < lo || x > hi) {
    fprintf(stderr, "moerpc-mkmodel: %s = \"%s\", must be an integer in %llu..%llu\n", flag, v,
            (unsigned long long)lo, (unsigned long long)hi);
    return false;
  }
  *out = x;
  return true;
}

/* Returns 0 to run, 1 after --help, 2 on a usage error (printed). */
static int mk_parse(int argc, char **argv, mk_args *a) {
  *a = (mk_args){.layers = 4, .experts = 16, .topk = 4, .hidden = 256, .inter = 128,
                 .vocab = 512, .heads = 4, .kv_heads = 2, .head_dim = 64, .seed = 1};
  static const struct {
    const char *flag;
    uint64_t lo, hi;
    size_t off; /* offsetof the uint32_t field, or SIZE_MAX for the u64 ones */
  } nums[] = {
      {"--layers", 1, MR_MAX_LAYERS, offsetof(mk_args, layers)},
      {"--experts", 1, 65536, offsetof(mk_args, experts)},
      {"--topk", 1, 65536, offsetof(mk_args, topk)},
      {"--hidden", 1, 65536, offsetof(mk_args, hidden)},
      {"--inter", 1, 1u << 20, offsetof(mk_args, inter)},
      {"--vocab", 1, 1u << 24, offsetof(mk_args, vocab)},
      {"--heads", 1, 4096, offsetof(mk_args, heads)},
      {"--kv-heads", 1, 4096, offsetof(mk_args, kv_heads)},
      {"--head-dim", 1, 4096, offsetof(mk_args, head_dim)},
  };
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      mk_usage(stdout);
      return 1;
    }
    /* "--flag=value" or "--flag value" */
    char flag[32];
    const char *val = NULL;
    const char *eq = strchr(arg, '=');
    if (eq && (size_t)(eq - arg) < sizeof flag) {
      memcpy(flag, arg, (size_t)(eq - arg));
      flag[eq - arg] = '\0';
      val = eq + 1;
    } else {
      snprintf(flag, sizeof flag, "%s", arg);
    }
    bool known = strcmp(flag, "--out") == 0 || strcmp(flag, "--seed") == 0 ||
                 strcmp(flag, "--shard-mb") == 0 || strcmp(flag, "--router-skew") == 0 ||
                 strcmp(flag, "--dtype") == 0;
    for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++)
      if (strcmp(flag, nums[k].flag) == 0) known = true;
    if (!known || strncmp(arg, "--", 2) != 0) {
      fprintf(stderr, "moerpc-mkmodel: unknown argument \"%s\" (see --help)\n", arg);
      return 2;
    }
    if (!val) {
      if (i + 1 >= argc) {
        fprintf(stderr, "moerpc-mkmodel: %s needs a value (see --help)\n", flag);
        return 2;
      }
      val = argv[++i];
    }
    uint64_t x;
    if (strcmp(flag, "--out") == 0) {
      if (!val[0]) {
        fprintf(stderr, "moerpc-mkmodel: --out is empty\n");
        return 2;
      }
      a->out = val;
    } else if (strcmp(flag, "--seed") == 0) {
      if (!mk_num(flag, val, 0, UINT64_MAX, &x)) return 2;
      a->seed = x;
    } else if (strcmp(flag, "--router-skew") == 0) {
      char *end = NULL;
      errno = 0;
      double v = strtod(val, &end);
      if (!val[0] || *end || errno || !(v >= 0.0 && v <= 8.0)) {
        fprintf(stderr, "moerpc-mkmodel: --router-skew \"%s\": must be a number in 0..8\n", val);
        return 2;
      }
      a->router_skew = v;
    } else if (strcmp(flag, "--dtype") == 0) {
      if (strcmp(val, "bf16") != 0 && strcmp(val, "fp8") != 0) {
        fprintf(stderr, "moerpc-mkmodel: --dtype \"%s\": must be bf16 or fp8\n", val);
        return 2;
      }
      a->fp8 = strcmp(val, "fp8") == 0;
    } else if (strcmp(flag, "--shard-mb") == 0) {
      if (!mk_num(flag, val, 0, 1u << 20, &x)) return 2;
      a->shard_mb = x;
    } else {
      for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++) {
        if (strcmp(flag, nums[k].flag) != 0) continue;
        if (!mk_num(flag, val, nums[k].lo, nums[k].hi, &x)) return 2;
        *(uint32_t *)((char *)a + nums[k].off) = (uint32_t)x;
      }
    }
  }
  if (!a->out) {
    fprintf(stderr, "moerpc-mkmodel: --out DIR is required (see --help)\n");
    return 2;
  }
  /* Limits between flags. */
  if (a->topk > a->experts) {
    fprintf(stderr, "moerpc-mkmodel: --topk = %u, must be in 1..--experts (%u)\n", a->topk,
            a->experts);
    return 2;
  }
  if (a->kv_heads > a->heads || a->heads % a->kv_heads != 0) {
    fprintf(stderr, "moerpc-mkmodel: --kv-heads = %u, must divide --heads (%u)\n", a->kv_heads,
            a->heads);
    return 2;
  }
  if ((uint64_t)a->layers * a->experts > MK_MAX_TOTAL_EXPERTS) {
    fprintf(stderr, "moerpc-mkmodel: --layers x --experts = %llu, at most %u\n",
            (unsigned long long)a->layers * a->experts, MK_MAX_TOTAL_EXPERTS);
    return 2;
  }
  return 0;
}

static int mk_mkdir_p(const char *dir, mr_err *e) {
  char p[4096];
  if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
    return mr_err_set(e, MR_ERANGE, "--out: path too long");
  for (char *s = p + 1;; s++) {
    if (*s == '/' || *s == '\0') {
      char c = *s;
      *s = '\0';
      if (mkdir(p, 0755) != 0 && errno != EEXIST)
        return mr_err_set(e, MR_EIO, "--out: cannot create %s: %s", p, strerror(errno));
      *s = c;
      if (c == '\0') break;
    }
  }
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return mr_err_set(e, MR_EINVAL, "--out: %s is not a directory", dir);
  return 0;
}

int main(int argc, char **argv) {
  mk_args a;
  mr_err e = {0};
  mr_log_set_component("mkmodel");
  int prc = mk_parse(argc, argv, &a);
  if (prc == 1) return 0;
  if (prc == 2) return 2;
  int rc = mk_mkdir_p(a.out, &e);
  if (!rc) rc = mk_run(&a, &e);
  if (rc) {
    mr_log(MR_LOG_ERROR, "%s (%s)", e.msg[0] ? e.msg : mr_strerror(rc), mr_err_name(rc));
    return 1;
  }
  return 0;
}
