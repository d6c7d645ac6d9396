/*
 * moerpc-mkmodel - writes a random, deterministic MoE checkpoint in the Hugging Face layout
 * (config.json + bf16 safetensors, sharded with an index when large), so that tests,
 * benchmarks and demos have a model of any shape without downloading one: Qwen3-MoE by
 * default, DeepSeek-V3 with --arch deepseek-v3. transformers' Qwen3MoeForCausalLM and
 * DeepseekV3ForCausalLM load them as they are.
 *
 *   moerpc-mkmodel --out DIR [--arch qwen3-moe|deepseek-v3 --layers 4 --experts 16 --topk 4
 *                  --hidden 256 --inter 128 --vocab 512 --heads 4 --kv-heads 2 --head-dim 64
 *                  --seed 1 --shard-mb 0 --dtype bf16|fp8 --tie 0|1 ...]   (see --help)
 *
 * DeepSeek-V3 (docs/DESIGN.md section 18): MLA attention (q_a/q_b or q_proj,
 * kv_a_proj_with_mqa, kv_b_proj, o_proj and their norms), --dense-layers dense MLP layers
 * first, then MoE
 * layers with a bf16 router, an F32 e_score_correction_bias (uniform +-0.05, so that the
 * biased selection differs from plain top-k), shared experts and the routed experts under
 * per-expert keys; n_group / topk_group, routed_scaling_factor and yarn RoPE in the config.
 * With --dtype fp8 every nn.Linear of its decoder layers is F8_E4M3 + F32 scale_inv.
 *
 * Qwen3-MoE --dtype fp8 writes the routed experts' projections as an FP8 checkpoint does
 * (DeepSeek-V3, Qwen3-*-FP8, transformers FineGrainedFP8): "...gate_proj.weight" F8_E4M3
 * [N, K] codes and "...gate_proj.weight_scale_inv" F32 [ceil(N/128), ceil(K/128)], the quantization of
 * the bf16 values the same seed gives (scale = amax / 448 per 128x128 block, e4m3 round to
 * nearest even, saturating), and config.json gets quantization_config {"quant_method":
 * "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}.
 * Everything else stays bf16 (embeddings, norms, router and lm_head are bf16 in the real
 * checkpoints too; their attention projections are fp8, Qwen3-MoE's here bf16, since the
 * servers only hold experts), listed in modules_to_not_convert.
 *
 * Determinism: every tensor draws from its own xoshiro256** stream seeded from (--seed,
 * tensor name), so a tensor's values do not depend on sharding, write order or the other
 * flags except its own shape.
 *
 * Memory stays bounded whatever the model size: tensors are declared lazily and their bytes
 * are generated into the writer's 4 MiB output buffer as the file is written
 * (mr__st_writer_write_fill), one shard at a time; an fp8 weight is generated and quantized
 * one 128-row strip (one row of 128x128 blocks) at a time.
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

typedef enum mk_arch { MK_QWEN3_MOE = 0, MK_DEEPSEEK_V3 } mk_arch;

typedef struct mk_args {
  mk_arch arch;       /* --arch */
  uint32_t layers, experts, topk, hidden, inter, vocab, heads, kv_heads, head_dim;
  uint64_t seed;
  uint64_t shard_mb;
  double router_skew; /* --router-skew S: 0 = plain random routers */
  double expert_scale; /* --expert-scale S: routed experts' weights times S (1 = as drawn) */
  bool fp8;           /* --dtype fp8: experts (qwen) / every decoder Linear (deepseek) as F8_E4M3 */
  bool tie;           /* --tie 1: no lm_head, tie_word_embeddings true */
  /* --arch deepseek-v3 only (ds-shared.md): MLA widths, MoE shape, routing, RoPE. */
  uint32_t q_lora, kv_lora, nope, rope, vdim; /* q_lora 0 = q_proj, no low-rank query */
  uint32_t n_shared, dense_layers, dense_inter, groups, topk_groups;
  double routed_scale; /* routed_scaling_factor */
  double yarn;         /* rope_scaling yarn factor; 0 = default RoPE */
  bool norm_topk;      /* norm_topk_prob */
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

/* Tensor i of the model, in checkpoint order: embed, then the layers' tensors, then the
 * final norm and lm_head (absent with --tie 1). Qwen3-MoE has 9 + 3E tensors per layer
 * (9 + 6E with --dtype fp8); DeepSeek-V3's layers are listed by mk_ds_layer. Generated from
 * the index so no list is ever held. */
typedef struct mk_tensor {
  char name[160];
  uint32_t ndim;
  uint64_t shape[2];
  /* Values: 2-D weights are uniform with std 1/sqrt(fan_in) (fan_in = shape[1]) so that
   * activations stay O(1) through the layers; the embedding has std 1; 1-D tensors are
   * RMSNorm weights, 1 + uniform noise of +-0.05, or (MK_F32) DeepSeek's
   * e_score_correction_bias, uniform +-0.05 around 0. */
  float scale; /* half-width of the uniform distribution */
  bool norm;
  int64_t router_layer; /* the layer of a router (mlp.gate) tensor, else -1 */
  /* F8: e4m3 codes; SCALE: F32 scale_inv of an F8 weight; F32: plain F32 values */
  enum { MK_BF16 = 0, MK_F8, MK_SCALE, MK_F32 } kind;
  uint64_t src_rows, src_cols; /* F8 / SCALE: the shape of the quantized weight */
  char src_name[160];          /* F8 / SCALE: the weight's name (its rng stream) */
} mk_tensor;

static uint64_t mk_per_layer(const mk_args *a) { return 9 + (a->fp8 ? 6 : 3) * (uint64_t)a->experts; }

/* DeepSeek-V3: one tensor of a layer before its routed experts. LIN is an nn.Linear weight
 * (two tensors with --dtype fp8: codes and scale_inv), NORM an RMSNorm weight, ROUTER the
 * bf16 mlp.gate.weight, BIAS the F32 e_score_correction_bias. */
typedef struct mk_slot {
  const char *name; /* after "model.layers.L." */
  uint64_t rows, cols;
  enum { MK_SLOT_LIN, MK_SLOT_NORM, MK_SLOT_ROUTER, MK_SLOT_BIAS } kind;
} mk_slot;

#define MK_DS_MAX_SLOTS 16

/* The fixed (non-routed-expert) tensors of a DeepSeek-V3 layer, in the order
 * modeling_deepseek_v3.py declares them; returns their count. */
static uint32_t mk_ds_slots(const mk_args *a, bool moe, mk_slot *s) {
  const uint64_t H = a->hidden, nh = a->heads, qk = (uint64_t)a->nope + a->rope;
  uint32_t n = 0;
  s[n++] = (mk_slot){"input_layernorm.weight", H, 0, MK_SLOT_NORM};
  s[n++] = (mk_slot){"post_attention_layernorm.weight", H, 0, MK_SLOT_NORM};
  if (a->q_lora) {
    s[n++] = (mk_slot){"self_attn.q_a_proj.weight", a->q_lora, H, MK_SLOT_LIN};
    s[n++] = (mk_slot){"self_attn.q_a_layernorm.weight", a->q_lora, 0, MK_SLOT_NORM};
    s[n++] = (mk_slot){"self_attn.q_b_proj.weight", nh * qk, a->q_lora, MK_SLOT_LIN};
  } else {
    s[n++] = (mk_slot){"self_attn.q_proj.weight", nh * qk, H, MK_SLOT_LIN};
  }
  s[n++] = (mk_slot){"self_attn.kv_a_proj_with_mqa.weight", (uint64_t)a->kv_lora + a->rope, H,
                     MK_SLOT_LIN};
  s[n++] = (mk_slot){"self_attn.kv_a_layernorm.weight", a->kv_lora, 0, MK_SLOT_NORM};
  s[n++] = (mk_slot){"self_attn.kv_b_proj.weight", nh * ((uint64_t)a->nope + a->vdim), a->kv_lora,
                     MK_SLOT_LIN};
  s[n++] = (mk_slot){"self_attn.o_proj.weight", H, nh * a->vdim, MK_SLOT_LIN};
  if (!moe) {
    const uint64_t DI = a->dense_inter;
    s[n++] = (mk_slot){"mlp.gate_proj.weight", DI, H, MK_SLOT_LIN};
    s[n++] = (mk_slot){"mlp.up_proj.weight", DI, H, MK_SLOT_LIN};
    s[n++] = (mk_slot){"mlp.down_proj.weight", H, DI, MK_SLOT_LIN};
    return n;
  }
  s[n++] = (mk_slot){"mlp.gate.weight", a->experts, H, MK_SLOT_ROUTER};
  s[n++] = (mk_slot){"mlp.gate.e_score_correction_bias", a->experts, 0, MK_SLOT_BIAS};
  /* --shared-experts 0 writes them zero-wide ([0, H], [H, 0]): transformers' DeepseekV3MoE
   * always builds shared_experts, of width moe_intermediate_size x n_shared_experts. */
  const uint64_t SI = (uint64_t)a->inter * a->n_shared;
  s[n++] = (mk_slot){"mlp.shared_experts.gate_proj.weight", SI, H, MK_SLOT_LIN};
  s[n++] = (mk_slot){"mlp.shared_experts.up_proj.weight", SI, H, MK_SLOT_LIN};
  s[n++] = (mk_slot){"mlp.shared_experts.down_proj.weight", H, SI, MK_SLOT_LIN};
  MR_ASSERT(n <= MK_DS_MAX_SLOTS);
  return n;
}

/* Tensors per slot: a Linear is two with --dtype fp8 (codes + scale_inv). */
static uint64_t mk_ds_width(const mk_args *a, const mk_slot *s) {
  return a->fp8 && s->kind == MK_SLOT_LIN ? 2 : 1;
}

static uint64_t mk_ds_layer_count(const mk_args *a, bool moe) {
  mk_slot s[MK_DS_MAX_SLOTS];
  uint32_t ns = mk_ds_slots(a, moe, s);
  uint64_t n = 0;
  for (uint32_t k = 0; k < ns; k++) n += mk_ds_width(a, &s[k]);
  if (moe) n += (a->fp8 ? 6 : 3) * (uint64_t)a->experts;
  return n;
}

/* Layers 0..dense_layers-1 are dense (first_k_dense_replace), the rest MoE. */
static uint64_t mk_layers_count(const mk_args *a) {
  if (a->arch == MK_QWEN3_MOE) return (uint64_t)a->layers * mk_per_layer(a);
  uint64_t d = a->dense_layers;
  return d * mk_ds_layer_count(a, false) + (a->layers - d) * mk_ds_layer_count(a, true);
}

static uint64_t mk_tensor_count(const mk_args *a) {
  return 1 + mk_layers_count(a) + (a->tie ? 1 : 2);
}

static void mk_2d(mk_tensor *t, uint64_t rows, uint64_t cols) {
  t->ndim = 2;
  t->shape[0] = rows;
  t->shape[1] = cols;
  t->scale = cols ? (float)(sqrt(3.0) / sqrt((double)cols)) : 0.0f; /* [H, 0]: no values */
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

/* t (a 2-D bf16 weight, named) becomes part `sub` of its fp8 form: 0 = the F8_E4M3 codes
 * under the same name, 1 = "<name>_scale_inv", F32 [ceil(N/128), ceil(K/128)]. Both draw
 * from the weight's stream (src_name), so the codes quantize the bf16 model's values. */
static void mk_as_fp8(mk_tensor *t, uint64_t sub) {
  snprintf(t->src_name, sizeof t->src_name, "%s", t->name);
  t->src_rows = t->shape[0];
  t->src_cols = t->shape[1];
  if (sub == 0) {
    t->kind = MK_F8;
    return;
  }
  t->kind = MK_SCALE;
  /* Names are short (model.layers.L.mlp.experts.E.x_proj.weight); cut, never overrun. */
  int nl = snprintf(t->name, sizeof t->name, "%.140s_scale_inv", t->src_name);
  MR_ASSERT(nl > 0 && (size_t)nl < sizeof t->name);
  t->shape[0] = (t->src_rows + 127) / 128;
  t->shape[1] = (t->src_cols + 127) / 128;
}

/* Tensor k of DeepSeek-V3 layer l: the fixed slots (mk_ds_slots), then per routed expert
 * gate, up, down (each followed by its scale_inv with --dtype fp8). */
static void mk_ds_layer(const mk_args *a, uint64_t l, uint64_t k, mk_tensor *t) {
  const bool moe = l >= a->dense_layers;
  char pre[48];
  snprintf(pre, sizeof pre, "model.layers.%llu.", (unsigned long long)l);
  mk_slot s[MK_DS_MAX_SLOTS];
  uint32_t ns = mk_ds_slots(a, moe, s);
  for (uint32_t j = 0; j < ns; j++) {
    uint64_t w = mk_ds_width(a, &s[j]);
    if (k >= w) {
      k -= w;
      continue;
    }
    snprintf(t->name, sizeof t->name, "%s%s", pre, s[j].name);
    switch (s[j].kind) {
    case MK_SLOT_NORM: mk_1d(t, s[j].rows); break;
    case MK_SLOT_BIAS:
      mk_1d(t, s[j].rows);
      t->norm = false;
      t->kind = MK_F32;
      break;
    case MK_SLOT_ROUTER:
      mk_2d(t, s[j].rows, s[j].cols);
      t->router_layer = (int64_t)l;
      break;
    case MK_SLOT_LIN:
      mk_2d(t, s[j].rows, s[j].cols);
      if (a->fp8) mk_as_fp8(t, k);
      break;
    }
    return;
  }
  MR_ASSERT(moe);
  const uint64_t w = a->fp8 ? 2 : 1, e = k / (3 * w), p = k % (3 * w) / w;
  MR_ASSERT(e < a->experts);
  static const char *const proj[] = {"gate_proj", "up_proj", "down_proj"};
  snprintf(t->name, sizeof t->name, "%smlp.experts.%llu.%s.weight", pre, (unsigned long long)e,
           proj[p]);
  if (p == 2) mk_2d(t, a->hidden, a->inter);
  else mk_2d(t, a->inter, a->hidden);
  t->scale *= (float)a->expert_scale;
  if (a->fp8) mk_as_fp8(t, k % w);
}

/* Tensor k of Qwen3-MoE layer l. */
static void mk_qwen_layer(const mk_args *a, uint64_t l, uint64_t k, mk_tensor *t) {
  uint64_t H = a->hidden, I = a->inter, hd = a->head_dim;
  uint64_t q = (uint64_t)a->heads * hd, kv = (uint64_t)a->kv_heads * hd;
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
  t->scale *= (float)a->expert_scale; /* 1: the values drawn, bit for bit */
  if (a->fp8) mk_as_fp8(t, p < 3 ? 0 : 1); /* codes of the three, then their scales */
}

static void mk_tensor_get(const mk_args *a, uint64_t i, mk_tensor *t) {
  uint64_t n = mk_tensor_count(a), nl = mk_layers_count(a);
  MR_ASSERT(i < n);
  if (i == 0) {
    snprintf(t->name, sizeof t->name, "model.embed_tokens.weight");
    mk_2d(t, a->vocab, a->hidden);
    t->scale = (float)sqrt(3.0);
    return;
  }
  if (i == 1 + nl) {
    snprintf(t->name, sizeof t->name, "model.norm.weight");
    mk_1d(t, a->hidden);
    return;
  }
  if (i == 2 + nl) {
    snprintf(t->name, sizeof t->name, "lm_head.weight");
    mk_2d(t, a->vocab, a->hidden);
    return;
  }
  uint64_t j = i - 1;
  if (a->arch == MK_QWEN3_MOE) {
    mk_qwen_layer(a, j / mk_per_layer(a), j % mk_per_layer(a), t);
    return;
  }
  const uint64_t cd = mk_ds_layer_count(a, false), dense = (uint64_t)a->dense_layers * cd;
  if (j < dense) {
    mk_ds_layer(a, j / cd, j % cd, t);
  } else {
    const uint64_t cm = mk_ds_layer_count(a, true);
    mk_ds_layer(a, a->dense_layers + (j - dense) / cm, (j - dense) % cm, t);
  }
}

static uint64_t mk_tensor_bytes(const mk_tensor *t) {
  uint64_t n = t->kind == MK_F8 ? 1 : t->kind == MK_BF16 ? 2 : 4; /* e4m3, bf16, f32 */
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
  uint64_t draw;       /* the last draw of rng: elements 2j and 2j + 1 share draw j */
  float *row_scale;    /* [experts]: router skew of the current router tensor, or NULL */
  /* F8 / SCALE tensor being written: its weight is generated and quantized one 128-row
   * strip at a time (rows strip0 .. strip0 + strip_n - 1), so that memory stays at one
   * strip whatever the weight's size. */
  float *w8;           /* [128, K] the strip's bf16 values as fp32 */
  uint8_t *q8;         /* [128, K] its e4m3 codes */
  float *s8;           /* SCALE: every block scale [ceil(R/128), ceil(K/128)]; F8: the strip's */
  mk_rng qrng;         /* the weight's stream (src_name), after the strip */
  uint64_t qdraw;
  uint64_t strip0, strip_n;
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

/* The uniform in [0, 1) of element i of a stream, called for i = 0, 1, 2, ... in order: two
 * 24-bit uniforms per draw (bits 63..40 for even i, 39..16 for odd i), so that a tensor's
 * values do not depend on where the writer's buffer or a strip splits it. */
static inline float mk_stream_u(mk_rng *r, uint64_t *draw, uint64_t i) {
  const float inv24 = 1.0f / 16777216.0f;
  if (i % 2 == 0) {
    *draw = mk_rng_next(r);
    return (float)(*draw >> 40) * inv24;
  }
  return (float)((*draw >> 16) & 0xffffffu) * inv24;
}

static inline float mk_fill_u(mk_fill_ctx *c, uint64_t i) { return mk_stream_u(&c->rng, &c->draw, i); }

/* The next 128-row strip of the fp8 weight of t: its bf16 values (as mk_fill draws them for
 * the bf16 model, through fp32) and their block quantization into c->q8 and `scales`
 * (ceil(K/128) of them). */
static void mk_fp8_strip(mk_fill_ctx *c, const mk_tensor *t, float *scales) {
  const uint64_t R = t->src_rows, K = t->src_cols, r0 = c->strip0 + c->strip_n;
  const uint64_t rows = R - r0 < 128 ? R - r0 : 128;
  MR_ASSERT(r0 < R);
  const float sc = (float)(sqrt(3.0) / sqrt((double)K));
  for (uint64_t j = 0; j < rows * K; j++) {
    float u = mk_stream_u(&c->qrng, &c->qdraw, r0 * K + j);
    c->w8[j] = mr_bf16_to_f32(mr_f32_to_bf16(sc * (2.0f * u - 1.0f)));
  }
  mr_f8e4m3_quantize_rows(c->w8, (uint32_t)rows, (uint32_t)K, c->q8, scales);
  c->strip0 = r0;
  c->strip_n = rows;
}

/* Starts the F8 codes or the SCALE tensor t of an fp8 weight: the strip buffers, the
 * weight's stream; for SCALE every strip is generated now (the scales are small, the
 * codes are dropped). */
static int mk_fp8_begin(mk_fill_ctx *c, const mk_tensor *t) {
  const uint64_t R = t->src_rows, K = t->src_cols, nkb = (K + 127) / 128;
  mr_free(c->w8);
  mr_free(c->q8);
  mr_free(c->s8);
  c->w8 = mr_malloc((size_t)(128 * K) * sizeof(float));
  c->q8 = mr_malloc((size_t)(128 * K));
  c->s8 = mr_malloc((size_t)(t->kind == MK_SCALE ? (R + 127) / 128 * nkb : nkb) * sizeof(float));
  if (!c->w8 || !c->q8 || !c->s8) return MR_ENOMEM;
  mk_rng_seed(&c->qrng, c->a->seed, t->src_name);
  c->strip0 = c->strip_n = 0;
  if (t->kind == MK_SCALE)
    for (uint64_t r0 = 0; r0 < R; r0 += 128) mk_fp8_strip(c, t, c->s8 + (r0 / 128) * nkb);
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
    if (c->t.kind == MK_F8 || c->t.kind == MK_SCALE) {
      int rc = mk_fp8_begin(c, &c->t);
      if (rc) return rc;
    }
  }
  if (c->t.kind == MK_SCALE) {
    memcpy(dst, (const char *)c->s8 + offset, n);
  } else if (c->t.kind == MK_F8) { /* codes, strip by strip as the offsets advance */
    MR_ASSERT(offset == c->next_off);
    const uint64_t K = c->t.src_cols;
    for (size_t done = 0; done < n;) {
      uint64_t off = offset + done;
      if (off >= (c->strip0 + c->strip_n) * K) mk_fp8_strip(c, &c->t, c->s8);
      uint64_t end = (c->strip0 + c->strip_n) * K;
      size_t k = n - done < end - off ? n - done : (size_t)(end - off);
      memcpy((uint8_t *)dst + done, c->q8 + (off - c->strip0 * K), k);
      done += k;
    }
  }
  if (c->t.kind == MK_F8 || c->t.kind == MK_SCALE) {
    c->next_off += n;
    c->bytes_done += n;
    if (c->next_off == mk_tensor_bytes(&c->t)) c->tensors_done++;
    mk_progress(c, false);
    return 0;
  }
  const size_t es = c->t.kind == MK_F32 ? 4 : 2;
  MR_ASSERT(offset == c->next_off && n % es == 0);
  const size_t count = n / es;
  const float scale = c->t.scale, base = c->t.norm ? 1.0f : 0.0f;
  const float *rs = c->t.router_layer >= 0 ? c->row_scale : NULL;
  const uint64_t e0 = offset / es, cols = c->t.ndim == 2 ? c->t.shape[1] : 1;
  for (size_t i = 0; i < count; i++) {
    float s = rs ? scale * rs[(e0 + i) / cols] : scale;
    float v = base + s * (2.0f * mk_fill_u(c, e0 + i) - 1.0f);
    if (es == 4) ((float *)dst)[i] = v;
    else ((uint16_t *)dst)[i] = mr_f32_to_bf16(v);
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

/* original_max_position_embeddings of a yarn factor: the context the model was trained on,
 * max_position / factor rounded (at least 1). */
static uint32_t mk_yarn_original(double factor, uint32_t max_pos) {
  double o = floor((double)max_pos / factor + 0.5);
  return o < 1 ? 1u : (uint32_t)o;
}

/* x as a JSON number that reads back as a float: shortest exact form, with ".0" when it
 * would look like an integer (transformers' strict config dataclasses refuse an int for a
 * float field such as routed_scaling_factor). */
static const char *mk_json_float(char buf[40], double x) {
  const bool plain = fabs(x) >= 1e-4 && fabs(x) < 1e15; /* the flags' ranges: always */
  snprintf(buf, 40, "%.17g", x);
  for (int p = plain ? 0 : 1; p <= 17; p++) { /* the shortest form that reads back exactly */
    char t[40];
    snprintf(t, sizeof t, plain ? "%.*f" : "%.*g", p, x);
    if (strtod(t, NULL) == x) {
      snprintf(buf, 40, "%s", t);
      break;
    }
  }
  if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
  return buf;
}

/* DeepSeek-V3's config.json, as the released checkpoints write it (rope_theta and
 * rope_scaling at the top level, "type": "yarn"), with this model's shape. */
static int mk_config_ds(const mk_args *a, mk_buf *b) {
  char qlora[24] = "null", rope[512] = "null", quant[512] = "", skew[80] = "";
  char f1[40], f2[40];
  uint32_t max_pos = 4096;
  if (a->q_lora) snprintf(qlora, sizeof qlora, "%u", a->q_lora);
  if (a->yarn > 0)
    snprintf(rope, sizeof rope,
             "{\"type\": \"yarn\", \"factor\": %s, \"beta_fast\": 32, \"beta_slow\": 1, "
             "\"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": %u}",
             mk_json_float(f1, a->yarn), mk_yarn_original(a->yarn, max_pos));
  if (a->router_skew > 0)
    snprintf(skew, sizeof skew, ",\n  \"moerpc_router_skew\": %s", mk_json_float(f2, a->router_skew));
  /* Every decoder Linear is fp8; the router (mlp.gate, an nn.Parameter in transformers, a
   * boundary match that leaves mlp.gate_proj converted), embeddings and lm_head are not. */
  if (a->fp8)
    snprintf(quant, sizeof quant,
             ",\n  \"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
             "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, 128], "
             "\"modules_to_not_convert\": [\"lm_head\", \"model.embed_tokens\", \"mlp.gate\"]}");
  return mk_printf(
      b,
      "{\n"
      "  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n"
      "  \"model_type\": \"deepseek_v3\",\n"
      "  \"attention_bias\": false,\n"
      "  \"attention_dropout\": 0.0,\n"
      "  \"bos_token_id\": %u,\n"
      "  \"eos_token_id\": %u,\n"
      "  \"first_k_dense_replace\": %u,\n"
      "  \"hidden_act\": \"silu\",\n"
      "  \"hidden_size\": %u,\n"
      "  \"initializer_range\": 0.02,\n"
      "  \"intermediate_size\": %u,\n"
      "  \"kv_lora_rank\": %u,\n"
      "  \"max_position_embeddings\": %u,\n"
      "  \"moe_intermediate_size\": %u,\n"
      "  \"moe_layer_freq\": 1,\n"
      "  \"n_group\": %u,\n"
      "  \"n_routed_experts\": %u,\n"
      "  \"n_shared_experts\": %u,\n"
      "  \"norm_topk_prob\": %s,\n"
      "  \"num_attention_heads\": %u,\n"
      "  \"num_experts_per_tok\": %u,\n"
      "  \"num_hidden_layers\": %u,\n"
      "  \"num_key_value_heads\": %u,\n"
      "  \"num_nextn_predict_layers\": 0,\n"
      "  \"q_lora_rank\": %s,\n"
      "  \"qk_nope_head_dim\": %u,\n"
      "  \"qk_rope_head_dim\": %u,\n"
      "  \"rms_norm_eps\": 1e-06,\n"
      "  \"rope_interleave\": true,\n"
      "  \"rope_scaling\": %s,\n"
      "  \"rope_theta\": 10000.0,\n"
      "  \"routed_scaling_factor\": %s,\n"
      "  \"scoring_func\": \"sigmoid\",\n"
      "  \"tie_word_embeddings\": %s,\n"
      "  \"topk_group\": %u,\n"
      "  \"topk_method\": \"noaux_tc\",\n"
      "  \"torch_dtype\": \"bfloat16\",\n"
      "  \"transformers_version\": \"4.51.0\",\n"
      "  \"use_cache\": true,\n"
      "  \"v_head_dim\": %u,\n"
      "  \"vocab_size\": %u,\n"
      "  \"moerpc_seed\": %llu%s%s\n"
      "}\n",
      a->vocab > 1 ? 1u : 0u, a->vocab > 2 ? 2u : 0u, a->dense_layers, a->hidden, a->dense_inter,
      a->kv_lora, max_pos, a->inter, a->groups, a->experts, a->n_shared,
      a->norm_topk ? "true" : "false", a->heads, a->topk, a->layers, a->heads, qlora, a->nope,
      a->rope, rope, mk_json_float(f1, a->routed_scale), a->tie ? "true" : "false",
      a->topk_groups, a->vdim,
      a->vocab, (unsigned long long)a->seed, skew, quant);
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
  int rc;
  if (a->arch == MK_DEEPSEEK_V3) rc = mk_config_ds(a, &b);
  else rc = mk_printf(
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
      "  \"tie_word_embeddings\": %s,\n"
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
      a->kv_heads, a->tie ? "true" : "false", a->vocab, (unsigned long long)a->seed, skew);
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

/* ---- a tokenizer for the random model ------------------------------------------------------
 *
 * So that text goes end to end (`generate --chat`, `serve`), a model gets a small byte-level
 * BPE tokenizer in the layout of Qwen2/Qwen3's (NFC, the Split regex + ByteLevel
 * pre-tokenizer, ByteLevel decoder; tokenizer.json version 1.0), a tokenizer_config.json
 * with ChatML special tokens and a chat template, and a generation_config.json naming the
 * stop ids. Ids: 0..255 the 256 byte symbols, then one token per merge, three special
 * tokens last (<|endoftext|>, <|im_start|>, <|im_end|>). The merges spell common English
 * words with their leading space (the ByteLevel "G-dot" symbol), left to right, until the
 * vocabulary is full: real tokenizers merge by corpus frequency, this one only has to be
 * valid, deterministic, and read the same by the tokenizers package and by moerpc. The
 * weights are random, so the model's text is nonsense whatever the tokenizer. */

static const char *const mk_words[] = {
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "what", "up", "out",
    "about", "into", "than", "them", "time", "only", "could", "new", "some", "other", "these",
    "may", "like", "then", "first", "any", "now", "such", "over", "model", "expert", "server",
    "token", "layer", "hello", "world", "question", "answer", "because", "where", "how", "why",
    "people", "water", "number", "system", "between", "under", "never", "after", "before",
    "while", "through", "work", "make", "good", "well", "very", "also", "just", "know", "see"};

/* GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + n. */
static uint32_t mk_byte_char(uint8_t b) {
  if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae) return b;
  uint32_t n = 0;
  for (uint32_t c = 0; c < b; c++)
    if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || c >= 0xae)) n++;
  return 256 + n;
}

/* Appends code point cp as UTF-8, JSON-escaped where it must be. */
static int mk_put_cp(mk_buf *b, uint32_t cp) {
  if (cp == '"' || cp == '\\') return mk_printf(b, "\\%c", (char)cp);
  if (cp < 0x80) return mk_printf(b, "%c", (char)cp);
  if (cp < 0x800) return mk_printf(b, "%c%c", (char)(0xc0 | cp >> 6), (char)(0x80 | (cp & 0x3f)));
  return mk_printf(b, "%c%c%c", (char)(0xe0 | cp >> 12), (char)(0x80 | (cp >> 6 & 0x3f)), (char)(0x80 | (cp & 0x3f)));
}

/* A token: up to 32 bytes (before the byte-to-symbol mapping). */
typedef struct mk_tok {
  uint8_t b[32];
  uint8_t n;
} mk_tok;

static int mk_put_tok(mk_buf *b, const mk_tok *t) {
  for (uint32_t i = 0; i < t->n; i++) {
    int rc = mk_put_cp(b, mk_byte_char(t->b[i]));
    if (rc) return rc;
  }
  return 0;
}

static int32_t mk_tok_find(const mk_tok *v, uint32_t n, const uint8_t *bytes, uint32_t len) {
  for (uint32_t i = 0; i < n; i++)
    if (v[i].n == len && memcmp(v[i].b, bytes, len) == 0) return (int32_t)i;
  return -1;
}

/* The ChatML template of the random model (a Qwen-style subset: roles, system, the
 * assistant's turn on add_generation_prompt). */
static const char mk_chat_template[] =
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

/* The Qwen2 pre-tokenizer pattern, as tokenizer.json writes it (JSON-escaped). */
static const char mk_qwen_regex[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|"
    "\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+";

static int mk_write_tokenizer(const mk_args *a, mr_err *e) {
  static const char *const special[3] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  if (a->vocab < 256 + 3) {
    mr_log(MR_LOG_INFO, "no tokenizer: --vocab %u leaves no room for 256 byte tokens and 3 special ones",
           a->vocab);
    return 0;
  }
  const uint32_t n_merge_max = a->vocab - 256 - 3 < 4096 ? a->vocab - 256 - 3 : 4096;
  mk_tok *v = mr_calloc(256 + n_merge_max, sizeof *v);
  int32_t (*merges)[2] = mr_calloc(n_merge_max ? n_merge_max : 1, sizeof *merges);
  mk_buf b = {0};
  char path[4096];
  int rc = 0;
  if (!v || !merges) {
    rc = mr_err_set(e, MR_ENOMEM, "tokenizer: out of memory");
    goto out;
  }
  for (uint32_t i = 0; i < 256; i++) v[i] = (mk_tok){{(uint8_t)i}, 1};
  uint32_t n = 256, n_merges = 0;
  for (size_t w = 0; w < sizeof mk_words / sizeof mk_words[0] && n_merges < n_merge_max; w++) {
    uint8_t word[32];
    uint32_t len = 0;
    word[len++] = ' ';
    for (const char *c = mk_words[w]; *c && len < sizeof word; c++) word[len++] = (uint8_t)*c;
    int32_t left = word[0];
    for (uint32_t k = 2; k <= len && n_merges < n_merge_max; k++) {
      int32_t have = mk_tok_find(v, n, word, k);
      if (have < 0) {
        v[n].n = (uint8_t)k;
        memcpy(v[n].b, word, k);
        merges[n_merges][0] = left;
        merges[n_merges][1] = word[k - 1];
        n_merges++;
        have = (int32_t)n++;
      }
      left = have;
    }
  }
  const uint32_t sp0 = a->vocab - 3; /* the special tokens take the last ids */
  /* tokenizer.json */
  rc = mk_printf(&b, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [");
  for (int i = 0; !rc && i < 3; i++)
    rc = mk_printf(&b, "%s\n    {\"id\": %u, \"content\": \"%s\", \"single_word\": false, \"lstrip\": false, "
                   "\"rstrip\": false, \"normalized\": false, \"special\": true}", i ? "," : "", sp0 + i, special[i]);
  if (!rc)
    rc = mk_printf(&b, "\n  ],\n  \"normalizer\": {\"type\": \"NFC\"},\n"
                   "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [\n"
                   "    {\"type\": \"Split\", \"pattern\": {\"Regex\": \"%s\"}, \"behavior\": \"Isolated\", \"invert\": false},\n"
                   "    {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false}]},\n"
                   "  \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false},\n"
                   "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false},\n"
                   "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": \"\", "
                   "\"end_of_word_suffix\": \"\", \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n"
                   "    \"vocab\": {", mk_qwen_regex);
  for (uint32_t i = 0; !rc && i < n; i++) {
    rc = mk_printf(&b, "%s\"", i ? ", " : "");
    if (!rc) rc = mk_put_tok(&b, &v[i]);
    if (!rc) rc = mk_printf(&b, "\": %u", i);
  }
  /* ids between the merges and the special tokens: unreachable placeholders, so that the
   * vocabulary covers every id of the model's embedding */
  for (uint32_t i = n; !rc && i < sp0; i++) rc = mk_printf(&b, ", \"<|reserved_%u|>\": %u", i, i);
  if (!rc) rc = mk_printf(&b, "},\n    \"merges\": [");
  for (uint32_t i = 0; !rc && i < n_merges; i++) {
    rc = mk_printf(&b, "%s\"", i ? ", " : "");
    if (!rc) rc = mk_put_tok(&b, &v[merges[i][0]]);
    if (!rc) rc = mk_printf(&b, " ");
    if (!rc) rc = mk_put_tok(&b, &v[merges[i][1]]);
    if (!rc) rc = mk_printf(&b, "\"");
  }
  if (!rc) rc = mk_printf(&b, "]\n  }\n}\n");
  if (rc) {
    rc = mr_err_set(e, rc, "tokenizer.json: out of memory");
    goto out;
  }
  if (mr__path_join(path, sizeof path, a->out, "tokenizer.json") != 0) {
    rc = mr_err_set(e, MR_ERANGE, "%s: path too long", a->out);
    goto out;
  }
  if ((rc = mk_write_text(path, b.s, b.len, e))) goto out;
  /* tokenizer_config.json: the special tokens and the chat template */
  b.len = 0;
  rc = mk_printf(&b, "{\n  \"tokenizer_class\": \"Qwen2Tokenizer\",\n  \"bos_token\": null,\n"
                 "  \"eos_token\": \"<|im_end|>\",\n  \"pad_token\": \"<|endoftext|>\",\n"
                 "  \"model_max_length\": 4096,\n  \"added_tokens_decoder\": {");
  for (int i = 0; !rc && i < 3; i++)
    rc = mk_printf(&b, "%s\n    \"%u\": {\"content\": \"%s\", \"lstrip\": false, \"normalized\": false, "
                   "\"rstrip\": false, \"single_word\": false, \"special\": true}", i ? "," : "", sp0 + i, special[i]);
  if (!rc) rc = mk_printf(&b, "\n  },\n  \"chat_template\": \"");
  for (const char *c = mk_chat_template; !rc && *c; c++)
    rc = *c == '\n' ? mk_printf(&b, "\\n") : mk_put_cp(&b, (uint8_t)*c);
  if (!rc) rc = mk_printf(&b, "\"\n}\n");
  if (!rc && mr__path_join(path, sizeof path, a->out, "tokenizer_config.json") != 0)
    rc = mr_err_set(e, MR_ERANGE, "%s: path too long", a->out);
  if (!rc) rc = mk_write_text(path, b.s, b.len, e);
  if (rc) goto out;
  /* generation_config.json: the stop ids */
  b.len = 0;
  rc = mk_printf(&b, "{\n  \"eos_token_id\": [%u, %u],\n  \"pad_token_id\": %u,\n  \"do_sample\": false\n}\n",
                 sp0 + 2, sp0, sp0);
  if (!rc && mr__path_join(path, sizeof path, a->out, "generation_config.json") != 0)
    rc = mr_err_set(e, MR_ERANGE, "%s: path too long", a->out);
  if (!rc) rc = mk_write_text(path, b.s, b.len, e);
out:
  mr_free(v);
  mr_free(merges);
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
         "writing %s: %s, %u layers, %u experts (top-%u), hidden %u, inter %u, vocab %u, "
         "%llu tensors, %.3f GB in %u file(s), seed %llu",
         a->out, a->arch == MK_DEEPSEEK_V3 ? "deepseek-v3" : "qwen3-moe", a->layers, a->experts,
         a->topk, a->hidden, a->inter, a->vocab,
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
           : t.kind != MK_BF16 ? mr__st_writer_add_lazy(w, t.name, MR_DTYPE_F32, t.ndim, t.shape)
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
  if ((rc = mk_write_tokenizer(a, e))) goto out;
  if (total > (256u << 20)) mk_progress(&fc, true);
  mr_log(MR_LOG_INFO, "done: %s in %.1f s", a->out, (double)(mr_now_ns() - fc.t0_ns) / 1e9);
out:
  mr_st_writer_free(w);
  mr_free(fc.row_scale);
  mr_free(fc.w8);
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
          "Writes a random, deterministic MoE checkpoint (config.json + bf16 safetensors) in the\n"
          "Hugging Face layout: Qwen3-MoE, or DeepSeek-V3 (--arch deepseek-v3).\n"
          "\n"
          "  --out DIR        output directory (created if missing)          required\n"
          "  --arch A         qwen3-moe or deepseek-v3                        default qwen3-moe\n"
          "  --layers N       decoder layers, 1..%u                        default 4\n"
          "  --experts N      routed experts per layer, 1..65536              default 16\n"
          "  --topk N         experts per token, 1..--experts                 default 4\n"
          "  --hidden N       hidden size, 1..65536                           default 256\n"
          "  --inter N        expert intermediate size, 1..1048576            default 128\n"
          "  --vocab N        vocabulary size, 1..16777216                    default 512\n"
          "  --heads N        attention heads, 1..4096                        default 4\n"
          "  --kv-heads N     key/value heads, 1..--heads, dividing --heads   default 2\n"
          "                   (qwen3-moe only)\n"
          "  --head-dim N     head dimension, 1..4096 (qwen3-moe only)        default 64\n"
          "  --tie 0|1        1: no lm_head, tie_word_embeddings true         default 0\n"
          "  --seed N         PRNG seed, 0..2^64-1                            default 1\n"
          "  --shard-mb N     shard into files of at most N MiB of tensor data when the\n"
          "                   model is larger, 0..1048576; 0 = auto: 2 GiB     default 0\n"
          "  --router-skew S  popular experts: router row e of a layer is scaled by\n"
          "                   (1 + rank)^-S, ranks a per-layer permutation, 0..8   default 0\n"
          "  --expert-scale S the routed experts' gate, up and down weights times S, > 0 and\n"
          "                   <= 1e6 (an expert's output grows as S^3: models whose outputs\n"
          "                   overflow f16, for the finite-check tests)         default 1\n"
          "  --dtype D        bf16, or fp8: F8_E4M3 weights with F32 128x128 block scales\n"
          "                   (weight_scale_inv) and quantization_config fp8; qwen3-moe: the\n"
          "                   routed experts, deepseek-v3: every Linear of the decoder layers\n"
          "                   (attention, dense MLP, shared and routed experts); routers,\n"
          "                   embeddings, norms and lm_head stay bf16           default bf16\n"
          "\n"
          "deepseek-v3 only (MLA attention, grouped sigmoid routing; num_key_value_heads =\n"
          "--heads):\n"
          "  --q-lora-rank N    q_lora_rank, 0..65536; 0 = q_proj, no low-rank query  default 48\n"
          "  --kv-lora-rank N   kv_lora_rank, 1..65536                        default 32\n"
          "  --qk-nope-dim N    qk_nope_head_dim, 1..4096                     default 16\n"
          "  --qk-rope-dim N    qk_rope_head_dim, even, 2..4096 (nope + rope <= 4096)  default 8\n"
          "  --v-head-dim N     v_head_dim, 1..4096                           default 16\n"
          "  --shared-experts N n_shared_experts, 0..16 (width N x --inter)   default 1\n"
          "  --dense-layers N   first_k_dense_replace, 0..--layers - 1        default 1\n"
          "                     (0 with --layers 1)\n"
          "  --dense-inter N    intermediate_size of the dense layers, 1..1048576\n"
          "                                                                   default 2 x --inter\n"
          "  --groups N         n_group, dividing --experts, at least 2 experts per group\n"
          "                                                                   default 1\n"
          "  --topk-groups N    topk_group, 1..--groups; --topk must fit in the kept groups\n"
          "                     (topk_group x experts / n_group)              default --groups\n"
          "  --routed-scale S   routed_scaling_factor, (0..1000]              default 2.5\n"
          "  --yarn F           0 = default RoPE; else rope_scaling yarn of factor F in 1..1024\n"
          "                     (beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1,\n"
          "                     original_max_position_embeddings 4096 / F rounded)  default 0\n"
          "  --norm-topk 0|1    norm_topk_prob                                default 1\n"
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

/* The limits between DeepSeek-V3's flags, and the defaults that depend on others. Returns 0
 * or 2 (printed). */
static int mk_parse_ds(mk_args *a, bool dense_given, bool dinter_given, bool tkg_given) {
  if (a->rope % 2 != 0) {
    fprintf(stderr, "moerpc-mkmodel: --qk-rope-dim = %u, must be even (RoPE rotates pairs)\n",
            a->rope);
    return 2;
  }
  if (!dense_given) a->dense_layers = a->layers > 1 ? 1 : 0;
  if (a->dense_layers > a->layers - 1) {
    fprintf(stderr, "moerpc-mkmodel: --dense-layers = %u, must be in 0..--layers - 1 (%u): at "
            "least one layer has experts\n", a->dense_layers, a->layers - 1);
    return 2;
  }
  if (!dinter_given) a->dense_inter = a->inter <= (1u << 19) ? 2 * a->inter : 1u << 20;
  if ((uint64_t)a->nope + a->rope > 4096) {
    fprintf(stderr, "moerpc-mkmodel: --qk-nope-dim + --qk-rope-dim = %u + %u, at most 4096\n",
            a->nope, a->rope);
    return 2;
  }
  if (a->experts % a->groups != 0) {
    fprintf(stderr, "moerpc-mkmodel: --groups = %u, must divide --experts (%u)\n", a->groups,
            a->experts);
    return 2;
  }
  /* transformers scores a group by the sum of its two best experts (topk(2)). */
  if (a->experts / a->groups < 2) {
    fprintf(stderr, "moerpc-mkmodel: --experts / --groups = %u / %u, must be at least 2 (a "
            "group's score is the sum of its top-2 experts)\n", a->experts, a->groups);
    return 2;
  }
  if (!tkg_given) a->topk_groups = a->groups;
  if (a->topk_groups > a->groups) {
    fprintf(stderr, "moerpc-mkmodel: --topk-groups = %u, must be in 1..--groups (%u)\n",
            a->topk_groups, a->groups);
    return 2;
  }
  uint64_t kept = (uint64_t)a->topk_groups * (a->experts / a->groups);
  if (a->topk > kept) {
    fprintf(stderr, "moerpc-mkmodel: --topk = %u, more than the %llu experts of the "
            "--topk-groups (%u) kept groups of --experts / --groups (%u) each\n", a->topk,
            (unsigned long long)kept, a->topk_groups, a->experts / a->groups);
    return 2;
  }
  return 0;
}

/* Parses a number x for flag with lo < x <= hi (lo_open) or lo <= x <= hi; prints the
 * error and returns false. */
static bool mk_real(const char *flag, const char *v, double lo, bool lo_open, double hi,
                    double *out) {
  char *end = NULL;
  errno = 0;
  double x = strtod(v, &end);
  if (!v[0] || *end || errno || !(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    if (lo_open)
      fprintf(stderr, "moerpc-mkmodel: %s \"%s\": must be a number > %g and <= %g\n", flag, v, lo,
              hi);
    else
      fprintf(stderr, "moerpc-mkmodel: %s \"%s\": must be a number in %g..%g\n", flag, v, lo, hi);
    return false;
  }
  *out = x;
  return true;
}

/* Returns 0 to run, 1 after --help, 2 on a usage error (printed). */
static int mk_parse(int argc, char **argv, mk_args *a) {
  *a = (mk_args){.layers = 4, .experts = 16, .topk = 4, .hidden = 256, .inter = 128,
                 .vocab = 512, .heads = 4, .kv_heads = 2, .head_dim = 64, .seed = 1,
                 .q_lora = 48, .kv_lora = 32, .nope = 16, .rope = 8, .vdim = 16, .n_shared = 1,
                 .groups = 1, .routed_scale = 2.5, .norm_topk = true, .expert_scale = 1.0};
  enum { MK_ANY, MK_QWEN_ONLY, MK_DS_ONLY };
  static const struct {
    const char *flag;
    uint64_t lo, hi;
    size_t off; /* offsetof the uint32_t field */
    int only;   /* the --arch it applies to */
  } nums[] = {
      {"--layers", 1, MR_MAX_LAYERS, offsetof(mk_args, layers), MK_ANY},
      {"--experts", 1, 65536, offsetof(mk_args, experts), MK_ANY},
      {"--topk", 1, 65536, offsetof(mk_args, topk), MK_ANY},
      {"--hidden", 1, 65536, offsetof(mk_args, hidden), MK_ANY},
      {"--inter", 1, 1u << 20, offsetof(mk_args, inter), MK_ANY},
      {"--vocab", 1, 1u << 24, offsetof(mk_args, vocab), MK_ANY},
      {"--heads", 1, 4096, offsetof(mk_args, heads), MK_ANY},
      {"--kv-heads", 1, 4096, offsetof(mk_args, kv_heads), MK_QWEN_ONLY},
      {"--head-dim", 1, 4096, offsetof(mk_args, head_dim), MK_QWEN_ONLY},
      {"--q-lora-rank", 0, 65536, offsetof(mk_args, q_lora), MK_DS_ONLY},
      {"--kv-lora-rank", 1, 65536, offsetof(mk_args, kv_lora), MK_DS_ONLY},
      {"--qk-nope-dim", 1, 4096, offsetof(mk_args, nope), MK_DS_ONLY},
      {"--qk-rope-dim", 2, 4096, offsetof(mk_args, rope), MK_DS_ONLY},
      {"--v-head-dim", 1, 4096, offsetof(mk_args, vdim), MK_DS_ONLY},
      {"--shared-experts", 0, 16, offsetof(mk_args, n_shared), MK_DS_ONLY},
      {"--dense-layers", 0, MR_MAX_LAYERS - 1, offsetof(mk_args, dense_layers), MK_DS_ONLY},
      {"--dense-inter", 1, 1u << 20, offsetof(mk_args, dense_inter), MK_DS_ONLY},
      {"--groups", 1, 65536, offsetof(mk_args, groups), MK_DS_ONLY},
      {"--topk-groups", 1, 65536, offsetof(mk_args, topk_groups), MK_DS_ONLY},
  };
  enum { MK_NUMS = sizeof nums / sizeof nums[0] };
  /* Flags that are not in nums: their arch, and whether they were given. */
  static const struct {
    const char *flag;
    int only;
  } others[] = {{"--out", MK_ANY},          {"--seed", MK_ANY},       {"--shard-mb", MK_ANY},
                {"--router-skew", MK_ANY},  {"--dtype", MK_ANY},      {"--arch", MK_ANY},
                {"--tie", MK_ANY},          {"--routed-scale", MK_DS_ONLY},
                {"--expert-scale", MK_ANY},
                {"--yarn", MK_DS_ONLY},     {"--norm-topk", MK_DS_ONLY}};
  enum { MK_OTHERS = sizeof others / sizeof others[0] };
  bool given[MK_NUMS + MK_OTHERS] = {0};
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
    int which = -1;
    for (size_t k = 0; k < MK_NUMS; k++)
      if (strcmp(flag, nums[k].flag) == 0) which = (int)k;
    for (size_t k = 0; k < MK_OTHERS; k++)
      if (strcmp(flag, others[k].flag) == 0) which = (int)(MK_NUMS + k);
    if (which < 0 || strncmp(arg, "--", 2) != 0) {
      fprintf(stderr, "moerpc-mkmodel: unknown argument \"%s\" (see --help)\n", arg);
      return 2;
    }
    given[which] = true;
    if (!val) {
      if (i + 1 >= argc) {
        fprintf(stderr, "moerpc-mkmodel: %s needs a value (see --help)\n", flag);
        return 2;
      }
      val = argv[++i];
    }
    uint64_t x;
    if (which < (int)MK_NUMS) {
      if (!mk_num(flag, val, nums[which].lo, nums[which].hi, &x)) return 2;
      *(uint32_t *)((char *)a + nums[which].off) = (uint32_t)x;
    } else if (strcmp(flag, "--out") == 0) {
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
    } else if (strcmp(flag, "--expert-scale") == 0) {
      if (!mk_real(flag, val, 0.0, true, 1e6, &a->expert_scale)) return 2;
    } else if (strcmp(flag, "--routed-scale") == 0) {
      if (!mk_real(flag, val, 0.0, true, 1000.0, &a->routed_scale)) return 2;
    } else if (strcmp(flag, "--yarn") == 0) {
      if (!mk_real(flag, val, 0.0, false, 1024.0, &a->yarn)) return 2;
      if (a->yarn > 0 && a->yarn < 1.0) {
        fprintf(stderr, "moerpc-mkmodel: --yarn \"%s\": must be 0 (default RoPE) or a factor "
                "in 1..1024\n", val);
        return 2;
      }
    } else if (strcmp(flag, "--dtype") == 0) {
      if (strcmp(val, "bf16") != 0 && strcmp(val, "fp8") != 0) {
        fprintf(stderr, "moerpc-mkmodel: --dtype \"%s\": must be bf16 or fp8\n", val);
        return 2;
      }
      a->fp8 = strcmp(val, "fp8") == 0;
    } else if (strcmp(flag, "--arch") == 0) {
      if (strcmp(val, "qwen3-moe") == 0) {
        a->arch = MK_QWEN3_MOE;
      } else if (strcmp(val, "deepseek-v3") == 0) {
        a->arch = MK_DEEPSEEK_V3;
      } else {
        fprintf(stderr, "moerpc-mkmodel: --arch \"%s\": must be qwen3-moe or deepseek-v3\n", val);
        return 2;
      }
    } else if (strcmp(flag, "--tie") == 0 || strcmp(flag, "--norm-topk") == 0) {
      if (!mk_num(flag, val, 0, 1, &x)) return 2;
      if (flag[2] == 't') a->tie = x;
      else a->norm_topk = x;
    } else if (strcmp(flag, "--shard-mb") == 0) {
      if (!mk_num(flag, val, 0, 1u << 20, &x)) return 2;
      a->shard_mb = x;
    } else {
      MR_ASSERT(!"flag in the tables but not handled");
    }
  }
  if (!a->out) {
    fprintf(stderr, "moerpc-mkmodel: --out DIR is required (see --help)\n");
    return 2;
  }
  /* Flags of the other architecture. */
  for (size_t k = 0; k < MK_NUMS + MK_OTHERS; k++) {
    int only = k < MK_NUMS ? nums[k].only : others[k - MK_NUMS].only;
    const char *f = k < MK_NUMS ? nums[k].flag : others[k - MK_NUMS].flag;
    if (!given[k]) continue;
    if (only == MK_DS_ONLY && a->arch != MK_DEEPSEEK_V3) {
      fprintf(stderr, "moerpc-mkmodel: %s applies to --arch deepseek-v3 only\n", f);
      return 2;
    }
    if (only == MK_QWEN_ONLY && a->arch == MK_DEEPSEEK_V3) {
      fprintf(stderr, "moerpc-mkmodel: %s does not apply to --arch deepseek-v3 (%s)\n", f,
              strcmp(f, "--head-dim") == 0
                  ? "query/key heads are --qk-nope-dim + --qk-rope-dim wide, values --v-head-dim"
                  : "num_key_value_heads = --heads");
      return 2;
    }
  }
  /* Limits between flags. */
  if (a->topk > a->experts) {
    fprintf(stderr, "moerpc-mkmodel: --topk = %u, must be in 1..--experts (%u)\n", a->topk,
            a->experts);
    return 2;
  }
  if (a->arch == MK_QWEN3_MOE && (a->kv_heads > a->heads || a->heads % a->kv_heads != 0)) {
    fprintf(stderr, "moerpc-mkmodel: --kv-heads = %u, must divide --heads (%u)\n", a->kv_heads,
            a->heads);
    return 2;
  }
  if ((uint64_t)a->layers * a->experts > MK_MAX_TOTAL_EXPERTS) {
    fprintf(stderr, "moerpc-mkmodel: --layers x --experts = %llu, at most %u\n",
            (unsigned long long)a->layers * a->experts, MK_MAX_TOTAL_EXPERTS);
    return 2;
  }
  if (a->arch != MK_DEEPSEEK_V3) return 0;
  bool g_dense = false, g_dinter = false, g_tkg = false;
  for (size_t k = 0; k < MK_NUMS; k++) {
    if (!given[k]) continue;
    if (strcmp(nums[k].flag, "--dense-layers") == 0) g_dense = true;
    if (strcmp(nums[k].flag, "--dense-inter") == 0) g_dinter = true;
    if (strcmp(nums[k].flag, "--topk-groups") == 0) g_tkg = true;
  }
  return mk_parse_ds(a, g_dense, g_dinter, g_tkg);
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
