/* test_mr_core.c - errors, logging levels, the rate limiter, arena, fault injection, dtype
 * conversion. */
#include <pthread.h>
#include <string.h>

#include "common/mr.h"
#include "tests/unit/mt.h"

MT_TEST(errors_have_names_and_messages) {
  MT_EQ_STR(mr_err_name(MR_EINVAL), "MR_EINVAL");
  MT_EQ_STR(mr_err_name(MR_EINTERNAL), "MR_EINTERNAL");
  MT_EQ_STR(mr_err_name(-999), "MR_E?");
  MT_EQ_STR(mr_strerror(MR_ETIMEDOUT), "deadline exceeded");
  MT_EQ_STR(mr_strerror(0), "ok");
  mr_err e;
  mr_err_clear(&e);
  MT_EQ_INT(mr_err_set(&e, MR_ERANGE, "field %s = %d, limit %d", "n_tokens", 9, 8), MR_ERANGE);
  MT_EQ_INT(e.code, MR_ERANGE);
  MT_EQ_STR(e.msg, "field n_tokens = 9, limit 8");
  MT_EQ_INT(mr_err_prefix(&e, MR_EINVAL, "server s1"), MR_ERANGE);
  MT_EQ_STR(e.msg, "server s1: field n_tokens = 9, limit 8");
  MT_EQ_INT(mr_err_set(NULL, MR_EIO, "dropped"), MR_EIO);
}

MT_TEST(log_levels_parse) {
  int l = -1;
  MT_OK(mr_log_parse_level("debug", &l), (mr_err *)NULL);
  MT_EQ_INT(l, MR_LOG_DEBUG);
  MT_OK(mr_log_parse_level("WARN", &l), (mr_err *)NULL);
  MT_EQ_INT(l, MR_LOG_WARN);
  MT_EQ_INT(mr_log_parse_level("loud", &l), MR_EINVAL);
}

MT_TEST(arena_alignment_growth_and_reset) {
  mr_arena a;
  mr_arena_init(&a, 256);
  char *p1 = mr_arena_alloc(&a, 10, 8);
  MT_TRUE(p1 != NULL);
  MT_EQ_INT((uintptr_t)p1 % 8, 0);
  char *p2 = mr_arena_alloc(&a, 100, 64);
  MT_EQ_INT((uintptr_t)p2 % 64, 0);
  MT_TRUE(p2 >= p1 + 10);
  char *big = mr_arena_alloc(&a, 10000, 4096); /* forces a new, larger block */
  MT_TRUE(big != NULL);
  MT_EQ_INT((uintptr_t)big % 4096, 0);
  memset(big, 0xab, 10000);
  MT_TRUE(a.used_peak >= 10110);
  mr_arena_reset(&a);
  MT_EQ_INT(a.used, 0);
  char *p3 = mr_arena_alloc(&a, 5000, 64); /* fits the kept block */
  MT_TRUE(p3 != NULL);
  mr_arena_close(&a);
}

MT_TEST(alloc_fault_injection) {
  mr_alloc_fail_after(3);
  void *a = mr_malloc(8), *b = mr_malloc(8), *c = mr_malloc(8), *d = mr_malloc(8);
  MT_TRUE(a && b);
  MT_TRUE(c == NULL && d == NULL);
  mr_alloc_fail_after(0);
  void *e2 = mr_malloc(8);
  MT_TRUE(e2 != NULL);
  mr_free(a); mr_free(b); mr_free(e2);
  mr_arena ar;
  mr_arena_init(&ar, 64);
  mr_alloc_fail_after(1);
  MT_TRUE(mr_arena_alloc(&ar, 8, 8) == NULL);
  mr_alloc_fail_after(0);
  mr_arena_close(&ar);
}

MT_TEST(bf16_round_trip_and_rounding) {
  /* Every bf16 value survives bf16 -> f32 -> bf16 (NaNs stay NaN). */
  for (uint32_t h = 0; h < 65536; h++) {
    float f = mr_bf16_to_f32((uint16_t)h);
    uint16_t back = mr_f32_to_bf16(f);
    if (f != f) { MT_TRUE(mr_bf16_to_f32(back) != mr_bf16_to_f32(back)); continue; }
    MT_EQ_INT(back, h);
  }
  /* Ties round to even. */
  MT_EQ_INT(mr_f32_to_bf16(1.0f + 1.0f / 256.0f), 0x3f80); /* exactly half: stays even */
  MT_EQ_INT(mr_f32_to_bf16(1.0f + 3.0f / 256.0f), 0x3f82); /* half above odd: rounds up */
}

MT_TEST(f16_exhaustive_round_trip) {
  for (uint32_t h = 0; h < 65536; h++) {
    float f = mr_f16_to_f32((uint16_t)h);
    uint16_t back = mr_f32_to_f16(f);
    if (f != f) { MT_TRUE((back & 0x7c00) == 0x7c00 && (back & 0x3ff)); continue; }
    MT_EQ_INT(back, h);
  }
  MT_NEAR(mr_f16_to_f32(0x3c00), 1.0, 0);
  MT_NEAR(mr_f16_to_f32(0x0001), 5.960464477539063e-08, 0); /* smallest subnormal */
  MT_EQ_INT(mr_f32_to_f16(65520.0f), 0x7c00);               /* rounds to inf */
  MT_EQ_INT(mr_f32_to_f16(65504.0f), 0x7bff);
  MT_EQ_INT(mr_f32_to_f16(1.0f + 1.0f / 2048.0f), 0x3c00);  /* tie to even */
  MT_EQ_INT(mr_f32_to_f16(2.9802322387695312e-08f), 0x0000); /* half of min subnormal */
  MT_EQ_INT(mr_f32_to_f16(2.99e-08f), 0x0001);
}

MT_TEST(bulk_conversion) {
  float src[5] = {0.5f, -2.0f, 3.140625f, 0.0f, 1e-3f}, back[5];
  uint16_t tmp[5];
  mr_dtype dts[2] = {MR_DTYPE_BF16, MR_DTYPE_F16};
  for (int d = 0; d < 2; d++) {
    mr_convert_from_f32(tmp, dts[d], src, 5);
    mr_convert_to_f32(back, tmp, dts[d], 5);
    for (int i = 0; i < 5; i++) MT_NEAR(back[i], src[i], fabs(src[i]) * 1e-2);
  }
  mr_dtype dt;
  MT_OK(mr_dtype_parse("bfloat16", &dt), (mr_err *)NULL);
  MT_EQ_INT(dt, MR_DTYPE_BF16);
  MT_EQ_INT(mr_dtype_parse("int8", &dt), MR_EINVAL);
  MT_EQ_INT(mr_dtype_size(MR_DTYPE_F32), 4);
  MT_EQ_INT(mr_dtype_size((mr_dtype)9), 0);
}

/* per_sec lines pass in a window, the rest are counted, and the next line that passes gets
 * the count of what was dropped (once). */
MT_TEST(ratelimit_counts_suppressed) {
  struct mr_ratelimit rl = {0};
  uint64_t sup = 99;
  MT_TRUE(mr_ratelimit_pass(&rl, 2, &sup));
  MT_EQ_U64(sup, 0);
  MT_TRUE(mr_ratelimit_pass(&rl, 2, &sup));
  for (int i = 0; i < 12; i++) MT_FALSE(mr_ratelimit_pass(&rl, 2, &sup));
  usleep(1100 * 1000); /* the next window */
  MT_TRUE(mr_ratelimit_pass(&rl, 2, &sup));
  MT_EQ_U64(sup, 12);
  MT_TRUE(mr_ratelimit_pass(&rl, 2, &sup));
  MT_EQ_U64(sup, 0);
  MT_TRUE(mr_ratelimit_pass(&rl, 2, NULL) == false);
}

typedef struct rl_arg {
  struct mr_ratelimit *rl;
  int per_sec, n;
  uint64_t passed, reported;
} rl_arg;

static void *rl_worker(void *p) {
  rl_arg *a = p;
  for (int i = 0; i < a->n; i++) {
    uint64_t sup = 0;
    if (mr_ratelimit_pass(a->rl, a->per_sec, &sup)) {
      a->passed++;
      a->reported += sup;
    }
  }
  return NULL;
}

static void rl_run2(rl_arg *a, rl_arg *b) {
  pthread_t ta, tb;
  MT_EQ_INT(pthread_create(&ta, NULL, rl_worker, a), 0);
  MT_EQ_INT(pthread_create(&tb, NULL, rl_worker, b), 0);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
}

/* Two threads on one call site. With a budget no window can exhaust every call passes (a
 * racy count would lose increments and the totals would not add up); with a small one,
 * every call is either let through or counted as suppressed exactly once. */
MT_TEST(ratelimit_two_threads) {
  struct mr_ratelimit rl = {0};
  rl_arg a = {&rl, 1 << 30, 200000, 0, 0}, b = {&rl, 1 << 30, 200000, 0, 0};
  rl_run2(&a, &b);
  MT_EQ_U64(a.passed + b.passed, 400000);
  MT_EQ_U64(a.reported + b.reported, 0);
  MT_EQ_INT(rl.count, 400000);

  struct mr_ratelimit r2 = {0};
  rl_arg c = {&r2, 10, 100000, 0, 0}, d = {&r2, 10, 100000, 0, 0};
  rl_run2(&c, &d);
  uint64_t passed = c.passed + d.passed;
  MT_TRUE(passed >= 10 && passed < 200000);
  MT_EQ_U64(passed + c.reported + d.reported + r2.suppressed, 200000);
}

MT_MAIN()
