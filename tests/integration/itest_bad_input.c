/*
 * itest_bad_input.c - a real moerpc-server on loopback gets every kind of bad request a
 * peer can send; each is answered with the status of docs/DESIGN.md section 4 and a message
 * naming the field, and the same stream then still answers a good request correctly.
 * Also: Hello version check, health service, Stats counters; non-finite hidden states
 * (INVALID_ARGUMENT naming the token and the index) and an expert output that overflows
 * fp32 (INTERNAL naming the layer), each answered alone on a stream that keeps serving.
 */
#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <math.h>

#include "tests/integration/util.h"
#include "tests/unit/mt.h"

/* Model: 3 MoE layers, 16 experts, H=64, I=32; the server owns experts 0-7 of layers 0-1. */
#define H 64
#define E 16
#define MAXTOK 8

static char *tmp;
static char model[600];
static itu_server srv;

static void setup(void) {
  grpc_init();
  itu_server_isa("ref"); /* compared with kn_ref at 1e-5 */
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  snprintf(model, sizeof model, "%s/model", tmp);
  MT_EQ_INT(itu_make_model(model, "--layers 3 --experts 16 --topk 4 --hidden 64 --inter 32 "
                                  "--vocab 64 --heads 2 --kv-heads 1 --head-dim 32 --seed 7"),
            0);
  char extra[128];
  snprintf(extra, sizeof extra, "--experts 0-7 --layers 0-1 --max-tokens %d", MAXTOK);
  MT_EQ_INT(itu_server_start(&srv, model, extra, tmp, 60000), 0);
}

static void teardown(void) {
  int st = 0;
  MT_EQ_INT(itu_server_stop(&srv, SIGTERM, 15000, &st), 0);
  MT_TRUE(WIFEXITED(st));
  MT_EQ_INT(WEXITSTATUS(st), 0);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

static float hidden[MAXTOK + 1][H];
static void fill_hidden(void) {
  uint64_t s = 12345;
  for (int t = 0; t <= MAXTOK; t++)
    for (int h = 0; h < H; h++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      hidden[t][h] = (float)((int)(s >> 40 & 0xffff) - 32768) / 32768.0f;
    }
}

/* Sends bb on the stream, receives one reply, checks status and that error names `field`. */
static void expect_status(itu_call *c, grpc_byte_buffer *bb, uint64_t id, uint32_t status,
                          const char *field) {
  MT_EQ_INT(itu_call_send(c, bb, 5000), 0);
  grpc_byte_buffer *rb = NULL;
  MT_EQ_INT(itu_call_recv(c, &rb, 10000), 0);
  MT_TRUE(rb != NULL);
  Moerpc__V1__ForwardReply *r = NULL;
  void *out = NULL;
  size_t out_len = 0;
  MT_EQ_INT(itu_forward_reply(rb, &r, &out, &out_len), 0);
  grpc_byte_buffer_destroy(rb);
  fprintf(stderr, "  id %llu -> status %u: %s\n", (unsigned long long)r->id, r->status, r->error);
  MT_EQ_U64(r->id, id);
  MT_EQ_INT(r->status, status);
  MT_EQ_INT(out_len, 0);
  MT_CONTAINS(r->error, field);
  moerpc__v1__forward_reply__free_unpacked(r, NULL);
  free(out);
}

/* A good request on layer `layer`, checked against the local reference. */
static void expect_good(itu_call *c, uint64_t id, uint32_t layer, uint32_t T, int dtype) {
  int32_t ids[MAXTOK * 4];
  float w[MAXTOK * 4];
  for (uint32_t i = 0; i < T * 4; i++) {
    ids[i] = (i % 5 == 4) ? -1 : (int32_t)((i * 3 + layer) % 8); /* owned: 0-7, some empty */
    w[i] = 0.1f + 0.05f * (float)(i % 4);
  }
  size_t esz = dtype == 1 ? 4 : 2;
  uint8_t payload[sizeof hidden];
  if (dtype == 1) {
    memcpy(payload, hidden, T * H * 4);
  } else {
    mr_convert_from_f32(payload, (mr_dtype)dtype, &hidden[0][0], T * H);
  }
  grpc_byte_buffer *bb = itu_forward_request(id, layer, T, 4, ids, T * 4, w, T * 4, dtype,
                                             payload, T * H * esz);
  MT_EQ_INT(itu_call_send(c, bb, 5000), 0);
  grpc_byte_buffer *rb = NULL;
  MT_EQ_INT(itu_call_recv(c, &rb, 10000), 0);
  MT_TRUE(rb != NULL);
  Moerpc__V1__ForwardReply *r = NULL;
  void *out = NULL;
  size_t out_len = 0;
  MT_EQ_INT(itu_forward_reply(rb, &r, &out, &out_len), 0);
  grpc_byte_buffer_destroy(rb);
  MT_EQ_U64(r->id, id);
  if (r->status) fprintf(stderr, "  unexpected error: %s\n", r->error);
  MT_EQ_INT(r->status, 0);
  MT_EQ_INT(r->dtype, dtype);
  MT_EQ_INT(out_len, T * H * esz);
  float got[MAXTOK * H], ref[MAXTOK * H];
  mr_convert_to_f32(got, out, (mr_dtype)dtype, T * H);
  /* The reference sees the same (wire-rounded) inputs the server saw. */
  float xin[MAXTOK * H];
  mr_convert_to_f32(xin, payload, (mr_dtype)dtype, T * H);
  kn_moe_args a = {.n_tokens = T, .top_k = 4, .ids = ids, .weights = w, .x = xin,
                   .x_dtype = MR_DTYPE_F32, .out = ref};
  mr_err e = {0};
  MT_OK(itu_ref_forward(model, layer, KN_FMT_BF16, 0, &a, &e), &e);
  double err = kn_rel_l2(got, ref, T * H);
  fprintf(stderr, "  good request id %llu layer %u T %u dtype %d: rel L2 %.3g\n",
          (unsigned long long)id, layer, T, dtype, err);
  MT_LE(err, dtype == 1 ? 1e-5 : 1e-2);
  moerpc__v1__forward_reply__free_unpacked(r, NULL);
  free(out);
}

MT_TEST(bad_requests_are_answered_and_stream_keeps_serving) {
  fill_hidden();
  setup();
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  expect_good(&c, 1, 0, 1, 1);

  int32_t ids[MAXTOK * 4 + 8];
  float w[MAXTOK * 4 + 8];
  for (int i = 0; i < MAXTOK * 4 + 8; i++) {
    ids[i] = i % 8;
    w[i] = 0.25f;
  }
  size_t hb = 2 * H * 4; /* two f32 tokens */
  /* layer out of range (the model has 3 layers) */
  expect_status(&c, itu_forward_request(10, 99, 2, 4, ids, 8, w, 8, 1, hidden, hb), 10, 3, "layer");
  /* layer of the model but not owned (server owns 0-1) */
  expect_status(&c, itu_forward_request(11, 2, 2, 4, ids, 8, w, 8, 1, hidden, hb), 11, 9, "layer");
  /* expert id out of range */
  ids[3] = E;
  expect_status(&c, itu_forward_request(12, 0, 2, 4, ids, 8, w, 8, 1, hidden, hb), 12, 3, "expert");
  ids[3] = -2;
  expect_status(&c, itu_forward_request(13, 0, 2, 4, ids, 8, w, 8, 1, hidden, hb), 13, 3, "expert");
  /* expert not owned */
  ids[3] = 12;
  expect_status(&c, itu_forward_request(14, 0, 2, 4, ids, 8, w, 8, 1, hidden, hb), 14, 9, "12");
  ids[3] = 3;
  /* hidden length not n_tokens * hidden_size * sizeof(dtype) */
  expect_status(&c, itu_forward_request(15, 0, 2, 4, ids, 8, w, 8, 1, hidden, hb - 4), 15, 3, "hidden");
  expect_status(&c, itu_forward_request(16, 0, 2, 4, ids, 8, w, 8, 3, hidden, hb), 16, 3, "hidden");
  /* expert_ids / weights length mismatch */
  expect_status(&c, itu_forward_request(17, 0, 2, 4, ids, 8, w, 7, 1, hidden, hb), 17, 3, "weights");
  expect_status(&c, itu_forward_request(18, 0, 2, 4, ids, 6, w, 8, 1, hidden, hb), 18, 3, "expert_ids");
  /* n_tokens over max_tokens */
  expect_status(&c, itu_forward_request(19, 0, MAXTOK + 1, 4, ids, (MAXTOK + 1) * 4, w,
                                        (MAXTOK + 1) * 4, 1, hidden, (MAXTOK + 1) * H * 4),
                19, 8, "n_tokens");
  /* unknown dtype */
  expect_status(&c, itu_forward_request(20, 0, 2, 4, ids, 8, w, 8, 7, hidden, hb), 20, 3, "dtype");
  /* top_k 0 and n_tokens 0 */
  expect_status(&c, itu_forward_request(21, 0, 2, 0, ids, 0, w, 0, 1, hidden, hb), 21, 3, "top_k");
  expect_status(&c, itu_forward_request(22, 0, 0, 4, ids, 0, w, 0, 1, hidden, 0), 22, 3, "n_tokens");
  /* non-finite weight */
  w[5] = NAN;
  expect_status(&c, itu_forward_request(23, 0, 2, 4, ids, 8, w, 8, 1, hidden, hb), 23, 3, "weight");
  w[5] = 0.25f;
  /* garbage bytes instead of a protobuf message: an error reply with id 0 */
  {
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                   0xff, 0xff, 0x0f, 0x7a, 0x99};
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)junk, sizeof junk);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    expect_status(&c, bb, 0, 3, "ForwardRequest");
  }
  /* The same stream still serves: f32 and bf16, T = 1 and T = max_tokens. */
  expect_good(&c, 30, 0, 1, 1);
  expect_good(&c, 31, 1, MAXTOK, 1);
  expect_good(&c, 32, 1, MAXTOK, 3);
  expect_good(&c, 33, 0, 3, 2);
  MT_EQ_INT(itu_call_finish(&c, 10000), 0);
  MT_EQ_INT(c.status, GRPC_STATUS_OK);
  itu_call_close(&c);

  /* Stats counted the requests and the errors. */
  itu_call s;
  MT_EQ_INT(itu_call_open(&s, srv.address, PR_METHOD_STATS, 10000), 0);
  Moerpc__V1__StatsRequest sr = MOERPC__V1__STATS_REQUEST__INIT;
  MT_EQ_INT(itu_call_send(&s, pr_encode(&sr.base), 5000), 0);
  grpc_byte_buffer *rb = NULL;
  MT_EQ_INT(itu_call_recv(&s, &rb, 10000), 0);
  MT_TRUE(rb != NULL);
  ProtobufCMessage *m = NULL;
  mr_err e = {0};
  MT_OK(pr_decode(rb, &moerpc__v1__stats_reply__descriptor, 1 << 20, &m, &e), &e);
  Moerpc__V1__StatsReply *st = (Moerpc__V1__StatsReply *)m;
  fprintf(stderr, "  stats: requests %llu errors %llu counts %zu\n",
          (unsigned long long)st->requests, (unsigned long long)st->errors, st->n_counts);
  MT_EQ_U64(st->errors, 15);
  MT_TRUE(st->requests >= 20);
  MT_TRUE(st->n_counts > 0);
  uint64_t tokens = 0;
  for (size_t i = 0; i < st->n_counts; i++) {
    MT_TRUE(st->counts[i]->layer <= 1);
    MT_TRUE(st->counts[i]->expert <= 7);
    tokens += st->counts[i]->tokens;
  }
  MT_TRUE(tokens > 0);
  protobuf_c_message_free_unpacked(m, NULL);
  grpc_byte_buffer_destroy(rb);
  itu_call_finish(&s, 5000);
  itu_call_close(&s);
  teardown();
}

MT_TEST(non_finite_hidden_and_overflowing_output_are_errors) {
  fill_hidden();
  setup();
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  int32_t ids[MAXTOK * 4];
  float w[MAXTOK * 4];
  for (int i = 0; i < MAXTOK * 4; i++) {
    ids[i] = i % 8;
    w[i] = 0.25f;
  }
  /* A NaN in a bf16 request: token 2, index 17. */
  uint16_t x16[4 * H];
  mr_convert_from_f32(x16, MR_DTYPE_BF16, &hidden[0][0], 4 * H);
  x16[2 * H + 17] = 0x7fc0;
  expect_status(&c, itu_forward_request(40, 0, 4, 4, ids, 16, w, 16, 3, x16, sizeof x16), 40, 3,
                "hidden[token 2, index 17] = NaN");
  /* -Inf in an f16 request, the last element. */
  mr_convert_from_f32(x16, MR_DTYPE_F16, &hidden[0][0], 4 * H);
  x16[4 * H - 1] = 0xfc00;
  expect_status(&c, itu_forward_request(41, 1, 4, 4, ids, 16, w, 16, 2, x16, sizeof x16), 41, 3,
                "hidden[token 3, index 63] = -Inf");
  expect_good(&c, 42, 0, 2, 3);
  /* Finite but huge f32 hidden states (1e30; bf16 would hold them too): gate and up are
   * ~1e29 each, their product overflows fp32, so the expert output is not finite. */
  float big[2 * H];
  for (int i = 0; i < 2 * H; i++) big[i] = hidden[i / H][i % H] >= 0 ? 1e30f : -1e30f;
  expect_status(&c, itu_forward_request(43, 1, 2, 4, ids, 8, w, 8, 1, big, sizeof big), 43, 13,
                "in layer 1");
  /* The stream still serves, in every dtype. */
  expect_good(&c, 44, 1, 3, 1);
  expect_good(&c, 45, 0, MAXTOK, 3);
  expect_good(&c, 46, 1, 1, 2);
  MT_EQ_INT(itu_call_finish(&c, 10000), 0);
  MT_EQ_INT(c.status, GRPC_STATUS_OK);
  itu_call_close(&c);
  teardown();
}

MT_TEST(hello_checks_protocol_and_reports_shapes) {
  setup();
  MT_EQ_INT(itu_health(srv.address, 5000), PR_HEALTH_SERVING);
  for (int major = 1; major <= 2; major++) {
    itu_call c;
    MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_HELLO, 10000), 0);
    Moerpc__V1__HelloRequest hr = MOERPC__V1__HELLO_REQUEST__INIT;
    hr.protocol_major = (uint32_t)major;
    hr.client_name = "itest";
    MT_EQ_INT(itu_call_send(&c, pr_encode(&hr.base), 5000), 0);
    grpc_byte_buffer *rb = NULL;
    MT_EQ_INT(itu_call_recv(&c, &rb, 10000), 0);
    MT_EQ_INT(itu_call_finish(&c, 10000), 0);
    if (major == 2) {
      MT_TRUE(rb == NULL);
      MT_EQ_INT(c.status, GRPC_STATUS_FAILED_PRECONDITION);
    } else {
      MT_EQ_INT(c.status, GRPC_STATUS_OK);
      MT_TRUE(rb != NULL);
      ProtobufCMessage *m = NULL;
      mr_err e = {0};
      MT_OK(pr_decode(rb, &moerpc__v1__hello_reply__descriptor, 1 << 20, &m, &e), &e);
      Moerpc__V1__HelloReply *r = (Moerpc__V1__HelloReply *)m;
      MT_EQ_INT(r->protocol_major, 1);
      MT_EQ_INT(r->hidden_size, H);
      MT_EQ_INT(r->intermediate_size, 32);
      MT_EQ_INT(r->num_layers, 3);
      MT_EQ_INT(r->num_experts, E);
      MT_EQ_INT(r->max_tokens, MAXTOK);
      MT_EQ_INT(strlen(r->model_fingerprint), 16);
      MT_EQ_STR(r->weight_format, "bf16");
      MT_EQ_INT(r->n_owned, 2);
      for (size_t i = 0; i < r->n_owned; i++) {
        MT_EQ_INT(r->owned[i]->layer, i);
        MT_EQ_INT(r->owned[i]->n_experts, 8);
      }
      protobuf_c_message_free_unpacked(m, NULL);
    }
    if (rb) grpc_byte_buffer_destroy(rb);
    itu_call_close(&c);
  }
  teardown();
}

MT_MAIN()
