/*
 * fuzz_health_response.c - libFuzzer target: a grpc.health.v1 HealthCheckResponse (a byte
 * buffer of several slices, fuzz_bb.h) decoded by pr_health_response_decode, the decoder a
 * health-checking client uses (the integration tests' itu_health; the client library does
 * not call Health).
 *
 * Checked beyond "no crash, no leak, no UB": a failure is MR_EFORMAT naming
 * HealthCheckResponse and leaves *status as it was; a success encodes back, for the three
 * known statuses, to a message that decodes to the same status.
 */
#include <stdio.h>
#include <string.h>

#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_health_response: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  int st = -12345;
  mr_err e;
  mr_err_clear(&e);
  int rc = pr_health_response_decode(bb, &st, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc != MR_EFORMAT) fuzz_fail("undocumented code", mr_err_name(rc));
    if (!strstr(e.msg, "HealthCheckResponse")) fuzz_fail("error does not name the message", e.msg);
    if (st != -12345) fuzz_fail("failed decode wrote the status", e.msg);
  } else if (st >= PR_HEALTH_UNKNOWN && st <= PR_HEALTH_NOT_SERVING) {
    grpc_byte_buffer *again = pr_health_response_encode(st);
    int st2 = -1;
    if (pr_health_response_decode(again, &st2, &e) != 0 || st2 != st)
      fuzz_fail("encode / decode round trip differs", e.msg);
    grpc_byte_buffer_destroy(again);
  }
  grpc_byte_buffer_destroy(bb);
  return 0;
}
