/*
 * fuzz_cache_manifest.c - libFuzzer target for the weight cache's manifest reader
 * (es_cache_manifest_check, expert_server/es_cache.c; docs/DESIGN.md section 23): the text
 * of DIR/manifest.json, checked against a fixed server (4 layers x 16 experts, hidden 64,
 * inter 32, bf16 on avx512, two NUMA slices of 16 rows and 4096 bytes each).
 *
 * Checked beyond "no crash, no leak, no UB": a refusal is MR_EMISMATCH, MR_EFORMAT or
 * MR_ENOMEM with a message; an accepted manifest has 1..4096 segments. Accepted = 0.
 */
#include <stdio.h>
#include <stdlib.h>

#include "expert_server/es.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint32_t off[2] = {0, 16}, len[2] = {16, 16};
  static const uint64_t bytes[2] = {4096, 4096};
  const es_cache_want w = {.fingerprint = "0123456789abcdef", .model_stamp = "fedcba9876543210",
                           .model_dir = "/models/m", .format = "bf16", .isa = "avx512",
                           .hidden = 64, .inter = 32, .num_layers = 4, .num_experts = 16,
                           .n_slices = 2, .slice_off = off, .slice_len = len, .slice_bytes = bytes};
  mr_err e;
  mr_err_clear(&e);
  uint32_t n = 0;
  int rc = es_cache_manifest_check(&w, (const char *)data, size, "fuzz/manifest.json", &n, &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if ((rc != MR_EMISMATCH && rc != MR_EFORMAT && rc != MR_ENOMEM) || e.msg[0] == '\0') {
      fprintf(stderr, "fuzz_cache_manifest: refused with code %d (%s): %s\n", rc, mr_strerror(rc), e.msg);
      abort();
    }
    return 0;
  }
  if (n < 1 || n > 4096) abort();
  return 0;
}
