/*
 * es_admin.c - es_server_run: the server's own libuv loop (signals, the metrics timer) and
 * the drain sequence.
 *
 * The loop runs on the thread that calls es_server_run. Other threads reach it only through
 * es__admin_wake (uv_async_send, also async-signal-safe) and atomics; every field of the
 * admin section of es_server is touched by this thread alone.
 *
 * Start: es_server_run starts gRPC (health answers at once: liveness SERVING, readiness
 * NOT_SERVING; Hello, Stats and new Forward streams get UNAVAILABLE "loading: N of M
 * tensors") and the loader thread (LOADING). When the loader returns, this thread joins it,
 * takes the auto admission budget (the memory left with the weights in), starts the compute
 * thread and only then sets srv->loaded and readiness SERVING. A drain that begins while
 * loading (signal, es_server_stop) sets load_abort and joins the loader, which stops after
 * the expert it is packing (a few ms; this blocks the loop that long), then drains as below:
 * no request was accepted, so it ends as soon as the open calls do. A load that fails makes
 * es_server_run return its error.
 *
 * Drain, one phase after the other, re-checked on every wake-up and on a 20 ms tick:
 *
 *   SERVING --signal/stop--> DRAIN_REQUESTS: health NOT_SERVING; new Forward streams end
 *       at once with UNAVAILABLE, new requests on open streams get UNAVAILABLE replies,
 *       Hello gets UNAVAILABLE. The listener stays open, so that health checks (on open
 *       channels or new ones) keep seeing NOT_SERVING for the whole drain. Wait until every
 *       request accepted before is answered and its send completed (inflight == 0), or the
 *       drain timeout: then answer every queued job UNAVAILABLE without computing it.
 *   DRAIN_CALLS: ask every open stream to finish (status OK once its queued replies are
 *       sent); wait until every call has ended (live_calls == 0). If that takes longer than
 *       the rest of the timeout (at least 1 s, so that the UNAVAILABLE replies can go out,
 *       and 1 s after a batch that was computing then has finished, for at most 30 s more),
 *       cancel every call: replies still unsent then are lost, and counted.
 *   DRAIN_SHUTDOWN: grpc_server_shutdown_and_notify and, no call being left, cancel-all at
 *       once, which closes idle client connections instead of waiting for their clients;
 *       wait for the notification, then stop the compute thread, shut the completion queues
 *       down, join their threads, destroy the server: STOPPED. es_server_unanswered tells
 *       how many accepted requests never got their reply (the binary exits 3 then).
 *
 * Housekeeping, every ES_HOUSE_TICK_MS while serving and draining: streams paused on the
 * byte budget are resumed when it has room (also on a wake-up when bytes come back), a
 * stream whose reply send stalled past --stall-timeout-ms is cut, and after a peak of held
 * bytes has passed, after an eighth of the budget was received since the last trim, or
 * after a quiet second, malloc_trim gives the freed memory back to the system.
 *
 * A second SIGTERM/SIGINT during the drain stops the loop at once and es_server_run returns
 * MR_ECANCELED.
 *
 * SIGHUP reloads the credentials (es__auth_reload): the token file and the TLS files are
 * read and checked again and put in place only if all of them pass; one log line says what
 * was reloaded, or why nothing was. Nothing else changes: no drain, no restart, calls and
 * connections that are open go on. Without --tls-cert and --auth-token-file there is
 * nothing to reload, which the line says too.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "expert_server/internal.h"

#define ES_DRAIN_TICK_MS 20
#define ES_DRAIN_CALLS_MIN_MS 1000
/* A batch still computing when the calls' time is up was accepted before the drain: its
 * replies are waited for (and ES_DRAIN_CALLS_MIN_MS more to send them), up to this long past
 * the drain timeout. One batch is at most --max-tokens tokens of one layer: seconds at worst
 * (a sanitized build, one thread), unless the machine is stuck. */
#define ES_DRAIN_BATCH_MAX_MS 30000
/* After every call has ended, how long to wait for gRPC's shutdown notification (the
 * transports closing) before cancelling whatever still holds it up. */
#define ES_DRAIN_SHUTDOWN_GRACE_MS 5000
#define ES_HOUSE_TICK_MS 200
/* malloc_trim once held bytes fell below a quarter of a peak at least this large. */
#define ES_TRIM_MIN_PEAK ((int64_t)64 << 20)
/* Also trim once nothing happened for this long after some activity. */
#define ES_TRIM_QUIET_MS 1000
/* Free request buffers the pool keeps once a peak has passed. */
#define ES_POOL_KEEP_AFTER_PEAK ((size_t)16 << 20)

static uint64_t es__now_ms(void) { return mr_now_ns() / 1000000u; }

static void es__drain_step(es_server *s);
static void es__on_drain_tick(uv_timer_t *t);

static void es__loader_join(es_server *s) {
  if (!s->loader_started) return;
  pthread_join(s->loader, NULL);
  s->loader_started = false;
}

static void es__drain_begin(es_server *s, const char *why) {
  if (s->phase != ES_PHASE_SERVING && s->phase != ES_PHASE_LOADING) return;
  if (s->phase == ES_PHASE_LOADING) {
    atomic_store(&s->load_abort, true);
    atomic_store(&s->draining, true); /* Hello says draining from here on */
    es__loader_join(s);
    mr_log(MR_LOG_INFO, "loading stopped (%s) after %llu of %llu tensors", why,
           (unsigned long long)atomic_load(&s->load_tensors_done),
           (unsigned long long)s->load_tensors_total);
  }
  s->phase = ES_PHASE_DRAIN_REQUESTS;
  s->drain_t0_ms = es__now_ms();
  s->drain_deadline_ms = s->drain_t0_ms + s->opts.drain_timeout_ms;
  /* Order matters (see es__stream_on_request): the flag first, then the count is read. */
  atomic_store(&s->serving, false);
  atomic_store(&s->draining, true);
  /* For the log line only: q_len under its lock, no other lock held. */
  pthread_mutex_lock(&s->q_lock);
  uint32_t queued = s->q_len;
  pthread_mutex_unlock(&s->q_lock);
  mr_log(MR_LOG_INFO,
         "draining (%s): %lld requests in flight, %lld calls open, %" PRIu32 " jobs queued; "
         "waiting up to %" PRIu32 " ms",
         why, (long long)atomic_load(&s->inflight), (long long)atomic_load(&s->live_calls), queued,
         s->opts.drain_timeout_ms);
  uv_timer_start(&s->drain_timer, es__on_drain_tick, ES_DRAIN_TICK_MS, ES_DRAIN_TICK_MS);
  es__drain_step(s);
}

static void es__stop_loop(es_server *s) {
  uv_timer_stop(&s->drain_timer);
  uv_timer_stop(&s->house_timer);
  uv_timer_stop(&s->metrics_timer);
  uv_stop(&s->loop);
}

/* One step of the drain (see the top): each phase returns while it must wait and falls
 * through to the next once its condition holds, so one wake-up may cover several phases.
 * Called on every wake-up and drain tick; idempotent while waiting. */
static void es__drain_step(es_server *s) {
  uint64_t now = es__now_ms();
  switch (s->phase) {
  case ES_PHASE_DRAIN_REQUESTS: {
    /* inflight counts requests accepted before the drain and not yet sent; the CQ threads
     * refuse new ones once draining is set (es__stream_on_request's order). */
    long long left = atomic_load(&s->inflight);
    if (left > 0 && now < s->drain_deadline_ms) return;
    if (left > 0) {
      uint32_t q = es__compute_abort_queued(s);
      mr_log(MR_LOG_WARN,
             "drain: timeout after %" PRIu32 " ms with %lld requests unanswered; %" PRIu32
             " queued ones answered UNAVAILABLE without computing them",
             s->opts.drain_timeout_ms, left, q);
    }
    s->phase = ES_PHASE_DRAIN_CALLS;
    /* The calls get what is left of the timeout, but at least ES_DRAIN_CALLS_MIN_MS: the
     * UNAVAILABLE replies of an aborted queue still have to go out. */
    uint64_t rest = s->drain_deadline_ms > now ? s->drain_deadline_ms - now : 0;
    s->calls_deadline_ms = now + (rest > ES_DRAIN_CALLS_MIN_MS ? rest : ES_DRAIN_CALLS_MIN_MS);
    es__streams_finish(s);
  }
  /* fall through */
  case ES_PHASE_DRAIN_CALLS: {
    /* live_calls: unary calls and streams not yet freed; each stream ends once its queued
     * replies are sent (es__streams_finish), a client that does not read holds it open. */
    long long calls = atomic_load(&s->live_calls);
    if (calls > 0) {
      /* A batch computing now holds accepted requests: its replies get their time to go
       * out (see ES_DRAIN_BATCH_MAX_MS). */
      const bool cut = atomic_load(&s->cancelled_all);
      if (now >= s->calls_deadline_ms && !cut &&
          now < s->drain_deadline_ms + ES_DRAIN_BATCH_MAX_MS && es__compute_busy(s))
        s->calls_deadline_ms = now + ES_DRAIN_CALLS_MIN_MS;
      if (now >= s->calls_deadline_ms && !cut) {
        mr_log(MR_LOG_WARN, "drain: %lld calls still open after their streams were finished; "
               "cancelling them", calls);
        atomic_store(&s->cancelled_all, true); /* first: their unsent replies are lost */
        grpc_server_cancel_all_calls(s->gs);
      }
      return;
    }
    s->phase = ES_PHASE_DRAIN_SHUTDOWN;
    es__grpc_shutdown_begin(s);
    /* No call is left: this only closes the connections, so that an idle client does not
     * hold the exit up until it notices the GOAWAY. */
    grpc_server_cancel_all_calls(s->gs);
  }
  /* fall through */
  case ES_PHASE_DRAIN_SHUTDOWN:
    if (!atomic_load(&s->shutdown_notified)) {
      /* Every call has ended; the notification follows once the transports close. */
      if (now >= s->calls_deadline_ms + ES_DRAIN_SHUTDOWN_GRACE_MS && !atomic_load(&s->cancelled_all)) {
        atomic_store(&s->cancelled_all, true);
        grpc_server_cancel_all_calls(s->gs);
      }
      return;
    }
    /* No call is left, so no job either: the compute thread ends at once; then the CQ
     * threads are joined and every gRPC object is destroyed (es_server_free does the
     * rest). */
    es__compute_stop(s);
    es__grpc_destroy(s);
    s->phase = ES_PHASE_STOPPED;
    long long lost = atomic_load(&s->lost_in_drain);
    mr_log(lost ? MR_LOG_WARN : MR_LOG_INFO,
           "stopped: drained in %.2f s, %lld accepted unanswered; requests %llu, "
           "errors %llu since start; computed in %llu batches, merged %llu",
           (double)(es__now_ms() - s->drain_t0_ms) / 1e3, lost,
           (unsigned long long)atomic_load(&s->tot_requests),
           (unsigned long long)atomic_load(&s->tot_errors),
           (unsigned long long)atomic_load(&s->n_batches),
           (unsigned long long)atomic_load(&s->n_merged));
    s->run_rc = 0;
    es__stop_loop(s);
    return;
  default:
    return;
  }
}

static void es__on_drain_tick(uv_timer_t *t) { es__drain_step(t->data); }

/* Housekeeping (see the top). */
static void es__house(es_server *s) {
  if (s->phase < ES_PHASE_SERVING || s->phase >= ES_PHASE_DRAIN_SHUTDOWN) return;
  es__streams_service(s);
  es__leaving_service(s);
  es__tab_reap(s);
  int64_t held = atomic_load(&s->held_bytes);
  if (held > s->house_trim_peak) s->house_trim_peak = held;
  /* Activity: requests or calls came or went since the last tick. */
  uint64_t req = atomic_load(&s->tot_requests);
  long long calls = atomic_load(&s->live_calls);
  if (req != s->house_last_requests || calls != s->house_last_calls) {
    s->house_dirty = true;
    s->house_quiet_ms = 0;
  } else {
    s->house_quiet_ms += ES_HOUSE_TICK_MS;
  }
  s->house_last_requests = req;
  s->house_last_calls = calls;
  bool after_peak = s->house_trim_peak >= ES_TRIM_MIN_PEAK && held < s->house_trim_peak / 4;
  bool quiet = s->house_dirty && s->house_quiet_ms >= ES_TRIM_QUIET_MS;
  /* Churn: every request arrives twice, in gRPC's read buffers and then in our buffer; the
   * first copy is freed at once but stays in malloc's free lists, between live blocks, so a
   * flood of new streams left RSS near the budget *plus* the bytes gRPC had received
   * meanwhile (measured: 256 greedy streams, 537 MB budget, peak 1.0 GB, 0.6 GB once
   * trimmed). A trim every eighth of the budget received bounds that to about an eighth
   * of it, at the cost of one heap walk per eighth (docs/DESIGN.md 3.5). */
  uint64_t in = atomic_load_explicit(&s->bytes_in, memory_order_relaxed);
  bool churn = in - s->house_trim_bytes_in >= s->max_inflight_bytes / 8;
  if (after_peak || quiet || churn) {
    /* gRPC's buffers of closed connections and our freed buffers go back to the system
     * rather than stay in malloc's free lists at the size of the last peak. */
    es__pool_trim(&s->pool, ES_POOL_KEEP_AFTER_PEAK);
    malloc_trim(0);
    mr_log(MR_LOG_DEBUG, "memory: trimmed (%s; held %.0f MB, peak %.0f MB)",
           after_peak ? "after a peak" : quiet ? "quiet" : "churn", (double)held / 1e6,
           (double)s->house_trim_peak / 1e6);
    s->house_trim_peak = held;
    s->house_dirty = false;
    s->house_trim_bytes_in = in;
  }
}

static void es__on_house(uv_timer_t *t) { es__house(t->data); }

static void es__log_serving(es_server *s);

/* The loader returned (admin thread): serve, or stop with its error. */
static void es__load_done(es_server *s) {
  es__loader_join(s);
  if (s->load_rc) {
    mr_log(MR_LOG_ERROR, "loading failed: %s (%s)", s->load_err.msg, mr_err_name(s->load_rc));
    s->run_rc = s->load_rc;
    es__stop_loop(s);
    return;
  }
  if (!s->opts.max_inflight_bytes) s->max_inflight_bytes = es__inflight_budget(s);
  if (!s->opts.max_inflight_bytes && !es__streams_size(s))
    mr_log(MR_LOG_WARN, "--max-streams %" PRIu32 ": the streams' windows and state (%" PRIu32
           " x %zu bytes) are more than half of the auto budget (%zu bytes); half is set aside "
           "for them, the rest is not counted", s->max_streams, s->max_streams,
           s->stream_charge, s->max_inflight_bytes);
  int rc = es__tab_init(s, &s->load_err);
  if (!rc) rc = es__compute_start(s, &s->load_err);
  if (rc) {
    s->load_rc = s->run_rc = rc;
    es__stop_loop(s);
    return;
  }
  /* Everything a request reads (the table, the budget, the compute thread) exists before
   * loaded is published: the CQ threads check it (acquire) before anything else. */
  s->phase = ES_PHASE_SERVING;
  atomic_store_explicit(&s->loaded, true, memory_order_release);
  atomic_store(&s->serving, true);
  es__log_serving(s);
  es__cache_start(s); /* es-cache: write the cache, or verify the mapped one */
  if (atomic_load(&s->stop_requested)) es__drain_begin(s, "stop requested");
}

static void *es__loader_main(void *arg) {
  es_server *s = arg;
  pthread_setname_np(pthread_self(), "es-loader");
  mr_err_clear(&s->load_err);
  /* A usable --weight-cache is mapped instead of packing (es_cache.c). */
  s->load_t0_ns = mr_now_ns();
  const bool cached = es__cache_attach(s);
  s->load_rc = es__load_weights(s, cached, &s->load_err);
  atomic_store(&s->load_finished, true);
  es__admin_wake(s);
  return NULL;
}

/* The doorbell (es__admin_wake, internal.h): rung by the loader's end, bytes returned to a
 * budget with paused streams, a drain counter reaching zero, the gRPC shutdown notification
 * and es_server_stop. uv_async_send coalesces rings, so every cause is re-checked here. */
static void es__on_wake(uv_async_t *a) {
  es_server *s = a->data;
  if (atomic_load(&s->mem_paused) > 0) es__house(s);
  if (s->phase == ES_PHASE_LOADING && atomic_load(&s->load_finished) && !atomic_load(&s->stop_requested))
    es__load_done(s);
  if ((s->phase == ES_PHASE_SERVING || s->phase == ES_PHASE_LOADING) &&
      atomic_load(&s->stop_requested))
    es__drain_begin(s, "stop requested");
  else if (s->phase >= ES_PHASE_DRAIN_REQUESTS && s->phase < ES_PHASE_STOPPED)
    es__drain_step(s);
}

static void es__on_signal(uv_signal_t *h, int signum) {
  es_server *s = h->data;
  const char *name = signum == SIGTERM ? "SIGTERM" : signum == SIGINT ? "SIGINT" : "signal";
  if (s->phase == ES_PHASE_SERVING || s->phase == ES_PHASE_LOADING) {
    es__drain_begin(s, name);
  } else if (s->phase < ES_PHASE_STOPPED) {
    mr_log(MR_LOG_ERROR, "second %s during the drain: exiting now, %lld requests unanswered", name,
           (long long)atomic_load(&s->inflight));
    s->run_rc = MR_ECANCELED;
    es__stop_loop(s);
  }
}

static void es__on_hup(uv_signal_t *h, int signum) {
  es_server *s = h->data;
  (void)signum;
  if (!s->tls_on && !s->auth_on) {
    mr_log(MR_LOG_INFO, "SIGHUP: nothing to reload (no --tls-cert, no --auth-token-file); "
           "serving on");
    return;
  }
  char what[1200];
  mr_err e;
  mr_err_clear(&e);
  if (es__auth_reload(s, what, sizeof what, &e) != 0)
    mr_log(MR_LOG_ERROR, "SIGHUP: reload refused, the credentials in use stay: %s", e.msg);
  else
    mr_log(MR_LOG_INFO, "SIGHUP: reloaded %s; new calls and connections use them", what);
}

/* Logs one metrics line if there was traffic since the last one. */
static void es__on_metrics(uv_timer_t *t) {
  es_server *s = t->data;
  uint64_t now = es__now_ms();
  uint64_t req = atomic_load(&s->tot_requests), err = atomic_load(&s->tot_errors);
  uint64_t done = atomic_load(&s->n_computed), qus = atomic_load(&s->sum_queue_us);
  uint64_t cus = atomic_load(&s->sum_compute_us), bat = atomic_load(&s->n_batches);
  uint64_t mrg = atomic_load(&s->n_merged);
  uint64_t d_req = req - s->m_last_requests, d_err = err - s->m_last_errors;
  uint64_t d_done = done - s->m_last_computed, d_bat = bat - s->m_last_batches;
  double secs = (double)(now - s->m_last_ms) / 1e3;
  if (d_req || d_err) {
    mr_log(MR_LOG_INFO,
           "metrics: %" PRIu64 " requests (%.1f/s), %" PRIu64 " errors, %" PRIu64 " computed in %" PRIu64
           " batches (%" PRIu64 " merged), mean queue %.0f us, mean compute %.0f us, %lld calls open, "
           "%.1f MB held",
           d_req, secs > 0 ? (double)d_req / secs : 0.0, d_err, d_done, d_bat, mrg - s->m_last_merged,
           d_done ? (double)(qus - s->m_last_queue_us) / (double)d_done : 0.0,
           d_done ? (double)(cus - s->m_last_compute_us) / (double)d_done : 0.0,
           (long long)atomic_load(&s->live_calls), (double)atomic_load(&s->held_bytes) / 1e6);
  }
  s->m_last_ms = now;
  s->m_last_requests = req;
  s->m_last_errors = err;
  s->m_last_computed = done;
  s->m_last_queue_us = qus;
  s->m_last_compute_us = cus;
  s->m_last_batches = bat;
  s->m_last_merged = mrg;
}

int es__admin_init(es_server *s, mr_err *e) {
  int rc = uv_loop_init(&s->loop);
  if (rc) return mr_err_set(e, MR_EINTERNAL, "uv_loop_init: %s", uv_strerror(rc));
  rc = uv_async_init(&s->loop, &s->wake, es__on_wake);
  if (rc) {
    uv_loop_close(&s->loop);
    return mr_err_set(e, MR_EINTERNAL, "uv_async_init: %s", uv_strerror(rc));
  }
  s->wake.data = s;
  s->loop_inited = true;
  return 0;
}

static void es__on_closed(uv_handle_t *h) { (void)h; }

void es__admin_close(es_server *s) {
  if (!s->loop_inited) return;
  s->loop_inited = false;
  uv_close((uv_handle_t *)&s->wake, es__on_closed);
  uv_run(&s->loop, UV_RUN_NOWAIT);
  int rc = uv_loop_close(&s->loop);
  if (rc) mr_log(MR_LOG_ERROR, "uv_loop_close: %s", uv_strerror(rc));
}

static void es__log_serving(es_server *s) {
  mr_log(MR_LOG_INFO,
         "serving: %.*s:%d, %" PRIu32 " gRPC thread(s), max_tokens %" PRIu32 ", max_top_k %" PRIu32
         ", format %s, drain timeout %" PRIu32 " ms, budget %.0f MB in flight, at most %" PRIu32
         " streams%s (%zu KiB window each), stall timeout %" PRIu32 " ms",
         (int)(strrchr(s->listen, ':') - s->listen), s->listen, s->port, s->n_cq_threads, s->opts.max_tokens,
         s->limits.max_top_k, s->weight_format, s->opts.drain_timeout_ms,
         (double)s->max_inflight_bytes / 1e6, s->max_streams, s->opts.max_streams ? "" : " (auto)",
         s->stream_window >> 10, s->opts.stall_timeout_ms);
}

int es_server_run(es_server *s, mr_err *e) {
  MR_ASSERT(s && !s->run_called);
  s->run_called = true;
  int rc = es__grpc_start(s, e);
  if (rc) return rc;

  uv_timer_init(&s->loop, &s->metrics_timer);
  uv_timer_init(&s->loop, &s->drain_timer);
  uv_timer_init(&s->loop, &s->house_timer);
  s->metrics_timer.data = s->drain_timer.data = s->house_timer.data = s;
  uv_timer_start(&s->house_timer, es__on_house, ES_HOUSE_TICK_MS, ES_HOUSE_TICK_MS);
  if (s->opts.handle_signals) {
    uv_signal_init(&s->loop, &s->sig_term);
    uv_signal_init(&s->loop, &s->sig_int);
    uv_signal_init(&s->loop, &s->sig_hup);
    s->sig_term.data = s->sig_int.data = s->sig_hup.data = s;
    uv_signal_start(&s->sig_term, es__on_signal, SIGTERM);
    uv_signal_start(&s->sig_int, es__on_signal, SIGINT);
    uv_signal_start(&s->sig_hup, es__on_hup, SIGHUP);
  }
  s->m_last_ms = es__now_ms();
  if (s->opts.metrics_interval_ms)
    uv_timer_start(&s->metrics_timer, es__on_metrics, s->opts.metrics_interval_ms,
                   s->opts.metrics_interval_ms);

  s->run_rc = MR_EINTERNAL; /* until the drain completes or a second signal arrives */
  s->phase = ES_PHASE_LOADING;
  mr_log(MR_LOG_INFO, "listening: %.*s:%d, instance %s (health: liveness SERVING, readiness "
         "NOT_SERVING until loaded); loading %llu tensors, %.2f GB",
         (int)(strrchr(s->listen, ':') - s->listen), s->listen, s->port, s->instance_id,
         (unsigned long long)s->load_tensors_total, (double)s->load_bytes_total / 1e9);
  int err = pthread_create(&s->loader, NULL, es__loader_main, s);
  if (err) {
    s->run_rc = mr_err_set(e, MR_EINTERNAL, "cannot start the loader thread: error %d", err);
    s->phase = ES_PHASE_STOPPED;
  } else {
    s->loader_started = true;
  }
  if (atomic_load(&s->stop_requested)) es__drain_begin(s, "stop requested");

  if (s->phase != ES_PHASE_STOPPED) uv_run(&s->loop, UV_RUN_DEFAULT);

  /* Close this run's handles; the wake handle stays for es_server_stop until free. */
  uv_close((uv_handle_t *)&s->metrics_timer, es__on_closed);
  uv_close((uv_handle_t *)&s->drain_timer, es__on_closed);
  uv_close((uv_handle_t *)&s->house_timer, es__on_closed);
  if (s->opts.handle_signals) {
    uv_close((uv_handle_t *)&s->sig_term, es__on_closed);
    uv_close((uv_handle_t *)&s->sig_int, es__on_closed);
    uv_close((uv_handle_t *)&s->sig_hup, es__on_closed);
  }
  uv_run(&s->loop, UV_RUN_NOWAIT);
  if (s->run_rc == MR_ECANCELED)
    mr_err_set(e, MR_ECANCELED, "second signal during the drain");
  else if (s->run_rc && s->load_rc && e)
    *e = s->load_err;
  return s->run_rc;
}
