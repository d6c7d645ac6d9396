/*
 * fuzz_pl_stats.c - libFuzzer target for the moerpc-stats reader (placement/pl_stats.c).
 * A refusal must come with a message and leave nothing allocated; an accepted file must
 * satisfy the documented limits and survive a round trip through the writer unchanged.
 */
#include "placement/pl.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  pl_stats s, t;
  mr_err e;
  int rc = pl_stats_parse(&s, (const char *)data, size, "fuzz", &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0' || s.counts) abort();
    return 0;
  }
  if (!s.counts || s.num_layers < 1 || s.num_layers > MR_MAX_LAYERS || s.num_experts < 1 ||
      s.num_experts > PL_STATS_MAX_EXPERTS ||
      (uint64_t)s.num_layers * s.num_experts > PL_STATS_MAX_PAIRS || s.n_sources > PL_STATS_MAX_SOURCES)
    abort();
  if (strcmp(s.window_kind, "steps") && strcmp(s.window_kind, "since_reset") &&
      strcmp(s.window_kind, "import"))
    abort();
  for (size_t i = 0; i < (size_t)s.num_layers * s.num_experts; i++)
    if (s.counts[i] > ((uint64_t)1 << 53)) abort();
  char *text = NULL;
  size_t len = 0;
  if (pl_stats_format(&s, &text, &len, &e) != 0) abort();
  if (pl_stats_parse(&t, text, len, "fuzz round trip", &e) != 0) abort();
  if (t.num_layers != s.num_layers || t.num_experts != s.num_experts || t.steps != s.steps ||
      t.tokens != s.tokens || t.n_sources != s.n_sources || strcmp(t.window_kind, s.window_kind) ||
      strcmp(t.model_fingerprint, s.model_fingerprint) ||
      memcmp(t.counts, s.counts, (size_t)s.num_layers * s.num_experts * sizeof *s.counts))
    abort();
  for (uint32_t i = 0; i < s.n_sources; i++)
    if (strcmp(t.sources[i], s.sources[i])) abort();
  mr_free(text);
  pl_stats_close(&t);
  pl_stats_close(&s);
  return 0;
}
