/*
 * itest_apply.c - the control RPCs against a real moerpc-server (docs/DESIGN.md section 15),
 * through the library's typed control calls (gc_control_*) and gc_layer_forward:
 *
 *   unloaded_expert_gets_a_per_request_error: a client opened before UnloadExperts (the
 *     server runs with --unload-grace 0) still routes expert 5 to s0; the request gets
 *     FAILED_PRECONDITION, the client re-Hellos, finds no server serving it and fails that
 *     request naming the expert, the layer and the servers asked; the stream keeps serving
 *     (expert 0 on the same server still computes, same output as before), and after a
 *     LoadExperts of it again the client re-Hellos and it is served with the same output;
 *   an_fp8_model_reloads_the_same_numbers_packed_and_in_place: the same unload and load of
 *     an expert of an FP8 checkpoint, packed and with --map-weights (in place);
 *   load_refusals: LoadStatus of an unknown load_id is NOT_FOUND, a dense or out-of-range
 *     layer INVALID_ARGUMENT, over --max-expert-memory RESOURCE_EXHAUSTED naming the bytes,
 *     another model's fingerprint FAILED_PRECONDITION; nothing changes (Hello's owned
 *     generation stays).
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "gpu_client/rpc/moerpc_client.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define H 64u

static char *tmp;
static char model[600], cluster[700], tok[700];
static itu_server s0;

/* model_flags: more moerpc-mkmodel flags (--dtype fp8). */
static void setup_model(const char *model_flags, const char *extra_flags) {
  grpc_init();
  tmp = itu_tmpdir();
  snprintf(model, sizeof model, "%s/m", tmp);
  char mflags[400];
  snprintf(mflags, sizeof mflags, "--layers 2 --experts 8 --topk 2 --hidden 64 --inter 32 "
           "--vocab 64 --heads 2 --kv-heads 1 --head-dim 32 %s", model_flags);
  MT_EQ_INT(itu_make_model(model, mflags), 0);
  snprintf(tok, sizeof tok, "%s/tok", tmp);
  FILE *f = fopen(tok, "w");
  MT_TRUE(f != NULL);
  fputs("itest-apply-token-0123456789\n", f);
  MT_EQ_INT(fclose(f), 0);
  MT_EQ_INT(chmod(tok, 0600), 0); /* a token file readable by others is refused */
  char extra[1200];
  snprintf(extra, sizeof extra, "--experts 0-7 --threads 1 --auth-token-file %s --unload-grace 0 %s",
           tok, extra_flags);
  itu_client_security(NULL, NULL, NULL, NULL, "itest-apply-token-0123456789");
  MT_EQ_INT(itu_server_start(&s0, model, extra, tmp, 20000), 0);
  snprintf(cluster, sizeof cluster, "%s/cluster.json", tmp);
  f = fopen(cluster, "w");
  MT_TRUE(f != NULL);
  fprintf(f, "{\"token_file\": \"%s\", \"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}]}\n",
          tok, s0.address);
  MT_EQ_INT(fclose(f), 0);
}

static void setup(const char *extra_flags) { setup_model("", extra_flags); }

static void teardown(void) {
  int st = 0;
  itu_server_stop(&s0, SIGTERM, 10000, &st);
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

static uint64_t owned_generation(gc_cluster *c) {
  gc_hello_info h;
  mr_err e;
  MT_OK(gc_control_hello(c, 0, &h, &e), &e);
  MT_EQ_INT(h.protocol_minor, PR_PROTOCOL_MINOR);
  uint64_t g = h.owned_generation;
  gc_hello_info_close(&h);
  return g;
}

/* One token of layer 1 through expert x (weight 1). */
static int forward(gc_cluster *c, int32_t x, float *out, mr_err *e) {
  static float in[H];
  for (uint32_t i = 0; i < H; i++) in[i] = (float)((int)(i % 7) - 3) * 0.125f;
  int32_t ids[1] = {x};
  float w[1] = {1.0f};
  gc_layer_req q = {.layer = 1, .n_tokens = 1, .top_k = 1, .ids = ids, .weights = w, .x = in,
                    .dtype = MR_DTYPE_F32};
  return gc_layer_forward(c, &q, out, e);
}

/* A pairs mask of L layers x 8 experts with (layer, x) set for each x of xs. */
static uint8_t *pairs_mask(uint32_t L, uint32_t layer, const uint32_t *xs, size_t n) {
  static uint8_t m[4 * 8];
  MT_TRUE(L <= 4);
  memset(m, 0, sizeof m);
  for (size_t i = 0; i < n; i++) m[layer * 8 + xs[i]] = 1;
  return m;
}

MT_TEST(unloaded_expert_gets_a_per_request_error) {
  setup("");
  mr_err e;
  mr_cluster_file cf;
  MT_OK(mr_cluster_load(&cf, cluster, &e), &e);
  gc_cluster *ctl = NULL, *cl = NULL;
  MT_OK(gc_control_open(&ctl, &cf, &e), &e);
  MT_OK(gc_cluster_open(&cl, cluster, NULL, &e), &e);
  uint64_t g0 = owned_generation(ctl);
  float ref0[H], ref5[H], out[H];
  MT_OK(forward(cl, 0, ref0, &e), &e);
  MT_OK(forward(cl, 5, ref5, &e), &e);

  uint32_t five[] = {5};
  gc_unload_result ur;
  MT_OK(gc_control_unload(ctl, 0, pairs_mask(2, 1, five, 1), 2, 8, "", &ur, &e), &e);
  MT_EQ_U64(ur.pairs, 1);
  MT_EQ_U64(ur.owned_generation, g0 + 1);

  /* The old client still routes 5 to s0: it re-Hellos, finds that no server serves it any
   * more, and fails that request only, naming the expert, the layer and the servers. */
  MT_EQ_INT(forward(cl, 5, out, &e), MR_EPRECOND);
  MT_CONTAINS(e.msg, "expert 5");
  MT_CONTAINS(e.msg, "not served");
  MT_CONTAINS(e.msg, "layer 1: expert 5 is served by no live server after a re-Hello");
  MT_CONTAINS(e.msg, "asked server s0 (");
  MT_OK(forward(cl, 0, out, &e), &e);
  MT_TRUE(memcmp(out, ref0, sizeof out) == 0);

  /* Load it again: served again, same numbers (same file, same packing). */
  gc_load_started ls;
  MT_OK(gc_control_load(ctl, 0, pairs_mask(2, 1, five, 1), 2, 8, "", &ls, &e), &e);
  MT_EQ_U64(ls.pairs, 1);
  MT_EQ_U64(ls.tensors_total, 3);
  MT_OK(itu_load_wait(ctl, ls.load_id, 5000, &e), &e);
  MT_EQ_U64(owned_generation(ctl), g0 + 2);
  /* The client re-Hellos for an expert no server announced at most every 200 ms
   * (GC__UNANNOUNCED_GAP_MS), then finds it on s0 again. */
  usleep(250000);
  MT_OK(forward(cl, 5, out, &e), &e);
  MT_TRUE(memcmp(out, ref5, sizeof out) == 0);
  gc_cluster_close(cl);
  gc_cluster_close(ctl);
  teardown();
}

/* An FP8 checkpoint (fp8-b128 served as stored): an expert unloaded and loaded again by
 * LoadExperts computes what it did, packed and, with --map-weights, served in place from
 * the file (the codes; the layer holds their per-row scales). */
MT_TEST(an_fp8_model_reloads_the_same_numbers_packed_and_in_place) {
  for (int map = 0; map < 2; map++) {
    setup_model("--dtype fp8", map ? "--map-weights" : "");
    mr_err e;
    mr_cluster_file cf;
    MT_OK(mr_cluster_load(&cf, cluster, &e), &e);
    gc_cluster *ctl = NULL, *cl = NULL;
    MT_OK(gc_control_open(&ctl, &cf, &e), &e);
    MT_OK(gc_cluster_open(&cl, cluster, NULL, &e), &e);
    gc_hello_info h;
    MT_OK(gc_control_hello(ctl, 0, &h, &e), &e);
    MT_EQ_STR(h.weight_format, "fp8-b128");
    gc_hello_info_close(&h);
    float ref5[H], out[H];
    MT_OK(forward(cl, 5, ref5, &e), &e);
    uint32_t five[] = {5};
    gc_unload_result ur;
    MT_OK(gc_control_unload(ctl, 0, pairs_mask(2, 1, five, 1), 2, 8, "", &ur, &e), &e);
    MT_EQ_U64(ur.pairs, 1);
    gc_load_started ls;
    MT_OK(gc_control_load(ctl, 0, pairs_mask(2, 1, five, 1), 2, 8, "", &ls, &e), &e);
    MT_OK(itu_load_wait(ctl, ls.load_id, 5000, &e), &e);
    usleep(250000); /* the client's next re-Hello for an unannounced expert (see above) */
    MT_OK(forward(cl, 5, out, &e), &e);
    MT_TRUE(memcmp(out, ref5, sizeof out) == 0);
    MT_CONTAINS(itu_log_text(&s0), map ? "1 pairs in place" : "0 pairs in place");
    if (map) MT_CONTAINS(itu_log_text(&s0), "(16 of 16 served in place from the model's files)");
    gc_cluster_close(cl);
    gc_cluster_close(ctl);
    teardown();
  }
}

MT_TEST(load_refusals) {
  setup("--max-expert-memory 20K");
  mr_err e;
  mr_cluster_file cf;
  MT_OK(mr_cluster_load(&cf, cluster, &e), &e);
  gc_cluster *ctl = NULL;
  MT_OK(gc_control_open(&ctl, &cf, &e), &e);
  uint64_t g0 = owned_generation(ctl);
  gc_load_progress p;
  MT_EQ_INT(gc_control_load_status(ctl, 0, 77, &p, &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "load_id = 77: unknown");
  uint32_t ids[] = {1, 2};
  gc_load_started ls;
  /* a layer the server does not have (it has 2): the mask is for 3 layers */
  MT_EQ_INT(gc_control_load(ctl, 0, pairs_mask(3, 2, ids, 2), 3, 8, "", &ls, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "layers[0].layer = 2, must be < num_layers = 2");
  /* Unload both experts of layer 1, then loading them back is over 20 KB of weights. */
  gc_unload_result ur;
  MT_OK(gc_control_unload(ctl, 0, pairs_mask(2, 1, ids, 2), 2, 8, "", &ur, &e), &e);
  MT_EQ_INT(gc_control_load(ctl, 0, pairs_mask(2, 1, ids, 2), 2, 8, "", &ls, &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "RESOURCE_EXHAUSTED");
  MT_CONTAINS(e.msg, "loading needs 24576 bytes");
  MT_EQ_INT(gc_control_load(ctl, 0, pairs_mask(2, 1, ids, 2), 2, 8, "ffffffffffffffff", &ls, &e), MR_EPRECOND);
  MT_CONTAINS(e.msg, "model_fingerprint");
  MT_EQ_U64(owned_generation(ctl), g0 + 1); /* only the unload changed anything */
  gc_cluster_close(ctl);
  teardown();
}

MT_MAIN()
