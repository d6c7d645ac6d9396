/*
 * common/config.c - reader of a Hugging Face config.json for the MoE families we serve.
 *
 * What each family calls things (transformers' configuration_*.py):
 *
 *   field of mr_model_config | Qwen3-MoE / Qwen2-MoE      | Mixtral            | DeepSeek-V3 / V2
 *   -------------------------+----------------------------+--------------------+-----------------------
 *   num_experts              | num_experts                | num_local_experts  | n_routed_experts
 *   moe_intermediate         | moe_intermediate_size      | intermediate_size  | moe_intermediate_size
 *   dense_intermediate       | intermediate_size          | 0 (no dense MLPs)  | intermediate_size
 *   top_k                    | num_experts_per_tok        | num_experts_per_tok| num_experts_per_tok
 *   is_moe[l]                | l not in mlp_only_layers   | every layer        | l >= first_k_dense_replace
 *                            | && (l+1) % decoder_sparse_ |                    | && l % moe_layer_freq == 0
 *                            |    step == 0               |                    |
 *   norm_topk_prob           | norm_topk_prob (def false) | true (always)      | norm_topk_prob
 *   routed_scaling_factor    | 1                          | 1                  | routed_scaling_factor
 *   scoring / topk_method    | softmax / greedy           | softmax / greedy   | scoring_func / topk_method
 *                            |                            |                    | (V3: sigmoid / noaux_tc)
 *   n_group / topk_group     | 1 / 1                      | 1 / 1              | n_group / topk_group
 *   MLA, n_shared_experts    | -                          | -                  | q/kv_lora_rank, qk_*_head_dim,
 *                            |                            |                    | v_head_dim, n_shared_experts
 *
 * Every value is validated here, once, with a message naming the file, the field, the
 * value and the limit; nothing downstream re-checks ranges.
 */
#include "common/internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* Limits beyond every released model by a wide margin, but small enough that products of
 * them (H * I * 2 bytes per projection) cannot overflow 64 bits anywhere downstream. */
#define CFG_MAX_HIDDEN 65536u
#define CFG_MAX_EXPERTS 65536u
#define CFG_MAX_INTER (1u << 20)
#define CFG_MAX_VOCAB (1u << 24)
#define CFG_MAX_HEADS 4096u
#define CFG_MAX_HEAD_DIM 4096u

typedef struct cfg_ctx {
  const cJSON *root;
  const char *label;
  mr_err *e;
} cfg_ctx;

static const cJSON *cfg_get(const cfg_ctx *c, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(c->root, key);
  /* transformers writes absent optional values as null; treat them as absent. */
  return cJSON_IsNull(v) ? NULL : v;
}

/* Reads an unsigned integer field in lo..hi; absent -> *out = def, or an error if required. */
static int cfg_u32(const cfg_ctx *c, const char *key, bool required, uint32_t def, uint32_t lo,
                   uint32_t hi, uint32_t *out) {
  const cJSON *v = cfg_get(c, key);
  if (!v) {
    if (required)
      return mr_err_set(c->e, MR_EFORMAT, "%s: required field %s is missing (must be %u..%u)",
                        c->label, key, lo, hi);
    *out = def;
    return 0;
  }
  uint64_t x;
  int rc = mr__json_u64(v, c->label, key, lo, hi, &x, c->e);
  if (rc) return rc;
  *out = (uint32_t)x;
  return 0;
}

static int cfg_bool(const cfg_ctx *c, const char *key, bool def, bool *out) {
  const cJSON *v = cfg_get(c, key);
  if (!v) {
    *out = def;
    return 0;
  }
  if (!cJSON_IsBool(v)) {
    char desc[96];
    mr__json_describe(v, desc, sizeof desc);
    return mr_err_set(c->e, MR_EFORMAT, "%s: %s = %s, must be true or false", c->label, key,
                      desc);
  }
  *out = cJSON_IsTrue(v);
  return 0;
}

/* Reads a float field in (lo, hi] (lo exclusive, as for epsilons and scales). */
static int cfg_float(const cfg_ctx *c, const char *key, float def, double lo, double hi,
                     float *out) {
  const cJSON *v = cfg_get(c, key);
  if (!v) {
    *out = def;
    return 0;
  }
  if (!cJSON_IsNumber(v)) {
    char desc[96];
    mr__json_describe(v, desc, sizeof desc);
    return mr_err_set(c->e, MR_EFORMAT, "%s: %s = %s, must be a number in (%g, %g]", c->label,
                      key, desc, lo, hi);
  }
  double d = v->valuedouble;
  /* The check is on the float we keep: 1e-86 is > 0 as a double but 0 as a float. */
  float f = (float)d;
  if (!isfinite(d) || !(d > lo) || !(d <= hi) || !(f > (float)lo) || !isfinite(f))
    return mr_err_set(c->e, MR_ERANGE,
                      "%s: %s = %g, must be a number in (%g, %g] that a 32-bit float holds",
                      c->label, key, d, lo, hi);
  *out = f;
  return 0;
}

static const struct cfg_arch {
  const char *name;       /* architectures[0] */
  const char *model_type; /* fallback when architectures is absent */
  mr_arch arch;
} cfg_archs[] = {
    {"Qwen3MoeForCausalLM", "qwen3_moe", MR_ARCH_QWEN3_MOE},
    {"Qwen2MoeForCausalLM", "qwen2_moe", MR_ARCH_QWEN3_MOE},
    {"MixtralForCausalLM", "mixtral", MR_ARCH_MIXTRAL},
    {"DeepseekV3ForCausalLM", "deepseek_v3", MR_ARCH_DEEPSEEK_V3},
    {"DeepseekV2ForCausalLM", "deepseek_v2", MR_ARCH_DEEPSEEK_V3},
    {"DeepseekV3ForCausalLM", "kimi_k2", MR_ARCH_DEEPSEEK_V3},
};

static int cfg_arch(const cfg_ctx *c, mr_model_config *cfg) {
  const char *name = NULL;
  const cJSON *archs = cfg_get(c, "architectures");
  if (archs) {
    const cJSON *a0 = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
    if (!cJSON_IsString(a0)) {
      char desc[96];
      mr__json_describe(cJSON_IsArray(archs) ? a0 : archs, desc, sizeof desc);
      return mr_err_set(c->e, MR_EFORMAT,
                        "%s: architectures[0] = %s, must be a string such as "
                        "\"Qwen3MoeForCausalLM\"",
                        c->label, desc);
    }
    name = a0->valuestring;
    for (size_t i = 0; i < sizeof cfg_archs / sizeof cfg_archs[0]; i++)
      if (strcmp(name, cfg_archs[i].name) == 0) {
        cfg->arch = cfg_archs[i].arch;
        snprintf(cfg->arch_name, sizeof cfg->arch_name, "%s", cfg_archs[i].name);
        return 0;
      }
  } else {
    const cJSON *mt = cfg_get(c, "model_type");
    if (cJSON_IsString(mt)) {
      name = mt->valuestring;
      for (size_t i = 0; i < sizeof cfg_archs / sizeof cfg_archs[0]; i++)
        if (strcmp(name, cfg_archs[i].model_type) == 0) {
          cfg->arch = cfg_archs[i].arch;
          snprintf(cfg->arch_name, sizeof cfg->arch_name, "%s", cfg_archs[i].name);
          return 0;
        }
    }
  }
  if (!name)
    return mr_err_set(c->e, MR_EFORMAT,
                      "%s: required field architectures is missing (and no model_type)", c->label);
  return mr_err_set(c->e, MR_ENOTSUP,
                    "%s: architecture \"%.64s\" is not supported (supported: Qwen3MoeForCausalLM, "
                    "Qwen2MoeForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM, "
                    "DeepseekV2ForCausalLM)",
                    c->label, name);
}

/* yarn's parameters, from one rope_scaling / rope_parameters object (a later object
 * overrides the fields it has). 0 = absent for the optional ones. */
static int cfg_yarn_fields(const cfg_ctx *sub, mr_model_config *cfg) {
  int rc;
  if ((rc = cfg_float(sub, "factor", cfg->yarn_factor, 0.0, 1e6, &cfg->yarn_factor))) return rc;
  if ((rc = cfg_float(sub, "beta_fast", cfg->yarn_beta_fast, 0.0, 1e6, &cfg->yarn_beta_fast)))
    return rc;
  if ((rc = cfg_float(sub, "beta_slow", cfg->yarn_beta_slow, 0.0, 1e6, &cfg->yarn_beta_slow)))
    return rc;
  /* mscale and mscale_all_dim may be 0 (= absent, as transformers' truthiness test reads). */
  if ((rc = cfg_float(sub, "mscale", cfg->yarn_mscale, -1e-30, 1e6, &cfg->yarn_mscale))) return rc;
  if ((rc = cfg_float(sub, "mscale_all_dim", cfg->yarn_mscale_all_dim, -1e-30, 1e6,
                      &cfg->yarn_mscale_all_dim)))
    return rc;
  if ((rc = cfg_float(sub, "attention_factor", cfg->yarn_attention_factor, 0.0, 1e6,
                      &cfg->yarn_attention_factor)))
    return rc;
  if ((rc = cfg_u32(sub, "original_max_position_embeddings", false,
                    cfg->yarn_original_max_position, 1, UINT32_MAX,
                    &cfg->yarn_original_max_position)))
    return rc;
  return cfg_bool(sub, "truncate", cfg->yarn_truncate, &cfg->yarn_truncate);
}

static float cfg_yarn_get_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0f : (float)(0.1 * mscale * log(scale) + 1.0);
}

/* Completes yarn as transformers 5 does (_compute_yarn_parameters): the original length
 * defaults to max_position, the factor to max_position / original, attention_factor to
 * mscale / mscale_all_dim. What cannot be derived stays 0 (the runner refuses it; a server
 * does not need RoPE). */
static void cfg_yarn_finish(mr_model_config *cfg) {
  if (!cfg->yarn_original_max_position) cfg->yarn_original_max_position = cfg->max_position;
  if (!(cfg->yarn_factor > 0) && cfg->max_position && cfg->yarn_original_max_position)
    cfg->yarn_factor = (float)((double)cfg->max_position / cfg->yarn_original_max_position);
  if (!(cfg->yarn_beta_fast > 0)) cfg->yarn_beta_fast = 32;
  if (!(cfg->yarn_beta_slow > 0)) cfg->yarn_beta_slow = 1;
  if (!(cfg->yarn_attention_factor > 0) && cfg->yarn_factor > 0) {
    if (cfg->yarn_mscale != 0 && cfg->yarn_mscale_all_dim != 0)
      cfg->yarn_attention_factor = cfg_yarn_get_mscale(cfg->yarn_factor, cfg->yarn_mscale) /
                                   cfg_yarn_get_mscale(cfg->yarn_factor, cfg->yarn_mscale_all_dim);
    else
      cfg->yarn_attention_factor = cfg_yarn_get_mscale(cfg->yarn_factor, 1.0);
  }
}

/* The fields only a whole-model runner reads (attention, RoPE, head). transformers 5 moved
 * rope_theta and the scaling type into "rope_parameters"; 4.x writes "rope_theta" and
 * "rope_scaling" at the top level. Both are read; the nested value wins. */
static int cfg_runner(const cfg_ctx *c, mr_model_config *cfg) {
  int rc;
  float def_theta = cfg->arch == MR_ARCH_MIXTRAL ? 1e6f : 10000.0f;
  if ((rc = cfg_float(c, "rope_theta", def_theta, 0.0, 1e12, &cfg->rope_theta))) return rc;
  snprintf(cfg->rope_type, sizeof cfg->rope_type, "default");
  cfg->yarn_truncate = true;
  static const char *const rope_keys[] = {"rope_scaling", "rope_parameters"};
  for (int i = 0; i < 2; i++) {
    const cJSON *rp = cfg_get(c, rope_keys[i]);
    if (!rp) continue;
    if (!cJSON_IsObject(rp)) {
      char desc[96];
      mr__json_describe(rp, desc, sizeof desc);
      return mr_err_set(c->e, MR_EFORMAT, "%s: %s = %s, must be an object or null", c->label,
                        rope_keys[i], desc);
    }
    cfg_ctx sub = {.root = rp, .label = c->label, .e = c->e};
    if ((rc = cfg_float(&sub, "rope_theta", cfg->rope_theta, 0.0, 1e12, &cfg->rope_theta)))
      return mr_err_prefix(c->e, rc, "%s", rope_keys[i]);
    const cJSON *t = cfg_get(&sub, "rope_type");
    if (!t) t = cfg_get(&sub, "type");
    if (t) {
      if (!cJSON_IsString(t) || strlen(t->valuestring) >= sizeof cfg->rope_type) {
        char desc[96];
        mr__json_describe(t, desc, sizeof desc);
        return mr_err_set(c->e, MR_EFORMAT, "%s: %s.rope_type = %s, must be a string of at "
                          "most %zu bytes", c->label, rope_keys[i], desc,
                          sizeof cfg->rope_type - 1);
      }
      snprintf(cfg->rope_type, sizeof cfg->rope_type, "%s", t->valuestring);
    }
    if ((rc = cfg_yarn_fields(&sub, cfg))) return mr_err_prefix(c->e, rc, "%s", rope_keys[i]);
  }
  if ((rc = cfg_bool(c, "tie_word_embeddings", false, &cfg->tie_word_embeddings))) return rc;
  if ((rc = cfg_bool(c, "attention_bias", false, &cfg->attention_bias))) return rc;
  cfg->qk_norm = cfg->arch == MR_ARCH_QWEN3_MOE && strcmp(cfg->arch_name, "Qwen3MoeForCausalLM") == 0;
  if (cfg->arch == MR_ARCH_QWEN3_MOE && strcmp(cfg->arch_name, "Qwen2MoeForCausalLM") == 0)
    cfg->attention_bias = true; /* Qwen2-MoE always has q/k/v biases */
  /* Qwen's sliding_window only applies with use_sliding_window; Mixtral's always does. */
  bool use_sw = cfg->arch == MR_ARCH_MIXTRAL;
  if (cfg->arch == MR_ARCH_QWEN3_MOE &&
      (rc = cfg_bool(c, "use_sliding_window", false, &use_sw)))
    return rc;
  uint32_t sw = 0;
  if ((rc = cfg_u32(c, "sliding_window", false, 0, 0, UINT32_MAX, &sw))) return rc;
  cfg->sliding_window = use_sw ? sw : 0;
  if ((rc = cfg_u32(c, "max_position_embeddings", false, 0, 0, UINT32_MAX, &cfg->max_position)))
    return rc;
  if (strcmp(cfg->rope_type, "yarn") == 0) cfg_yarn_finish(cfg);
  return 0;
}

/* Fields every family shares. */
static int cfg_common(const cfg_ctx *c, mr_model_config *cfg) {
  int rc;
  if ((rc = cfg_u32(c, "hidden_size", true, 0, 1, CFG_MAX_HIDDEN, &cfg->hidden_size))) return rc;
  if ((rc = cfg_u32(c, "num_hidden_layers", true, 0, 1, MR_MAX_LAYERS, &cfg->num_layers)))
    return rc;
  if ((rc = cfg_u32(c, "vocab_size", true, 0, 1, CFG_MAX_VOCAB, &cfg->vocab_size))) return rc;
  if ((rc = cfg_u32(c, "num_attention_heads", true, 0, 1, CFG_MAX_HEADS, &cfg->num_heads)))
    return rc;
  if ((rc = cfg_u32(c, "num_key_value_heads", false, cfg->num_heads, 1, cfg->num_heads,
                    &cfg->num_kv_heads)))
    return rc;
  if (cfg->num_heads % cfg->num_kv_heads != 0)
    return mr_err_set(c->e, MR_ERANGE,
                      "%s: num_attention_heads = %u is not a multiple of num_key_value_heads = %u",
                      c->label, cfg->num_heads, cfg->num_kv_heads);

  /* head_dim: explicit if present; DeepSeek's MLA query heads are qk_nope + qk_rope wide;
   * otherwise hidden / heads, which must then divide evenly. */
  uint32_t def_hd = 0;
  if (cfg->arch == MR_ARCH_DEEPSEEK_V3) {
    uint32_t nope = 0, rope = 0;
    int r1 = cfg_u32(c, "qk_nope_head_dim", false, 0, 0, CFG_MAX_HEAD_DIM, &nope);
    int r2 = r1 ? r1 : cfg_u32(c, "qk_rope_head_dim", false, 0, 0, CFG_MAX_HEAD_DIM, &rope);
    if (r2) return r2;
    if (nope + rope > 0) def_hd = nope + rope;
  }
  if (!def_hd) {
    if (!cfg_get(c, "head_dim") && cfg->hidden_size % cfg->num_heads != 0)
      return mr_err_set(c->e, MR_EFORMAT,
                        "%s: head_dim is missing and hidden_size = %u is not a multiple of "
                        "num_attention_heads = %u",
                        c->label, cfg->hidden_size, cfg->num_heads);
    def_hd = cfg->hidden_size / cfg->num_heads;
  }
  if ((rc = cfg_u32(c, "head_dim", false, def_hd, 1, CFG_MAX_HEAD_DIM, &cfg->head_dim)))
    return rc;
  if (cfg->head_dim == 0 || cfg->head_dim > CFG_MAX_HEAD_DIM)
    return mr_err_set(c->e, MR_ERANGE, "%s: head_dim = %u (derived), must be in 1..%u", c->label,
                      cfg->head_dim, CFG_MAX_HEAD_DIM);
  float def_eps = cfg->arch == MR_ARCH_MIXTRAL ? 1e-5f : 1e-6f;
  if ((rc = cfg_float(c, "rms_norm_eps", def_eps, 0.0, 1.0, &cfg->rms_norm_eps))) return rc;
  return cfg_runner(c, cfg);
}

static int cfg_experts(const cfg_ctx *c, mr_model_config *cfg, const char *experts_key,
                       const char *inter_key) {
  int rc;
  if ((rc = cfg_u32(c, experts_key, true, 0, 1, CFG_MAX_EXPERTS, &cfg->num_experts))) return rc;
  if ((rc = cfg_u32(c, "num_experts_per_tok", true, 0, 1, cfg->num_experts, &cfg->top_k)))
    return rc;
  if ((rc = cfg_u32(c, inter_key, true, 0, 1, CFG_MAX_INTER, &cfg->moe_intermediate))) return rc;
  return 0;
}

static int cfg_qwen(const cfg_ctx *c, mr_model_config *cfg) {
  int rc;
  /* transformers 5 saves Qwen3-MoE's expert count as num_local_experts (its attribute map
   * renamed num_experts); 4.x and the released checkpoints write num_experts. */
  const char *ekey = !cfg_get(c, "num_experts") && cfg_get(c, "num_local_experts")
                         ? "num_local_experts" : "num_experts";
  if ((rc = cfg_experts(c, cfg, ekey, "moe_intermediate_size"))) return rc;
  if ((rc = cfg_u32(c, "intermediate_size", false, 0, 0, CFG_MAX_INTER,
                    &cfg->dense_intermediate)))
    return rc;
  if ((rc = cfg_bool(c, "norm_topk_prob", false, &cfg->norm_topk_prob))) return rc;
  uint32_t step;
  if ((rc = cfg_u32(c, "decoder_sparse_step", false, 1, 1, MR_MAX_LAYERS, &step))) return rc;
  uint8_t dense[MR_MAX_LAYERS] = {0};
  const cJSON *only = cfg_get(c, "mlp_only_layers");
  if (only) {
    if (!cJSON_IsArray(only)) {
      char desc[96];
      mr__json_describe(only, desc, sizeof desc);
      return mr_err_set(c->e, MR_EFORMAT, "%s: mlp_only_layers = %s, must be an array of layer ids",
                        c->label, desc);
    }
    int i = 0;
    for (const cJSON *x = only->child; x; x = x->next, i++) {
      char field[48];
      snprintf(field, sizeof field, "mlp_only_layers[%d]", i);
      uint64_t l;
      if ((rc = mr__json_u64(x, c->label, field, 0, cfg->num_layers - 1, &l, c->e))) return rc;
      dense[l] = 1;
    }
  }
  for (uint32_t l = 0; l < cfg->num_layers; l++)
    cfg->is_moe[l] = !dense[l] && (l + 1) % step == 0;
  return 0;
}

static int cfg_mixtral(const cfg_ctx *c, mr_model_config *cfg) {
  int rc;
  if ((rc = cfg_experts(c, cfg, "num_local_experts", "intermediate_size"))) return rc;
  /* Mixtral always renormalises the top-k softmax weights and has no dense MLP layers. */
  cfg->norm_topk_prob = true;
  cfg->dense_intermediate = 0;
  for (uint32_t l = 0; l < cfg->num_layers; l++) cfg->is_moe[l] = 1;
  return 0;
}

/* A string field that must be one of names[0..n); absent -> *out = def. */
static int cfg_enum(const cfg_ctx *c, const char *key, const char *const *names, int n, int def,
                    int *out) {
  const cJSON *v = cfg_get(c, key);
  *out = def;
  if (!v) return 0;
  if (cJSON_IsString(v))
    for (int i = 0; i < n; i++)
      if (names[i] && strcmp(v->valuestring, names[i]) == 0) {
        *out = i;
        return 0;
      }
  char desc[96], list[256] = "";
  mr__json_describe(v, desc, sizeof desc);
  for (int i = 0; i < n; i++)
    if (names[i])
      snprintf(list + strlen(list), sizeof list - strlen(list), "%s\"%s\"", *list ? ", " : "",
               names[i]);
  return mr_err_set(c->e, cJSON_IsString(v) ? MR_ENOTSUP : MR_EFORMAT,
                    "%s: %s = %s, must be one of %s", c->label, key, desc, list);
}

/* MLA attention, shared experts and the grouped router of DeepSeek-V2/V3 and Kimi-K2. */
static int cfg_mla(const cfg_ctx *c, mr_model_config *cfg) {
  int rc;
  if ((rc = cfg_u32(c, "q_lora_rank", false, 0, 1, CFG_MAX_HIDDEN, &cfg->q_lora_rank))) return rc;
  if ((rc = cfg_u32(c, "kv_lora_rank", false, 0, 1, CFG_MAX_HIDDEN, &cfg->kv_lora_rank)))
    return rc;
  if ((rc = cfg_u32(c, "qk_nope_head_dim", false, 0, 0, CFG_MAX_HEAD_DIM, &cfg->qk_nope_dim)))
    return rc;
  if ((rc = cfg_u32(c, "qk_rope_head_dim", false, 0, 0, CFG_MAX_HEAD_DIM, &cfg->qk_rope_dim)))
    return rc;
  if ((rc = cfg_u32(c, "v_head_dim", false, 0, 1, CFG_MAX_HEAD_DIM, &cfg->v_head_dim))) return rc;
  if ((rc = cfg_u32(c, "n_shared_experts", false, 0, 0, 1024, &cfg->n_shared_experts))) return rc;
  if ((rc = cfg_u32(c, "n_group", false, 1, 1, cfg->num_experts, &cfg->n_group))) return rc;
  if ((rc = cfg_u32(c, "topk_group", false, cfg->n_group, 1, cfg->n_group, &cfg->topk_group)))
    return rc;
  if (cfg->num_experts % cfg->n_group)
    return mr_err_set(c->e, MR_ERANGE, "%s: n_group = %u does not divide n_routed_experts = %u",
                      c->label, cfg->n_group, cfg->num_experts);
  const uint32_t per_group = cfg->num_experts / cfg->n_group;
  if ((uint64_t)cfg->topk_group * per_group < cfg->top_k)
    return mr_err_set(c->e, MR_ERANGE, "%s: num_experts_per_tok = %u exceeds the %u experts of "
                      "topk_group = %u groups of %u", c->label, cfg->top_k,
                      cfg->topk_group * per_group, cfg->topk_group, per_group);
  bool v3 = strcmp(cfg->arch_name, "DeepseekV3ForCausalLM") == 0;
  static const char *const scores[] = {"softmax", "sigmoid"};
  static const char *const methods[] = {"greedy", "noaux_tc", "group_limited_greedy"};
  int sc, tm;
  if ((rc = cfg_enum(c, "scoring_func", scores, 2, v3 ? 1 : 0, &sc))) return rc;
  if ((rc = cfg_enum(c, "topk_method", methods, 3, v3 ? 1 : 0, &tm))) return rc;
  cfg->scoring = (mr_score_func)sc;
  cfg->topk_method = (mr_topk_method)tm;
  if (cfg->topk_method == MR_TOPK_NOAUX_TC && cfg->n_group > 1 && per_group < 2)
    return mr_err_set(c->e, MR_ERANGE, "%s: topk_method noaux_tc scores a group by its top 2 "
                      "experts, but n_group = %u leaves %u expert per group", c->label,
                      cfg->n_group, per_group);
  if ((rc = cfg_bool(c, "rope_interleave", v3, &cfg->rope_interleave))) return rc;
  if (cfg->qk_nope_dim + cfg->qk_rope_dim > 0) {
    /* MLA: a query head is nope + rope wide whatever "head_dim" says (transformers writes
     * qk_rope_head_dim there). */
    /* (kv_lora_rank, v_head_dim: only the runner needs them, and checks them) */
    if (cfg->qk_rope_dim % 2)
      return mr_err_set(c->e, MR_ERANGE, "%s: qk_rope_head_dim = %u, RoPE needs it even",
                        c->label, cfg->qk_rope_dim);
    cfg->head_dim = cfg->qk_nope_dim + cfg->qk_rope_dim;
    if (cfg->head_dim > CFG_MAX_HEAD_DIM)
      return mr_err_set(c->e, MR_ERANGE, "%s: qk_nope_head_dim + qk_rope_head_dim = %u, must be "
                        "<= %u", c->label, cfg->head_dim, CFG_MAX_HEAD_DIM);
  }
  return 0;
}

static int cfg_deepseek(const cfg_ctx *c, mr_model_config *cfg) {
  int rc;
  if ((rc = cfg_experts(c, cfg, "n_routed_experts", "moe_intermediate_size"))) return rc;
  if ((rc = cfg_u32(c, "intermediate_size", false, 0, 0, CFG_MAX_INTER,
                    &cfg->dense_intermediate)))
    return rc;
  /* V3's configuration default is true, V2's false. */
  bool def_norm = strcmp(cfg->arch_name, "DeepseekV3ForCausalLM") == 0;
  if ((rc = cfg_bool(c, "norm_topk_prob", def_norm, &cfg->norm_topk_prob))) return rc;
  if ((rc = cfg_float(c, "routed_scaling_factor", 1.0f, 0.0, 1000.0,
                      &cfg->routed_scaling_factor)))
    return rc;
  uint32_t first_dense, freq;
  if ((rc = cfg_u32(c, "first_k_dense_replace", false, 0, 0, cfg->num_layers, &first_dense)))
    return rc;
  if ((rc = cfg_u32(c, "moe_layer_freq", false, 1, 1, MR_MAX_LAYERS, &freq))) return rc;
  for (uint32_t l = 0; l < cfg->num_layers; l++)
    cfg->is_moe[l] = l >= first_dense && l % freq == 0;
  return cfg_mla(c, cfg);
}

/* quantization_config: absent/null = plain weights; {"quant_method": "fp8", ...} =
 * FineGrainedFP8 (DeepSeek-V3, Qwen3-*-FP8); anything else is refused by name rather than
 * served as garbage. */
static int cfg_quant(const cfg_ctx *c, mr_model_config *cfg) {
  const cJSON *q = cfg_get(c, "quantization_config");
  if (!q) return 0;
  char desc[96];
  if (!cJSON_IsObject(q)) {
    mr__json_describe(q, desc, sizeof desc);
    return mr_err_set(c->e, MR_EFORMAT, "%s: quantization_config = %s, must be an object or null",
                      c->label, desc);
  }
  cfg_ctx sub = {.root = q, .label = c->label, .e = c->e};
  const cJSON *m = cfg_get(&sub, "quant_method");
  if (!cJSON_IsString(m)) {
    mr__json_describe(m, desc, sizeof desc);
    return mr_err_set(c->e, MR_EFORMAT, "%s: quantization_config.quant_method = %s, must be a string "
                      "(supported: \"fp8\")", c->label, desc);
  }
  if (strcmp(m->valuestring, "fp8") != 0)
    return mr_err_set(c->e, MR_ENOTSUP, "%s: quantization_config.quant_method = \"%.64s\" is not "
                      "supported (supported: \"fp8\", 128x128 block-scaled e4m3)", c->label,
                      m->valuestring);
  const cJSON *fmt = cfg_get(&sub, "fmt");
  if (fmt && (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "e4m3") != 0)) {
    mr__json_describe(fmt, desc, sizeof desc);
    return mr_err_set(c->e, MR_ENOTSUP, "%s: quantization_config.fmt = %s, only \"e4m3\" is "
                      "supported", c->label, desc);
  }
  const cJSON *act = cfg_get(&sub, "activation_scheme");
  if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "dynamic") != 0)) {
    mr__json_describe(act, desc, sizeof desc);
    return mr_err_set(c->e, MR_ENOTSUP, "%s: quantization_config.activation_scheme = %s, only "
                      "\"dynamic\" is supported (static input scales are not read)", c->label, desc);
  }
  const cJSON *bs = cfg_get(&sub, "weight_block_size");
  uint64_t b[2] = {128, 128};
  if (bs) {
    if (!cJSON_IsArray(bs) || cJSON_GetArraySize(bs) != 2) {
      mr__json_describe(bs, desc, sizeof desc);
      return mr_err_set(c->e, MR_EFORMAT, "%s: quantization_config.weight_block_size = %s, must be "
                        "[rows, cols]", c->label, desc);
    }
    int i = 0;
    for (const cJSON *x = bs->child; x; x = x->next, i++) {
      char field[64];
      snprintf(field, sizeof field, "quantization_config.weight_block_size[%d]", i);
      int rc = mr__json_u64(x, c->label, field, 1, 65536, &b[i], c->e);
      if (rc) return rc;
    }
    if (b[0] != 128 || b[1] != 128)
      return mr_err_set(c->e, MR_ENOTSUP, "%s: quantization_config.weight_block_size = [%llu, %llu], "
                        "only [128, 128] is supported", c->label, (unsigned long long)b[0],
                        (unsigned long long)b[1]);
  }
  cfg->fp8 = true;
  cfg->fp8_block[0] = (uint32_t)b[0];
  cfg->fp8_block[1] = (uint32_t)b[1];
  return 0;
}

int mr_config_parse(mr_model_config *cfg, const char *json, size_t len, const char *label,
                    mr_err *e) {
  memset(cfg, 0, sizeof *cfg);
  if (!label) label = "config.json";
  cJSON *root = NULL;
  int rc = mr__json_parse_object(json, len, label, &root, e);
  if (rc) return rc;
  cfg_ctx c = {.root = root, .label = label, .e = e};
  cfg->routed_scaling_factor = 1.0f;
  cfg->n_group = cfg->topk_group = 1;
  if ((rc = cfg_arch(&c, cfg))) goto out_free_root;
  if ((rc = cfg_common(&c, cfg))) goto out_free_root;
  switch (cfg->arch) {
  case MR_ARCH_QWEN3_MOE: rc = cfg_qwen(&c, cfg); break;
  case MR_ARCH_MIXTRAL: rc = cfg_mixtral(&c, cfg); break;
  case MR_ARCH_DEEPSEEK_V3: rc = cfg_deepseek(&c, cfg); break;
  default: MR_ASSERT(!"cfg_arch returned an unknown arch");
  }
  if (rc) goto out_free_root;
  if ((rc = cfg_quant(&c, cfg))) goto out_free_root;
  if (mr_config_num_moe_layers(cfg) == 0) {
    rc = mr_err_set(e, MR_EFORMAT,
                    "%s: no layer of the %u has routed experts (check decoder_sparse_step, "
                    "mlp_only_layers, first_k_dense_replace, moe_layer_freq)",
                    label, cfg->num_layers);
    goto out_free_root;
  }
out_free_root:
  cJSON_Delete(root);
  if (rc) {
    memset(cfg, 0, sizeof *cfg);
  }
  return rc;
}

int mr_config_load(mr_model_config *cfg, const char *path, mr_err *e) {
  char p[4096];
  memset(cfg, 0, sizeof *cfg);
  /* A directory means its config.json, as HF's from_pretrained does. */
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
    if (mr__path_join(p, sizeof p, path, "config.json") != 0)
      return mr_err_set(e, MR_ERANGE, "%s: path too long", path);
    path = p;
  }
  return MR__PARSE_FILE(path, mr_config_parse, cfg, e);
}

uint32_t mr_config_num_moe_layers(const mr_model_config *c) {
  uint32_t n = 0;
  for (uint32_t l = 0; l < c->num_layers && l < MR_MAX_LAYERS; l++) n += c->is_moe[l] ? 1 : 0;
  return n;
}

int mr_config_expert_key(const mr_model_config *c, uint32_t layer, uint32_t expert, mr_proj p,
                         char *buf, size_t len) {
  static const char *const hf[] = {"gate_proj", "up_proj", "down_proj"};
  static const char *const mixtral[] = {"w1", "w3", "w2"};
  MR_ASSERT(p == MR_PROJ_GATE || p == MR_PROJ_UP || p == MR_PROJ_DOWN);
  if (c->arch == MR_ARCH_MIXTRAL)
    return snprintf(buf, len, "model.layers.%u.block_sparse_moe.experts.%u.%s.weight", layer,
                    expert, mixtral[p]);
  return snprintf(buf, len, "model.layers.%u.mlp.experts.%u.%s.weight", layer, expert, hf[p]);
}

int mr_config_expert_tensors(const mr_model_config *c, const mr_st *st, uint32_t layer,
                             uint32_t expert, const mr_st_tensor *out[3], mr_err *e) {
  const mr_st_tensor *scales[3];
  return mr_config_expert_tensors_q(c, st, layer, expert, out, scales, e);
}

int mr_config_expert_tensors_q(const mr_model_config *c, const mr_st *st, uint32_t layer,
                               uint32_t expert, const mr_st_tensor *out[3],
                               const mr_st_tensor *scales[3], mr_err *e) {
  static const char *const proj[] = {"gate", "up", "down"};
  const uint64_t gate_up[2] = {c->moe_intermediate, c->hidden_size};
  const uint64_t down[2] = {c->hidden_size, c->moe_intermediate};
  char key[256];
  for (int p = MR_PROJ_GATE; p <= MR_PROJ_DOWN; p++) {
    scales[p] = NULL;
    mr_config_expert_key(c, layer, expert, (mr_proj)p, key, sizeof key);
    const uint64_t *shp = p == MR_PROJ_DOWN ? down : gate_up;
    const mr_st_tensor *t = mr_st_find(st, key);
    bool f8 = t && mr_st_is_f8e4m3(t);
    if (f8 && !c->fp8)
      return mr_err_set(e, MR_EFORMAT,
                        "layer %u expert %u %s: %s: tensor \"%.200s\" is F8_E4M3 but config.json has "
                        "no quantization_config {\"quant_method\": \"fp8\"}",
                        layer, expert, proj[p], t->file, key);
    int rc = mr_st_expect_as(st, key, f8 ? "F8_E4M3" : NULL, 2, shp, &out[p], e);
    if (rc) return mr_err_prefix(e, rc, "layer %u expert %u %s", layer, expert, proj[p]);
    if (!f8) continue;
    /* "...weight" -> "...weight_scale_inv", [ceil(N / 128), ceil(K / 128)], F32 or BF16. */
    char skey[280];
    snprintf(skey, sizeof skey, "%s_scale_inv", key);
    const uint64_t sshp[2] = {(shp[0] + c->fp8_block[0] - 1) / c->fp8_block[0],
                              (shp[1] + c->fp8_block[1] - 1) / c->fp8_block[1]};
    rc = mr_st_expect(st, skey, 2, sshp, &scales[p], e);
    if (rc == 0 && scales[p]->dtype == MR_DTYPE_F16)
      rc = mr_err_set(e, MR_EFORMAT, "%s: tensor \"%.200s\": dtype = F16, expected F32 or BF16",
                      scales[p]->file, skey);
    if (rc)
      return mr_err_prefix(e, rc, "layer %u expert %u %s (fp8 block scales of %ux%u)", layer, expert,
                           proj[p], c->fp8_block[0], c->fp8_block[1]);
  }
  if ((scales[0] != NULL) != (scales[1] != NULL) || (scales[0] != NULL) != (scales[2] != NULL))
    return mr_err_set(e, MR_EFORMAT,
                      "layer %u expert %u: gate/up/down are %s/%s/%s; all three must be F8_E4M3 "
                      "or all float",
                      layer, expert, out[0]->dtype_name, out[1]->dtype_name, out[2]->dtype_name);
  if (out[0]->dtype != out[1]->dtype || out[0]->dtype != out[2]->dtype)
    return mr_err_set(e, MR_EFORMAT,
                      "layer %u expert %u: gate/up/down have different dtypes (%s in %s, %s in "
                      "%s, %s in %s); they must match",
                      layer, expert, out[0]->dtype_name, out[0]->file, out[1]->dtype_name,
                      out[1]->file, out[2]->dtype_name, out[2]->file);
  return 0;
}
