/*
 * fuzz_hello_request.c - libFuzzer target: a HelloRequest as the server receives it (a byte
 * buffer of several slices, fuzz_bb.h), decoded by pr_decode with the server's limit
 * (ES_MAX_CONTROL_REQUEST_BYTES), as es__on_hello does.
 *
 * Checked beyond "no crash, no leak, no UB": a failure is MR_EFORMAT or MR_EEXHAUSTED (over
 * the limit) with a message naming HelloRequest and no message returned; an accepted
 * message was within the limit and packs again into bytes that decode to the same fields.
 *
 * The same buffer also goes through pr_hello_client_name, the raw reader of client_name
 * that the server logs from (with two buffer sizes, so that cutting is exercised): a
 * failure is MR_EFORMAT naming HelloRequest, with no length; when both accept, it reads the
 * same name as protobuf-c up to protobuf-c's first NUL, and a length no shorter.
 */
#include <stdio.h>
#include <string.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_hello_request: %s: %s\n", what, msg);
  abort();
}

static const char *str(const char *s) { return s ? s : ""; }

/* The fields the server reads are equal. */
static bool same(const Moerpc__V1__HelloRequest *a, const Moerpc__V1__HelloRequest *b) {
  return a->protocol_major == b->protocol_major && a->protocol_minor == b->protocol_minor &&
         strcmp(str(a->client_name), str(b->client_name)) == 0;
}

/* pr_hello_client_name on bb with a buffer of cap bytes; req is protobuf-c's reading (or
 * NULL when it refused the message). */
static void check_raw_name(grpc_byte_buffer *bb, size_t cap, const Moerpc__V1__HelloRequest *req) {
  static char raw[300];
  size_t len = 12345;
  mr_err e;
  mr_err_clear(&e);
  int rc = pr_hello_client_name(bb, raw, cap, &len, &e);
  if (rc) {
    if (rc != MR_EFORMAT && rc != MR_ENOMEM) fuzz_fail("raw name: undocumented code", mr_err_name(rc));
    if (!strstr(e.msg, "HelloRequest")) fuzz_fail("raw name: message names no HelloRequest", e.msg);
    if (len != 0) fuzz_fail("raw name: a length set on failure", e.msg);
    return; /* protobuf-c may still accept it: it is lenient with field 0 (the server then
             * logs protobuf-c's copy) */
  }
  if (!req) return;
  const char *cn = str(req->client_name);
  size_t n = strlen(cn); /* protobuf-c's copy ends at the first NUL */
  size_t got = len < cap ? len : cap;
  if (len < n) fuzz_fail("raw name: shorter than protobuf-c's", cn);
  if (memcmp(raw, cn, n < got ? n : got) != 0) fuzz_fail("raw name: differs from protobuf-c's", cn);
  if (n < got && raw[n] != '\0') fuzz_fail("raw name: no NUL where protobuf-c's copy ends", cn);
  /* What the server logs from it fits its buffer, whatever the bytes. */
  char out[MR_LOG_ESC_MAX];
  size_t k = mr_log_escape(out, sizeof out, raw, got);
  if (k >= sizeof out || strlen(out) != k) fuzz_fail("raw name: escaped text not one bounded line", out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  Moerpc__V1__HelloRequest *req = (Moerpc__V1__HelloRequest *)fuzz_pr_decode(
      "fuzz_hello_request", bb, &moerpc__v1__hello_request__descriptor, ES_MAX_CONTROL_REQUEST_BYTES);
  fuzz_verdict_set(req != NULL);
  check_raw_name(bb, 300, req);
  check_raw_name(bb, 3, req);
  if (req) {
    if (grpc_byte_buffer_length(bb) > ES_MAX_CONTROL_REQUEST_BYTES)
      fuzz_fail("accepted a message over the limit", "");
    size_t n = moerpc__v1__hello_request__get_packed_size(req);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) abort();
    moerpc__v1__hello_request__pack(req, buf);
    Moerpc__V1__HelloRequest *again = moerpc__v1__hello_request__unpack(NULL, n, buf);
    /* protobuf-c keeps unknown fields it accepts leniently (field number 0, a tag in a
     * non-minimal varint) and packs them back as they came, which it then refuses: only a
     * message without unknown fields must survive the round trip. */
    if (!again && req->base.n_unknown_fields == 0) fuzz_fail("repacked message does not decode", "");
    if (again && !same(req, again)) fuzz_fail("repacked message differs", "");
    if (again) moerpc__v1__hello_request__free_unpacked(again, NULL);
    free(buf);
    moerpc__v1__hello_request__free_unpacked(req, NULL);
  }
  grpc_byte_buffer_destroy(bb);
  return 0;
}
