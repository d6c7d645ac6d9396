/*
 * fuzz_unload_request.c - libFuzzer target: an UnloadRequest (control, protocol 1.2) as the server
 * receives it (a byte buffer of several slices, fuzz_bb.h), decoded by pr_decode with the
 * server's limit (ES_MAX_CONTROL_REQUEST_BYTES_LARGE) and checked by es_control_validate
 * against a model of 4 layers (layer 0 dense) x 16 experts, as es__on_unload does.
 *
 * Accepted = decoded and valid. Checked beyond "no crash, no leak, no UB": a decode failure
 * follows pr_decode's contract (fuzz_pr_decode); a validation failure is MR_EINVAL or
 * MR_EMISMATCH with a message; on success at least one pair is named, every named pair is
 * inside the model and in a MoE layer, and the count is that of the distinct pairs.
 */
#include <stdio.h>
#include <string.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

#define L 4
#define E 16

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_unload_request: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  Moerpc__V1__UnloadRequest *req = (Moerpc__V1__UnloadRequest *)fuzz_pr_decode(
      "fuzz_unload_request", bb, &moerpc__v1__unload_request__descriptor, ES_MAX_CONTROL_REQUEST_BYTES_LARGE);
  grpc_byte_buffer_destroy(bb);
  if (!req) return 0;
  static const uint8_t is_moe[L] = {0, 1, 1, 1};
  es_limits lim = {.num_layers = L, .num_experts = E, .hidden_size = 8, .max_tokens = 4,
                   .is_moe = is_moe};
  static uint8_t pairs[L * E];
  uint64_t n = 0;
  mr_err e;
  mr_err_clear(&e);
  int rc = es_control_validate((const Moerpc__V1__LayerExperts *const *)req->drop, req->n_drop,
                               req->model_fingerprint, "0123456789abcdef", &lim, pairs, &n, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc != MR_EINVAL && rc != MR_EMISMATCH) fuzz_fail("undocumented code", mr_err_name(rc));
    if (!e.msg[0]) fuzz_fail("error without a message", "");
  } else {
    uint64_t set = 0;
    for (uint32_t i = 0; i < L * E; i++) {
      if (!pairs[i]) continue;
      set++;
      if (!is_moe[i / E]) fuzz_fail("a pair in a dense layer passed", "");
    }
    if (n == 0 || n != set) fuzz_fail("pair count differs from the pairs named", "");
    for (size_t i = 0; i < req->n_drop; i++)
      for (size_t k = 0; k < req->drop[i]->n_experts; k++)
        if (!pairs[req->drop[i]->layer * E + req->drop[i]->experts[k]])
          fuzz_fail("a named pair is missing", "");
  }
  moerpc__v1__unload_request__free_unpacked(req, NULL);
  return 0;
}
