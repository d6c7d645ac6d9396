/*
 * proto/internal.h - internals shared by the files of proto/ (not part of the public API).
 *
 * pr__rd is a read cursor over a message that is split across several segments (the
 * slices gRPC hands us). It never joins the segments: every read walks them byte by byte
 * or by memcpy runs, so a varint or a tag may straddle a boundary. All functions assume
 * the caller has checked that enough bytes are left (pr__rd_left); pr__rd_field does
 * those checks itself and is the only entry point that looks at untrusted framing.
 */
#ifndef PR_INTERNAL_H
#define PR_INTERNAL_H

#include "proto/pr.h"

/* Longest varint (64-bit value, 7 bits per byte). */
#define PR__VARINT_MAX 10
/* Largest legal field number (2^29 - 1). */
#define PR__FIELD_MAX 536870911u

/* Protobuf wire types. Groups (3, 4) are deprecated and not used by moe.proto or
 * grpc.health.v1, so they are rejected; 6 and 7 do not exist. */
enum {
  PR__WT_VARINT = 0,
  PR__WT_FIXED64 = 1,
  PR__WT_LEN = 2,
  PR__WT_SGROUP = 3,
  PR__WT_EGROUP = 4,
  PR__WT_FIXED32 = 5,
};

typedef struct pr__rd {
  const pr_seg *seg; /* the segments, not owned */
  size_t nseg;
  size_t i;     /* current segment; nseg at the end; never an exhausted or empty one */
  size_t off;   /* offset inside seg[i], < seg[i].len unless i == nseg */
  size_t pos;   /* bytes consumed since the start of the message */
  size_t total; /* bytes in the whole message */
} pr__rd;

/* Points r at the start of the message in[0..n). */
void pr__rd_init(pr__rd *r, const pr_seg *in, size_t n);

static inline size_t pr__rd_left(const pr__rd *r) { return r->total - r->pos; }

/* Advances over len bytes (len <= pr__rd_left). */
void pr__rd_skip(pr__rd *r, size_t len);
/* Copies the next len bytes (len <= pr__rd_left) to dst and advances. */
void pr__rd_copy(pr__rd *r, uint8_t *dst, size_t len);

/*
 * Reads the framing of the next field (the caller checked pr__rd_left(r) > 0).
 * On success: *field and *wt are set, *start is the field's byte offset, and
 *   - wire type 0: the varint is consumed, *val holds it, *body = 0;
 *   - wire type 1 / 5: the cursor is before the 8 / 4 value bytes, *body = 8 / 4;
 *   - wire type 2: the length is consumed, the cursor is at the data, *body = length;
 * and *body is never more than the bytes left, so the caller may skip or copy it.
 * Errors (MR_EFORMAT, message "field F at byte N: ..." or "byte N: ..." for a bad tag):
 * truncated or over-long (11+ bytes) varint, field number 0 or over 2^29-1, wire type
 * 3/4/6/7, a value or length running past the end of the message.
 */
int pr__rd_field(pr__rd *r, uint32_t *field, unsigned *wt, uint64_t *val, size_t *body,
                 size_t *start, mr_err *e);

/* Writes v as a varint to out (room for PR__VARINT_MAX bytes); returns the bytes written. */
size_t pr__varint_put(uint8_t *out, uint64_t v);

#endif /* PR_INTERNAL_H */
