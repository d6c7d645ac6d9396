/*
 * fuzz_http_request.c - libFuzzer target: the bytes a /metrics client sends, as
 * mr_http_parse_request (common/http.c) sees them: the whole input with the responder's
 * limit, and every prefix the responder could have read before it.
 *
 * Checked beyond "no crash, no leak, no UB": a failure is MR_EFORMAT with status 400 or
 * 505, or MR_EEXHAUSTED with 431, and names its status in the message; a complete head has
 * a method of capital letters and a path starting with '/', NUL-terminated inside their
 * fields, and head_len within the input; a prefix of a complete head is never refused
 * (the responder must not answer 400 to a head that was only cut short by the network).
 * Verdict: accepted = complete and well formed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"
#include "tests/fuzz/fuzz.h"

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_http_request: %s: %s\n", what, msg);
  abort();
}

static int check(const char *buf, size_t len, mr_http_req *r) {
  mr_err e;
  mr_err_clear(&e);
  int rc = mr_http_parse_request(buf, len, MR_HTTP_MAX_HEAD, r, &e);
  if (rc == MR_EFORMAT) {
    if (r->status != 400 && r->status != 505) fuzz_fail("MR_EFORMAT with status", e.msg);
  } else if (rc == MR_EEXHAUSTED) {
    if (r->status != 431) fuzz_fail("MR_EEXHAUSTED without 431", e.msg);
  } else if (rc != 0) {
    fuzz_fail("undocumented code", mr_err_name(rc));
  }
  if (rc && !strstr(e.msg, "HTTP 4") && !strstr(e.msg, "HTTP 5")) fuzz_fail("no status in", e.msg);
  if (rc == 0 && r->complete) {
    if (!r->method[0] || strnlen(r->method, sizeof r->method) == sizeof r->method)
      fuzz_fail("method", "empty or not terminated");
    for (const char *c = r->method; *c; c++)
      if (*c < 'A' || *c > 'Z') fuzz_fail("method", r->method);
    if (r->path[0] != '/' || strnlen(r->path, sizeof r->path) == sizeof r->path)
      fuzz_fail("path", "not /... or not terminated");
    if (r->head_len == 0 || r->head_len > len) fuzz_fail("head_len", "outside the input");
  }
  return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* A heap copy of exactly size bytes: ASan sees any read past the input. */
  char *buf = malloc(size ? size : 1);
  if (!buf) abort();
  memcpy(buf, data, size);
  mr_http_req r;
  int rc = check(buf, size, &r);
  bool complete = rc == 0 && r.complete;
  fuzz_verdict_set(complete);
  if (complete) {
    size_t head = r.head_len;
    for (size_t n = 0; n < head; n += 1 + n / 8) {
      mr_http_req p;
      if (check(buf, n, &p) != 0) fuzz_fail("a prefix of a good head was refused", "");
    }
  }
  free(buf);
  return 0;
}
