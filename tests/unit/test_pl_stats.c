/*
 * test_pl_stats.c - the moerpc-stats file (placement/pl_stats.c): good files, every class of
 * bad one refused with the file and field named, and a save/load round trip.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "placement/pl.h"
#include "tests/unit/mt.h"

#define HEAD "{\"format\":\"moerpc-stats\",\"version\":1,\"model_fingerprint\":\"abc\","
#define WIN "\"window\":{\"kind\":\"steps\",\"steps\":5,\"tokens\":7,\"seconds\":1.5},"

static int parse(pl_stats *s, const char *json, mr_err *e) {
  return pl_stats_parse(s, json, strlen(json), "s.json", e);
}

MT_TEST(good_file) {
  pl_stats s;
  mr_err e = {0};
  MT_OK(parse(&s, HEAD "\"num_layers\":2,\"num_experts\":3," WIN
                  "\"sources\":[\"client\",\"s0\"],\"counts\":[[1,2,3],[0,0,9007199254740992]]}", &e), &e);
  MT_EQ_INT(s.num_layers, 2);
  MT_EQ_INT(s.num_experts, 3);
  MT_EQ_STR(s.model_fingerprint, "abc");
  MT_EQ_STR(s.window_kind, "steps");
  MT_EQ_INT(s.steps, 5);
  MT_EQ_INT(s.tokens, 7);
  MT_NEAR(s.seconds, 1.5, 0);
  MT_EQ_INT(s.n_sources, 2);
  MT_EQ_STR(s.sources[1], "s0");
  MT_EQ_INT(s.counts[2], 3);
  MT_TRUE(s.counts[5] == ((uint64_t)1 << 53));
  pl_stats_close(&s);
  /* The minimum: optional fingerprint, sources and window numbers left out. */
  MT_OK(parse(&s, "{\"format\":\"moerpc-stats\",\"version\":1,\"num_layers\":1,\"num_experts\":1,"
                  "\"window\":{\"kind\":\"import\"},\"counts\":[[4]]}", &e), &e);
  MT_EQ_STR(s.model_fingerprint, "");
  MT_EQ_INT(s.n_sources, 0);
  MT_EQ_INT(pl_stats_total(&s), 4);
  pl_stats_close(&s);
}

MT_TEST(bad_files_name_the_field) {
  static const struct { const char *json, *want; } cases[] = {
      {"[]", "top level"},
      {"{\"format\":\"moerpc-stats\"", "invalid JSON"},
      {"{\"format\":\"x\",\"version\":1,\"num_layers\":1,\"num_experts\":1,\"window\":{\"kind\":\"import\"},\"counts\":[[1]]}", "format"},
      {HEAD "\"version\":1,\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[[1]]}", "appears twice"},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[[1]],\"extra\":1}", "unknown key \"extra\""},
      {"{\"format\":\"moerpc-stats\",\"version\":2,\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[[1]]}", "version"},
      {HEAD "\"num_experts\":1," WIN "\"counts\":[[1]]}", "num_layers is missing"},
      {HEAD "\"num_layers\":1," WIN "\"counts\":[[1]]}", "num_experts is missing"},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"counts\":[[1]]}", "window is missing"},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"sources\":[]}", "counts is missing"},
      {HEAD "\"num_layers\":0,\"num_experts\":1," WIN "\"counts\":[]}", "num_layers = 0, must be an integer in 1..1024"},
      {HEAD "\"num_layers\":1025,\"num_experts\":1," WIN "\"counts\":[]}", "1..1024"},
      {HEAD "\"num_layers\":1,\"num_experts\":65537," WIN "\"counts\":[]}", "num_experts = 65537, must be an integer in 1..65536"},
      {HEAD "\"num_layers\":1024,\"num_experts\":65536," WIN "\"counts\":[]}", "at most 4194304 pairs"},
      {HEAD "\"num_layers\":\"1\",\"num_experts\":1," WIN "\"counts\":[[1]]}", "num_layers = \"1\""},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":[]," "\"counts\":[[1]]}", "window = an array, must be an object"},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":{}," "\"counts\":[[1]]}", "window.kind is missing"},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":{\"kind\":\"hours\"}," "\"counts\":[[1]]}", "window.kind = \"hours\""},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":{\"kind\":\"steps\",\"step\":1}," "\"counts\":[[1]]}", "unknown key \"step\" in window"},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":{\"kind\":\"steps\",\"steps\":-1}," "\"counts\":[[1]]}", "window.steps = -1"},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":{\"kind\":\"steps\",\"seconds\":-2}," "\"counts\":[[1]]}", "window.seconds = -2"},
      {HEAD "\"num_layers\":1,\"num_experts\":1,\"window\":{\"kind\":\"steps\",\"seconds\":\"x\"}," "\"counts\":[[1]]}", "window.seconds = \"x\""},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"sources\":\"s0\",\"counts\":[[1]]}", "sources = \"s0\""},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"sources\":[\"\"],\"counts\":[[1]]}", "sources[0] is empty"},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"sources\":[1],\"counts\":[[1]]}", "sources[0] = 1, must be a string"},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":{}}", "counts = an object"},
      {HEAD "\"num_layers\":2,\"num_experts\":1," WIN "\"counts\":[[1]]}", "counts has 1 rows, must be num_layers = 2"},
      {HEAD "\"num_layers\":1,\"num_experts\":2," WIN "\"counts\":[[1]]}", "counts[0] has 1 numbers, must be num_experts = 2"},
      {HEAD "\"num_layers\":1,\"num_experts\":2," WIN "\"counts\":[[1,2,3]]}", "counts[0] has more than num_experts = 2"},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[7]}", "counts[0] = 7, must be an array"},
      {HEAD "\"num_layers\":1,\"num_experts\":2," WIN "\"counts\":[[1,-3]]}", "counts[0][1] = -3"},
      {HEAD "\"num_layers\":1,\"num_experts\":2," WIN "\"counts\":[[1,2.5]]}", "counts[0][1] = 2.5"},
      {HEAD "\"num_layers\":1,\"num_experts\":2," WIN "\"counts\":[[1,\"2\"]]}", "counts[0][1] = \"2\""},
      {HEAD "\"num_layers\":1,\"num_experts\":2," WIN "\"counts\":[[1,1e300]]}", "counts[0][1]"},
      {"{\"format\":\"moerpc-stats\",\"version\":1,\"model_fingerprint\":7,\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[[1]]}", "model_fingerprint = 7"},
      {"{\"format\":\"moerpc-stats\",\"version\":1,\"model_fingerprint\":\"0123456789012345678901234567890123456789012345678901234567890123\",\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[[1]]}", "model_fingerprint has 64 characters, at most 63"},
      {HEAD "\"num_layers\":1,\"num_experts\":1," WIN "\"counts\":[[1]]} x", "trailing data"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    pl_stats s;
    mr_err e = {0};
    int rc = parse(&s, cases[i].json, &e);
    fprintf(stderr, "  %zu: %s\n", i, e.msg);
    MT_TRUE(rc != 0);
    MT_CONTAINS(e.msg, "s.json");
    MT_CONTAINS(e.msg, cases[i].want);
    MT_TRUE(s.counts == NULL);
    pl_stats_close(&s);
  }
}

MT_TEST(round_trip_save_load) {
  pl_stats s, t;
  mr_err e = {0};
  MT_OK(pl_stats_init(&s, 3, 5, &e), &e);
  snprintf(s.model_fingerprint, sizeof s.model_fingerprint, "f00d\"q");
  snprintf(s.window_kind, sizeof s.window_kind, "steps");
  s.steps = 17;
  s.tokens = 99;
  s.seconds = 0.1 + 0.2;
  MT_OK(pl_stats_source_add(&s, "client", &e), &e);
  MT_OK(pl_stats_source_add(&s, "s1", &e), &e);
  for (uint32_t i = 0; i < 15; i++) s.counts[i] = (uint64_t)i * 1000003u + (i == 14 ? (1ull << 52) : 0);
  char path[] = "/tmp/test_pl_stats_XXXXXX";
  int fd = mkstemp(path);
  MT_TRUE(fd >= 0);
  close(fd);
  MT_OK(pl_stats_save(&s, path, &e), &e);
  MT_OK(pl_stats_load(&t, path, &e), &e);
  MT_EQ_INT(t.num_layers, 3);
  MT_EQ_INT(t.num_experts, 5);
  MT_EQ_STR(t.model_fingerprint, "f00d\"q");
  MT_EQ_STR(t.window_kind, "steps");
  MT_EQ_INT(t.steps, 17);
  MT_EQ_INT(t.tokens, 99);
  MT_TRUE(t.seconds == s.seconds); /* %.17g: exact */
  MT_EQ_INT(t.n_sources, 2);
  MT_EQ_STR(t.sources[0], "client");
  MT_TRUE(memcmp(s.counts, t.counts, 15 * sizeof *s.counts) == 0);
  /* add: shapes must match; counts, steps and tokens sum. */
  MT_OK(pl_stats_add(&t, &s, &e), &e);
  MT_EQ_INT(t.counts[3], 2 * s.counts[3]);
  MT_EQ_INT(t.steps, 34);
  MT_EQ_INT(t.n_sources, 2); /* the same two sources, listed once */
  pl_stats u;
  MT_OK(pl_stats_init(&u, 3, 4, &e), &e);
  MT_TRUE(pl_stats_add(&t, &u, &e) == MR_EINVAL);
  MT_CONTAINS(e.msg, "3 x 4");
  /* A missing file and a directory are named. */
  MT_TRUE(pl_stats_load(&u, "/nonexistent/s.json", &e) != 0);
  MT_CONTAINS(e.msg, "/nonexistent/s.json");
  MT_TRUE(pl_stats_save(&s, "/nonexistent/dir/s.json", &e) == MR_EIO);
  MT_CONTAINS(e.msg, "/nonexistent/dir/s.json");
  unlink(path);
  pl_stats_close(&s);
  pl_stats_close(&t);
  pl_stats_close(&u);
}

MT_TEST(init_limits) {
  pl_stats s;
  mr_err e = {0};
  MT_TRUE(pl_stats_init(&s, 0, 4, &e) == MR_ERANGE);
  MT_TRUE(pl_stats_init(&s, 4, 65537, &e) == MR_ERANGE);
  MT_TRUE(pl_stats_init(&s, 1024, 8192, &e) == MR_ERANGE);
  MT_CONTAINS(e.msg, "4194304");
  MT_OK(pl_stats_init(&s, 1, 1, &e), &e);
  char name[80];
  memset(name, 'a', 70);
  name[70] = '\0';
  MT_TRUE(pl_stats_source_add(&s, name, &e) == MR_ERANGE);
  for (uint32_t i = 0; i < PL_STATS_MAX_SOURCES; i++) {
    char n[16];
    snprintf(n, sizeof n, "s%u", i);
    MT_OK(pl_stats_source_add(&s, n, &e), &e);
    MT_OK(pl_stats_source_add(&s, n, &e), &e); /* listed once */
  }
  MT_EQ_INT(s.n_sources, PL_STATS_MAX_SOURCES);
  MT_TRUE(pl_stats_source_add(&s, "x", &e) == MR_ERANGE);
  pl_stats_close(&s);
}

MT_MAIN()
