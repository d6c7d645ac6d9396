/*
 * gen_proto_seeds.c - writes the seed corpus of fuzz_forward_reply into a directory: valid
 * ForwardReplies packed by protobuf-c (several shapes and dtypes, error replies, the empty
 * message), hand-framed variants (payload first, payload twice, unknown fields, an empty
 * payload) and every kind of malformed framing, each prefixed with the split bytes the
 * fuzz target reads (see the layout in fuzz_forward_reply.c). Cuts are placed on purpose
 * inside tags and varints. Not built by make; rebuild the corpus with:
 *
 *   make BUILD=build/h-proto build/h-proto/gen/proto/moe.pb-c.c
 *   cc -std=gnu11 -I. -Ibuild/h-proto/gen/proto -o /tmp/gen_ps tests/fuzz/gen_proto_seeds.c \
 *      build/h-proto/gen/proto/moe.pb-c.c -lprotobuf-c
 *   /tmp/gen_ps tests/fuzz/corpus/forward_reply
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.pb-c.h"

#define MAXSEG 8

static const char *outdir;
static int written;

/* Writes [nseg - 1][cuts as u16 little-endian][msg] to outdir/name; cuts[] are byte
 * offsets into msg (the target takes each modulo len + 1). */
static void put(const char *name, const size_t *cuts, size_t ncut, const uint8_t *msg,
                size_t len) {
  char path[1024];
  uint8_t head[1 + 2 * (MAXSEG - 1)];
  if (ncut + 1 > MAXSEG) abort();
  head[0] = (uint8_t)ncut;
  for (size_t i = 0; i < ncut; i++) {
    if (cuts[i] > 0xffff) abort();
    head[1 + 2 * i] = (uint8_t)cuts[i];
    head[2 + 2 * i] = (uint8_t)(cuts[i] >> 8);
  }
  size_t hn = 1 + 2 * ncut;
  snprintf(path, sizeof path, "%s/%s", outdir, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(head, 1, hn, f) != hn || (len && fwrite(msg, 1, len, f) != len) ||
      fclose(f) != 0) {
    perror(path);
    exit(1);
  }
  written++;
}

typedef struct wbuf {
  uint8_t b[16384];
  size_t n;
} wbuf;
static void w_bytes(wbuf *w, const void *p, size_t n) {
  if (w->n + n > sizeof w->b) abort();
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
static void w_reply(wbuf *w, const Moerpc__V1__ForwardReply *r) {
  size_t n = moerpc__v1__forward_reply__get_packed_size(r);
  if (w->n + n > sizeof w->b) abort();
  moerpc__v1__forward_reply__pack(r, w->b + w->n);
  w->n += n;
}

static uint8_t pay[8192];

static Moerpc__V1__ForwardReply reply(uint64_t id, Moerpc__V1__DType dt, size_t out_len) {
  Moerpc__V1__ForwardReply r = MOERPC__V1__FORWARD_REPLY__INIT;
  r.id = id;
  r.queue_us = 17;
  r.compute_us = 1234;
  r.dtype = dt;
  r.output.data = pay;
  r.output.len = out_len;
  return r;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUTDIR\n", argv[0]);
    return 2;
  }
  outdir = argv[1];
  for (size_t i = 0; i < sizeof pay; i++) pay[i] = (uint8_t)(i * 37u + 11u);
  wbuf w;
  Moerpc__V1__ForwardReply r;

  /* Valid replies packed by protobuf-c (payload last, as pr_encode_with_payload sends). */
  r = reply(1, MOERPC__V1__DTYPE__DTYPE_F32, 64 * 4);
  w.n = 0, w_reply(&w, &r);
  put("ok_f32_one_segment", NULL, 0, w.b, w.n);
  size_t c3[] = {3, w.n - 200};
  put("ok_f32_three_segments", c3, 2, w.b, w.n);

  r = reply(0xfedcba9876543210ull, MOERPC__V1__DTYPE__DTYPE_BF16, 2 * 64 * 2);
  w.n = 0, w_reply(&w, &r);
  size_t c8[] = {1, 2, 5, 9, 10, 11, 100};
  put("ok_bf16_eight_segments", c8, 7, w.b, w.n);

  r = reply(77, MOERPC__V1__DTYPE__DTYPE_F16, 4096); /* 2-byte length varint */
  w.n = 0, w_reply(&w, &r);
  size_t at = w.n - 4096 - 2; /* the length varint of field 15 */
  size_t cv[] = {at - 1, at, at + 1, at + 2, w.n - 1};
  put("ok_f16_cut_inside_length_varint", cv, 5, w.b, w.n);

  r = reply(5, MOERPC__V1__DTYPE__DTYPE_F32, 0);
  r.status = 3;
  r.error = "expert_ids[5] = 300, must be < num_experts 128";
  w.n = 0, w_reply(&w, &r);
  size_t ce[] = {2, 20};
  put("ok_error_reply", ce, 2, w.b, w.n);

  put("ok_empty_message", NULL, 0, w.b, 0);

  /* Hand-framed but valid protobuf. */
  r = reply(9, MOERPC__V1__DTYPE__DTYPE_F32, 0);
  w.n = 0, w_len(&w, 15, pay, 300), w_reply(&w, &r);
  size_t cf[] = {1, 150};
  put("ok_payload_first", cf, 2, w.b, w.n);

  w.n = 0, w_len(&w, 15, pay, 40), w_reply(&w, &r), w_len(&w, 15, pay + 100, 60);
  size_t ct[] = {41, 45};
  put("ok_payload_twice_last_wins", ct, 2, w.b, w.n);

  w.n = 0;
  w_tag(&w, 100, 0), w_varint(&w, UINT64_MAX);
  w_tag(&w, 101, 1), w_bytes(&w, pay, 8);
  w_reply(&w, &r);
  w_len(&w, 102, "unknown", 7);
  w_tag(&w, 536870911, 5), w_bytes(&w, pay, 4);
  w_len(&w, 15, pay, 64);
  size_t cu[] = {1, 3, 12, 30};
  put("ok_unknown_fields", cu, 4, w.b, w.n);

  w.n = 0, w_reply(&w, &r), w_len(&w, 15, pay, 0);
  put("ok_empty_payload_present", NULL, 0, w.b, w.n);

  /* Malformed framing (each after a valid id field, so offsets are not all 0). */
  static const struct { const char *name; uint8_t b[16]; size_t n; } bad[] = {
      {"bad_truncated_tag", {0x08, 0x05, 0x80}, 3},
      {"bad_truncated_varint", {0x08, 0x05, 0x10, 0x80, 0x80}, 5},
      {"bad_truncated_length", {0x08, 0x05, 0x1a}, 3},
      {"bad_length_past_end", {0x08, 0x05, 0x1a, 0x05, 'a', 'b'}, 6},
      {"bad_payload_past_end", {0x08, 0x05, 0x7a, 0x10, 1, 2, 3}, 7},
      {"bad_varint_11_bytes",
       {0x08, 0x05, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},
       14},
      {"bad_huge_length",
       {0x08, 0x05, 0x7a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00},
       14},
      {"bad_wire_type_3", {0x08, 0x05, 0x4b, 0x00}, 4},
      {"bad_wire_type_4", {0x08, 0x05, 0x4c, 0x00}, 4},
      {"bad_wire_type_6", {0x08, 0x05, 0x4e, 0x00}, 4},
      {"bad_wire_type_7", {0x08, 0x05, 0x4f, 0x00}, 4},
      {"bad_field_zero", {0x08, 0x05, 0x02, 0x00}, 4},
      {"bad_field_over_max", {0x08, 0x05, 0x80, 0x80, 0x80, 0x80, 0x10, 0x00}, 8},
      {"bad_fixed64_truncated", {0x08, 0x05, 0x19, 1, 2, 3}, 6},
      {"bad_payload_wire_type_0", {0x08, 0x05, 0x78, 0x01}, 4},
      {"bad_header_for_protobuf_c", {0x08, 0x05, 0x11, 1, 2, 3, 4, 5, 6, 7, 8}, 11},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    size_t cb[] = {1, 3};
    put(bad[i].name, cb, i % 2 ? 2 : 0, bad[i].b, bad[i].n);
  }
  printf("%d seeds written to %s\n", written, outdir);
  return 0;
}
