/*
 * placement/pl_plan.c - the planner: hot set under the GPU budget, cold experts over the
 * hosts, replicas, and the fewest moves from a current placement (docs/DESIGN.md §14).
 *
 * Model of a host's load (one number per host and layer):
 *
 *   load(l, h) = sum over cold pairs (l, x) held by h of  tokens(l, x) / copies(l, x)
 *                                                          x bytes(h) / speed(h)
 *
 * bytes(h) is one expert's packed size on h (pl_expert_bytes with h's NUMA node count):
 * decode on a CPU host is bound by reading the weights, so a token routed to an expert
 * costs its bytes; a replicated pair's tokens split evenly over its copies (the client
 * sends each call to the least-loaded replica). A step runs the layers one after another
 * and waits in each for the busiest host, so the planner balances every layer (the
 * objective is the "step load", sum over l of max over h of load(l, h)) and reports the
 * imbalance of the totals, max / mean over hosts of sum over l of load(l, h).
 *
 * Why per layer and not per host total: the client sends a layer's calls to every host at
 * once and cannot start the next layer before the slowest answers, so a host idle in layer
 * 3 cannot make up for one overloaded in layer 4. Balancing the totals alone would let every
 * layer keep its hot pairs on one host; the totals are evened only afterwards, and only by
 * moves that raise no layer's max (total_balance).
 *
 * What is decided, in order (pl_plan_make; each arrow is one function below):
 *
 *   counts w[l][x] --hot_set--> local[] (the GPU's pairs)   --check_fit--> every cold pair
 *                                                                         has a slot
 *   kt strategies:  cold_blocks   equal contiguous blocks of each layer per host
 *   balanced:       cold_lpt      greedy, heaviest pair first, per layer, within quotas
 *                   local_search  moves / swaps off the layer's busiest host until none helps
 *                   replicas      extra copies of the heaviest shares while they lower a max
 *                   total_balance evens the hosts' totals without raising any layer's max
 *   --current:      the same seeded with the current copies (seed_current), stopped at
 *                   "good enough" (the fresh plan's layer max x (1 + tolerance)); kept only
 *                   if its step load is within the tolerance (pl_plan_make, plan_sticky)
 *
 * Constraints, and why each: a host holds at most floor(expert_memory / bytes(h)) experts
 * (it has to fit them in RAM; whole experts, since a server loads an expert or not); every
 * cold pair of a MoE layer has at least one copy (the client refuses a placement that leaves
 * a routed expert without a server); at most R copies of a pair and never two on one host
 * (a second copy on the same host adds memory and no throughput); the GPU set is at most
 * floor(gpu_bytes / bytes of one unsplit expert) pairs (the client's budget).
 *
 * The problem is NP-hard (it contains multiprocessor scheduling, P||Cmax, per layer), so
 * the planner is a heuristic with a known start: LPT is within 4/3 of the optimum on one
 * layer of equal hosts without capacities (Graham 1969), and the local search only ever
 * lowers a layer's max.
 *
 * Cost, with P = L x E pairs and S hosts: the hot set O(P log P) (a sort); LPT
 * O(E log E + E x S) per layer; one local-search iteration O(E + E^2 / S) per layer (the
 * busiest host's pairs times every other host's, buckets built in O(E)), at most 8E
 * iterations but in practice a handful; replicas try at most 3 candidates x 2 hosts per
 * layer and round, each followed by a local search. 61 x 256 x 16 plans in 30-60 ms.
 *
 * Everything is single-threaded and deterministic: ties break on (layer, expert, host)
 * order, and "random" draws from splitmix64(seed).
 */
#define _GNU_SOURCE /* qsort_r */
#include "placement/internal.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- names --------------------------------------------------------------------------- */

/* Index of s in names[0 .. n), or -1. */
static int name_index(const char *const *names, int n, const char *s) {
  for (int i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) return i;
  return -1;
}

static const char *const strategy_names[PL_STRATEGY_COUNT] = {
    "balanced", "uniform", "frequency", "front-loading", "random"};

int pl_strategy_parse(const char *s, pl_strategy *out) {
  int i = name_index(strategy_names, PL_STRATEGY_COUNT, s);
  if (i < 0) return MR_EINVAL;
  *out = (pl_strategy)i;
  return 0;
}

const char *pl_strategy_name(pl_strategy s) {
  return (unsigned)s < PL_STRATEGY_COUNT ? strategy_names[s] : "?";
}

static const char *const wformat_names[PL_WF_COUNT] = {
    "bf16", "f16", "f32", "int8", "int4-g32", "int4-g64", "int4-g128", "fp8-b128"};

int pl_wformat_parse(const char *s, pl_wformat *out) {
  int i = name_index(wformat_names, PL_WF_COUNT, s);
  if (i < 0) return MR_EINVAL;
  *out = (pl_wformat)i;
  return 0;
}

const char *pl_wformat_name(pl_wformat f) {
  return (unsigned)f < PL_WF_COUNT ? wformat_names[f] : "?";
}

/* ---- bytes of one expert ------------------------------------------------------------- */

/* The kernels' rules (kernels/kn.c: kn__row_bytes, kn__row_scales, slice_layout_of,
 * kn__split_inter), restated here so that the planner does not link the kernels. */
#define PL_PACK_ALIGN 64u

static uint64_t align64(uint64_t n) { return (n + PL_PACK_ALIGN - 1) & ~(uint64_t)(PL_PACK_ALIGN - 1); }

static uint32_t wf_group(pl_wformat f) {
  switch (f) {
    case PL_WF_INT4_G32: return 32;
    case PL_WF_INT4_G64: return 64;
    case PL_WF_INT4_G128: return 128;
    case PL_WF_FP8_B128: return 128;
    default: return 0;
  }
}

static bool wf_is_int4(pl_wformat f) {
  return f == PL_WF_INT4_G32 || f == PL_WF_INT4_G64 || f == PL_WF_INT4_G128;
}

/* Bytes of a row of K weights: int4 packs two weights a byte and pads K to its group. */
static uint64_t row_bytes(pl_wformat f, uint32_t K) {
  switch (f) {
    case PL_WF_F32: return (uint64_t)K * 4;
    case PL_WF_F16:
    case PL_WF_BF16: return (uint64_t)K * 2;
    case PL_WF_INT8:
    case PL_WF_FP8_B128: return K;
    default: {
      uint32_t G = wf_group(f);
      return (uint64_t)((K + G - 1) / G) * G / 2;
    }
  }
}

/* f32 scales of a matrix of `rows` rows of K weights. */
static uint64_t mat_scales(pl_wformat f, uint32_t rows, uint32_t K) {
  if (f == PL_WF_INT8) return rows;
  if (wf_is_int4(f)) return (uint64_t)rows * ((K + wf_group(f) - 1) / wf_group(f));
  /* fp8-b128: the kernels repeat a 128 x 128 block's scale on each of its rows */
  if (f == PL_WF_FP8_B128) return (uint64_t)rows * ((K + 127) / 128);
  return 0;
}

/* One slice of an expert, Is intermediate rows of the model's H, as the kernels pack it: six
 * arrays back to back, each starting on a 64-byte boundary (so a slice's size is not the
 * sum of its arrays):
 *
 *   0      gate  [Is][H]    Is x row_bytes(H)
 *   up     up    [Is][H]    Is x row_bytes(H)
 *   down   down  [H][Is]    H x row_bytes(Is)
 *   gs     gate scales      f32, mat_scales(Is rows of H)   (none for f32 / f16 / bf16)
 *   us     up scales        f32, the same count
 *   ds     down scales      f32, mat_scales(H rows of Is)
 *   end    (aligned up to 64)                                                              */
static uint64_t slice_bytes(pl_wformat f, uint32_t H, uint32_t Is) {
  uint64_t gu = (uint64_t)Is * row_bytes(f, H), dn = (uint64_t)H * row_bytes(f, Is);
  uint64_t gus = mat_scales(f, Is, H) * 4, dns = mat_scales(f, H, Is) * 4;
  uint64_t up = align64(gu), down = align64(up + gu), gs = align64(down + dn);
  uint64_t us = align64(gs + gus), ds = align64(us + gus);
  return align64(ds + dns);
}

/* The intermediate rows are cut in units of 32 (or of the group, when larger: a group never
 * straddles two NUMA nodes) and the units dealt out evenly, the first units % n slices one
 * more; a slice past the end of I (more nodes than units) is empty and costs nothing. */
uint64_t pl_expert_bytes(pl_wformat f, uint32_t H, uint32_t I, uint32_t n) {
  if (n == 0) n = 1;
  uint32_t unit = 32;
  if (wf_group(f) > unit) unit = wf_group(f);
  uint32_t units = (I + unit - 1) / unit, base = units / n, rem = units % n, u = 0;
  uint64_t total = 0;
  for (uint32_t s = 0; s < n; s++) {
    uint32_t nu = base + (s < rem ? 1u : 0u);
    uint64_t b = (uint64_t)u * unit, end = (uint64_t)(u + nu) * unit;
    if (b > I) b = I;
    if (end > I) end = I;
    if (end > b) total += slice_bytes(f, H, (uint32_t)(end - b));
    u += nu;
  }
  return total;
}

/* ---- working state ------------------------------------------------------------------- */

static inline double dmax(double a, double b) { return a > b ? a : b; } /* no libm call */

/* The planner's state: the problem in the units the search uses, and one assignment with
 * its loads kept up to date incrementally (copy_add / copy_del), so that trying a move costs
 * O(1) and not a recount. Pair i is (layer i / E, expert i % E). */
typedef struct work {
  const pl_problem *pb;
  uint32_t L, E, S, R;  /* layers, experts, hosts, most copies of a pair */
  size_t P;             /* L x E */
  double *w;            /* [P] tokens per pair (1 for every MoE pair without counts) */
  uint64_t B[MR_PLACEMENT_MAX_SERVERS];   /* bytes of one expert on host h */
  double k[MR_PLACEMENT_MAX_SERVERS];     /* B / speed: load per token (byte-tokens per unit
                                             of speed; only ratios matter) */
  uint64_t cap[MR_PLACEMENT_MAX_SERVERS]; /* bytes for experts; UINT64_MAX = unbounded */
  uint64_t gpuB;        /* bytes of one expert on the GPU (1 slice) */
  /* An assignment: */
  uint8_t *local;       /* [P] 1 = the client computes it (hot) */
  uint8_t *nc;          /* [P] copies on hosts (0 for local pairs and dense layers) */
  uint16_t *hs;         /* [P * R] pair i's hosts are hs[i * R .. i * R + nc[i]) */
  double *lload;        /* [L * S] load(l, h), as in the header */
  uint64_t used[MR_PLACEMENT_MAX_SERVERS]; /* bytes held per host */
  /* Scratch of local_search: the single-copy pairs of one layer bucketed by host. */
  uint32_t *bucket; /* [E] */
  uint32_t *start;  /* [S + 1] */
} work;

static bool pair_on(const work *w, size_t i, uint32_t h) {
  for (uint32_t c = 0; c < w->nc[i]; c++)
    if (w->hs[i * w->R + c] == h) return true;
  return false;
}

/* Removes (sign -1) or adds (+1) pair i's share to the layer loads of its holders. A
 * change of copies changes every holder's share (tokens / copies), so copy_add and
 * copy_del remove the old shares, change the copies, and add the new ones. */
static void pair_contrib(work *w, size_t i, double sign) {
  if (!w->nc[i]) return;
  double t = w->w[i] / w->nc[i];
  double *ll = w->lload + (i / w->E) * w->S;
  for (uint32_t c = 0; c < w->nc[i]; c++) {
    uint32_t h = w->hs[i * w->R + c];
    ll[h] += sign * t * w->k[h];
  }
}

/* Can host h hold one more expert? */
static bool has_room(const work *w, uint32_t h) {
  return w->cap[h] == UINT64_MAX || w->used[h] + w->B[h] <= w->cap[h];
}

/* One more copy of pair i, on host h (which must not hold it); loads and bytes follow. */
static void copy_add(work *w, size_t i, uint32_t h) {
  MR_ASSERT(w->nc[i] < w->R && !pair_on(w, i, h));
  pair_contrib(w, i, -1);
  w->hs[i * w->R + w->nc[i]++] = (uint16_t)h;
  w->used[h] += w->B[h];
  pair_contrib(w, i, +1);
}

/* Host h's copy of pair i removed (the others keep their order); loads and bytes follow. */
static void copy_del(work *w, size_t i, uint32_t h) {
  pair_contrib(w, i, -1);
  uint32_t c = 0;
  while (c < w->nc[i] && w->hs[i * w->R + c] != h) c++;
  MR_ASSERT(c < w->nc[i]);
  for (; c + 1 < w->nc[i]; c++) w->hs[i * w->R + c] = w->hs[i * w->R + c + 1];
  w->nc[i]--;
  w->used[h] -= w->B[h];
  pair_contrib(w, i, +1);
}

static void work_clear(work *w) {
  memset(w->local, 0, w->P);
  memset(w->nc, 0, w->P);
  memset(w->lload, 0, (size_t)w->L * w->S * sizeof *w->lload);
  memset(w->used, 0, sizeof w->used);
}

static bool is_moe(const work *w, uint32_t l) { return w->pb->is_moe[l] != 0; }

/* Moves single-copy pair p from host a to host b, or, when q is not SIZE_MAX, swaps it with
 * single-copy pair q of host b (the host byte counts then stay as they were). */
static void move_or_swap(work *w, size_t p, uint32_t a, size_t q, uint32_t b) {
  if (q != SIZE_MAX) {
    copy_del(w, q, b);
    copy_del(w, p, a);
    copy_add(w, p, b);
    copy_add(w, q, a);
  } else {
    copy_del(w, p, a);
    copy_add(w, p, b);
  }
}

/* The best move a search (local_search, total_balance) has found so far: single-copy pair p
 * of the busiest host to host b, swapped with b's single-copy pair q unless q is SIZE_MAX;
 * m is the larger of the two hosts' loads it leaves, which a later candidate must beat. m
 * starts just below the busiest load, so that only a move that lowers it is ever taken. */
typedef struct best_move {
  double m;
  size_t p, q;
  uint32_t b;
} best_move;

static void best_offer(best_move *bm, double m, size_t p, size_t q, uint32_t b) {
  if (m < bm->m) *bm = (best_move){.m = m, .p = p, .q = q, .b = b};
}

/* Index of the largest of v[0 .. n) (the first on ties), n >= 1: the busiest host. */
static uint32_t argmax(const double *v, uint32_t n) {
  uint32_t a = 0;
  for (uint32_t h = 1; h < n; h++)
    if (v[h] > v[a]) a = h;
  return a;
}

/* The two figures of an assignment's loads lload[L * S]: *step = sum over l of max over h
 * (the objective), *imb = max / mean of the host totals tot[h] = sum over l (1 with no
 * load); tot[] is filled for the caller. */
static void work_eval(const double *lload, uint32_t L, uint32_t S, double *step, double *imb,
                      double *tot) {
  double st = 0;
  for (uint32_t h = 0; h < S; h++) tot[h] = 0;
  for (uint32_t l = 0; l < L; l++) {
    double m = 0;
    for (uint32_t h = 0; h < S; h++) {
      double v = lload[(size_t)l * S + h];
      tot[h] += v;
      if (v > m) m = v;
    }
    st += m;
  }
  double mx = 0, sum = 0;
  for (uint32_t h = 0; h < S; h++) {
    sum += tot[h];
    if (tot[h] > mx) mx = tot[h];
  }
  *step = st;
  *imb = sum > 0 ? mx / (sum / S) : 1.0;
}

/* ---- hot set ------------------------------------------------------------------------- */

/* Hotter first; ties: lower expert id, then lower layer (so that equal counts, e.g. no
 * statistics, spread the hot set over the layers as kt-kernel's uniform does). */
static int cmp_hot(const void *a, const void *b, void *ctx) {
  const work *sort_ctx = ctx;
  uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
  double wi = sort_ctx->w[i], wj = sort_ctx->w[j];
  if (wi != wj) return wi > wj ? -1 : 1;
  uint32_t E = sort_ctx->E;
  if (i % E != j % E) return i % E < j % E ? -1 : 1;
  return i < j ? -1 : i > j;
}

/* The GPU set, local[]: N = floor(gpu_bytes / one unsplit expert) pairs of the MoE layers,
 * chosen by the strategy with kt-kernel's semantics (docs/DESIGN.md section 14), so that a
 * plan here and a kt-kernel mask agree for the same N. balanced takes frequency's set: a
 * token served on the GPU costs no host anything, so the hottest pairs are worth the most
 * there, whatever their layer. */
static int hot_set(work *w, mr_err *e) {
  uint32_t n_moe = 0;
  for (uint32_t l = 0; l < w->L; l++) n_moe += is_moe(w, l);
  uint64_t moe_pairs = (uint64_t)n_moe * w->E;
  uint64_t n = w->gpuB ? w->pb->gpu_bytes / w->gpuB : 0;
  if (n > moe_pairs) n = moe_pairs;
  if (n == 0) return 0;
  switch (w->pb->strategy) {
    case PL_STRATEGY_UNIFORM: {
      /* kt-kernel generate_uniform_masks: N / M per MoE layer, the first N % M MoE layers
       * one more, experts 0.. of each. */
      uint64_t per = n / n_moe, rem = n % n_moe, idx = 0;
      for (uint32_t l = 0; l < w->L; l++) {
        if (!is_moe(w, l)) continue;
        uint64_t k = per + (idx++ < rem ? 1 : 0);
        if (k > w->E) k = w->E;
        for (uint32_t x = 0; x < k; x++) w->local[(size_t)l * w->E + x] = 1;
      }
      return 0;
    }
    case PL_STRATEGY_FRONT_LOADING: {
      /* kt-kernel generate_front_loading_masks: fill MoE layers from the first. */
      uint64_t left = n;
      for (uint32_t l = 0; l < w->L && left; l++) {
        if (!is_moe(w, l)) continue;
        uint64_t k = left < w->E ? left : w->E;
        for (uint32_t x = 0; x < k; x++) w->local[(size_t)l * w->E + x] = 1;
        left -= k;
      }
      return 0;
    }
    default: break;
  }
  uint32_t *ord = mr_malloc(moe_pairs * sizeof *ord);
  if (!ord) return mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  size_t m = 0;
  for (uint32_t l = 0; l < w->L; l++)
    if (is_moe(w, l))
      for (uint32_t x = 0; x < w->E; x++) ord[m++] = l * w->E + x;
  if (w->pb->strategy == PL_STRATEGY_RANDOM) {
    /* kt-kernel generate_random_masks: a random permutation of the MoE pairs, the first N
     * (same rule; splitmix64 Fisher-Yates, not torch's generator). */
    uint64_t s = w->pb->seed;
    for (size_t i = m; i > 1; i--) {
      size_t j = (size_t)(pl__splitmix64(&s) % i);
      uint32_t t = ord[i - 1];
      ord[i - 1] = ord[j];
      ord[j] = t;
    }
  } else {
    /* frequency / balanced: kt-kernel generate_gpu_experts_masks, the global top N. */
    qsort_r(ord, m, sizeof *ord, cmp_hot, w);
  }
  for (uint64_t i = 0; i < n; i++) w->local[ord[i]] = 1;
  mr_free(ord);
  return 0;
}

/* ---- capacity ------------------------------------------------------------------------ */

/* Experts host h can still take (UINT64_MAX: unbounded). */
static uint64_t free_slots(const work *w, uint32_t h) {
  if (w->cap[h] == UINT64_MAX) return UINT64_MAX;
  return w->used[h] >= w->cap[h] ? 0 : (w->cap[h] - w->used[h]) / w->B[h];
}

/* Every cold pair must fit once; the hosts' slots are counted in whole experts, since a
 * host's remainder below one expert holds nothing. Checked before any placement so that
 * the failure names the bytes instead of an assertion deep in the search; the message
 * counts the need at the smallest expert size (the best case over the hosts). */
static int check_fit(const work *w, mr_err *e) {
  uint64_t cold = 0, slots = 0, bytes_avail = 0, need_min = 0;
  bool unbounded = false;
  for (size_t i = 0; i < w->P; i++)
    if (is_moe(w, (uint32_t)(i / w->E)) && !w->local[i]) cold++;
  uint64_t bmin = UINT64_MAX;
  for (uint32_t h = 0; h < w->S; h++) {
    if (w->B[h] < bmin) bmin = w->B[h];
    if (w->cap[h] == UINT64_MAX) {
      unbounded = true;
      continue;
    }
    slots += w->cap[h] / w->B[h];
    bytes_avail += w->cap[h];
  }
  if (unbounded || cold <= slots) return 0;
  need_min = cold * bmin;
  char nb[32], ab[32], eb[32];
  pl__bytes_human(need_min, nb, sizeof nb);
  pl__bytes_human(bytes_avail, ab, sizeof ab);
  pl__bytes_human(bmin, eb, sizeof eb);
  return mr_err_set(e, MR_EEXHAUSTED,
                    "plan does not fit: %llu cold experts of %s each (%s) need %llu bytes "
                    "(%s), the hosts' expert_memory is %llu bytes (%s, room for %llu experts); "
                    "raise expert_memory or --gpu-bytes, or use a smaller --format",
                    (unsigned long long)cold, eb, pl_wformat_name(w->pb->format),
                    (unsigned long long)need_min, nb, (unsigned long long)bytes_avail, ab,
                    (unsigned long long)slots);
}

/* ---- cold placement: contiguous blocks (the kt-parity strategies, and "uniform") ------ */

/* The kt-parity placement of the cold pairs: in each MoE layer, the pairs in expert order
 * cut into S blocks of equal size (the first n % S one larger), block h to host h, each cut
 * to the host's free slots with the rest going to the first hosts with room. It ignores the
 * counts on purpose: it is what "no planner" looks like, the "before" of a plan. */
static int cold_blocks(work *w, mr_err *e) {
  uint32_t *q = mr_malloc(w->S * sizeof *q);
  if (!q) return mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  for (uint32_t l = 0; l < w->L; l++) {
    if (!is_moe(w, l)) continue;
    uint32_t n = 0;
    for (uint32_t x = 0; x < w->E; x++) n += !w->local[(size_t)l * w->E + x];
    if (!n) continue;
    /* Equal shares in host order, cut to each host's free slots; the rest to hosts with
     * room, in order. */
    uint32_t got = 0;
    for (uint32_t h = 0; h < w->S; h++) {
      uint64_t share = n / w->S + (h < n % w->S ? 1 : 0), fs = free_slots(w, h);
      q[h] = (uint32_t)(share < fs ? share : fs);
      got += q[h];
    }
    for (uint32_t h = 0; got < n && h < w->S; h++) {
      uint64_t fs = free_slots(w, h) - q[h];
      uint64_t add = n - got < fs ? n - got : fs;
      q[h] += (uint32_t)add;
      got += (uint32_t)add;
    }
    MR_ASSERT(got == n); /* check_fit */
    uint32_t h = 0;
    for (uint32_t x = 0; x < w->E; x++) {
      size_t i = (size_t)l * w->E + x;
      if (w->local[i]) continue;
      while (q[h] == 0) h++;
      copy_add(w, i, h);
      q[h]--;
    }
  }
  mr_free(q);
  return 0;
}

/* ---- cold placement: balanced --------------------------------------------------------- */

static int cmp_heavy(const void *a, const void *b, void *ctx) {
  const work *sort_ctx = ctx;
  uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
  double wi = sort_ctx->w[i], wj = sort_ctx->w[j];
  if (wi != wj) return wi > wj ? -1 : 1;
  return i < j ? -1 : i > j;
}

/* LPT greedy, layer by layer, for the pairs of the layer without a copy: heaviest first,
 * each onto the host whose layer load grows least; a layer may use at most its
 * proportional share of each host's free slots, so that early layers do not take the
 * room later layers need.
 *
 * "Grows least" is min over h of ll[h] + w x k[h]: with equal speeds, the least-loaded
 * host; with unequal ones a fast host takes more. The quota of host h in a layer of n
 * unplaced pairs, out of `remaining` over all layers, is ceil(free(h) x n / remaining):
 * without it a roomy early layer could fill a host and leave a later layer only the slow
 * or full ones. Ties (within a relative 1e-12) go to the host with fewer pairs in this
 * layer, then to the lighter total, so that pairs of equal weight (no counts) spread by
 * number. Per layer O(n log n + n x S). */
static int cold_lpt(work *w, mr_err *e) {
  uint32_t *ord = mr_malloc(w->E * sizeof *ord);
  uint64_t *quota = mr_malloc(w->S * sizeof *quota);
  uint32_t *inl = mr_malloc(w->S * sizeof *inl);
  if (!ord || !quota || !inl) {
    mr_free(ord);
    mr_free(quota);
    mr_free(inl);
    return mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  }
  uint64_t remaining = 0; /* cold pairs without a copy, over the layers not yet done */
  double tot[MR_PLACEMENT_MAX_SERVERS] = {0}; /* hosts' totals so far: ties go to the lighter */
  for (size_t i = 0; i < w->P; i++)
    if (is_moe(w, (uint32_t)(i / w->E)) && !w->local[i] && !w->nc[i]) remaining++;
  /* Copies already placed (seed_current's) count in the totals from the start. */
  for (size_t i = 0; i < w->P; i++) {
    if (!w->nc[i]) continue;
    for (uint32_t c = 0; c < w->nc[i]; c++) {
      uint32_t h = w->hs[i * w->R + c];
      tot[h] += w->w[i] / w->nc[i] * w->k[h];
    }
  }
  for (uint32_t l = 0; l < w->L; l++) {
    if (!is_moe(w, l)) continue;
    uint32_t n = 0;
    for (uint32_t x = 0; x < w->E; x++) {
      size_t i = (size_t)l * w->E + x;
      if (!w->local[i] && !w->nc[i]) ord[n++] = (uint32_t)i;
    }
    if (!n) continue;
    qsort_r(ord, n, sizeof *ord, cmp_heavy, w); /* heaviest first, ties by index */
    /* quota[h]: the most pairs of this layer host h may take, its share of its free slots */
    for (uint32_t h = 0; h < w->S; h++) {
      uint64_t fs = free_slots(w, h);
      if (fs == UINT64_MAX) quota[h] = UINT64_MAX;
      else quota[h] = (uint64_t)ceil((double)fs * n / (double)remaining);
      if (quota[h] != UINT64_MAX && quota[h] > fs) quota[h] = fs;
      inl[h] = 0;
    }
    double *ll = w->lload + (size_t)l * w->S;
    for (uint32_t a = 0; a < n; a++) {
      size_t i = ord[a];
      uint32_t best = UINT32_MAX;
      double bv = 0;
      for (uint32_t h = 0; h < w->S; h++) {
        if (inl[h] >= quota[h] || !has_room(w, h)) continue;
        double v = ll[h] + w->w[i] * w->k[h];
        /* Zero-weight pairs: spread them by count (memory), relative to capacity. */
        if (best == UINT32_MAX || v < bv * (1 - 1e-12) ||
            (v <= bv * (1 + 1e-12) && (inl[h] < inl[best] ||
                                        (inl[h] == inl[best] && tot[h] < tot[best])))) {
          best = h;
          bv = v;
        }
      }
      /* Quotas are ceilings of shares, so they add up to at least n unless a host with room
       * was cut to its free slots by rounding: then any host with room will do. */
      if (best == UINT32_MAX)
        for (uint32_t h = 0; h < w->S && best == UINT32_MAX; h++)
          if (has_room(w, h)) best = h;
      MR_ASSERT(best != UINT32_MAX); /* check_fit */
      copy_add(w, i, best);
      inl[best]++;
      tot[best] += w->w[i] * w->k[best];
    }
    remaining -= n;
  }
  mr_free(inl);
  mr_free(quota);
  mr_free(ord);
  return 0;
}

/* Buckets the single-copy pairs of layer l by host: w->bucket[w->start[h] ..
 * w->start[h + 1]) are host h's. A counting sort, O(E + S), so that the searches below
 * visit only the busiest host's pairs against each other host's instead of all E^2. */
static void bucket_layer(work *w, uint32_t l) {
  const uint32_t S = w->S, E = w->E;
  uint32_t *st = w->start, *bk = w->bucket;
  memset(st, 0, (S + 1) * sizeof *st);
  for (uint32_t x = 0; x < E; x++) {
    size_t i = (size_t)l * E + x;
    if (w->nc[i] == 1) st[w->hs[i * w->R] + 1]++;
  }
  for (uint32_t h = 0; h < S; h++) st[h + 1] += st[h];
  for (uint32_t x = 0; x < E; x++) { /* st[h] runs to the end of h's range... */
    size_t i = (size_t)l * E + x;
    if (w->nc[i] == 1) bk[st[w->hs[i * w->R]]++] = (uint32_t)i;
  }
  for (uint32_t h = S; h > 0; h--) st[h] = st[h - 1]; /* ...and back to its start */
  st[0] = 0;
}

/* Local search in one layer over single-copy pairs: move a pair off the busiest host, or
 * swap it with a lighter one of another host, whenever that lowers the busiest host's load
 * without raising the other above it. Stops when no move helps, or once the layer's max
 * is at most `good` (with --current: close enough to the fresh plan, fewer moves).
 *
 * Each iteration takes the best move of the neighbourhood (best improvement, not first):
 *
 *   move p: a -> b        new max of the two = max(ll[a] - w_p k_a, ll[b] + w_p k_b)
 *   swap p <-> q (w_q < w_p)   max(ll[a] - w_p k_a + w_q k_a, ll[b] - w_q k_b + w_p k_b)
 *
 * and applies it only if that max is below ll[a] by a relative 1e-9, so the busiest load
 * strictly falls and the search ends; 8E iterations bound it anyway. Only single-copy
 * pairs move (a replicated pair's copies stay where replicas put them), only swaps with a
 * lighter pair are tried (a heavier one onto a could not lower a's load), and a move needs
 * room on b while a swap keeps both hosts' bytes (equal expert sizes per host). Hosts at or
 * above the best max found are skipped: nothing moved onto them can help. */
static void local_search(work *w, uint32_t l, double good) {
  const uint32_t S = w->S, E = w->E;
  double *ll = w->lload + (size_t)l * S;
  for (uint32_t iter = 0; iter < 8 * E; iter++) {
    const uint32_t a = argmax(ll, S);
    double amax = ll[a];
    if (amax <= good || amax <= 0) return;
    bucket_layer(w, l);
    const uint32_t *st = w->start, *bk = w->bucket;
    best_move bm = {.m = amax * (1 - 1e-9), .p = SIZE_MAX, .q = SIZE_MAX, .b = 0};
    for (uint32_t pa = st[a]; pa < st[a + 1]; pa++) {
      size_t p = bk[pa];
      double wp = w->w[p];
      if (wp <= 0) continue; /* moving a pair without tokens changes no load */
      for (uint32_t b = 0; b < S; b++) {
        if (b == a || ll[b] >= bm.m) continue; /* b at the max: no move onto it helps */
        if (has_room(w, b)) /* move: a sheds p, b takes it at b's cost per token */
          best_offer(&bm, dmax(amax - wp * w->k[a], ll[b] + wp * w->k[b]), p, SIZE_MAX, b);
        for (uint32_t qb = st[b]; qb < st[b + 1]; qb++) { /* swap: a trades p for b's q */
          size_t q = bk[qb];
          double wq = w->w[q];
          if (wq >= wp) continue;
          double m = dmax(amax - wp * w->k[a] + wq * w->k[a], ll[b] - wq * w->k[b] + wp * w->k[b]);
          best_offer(&bm, m, p, q, b);
        }
      }
    }
    if (bm.p == SIZE_MAX) return;
    move_or_swap(w, bm.p, a, bm.q, bm.b);
  }
}

/* Layer max after giving pair i one more copy on host b (nothing changed): b gains a share
 * t1 = tokens / (copies + 1), every present holder's share drops from t0 to t1. O(S x R). */
static double max_with_copy(const work *w, size_t i, uint32_t b) {
  const uint32_t S = w->S;
  const double *ll = w->lload + (i / w->E) * S;
  double t0 = w->w[i] / w->nc[i], t1 = w->w[i] / (w->nc[i] + 1);
  double m = 0;
  for (uint32_t h = 0; h < S; h++) {
    double v = ll[h];
    if (h == b) v += t1 * w->k[h];
    else if (pair_on(w, i, h)) v += (t1 - t0) * w->k[h];
    if (v > m) m = v;
  }
  return m;
}

/* A layer's assignment, to try a change and undo it (a replica and the local search after
 * it touch one layer's pairs and loads and the hosts' byte counts, nothing else). */
typedef struct layer_snap {
  uint8_t *nc;   /* [E] */
  uint16_t *hs;  /* [E * R] */
  double ll[MR_PLACEMENT_MAX_SERVERS];
  uint64_t used[MR_PLACEMENT_MAX_SERVERS];
} layer_snap;

static void snap_save(const work *w, uint32_t l, layer_snap *s) {
  memcpy(s->nc, w->nc + (size_t)l * w->E, w->E);
  memcpy(s->hs, w->hs + (size_t)l * w->E * w->R, (size_t)w->E * w->R * sizeof *s->hs);
  memcpy(s->ll, w->lload + (size_t)l * w->S, w->S * sizeof *s->ll);
  memcpy(s->used, w->used, w->S * sizeof *s->used);
}

static void snap_restore(work *w, uint32_t l, const layer_snap *s) {
  memcpy(w->nc + (size_t)l * w->E, s->nc, w->E);
  memcpy(w->hs + (size_t)l * w->E * w->R, s->hs, (size_t)w->E * w->R * sizeof *s->hs);
  memcpy(w->lload + (size_t)l * w->S, s->ll, w->S * sizeof *s->ll);
  memcpy(w->used, s->used, w->S * sizeof *s->used);
}

static double layer_max(const work *w, uint32_t l) {
  double m = 0;
  for (uint32_t h = 0; h < w->S; h++)
    if (w->lload[(size_t)l * w->S + h] > m) m = w->lload[(size_t)l * w->S + h];
  return m;
}

/* One replica in layer l if it lowers the layer's max once the single-copy pairs are
 * rebalanced around it (local_search): the heaviest shares of the busiest host, each on
 * the two hosts where the copy alone gives the lowest max. Returns true if one was kept.
 *
 * Why replicas at all: one pair hotter than a host's fair share sets the layer's max however
 * the others are placed; only splitting its tokens (EPLB's idea) lowers it. Why try only
 * 3 x 2 placements: each try runs a local search, and the heaviest shares of the busiest
 * host are where a copy can matter; a copy that does not lower the max by a relative 1e-6
 * after the search is undone (snapshot), since it would only cost memory and a load. */
static bool replica_step(work *w, uint32_t l, double good, layer_snap *snap) {
  const uint32_t S = w->S, E = w->E;
  double *ll = w->lload + (size_t)l * S;
  const uint32_t a = argmax(ll, S);
  double amax = ll[a];
  if (amax <= good || amax <= 0) return false;
  /* No placement of the layer's tokens beats sum(tokens) / sum(1 / k): with every host at
   * the same load m, host h carries m / k_h tokens, and these add up to the layer's tokens.
   * At that bound, copies cannot help. */
  double tokens = 0, inv = 0;
  for (uint32_t x = 0; x < E; x++) tokens += w->nc[(size_t)l * E + x] ? w->w[(size_t)l * E + x] : 0;
  for (uint32_t h = 0; h < S; h++) inv += 1.0 / w->k[h];
  if (amax <= tokens / inv * (1 + 1e-6)) return false;
  /* The few heaviest shares on a (that may get another copy): selection by repeated scans,
   * O(CAND x E), cheaper than a sort for three. */
  enum { CAND = 3, TRY_HOSTS = 2 };
  size_t cand[CAND];
  int nc = 0;
  for (; nc < CAND; nc++) {
    size_t bi = SIZE_MAX;
    double bs = 0;
    for (uint32_t x = 0; x < E; x++) {
      size_t i = (size_t)l * E + x;
      /* a cold pair of a, with tokens to split and fewer than R copies */
      if (!w->nc[i] || w->nc[i] >= w->R || w->w[i] <= 0 || !pair_on(w, i, a)) continue;
      bool taken = false;
      for (int c = 0; c < nc; c++) taken |= cand[c] == i;
      double sh = w->w[i] / w->nc[i];
      if (!taken && sh > bs) {
        bs = sh;
        bi = i;
      }
    }
    if (bi == SIZE_MAX) break;
    cand[nc] = bi;
  }
  /* Per candidate, the TRY_HOSTS hosts where the copy alone gives the lowest max (an
   * insertion into a sorted array of TRY_HOSTS), each tried with the search after it. */
  for (int c = 0; c < nc; c++) {
    uint32_t hb[TRY_HOSTS];
    double hm[TRY_HOSTS];
    int nh = 0;
    for (uint32_t b = 0; b < S; b++) {
      if (pair_on(w, cand[c], b) || !has_room(w, b)) continue;
      double m = max_with_copy(w, cand[c], b);
      /* insert (m, b) into hm / hb, kept sorted by m and cut at TRY_HOSTS entries */
      int pos = nh < TRY_HOSTS ? nh++ : TRY_HOSTS;
      while (pos > 0 && hm[pos - 1] > m) {
        if (pos < TRY_HOSTS) {
          hm[pos] = hm[pos - 1];
          hb[pos] = hb[pos - 1];
        }
        pos--;
      }
      if (pos < TRY_HOSTS) {
        hm[pos] = m;
        hb[pos] = b;
      }
    }
    for (int t = 0; t < nh; t++) { /* try: copy, rebalance, keep if the max fell, else undo */
      snap_save(w, l, snap);
      copy_add(w, cand[c], hb[t]);
      local_search(w, l, good);
      if (layer_max(w, l) < amax * (1 - 1e-6)) return true;
      snap_restore(w, l, snap);
    }
  }
  return false;
}

/* Replicas in rounds over the layers, one per layer per round, while there is room and
 * they help; `good` per layer (NULL: none). Round-robin rather than layer after layer, so
 * that when memory runs short every layer got its most useful copies before any layer got
 * its fifth. Copies use free slots only: the pairs' first copies were placed first. */
static int replicas(work *w, const double *good, mr_err *e) {
  if (w->R <= 1) return 0;
  layer_snap snap;
  snap.nc = mr_malloc(w->E);
  snap.hs = mr_malloc((size_t)w->E * w->R * sizeof *snap.hs);
  if (!snap.nc || !snap.hs) {
    mr_free(snap.nc);
    mr_free(snap.hs);
    return mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  }
  /* A layer whose step failed is not tried again: it has not changed since, and the room
   * of the others only shrinks. The rounds end when no layer took a copy (E x R rounds
   * bound them: no layer can take more copies than that). */
  uint8_t *done = mr_calloc(w->L, 1);
  if (!done) {
    mr_free(snap.nc);
    mr_free(snap.hs);
    return mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  }
  for (uint32_t round = 0; round < w->E * w->R; round++) {
    bool any = false;
    for (uint32_t l = 0; l < w->L; l++) {
      if (!is_moe(w, l) || done[l]) continue;
      if (replica_step(w, l, good ? good[l] : 0, &snap)) any = true;
      else done[l] = 1;
    }
    if (!any) break;
  }
  mr_free(done);
  mr_free(snap.nc);
  mr_free(snap.hs);
  return 0;
}

/* Evens the hosts' totals without raising any layer's max: moves or swaps of single-copy
 * pairs off the host with the largest total, in any layer where the receiving host stays
 * at or under that layer's max. (Per-layer balance leaves the totals free: in a skewed
 * layer the host holding its heaviest pair carries the max while the others may take any
 * of the rest.)
 *
 * Target: stop once max / mean of the totals is at most target (0: as far as it goes).
 * The same move / swap neighbourhood as local_search, scored on the totals T[] instead of a
 * layer's loads, with the constraint ll[b] + share <= the layer's max (and for a swap the
 * same on a) checked per layer. Layers are visited from the one of the last move on, so a
 * layer with room is used until it has none. O(L x (E + E^2 / S)) per move, at most 4 L S
 * moves. */
static void total_balance(work *w, double target) {
  const uint32_t S = w->S;
  double T[MR_PLACEMENT_MAX_SERVERS], sum = 0;
  for (uint32_t h = 0; h < S; h++) T[h] = 0;
  for (uint32_t l = 0; l < w->L; l++)
    for (uint32_t h = 0; h < S; h++) T[h] += w->lload[(size_t)l * S + h];
  for (uint32_t h = 0; h < S; h++) sum += T[h];
  uint32_t start = 0; /* the layer of the last move: searched first next time */
  for (uint32_t iter = 0; iter < 4 * w->L * S; iter++) {
    const uint32_t a = argmax(T, S);
    if (sum <= 0 || T[a] / (sum / S) <= target) return; /* moves keep the sum */
    bool done = false;
    for (uint32_t k = 0; k < w->L && !done; k++) {
      uint32_t l = (start + k) % w->L; /* from the layer of the last move on */
      if (!is_moe(w, l)) continue;
      /* lm: the layer's max, which no host may exceed after the move (1e-12: rounding) */
      double *ll = w->lload + (size_t)l * S, lm = layer_max(w, l) * (1 + 1e-12);
      /* the totals' max must fall, as in local_search */
      best_move bm = {.m = T[a] * (1 - 1e-9), .p = SIZE_MAX, .q = SIZE_MAX, .b = 0};
      bucket_layer(w, l);
      const uint32_t *st = w->start, *bk = w->bucket;
      for (uint32_t pa = st[a]; pa < st[a + 1]; pa++) {
        size_t p = bk[pa];
        if (w->w[p] <= 0) continue;
        double ca = w->w[p] * w->k[a];
        for (uint32_t b = 0; b < S; b++) {
          if (b == a || T[b] >= bm.m) continue;
          double cb = w->w[p] * w->k[b];
          if (has_room(w, b) && ll[b] + cb <= lm) /* move, if b stays within the layer's max */
            best_offer(&bm, dmax(T[a] - ca, T[b] + cb), p, SIZE_MAX, b);
          for (uint32_t qb = st[b]; qb < st[b + 1]; qb++) { /* swap, if both stay within it */
            size_t q = bk[qb];
            if (w->w[q] >= w->w[p]) continue;
            double qa = w->w[q] * w->k[a], qc = w->w[q] * w->k[b];
            if (ll[a] - ca + qa > lm || ll[b] - qc + cb > lm) continue;
            best_offer(&bm, dmax(T[a] - ca + qa, T[b] - qc + cb), p, q, b);
          }
        }
      }
      if (bm.p == SIZE_MAX) continue;
      /* T follows the move: this layer's loads out, the move, its new loads in. */
      for (uint32_t h = 0; h < S; h++) T[h] -= ll[h];
      move_or_swap(w, bm.p, a, bm.q, bm.b);
      for (uint32_t h = 0; h < S; h++) T[h] += ll[h];
      done = true;
      start = l;
    }
    if (!done) return;
  }
}

/* The balanced strategy's cold placement, the passes in order (header). With good[] (the
 * --current run) every pass stops at good enough, and pl_plan_make evens the totals only
 * as far as the tolerance asks. */
static int balanced_cold(work *w, const double *good, mr_err *e) {
  int rc = cold_lpt(w, e);
  if (rc) return rc;
  for (uint32_t l = 0; l < w->L; l++)
    if (is_moe(w, l)) local_search(w, l, good ? good[l] : 0);
  if ((rc = replicas(w, good, e))) return rc;
  if (!good) total_balance(w, 0); /* with --current: pl_plan_make decides */
  return 0;
}

/* ---- the current placement ----------------------------------------------------------- */

/* Checks --current against the problem (shape, servers, dense layers) and maps its servers
 * to host indices: map[i] is the host of cur->server[i]. */
static int map_current(const work *w, const mr_placement *cur, int32_t *map, mr_err *e) {
  if (cur->num_layers != w->L || cur->num_experts != w->E)
    return mr_err_set(e, MR_EMISMATCH, "--current: num_layers = %u, num_experts = %u, the "
                      "model has %u and %u", cur->num_layers, cur->num_experts, w->L, w->E);
  for (uint32_t i = 0; i < cur->n_servers; i++) {
    map[i] = -1;
    for (uint32_t h = 0; h < w->S; h++)
      if (strcmp(cur->server[i], w->pb->hosts[h].name) == 0) map[i] = (int32_t)h;
    if (map[i] < 0)
      return mr_err_set(e, MR_ENOTFOUND, "--current: server \"%s\" is not in the cluster "
                        "(%u servers)", cur->server[i], w->S);
  }
  for (size_t i = 0; i < w->P; i++)
    if (!is_moe(w, (uint32_t)(i / w->E)) && (cur->local[i] || cur->copies[i]))
      return mr_err_set(e, MR_EINVAL, "--current: layer %zu is a dense layer and has no "
                        "experts to place (expert %zu)", i / w->E, i % w->E);
  return 0;
}

/* Loads of the current placement (its own local set): a cold pair it does not list counts
 * as split evenly over every host (the client then picks among the servers announcing
 * it). This is the "before" of a plan with --current, measured with this plan's counts, so
 * before and after compare the same traffic on two placements. */
static void current_loads(const work *w, const mr_placement *cur, const int32_t *map,
                          double *lload) {
  memset(lload, 0, (size_t)w->L * w->S * sizeof *lload);
  for (size_t i = 0; i < w->P; i++) {
    uint32_t l = (uint32_t)(i / w->E);
    if (!is_moe(w, l) || cur->local[i]) continue;
    double *ll = lload + (size_t)l * w->S;
    if (cur->copies[i]) {
      double t = w->w[i] / cur->copies[i];
      for (uint32_t c = cur->rep_off[i]; c < cur->rep_off[i + 1]; c++) {
        uint32_t h = (uint32_t)map[cur->rep[c]];
        ll[h] += t * w->k[h];
      }
    } else {
      double t = w->w[i] / w->S;
      for (uint32_t h = 0; h < w->S; h++) ll[h] += t * w->k[h];
    }
  }
}

/* Seeds the assignment with the current copies of every pair that stays cold: first
 * copies within each host's room, then further ones (at most R) only while the free
 * slots left exceed the pairs still without a copy, so that every pair keeps a place.
 * Pass c takes every pair's c-th current copy, so that first copies are kept over second
 * ones when room is short. What is not seeded is placed by cold_lpt as for a fresh plan. */
static void seed_current(work *w, const mr_placement *cur, const int32_t *map) {
  for (uint32_t pass = 0; pass < w->R; pass++) {
    uint64_t unplaced = 0, freeall = 0;
    bool unbounded = false;
    if (pass > 0) {
      for (size_t i = 0; i < w->P; i++)
        unplaced += is_moe(w, (uint32_t)(i / w->E)) && !w->local[i] && !w->nc[i];
      for (uint32_t h = 0; h < w->S; h++) {
        uint64_t f = free_slots(w, h);
        if (f == UINT64_MAX) unbounded = true;
        else freeall += f;
      }
    }
    /* Pass 0 seeds first copies wherever their host has room; a later pass spends a free
     * slot on a further copy only while more slots are left than unplaced pairs. */
    for (size_t i = 0; i < w->P; i++) {
      if (!is_moe(w, (uint32_t)(i / w->E)) || w->local[i] || cur->copies[i] <= pass) continue;
      uint32_t h = (uint32_t)map[cur->rep[cur->rep_off[i] + pass]];
      if (!has_room(w, h) || pair_on(w, i, h)) continue;
      if (pass > 0 && !unbounded) {
        if (freeall <= unplaced) continue;
        freeall--;
      }
      copy_add(w, i, h);
    }
  }
}

/* ---- plan ---------------------------------------------------------------------------- */

static void work_free(work *w) {
  mr_free(w->w);
  mr_free(w->local);
  mr_free(w->nc);
  mr_free(w->hs);
  mr_free(w->lload);
  mr_free(w->bucket);
  mr_free(w->start);
}

/* Sizes w for pb and computes the per-pair weights and per-host constants. Counts (< 2^53)
 * convert to doubles exactly; the loads are sums of doubles whose rounding (relative 2^-53
 * an addition) stays far below the relative 1e-9 and 1e-12 margins of the comparisons. */
static int work_init(work *w, const pl_problem *pb, mr_err *e) {
  memset(w, 0, sizeof *w);
  w->pb = pb;
  w->L = pb->num_layers;
  w->E = pb->num_experts;
  w->S = pb->n_hosts;
  w->R = pb->replicas ? pb->replicas : 1;
  w->P = (size_t)w->L * w->E;
  w->w = mr_malloc(w->P * sizeof *w->w);
  w->local = mr_malloc(w->P);
  w->nc = mr_malloc(w->P);
  w->hs = mr_malloc(w->P * w->R * sizeof *w->hs);
  w->lload = mr_malloc((size_t)w->L * w->S * sizeof *w->lload);
  w->bucket = mr_malloc(w->E * sizeof *w->bucket);
  w->start = mr_malloc((w->S + 1) * sizeof *w->start);
  if (!w->w || !w->local || !w->nc || !w->hs || !w->lload || !w->bucket || !w->start) {
    work_free(w);
    return mr_err_set(e, MR_ENOMEM, "plan: %u x %u pairs: out of memory", w->L, w->E);
  }
  for (size_t i = 0; i < w->P; i++) {
    uint32_t l = (uint32_t)(i / w->E);
    w->w[i] = !is_moe(w, l) ? 0 : pb->counts ? (double)pb->counts[i] : 1.0;
  }
  w->gpuB = pl_expert_bytes(pb->format, pb->hidden, pb->inter, 1);
  for (uint32_t h = 0; h < w->S; h++) {
    w->B[h] = pl_expert_bytes(pb->format, pb->hidden, pb->inter, pb->hosts[h].numa_nodes);
    w->k[h] = (double)w->B[h] / pb->hosts[h].speed;
    w->cap[h] = pb->hosts[h].capacity ? pb->hosts[h].capacity : UINT64_MAX;
  }
  work_clear(w);
  return 0;
}

/* Every field of pb in range (the library may be called with anything; the command's own
 * checks give the friendlier messages first). */
static int check_problem(const pl_problem *pb, mr_err *e) {
  if (pb->num_layers < 1 || pb->num_layers > MR_MAX_LAYERS || pb->num_experts < 1 ||
      pb->num_experts > 65536)
    return mr_err_set(e, MR_ERANGE, "plan: %u layers x %u experts, must be 1..%u x 1..65536",
                      pb->num_layers, pb->num_experts, MR_MAX_LAYERS);
  if (pb->n_hosts < 1 || pb->n_hosts > MR_PLACEMENT_MAX_SERVERS)
    return mr_err_set(e, MR_ERANGE, "plan: %u hosts, must be 1..%u (the cluster file's servers)",
                      pb->n_hosts, MR_PLACEMENT_MAX_SERVERS);
  if (pb->replicas > PL_MAX_REPLICAS)
    return mr_err_set(e, MR_ERANGE, "--replicas = %u, must be 1..%u", pb->replicas, PL_MAX_REPLICAS);
  if (pb->hidden < 1 || pb->hidden > 65536 || pb->inter < 1 || pb->inter > 65536)
    return mr_err_set(e, MR_ERANGE, "plan: hidden %u, inter %u, must be 1..65536", pb->hidden,
                      pb->inter);
  if ((unsigned)pb->format >= PL_WF_COUNT || (unsigned)pb->strategy >= PL_STRATEGY_COUNT)
    return mr_err_set(e, MR_EINVAL, "plan: bad format or strategy");
  if (!(pb->tolerance >= 0 && pb->tolerance <= 1))
    return mr_err_set(e, MR_ERANGE, "--tolerance = %g, must be 0..1", pb->tolerance);
  for (uint32_t h = 0; h < pb->n_hosts; h++) {
    const pl_host *ho = &pb->hosts[h];
    if (!ho->name[0]) return mr_err_set(e, MR_EINVAL, "plan: host %u has no name", h);
    if (!(ho->speed > 0) || ho->speed > MR_CLUSTER_MAX_SPEED)
      return mr_err_set(e, MR_ERANGE, "plan: host %s: speed = %g, must be > 0 and <= 1e6",
                        ho->name, ho->speed);
    if (ho->numa_nodes > MR_CLUSTER_MAX_NUMA_NODES)
      return mr_err_set(e, MR_ERANGE, "plan: host %s: numa_nodes = %u, must be 1..%u",
                        ho->name, ho->numa_nodes, MR_CLUSTER_MAX_NUMA_NODES);
    for (uint32_t g = 0; g < h; g++)
      if (strcmp(pb->hosts[g].name, ho->name) == 0)
        return mr_err_set(e, MR_EINVAL, "plan: host %s is named twice", ho->name);
  }
  if (pb->counts)
    for (uint32_t l = 0; l < pb->num_layers; l++) {
      if (pb->is_moe[l]) continue;
      for (uint32_t x = 0; x < pb->num_experts; x++)
        if (pb->counts[(size_t)l * pb->num_experts + x])
          return mr_err_set(e, MR_EINVAL, "stats: layer %u expert %u has %llu tokens, but "
                            "layer %u is a dense layer of the model (no routed experts)", l, x,
                            (unsigned long long)pb->counts[(size_t)l * pb->num_experts + x], l);
    }
  return 0;
}

/* Runs the strategy on w (cleared), from scratch (cur == NULL) or seeded with the current
 * placement; good[] bounds the balanced search (NULL: none). */
static int run_strategy(work *w, const mr_placement *cur, const int32_t *map,
                        const double *good, pl_strategy st, mr_err *e) {
  work_clear(w);
  /* The passes read the strategy from w->pb; a copy of the problem with st in it stands in
   * for the caller's (const) one while they run. */
  const pl_problem *pb = w->pb;
  pl_problem tmp = *pb;
  tmp.strategy = st;
  w->pb = &tmp;
  int rc = hot_set(w, e);
  if (!rc) rc = check_fit(w, e);
  if (!rc) {
    if (st == PL_STRATEGY_BALANCED) {
      if (cur) seed_current(w, cur, map);
      rc = balanced_cold(w, good, e);
    } else {
      rc = cold_blocks(w, e);
    }
  }
  w->pb = pb;
  return rc;
}

/* The step load of w (sum over layers of the layer max), each layer's max in lmax[] when
 * not NULL. */
static double step_of(const work *w, double *lmax) {
  double s = 0;
  for (uint32_t l = 0; l < w->L; l++) {
    double m = layer_max(w, l);
    if (lmax) lmax[l] = m;
    s += m;
  }
  return s;
}

void pl_plan_free(pl_plan *p) {
  if (!p) return;
  mr_free(p->local);
  mr_free(p->ncopy);
  mr_free(p->host);
  mr_free(p);
}

/* A whole assignment put aside: the fresh plan, while the fewest-moves one is tried. */
typedef struct assign_snap {
  uint8_t *local, *nc;  /* [P] */
  uint16_t *hs;         /* [P * R] */
  double *lload;        /* [L * S] */
  uint64_t used[MR_PLACEMENT_MAX_SERVERS];
} assign_snap;

static void assign_free(assign_snap *a) {
  mr_free(a->local);
  mr_free(a->nc);
  mr_free(a->hs);
  mr_free(a->lload);
}

/* Copies w's assignment into a (allocated here; assign_free releases it, also on error). */
static int assign_save(const work *w, assign_snap *a, mr_err *e) {
  a->local = mr_malloc(w->P);
  a->nc = mr_malloc(w->P);
  a->hs = mr_malloc(w->P * w->R * sizeof *a->hs);
  a->lload = mr_malloc((size_t)w->L * w->S * sizeof *a->lload);
  if (!a->local || !a->nc || !a->hs || !a->lload)
    return mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  memcpy(a->local, w->local, w->P);
  memcpy(a->nc, w->nc, w->P);
  memcpy(a->hs, w->hs, w->P * w->R * sizeof *a->hs);
  memcpy(a->lload, w->lload, (size_t)w->L * w->S * sizeof *a->lload);
  memcpy(a->used, w->used, sizeof a->used);
  return 0;
}

static void assign_restore(work *w, const assign_snap *a) {
  memcpy(w->local, a->local, w->P);
  memcpy(w->nc, a->nc, w->P);
  memcpy(w->hs, a->hs, w->P * w->R * sizeof *a->hs);
  memcpy(w->lload, a->lload, (size_t)w->L * w->S * sizeof *a->lload);
  memcpy(w->used, a->used, sizeof w->used);
}

/* The "before" figures of p: the loads of the current placement (map: its servers' host
 * indices), or without one those of the uniform plan, which w holds afterwards. before[]
 * is the caller's [L * S] scratch. */
static int plan_before(work *w, const int32_t *map, double *before, pl_plan *p, mr_err *e) {
  const pl_problem *pb = w->pb;
  double tot[MR_PLACEMENT_MAX_SERVERS];
  if (pb->current) {
    current_loads(w, pb->current, map, before);
    p->before_is_current = true;
  } else {
    int rc = run_strategy(w, NULL, map, NULL, PL_STRATEGY_UNIFORM, e);
    if (rc) return rc;
    memcpy(before, w->lload, (size_t)w->L * w->S * sizeof *before);
  }
  work_eval(before, w->L, w->S, &p->step_before, &p->imbalance_before, tot);
  for (uint32_t h = 0; h < w->S; h++) p->host_load_before[h] = tot[h];
  return 0;
}

/* Fewest moves (balanced with --current), w holding the fresh plan: a second plan starts
 * from the current copies and improves each layer only until its max is within the
 * tolerance of the fresh plan's (lmax: the caller's [L] scratch), then the hosts' totals
 * only until within the tolerance of the fresh imbalance (each move costs bytes). It is
 * kept (p->kept_current) when its step load is within the tolerance of the fresh one's,
 * else w gets the fresh plan back. */
static int plan_sticky(work *w, const int32_t *map, double *lmax, pl_plan *p, mr_err *e) {
  const pl_problem *pb = w->pb;
  double fresh = step_of(w, lmax), fresh_imb, tot2[MR_PLACEMENT_MAX_SERVERS], st2;
  work_eval(w->lload, w->L, w->S, &st2, &fresh_imb, tot2);
  for (uint32_t l = 0; l < w->L; l++) lmax[l] *= 1 + pb->tolerance;
  assign_snap fresh_plan = {0};
  int rc = assign_save(w, &fresh_plan, e);
  if (!rc) rc = run_strategy(w, pb->current, map, lmax, pb->strategy, e);
  if (!rc) {
    total_balance(w, fresh_imb * (1 + pb->tolerance));
    double sticky = step_of(w, NULL);
    if (sticky <= fresh * (1 + pb->tolerance)) p->kept_current = true;
    else assign_restore(w, &fresh_plan);
  }
  assign_free(&fresh_plan);
  return rc;
}

/* Moves w's assignment into p (w keeps its loads and byte counts) with the "after"
 * figures. */
static void plan_take(work *w, pl_plan *p) {
  const pl_problem *pb = w->pb;
  double tot[MR_PLACEMENT_MAX_SERVERS];
  p->num_layers = w->L;
  p->num_experts = w->E;
  p->n_hosts = w->S;
  p->max_copies = w->R;
  snprintf(p->model_fingerprint, sizeof p->model_fingerprint, "%s", pb->model_fingerprint);
  for (uint32_t h = 0; h < w->S; h++) snprintf(p->host_name[h], 64, "%s", pb->hosts[h].name);
  p->local = w->local;
  p->ncopy = w->nc;
  p->host = w->hs;
  w->local = NULL;
  w->nc = NULL;
  w->hs = NULL;
  work_eval(w->lload, w->L, w->S, &p->step_after, &p->imbalance_after, tot);
  for (uint32_t h = 0; h < w->S; h++) {
    p->host_load[h] = tot[h];
    p->host_bytes[h] = w->used[h];
  }
}

/* What applying p costs against --current (without one every copy is new): per host the
 * bytes of copies to load and to drop, the client's local bytes gained and lost, and the
 * counts of local pairs and extra copies. O(P x R x copies). */
static void plan_moves(const work *w, const int32_t *map, pl_plan *p) {
  const mr_placement *cur = w->pb->current;
  for (size_t i = 0; i < w->P; i++) {
    if (p->local[i]) {
      p->n_local++;
      if (!cur || !cur->local[i]) p->gpu_in += w->gpuB;
    } else if (cur && cur->local[i]) {
      p->gpu_out += w->gpuB;
    }
    if (p->ncopy[i] > 1) p->n_extra_copies += p->ncopy[i] - 1u;
    for (uint32_t c = 0; c < p->ncopy[i]; c++) {
      uint32_t h = p->host[i * w->R + c];
      bool had = false;
      if (cur)
        for (uint32_t k = cur->rep_off[i]; k < cur->rep_off[i + 1]; k++)
          if ((uint32_t)map[cur->rep[k]] == h) had = true;
      if (!had) p->bytes_in[h] += w->B[h];
    }
    if (cur)
      for (uint32_t k = cur->rep_off[i]; k < cur->rep_off[i + 1]; k++) {
        uint32_t h = (uint32_t)map[cur->rep[k]];
        bool keep = false;
        for (uint32_t c = 0; c < p->ncopy[i]; c++)
          if (p->host[i * w->R + c] == h) keep = true;
        if (!keep) p->bytes_out[h] += w->B[h];
      }
  }
  p->gpu_bytes_used = p->n_local * w->gpuB;
}

int pl_plan_make(const pl_problem *pb, pl_plan **out, mr_err *e) {
  *out = NULL;
  int rc = check_problem(pb, e);
  if (rc) return rc;
  work w;
  if ((rc = work_init(&w, pb, e))) return rc;
  int32_t map[MR_PLACEMENT_MAX_SERVERS]; /* --current's server i is host map[i] */
  double *lmax = mr_malloc(w.L * sizeof *lmax);
  double *before = mr_malloc((size_t)w.L * w.S * sizeof *before);
  pl_plan *p = mr_calloc(1, sizeof *p);
  if (!lmax || !before || !p) rc = mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  if (!rc && pb->current) rc = map_current(&w, pb->current, map, e);
  if (!rc) rc = plan_before(&w, map, before, p, e);
  if (!rc) rc = run_strategy(&w, NULL, map, NULL, pb->strategy, e); /* from scratch */
  if (!rc && pb->strategy == PL_STRATEGY_BALANCED && pb->current)
    rc = plan_sticky(&w, map, lmax, p, e);
  if (!rc) {
    plan_take(&w, p);
    plan_moves(&w, map, p);
    *out = p;
    p = NULL;
  }
  pl_plan_free(p);
  mr_free(lmax);
  mr_free(before);
  work_free(&w);
  return rc;
}

/* ---- output -------------------------------------------------------------------------- */

/* One object per layer with any pair placed: "local" (an id-range set, e.g. "0-3,7") and
 * "remote" {host: set}; a pair with copies appears in several hosts' sets. cJSON builds it
 * (tab-indented, as cJSON_Print writes), with a final newline. */
int pl_plan_json(const pl_plan *p, char **out, mr_err *e) {
  *out = NULL;
  const uint32_t L = p->num_layers, E = p->num_experts, S = p->n_hosts, R = p->max_copies;
  const size_t words = ((size_t)E + 63) / 64;
  cJSON *root = cJSON_CreateObject();
  mr_idset *set = mr_calloc(S + 1, sizeof *set); /* set[S] = local */
  size_t cap = (size_t)E * 8 + 16;
  char *buf = mr_malloc(cap);
  int rc = 0;
  bool ok = root && set && buf;
  for (uint32_t h = 0; ok && h <= S; h++) ok = mr_idset_init(&set[h], E) == 0;
  if (!ok) {
    rc = mr_err_set(e, MR_ENOMEM, "plan: out of memory");
    goto out;
  }
  cJSON_AddStringToObject(root, "format", "moerpc-placement");
  cJSON_AddNumberToObject(root, "version", 1);
  if (p->model_fingerprint[0])
    cJSON_AddStringToObject(root, "model_fingerprint", p->model_fingerprint);
  cJSON_AddNumberToObject(root, "num_layers", L);
  cJSON_AddNumberToObject(root, "num_experts", E);
  cJSON *layers = cJSON_AddArrayToObject(root, "layers");
  for (uint32_t l = 0; l < L && layers; l++) {
    bool any = false;
    for (uint32_t h = 0; h <= S; h++) memset(set[h].bits, 0, words * sizeof *set[h].bits);
    for (uint32_t x = 0; x < E; x++) {
      size_t i = (size_t)l * E + x;
      if (p->local[i]) {
        mr_idset_add(&set[S], x);
        any = true;
      }
      for (uint32_t c = 0; c < p->ncopy[i]; c++) {
        mr_idset_add(&set[p->host[i * R + c]], x);
        any = true;
      }
    }
    if (!any) continue; /* a dense layer */
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToArray(layers, o);
    cJSON_AddNumberToObject(o, "layer", l);
    if (mr_idset_count(&set[S])) {
      mr_idset_format(&set[S], buf, cap);
      cJSON_AddStringToObject(o, "local", buf);
    }
    cJSON *rem = cJSON_AddObjectToObject(o, "remote");
    for (uint32_t h = 0; h < S; h++)
      if (mr_idset_count(&set[h])) {
        mr_idset_format(&set[h], buf, cap);
        cJSON_AddStringToObject(rem, p->host_name[h], buf);
      }
  }
  char *txt = layers ? cJSON_Print(root) : NULL;
  size_t n = txt ? strlen(txt) : 0;
  if (txt) *out = mr_malloc(n + 2);
  if (!*out) {
    rc = mr_err_set(e, MR_ENOMEM, "plan: out of memory");
  } else {
    memcpy(*out, txt, n);
    (*out)[n] = '\n';
    (*out)[n + 1] = '\0';
  }
  if (txt) cJSON_free(txt);
out:
  if (set)
    for (uint32_t h = 0; h <= S; h++) mr_idset_close(&set[h]);
  mr_free(set);
  mr_free(buf);
  cJSON_Delete(root);
  return rc;
}

int pl_plan_write(const pl_plan *p, const char *path, mr_err *e) {
  char *txt = NULL;
  int rc = pl_plan_json(p, &txt, e);
  if (rc) return rc;
  size_t n = strlen(txt);
  if (strcmp(path, "-") == 0) {
    if (fwrite(txt, 1, n, stdout) != n || fflush(stdout) != 0)
      rc = mr_err_set(e, MR_EIO, "stdout: write failed: %s", strerror(errno));
    mr_free(txt);
    return rc;
  }
  rc = mr_file_write_atomic(path, txt, n, e);
  mr_free(txt);
  return rc;
}
