/*
 * test_gc_cuda.c - the CUDA backend (libmoerpc-cuda.so, kernels/cuda/) and its loader.
 *
 * Everywhere (CI has no GPU):
 *   - a CUDA build loads the library from build/lib beside the binary (so it links: cuBLAS
 *     and NCCL resolve), its ABI matches, device_count answers 0 without crashing on a host
 *     without a device, and --backend cuda is then refused with "no CUDA device";
 *   - a build without CUDA (HAVE_CUDA=0) says it has no CUDA backend;
 *   - unknown backend names are MR_EINVAL naming the value.
 * On a GPU host only (skipped "no CUDA device" elsewhere): every op of the CUDA backend
 * against the CPU backend (gc_bk_cpu_new, reference ISA) on the same random inputs, for
 * decode (T = 1..2) and prefill (T = 37, 300) shapes, GQA, a sliding window, MLA, grouped
 * noaux_tc routing and hot experts with empty slots. Tolerances (relative L2):
 *   fp32 ops 1e-5 (only the order of fp32 sums differs);
 *   bf16 weights, activations split into two bf16 terms (MOERPC_CUDA_ACT=split, the
 *   default) 3e-5 against the CPU reference holding the same bf16 weights (fp32
 *   activations; hi + lo carry x to 2^-17);
 *   bf16 weights, MOERPC_CUDA_ACT=bf16 1e-2 (the GPU rounds the activations to bf16 for
 *   the tensor cores, about 2^-9 per element);
 *   route: the same ids (a swap is accepted only between weights within 1e-5: a near-tie).
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_client/runner/backend.h"
#include "gpu_client/runner/comm.h"
#include "tests/unit/mt.h"

#define TOL_F32 1e-5
#define TOL_BF16 1e-2
#define TOL_SPLIT 3e-5

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in [-1, 1) */
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((rng >> 40) / (double)(1ull << 24)) * 2.0f - 1.0f;
}
static float *rand_vec(size_t n, float scale) {
  float *v = malloc(n * sizeof *v);
  MT_TRUE(v != NULL);
  for (size_t i = 0; i < n; i++) v[i] = frand() * scale;
  return v;
}
/* v rounded to bf16 (both backends then hold the same weights). */
static uint16_t *bf16_of(const float *v, size_t n) {
  uint16_t *b = malloc(n * sizeof *b);
  MT_TRUE(b != NULL);
  for (size_t i = 0; i < n; i++) b[i] = mr_f32_to_bf16(v[i]);
  return b;
}

/* ---- loading (every host) -------------------------------------------------------------- */

MT_TEST(cuda_library_loads_or_says_why) {
  const gc_cuda_lib *lib = NULL;
  mr_err e = {0};
  int rc = gc_cuda_lib_load(&lib, &e);
#if MR_HAVE_CUDA
  MT_OK(rc, &e);
  MT_EQ_INT(lib->abi, GC_CUDA_ABI);
  MT_TRUE(lib->device_count && lib->device_name && lib->backend_new && lib->comm_nccl_new);
  int n = lib->device_count(&e);
  MT_TRUE(n >= 0);
  if (n == 0) {
    printf("  no CUDA device here: %s\n", e.msg);
    gc_backend *b = NULL;
    MT_EQ_INT(lib->backend_new(&b, 0, NULL, 16, &e), MR_ENOTSUP);
    MT_CONTAINS(e.msg, "no CUDA device");
    MT_TRUE(b == NULL);
    gc_comm *c = NULL;
    int dev0 = 0;
    MT_TRUE(lib->comm_nccl_new(&c, 1, &dev0, &e) < 0);
    MT_TRUE(c == NULL);
  } else {
    for (int d = 0; d < n; d++) {
      char name[256];
      MT_OK(lib->device_name(d, name, sizeof name, &e), &e);
      printf("  %s\n", name);
    }
  }
#else
  if (rc == 0) MT_SKIP("a libmoerpc-cuda.so from an earlier CUDA build is in this build's lib/");
  MT_EQ_INT(rc, MR_ENOTSUP);
  MT_CONTAINS(e.msg, "no CUDA backend");
#endif
}

MT_TEST(open_by_name) {
  kn_engine *eng = NULL;
  kn_engine_opts o = {.isa = KN_ISA_REF, .threads = 1};
  mr_err e = {0};
  MT_OK(kn_engine_new(&eng, &o, &e), &e);
  gc_backend *b = NULL;
  MT_EQ_INT(gc_bk_open(&b, "tpu", 0, eng, 16, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "\"tpu\"");
  MT_OK(gc_bk_open(&b, "cpu", 0, eng, 16, &e), &e);
  MT_EQ_STR(b->ops->name, "cpu");
  b->ops->destroy(b);
  b = NULL;
  int rc = gc_bk_open(&b, "cuda", 0, eng, 16, &e);
  const gc_cuda_lib *lib = NULL;
  mr_err e2 = {0};
  if (gc_cuda_lib_load(&lib, &e2) != 0) {
    MT_EQ_INT(rc, MR_ENOTSUP);
    MT_CONTAINS(e.msg, "no CUDA backend");
  } else if (lib->device_count(&e2) == 0) {
    MT_EQ_INT(rc, MR_ENOTSUP);
    MT_CONTAINS(e.msg, "no CUDA device");
  } else {
    MT_OK(rc, &e);
    MT_EQ_STR(b->ops->name, "cuda");
    MT_TRUE(b->ops->native_stream(b) != NULL);
    b->ops->destroy(b);
  }
  kn_engine_free(eng);
}

/* ---- the device cases ------------------------------------------------------------------ */

static kn_engine *eng;
static gc_backend *cpu, *gpu;
static const gc_cuda_lib *lib;

static void close_pair(void) {
  if (gpu) gpu->ops->destroy(gpu);
  if (cpu) cpu->ops->destroy(cpu);
  kn_engine_free(eng);
  gpu = cpu = NULL;
  eng = NULL;
}

/* Both backends, or a skip without a device; act: MOERPC_CUDA_ACT for the GPU backend
 * (NULL: unset, the default). */
static void open_pair_act(uint32_t max_seq, const char *act) {
  mr_err e = {0};
  if (gc_cuda_lib_load(&lib, &e) != 0) MT_SKIP("no CUDA device (no CUDA backend: %s)", e.msg);
  int n = lib->device_count(&e);
  MT_TRUE(n >= 0);
  if (n == 0) MT_SKIP("no CUDA device");
  kn_engine_opts o = {.isa = KN_ISA_REF, .threads = 2};
  MT_OK(kn_engine_new(&eng, &o, &e), &e);
  MT_OK(gc_bk_cpu_new(&cpu, eng, max_seq, &e), &e);
  if (act) setenv("MOERPC_CUDA_ACT", act, 1);
  int rc = lib->backend_new(&gpu, 0, eng, max_seq, &e);
  unsetenv("MOERPC_CUDA_ACT");
  mt_defer(close_pair);
  MT_OK(rc, &e);
}
static void open_pair(uint32_t max_seq) { open_pair_act(max_seq, NULL); }

/* A device copy of host[0..n) on b. */
static float *up(gc_backend *b, const float *host, size_t n) {
  mr_err e = {0};
  float *d = b->ops->alloc(b, n * sizeof *d);
  MT_TRUE(d != NULL);
  MT_OK(b->ops->upload(b, d, host, n, &e), &e);
  return d;
}
/* host = dev[0..n) of b (to_host + sync). */
static void down(gc_backend *b, const float *dev, size_t n, float *host) {
  mr_err e = {0};
  MT_OK(b->ops->to_host(b, host, MR_DTYPE_F32, dev, n, &e), &e);
  MT_OK(b->ops->sync(b, &e), &e);
}
/* Both backends' dev[0..n) compared under tol (relative L2), named by what. */
static void expect_close(const char *what, const float *dc, const float *dg, size_t n,
                         double tol) {
  float *hc = malloc(n * sizeof *hc), *hg = malloc(n * sizeof *hg);
  MT_TRUE(hc && hg);
  down(cpu, dc, n, hc);
  down(gpu, dg, n, hg);
  double r = kn_rel_l2(hg, hc, n);
  printf("  %-40s rel L2 %.3g (tol %.0e)\n", what, r, tol);
  if (!(r <= tol)) MT__FAIL("%s: rel L2 %g > %g", what, r, tol);
  free(hc);
  free(hg);
}

MT_TEST(memory_ops) {
  open_pair(16);
  mr_err e = {0};
  const size_t n = 1000;
  float *h = rand_vec(n, 3.0f), *h2 = rand_vec(n, 1.0f);
  float *dg = up(gpu, h, n), *dg2 = up(gpu, h2, n);
  /* to_host in each dtype, into pageable and pinned memory */
  uint16_t ref16[1000], got16[1000];
  const mr_dtype dts[2] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  for (int i = 0; i < 2; i++) {
    mr_convert_from_f32(ref16, dts[i], h, n);
    MT_OK(gpu->ops->to_host(gpu, got16, dts[i], dg, n, &e), &e);
    MT_OK(gpu->ops->sync(gpu, &e), &e);
    MT_TRUE(memcmp(ref16, got16, sizeof got16) == 0);
    uint16_t *pin = gpu->ops->host_alloc(gpu, n * 2);
    MT_TRUE(pin != NULL);
    MT_OK(gpu->ops->to_host(gpu, pin, dts[i], dg, n, &e), &e);
    MT_OK(gpu->ops->sync(gpu, &e), &e);
    MT_TRUE(memcmp(ref16, pin, sizeof got16) == 0);
    gpu->ops->host_free(gpu, pin);
  }
  float back[1000];
  down(gpu, dg, n, back);
  MT_TRUE(memcmp(back, h, sizeof back) == 0);
  /* add_host reads the host array before it returns: scribbling on it afterwards is safe */
  float *pin = gpu->ops->host_alloc(gpu, n * sizeof *pin);
  memcpy(pin, h2, n * sizeof *pin);
  MT_OK(gpu->ops->add_host(gpu, dg, pin, n, &e), &e);
  memset(pin, 0x7f, n * sizeof *pin);
  down(gpu, dg, n, back);
  for (size_t i = 0; i < n; i++) MT_NEAR(back[i], h[i] + h2[i], 0);
  gpu->ops->host_free(gpu, pin);
  MT_OK(gpu->ops->add(gpu, dg, dg2, n, &e), &e);
  down(gpu, dg, n, back);
  for (size_t i = 0; i < n; i++) MT_NEAR(back[i], (h[i] + h2[i]) + h2[i], 0);
  /* gather_rows: 10 rows of 100 */
  uint32_t rows[4] = {7, 0, 7, 3};
  float *dst = gpu->ops->alloc(gpu, 400 * sizeof(float));
  MT_OK(gpu->ops->gather_rows(gpu, dst, dg2, 100, rows, 4, &e), &e);
  rows[0] = 1; /* the caller may reuse its array at once */
  down(gpu, dst, 400, back);
  const uint32_t want[4] = {7, 0, 7, 3};
  for (int i = 0; i < 4; i++) MT_TRUE(memcmp(back + i * 100, h2 + want[i] * 100, 400) == 0);
  MT_OK(gpu->ops->zero(gpu, dg, n, &e), &e);
  down(gpu, dg, n, back);
  for (size_t i = 0; i < n; i++) MT_NEAR(back[i], 0, 0);
  gpu->ops->free(gpu, dst);
  gpu->ops->free(gpu, dg);
  gpu->ops->free(gpu, dg2);
  free(h);
  free(h2);
}

static void check_matmul(kn_format fmt, uint32_t T, uint32_t N, uint32_t K, bool bias,
                         double tol) {
  mr_err e = {0};
  float *w = rand_vec((size_t)N * K, 0.1f), *x = rand_vec((size_t)T * K, 1.0f);
  float *bv = rand_vec(N, 0.5f);
  uint16_t *wb = bf16_of(w, (size_t)N * K);
  gc_bk_linear *lc, *lg;
  MT_OK(cpu->ops->linear_new(cpu, &lc, N, K, fmt, 64, &e), &e);
  MT_OK(gpu->ops->linear_new(gpu, &lg, N, K, fmt, 64, &e), &e);
  /* two bands, as q | k | v are loaded */
  const void *src = fmt == KN_FMT_F32 ? (const void *)w : (const void *)wb;
  mr_dtype dt = fmt == KN_FMT_F32 ? MR_DTYPE_F32 : MR_DTYPE_BF16;
  size_t es = mr_dtype_size(dt);
  uint32_t r1 = N / 3;
  MT_OK(cpu->ops->linear_load(cpu, lc, 0, r1, src, dt, &e), &e);
  MT_OK(cpu->ops->linear_load(cpu, lc, r1, N - r1, (const char *)src + (size_t)r1 * K * es, dt, &e), &e);
  MT_OK(gpu->ops->linear_load(gpu, lg, 0, r1, src, dt, &e), &e);
  MT_OK(gpu->ops->linear_load(gpu, lg, r1, N - r1, (const char *)src + (size_t)r1 * K * es, dt, &e), &e);
  MT_EQ_U64(gpu->ops->linear_bytes(lg), (uint64_t)N * K * (fmt == KN_FMT_F32 ? 4 : 2));
  float *xc = up(cpu, x, (size_t)T * K), *xg = up(gpu, x, (size_t)T * K);
  float *bc = up(cpu, bv, N), *bg = up(gpu, bv, N);
  float *yc = cpu->ops->alloc(cpu, (size_t)T * N * 4), *yg = gpu->ops->alloc(gpu, (size_t)T * N * 4);
  MT_OK(cpu->ops->matmul(cpu, lc, T, xc, bias ? bc : NULL, yc, &e), &e);
  MT_OK(gpu->ops->matmul(gpu, lg, T, xg, bias ? bg : NULL, yg, &e), &e);
  char what[96];
  snprintf(what, sizeof what, "matmul %s T=%u %ux%u%s", kn_format_name(fmt), T, N, K,
           bias ? " +bias" : "");
  expect_close(what, yc, yg, (size_t)T * N, tol);
  cpu->ops->linear_free(cpu, lc);
  gpu->ops->linear_free(gpu, lg);
  free(w), free(x), free(bv), free(wb);
}

MT_TEST(matmul_bf16_activations_vs_cpu) {
  open_pair_act(16, "bf16");
  check_matmul(KN_FMT_BF16, 1, 96, 200, false, TOL_BF16);
  check_matmul(KN_FMT_BF16, 37, 96, 200, true, TOL_BF16);
}

MT_TEST(cuda_act_value_checked) {
  mr_err e = {0};
  if (gc_cuda_lib_load(&lib, &e) != 0 || lib->device_count(&e) <= 0) MT_SKIP("no CUDA device");
  gc_backend *b = NULL;
  setenv("MOERPC_CUDA_ACT", "fp8", 1);
  int rc = lib->backend_new(&b, 0, NULL, 16, &e);
  unsetenv("MOERPC_CUDA_ACT");
  MT_EQ_INT(rc, MR_EINVAL);
  MT_CONTAINS(e.msg, "MOERPC_CUDA_ACT");
  MT_TRUE(b == NULL);
}

MT_TEST(matmul_vs_cpu) {
  open_pair(16);
  check_matmul(KN_FMT_BF16, 1, 96, 200, false, TOL_SPLIT);
  check_matmul(KN_FMT_BF16, 37, 96, 200, true, TOL_SPLIT);
  check_matmul(KN_FMT_BF16, 300, 160, 512, true, TOL_SPLIT);
  check_matmul(KN_FMT_F32, 1, 70, 130, true, TOL_F32);
  check_matmul(KN_FMT_F32, 37, 70, 130, false, TOL_F32);
  mr_err e = {0};
  gc_bk_linear *l = NULL;
  MT_EQ_INT(gpu->ops->linear_new(gpu, &l, 8, 8, KN_FMT_INT8, 64, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "int8");
}

MT_TEST(embed_norm_rope_silu_vs_cpu) {
  open_pair(16);
  mr_err e = {0};
  const uint32_t V = 50, D = 96, T = 37;
  /* embedding: bf16 and f32 tables, exact */
  float *tab = rand_vec((size_t)V * D, 1.0f);
  uint16_t *tabb = bf16_of(tab, (size_t)V * D);
  int32_t ids[37];
  for (uint32_t t = 0; t < T; t++) ids[t] = (int32_t)((t * 7 + 3) % V);
  for (int bf = 0; bf < 2; bf++) {
    gc_bk_table *tc, *tg;
    const void *src = bf ? (const void *)tabb : (const void *)tab;
    mr_dtype dt = bf ? MR_DTYPE_BF16 : MR_DTYPE_F32;
    MT_OK(cpu->ops->table_new(cpu, &tc, V, D, src, dt, &e), &e);
    MT_OK(gpu->ops->table_new(gpu, &tg, V, D, src, dt, &e), &e);
    float *oc = cpu->ops->alloc(cpu, (size_t)T * D * 4), *og = gpu->ops->alloc(gpu, (size_t)T * D * 4);
    MT_OK(cpu->ops->embed(cpu, tc, T, ids, oc, &e), &e);
    MT_OK(gpu->ops->embed(gpu, tg, T, ids, og, &e), &e);
    expect_close(bf ? "embed bf16" : "embed f32", oc, og, (size_t)T * D, 0);
    cpu->ops->table_free(cpu, tc);
    gpu->ops->table_free(gpu, tg);
  }
  /* rmsnorm: strided rows, out of place and in place */
  const size_t ld = 128;
  float *x = rand_vec(T * ld, 2.0f), *w = rand_vec(D, 1.0f);
  float *xc = up(cpu, x, T * ld), *xg = up(gpu, x, T * ld);
  float *wc = up(cpu, w, D), *wg = up(gpu, w, D);
  float *yc = cpu->ops->alloc(cpu, T * D * 4), *yg = gpu->ops->alloc(gpu, T * D * 4);
  MT_OK(cpu->ops->rmsnorm(cpu, T, D, xc, ld, wc, 1e-6f, yc, D, &e), &e);
  MT_OK(gpu->ops->rmsnorm(gpu, T, D, xg, ld, wg, 1e-6f, yg, D, &e), &e);
  expect_close("rmsnorm strided", yc, yg, T * D, TOL_F32);
  MT_OK(cpu->ops->rmsnorm(cpu, T, D, xc, ld, wc, 1e-6f, xc, ld, &e), &e);
  MT_OK(gpu->ops->rmsnorm(gpu, T, D, xg, ld, wg, 1e-6f, xg, ld, &e), &e);
  expect_close("rmsnorm in place", xc, xg, T * ld, TOL_F32);
  /* rope: rotate-half on whole heads, interleaved on a part with a yarn-like scale */
  uint32_t pos[37];
  for (uint32_t t = 0; t < T; t++) pos[t] = t * 13 % 200;
  float inv[32];
  for (int i = 0; i < 32; i++) inv[i] = powf(10000.0f, -(float)i / 32.0f);
  float *ic = up(cpu, inv, 32), *ig = up(gpu, inv, 32);
  for (int il = 0; il < 2; il++) {
    float *hc = up(cpu, x, T * ld), *hg = up(gpu, x, T * ld);
    gc_bk_rope r = {.n_tokens = T, .n_heads = il ? 4 : 2, .head_stride = il ? 24 : 64,
                    .offset = il ? 8 : 0, .dim = il ? 16 : 64, .interleave = il == 1,
                    .scale = il ? 1.2f : 1.0f, .ld = ld, .pos = pos};
    r.x = hc, r.inv_freq = ic;
    MT_OK(cpu->ops->rope(cpu, &r, &e), &e);
    r.x = hg, r.inv_freq = ig;
    MT_OK(gpu->ops->rope(gpu, &r, &e), &e);
    expect_close(il ? "rope interleave offset scale" : "rope rotate-half", hc, hg, T * ld, TOL_F32);
  }
  /* silu_mul */
  const uint32_t n = 40;
  float *gu = rand_vec((size_t)T * 2 * n, 4.0f);
  float *gc = up(cpu, gu, (size_t)T * 2 * n), *gg = up(gpu, gu, (size_t)T * 2 * n);
  MT_OK(cpu->ops->silu_mul(cpu, T, n, gc, yc, &e), &e);
  MT_OK(gpu->ops->silu_mul(gpu, T, n, gg, yg, &e), &e);
  expect_close("silu_mul", yc, yg, (size_t)T * n, TOL_F32);
  free(tab), free(tabb), free(x), free(w), free(gu);
}

/* One attention call on both backends (same inputs), outputs and caches compared. */
static void attn_call(const char *what, uint32_t T, const uint32_t *seq, const uint32_t *pos,
                      uint32_t nh, uint32_t nkv, uint32_t hd, uint32_t max_seq, uint32_t window,
                      float *kc[2], float *vc[2], size_t cache_n) {
  mr_err e = {0};
  const size_t ld = (size_t)(nh + 2 * nkv) * hd;
  float *qkv = rand_vec(T * ld, 1.0f);
  gc_backend *bk[2] = {cpu, gpu};
  float *out[2], *dq[2];
  for (int i = 0; i < 2; i++) {
    dq[i] = up(bk[i], qkv, T * ld);
    out[i] = bk[i]->ops->alloc(bk[i], (size_t)T * nh * hd * 4);
    gc_bk_attn a = {.n_tokens = T, .seq = seq, .pos = pos, .n_heads = nh, .n_kv_heads = nkv,
                    .head_dim = hd, .max_seq = max_seq, .window = window,
                    .scale = 1.0f / sqrtf((float)hd), .q = dq[i], .k = dq[i] + (size_t)nh * hd,
                    .v = dq[i] + (size_t)(nh + nkv) * hd, .ld = ld, .k_cache = kc[i],
                    .v_cache = vc[i], .out = out[i]};
    MT_OK(bk[i]->ops->attention(bk[i], &a, &e), &e);
  }
  expect_close(what, out[0], out[1], (size_t)T * nh * hd, TOL_F32);
  expect_close("  k cache", kc[0], kc[1], cache_n, 0);
  for (int i = 0; i < 2; i++) bk[i]->ops->free(bk[i], out[i]), bk[i]->ops->free(bk[i], dq[i]);
  free(qkv);
}

static void check_attention(uint32_t nh, uint32_t nkv, uint32_t hd, uint32_t window) {
  const uint32_t max_seq = 400, slots = 2;
  const size_t cache_n = (size_t)slots * max_seq * nkv * hd;
  float *zero = calloc(cache_n, sizeof *zero);
  gc_backend *bk[2] = {cpu, gpu};
  float *kc[2], *vc[2];
  for (int i = 0; i < 2; i++) kc[i] = up(bk[i], zero, cache_n), vc[i] = up(bk[i], zero, cache_n);
  char what[96];
  /* prefill of two sequences interleaved in one call: slot 0 gets 20, slot 1 17 tokens */
  uint32_t seq[300], pos[300];
  uint32_t n0 = 0, n1 = 0;
  for (uint32_t t = 0; t < 37; t++) {
    bool s1 = (t % 3 == 2 && n1 < 17) || n0 >= 20;
    seq[t] = s1 ? 1 : 0;
    pos[t] = s1 ? n1++ : n0++;
  }
  snprintf(what, sizeof what, "attention prefill T=37 %u/%u x %u w%u", nh, nkv, hd, window);
  attn_call(what, 37, seq, pos, nh, nkv, hd, max_seq, window, kc, vc, cache_n);
  /* a long prefill of slot 0 (many query tiles, keys past one decode chunk) */
  for (uint32_t t = 0; t < 300; t++) seq[t] = 0, pos[t] = n0 + t;
  n0 += 300;
  snprintf(what, sizeof what, "attention prefill T=300 %u/%u x %u w%u", nh, nkv, hd, window);
  attn_call(what, 300, seq, pos, nh, nkv, hd, max_seq, window, kc, vc, cache_n);
  /* decode: one token, then one of each slot (split-K over 2 chunks for slot 0) */
  seq[0] = 1, pos[0] = n1++;
  snprintf(what, sizeof what, "attention decode T=1 %u/%u x %u w%u", nh, nkv, hd, window);
  attn_call(what, 1, seq, pos, nh, nkv, hd, max_seq, window, kc, vc, cache_n);
  seq[0] = 0, pos[0] = n0++, seq[1] = 1, pos[1] = n1++;
  snprintf(what, sizeof what, "attention decode T=2 %u/%u x %u w%u", nh, nkv, hd, window);
  attn_call(what, 2, seq, pos, nh, nkv, hd, max_seq, window, kc, vc, cache_n);
  for (int i = 0; i < 2; i++) bk[i]->ops->free(bk[i], kc[i]), bk[i]->ops->free(bk[i], vc[i]);
  free(zero);
}

MT_TEST(attention_vs_cpu) {
  open_pair(400);
  check_attention(8, 2, 64, 0);   /* GQA 4:1 */
  check_attention(4, 4, 128, 0);  /* MHA, head_dim 128 */
  check_attention(8, 2, 64, 7);   /* sliding window */
  check_attention(2, 1, 320, 0);  /* head_dim past the prefill kernel's limit (split-K) */
}

MT_TEST(mla_vs_cpu) {
  open_pair(64);
  mr_err e = {0};
  const uint32_t nh = 4, nope = 16, rope = 8, vd = 16, R = 64, max_seq = 64, lw = R + rope;
  const uint32_t qh = nope + rope;
  const size_t cache_n = (size_t)2 * max_seq * lw;
  float *w = rand_vec((size_t)nh * (nope + vd) * R, 0.2f);
  float *zero = calloc(cache_n, sizeof *zero);
  gc_backend *bk[2] = {cpu, gpu};
  float *dw[2], *cache[2];
  for (int i = 0; i < 2; i++) dw[i] = up(bk[i], w, (size_t)nh * (nope + vd) * R), cache[i] = up(bk[i], zero, cache_n);
  uint32_t seq[37], pos[37], n0 = 0, n1 = 0;
  for (uint32_t t = 0; t < 37; t++) {
    seq[t] = t % 2;
    pos[t] = t % 2 ? n1++ : n0++;
  }
  for (int call = 0; call < 2; call++) {
    const uint32_t T = call ? 1 : 37;
    if (call) seq[0] = 0, pos[0] = n0++;
    float *q = rand_vec((size_t)T * nh * qh, 1.0f), *kv = rand_vec((size_t)T * (lw + 5), 1.0f);
    float *out[2];
    for (int i = 0; i < 2; i++) {
      float *dq = up(bk[i], q, (size_t)T * nh * qh), *dkv = up(bk[i], kv, (size_t)T * (lw + 5));
      out[i] = bk[i]->ops->alloc(bk[i], (size_t)T * nh * vd * 4);
      gc_bk_mla a = {.n_tokens = T, .seq = seq, .pos = pos, .n_heads = nh, .nope = nope,
                     .rope = rope, .v_dim = vd, .kv_lora = R, .max_seq = max_seq,
                     .scale = 1.0f / sqrtf((float)qh), .q = dq, .ldq = (size_t)nh * qh,
                     .kv = dkv, .ldkv = lw + 5, .w_kv_b = dw[i], .cache = cache[i],
                     .out = out[i]};
      MT_OK(bk[i]->ops->mla_attention(bk[i], &a, &e), &e);
    }
    expect_close(call ? "mla decode T=1" : "mla prefill T=37", out[0], out[1],
                 (size_t)T * nh * vd, TOL_F32);
    free(q), free(kv);
  }
  expect_close("mla latent cache", cache[0], cache[1], cache_n, 0);
  free(w), free(zero);
}

/* Route on both backends; ids must match except for swaps between weights within 1e-5. */
static void check_route(const char *what, uint32_t T, uint32_t E, uint32_t k, mr_score_func sf,
                        mr_topk_method m, bool norm, uint32_t G, uint32_t TG, float scale) {
  mr_err e = {0};
  float *lg = rand_vec((size_t)T * E, 3.0f), *bias = rand_vec(E, 0.3f);
  int32_t *ids[2];
  float *wt[2];
  gc_backend *bk[2] = {cpu, gpu};
  for (int i = 0; i < 2; i++) {
    float *dl = up(bk[i], lg, (size_t)T * E), *db = up(bk[i], bias, E);
    ids[i] = bk[i]->ops->host_alloc(bk[i], (size_t)T * k * 4);
    wt[i] = malloc((size_t)T * k * 4); /* pageable: the staged path */
    gc_bk_route r = {.n_tokens = T, .num_experts = E, .top_k = k, .norm_topk = norm,
                     .scoring = sf, .method = m, .bias = m == MR_TOPK_NOAUX_TC ? db : NULL,
                     .n_group = G, .topk_group = TG, .scale = scale, .logits = dl,
                     .ids = ids[i], .weights = wt[i]};
    MT_OK(bk[i]->ops->route(bk[i], &r, &e), &e);
    MT_OK(bk[i]->ops->sync(bk[i], &e), &e);
  }
  uint32_t swaps = 0;
  for (size_t j = 0; j < (size_t)T * k; j++) {
    if (ids[0][j] != ids[1][j]) {
      swaps++;
      if (fabsf(wt[0][j] - wt[1][j]) > 1e-5f)
        MT__FAIL("%s: slot %zu: cpu expert %d (w %g), cuda expert %d (w %g)", what, j,
                 ids[0][j], wt[0][j], ids[1][j], wt[1][j]);
    }
    MT_NEAR(wt[1][j], wt[0][j], 1e-5);
  }
  printf("  %-40s ids equal (%u near-tie swaps)\n", what, swaps);
  for (int i = 0; i < 2; i++) bk[i]->ops->host_free(bk[i], ids[i]), free(wt[i]);
  free(lg), free(bias);
}

MT_TEST(route_vs_cpu) {
  open_pair(16);
  check_route("route softmax norm T=1", 1, 64, 8, MR_SCORE_SOFTMAX, MR_TOPK_GREEDY, true, 1, 1, 1.0f);
  check_route("route softmax T=37", 37, 128, 8, MR_SCORE_SOFTMAX, MR_TOPK_GREEDY, false, 1, 1, 1.0f);
  check_route("route sigmoid norm scale T=37", 37, 60, 4, MR_SCORE_SIGMOID, MR_TOPK_GREEDY, true, 1, 1, 2.0f);
  check_route("route noaux_tc groups T=37", 37, 64, 6, MR_SCORE_SIGMOID, MR_TOPK_NOAUX_TC, true, 8, 3, 2.5f);
  check_route("route noaux_tc ungrouped T=1", 1, 256, 8, MR_SCORE_SIGMOID, MR_TOPK_NOAUX_TC, true, 1, 1, 2.5f);
  check_route("route noaux_tc 256/8/4 T=37", 37, 256, 8, MR_SCORE_SIGMOID, MR_TOPK_NOAUX_TC, true, 8, 4, 2.5f);
}

static void check_experts(double tol) {
  mr_err e = {0};
  const uint32_t E = 8, H = 64, I = 48, k = 4;
  kn_layer_desc d = {.hidden = H, .inter = I, .num_experts = E, .format = KN_FMT_BF16, .group = 64};
  gc_bk_experts *xc, *xg;
  MT_OK(cpu->ops->experts_new(cpu, &xc, &d, &e), &e);
  MT_OK(gpu->ops->experts_new(gpu, &xg, &d, &e), &e);
  const uint32_t hot[5] = {0, 2, 3, 5, 7};
  for (int i = 0; i < 5; i++) {
    float *g = rand_vec((size_t)I * H, 0.2f), *u = rand_vec((size_t)I * H, 0.2f);
    float *dn = rand_vec((size_t)H * I, 0.2f);
    uint16_t *gb = bf16_of(g, (size_t)I * H), *ub = bf16_of(u, (size_t)I * H), *db = bf16_of(dn, (size_t)H * I);
    MT_OK(cpu->ops->experts_load(cpu, xc, hot[i], gb, ub, db, MR_DTYPE_BF16, &e), &e);
    MT_OK(gpu->ops->experts_load(gpu, xg, hot[i], gb, ub, db, MR_DTYPE_BF16, &e), &e);
    free(g), free(u), free(dn), free(gb), free(ub), free(db);
  }
  /* expert 1 from F8_E4M3 checkpoint tensors with 128x128 block scales */
  {
    const uint32_t N[3] = {I, I, H}, K[3] = {H, H, I};
    uint8_t *q[3];
    float *sc[3];
    mr_st_tensor ts[3], ss[3];
    const mr_st_tensor *t3[3], *s3[3];
    for (int p = 0; p < 3; p++) {
      float *wv = rand_vec((size_t)N[p] * K[p], 0.2f);
      q[p] = malloc((size_t)N[p] * K[p]);
      size_t ns = (size_t)((N[p] + 127) / 128) * ((K[p] + 127) / 128);
      sc[p] = malloc(ns * sizeof(float));
      MT_OK(kn_fp8_quantize_b128(wv, MR_DTYPE_F32, N[p], K[p], q[p], sc[p], &e), &e);
      ts[p] = (mr_st_tensor){.name = "w", .dtype = MR_DTYPE_UNSPECIFIED, .dtype_name = "F8_E4M3",
                             .ndim = 2, .shape = {N[p], K[p]}, .nbytes = (uint64_t)N[p] * K[p],
                             .data = q[p]};
      ss[p] = (mr_st_tensor){.name = "w_scale_inv", .dtype = MR_DTYPE_F32, .dtype_name = "F32",
                             .ndim = 2, .shape = {(N[p] + 127) / 128, (K[p] + 127) / 128},
                             .nbytes = ns * 4, .data = sc[p]};
      t3[p] = &ts[p], s3[p] = &ss[p];
      free(wv);
    }
    MT_OK(cpu->ops->experts_load_st(cpu, xc, 1, t3, s3, &e), &e);
    MT_OK(gpu->ops->experts_load_st(gpu, xg, 1, t3, s3, &e), &e);
    for (int p = 0; p < 3; p++) free(q[p]), free(sc[p]);
  }
  MT_EQ_U64(gpu->ops->experts_expert_bytes(xg), (uint64_t)3 * H * I * 2);
  const uint32_t loaded[6] = {0, 1, 2, 3, 5, 7};
  for (int call = 0; call < 2; call++) {
    const uint32_t T = call ? 37 : 1;
    int32_t *ids = malloc((size_t)T * k * sizeof *ids);
    float *w = malloc((size_t)T * k * sizeof *w);
    for (uint32_t t = 0; t < T; t++)
      for (uint32_t j = 0; j < k; j++) {
        uint64_t rv = (uint64_t)(frand() * 1e6f + 2e6f);
        /* every 5th token has no hot slot at all */
        ids[t * k + j] = (t % 5 == 4 || rv % 3 == 0) ? -1 : (int32_t)loaded[(rv + j) % 6];
        w[t * k + j] = frand() * 0.5f + 0.5f;
      }
    for (uint32_t j = 1; j < k; j++) /* no expert twice in a token */
      for (uint32_t t = 0; t < T; t++)
        for (uint32_t i = 0; i < j; i++)
          if (ids[t * k + j] == ids[t * k + i]) ids[t * k + j] = -1;
    float *x = rand_vec((size_t)T * H, 1.0f);
    float *in[2], *out[2];
    gc_backend *bk[2] = {cpu, gpu};
    gc_bk_experts *xs[2] = {xc, xg};
    for (int i = 0; i < 2; i++) {
      in[i] = up(bk[i], x, (size_t)T * H);
      out[i] = up(bk[i], x, (size_t)T * H); /* overwritten */
      MT_OK(bk[i]->ops->experts(bk[i], xs[i], T, k, ids, w, in[i], out[i], &e), &e);
    }
    expect_close(call ? "experts T=37 (-1 slots, fp8 expert)" : "experts T=1", out[0], out[1],
                 (size_t)T * H, tol);
    free(ids), free(w), free(x);
  }
  int32_t bad[4] = {4, -1, -1, -1};
  float bw[4] = {1, 1, 1, 1};
  float *dummy = gpu->ops->alloc(gpu, H * 4);
  MT_EQ_INT(gpu->ops->experts(gpu, xg, 1, 4, bad, bw, dummy, dummy, &e), MR_EPRECOND);
  cpu->ops->experts_free(cpu, xc);
  gpu->ops->experts_free(gpu, xg);
}

MT_TEST(experts_vs_cpu) {
  open_pair(16);
  check_experts(TOL_SPLIT);
}

MT_TEST(experts_bf16_activations_vs_cpu) {
  open_pair_act(16, "bf16");
  check_experts(TOL_BF16);
}

MT_TEST(nccl_all_reduce_one_rank) {
  open_pair(16);
  mr_err e = {0};
  gc_comm *c = NULL;
  int dev0 = 0;
  MT_OK(lib->comm_nccl_new(&c, 1, &dev0, &e), &e);
  MT_EQ_STR(c->ops->name, "nccl");
  float h[100], back[100];
  for (int i = 0; i < 100; i++) h[i] = (float)i - 7.5f;
  float *d = up(gpu, h, 100);
  MT_OK(c->ops->all_reduce_sum(c, 0, gpu, d, 100, &e), &e);
  down(gpu, d, 100, back);
  MT_TRUE(memcmp(h, back, sizeof h) == 0);
  c->ops->abort(c);
  MT_EQ_INT(c->ops->all_reduce_sum(c, 0, gpu, d, 100, &e), MR_ECANCELED);
  c->ops->destroy(c);
  gpu->ops->free(gpu, d);
}

MT_MAIN()
