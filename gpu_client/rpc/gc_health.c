/*
 * gc_health.c - which servers are up: marking one down, the prober thread that brings it
 * back, and the health counters (docs/DESIGN.md "Replicas and failover").
 *
 * Life of a server, as seen by one client:
 *
 *          stream broke / failover deadline             fresh Hello matches the cluster
 *   UP ---------------------------------------> DOWN -----------------------------------> UP
 *   (gets traffic)    gc__server_down           (no traffic;     probe (prober thread)
 *                                                 probed with     Hello refused: stays
 *                                                 backoff)        DOWN, logged once
 *
 * The prober Hellos every down server whose probe time has come, all at once on their
 * control channels (WAIT_FOR_READY, GC__PROBE_TIMEOUT_MS), so a returning server is seen as
 * soon as gRPC's reconnect (backoff capped at 2 s, gc_cluster.c) gets through. Between
 * failed probes it waits a backoff of 200 ms doubling to 2 s. The first probe after a
 * broken stream is immediate (a live server whose stream merely ended answers at once);
 * after a stall it waits the backoff (a stuck server may still answer Hellos). A server
 * that goes down again within GC__FLAP_MS of its return starts from twice its last backoff.
 *
 * Decode steps never wait for the prober: the plan reads the up flags without a lock.
 * The stream of a returning server is reopened by the next request to it (gc_stream.c
 * refuses to open one while the server is down).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gpu_client/rpc/internal.h"

#define GC__PROBE_TIMEOUT_MS 500u
#define GC__BACKOFF_INITIAL_MS 200u
#define GC__BACKOFF_MAX_MS 2000u
#define GC__FLAP_MS 10000u

void gc__server_down(gc_cluster *c, uint32_t idx, bool probe_now, const char *why) {
  gc__stream *s = &c->streams[idx];
  const uint64_t now = mr_now_ns();
  pthread_mutex_lock(&c->health_lock);
  if (!atomic_load(&s->up)) {
    pthread_mutex_unlock(&c->health_lock);
    return;
  }
  atomic_store(&s->up, false);
  /* Flapping (down again soon after a return) backs off further than a first outage. */
  bool flap = s->health.returns && now - s->health.t_up_ns < (uint64_t)GC__FLAP_MS * 1000000u;
  uint32_t b = flap ? 2 * s->health.backoff_ms : GC__BACKOFF_INITIAL_MS;
  s->health.backoff_ms = b > GC__BACKOFF_MAX_MS ? GC__BACKOFF_MAX_MS : b;
  s->health.t_down_ns = now;
  s->health.next_probe_ns = now + (probe_now && !flap ? 0 : (uint64_t)s->health.backoff_ms * 1000000u);
  s->health.refusal_logged = false;
  s->health.fo_measured = false;
  s->health.t_last_ok_ns = atomic_load(&s->t_last_ok_ns);
  s->health.failovers++;
  snprintf(s->health.why, sizeof s->health.why, "%s", why);
  uint64_t n = s->health.failovers;
  pthread_cond_signal(&c->health_cond);
  pthread_mutex_unlock(&c->health_lock);
  mr_log(MR_LOG_WARN, GC__SRV_FMT ": down: %s; its work goes to the other replicas until a "
         "fresh Hello (failover %llu)", GC__SRV_ARGS(s->srv), why, (unsigned long long)n);
}

void gc__server_resent(gc_cluster *c, uint32_t idx, uint32_t n) {
  pthread_mutex_lock(&c->health_lock);
  c->streams[idx].health.resent += n;
  pthread_mutex_unlock(&c->health_lock);
}

void gc__server_failover_time(gc_cluster *c, uint32_t idx, uint64_t t_first_ns) {
  gc__stream *s = &c->streams[idx];
  pthread_mutex_lock(&c->health_lock);
  if (!s->health.fo_measured && s->health.t_last_ok_ns && t_first_ns > s->health.t_last_ok_ns) {
    s->health.last_failover_us = (t_first_ns - s->health.t_last_ok_ns) / 1000u;
    s->health.fo_measured = true;
  }
  pthread_mutex_unlock(&c->health_lock);
}

void gc__down_explain(gc_cluster *c, uint32_t layer, const uint8_t *missing, char *msg,
                      size_t len) {
  if (!missing || !msg) return;
  uint8_t seen[MR_CLUSTER_MAX_SERVERS] = {0};
  size_t pos = strlen(msg);
  const uint64_t now = mr_now_ns();
  bool first = true;
  const gc__routes *rt = gc__routes_get(c);
  pthread_mutex_lock(&c->health_lock);
  for (uint32_t x = 0; x < c->E; x++) {
    if (!missing[x]) continue;
    size_t i = (size_t)layer * c->E + x;
    for (uint32_t j = rt->rep_off[i]; j < rt->rep_off[i + 1]; j++) {
      uint32_t s = rt->rep[j];
      if (seen[s] || pos + 1 >= len) continue;
      seen[s] = 1;
      const gc__stream *st = &c->streams[s];
      bool down = !atomic_load(&st->up);
      int w = snprintf(msg + pos, len - pos, "%s" GC__SRV_FMT ": %s", first ? "; down: " : ", ",
                       GC__SRV_ARGS(st->srv), down ? st->health.why : "(left out: it just failed)");
      if (w > 0 && down)
        w += snprintf(msg + pos + ((size_t)w < len - pos ? (size_t)w : len - pos - 1),
                      len - pos - ((size_t)w < len - pos ? (size_t)w : len - pos - 1),
                      " (down %llu ms)",
                      (unsigned long long)((now - st->health.t_down_ns) / 1000000u));
      if (w > 0) pos += (size_t)w < len - pos ? (size_t)w : len - pos - 1;
      first = false;
    }
  }
  pthread_mutex_unlock(&c->health_lock);
}

void gc__health_counters(gc_cluster *c, uint32_t idx, bool reset, gc_server_counters *out) {
  gc__stream *s = &c->streams[idx];
  const uint64_t now = mr_now_ns();
  pthread_mutex_lock(&c->health_lock);
  bool down = !atomic_load(&s->up);
  out->failovers = s->health.failovers;
  out->resent = s->health.resent;
  out->returns = s->health.returns;
  out->refusals = s->health.refusals;
  out->last_failover_us = s->health.last_failover_us;
  out->down_us = (s->health.down_ns + (down ? now - s->health.t_down_ns : 0)) / 1000u;
  out->down = down;
  if (reset) {
    s->health.failovers = s->health.resent = s->health.returns = s->health.refusals = 0;
    s->health.last_failover_us = s->health.down_ns = 0;
    if (down) s->health.t_down_ns = now; /* the spell in progress counts from the reset */
  }
  pthread_mutex_unlock(&c->health_lock);
}

/* Whether the returning server's Hello (tmp) matches what the cluster was opened with;
 * else why into msg, naming both values. */
static bool hello_matches(const gc_cluster *c, const gc__server *old, const gc__server *tmp,
                          char *msg, size_t len) {
  if (strcmp(tmp->fingerprint, c->fingerprint) != 0) {
    snprintf(msg, len, "model_fingerprint %s, the cluster's is %s (not the same model files)",
             tmp->fingerprint, c->fingerprint);
    return false;
  }
  if (strcmp(tmp->weight_format, c->weight_format) != 0) {
    snprintf(msg, len, "weight_format %s, the cluster's is %s (model_fingerprint %s both)",
             tmp->weight_format, c->weight_format, c->fingerprint);
    return false;
  }
  struct { const char *name; uint32_t theirs, ours; } dims[] = {
      {"hidden_size", tmp->hidden, c->H},       {"intermediate_size", tmp->inter, c->I},
      {"num_layers", tmp->layers, c->L},        {"num_experts", tmp->experts, c->E},
  };
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
    if (dims[i].theirs != dims[i].ours) {
      snprintf(msg, len, "%s %u, the cluster's is %u (model_fingerprint %s, the cluster's %s)",
               dims[i].name, dims[i].theirs, dims[i].ours, tmp->fingerprint, c->fingerprint);
      return false;
    }
  /* Requests are split by the max_tokens of the first Hello and routed by its pairs. */
  if (tmp->max_tokens < old->max_tokens || tmp->max_top_k < old->max_top_k) {
    snprintf(msg, len, "max_tokens %u / max_top_k %u, below the %u / %u it had", tmp->max_tokens,
             tmp->max_top_k, old->max_tokens, old->max_top_k);
    return false;
  }
  /* Its owned set may differ from the one at open: `moerpc-place apply` moves experts
   * while servers come and go. A pair it no longer serves is answered "not served", which
   * makes the caller re-Hello and re-route (docs/DESIGN.md 3.7), so it is no reason to keep
   * the server down (that would strand the pairs only it serves). */
  return true;
}

/* The prober's scratch, allocated before the thread starts. */
typedef struct gc__prober {
  gc_cluster *c;
  uint32_t *due;
  gc__server *tmp;
  int *rcs;
  mr_err *errs;
} gc__prober;

static void prober_free(gc__prober *pb) {
  if (!pb) return;
  mr_free(pb->due);
  mr_free(pb->tmp);
  mr_free(pb->rcs);
  mr_free(pb->errs);
  mr_free(pb);
}

static void *health_main(void *arg) {
  gc__prober *pb = arg;
  gc_cluster *c = pb->c;
  const uint32_t n = c->n_servers;
  uint32_t *due = pb->due;
  gc__server *tmp = pb->tmp;
  int *rcs = pb->rcs;
  mr_err *errs = pb->errs;
  pthread_mutex_lock(&c->health_lock);
  while (!c->health_stop) {
    uint64_t now = mr_now_ns(), next = UINT64_MAX;
    uint32_t nd = 0;
    for (uint32_t i = 0; i < n; i++) {
      gc__stream *s = &c->streams[i];
      if (atomic_load(&s->up)) continue;
      if (s->health.next_probe_ns <= now) due[nd++] = i;
      else if (s->health.next_probe_ns < next) next = s->health.next_probe_ns;
    }
    if (nd == 0) {
      /* Nothing due: sleep until the next probe, or until a server goes down (signal). */
      struct timespec ts;
      uint64_t until = next == UINT64_MAX ? now + 3600ull * 1000000000u : next;
      ts.tv_sec = (time_t)(until / 1000000000u);
      ts.tv_nsec = (long)(until % 1000000000u);
      pthread_cond_timedwait(&c->health_cond, &c->health_lock, &ts);
      continue;
    }
    pthread_mutex_unlock(&c->health_lock);
    gc__hello_round(c, due, nd, GC__PROBE_TIMEOUT_MS, tmp, rcs, errs);
    pthread_mutex_lock(&c->health_lock);
    now = mr_now_ns();
    for (uint32_t d = 0; d < nd; d++) {
      const uint32_t i = due[d];
      gc__stream *s = &c->streams[i];
      const gc__server *old = &c->servers[i];
      char why[400];
      bool refused = false;
      if (rcs[d] == 0 && hello_matches(c, old, &tmp[d], why, sizeof why)) {
        s->health.returns++;
        s->health.down_ns += now - s->health.t_down_ns;
        s->health.t_up_ns = now;
        atomic_store(&s->up, true);
        mr_log(MR_LOG_INFO, GC__SRV_FMT ": back after %llu ms: Hello matches (model %s, %s); "
               "it gets traffic again", GC__SRV_ARGS(old),
               (unsigned long long)((now - s->health.t_down_ns) / 1000000u), tmp[d].fingerprint,
               tmp[d].weight_format);
      } else {
        if (rcs[d] == 0 || rcs[d] == MR_EMISMATCH || rcs[d] == MR_EPROTO) {
          refused = true;
          if (rcs[d]) snprintf(why, sizeof why, "%s", errs[d].msg);
        }
        if (refused) {
          s->health.refusals++;
          if (!s->health.refusal_logged)
            mr_log(MR_LOG_WARN, GC__SRV_FMT ": answers again but is refused: %s; it stays "
                   "down", GC__SRV_ARGS(old), why);
          s->health.refusal_logged = true;
          snprintf(s->health.why, sizeof s->health.why, "refused on return: %.280s", why);
        } else {
          mr_log(MR_LOG_DEBUG, GC__SRV_FMT ": probe: %s", GC__SRV_ARGS(old), errs[d].msg);
        }
        /* A refused server is asked again at the longest backoff (it may be fixed). */
        uint32_t b = refused ? GC__BACKOFF_MAX_MS : s->health.backoff_ms;
        s->health.next_probe_ns = now + (uint64_t)b * 1000000u;
        if (!refused)
          s->health.backoff_ms = 2 * b > GC__BACKOFF_MAX_MS ? GC__BACKOFF_MAX_MS : 2 * b;
      }
      mr_free(tmp[d].announce);
      tmp[d].announce = NULL;
    }
  }
  pthread_mutex_unlock(&c->health_lock);
  prober_free(pb);
  return NULL;
}

int gc__health_start(gc_cluster *c, mr_err *e) {
  for (uint32_t i = 0; i < c->n_servers; i++) {
    c->streams[i].health.backoff_ms = GC__BACKOFF_INITIAL_MS;
    atomic_store(&c->streams[i].up, true);
  }
  const uint32_t n = c->n_servers;
  gc__prober *pb = mr_calloc(1, sizeof *pb);
  if (pb) {
    pb->c = c;
    pb->due = mr_calloc(n, sizeof *pb->due);
    pb->tmp = mr_calloc(n, sizeof *pb->tmp);
    pb->rcs = mr_calloc(n, sizeof *pb->rcs);
    pb->errs = mr_calloc(n, sizeof *pb->errs);
  }
  if (!pb || !pb->due || !pb->tmp || !pb->rcs || !pb->errs) {
    prober_free(pb);
    return mr_err_set(e, MR_ENOMEM, "client prober: out of memory");
  }
  if (pthread_create(&c->health_thread, NULL, health_main, pb) != 0) {
    prober_free(pb);
    return mr_err_set(e, MR_ENOMEM, "client prober thread: %s", strerror(errno));
  }
  c->health_started = true;
  return 0;
}

void gc__health_stop(gc_cluster *c) {
  if (!c->health_started) return;
  pthread_mutex_lock(&c->health_lock);
  c->health_stop = true;
  pthread_cond_signal(&c->health_cond);
  pthread_mutex_unlock(&c->health_lock);
  /* A probe in flight ends within GC__PROBE_TIMEOUT_MS. */
  pthread_join(c->health_thread, NULL);
  c->health_started = false;
}
