/*
 * pr_split.c - the receive side of the zero-copy framing: walking a protobuf message that
 * arrives as several segments, without joining them.
 *
 * The cursor (pr__rd) is shared with the health decoder in pr_grpc.c; the byte layout
 * that pr_split_message reads is drawn above it.
 */
#include <inttypes.h>
#include <string.h>

#include "proto/internal.h"

/* ---- cursor over segments ------------------------------------------------------------ */

/* Moves past exhausted and empty segments so that seg[i] has a byte at off, or i == nseg. */
static void rd_settle(pr__rd *r) {
  while (r->i < r->nseg && r->off == r->seg[r->i].len) {
    r->i++;
    r->off = 0;
  }
}

void pr__rd_init(pr__rd *r, const pr_seg *in, size_t n) {
  r->seg = in;
  r->nseg = n;
  r->i = 0;
  r->off = 0;
  r->pos = 0;
  r->total = 0;
  for (size_t k = 0; k < n; k++) r->total += in[k].len;
  rd_settle(r);
}

static inline uint8_t rd_byte(pr__rd *r) {
  uint8_t b = r->seg[r->i].p[r->off++];
  r->pos++;
  rd_settle(r);
  return b;
}

void pr__rd_skip(pr__rd *r, size_t len) {
  MR_ASSERT(len <= pr__rd_left(r));
  r->pos += len;
  while (len > 0) {
    size_t run = r->seg[r->i].len - r->off;
    if (run > len) run = len;
    r->off += run;
    len -= run;
    rd_settle(r);
  }
}

void pr__rd_copy(pr__rd *r, uint8_t *dst, size_t len) {
  MR_ASSERT(len <= pr__rd_left(r));
  r->pos += len;
  while (len > 0) {
    size_t run = r->seg[r->i].len - r->off;
    if (run > len) run = len;
    memcpy(dst, r->seg[r->i].p + r->off, run);
    dst += run;
    r->off += run;
    len -= run;
    rd_settle(r);
  }
}

/* Reads a varint. Returns 0, 1 if the message ends inside it, 2 if it is longer than
 * PR__VARINT_MAX bytes. Bits past 64 in the tenth byte are dropped, as protobuf does. */
static int rd_varint(pr__rd *r, uint64_t *v) {
  uint64_t x = 0;
  for (unsigned k = 0; k < PR__VARINT_MAX; k++) {
    if (pr__rd_left(r) == 0) return 1;
    uint8_t b = rd_byte(r);
    x |= (uint64_t)(b & 0x7fu) << (7u * k);
    if (!(b & 0x80u)) {
      *v = x;
      return 0;
    }
  }
  return 2;
}

size_t pr__varint_put(uint8_t *out, uint64_t v) {
  size_t k = 0;
  while (v >= 0x80u) {
    out[k++] = (uint8_t)(v | 0x80u);
    v >>= 7;
  }
  out[k++] = (uint8_t)v;
  return k;
}

int pr__rd_field(pr__rd *r, uint32_t *field, unsigned *wt, uint64_t *val, size_t *body,
                 size_t *start, mr_err *e) {
  size_t at = r->pos;
  uint64_t tag = 0, v = 0;
  int rc;

  *start = at;
  rc = rd_varint(r, &tag);
  if (rc == 1)
    return mr_err_set(e, MR_EFORMAT, "byte %zu: message ends inside a field tag (varint)", at);
  if (rc == 2)
    return mr_err_set(e, MR_EFORMAT, "byte %zu: field tag varint is longer than %d bytes", at,
                      PR__VARINT_MAX);
  if ((tag >> 3) == 0 || (tag >> 3) > PR__FIELD_MAX)
    return mr_err_set(e, MR_EFORMAT, "byte %zu: field number %" PRIu64 " is out of range 1..%u",
                      at, tag >> 3, PR__FIELD_MAX);
  *field = (uint32_t)(tag >> 3);
  *wt = (unsigned)(tag & 7u);
  *val = 0;

  size_t left;
  switch (*wt) {
  case PR__WT_VARINT:
    rc = rd_varint(r, &v);
    if (rc == 1)
      return mr_err_set(e, MR_EFORMAT, "field %u at byte %zu: message ends inside its varint",
                        *field, at);
    if (rc == 2)
      return mr_err_set(e, MR_EFORMAT, "field %u at byte %zu: varint is longer than %d bytes",
                        *field, at, PR__VARINT_MAX);
    *val = v;
    *body = 0;
    return 0;
  case PR__WT_FIXED64:
  case PR__WT_FIXED32:
    *body = *wt == PR__WT_FIXED64 ? 8 : 4;
    left = pr__rd_left(r);
    if (*body > left)
      return mr_err_set(e, MR_EFORMAT,
                        "field %u at byte %zu: fixed%zu value needs %zu bytes, only %zu left",
                        *field, at, *body * 8, *body, left);
    return 0;
  case PR__WT_LEN:
    rc = rd_varint(r, &v);
    if (rc == 1)
      return mr_err_set(e, MR_EFORMAT, "field %u at byte %zu: message ends inside its length",
                        *field, at);
    if (rc == 2)
      return mr_err_set(e, MR_EFORMAT,
                        "field %u at byte %zu: length varint is longer than %d bytes", *field, at,
                        PR__VARINT_MAX);
    left = pr__rd_left(r);
    if (v > left)
      return mr_err_set(e, MR_EFORMAT,
                        "field %u at byte %zu: length %" PRIu64 ", but %zu left in the message",
                        *field, at, v, left);
    *val = v;
    *body = (size_t)v;
    return 0;
  case PR__WT_SGROUP:
  case PR__WT_EGROUP:
    return mr_err_set(e, MR_EFORMAT,
                      "field %u at byte %zu: wire type %u (group) is not supported, "
                      "only 0, 1, 2 and 5",
                      *field, at, *wt);
  default:
    return mr_err_set(e, MR_EFORMAT,
                      "field %u at byte %zu: wire type %u does not exist (valid: 0, 1, 2, 5)",
                      *field, at, *wt);
  }
}

/* ---- split --------------------------------------------------------------------------- */

/* Empties s, keeping its buffers. */
static void split_reset(pr_split *s) {
  s->hdr_len = 0;
  s->payload.n = 0;
  s->payload.len = 0;
  s->payload.present = false;
}

static int split_reserve_hdr(pr_split *s, size_t need, mr_err *e) {
  if (need <= s->cap_hdr) return 0;
  size_t cap = s->cap_hdr ? s->cap_hdr : 256;
  while (cap < need) cap *= 2;
  if (cap > PR_MAX_HEADER_BYTES) cap = PR_MAX_HEADER_BYTES; /* need is within it */
  uint8_t *p = mr_realloc(s->hdr, cap);
  if (!p) return mr_err_set(e, MR_ENOMEM, "header buffer of %zu bytes: out of memory", cap);
  s->hdr = p;
  s->cap_hdr = cap;
  return 0;
}

static int split_push_seg(pr_split *s, const uint8_t *p, size_t len, mr_err *e) {
  pr_payload *pl = &s->payload;
  if (pl->n == s->cap_segs) {
    size_t cap = s->cap_segs ? s->cap_segs * 2 : 8;
    pr_seg *v = mr_realloc(pl->segs, cap * sizeof *v);
    if (!v) return mr_err_set(e, MR_ENOMEM, "payload view list of %zu entries: out of memory", cap);
    pl->segs = v;
    s->cap_segs = cap;
  }
  pl->segs[pl->n++] = (pr_seg){p, len};
  return 0;
}

/* Records the next len bytes at r as payload views and advances past them. */
static int split_take_payload(pr_split *s, pr__rd *r, size_t len, mr_err *e) {
  MR_ASSERT(len <= pr__rd_left(r));
  r->pos += len;
  while (len > 0) {
    size_t run = r->seg[r->i].len - r->off;
    if (run > len) run = len;
    int rc = split_push_seg(s, r->seg[r->i].p + r->off, run, e);
    if (rc) return rc;
    r->off += run;
    len -= run;
    rd_settle(r);
  }
  return 0;
}

/*
 * Byte layout of a framed ForwardRequest / ForwardReply (proto3 wire format), as written
 * by pr_encode_with_payload (pr_grpc.c) and read by pr_split_message:
 *
 *   +--------------------------------------+------+-------------+------------------------+
 *   | header: every field but 15, packed   | 0x7a | varint(len) | payload: len bytes     |
 *   | by protobuf-c with the bytes field   | tag  | 1..10 bytes | (hidden / output)      |
 *   | left empty (so proto3 omits it)      | 15|2 |             | referenced, not copied |
 *   +--------------------------------------+------+-------------+------------------------+
 *
 * The decoder does not rely on that order: any protobuf encoder may put field 15 first,
 * repeat it, or add fields we do not know. Every top-level field is one of
 *
 *   tag = varint(field << 3 | wire type), then
 *     wire type 0: varint                 (1..10 bytes)
 *     wire type 1: 8 bytes                (fixed64 / double)
 *     wire type 2: varint(len), len bytes (bytes, string, packed repeated, sub-message)
 *     wire type 5: 4 bytes                (fixed32 / float)
 *
 * Fields other than 15 are copied verbatim (tag included) into one contiguous header
 * buffer that protobuf-c then unpacks; it sees a message identical to the original minus
 * field 15. Field 15 becomes a list of views into the segments. The header is small (ids
 * and weights), the payload is the bulk, so the only bulk copy left is the consumer's
 * single gather into its destination.
 */

/* Buffers are kept across calls (a zero-initialised pr_split is the empty state), so a
 * stream that reuses one split allocates only while its messages grow. On error the split
 * is left empty (hdr_len 0, no payload) but keeps its buffers for pr_split_free. */
int pr_split_message(pr_split *s, const pr_seg *in, size_t n, mr_err *e) {
  pr__rd r, at;
  int rc = 0;

  MR_ASSERT(s && (in || n == 0));
  split_reset(s);
  pr__rd_init(&r, in, n);

  while (pr__rd_left(&r) > 0) {
    uint32_t field;
    unsigned wt;
    uint64_t val;
    size_t body, start;

    at = r; /* the cursor at the tag, to copy the whole field from */
    rc = pr__rd_field(&r, &field, &wt, &val, &body, &start, e);
    if (rc) goto out_reset;

    if (field == PR_PAYLOAD_FIELD) {
      if (wt != PR__WT_LEN) {
        rc = mr_err_set(e, MR_EFORMAT,
                        "field %u at byte %zu: payload has wire type %u, must be 2 "
                        "(length-delimited bytes)",
                        field, start, wt);
        goto out_reset;
      }
      /* Last occurrence wins (proto3 scalar bytes): drop views of an earlier one. */
      s->payload.n = 0;
      s->payload.len = body;
      s->payload.present = true;
      rc = split_take_payload(s, &r, body, e);
      if (rc) goto out_reset;
      continue;
    }

    size_t flen = (r.pos - start) + body; /* tag + varint/length + value bytes */
    if (flen > PR_MAX_HEADER_BYTES - s->hdr_len) {
      rc = mr_err_set(e, MR_EFORMAT,
                      "field %u at byte %zu: header fields reach %zu bytes, over the limit "
                      "of %u (PR_MAX_HEADER_BYTES)",
                      field, start, s->hdr_len + flen, PR_MAX_HEADER_BYTES);
      goto out_reset;
    }
    rc = split_reserve_hdr(s, s->hdr_len + flen, e);
    if (rc) goto out_reset;
    pr__rd_copy(&at, s->hdr + s->hdr_len, flen);
    s->hdr_len += flen;
    r = at; /* the copy advanced `at` to the end of the field */
  }
  return 0;

out_reset:
  split_reset(s);
  return rc;
}

void pr_split_free(pr_split *s) {
  if (!s) return;
  mr_free(s->hdr);
  mr_free(s->payload.segs);
  memset(s, 0, sizeof *s);
}

void pr_payload_gather(const pr_payload *p, void *dst) {
  uint8_t *d = dst;
  for (size_t k = 0; k < p->n; k++) {
    memcpy(d, p->segs[k].p, p->segs[k].len);
    d += p->segs[k].len;
  }
}

size_t pr_payload_prefix(uint8_t *out, uint64_t len) {
  out[0] = (uint8_t)(PR_PAYLOAD_FIELD << 3 | PR__WT_LEN); /* 0x7a */
  return 1 + pr__varint_put(out + 1, len);
}

/* ---- ForwardRequest / ForwardReply ----------------------------------------------------- */

/* Splits, then unpacks the header bytes with protobuf-c. The header never holds field 15,
 * so protobuf-c allocates only the small fields (ids, weights, error text). */
static int forward_decode(const pr_seg *in, size_t n, pr_split *split,
                          const ProtobufCMessageDescriptor *d, ProtobufCMessage **out,
                          mr_err *e) {
  static const uint8_t empty[1];
  *out = NULL;
  int rc = pr_split_message(split, in, n, e);
  if (rc) return mr_err_prefix(e, rc, "%s", d->short_name);
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, split->hdr_len,
                                                  split->hdr_len ? split->hdr : empty);
  if (!m) {
    rc = mr_err_set(e, MR_EFORMAT, "%s: protobuf-c could not unpack header (%zu bytes)",
                    d->short_name, split->hdr_len);
    split_reset(split); /* on every error the split holds nothing */
    return rc;
  }
  *out = m;
  return 0;
}

int pr_forward_request_decode(const pr_seg *in, size_t n, pr_split *split,
                              Moerpc__V1__ForwardRequest **hdr, mr_err *e) {
  return forward_decode(in, n, split, &moerpc__v1__forward_request__descriptor,
                        (ProtobufCMessage **)hdr, e);
}

int pr_forward_reply_decode(const pr_seg *in, size_t n, pr_split *split,
                            Moerpc__V1__ForwardReply **hdr, mr_err *e) {
  return forward_decode(in, n, split, &moerpc__v1__forward_reply__descriptor,
                        (ProtobufCMessage **)hdr, e);
}
