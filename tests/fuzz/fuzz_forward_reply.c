/*
 * fuzz_forward_reply.c - libFuzzer target: a ForwardReply as the client receives it, split
 * across gRPC slices, decoded with pr_forward_reply_decode, and checked against plain
 * protobuf-c reading the same bytes in one piece.
 *
 * Input layout (what the corpus generator gen_proto_seeds.c writes):
 *
 *   +--------+---------------------------+---------------------------------------------+
 *   | byte 0 | 2 * (nseg-1) bytes        | message bytes                               |
 *   | nseg-1 | cut points, u16 little-   | a serialized ForwardReply (or anything else) |
 *   | (& 7)  | endian, each % (len + 1)  |                                             |
 *   +--------+---------------------------+---------------------------------------------+
 *
 * so 1..8 segments, with empty ones where cuts coincide. Each segment is copied to its own
 * heap block of exactly its size so that ASan sees a read past the end of a slice.
 *
 * Checked beyond "no crash, no leak, no UB":
 *   - a failure is MR_EFORMAT with a message that names a byte offset, and no header;
 *   - on success the payload views add up to payload.len and lie inside the segments;
 *   - differential: whenever protobuf-c unpacks the joined bytes, pr_ decodes them too,
 *     to the same header fields and the same output bytes. (pr_ is stricter only about
 *     field numbers 0 and over 2^29-1, which protobuf-c lets through as unknown fields.)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"

#define MAXSEG 8

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_forward_reply: %s: %s\n", what, msg);
  abort();
}

static bool inside(const pr_seg *segs, size_t n, const pr_seg *v) {
  for (size_t i = 0; i < n; i++)
    if (v->p >= segs[i].p && v->p + v->len <= segs[i].p + segs[i].len) return true;
  return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false); /* until the decode says otherwise */
  if (size < 1) return 0;
  size_t nseg = 1 + (data[0] & 7u);
  if (size < 2 * nseg - 1) nseg = (size + 1) / 2; /* too short for its cut bytes: fewer */
  const uint8_t *cuts = data + 1;
  const uint8_t *msg = data + 2 * nseg - 1;
  size_t len = size - (2 * nseg - 1);

  size_t cut[MAXSEG + 1];
  cut[0] = 0;
  cut[nseg] = len;
  for (size_t i = 1; i < nseg; i++)
    cut[i] = ((size_t)cuts[2 * i - 2] | (size_t)cuts[2 * i - 1] << 8) % (len + 1);
  for (size_t i = 1; i < nseg; i++) /* insertion sort of cut[1..nseg) */
    for (size_t j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
      size_t t = cut[j];
      cut[j] = cut[j - 1];
      cut[j - 1] = t;
    }
  pr_seg segs[MAXSEG];
  uint8_t *blocks[MAXSEG];
  for (size_t i = 0; i < nseg; i++) {
    size_t n = cut[i + 1] - cut[i];
    blocks[i] = malloc(n ? n : 1);
    if (!blocks[i]) abort();
    memcpy(blocks[i], msg + cut[i], n);
    segs[i] = (pr_seg){blocks[i], n};
  }

  pr_split split;
  memset(&split, 0, sizeof split);
  Moerpc__V1__ForwardReply *rep = NULL;
  mr_err e;
  mr_err_clear(&e);
  int rc = pr_forward_reply_decode(segs, nseg, &split, &rep, &e);
  Moerpc__V1__ForwardReply *ref = moerpc__v1__forward_reply__unpack(NULL, len, msg);
  fuzz_verdict_set(rc == 0);

  if (rc) {
    if (rc != MR_EFORMAT && rc != MR_ENOMEM) fuzz_fail("undocumented code", mr_err_name(rc));
    if (rep) fuzz_fail("decode failed but returned a header", e.msg);
    if (!strstr(e.msg, "ForwardReply: ")) fuzz_fail("error does not name the message", e.msg);
    if (!strstr(e.msg, "byte ") && !strstr(e.msg, "protobuf-c could not unpack header"))
      fuzz_fail("error names no offset", e.msg);
    if (split.hdr_len || split.payload.present) fuzz_fail("failed split not emptied", e.msg);
    if (ref && !strstr(e.msg, "field number"))
      fuzz_fail("protobuf-c accepts what pr_ rejects", e.msg);
  } else {
    const pr_payload *p = &split.payload;
    size_t sum = 0;
    for (size_t k = 0; k < p->n; k++) {
      if (!inside(segs, nseg, &p->segs[k])) fuzz_fail("payload view outside the input", "");
      sum += p->segs[k].len;
    }
    if (sum != p->len) fuzz_fail("payload views do not add up", "");
    if (p->len && !p->present) fuzz_fail("payload bytes without the field", "");
    if (rep->output.len != 0) fuzz_fail("header still holds the payload", "");
    uint8_t *out = malloc(p->len ? p->len : 1);
    if (!out) abort();
    pr_payload_gather(p, out);
    if (ref) {
      if (ref->id != rep->id || ref->status != rep->status || ref->queue_us != rep->queue_us ||
          ref->compute_us != rep->compute_us || ref->dtype != rep->dtype ||
          strcmp(ref->error, rep->error) != 0)
        fuzz_fail("header differs from protobuf-c", "");
      if (ref->output.len != p->len || (p->len && memcmp(ref->output.data, out, p->len) != 0))
        fuzz_fail("payload differs from protobuf-c", "");
    }
    free(out);
    moerpc__v1__forward_reply__free_unpacked(rep, NULL);
  }
  if (ref) moerpc__v1__forward_reply__free_unpacked(ref, NULL);
  pr_split_free(&split);
  for (size_t i = 0; i < nseg; i++) free(blocks[i]);
  return 0;
}
