/*
 * itest_map.c - experts served in place from the model's files (--map-weights,
 * docs/DESIGN.md section 6.6) against real moerpc-server processes:
 *
 *   in_place_is_bit_identical_to_packing: a bf16 model served in place gives the Forward
 *     outputs of a server that packs it (both layers), says so in its "loaded:" line, and a
 *     LoadExperts of more pairs serves them in place too (the same outputs as a server that
 *     packed them at start); it stops cleanly (the mappings closed after the layers: ASan and
 *     TSan runs of this test check that order);
 *   fp8_in_place_is_bit_identical_to_packing: the same for an FP8 checkpoint (fp8-b128: the
 *     codes in place, the layer's own per-row scales);
 *   where_it_cannot_it_packs: --quant int8, a forced 2-node split and an FP8 checkpoint
 *     served as bf16 are packed as usual with a WARN naming why, and serve what the same
 *     server without --map-weights serves;
 *   with_weight_cache_it_is_refused: --map-weights --weight-cache exits non-zero naming both.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_client/rpc/moerpc_client.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define H 64u
#define T 3u
#define MODEL_FLAGS "--layers 2 --experts 8 --topk 2 --hidden 64 --inter 64 --vocab 64 " \
                    "--heads 2 --kv-heads 1 --head-dim 32 --seed 3"
#define TOKEN "itest-map-token-0123456789abcdef"

static char *tmp;
static char model[600], tok[700];

/* dtype_flags: "" (bf16) or "--dtype fp8" (F8_E4M3 experts with block scales). */
static void setup_dtype(const char *dtype_flags) {
  grpc_init();
  tmp = itu_tmpdir();
  snprintf(model, sizeof model, "%s/m", tmp);
  char flags[400];
  snprintf(flags, sizeof flags, MODEL_FLAGS " %s", dtype_flags);
  MT_EQ_INT(itu_make_model(model, flags), 0);
  snprintf(tok, sizeof tok, "%s/tok", tmp);
  FILE *f = fopen(tok, "w");
  MT_TRUE(f != NULL);
  fputs(TOKEN "\n", f);
  MT_EQ_INT(fclose(f), 0);
  MT_EQ_INT(chmod(tok, 0600), 0);
  itu_client_security(NULL, NULL, NULL, NULL, TOKEN);
}

static void setup(void) { setup_dtype(""); }

static void teardown(void) {
  unsetenv("MOERPC_TEST_FORCE_SPLIT");
  itu_client_security(NULL, NULL, NULL, NULL, NULL);
  itu_rm_rf(tmp);
  grpc_shutdown();
}


static void start(itu_server *s, const char *experts, const char *extra) {
  char args[2000];
  snprintf(args, sizeof args, "--threads 2 --experts %s --auth-token-file %s %s", experts, tok,
           extra);
  MT_EQ_INT(itu_server_start(s, model, args, tmp, 20000), 0);
}

static void stop(itu_server *s) {
  int st = 0;
  MT_EQ_INT(itu_server_stop(s, SIGTERM, 10000, &st), 0);
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static gc_cluster *open_at(const itu_server *s, const char *name) {
  char cluster[700];
  snprintf(cluster, sizeof cluster, "%s/%s-%d.json", tmp, name, s->port);
  FILE *f = fopen(cluster, "w");
  MT_TRUE(f != NULL);
  fprintf(f, "{\"token_file\": \"%s\", \"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}]}\n",
          tok, s->address);
  MT_EQ_INT(fclose(f), 0);
  gc_cluster *c = NULL;
  mr_err e;
  MT_OK(gc_cluster_open(&c, cluster, NULL, &e), &e);
  return c;
}

/* T tokens of `layer` through experts ids (top-2, weights 0.75 / 0.25): out[T * H]. */
static void forward(const itu_server *s, uint32_t layer, const int32_t *ids, float *out) {
  gc_cluster *c = open_at(s, "fwd");
  static float in[T * H];
  for (uint32_t i = 0; i < T * H; i++) in[i] = (float)((int)(i % 13) - 6) * 0.0625f;
  float w[T * 2];
  for (uint32_t t = 0; t < T; t++) {
    w[2 * t] = 0.75f;
    w[2 * t + 1] = 0.25f;
  }
  gc_layer_req q = {.layer = layer, .n_tokens = T, .top_k = 2, .ids = ids, .weights = w, .x = in,
                    .dtype = MR_DTYPE_F32};
  mr_err e;
  MT_OK(gc_layer_forward(c, &q, out, &e), &e);
  gc_cluster_close(c);
}

static const int32_t ids_a[T * 2] = {0, 1, 2, 3, 1, 3};
static const int32_t ids_b[T * 2] = {4, 5, 7, 0, 6, 1};

/* Both layers through ids: out[2 * T * H]. */
static void forward2(const itu_server *s, const int32_t *ids, float *out) {
  forward(s, 0, ids, out);
  forward(s, 1, ids, out + T * H);
}

/* LoadExperts of experts 4-7 in both layers, waited for until DONE. */
static void load_47(const itu_server *s) {
  static uint8_t m[2 * 8];
  memset(m, 0, sizeof m);
  for (int x = 4; x < 8; x++) m[x] = m[8 + x] = 1;
  uint64_t pairs = 0;
  mr_err e;
  MT_OK(itu_load_pairs(s->address, tok, tmp, m, 2, 8, 5000, &pairs, &e), &e);
  MT_EQ_U64(pairs, 8);
}

static void in_place_case(const char *dtype_flags) {
  setup_dtype(dtype_flags);
  itu_server s;
  static float ref_a[2 * T * H], ref_b[2 * T * H], out[2 * T * H];
  start(&s, "0-7", "");
  forward2(&s, ids_a, ref_a);
  forward2(&s, ids_b, ref_b);
  MT_TRUE(strstr(itu_log_text(&s), "served in place") == NULL);
  stop(&s);

  start(&s, "0-7", "--map-weights");
  MT_CONTAINS(itu_log_text(&s), "(16 of 16 served in place from the model's files)");
  forward2(&s, ids_a, out);
  MT_TRUE(memcmp(out, ref_a, sizeof out) == 0);
  forward2(&s, ids_b, out);
  MT_TRUE(memcmp(out, ref_b, sizeof out) == 0);
  stop(&s);

  /* Live apply: experts 4-7 added in place to a server that started with 0-3. */
  start(&s, "0-3", "--map-weights");
  MT_CONTAINS(itu_log_text(&s), "(8 of 8 served in place");
  load_47(&s); /* (a cluster file must cover every expert: Forward after the load) */
  MT_CONTAINS(itu_log_text(&s), "placement: load 1 done");
  forward2(&s, ids_a, out);
  MT_TRUE(memcmp(out, ref_a, sizeof out) == 0);
  forward2(&s, ids_b, out);
  MT_TRUE(memcmp(out, ref_b, sizeof out) == 0);
  stop(&s);
  teardown();
}

MT_TEST(in_place_is_bit_identical_to_packing) { in_place_case(""); }

/* The codes of an FP8 checkpoint served in place, their per-row scales made at load. */
MT_TEST(fp8_in_place_is_bit_identical_to_packing) { in_place_case("--dtype fp8"); }

/* A server with flags and one with flags --map-weights: the second says warn, serves
 * nothing in place and gives the first one's outputs. */
static void expect_packed(const char *flags, const char *warn) {
  itu_server s;
  static float ref[2 * T * H], out[2 * T * H];
  char with[300];
  snprintf(with, sizeof with, "%s --map-weights", flags);
  start(&s, "0-7", flags);
  forward2(&s, ids_a, ref);
  stop(&s);
  start(&s, "0-7", with);
  MT_CONTAINS(itu_log_text(&s), warn);
  MT_TRUE(strstr(itu_log_text(&s), "served in place") == NULL);
  forward2(&s, ids_a, out);
  MT_TRUE(memcmp(out, ref, sizeof out) == 0);
  stop(&s);
}

MT_TEST(where_it_cannot_it_packs) {
  setup();
  /* int8: converted at load, so packed. */
  expect_packed("--quant int8", "--map-weights: the experts are served as int8, not as stored "
                                "(bf16): they are packed as usual");
  /* Two NUMA slices per expert (forced): each slice belongs on its node, so packed. */
  setenv("MOERPC_TEST_FORCE_SPLIT", "2", 1);
  expect_packed("", "--map-weights: the experts are split over 2 NUMA nodes");
  teardown();
  /* An FP8 checkpoint served as bf16: dequantized at load, so packed. */
  setup_dtype("--dtype fp8");
  expect_packed("--quant bf16", "--map-weights: the experts are served as bf16, not as stored "
                                "(fp8): they are packed as usual");
  teardown();
}

MT_TEST(with_weight_cache_it_is_refused) {
  setup();
  itu_server s;
  char args[1200];
  snprintf(args, sizeof args, "--experts all --map-weights --weight-cache %s/cache", tmp);
  MT_EQ_INT(itu_server_spawn(&s, model, args, tmp), 0);
  int st = 0;
  for (int i = 0; i < 1000 && waitpid(s.pid, &st, WNOHANG) == 0; i++) usleep(10000);
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0);
  MT_CONTAINS(itu_log_text(&s), "--map-weights serves the model's files in place: there is nothing "
                            "for --weight-cache DIR to hold");
  teardown();
}

MT_MAIN()
