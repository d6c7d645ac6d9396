/*
 * fuzz_config.c - libFuzzer target for the HF config.json reader. On success the parsed
 * config must satisfy the ranges the reader promises in mr.h.
 */
#include "common/mr.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static mr_model_config c; /* ~1.2 KiB; static keeps deep fuzz stacks small */
  mr_err e;
  int rc = mr_config_parse(&c, (const char *)data, size, "fuzz", &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0') abort();
    return 0;
  }
  if (c.arch == MR_ARCH_UNKNOWN) abort();
  if (c.hidden_size < 1 || c.hidden_size > 65536) abort();
  if (c.num_experts < 1 || c.num_experts > 65536) abort();
  if (c.top_k < 1 || c.top_k > c.num_experts) abort();
  if (c.num_layers < 1 || c.num_layers > MR_MAX_LAYERS) abort();
  if (c.moe_intermediate < 1 || c.num_heads < 1 || c.num_kv_heads < 1 || c.head_dim < 1) abort();
  if (c.num_heads % c.num_kv_heads != 0) abort();
  if (!(c.rms_norm_eps > 0) || !(c.routed_scaling_factor > 0)) abort();
  /* quantization_config: only fp8 with 128x128 blocks is ever accepted. */
  if (c.fp8 && (c.fp8_block[0] != 128 || c.fp8_block[1] != 128)) abort();
  if (!c.fp8 && (c.fp8_block[0] || c.fp8_block[1])) abort();
  /* grouped routing: what the router's loops rely on */
  if (c.n_group < 1 || c.num_experts % c.n_group || c.topk_group < 1 || c.topk_group > c.n_group)
    abort();
  if ((uint64_t)c.topk_group * (c.num_experts / c.n_group) < c.top_k) abort();
  if (c.qk_rope_dim % 2) abort();
  if (strcmp(c.rope_type, "yarn") == 0 && c.yarn_factor > 0 &&
      (!(c.yarn_attention_factor > 0) || !(c.yarn_beta_fast > 0) || !(c.yarn_beta_slow > 0)))
    abort();
  uint32_t n = mr_config_num_moe_layers(&c);
  if (n < 1 || n > c.num_layers) abort();
  char key[128];
  for (uint32_t l = 0; l < c.num_layers; l++) {
    if (!mr_config_is_moe_layer(&c, l)) continue;
    int k = mr_config_expert_key(&c, l, c.num_experts - 1, MR_PROJ_DOWN, key, sizeof key);
    if (k <= 0 || (size_t)k >= sizeof key) abort();
    break;
  }
  return 0;
}
