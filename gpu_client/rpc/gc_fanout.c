/*
 * gc_fanout.c - the pure parts of the client: the owner map, the split of one layer call
 * by owner, the gather and scatter-add of rows, the finite check of a reply's output, the
 * coverage check and format names.
 * No gRPC, no threads, no I/O: everything here is unit-tested in test_gc_fanout.c.
 *
 * The split of one call, T = 4 tokens, k = 2, experts 0-3 on server 0, 4-7 on server 1,
 * expert 8 local:
 *
 *   token  ids      ->  part s0 (rows 0,1,3)   part s1 (rows 1,2)   part local (row 3)
 *     0    [0, 2]        [0, 2]
 *     1    [1, 5]        [1,-1]                 [-1, 5]
 *     2    [6,-1]                               [ 6,-1]
 *     3    [8, 3]        [-1,3]                                      [8,-1]
 *
 * Each part carries only its tokens (rows, in increasing token order) and only its slots;
 * slot positions are kept, so a token's weights stay where the router put them.
 *
 * With replicas (a pair announced by several servers) each slot goes to one live replica,
 * the one with the least outstanding work counted in slots (queued + in flight on its
 * stream, plus what this plan already gave it), ties broken by a rotating start index so
 * that idle replicas take turns. A server still gets at most one part per plan.
 */
#include <stdio.h>
#include <string.h>

#include "gpu_client/rpc/internal.h"

#define GC__LAST_NONE UINT32_MAX

/* The server that computes slot (layer row, expert id): with replicas, the placement's
 * server while it is live, else the live replica with the least work (outstanding slots
 * plus the slots this plan gave it so far), ties to the first at or after rot in index
 * order. -1 when no replica is live. */
static int32_t replica_pick(const gc__replicas *rp, uint32_t n_servers, int32_t id,
                            const uint64_t *added) {
  if (rp->pref && rp->pref[id] >= 0 && rp->live[rp->pref[id]]) return rp->pref[id];
  int32_t best = -1;
  uint64_t best_w = 0;
  uint32_t best_r = 0;
  for (uint32_t i = rp->off[id]; i < rp->off[id + 1]; i++) {
    uint32_t s = rp->srv[i];
    if (!rp->live[s]) continue;
    uint64_t w = (rp->load ? rp->load[s] : 0) + added[s];
    uint32_t r = (s + n_servers - rp->rot % n_servers) % n_servers;
    if (best < 0 || w < best_w || (w == best_w && r < best_r)) {
      best = (int32_t)s;
      best_w = w;
      best_r = r;
    }
  }
  return best;
}

int gc__plan_build(gc__plan *p, const int32_t *owner_row, const gc__replicas *rp, uint32_t E,
                   uint32_t n_servers, uint32_t layer, uint32_t T, uint32_t k,
                   const int32_t *ids, const float *weights, mr_arena *a, mr_err *e) {
  const uint32_t n_targets = n_servers + 1; /* servers, then the local target */

  memset(p, 0, sizeof *p);
  p->n_tokens = T;
  p->top_k = k;

  uint32_t *count = mr_arena_alloc(a, n_targets * sizeof *count, 8);
  uint32_t *last = mr_arena_alloc(a, n_targets * sizeof *last, 8);
  int32_t *part_of = mr_arena_alloc(a, n_targets * sizeof *part_of, 8);
  /* The target of every slot, chosen once in pass 1 (-1: empty or caller-computed). */
  size_t n_slots = (size_t)T * k;
  int32_t *tgt = mr_arena_alloc(a, (n_slots ? n_slots : 1) * sizeof *tgt, 8);
  uint64_t *added = rp ? mr_arena_alloc(a, n_servers * sizeof *added, 8) : NULL;
  if (!count || !last || !part_of || !tgt || (rp && !added))
    return mr_err_set(e, MR_ENOMEM, "layer %u: split of %u tokens: out of memory", layer, T);
  memset(count, 0, n_targets * sizeof *count);
  if (added) memset(added, 0, n_servers * sizeof *added);
  for (uint32_t i = 0; i < n_targets; i++) last[i] = GC__LAST_NONE;
  uint32_t n_missing = 0;

  /* Pass 1: validate every slot, choose its target and count the tokens of each target. */
  for (uint32_t t = 0; t < T; t++) {
    for (uint32_t j = 0; j < k; j++) {
      size_t i = (size_t)t * k + j;
      int32_t id = ids[i];
      tgt[i] = -1;
      if (id == -1) continue;
      if (id < -1 || (uint32_t)id >= E)
        return mr_err_set(e, MR_ERANGE,
                          "layer %u: ids[%zu] (token %u, slot %u) = %d, must be -1 or < "
                          "num_experts %u",
                          layer, i, t, j, id, E);
      int32_t o = owner_row[id];
      if (o == GC_OWNER_CALLER) continue; /* the caller computes it: skipped like -1 */
      if (o == GC_OWNER_NONE)
        return mr_err_set(e, MR_EPRECOND,
                          "layer %u expert %d (ids[%zu], token %u) is owned by no server and "
                          "not local",
                          layer, id, i, t);
      if (o >= 0 && rp) {
        o = replica_pick(rp, n_servers, id, added);
        if (o < 0) {
          if (!p->missing) {
            p->missing = mr_arena_alloc(a, E, 8);
            if (!p->missing)
              return mr_err_set(e, MR_ENOMEM, "layer %u: split: out of memory", layer);
            memset(p->missing, 0, E);
          }
          n_missing += !p->missing[id];
          p->missing[id] = 1;
          continue;
        }
        added[o]++;
      }
      uint32_t tg = o == GC_OWNER_LOCAL ? n_servers : (uint32_t)o;
      MR_ASSERT(tg < n_targets); /* the owner map only holds indices we built */
      tgt[i] = (int32_t)tg;
      if (last[tg] != t) {
        last[tg] = t;
        count[tg]++;
      }
    }
  }
  if (n_missing) {
    char list[256];
    mr_idlist w;
    mr_idlist_init(&w, list, sizeof list);
    for (uint32_t x = 0; x < E; x++)
      if (p->missing[x]) mr_idlist_add(&w, x);
    mr_idlist_end(&w, true);
    return mr_err_set(e, MR_EUNAVAIL, "layer %u: expert%s %s %s no live replica", layer,
                      n_missing == 1 ? "" : "s", list, n_missing == 1 ? "has" : "have");
  }

  for (uint32_t tg = 0; tg < n_targets; tg++) {
    part_of[tg] = count[tg] ? (int32_t)p->n_parts++ : -1;
    last[tg] = GC__LAST_NONE;
  }
  if (p->n_parts == 0) return 0; /* every slot empty: nothing to send or compute */

  p->parts = mr_arena_alloc(a, p->n_parts * sizeof *p->parts, 8);
  if (!p->parts)
    return mr_err_set(e, MR_ENOMEM, "layer %u: split of %u tokens: out of memory", layer, T);
  for (uint32_t tg = 0; tg < n_targets; tg++) {
    if (part_of[tg] < 0) continue;
    gc__part *pt = &p->parts[part_of[tg]];
    size_t n = count[tg];
    pt->target = tg == n_servers ? GC_OWNER_LOCAL : (int32_t)tg;
    pt->n_tokens = 0; /* filled in pass 2 */
    pt->rows = mr_arena_alloc(a, n * sizeof *pt->rows, 64);
    pt->ids = mr_arena_alloc(a, n * k * sizeof *pt->ids, 64);
    pt->weights = mr_arena_alloc(a, n * k * sizeof *pt->weights, 64);
    if (!pt->rows || !pt->ids || !pt->weights)
      return mr_err_set(e, MR_ENOMEM, "layer %u: split of %u tokens: out of memory", layer, T);
  }

  /* Pass 2: a token's first slot for a target opens a row of all-empty slots in that
   * target's part; each slot then lands in its own position. */
  for (uint32_t t = 0; t < T; t++) {
    for (uint32_t j = 0; j < k; j++) {
      size_t i = (size_t)t * k + j;
      if (tgt[i] < 0) continue;
      uint32_t tg = (uint32_t)tgt[i];
      gc__part *pt = &p->parts[part_of[tg]];
      if (last[tg] != t) {
        last[tg] = t;
        uint32_t r = pt->n_tokens++;
        pt->rows[r] = t;
        for (uint32_t jj = 0; jj < k; jj++) {
          pt->ids[(size_t)r * k + jj] = -1;
          pt->weights[(size_t)r * k + jj] = 0.0f;
        }
      }
      size_t r = pt->n_tokens - 1;
      pt->ids[r * k + j] = ids[i];
      pt->weights[r * k + j] = weights[i];
    }
  }
  for (uint32_t tg = 0; tg < n_targets; tg++)
    if (part_of[tg] >= 0) MR_ASSERT(p->parts[part_of[tg]].n_tokens == count[tg]);
  return 0;
}

void gc__gather_rows(void *dst, const void *src, const uint32_t *rows, uint32_t n,
                     size_t row_bytes) {
  uint8_t *d = dst;
  const uint8_t *s = src;
  /* Runs of consecutive rows (common: a server owning most tokens) go in one memcpy. */
  uint32_t i = 0;
  while (i < n) {
    uint32_t j = i + 1;
    while (j < n && rows[j] == rows[j - 1] + 1) j++;
    memcpy(d + (size_t)i * row_bytes, s + (size_t)rows[i] * row_bytes, (size_t)(j - i) * row_bytes);
    i = j;
  }
}

void gc__scatter_add(float *out, uint32_t H, const uint32_t *rows, uint32_t n, const void *src,
                     mr_dtype dt) {
  const size_t row = (size_t)H * mr_dtype_size(dt);
  for (uint32_t i = 0; i < n; i++)
    mr_convert_add_f32(out + (size_t)rows[i] * H, (const uint8_t *)src + i * row, dt, H);
}

int gc__reply_check_finite(const void *y, mr_dtype dt, const uint32_t *rows, uint32_t n,
                           uint32_t H, mr_err *e) {
  size_t total = (size_t)n * H;
  size_t i = mr_nonfinite_find(y, dt, total);
  if (i == total) return 0;
  uint32_t bits;
  const char *what = mr_nonfinite_name(y, dt, i, &bits);
  size_t t = i / H;
  return mr_err_set(e, MR_EPROTO,
                    "reply output[row %zu (token %u of the call), index %zu] = %s (%s bits "
                    "0x%0*x): an OK reply must hold finite values only",
                    t, rows ? rows[t] : (unsigned)t, i % H, what, mr_dtype_name(dt),
                    (int)(2 * mr_dtype_size(dt)), (unsigned)bits);
}

void gc__owner_build(int32_t *owner, uint32_t L, uint32_t E, uint32_t n_servers,
                     const uint64_t *const *announce, const uint8_t *local, const int32_t *route,
                     uint64_t *assigned) {
  if (assigned) memset(assigned, 0, n_servers * sizeof *assigned);
  for (uint32_t l = 0; l < L; l++) {
    for (uint32_t x = 0; x < E; x++) {
      size_t i = (size_t)l * E + x;
      int32_t o = GC_OWNER_NONE;
      if (local && local[i]) {
        o = local[i] == GC__LOCAL_CALLER ? GC_OWNER_CALLER : GC_OWNER_LOCAL;
      } else if (route && route[i] >= 0 && (uint32_t)route[i] < n_servers) {
        o = route[i];
      } else {
        for (uint32_t s = 0; s < n_servers; s++) {
          if (announce[s] && (announce[s][i >> 6] >> (i & 63) & 1u)) {
            o = (int32_t)s;
            break;
          }
        }
      }
      owner[i] = o;
      if (o >= 0 && assigned) assigned[o]++;
    }
  }
}

size_t gc__replicas_build(uint32_t *off, uint16_t *srv, const int32_t *owner, uint32_t L,
                          uint32_t E, uint32_t n_servers, const uint64_t *const *announce,
                          uint64_t *assigned) {
  size_t n = 0;
  if (assigned) memset(assigned, 0, n_servers * sizeof *assigned);
  for (size_t i = 0; i < (size_t)L * E; i++) {
    off[i] = (uint32_t)n;
    if (owner[i] < 0) continue; /* local, caller-computed or nobody's */
    for (uint32_t s = 0; s < n_servers; s++) {
      if (!announce[s] || !(announce[s][i >> 6] >> (i & 63) & 1u)) continue;
      if (srv) srv[n] = (uint16_t)s;
      if (assigned) assigned[s]++;
      n++;
    }
  }
  off[(size_t)L * E] = (uint32_t)n;
  return n;
}

/* Most layers described in detail by the coverage message. */
#define GC__COVERAGE_DETAIL 3

uint32_t gc__coverage_check(const int32_t *owner, uint32_t L, uint32_t E, const uint8_t *must,
                            char *msg, size_t len) {
  uint32_t bad = 0;
  size_t pos = 0;
  if (len) msg[0] = '\0';
  for (uint32_t l = 0; l < L; l++) {
    uint32_t owned = 0;
    for (uint32_t x = 0; x < E; x++) owned += owner[(size_t)l * E + x] != GC_OWNER_NONE;
    if (owned == E || (owned == 0 && !(must && must[l]))) continue;
    bad++;
    if (bad > GC__COVERAGE_DETAIL || pos + 1 >= len) continue;
    char ids[256];
    mr_idlist missing;
    mr_idlist_init(&missing, ids, sizeof ids);
    for (uint32_t x = 0; x < E; x++)
      if (owner[(size_t)l * E + x] == GC_OWNER_NONE) mr_idlist_add(&missing, x);
    mr_idlist_end(&missing, true);
    int w = snprintf(msg + pos, len - pos, "%slayer %u: expert%s %s %s owned by no server and not "
                     "local", pos ? "; " : "", l, E - owned == 1 ? "" : "s", ids,
                     E - owned == 1 ? "is" : "are");
    if (w > 0) pos += (size_t)w < len - pos ? (size_t)w : len - pos - 1;
  }
  if (bad > GC__COVERAGE_DETAIL && pos + 1 < len)
    snprintf(msg + pos, len - pos, "; and %u more incomplete layer%s", bad - GC__COVERAGE_DETAIL,
             bad - GC__COVERAGE_DETAIL == 1 ? "" : "s");
  return bad;
}

int gc_weight_format_parse(const char *s, kn_format *fmt, uint32_t *group, mr_err *e) {
  if (!s || !*s) return mr_err_set(e, MR_EINVAL, "weight_format is empty");
  *group = 0;
  if (strncmp(s, "int4", 4) == 0) {
    unsigned g = 0;
    char tail = 0;
    if (sscanf(s, "int4-g%u%c", &g, &tail) != 1 || (g != 32 && g != 64 && g != 128))
      return mr_err_set(e, MR_EINVAL,
                        "weight_format \"%s\": int4 needs a group, \"int4-g32\", \"int4-g64\" "
                        "or \"int4-g128\"",
                        s);
    *fmt = KN_FMT_INT4;
    *group = g;
    return 0;
  }
  /* Wire names only: "fp8" is a flag alias (kn_format_parse), the wire says "fp8-b128". */
  if (strcmp(s, "fp8") == 0 || kn_format_parse(s, fmt) != 0)
    return mr_err_set(e, MR_EINVAL,
                      "weight_format \"%s\" is unknown, must be f32, f16, bf16, int8, "
                      "int4-g<32|64|128> or fp8-b128",
                      s);
  return 0;
}
