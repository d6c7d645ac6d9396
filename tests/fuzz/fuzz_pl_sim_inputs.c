/*
 * fuzz_pl_sim_inputs.c - libFuzzer target for the readers of `moerpc-place simulate`'s
 * measured inputs (placement/pl_sim.c): JSON lines of moerpc-bench-kernels (pl_rates_parse),
 * moerpc-client bench-rpc (pl_rpc_parse) and moerpc-client bench (pl_client_bench_parse).
 * The first byte picks the reader ('k' kernels of bf16, 'K' kernels of any format, 'r' rpc,
 * 'c' client bench; anything else: all four on the same text, accepted if any accepts); the
 * rest is the text. On success the documented invariants must hold; on failure the error
 * must be a negative code with a message.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "placement/pl.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_err(int rc, const mr_err *e) {
  if (rc > 0 || (rc < 0 && e->msg[0] == '\0')) abort();
}

static bool run_rates(const char *t, size_t n, const char *fmt) {
  pl_rates r;
  mr_err e;
  mr_err_clear(&e);
  int rc = pl_rates_parse(&r, t, n, fmt, "fuzz", &e);
  check_err(rc, &e);
  if (rc) {
    if (r.n != 0) abort();
    return false;
  }
  if (r.n < 1 || r.n > PL_RATES_MAX || r.threads < 1) abort();
  for (uint32_t i = 0; i < r.n; i++) {
    if (!(r.pt[i].gbps > 0) || !isfinite(r.pt[i].gbps) || !(r.pt[i].u >= 1 - 1e-9) ||
        !isfinite(r.pt[i].u))
      abort();
    if (i && r.pt[i].u < r.pt[i - 1].u) abort();
  }
  double g = pl_rates_gbps(&r, 3.0);
  if (!(g > 0) || !isfinite(g)) abort();
  return true;
}

static bool run_rpc(const char *t, size_t n) {
  pl_rpc_cost c;
  mr_err e;
  mr_err_clear(&e);
  int rc = pl_rpc_parse(&c, t, n, "fuzz", &e);
  check_err(rc, &e);
  if (rc) return false;
  if (!(c.fixed_us >= 0) || !(c.per_byte_us >= 0) || !isfinite(c.fixed_us) ||
      !isfinite(c.per_byte_us) || c.n_lines < 1)
    abort();
  return true;
}

static bool run_client(const char *t, size_t n) {
  pl_client_bench b;
  mr_err e;
  mr_err_clear(&e);
  int rc = pl_client_bench_parse(&b, t, n, "fuzz", &e);
  check_err(rc, &e);
  if (rc) return false;
  if (!(b.step_us > 0) || !(b.expert_us >= 0) || !isfinite(b.step_us) ||
      !(b.prefill_tok_s > 0) || b.batch < 1 || b.prompt_len < 1)
    abort();
  return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const char *t = (const char *)data + 1;
  size_t n = size - 1;
  bool ok;
  switch (data[0]) {
    case 'k': ok = run_rates(t, n, "bf16"); break;
    case 'K': ok = run_rates(t, n, NULL); break;
    case 'r': ok = run_rpc(t, n); break;
    case 'c': ok = run_client(t, n); break;
    default: {
      bool a = run_rates(t, n, NULL), b = run_rpc(t, n), c = run_client(t, n);
      ok = a || b || c;
    }
  }
  fuzz_verdict_set(ok);
  return 0;
}
