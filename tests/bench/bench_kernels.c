/*
 * bench_kernels.c - moerpc-bench-kernels: speed of one MoE layer call (kn_moe_forward) on
 * real model shapes, next to the two ceilings of this machine measured in the same run.
 *
 *   moerpc-bench-kernels [--shape qwen3-30b-a3b|deepseek-v3] [--tokens 1,4,16,...]
 *                        [--format bf16,int8,int4,...] [--isa amx,avx512,avx2,ref,auto]
 *                        [--threads N] [--layers N] [--group G] [--repeats N]
 *                        [--max-gb G] [--llc-mb M] [--seed S] [--fp8-kernel lut|shift]
 *                        [--json]
 *
 * fp8-b128 (--format fp8): the random bf16 expert is quantized once (kn_fp8_quantize_b128)
 * and every used expert loaded from those codes (kn_layer_load_expert_fp8), as from an FP8
 * checkpoint. --fp8-kernel shift replaces the AVX-512 fp8 kernel by its shift-conversion
 * variant (the one CPUs without VBMI get), so that both conversions are compared in one
 * run; the kernel name in the output tells which ran.
 *
 * Per case (shape, format, isa, tokens T):
 *   - routing: every token picks top_k distinct experts uniformly at random; calls cycle
 *     through `layers` layers, so that the weights a call reads were evicted from the LLC
 *     since the last call on that layer (default: enough layers that the weights read
 *     between two calls on one layer exceed 4x the LLC). Only experts some call uses are
 *     loaded; --max-gb caps the memory by routing over a pool of the first experts
 *     (reported as experts_pool; on deepseek-v3 at large T that raises tokens per expert);
 *   - us: median wall time of one layer call over the repeats (1 warm-up call first);
 *   - weight_gbps: packed bytes of the experts the call activates / time;
 *   - read_gbps: a plain SIMD streaming read (no writes) of the same number of bytes
 *     (capped at 512 MiB) from a buffer not in cache, on the same number of threads,
 *     timed right after each call: bw_ratio = weight_gbps / read_gbps;
 *   - tflops: 2 * 3 * H * I * T * top_k / time (int8/int4: int ops);
 *   - peak_tflops: the register-only peak of the best dot instruction for the format, measured
 *     once per run on the same number of threads: vdpbf16ps (bf16), vpdpbusd (int8,
 *     int4), vpmaddubsw (int8, int4 without VNNI: the AVX2 kernels), vfmadd231ps (f32, f16,
 *     and bf16 without BF16); peak_kind
 *     names it; peak_ratio = tflops / peak_tflops;
 *   - amx_peak_tflops (AMX CPUs only, null elsewhere): the tile peak of the format (bf16
 *     tiles for bf16 / fp8, int8 tiles for int8 / int4), operands resident in tiles, a 2 x 2
 *     block of full-tile dot products (kn__amx_peak, kernels/x86/moe_amx.c) on the same
 *     threads, best of 3;
 *   - roofline_tflops = min(ceiling, intensity x read_gbps), the intensity being the case's
 *     operations per weight byte (its tokens per expert) and the ceiling the AMX peak for a
 *     case that ran on tiles, else peak_tflops: what the case could reach on this machine;
 *     roofline_ratio = tflops / roofline_tflops.
 * JSON lines on stdout with --json; a human table on stderr always.
 *
 *   moerpc-bench-kernels --linear NxK[,NxK...]|qwen3-30b-a3b [--tokens ...] [--format ...]
 *                        [--isa ...] [--threads N] [--group G] [--repeats N] [--max-gb G]
 *
 * Dense layers instead (kn_linear_forward, y[T, N] = x[T, K] W^T), per (shape N x K,
 * format, isa, tokens T): `copies` distinct packed copies of W, enough that the bytes of
 * all of them exceed 4x the LLC (so no call finds its weights in cache), are called back
 * to back, once each, as a runner's layers would be; us = that pass's time / copies
 * (median over the repeats, after one warm-up pass); read_gbps: the plain read of the
 * same bytes right after each pass; tflops = 2 N K T / time. The calling thread is pinned
 * to worker 0's core (kn_engine_pin_caller) first. "qwen3-30b-a3b" stands for
 * its attention and head: 4096x2048 (q), 512x2048 (k, v), 2048x4096 (o), 5120x2048 (fused
 * qkv), 151936x2048 (lm_head).
 */
#include "kernels/internal.h"

#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- shapes ------------------------------------------------------------------------ */

typedef struct shape {
  const char *name;
  uint32_t H, I, E, k;
} shape;
static const shape shapes[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8}, /* hidden, moe_intermediate_size, experts, top-k */
    {"deepseek-v3", 7168, 2048, 256, 8},
};

/* ---- options ----------------------------------------------------------------------- */

#define MAX_LIST 16
typedef struct opts {
  const shape *sh;
  uint32_t tokens[MAX_LIST];
  int n_tokens;
  kn_format fmt[MAX_LIST];
  int n_fmt;
  kn_isa isa[MAX_LIST];
  int n_isa;
  uint32_t threads;
  uint32_t layers; /* 0 = auto */
  uint32_t group;
  uint32_t repeats; /* 0 = by T */
  double max_gb;
  double llc_mb; /* 0 = detect */
  uint64_t seed;
  bool json;
  int fp8_shift; /* --fp8-kernel shift: the AVX-512 fp8 kernel without VBMI's LUT */
  bool streams; /* --streams: the row-interleaving read test instead of the cases */
  uint32_t lin_n[MAX_LIST], lin_k[MAX_LIST]; /* --linear: dense-layer shapes N x K */
  int n_lin;
} opts;

static void usage(FILE *f) {
  fprintf(f,
          "usage: moerpc-bench-kernels [--shape qwen3-30b-a3b|deepseek-v3] [--tokens 1,4,16]\n"
          "         [--format bf16,int8,int4] [--isa avx512,ref] [--threads N] [--layers N]\n"
          "         [--group 32|64|128] [--repeats N] [--max-gb G] [--llc-mb M] [--seed S]\n"
          "         [--fp8-kernel lut|shift] [--json]\n"
          "       moerpc-bench-kernels --linear NxK[,NxK...]|qwen3-30b-a3b [--tokens ...] [--format ...]\n"
          "         [--isa ...] [--threads N] [--group G] [--repeats N] [--max-gb G] [--json]   (dense layers)\n"
          "       moerpc-bench-kernels --streams   (one thread: reading R rows side by side vs one after another)\n");
}

/* Splits a comma list; calls one(item) for each; returns -1 on the first bad item. */
static int parse_list(const char *s, int max, int (*one)(const char *, void *, int), void *out, int *n) {
  char buf[256];
  snprintf(buf, sizeof buf, "%s", s);
  *n = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (*n == max) {
      fprintf(stderr, "too many items in \"%s\" (at most %d)\n", s, max);
      return -1;
    }
    if (one(tok, out, *n) != 0) return -1;
    (*n)++;
  }
  if (*n == 0) {
    fprintf(stderr, "empty list \"%s\"\n", s);
    return -1;
  }
  return 0;
}
static int one_token(const char *s, void *out, int i) {
  char *end;
  unsigned long v = strtoul(s, &end, 10);
  if (*end || end == s || v < 1 || v > 65536) {
    fprintf(stderr, "--tokens: \"%s\" must be in 1..65536\n", s);
    return -1;
  }
  ((uint32_t *)out)[i] = (uint32_t)v;
  return 0;
}
static int one_fmt(const char *s, void *out, int i) {
  if (kn_format_parse(s, &((kn_format *)out)[i]) != 0) {
    fprintf(stderr, "--format: \"%s\" must be f32, f16, bf16, int8, int4 or fp8 (fp8-b128)\n", s);
    return -1;
  }
  return 0;
}
static int one_isa(const char *s, void *out, int i) {
  if (strcmp(s, "auto") == 0) {
    ((kn_isa *)out)[i] = KN_ISA_COUNT;
    return 0;
  }
  if (kn_isa_parse(s, &((kn_isa *)out)[i]) != 0) {
    fprintf(stderr, "--isa: \"%s\" must be ref, avx2, avx512, amx or auto\n", s);
    return -1;
  }
  return 0;
}
/* The dense layers of qwen3-30b-a3b: q, k (= v), o, fused qkv, lm_head. */
static const uint32_t qwen3_linear[5][2] = {{4096, 2048}, {512, 2048}, {2048, 4096}, {5120, 2048}, {151936, 2048}};
static int one_linear(const char *s, void *out, int i) {
  uint32_t(*nk)[2] = out;
  char *end, *end2;
  unsigned long n = strtoul(s, &end, 10), k = 0;
  if (end != s && *end == 'x') k = strtoul(end + 1, &end2, 10);
  if (end == s || *end != 'x' || *end2 || n < 1 || n > KN_LINEAR_MAX_OUT || k < 1 || k > KN_LINEAR_MAX_IN) {
    fprintf(stderr, "--linear: \"%s\" must be NxK with N in 1..%u and K in 1..%u, or qwen3-30b-a3b\n", s,
            KN_LINEAR_MAX_OUT, KN_LINEAR_MAX_IN);
    return -1;
  }
  nk[i][0] = (uint32_t)n;
  nk[i][1] = (uint32_t)k;
  return 0;
}

static int parse_num(const char *flag, const char *s, double lo, double hi, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (*end || end == s || !(v >= lo && v <= hi)) {
    fprintf(stderr, "%s = \"%s\": must be a number in %g..%g\n", flag, s, lo, hi);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_args(int argc, char **argv, opts *o) {
  memset(o, 0, sizeof *o);
  o->sh = &shapes[0];
  const uint32_t def_tokens[] = {1, 4, 16, 64, 256, 1024};
  memcpy(o->tokens, def_tokens, sizeof def_tokens);
  o->n_tokens = 6;
  o->fmt[0] = KN_FMT_BF16;
  o->fmt[1] = KN_FMT_INT8;
  o->fmt[2] = KN_FMT_INT4;
  o->n_fmt = 3;
  o->isa[0] = KN_ISA_COUNT;
  o->n_isa = 1;
  o->group = 64;
  o->max_gb = 6.0;
  o->seed = 1;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    double v;
    if (strcmp(a, "--json") == 0) {
      o->json = true;
      continue;
    }
    if (strcmp(a, "--streams") == 0) {
      o->streams = true;
      continue;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      usage(stdout);
      exit(0);
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "%s: missing value\n", a);
      usage(stderr);
      return -1;
    }
    const char *val = argv[++i];
    if (strcmp(a, "--shape") == 0) {
      o->sh = NULL;
      for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        if (strcmp(val, shapes[s].name) == 0) o->sh = &shapes[s];
      if (!o->sh) {
        fprintf(stderr, "--shape = \"%s\": must be qwen3-30b-a3b or deepseek-v3\n", val);
        return -1;
      }
    } else if (strcmp(a, "--linear") == 0) {
      uint32_t nk[MAX_LIST][2];
      if (strcmp(val, "qwen3-30b-a3b") == 0) {
        o->n_lin = 5;
        memcpy(nk, qwen3_linear, sizeof qwen3_linear);
      } else if (parse_list(val, MAX_LIST, one_linear, nk, &o->n_lin)) {
        return -1;
      }
      for (int q = 0; q < o->n_lin; q++) {
        o->lin_n[q] = nk[q][0];
        o->lin_k[q] = nk[q][1];
      }
    } else if (strcmp(a, "--fp8-kernel") == 0) {
      if (strcmp(val, "lut") != 0 && strcmp(val, "shift") != 0) {
        fprintf(stderr, "--fp8-kernel = \"%s\": must be lut or shift\n", val);
        return -1;
      }
      o->fp8_shift = strcmp(val, "shift") == 0;
    } else if (strcmp(a, "--tokens") == 0) {
      if (parse_list(val, MAX_LIST, one_token, o->tokens, &o->n_tokens)) return -1;
    } else if (strcmp(a, "--format") == 0) {
      if (parse_list(val, MAX_LIST, one_fmt, o->fmt, &o->n_fmt)) return -1;
    } else if (strcmp(a, "--isa") == 0) {
      if (parse_list(val, MAX_LIST, one_isa, o->isa, &o->n_isa)) return -1;
    } else if (strcmp(a, "--threads") == 0) {
      if (parse_num(a, val, 0, 4096, &v)) return -1;
      o->threads = (uint32_t)v;
    } else if (strcmp(a, "--layers") == 0) {
      if (parse_num(a, val, 1, 1024, &v)) return -1;
      o->layers = (uint32_t)v;
    } else if (strcmp(a, "--group") == 0) {
      if (parse_num(a, val, 32, 128, &v) || (v != 32 && v != 64 && v != 128)) {
        fprintf(stderr, "--group must be 32, 64 or 128\n");
        return -1;
      }
      o->group = (uint32_t)v;
    } else if (strcmp(a, "--repeats") == 0) {
      if (parse_num(a, val, 1, 10000, &v)) return -1;
      o->repeats = (uint32_t)v;
    } else if (strcmp(a, "--max-gb") == 0) {
      if (parse_num(a, val, 0.1, 4096, &o->max_gb)) return -1;
    } else if (strcmp(a, "--llc-mb") == 0) {
      if (parse_num(a, val, 1, 65536, &o->llc_mb)) return -1;
    } else if (strcmp(a, "--seed") == 0) {
      if (parse_num(a, val, 0, 1e18, &v)) return -1;
      o->seed = (uint64_t)v;
    } else {
      fprintf(stderr, "unknown option %s\n", a);
      usage(stderr);
      return -1;
    }
  }
  return 0;
}

/* Last-level cache bytes: sysfs (index3, else the highest index), else 32 MiB. sysconf's
 * _SC_LEVEL3_CACHE_SIZE is wrong in some VMs (320 MiB on the one this was written on). */
static double llc_bytes(void) {
  for (int idx = 3; idx >= 2; idx--) {
    char path[128];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", idx);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    unsigned long v = 0;
    char unit = 0;
    int got = fscanf(f, "%lu%c", &v, &unit);
    fclose(f);
    if (got >= 1 && v > 0) return (double)v * (unit == 'K' ? 1024.0 : unit == 'M' ? 1048576.0 : 1.0);
  }
  return 32.0 * 1048576.0;
}

/* ---- random numbers ---------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* ---- a thread team for the read and peak measurements ------------------------------ */

/* Workers sleep on a condition variable between rounds (they must not take CPU from the
 * engine's pool while kn_moe_forward runs); in a round, all threads spin at a start line
 * so that the timed interval starts with every thread awake. */
typedef struct team {
  int n; /* threads, the caller included */
  pthread_t th[256];
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t gen; /* under mu */
  bool quit;    /* under mu */
  _Atomic int ready, done, go;
  void (*fn)(int id, int n, void *arg);
  void *arg;
  uint64_t end_ns[256];
} team;

typedef struct team_arg {
  team *t;
  int id;
} team_arg;
static team_arg team_args[256];

static void *team_main(void *p) {
  team_arg *ta = p;
  team *t = ta->t;
  uint64_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&t->mu);
    while (t->gen == seen && !t->quit) pthread_cond_wait(&t->cv, &t->mu);
    bool quit = t->quit;
    seen = t->gen;
    pthread_mutex_unlock(&t->mu);
    if (quit) return NULL;
    atomic_fetch_add(&t->ready, 1);
    while (!atomic_load(&t->go)) _mm_pause();
    t->fn(ta->id, t->n, t->arg);
    t->end_ns[ta->id] = mr_now_ns();
    atomic_fetch_add(&t->done, 1);
  }
}

static int team_start(team *t, int n) {
  memset(t, 0, sizeof *t);
  t->n = n < 1 ? 1 : n > 256 ? 256 : n;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  for (int i = 1; i < t->n; i++) {
    team_args[i] = (team_arg){t, i};
    if (pthread_create(&t->th[i], NULL, team_main, &team_args[i]) != 0) {
      t->n = i;
      break;
    }
  }
  return t->n;
}

/* Runs fn on every thread at once; returns the wall time in ns from the common start to
 * the last thread's end. */
static uint64_t team_run(team *t, void (*fn)(int, int, void *), void *arg) {
  t->fn = fn;
  t->arg = arg;
  atomic_store(&t->ready, 0);
  atomic_store(&t->done, 0);
  atomic_store(&t->go, 0);
  pthread_mutex_lock(&t->mu);
  t->gen++;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
  while (atomic_load(&t->ready) < t->n - 1) _mm_pause();
  uint64_t t0 = mr_now_ns();
  atomic_store(&t->go, 1);
  fn(0, t->n, arg);
  t->end_ns[0] = mr_now_ns();
  while (atomic_load(&t->done) < t->n - 1) _mm_pause();
  uint64_t end = 0;
  for (int i = 0; i < t->n; i++)
    if (t->end_ns[i] > end) end = t->end_ns[i];
  return end - t0;
}

static void team_stop(team *t) {
  pthread_mutex_lock(&t->mu);
  t->quit = true;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
  for (int i = 1; i < t->n; i++) pthread_join(t->th[i], NULL);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
}

/* ---- streaming read ---------------------------------------------------------------- */

static volatile uint64_t sink;

/* The lanes' sum, wrapping as unsigned: _mm512_reduce_add_epi64 adds as signed long long
 * (GCC's header), which UBSan reports as an overflow on arbitrary data. */
__attribute__((target("avx512f"))) static uint64_t hsum_u64(__m512i v) {
  uint64_t t[8], s = 0;
  _mm512_storeu_si512(t, v);
  for (int i = 0; i < 8; i++) s += t[i];
  return s;
}

__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint8_t *p, size_t n) {
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 256 <= n; i += 256) {
    s0 = _mm512_add_epi64(s0, _mm512_load_si512(p + i));
    s1 = _mm512_add_epi64(s1, _mm512_load_si512(p + i + 64));
    s2 = _mm512_add_epi64(s2, _mm512_load_si512(p + i + 128));
    s3 = _mm512_add_epi64(s3, _mm512_load_si512(p + i + 192));
  }
  return hsum_u64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
}
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, size_t n) {
  __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(p + i)));
    s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(p + i + 32)));
    s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i *)(p + i + 64)));
    s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i *)(p + i + 96)));
  }
  __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
  return (uint64_t)_mm256_extract_epi64(s, 0) + (uint64_t)_mm256_extract_epi64(s, 3);
}
static uint64_t read_plain(const uint8_t *p, size_t n) {
  uint64_t s = 0;
  for (size_t i = 0; i + 8 <= n; i += 8) s += *(const uint64_t *)(p + i);
  return s;
}

typedef struct read_job {
  const uint8_t *base; /* 64-byte aligned */
  size_t bytes;        /* split over the threads in 256-byte units */
  int simd;            /* 2 AVX-512, 1 AVX2, 0 plain */
} read_job;

static void read_fn(int id, int n, void *arg) {
  read_job *j = arg;
  size_t units = j->bytes / 256, per = units / (size_t)n, extra = units % (size_t)n;
  size_t u0 = per * (size_t)id + ((size_t)id < extra ? (size_t)id : extra);
  size_t nu = per + ((size_t)id < extra ? 1 : 0);
  const uint8_t *p = j->base + u0 * 256;
  size_t len = nu * 256;
  sink += j->simd == 2 ? read_avx512(p, len) : j->simd == 1 ? read_avx2(p, len) : read_plain(p, len);
}

/* ---- register-only peaks ----------------------------------------------------------- */

#define PEAK_ITERS 2000000u
/* Each iteration: 16 independent instructions on zmm/ymm accumulators (more than latency x
 * throughput of any of them on current cores). asm keeps the compiler from folding them. */
#define ACC16_DECL(T, init)                                                                  \
  T a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init,  \
    a8 = init, a9 = init, a10 = init, a11 = init, a12 = init, a13 = init, a14 = init, a15 = init
#define ACC8_LO "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7)
#define ACC8_HI "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11), "+v"(a12), "+v"(a13), "+v"(a14), "+v"(a15)
/* 8 instructions on operands %0..%7 with sources %8, %9 (an asm statement holds at most 30
 * operands, and each "+v" counts twice). */
#define INS8(op)                                                                                 \
  op " %8, %9, %0\n\t" op " %8, %9, %1\n\t" op " %8, %9, %2\n\t" op " %8, %9, %3\n\t"           \
  op " %8, %9, %4\n\t" op " %8, %9, %5\n\t" op " %8, %9, %6\n\t" op " %8, %9, %7\n\t"
#define LOOP16(op, cons)                                                              \
  for (uint32_t i = 0; i < iters; i++) {                                              \
    __asm__ volatile(INS8(op) : ACC8_LO : cons(b), cons(c));                          \
    __asm__ volatile(INS8(op) : ACC8_HI : cons(b), cons(c));                          \
  }
#define SUM16(add) add(add(add(add(a0, a1), add(a2, a3)), add(add(a4, a5), add(a6, a7))), \
                       add(add(add(a8, a9), add(a10, a11)), add(add(a12, a13), add(a14, a15))))

__attribute__((target("avx512f,avx512bf16"))) static void peak_dpbf16(uint32_t iters) {
  volatile float seed = 1e-3f;
  __m512 b = _mm512_set1_ps(seed), c = _mm512_set1_ps(seed);
  ACC16_DECL(__m512, _mm512_setzero_ps());
  LOOP16("vdpbf16ps", "v")
  float out[16];
  _mm512_storeu_ps(out, SUM16(_mm512_add_ps));
  sink += (uint64_t)out[0];
}
__attribute__((target("avx512f,avx512vnni"))) static void peak_dpbusd(uint32_t iters) {
  volatile int seed = 1;
  __m512i b = _mm512_set1_epi32(seed), c = _mm512_set1_epi32(seed);
  ACC16_DECL(__m512i, _mm512_setzero_si512());
  LOOP16("vpdpbusd", "v")
  int out[16];
  _mm512_storeu_si512(out, SUM16(_mm512_add_epi32));
  sink += (uint64_t)out[0];
}
__attribute__((target("avx512f,fma"))) static void peak_fma512(uint32_t iters) {
  volatile float seed = 1e-3f;
  __m512 b = _mm512_set1_ps(seed), c = _mm512_set1_ps(seed);
  ACC16_DECL(__m512, _mm512_setzero_ps());
  LOOP16("vfmadd231ps", "v")
  float out[16];
  _mm512_storeu_ps(out, SUM16(_mm512_add_ps));
  sink += (uint64_t)out[0];
}
__attribute__((target("avx2,fma"))) static void peak_fma256(uint32_t iters) {
  volatile float seed = 1e-3f;
  __m256 b = _mm256_set1_ps(seed), c = _mm256_set1_ps(seed);
  ACC16_DECL(__m256, _mm256_setzero_ps());
  LOOP16("vfmadd231ps", "x")
  float out[8];
  _mm256_storeu_ps(out, SUM16(_mm256_add_ps));
  sink += (uint64_t)out[0];
}

/* The int8 pair of the AVX2 kernels without VNNI (moe_avx2.c): vpmaddubsw, 16 int16 sums
 * of 2 u8 x s8 products each (32 multiply-adds, 64 ops), the instruction that bounds them
 * as vpdpbusd bounds the AVX-512 ones (their vpmaddwd and vpaddd after it go uncounted, so
 * this is an upper bound). */
__attribute__((target("avx2"))) static void peak_maddubs256(uint32_t iters) {
  volatile int seed = 1;
  __m256i b = _mm256_set1_epi8((char)seed), c = _mm256_set1_epi8((char)seed);
  ACC16_DECL(__m256i, _mm256_setzero_si256());
  LOOP16("vpmaddubsw", "x")
  short out[16];
  _mm256_storeu_si256((__m256i *)out, SUM16(_mm256_add_epi16));
  sink += (uint64_t)out[0];
}

typedef enum peak_kind { PK_DPBF16, PK_DPBUSD, PK_FMA512, PK_FMA256, PK_MADDUBS256, PK_SCALAR, PK_COUNT } peak_kind;
static const char *const peak_names[PK_COUNT] = {"avx512_bf16_vdpbf16ps", "avx512_vnni_vpdpbusd",
                                                 "avx512_fma_f32", "avx2_fma_f32", "avx2_vpmaddubsw", "none"};
/* Operations per instruction (per iteration: 16 instructions). */
static const double peak_ops[PK_COUNT] = {64, 128, 32, 16, 64, 0};

typedef struct peak_job {
  peak_kind k;
  uint32_t iters;
} peak_job;
static void peak_fn(int id, int n, void *arg) {
  (void)id;
  (void)n;
  peak_job *j = arg;
  switch (j->k) {
    case PK_DPBF16: peak_dpbf16(j->iters); break;
    case PK_DPBUSD: peak_dpbusd(j->iters); break;
    case PK_FMA512: peak_fma512(j->iters); break;
    case PK_FMA256: peak_fma256(j->iters); break;
    case PK_MADDUBS256: peak_maddubs256(j->iters); break;
    default: break;
  }
}

/* The best dot instruction this CPU has for format f. */
static peak_kind peak_for(kn_format f) {
  const kn__cpu *c = kn__cpu_get();
  bool z = c->best >= KN_ISA_AVX512;
  if ((f == KN_FMT_BF16 || f == KN_FMT_FP8) && z && c->avx512_bf16) return PK_DPBF16;
  if ((f == KN_FMT_INT8 || f == KN_FMT_INT4) && z && c->avx512_vnni) return PK_DPBUSD;
  /* without VNNI the int8 / int4 kernels are the AVX2 ones, on vpmaddubsw */
  if ((f == KN_FMT_INT8 || f == KN_FMT_INT4) && c->best >= KN_ISA_AVX2) return PK_MADDUBS256;
  if (z) return PK_FMA512;
  if (c->best >= KN_ISA_AVX2) return PK_FMA256;
  return PK_SCALAR;
}

/* Ops per second of kind k on the team's threads: best of 3 rounds. */
static double peak_measure(team *t, peak_kind k) {
  if (k == PK_SCALAR) return 0.0;
  peak_job j = {k, PEAK_ITERS / 4};
  team_run(t, peak_fn, &j); /* warm up (clock ramp) */
  double best = 0.0;
  j.iters = PEAK_ITERS;
  for (int r = 0; r < 3; r++) {
    uint64_t ns = team_run(t, peak_fn, &j);
    double ops = (double)j.iters * 16.0 * peak_ops[k] * t->n / ((double)ns * 1e-9);
    if (ops > best) best = ops;
  }
  return best;
}

/* The tile peak of format f (bf16 tiles, or int8 tiles for int8 / int4) on the team's
 * threads, ops/s, best of 3 rounds; 0 where the CPU has no AMX. */
typedef struct amx_peak_job {
  kn_format f;
  uint64_t iters;
  _Atomic uint64_t ops;
} amx_peak_job;
static void amx_peak_fn(int id, int n, void *arg) {
  (void)id;
  (void)n;
  amx_peak_job *j = arg;
#if MR_HAVE_AMX
  atomic_fetch_add(&j->ops, kn__amx_peak(j->f, j->iters));
#else
  (void)j;
#endif
}
static double amx_peak_measure(team *t, kn_format f) {
  if (kn__cpu_get()->best != KN_ISA_AMX || !(f == KN_FMT_BF16 || f == KN_FMT_FP8 || f == KN_FMT_INT8 ||
                                              f == KN_FMT_INT4))
    return 0.0;
  amx_peak_job j = {.f = f, .iters = PEAK_ITERS / 8};
  team_run(t, amx_peak_fn, &j); /* warm up (clock ramp, the tile state's first use) */
  double best = 0.0;
  j.iters = PEAK_ITERS / 2;
  for (int r = 0; r < 3; r++) {
    atomic_store(&j.ops, 0);
    uint64_t ns = team_run(t, amx_peak_fn, &j);
    double ops = (double)atomic_load(&j.ops) / ((double)ns * 1e-9);
    if (ops > best) best = ops;
  }
  return best;
}

/* ---- one case ---------------------------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Expected distinct experts of T tokens drawing k distinct of E each. */
static double expected_distinct(uint32_t E, uint32_t k, uint32_t T) {
  return E * (1.0 - pow(1.0 - (double)k / E, (double)T));
}

typedef struct routing {
  uint32_t T, calls;
  uint32_t layers; /* calls cycle through layers 0 .. layers - 1 */
  int32_t *ids;   /* [calls][T * k] */
  float *weights; /* [T * k] */
} routing;

/* One format's layers, holding the union of the experts all its cases use. */
typedef struct fmt_run {
  kn_format f;
  uint32_t n_layers, pool;
  kn_layer **layers;
  routing *rt; /* [n_tokens] */
  uint64_t loaded_bytes;
} fmt_run;

static uint32_t repeats_for(const opts *o, uint32_t T) {
  if (o->repeats) return o->repeats;
  return T <= 16 ? 15 : T <= 64 ? 9 : T <= 256 ? 7 : 5;
}

/* Plans layers and routing for format f, then loads the experts that are used. */
static int fmt_setup(const opts *o, kn_engine *eng, kn_format f, fmt_run *fr) {
  const shape *sh = o->sh;
  memset(fr, 0, sizeof *fr);
  fr->f = f;
  mr_err e = {0};
  kn_layer_desc d = {.hidden = sh->H, .inter = sh->I, .num_experts = sh->E, .format = f,
                     .group = f == KN_FMT_INT4 ? o->group : 0};
  kn_layer *probe = NULL;
  if (kn_layer_new(&probe, eng, &d, &e) != 0) {
    fprintf(stderr, "layer: %s\n", e.msg);
    return -1;
  }
  const uint64_t eb = kn_layer_expert_bytes(probe);
  kn_layer_free(probe);
  const double llc = o->llc_mb > 0 ? o->llc_mb * 1048576.0 : llc_bytes();
  /* Layers per T: enough that the weights of the calls between two calls on one layer
   * (layers x the bytes of a call) exceed 4x the LLC; the layers of the smallest T are
   * allocated. */
  fr->n_layers = 1;
  uint32_t lay_t[MAX_LIST];
  for (int i = 0; i < o->n_tokens; i++) {
    double per_call = expected_distinct(sh->E, sh->k, o->tokens[i]) * (double)eb;
    lay_t[i] = o->layers ? o->layers : (uint32_t)ceil(4.0 * llc / per_call);
    if (lay_t[i] < 1) lay_t[i] = 1;
    if (lay_t[i] > fr->n_layers) fr->n_layers = lay_t[i];
  }
  /* The expert pool: all E, or the largest pool whose expected loaded experts (per T: its
   * layers x the distinct experts of the calls on one layer; summed over T, an upper
   * bound of the union) fit in --max-gb. */
  const double budget = o->max_gb * 1e9;
  for (fr->pool = sh->E; fr->pool >= sh->k; fr->pool--) {
    double experts = 0.0;
    for (int i = 0; i < o->n_tokens; i++) {
      double calls_per_layer = ceil((repeats_for(o, o->tokens[i]) + 1.0) / lay_t[i]);
      experts += lay_t[i] * expected_distinct(fr->pool, sh->k, (uint32_t)(o->tokens[i] * calls_per_layer));
    }
    if (experts * (double)eb <= budget) break;
  }
  if (fr->pool < sh->k) {
    fprintf(stderr, "%s: experts of %.1f MB do not fit in --max-gb %.1f (need %u per layer)\n",
            kn_format_name(f), eb / 1e6, o->max_gb, sh->k);
    return -1;
  }
  /* Routing of every call of every T; the used experts of each layer. */
  int rc = -1;
  uint64_t rs = o->seed * 0x9E3779B97F4A7C15ull + 7;
  uint16_t *src = NULL;
  uint8_t *q8 = NULL; /* fp8: the quantized source expert */
  float *s8 = NULL;
  size_t ns8 = 0;
  uint8_t *used = calloc((size_t)fr->n_layers * sh->E, 1);
  fr->rt = calloc((size_t)o->n_tokens, sizeof *fr->rt);
  fr->layers = calloc(fr->n_layers, sizeof *fr->layers);
  if (!used || !fr->rt || !fr->layers) goto out_nomem;
  for (int ti = 0; ti < o->n_tokens; ti++) {
    routing *r = &fr->rt[ti];
    r->T = o->tokens[ti];
    r->calls = repeats_for(o, r->T) + 1;
    r->layers = lay_t[ti];
    size_t slots = (size_t)r->T * sh->k;
    r->ids = malloc(r->calls * slots * sizeof(int32_t));
    r->weights = malloc(slots * sizeof(float));
    if (!r->ids || !r->weights) goto out_nomem;
    for (size_t s = 0; s < slots; s++) r->weights[s] = 1.0f / sh->k;
    for (uint32_t c = 0; c < r->calls; c++) {
      uint32_t layer = c % r->layers;
      for (uint32_t t = 0; t < r->T; t++) {
        int32_t *ids = r->ids + c * slots + (size_t)t * sh->k;
        for (uint32_t j = 0; j < sh->k; j++) {
          int32_t id;
          bool dup;
          do { /* k distinct experts per token, uniform over the pool */
            id = (int32_t)(rng_next(&rs) % fr->pool);
            dup = false;
            for (uint32_t q = 0; q < j; q++) dup |= ids[q] == id;
          } while (dup);
          ids[j] = id;
          used[(size_t)layer * sh->E + id] = 1;
        }
      }
    }
  }
  /* Source weights: one random bf16 expert (values ~U(-0.05, 0.05)), loaded into every
   * used (layer, expert); the packed copies are distinct memory all the same. */
  size_t n = (size_t)sh->H * sh->I;
  src = malloc(3 * n * sizeof(uint16_t));
  if (!src) goto out_nomem;
  uint64_t ws = o->seed + 99;
  for (size_t i = 0; i < 3 * n; i++) {
    float v = ((float)(rng_next(&ws) >> 40) / 16777216.0f - 0.5f) * 0.1f;
    src[i] = mr_f32_to_bf16(v);
  }
  if (f == KN_FMT_FP8) { /* quantize once; load every copy from the codes */
    const size_t nb = (size_t)((sh->I + 127) / 128) * ((sh->H + 127) / 128);
    ns8 = nb;
    q8 = malloc(3 * n);
    s8 = malloc(3 * nb * sizeof(float));
    if (!q8 || !s8) goto out_nomem;
    for (int p = 0; p < 3; p++)
      if (kn_fp8_quantize_b128(src + p * n, MR_DTYPE_BF16, p == 2 ? sh->H : sh->I, p == 2 ? sh->I : sh->H,
                               q8 + p * n, s8 + p * nb, &e) != 0) {
        fprintf(stderr, "fp8: %s\n", e.msg);
        goto out_free;
      }
  }
  uint64_t t0 = mr_now_ns();
  uint32_t loaded = 0;
  for (uint32_t l = 0; l < fr->n_layers; l++) {
    if (kn_layer_new(&fr->layers[l], eng, &d, &e) != 0) {
      fprintf(stderr, "layer: %s\n", e.msg);
      goto out_free;
    }
    for (uint32_t x = 0; x < sh->E; x++) {
      if (!used[(size_t)l * sh->E + x]) continue;
      if (f == KN_FMT_FP8 ? kn_layer_load_expert_fp8(fr->layers[l], x, q8, s8, q8 + n, s8 + ns8, q8 + 2 * n,
                                                     s8 + 2 * ns8, &e) != 0
                          : kn_layer_load_expert(fr->layers[l], x, src, src + n, src + 2 * n, MR_DTYPE_BF16, &e) != 0) {
        fprintf(stderr, "load: %s\n", e.msg);
        goto out_free;
      }
      loaded++;
    }
    fr->loaded_bytes += kn_layer_bytes(fr->layers[l]);
  }
  fprintf(stderr, "# %s %s: up to %u layers, expert pool %u of %u, %u experts loaded (%.2f GB) in %.1f s\n",
          sh->name, kn_format_name(f), fr->n_layers, fr->pool, sh->E, loaded, fr->loaded_bytes / 1e9,
          (mr_now_ns() - t0) / 1e9);
  rc = 0;
  goto out_free;
out_nomem:
  fprintf(stderr, "%s: out of memory for routing or source weights (--tokens, --repeats)\n", kn_format_name(f));
out_free:
  free(src);
  free(q8);
  free(s8);
  free(used);
  return rc;
}

static void fmt_free(fmt_run *fr, int n_tokens) {
  for (uint32_t l = 0; l < fr->n_layers && fr->layers; l++) kn_layer_free(fr->layers[l]);
  free(fr->layers);
  for (int i = 0; i < n_tokens && fr->rt; i++) {
    free(fr->rt[i].ids);
    free(fr->rt[i].weights);
  }
  free(fr->rt);
}

typedef struct result {
  double us, us_min, weight_gbps, read_gbps, bw_ratio, tflops, weight_mb;
  uint32_t repeats;
} result;

static int run_case(const opts *o, kn_engine *eng, team *tm, const fmt_run *fr, const routing *rt,
                    const uint8_t *rbuf, size_t rbuf_bytes, result *res) {
  const shape *sh = o->sh;
  const uint32_t T = rt->T, k = sh->k, H = sh->H;
  const size_t slots = (size_t)T * k;
  uint16_t *x = malloc((size_t)T * H * sizeof(uint16_t)); /* bf16, as the client sends */
  float *out = malloc((size_t)T * H * sizeof(float));
  uint8_t *seen = calloc(sh->E, 1);
  double *us = malloc(rt->calls * sizeof(double)), *gbr = malloc(rt->calls * sizeof(double));
  double *bytes_v = malloc(rt->calls * sizeof(double));
  if (!x || !out || !seen || !us || !gbr || !bytes_v) return -1;
  uint64_t xs = o->seed + T;
  for (size_t i = 0; i < (size_t)T * H; i++)
    x[i] = mr_f32_to_bf16((float)(rng_next(&xs) >> 40) / 8388608.0f - 1.0f);
  /* The request's scratch arena, sized so that its first block holds a whole call
   * (kn_moe_forward needs about pairs * (2 H + I) floats plus the prepared inputs): the
   * page faults of growing it are a property of the caller's arena, not of the kernels. */
  mr_arena ar;
  mr_arena_init(&ar, (size_t)slots * (2 * (size_t)H + sh->I) * sizeof(float) * 3 / 2 + ((size_t)16 << 20));
  const int simd = kn__cpu_get()->best >= KN_ISA_AVX512 ? 2 : kn__cpu_get()->best >= KN_ISA_AVX2 ? 1 : 0;
  size_t roff = 0;
  int n = 0;
  mr_err e = {0};
  for (uint32_t c = 0; c < rt->calls; c++) {
    const kn_layer *L = fr->layers[c % rt->layers];
    const int32_t *ids = rt->ids + c * slots;
    memset(seen, 0, sh->E);
    uint32_t distinct = 0;
    for (size_t s = 0; s < slots; s++)
      if (!seen[ids[s]]) {
        seen[ids[s]] = 1;
        distinct++;
      }
    const double bytes = (double)distinct * (double)kn_layer_expert_bytes(L);
    kn_moe_args a = {.n_tokens = T, .top_k = k, .ids = ids, .weights = rt->weights, .x = x,
                     .x_dtype = MR_DTYPE_BF16, .out = out};
    uint64_t t0 = mr_now_ns();
    int rc = kn_moe_forward(eng, L, &a, &ar, &e);
    uint64_t dt = mr_now_ns() - t0;
    mr_arena_reset(&ar);
    if (rc != 0) {
      fprintf(stderr, "kn_moe_forward: %s\n", e.msg);
      return -1;
    }
    /* The read of the same bytes, right after, from the next part of the big buffer. */
    size_t rb = (size_t)bytes;
    if (rb > rbuf_bytes / 2) rb = rbuf_bytes / 2;
    rb &= ~(size_t)255;
    if (roff + rb > rbuf_bytes) roff = 0;
    read_job rj = {rbuf + roff, rb, simd};
    uint64_t rns = team_run(tm, read_fn, &rj);
    roff += rb;
    if (c == 0) continue; /* warm-up call */
    us[n] = dt / 1e3;
    gbr[n] = rb / (double)rns;
    bytes_v[n] = bytes;
    n++;
  }
  double bytes_med = median(bytes_v, n);
  double us_min = us[0];
  for (int i = 1; i < n; i++)
    if (us[i] < us_min) us_min = us[i];
  res->repeats = (uint32_t)n;
  res->us = median(us, n);
  res->us_min = us_min;
  res->weight_mb = bytes_med / 1e6;
  res->weight_gbps = bytes_med / (res->us * 1e3);
  res->read_gbps = median(gbr, n);
  res->bw_ratio = res->weight_gbps / res->read_gbps;
  res->tflops = 2.0 * 3.0 * (double)H * sh->I * T * k / (res->us * 1e-6) / 1e12;
  mr_arena_close(&ar);
  free(x);
  free(out);
  free(seen);
  free(us);
  free(gbr);
  free(bytes_v);
  return 0;
}

/* --streams: one thread reads 512 MiB as blocks of R consecutive rows of `row` bytes,
 * either side by side (64 bytes of row 0, of row 1, .., then the next 64 of row 0: what a
 * tile that loads every row per K step does) or one row after another (sequential). This
 * is what decided the loop orders of kernels/x86 (TILE_ORDER). */
__attribute__((target("avx512f"))) static double streams_read(const uint8_t *buf, size_t total,
                                                               uint32_t R, size_t row, bool side) {
  __m512i s = _mm512_setzero_si512();
  uint64_t t0 = mr_now_ns();
  for (size_t blk = 0; blk + R * row <= total; blk += R * row) {
    const uint8_t *p = buf + blk;
    if (side) {
      for (size_t k = 0; k < row; k += 64)
        for (uint32_t r = 0; r < R; r++) s = _mm512_add_epi64(s, _mm512_load_si512(p + r * row + k));
    } else {
      for (size_t k = 0; k < R * row; k += 64) s = _mm512_add_epi64(s, _mm512_load_si512(p + k));
    }
  }
  uint64_t ns = mr_now_ns() - t0;
  sink += hsum_u64(s);
  return (double)total / (double)ns;
}

static int streams_test(void) {
  if (kn__cpu_get()->best < KN_ISA_AVX512) {
    fprintf(stderr, "--streams needs AVX-512\n");
    return 1;
  }
  const size_t total = (size_t)512 << 20;
  uint8_t *buf = mr_malloc_aligned(total, 4096);
  if (!buf) return 1;
  memset(buf, 1, total);
  const uint32_t Rs[5] = {2, 4, 8, 16, 32};
  const size_t rows[3] = {1024, 2048, 4096};
  printf("# one thread, GB/s (best of 3), 512 MiB from DRAM\n%-10s %-4s %12s %12s\n", "row bytes", "R",
         "side-by-side", "one-by-one");
  for (int ri = 0; ri < 3; ri++)
    for (int i = 0; i < 5; i++) {
      double side = 0, seq = 0;
      for (int rep = 0; rep < 3; rep++) {
        side = fmax(side, streams_read(buf, total, Rs[i], rows[ri], true));
        seq = fmax(seq, streams_read(buf, total, Rs[i], rows[ri], false));
      }
      printf("%-10zu %-4u %12.1f %12.1f\n", rows[ri], Rs[i], side, seq);
    }
  mr_free_aligned(buf);
  return 0;
}

/* ---- --linear: dense layers --------------------------------------------------------- */

/* One shape and format: `n` packed copies of one random bf16 W (values ~U(-0.05, 0.05)). */
typedef struct lin_set {
  uint32_t N, K, n;
  kn_format f;
  kn_linear **lin;
  uint64_t bytes; /* kn_linear_bytes of one copy */
} lin_set;

static void lin_set_free(lin_set *ls) {
  for (uint32_t c = 0; c < ls->n && ls->lin; c++) kn_linear_free(ls->lin[c]);
  free(ls->lin);
  ls->lin = NULL;
}

static int lin_set_make(const opts *o, kn_engine *eng, uint32_t N, uint32_t K, kn_format f, lin_set *ls) {
  memset(ls, 0, sizeof *ls);
  ls->N = N;
  ls->K = K;
  ls->f = f;
  mr_err e = {0};
  kn_linear *probe = NULL;
  if (kn_linear_new(&probe, eng, N, K, f, o->group, &e) != 0) {
    fprintf(stderr, "linear %ux%u %s: %s\n", N, K, kn_format_name(f), e.msg);
    return -1;
  }
  ls->bytes = kn_linear_bytes(probe);
  kn_linear_free(probe);
  const double llc = o->llc_mb > 0 ? o->llc_mb * 1048576.0 : llc_bytes();
  ls->n = (uint32_t)ceil(4.0 * llc / (double)ls->bytes);
  if (ls->n < 1) ls->n = 1;
  if ((double)ls->n * ls->bytes > o->max_gb * 1e9) ls->n = (uint32_t)(o->max_gb * 1e9 / (double)ls->bytes);
  if (ls->n < 1) {
    fprintf(stderr, "linear %ux%u %s: %.1f MB does not fit in --max-gb %.1f\n", N, K, kn_format_name(f),
            ls->bytes / 1e6, o->max_gb);
    return -1;
  }
  const size_t nk = (size_t)N * K;
  uint16_t *src = malloc(nk * sizeof(uint16_t));
  ls->lin = calloc(ls->n, sizeof *ls->lin);
  if (!src || !ls->lin) {
    free(src);
    fprintf(stderr, "linear %ux%u: out of memory for the source weights\n", N, K);
    return -1;
  }
  uint64_t ws = o->seed + 99;
  for (size_t i = 0; i < nk; i++)
    src[i] = mr_f32_to_bf16(((float)(rng_next(&ws) >> 40) / 16777216.0f - 0.5f) * 0.1f);
  uint64_t t0 = mr_now_ns();
  int rc = 0;
  for (uint32_t c = 0; c < ls->n && rc == 0; c++) {
    rc = kn_linear_new(&ls->lin[c], eng, N, K, f, o->group, &e);
    if (rc == 0) rc = kn_linear_load_rows(ls->lin[c], 0, N, src, MR_DTYPE_BF16, &e);
    if (rc) fprintf(stderr, "linear %ux%u copy %u: %s\n", N, K, c, e.msg);
  }
  free(src);
  if (rc) return -1;
  fprintf(stderr, "# linear %ux%u %s: %u copies of %.2f MB loaded in %.1f s\n", N, K, kn_format_name(f), ls->n,
          ls->bytes / 1e6, (mr_now_ns() - t0) / 1e9);
  return 0;
}

typedef struct lin_result {
  double us, us_min, weight_gbps, read_gbps, bw_ratio, tflops;
  uint32_t repeats;
} lin_result;

/* One (set, engine, T) case: one warm-up pass over the copies, then `repeats` timed passes,
 * each followed by the plain read of the pass's bytes. */
static int lin_case(const opts *o, kn_engine *eng, team *tm, const lin_set *ls, uint32_t T, const uint8_t *rbuf,
                    size_t rbuf_bytes, lin_result *res) {
  const uint32_t reps = repeats_for(o, T);
  float *x = malloc((size_t)T * ls->K * sizeof(float)), *y = malloc((size_t)T * ls->N * sizeof(float));
  double *us = malloc((reps + 1) * sizeof(double)), *gbr = malloc((reps + 1) * sizeof(double));
  if (!x || !y || !us || !gbr) {
    fprintf(stderr, "linear %ux%u T=%u: out of memory for x / y\n", ls->N, ls->K, T);
    free(x), free(y), free(us), free(gbr);
    return -1;
  }
  uint64_t xs = o->seed + T;
  for (size_t i = 0; i < (size_t)T * ls->K; i++) x[i] = (float)(rng_next(&xs) >> 40) / 8388608.0f - 1.0f;
  memset(y, 0, (size_t)T * ls->N * sizeof(float)); /* fault y in before timing */
  mr_arena ar; /* sized so that its first block holds a call's scratch */
  mr_arena_init(&ar, (size_t)16 << 20);
  const int simd = kn__cpu_get()->best >= KN_ISA_AVX512 ? 2 : kn__cpu_get()->best >= KN_ISA_AVX2 ? 1 : 0;
  size_t roff = 0;
  int n = 0, rc = 0;
  mr_err e = {0};
  for (uint32_t r = 0; r <= reps && rc == 0; r++) {
    uint64_t t0 = mr_now_ns();
    for (uint32_t c = 0; c < ls->n && rc == 0; c++) {
      rc = kn_linear_forward(eng, ls->lin[c], T, x, y, &ar, &e);
      mr_arena_reset(&ar);
    }
    uint64_t dt = mr_now_ns() - t0;
    if (rc) {
      fprintf(stderr, "kn_linear_forward: %s\n", e.msg);
      break;
    }
    size_t rb = (size_t)((double)ls->bytes * ls->n);
    if (rb > rbuf_bytes / 2) rb = rbuf_bytes / 2;
    rb &= ~(size_t)255;
    if (roff + rb > rbuf_bytes) roff = 0;
    read_job rj = {rbuf + roff, rb, simd};
    uint64_t rns = team_run(tm, read_fn, &rj);
    roff += rb;
    if (r == 0) continue; /* warm-up pass */
    us[n] = dt / 1e3 / ls->n;
    gbr[n] = rb / (double)rns;
    n++;
  }
  if (rc == 0) {
    double us_min = us[0];
    for (int i = 1; i < n; i++) us_min = us[i] < us_min ? us[i] : us_min;
    res->repeats = (uint32_t)n;
    res->us = median(us, n);
    res->us_min = us_min;
    res->weight_gbps = (double)ls->bytes / (res->us * 1e3);
    res->read_gbps = median(gbr, n);
    res->bw_ratio = res->weight_gbps / res->read_gbps;
    res->tflops = 2.0 * ls->N * ls->K * (double)T / (res->us * 1e-6) / 1e12;
  }
  mr_arena_close(&ar);
  free(x);
  free(y);
  free(us);
  free(gbr);
  return rc ? -1 : 0;
}

/* Every (format, shape, isa, T) of --linear; returns the number of failed cases. */
static int linear_run(const opts *o, kn_engine *const *eng, kn_engine *any, team *tm, const uint8_t *rbuf,
                      size_t rbuf_bytes, double *peak, bool *peak_done, bool pinned) {
  int failures = 0;
  const uint32_t threads = kn_engine_threads(any);
  fprintf(stderr, "%-12s %-8s %-6s %-18s %5s %3s %4s %11s %9s %8s %8s %6s %8s %8s %6s\n", "linear", "format",
          "isa", "kernel", "T", "thr", "cp", "us", "weightMB", "wGB/s", "readGB/s", "bw", "TFLOP/s", "peak",
          "peak%");
  for (int fi = 0; fi < o->n_fmt; fi++) {
    const kn_format f = o->fmt[fi];
    const peak_kind pk = peak_for(f);
    if (!peak_done[pk]) {
      peak[pk] = peak_measure(tm, pk);
      peak_done[pk] = true;
    }
    char fname[24];
    if (f == KN_FMT_INT4)
      snprintf(fname, sizeof fname, "int4-g%u", o->group);
    else
      snprintf(fname, sizeof fname, "%s", kn_format_name(f));
    for (int si = 0; si < o->n_lin; si++) {
      lin_set ls;
      if (lin_set_make(o, any, o->lin_n[si], o->lin_k[si], f, &ls) != 0) {
        failures++;
        lin_set_free(&ls);
        continue;
      }
      char sname[32];
      snprintf(sname, sizeof sname, "%ux%u", ls.N, ls.K);
      for (int ii = 0; ii < o->n_isa; ii++) {
        if (!eng[ii]) continue;
        const char *kname = eng[ii]->kern[f]->name;
        const kn_isa isa_used = kn_engine_isa(eng[ii], f);
        for (int ti = 0; ti < o->n_tokens; ti++) {
          const uint32_t T = o->tokens[ti];
          lin_result r;
          if (lin_case(o, eng[ii], tm, &ls, T, rbuf, rbuf_bytes, &r) != 0) {
            failures++;
            continue;
          }
          const double pt = peak[pk] / 1e12, pr = pt > 0 ? r.tflops / pt : 0.0;
          fprintf(stderr, "%-12s %-8s %-6s %-18s %5u %3u %4u %11.1f %9.2f %8.2f %8.2f %6.3f %8.4f %8.4f %5.1f%%\n",
                  sname, fname, kn_isa_name(isa_used), kname, T, threads, ls.n, r.us, ls.bytes / 1e6,
                  r.weight_gbps, r.read_gbps, r.bw_ratio, r.tflops, pt, 100.0 * pr);
          if (o->json)
            printf("{\"mode\":\"linear\",\"shape\":\"%s\",\"n_out\":%u,\"n_in\":%u,\"format\":\"%s\",\"group\":%u,"
                   "\"isa\":\"%s\",\"kernel\":\"%s\",\"tokens\":%u,\"threads\":%u,\"caller_pinned\":%s,\"copies\":%u,\"repeats\":%u,"
                   "\"us\":%.2f,\"us_min\":%.2f,\"weight_mb\":%.3f,\"weight_gbps\":%.3f,\"read_gbps\":%.3f,"
                   "\"bw_ratio\":%.4f,\"tflops\":%.5f,\"peak_tflops\":%.5f,\"peak_kind\":\"%s\",\"peak_ratio\":%.4f}\n",
                   sname, ls.N, ls.K, kn_format_name(f), f == KN_FMT_INT4 ? o->group : 0, kn_isa_name(isa_used),
                   kname, T, threads, pinned ? "true" : "false", ls.n, r.repeats, r.us, r.us_min, ls.bytes / 1e6, r.weight_gbps, r.read_gbps,
                   r.bw_ratio, r.tflops, pt, peak_names[pk], pr);
          fflush(stdout);
        }
      }
      lin_set_free(&ls);
    }
  }
  return failures;
}

int main(int argc, char **argv) {
  opts o;
  if (parse_args(argc, argv, &o) != 0) return 2;
  if (o.streams) return streams_test();
  mr_err e = {0};
  const shape *sh = o.sh;
  int failures = 0;

  /* Engines: one per ISA asked for (refused ISAs are reported and skipped). */
  kn_engine *eng[MAX_LIST] = {0};
  for (int i = 0; i < o.n_isa; i++) {
    kn_engine_opts eo = {.isa = o.isa[i], .threads = o.threads};
    if (kn_engine_new(&eng[i], &eo, &e) != 0) {
      fprintf(stderr, "isa %s: %s\n", o.isa[i] == KN_ISA_COUNT ? "auto" : kn_isa_name(o.isa[i]), e.msg);
      failures++;
      continue;
    }
#if MR_HAVE_AVX512
    if (o.fp8_shift && eng[i]->fmt_isa[KN_FMT_FP8] == KN_ISA_AVX512) {
      kn__cpu c = *kn__cpu_get();
      c.avx512_vbmi = false;
      kn__kernel_table tab;
      memset(&tab, 0, sizeof tab);
      kn__avx512_register_cpu(&tab, &c);
      eng[i]->table.k[KN_FMT_FP8][KN_ISA_AVX512] = tab.k[KN_FMT_FP8][KN_ISA_AVX512];
    }
#endif
  }
  kn_engine *any = NULL;
  for (int i = 0; i < o.n_isa && !any; i++) any = eng[i];
  if (!any) return 1;
  /* What the start-up self-test of the fast kernels cost this process (once per process,
   * at the first engine; kernels/README.md "Start-up self-test"). */
  {
    const kn__selftest_report *rep = NULL;
    (void)kn__verified_table(&rep);
    if (o.json)
      printf("{\"mode\":\"selftest\",\"cpu\":\"%s\",\"kernels\":%u,\"refused\":%u,\"children\":%u,\"ms\":%.2f}\n",
             kn__cpu_get()->model, rep->tested, rep->refused, rep->children, rep->ms);
    else
      printf("start-up self-test: %u fast kernels, %u refused, %.2f ms (%u child process%s) on %s\n", rep->tested,
             rep->refused, rep->ms, rep->children, rep->children == 1 ? "" : "es", kn__cpu_get()->model);
  }
  const uint32_t threads = kn_engine_threads(any);

  team tm;
  team_start(&tm, (int)threads);
  double peak[PK_COUNT] = {0};
  bool peak_done[PK_COUNT] = {0};
  double amx_peak[KN_FMT_COUNT] = {0};

  /* The read buffer: 4x the LLC, at least 2x the bytes of the biggest call (capped). */
  const double llc = o.llc_mb > 0 ? o.llc_mb * 1048576.0 : llc_bytes();
  size_t rbuf_bytes = (size_t)(4.0 * llc) + (1u << 20);
  if (rbuf_bytes < ((size_t)1 << 30)) rbuf_bytes = (size_t)1 << 30; /* 2 x 512 MiB reads */
  uint8_t *rbuf = mr_malloc_aligned(rbuf_bytes, 4096);
  if (!rbuf) {
    fprintf(stderr, "out of memory for the %zu-byte read buffer\n", rbuf_bytes);
    return 1;
  }
  memset(rbuf, 1, rbuf_bytes);

  if (o.n_lin) {
    fprintf(stderr, "# moerpc-bench-kernels --linear: %d shape(s), %u thread(s), LLC %.0f MiB\n", o.n_lin, threads,
            llc / 1048576.0);
    /* The calling thread is worker 0: pinned to its core, the OS cannot park it on the
     * pool thread's core (which made whole passes 2-4x slower on the 2-core VM). */
    const bool pinned = kn_engine_pin_caller(any, &e) == 0;
    if (!pinned) fprintf(stderr, "# %s\n", e.msg);
    failures += linear_run(&o, eng, any, &tm, rbuf, rbuf_bytes, peak, peak_done, pinned);
    goto out_done;
  }
  fprintf(stderr, "# moerpc-bench-kernels: %s H=%u I=%u E=%u k=%u, %u thread(s), LLC %.0f MiB\n",
          sh->name, sh->H, sh->I, sh->E, sh->k, threads, llc / 1048576.0);
  fprintf(stderr, "%-14s %-6s %-6s %-18s %5s %3s %11s %9s %8s %8s %6s %8s %8s %6s %8s %6s\n", "shape", "format",
          "isa", "kernel", "T", "thr", "us", "weightMB", "wGB/s", "readGB/s", "bw", "TFLOP/s",
          "peak", "peak%", "roofline", "roof%");
  for (int fi = 0; fi < o.n_fmt; fi++) {
    kn_format f = o.fmt[fi];
    fmt_run fr;
    if (fmt_setup(&o, any, f, &fr) != 0) {
      failures++;
      fmt_free(&fr, o.n_tokens);
      continue;
    }
    peak_kind pk = peak_for(f);
    if (!peak_done[pk]) {
      peak[pk] = peak_measure(&tm, pk);
      peak_done[pk] = true;
    }
    amx_peak[f] = amx_peak_measure(&tm, f);
    if (amx_peak[f] > 0)
      fprintf(stderr, "# AMX tile peak for %s: %.3f TFLOP/s on %u thread(s)\n", kn_format_name(f), amx_peak[f] / 1e12,
              threads);
    for (int ii = 0; ii < o.n_isa; ii++) {
      if (!eng[ii]) continue;
      if (kn_engine_nodes(eng[ii]) != kn_engine_nodes(any)) {
        fprintf(stderr, "isa %s: engines disagree on nodes\n", kn_isa_name(o.isa[ii]));
        failures++;
        continue;
      }
      const char *kname = eng[ii]->kern[f]->name;
      kn_isa isa_used = kn_engine_isa(eng[ii], f);
      for (int ti = 0; ti < o.n_tokens; ti++) {
        result r;
        if (run_case(&o, eng[ii], &tm, &fr, &fr.rt[ti], rbuf, rbuf_bytes, &r) != 0) {
          failures++;
          continue;
        }
        double pt = peak[pk] / 1e12;
        double pr = pt > 0 ? r.tflops / pt : 0.0;
        /* the roofline: the case's ceiling (the tiles' for a case on tiles), or its bytes at
         * the plain read's rate (intensity x read_gbps = tflops / bw_ratio) */
        const double at = amx_peak[f] / 1e12;
        const double ceil_t = isa_used == KN_ISA_AMX && at > 0 ? at : pt;
        const double bw_t = r.bw_ratio > 0 ? r.tflops / r.bw_ratio : 0.0;
        const double roof = ceil_t > 0 && ceil_t < bw_t ? ceil_t : bw_t, rr = roof > 0 ? r.tflops / roof : 0.0;
        char atj[32];
        if (at > 0) snprintf(atj, sizeof atj, "%.5f", at);
        else snprintf(atj, sizeof atj, "null");
        char group[16] = "";
        if (f == KN_FMT_INT4) snprintf(group, sizeof group, "-g%u", o.group);
        char fname[24];
        snprintf(fname, sizeof fname, "%s%s", kn_format_name(f), group);
        fprintf(stderr, "%-14s %-6s %-6s %-18s %5u %3u %11.1f %9.1f %8.2f %8.2f %6.3f %8.4f %8.4f %5.1f%% %8.4f %5.1f%%\n",
                sh->name, fname, kn_isa_name(isa_used), kname, fr.rt[ti].T, threads, r.us, r.weight_mb,
                r.weight_gbps, r.read_gbps, r.bw_ratio, r.tflops, pt, 100.0 * pr, roof, 100.0 * rr);
        if (o.json)
          printf("{\"shape\":\"%s\",\"format\":\"%s\",\"group\":%u,\"isa\":\"%s\",\"kernel\":\"%s\","
                 "\"tokens\":%u,\"top_k\":%u,\"threads\":%u,\"layers\":%u,\"experts_pool\":%u,"
                 "\"repeats\":%u,\"us\":%.2f,\"us_min\":%.2f,\"weight_mb\":%.3f,\"weight_gbps\":%.3f,"
                 "\"read_gbps\":%.3f,\"bw_ratio\":%.4f,\"tflops\":%.5f,\"peak_tflops\":%.5f,"
                 "\"peak_kind\":\"%s\",\"peak_ratio\":%.4f,\"amx_peak_tflops\":%s,\"roofline_tflops\":%.5f,"
                 "\"roofline_ratio\":%.4f}\n",
                 sh->name, kn_format_name(f), f == KN_FMT_INT4 ? o.group : 0, kn_isa_name(isa_used), kname,
                 fr.rt[ti].T, sh->k, threads, fr.rt[ti].layers, fr.pool, r.repeats, r.us, r.us_min, r.weight_mb,
                 r.weight_gbps, r.read_gbps, r.bw_ratio, r.tflops, pt, peak_names[pk], pr, atj, roof, rr);
        fflush(stdout);
      }
    }
    fmt_free(&fr, o.n_tokens);
  }
out_done:
  team_stop(&tm);
  mr_free_aligned(rbuf);
  for (int i = 0; i < o.n_isa; i++) kn_engine_free(eng[i]);
  return failures ? 1 : 0;
}
