/*
 * fuzz_control.h - the check shared by fuzz_load_request.c and fuzz_unload_request.c: the
 * pairs a decoded LoadRequest.add / UnloadRequest.drop names, validated by
 * es_control_validate against a model of 4 layers (layer 0 dense) x 16 experts, as
 * es__on_load / es__on_unload do.
 *
 * A validation failure must be MR_EINVAL or MR_EMISMATCH with a message; on success at
 * least one pair is named, every named pair is inside the model and in a MoE layer, and
 * the count is that of the distinct pairs. Sets the fuzz verdict (accepted = valid).
 */
#ifndef FUZZ_CONTROL_H
#define FUZZ_CONTROL_H

#include <stdio.h>
#include <stdlib.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"

#define FUZZ_CONTROL_L 4
#define FUZZ_CONTROL_E 16

static void fuzz_control_fail(const char *target, const char *what, const char *msg) {
  fprintf(stderr, "%s: %s: %s\n", target, what, msg);
  abort();
}

static void fuzz_control_check(const char *target, Moerpc__V1__LayerExperts *const *items,
                               size_t n_items, const char *fingerprint) {
  enum { L = FUZZ_CONTROL_L, E = FUZZ_CONTROL_E };
  static const uint8_t is_moe[L] = {0, 1, 1, 1};
  es_limits lim = {.num_layers = L, .num_experts = E, .hidden_size = 8, .max_tokens = 4,
                   .is_moe = is_moe};
  static uint8_t pairs[L * E];
  uint64_t n = 0;
  mr_err e;
  mr_err_clear(&e);
  int rc = es_control_validate((const Moerpc__V1__LayerExperts *const *)items, n_items,
                               fingerprint, "0123456789abcdef", &lim, pairs, &n, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc != MR_EINVAL && rc != MR_EMISMATCH)
      fuzz_control_fail(target, "undocumented code", mr_err_name(rc));
    if (!e.msg[0]) fuzz_control_fail(target, "error without a message", "");
    return;
  }
  uint64_t set = 0;
  for (uint32_t i = 0; i < L * E; i++) {
    if (!pairs[i]) continue;
    set++;
    if (!is_moe[i / E]) fuzz_control_fail(target, "a pair in a dense layer passed", "");
  }
  if (n == 0 || n != set) fuzz_control_fail(target, "pair count differs from the pairs named", "");
  for (size_t i = 0; i < n_items; i++)
    for (size_t k = 0; k < items[i]->n_experts; k++)
      if (!pairs[items[i]->layer * E + items[i]->experts[k]])
        fuzz_control_fail(target, "a named pair is missing", "");
}

#endif /* FUZZ_CONTROL_H */
