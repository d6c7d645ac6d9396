/*
 * test_convert.c - the bulk wire-dtype conversions (common/convert.c) give the bits of the
 * per-element rules of mr.h for every input, on the path this CPU takes (AVX2 + F16C where
 * it has them, which the first case checks is the one chosen):
 *   - f16 / bf16 -> f32 and the sum into f32: every one of the 65,536 bit patterns, at
 *     every offset of an 8-lane vector and with tails of every length;
 *   - f32 -> f16 / bf16: signed zeros, infinities, NaNs (quiet and signalling, with
 *     payloads: the rules keep them, the instructions would quiet them), f32 and f16
 *     subnormals, the f16 overflow edge (65504, 65519.99, 65520), bf16 rounding ties, and
 *     random values of every magnitude.
 */
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"
#include "tests/unit/mt.h"

#define N16 65536

static uint32_t rng_state = 12345;
static uint32_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 17;
  rng_state ^= rng_state << 5;
  return rng_state;
}

static float f_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

MT_TEST(the_vector_path_is_chosen_where_the_cpu_has_it) {
  const char *impl = mr_convert_impl();
  fprintf(stderr, "  bulk conversions: %s\n", impl);
#if MR_HAVE_AVX2 && (defined(__x86_64__) || defined(__i386__))
  const char *env = getenv("MOERPC_CONVERT");
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && !(env && strcmp(env, "scalar") == 0))
    MT_EQ_STR(impl, "avx2");
  else
    MT_EQ_STR(impl, "scalar");
#else
  MT_EQ_STR(impl, "scalar");
#endif
}

/* Every 16-bit pattern of dt, converted from offset off in runs of len, against the rule. */
static int check_to_f32(mr_dtype dt, size_t off, size_t len) {
  static uint16_t src[N16 + 16];
  static float got[N16 + 16], sum[N16 + 16];
  for (uint32_t i = 0; i < N16; i++) src[off + i] = (uint16_t)i;
  for (size_t i = 0; i < N16; i += len) {
    size_t n = i + len <= N16 ? len : N16 - i;
    mr_convert_to_f32(got + off + i, src + off + i, dt, n);
    for (size_t j = 0; j < n; j++) sum[off + i + j] = 0.5f;
    mr_convert_add_f32(sum + off + i, src + off + i, dt, n);
  }
  for (uint32_t i = 0; i < N16; i++) {
    float want = dt == MR_DTYPE_BF16 ? mr_bf16_to_f32((uint16_t)i) : mr_f16_to_f32((uint16_t)i);
    float want_sum = 0.5f + want;
    if (memcmp(&got[off + i], &want, 4) != 0) {
      MT__FAIL("%s 0x%04x (offset %zu, runs of %zu): to_f32 gives %a, the rule %a",
               mr_dtype_name(dt), i, off, len, (double)got[off + i], (double)want);
      return 1;
    }
    if (memcmp(&sum[off + i], &want_sum, 4) != 0) {
      MT__FAIL("%s 0x%04x (offset %zu, runs of %zu): add_f32 gives %a, the rule %a",
               mr_dtype_name(dt), i, off, len, (double)sum[off + i], (double)want_sum);
      return 1;
    }
  }
  return 0;
}

MT_TEST(to_f32_and_add_give_the_rules_bits_for_every_pattern) {
  const mr_dtype dts[2] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  const size_t lens[] = {N16, 1, 7, 8, 9, 15, 16, 17, 33, 1000};
  for (int d = 0; d < 2; d++)
    for (size_t off = 0; off < 8; off += 3)
      for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++)
        if (check_to_f32(dts[d], off, lens[l])) return;
  /* f32 adds as f32: the same sums as the scalar loop, signed zero and NaN included. */
  float a[37], b[37], want[37];
  for (int i = 0; i < 37; i++) {
    a[i] = f_of(rnd());
    b[i] = i % 5 == 0 ? -a[i] : f_of(rnd());
    want[i] = a[i] + b[i];
  }
  mr_convert_add_f32(a, b, MR_DTYPE_F32, 37);
  MT_TRUE(memcmp(a, want, sizeof a) == 0);
}

/* The f32 values that the rounding rules treat specially. */
static size_t edge_values(float *v) {
  static const uint32_t bits[] = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, /* zeros, infinities */
      0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7fbfffffu, 0xff812345u, 0x7fc0abcdu, /* NaNs */
      0x00000001u, 0x807fffffu, 0x00400000u,             /* f32 subnormals */
      0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477fffffu, 0x47800000u, /* 65504 .. 65536 */
      0x33800000u, 0x33000000u, 0x33000001u, 0x387fc000u, 0x38800000u, /* f16 subnormals */
      0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, /* bf16 ties, even and odd */
      0x7f7fffffu, 0xff7f8000u, 0x7f7f7fffu,             /* bf16 overflow edge */
  };
  for (size_t i = 0; i < sizeof bits / sizeof bits[0]; i++) v[i] = f_of(bits[i]);
  return sizeof bits / sizeof bits[0];
}

MT_TEST(from_f32_gives_the_rules_bits_for_edges_and_random_values) {
  enum { N = 4096 };
  static float src[N + 8];
  static uint16_t got[N + 8];
  const mr_dtype dts[2] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  for (int round = 0; round < 64; round++) {
    size_t n = 0;
    if (round % 4 == 0) n = edge_values(src); /* edges alone, then among random ones */
    for (; n < N; n++) {
      uint32_t u = rnd();
      switch (round % 4) {
        case 1: src[n] = f_of(u); break;                                     /* any bits */
        case 2: src[n] = f_of((u & 0x807fffffu) | ((100u + u % 60u) << 23)); break; /* f16's range */
        default: src[n] = (float)((int32_t)u) * 1e-6f; break;
      }
      if (round % 4 == 3 && u % 97 == 0 && n + 40 < N) n += edge_values(src + n + 1); /* edges inside vectors */
      if (n >= N) break;
    }
    for (int d = 0; d < 2; d++)
      for (size_t off = 0; off < 3; off++) {
        const size_t len = N - off - (size_t)(round % 11);
        mr_convert_from_f32(got + off, dts[d], src + off, len);
        for (size_t i = 0; i < len; i++) {
          float f = src[off + i];
          uint16_t want = dts[d] == MR_DTYPE_BF16 ? mr_f32_to_bf16(f) : mr_f32_to_f16(f);
          if (got[off + i] != want) {
            uint32_t u;
            memcpy(&u, &f, 4);
            MT__FAIL("%s of f32 0x%08x (round %d, index %zu): 0x%04x, the rule 0x%04x",
                     mr_dtype_name(dts[d]), u, round, i, got[off + i], want);
            return;
          }
        }
      }
  }
}

MT_MAIN()
