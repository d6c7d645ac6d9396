/*
 * fuzz_health_request.c - libFuzzer target: a grpc.health.v1 HealthCheckRequest as the
 * server receives it (a byte buffer of several slices, fuzz_bb.h), decoded by
 * pr_health_request_decode into a buffer of the server's size (256 bytes, es__on_health).
 *
 * Checked beyond "no crash, no leak, no UB": a failure is MR_EFORMAT naming
 * HealthCheckRequest and leaves service ""; on success service is NUL-terminated inside
 * the buffer, and the decoded name is the same with a 1-byte-larger buffer (no
 * off-by-one at the cap); a decoded name is also cross-checked by encoding it again.
 */
#include <stdio.h>
#include <string.h>

#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

#define CAP 256

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_health_request: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  char *svc = malloc(CAP), *svc2 = malloc(CAP + 1); /* heap: ASan sees a write past cap */
  if (!svc || !svc2) abort();
  mr_err e;
  mr_err_clear(&e);
  int rc = pr_health_request_decode(bb, svc, CAP, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc != MR_EFORMAT) fuzz_fail("undocumented code", mr_err_name(rc));
    if (!strstr(e.msg, "HealthCheckRequest")) fuzz_fail("error does not name the message", e.msg);
    if (svc[0] != '\0') fuzz_fail("failed decode left a service name", e.msg);
  } else {
    size_t n = strnlen(svc, CAP);
    if (n >= CAP) fuzz_fail("service not terminated", "");
    if (pr_health_request_decode(bb, svc2, CAP + 1, &e) != 0 || strcmp(svc, svc2) != 0)
      fuzz_fail("a larger buffer decodes differently", e.msg);
    if (memchr(svc, 0, n) == NULL && n > 0) {
      grpc_byte_buffer *again = pr_health_request_encode(svc);
      if (pr_health_request_decode(again, svc2, CAP, &e) != 0 || strcmp(svc, svc2) != 0)
        fuzz_fail("encode / decode round trip differs", e.msg);
      grpc_byte_buffer_destroy(again);
    }
  }
  free(svc);
  free(svc2);
  grpc_byte_buffer_destroy(bb);
  return 0;
}
