/*
 * fuzz_hidden_finite.c - libFuzzer target: the finite checks of both sides, all one scan
 * (mr_nonfinite_find): the server's of hidden states and outputs (es_hidden_check_finite,
 * es_output_check_finite on wire-dtype rows) and the client's of a reply's output
 * (gc__reply_check_finite), against a scalar reference (mr_convert_to_f32 + isfinite) on
 * the same bytes.
 *
 * Input layout (what gen_control_seeds.c writes):
 *
 *   +--------+--------+-----------------------------------------------+
 *   | byte 0 | byte 1 | payload                                       |
 *   | flags  | H - 1  | n_tokens = len / (H * dtype size) whole rows; |
 *   |        |        | the rest is dropped                           |
 *   +--------+--------+-----------------------------------------------+
 *
 * flags: bits 0-1 the dtype ((flags & 3) % 3: 0 f32, 1 f16, 2 bf16), bit 2 unaligned. The
 * rows are copied to a heap block of exactly their size (at an odd address when unaligned),
 * so that ASan sees a read past the end and the loads are exercised unaligned.
 *
 * Accepted = every element finite. Checked: the verdict equals the reference's; a refusal
 * is MR_EINVAL naming the first non-finite element's token and index and its class (NaN,
 * +Inf, -Inf); the output check (MR_ERANGE, naming the layer) and the reply check
 * (MR_EPROTO, naming the row and the call's token) give the same verdict and position in
 * every dtype.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert_server/es.h"
#include "gpu_client/rpc/internal.h"
#include "tests/fuzz/fuzz.h"

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_hidden_finite: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const mr_dtype dts[3] = {MR_DTYPE_F32, MR_DTYPE_F16, MR_DTYPE_BF16};
  fuzz_verdict_set(false);
  if (size < 2) return 0;
  mr_dtype dt = dts[(data[0] & 3) % 3];
  size_t off = data[0] & 4 ? 1 : 0;
  uint32_t H = (uint32_t)data[1] + 1;
  size_t es = mr_dtype_size(dt);
  uint32_t T = (uint32_t)((size - 2) / (H * es));
  size_t n = (size_t)T * H, nbytes = n * es;
  uint8_t *block = malloc(nbytes + off + 1);
  float *f = malloc((n ? n : 1) * sizeof *f);
  if (!block || !f) abort();
  uint8_t *x = block + off;
  memcpy(x, data + 2, nbytes);
  /* The reference: the first element that is not finite once widened to f32 (f16 and
   * bf16 widen exactly, NaN stays NaN and Inf stays Inf). */
  uint16_t h16;
  uint32_t h32;
  size_t first = n;
  for (size_t i = 0; i < n && first == n; i++) {
    if (es == 4) {
      memcpy(&h32, x + 4 * i, 4);
      mr_convert_to_f32(&f[i], &h32, dt, 1);
    } else {
      memcpy(&h16, x + 2 * i, 2);
      mr_convert_to_f32(&f[i], &h16, dt, 1);
    }
    if (!isfinite(f[i])) first = i;
  }
  mr_err e;
  mr_err_clear(&e);
  int rc = es_hidden_check_finite(x, dt, T, H, &e);
  fuzz_verdict_set(rc == 0);
  if ((rc == 0) != (first == n)) fuzz_fail("verdict differs from the reference", e.msg);
  if (rc) {
    char want[96];
    snprintf(want, sizeof want, "hidden[token %zu, index %zu] = %s", first / H, first % H,
             isnan(f[first]) ? "NaN" : f[first] > 0 ? "+Inf" : "-Inf");
    if (rc != MR_EINVAL) fuzz_fail("undocumented code", mr_err_name(rc));
    if (!strstr(e.msg, want)) fuzz_fail("message does not name the first bad element", e.msg);
  }
  /* The output check on the same bytes as wire-dtype output rows: the same verdict and
   * position; with the widened values as the fp32 rows it came from (y32), a refusal
   * says "not finite in fp32" (the widening keeps NaN and Inf), without them it names the
   * dtype. */
  int rc2 = es_output_check_finite(x, dt, n ? f : NULL, 7, T, H, &e);
  if ((rc2 == 0) != (rc == 0)) fuzz_fail("output check disagrees", e.msg);
  if (rc2) {
    char want[64];
    snprintf(want, sizeof want, "output[token %zu, index %zu]", first / H, first % H);
    if (rc2 != MR_ERANGE || !strstr(e.msg, want) || !strstr(e.msg, "layer 7") ||
        !strstr(e.msg, "not finite in fp32"))
      fuzz_fail("output message does not name the element and layer", e.msg);
    rc2 = es_output_check_finite(x, dt, NULL, 7, T, H, &e);
    if (rc2 != MR_ERANGE || !strstr(e.msg, want)) fuzz_fail("output check without y32", e.msg);
  }
  /* The client's check of a reply: the same verdict, the row and the call's token (rows
   * spread as a part's rows are: increasing, here 3t + 1). */
  uint32_t *rows = malloc((T ? T : 1) * sizeof *rows);
  if (!rows) abort();
  for (uint32_t t = 0; t < T; t++) rows[t] = 3 * t + 1;
  int rc3 = gc__reply_check_finite(x, dt, rows, T, H, &e);
  if ((rc3 == 0) != (rc == 0)) fuzz_fail("reply check disagrees", e.msg);
  if (rc3) {
    char want[96];
    snprintf(want, sizeof want, "reply output[row %zu (token %zu of the call), index %zu] = %s",
             first / H, 3 * (first / H) + 1, first % H,
             isnan(f[first]) ? "NaN" : f[first] > 0 ? "+Inf" : "-Inf");
    if (rc3 != MR_EPROTO || !strstr(e.msg, want))
      fuzz_fail("reply message does not name the row, token and element", e.msg);
  }
  free(rows);
  free(block);
  free(f);
  return 0;
}
