/*
 * itest_placement.c - placement must not change results (docs/DESIGN.md section 5), and a dead
 * or slow server is an error naming it, never a hang.
 *
 * Real processes on loopback: servers A (experts 0-7), B (8-15) and C (all) over one model;
 * the same layer calls go through cluster {A, B}, cluster {C}, cluster {A + local 8-15}
 * and the local kn_ref; fp32 wire results agree to 1e-5 (summation order only), bf16 wire
 * within bf16 rounding. Cases: T = 1, a few tokens, T = max_tokens and T > max_tokens
 * (split by the client), tokens that touch one server only, empty slots, a token with
 * every slot empty. The local experts served in place from the model's files
 * (local_map_weights) give the packed copy's sums bit for bit. Then: mismatched fingerprints and uncovered experts refuse to open,
 * SIGSTOP (slow) gives MR_ETIMEDOUT and SIGKILL (dead) MR_EUNAVAIL, each naming the server.
 */
#include <grpc/grpc.h>
#include <signal.h>

#include "gpu_client/rpc/moerpc_client.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define H 128
#define E 16
#define K 4
#define LAYERS 3
#define MAXTOK 64

static char *tmp;
static char model[600], model2[600];
static itu_server sa, sb, sc;

static void make_models(void) {
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  snprintf(model, sizeof model, "%s/model", tmp);
  snprintf(model2, sizeof model2, "%s/model2", tmp);
  const char *shape = "--layers 3 --experts 16 --topk 4 --hidden 128 --inter 64 --vocab 64 "
                      "--heads 2 --kv-heads 1 --head-dim 64";
  char flags[512];
  snprintf(flags, sizeof flags, "%s --seed 11", shape);
  MT_EQ_INT(itu_make_model(model, flags), 0);
  snprintf(flags, sizeof flags, "%s --seed 12", shape);
  MT_EQ_INT(itu_make_model(model2, flags), 0);
}

static void cluster_file(mr_cluster_file *f, const itu_server **s, int n, const char *local) {
  memset(f, 0, sizeof *f);
  f->deadline_ms = 3000;
  snprintf(f->model, sizeof f->model, "%s", model);
  f->n_servers = (uint32_t)n;
  for (int i = 0; i < n; i++) {
    snprintf(f->servers[i].name, sizeof f->servers[i].name, "s%d-%d", i, s[i]->port);
    snprintf(f->servers[i].address, sizeof f->servers[i].address, "%s", s[i]->address);
  }
  if (local) {
    snprintf(f->local_layers, sizeof f->local_layers, "all");
    snprintf(f->local_experts, sizeof f->local_experts, "%s", local);
  }
}

static gc_cluster *open_cluster_map(const itu_server **s, int n, const char *local, bool map,
                                    mr_err *e) {
  mr_cluster_file f;
  cluster_file(&f, s, n, local);
  gc_options o;
  gc_options_init(&o);
  o.client_name = "itest_placement";
  o.local_engine.isa = KN_ISA_REF; /* the local part is the reference too */
  o.local_map_weights = map;
  gc_cluster *c = NULL;
  int rc = gc_cluster_open_parsed(&c, &f, &o, e);
  return rc == 0 ? c : NULL;
}

static gc_cluster *open_cluster(const itu_server **s, int n, const char *local, mr_err *e) {
  return open_cluster_map(s, n, local, false, e);
}

/* Routing for case `kind`: 0 mixed, 1 only experts 0-7 (server A alone), 2 empty slots. */
static void make_call(uint32_t T, int kind, uint64_t seed, int32_t *ids, float *w, float *x) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint32_t i = 0; i < T * H; i++) {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    x[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
  for (uint32_t t = 0; t < T; t++) {
    for (uint32_t j = 0; j < K; j++) {
      s ^= s << 13; s ^= s >> 7; s ^= s << 17;
      int32_t id = (int32_t)((t * 5 + j * 3 + (s >> 60)) % E);
      if (kind == 1) id %= 8;
      if (kind == 2 && (t + j) % 3 == 0) id = -1;
      /* distinct experts within a token, as a router gives */
      ids[t * K + j] = id;
      w[t * K + j] = 0.1f + 0.2f * (float)((s >> 20) % 100) / 100.0f;
    }
    if (kind == 2 && t == T / 2)
      for (uint32_t j = 0; j < K; j++) ids[t * K + j] = -1; /* a token with no slot */
  }
}

/* Local experts served in place from the model's files (local_map_weights) against the
 * packed copy of cl: every pair in place, the same sums bit for bit. */
static void check_local_map(gc_cluster *cl, gc_cluster *cm) {
  static int32_t ids[MAXTOK * K];
  static float w[MAXTOK * K], x[MAXTOK * H], ol[MAXTOK * H], om[MAXTOK * H];
  static const uint32_t Ts[] = {1, 5, MAXTOK};
  gc_cluster_info il, im;
  gc_cluster_info_get(cl, &il);
  gc_cluster_info_get(cm, &im);
  MT_EQ_INT(il.local_mapped, 0);
  MT_EQ_INT(im.local_pairs, LAYERS * 8);
  MT_EQ_INT(im.local_mapped, LAYERS * 8); /* bf16 files served as bf16: all in place */
  mr_err e = {0};
  for (uint32_t layer = 0; layer < LAYERS; layer++)
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
      uint32_t T = Ts[ti];
      make_call(T, 0, 500 + layer * 10 + ti, ids, w, x);
      gc_layer_req r = {.layer = layer, .n_tokens = T, .top_k = K, .ids = ids, .weights = w,
                        .x = x, .dtype = MR_DTYPE_F32};
      MT_OK(gc_layer_forward(cl, &r, ol, &e), &e);
      MT_OK(gc_layer_forward(cm, &r, om, &e), &e);
      MT_EQ_INT(memcmp(ol, om, (size_t)T * H * sizeof *ol), 0);
    }
}

static void check_equal_everywhere(gc_cluster *c2, gc_cluster *c1, gc_cluster *cl) {
  static int32_t ids[(MAXTOK + 40) * K];
  static float w[(MAXTOK + 40) * K], x[(MAXTOK + 40) * H];
  static float o2[(MAXTOK + 40) * H], o1[(MAXTOK + 40) * H], ol[(MAXTOK + 40) * H],
      ref[(MAXTOK + 40) * H];
  static const uint32_t Ts[] = {1, 5, MAXTOK, MAXTOK + 40};
  mr_err e = {0};
  for (uint32_t layer = 0; layer < LAYERS; layer++) {
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
      for (int kind = 0; kind < 3; kind++) {
        uint32_t T = Ts[ti];
        make_call(T, kind, layer * 100 + ti * 10 + (uint64_t)kind, ids, w, x);
        gc_layer_req r = {.layer = layer, .n_tokens = T, .top_k = K, .ids = ids,
                          .weights = w, .x = x, .dtype = MR_DTYPE_F32};
        MT_OK(gc_layer_forward(c2, &r, o2, &e), &e);
        MT_OK(gc_layer_forward(c1, &r, o1, &e), &e);
        MT_OK(gc_layer_forward(cl, &r, ol, &e), &e);
        kn_moe_args a = {.n_tokens = T, .top_k = K, .ids = ids, .weights = w, .x = x,
                         .x_dtype = MR_DTYPE_F32, .out = ref};
        MT_OK(itu_ref_forward(model, layer, KN_FMT_BF16, 0, &a, &e), &e);
        double e21 = kn_rel_l2(o2, o1, (size_t)T * H), e2r = kn_rel_l2(o2, ref, (size_t)T * H);
        double elr = kn_rel_l2(ol, ref, (size_t)T * H);
        fprintf(stderr, "  layer %u T %3u kind %d: 2srv~1srv %.2e  2srv~ref %.2e  local+srv~ref %.2e\n",
                layer, T, kind, e21, e2r, elr);
        MT_LE(e21, 1e-5);
        MT_LE(e2r, 1e-5);
        MT_LE(elr, 1e-5);
        if (kind == 2) { /* the token with no slot is exactly zero everywhere */
          for (uint32_t h = 0; h < H; h++) {
            MT_EQ_INT(o2[(T / 2) * H + h] == 0.0f, 1);
            MT_EQ_INT(ol[(T / 2) * H + h] == 0.0f, 1);
          }
        }
      }
    }
  }
  /* bf16 wire: the servers see bf16 inputs and answer in bf16. */
  uint32_t T = 16;
  make_call(T, 0, 777, ids, w, x);
  static uint16_t xb[MAXTOK * H];
  mr_convert_from_f32(xb, MR_DTYPE_BF16, x, (size_t)T * H);
  mr_convert_to_f32(x, xb, MR_DTYPE_BF16, (size_t)T * H); /* what the servers see */
  gc_layer_req r = {.layer = 1, .n_tokens = T, .top_k = K, .ids = ids, .weights = w, .x = xb,
                    .dtype = MR_DTYPE_BF16};
  MT_OK(gc_layer_forward(c2, &r, o2, &e), &e);
  kn_moe_args a = {.n_tokens = T, .top_k = K, .ids = ids, .weights = w, .x = x,
                   .x_dtype = MR_DTYPE_F32, .out = ref};
  MT_OK(itu_ref_forward(model, 1, KN_FMT_BF16, 0, &a, &e), &e);
  double eb = kn_rel_l2(o2, ref, (size_t)T * H);
  fprintf(stderr, "  bf16 wire: 2srv~ref %.2e\n", eb);
  /* Each server rounds its own partial sum to bf16 (relative error <= 2^-9 per element),
   * so the sum of two parts stays within ~2^-8 of the reference. */
  MT_LE(eb, 8e-3);
}

MT_TEST(placement_does_not_change_results_and_failures_name_the_server) {
  grpc_init(); /* itu_* talks gRPC before any cluster is open */
  make_models();
  itu_server_isa("ref"); /* compared with kn_ref at 1e-5 */
  char extra[128];
  snprintf(extra, sizeof extra, "--experts 0-7 --max-tokens %d", MAXTOK);
  MT_EQ_INT(itu_server_start(&sa, model, extra, tmp, 60000), 0);
  snprintf(extra, sizeof extra, "--experts 8-15 --max-tokens %d", MAXTOK);
  MT_EQ_INT(itu_server_start(&sb, model, extra, tmp, 60000), 0);
  snprintf(extra, sizeof extra, "--experts all --max-tokens %d", MAXTOK);
  MT_EQ_INT(itu_server_start(&sc, model, extra, tmp, 60000), 0);

  mr_err e = {0};
  const itu_server *ab[2] = {&sa, &sb}, *c_only[1] = {&sc}, *a_only[1] = {&sa};
  gc_cluster *c2 = open_cluster(ab, 2, NULL, &e);
  if (!c2) fprintf(stderr, "  open {A,B}: %s\n", e.msg);
  MT_TRUE(c2 != NULL);
  gc_cluster *c1 = open_cluster(c_only, 1, NULL, &e);
  MT_TRUE(c1 != NULL);
  gc_cluster *cl = open_cluster(a_only, 1, "8-15", &e);
  if (!cl) fprintf(stderr, "  open {A + local}: %s\n", e.msg);
  MT_TRUE(cl != NULL);
  gc_cluster_info info;
  gc_cluster_info_get(cl, &info);
  MT_EQ_INT(info.local_pairs, LAYERS * 8);
  MT_EQ_INT(gc_cluster_owner(c2, 2, 9), 1);
  MT_EQ_INT(gc_cluster_owner(cl, 2, 9), GC_OWNER_LOCAL);

  check_equal_everywhere(c2, c1, cl);
  gc_cluster *cm = open_cluster_map(a_only, 1, "8-15", true, &e);
  if (!cm) fprintf(stderr, "  open {A + local in place}: %s\n", e.msg);
  MT_TRUE(cm != NULL);
  check_local_map(cl, cm);
  gc_cluster_close(cm);

  /* A layer whose experts nobody covers refuses to open, naming layer and experts. */
  mr_err e2 = {0};
  gc_cluster *bad = open_cluster(a_only, 1, NULL, &e2);
  MT_TRUE(bad == NULL);
  fprintf(stderr, "  uncovered: %s\n", e2.msg);
  MT_EQ_INT(e2.code, MR_EPRECOND);
  MT_CONTAINS(e2.msg, "8-15");
  MT_CONTAINS(e2.msg, "layer");

  /* A server of another model refuses to open, naming both servers. */
  itu_server sd;
  MT_EQ_INT(itu_server_start(&sd, model2, "--experts 8-15", tmp, 60000), 0);
  const itu_server *ad[2] = {&sa, &sd};
  mr_err e3 = {0};
  bad = open_cluster(ad, 2, NULL, &e3);
  MT_TRUE(bad == NULL);
  fprintf(stderr, "  mismatch: %s\n", e3.msg);
  MT_EQ_INT(e3.code, MR_EMISMATCH);
  MT_CONTAINS(e3.msg, "fingerprint");
  char name_d[64];
  snprintf(name_d, sizeof name_d, "s1-%d", sd.port);
  MT_CONTAINS(e3.msg, name_d);
  MT_EQ_INT(itu_server_stop(&sd, SIGTERM, 15000, NULL), 0);

  /* Slow server: SIGSTOP B; the call fails at the deadline (3 s) naming B. */
  static int32_t ids[8 * K];
  static float w[8 * K], x[8 * H], out[8 * H];
  make_call(8, 0, 5, ids, w, x);
  gc_layer_req r = {.layer = 0, .n_tokens = 8, .top_k = K, .ids = ids, .weights = w, .x = x,
                    .dtype = MR_DTYPE_F32};
  char name_b[64];
  snprintf(name_b, sizeof name_b, "s1-%d", sb.port);
  MT_EQ_INT(itu_server_pause(&sb, 5000), 0); /* every thread of B stopped */
  uint64_t t0 = mr_now_ns();
  mr_err e4 = {0};
  MT_EQ_INT(gc_layer_forward(c2, &r, out, &e4), MR_ETIMEDOUT);
  double waited_ms = (double)(mr_now_ns() - t0) / 1e6;
  fprintf(stderr, "  slow: %s (after %.0f ms)\n", e4.msg, waited_ms);
  MT_CONTAINS(e4.msg, name_b);
  MT_TRUE(waited_ms >= 2500 && waited_ms < 6000);
  itu_server_resume(&sb);
  /* It recovers once the server runs again (the late reply is dropped). */
  MT_OK(gc_layer_forward(c2, &r, out, &e), &e);

  /* Dead server: SIGKILL B; the call fails fast with MR_EUNAVAIL naming B. */
  int st;
  itu_server_stop(&sb, SIGKILL, 5000, &st);
  t0 = mr_now_ns();
  mr_err e5 = {0};
  int rc = gc_layer_forward(c2, &r, out, &e5);
  waited_ms = (double)(mr_now_ns() - t0) / 1e6;
  fprintf(stderr, "  dead: rc %d %s (after %.0f ms)\n", rc, e5.msg, waited_ms);
  MT_TRUE(rc == MR_EUNAVAIL || rc == MR_ETIMEDOUT);
  MT_CONTAINS(e5.msg, name_b);
  MT_TRUE(waited_ms < 6000);
  /* The other cluster is unaffected. */
  MT_OK(gc_layer_forward(c1, &r, out, &e), &e);

  gc_cluster_close(c2);
  gc_cluster_close(c1);
  gc_cluster_close(cl);
  MT_EQ_INT(itu_server_stop(&sa, SIGTERM, 15000, &st), 0);
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  MT_EQ_INT(itu_server_stop(&sc, SIGTERM, 15000, &st), 0);
  MT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

MT_MAIN()
