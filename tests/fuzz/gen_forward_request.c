/*
 * gen_forward_request.c - writes the seed corpus of fuzz_forward_request into a directory:
 * valid ForwardRequests of several shapes and every kind of bad request, each prefixed with
 * the two bytes the fuzz target reads (segment count - 1, cut seed; see the layout in
 * fuzz_forward_request.c). Not built by make; rebuild the corpus with:
 *
 *   make BUILD=build/h-server build/h-server/gen/proto/moe.pb-c.c
 *   cc -std=gnu11 -I. -Ibuild/h-server/gen/proto -o /tmp/gen_fr tests/fuzz/gen_forward_request.c \
 *      build/h-server/gen/proto/moe.pb-c.c -lprotobuf-c
 *   /tmp/gen_fr tests/fuzz/corpus/forward_request
 *
 * The limits the seeds aim at are the target's: H = 64, E = 16, max_tokens 32, layers 0-3
 * served with experts 0-7, layer 4 dense, layer 5 not served.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.pb-c.h"

#define H 64

static const char *outdir;
static int written;

/* Writes [nseg - 1][seed][msg] to outdir/name. */
static void put(const char *name, int nseg, int seed, const uint8_t *msg, size_t len) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", outdir, name);
  FILE *f = fopen(path, "wb");
  if (!f) {
    perror(path);
    exit(1);
  }
  uint8_t pre[2] = {(uint8_t)(nseg - 1), (uint8_t)seed};
  if (fwrite(pre, 1, 2, f) != 2 || (len && fwrite(msg, 1, len, f) != len)) {
    perror(path);
    exit(1);
  }
  fclose(f);
  written++;
}

static size_t varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}

/* A request description; hidden_len < 0 means "the right length for the dtype". */
typedef struct req {
  uint64_t id;
  uint32_t layer, n_tokens, top_k;
  int n_ids, n_w;    /* -1: n_tokens * top_k */
  int dtype;
  long hidden_len;   /* -1: right; -2: field 15 absent */
  int32_t *ids;      /* NULL: a pattern over experts 0-7 with one empty slot per token */
  float bad_weight;  /* put into weights[1] if not 0 */
} req;

/* Packs r as the client does: header by protobuf-c, then 0x7a varint(len) payload. */
static size_t pack(const req *r, uint8_t *out, size_t cap) {
  static int32_t ids[4096];
  static float w[4096];
  int slots = (int)(r->n_tokens * r->top_k);
  int n_ids = r->n_ids >= 0 ? r->n_ids : slots, n_w = r->n_w >= 0 ? r->n_w : slots;
  for (int i = 0; i < 4096; i++) {
    ids[i] = r->ids ? r->ids[i % 16] : ((r->top_k > 1 && i % (int)r->top_k == 1) ? -1 : i % 8);
    w[i] = 0.125f * (float)(1 + i % 4);
  }
  if (r->bad_weight != 0) w[1] = r->bad_weight;
  Moerpc__V1__ForwardRequest m = MOERPC__V1__FORWARD_REQUEST__INIT;
  m.id = r->id;
  m.layer = r->layer;
  m.n_tokens = r->n_tokens;
  m.top_k = r->top_k;
  m.n_expert_ids = (size_t)n_ids;
  m.expert_ids = ids;
  m.n_weights = (size_t)n_w;
  m.weights = w;
  m.dtype = (Moerpc__V1__DType)r->dtype;
  size_t n = moerpc__v1__forward_request__get_packed_size(&m);
  if (n + 16 > cap) exit(2);
  moerpc__v1__forward_request__pack(&m, out);
  if (r->hidden_len == -2) return n;
  size_t esize = r->dtype == 1 ? 4 : (r->dtype == 2 || r->dtype == 3) ? 2 : 4;
  size_t hl = r->hidden_len >= 0 ? (size_t)r->hidden_len : (size_t)r->n_tokens * H * esize;
  out[n++] = 0x7a;
  n += varint(out + n, hl);
  if (n + hl > cap) exit(2);
  for (size_t i = 0; i < hl; i++) {
    /* Small finite values in every dtype: 0x3c00 / 0x3f80 patterns alternate with zeros. */
    out[n + i] = (uint8_t)(i % 2 ? (r->dtype == 3 ? 0x3f : 0x3c) : 0x00);
  }
  return n + hl;
}

static uint8_t buf[1 << 20];

static void put_req(const char *name, int nseg, int seed, req r) {
  size_t n = pack(&r, buf, sizeof buf);
  put(name, nseg, seed, buf, n);
}

#define REQ(...) ((req){.n_ids = -1, .n_w = -1, .hidden_len = -1, __VA_ARGS__})

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  outdir = argv[1];

  /* Valid requests of several shapes and dtypes, split into 1..8 segments. */
  put_req("ok_f32_t1_k1", 1, 0, REQ(.id = 1, .layer = 0, .n_tokens = 1, .top_k = 1, .dtype = 1));
  put_req("ok_bf16_t4_k4", 3, 17, REQ(.id = 2, .layer = 1, .n_tokens = 4, .top_k = 4, .dtype = 3));
  put_req("ok_f16_t32_k2_8seg", 8, 99, REQ(.id = 3, .layer = 3, .n_tokens = 32, .top_k = 2, .dtype = 2));
  put_req("ok_f32_t2_k16", 2, 5, REQ(.id = 4, .layer = 2, .n_tokens = 2, .top_k = 16, .dtype = 1));
  {
    static int32_t empty[16] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    put_req("ok_all_slots_empty", 4, 3, REQ(.id = 5, .layer = 0, .n_tokens = 3, .top_k = 2, .dtype = 1, .ids = empty));
  }
  /* Payload first, then the header fields: any field order is valid protobuf. */
  {
    uint8_t hdr[4096];
    req r = REQ(.id = 6, .layer = 1, .n_tokens = 2, .top_k = 2, .dtype = 3, .hidden_len = -2);
    size_t hn = pack(&r, hdr, sizeof hdr);
    size_t n = 0, hl = 2 * H * 2;
    buf[n++] = 0x7a;
    n += varint(buf + n, hl);
    memset(buf + n, 0, hl);
    n += hl;
    memcpy(buf + n, hdr, hn);
    n += hn;
    put("ok_payload_first", 5, 21, buf, n);
    /* Field 15 twice: the last occurrence wins (a wrong-size one first). */
    n = 0;
    buf[n++] = 0x7a;
    n += varint(buf + n, 7);
    memset(buf + n, 1, 7);
    n += 7;
    memcpy(buf + n, hdr, hn);
    n += hn;
    buf[n++] = 0x7a;
    n += varint(buf + n, hl);
    memset(buf + n, 0, hl);
    n += hl;
    put("ok_payload_twice_last_wins", 2, 8, buf, n);
    /* An unknown field (number 20, varint) is skipped. */
    n = pack(&r, buf, sizeof buf);
    n += varint(buf + n, 20u << 3 | 0u); /* key: field 20, wire type 0 */
    buf[n++] = 0x05;
    buf[n++] = 0x7a;
    n += varint(buf + n, hl);
    memset(buf + n, 0, hl);
    n += hl;
    put("ok_unknown_field", 3, 40, buf, n);
  }

  /* One seed per kind of bad request. */
  put_req("bad_layer_out_of_range", 1, 0, REQ(.id = 10, .layer = 6, .n_tokens = 2, .top_k = 2, .dtype = 1));
  put_req("bad_layer_dense", 2, 1, REQ(.id = 11, .layer = 4, .n_tokens = 2, .top_k = 2, .dtype = 1));
  put_req("bad_layer_not_served", 2, 2, REQ(.id = 12, .layer = 5, .n_tokens = 2, .top_k = 2, .dtype = 1));
  put_req("bad_n_tokens_zero", 1, 0, REQ(.id = 13, .layer = 0, .n_tokens = 0, .top_k = 2, .dtype = 1));
  put_req("bad_top_k_zero", 1, 0, REQ(.id = 14, .layer = 0, .n_tokens = 2, .top_k = 0, .dtype = 1));
  put_req("bad_top_k_over_experts", 3, 9, REQ(.id = 15, .layer = 0, .n_tokens = 1, .top_k = 17, .dtype = 1));
  put_req("bad_n_tokens_over_max", 4, 11, REQ(.id = 16, .layer = 0, .n_tokens = 33, .top_k = 1, .dtype = 1));
  put_req("bad_expert_ids_length", 2, 12, REQ(.id = 17, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 1, .n_ids = 3));
  put_req("bad_weights_length", 2, 13, REQ(.id = 18, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 1, .n_w = 5));
  {
    static int32_t over[16] = {0, 16, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6};
    static int32_t neg[16] = {0, -2, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6};
    static int32_t unowned[16] = {0, 12, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6};
    put_req("bad_expert_id_over", 2, 14, REQ(.id = 19, .layer = 1, .n_tokens = 2, .top_k = 2, .dtype = 1, .ids = over));
    put_req("bad_expert_id_negative", 2, 15, REQ(.id = 20, .layer = 1, .n_tokens = 2, .top_k = 2, .dtype = 1, .ids = neg));
    put_req("bad_expert_not_served", 3, 16, REQ(.id = 21, .layer = 1, .n_tokens = 2, .top_k = 2, .dtype = 1, .ids = unowned));
  }
  put_req("bad_dtype_unspecified", 1, 0, REQ(.id = 22, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 0, .hidden_len = 2 * H * 4));
  put_req("bad_dtype_unknown", 1, 0, REQ(.id = 23, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 7, .hidden_len = 2 * H * 4));
  put_req("bad_hidden_short", 2, 18, REQ(.id = 24, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 1, .hidden_len = 2 * H * 4 - 1));
  put_req("bad_hidden_absent", 1, 0, REQ(.id = 25, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 3, .hidden_len = -2));
  put_req("bad_weight_nan", 2, 19, REQ(.id = 26, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 1, .bad_weight = NAN));
  put_req("bad_weight_inf", 2, 20, REQ(.id = 27, .layer = 0, .n_tokens = 2, .top_k = 2, .dtype = 1, .bad_weight = INFINITY));

  /* Bytes that do not decode. */
  {
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                                   0xff, 0xff, 0x0f, 0x7a, 0x99};
    put("bad_long_varint", 2, 3, junk, sizeof junk);
    size_t n = pack(&REQ(.id = 30, .layer = 0, .n_tokens = 4, .top_k = 2, .dtype = 1), buf, sizeof buf);
    put("bad_truncated_payload", 3, 30, buf, n - 100);
    /* Field 15 with wire type 0 (varint) instead of 2. */
    n = pack(&REQ(.id = 31, .layer = 0, .n_tokens = 1, .top_k = 1, .dtype = 1, .hidden_len = -2), buf, sizeof buf);
    buf[n++] = 0x78;
    buf[n++] = 0x01;
    put("bad_payload_wire_type", 1, 0, buf, n);
    /* A length that runs past the end of the message. */
    n = pack(&REQ(.id = 32, .layer = 0, .n_tokens = 1, .top_k = 1, .dtype = 1, .hidden_len = -2), buf, sizeof buf);
    buf[n++] = 0x7a;
    n += varint(buf + n, 1u << 30);
    buf[n++] = 0;
    put("bad_length_past_end", 2, 31, buf, n);
    /* Packed ids whose length cuts a varint in half. */
    static const uint8_t cut_ids[] = {0x08, 0x01, 0x2a, 0x03, 0x01, 0xff, 0xff};
    put("bad_packed_ids_cut", 3, 32, cut_ids, sizeof cut_ids);
    /* Field number 0. */
    static const uint8_t field0[] = {0x00, 0x01};
    put("bad_field_zero", 1, 0, field0, sizeof field0);
    /* The empty message: all defaults, n_tokens 0. */
    put("bad_empty_message", 1, 0, buf, 0);
  }
  printf("wrote %d seeds into %s\n", written, outdir);
  return 0;
}
