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
#include <stdlib.h>

#include <grpc/byte_buffer.h>
#include <grpc/slice.h>

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

#endif /* FUZZ_BB_H */
