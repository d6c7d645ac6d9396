/*
 * test_config.c - HF config.json reader: the three families with configs shaped like the
 * released models, the MoE-layer rules, and each kind of bad field (checking the code AND
 * that the message names the field and the limit).
 */
#include "common/internal.h"
#include "tests/unit/mt.h"

#include <pthread.h>
#include <sys/stat.h>

static int parse(mr_model_config *c, const char *json, mr_err *e) {
  mr_err_clear(e);
  return mr_config_parse(c, json, strlen(json), "m/config.json", e);
}

/* out = base with its first `from` replaced by `to` (from must occur). */
static const char *edit(const char *base, const char *from, const char *to, char *out,
                        size_t len) {
  const char *p = strstr(base, from);
  MT_TRUE(p != NULL);
  snprintf(out, len, "%.*s%s%s", (int)(p - base), base, to, p + strlen(from));
  return out;
}

/* Qwen3-30B-A3B's config.json (fields that matter, values as released). */
static const char *qwen3_30b =
    "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\","
    " \"attention_bias\": false, \"bos_token_id\": 151643, \"decoder_sparse_step\": 1,"
    " \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\","
    " \"hidden_size\": 2048, \"intermediate_size\": 6144, \"max_position_embeddings\": 40960,"
    " \"max_window_layers\": 48, \"mlp_only_layers\": [], \"moe_intermediate_size\": 768,"
    " \"norm_topk_prob\": true, \"num_attention_heads\": 32, \"num_experts\": 128,"
    " \"num_experts_per_tok\": 8, \"num_hidden_layers\": 48, \"num_key_value_heads\": 4,"
    " \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, \"rope_theta\": 1000000.0,"
    " \"sliding_window\": null, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
    " \"vocab_size\": 151936}";

MT_TEST(qwen3_moe) {
  mr_model_config c;
  mr_err e;
  MT_OK(parse(&c, qwen3_30b, &e), &e);
  MT_EQ_INT(c.arch, MR_ARCH_QWEN3_MOE);
  MT_EQ_STR(c.arch_name, "Qwen3MoeForCausalLM");
  MT_EQ_INT(c.hidden_size, 2048);
  MT_EQ_INT(c.moe_intermediate, 768);
  MT_EQ_INT(c.dense_intermediate, 6144);
  MT_EQ_INT(c.num_experts, 128);
  MT_EQ_INT(c.top_k, 8);
  MT_EQ_INT(c.num_layers, 48);
  MT_EQ_INT(c.vocab_size, 151936);
  MT_EQ_INT(c.num_heads, 32);
  MT_EQ_INT(c.num_kv_heads, 4);
  MT_EQ_INT(c.head_dim, 128);
  MT_TRUE(c.norm_topk_prob);
  MT_NEAR(c.routed_scaling_factor, 1.0, 0);
  MT_NEAR(c.rms_norm_eps, 1e-6, 1e-12);
  MT_EQ_INT(mr_config_num_moe_layers(&c), 48);
  MT_TRUE(mr_config_is_moe_layer(&c, 0));
  MT_TRUE(mr_config_is_moe_layer(&c, 47));
  MT_FALSE(mr_config_is_moe_layer(&c, 48));
  char key[128];
  int n = mr_config_expert_key(&c, 3, 17, MR_PROJ_GATE, key, sizeof key);
  MT_EQ_STR(key, "model.layers.3.mlp.experts.17.gate_proj.weight");
  MT_EQ_INT(n, (int)strlen(key));
  mr_config_expert_key(&c, 47, 127, MR_PROJ_DOWN, key, sizeof key);
  MT_EQ_STR(key, "model.layers.47.mlp.experts.127.down_proj.weight");
  mr_config_expert_key(&c, 0, 0, MR_PROJ_UP, key, sizeof key);
  MT_EQ_STR(key, "model.layers.0.mlp.experts.0.up_proj.weight");
  /* snprintf semantics when the buffer is short. */
  char tiny[8];
  MT_EQ_INT(mr_config_expert_key(&c, 0, 0, MR_PROJ_UP, tiny, sizeof tiny), (int)strlen(key));
  MT_EQ_STR(tiny, "model.l");
}

/* What the runner reads: RoPE, head, biases, window; and transformers 5's spelling of
 * Qwen3-MoE configs (num_local_experts, rope_parameters). */
MT_TEST(runner_fields_and_transformers5_names) {
  mr_model_config c;
  mr_err e;
  MT_OK(parse(&c, qwen3_30b, &e), &e);
  MT_NEAR(c.rope_theta, 1e6, 1e-3);
  MT_EQ_STR(c.rope_type, "default");
  MT_FALSE(c.tie_word_embeddings);
  MT_FALSE(c.attention_bias);
  MT_TRUE(c.qk_norm);
  MT_EQ_INT(c.sliding_window, 0);
  MT_EQ_INT(c.max_position, 40960);
  static const char *v5 =
      "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"hidden_size\": 64,"
      " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"num_attention_heads\": 4,"
      " \"num_key_value_heads\": 2, \"head_dim\": 16, \"moe_intermediate_size\": 32,"
      " \"num_local_experts\": 8, \"num_experts_per_tok\": 2, \"tie_word_embeddings\": true,"
      " \"rope_parameters\": {\"rope_theta\": 5000.0, \"rope_type\": \"default\"},"
      " \"sliding_window\": 64, \"use_sliding_window\": false}";
  MT_OK(parse(&c, v5, &e), &e);
  MT_EQ_INT(c.num_experts, 8);
  MT_NEAR(c.rope_theta, 5000.0, 1e-3);
  MT_TRUE(c.tie_word_embeddings);
  MT_EQ_INT(c.sliding_window, 0); /* Qwen: only with use_sliding_window */
  static const char *yarn =
      "{\"architectures\": [\"MixtralForCausalLM\"], \"hidden_size\": 64,"
      " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"num_attention_heads\": 4,"
      " \"intermediate_size\": 32, \"num_local_experts\": 4, \"num_experts_per_tok\": 2,"
      " \"sliding_window\": 4096, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}}";
  MT_OK(parse(&c, yarn, &e), &e);
  MT_EQ_STR(c.rope_type, "yarn");
  MT_EQ_INT(c.sliding_window, 4096); /* Mixtral: always */
  MT_NEAR(c.rope_theta, 1e6, 1e-3);  /* Mixtral's default */
  static const char *bad =
      "{\"architectures\": [\"MixtralForCausalLM\"], \"hidden_size\": 64,"
      " \"num_hidden_layers\": 2, \"vocab_size\": 256, \"num_attention_heads\": 4,"
      " \"intermediate_size\": 32, \"num_local_experts\": 4, \"num_experts_per_tok\": 2,"
      " \"rope_parameters\": {\"rope_theta\": -1}}";
  MT_TRUE(parse(&c, bad, &e) != 0);
  MT_CONTAINS(e.msg, "rope_theta");
}

MT_TEST(qwen2_moe_sparse_step_and_mlp_only) {
  mr_model_config c;
  mr_err e;
  /* Layer l is MoE iff l not in mlp_only_layers and (l+1) % step == 0. */
  MT_OK(parse(&c,
              "{\"architectures\":[\"Qwen2MoeForCausalLM\"],\"hidden_size\":64,"
              "\"num_hidden_layers\":8,\"vocab_size\":100,\"num_attention_heads\":4,"
              "\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
              "\"decoder_sparse_step\":2,\"mlp_only_layers\":[3,4]}",
              &e),
        &e);
  uint8_t want[8] = {0, 1, 0, 0, 0, 1, 0, 1};
  for (uint32_t l = 0; l < 8; l++) MT_EQ_INT(mr_config_is_moe_layer(&c, l), want[l]);
  MT_EQ_INT(mr_config_num_moe_layers(&c), 3);
  /* Defaults: kv heads = heads, head_dim = hidden / heads, norm_topk_prob false. */
  MT_EQ_INT(c.num_kv_heads, 4);
  MT_EQ_INT(c.head_dim, 16);
  MT_FALSE(c.norm_topk_prob);
  MT_EQ_INT(c.dense_intermediate, 0);
}

MT_TEST(mixtral) {
  mr_model_config c;
  mr_err e;
  /* Mixtral-8x7B-v0.1 */
  MT_OK(parse(&c,
              "{\"architectures\":[\"MixtralForCausalLM\"],\"hidden_size\":4096,"
              "\"intermediate_size\":14336,\"num_attention_heads\":32,\"num_hidden_layers\":32,"
              "\"num_key_value_heads\":8,\"num_local_experts\":8,\"num_experts_per_tok\":2,"
              "\"rms_norm_eps\":1e-05,\"vocab_size\":32000,\"model_type\":\"mixtral\"}",
              &e),
        &e);
  MT_EQ_INT(c.arch, MR_ARCH_MIXTRAL);
  MT_EQ_INT(c.num_experts, 8);
  MT_EQ_INT(c.top_k, 2);
  MT_EQ_INT(c.moe_intermediate, 14336);
  MT_EQ_INT(c.dense_intermediate, 0);
  MT_EQ_INT(c.head_dim, 128);
  MT_TRUE(c.norm_topk_prob);
  MT_EQ_INT(mr_config_num_moe_layers(&c), 32);
  char key[128];
  mr_config_expert_key(&c, 5, 7, MR_PROJ_GATE, key, sizeof key);
  MT_EQ_STR(key, "model.layers.5.block_sparse_moe.experts.7.w1.weight");
  mr_config_expert_key(&c, 5, 7, MR_PROJ_UP, key, sizeof key);
  MT_EQ_STR(key, "model.layers.5.block_sparse_moe.experts.7.w3.weight");
  mr_config_expert_key(&c, 5, 7, MR_PROJ_DOWN, key, sizeof key);
  MT_EQ_STR(key, "model.layers.5.block_sparse_moe.experts.7.w2.weight");
}

/* DeepSeek-V3's config.json (the fields that matter). */
static const char *deepseek_v3 =
    "{\"architectures\":[\"DeepseekV3ForCausalLM\"],\"model_type\":\"deepseek_v3\","
    "\"first_k_dense_replace\":3,\"hidden_size\":7168,\"intermediate_size\":18432,"
    "\"kv_lora_rank\":512,\"moe_intermediate_size\":2048,\"moe_layer_freq\":1,"
    "\"n_group\":8,\"n_routed_experts\":256,\"n_shared_experts\":1,\"norm_topk_prob\":true,"
    "\"num_attention_heads\":128,\"num_experts_per_tok\":8,\"num_hidden_layers\":61,"
    "\"num_key_value_heads\":128,\"q_lora_rank\":1536,\"qk_nope_head_dim\":128,"
    "\"qk_rope_head_dim\":64,\"rms_norm_eps\":1e-06,\"routed_scaling_factor\":2.5,"
    "\"scoring_func\":\"sigmoid\",\"topk_group\":4,\"topk_method\":\"noaux_tc\","
    "\"v_head_dim\":128,\"vocab_size\":129280}";

MT_TEST(deepseek_v3) {
  mr_model_config c;
  mr_err e;
  MT_OK(parse(&c, deepseek_v3, &e), &e);
  MT_EQ_INT(c.arch, MR_ARCH_DEEPSEEK_V3);
  MT_EQ_INT(c.num_experts, 256);
  MT_EQ_INT(c.top_k, 8);
  MT_EQ_INT(c.moe_intermediate, 2048);
  MT_EQ_INT(c.dense_intermediate, 18432);
  MT_EQ_INT(c.num_layers, 61);
  MT_EQ_INT(c.head_dim, 192); /* qk_nope + qk_rope */
  MT_NEAR(c.routed_scaling_factor, 2.5, 0);
  MT_TRUE(c.norm_topk_prob);
  MT_FALSE(mr_config_is_moe_layer(&c, 2));
  MT_TRUE(mr_config_is_moe_layer(&c, 3));
  MT_TRUE(mr_config_is_moe_layer(&c, 60));
  MT_EQ_INT(mr_config_num_moe_layers(&c), 58);
  char key[128];
  mr_config_expert_key(&c, 3, 255, MR_PROJ_UP, key, sizeof key);
  MT_EQ_STR(key, "model.layers.3.mlp.experts.255.up_proj.weight");
  /* MLA and the router */
  MT_EQ_INT(c.q_lora_rank, 1536);
  MT_EQ_INT(c.kv_lora_rank, 512);
  MT_EQ_INT(c.qk_nope_dim, 128);
  MT_EQ_INT(c.qk_rope_dim, 64);
  MT_EQ_INT(c.v_head_dim, 128);
  MT_EQ_INT(c.n_shared_experts, 1);
  MT_EQ_INT(c.n_group, 8);
  MT_EQ_INT(c.topk_group, 4);
  MT_EQ_INT(c.scoring, MR_SCORE_SIGMOID);
  MT_EQ_INT(c.topk_method, MR_TOPK_NOAUX_TC);
  MT_TRUE(c.rope_interleave); /* V3's default */
  MT_EQ_STR(c.rope_type, "default");
}

/* DeepSeek-V3's released rope_scaling (4.x layout, "type") and transformers 5's layout with
 * the qk_rope_head_dim it writes as head_dim. */
static int parse_ds(const char *extra, mr_model_config *c, mr_err *e) {
  static char buf[8192];
  snprintf(buf, sizeof buf, "%.*s,%s}", (int)strlen(deepseek_v3) - 1, deepseek_v3, extra);
  return parse(c, buf, e);
}

MT_TEST(deepseek_yarn_and_mla_fields) {
  mr_model_config c;
  mr_err e;
  MT_OK(parse_ds("\"max_position_embeddings\":163840,\"rope_theta\":10000,\"rope_scaling\":"
                 "{\"beta_fast\":32,\"beta_slow\":1,\"factor\":40,\"mscale\":1.0,"
                 "\"mscale_all_dim\":1.0,\"original_max_position_embeddings\":4096,"
                 "\"type\":\"yarn\"},\"head_dim\":64",
                 &c, &e),
        &e);
  MT_EQ_STR(c.rope_type, "yarn");
  MT_NEAR(c.yarn_factor, 40, 0);
  MT_EQ_INT(c.yarn_original_max_position, 4096);
  MT_NEAR(c.yarn_attention_factor, 1.0, 1e-7); /* mscale / mscale_all_dim */
  MT_NEAR(c.yarn_mscale_all_dim, 1.0, 0);
  MT_TRUE(c.yarn_truncate);
  MT_EQ_INT(c.head_dim, 192); /* nope + rope, not transformers' "head_dim" */
  /* no mscale: attention_factor = 0.1 ln(factor) + 1; factor from the lengths */
  MT_OK(parse_ds("\"max_position_embeddings\":16384,\"rope_parameters\":{\"rope_type\":"
                 "\"yarn\",\"rope_theta\":50000,\"original_max_position_embeddings\":4096,"
                 "\"beta_fast\":16}",
                 &c, &e),
        &e);
  MT_NEAR(c.yarn_factor, 4, 0);
  MT_NEAR(c.yarn_attention_factor, 0.1 * log(4.0) + 1, 1e-6);
  MT_NEAR(c.yarn_beta_fast, 16, 0);
  MT_NEAR(c.yarn_beta_slow, 1, 0);
  MT_NEAR(c.rope_theta, 50000, 0);
  /* q_lora_rank null = a plain q_proj; rope_interleave false */
  char buf[4096];
  MT_OK(parse(&c, edit(deepseek_v3, "\"q_lora_rank\":1536",
                       "\"q_lora_rank\":null,\"rope_interleave\":false", buf, sizeof buf),
              &e),
        &e);
  MT_EQ_INT(c.q_lora_rank, 0);
  MT_FALSE(c.rope_interleave);
}

MT_TEST(deepseek_bad_groups_and_methods_are_named) {
  mr_model_config c;
  mr_err e;
  char buf[4096], buf2[4096];
  const char *ng = "\"n_group\":8", *tg = "\"topk_group\":4";
#define DS_EDIT(from, to) edit(deepseek_v3, from, to, buf, sizeof buf)
#define DS_EDIT2(from, to, from2, to2) edit(DS_EDIT(from, to), from2, to2, buf2, sizeof buf2)
  MT_EQ_INT(parse(&c, DS_EDIT(ng, "\"n_group\":7"), &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "n_group = 7 does not divide n_routed_experts = 256");
  MT_EQ_INT(parse(&c, DS_EDIT(tg, "\"topk_group\":9"), &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "topk_group = 9, must be an integer in 1..8");
  /* 256 experts in 3 groups */
  MT_EQ_INT(parse(&c, DS_EDIT2(ng, "\"n_group\":3", tg, "\"topk_group\":1"), &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "n_group = 3 does not divide n_routed_experts = 256");
  /* top-8 from groups of 2: 128 groups keeping 4 = 8 experts is fine, keeping 3 is not */
  MT_OK(parse(&c, DS_EDIT(ng, "\"n_group\":128"), &e), &e);
  MT_EQ_INT(parse(&c, DS_EDIT2(ng, "\"n_group\":128", tg, "\"topk_group\":3"), &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "num_experts_per_tok = 8 exceeds the 6 experts of topk_group = 3 groups of 2");
  /* a group of one expert cannot be scored by its top 2 */
  MT_EQ_INT(parse(&c, DS_EDIT2(ng, "\"n_group\":256", tg, "\"topk_group\":8"), &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "leaves 1 expert per group");
  MT_EQ_INT(parse(&c, DS_EDIT("\"noaux_tc\"", "\"auxfree\""), &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "topk_method = \"auxfree\", must be one of \"greedy\", \"noaux_tc\", "
                     "\"group_limited_greedy\"");
  MT_EQ_INT(parse(&c, DS_EDIT("\"sigmoid\"", "3"), &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "scoring_func = 3, must be one of \"softmax\", \"sigmoid\"");
  MT_EQ_INT(parse(&c, DS_EDIT("\"qk_rope_head_dim\":64", "\"qk_rope_head_dim\":63"), &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "qk_rope_head_dim = 63, RoPE needs it even");
#undef DS_EDIT2
#undef DS_EDIT
}

MT_TEST(deepseek_v2_layer_freq_and_defaults) {
  mr_model_config c;
  mr_err e;
  /* l is MoE iff l >= first_k_dense_replace && l % moe_layer_freq == 0. */
  MT_OK(parse(&c,
              "{\"architectures\":[\"DeepseekV2ForCausalLM\"],\"hidden_size\":64,"
              "\"num_hidden_layers\":7,\"vocab_size\":10,\"num_attention_heads\":4,"
              "\"n_routed_experts\":16,\"num_experts_per_tok\":6,\"moe_intermediate_size\":8,"
              "\"first_k_dense_replace\":1,\"moe_layer_freq\":2,\"head_dim\":32}",
              &e),
        &e);
  uint8_t want[7] = {0, 0, 1, 0, 1, 0, 1};
  for (uint32_t l = 0; l < 7; l++) MT_EQ_INT(mr_config_is_moe_layer(&c, l), want[l]);
  MT_FALSE(c.norm_topk_prob); /* V2 default */
  MT_NEAR(c.routed_scaling_factor, 1.0, 0);
  MT_EQ_INT(c.head_dim, 32);
}

MT_TEST(model_type_fallback_and_nulls) {
  mr_model_config c;
  mr_err e;
  /* No architectures: model_type decides. Nulls count as absent for optional fields. */
  MT_OK(parse(&c,
              "{\"model_type\":\"qwen3_moe\",\"hidden_size\":64,\"num_hidden_layers\":2,"
              "\"vocab_size\":10,\"num_attention_heads\":4,\"num_key_value_heads\":null,"
              "\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32,"
              "\"head_dim\":null,\"mlp_only_layers\":null}",
              &e),
        &e);
  MT_EQ_INT(c.arch, MR_ARCH_QWEN3_MOE);
  MT_EQ_STR(c.arch_name, "Qwen3MoeForCausalLM");
  MT_EQ_INT(c.num_kv_heads, 4);
  MT_EQ_INT(c.head_dim, 16);
}

/* Replaces the first occurrence of `from` in qwen3_30b by `to` and parses the result. */
static int parse_edit(const char *from, const char *to, mr_model_config *c, mr_err *e) {
  static char buf[8192];
  return parse(c, edit(qwen3_30b, from, to, buf, sizeof buf), e);
}

MT_TEST(missing_required_fields) {
  mr_model_config c;
  mr_err e;
  const char *fields[] = {"\"hidden_size\"", "\"num_hidden_layers\"", "\"vocab_size\"",
                          "\"num_attention_heads\"", "\"num_experts\"", "\"num_experts_per_tok\"",
                          "\"moe_intermediate_size\""};
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    char renamed[64];
    snprintf(renamed, sizeof renamed, "\"x_%s", fields[i] + 1);
    MT_EQ_INT(parse_edit(fields[i], renamed, &c, &e), MR_EFORMAT);
    char want[80];
    snprintf(want, sizeof want, "required field %.*s is missing", (int)strlen(fields[i]) - 2,
             fields[i] + 1);
    MT_CONTAINS(e.msg, want);
    MT_CONTAINS(e.msg, "m/config.json");
    MT_EQ_INT(c.hidden_size, 0); /* cfg cleared on failure */
  }
}

MT_TEST(wrong_types) {
  mr_model_config c;
  mr_err e;
  MT_EQ_INT(parse_edit("\"hidden_size\": 2048", "\"hidden_size\": \"2048\"", &c, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "m/config.json: hidden_size = \"2048\", must be an integer in 1..65536");
  MT_EQ_INT(parse_edit("\"hidden_size\": 2048", "\"hidden_size\": 2048.5", &c, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "hidden_size = 2048.5");
  MT_EQ_INT(parse_edit("\"num_experts\": 128", "\"num_experts\": [128]", &c, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "num_experts = an array");
  MT_EQ_INT(parse_edit("\"norm_topk_prob\": true", "\"norm_topk_prob\": \"yes\"", &c, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "norm_topk_prob = \"yes\", must be true or false");
  MT_EQ_INT(parse_edit("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": \"1e-6\"", &c, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "rms_norm_eps");
  MT_EQ_INT(parse_edit("\"mlp_only_layers\": []", "\"mlp_only_layers\": {}", &c, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "mlp_only_layers = an object");
  MT_EQ_INT(parse_edit("\"mlp_only_layers\": []", "\"mlp_only_layers\": [\"1\"]", &c, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "mlp_only_layers[0]");
  MT_EQ_INT(parse_edit("[\"Qwen3MoeForCausalLM\"]", "\"Qwen3MoeForCausalLM\"", &c, &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "architectures[0]");
  MT_EQ_INT(parse_edit("[\"Qwen3MoeForCausalLM\"]", "[]", &c, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "architectures[0] = (missing)");
}

MT_TEST(ranges) {
  mr_model_config c;
  mr_err e;
  MT_EQ_INT(parse_edit("\"num_experts\": 128", "\"num_experts\": 0", &c, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "num_experts = 0, must be an integer in 1..65536");
  MT_EQ_INT(parse_edit("\"num_experts\": 128", "\"num_experts\": 65537", &c, &e), MR_ERANGE);
  MT_EQ_INT(parse_edit("\"num_experts_per_tok\": 8", "\"num_experts_per_tok\": 129", &c, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "num_experts_per_tok = 129, must be an integer in 1..128");
  MT_EQ_INT(parse_edit("\"num_hidden_layers\": 48", "\"num_hidden_layers\": 1025", &c, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "num_hidden_layers = 1025, must be an integer in 1..1024");
  MT_EQ_INT(parse_edit("\"hidden_size\": 2048", "\"hidden_size\": -1", &c, &e), MR_ERANGE);
  MT_EQ_INT(parse_edit("\"hidden_size\": 2048", "\"hidden_size\": 1e300", &c, &e), MR_ERANGE);
  MT_EQ_INT(parse_edit("\"num_key_value_heads\": 4", "\"num_key_value_heads\": 5", &c, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "num_attention_heads = 32 is not a multiple of num_key_value_heads = 5");
  MT_EQ_INT(parse_edit("\"num_key_value_heads\": 4", "\"num_key_value_heads\": 64", &c, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "num_key_value_heads = 64, must be an integer in 1..32");
  MT_EQ_INT(parse_edit("\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 0", &c, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "decoder_sparse_step = 0");
  MT_EQ_INT(parse_edit("\"mlp_only_layers\": []", "\"mlp_only_layers\": [48]", &c, &e),
            MR_ERANGE);
  MT_CONTAINS(e.msg, "mlp_only_layers[0] = 48, must be an integer in 0..47");
  MT_EQ_INT(parse_edit("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": -1e-06", &c, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "rms_norm_eps = -1e-06");
  /* Found by fuzz_config: positive as a double, zero as the float we keep. */
  MT_EQ_INT(parse_edit("\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-86", &c, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "rms_norm_eps = 1e-86");
  MT_EQ_INT(parse_edit("\"head_dim\": 128", "\"head_dim\": 0", &c, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "head_dim = 0");
  /* head_dim absent and hidden not divisible by heads */
  MT_EQ_INT(parse_edit("\"head_dim\": 128", "\"head_dimx\": 128", &c, &e), MR_OK);
  MT_EQ_INT(c.head_dim, 64);
  MT_EQ_INT(parse(&c,
                  "{\"architectures\":[\"Qwen3MoeForCausalLM\"],\"hidden_size\":100,"
                  "\"num_hidden_layers\":2,\"vocab_size\":10,\"num_attention_heads\":3,"
                  "\"num_experts\":4,\"num_experts_per_tok\":2,\"moe_intermediate_size\":32}",
                  &e),
            MR_EFORMAT);
  MT_CONTAINS(e.msg, "head_dim is missing and hidden_size = 100");
}

MT_TEST(deepseek_ranges) {
  mr_model_config c;
  mr_err e;
  char buf[4096];
  const char *p = strstr(deepseek_v3, "\"routed_scaling_factor\":2.5");
  snprintf(buf, sizeof buf, "%.*s\"routed_scaling_factor\":0%s", (int)(p - deepseek_v3),
           deepseek_v3, p + strlen("\"routed_scaling_factor\":2.5"));
  MT_EQ_INT(parse(&c, buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "routed_scaling_factor = 0, must be a number in (0, 1000]");
  p = strstr(deepseek_v3, "\"first_k_dense_replace\":3");
  snprintf(buf, sizeof buf, "%.*s\"first_k_dense_replace\":62%s", (int)(p - deepseek_v3),
           deepseek_v3, p + strlen("\"first_k_dense_replace\":3"));
  MT_EQ_INT(parse(&c, buf, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "first_k_dense_replace = 62, must be an integer in 0..61");
  /* All layers dense: no MoE layer at all is an error. */
  snprintf(buf, sizeof buf, "%.*s\"first_k_dense_replace\":61%s", (int)(p - deepseek_v3),
           deepseek_v3, p + strlen("\"first_k_dense_replace\":3"));
  MT_EQ_INT(parse(&c, buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "no layer of the 61 has routed experts");
  p = strstr(deepseek_v3, "\"n_routed_experts\":256");
  snprintf(buf, sizeof buf, "%.*s\"n_routed_experts\":null%s", (int)(p - deepseek_v3),
           deepseek_v3, p + strlen("\"n_routed_experts\":256"));
  MT_EQ_INT(parse(&c, buf, &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "required field n_routed_experts is missing");
}

MT_TEST(unsupported_and_malformed) {
  mr_model_config c;
  mr_err e;
  MT_EQ_INT(parse_edit("Qwen3MoeForCausalLM", "LlamaForCausalLM", &c, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "architecture \"LlamaForCausalLM\" is not supported");
  MT_EQ_INT(parse(&c, "{\"hidden_size\": 1}", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "architectures is missing");
  MT_EQ_INT(parse(&c, "{\"hidden_size\": 1,", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "m/config.json: invalid JSON");
  MT_EQ_INT(parse(&c, "[1]", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "must be a JSON object");
  MT_EQ_INT(parse(&c, "", &e), MR_EFORMAT);
  MT_EQ_INT(mr_config_parse(&c, "{}", 2, NULL, NULL), MR_EFORMAT); /* NULL label and err */
}

MT_TEST(load_file_and_dir) {
  char dir[] = "/tmp/mr-test-cfg-XXXXXX";
  MT_TRUE(mkdtemp(dir) != NULL);
  char path[256];
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fputs(qwen3_30b, f);
  fclose(f);
  mr_model_config c;
  mr_err e = {0};
  int rc1 = mr_config_load(&c, dir, &e);
  int rc2 = mr_config_load(&c, path, &e);
  unlink(path);
  int rc3 = mr_config_load(&c, dir, &e);
  rmdir(dir);
  MT_EQ_INT(rc1, 0);
  MT_EQ_INT(rc2, 0);
  MT_EQ_INT(c.num_experts, 0); /* cleared by the failed load */
  MT_EQ_INT(rc3, MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "config.json");
}

/* mr.h: readers may be called from any thread. Run under `make SANITIZER=thread` this
 * also proves that no shared state is touched without a lock (cJSON's global error
 * pointer is the one to watch). */
static void *parse_many(void *arg) {
  long bad = 0;
  for (int i = 0; i < 300; i++) {
    mr_model_config c;
    mr_err e;
    const char *json = (i + (long)(intptr_t)arg) % 2 ? qwen3_30b : "{\"hidden_size\": 1,";
    int rc = mr_config_parse(&c, json, strlen(json), "t", &e);
    if (json == qwen3_30b ? (rc != 0 || c.num_experts != 128) : rc != MR_EFORMAT) bad++;
  }
  return (void *)(intptr_t)bad;
}

MT_TEST(concurrent_parse) {
  pthread_t th[4];
  for (long i = 0; i < 4; i++) MT_EQ_INT(pthread_create(&th[i], NULL, parse_many, (void *)i), 0);
  for (int i = 0; i < 4; i++) {
    void *bad;
    pthread_join(th[i], &bad);
    MT_EQ_INT((intptr_t)bad, 0);
  }
}

/* quantization_config: FineGrainedFP8 as DeepSeek-V3 / Qwen3-FP8 write it is read; other
 * methods, formats, schemes and block sizes are refused naming the field and the limit. */
MT_TEST(quantization_config_fp8) {
  mr_model_config c;
  mr_err e = {0};
  char buf[4096];
  const char *tail = strrchr(qwen3_30b, '}');
  const size_t head = (size_t)(tail - qwen3_30b);
#define WITH_Q(q) (snprintf(buf, sizeof buf, "%.*s, \"quantization_config\": %s}", (int)head, qwen3_30b, q), buf)
  MT_OK(parse(&c, qwen3_30b, &e), &e);
  MT_FALSE(c.fp8);
  MT_OK(parse(&c, WITH_Q("{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": "
                         "\"fp8\", \"weight_block_size\": [128, 128], \"modules_to_not_convert\": [\"lm_head\"]}"), &e), &e);
  MT_TRUE(c.fp8 && c.fp8_block[0] == 128 && c.fp8_block[1] == 128);
  MT_OK(parse(&c, WITH_Q("{\"quant_method\": \"fp8\"}"), &e), &e); /* defaults: e4m3, 128x128 */
  MT_TRUE(c.fp8);
  MT_OK(parse(&c, WITH_Q("null"), &e), &e);
  MT_FALSE(c.fp8);
  struct { const char *q; int rc; const char *msg; } bad[] = {
      {"{\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]}", MR_ENOTSUP,
       "quantization_config.weight_block_size = [64, 64], only [128, 128] is supported"},
      {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128]}", MR_EFORMAT, "weight_block_size = an array, must be [rows, cols]"},
      {"{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 0]}", MR_ERANGE, "weight_block_size[1]"},
      {"{\"quant_method\": \"fp8\", \"fmt\": \"e5m2\"}", MR_ENOTSUP, "fmt = \"e5m2\", only \"e4m3\""},
      {"{\"quant_method\": \"fp8\", \"activation_scheme\": \"static\"}", MR_ENOTSUP, "activation_scheme = \"static\""},
      {"{\"quant_method\": \"gptq\", \"bits\": 4}", MR_ENOTSUP, "quant_method = \"gptq\" is not supported"},
      {"{\"bits\": 4}", MR_EFORMAT, "quant_method = (missing), must be a string"},
      {"[1]", MR_EFORMAT, "quantization_config = "},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    MT_EQ_INT(parse(&c, WITH_Q(bad[i].q), &e), bad[i].rc);
    MT_CONTAINS(e.msg, "m/config.json: ");
    MT_CONTAINS(e.msg, bad[i].msg);
  }
#undef WITH_Q
}

MT_MAIN()
