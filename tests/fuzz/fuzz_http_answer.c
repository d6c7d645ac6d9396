/*
 * fuzz_http_answer.c - libFuzzer target for the HTTP answer check of mr_http_get
 * (common/http.c, mr_http_parse_answer): any bytes give a status in 100..599 with the body
 * inside the input and within the limit, or an error with a message.
 */
#include "common/mr.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int status = -1;
  size_t off = (size_t)-1;
  mr_err e;
  const size_t max_body = 4096;
  int rc = mr_http_parse_answer((const char *)data, size, max_body, &status, &off, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc > 0 || e.msg[0] == '\0' || status != 0) abort();
    return 0;
  }
  if (status < 100 || status > 599 || off < 14 || off > size || off > MR_HTTP_MAX_HEAD ||
      size - off > max_body)
    abort();
  if (data[off - 1] != '\n' || data[off - 2] != '\r') abort();
  return 0;
}
