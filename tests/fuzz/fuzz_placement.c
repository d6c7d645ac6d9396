/*
 * fuzz_placement.c - libFuzzer target for the placement file reader (common/placement.c).
 * On success the result must satisfy its documented invariants: every route names a
 * server of the list, no pair is both local and routed, n_local counts the local flags.
 */
#include "common/mr.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  mr_placement p;
  mr_err e;
  int rc = mr_placement_parse(&p, (const char *)data, size, "fuzz", &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0' || p.local || p.route || p.server) abort();
    return 0;
  }
  size_t pairs = (size_t)p.num_layers * p.num_experts;
  uint64_t n_local = 0;
  for (size_t i = 0; i < pairs; i++) {
    n_local += p.local[i];
    if (p.route[i] < -1 || p.route[i] >= (int32_t)p.n_servers) abort();
    if (p.local[i] && p.route[i] >= 0) abort();
  }
  if (n_local != p.n_local) abort();
  for (uint32_t i = 0; i < p.n_servers; i++)
    if (!p.server[i][0] || strlen(p.server[i]) > 63) abort();
  mr_placement_close(&p);
  return 0;
}
