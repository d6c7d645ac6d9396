/*
 * fuzz_safetensors.c - libFuzzer target for the safetensors header parser: any byte
 * string is a candidate file image. On success every tensor's bytes must lie inside the
 * input (touched here, so ASan sees any escape) and lookups must be consistent.
 */
#include "common/mr.h"
#include "tests/fuzz/fuzz.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int quiet;
  if (!quiet) {
    mr_log_set_level(MR_LOG_ERROR);
    quiet = 1;
  }
  mr_st *st = NULL;
  mr_err e;
  int rc = mr_st_parse_buffer(&st, data, size, "fuzz", &e);
  fuzz_verdict_set(rc == 0);
  if (rc != 0) {
    if (st != NULL || rc > 0 || e.msg[0] == '\0') abort(); /* contract: code + message */
    return 0;
  }
  volatile uint8_t sink = 0;
  size_t n = mr_st_count(st);
  for (size_t i = 0; i < n; i++) {
    const mr_st_tensor *t = mr_st_at(st, i);
    if (t->ndim > MR_ST_MAX_DIMS) abort();
    if (t->nbytes) {
      const uint8_t *p = t->data;
      if (p < data || p + t->nbytes > data + size) abort();
      sink ^= p[0];
      sink ^= p[t->nbytes - 1];
    }
    if (mr_st_find(st, t->name) != t) abort();
    if (i > 0 && strcmp(mr_st_at(st, i - 1)->name, t->name) >= 0) abort(); /* sorted, unique */
    const mr_st_tensor *x = NULL;
    rc = mr_st_expect(st, t->name, t->ndim, t->shape, &x, NULL);
    bool is_float = t->dtype == MR_DTYPE_F32 || t->dtype == MR_DTYPE_F16 ||
                    t->dtype == MR_DTYPE_BF16;
    if (is_float != (rc == 0) || (is_float && x != t)) abort();
    /* float8_e4m3fn (F8_E4M3): flagged as such, found by mr_st_expect_as with its name and
     * refused by mr_st_expect (not a float mr_dtype), one byte per element. */
    const bool f8 = strcmp(t->dtype_name, "F8_E4M3") == 0;
    if (f8 != mr_st_is_f8e4m3(t)) abort();
    rc = mr_st_expect_as(st, t->name, "F8_E4M3", t->ndim, t->shape, &x, NULL);
    if (f8 != (rc == 0) || (f8 && x != t)) abort();
    if (f8) {
      uint64_t want = 1;
      for (uint32_t d = 0; d < t->ndim; d++) want *= t->shape[d];
      if (want != t->nbytes) abort();
    }
    if (is_float) { /* nbytes = prod(shape) * size; the parser proved it cannot overflow */
      uint64_t want = mr_dtype_size(t->dtype);
      for (uint32_t d = 0; d < t->ndim; d++) want *= t->shape[d];
      if (want != t->nbytes) abort();
    }
  }
  (void)sink;
  mr_st_close(st);
  return 0;
}
