/*
 * bench_finite.c - moerpc-bench-finite: the cost of the finite checks (and the dtype
 * conversions) on both sides of the wire (docs/DESIGN.md section 5): the server's es_hidden_check_finite on the gathered
 * payload and es_output_check_finite on each job's output rows in the wire dtype, and the
 * client's gc__reply_check_finite on every reply's gathered output, next to the compute of
 * a decode request of the same shape, measured in the same run.
 *
 *   build/bin/moerpc-bench-finite [--repeats N] [--no-compute]
 *
 * For H = 2048 (qwen3-30b-a3b: I 768) and H = 7168 (deepseek-v3: I 2048), top-8:
 *   - each check (hidden, output, reply) in each wire dtype (f32, f16, bf16) on T = 1 and
 *     T = 64 tokens of finite values, the buffer warm in cache as it is right after the
 *     gather (the server's and the client's case); median over N calls (default 2001);
 *   - one decode request (T = 1, 8 experts, bf16 weights, best ISA, default threads):
 *     kn_moe_forward, median over 15 calls after a warm-up; the 8 experts are 75 MB /
 *     704 MB, far over the LLC, so every call streams its weights as a real decode does.
 *   - the wire conversions of both sides (common/convert.c: f32 -> f16 / bf16, back, and
 *     summed into f32) on T = 1, 16 and 256 tokens, next to the per-element loops they
 *     replaced, in the same run ("speedup"; "impl" names the path this CPU takes);
 * Prints one JSON line per case on stdout (the CPU's name from /proc/cpuinfo in each) and
 * a table on stderr; the fractions are, at T = 1 on the bf16 wire, (hidden + output check)
 * / decode for the server and (reply check) / decode for the client.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"
#include "expert_server/es.h"
#include "gpu_client/rpc/internal.h"
#include "kernels/kn.h"

static char cpu[128] = "unknown";

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static uint64_t median(uint64_t *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_u64);
  return v[n / 2];
}

static volatile int sink;

enum check_kind { CHECK_HIDDEN, CHECK_OUTPUT, CHECK_REPLY };

/* Median ns of one check call of kind on T x H finite elements of wire dtype dt. */
static double time_check(mr_dtype dt, enum check_kind kind, uint32_t T, uint32_t H,
                         int repeats) {
  size_t n = (size_t)T * H;
  float *f = malloc(n * sizeof *f);
  void *x = malloc(n * 4);
  uint32_t *rows = malloc(T * sizeof *rows);
  uint64_t *ns = malloc((size_t)repeats * sizeof *ns);
  if (!f || !x || !rows || !ns) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  uint64_t s = 7;
  for (size_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    f[i] = (float)((int)(s >> 40 & 0xffff) - 32768) / 3276.8f;
  }
  for (uint32_t t = 0; t < T; t++) rows[t] = 2 * t;
  mr_convert_from_f32(x, dt, f, n);
  mr_err e;
  for (int r = -10; r < repeats; r++) { /* 10 warm-up calls */
    uint64_t t0 = mr_now_ns();
    int rc = kind == CHECK_HIDDEN   ? es_hidden_check_finite(x, dt, T, H, &e)
             : kind == CHECK_OUTPUT ? es_output_check_finite(x, dt, f, 0, T, H, &e)
                                    : gc__reply_check_finite(x, dt, rows, T, H, &e);
    uint64_t t1 = mr_now_ns();
    sink += rc;
    if (rc) {
      fprintf(stderr, "check refused finite input: %s\n", e.msg);
      exit(1);
    }
    if (r >= 0) ns[r] = t1 - t0;
  }
  double m = (double)median(ns, repeats);
  free(f);
  free(x);
  free(rows);
  free(ns);
  return m;
}

/* The wire conversions (common/convert.c) next to the per-element loops they replace
 * (the rules of mr.h, as the bulk functions were before 2026-12-05), in the same run. */
enum conv_op { CONV_FROM, CONV_TO, CONV_ADD };
static const char *const conv_names[3] = {"from_f32", "to_f32", "add_f32"};

static void conv_loop(enum conv_op op, mr_dtype dt, float *f, uint16_t *w, size_t n) {
  const bool bf = dt == MR_DTYPE_BF16;
  if (op == CONV_FROM)
    for (size_t i = 0; i < n; i++) w[i] = bf ? mr_f32_to_bf16(f[i]) : mr_f32_to_f16(f[i]);
  else if (op == CONV_TO)
    for (size_t i = 0; i < n; i++) f[i] = bf ? mr_bf16_to_f32(w[i]) : mr_f16_to_f32(w[i]);
  else
    for (size_t i = 0; i < n; i++) f[i] += bf ? mr_bf16_to_f32(w[i]) : mr_f16_to_f32(w[i]);
}

/* Median ns of one conversion of T x H values (bulk, or the loop), the buffers warm. */
static double time_conv(enum conv_op op, mr_dtype dt, uint32_t T, uint32_t H, bool loop,
                        int repeats) {
  size_t n = (size_t)T * H;
  float *f = calloc(n, sizeof *f);
  uint16_t *w = malloc(n * sizeof *w);
  uint64_t *ns = malloc((size_t)repeats * sizeof *ns);
  if (!f || !w || !ns) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  uint64_t s = 11;
  for (size_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    f[i] = (float)((int)(s >> 40 & 0xffff) - 32768) / 3276.8f;
  }
  mr_convert_from_f32(w, dt, f, n);
  for (int r = -10; r < repeats; r++) {
    uint64_t t0 = mr_now_ns();
    if (loop) conv_loop(op, dt, f, w, n);
    else if (op == CONV_FROM) mr_convert_from_f32(w, dt, f, n);
    else if (op == CONV_TO) mr_convert_to_f32(f, w, dt, n);
    else mr_convert_add_f32(f, w, dt, n);
    uint64_t t1 = mr_now_ns();
    if (op == CONV_ADD && (r & 63) == 0) mr_convert_to_f32(f, w, dt, n); /* keep sums bounded */
    sink += w[n / 2] + (int)f[n / 3];
    if (r >= 0) ns[r] = t1 - t0;
  }
  double m = (double)median(ns, repeats);
  free(f);
  free(w);
  free(ns);
  return m;
}

/* Median ns of one T = 1, top-8 kn_moe_forward with bf16 weights, or -1 on failure. */
static double time_decode(uint32_t H, uint32_t I) {
  const uint32_t E = 8, k = 8;
  kn_engine *eng = NULL;
  kn_layer *L = NULL;
  mr_err e;
  double res = -1;
  kn_engine_opts eo = {.isa = KN_ISA_COUNT};
  uint16_t *src = NULL;
  mr_arena ar;
  mr_arena_init(&ar, (size_t)64 << 20);
  if (kn_engine_new(&eng, &eo, &e) != 0) goto out_fail;
  kn_layer_desc d = {.hidden = H, .inter = I, .num_experts = E, .format = KN_FMT_BF16};
  if (kn_layer_new(&L, eng, &d, &e) != 0) goto out_fail;
  size_t n = (size_t)H * I;
  src = malloc(3 * n * sizeof *src);
  if (!src) goto out_free;
  uint64_t s = 99;
  for (size_t i = 0; i < 3 * n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    src[i] = mr_f32_to_bf16(((float)(s >> 40) / 16777216.0f - 0.5f) * 0.1f);
  }
  for (uint32_t x = 0; x < E; x++)
    if (kn_layer_load_expert(L, x, src, src + n, src + 2 * n, MR_DTYPE_BF16, &e) != 0) goto out_fail;
  int32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  float w[8] = {0.2f, 0.15f, 0.15f, 0.1f, 0.1f, 0.1f, 0.1f, 0.1f};
  uint16_t *xin = malloc(H * sizeof *xin);
  float *out = malloc(H * sizeof *out);
  if (!xin || !out) {
    free(xin);
    free(out);
    goto out_free;
  }
  for (uint32_t i = 0; i < H; i++) xin[i] = mr_f32_to_bf16((float)(i % 17) * 0.01f - 0.08f);
  uint64_t ns[15];
  for (int r = -1; r < 15; r++) {
    kn_moe_args a = {.n_tokens = 1, .top_k = k, .ids = ids, .weights = w, .x = xin,
                     .x_dtype = MR_DTYPE_BF16, .out = out};
    uint64_t t0 = mr_now_ns();
    int rc = kn_moe_forward(eng, L, &a, &ar, &e);
    uint64_t t1 = mr_now_ns();
    mr_arena_reset(&ar);
    if (rc) {
      free(xin);
      free(out);
      goto out_fail;
    }
    if (r >= 0) ns[r] = t1 - t0;
  }
  res = (double)median(ns, 15);
  free(xin);
  free(out);
  goto out_free;
out_fail:
  fprintf(stderr, "decode H=%u: %s\n", H, e.msg);
out_free:
  free(src);
  kn_layer_free(L);
  kn_engine_free(eng);
  mr_arena_close(&ar);
  return res;
}

int main(int argc, char **argv) {
  int repeats = 2001;
  bool compute = true;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--repeats") == 0 && i + 1 < argc) repeats = atoi(argv[++i]);
    else if (strcmp(argv[i], "--no-compute") == 0) compute = false;
    else {
      fprintf(stderr, "usage: %s [--repeats N] [--no-compute]\n", argv[0]);
      return 2;
    }
  }
  if (repeats < 1) repeats = 1;
  mr_host_cpu_model(cpu, sizeof cpu);
  static const struct { uint32_t H, I; const char *shape; } shapes[] = {
      {2048, 768, "qwen3-30b-a3b"}, {7168, 2048, "deepseek-v3"}};
  static const struct { const char *name; mr_dtype dt; enum check_kind kind; } checks[] = {
      {"hidden_f32", MR_DTYPE_F32, CHECK_HIDDEN}, {"hidden_f16", MR_DTYPE_F16, CHECK_HIDDEN},
      {"hidden_bf16", MR_DTYPE_BF16, CHECK_HIDDEN}, {"output_f32", MR_DTYPE_F32, CHECK_OUTPUT},
      {"output_f16", MR_DTYPE_F16, CHECK_OUTPUT}, {"output_bf16", MR_DTYPE_BF16, CHECK_OUTPUT},
      {"reply_f32", MR_DTYPE_F32, CHECK_REPLY}, {"reply_f16", MR_DTYPE_F16, CHECK_REPLY},
      {"reply_bf16", MR_DTYPE_BF16, CHECK_REPLY}};
  const size_t n_checks = sizeof checks / sizeof checks[0];
  fprintf(stderr, "# %s\n# %-14s %-12s %5s %12s\n", cpu, "shape", "check", "T", "ns/token");
  for (size_t q = 0; q < 2; q++) {
    uint32_t H = shapes[q].H;
    double t1_server = 0, t1_client = 0; /* T = 1, bf16 wire */
    for (size_t c = 0; c < n_checks; c++) {
      static const uint32_t Ts[] = {1, 64};
      for (size_t ti = 0; ti < 2; ti++) {
        uint32_t T = Ts[ti];
        double ns = time_check(checks[c].dt, checks[c].kind, T, H, repeats) / T;
        if (T == 1 && checks[c].dt == MR_DTYPE_BF16) {
          if (checks[c].kind == CHECK_REPLY) t1_client = ns;
          else t1_server += ns;
        }
        fprintf(stderr, "  %-14s %-12s %5u %12.1f\n", shapes[q].shape, checks[c].name, T, ns);
        printf("{\"bench\":\"finite\",\"cpu\":\"%s\",\"shape\":\"%s\",\"H\":%u,\"check\":\"%s\","
               "\"tokens\":%u,\"repeats\":%d,\"ns_per_token\":%.1f}\n",
               cpu, shapes[q].shape, H, checks[c].name, T, repeats, ns);
      }
    }
    for (int d = 0; d < 2; d++)
      for (int op = 0; op < 3; op++) {
        static const uint32_t Ts[] = {1, 16, 256};
        const mr_dtype dt = d ? MR_DTYPE_F16 : MR_DTYPE_BF16;
        for (size_t ti = 0; ti < 3; ti++) {
          uint32_t T = Ts[ti];
          int reps = T == 256 ? (repeats + 9) / 10 : repeats;
          double bulk = time_conv((enum conv_op)op, dt, T, H, false, reps) / T;
          double loop = time_conv((enum conv_op)op, dt, T, H, true, reps) / T;
          fprintf(stderr, "  %-14s %-6s%-9s %5u %12.1f  (loop %.1f, %.1fx, %s)\n", shapes[q].shape,
                  mr_dtype_name(dt), conv_names[op], T, bulk, loop, loop / bulk, mr_convert_impl());
          printf("{\"bench\":\"convert\",\"cpu\":\"%s\",\"shape\":\"%s\",\"H\":%u,"
                 "\"dtype\":\"%s\",\"op\":\"%s\",\"tokens\":%u,\"repeats\":%d,"
                 "\"impl\":\"%s\",\"ns_per_token\":%.1f,\"loop_ns_per_token\":%.1f,"
                 "\"speedup\":%.2f}\n",
                 cpu, shapes[q].shape, H, mr_dtype_name(dt), conv_names[op], T, reps,
                 mr_convert_impl(), bulk, loop, loop / bulk);
        }
      }
    if (!compute) continue;
    double dec = time_decode(H, shapes[q].I);
    if (dec <= 0) return 1;
    double frac = t1_server / dec, frac_c = t1_client / dec;
    fprintf(stderr, "  %-14s decode T=1 top-8 bf16: %.1f us; server checks (bf16 hidden + "
            "output) %.1f ns = %.2e of it; client reply check %.1f ns = %.2e\n",
            shapes[q].shape, dec / 1e3, t1_server, frac, t1_client, frac_c);
    printf("{\"bench\":\"finite_vs_decode\",\"cpu\":\"%s\",\"shape\":\"%s\",\"H\":%u,\"I\":%u,"
           "\"decode_us\":%.1f,\"checks_ns\":%.1f,\"fraction\":%.3g,\"reply_check_ns\":%.1f,"
           "\"reply_fraction\":%.3g}\n",
           cpu, shapes[q].shape, H, shapes[q].I, dec / 1e3, t1_server, frac, t1_client, frac_c);
  }
  return sink == 12345;
}
