/*
 * fuzz_placement.c - libFuzzer target for the placement file reader (common/placement.c).
 * On success the result must satisfy its documented invariants: every route names a
 * server of the list, no pair is both local and routed, n_local counts the local flags,
 * and the replica lists (copies, rep_off, rep) agree with route and name distinct servers.
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
  uint64_t single = 0, repl = 0;
  if (p.rep_off[0] != 0 || p.rep_off[pairs] != p.n_copies) abort();
  for (size_t i = 0; i < pairs; i++) {
    uint32_t c = p.copies[i];
    if (p.rep_off[i + 1] - p.rep_off[i] != c) abort();
    if (p.local[i] && c) abort();
    if (c == 1) single++;
    if (c > 1) repl++;
    if (c == 1 ? p.route[i] != p.rep[p.rep_off[i]] : p.route[i] != -1) abort();
    for (uint32_t a = p.rep_off[i]; a < p.rep_off[i + 1]; a++) {
      if (p.rep[a] < 0 || p.rep[a] >= (int32_t)p.n_servers) abort();
      for (uint32_t b = p.rep_off[i]; b < a; b++)
        if (p.rep[a] == p.rep[b]) abort();
    }
  }
  if (single != p.n_single || repl != p.n_replicated) abort();
  for (uint32_t i = 0; i < p.n_servers; i++)
    if (!p.server[i][0] || strlen(p.server[i]) > 63) abort();
  mr_placement_close(&p);
  return 0;
}
