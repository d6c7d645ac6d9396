/*
 * test_proto.c - proto/ glue: zero-copy framing, decoding across arbitrary slice
 * boundaries, compatibility with plain protobuf-c, malformed input, byte buffers, health
 * framing, status mapping, channel args and targets.
 *
 * Every decode here runs over segments that live in separate heap blocks (seg_list), so
 * that a read past the end of one segment is caught by ASan (make SANITIZER=address)
 * instead of silently landing in the next one. Random splits use a fixed seed, printed
 * on failure; PR_TEST_SEED overrides it.
 */
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>

#include "proto/pr.h"
#include "tests/unit/mt.h"

/* ---- helpers ---------------------------------------------------------------------------- */

static uint64_t rng_state;
static void rng_seed(void) {
  const char *s = getenv("PR_TEST_SEED");
  rng_state = s ? strtoull(s, NULL, 0) : 0x9e3779b97f4a7c15ull;
  if (!rng_state) rng_state = 1;
}
static uint64_t rng_next(void) { /* xorshift64 */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
static size_t rng_below(size_t n) { return n ? (size_t)(rng_next() % n) : 0; }

/* Joins a byte buffer with gRPC's own reader (independent of the code under test). */
static uint8_t *bb_flatten(grpc_byte_buffer *bb, size_t *len) {
  grpc_byte_buffer_reader rd;
  MT_TRUE(grpc_byte_buffer_reader_init(&rd, bb));
  grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  *len = GRPC_SLICE_LENGTH(s);
  uint8_t *out = malloc(*len ? *len : 1);
  memcpy(out, GRPC_SLICE_START_PTR(s), *len);
  grpc_slice_unref(s);
  return out;
}

static int cmp_size(const void *a, const void *b) {
  size_t x = *(const size_t *)a, y = *(const size_t *)b;
  return x < y ? -1 : x > y;
}

/* A message cut into segments, each in its own heap block of exactly its size. */
typedef struct seg_list {
  pr_seg *v;
  size_t n;
} seg_list;

/* cuts[0..ncut) are offsets in 0..len, in any order, duplicates allowed (which make empty
 * segments). */
static seg_list seg_list_make(const uint8_t *buf, size_t len, size_t *cuts, size_t ncut) {
  if (ncut > 1) qsort(cuts, ncut, sizeof *cuts, cmp_size);
  seg_list l = {calloc(ncut + 1, sizeof(pr_seg)), ncut + 1};
  size_t prev = 0;
  for (size_t i = 0; i <= ncut; i++) {
    size_t end = i < ncut ? cuts[i] : len;
    size_t n = end - prev;
    uint8_t *p = malloc(n ? n : 1);
    memcpy(p, buf + prev, n);
    l.v[i] = (pr_seg){p, n};
    prev = end;
  }
  return l;
}
static seg_list seg_list_one(const uint8_t *buf, size_t len) {
  return seg_list_make(buf, len, NULL, 0);
}
static seg_list seg_list_bytes(const uint8_t *buf, size_t len) { /* 1-byte segments */
  size_t *cuts = malloc((len ? len : 1) * sizeof *cuts);
  for (size_t i = 0; i < len; i++) cuts[i] = i;
  seg_list l = seg_list_make(buf, len, cuts, len);
  free(cuts);
  return l;
}
static seg_list seg_list_random(const uint8_t *buf, size_t len) {
  size_t ncut = 1 + rng_below(len + 1);
  size_t *cuts = malloc(ncut * sizeof *cuts);
  for (size_t i = 0; i < ncut; i++) cuts[i] = rng_below(len + 1);
  seg_list l = seg_list_make(buf, len, cuts, ncut);
  free(cuts);
  return l;
}
static void seg_list_free(seg_list *l) {
  for (size_t i = 0; i < l->n; i++) free((void *)l->v[i].p);
  free(l->v);
  l->v = NULL;
  l->n = 0;
}

static uint8_t *payload_make(size_t len, uint8_t salt) {
  uint8_t *p = malloc(len ? len : 1);
  for (size_t i = 0; i < len; i++) p[i] = (uint8_t)(i * 131u + salt + (i >> 8));
  return p;
}

static int32_t req_ids[12] = {3, 17, -1, 127, 0, 5, 64, -1, 99, 100, 1, 2};
static float req_w[12] = {0.5f, 0.25f, 0.f, 0.125f, 1.f, -2.5f, 3e-8f, 0.f, 7.f, 0.1f, 0.2f, 0.3f};

static Moerpc__V1__ForwardRequest req_make(void) {
  Moerpc__V1__ForwardRequest r = MOERPC__V1__FORWARD_REQUEST__INIT;
  r.id = 0x0123456789abcdefull;
  r.layer = 57;
  r.n_tokens = 3;
  r.top_k = 4;
  r.n_expert_ids = 12;
  r.expert_ids = req_ids;
  r.n_weights = 12;
  r.weights = req_w;
  r.dtype = MOERPC__V1__DTYPE__DTYPE_BF16;
  return r;
}

static void req_expect_equal(const Moerpc__V1__ForwardRequest *a,
                             const Moerpc__V1__ForwardRequest *b) {
  MT_EQ_U64(a->id, b->id);
  MT_EQ_INT(a->layer, b->layer);
  MT_EQ_INT(a->n_tokens, b->n_tokens);
  MT_EQ_INT(a->top_k, b->top_k);
  MT_EQ_INT(a->dtype, b->dtype);
  MT_EQ_INT(a->n_expert_ids, b->n_expert_ids);
  MT_EQ_INT(a->n_weights, b->n_weights);
  for (size_t i = 0; i < a->n_expert_ids; i++) MT_EQ_INT(a->expert_ids[i], b->expert_ids[i]);
  for (size_t i = 0; i < a->n_weights; i++)
    MT_TRUE(memcmp(&a->weights[i], &b->weights[i], sizeof(float)) == 0);
}

static Moerpc__V1__ForwardReply rep_make(void) {
  Moerpc__V1__ForwardReply r = MOERPC__V1__FORWARD_REPLY__INIT;
  r.id = 42;
  r.status = 3;
  r.error = "expert_ids[5] = 300, must be < num_experts 128";
  r.queue_us = 12;
  r.compute_us = 3456789;
  r.dtype = MOERPC__V1__DTYPE__DTYPE_F16;
  return r;
}

static void rep_expect_equal(const Moerpc__V1__ForwardReply *a,
                             const Moerpc__V1__ForwardReply *b) {
  MT_EQ_U64(a->id, b->id);
  MT_EQ_INT(a->status, b->status);
  MT_EQ_STR(a->error, b->error);
  MT_EQ_INT(a->queue_us, b->queue_us);
  MT_EQ_INT(a->compute_us, b->compute_us);
  MT_EQ_INT(a->dtype, b->dtype);
}

/* Decodes a ForwardRequest from l and checks header and payload against want / pay. */
static void req_check_decode(const seg_list *l, const Moerpc__V1__ForwardRequest *want,
                             const uint8_t *pay, size_t pay_len) {
  pr_split sp = {0};
  Moerpc__V1__ForwardRequest *got = NULL;
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  MT_OK(pr_forward_request_decode(l->v, l->n, &sp, &got, e), e);
  req_expect_equal(got, want);
  MT_EQ_INT(got->hidden.len, 0);
  MT_TRUE(sp.payload.present == (pay_len > 0));
  MT_EQ_INT(sp.payload.len, pay_len);
  size_t sum = 0;
  for (size_t k = 0; k < sp.payload.n; k++) sum += sp.payload.segs[k].len;
  MT_EQ_INT(sum, pay_len);
  uint8_t *g = malloc(pay_len ? pay_len : 1);
  pr_payload_gather(&sp.payload, g);
  MT_TRUE(memcmp(g, pay, pay_len) == 0);
  free(g);
  moerpc__v1__forward_request__free_unpacked(got, NULL);
  pr_split_free(&sp);
}

static void rep_check_decode(const seg_list *l, const Moerpc__V1__ForwardReply *want,
                             const uint8_t *pay, size_t pay_len) {
  pr_split sp = {0};
  Moerpc__V1__ForwardReply *got = NULL;
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  MT_OK(pr_forward_reply_decode(l->v, l->n, &sp, &got, e), e);
  rep_expect_equal(got, want);
  MT_EQ_INT(got->output.len, 0);
  MT_EQ_INT(sp.payload.len, pay_len);
  uint8_t *g = malloc(pay_len ? pay_len : 1);
  pr_payload_gather(&sp.payload, g);
  MT_TRUE(memcmp(g, pay, pay_len) == 0);
  free(g);
  moerpc__v1__forward_reply__free_unpacked(got, NULL);
  pr_split_free(&sp);
}

/* Runs check over: one segment, every single split point, 1-byte segments, and `nrand`
 * random multi-splits (with empty segments where cuts coincide). */
#define FOR_EACH_SPLIT(buf, len, nrand, l, body)                                          \
  do {                                                                                    \
    seg_list l = seg_list_one((buf), (len));                                              \
    body;                                                                                 \
    seg_list_free(&l);                                                                    \
    for (size_t cut_ = 0; cut_ <= (len); cut_++) {                                        \
      size_t c_[1] = {cut_};                                                              \
      l = seg_list_make((buf), (len), c_, 1);                                             \
      body;                                                                               \
      seg_list_free(&l);                                                                  \
    }                                                                                     \
    l = seg_list_bytes((buf), (len));                                                     \
    body;                                                                                 \
    seg_list_free(&l);                                                                    \
    for (int r_ = 0; r_ < (nrand); r_++) {                                                \
      l = seg_list_random((buf), (len));                                                  \
      body;                                                                               \
      seg_list_free(&l);                                                                  \
    }                                                                                     \
  } while (0)

/* ---- framing round trips ------------------------------------------------------------------ */

static void request_roundtrip(size_t pay_len) {
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *pay = payload_make(pay_len, 7);
  grpc_byte_buffer *bb = pr_encode_with_payload(&req.base, pay, pay_len, NULL, NULL);
  MT_TRUE(bb != NULL);
  size_t len;
  uint8_t *buf = bb_flatten(bb, &len);
  grpc_byte_buffer_destroy(bb);
  FOR_EACH_SPLIT(buf, len, 300, l, req_check_decode(&l, &req, pay, pay_len));
  free(buf);
  free(pay);
}

MT_TEST(request_roundtrip_every_split) {
  grpc_init();
  rng_seed();
  /* Payload lengths around the 1/2/3-byte varint edges of the length prefix. */
  size_t lens[] = {0, 1, 127, 128, 300, 16383, 16384};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    if (lens[i] > 1000) { /* every split of 16 KiB is slow; one-segment + random only */
      Moerpc__V1__ForwardRequest req = req_make();
      uint8_t *pay = payload_make(lens[i], 3);
      grpc_byte_buffer *bb = pr_encode_with_payload(&req.base, pay, lens[i], NULL, NULL);
      size_t len;
      uint8_t *buf = bb_flatten(bb, &len);
      grpc_byte_buffer_destroy(bb);
      for (int r = 0; r < 100; r++) {
        seg_list l = seg_list_random(buf, len);
        req_check_decode(&l, &req, pay, lens[i]);
        seg_list_free(&l);
      }
      seg_list l = seg_list_bytes(buf, len);
      req_check_decode(&l, &req, pay, lens[i]);
      seg_list_free(&l);
      free(buf);
      free(pay);
    } else {
      request_roundtrip(lens[i]);
    }
  }
  grpc_shutdown();
}

MT_TEST(reply_roundtrip_every_split) {
  grpc_init();
  rng_seed();
  size_t lens[] = {0, 5, 200};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    Moerpc__V1__ForwardReply rep = rep_make();
    uint8_t *pay = payload_make(lens[i], 11);
    grpc_byte_buffer *bb = pr_encode_with_payload(&rep.base, pay, lens[i], NULL, NULL);
    size_t len;
    uint8_t *buf = bb_flatten(bb, &len);
    grpc_byte_buffer_destroy(bb);
    FOR_EACH_SPLIT(buf, len, 300, l, rep_check_decode(&l, &rep, pay, lens[i]));
    free(buf);
    free(pay);
  }
  grpc_shutdown();
}

/* A default reply is the empty message: zero segments, or only empty ones, decode. */
MT_TEST(empty_message_decodes_to_defaults) {
  pr_split sp = {0};
  Moerpc__V1__ForwardReply *got = NULL;
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  MT_OK(pr_forward_reply_decode(NULL, 0, &sp, &got, e), e);
  MT_EQ_U64(got->id, 0);
  MT_EQ_STR(got->error, "");
  MT_FALSE(sp.payload.present);
  MT_EQ_INT(sp.hdr_len, 0);
  moerpc__v1__forward_reply__free_unpacked(got, NULL);
  static const uint8_t none[1];
  pr_seg empties[3] = {{none, 0}, {none, 0}, {none, 0}};
  MT_OK(pr_forward_reply_decode(empties, 3, &sp, &got, e), e);
  MT_FALSE(sp.payload.present);
  moerpc__v1__forward_reply__free_unpacked(got, NULL);
  pr_split_free(&sp);
}

/* ---- compatibility with plain protobuf-c --------------------------------------------------- */

MT_TEST(protobuf_c_packed_decodes_with_pr) {
  rng_seed();
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *pay = payload_make(1000, 5);
  req.hidden.data = pay;
  req.hidden.len = 1000;
  size_t len = moerpc__v1__forward_request__get_packed_size(&req);
  uint8_t *buf = malloc(len);
  MT_EQ_INT(moerpc__v1__forward_request__pack(&req, buf), len);
  req.hidden.data = NULL;
  req.hidden.len = 0;
  FOR_EACH_SPLIT(buf, len, 50, l, req_check_decode(&l, &req, pay, 1000));

  Moerpc__V1__ForwardReply rep = rep_make();
  rep.output.data = pay;
  rep.output.len = 333;
  len = moerpc__v1__forward_reply__get_packed_size(&rep);
  buf = realloc(buf, len);
  moerpc__v1__forward_reply__pack(&rep, buf);
  seg_list l = seg_list_bytes(buf, len);
  rep_check_decode(&l, &rep, pay, 333);
  seg_list_free(&l);
  free(buf);
  free(pay);
}

MT_TEST(pr_encoded_is_byte_identical_to_protobuf_c) {
  grpc_init();
  size_t lens[] = {1, 127, 128, 70000};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    Moerpc__V1__ForwardRequest req = req_make();
    uint8_t *pay = payload_make(lens[i], 9);
    grpc_byte_buffer *bb = pr_encode_with_payload(&req.base, pay, lens[i], NULL, NULL);
    size_t len;
    uint8_t *buf = bb_flatten(bb, &len);
    grpc_byte_buffer_destroy(bb);

    /* protobuf-c reads it as one message ... */
    Moerpc__V1__ForwardRequest *u = moerpc__v1__forward_request__unpack(NULL, len, buf);
    MT_TRUE(u != NULL);
    req_expect_equal(u, &req);
    MT_EQ_INT(u->hidden.len, lens[i]);
    MT_TRUE(memcmp(u->hidden.data, pay, lens[i]) == 0);
    moerpc__v1__forward_request__free_unpacked(u, NULL);

    /* ... and writes the very same bytes (it orders fields by number, 15 last). */
    req.hidden.data = pay;
    req.hidden.len = lens[i];
    size_t plen = moerpc__v1__forward_request__get_packed_size(&req);
    uint8_t *pbuf = malloc(plen);
    moerpc__v1__forward_request__pack(&req, pbuf);
    MT_EQ_INT(plen, len);
    MT_TRUE(memcmp(pbuf, buf, len) == 0);
    free(pbuf);
    free(buf);
    free(pay);
  }
  /* A header small enough for gRPC to inline in the slice struct (under 24 bytes). */
  Moerpc__V1__ForwardReply tiny = MOERPC__V1__FORWARD_REPLY__INIT;
  tiny.id = 3;
  static const uint8_t out[5] = {9, 8, 7, 6, 5};
  grpc_byte_buffer *bb = pr_encode_with_payload(&tiny.base, out, sizeof out, NULL, NULL);
  size_t len;
  uint8_t *buf = bb_flatten(bb, &len);
  const uint8_t want[] = {0x08, 0x03, 0x7a, 0x05, 9, 8, 7, 6, 5};
  MT_EQ_INT(len, sizeof want);
  MT_TRUE(memcmp(buf, want, len) == 0);
  free(buf);
  grpc_byte_buffer_destroy(bb);
  grpc_shutdown();
}

/* The framing relies on protobuf-c omitting a proto3 bytes field of length 0, even with a
 * non-NULL data pointer; if a protobuf-c upgrade changed that, field 15 would be sent
 * twice. */
MT_TEST(protobuf_c_omits_empty_bytes_field) {
  grpc_init();
  Moerpc__V1__ForwardRequest req = req_make();
  size_t n0 = moerpc__v1__forward_request__get_packed_size(&req);
  static uint8_t dummy[4] = {1, 2, 3, 4};
  req.hidden.data = dummy;
  req.hidden.len = 0;
  MT_EQ_INT(moerpc__v1__forward_request__get_packed_size(&req), n0);
  uint8_t *a = malloc(n0);
  moerpc__v1__forward_request__pack(&req, a);
  req.hidden.data = NULL;

  /* pr_encode_with_payload with len 0 equals pr_encode: no field 15 at all. */
  grpc_byte_buffer *b1 = pr_encode_with_payload(&req.base, NULL, 0, NULL, NULL);
  grpc_byte_buffer *b2 = pr_encode(&req.base);
  size_t l1, l2;
  uint8_t *f1 = bb_flatten(b1, &l1), *f2 = bb_flatten(b2, &l2);
  MT_EQ_INT(l1, n0);
  MT_EQ_INT(l2, n0);
  MT_TRUE(memcmp(f1, a, n0) == 0 && memcmp(f2, a, n0) == 0);
  seg_list l = seg_list_one(f1, l1);
  pr_split sp = {0};
  MT_OK(pr_split_message(&sp, l.v, l.n, NULL), (mr_err *)NULL);
  MT_FALSE(sp.payload.present);
  MT_EQ_INT(sp.hdr_len, n0);
  pr_split_free(&sp);
  seg_list_free(&l);
  free(f1);
  free(f2);
  free(a);
  grpc_byte_buffer_destroy(b1);
  grpc_byte_buffer_destroy(b2);
  grpc_shutdown();
}

/* ---- field order, repetition, unknown fields ------------------------------------------------ */

/* Appends bytes to a growing test message. */
typedef struct wbuf {
  uint8_t b[4096];
  size_t n;
} wbuf;
static void w_bytes(wbuf *w, const void *p, size_t n) {
  MT_TRUE(w->n + n <= sizeof w->b);
  memcpy(w->b + w->n, p, n);
  w->n += n;
}
static void w_varint(wbuf *w, uint64_t v) {
  do {
    uint8_t c = (uint8_t)(v & 0x7f);
    v >>= 7;
    if (v) c |= 0x80;
    w_bytes(w, &c, 1);
  } while (v);
}
static void w_tag(wbuf *w, uint32_t field, unsigned wt) { w_varint(w, (uint64_t)field << 3 | wt); }
static void w_len(wbuf *w, uint32_t field, const void *p, size_t n) {
  w_tag(w, field, 2);
  w_varint(w, n);
  w_bytes(w, p, n);
}
/* Appends req (without payload) packed by protobuf-c. */
static void w_req(wbuf *w, const Moerpc__V1__ForwardRequest *req) {
  size_t n = moerpc__v1__forward_request__get_packed_size(req);
  MT_TRUE(w->n + n <= sizeof w->b);
  moerpc__v1__forward_request__pack(req, w->b + w->n);
  w->n += n;
}

MT_TEST(payload_field_first) {
  rng_seed();
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *pay = payload_make(150, 1);
  wbuf w = {.n = 0};
  w_len(&w, 15, pay, 150);
  w_req(&w, &req);
  FOR_EACH_SPLIT(w.b, w.n, 100, l, req_check_decode(&l, &req, pay, 150));
  free(pay);
}

MT_TEST(payload_field_twice_last_wins) {
  rng_seed();
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *first = payload_make(90, 1), *last = payload_make(140, 2);
  wbuf w = {.n = 0};
  w_len(&w, 15, first, 90);
  w_req(&w, &req);
  w_len(&w, 15, last, 140);
  FOR_EACH_SPLIT(w.b, w.n, 100, l, req_check_decode(&l, &req, last, 140));

  /* Also with the header between the two occurrences split in halves. */
  Moerpc__V1__ForwardRequest half = MOERPC__V1__FORWARD_REQUEST__INIT;
  half.id = req.id;
  half.layer = req.layer;
  wbuf w2 = {.n = 0};
  w_req(&w2, &half);
  w_len(&w2, 15, last, 140);
  half.id = 0;
  half.layer = 0;
  half.n_tokens = req.n_tokens;
  half.top_k = req.top_k;
  half.n_expert_ids = req.n_expert_ids;
  half.expert_ids = req.expert_ids;
  half.n_weights = req.n_weights;
  half.weights = req.weights;
  half.dtype = req.dtype;
  w_req(&w2, &half);
  w_len(&w2, 15, first, 90);
  seg_list l = seg_list_bytes(w2.b, w2.n);
  req_check_decode(&l, &req, first, 90);
  seg_list_free(&l);
  free(first);
  free(last);
}

MT_TEST(unknown_fields_skipped) {
  rng_seed();
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *pay = payload_make(200, 4);
  wbuf w = {.n = 0};
  uint8_t f8[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  w_tag(&w, 100, 0); /* varint, 10 bytes */
  w_varint(&w, UINT64_MAX);
  w_tag(&w, 101, 1); /* fixed64 */
  w_bytes(&w, f8, 8);
  w_req(&w, &req);
  w_len(&w, 102, "unknown", 7);
  w_len(&w, 15, pay, 200);
  w_tag(&w, 536870911, 5); /* largest field number, fixed32 */
  w_bytes(&w, f8, 4);
  w_len(&w, 103, "", 0);
  FOR_EACH_SPLIT(w.b, w.n, 100, l, req_check_decode(&l, &req, pay, 200));
  free(pay);
}

/* ---- malformed input ------------------------------------------------------------------------ */

/* Decodes l as ForwardRequest and expects MR_EFORMAT with n1 and n2 (offset, field,
 * reason) in the message, no header and an emptied split. */
static void bad_check(const seg_list *l, const char *n1, const char *n2) {
  pr_split sp = {0};
  Moerpc__V1__ForwardRequest *got = (void *)1;
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  MT_EQ_INT(pr_forward_request_decode(l->v, l->n, &sp, &got, e), MR_EFORMAT);
  MT_EQ_INT(e->code, MR_EFORMAT);
  MT_TRUE(got == NULL);
  MT_EQ_INT(sp.hdr_len, 0);
  MT_FALSE(sp.payload.present);
  MT_CONTAINS(e->msg, "ForwardRequest: ");
  MT_CONTAINS(e->msg, n1);
  if (n2) MT_CONTAINS(e->msg, n2);
  pr_split_free(&sp);
}
/* ... over every kind of split. */
static void expect_bad(const uint8_t *buf, size_t len, const char *n1, const char *n2) {
  FOR_EACH_SPLIT(buf, len, 20, l, bad_check(&l, n1, n2));
}

MT_TEST(malformed_inputs_are_eformat_with_offset) {
  rng_seed();
  /* Each starts with a valid field (id = 5) so the offset is not trivially 0. */
  const uint8_t trunc_tag[] = {0x08, 0x05, 0x80};
  expect_bad(trunc_tag, sizeof trunc_tag, "byte 2:", "inside a field tag");
  const uint8_t trunc_val[] = {0x08, 0x05, 0x10, 0x80, 0x80};
  expect_bad(trunc_val, sizeof trunc_val, "field 2 at byte 2:", "inside its varint");
  const uint8_t trunc_len[] = {0x08, 0x05, 0x2a};
  expect_bad(trunc_len, sizeof trunc_len, "field 5 at byte 2:", "inside its length");
  const uint8_t past_end[] = {0x08, 0x05, 0x2a, 0x05, 0x01, 0x02};
  expect_bad(past_end, sizeof past_end, "field 5 at byte 2:", "length 5, but 2 left in the message");
  const uint8_t pay_past_end[] = {0x08, 0x05, 0x7a, 0x10, 0x01, 0x02, 0x03};
  expect_bad(pay_past_end, sizeof pay_past_end, "field 15 at byte 2:", "length 16, but 3 left");
  const uint8_t v11[] = {0x08, 0x05, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff,
                         0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  expect_bad(v11, sizeof v11, "field 1 at byte 2:", "longer than 10 bytes");
  const uint8_t tag11[] = {0x08, 0x05, 0x80, 0x80, 0x80, 0x80, 0x80,
                           0x80, 0x80, 0x80, 0x80, 0x80, 0x01};
  expect_bad(tag11, sizeof tag11, "byte 2:", "tag varint is longer than 10 bytes");
  const uint8_t len11[] = {0x08, 0x05, 0x7a, 0xff, 0xff, 0xff, 0xff, 0xff,
                           0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  expect_bad(len11, sizeof len11, "field 15 at byte 2:", "length varint is longer");
  const uint8_t huge[] = {0x08, 0x05, 0x7a, 0xff, 0xff, 0xff, 0xff, 0xff,
                          0xff, 0xff, 0xff, 0xff, 0x01, 0x00};
  expect_bad(huge, sizeof huge, "field 15 at byte 2:", "length 18446744073709551615, but 1 left");
  const uint8_t huge_hdr[] = {0x08, 0x05, 0x32, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x00};
  expect_bad(huge_hdr, sizeof huge_hdr, "field 6 at byte 2:", "length 4294967295, but 1 left");
  const uint8_t wt3[] = {0x08, 0x05, 0x4b, 0x00};
  expect_bad(wt3, sizeof wt3, "field 9 at byte 2:", "wire type 3 (group)");
  const uint8_t wt4[] = {0x08, 0x05, 0x4c, 0x00};
  expect_bad(wt4, sizeof wt4, "field 9 at byte 2:", "wire type 4 (group)");
  const uint8_t wt6[] = {0x08, 0x05, 0x4e, 0x00};
  expect_bad(wt6, sizeof wt6, "field 9 at byte 2:", "wire type 6 does not exist");
  const uint8_t wt7[] = {0x08, 0x05, 0x4f, 0x00};
  expect_bad(wt7, sizeof wt7, "field 9 at byte 2:", "wire type 7 does not exist");
  const uint8_t field0[] = {0x08, 0x05, 0x02, 0x00};
  expect_bad(field0, sizeof field0, "byte 2:", "field number 0 is out of range");
  const uint8_t field_big[] = {0x08, 0x05, 0x80, 0x80, 0x80, 0x80, 0x10}; /* tag 2^32 */
  expect_bad(field_big, sizeof field_big, "byte 2:", "field number 536870912 is out of range");
  const uint8_t fixed64[] = {0x08, 0x05, 0x19, 0x01, 0x02, 0x03};
  expect_bad(fixed64, sizeof fixed64, "field 3 at byte 2:", "needs 8 bytes, only 3 left");
  const uint8_t fixed32[] = {0x08, 0x05, 0x1d, 0x01};
  expect_bad(fixed32, sizeof fixed32, "field 3 at byte 2:", "needs 4 bytes, only 1 left");
  const uint8_t pay_wt0[] = {0x08, 0x05, 0x78, 0x01};
  expect_bad(pay_wt0, sizeof pay_wt0, "field 15 at byte 2:", "must be 2");
  /* Valid framing, but field 5 (repeated int32) as fixed64: protobuf-c rejects it. */
  const uint8_t pbc_bad[] = {0x08, 0x05, 0x29, 1, 2, 3, 4, 5, 6, 7, 8};
  expect_bad(pbc_bad, sizeof pbc_bad, "protobuf-c could not unpack header (11 bytes)", NULL);
}

MT_TEST(header_limit_is_enforced) {
  /* Unknown field 20, length-delimited: tag 0xa2 0x01, a 4-byte length, then data, so the
   * field is 6 + len bytes. Exactly PR_MAX_HEADER_BYTES passes; one more byte fails. */
  size_t len = PR_MAX_HEADER_BYTES - 6 + 1;
  uint8_t *buf = calloc(1, len + 6);
  for (int over = 0; over <= 1; over++) {
    size_t body = PR_MAX_HEADER_BYTES - 6 + (size_t)over;
    buf[0] = 0xa2;
    buf[1] = 0x01;
    buf[2] = (uint8_t)(body | 0x80);
    buf[3] = (uint8_t)(body >> 7 | 0x80);
    buf[4] = (uint8_t)(body >> 14 | 0x80);
    buf[5] = (uint8_t)(body >> 21);
    pr_seg s[2] = {{buf, 3}, {buf + 3, body + 3}};
    pr_split sp = {0};
    mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
    int rc = pr_split_message(&sp, s, 2, e);
    if (!over) {
      MT_OK(rc, e);
      MT_EQ_INT(sp.hdr_len, PR_MAX_HEADER_BYTES);
    } else {
      MT_EQ_INT(rc, MR_EFORMAT);
      MT_CONTAINS(e->msg, "field 20 at byte 0:");
      MT_CONTAINS(e->msg, "16777217 bytes, over the limit of 16777216");
    }
    pr_split_free(&sp);
  }
  free(buf);
}

/* A split is reused across messages (as a stream does), also after an error. */
MT_TEST(split_reuse_and_error_recovery) {
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *big = payload_make(5000, 1);
  wbuf w = {.n = 0};
  w_req(&w, &req);
  w_len(&w, 15, big, 3000);
  pr_split sp = {0};
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  seg_list l = seg_list_bytes(w.b, w.n);
  MT_OK(pr_split_message(&sp, l.v, l.n, e), e);
  MT_EQ_INT(sp.payload.n, 3000);
  MT_EQ_INT(sp.payload.len, 3000);
  seg_list_free(&l);

  const uint8_t bad[] = {0x4b, 0x00};
  l = seg_list_one(bad, sizeof bad);
  MT_EQ_INT(pr_split_message(&sp, l.v, l.n, e), MR_EFORMAT);
  MT_EQ_INT(sp.hdr_len, 0);
  MT_EQ_INT(sp.payload.n, 0);
  seg_list_free(&l);

  wbuf w2 = {.n = 0};
  w_len(&w2, 15, big + 7, 10);
  l = seg_list_one(w2.b, w2.n);
  MT_OK(pr_split_message(&sp, l.v, l.n, e), e);
  MT_EQ_INT(sp.hdr_len, 0);
  MT_EQ_INT(sp.payload.n, 1);
  MT_TRUE(sp.payload.present);
  uint8_t g[10];
  pr_payload_gather(&sp.payload, g);
  MT_TRUE(memcmp(g, big + 7, 10) == 0);
  /* The view points into the input segment: nothing was copied. */
  MT_TRUE(sp.payload.segs[0].p == l.v[0].p + 2);
  seg_list_free(&l);

  const uint8_t empty_pay[] = {0x7a, 0x00};
  l = seg_list_one(empty_pay, sizeof empty_pay);
  MT_OK(pr_split_message(&sp, l.v, l.n, e), e);
  MT_TRUE(sp.payload.present);
  MT_EQ_INT(sp.payload.len, 0);
  MT_EQ_INT(sp.payload.n, 0);
  seg_list_free(&l);
  pr_split_free(&sp);
  pr_split_free(&sp); /* idempotent on the emptied split */
  pr_split_free(NULL);
  free(big);
}

MT_TEST(split_out_of_memory_is_clean) {
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *pay = payload_make(100, 1);
  wbuf w = {.n = 0};
  w_req(&w, &req);
  w_len(&w, 15, pay, 100);
  seg_list l = seg_list_bytes(w.b, w.n); /* 100 views: the view list grows several times */
  int saw_enomem = 0, saw_ok = 0;
  for (long n = 1; n <= 12; n++) {
    pr_split sp = {0};
    mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
    mr_alloc_fail_after(n);
    int rc = pr_split_message(&sp, l.v, l.n, e);
    mr_alloc_fail_after(0);
    if (rc) {
      MT_EQ_INT(rc, MR_ENOMEM);
      MT_CONTAINS(e->msg, "out of memory");
      MT_EQ_INT(sp.hdr_len, 0);
      saw_enomem++;
    } else {
      MT_EQ_INT(sp.payload.len, 100);
      saw_ok++;
    }
    pr_split_free(&sp);
  }
  MT_TRUE(saw_enomem > 0 && saw_ok > 0);
  seg_list_free(&l);
  free(pay);
}

/* ---- zero copy -------------------------------------------------------------------------------- */

static int release_calls;
static void *release_owner;
static void on_release(void *owner) {
  release_calls++;
  release_owner = owner;
}

MT_TEST(zero_copy_payload_released_once) {
  grpc_init();
  size_t lens[] = {5, 4096};
  for (size_t i = 0; i < 2; i++) {
    Moerpc__V1__ForwardReply rep = rep_make();
    uint8_t *pay = payload_make(lens[i], 2);
    int owner_tag;
    release_calls = 0;
    release_owner = NULL;
    grpc_byte_buffer *bb = pr_encode_with_payload(&rep.base, pay, lens[i], on_release, &owner_tag);
    MT_TRUE(bb != NULL);
    MT_EQ_INT(release_calls, 0);
    MT_EQ_INT(bb->data.raw.slice_buffer.count, 2);
    grpc_slice ps = bb->data.raw.slice_buffer.slices[1];
    MT_TRUE(GRPC_SLICE_START_PTR(ps) == pay); /* referenced, not copied */
    MT_EQ_INT(GRPC_SLICE_LENGTH(ps), lens[i]);

    /* The receive path of the same buffer yields views into the caller's memory too. */
    pr_seg *segs;
    size_t n;
    mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
    MT_OK(pr_bb_segs(bb, &segs, &n, e), e);
    MT_EQ_INT(n, 2);
    pr_split sp = {0};
    Moerpc__V1__ForwardReply *got;
    MT_OK(pr_forward_reply_decode(segs, n, &sp, &got, e), e);
    rep_expect_equal(got, &rep);
    MT_EQ_INT(sp.payload.n, 1);
    MT_TRUE(sp.payload.segs[0].p == pay);
    moerpc__v1__forward_reply__free_unpacked(got, NULL);
    pr_split_free(&sp);
    mr_free(segs);

    MT_EQ_INT(release_calls, 0);
    grpc_byte_buffer_destroy(bb);
    MT_EQ_INT(release_calls, 1);
    MT_TRUE(release_owner == &owner_tag);
    free(pay);
  }

  /* release NULL: a static slice, still the caller's pointer. */
  static const uint8_t static_pay[64] = {1, 2, 3};
  Moerpc__V1__ForwardRequest req = req_make();
  grpc_byte_buffer *bb = pr_encode_with_payload(&req.base, static_pay, sizeof static_pay, NULL, NULL);
  MT_TRUE(GRPC_SLICE_START_PTR(bb->data.raw.slice_buffer.slices[1]) == static_pay);
  grpc_byte_buffer_destroy(bb);

  /* len 0: no payload slice, and release is called at once, exactly once. */
  release_calls = 0;
  bb = pr_encode_with_payload(&req.base, static_pay, 0, on_release, (void *)static_pay);
  MT_EQ_INT(release_calls, 1);
  MT_EQ_INT(bb->data.raw.slice_buffer.count, 1);
  grpc_byte_buffer_destroy(bb);
  MT_EQ_INT(release_calls, 1);
  grpc_shutdown();
}

/* Our bug, not input: a header with the payload field set aborts. */
MT_TEST(encode_with_payload_set_in_header_asserts) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    grpc_init();
    Moerpc__V1__ForwardRequest req = req_make();
    uint8_t x = 1;
    req.hidden.data = &x;
    req.hidden.len = 1;
    if (!freopen("/dev/null", "w", stderr)) _exit(3);
    pr_encode_with_payload(&req.base, &x, 1, NULL, NULL);
    _exit(0);
  }
  int st;
  waitpid(pid, &st, 0);
  MT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
}

MT_TEST(payload_prefix_bytes) {
  uint8_t b[11];
  MT_EQ_INT(pr_payload_prefix(b, 0), 2);
  MT_EQ_INT(b[0], 0x7a);
  MT_EQ_INT(b[1], 0);
  MT_EQ_INT(pr_payload_prefix(b, 127), 2);
  MT_EQ_INT(b[1], 127);
  MT_EQ_INT(pr_payload_prefix(b, 128), 3);
  MT_EQ_INT(b[1], 0x80);
  MT_EQ_INT(b[2], 0x01);
  MT_EQ_INT(pr_payload_prefix(b, UINT64_MAX), 11);
  MT_EQ_INT(b[9], 0xff);
  MT_EQ_INT(b[10], 0x01);
}

/* ---- byte buffers ---------------------------------------------------------------------------- */

MT_TEST(bb_segs_raw_and_compressed) {
  grpc_init();
  Moerpc__V1__ForwardRequest req = req_make();
  uint8_t *pay = payload_make(700, 8);
  wbuf w = {.n = 0};
  w_req(&w, &req);
  w_len(&w, 15, pay, 700);

  /* Raw, three slices: views, no copy. */
  /* (Over gRPC's 23-byte inline size, else grpc_slice_buffer_add merges them.) */
  grpc_slice s[3] = {grpc_slice_from_copied_buffer((char *)w.b, 30),
                     grpc_slice_from_copied_buffer((char *)w.b + 30, 40),
                     grpc_slice_from_copied_buffer((char *)w.b + 70, w.n - 70)};
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, 3);
  for (int i = 0; i < 3; i++) grpc_slice_unref(s[i]);
  pr_seg *segs;
  size_t n;
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  MT_OK(pr_bb_segs(bb, &segs, &n, e), e);
  MT_EQ_INT(n, 3);
  MT_EQ_INT(segs[0].len, 30);
  MT_EQ_INT(segs[1].len, 40);
  MT_TRUE(segs[2].p == GRPC_SLICE_START_PTR(bb->data.raw.slice_buffer.slices[2]));
  seg_list l = {segs, n};
  req_check_decode(&l, &req, pay, 700);
  mr_free(segs);
  grpc_byte_buffer_destroy(bb);

  /* Compressed: gRPC 1.51's reader would hand back the compressed bytes, so it is
   * refused (gRPC's decompression filter, on by default, never lets one through). */
  const char junk[40] = "deflate output, not protobuf";
  grpc_slice zs = grpc_slice_from_copied_buffer(junk, sizeof junk);
  bb = grpc_raw_compressed_byte_buffer_create(&zs, 1, GRPC_COMPRESS_GZIP);
  grpc_slice_unref(zs);
  segs = (void *)1;
  MT_EQ_INT(pr_bb_segs(bb, &segs, &n, e), MR_ENOTSUP);
  MT_CONTAINS(e->msg, "compressed (compression algorithm 2)");
  MT_TRUE(segs == NULL && n == 0);
  ProtobufCMessage *m = (void *)1;
  MT_EQ_INT(pr_decode(bb, &moerpc__v1__forward_request__descriptor, 1000, &m, e), MR_ENOTSUP);
  MT_CONTAINS(e->msg, "ForwardRequest: message arrived compressed");
  MT_TRUE(m == NULL);
  int st;
  MT_EQ_INT(pr_health_response_decode(bb, &st, e), MR_ENOTSUP);
  MT_CONTAINS(e->msg, "HealthCheckResponse: ");
  grpc_byte_buffer_destroy(bb);

  /* Out of memory for the view list. */
  bb = pr_encode(&req.base);
  mr_alloc_fail_after(1);
  int rc = pr_bb_segs(bb, &segs, &n, e);
  mr_alloc_fail_after(0);
  MT_EQ_INT(rc, MR_ENOMEM);
  MT_TRUE(segs == NULL);
  grpc_byte_buffer_destroy(bb);
  free(pay);
  grpc_shutdown();
}

MT_TEST(small_message_encode_decode) {
  grpc_init();
  uint32_t e0[] = {1, 2, 3}, e1[] = {7};
  Moerpc__V1__LayerExperts le[2] = {MOERPC__V1__LAYER_EXPERTS__INIT,
                                    MOERPC__V1__LAYER_EXPERTS__INIT};
  le[0].layer = 1;
  le[0].n_experts = 3;
  le[0].experts = e0;
  le[1].layer = 60;
  le[1].n_experts = 1;
  le[1].experts = e1;
  Moerpc__V1__LayerExperts *owned[2] = {&le[0], &le[1]};
  Moerpc__V1__HelloReply hr = MOERPC__V1__HELLO_REPLY__INIT;
  hr.protocol_major = PR_PROTOCOL_MAJOR;
  hr.model_fingerprint = "0123456789abcdef";
  hr.hidden_size = 7168;
  hr.n_owned = 2;
  hr.owned = owned;
  hr.weight_format = "int4-g64";
  hr.max_tokens = 8192;

  grpc_byte_buffer *bb = pr_encode(&hr.base);
  size_t len;
  uint8_t *flat = bb_flatten(bb, &len);
  ProtobufCMessage *m = NULL;
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  MT_OK(pr_decode(bb, &moerpc__v1__hello_reply__descriptor, 1 << 20, &m, e), e);
  Moerpc__V1__HelloReply *g = (Moerpc__V1__HelloReply *)m;
  MT_EQ_INT(g->protocol_major, 1);
  MT_EQ_STR(g->model_fingerprint, "0123456789abcdef");
  MT_EQ_INT(g->hidden_size, 7168);
  MT_EQ_INT(g->n_owned, 2);
  MT_EQ_INT(g->owned[0]->n_experts, 3);
  MT_EQ_INT(g->owned[0]->experts[2], 3);
  MT_EQ_INT(g->owned[1]->layer, 60);
  MT_EQ_STR(g->weight_format, "int4-g64");
  MT_EQ_INT(g->max_tokens, 8192);
  protobuf_c_message_free_unpacked(m, NULL);

  /* Over the limit: named type and limit. */
  MT_EQ_INT(pr_decode(bb, &moerpc__v1__hello_reply__descriptor, len - 1, &m, e), MR_EEXHAUSTED);
  MT_TRUE(m == NULL);
  MT_CONTAINS(e->msg, "HelloReply");
  char lim[64];
  snprintf(lim, sizeof lim, "limit of %zu bytes", len - 1);
  MT_CONTAINS(e->msg, lim);
  grpc_byte_buffer_destroy(bb);

  /* Several slices: joined by the reader. */
  grpc_slice s[3] = {grpc_slice_from_copied_buffer((char *)flat, 1),
                     grpc_slice_from_copied_buffer((char *)flat + 1, 5),
                     grpc_slice_from_copied_buffer((char *)flat + 6, len - 6)};
  bb = grpc_raw_byte_buffer_create(s, 3);
  for (int i = 0; i < 3; i++) grpc_slice_unref(s[i]);
  MT_OK(pr_decode(bb, &moerpc__v1__hello_reply__descriptor, len, &m, e), e);
  MT_EQ_INT(((Moerpc__V1__HelloReply *)m)->max_tokens, 8192);
  protobuf_c_message_free_unpacked(m, NULL);
  grpc_byte_buffer_destroy(bb);

  /* Garbage, in one and in two slices: MR_EFORMAT naming the type. */
  const char junk[] = {0x0f, 0x01, 0x02};
  for (int parts = 1; parts <= 2; parts++) {
    grpc_slice js[2] = {grpc_slice_from_copied_buffer(junk, parts == 1 ? 3 : 1),
                        grpc_slice_from_copied_buffer(junk + 1, 2)};
    bb = grpc_raw_byte_buffer_create(js, (size_t)parts);
    grpc_slice_unref(js[0]);
    grpc_slice_unref(js[1]);
    MT_EQ_INT(pr_decode(bb, &moerpc__v1__hello_reply__descriptor, 100, &m, e), MR_EFORMAT);
    MT_CONTAINS(e->msg, "HelloReply: protobuf-c could not unpack 3 bytes");
    grpc_byte_buffer_destroy(bb);
  }
  free(flat);
  grpc_shutdown();
}

/* ---- health ----------------------------------------------------------------------------------- */

static grpc_byte_buffer *bb_from(const uint8_t *p, size_t n) {
  grpc_slice s = grpc_slice_from_copied_buffer((const char *)p, n);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

MT_TEST(health_framing) {
  grpc_init();
  mr_err e_ = {0}, *e = &e_; /* a pointer: MT_OK tests it */
  int st;
  int statuses[] = {PR_HEALTH_UNKNOWN, PR_HEALTH_SERVING, PR_HEALTH_NOT_SERVING, 3, 200};
  for (size_t i = 0; i < sizeof statuses / sizeof statuses[0]; i++) {
    grpc_byte_buffer *bb = pr_health_response_encode(statuses[i]);
    size_t len;
    uint8_t *f = bb_flatten(bb, &len);
    if (statuses[i] == 0) {
      MT_EQ_INT(len, 0); /* proto3 default: empty message */
    } else {
      MT_EQ_INT(f[0], 0x08);
    }
    st = -1;
    MT_OK(pr_health_response_decode(bb, &st, e), e);
    MT_EQ_INT(st, statuses[i]);
    free(f);
    grpc_byte_buffer_destroy(bb);
  }
  /* SERVING is exactly 08 01. */
  grpc_byte_buffer *bb = pr_health_response_encode(PR_HEALTH_SERVING);
  size_t len;
  uint8_t *f = bb_flatten(bb, &len);
  MT_EQ_INT(len, 2);
  MT_EQ_INT(f[1], 1);
  free(f);
  grpc_byte_buffer_destroy(bb);

  /* Unknown fields around, status twice (last wins), split into 1-byte slices. */
  const uint8_t rich[] = {0x12, 0x03, 'a', 'b', 'c', 0x08, 0x02, 0x19, 1, 2, 3, 4, 5, 6, 7, 8,
                          0x25, 1, 2, 3, 4, 0x08, 0x01, 0xa0, 0x06, 0x05};
  grpc_slice sl[sizeof rich];
  for (size_t i = 0; i < sizeof rich; i++) sl[i] = grpc_slice_from_copied_buffer((char *)rich + i, 1);
  bb = grpc_raw_byte_buffer_create(sl, sizeof rich);
  for (size_t i = 0; i < sizeof rich; i++) grpc_slice_unref(sl[i]);
  MT_OK(pr_health_response_decode(bb, &st, e), e);
  MT_EQ_INT(st, PR_HEALTH_SERVING);
  grpc_byte_buffer_destroy(bb);

  /* Malformed: status with the wrong wire type, truncated varint, a group. */
  const uint8_t wrong[] = {0x0a, 0x01, 0x01};
  bb = bb_from(wrong, sizeof wrong);
  MT_EQ_INT(pr_health_response_decode(bb, &st, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "field 1 (status) at byte 0 has wire type 2");
  grpc_byte_buffer_destroy(bb);
  const uint8_t trunc[] = {0x10, 0x01, 0x08, 0x80};
  bb = bb_from(trunc, sizeof trunc);
  MT_EQ_INT(pr_health_response_decode(bb, &st, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "HealthCheckResponse: field 1 at byte 2: message ends inside its varint");
  grpc_byte_buffer_destroy(bb);
  const uint8_t grp[] = {0x0b};
  bb = bb_from(grp, sizeof grp);
  MT_EQ_INT(pr_health_response_decode(bb, &st, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "wire type 3 (group)");
  grpc_byte_buffer_destroy(bb);

  /* Requests: "" is the empty message; a name is 0a len name. */
  bb = pr_health_request_encode("");
  f = bb_flatten(bb, &len);
  MT_EQ_INT(len, 0);
  free(f);
  grpc_byte_buffer_destroy(bb);
  bb = pr_health_request_encode(NULL);
  MT_EQ_INT(grpc_byte_buffer_length(bb), 0);
  grpc_byte_buffer_destroy(bb);
  bb = pr_health_request_encode("moerpc.v1.ExpertService");
  f = bb_flatten(bb, &len);
  MT_EQ_INT(len, 2 + 23);
  MT_EQ_INT(f[0], 0x0a);
  MT_EQ_INT(f[1], 23);
  MT_TRUE(memcmp(f + 2, "moerpc.v1.ExpertService", 23) == 0);
  free(f);
  grpc_byte_buffer_destroy(bb);
  char longname[300];
  memset(longname, 'x', 299);
  longname[299] = '\0';
  bb = pr_health_request_encode(longname);
  f = bb_flatten(bb, &len);
  MT_EQ_INT(len, 3 + 299); /* two-byte length varint */
  MT_EQ_INT(f[1], (299 & 0x7f) | 0x80);
  MT_EQ_INT(f[2], 299 >> 7);
  free(f);

  /* The server's decoder reads what the encoder wrote, and the 299-byte name only with room
   * for it. */
  char svc[300];
  MT_OK(pr_health_request_decode(bb, svc, sizeof svc, e), e);
  MT_EQ_STR(svc, longname);
  MT_EQ_INT(pr_health_request_decode(bb, svc, 299, e), MR_EFORMAT);
  MT_CONTAINS(e->msg,
              "HealthCheckRequest: field 1 (service) at byte 0: name of 299 bytes, at most 298");
  MT_EQ_STR(svc, "");
  grpc_byte_buffer_destroy(bb);
  bb = pr_health_request_encode("");
  MT_OK(pr_health_request_decode(bb, svc, sizeof svc, e), e);
  MT_EQ_STR(svc, "");
  grpc_byte_buffer_destroy(bb);

  /* Unknown fields around, service twice (last wins), split into 1-byte slices. */
  const uint8_t req_rich[] = {0x10, 0x05, 0x0a, 0x02, 'n', 'o', 0x1d, 1, 2, 3, 4,
                              0x0a, 0x03, 'y', 'e', 's', 0x22, 0x00};
  grpc_slice rs[sizeof req_rich];
  for (size_t i = 0; i < sizeof req_rich; i++)
    rs[i] = grpc_slice_from_copied_buffer((char *)req_rich + i, 1);
  bb = grpc_raw_byte_buffer_create(rs, sizeof req_rich);
  for (size_t i = 0; i < sizeof req_rich; i++) grpc_slice_unref(rs[i]);
  MT_OK(pr_health_request_decode(bb, svc, sizeof svc, e), e);
  MT_EQ_STR(svc, "yes");
  grpc_byte_buffer_destroy(bb);

  /* Malformed: service with the wrong wire type, a length past the end, a group. */
  const uint8_t req_wrong[] = {0x08, 0x01};
  bb = bb_from(req_wrong, sizeof req_wrong);
  MT_EQ_INT(pr_health_request_decode(bb, svc, sizeof svc, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "HealthCheckRequest: field 1 (service) at byte 0 has wire type 0, must be 2");
  grpc_byte_buffer_destroy(bb);
  const uint8_t req_past[] = {0x0a, 0x05, 'a', 'b'};
  bb = bb_from(req_past, sizeof req_past);
  MT_EQ_INT(pr_health_request_decode(bb, svc, sizeof svc, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "HealthCheckRequest: field 1 at byte 0: length 5, but 2 left");
  grpc_byte_buffer_destroy(bb);
  bb = bb_from(grp, sizeof grp);
  MT_EQ_INT(pr_health_request_decode(bb, svc, sizeof svc, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "wire type 3 (group)");
  grpc_byte_buffer_destroy(bb);
  grpc_shutdown();
}

/* HelloRequest.client_name as sent: a NUL inside is kept (protobuf-c's copy stops there),
 * the last occurrence wins across 1-byte slices, a long name is cut with its length kept. */
MT_TEST(hello_client_name_raw) {
  grpc_init();
  mr_err e_ = {0}, *e = &e_;
  char buf[16];
  size_t len = 99;
  const uint8_t nul[] = {0x08, 0x01, 0x1a, 0x02, 'x', 'y', 0x20, 0x05,
                         0x1a, 0x06, 'a', 'b', 0x00, 'c', 0x1b, 'd'};
  grpc_slice sl[sizeof nul];
  for (size_t i = 0; i < sizeof nul; i++) sl[i] = grpc_slice_from_copied_buffer((char *)nul + i, 1);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(sl, sizeof nul);
  for (size_t i = 0; i < sizeof nul; i++) grpc_slice_unref(sl[i]);
  MT_OK(pr_hello_client_name(bb, buf, sizeof buf, &len, e), e);
  MT_EQ_U64(len, 6);
  MT_TRUE(memcmp(buf, "ab\0c\x1b" "d", 6) == 0);
  /* protobuf-c, which the server decodes the rest with, stops at the NUL. */
  Moerpc__V1__HelloRequest *q = NULL;
  MT_OK(pr_decode(bb, &moerpc__v1__hello_request__descriptor, 1 << 16, (ProtobufCMessage **)&q, e), e);
  MT_EQ_STR(q->client_name, "ab");
  protobuf_c_message_free_unpacked(&q->base, NULL);
  /* Cut to the buffer, the whole length told. */
  MT_OK(pr_hello_client_name(bb, buf, 3, &len, e), e);
  MT_EQ_U64(len, 6);
  MT_TRUE(memcmp(buf, "ab\0", 3) == 0);
  grpc_byte_buffer_destroy(bb);
  /* Absent: length 0. */
  const uint8_t none[] = {0x08, 0x01};
  bb = bb_from(none, sizeof none);
  len = 99;
  MT_OK(pr_hello_client_name(bb, buf, sizeof buf, &len, e), e);
  MT_EQ_U64(len, 0);
  grpc_byte_buffer_destroy(bb);
  /* Malformed: client_name not length-delimited, a length past the end. */
  const uint8_t wrong[] = {0x18, 0x01};
  bb = bb_from(wrong, sizeof wrong);
  MT_EQ_INT(pr_hello_client_name(bb, buf, sizeof buf, &len, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "HelloRequest: field 3 (client_name) at byte 0 has wire type 0, must be 2");
  MT_EQ_U64(len, 0);
  grpc_byte_buffer_destroy(bb);
  const uint8_t past[] = {0x1a, 0x09, 'a'};
  bb = bb_from(past, sizeof past);
  MT_EQ_INT(pr_hello_client_name(bb, buf, sizeof buf, &len, e), MR_EFORMAT);
  MT_CONTAINS(e->msg, "HelloRequest: field 3 at byte 0: length 9, but 1 left");
  grpc_byte_buffer_destroy(bb);
  grpc_shutdown();
}

/* ---- status mapping, channel args, targets ---------------------------------------------------- */

MT_TEST(status_mapping) {
  struct { int mr; grpc_status_code st; } fwd[] = {
      {MR_OK, GRPC_STATUS_OK},
      {MR_EINVAL, GRPC_STATUS_INVALID_ARGUMENT},
      {MR_ERANGE, GRPC_STATUS_INVALID_ARGUMENT},
      {MR_EFORMAT, GRPC_STATUS_INVALID_ARGUMENT},
      {MR_EPRECOND, GRPC_STATUS_FAILED_PRECONDITION},
      {MR_EMISMATCH, GRPC_STATUS_FAILED_PRECONDITION},
      {MR_EEXHAUSTED, GRPC_STATUS_RESOURCE_EXHAUSTED},
      {MR_ETIMEDOUT, GRPC_STATUS_DEADLINE_EXCEEDED},
      {MR_EUNAVAIL, GRPC_STATUS_UNAVAILABLE},
      {MR_ECANCELED, GRPC_STATUS_CANCELLED},
      {MR_ENOTSUP, GRPC_STATUS_UNIMPLEMENTED},
      {MR_ENOTFOUND, GRPC_STATUS_NOT_FOUND},
      {MR_ENOMEM, GRPC_STATUS_INTERNAL},
      {MR_EIO, GRPC_STATUS_INTERNAL},
      {MR_EPROTO, GRPC_STATUS_INTERNAL},
      {MR_EINTERNAL, GRPC_STATUS_INTERNAL},
      {-999, GRPC_STATUS_INTERNAL},
  };
  for (size_t i = 0; i < sizeof fwd / sizeof fwd[0]; i++)
    MT_EQ_INT(pr_status_from_mr(fwd[i].mr), fwd[i].st);
  /* docs/DESIGN.md section 4 numbers, literally. */
  MT_EQ_INT(pr_status_from_mr(MR_EINVAL), 3);
  MT_EQ_INT(pr_status_from_mr(MR_EPRECOND), 9);
  MT_EQ_INT(pr_status_from_mr(MR_EEXHAUSTED), 8);

  struct { grpc_status_code st; int mr; } inv[] = {
      {GRPC_STATUS_OK, MR_OK},
      {GRPC_STATUS_INVALID_ARGUMENT, MR_EINVAL},
      {GRPC_STATUS_FAILED_PRECONDITION, MR_EPRECOND},
      {GRPC_STATUS_RESOURCE_EXHAUSTED, MR_EEXHAUSTED},
      {GRPC_STATUS_DEADLINE_EXCEEDED, MR_ETIMEDOUT},
      {GRPC_STATUS_UNAVAILABLE, MR_EUNAVAIL},
      {GRPC_STATUS_CANCELLED, MR_ECANCELED},
      {GRPC_STATUS_UNIMPLEMENTED, MR_ENOTSUP},
      {GRPC_STATUS_NOT_FOUND, MR_ENOTFOUND},
      {GRPC_STATUS_INTERNAL, MR_EINTERNAL},
      {GRPC_STATUS_UNKNOWN, MR_EINTERNAL},
      {GRPC_STATUS_ABORTED, MR_EINTERNAL},
      {GRPC_STATUS_DATA_LOSS, MR_EINTERNAL},
      {GRPC_STATUS_PERMISSION_DENIED, MR_EAUTH}, /* control RPCs without a token (1.2) */
  };
  for (size_t i = 0; i < sizeof inv / sizeof inv[0]; i++)
    MT_EQ_INT(pr_mr_from_status(inv[i].st), inv[i].mr);
  /* Round trip: every status we send maps back to a code that sends the same status. */
  for (int st = 0; st <= 16; st++)
    MT_EQ_INT(pr_status_from_mr(pr_mr_from_status((grpc_status_code)st)),
              st == 0 || st == 1 || st == 3 || st == 4 || st == 5 || st == 8 || st == 9 ||
                      st == 12 || st == 14 || st == 16
                  ? st
                  : st == 7 ? GRPC_STATUS_UNAUTHENTICATED /* both are MR_EAUTH */
                            : GRPC_STATUS_INTERNAL);
}

MT_TEST(channel_args) {
  grpc_arg a[PR_SERVER_ARGS + 1];
  memset(a, 0, sizeof a);
  MT_EQ_INT(pr_channel_args(a, 64 << 20), PR_CHANNEL_ARGS);
  MT_EQ_STR(a[0].key, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH);
  MT_EQ_STR(a[1].key, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH);
  MT_EQ_STR(a[2].key, GRPC_ARG_KEEPALIVE_TIME_MS);
  MT_EQ_STR(a[3].key, GRPC_ARG_KEEPALIVE_TIMEOUT_MS);
  MT_EQ_STR(a[4].key, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS);
  MT_EQ_STR(a[5].key, GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA);
  for (int i = 0; i < PR_CHANNEL_ARGS; i++) MT_EQ_INT(a[i].type, GRPC_ARG_INTEGER);
  MT_EQ_INT(a[0].value.integer, 64 << 20);
  MT_EQ_INT(a[1].value.integer, 64 << 20);
  MT_EQ_INT(a[2].value.integer, pr_keepalive_time_ms());
  MT_EQ_INT(a[4].value.integer, 1);
  MT_EQ_INT(a[5].value.integer, 0);
  MT_TRUE(a[PR_CHANNEL_ARGS].key == NULL); /* the next slot is left alone */
}

/* The server accepts the clients' pings: its minimum interval is below their period. */
MT_TEST(server_args_keepalive_policy) {
  unsetenv("MOERPC_KEEPALIVE_TIME_MS");
  grpc_arg c[PR_CHANNEL_ARGS], s[PR_SERVER_ARGS + 1];
  memset(s, 0, sizeof s);
  pr_channel_args(c, 1 << 22);
  MT_EQ_INT(pr_server_args(s, 1 << 22), PR_SERVER_ARGS);
  MT_EQ_INT(c[2].value.integer, PR_KEEPALIVE_TIME_MS);
  MT_EQ_INT(c[3].value.integer, PR_KEEPALIVE_TIMEOUT_MS);
  MT_EQ_STR(s[6].key, GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS);
  MT_EQ_STR(s[7].key, GRPC_ARG_HTTP2_MAX_PING_STRIKES);
  MT_TRUE(s[6].value.integer < c[2].value.integer);
  MT_EQ_INT(s[7].value.integer, PR_KEEPALIVE_MAX_PING_STRIKES);
  MT_EQ_INT(s[4].value.integer, 1); /* pings on a connection without calls are no strikes */
  MT_TRUE(s[PR_SERVER_ARGS].key == NULL);
}

/* The test-only override: in range it replaces the period, out of range it is ignored. */
MT_TEST(keepalive_env_override) {
  setenv("MOERPC_KEEPALIVE_TIME_MS", "300", 1);
  MT_EQ_INT(pr_keepalive_time_ms(), 300);
  grpc_arg s[PR_SERVER_ARGS];
  pr_server_args(s, 1 << 22);
  MT_EQ_INT(s[2].value.integer, 300);
  MT_EQ_INT(s[3].value.integer, 1000);
  MT_EQ_INT(s[6].value.integer, 100);
}

MT_TEST(keepalive_env_out_of_range_ignored) {
  setenv("MOERPC_KEEPALIVE_TIME_MS", "5", 1);
  MT_EQ_INT(pr_keepalive_time_ms(), PR_KEEPALIVE_TIME_MS);
}

MT_TEST(target_from_address) {
  char b[128];
  pr_target_from_address("127.0.0.1:50051", b, sizeof b);
  MT_EQ_STR(b, "ipv4:127.0.0.1:50051");
  pr_target_from_address("[::1]:5", b, sizeof b);
  MT_EQ_STR(b, "ipv6:[::1]:5");
  pr_target_from_address("[fe80::1%eth0]:5", b, sizeof b); /* zone ids are not for inet_pton */
  MT_EQ_STR(b, "dns:///[fe80::1%eth0]:5");
  pr_target_from_address("localhost:50051", b, sizeof b);
  MT_EQ_STR(b, "dns:///localhost:50051");
  pr_target_from_address("expert-3.example:443", b, sizeof b);
  MT_EQ_STR(b, "dns:///expert-3.example:443");
  pr_target_from_address("300.1.1.1:5", b, sizeof b);
  MT_EQ_STR(b, "dns:///300.1.1.1:5");
  pr_target_from_address("ipv4:10.0.0.2:7", b, sizeof b);
  MT_EQ_STR(b, "ipv4:10.0.0.2:7");
  pr_target_from_address("unix:/tmp/s", b, sizeof b);
  MT_EQ_STR(b, "unix:/tmp/s");
  char small[8];
  pr_target_from_address("127.0.0.1:50051", small, sizeof small);
  MT_EQ_STR(small, "ipv4:12");
}

MT_MAIN()
