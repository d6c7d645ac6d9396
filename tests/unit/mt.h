/*
 * mt.h - the tiny unit-test harness of moerpc (header only).
 *
 *   MT_TEST(name) { MT_EQ_INT(a, b); MT_NEAR(x, y, tol); MT_TRUE(c); ... }
 *   MT_MAIN()     -- at the end of the file
 *
 * Each test runs in its own forked process with a timeout (default 60 s, env MT_TIMEOUT),
 * like libuv's runner: a crash or a hang fails that test alone. Asserts print both values
 * and file:line. A test that finds nothing to test here (no fast path on this CPU or in
 * this build) ends with MT_SKIP("why") and is counted as skipped, never as passed.
 * `./test_x name` runs one test in-process (for gdb). The last line is
 * "<binary>: N passed, N failed, N skipped" (a forked case ends in _exit and never prints
 * one), and tests/run.sh counts that one line of that name. More cases than MT_MAX_CASES
 * is an error of the binary, not a silent drop.
 */
#ifndef MT_H
#define MT_H

#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef void (*mt_fn)(void);
struct mt_case {
  const char *name;
  mt_fn fn;
};
#define MT_MAX_CASES 256
static struct mt_case mt__cases[MT_MAX_CASES];
static int mt__ncases;
static int mt__overflow; /* cases past MT_MAX_CASES: the binary fails before running any */
static int mt__failed_here;

/* Cleanups of the running case (temp dirs): run when it ends, passed, failed or skipped.
 * (A passing case ends with _exit, so atexit handlers would not run.) */
#define MT_MAX_DEFERRED 8
static void (*mt__deferred[MT_MAX_DEFERRED])(void);
static int mt__ndeferred;
static inline void mt_defer(void (*fn)(void)) {
  if (mt__ndeferred < MT_MAX_DEFERRED) mt__deferred[mt__ndeferred++] = fn;
}
static inline void mt__run_deferred(void) {
  while (mt__ndeferred > 0) mt__deferred[--mt__ndeferred]();
}

#define MT_TEST(name)                                                                  \
  static void mt_test_##name(void);                                                    \
  __attribute__((constructor)) static void mt_reg_##name(void) {                       \
    if (mt__ncases < MT_MAX_CASES) mt__cases[mt__ncases++] = (struct mt_case){#name, mt_test_##name}; \
    else mt__overflow++;                                                               \
  }                                                                                    \
  static void mt_test_##name(void)

#define MT__FAIL(...)                                                                  \
  do {                                                                                 \
    fprintf(stderr, "  %s:%d: ", __FILE__, __LINE__);                                  \
    fprintf(stderr, __VA_ARGS__);                                                      \
    fprintf(stderr, "\n");                                                             \
    mt__failed_here = 1;                                                               \
    mt__run_deferred();                                                                \
    exit(1);                                                                           \
  } while (0)

/* Ends the test as skipped, printing why (exit status MT__SKIP_EXIT of the forked case). */
#define MT__SKIP_EXIT 77
#define MT_SKIP(...)                                                                   \
  do {                                                                                 \
    printf("  skipped: ");                                                             \
    printf(__VA_ARGS__);                                                               \
    printf("\n");                                                                      \
    fflush(NULL);                                                                      \
    mt__run_deferred();                                                                \
    exit(MT__SKIP_EXIT);                                                               \
  } while (0)

#define MT_TRUE(c)                                                                     \
  do { if (!(c)) MT__FAIL("expected true: %s", #c); } while (0)
#define MT_FALSE(c)                                                                    \
  do { if (c) MT__FAIL("expected false: %s", #c); } while (0)
#define MT_EQ_INT(a, b)                                                                \
  do {                                                                                 \
    long long mt_a_ = (long long)(a), mt_b_ = (long long)(b);                          \
    if (mt_a_ != mt_b_) MT__FAIL("%s == %s: %lld != %lld", #a, #b, mt_a_, mt_b_);      \
  } while (0)
#define MT_NE_INT(a, b)                                                                \
  do {                                                                                 \
    long long mt_a_ = (long long)(a), mt_b_ = (long long)(b);                          \
    if (mt_a_ == mt_b_) MT__FAIL("%s != %s: both %lld", #a, #b, mt_a_);                \
  } while (0)
#define MT_EQ_U64(a, b)                                                                \
  do {                                                                                 \
    unsigned long long mt_a_ = (unsigned long long)(a), mt_b_ = (unsigned long long)(b); \
    if (mt_a_ != mt_b_) MT__FAIL("%s == %s: %llu != %llu", #a, #b, mt_a_, mt_b_);      \
  } while (0)
#define MT_LE(a, b)                                                                    \
  do {                                                                                 \
    double mt_a_ = (double)(a), mt_b_ = (double)(b);                                   \
    if (!(mt_a_ <= mt_b_)) MT__FAIL("%s <= %s: %g > %g", #a, #b, mt_a_, mt_b_);        \
  } while (0)
#define MT_NEAR(a, b, tol)                                                             \
  do {                                                                                 \
    double mt_a_ = (double)(a), mt_b_ = (double)(b), mt_t_ = (double)(tol);            \
    if (!(fabs(mt_a_ - mt_b_) <= mt_t_))                                               \
      MT__FAIL("%s ~ %s: %.9g vs %.9g (|diff| %.3g > tol %.3g)", #a, #b, mt_a_, mt_b_, \
               fabs(mt_a_ - mt_b_), mt_t_);                                            \
  } while (0)
#define MT_EQ_STR(a, b)                                                                \
  do {                                                                                 \
    const char *mt_a_ = (a), *mt_b_ = (b);                                             \
    if (!mt_a_ || !mt_b_ || strcmp(mt_a_, mt_b_) != 0)                                 \
      MT__FAIL("%s == %s: \"%s\" != \"%s\"", #a, #b, mt_a_ ? mt_a_ : "(null)",         \
               mt_b_ ? mt_b_ : "(null)");                                              \
  } while (0)
#define MT_CONTAINS(hay, needle)                                                       \
  do {                                                                                 \
    const char *mt_h_ = (hay), *mt_n_ = (needle);                                      \
    if (!mt_h_ || !strstr(mt_h_, mt_n_))                                               \
      MT__FAIL("%s contains \"%s\": got \"%s\"", #hay, mt_n_, mt_h_ ? mt_h_ : "(null)"); \
  } while (0)
/* For int-returning calls: expect ok (0), printing the mr_err message if any. */
#define MT_OK(call, errp)                                                              \
  do {                                                                                 \
    int mt_rc_ = (call);                                                               \
    const mr_err *mt_e_ = (errp);                                                      \
    if (mt_rc_ != 0) MT__FAIL("%s failed: %d %s", #call, mt_rc_, mt_e_ ? mt_e_->msg : ""); \
  } while (0)

enum { MT__PASSED = 0, MT__FAILED = 1, MT__SKIPPED = 2 };
static int mt__run_one(const struct mt_case *c, int timeout_s) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) { perror("fork"); return MT__FAILED; }
  if (pid == 0) {
    alarm((unsigned)timeout_s);
    c->fn();
    mt__run_deferred();
    fflush(NULL);
    _exit(0);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0) {}
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return MT__PASSED;
  if (WIFEXITED(st) && WEXITSTATUS(st) == MT__SKIP_EXIT) return MT__SKIPPED;
  if (WIFSIGNALED(st))
    fprintf(stderr, "  %s: killed by signal %d%s\n", c->name, WTERMSIG(st),
            WTERMSIG(st) == SIGALRM ? " (timeout)" : "");
  return MT__FAILED;
}

static int mt__main(int argc, char **argv) {
  /* 60 s a case; three times that under a sanitizer (the Makefile exports SANITIZER), where
   * everything runs 5-50x slower and a slow CI host is not a hang. */
  const char *mt_san_ = getenv("SANITIZER");
  int timeout_s = getenv("MT_TIMEOUT") ? atoi(getenv("MT_TIMEOUT"))
                  : (mt_san_ && mt_san_[0]) ? 180 : 60;
  const char *prog = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
  if (mt__overflow) {
    fprintf(stderr, "%s: %d cases more than MT_MAX_CASES = %d would not run: raise MT_MAX_CASES "
            "in tests/unit/mt.h or split the file\n", prog, mt__overflow, MT_MAX_CASES);
    printf("%s: 0 passed, %d failed, 0 skipped\n", prog, mt__ncases + mt__overflow);
    return 1;
  }
  if (argc > 1) { /* run the named tests in-process */
    for (int a = 1; a < argc; a++) {
      int found = 0;
      for (int i = 0; i < mt__ncases; i++)
        if (strcmp(mt__cases[i].name, argv[a]) == 0) {
          found = 1;
          mt__cases[i].fn();
          mt__run_deferred();
        }
      if (!found) { fprintf(stderr, "%s: no test named %s\n", prog, argv[a]); return 2; }
    }
    printf("%s: ok\n", prog);
    return 0;
  }
  int passed = 0, failed = 0, skipped = 0;
  for (int i = 0; i < mt__ncases; i++) {
    switch (mt__run_one(&mt__cases[i], timeout_s)) {
    case MT__PASSED:
      passed++;
      printf("ok   %s.%s\n", prog, mt__cases[i].name);
      break;
    case MT__SKIPPED:
      skipped++;
      printf("skip %s.%s\n", prog, mt__cases[i].name);
      break;
    default:
      failed++;
      printf("FAIL %s.%s\n", prog, mt__cases[i].name);
    }
    fflush(stdout);
  }
  printf("%s: %d passed, %d failed, %d skipped\n", prog, passed, failed, skipped);
  return failed ? 1 : 0;
}
#define MT_MAIN()                                                                      \
  int main(int argc, char **argv) { return mt__main(argc, argv); }

#endif /* MT_H */
