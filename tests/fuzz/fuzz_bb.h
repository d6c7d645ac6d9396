/*
 * fuzz_bb.h - turns a fuzz input into a gRPC byte buffer of several slices, as gRPC hands a
 * received message to the unary handlers (pr_decode, the health decoders).
 *
 * Input layout (what gen_control_seeds.c writes):
 *
 *   +--------+------------------------------------------+
 *   | byte 0 | message bytes                            |
 *   | split  | a serialized message (or anything else)  |
 *   +--------+------------------------------------------+
 *
 * 1 + (byte 0 & 3) slices, cut at points derived from byte 0 >> 2 by an LCG (empty slices
 * included). Each slice is a copied gRPC slice of exactly its bytes, heap-allocated when
 * over 23 bytes (gRPC inlines shorter ones inside the slice struct, where a read past the
 * end stays inside the struct and is not caught by ASan).
 */
#ifndef FUZZ_BB_H
#define FUZZ_BB_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

#include "proto/pr.h"

#define FUZZ_BB_MAXSEG 4

/* A byte buffer of the message in data[1..size), or NULL when size is 0. The caller
 * destroys it with grpc_byte_buffer_destroy. */
static inline grpc_byte_buffer *fuzz_bb_new(const uint8_t *data, size_t size) {
  if (size < 1) return NULL;
  size_t nseg = 1 + (data[0] & 3u);
  uint32_t seed = (uint32_t)(data[0] >> 2) * 2654435761u + 1u;
  const uint8_t *msg = data + 1;
  size_t len = size - 1;
  size_t cut[FUZZ_BB_MAXSEG + 1];
  cut[0] = 0;
  cut[nseg] = len;
  for (size_t i = 1; i < nseg; i++) {
    seed = seed * 1664525u + 1013904223u;
    cut[i] = len ? (seed >> 8) % (len + 1) : 0;
  }
  for (size_t i = 1; i < nseg; i++) /* insertion sort of cut[1..nseg) */
    for (size_t j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
      size_t t = cut[j];
      cut[j] = cut[j - 1];
      cut[j - 1] = t;
    }
  grpc_slice s[FUZZ_BB_MAXSEG];
  for (size_t i = 0; i < nseg; i++)
    s[i] = grpc_slice_from_copied_buffer((const char *)msg + cut[i], cut[i + 1] - cut[i]);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(s, nseg);
  for (size_t i = 0; i < nseg; i++) grpc_slice_unref(s[i]);
  if (!bb) abort();
  return bb;
}

/* pr_decode of bb (at most max bytes) held to its error contract: a failure is MR_EFORMAT
 * or MR_EEXHAUSTED, returns no message and names the message type. Aborts, naming target,
 * on a breach; else returns the message (the caller frees it) or NULL. bb is kept. */
static inline ProtobufCMessage *fuzz_pr_decode(const char *target, grpc_byte_buffer *bb,
                                               const ProtobufCMessageDescriptor *desc,
                                               size_t max) {
  ProtobufCMessage *m = NULL;
  mr_err e;
  mr_err_clear(&e);
  int rc = pr_decode(bb, desc, max, &m, &e);
  if (rc == 0) return m;
  const char *breach = rc != MR_EFORMAT && rc != MR_EEXHAUSTED ? "undocumented decode code"
                       : m                                      ? "decode failed but returned a message"
                       : !strstr(e.msg, desc->short_name)        ? "error does not name the message"
                                                                 : NULL;
  if (breach) {
    fprintf(stderr, "%s: %s: %s (%s)\n", target, breach, e.msg, mr_err_name(rc));
    abort();
  }
  return NULL;
}

#endif /* FUZZ_BB_H */
