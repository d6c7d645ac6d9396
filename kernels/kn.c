/*
 * kn.c - the kernel engine: format and ISA names, ISA detection, engine and layer objects,
 * packing (conversion and quantization at load), request validation and kn_moe_forward.
 *
 * The per-slice arithmetic is not here: kn_moe_forward calls the kernel table of the engine
 * (internal.h section C), whose REF entries live in kn_ref.c and whose fast paths live in
 * kernels/x86/.
 */
#include "kernels/internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KN__X86 1
#else
#define KN__X86 0
#endif

#if MR_HAVE_NUMA
#include <numa.h>
#endif

/* ---- names ------------------------------------------------------------------------- */

static const char *const fmt_names[KN_FMT_COUNT] = {"f32", "f16", "bf16", "int8", "int4"};
static const char *const isa_names[KN_ISA_COUNT] = {"ref", "avx2", "avx512", "amx"};

const char *kn_format_name(kn_format f) {
  return (unsigned)f < KN_FMT_COUNT ? fmt_names[f] : "?";
}

int kn_format_parse(const char *s, kn_format *out) {
  if (!s) return MR_EINVAL;
  for (int f = 0; f < KN_FMT_COUNT; f++)
    if (strcmp(s, fmt_names[f]) == 0) {
      *out = (kn_format)f;
      return 0;
    }
  return MR_EINVAL;
}

void kn_format_wire_name(kn_format f, uint32_t group, char *buf, size_t len) {
  if (!buf || len == 0) return;
  if (f == KN_FMT_INT4)
    snprintf(buf, len, "int4-g%u", group);
  else
    snprintf(buf, len, "%s", kn_format_name(f));
}

const char *kn_isa_name(kn_isa isa) {
  return (unsigned)isa < KN_ISA_COUNT ? isa_names[isa] : "?";
}

int kn_isa_parse(const char *s, kn_isa *out) {
  if (!s) return MR_EINVAL;
  for (int i = 0; i < KN_ISA_COUNT; i++)
    if (strcmp(s, isa_names[i]) == 0) {
      *out = (kn_isa)i;
      return 0;
    }
  return MR_EINVAL;
}

/* ---- ISA detection ----------------------------------------------------------------- */

static kn__cpu cpu_info;
static pthread_once_t cpu_once = PTHREAD_ONCE_INIT;

#if KN__X86 && !defined(MR_FUZZ_NO_ISA)
/* XCR0 through XGETBV (only valid once cpuid says OSXSAVE). Written as bytes so that this
 * file needs no -mxsave. */
static uint64_t xgetbv0(void) {
  uint32_t lo, hi;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}
#define KN__ARCH_REQ_XCOMP_PERM 0x1023
#define KN__XFEATURE_XTILEDATA 18
#endif

static void cpu_detect(void) {
  kn__cpu *c = &cpu_info;
  memset(c, 0, sizeof *c);
  c->best = KN_ISA_REF;
#if KN__X86 && !defined(MR_FUZZ_NO_ISA)
  unsigned a, b, cx, d;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return;
  bool osxsave = (cx >> 27) & 1;
  bool avx = (cx >> 28) & 1;
  c->fma = (cx >> 12) & 1;
  c->f16c = (cx >> 29) & 1;
  unsigned max_leaf = __get_cpuid_max(0, NULL);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, cx, d);
    c->avx2 = (b >> 5) & 1;
    c->avx512f = (b >> 16) & 1;
    c->avx512dq = (b >> 17) & 1;
    c->avx512bw = (b >> 30) & 1;
    c->avx512vl = (b >> 31) & 1;
    c->avx512_vnni = (cx >> 11) & 1;
    c->amx_bf16 = (d >> 22) & 1;
    c->amx_tile = (d >> 24) & 1;
    c->amx_int8 = (d >> 25) & 1;
    unsigned max_sub = a;
    if (max_sub >= 1) {
      __cpuid_count(7, 1, a, b, cx, d);
      c->avx512_bf16 = (a >> 5) & 1;
    }
  }
  if (osxsave) {
    uint64_t xcr0 = xgetbv0();
    /* bit 1 SSE, 2 AVX (YMM upper halves); 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM; 17 XTILECFG,
     * 18 XTILEDATA. */
    c->os_avx = avx && (xcr0 & 0x6) == 0x6;
    c->os_avx512 = c->os_avx && (xcr0 & 0xe0) == 0xe0;
    c->os_amx = (xcr0 & (3u << 17)) == (3u << 17);
  }
  /* Linux hands out the (8 KiB) AMX tile state only to processes that ask for it; without
   * the permission the first tile instruction faults. Ask once, for the whole process. */
  if (c->amx_tile && c->os_amx)
    c->amx_perm = syscall(SYS_arch_prctl, KN__ARCH_REQ_XCOMP_PERM, KN__XFEATURE_XTILEDATA) == 0;
  if (c->os_avx && c->avx2 && c->fma && c->f16c) c->best = KN_ISA_AVX2;
  if (c->best == KN_ISA_AVX2 && c->os_avx512 && c->avx512f && c->avx512bw && c->avx512vl &&
      c->avx512dq)
    c->best = KN_ISA_AVX512;
  if (c->best == KN_ISA_AVX512 && c->amx_tile && c->amx_bf16 && c->amx_int8 && c->amx_perm)
    c->best = KN_ISA_AMX;
#endif
}

const kn__cpu *kn__cpu_get(void) {
  pthread_once(&cpu_once, cpu_detect);
  return &cpu_info;
}

kn_isa kn_isa_detect(void) { return kn__cpu_get()->best; }

/* Why the CPU cannot run isa, for the error of a forced ISA. */
static const char *isa_missing(const kn__cpu *c, kn_isa isa) {
  if (!c->os_avx) return "no AVX, or the OS does not enable the AVX state (XCR0)";
  if (!(c->avx2 && c->fma && c->f16c)) return "it lacks AVX2, FMA or F16C";
  if (isa == KN_ISA_AVX2) return "?";
  if (!(c->avx512f && c->avx512bw && c->avx512vl && c->avx512dq))
    return "it lacks AVX-512 F/BW/VL/DQ";
  if (!c->os_avx512) return "the OS does not enable the AVX-512 state (XCR0)";
  if (isa == KN_ISA_AVX512) return "?";
  if (!(c->amx_tile && c->amx_bf16 && c->amx_int8)) return "it lacks AMX-TILE/BF16/INT8";
  if (!c->os_amx) return "the OS does not enable the AMX tile state (XCR0)";
  if (!c->amx_perm) return "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) was refused";
  return "?";
}

/* ---- engine ------------------------------------------------------------------------ */

/* The registration function of every ISA built into this binary. Phase 2 adds
 * { KN_ISA_AVX2, kn__avx2_register } etc. here under #if MR_HAVE_AVX2 (and so on), never
 * in a build with MR_FUZZ_NO_ISA, which leaves the ISA files out. */
static const struct {
  kn_isa isa;
  void (*reg)(kn__kernel_table *t);
} registrations[] = {
    {KN_ISA_REF, kn__ref_register},
};

/* Fills eng->n_nodes / node[] from opts->force_split or opts->numa. */
static int engine_nodes(kn_engine *eng, const kn_engine_opts *o, mr_err *e) {
  uint32_t avail[KN_MAX_NODES];
  uint32_t n_avail = 0;
#if MR_HAVE_NUMA
  if (numa_available() >= 0) {
    int maxn = numa_max_node();
    for (int n = 0; n <= maxn && n_avail < KN_MAX_NODES; n++)
      if (numa_bitmask_isbitset(numa_all_nodes_ptr, (unsigned)n)) avail[n_avail++] = (uint32_t)n;
  }
#endif
  if (n_avail == 0) avail[n_avail++] = 0; /* no libnuma or no NUMA: one node, id 0 */

  if (o && o->force_split > 0) {
    if (o->force_split > KN_MAX_NODES)
      return mr_err_set(e, MR_EINVAL, "force_split = %u, must be in 0..%u", o->force_split,
                        KN_MAX_NODES);
    /* Pretend nodes: the slices are cut as on a host with force_split nodes, all of them
     * on the first real node. */
    eng->n_nodes = o->force_split;
    for (uint32_t s = 0; s < eng->n_nodes; s++) eng->node[s] = avail[0];
    eng->forced_split = true;
    return 0;
  }
  const char *spec = (o && o->numa) ? o->numa : "auto";
  if (strcmp(spec, "auto") == 0 || spec[0] == '\0') {
    eng->n_nodes = n_avail;
    memcpy(eng->node, avail, n_avail * sizeof avail[0]);
    return 0;
  }
  if (strchr(spec, ',') == NULL) { /* a count: the first n available nodes */
    char *end;
    errno = 0;
    unsigned long n = strtoul(spec, &end, 10);
    if (*end == '\0' && errno == 0 && end != spec) {
      if (n < 1 || n > n_avail)
        return mr_err_set(e, MR_EINVAL, "numa = \"%s\": node count must be in 1..%u (nodes on this host)",
                          spec, n_avail);
      eng->n_nodes = (uint32_t)n;
      memcpy(eng->node, avail, n * sizeof avail[0]);
      return 0;
    }
  }
  /* A list "0,1" (a single "3" was taken as a count above; write "3," for node 3 alone). */
  uint32_t n = 0;
  const char *p = spec;
  while (*p) {
    char *end;
    errno = 0;
    unsigned long id = strtoul(p, &end, 10);
    if (end == p || errno != 0 || (*end != ',' && *end != '\0'))
      return mr_err_set(e, MR_EINVAL,
                        "numa = \"%s\": expected \"auto\", a node count or a node list like \"0,1\"",
                        spec);
    bool ok = false;
    for (uint32_t i = 0; i < n_avail; i++) ok |= avail[i] == id;
    if (!ok) return mr_err_set(e, MR_EINVAL, "numa = \"%s\": node %lu is not available on this host", spec, id);
    for (uint32_t i = 0; i < n; i++)
      if (eng->node[i] == id) return mr_err_set(e, MR_EINVAL, "numa = \"%s\": node %lu listed twice", spec, id);
    if (n == KN_MAX_NODES)
      return mr_err_set(e, MR_EINVAL, "numa = \"%s\": more than %u nodes", spec, KN_MAX_NODES);
    eng->node[n++] = (uint32_t)id;
    p = *end == ',' ? end + 1 : end;
  }
  if (n == 0) return mr_err_set(e, MR_EINVAL, "numa = \"%s\": empty node list", spec);
  eng->n_nodes = n;
  return 0;
}

int kn_engine_new(kn_engine **out, const kn_engine_opts *opts, mr_err *e) {
  int rc;
  *out = NULL;
  kn_engine *eng = mr_calloc(1, sizeof *eng);
  if (!eng) return mr_err_set(e, MR_ENOMEM, "kn_engine_new: out of memory");

  const kn__cpu *cpu = kn__cpu_get();
  kn_isa want = opts ? opts->isa : KN_ISA_COUNT;
  const char *want_from = "isa";
  const char *env = getenv("MOERPC_ISA");
  if (env && *env && strcmp(env, "auto") != 0) {
    if (kn_isa_parse(env, &want) != 0) {
      rc = mr_err_set(e, MR_EINVAL, "MOERPC_ISA = \"%s\": must be ref, avx2, avx512, amx or auto", env);
      goto out_free_eng;
    }
    want_from = "MOERPC_ISA";
  } else if (env && strcmp(env, "auto") == 0) {
    want = KN_ISA_COUNT;
  }
  if (want == KN_ISA_COUNT) {
    want = cpu->best;
  } else if ((unsigned)want > KN_ISA_COUNT) {
    rc = mr_err_set(e, MR_EINVAL, "isa = %d: must be below %d", (int)want, KN_ISA_COUNT);
    goto out_free_eng;
  } else if (want > cpu->best) {
    rc = mr_err_set(e, MR_ENOTSUP, "%s = %s: this CPU/OS cannot run it (%s); best available is %s",
                    want_from, kn_isa_name(want), isa_missing(cpu, want), kn_isa_name(cpu->best));
    goto out_free_eng;
  }
  eng->isa = want;

  if (opts && opts->threads > 4096) {
    rc = mr_err_set(e, MR_EINVAL, "threads = %u, must be in 0..4096", opts->threads);
    goto out_free_eng;
  }
  eng->threads = opts ? opts->threads : 0;
  rc = engine_nodes(eng, opts, e);
  if (rc) goto out_free_eng;

  for (size_t i = 0; i < sizeof registrations / sizeof registrations[0]; i++)
    if (registrations[i].isa <= eng->isa) registrations[i].reg(&eng->table);
  for (int f = 0; f < KN_FMT_COUNT; f++) {
    int i = eng->isa;
    while (i > KN_ISA_REF && !eng->table.k[f][i].gate_up) i--;
    MR_ASSERT(eng->table.k[f][i].gate_up && eng->table.k[f][i].down &&
              eng->table.k[f][i].tmp_floats);
    eng->fmt_isa[f] = (kn_isa)i;
    eng->kern[f] = &eng->table.k[f][i];
  }
  mr_arena_init(&eng->scratch, 4u << 20);
  mr_log(MR_LOG_DEBUG, "kn engine: isa %s (cpu best %s), %u node slice(s)%s", kn_isa_name(eng->isa),
         kn_isa_name(cpu->best), eng->n_nodes, eng->forced_split ? " (forced split)" : "");
  *out = eng;
  return 0;

out_free_eng:
  mr_free(eng);
  return rc;
}

void kn_engine_free(kn_engine *eng) {
  if (!eng) return;
  mr_arena_close(&eng->scratch);
  mr_free(eng);
}

kn_isa kn_engine_isa(const kn_engine *eng, kn_format f) {
  return (unsigned)f < KN_FMT_COUNT ? eng->fmt_isa[f] : KN_ISA_REF;
}

/* Phase 1 computes on the thread that calls kn_moe_forward; the worker pool that honours
 * opts->threads comes with the NUMA placement. */
uint32_t kn_engine_threads(const kn_engine *eng) {
  (void)eng;
  return 1;
}

uint32_t kn_engine_nodes(const kn_engine *eng) { return eng->n_nodes; }

/* ---- packing ----------------------------------------------------------------------- */

size_t kn__row_bytes(kn_format f, uint32_t K, uint32_t G) {
  switch (f) {
    case KN_FMT_F32: return (size_t)K * 4;
    case KN_FMT_F16:
    case KN_FMT_BF16: return (size_t)K * 2;
    case KN_FMT_INT8: return K;
    case KN_FMT_INT4: return (size_t)kn__ngroups(K, G) * G / 2;
    default: MR_ASSERT(!"kn__row_bytes: bad format");
  }
  return 0;
}

/* Scales of one row of K elements. */
static size_t row_scales(kn_format f, uint32_t K, uint32_t G) {
  if (f == KN_FMT_INT8) return 1;
  if (f == KN_FMT_INT4) return kn__ngroups(K, G);
  return 0;
}

static size_t align_up(size_t n) { return (n + KN_PACK_ALIGN - 1) & ~(size_t)(KN_PACK_ALIGN - 1); }

/* Byte offsets of the six arrays of a slice inside its block (section A of internal.h). */
typedef struct slice_layout {
  size_t gate, up, down, gate_scale, up_scale, down_scale, total;
} slice_layout;

static slice_layout slice_layout_of(const kn_layer *L, uint32_t s) {
  kn_format f = L->d.format;
  uint32_t H = L->d.hidden, Is = L->slice_len[s], G = L->d.group;
  size_t gu = (size_t)Is * kn__row_bytes(f, H, G);
  size_t dn = (size_t)H * kn__row_bytes(f, Is, G);
  size_t gus = (size_t)Is * row_scales(f, H, G) * sizeof(float);
  size_t dns = (size_t)H * row_scales(f, Is, G) * sizeof(float);
  slice_layout l;
  l.gate = 0;
  l.up = align_up(l.gate + gu);
  l.down = align_up(l.up + gu);
  l.gate_scale = align_up(l.down + dn);
  l.up_scale = align_up(l.gate_scale + gus);
  l.down_scale = align_up(l.up_scale + gus);
  l.total = align_up(l.down_scale + dns);
  return l;
}

void kn__split_inter(uint32_t I, uint32_t n, uint32_t unit, uint32_t *off, uint32_t *len) {
  MR_ASSERT(n >= 1 && unit >= 1);
  /* units = ceil(I / unit); only the very last unit may be short. */
  uint32_t units = (I + unit - 1) / unit, base = units / n, rem = units % n, u = 0;
  for (uint32_t s = 0; s < n; s++) {
    uint32_t nu = base + (s < rem ? 1u : 0u);
    uint64_t b = (uint64_t)u * unit, end = (uint64_t)(u + nu) * unit;
    if (b > I) b = I;
    if (end > I) end = I;
    off[s] = (uint32_t)b;
    len[s] = (uint32_t)(end - b);
    u += nu;
  }
  MR_ASSERT(off[n - 1] + len[n - 1] == I);
}

float kn__amax(const float *src, uint32_t n) {
  float amax = 0.0f;
  for (uint32_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(src[i]));
  return amax;
}

void kn__quant_row_int8(const float *src, uint32_t n, float scale, int8_t *dst) {
  for (uint32_t i = 0; i < n; i++) {
    /* scale == 0 also covers amax so small that amax / 127 underflows: those rows are 0. */
    float q = scale > 0.0f ? nearbyintf(src[i] / scale) : 0.0f;
    dst[i] = (int8_t)fminf(fmaxf(q, -127.0f), 127.0f);
  }
}

void kn__quant_row_int4(const float *src, uint32_t K, uint32_t G, uint8_t *dst, float *scale) {
  uint32_t ng = kn__ngroups(K, G);
  memset(dst, 0, (size_t)ng * G / 2);
  for (uint32_t g = 0; g < ng; g++) {
    uint32_t k0 = g * G, k1 = k0 + G < K ? k0 + G : K;
    float amax = 0.0f;
    for (uint32_t k = k0; k < k1; k++) amax = fmaxf(amax, fabsf(src[k]));
    float sc = amax / 7.0f;
    scale[g] = sc;
    for (uint32_t k = k0; k < k1; k++) {
      float q = sc > 0.0f ? nearbyintf(src[k] / sc) : 0.0f;
      int v = (int)fminf(fmaxf(q, -7.0f), 7.0f);
      uint8_t nib = (uint8_t)(v & 0xf);
      dst[k / 2] |= (k & 1) ? (uint8_t)(nib << 4) : nib;
    }
  }
}

/* Stores one fp32 row of K elements in format f at dst (+ its scales at scale). For INT8,
 * int8_scale is the row's scale (amax of the full HF row / 127, see load_expert). */
static void pack_row(kn_format f, uint32_t G, const float *src, uint32_t K, float int8_scale,
                     void *dst, float *scale) {
  switch (f) {
    case KN_FMT_F32: memcpy(dst, src, (size_t)K * 4); break;
    case KN_FMT_F16: mr_convert_from_f32(dst, MR_DTYPE_F16, src, K); break;
    case KN_FMT_BF16: mr_convert_from_f32(dst, MR_DTYPE_BF16, src, K); break;
    case KN_FMT_INT8:
      *scale = int8_scale;
      kn__quant_row_int8(src, K, int8_scale, dst);
      break;
    case KN_FMT_INT4: kn__quant_row_int4(src, K, G, dst, scale); break;
    default: MR_ASSERT(!"pack_row: bad format");
  }
}

/* ---- layer ------------------------------------------------------------------------- */

int kn_layer_new(kn_layer **out, kn_engine *eng, const kn_layer_desc *d, mr_err *e) {
  *out = NULL;
  if (!eng || !d) return mr_err_set(e, MR_EINVAL, "kn_layer_new: engine and desc are required");
  if (d->hidden < 1 || d->hidden > KN_MAX_DIM)
    return mr_err_set(e, MR_EINVAL, "hidden = %u, must be in 1..%u", d->hidden, KN_MAX_DIM);
  if (d->inter < 1 || d->inter > KN_MAX_DIM)
    return mr_err_set(e, MR_EINVAL, "inter = %u, must be in 1..%u", d->inter, KN_MAX_DIM);
  if (d->num_experts < 1 || d->num_experts > KN_MAX_EXPERTS)
    return mr_err_set(e, MR_EINVAL, "num_experts = %u, must be in 1..%u", d->num_experts,
                      KN_MAX_EXPERTS);
  if ((unsigned)d->format >= KN_FMT_COUNT)
    return mr_err_set(e, MR_EINVAL, "format = %d, must be below %d", (int)d->format, KN_FMT_COUNT);
  if (d->format == KN_FMT_INT4 && d->group != 32 && d->group != 64 && d->group != 128)
    return mr_err_set(e, MR_EINVAL, "group = %u, must be 32, 64 or 128 for int4", d->group);

  kn_layer *L = mr_calloc(1, sizeof *L);
  if (!L) return mr_err_set(e, MR_ENOMEM, "kn_layer_new: out of memory");
  L->d = *d;
  if (d->format != KN_FMT_INT4) L->d.group = 0;
  L->n_slices = eng->n_nodes;
  memcpy(L->node, eng->node, sizeof L->node);
  /* INT4 slices are cut at whole groups, so that the groups of the down matrix are the
   * same (in HF column coordinates) for any slice count and the packed values do not
   * depend on it. */
  uint32_t unit = KN_SLICE_ALIGN;
  if (d->format == KN_FMT_INT4 && d->group > unit) unit = d->group;
  kn__split_inter(d->inter, L->n_slices, unit, L->slice_off, L->slice_len);
  for (uint32_t s = 0; s < L->n_slices; s++) {
    if (L->slice_len[s] > L->max_slice_len) L->max_slice_len = L->slice_len[s];
    if (L->slice_len[s]) L->expert_bytes += slice_layout_of(L, s).total;
  }
  L->w = mr_calloc(d->num_experts, sizeof *L->w);
  L->owned = mr_calloc((d->num_experts + 63) / 64, sizeof *L->owned);
  if (!L->w || !L->owned) {
    kn_layer_free(L);
    return mr_err_set(e, MR_ENOMEM, "kn_layer_new: out of memory for %u experts", d->num_experts);
  }
  *out = L;
  return 0;
}

static void slices_free(kn__slice_w *w, uint32_t n) {
  if (!w) return;
  for (uint32_t s = 0; s < n; s++) mr_free_aligned(w[s].mem);
  mr_free(w);
}

void kn_layer_free(kn_layer *L) {
  if (!L) return;
  if (L->w)
    for (uint32_t x = 0; x < L->d.num_experts; x++) slices_free(L->w[x], L->n_slices);
  mr_free(L->w);
  mr_free(L->owned);
  mr_free(L);
}

static const char *const proj_names[3] = {"gate", "up", "down"};

/* Converts K source elements to fp32 at dst and refuses non-finite values: a NaN or inf
 * weight would silently poison every token routed to the expert. */
static int load_row(float *dst, const void *src, mr_dtype dt, size_t elem_off, uint32_t K,
                    uint32_t expert, kn__proj p, uint32_t row, uint32_t col0, mr_err *e) {
  mr_convert_to_f32(dst, (const char *)src + elem_off * mr_dtype_size(dt), dt, K);
  for (uint32_t k = 0; k < K; k++)
    if (!isfinite(dst[k]))
      return mr_err_set(e, MR_EINVAL, "expert %u %s[%u, %u] = %g: weights must be finite", expert,
                        proj_names[p], row, col0 + k, (double)dst[k]);
  return 0;
}

int kn_layer_load_expert(kn_layer *L, uint32_t expert, const void *gate, const void *up,
                         const void *down, mr_dtype src, mr_err *e) {
  int rc = 0;
  if (!L || !gate || !up || !down)
    return mr_err_set(e, MR_EINVAL, "kn_layer_load_expert: layer, gate, up and down are required");
  if (expert >= L->d.num_experts)
    return mr_err_set(e, MR_ERANGE, "expert = %u, must be below num_experts = %u", expert,
                      L->d.num_experts);
  if (src != MR_DTYPE_F32 && src != MR_DTYPE_F16 && src != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "src dtype = %d, must be f32, f16 or bf16", (int)src);

  const uint32_t H = L->d.hidden, I = L->d.inter, G = L->d.group;
  const kn_format f = L->d.format;
  kn__slice_w *w = mr_calloc(L->n_slices, sizeof *w);
  float *row = mr_malloc((size_t)(H > I ? H : I) * sizeof(float));
  if (!w || !row) {
    rc = mr_err_set(e, MR_ENOMEM, "expert %u: out of memory", expert);
    goto out_free;
  }
  uint64_t bytes = 0;
  for (uint32_t s = 0; s < L->n_slices; s++) {
    const uint32_t off = L->slice_off[s], Is = L->slice_len[s];
    if (Is == 0) continue;
    slice_layout lay = slice_layout_of(L, s);
    char *mem = mr_malloc_aligned(lay.total, KN_PACK_ALIGN);
    if (!mem) {
      rc = mr_err_set(e, MR_ENOMEM, "expert %u slice %u: out of memory for %zu bytes", expert, s,
                      lay.total);
      goto out_free;
    }
    kn__slice_w *ws = &w[s];
    ws->mem = mem;
    ws->mem_bytes = lay.total;
    ws->gate = mem + lay.gate;
    ws->up = mem + lay.up;
    ws->down = mem + lay.down;
    bool scaled = f == KN_FMT_INT8 || f == KN_FMT_INT4;
    ws->gate_scale = scaled ? (float *)(mem + lay.gate_scale) : NULL;
    ws->up_scale = scaled ? (float *)(mem + lay.up_scale) : NULL;
    ws->down_scale = scaled ? (float *)(mem + lay.down_scale) : NULL;
    bytes += lay.total;

    const size_t rb_h = kn__row_bytes(f, H, G), rb_i = kn__row_bytes(f, Is, G);
    const size_t sc_h = row_scales(f, H, G), sc_i = row_scales(f, Is, G);
    for (uint32_t i = 0; i < Is; i++) {
      const void *srcs[2] = {gate, up};
      void *dsts[2] = {ws->gate, ws->up};
      float *scs[2] = {ws->gate_scale, ws->up_scale};
      for (int p = 0; p < 2; p++) {
        rc = load_row(row, srcs[p], src, (size_t)(off + i) * H, H, expert, (kn__proj)p, off + i, 0, e);
        if (rc) goto out_free;
        pack_row(f, G, row, H, kn__amax(row, H) / 127.0f, (char *)dsts[p] + i * rb_h,
                 scs[p] ? scs[p] + i * sc_h : NULL);
      }
    }
    for (uint32_t j = 0; j < H; j++) {
      /* The INT8 scale of a down row is that of the whole HF row (all I columns), not of
       * the slice's band, so that the packed values do not depend on the slice count and
       * a layer gives the same result on any number of nodes (DESIGN.md section 5). */
      float s8 = 0.0f;
      if (f == KN_FMT_INT8) {
        rc = load_row(row, down, src, (size_t)j * I, I, expert, KN__DOWN, j, 0, e);
        if (rc) goto out_free;
        s8 = kn__amax(row, I) / 127.0f;
      }
      rc = load_row(row, down, src, (size_t)j * I + off, Is, expert, KN__DOWN, j, off, e);
      if (rc) goto out_free;
      pack_row(f, G, row, Is, s8, (char *)ws->down + j * rb_i,
               ws->down_scale ? ws->down_scale + j * sc_i : NULL);
    }
  }
  MR_ASSERT(bytes == L->expert_bytes);

  /* Reloading an expert replaces it; the layer must not be in use meanwhile (kn.h). */
  if (L->w[expert]) {
    slices_free(L->w[expert], L->n_slices);
    L->bytes -= L->expert_bytes;
  } else {
    L->owned[expert >> 6] |= 1ull << (expert & 63);
    L->n_owned++;
  }
  L->w[expert] = w;
  L->bytes += bytes;
  w = NULL;

out_free:
  mr_free(row);
  slices_free(w, L->n_slices);
  return rc;
}

bool kn_layer_has_expert(const kn_layer *L, uint32_t expert) { return kn__layer_owns(L, expert); }
const kn_layer_desc *kn_layer_get_desc(const kn_layer *L) { return &L->d; }
uint64_t kn_layer_bytes(const kn_layer *L) { return L->bytes; }
uint64_t kn_layer_expert_bytes(const kn_layer *L) { return L->expert_bytes; }

/* ---- forward ----------------------------------------------------------------------- */

int kn__moe_validate(const kn_layer *L, const kn_moe_args *a, mr_err *e) {
  if (!L || !a) return mr_err_set(e, MR_EINVAL, "kn_moe_forward: layer and args are required");
  if (a->n_tokens == 0) return 0;
  if (a->top_k < 1 || a->top_k > KN_MAX_TOP_K)
    return mr_err_set(e, MR_EINVAL, "top_k = %u, must be in 1..%u", a->top_k, KN_MAX_TOP_K);
  if (a->x_dtype != MR_DTYPE_F32 && a->x_dtype != MR_DTYPE_F16 && a->x_dtype != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL, "x_dtype = %d, must be f32, f16 or bf16", (int)a->x_dtype);
  if (!a->ids || !a->weights || !a->x || !a->out)
    return mr_err_set(e, MR_EINVAL, "kn_moe_forward: ids, weights, x and out are required");
  const uint32_t E = L->d.num_experts, k = a->top_k;
  for (uint32_t t = 0; t < a->n_tokens; t++)
    for (uint32_t j = 0; j < k; j++) {
      int32_t id = a->ids[(size_t)t * k + j];
      if (id == -1) continue;
      if (id < -1 || (uint32_t)id >= E)
        return mr_err_set(e, MR_ERANGE,
                          "expert_ids[token %u, slot %u] = %d, must be -1 (empty) or in 0..%u",
                          t, j, id, E - 1);
      if (!kn__layer_owns(L, (uint32_t)id))
        return mr_err_set(e, MR_EPRECOND, "expert %d (token %u, slot %u) is not held here", id, t, j);
      /* A NaN or inf routing weight would turn the token's whole output row into NaN; the
       * router never produces one, so it is a broken or hostile peer. */
      float w = a->weights[(size_t)t * k + j];
      if (!isfinite(w))
        return mr_err_set(e, MR_EINVAL, "weights[token %u, slot %u] = %g, must be finite", t, j,
                          (double)w);
    }
  return 0;
}

#define ARENA_ALLOC(var, count)                                                              \
  do {                                                                                       \
    (var) = mr_arena_alloc(ar, (size_t)(count) * sizeof *(var) + 1, KN_PACK_ALIGN);          \
    if (!(var)) {                                                                            \
      rc = mr_err_set(e, MR_ENOMEM, "kn_moe_forward: out of scratch memory (%s, %zu bytes)", \
                      #var, (size_t)(count) * sizeof *(var));                                \
      goto out_reset;                                                                        \
    }                                                                                        \
  } while (0)

int kn_moe_forward(kn_engine *eng, const kn_layer *L, const kn_moe_args *a, mr_arena *scratch,
                   mr_err *e) {
  if (!eng) return mr_err_set(e, MR_EINVAL, "kn_moe_forward: engine is required");
  int rc = kn__moe_validate(L, a, e);
  if (rc) return rc;
  const uint32_t T = a->n_tokens, k = a->top_k, H = L->d.hidden, E = L->d.num_experts;
  if (T == 0) return 0;
  const kn__kernel *kern = eng->kern[L->d.format];
  mr_arena *ar = scratch ? scratch : &eng->scratch;
  const size_t TH = (size_t)T * H, pairs = (size_t)T * k;

  /* Counting sort of the (token, slot) pairs by expert: start[x]..start[x+1] are the pairs
   * of expert x, in token order. */
  uint32_t *start, *cur, *tok;
  float *wt;
  ARENA_ALLOC(start, (size_t)E + 1);
  ARENA_ALLOC(cur, E);
  ARENA_ALLOC(tok, pairs);
  ARENA_ALLOC(wt, pairs);
  memset(start, 0, ((size_t)E + 1) * sizeof *start);
  for (size_t p = 0; p < pairs; p++)
    if (a->ids[p] >= 0) start[a->ids[p] + 1]++;
  uint32_t max_n = 0;
  for (uint32_t x = 0; x < E; x++) {
    if (start[x + 1] > max_n) max_n = start[x + 1];
    start[x + 1] += start[x];
  }
  memcpy(cur, start, (size_t)E * sizeof *cur);
  for (size_t p = 0; p < pairs; p++) {
    int32_t id = a->ids[p];
    if (id < 0) continue;
    uint32_t at = cur[id]++;
    tok[at] = (uint32_t)(p / k);
    wt[at] = a->weights[p];
  }

  /* fp32 inputs, and one fp32 partial output per slice: slice 0 accumulates straight into
   * out, slice s > 0 into its own buffer, summed into out at the end. On a NUMA host the
   * partial of slice s is the one node s writes (phase 2). */
  const float *xf = a->x;
  if (a->x_dtype != MR_DTYPE_F32) {
    float *xc;
    ARENA_ALLOC(xc, TH);
    mr_convert_to_f32(xc, a->x, a->x_dtype, TH);
    xf = xc;
  }
  float *part[KN_MAX_NODES];
  part[0] = a->out;
  memset(a->out, 0, TH * sizeof(float));
  for (uint32_t s = 1; s < L->n_slices; s++) {
    part[s] = NULL;
    if (L->slice_len[s] == 0 || max_n == 0) continue;
    ARENA_ALLOC(part[s], TH);
    memset(part[s], 0, TH * sizeof(float));
  }
  if (max_n == 0) goto out_reset; /* every slot empty: out is zero */

  /* Per-expert buffers, sized for the most tokens any expert gets. */
  size_t tmp_n = 0, xq_n = 0;
  for (uint32_t s = 0; s < L->n_slices; s++) {
    size_t t = kern->tmp_floats(L, s, max_n);
    if (t > tmp_n) tmp_n = t;
  }
  if (kern->prep) xq_n = kern->prep_bytes(L, max_n);
  float *xg, *h, *y, *tmp;
  unsigned char *xq = NULL;
  ARENA_ALLOC(xg, (size_t)max_n * H);
  ARENA_ALLOC(h, (size_t)max_n * L->max_slice_len);
  ARENA_ALLOC(y, (size_t)max_n * H);
  ARENA_ALLOC(tmp, tmp_n);
  if (kern->prep) ARENA_ALLOC(xq, xq_n);

  for (uint32_t x = 0; x < E; x++) {
    const uint32_t n = start[x + 1] - start[x];
    if (n == 0) continue;
    const uint32_t *tx = tok + start[x];
    const float *wx = wt + start[x];
    for (uint32_t r = 0; r < n; r++) memcpy(xg + (size_t)r * H, xf + (size_t)tx[r] * H, H * sizeof(float));
    for (uint32_t s = 0; s < L->n_slices; s++) {
      if (L->slice_len[s] == 0) continue;
      kn__task task = {.L = L, .slice = s, .w = &L->w[x][s], .n = n, .x = xg, .xq = xq,
                       .h = h, .y = y, .tmp = tmp};
      if (kern->prep) kern->prep(L, n, xg, xq);
      kern->gate_up(&task, 0, L->slice_len[s]);
      kern->down(&task, 0, H);
      float *P = part[s];
      for (uint32_t r = 0; r < n; r++) {
        float *o = P + (size_t)tx[r] * H;
        const float *yr = y + (size_t)r * H, wr = wx[r];
        for (uint32_t j = 0; j < H; j++) o[j] += wr * yr[j];
      }
    }
  }
  for (uint32_t s = 1; s < L->n_slices; s++) {
    if (!part[s]) continue;
    for (size_t i = 0; i < TH; i++) a->out[i] += part[s][i];
  }

out_reset:
  if (!scratch) mr_arena_reset(&eng->scratch);
  return rc;
}

double kn_rel_l2(const float *y, const float *ref, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = (double)y[i] - (double)ref[i];
    num += d * d;
    den += (double)ref[i] * ref[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}
