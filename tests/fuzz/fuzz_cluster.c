/*
 * fuzz_cluster.c - libFuzzer target for the cluster file reader and, with the same bytes
 * as a NUL-terminated spec, the id-set parser. On success the results must satisfy the
 * documented limits (server count, unique names, deadline range, planning keys' bounds,
 * canonical round trip).
 */
#include "common/mr.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_idset(const uint8_t *data, size_t size) {
  char spec[512];
  if (size >= sizeof spec) return;
  memcpy(spec, data, size);
  spec[size] = '\0';
  mr_idset s, t;
  mr_err e;
  if (mr_idset_parse(&s, spec, 300, "fuzz", &e) != 0) {
    if (e.msg[0] == '\0' || s.bits != NULL) abort();
    return;
  }
  /* format -> parse must give the same set back. */
  char buf[2048];
  size_t need = mr_idset_format(&s, buf, sizeof buf);
  if (need >= sizeof buf) abort(); /* 300 ids never need 2 KiB */
  if (mr_idset_parse(&t, buf, 300, "roundtrip", &e) != 0) abort();
  for (uint32_t i = 0; i < 300; i++)
    if (mr_idset_has(&s, i) != mr_idset_has(&t, i)) abort();
  if (mr_idset_count(&s) != mr_idset_count(&t)) abort();
  mr_idset_close(&t);
  mr_idset_close(&s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static mr_cluster_file c; /* ~84 KiB: not on the stack */
  mr_err e;
  check_idset(data, size);
  int rc = mr_cluster_parse(&c, (const char *)data, size, "fuzz", &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0' || c.n_servers != 0) abort();
    return 0;
  }
  if (c.n_servers < 1 || c.n_servers > MR_CLUSTER_MAX_SERVERS) abort();
  if (c.deadline_ms < 1 || c.deadline_ms > 600000) abort();
  for (uint32_t i = 0; i < c.n_servers; i++) {
    if (!c.servers[i].name[0] || strlen(c.servers[i].name) > 63) abort();
    if (!strchr(c.servers[i].address, ':')) abort();
    /* Planning keys: within their documented bounds, speed defaulted to 1. */
    if (c.servers[i].expert_memory > MR_CLUSTER_MAX_EXPERT_MEMORY) abort();
    if (c.servers[i].numa_nodes > MR_CLUSTER_MAX_NUMA_NODES) abort();
    if (!(c.servers[i].speed > 0) || c.servers[i].speed > MR_CLUSTER_MAX_SPEED) abort();
    for (uint32_t j = 0; j < i; j++)
      if (strcmp(c.servers[i].name, c.servers[j].name) == 0) abort();
  }
  return 0;
}
