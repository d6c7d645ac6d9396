/*
 * test_gc_routing.c - the client's routing counters (gpu_client/gc_routing.c): the sliding
 * window (counts leave it after `window` steps, never before), the since-start total, reset,
 * concurrent counting, and the JSON being a moerpc-stats file that placement reads back.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_client/rpc/moerpc_client.h"
#include "placement/pl.h"
#include "tests/unit/mt.h"

static const int32_t NONE[4] = {-1, -1, -1, -1};

/* One step of a 2-layer model (layer 1 ends it) with no routed slot. */
static void empty_step(gc_routing *r) { gc_routing_count(r, 1, NONE, 4, 2, true); }

static uint64_t window_count(gc_routing *r, size_t i, uint64_t *steps) {
  gc_routing_counts c;
  mr_err e = {0};
  MT_OK(gc_routing_get(r, GC_ROUTING_WINDOW, &c, &e), &e);
  uint64_t v = c.counts[i];
  if (steps) *steps = c.steps;
  gc_routing_counts_close(&c);
  return v;
}

MT_TEST(window_keeps_counts_window_steps_then_drops_them) {
  gc_routing *r = NULL;
  mr_err e = {0};
  const uint32_t W = 32, per = W / GC_ROUTING_BUCKETS; /* 2 steps a bucket */
  MT_OK(gc_routing_new(&r, 2, 8, W, 1, &e), &e);
  MT_EQ_INT(gc_routing_window(r), W);
  const int32_t ids[4] = {3, 5, -1, 3}; /* 2 tokens x top-2 of layer 0 */
  gc_routing_count(r, 0, ids, 4, 2, true); /* not the last layer: no step */
  empty_step(r);                          /* step 1 ends */
  uint64_t steps = 0;
  MT_EQ_INT(window_count(r, 3, &steps), 2);
  MT_EQ_INT(window_count(r, 5, NULL), 1);
  MT_EQ_INT(steps, 1);
  /* W more steps: still in the window (it is kept at least W steps). */
  for (uint32_t s = 0; s < W; s++) empty_step(r);
  MT_EQ_INT(window_count(r, 3, &steps), 2);
  /* Within W + per steps after its own it is gone, and the window covers >= W steps. */
  for (uint32_t s = 0; s < per; s++) empty_step(r);
  MT_EQ_INT(window_count(r, 3, &steps), 0);
  MT_TRUE(steps >= W && steps <= W + per);
  /* The total keeps everything. */
  gc_routing_counts t;
  MT_OK(gc_routing_get(r, GC_ROUTING_TOTAL, &t, &e), &e);
  MT_EQ_INT(t.counts[3], 2);
  MT_EQ_INT(t.counts[5], 1);
  MT_EQ_INT(t.steps, 1 + W + per);
  MT_EQ_INT(t.tokens, 2 * (1 + W + per));
  gc_routing_counts_close(&t);
  gc_routing_reset(r);
  MT_OK(gc_routing_get(r, GC_ROUTING_TOTAL, &t, &e), &e);
  MT_EQ_INT(t.counts[3], 0);
  MT_EQ_INT(t.steps, 0);
  gc_routing_counts_close(&t);
  gc_routing_free(r);
}

/* A window shorter than the bucket count is exact: one-step buckets. */
MT_TEST(small_window_is_exact) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_OK(gc_routing_new(&r, 2, 8, 3, 1, &e), &e);
  const int32_t ids[1] = {6};
  gc_routing_count(r, 1, ids, 1, 1, true); /* step 1 routes expert 6 */
  uint64_t steps = 0;
  for (int s = 0; s < 3; s++) {
    MT_EQ_INT(window_count(r, 8 + 6, &steps), 1);
    MT_EQ_INT(steps, 1 + s);
    empty_step(r);
  }
  MT_EQ_INT(window_count(r, 8 + 6, &steps), 0); /* 3 steps later it is gone */
  MT_EQ_INT(steps, 3);
  gc_routing_free(r);
}

MT_TEST(deferred_part_is_no_second_step_and_bad_ids_are_skipped) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_OK(gc_routing_new(&r, 2, 8, 0, 1, &e), &e);
  MT_EQ_INT(gc_routing_window(r), GC_ROUTING_DEFAULT_WINDOW);
  const int32_t ids[4] = {1, 8, -7, 7}; /* 8 and -7: out of range, skipped */
  gc_routing_count(r, 1, ids, 4, 2, true);
  gc_routing_count(r, 1, ids, 2, 2, false); /* a deferred part: counts, no step */
  gc_routing_count(r, 5, ids, 4, 2, true);  /* beyond the layers: ignored */
  gc_routing_counts c;
  MT_OK(gc_routing_get(r, GC_ROUTING_WINDOW, &c, &e), &e);
  MT_EQ_INT(c.steps, 1);
  MT_EQ_INT(c.tokens, 2);
  MT_EQ_INT(c.counts[8 + 1], 2);
  MT_EQ_INT(c.counts[8 + 7], 1);
  uint64_t sum = 0;
  for (int i = 0; i < 16; i++) sum += c.counts[i];
  MT_EQ_INT(sum, 3);
  gc_routing_counts_close(&c);
  gc_routing_free(r);
}

/* A call with many slots per expert (the stack-histogram path) counts the same. */
MT_TEST(large_call_counts_exact) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_OK(gc_routing_new(&r, 1, 8, 0, 0, &e), &e);
  int32_t ids[400];
  uint64_t want[8] = {0};
  for (int i = 0; i < 400; i++) {
    ids[i] = i % 11 == 0 ? -1 : i % 13 == 0 ? 9 : (int32_t)((i * 7) % 8);
    if (ids[i] >= 0 && ids[i] < 8) want[ids[i]]++;
  }
  gc_routing_count(r, 0, ids, 400, 100, true);
  gc_routing_count(r, 0, ids, 3, 1, true); /* and a small one: the atomic path */
  for (int i = 0; i < 3; i++)
    if (ids[i] >= 0 && ids[i] < 8) want[ids[i]]++;
  gc_routing_counts c;
  MT_OK(gc_routing_get(r, GC_ROUTING_TOTAL, &c, &e), &e);
  for (int x = 0; x < 8; x++) MT_EQ_INT(c.counts[x], want[x]);
  MT_EQ_INT(c.steps, 2);
  MT_EQ_INT(c.tokens, 101);
  gc_routing_counts_close(&c);
  gc_routing_free(r);
}

MT_TEST(limits) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_TRUE(gc_routing_new(&r, 0, 8, 0, 0, &e) == MR_ERANGE);
  MT_TRUE(gc_routing_new(&r, 2, 65537, 0, 0, &e) == MR_ERANGE);
  MT_TRUE(gc_routing_new(&r, 2, 8, GC_ROUTING_MAX_WINDOW + 1, 0, &e) == MR_ERANGE);
  MT_CONTAINS(e.msg, "routing window");
  MT_TRUE(gc_routing_new(&r, 2, 8, 0, 2, &e) == MR_ERANGE);
  MT_TRUE(r == NULL);
  gc_routing_count(NULL, 0, NONE, 4, 1, true); /* no counters: a no-op */
  gc_routing_counts c;
  MT_TRUE(gc_routing_get(NULL, GC_ROUTING_WINDOW, &c, &e) == MR_EINVAL);
}

typedef struct worker {
  gc_routing *r;
  uint32_t layer;
} worker;

static void *count_many(void *arg) {
  worker *w = arg;
  const int32_t ids[4] = {0, 1, 2, 3};
  for (int i = 0; i < 20000; i++) gc_routing_count(w->r, w->layer, ids, 4, 1, true);
  return NULL;
}

MT_TEST(concurrent_counts_are_exact) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_OK(gc_routing_new(&r, 2, 4, 64, 1, &e), &e);
  worker w[4] = {{r, 0}, {r, 1}, {r, 0}, {r, 1}};
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, count_many, &w[i]);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  gc_routing_counts t, c;
  MT_OK(gc_routing_get(r, GC_ROUTING_TOTAL, &t, &e), &e);
  for (int i = 0; i < 8; i++) MT_EQ_INT(t.counts[i], 40000);
  MT_EQ_INT(t.steps, 40000);
  /* The window: whole buckets of layer-1 steps, each step one count of every expert of
   * layer 1, so counts[layer 1] == its steps exactly. */
  MT_OK(gc_routing_get(r, GC_ROUTING_WINDOW, &c, &e), &e);
  MT_TRUE(c.steps >= 64 && c.steps <= 68);
  for (int x = 0; x < 4; x++) MT_EQ_INT(c.counts[4 + x], c.steps);
  gc_routing_counts_close(&t);
  gc_routing_counts_close(&c);
  gc_routing_free(r);
}

/* The cost of counting: ns per slot of a decode-sized and a prefill-sized call (printed,
 * with a loose bound: the counters must stay far below a layer call's microseconds). */
MT_TEST(cost_per_slot) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_OK(gc_routing_new(&r, 61, 256, 1024, 60, &e), &e); /* DeepSeek-V3's shape */
  static int32_t ids[4096 * 8];
  for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) ids[i] = (int32_t)((i * 2654435761u) % 256);
  const uint32_t Ts[2] = {4, 4096};
  for (int c = 0; c < 2; c++) {
    uint32_t T = Ts[c];
    uint64_t iters = c ? 200 : 200000, t0 = mr_now_ns();
    for (uint64_t i = 0; i < iters; i++) gc_routing_count(r, (uint32_t)(i % 61), ids, (size_t)T * 8, T, true);
    double ns = (double)(mr_now_ns() - t0) / ((double)iters * T * 8);
    fprintf(stderr, "  routing count: T=%u top-8: %.2f ns per slot (%.0f ns per call)\n", T, ns,
            ns * T * 8);
    /* A guard against a pathological count (an allocation or a lock per slot), not a
     * speed figure: ~1-4 ns here; 200 ns leaves room for a loaded host, and a sanitizer
     * build (5-50x slower) is not timed. */
    const char *san = getenv("SANITIZER");
    if (!san || !*san) MT_TRUE(ns < 200);
  }
  gc_routing_free(r);
}

MT_TEST(json_is_a_moerpc_stats_file) {
  gc_routing *r = NULL;
  mr_err e = {0};
  MT_OK(gc_routing_new(&r, 3, 5, 16, 2, &e), &e);
  const int32_t ids[2] = {4, 0};
  gc_routing_count(r, 0, ids, 2, 1, true);
  gc_routing_count(r, 2, ids, 2, 1, true);
  for (int span = 0; span < 2; span++) {
    mr_buf p;
    mr_buf_init(&p);
    MT_OK(gc_routing_json(r, (gc_routing_span)span, "f1ab", &p, &e), &e);
    pl_stats s;
    MT_OK(pl_stats_parse(&s, p.buf, p.len, "/routing", &e), &e);
    MT_EQ_STR(s.window_kind, span ? "since_reset" : "steps");
    MT_EQ_STR(s.model_fingerprint, "f1ab");
    MT_EQ_INT(s.num_layers, 3);
    MT_EQ_INT(s.num_experts, 5);
    MT_EQ_INT(s.steps, 1);
    MT_EQ_INT(s.tokens, 1);
    MT_EQ_INT(s.counts[4], 1);
    MT_EQ_INT(s.counts[10], 1);
    MT_EQ_INT(s.counts[14], 1);
    MT_EQ_INT(pl_stats_total(&s), 4);
    MT_EQ_STR(s.sources[0], "client");
    /* The same bytes as placement's own writer. */
    char *text = NULL;
    size_t len = 0;
    MT_OK(pl_stats_format(&s, &text, &len, &e), &e);
    /* seconds differ in their digits only if the writers differ: compare up to "seconds". */
    MT_TRUE(len > 0 && strncmp(text, p.buf, (size_t)(strstr(p.buf, "\"seconds\"") - p.buf)) == 0);
    MT_TRUE(strcmp(strstr(text, "\"sources\""), strstr(p.buf, "\"sources\"")) == 0);
    mr_free(text);
    pl_stats_close(&s);
    mr_buf_close(&p);
  }
  char path[64];
  snprintf(path, sizeof path, "/tmp/test_gc_routing_%d.json", (int)getpid());
  MT_OK(gc_routing_save(r, GC_ROUTING_WINDOW, "f1ab", path, &e), &e);
  pl_stats s;
  MT_OK(pl_stats_load(&s, path, &e), &e);
  MT_EQ_INT(pl_stats_total(&s), 4);
  pl_stats_close(&s);
  remove(path);
  MT_TRUE(gc_routing_save(r, GC_ROUTING_WINDOW, "", "/nonexistent/x.json", &e) == MR_EIO);
  MT_CONTAINS(e.msg, "/nonexistent/x.json");
  gc_routing_free(r);
}

MT_MAIN()
