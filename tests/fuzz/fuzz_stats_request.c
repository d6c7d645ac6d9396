/*
 * fuzz_stats_request.c - libFuzzer target: a StatsRequest as the server receives it (a byte
 * buffer of several slices, fuzz_bb.h), decoded by pr_decode with the server's limit
 * (ES_MAX_CONTROL_REQUEST_BYTES), as es__on_stats does.
 *
 * Checked beyond "no crash, no leak, no UB": a failure is MR_EFORMAT or MR_EEXHAUSTED (over
 * the limit) with a message naming StatsRequest and no message returned; an accepted
 * message was within the limit and packs again into bytes that decode to the same fields.
 */
#include <stdio.h>
#include <string.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_stats_request: %s: %s\n", what, msg);
  abort();
}

static const char *str(const char *s) { return s ? s : ""; }

/* The fields the server reads are equal. */
static bool same(const Moerpc__V1__StatsRequest *a, const Moerpc__V1__StatsRequest *b) {
  (void)str;
  return !a->reset == !b->reset; /* protobuf-c keeps a bool's varint as it came */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  Moerpc__V1__StatsRequest *req = (Moerpc__V1__StatsRequest *)fuzz_pr_decode(
      "fuzz_stats_request", bb, &moerpc__v1__stats_request__descriptor, ES_MAX_CONTROL_REQUEST_BYTES);
  fuzz_verdict_set(req != NULL);
  if (req) {
    if (grpc_byte_buffer_length(bb) > ES_MAX_CONTROL_REQUEST_BYTES)
      fuzz_fail("accepted a message over the limit", "");
    size_t n = moerpc__v1__stats_request__get_packed_size(req);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) abort();
    moerpc__v1__stats_request__pack(req, buf);
    Moerpc__V1__StatsRequest *again = moerpc__v1__stats_request__unpack(NULL, n, buf);
    /* protobuf-c keeps unknown fields it accepts leniently (field number 0, a tag in a
     * non-minimal varint) and packs them back as they came, which it then refuses: only a
     * message without unknown fields must survive the round trip. */
    if (!again && req->base.n_unknown_fields == 0) fuzz_fail("repacked message does not decode", "");
    if (again && !same(req, again)) fuzz_fail("repacked message differs", "");
    if (again) moerpc__v1__stats_request__free_unpacked(again, NULL);
    free(buf);
    moerpc__v1__stats_request__free_unpacked(req, NULL);
  }
  grpc_byte_buffer_destroy(bb);
  return 0;
}
