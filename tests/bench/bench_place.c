/*
 * bench_place.c - moerpc-bench-place: how long pl_plan_make takes on a DeepSeek-V3-sized
 * problem (61 layers, the first 3 dense, 256 experts, H 7168, I 2048) over N hosts, with
 * Zipf-like statistics (a per-layer permutation of (1 + rank)^-s), per strategy, with and
 * without replicas and --current. One JSON line per case on stdout (median and minimum
 * milliseconds of `repeats` runs, and the expected imbalance before/after), a table on
 * stderr. The bound: 61 x 256 x 16 in under 1 s.
 */
#include "placement/pl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void usage(FILE *f) {
  fprintf(f, "usage: moerpc-bench-place [--hosts N] [--layers L] [--experts E] [--skew S]\n"
             "                          [--repeats N] [--quick]\n"
             "Times moerpc-place's planner (pl_plan_make) on a DeepSeek-V3-sized problem: L\n"
             "layers (the first 3 dense), E experts, H 7168, I 2048, int4-g64, N hosts with\n"
             "110%% of the memory the cold experts need and speeds 1 / 1.5 alternating, a GPU\n"
             "budget of 8 experts a layer, Zipf(S) statistics. Defaults: 16 hosts, 61 x 256,\n"
             "S 1.0, 5 repeats (--quick: 1 repeat, balanced only). JSON lines on stdout.\n");
}

int main(int argc, char **argv) {
  uint32_t S = 16, L = 61, E = 256, repeats = 5;
  double skew = 1.0;
  bool quick = false;
  for (int i = 1; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--help") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "--quick") == 0) {
      quick = true;
      repeats = 1;
    } else if (v && strcmp(argv[i], "--hosts") == 0) {
      S = (uint32_t)atoi(v), i++;
    } else if (v && strcmp(argv[i], "--layers") == 0) {
      L = (uint32_t)atoi(v), i++;
    } else if (v && strcmp(argv[i], "--experts") == 0) {
      E = (uint32_t)atoi(v), i++;
    } else if (v && strcmp(argv[i], "--repeats") == 0) {
      repeats = (uint32_t)atoi(v), i++;
    } else if (v && strcmp(argv[i], "--skew") == 0) {
      skew = atof(v), i++;
    } else {
      fprintf(stderr, "moerpc-bench-place: unknown or incomplete option \"%s\"\n", argv[i]);
      usage(stderr);
      return 2;
    }
  }
  if (S < 1 || S > 256 || L < 4 || L > MR_MAX_LAYERS || E < 2 || E > 4096 || repeats < 1 ||
      repeats > 100 || !(skew >= 0 && skew <= 8)) {
    fprintf(stderr, "moerpc-bench-place: --hosts 1..256, --layers 4..%u, --experts 2..4096, "
            "--repeats 1..100, --skew 0..8\n", MR_MAX_LAYERS);
    return 2;
  }
  uint8_t *is_moe = calloc(L, 1);
  uint64_t *cnt = calloc((size_t)L * E, sizeof *cnt), *cnt2 = calloc((size_t)L * E, sizeof *cnt2);
  uint32_t *perm = malloc(E * sizeof *perm);
  pl_host *hosts = calloc(S, sizeof *hosts);
  if (!is_moe || !cnt || !cnt2 || !perm || !hosts) return 1;
  uint64_t seed = 1;
  for (uint32_t l = 3; l < L; l++) {
    is_moe[l] = 1;
    for (uint32_t x = 0; x < E; x++) perm[x] = x;
    for (uint32_t x = E; x > 1; x--) {
      uint32_t j = (uint32_t)(rng(&seed) % x), t = perm[x - 1];
      perm[x - 1] = perm[j];
      perm[j] = t;
    }
    for (uint32_t r = 0; r < E; r++) {
      size_t i = (size_t)l * E + perm[r];
      cnt[i] = (uint64_t)(1e6 * pow(1.0 + r, -skew));
      cnt2[i] = cnt[i] * (85 + rng(&seed) % 31) / 100; /* the stats a while later */
    }
  }
  const pl_wformat fmt = PL_WF_INT4_G64;
  const uint32_t H = 7168, I = 2048;
  uint64_t eb = pl_expert_bytes(fmt, H, I, 1);
  uint64_t gpu = (uint64_t)8 * (L - 3) * eb;
  uint64_t cold = (uint64_t)(L - 3) * E - (uint64_t)8 * (L - 3);
  for (uint32_t h = 0; h < S; h++) {
    snprintf(hosts[h].name, sizeof hosts[h].name, "h%u", h);
    hosts[h].numa_nodes = 2;
    hosts[h].speed = h % 2 ? 1.5 : 1.0;
    hosts[h].capacity = (uint64_t)((double)cold / S * 1.10 + 1) *
                        pl_expert_bytes(fmt, H, I, hosts[h].numa_nodes);
  }
  pl_problem pb = {0};
  pb.num_layers = L;
  pb.num_experts = E;
  pb.is_moe = is_moe;
  pb.counts = cnt;
  pb.hidden = H;
  pb.inter = I;
  pb.format = fmt;
  pb.n_hosts = S;
  pb.hosts = hosts;
  pb.gpu_bytes = gpu;
  pb.seed = 42;
  pb.tolerance = 0.02;
  char cpu[128];
  mr_host_cpu_model(cpu, sizeof cpu);
  struct { const char *name; pl_strategy st; uint32_t R; bool current; } cases[] = {
      {"balanced", PL_STRATEGY_BALANCED, 1, false},
      {"balanced-r2", PL_STRATEGY_BALANCED, 2, false},
      {"balanced-current", PL_STRATEGY_BALANCED, 1, true},
      {"uniform", PL_STRATEGY_UNIFORM, 1, false},
      {"frequency", PL_STRATEGY_FREQUENCY, 1, false},
  };
  size_t n_cases = quick ? 1 : sizeof cases / sizeof cases[0];
  double *ms = malloc(repeats * sizeof *ms);
  mr_placement cur = {0};
  bool have_cur = false;
  fprintf(stderr, "planner: %u layers x %u experts x %u hosts, int4-g64 H %u I %u, skew %.2f, "
          "CPU %s\n", L, E, S, H, I, skew, cpu);
  for (size_t c = 0; c < n_cases; c++) {
    pl_problem q = pb;
    q.strategy = cases[c].st;
    q.replicas = cases[c].R;
    if (cases[c].current) {
      if (!have_cur) { /* the balanced plan of the first stats is "current" */
        pl_plan *p0 = NULL;
        char *txt = NULL;
        mr_err e;
        if (pl_plan_make(&pb, &p0, &e) || pl_plan_json(p0, &txt, &e) ||
            mr_placement_parse(&cur, txt, strlen(txt), "current", &e)) {
          fprintf(stderr, "moerpc-bench-place: %s\n", e.msg);
          return 1;
        }
        have_cur = true;
        mr_free(txt);
        pl_plan_free(p0);
      }
      q.current = &cur;
      q.counts = cnt2;
    }
    pl_plan *p = NULL;
    for (uint32_t r = 0; r < repeats; r++) {
      mr_err e;
      pl_plan_free(p);
      p = NULL;
      uint64_t t0 = mr_now_ns();
      if (pl_plan_make(&q, &p, &e)) {
        fprintf(stderr, "moerpc-bench-place: %s: %s\n", cases[c].name, e.msg);
        return 1;
      }
      ms[r] = (double)(mr_now_ns() - t0) / 1e6;
    }
    qsort(ms, repeats, sizeof *ms, cmp_d);
    uint64_t moved = 0;
    for (uint32_t h = 0; h < S; h++) moved += p->bytes_in[h];
    printf("{\"bench\":\"place\",\"case\":\"%s\",\"layers\":%u,\"experts\":%u,\"hosts\":%u,"
           "\"strategy\":\"%s\",\"replicas\":%u,\"current\":%s,\"skew\":%.2f,\"repeats\":%u,"
           "\"ms\":%.2f,\"ms_min\":%.2f,\"imbalance_before\":%.4f,\"imbalance_after\":%.4f,"
           "\"step_before\":%.6g,\"step_after\":%.6g,\"extra_copies\":%llu,\"bytes_in\":%llu,"
           "\"cpu\":\"%s\"}\n", cases[c].name, L, E, S, pl_strategy_name(q.strategy), q.replicas,
           cases[c].current ? "true" : "false", skew, repeats, ms[repeats / 2], ms[0],
           p->imbalance_before, p->imbalance_after, p->step_before, p->step_after,
           (unsigned long long)p->n_extra_copies, (unsigned long long)moved, cpu);
    fprintf(stderr, "  %-17s %8.1f ms (min %.1f)  imbalance %.3f -> %.3f  step %.4g -> %.4g  "
            "copies +%llu\n", cases[c].name, ms[repeats / 2], ms[0], p->imbalance_before,
            p->imbalance_after, p->step_before, p->step_after,
            (unsigned long long)p->n_extra_copies);
    pl_plan_free(p);
  }
  if (have_cur) mr_placement_close(&cur);
  free(ms);
  free(hosts);
  free(perm);
  free(cnt2);
  free(cnt);
  free(is_moe);
  return 0;
}
