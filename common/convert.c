/*
 * convert.c - the wire dtypes (f32, f16, bf16) to and from fp32, in bulk: what a hidden
 * state or an expert output goes through on its way over the wire (the client's request
 * rows, the server's outputs, the client's sum of the replies; docs/DESIGN.md section 6,
 * "What one round trip still does to a hidden row").
 *
 * The per-element rules in mr.h (mr_bf16_to_f32, mr_f32_to_bf16, mr_f16_to_f32,
 * mr_f32_to_f16) are the definition. On x86 with AVX2 and F16C (cpuid, and XCR0 for the
 * OS's YMM state, checked once) eight lanes at a time give the same bits for every input
 * (tests/unit/test_convert.c):
 *   - bf16 -> f32 is a shift; f32 -> bf16 is the same integer rounding lane by lane, with
 *     the same quieting of a NaN;
 *   - f16 <-> f32 is vcvtph2ps / vcvtps2ph (round to nearest even, overflow to inf, exact
 *     subnormals), which equal the rules for every value but NaN: the rules keep a NaN's
 *     payload bits as they are, the instructions quiet it. So a vector of eight that holds
 *     a NaN takes the per-element rules (they are not the fast path: the client and the
 *     server refuse non-finite data around every conversion).
 * MOERPC_CONVERT=scalar in the environment keeps the per-element loops (A/B benchmarks and
 * the test's reference). Measured on a 2-vCPU EPYC (Zen 4), 65,536 values: f32 -> bf16 37
 * -> 3.5 us, bf16 -> f32 16 -> 3 us.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"

#if MR_HAVE_AVX2 && (defined(__x86_64__) || defined(__i386__)) && !defined(MR_FUZZ_NO_ISA)
#define MR__CONV_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define MR__CONV_X86 0
#endif

/* ---- the per-element loops ------------------------------------------------------------- */

static void to_f32_scalar(float *dst, const void *src, mr_dtype dt, size_t n) {
  const uint16_t *s = src;
  if (dt == MR_DTYPE_BF16)
    for (size_t i = 0; i < n; i++) dst[i] = mr_bf16_to_f32(s[i]);
  else
    for (size_t i = 0; i < n; i++) dst[i] = mr_f16_to_f32(s[i]);
}

static void add_f32_scalar(float *dst, const void *src, mr_dtype dt, size_t n) {
  if (dt == MR_DTYPE_F32) {
    const float *s = src;
    for (size_t i = 0; i < n; i++) dst[i] += s[i];
    return;
  }
  const uint16_t *s = src;
  if (dt == MR_DTYPE_BF16)
    for (size_t i = 0; i < n; i++) dst[i] += mr_bf16_to_f32(s[i]);
  else
    for (size_t i = 0; i < n; i++) dst[i] += mr_f16_to_f32(s[i]);
}

static void from_f32_scalar(void *dst, mr_dtype dt, const float *src, size_t n) {
  uint16_t *d = dst;
  if (dt == MR_DTYPE_BF16)
    for (size_t i = 0; i < n; i++) d[i] = mr_f32_to_bf16(src[i]);
  else
    for (size_t i = 0; i < n; i++) d[i] = mr_f32_to_f16(src[i]);
}

/* ---- AVX2 + F16C ------------------------------------------------------------------------ */

#if MR__CONV_X86
#define MR__AVX2 __attribute__((target("avx2,f16c")))

static bool cpu_has_avx2_f16c(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!osxsave || !avx || !f16c) return false;
  uint32_t lo, hi; /* XGETBV(0), as bytes: this file needs no -mxsave */
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  (void)hi;
  if ((lo & 6u) != 6u) return false; /* the OS saves XMM and YMM */
  if (__get_cpuid_max(0, NULL) < 7) return false;
  __cpuid_count(7, 0, a, b, c, d);
  return b & (1u << 5);
}

/* Eight bf16 (as the low halves of 32-bit lanes) of eight f32: mr_f32_to_bf16 per lane. */
MR__AVX2 static inline __m256i bf16_of(__m256i u) {
  const __m256i one = _mm256_set1_epi32(1), r = _mm256_set1_epi32(0x7fff);
  const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  __m256i hi = _mm256_srli_epi32(u, 16);
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(r, _mm256_and_si256(hi, one))), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

MR__AVX2 static void from_f32_avx2(void *dst, mr_dtype dt, const float *src, size_t n) {
  uint16_t *d = dst;
  size_t i = 0;
  if (dt == MR_DTYPE_BF16) {
    for (; i + 16 <= n; i += 16) {
      __m256i a = bf16_of(_mm256_loadu_si256((const __m256i *)(src + i)));
      __m256i b = bf16_of(_mm256_loadu_si256((const __m256i *)(src + i + 8)));
      /* packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7]; 64-bit order 0 2 1 3 */
      __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
      _mm256_storeu_si256((__m256i *)(d + i), p);
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      __m256 x = _mm256_loadu_ps(src + i);
      if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) {
        from_f32_scalar(d + i, dt, src + i, 8); /* a NaN: its payload as the rule keeps it */
        continue;
      }
      _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
  }
  from_f32_scalar(d + i, dt, src + i, n - i);
}

/* Eight f16 at s hold a NaN (every exponent bit, a mantissa bit). */
MR__AVX2 static inline bool f16_nan8(__m128i h) {
  const __m128i m = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
  return _mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, m), inf)) != 0;
}

MR__AVX2 static inline __m256 f32_of(const uint16_t *s, mr_dtype dt, bool *nan) {
  __m128i h = _mm_loadu_si128((const __m128i *)s);
  if (dt == MR_DTYPE_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  *nan = f16_nan8(h);
  return _mm256_cvtph_ps(h);
}

MR__AVX2 static void to_f32_avx2(float *dst, const void *src, mr_dtype dt, size_t n) {
  const uint16_t *s = src;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    bool nan = false;
    __m256 v = f32_of(s + i, dt, &nan);
    if (nan) to_f32_scalar(dst + i, s + i, dt, 8);
    else _mm256_storeu_ps(dst + i, v);
  }
  to_f32_scalar(dst + i, s + i, dt, n - i);
}

MR__AVX2 static void add_f32_avx2(float *dst, const void *src, mr_dtype dt, size_t n) {
  size_t i = 0;
  if (dt == MR_DTYPE_F32) {
    const float *s = src;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(s + i)));
    add_f32_scalar(dst + i, s + i, dt, n - i);
    return;
  }
  const uint16_t *s = src;
  for (; i + 8 <= n; i += 8) {
    bool nan = false;
    __m256 v = f32_of(s + i, dt, &nan);
    if (nan) add_f32_scalar(dst + i, s + i, dt, 8);
    else _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), v));
  }
  add_f32_scalar(dst + i, s + i, dt, n - i);
}
#endif

/* ---- dispatch --------------------------------------------------------------------------- */

typedef struct mr__conv_fns {
  void (*to_f32)(float *dst, const void *src, mr_dtype dt, size_t n);
  void (*add_f32)(float *dst, const void *src, mr_dtype dt, size_t n);
  void (*from_f32)(void *dst, mr_dtype dt, const float *src, size_t n);
  const char *name;
} mr__conv_fns;

static const mr__conv_fns conv_scalar = {to_f32_scalar, add_f32_scalar, from_f32_scalar, "scalar"};
#if MR__CONV_X86
static const mr__conv_fns conv_avx2 = {to_f32_avx2, add_f32_avx2, from_f32_avx2, "avx2"};
#endif

static _Atomic(const mr__conv_fns *) conv_fns;

/* Chosen at the first call; a race only chooses the same twice. */
static const mr__conv_fns *conv(void) {
  const mr__conv_fns *f = atomic_load_explicit(&conv_fns, memory_order_acquire);
  if (f) return f;
  f = &conv_scalar;
#if MR__CONV_X86
  const char *env = getenv("MOERPC_CONVERT");
  if (!(env && strcmp(env, "scalar") == 0) && cpu_has_avx2_f16c()) f = &conv_avx2;
#endif
  atomic_store_explicit(&conv_fns, f, memory_order_release);
  return f;
}

const char *mr_convert_impl(void) { return conv()->name; }

void mr_convert_to_f32(float *dst, const void *src, mr_dtype dt, size_t n) {
  switch (dt) {
    case MR_DTYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case MR_DTYPE_BF16:
    case MR_DTYPE_F16: conv()->to_f32(dst, src, dt, n); break;
    default: MR_ASSERT(!"mr_convert_to_f32: unknown dtype");
  }
}

void mr_convert_add_f32(float *dst, const void *src, mr_dtype dt, size_t n) {
  switch (dt) {
    case MR_DTYPE_F32:
    case MR_DTYPE_BF16:
    case MR_DTYPE_F16: conv()->add_f32(dst, src, dt, n); break;
    default: MR_ASSERT(!"mr_convert_add_f32: unknown dtype");
  }
}

void mr_convert_from_f32(void *dst, mr_dtype dt, const float *src, size_t n) {
  switch (dt) {
    case MR_DTYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case MR_DTYPE_BF16:
    case MR_DTYPE_F16: conv()->from_f32(dst, dt, src, n); break;
    default: MR_ASSERT(!"mr_convert_from_f32: unknown dtype");
  }
}
