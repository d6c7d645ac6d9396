/*
 * mr_core.c - errors, logging, clocks, allocation with fault injection, arenas and dtype
 * conversion. See mr.h for the contracts.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "common/mr.h"

/* ---- errors ------------------------------------------------------------------------- */

const char *mr_strerror(int code) {
  switch (code) {
    case MR_OK:
      return "ok";
#define MR__ERR_MSG(name, val, msg) \
  case MR_##name:                   \
    return msg;
      MR_ERRNO_MAP(MR__ERR_MSG)
#undef MR__ERR_MSG
    default:
      return "unknown error";
  }
}

const char *mr_err_name(int code) {
  switch (code) {
    case MR_OK:
      return "MR_OK";
#define MR__ERR_NAME(name, val, msg) \
  case MR_##name:                    \
    return "MR_" #name;
      MR_ERRNO_MAP(MR__ERR_NAME)
#undef MR__ERR_NAME
    default:
      return "MR_E?";
  }
}

int mr_err_set(mr_err *e, int code, const char *fmt, ...) {
  if (e) {
    va_list ap;
    va_start(ap, fmt);
    e->code = code;
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

int mr_err_prefix(mr_err *e, int code, const char *fmt, ...) {
  if (!e) return code;
  char prefix[256], old[sizeof e->msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, e->msg, sizeof old);
  if (e->code == 0) e->code = code;
  snprintf(e->msg, sizeof e->msg, "%s: %s", prefix, old[0] ? old : mr_strerror(e->code));
  return e->code;
}

void mr_err_clear(mr_err *e) {
  if (e) {
    e->code = 0;
    e->msg[0] = '\0';
  }
}

/* ---- clocks ------------------------------------------------------------------------- */

uint64_t mr_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- logging ------------------------------------------------------------------------ */

static int log_level_from_env(void) {
  const char *s = getenv("MOERPC_LOG");
  int lvl = MR_LOG_INFO;
  if (s && *s) mr_log_parse_level(s, &lvl);
  return lvl;
}

int mr__log_level = MR_LOG_INFO;
static char log_component[32] = "moerpc";

__attribute__((constructor)) static void log_init(void) { mr__log_level = log_level_from_env(); }

void mr_log_set_level(int level) {
  if (level < MR_LOG_ERROR) level = MR_LOG_ERROR;
  if (level > MR_LOG_DEBUG) level = MR_LOG_DEBUG;
  mr__log_level = level;
}

int mr_log_parse_level(const char *s, int *level) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++) {
    if (strcasecmp(s, names[i]) == 0 || (s[0] == (char)('0' + i) && s[1] == '\0')) {
      *level = i;
      return 0;
    }
  }
  if (strcasecmp(s, "warning") == 0) {
    *level = MR_LOG_WARN;
    return 0;
  }
  return MR_EINVAL;
}

void mr_log_set_component(const char *name) {
  snprintf(log_component, sizeof log_component, "%s", name);
}

/* Formats one line (with an optional suppressed-count suffix) and writes it at once. */
static void log_vline(int level, const char *file, int line, uint64_t suppressed,
                      const char *fmt, va_list ap) {
  static const char *tags[] = {"ERROR", "WARN ", "INFO ", "DEBUG"};
  char buf[2048];
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  int n = snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s: ",
                   tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                   tm.tm_sec, ts.tv_nsec / 1000000, tags[level & 3], log_component);
  n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
  if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
  if (suppressed) {
    n += snprintf(buf + n, sizeof buf - (size_t)n, " (+%llu similar lines suppressed)",
                  (unsigned long long)suppressed);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
  }
  if (level == MR_LOG_ERROR || mr__log_level >= MR_LOG_DEBUG) {
    const char *base = strrchr(file, '/');
    n += snprintf(buf + n, sizeof buf - (size_t)n, " (%s:%d)", base ? base + 1 : file, line);
    if (n > (int)sizeof buf - 2) n = (int)sizeof buf - 2;
  }
  buf[n++] = '\n';
  /* One write per line so that lines of several threads do not interleave. */
  ssize_t off = 0;
  while (off < n) {
    ssize_t w = write(STDERR_FILENO, buf + off, (size_t)(n - off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    off += w;
  }
}

void mr__log(int level, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vline(level, file, line, 0, fmt, ap);
  va_end(ap);
}

void mr__log_suppressed(int level, const char *file, int line, uint64_t suppressed,
                        const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vline(level, file, line, suppressed, fmt, ap);
  va_end(ap);
}

bool mr_ratelimit_pass(struct mr_ratelimit *rl, int per_sec, uint64_t *suppressed) {
  int64_t now = (int64_t)(mr_now_ns() / 1000000u);
  bool pass;
  /* Several gRPC threads log through one call site: a spin lock around a few loads and
   * stores (never held across a system call or a log write). */
  while (__atomic_test_and_set(&rl->lock, __ATOMIC_ACQUIRE)) {
  }
  if (rl->window_start_ms == 0 || now - rl->window_start_ms >= 1000) {
    rl->window_start_ms = now;
    rl->count = 0;
  }
  pass = rl->count < per_sec;
  if (pass) {
    rl->count++;
    if (suppressed) *suppressed = rl->suppressed;
    rl->suppressed = 0;
  } else {
    rl->suppressed++;
  }
  __atomic_clear(&rl->lock, __ATOMIC_RELEASE);
  return pass;
}

void mr__assert_fail(const char *expr, const char *file, int line) {
  fprintf(stderr, "moerpc: assertion failed: %s (%s:%d)\n", expr, file, line);
  fflush(stderr);
  abort();
}

/* ---- allocation --------------------------------------------------------------------- */

/* Fault injection: allocations left before failing; 0 = off. Tests set it, so relaxed
 * atomics are enough; production code never touches it. */
static atomic_long alloc_countdown;

static bool alloc_should_fail(void) {
  long n = atomic_load_explicit(&alloc_countdown, memory_order_relaxed);
  if (n == 0) return false;
  if (n == 1) return true; /* stays at 1: every later allocation fails too */
  atomic_fetch_sub_explicit(&alloc_countdown, 1, memory_order_relaxed);
  return false;
}

void mr_alloc_fail_after(long n) { atomic_store(&alloc_countdown, n < 0 ? 0 : n); }

void *mr_malloc(size_t n) {
  if (alloc_should_fail()) return NULL;
  return malloc(n ? n : 1);
}

void *mr_calloc(size_t n, size_t size) {
  if (alloc_should_fail()) return NULL;
  return calloc(n ? n : 1, size ? size : 1);
}

void *mr_realloc(void *p, size_t n) {
  if (alloc_should_fail()) return NULL;
  return realloc(p, n ? n : 1);
}

void *mr_malloc_aligned(size_t n, size_t align) {
  if (alloc_should_fail()) return NULL;
  if (align < sizeof(void *)) align = sizeof(void *);
  void *p = NULL;
  if (posix_memalign(&p, align, n ? n : 1) != 0) return NULL;
  return p;
}

void mr_free(void *p) { free(p); }
void mr_free_aligned(void *p) { free(p); }

char *mr_strdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = mr_malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

/* ---- arena -------------------------------------------------------------------------- */

struct mr_arena_block {
  mr_arena_block *prev; /* older block, freed on reset */
  size_t size;          /* usable bytes after the header */
  size_t off;           /* bytes used */
  _Alignas(64) unsigned char data[];
};

void mr_arena_init(mr_arena *a, size_t block_size) {
  a->head = NULL;
  a->block_size = block_size ? block_size : (1u << 20);
  a->used_peak = 0;
  a->used = 0;
}

static mr_arena_block *arena_block_new(size_t size) {
  mr_arena_block *b = mr_malloc_aligned(sizeof *b + size, 64);
  if (!b) return NULL;
  b->prev = NULL;
  b->size = size;
  b->off = 0;
  return b;
}

void *mr_arena_alloc(mr_arena *a, size_t n, size_t align) {
  MR_ASSERT(align && (align & (align - 1)) == 0 && align <= 4096);
  mr_arena_block *b = a->head;
  if (b) {
    size_t off = (b->off + align - 1) & ~(align - 1);
    if (off <= b->size && n <= b->size - off) {
      b->off = off + n;
      a->used += n;
      if (a->used > a->used_peak) a->used_peak = a->used;
      return b->data + off;
    }
  }
  size_t want = a->block_size;
  if (n + align > want) want = n + align;
  if (b && want < b->size * 2) want = b->size * 2; /* grow geometrically */
  mr_arena_block *nb = arena_block_new(want);
  if (!nb) return NULL;
  if (b) mr_log(MR_LOG_DEBUG, "arena: grew to a new block of %zu bytes", want);
  nb->prev = b;
  a->head = nb;
  /* data is 64-aligned; alignments above 64 need padding. */
  size_t off = ((uintptr_t)nb->data % align) ? align - ((uintptr_t)nb->data % align) : 0;
  nb->off = off + n;
  a->used += n;
  if (a->used > a->used_peak) a->used_peak = a->used;
  return nb->data + off;
}

void mr_arena_reset(mr_arena *a) {
  mr_arena_block *b = a->head;
  if (!b) return;
  if (b->prev) {
    /* The request outgrew one block: replace the chain by one block of the total size, so
     * that the next request of the same size finds its scratch in one warm block instead
     * of faulting in fresh ones. */
    size_t total = 0;
    for (mr_arena_block *p = b; p; p = p->prev) total += p->size;
    mr_arena_block *nb = arena_block_new(total);
    if (nb) {
      for (mr_arena_block *p = b; p;) {
        mr_arena_block *prev = p->prev;
        mr_free_aligned(p);
        p = prev;
      }
      a->head = nb;
      a->used = 0;
      return;
    }
    /* Out of memory: keep the newest (largest) block and free the rest. */
    mr_arena_block *old = b->prev;
    while (old) {
      mr_arena_block *p = old->prev;
      mr_free_aligned(old);
      old = p;
    }
    b->prev = NULL;
  }
  b->off = 0;
  a->used = 0;
}

void mr_arena_shrink(mr_arena *a) {
  mr_arena_block *b = a->head;
  if (!b || b->off != 0 || b->prev || b->size <= a->block_size) return;
  mr_log(MR_LOG_DEBUG, "arena: released a %zu-byte block after a peak", b->size);
  mr_free_aligned(b);
  a->head = NULL;
}

void mr_arena_close(mr_arena *a) {
  mr_arena_block *b = a->head;
  while (b) {
    mr_arena_block *p = b->prev;
    mr_free_aligned(b);
    b = p;
  }
  a->head = NULL;
  a->used = 0;
}

/* ---- dtypes ------------------------------------------------------------------------- */

size_t mr_dtype_size(mr_dtype dt) {
  switch (dt) {
    case MR_DTYPE_F32:
      return 4;
    case MR_DTYPE_F16:
    case MR_DTYPE_BF16:
      return 2;
    default:
      return 0;
  }
}

const char *mr_dtype_name(mr_dtype dt) {
  switch (dt) {
    case MR_DTYPE_F32:
      return "f32";
    case MR_DTYPE_F16:
      return "f16";
    case MR_DTYPE_BF16:
      return "bf16";
    default:
      return "?";
  }
}

int mr_dtype_parse(const char *s, mr_dtype *out) {
  if (!strcasecmp(s, "f32") || !strcasecmp(s, "fp32") || !strcasecmp(s, "float32")) {
    *out = MR_DTYPE_F32;
  } else if (!strcasecmp(s, "f16") || !strcasecmp(s, "fp16") || !strcasecmp(s, "float16")) {
    *out = MR_DTYPE_F16;
  } else if (!strcasecmp(s, "bf16") || !strcasecmp(s, "bfloat16")) {
    *out = MR_DTYPE_BF16;
  } else {
    return MR_EINVAL;
  }
  return 0;
}

/* ---- float8_e4m3fn ---- */

static float f8_table[256];
static pthread_once_t f8_once = PTHREAD_ONCE_INIT;

/* From the fields: e = 0 subnormal m * 2^-9, else (1 + m / 8) * 2^(e - 7); S.1111.111 NaN. */
static void f8_table_init(void) {
  for (int c = 0; c < 256; c++) {
    int ex = (c >> 3) & 15, m = c & 7;
    float v;
    if (ex == 15 && m == 7) v = NAN;
    else if (ex == 0) v = ldexpf((float)m, -9);
    else v = ldexpf(1.0f + (float)m / 8.0f, ex - 7);
    f8_table[c] = (c & 0x80) ? -v : v;
  }
}

const float *mr_f8e4m3_table(void) {
  pthread_once(&f8_once, f8_table_init);
  return f8_table;
}

uint8_t mr_f32_to_f8e4m3(float v) {
  union { float f; uint32_t u; } x = {.f = v};
  const uint8_t sign = (uint8_t)((x.u >> 24) & 0x80);
  const uint32_t a = x.u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;  /* NaN */
  if (a >= 0x43e00000u) return sign | 0x7e; /* >= 448 (and inf): saturate */
  if (a < 0x3c800000u) {                    /* below 2^-6: subnormal, step 2^-9 */
    float q = rintf(fabsf(v) * 512.0f);     /* exact scaling; ties to even; 0..8 (8 = 2^-6) */
    return sign | (uint8_t)q;
  }
  /* Normal: keep 3 of the 23 mantissa bits, ties to even; a carry out of the mantissa steps
   * the exponent, which the code's layout (exponent above mantissa) does by itself. */
  uint32_t E = (a >> 23) - 127 + 7, keep = (a >> 20) & 7, rest = a & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1))) keep++;
  uint32_t code = (E << 3) + keep;
  return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

void mr_f8e4m3_quantize_rows(const float *w, uint32_t rows, uint32_t K, uint8_t *q,
                             float *scale_inv) {
  for (uint32_t k0 = 0, b = 0; k0 < K; k0 += 128, b++) {
    const uint32_t k1 = k0 + 128 < K ? k0 + 128 : K;
    float amax = 0.0f;
    for (uint32_t r = 0; r < rows; r++)
      for (uint32_t k = k0; k < k1; k++) {
        float a = fabsf(w[(size_t)r * K + k]);
        amax = a > amax ? a : amax;
      }
    float sc = amax / MR_F8E4M3_MAX;
    if (!(sc > 0.0f)) sc = 1.0f; /* all-zero block (or amax / 448 underflowing): codes 0 */
    scale_inv[b] = sc;
    for (uint32_t r = 0; r < rows; r++)
      for (uint32_t k = k0; k < k1; k++) q[(size_t)r * K + k] = mr_f32_to_f8e4m3(w[(size_t)r * K + k] / sc);
  }
}

float mr_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  union { uint32_t u; float f; } v;
  if (exp == 0) {
    if (man == 0) {
      v.u = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while (!(man & 0x400u));
      man &= 0x3ffu;
      v.u = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    v.u = sign | 0x7f800000u | (man << 13);
  } else {
    v.u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return v.f;
}

uint16_t mr_f32_to_f16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  uint32_t sign = (v.u >> 16) & 0x8000u;
  uint32_t x = v.u & 0x7fffffffu;
  if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow (rounds to inf) */
  if (x < 0x38800000u) { /* subnormal or zero in f16 */
    if (x < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal */
    uint32_t exp = x >> 23;
    uint32_t man = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp; /* 14 + (112 - exp) */
    uint32_t half = 1u << (shift - 1);
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = x - 0x38000000u; /* rebias exponent by (127 - 15) << 23 */
  uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

