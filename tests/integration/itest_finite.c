/*
 * itest_finite.c - no NaN or Inf crosses the wire as OK (issue 23, item 4; docs/DESIGN.md
 * section 5, "Finite checks"), with real moerpc-server processes on loopback.
 *
 * Server side, raw Forward streams:
 *   - finite hidden states scaled x1 .. x3000 in every wire dtype: each reply is either OK
 *     with every value finite, or INTERNAL naming the layer; the f16 wire refuses what its
 *     65504 cannot hold (x1000: fp32 outputs far over 65504) while f32 and bf16 answer;
 *   - routing weights of +-1e30: f32 and bf16 answer finite values, f16 is refused;
 *   - a model whose expert weights are scaled x100 (moerpc-mkmodel --expert-scale): f16
 *     refused naming the layer, token and index, f32 and bf16 answer;
 *   the stream keeps serving after each refusal.
 * Client side, through libmoerpc-client: a server made to put a NaN into every OK reply
 * of layer 1 (MOERPC_TEST_NONFINITE_LAYER, test only):
 *   - alone: a call of layer 1 fails with MR_EPROTO naming the server, the layer, the
 *     call's token and "NaN"; layer 0 still works;
 *   - next to a good replica of every expert: every call succeeds through failover, equal
 *     to the good server alone within 1e-5 (reference kernels), the bad server counted
 *     (errors, resent) but never marked down;
 *   - the whole-model runner (the report's symptom): a step through the bad server alone
 *     fails naming it and layer 1, not the next layer's "weights[0] = nan"; with the good
 *     replica next to it, greedy steps give the logits of the all-local run.
 * Before the fix the f16 cases answered OK with +-Inf and the client summed the NaN.
 */
#include <grpc/grpc.h>
#include <math.h>
#include <stdlib.h>

#include "gpu_client/rpc/moerpc_client.h"
#include "gpu_client/runner/model.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define SHAPE "--layers 3 --experts 8 --topk 4 --hidden 64 --inter 32 --vocab 64 --heads 2 " \
              "--kv-heads 1 --head-dim 32 --seed 7"
#define H 64
#define E 8
#define K 4
#define MAXTOK 16
#define F16_MAX 65504.0f

static char *tmp;
static char model[600];

static void rm_tmp(void) {
  if (tmp) itu_rm_rf(tmp);
  tmp = NULL;
}

static void make_model(const char *name, const char *extra) {
  grpc_init();
  itu_server_isa("ref");
  if (!tmp) {
    tmp = itu_tmpdir();
    mt_defer(rm_tmp); /* also when the case fails */
  }
  MT_TRUE(tmp != NULL);
  snprintf(model, sizeof model, "%s/%s", tmp, name);
  char flags[400];
  snprintf(flags, sizeof flags, "%s %s", SHAPE, extra);
  MT_EQ_INT(itu_make_model(model, flags), 0);
}

static void start(itu_server *s, const char *extra) {
  char args[200];
  snprintf(args, sizeof args, "--experts all --max-tokens %d %s", MAXTOK, extra);
  MT_EQ_INT(itu_server_start(s, model, args, tmp, 60000), 0);
}

static void stop(itu_server *s) {
  int st = 0;
  MT_EQ_INT(itu_server_stop(s, SIGTERM, 15000, &st), 0);
  MT_TRUE(WIFEXITED(st));
  MT_EQ_INT(WEXITSTATUS(st), 0);
}

static void finish(void) {
  rm_tmp();
  grpc_shutdown();
}

/* T tokens of hidden states in [-1, 1] times scale; every slot an expert, weight w. */
static void make_call(uint32_t T, float scale, float w, uint64_t seed, float *x, int32_t *ids,
                      float *wt) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint32_t i = 0; i < T * H; i++) {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    x[i] = scale * (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t j = 0; j < K; j++) {
      ids[t * K + j] = (int32_t)((t * 3 + j * 2 + j / 2) % E); /* 4 distinct experts */
      wt[t * K + j] = (t + j) % 2 ? w : -w;
    }
}

/* One raw request of layer on c: returns the reply status; *ymax gets the largest |value|
 * of an OK reply (every value must be finite), err (len) the error text of a refusal. */
static uint32_t forward_raw(itu_call *c, uint64_t id, uint32_t layer, uint32_t T, int dtype,
                            const float *x, const int32_t *ids, const float *w, float *ymax,
                            char *err, size_t len) {
  static uint8_t payload[MAXTOK * H * 4];
  static float y[MAXTOK * H];
  size_t esz = dtype == MR_DTYPE_F32 ? 4 : 2;
  mr_convert_from_f32(payload, (mr_dtype)dtype, x, (size_t)T * H);
  MT_EQ_INT(itu_call_send(c, itu_forward_request(id, layer, T, K, ids, T * K, w, T * K, dtype,
                                                 payload, T * H * esz), 5000), 0);
  grpc_byte_buffer *rb = NULL;
  MT_EQ_INT(itu_call_recv(c, &rb, 10000), 0);
  MT_TRUE(rb != NULL);
  Moerpc__V1__ForwardReply *r = NULL;
  void *out = NULL;
  size_t out_len = 0;
  MT_EQ_INT(itu_forward_reply(rb, &r, &out, &out_len), 0);
  grpc_byte_buffer_destroy(rb);
  MT_EQ_U64(r->id, id);
  uint32_t status = r->status;
  *ymax = 0;
  err[0] = '\0';
  if (status == 0) {
    MT_EQ_INT(out_len, T * H * esz);
    mr_convert_to_f32(y, out, (mr_dtype)dtype, (size_t)T * H);
    for (uint32_t i = 0; i < T * H; i++) {
      if (!isfinite(y[i]))
        fprintf(stderr, "  OK reply with y[token %u, index %u] = %g (%s wire)\n", i / H, i % H,
                (double)y[i], mr_dtype_name((mr_dtype)dtype));
      MT_TRUE(isfinite(y[i]));
      if (fabsf(y[i]) > *ymax) *ymax = fabsf(y[i]);
    }
  } else {
    MT_EQ_INT(out_len, 0);
    snprintf(err, len, "%s", r->error ? r->error : "");
  }
  moerpc__v1__forward_reply__free_unpacked(r, NULL);
  free(out);
  return status;
}

static const int dtypes[3] = {MR_DTYPE_F32, MR_DTYPE_F16, MR_DTYPE_BF16};

MT_TEST(f16_wire_overflow_is_refused_naming_the_layer_never_ok_with_inf) {
  make_model("m", "");
  itu_server s;
  start(&s, "");
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, s.address, PR_METHOD_FORWARD, 120000), 0);
  static float x[MAXTOK * H], w[MAXTOK * K];
  static int32_t ids[MAXTOK * K];
  char err[512];
  uint64_t id = 1;
  /* Finite f16 inputs (|x| <= 3000 < 65504) scaled up: the replies are OK and finite, or
   * INTERNAL naming the layer; never OK with an Inf. */
  static const float scales[] = {1, 30, 300, 1000, 3000};
  uint32_t f16_refused = 0;
  for (size_t q = 0; q < sizeof scales / sizeof scales[0]; q++) {
    make_call(MAXTOK, scales[q], 0.25f, q, x, ids, w);
    float ymax32 = 0;
    for (int d = 0; d < 3; d++) {
      float ymax;
      uint32_t st = forward_raw(&c, id++, 1, MAXTOK, dtypes[d], x, ids, w, &ymax, err, sizeof err);
      if (st == 0)
        fprintf(stderr, "  x%-5g %-4s -> OK, max |y| %.4g\n", (double)scales[q],
                mr_dtype_name((mr_dtype)dtypes[d]), (double)ymax);
      else
        fprintf(stderr, "  x%-5g %-4s -> status %u: %s\n", (double)scales[q],
                mr_dtype_name((mr_dtype)dtypes[d]), st, err);
      if (dtypes[d] == MR_DTYPE_F32) {
        MT_EQ_INT(st, 0); /* fp32 holds every one of these */
        ymax32 = ymax;
        continue;
      }
      if (dtypes[d] == MR_DTYPE_BF16) {
        MT_EQ_INT(st, 0); /* bf16 has fp32's range */
        continue;
      }
      /* f16: refused exactly when the fp32 outputs are well over its range. */
      if (ymax32 > 1.01f * F16_MAX) {
        MT_EQ_INT(st, 13);
        MT_CONTAINS(err, "in layer 1");
        MT_CONTAINS(err, "does not fit the f16 wire dtype");
        MT_CONTAINS(err, "output[token ");
        f16_refused++;
      } else if (ymax32 < 0.99f * F16_MAX) {
        MT_EQ_INT(st, 0);
      }
    }
  }
  MT_TRUE(f16_refused >= 2); /* x1000 and x3000 at least: the case of the report */
  /* Routing weights of +-1e30 on ordinary hidden states: outputs ~1e30, finite in fp32. */
  make_call(8, 1.0f, 1e30f, 99, x, ids, w);
  for (int d = 0; d < 3; d++) {
    float ymax;
    uint32_t st = forward_raw(&c, id++, 2, 8, dtypes[d], x, ids, w, &ymax, err, sizeof err);
    fprintf(stderr, "  weights 1e30 %-4s -> %u %s (max |y| %.3g)\n",
            mr_dtype_name((mr_dtype)dtypes[d]), st, err, (double)ymax);
    if (dtypes[d] == MR_DTYPE_F16) {
      MT_EQ_INT(st, 13);
      MT_CONTAINS(err, "in layer 2");
      MT_CONTAINS(err, "f16");
    } else {
      MT_EQ_INT(st, 0);
      MT_TRUE(ymax > 1e28f);
    }
  }
  /* The stream still serves in f16. */
  make_call(4, 1.0f, 0.25f, 5, x, ids, w);
  float ymax;
  MT_EQ_INT(forward_raw(&c, id++, 0, 4, MR_DTYPE_F16, x, ids, w, &ymax, err, sizeof err), 0);
  MT_TRUE(ymax > 0);
  MT_EQ_INT(itu_call_finish(&c, 10000), 0);
  MT_EQ_INT(c.status, GRPC_STATUS_OK);
  itu_call_close(&c);
  stop(&s);
  finish();
}

MT_TEST(huge_expert_weights_overflow_f16_only) {
  make_model("big", "--expert-scale 100"); /* an expert's output grows as 100^3 */
  itu_server s;
  start(&s, "");
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, s.address, PR_METHOD_FORWARD, 60000), 0);
  static float x[MAXTOK * H], w[MAXTOK * K];
  static int32_t ids[MAXTOK * K];
  char err[512];
  make_call(MAXTOK, 1.0f, 0.25f, 3, x, ids, w);
  float ymax32 = 0, ymax;
  for (int d = 0; d < 3; d++) {
    uint32_t st = forward_raw(&c, (uint64_t)d + 1, 1, MAXTOK, dtypes[d], x, ids, w, &ymax, err,
                              sizeof err);
    fprintf(stderr, "  %-4s -> %u %s (max |y| %.3g)\n", mr_dtype_name((mr_dtype)dtypes[d]), st,
            err, (double)ymax);
    if (dtypes[d] == MR_DTYPE_F16) {
      MT_EQ_INT(st, 13);
      MT_CONTAINS(err, "in layer 1");
      MT_CONTAINS(err, "output[token ");
      MT_CONTAINS(err, "does not fit the f16 wire dtype");
    } else {
      MT_EQ_INT(st, 0);
      if (dtypes[d] == MR_DTYPE_F32) ymax32 = ymax;
    }
  }
  MT_TRUE(ymax32 > 2 * F16_MAX);
  /* Small enough inputs still fit f16 on this model: the refusal is per request. */
  make_call(2, 0.02f, 0.01f, 4, x, ids, w);
  MT_EQ_INT(forward_raw(&c, 9, 1, 2, MR_DTYPE_F16, x, ids, w, &ymax, err, sizeof err), 0);
  MT_EQ_INT(itu_call_finish(&c, 10000), 0);
  itu_call_close(&c);
  stop(&s);
  finish();
}

/* ---- the client's check of every reply ---------------------------------------------------- */

static gc_cluster *open_cluster(itu_server *const *s, const char *const *names, int n,
                                mr_err *e) {
  mr_cluster_file f;
  memset(&f, 0, sizeof f);
  f.deadline_ms = 5000;
  snprintf(f.model, sizeof f.model, "%s", model);
  f.n_servers = (uint32_t)n;
  for (int i = 0; i < n; i++) {
    snprintf(f.servers[i].name, sizeof f.servers[i].name, "%s", names[i]);
    snprintf(f.servers[i].address, sizeof f.servers[i].address, "%s", s[i]->address);
  }
  gc_options o;
  gc_options_init(&o);
  o.client_name = "itest_finite";
  gc_cluster *c = NULL;
  return gc_cluster_open_parsed(&c, &f, &o, e) == 0 ? c : NULL;
}

MT_TEST(client_fails_a_non_finite_reply_and_fails_over_to_a_replica) {
  make_model("m", "");
  itu_server bad, good;
  setenv("MOERPC_TEST_NONFINITE_LAYER", "1", 1);
  start(&bad, "");
  unsetenv("MOERPC_TEST_NONFINITE_LAYER");
  start(&good, "");
  static float x[MAXTOK * H], w[MAXTOK * K], out[MAXTOK * H], ref[MAXTOK * H];
  static int32_t ids[MAXTOK * K];
  mr_err e = {0};

  /* The bad server alone: layer 1 fails naming it, the layer, the token and the NaN. */
  itu_server *one[] = {&bad};
  const char *one_names[] = {"bad"};
  gc_cluster *c1 = open_cluster(one, one_names, 1, &e);
  MT_TRUE(c1 != NULL);
  make_call(5, 1.0f, 0.25f, 1, x, ids, w);
  gc_layer_req q = {.layer = 1, .n_tokens = 5, .top_k = K, .ids = ids, .weights = w, .x = x,
                    .dtype = MR_DTYPE_F32};
  for (int i = 0; i < 5 * H; i++) out[i] = 0;
  int rc = gc_layer_forward(c1, &q, out, &e);
  fprintf(stderr, "  bad server alone: %s\n", e.msg);
  MT_EQ_INT(rc, MR_EPROTO);
  MT_CONTAINS(e.msg, "layer 1 request ");
  MT_CONTAINS(e.msg, "server bad (");
  MT_CONTAINS(e.msg, "(token 4 of the call), index 0] = NaN");
  MT_CONTAINS(e.msg, "no other live replica");
  q.layer = 0; /* its other layers are fine, and so is it: not marked down */
  MT_OK(gc_layer_forward(c1, &q, out, &e), &e);
  for (int i = 0; i < 5 * H; i++) MT_TRUE(isfinite(out[i]));
  gc_server_counters ct;
  MT_OK(gc_server_counters_get(c1, 0, false, &ct, &e), &e);
  MT_EQ_U64(ct.errors, 1);
  MT_FALSE(ct.down);
  gc_cluster_close(c1);

  /* With a good replica of every expert: every call succeeds, equal to the good server
   * alone. */
  itu_server *two[] = {&bad, &good}, *ref_srv[] = {&good};
  const char *two_names[] = {"bad", "good"}, *ref_names[] = {"good"};
  gc_cluster *c2 = open_cluster(two, two_names, 2, &e);
  MT_TRUE(c2 != NULL);
  gc_cluster *cg = open_cluster(ref_srv, ref_names, 1, &e);
  MT_TRUE(cg != NULL);
  for (uint32_t call = 0; call < 12; call++) {
    uint32_t T = 1 + (call * 5) % MAXTOK;
    make_call(T, 1.0f, 0.25f, 10 + call, x, ids, w);
    gc_layer_req r = {.layer = call % 3 == 2 ? 0 : 1, .n_tokens = T, .top_k = K, .ids = ids,
                      .weights = w, .x = x, .dtype = MR_DTYPE_F32};
    MT_OK(gc_layer_forward(c2, &r, out, &e), &e);
    MT_OK(gc_layer_forward(cg, &r, ref, &e), &e);
    for (uint32_t i = 0; i < T * H; i++) MT_TRUE(isfinite(out[i]));
    double d = kn_rel_l2(out, ref, (size_t)T * H);
    fprintf(stderr, "  call %2u layer %u T %2u: rel L2 to the good server alone %.2e\n", call,
            r.layer, T, d);
    MT_LE(d, 1e-5);
  }
  /* bf16 and f16 wires take the same path. */
  static uint16_t x16[MAXTOK * H];
  make_call(MAXTOK, 1.0f, 0.25f, 77, x, ids, w);
  for (int d = 1; d < 3; d++) {
    mr_convert_from_f32(x16, (mr_dtype)dtypes[d], x, MAXTOK * H);
    gc_layer_req r = {.layer = 1, .n_tokens = MAXTOK, .top_k = K, .ids = ids, .weights = w,
                      .x = x16, .dtype = (mr_dtype)dtypes[d]};
    MT_OK(gc_layer_forward(c2, &r, out, &e), &e);
    MT_OK(gc_layer_forward(cg, &r, ref, &e), &e);
    /* Parts rounded to the wire dtype one by one: verify's wire tolerances (section 5). */
    MT_LE(kn_rel_l2(out, ref, (size_t)MAXTOK * H), dtypes[d] == MR_DTYPE_F16 ? 2e-3 : 1e-2);
  }
  MT_OK(gc_server_counters_get(c2, 0, false, &ct, &e), &e);
  fprintf(stderr, "  bad server: replies %llu errors %llu resent %llu failovers %llu down %d\n",
          (unsigned long long)ct.replies, (unsigned long long)ct.errors,
          (unsigned long long)ct.resent, (unsigned long long)ct.failovers, (int)ct.down);
  MT_TRUE(ct.errors >= 1);
  MT_EQ_U64(ct.resent, ct.errors); /* each bad reply resent once, to the good server */
  MT_EQ_U64(ct.failovers, 0);      /* never marked down */
  MT_FALSE(ct.down);
  MT_TRUE(ct.replies >= 1);        /* its layer-0 parts were used */
  gc_cluster_close(cg);
  gc_cluster_close(c2);
  stop(&bad);
  stop(&good);
  finish();
}

static int open_runner(gc_model **m, const char *cluster, mr_err *e) {
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = model;
  o.cluster_path = cluster;
  o.local_experts = -1;
  o.max_seq = 32;
  o.engine.isa = KN_ISA_REF;
  o.engine.threads = 1;
  o.wire = MR_DTYPE_F32;
  o.quiet = true;
  return gc_model_open(m, &o, e);
}

static void write_cluster(const char *path, itu_server *const *s, const char *const *names,
                          int n) {
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fprintf(f, "{\"deadline_ms\": 5000, \"servers\": [");
  for (int i = 0; i < n; i++)
    fprintf(f, "%s{\"name\": \"%s\", \"address\": \"%s\"}", i ? ", " : "", names[i],
            s[i]->address);
  fprintf(f, "]}\n");
  MT_EQ_INT(fclose(f), 0);
}

/* Prefill of 6 tokens, then 4 greedy steps; logits[t] of every step, 10 x vocab. */
#define VOCAB 64
static int run_steps(gc_model *m, float *logits, mr_err *e) {
  static const int32_t prompt[6] = {3, 14, 15, 42, 6, 35};
  uint32_t seq[6] = {0}, pos[6] = {0, 1, 2, 3, 4, 5};
  gc_model_seq_reset(m, 0);
  gc_step s = {.n_tokens = 6, .ids = prompt, .seq = seq, .pos = pos, .logits = logits};
  int rc = gc_model_step(m, &s, e);
  for (uint32_t i = 0; rc == 0 && i < 4; i++) {
    const float *l = logits + (5 + i) * VOCAB;
    int32_t next = 0;
    for (int32_t v = 1; v < VOCAB; v++)
      if (l[v] > l[next]) next = v;
    uint32_t p = 6 + i, q = 0;
    gc_step d = {.n_tokens = 1, .ids = &next, .seq = &q, .pos = &p,
                 .logits = logits + (6 + i) * VOCAB};
    rc = gc_model_step(m, &d, e);
  }
  return rc;
}

MT_TEST(runner_step_names_the_bad_server_and_layer_and_fails_over) {
  make_model("m", "");
  itu_server bad, good;
  setenv("MOERPC_TEST_NONFINITE_LAYER", "1", 1);
  start(&bad, "");
  unsetenv("MOERPC_TEST_NONFINITE_LAYER");
  start(&good, "");
  static float ref[10 * VOCAB], got[10 * VOCAB];
  mr_err e = {0};
  gc_model *m = NULL;
  MT_OK(open_runner(&m, NULL, &e), &e); /* all local: the reference */
  MT_OK(run_steps(m, ref, &e), &e);
  gc_model_close(m);

  char path[700];
  snprintf(path, sizeof path, "%s/bad.json", tmp);
  itu_server *one[] = {&bad};
  const char *one_names[] = {"bad"};
  write_cluster(path, one, one_names, 1);
  MT_OK(open_runner(&m, path, &e), &e);
  int rc = run_steps(m, got, &e);
  fprintf(stderr, "  bad server alone: %s\n", e.msg);
  MT_EQ_INT(rc, MR_EPROTO);
  MT_CONTAINS(e.msg, "server bad (");
  MT_CONTAINS(e.msg, "layer 1");
  MT_CONTAINS(e.msg, "= NaN");
  MT_TRUE(strstr(e.msg, "weights[") == NULL); /* not blamed on the next hop */
  gc_model_close(m);

  snprintf(path, sizeof path, "%s/two.json", tmp);
  itu_server *two[] = {&bad, &good};
  const char *two_names[] = {"bad", "good"};
  write_cluster(path, two, two_names, 2);
  MT_OK(open_runner(&m, path, &e), &e);
  MT_OK(run_steps(m, got, &e), &e);
  double d = kn_rel_l2(got, ref, 10 * VOCAB);
  fprintf(stderr, "  bad + good replica: logits rel L2 to all-local %.2e\n", d);
  MT_LE(d, 1e-5);
  gc_model_close(m);
  stop(&bad);
  stop(&good);
  finish();
}

MT_MAIN()
