/*
 * gc_serve.c - the OpenAI-compatible server of `moerpc-client serve` (serve.h): requests
 * from the HTTP thread into the scheduler, tokens from the scheduler thread back out as
 * server-sent events or one JSON answer.
 *
 * The life of a completion request (an sv_req):
 *
 *   HTTP thread   handle_completion: state, gc_oai_parse, model name, prompt ids (chat
 *                 template + tokenizer, or the ids given), token budget, sampling
 *                 -> r->mu held: gc_sched_submit (refused: 400 / 429 / 503 answered here)
 *                 -> stream: head + the role chunk; live list; on_close; r->mu released
 *   sched thread  on_token (r->mu): text (text.h) -> chunk, or kept for the answer
 *                 on_boundary: peer_gone on every live call -> gc_sched_cancel
 *                 on_done (r->mu): last chunk + usage + [DONE] / the answer / an error;
 *                 off the live list; freed
 *
 * r->mu makes the handler's set-up (the stream's head) come before the first token even
 * when the scheduler picks the request up at once. Lock order (serve.h): r->mu -> sv->lock
 * -> the call's lock -> the scheduler's lock. on_close runs under the call's lock and only
 * sets r->gone and calls gc_sched_cancel.
 *
 * JSON answers and chunks are written by hand into an mr_buf text buffer (one per
 * request, reused): a chunk is a fixed head per request, the escaped text and a fixed
 * tail, so each token costs one escape and one copy. Text is made valid UTF-8 on its way
 * into a JSON string (U+FFFD for what is not).
 */
#include "gpu_client/runner/serve.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

enum { SV_LOADING, SV_READY, SV_DRAINING };

/* Appends a string literal. */
#define APP(p, lit) mr_buf_append((p), "" lit, sizeof(lit) - 1)

typedef struct sv_req sv_req;

struct gc_serve {
  mr_http_server *h;
  char *model_name;
  uint32_t drain_timeout_ms;
  _Atomic int state;
  _Atomic bool attached;        /* m is set (release): read m only after seeing it (acquire) */
  gc_serve_model m;
  long long created;            /* unix time the server started (/v1/models) */
  pthread_mutex_t lock;         /* live */
  sv_req *live;                 /* requests the scheduler holds */
  _Atomic uint64_t next_rid, cut;
  /* metrics */
  mr_hist ttft, itl, e2e;
  _Atomic uint64_t finished[GC_FINISH_ERROR + 1];
  _Atomic uint64_t prompt_tokens, completion_tokens;
};

struct sv_req {
  gc_serve *sv;
  pthread_mutex_t mu;           /* the handler's set-up vs the scheduler's callbacks */
  mr_http_call *call;
  uint64_t sched_id;
  gc_oai_kind kind;
  bool stream, include_usage, logprobs;
  bool started;                 /* the stream's head was handed over (mr_http_stream_begin) */
  uint32_t top_logprobs;
  _Atomic bool gone;            /* the client left (on_close, a failed write, peer_gone) */
  gc_text_out *txt;
  mr_buf text;                 /* the answer's text so far, JSON-escaped (not streamed) */
  mr_buf lp;                   /* logprob entries not yet sent, JSON (see lp_add) */
  uint32_t lp_n;                /* entries in lp */
  uint32_t text_off;            /* completions' text_offset: bytes of text emitted */
  mr_buf out;                  /* the chunk / answer being built */
  gc_tok_text tokstr;           /* decode of one id (logprobs) */
  char id[48];
  long long created;
  uint32_t n_prompt;
  uint64_t t_arrive_ns, t_last_ns;
  sv_req *prev, *next;
};

/* Buckets: time to first token and end-to-end up to minutes (long prompts, long answers),
 * inter-token latency from half a millisecond. Milliseconds, exposed in seconds. */
static void hist_ms(mr_hist *h, const double *ms, uint32_t n) {
  uint64_t ns[MR_HIST_MAX_BUCKETS];
  for (uint32_t i = 0; i < n; i++) ns[i] = (uint64_t)(ms[i] * 1e6);
  mr_hist_init(h, ns, n, 1e-9);
}

/* ---- JSON text ------------------------------------------------------------------------------ */

/* Appends s[0..n) as the inside of a JSON string: valid UTF-8 (U+FFFD otherwise), quotes,
 * backslashes and control characters escaped. */
static void json_esc(mr_buf *p, const char *s, size_t n) {
  char *v = NULL;
  size_t vl = 0, vc = 0;
  if (!gc_oai_utf8_append(&v, &vl, &vc, s, n)) {
    p->oom = true;
    return;
  }
  size_t run = 0;
  for (size_t i = 0; i < vl; i++) {
    const unsigned char c = (unsigned char)v[i];
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    mr_buf_append(p, v + run, i - run);
    run = i + 1;
    switch (c) {
      case '"': APP(p, "\\\""); break;
      case '\\': APP(p, "\\\\"); break;
      case '\n': APP(p, "\\n"); break;
      case '\r': APP(p, "\\r"); break;
      case '\t': APP(p, "\\t"); break;
      default: mr_buf_printf(p, "\\u%04x", c);
    }
  }
  mr_buf_append(p, v + run, vl - run);
  mr_free(v);
}

static void json_str(mr_buf *p, const char *s, size_t n) {
  APP(p, "\"");
  json_esc(p, s, n);
  APP(p, "\"");
}

/* A float as JSON (logprobs can be -inf for a token of probability 0: JSON has no
 * infinity, OpenAI's servers send -9999.0). */
static void json_float(mr_buf *p, float v) {
  if (!(v > -9999.0f)) v = -9999.0f;
  mr_buf_printf(p, "%.6g", (double)v);
}

/* {"error": {...}} in OpenAI's shape. */
static void error_json(mr_buf *p, const char *msg, const char *type, const char *param, const char *code) {
  APP(p, "{\"error\":{\"message\":");
  json_str(p, msg, strlen(msg));
  mr_buf_printf(p, ",\"type\":\"%s\",\"param\":", type);
  if (param && *param) json_str(p, param, strlen(param));
  else APP(p, "null");
  APP(p, ",\"code\":");
  if (code) json_str(p, code, strlen(code));
  else APP(p, "null");
  APP(p, "}}");
}

static void reply_error(mr_http_call *c, int status, const char *msg, const char *param, const char *code) {
  const char *type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error"
                     : status == 429 ? "rate_limit_error" : status >= 500 ? "server_error"
                                                          : "invalid_request_error";
  mr_buf p;
  mr_buf_init(&p);
  error_json(&p, msg, type, param, code);
  static const char *const retry[] = {"Retry-After", "1", NULL};
  mr_http_reply(c, status, "application/json", p.buf ? p.buf : "", p.len,
                status == 429 || status == 503 ? retry : NULL);
  mr_buf_close(&p);
}

/* ---- requests -------------------------------------------------------------------------------- */

static void req_free(sv_req *r) {
  gc_text_out_free(r->txt);
  mr_buf_close(&r->text);
  mr_buf_close(&r->lp);
  mr_buf_close(&r->out);
  gc_tok_text_close(&r->tokstr);
  pthread_mutex_destroy(&r->mu);
  mr_free(r);
}

/* The peer went away (the HTTP thread, under the call's lock). */
static void on_close(void *ud) {
  sv_req *r = ud;
  atomic_store(&r->gone, true);
  gc_sched_cancel(r->sv->m.sched, r->sched_id);
}

/* Writes what r->out holds as one SSE event ("data: ...\n\n"); a write the peer cannot
 * take marks r gone. */
static void sse_send(sv_req *r) {
  if (atomic_load(&r->gone)) return;
  APP(&r->out, "\n\n");
  int rc = r->out.oom ? MR_ENOMEM : mr_http_stream_write(r->call, r->out.buf, r->out.len);
  if (rc) atomic_store(&r->gone, true);
}

/* The head of every chunk of r, up to the choice's contents. */
static void chunk_head(sv_req *r) {
  gc_serve *sv = r->sv;
  mr_buf_reset(&r->out);
  mr_buf_printf(&r->out, "data: {\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", r->id,
                 r->kind == GC_OAI_CHAT ? "chat.completion.chunk" : "text_completion", r->created);
  json_str(&r->out, sv->model_name, strlen(sv->model_name));
  APP(&r->out, ",\"system_fingerprint\":\"moerpc\",\"choices\":[");
}

/* The decoded text of one id, for a logprob entry's "token" (valid UTF-8; a byte-level
 * token cut inside a character decodes to U+FFFD, as the reference servers show it). */
static void token_text(sv_req *r, int32_t id, const char **s, size_t *n) {
  mr_err e;
  if (gc_tok_decode(r->sv->m.tok, &id, 1, false, &r->tokstr, &e) == 0 && r->tokstr.s) {
    *s = r->tokstr.s;
    *n = r->tokstr.len;
  } else {
    *s = "";
    *n = 0;
  }
}

/* {"token": "...", "logprob": x, "bytes": [...]} (chat's shape). */
static void lp_entry(sv_req *r, mr_buf *p, int32_t id, float lp) {
  const char *s;
  size_t n;
  token_text(r, id, &s, &n);
  APP(p, "{\"token\":");
  json_str(p, s, n);
  APP(p, ",\"logprob\":");
  json_float(p, lp);
  APP(p, ",\"bytes\":[");
  for (size_t i = 0; i < n; i++) mr_buf_printf(p, i ? ",%u" : "%u", (unsigned char)s[i]);
  APP(p, "]");
}

/* Adds token t's logprob entry to r->lp. Chat: one object of "content" per token.
 * Completions: four parallel arrays (tokens, token_logprobs, top_logprobs, text_offset),
 * kept here as one "\x1f"-separated record per token and laid out when sent. */
static void lp_add(sv_req *r, const gc_sched_token *t) {
  mr_buf *p = &r->lp;
  if (r->kind == GC_OAI_CHAT) {
    if (r->lp_n) APP(p, ",");
    lp_entry(r, p, t->id, t->logprob);
    APP(p, ",\"top_logprobs\":[");
    for (uint32_t i = 0; i < t->n_top; i++) {
      if (i) APP(p, ",");
      lp_entry(r, p, t->top[i].id, t->top[i].logprob);
      APP(p, "}");
    }
    APP(p, "]}");
  } else {
    const char *s;
    size_t n;
    token_text(r, t->id, &s, &n);
    json_str(p, s, n); /* the token */
    APP(p, "\x1f");
    json_float(p, t->logprob);
    APP(p, "\x1f{");
    for (uint32_t i = 0; i < t->n_top; i++) {
      token_text(r, t->top[i].id, &s, &n);
      if (i) APP(p, ",");
      json_str(p, s, n);
      APP(p, ":");
      json_float(p, t->top[i].logprob);
    }
    mr_buf_printf(p, "}\x1f%u\x1e", r->text_off);
  }
  r->lp_n++;
}

/* Moves r->lp into out as the choice's "logprobs" value, and empties it. */
static void lp_take(sv_req *r, mr_buf *out) {
  if (!r->logprobs) {
    APP(out, "null");
    return;
  }
  if (r->kind == GC_OAI_CHAT) {
    APP(out, "{\"content\":[");
    if (r->lp.buf) mr_buf_append(out, r->lp.buf, r->lp.len);
    APP(out, "]}");
  } else {
    static const char *const names[4] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    APP(out, "{");
    for (int f = 0; f < 4; f++) {
      mr_buf_printf(out, "%s\"%s\":[", f ? "," : "", names[f]);
      const char *s = r->lp.buf ? r->lp.buf : "", *end = s + r->lp.len;
      bool first = true;
      while (s < end) { /* records "a\x1fb\x1fc\x1fd\x1e" */
        const char *rec_end = memchr(s, '\x1e', (size_t)(end - s));
        if (!rec_end) break;
        const char *q = s;
        for (int k = 0; k < f; k++) q = (const char *)memchr(q, '\x1f', (size_t)(rec_end - q)) + 1;
        const char *qe = memchr(q, '\x1f', (size_t)(rec_end - q));
        if (!qe) qe = rec_end;
        if (!first) APP(out, ",");
        mr_buf_append(out, q, (size_t)(qe - q));
        first = false;
        s = rec_end + 1;
      }
      APP(out, "]");
    }
    APP(out, "}");
  }
  mr_buf_reset(&r->lp);
  r->lp_n = 0;
}

/* One streamed chunk with text s[0..n) (and the pending logprobs); finish NULL = not the
 * last. */
static void send_chunk(sv_req *r, const char *s, size_t n, const char *finish) {
  chunk_head(r);
  mr_buf *o = &r->out;
  if (r->kind == GC_OAI_CHAT) {
    APP(o, "{\"index\":0,\"delta\":");
    if (n || !finish) {
      APP(o, "{\"content\":");
      json_str(o, s, n);
      APP(o, "}");
    } else {
      APP(o, "{}");
    }
  } else {
    APP(o, "{\"index\":0,\"text\":");
    json_str(o, s, n);
  }
  APP(o, ",\"logprobs\":");
  if (r->lp_n) lp_take(r, o);
  else APP(o, "null");
  if (finish) mr_buf_printf(o, ",\"finish_reason\":\"%s\"}]", finish);
  else APP(o, ",\"finish_reason\":null}]");
  if (r->include_usage) APP(o, ",\"usage\":null");
  APP(o, "}");
  sse_send(r);
}

/* Emitted text: streamed, or kept for the answer. */
static void text_out(sv_req *r, const char *s, size_t n) {
  r->text_off += (uint32_t)n;
  if (r->stream) {
    if (n || r->lp_n) send_chunk(r, s, n, NULL);
  } else {
    json_esc(&r->text, s, n);
  }
}

static bool on_token(void *ud, const gc_sched_token *t) {
  sv_req *r = ud;
  gc_serve *sv = r->sv;
  const uint64_t now = mr_now_ns();
  if (t->index == 0) mr_hist_observe(&sv->ttft, now - r->t_arrive_ns);
  else mr_hist_observe(&sv->itl, now - r->t_last_ns);
  r->t_last_ns = now;
  pthread_mutex_lock(&r->mu);
  const char *s;
  size_t n;
  bool stopped = false;
  mr_err e;
  if (r->logprobs) lp_add(r, t);
  if (gc_text_out_feed(r->txt, t->id, &s, &n, &stopped, &e) == 0) text_out(r, s, n);
  else stopped = true;
  const bool end = stopped || atomic_load(&r->gone);
  pthread_mutex_unlock(&r->mu);
  return end;
}

static void usage_json(mr_buf *o, const gc_sched_usage *u) {
  mr_buf_printf(o, "\"usage\":{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%u}",
                 u->prompt_tokens, u->completion_tokens, u->prompt_tokens + u->completion_tokens);
}

/* The one JSON answer of a request that was not streamed. */
static void answer(sv_req *r, const char *finish, const gc_sched_usage *u) {
  gc_serve *sv = r->sv;
  mr_buf *o = &r->out;
  mr_buf_reset(o);
  mr_buf_printf(o, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", r->id,
                 r->kind == GC_OAI_CHAT ? "chat.completion" : "text_completion", r->created);
  json_str(o, sv->model_name, strlen(sv->model_name));
  APP(o, ",\"system_fingerprint\":\"moerpc\",\"choices\":[{\"index\":0,");
  const char *text = r->text.buf ? r->text.buf : "";
  if (r->kind == GC_OAI_CHAT) {
    APP(o, "\"message\":{\"role\":\"assistant\",\"content\":\"");
    mr_buf_append(o, text, r->text.len);
    APP(o, "\"}");
  } else {
    APP(o, "\"text\":\"");
    mr_buf_append(o, text, r->text.len);
    APP(o, "\"");
  }
  APP(o, ",\"logprobs\":");
  lp_take(r, o);
  mr_buf_printf(o, ",\"finish_reason\":\"%s\"}],", finish);
  usage_json(o, u);
  APP(o, "}");
  if (o->oom) reply_error(r->call, 500, "out of memory building the answer", NULL, NULL);
  else mr_http_reply(r->call, 200, "application/json", o->buf, o->len, NULL);
}

/* A request that ends without its answer (a failed step, a drain cut, out of memory):
 * an error event in a stream that has begun, else an error answer. */
static void fail(sv_req *r, int status, const char *msg, const char *code) {
  if (!r->started) {
    reply_error(r->call, status, msg, NULL, code);
    return;
  }
  mr_buf_reset(&r->out);
  APP(&r->out, "data: ");
  error_json(&r->out, msg, status >= 500 ? "server_error" : "invalid_request_error", NULL, code);
  sse_send(r);
  mr_http_stream_end(r->call);
}

static void on_done(void *ud, gc_finish why, const mr_err *err, const gc_sched_usage *u) {
  sv_req *r = ud;
  gc_serve *sv = r->sv;
  pthread_mutex_lock(&r->mu);
  const uint64_t now = mr_now_ns();
  const bool gone = atomic_load(&r->gone);
  mr_hist_observe(&sv->e2e, now - r->t_arrive_ns);
  /* a client that left is a cancel, however the scheduler saw it end (a failed write ends
   * the request from on_token: "stop" there) */
  atomic_fetch_add(&sv->finished[gone && why != GC_FINISH_ERROR ? GC_FINISH_CANCELLED : why], 1);
  atomic_fetch_add(&sv->prompt_tokens, u->prompt_tokens);
  atomic_fetch_add(&sv->completion_tokens, u->completion_tokens);
  pthread_mutex_lock(&sv->lock);
  if (r->prev) r->prev->next = r->next;
  else sv->live = r->next;
  if (r->next) r->next->prev = r->prev;
  pthread_mutex_unlock(&sv->lock);
  const char *finish = why == GC_FINISH_LENGTH ? "length" : "stop";
  int status = 200;
  if (why == GC_FINISH_ERROR || (why == GC_FINISH_CANCELLED && !gone)) {
    char msg[sizeof(((mr_err *)0)->msg) + 96];
    if (why == GC_FINISH_ERROR) {
      status = 502;
      snprintf(msg, sizeof msg, "the model step failed: %s", err ? err->msg : "unknown error");
    } else {
      status = 503;
      atomic_fetch_add(&sv->cut, 1);
      snprintf(msg, sizeof msg, "the server is shutting down: the request did not finish within "
               "--drain-timeout %u ms", sv->drain_timeout_ms);
    }
    fail(r, status, msg, why == GC_FINISH_ERROR ? "expert_server_error" : "shutting_down");
    mr_log(MR_LOG_WARN, "serve: %s ended with %d: %s", r->id, status, msg);
  } else if (gone) {
    status = 499; /* nginx's "client closed request", for the log */
    if (r->started) mr_http_stream_end(r->call);
    else mr_http_reply(r->call, 499, "text/plain", "", 0, NULL);
  } else if (r->stream) {
    const char *s = NULL;
    size_t n = 0;
    mr_err e;
    if (gc_text_out_finish(r->txt, &s, &n, &e)) n = 0;
    send_chunk(r, s, n, finish);
    if (r->include_usage) {
      chunk_head(r);
      APP(&r->out, "],");
      usage_json(&r->out, u);
      APP(&r->out, "}");
      sse_send(r);
    }
    mr_buf_reset(&r->out);
    APP(&r->out, "data: [DONE]");
    sse_send(r);
    mr_http_stream_end(r->call);
  } else {
    const char *s = NULL;
    size_t n = 0;
    mr_err e;
    if (gc_text_out_finish(r->txt, &s, &n, &e) == 0) text_out(r, s, n);
    answer(r, finish, u);
  }
  if (status == 200 || status == 499)
    mr_log(MR_LOG_INFO, "serve: %s %d %s: %u prompt + %u completion tokens, first token %.3f s, %.3f s", r->id,
           status, status == 499 ? "client gone" : finish, u->prompt_tokens, u->completion_tokens,
           u->t_first_ns ? (double)(u->t_first_ns - r->t_arrive_ns) / 1e9 : 0.0,
           (double)(now - r->t_arrive_ns) / 1e9);
  pthread_mutex_unlock(&r->mu);
  req_free(r);
}

/* The scheduler's boundary hook: cancel the requests whose client left while they waited
 * (a suspended connection is not read by the HTTP server, so nothing else notices). */
static void on_boundary(void *ud) {
  gc_serve *sv = ud;
  pthread_mutex_lock(&sv->lock);
  for (sv_req *r = sv->live; r; r = r->next)
    if (atomic_load(&r->gone) || mr_http_call_peer_gone(r->call)) {
      atomic_store(&r->gone, true);
      gc_sched_cancel(sv->m.sched, r->sched_id);
    }
  pthread_mutex_unlock(&sv->lock);
}

/* ---- the completion handlers (HTTP thread) -------------------------------------------------- */

/* Tokens of the request's prompt. On error: *status, *param and e. */
static int prompt_ids(gc_serve *sv, const gc_oai_req *q, gc_tok_ids *ids, int *status, const char **param, mr_err *e) {
  const gc_serve_model *m = &sv->m;
  *status = 400;
  if (q->kind == GC_OAI_COMPLETION) {
    *param = "prompt";
    if (q->n_prompt_ids) {
      if (ids->cap < q->n_prompt_ids) {
        int32_t *v = mr_realloc(ids->v, (size_t)q->n_prompt_ids * sizeof *v);
        if (!v) return *status = 500, mr_err_set(e, MR_ENOMEM, "out of memory");
        ids->v = v;
        ids->cap = q->n_prompt_ids;
      }
      memcpy(ids->v, q->prompt_ids, (size_t)q->n_prompt_ids * sizeof *ids->v);
      ids->n = q->n_prompt_ids;
      return 0;
    }
    int rc = gc_tok_encode(m->tok, q->prompt, q->prompt_len, true, ids, e);
    if (rc) *status = 500;
    return rc;
  }
  *param = "messages";
  if (!m->chat)
    return mr_err_set(e, MR_EINVAL, "this model has no chat template (chat_template in tokenizer_config.json); "
                      "use /v1/completions, or start serve with --chat-template FILE");
  char *text = NULL;
  size_t len = 0;
  int rc = gc_chat_render(m->chat, q->messages, q->tools, true, q->template_kwargs, &text, &len, e);
  if (!rc) {
    rc = gc_tok_encode(m->tok, text, len, false, ids, e);
    if (rc) *status = 500;
  }
  mr_free(text);
  return rc;
}

static void handle_completion(gc_serve *sv, mr_http_call *c, gc_oai_kind kind) {
  const uint64_t t_arrive = mr_now_ns();
  const int state = atomic_load_explicit(&sv->state, memory_order_acquire);
  if (state != SV_READY) {
    reply_error(c, 503, state == SV_LOADING ? "the model is loading" : "the server is shutting down", NULL,
                state == SV_LOADING ? "loading" : "shutting_down");
    return;
  }
  const gc_serve_model *m = &sv->m;
  size_t blen = 0;
  const char *body = mr_http_call_body(c, &blen);
  gc_oai_req q;
  const char *param = "";
  mr_err e;
  mr_err_clear(&e);
  if (gc_oai_parse(kind, body, blen, &q, &param, &e)) {
    reply_error(c, 400, e.msg, param, NULL);
    return;
  }
  gc_tok_ids ids = {0};
  sv_req *r = NULL;
  int status = 400;
  char msg[sizeof(((mr_err *)0)->msg) + 160];
  const char *code = NULL;
  if (q.model && strcmp(q.model, sv->model_name) != 0) {
    snprintf(msg, sizeof msg, "model \"%.200s\": not served here (this server serves \"%s\")", q.model,
             sv->model_name);
    status = 404;
    param = "model";
    code = "model_not_found";
    goto refuse;
  }
  if (prompt_ids(sv, &q, &ids, &status, &param, &e)) {
    snprintf(msg, sizeof msg, "%s", e.msg);
    goto refuse;
  }
  const uint32_t max_seq = gc_model_max_seq(m->model), n = (uint32_t)ids.n;
  if (n == 0 || n >= max_seq) {
    snprintf(msg, sizeof msg, "%s: %u tokens, the context is %u (--max-seq): at most %u leave room for one "
             "new token", param, n, max_seq, max_seq - 1);
    code = n ? "context_length_exceeded" : NULL;
    goto refuse;
  }
  if (q.has_max_tokens && (uint64_t)n + q.max_tokens > max_seq) {
    snprintf(msg, sizeof msg, "max_tokens = %u: with the prompt's %u tokens that is %llu, over the context of "
             "%u (--max-seq): at most %u", q.max_tokens, n, (unsigned long long)n + q.max_tokens, max_seq,
             max_seq - n);
    param = q.kind == GC_OAI_CHAT && !cJSON_GetObjectItemCaseSensitive(q.root, "max_tokens")
                ? "max_completion_tokens" : "max_tokens";
    code = "context_length_exceeded";
    goto refuse;
  }
  r = mr_calloc(1, sizeof *r);
  if (!r) {
    snprintf(msg, sizeof msg, "out of memory");
    status = 503;
    goto refuse;
  }
  pthread_mutex_init(&r->mu, NULL);
  mr_buf_init(&r->text);
  mr_buf_init(&r->lp);
  mr_buf_init(&r->out);
  r->sv = sv;
  r->call = c;
  r->kind = kind;
  r->stream = q.stream;
  r->include_usage = q.include_usage;
  r->logprobs = q.logprobs;
  r->top_logprobs = q.top_logprobs;
  r->n_prompt = n;
  r->t_arrive_ns = r->t_last_ns = t_arrive;
  r->created = (long long)time(NULL);
  snprintf(r->id, sizeof r->id, "%s-%08llx%016llx", kind == GC_OAI_CHAT ? "chatcmpl" : "cmpl",
           (unsigned long long)sv->created & 0xffffffffu, (unsigned long long)atomic_fetch_add(&sv->next_rid, 1));
  if (gc_text_out_new(&r->txt, m->tok, q.stops, q.n_stops, true, &e)) {
    snprintf(msg, sizeof msg, "%s", e.msg);
    param = "stop";
    goto refuse;
  }
  gc_sched_req sr = {.prompt = ids.v, .n_prompt = n, .max_new = q.has_max_tokens ? q.max_tokens : max_seq - n,
                     .smp = m->defaults, .want_logprobs = q.logprobs, .top_logprobs = q.top_logprobs,
                     .on_token = on_token, .on_done = on_done, .ud = r};
  if (q.has_temperature) sr.smp.temperature = q.temperature;
  if (q.has_top_p) sr.smp.top_p = q.top_p;
  if (q.has_top_k) sr.smp.top_k = q.top_k;
  sr.smp.seed = q.has_seed ? q.seed : 0;
  for (uint32_t i = 0; i < GC_SCHED_MAX_STOP_IDS; i++)
    sr.stop_ids[i] = i < m->n_stop_ids && !q.ignore_eos ? m->stop_ids[i] : -1;
  pthread_mutex_lock(&r->mu); /* the callbacks wait until the set-up is done */
  int rc = gc_sched_submit(m->sched, &sr, &r->sched_id, &e);
  if (rc) {
    pthread_mutex_unlock(&r->mu);
    snprintf(msg, sizeof msg, "%s", e.msg);
    status = rc == MR_EEXHAUSTED ? 429 : rc == MR_EUNAVAIL ? 503 : rc == MR_ENOMEM ? 503 : 400;
    code = rc == MR_EEXHAUSTED ? "queue_full" : rc == MR_EUNAVAIL ? "shutting_down" : NULL;
    param = status == 400 ? param : "";
    goto refuse;
  }
  if (r->stream) {
    static const char *const sse_headers[] = {"X-Accel-Buffering", "no", NULL};
    r->started = mr_http_stream_begin(c, 200, "text/event-stream", sse_headers) == 0;
    if (!r->started) {
      atomic_store(&r->gone, true); /* the scheduler ends it at the next boundary */
      gc_sched_cancel(m->sched, r->sched_id);
    } else if (kind == GC_OAI_CHAT) { /* the role first, as OpenAI's stream starts */
      chunk_head(r);
      APP(&r->out, "{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,"
                     "\"finish_reason\":null}]");
      if (r->include_usage) APP(&r->out, ",\"usage\":null");
      APP(&r->out, "}");
      sse_send(r);
    }
  }
  pthread_mutex_lock(&sv->lock);
  r->next = sv->live;
  if (sv->live) sv->live->prev = r;
  sv->live = r;
  pthread_mutex_unlock(&sv->lock);
  mr_http_call_on_close(c, on_close, r);
  pthread_mutex_unlock(&r->mu);
  gc_tok_ids_close(&ids);
  gc_oai_req_close(&q);
  return;
refuse:
  reply_error(c, status, msg, param, code);
  if (r) req_free(r);
  gc_tok_ids_close(&ids);
  gc_oai_req_close(&q);
}

static void handle_chat(void *ud, mr_http_call *c) { handle_completion(ud, c, GC_OAI_CHAT); }
static void handle_text(void *ud, mr_http_call *c) { handle_completion(ud, c, GC_OAI_COMPLETION); }

/* ---- the other routes ------------------------------------------------------------------------- */

static void handle_models(void *ud, mr_http_call *c) {
  gc_serve *sv = ud;
  mr_buf o;
  mr_buf_init(&o);
  APP(&o, "{\"object\":\"list\",\"data\":[{\"id\":");
  json_str(&o, sv->model_name, strlen(sv->model_name));
  mr_buf_printf(&o, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"moerpc\"", sv->created);
  if (atomic_load_explicit(&sv->attached, memory_order_acquire))
    mr_buf_printf(&o, ",\"max_model_len\":%u", gc_model_max_seq(sv->m.model));
  APP(&o, "}]}");
  if (o.oom) reply_error(c, 500, "out of memory", NULL, NULL);
  else mr_http_reply(c, 200, "application/json", o.buf, o.len, NULL);
  mr_buf_close(&o);
}

/* GET /health: 200 once the model and the cluster are up, 503 while loading or draining
 * (a load balancer stops sending new requests at once). */
static void handle_health(void *ud, mr_http_call *c) {
  gc_serve *sv = ud;
  const int state = atomic_load_explicit(&sv->state, memory_order_acquire);
  const char *body = state == SV_READY ? "{\"status\":\"ok\"}" : state == SV_LOADING ? "{\"status\":\"loading\"}"
                                                                                   : "{\"status\":\"draining\"}";
  mr_http_reply(c, state == SV_READY ? 200 : 503, "application/json", body, strlen(body), NULL);
}

static bool probe(void *ud, bool ready) {
  gc_serve *sv = ud;
  return !ready || atomic_load_explicit(&sv->state, memory_order_acquire) == SV_READY;
}

static void metrics_render(void *ud, mr_buf *p) {
  gc_serve *sv = ud;
  const int state = atomic_load_explicit(&sv->state, memory_order_acquire);
  mr_prom_family(p, "moerpc_serve_http_requests_total", MR_PROM_COUNTER, "HTTP answers of serve, by status code");
  mr_http_server_render_answers(sv->h, p, "moerpc_serve_http_requests_total");
  mr_prom_family(p, "moerpc_serve_requests_finished_total", MR_PROM_COUNTER,
                 "Completion requests ended, by reason (stop, length, cancelled: client gone or drain cut, "
                 "error: a failed model step)");
  for (int f = GC_FINISH_STOP; f <= GC_FINISH_ERROR; f++) {
    const char *lab[] = {"reason", gc_finish_name((gc_finish)f), NULL};
    mr_prom_u64(p, "moerpc_serve_requests_finished_total", lab, atomic_load(&sv->finished[f]));
  }
  mr_prom_family(p, "moerpc_serve_time_to_first_token_seconds", MR_PROM_HISTOGRAM,
                 "From the request's arrival to its first token (template, tokenizer, queue, prefill)");
  mr_prom_hist(p, "moerpc_serve_time_to_first_token_seconds", NULL, &sv->ttft);
  mr_prom_family(p, "moerpc_serve_inter_token_latency_seconds", MR_PROM_HISTOGRAM,
                 "Between two tokens of one request");
  mr_prom_hist(p, "moerpc_serve_inter_token_latency_seconds", NULL, &sv->itl);
  mr_prom_family(p, "moerpc_serve_e2e_request_latency_seconds", MR_PROM_HISTOGRAM,
                 "From the request's arrival to its end");
  mr_prom_hist(p, "moerpc_serve_e2e_request_latency_seconds", NULL, &sv->e2e);
  mr_prom_family(p, "moerpc_serve_prompt_tokens_total", MR_PROM_COUNTER, "Prompt tokens of ended requests");
  mr_prom_u64(p, "moerpc_serve_prompt_tokens_total", NULL, atomic_load(&sv->prompt_tokens));
  mr_prom_family(p, "moerpc_serve_generation_tokens_total", MR_PROM_COUNTER, "Tokens generated by ended requests");
  mr_prom_u64(p, "moerpc_serve_generation_tokens_total", NULL, atomic_load(&sv->completion_tokens));
  const bool attached = atomic_load_explicit(&sv->attached, memory_order_acquire);
  gc_sched_stats st = {0};
  if (attached) gc_sched_stats_get(sv->m.sched, &st);
  mr_prom_family(p, "moerpc_serve_queue_length", MR_PROM_GAUGE, "Requests waiting for a KV slot");
  mr_prom_u64(p, "moerpc_serve_queue_length", NULL, st.queued);
  mr_prom_family(p, "moerpc_serve_running_sequences", MR_PROM_GAUGE, "Requests holding a KV slot");
  mr_prom_u64(p, "moerpc_serve_running_sequences", NULL, st.running);
  mr_prom_family(p, "moerpc_serve_kv_slots_in_use", MR_PROM_GAUGE, "KV slots in use");
  mr_prom_u64(p, "moerpc_serve_kv_slots_in_use", NULL, st.slots_in_use);
  mr_prom_family(p, "moerpc_serve_kv_slots", MR_PROM_GAUGE, "KV slots (--max-batch)");
  mr_prom_u64(p, "moerpc_serve_kv_slots", NULL, st.slots);
  mr_prom_family(p, "moerpc_serve_steps_total", MR_PROM_COUNTER, "Model steps run by the scheduler");
  mr_prom_u64(p, "moerpc_serve_steps_total", NULL, st.steps);
  mr_prom_family(p, "moerpc_serve_failed_steps_total", MR_PROM_COUNTER,
                 "Model steps that failed (every sequence in such a step ends with an error)");
  mr_prom_u64(p, "moerpc_serve_failed_steps_total", NULL, st.failed_steps);
  mr_prom_family(p, "moerpc_serve_ready", MR_PROM_GAUGE, "1 while serving (model and cluster up, not draining)");
  mr_prom_u64(p, "moerpc_serve_ready", NULL, state == SV_READY);
  if (attached) gc_model_metrics_render(sv->m.model, p);
}

/* ---- the server --------------------------------------------------------------------------------- */

int gc_serve_new(gc_serve **out, mr_http_server *h, const gc_serve_opts *o, mr_err *e) {
  *out = NULL;
  gc_serve *sv = mr_calloc(1, sizeof *sv);
  if (!sv || !(sv->model_name = mr_strdup(o->model_name ? o->model_name : "moerpc"))) {
    mr_free(sv);
    return mr_err_set(e, MR_ENOMEM, "serve: out of memory");
  }
  sv->h = h;
  sv->drain_timeout_ms = o->drain_timeout_ms;
  sv->created = (long long)time(NULL);
  pthread_mutex_init(&sv->lock, NULL);
  static const double ttft_ms[] = {1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000};
  static const double itl_ms[] = {0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000};
  static const double e2e_ms[] = {10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000, 600000};
  hist_ms(&sv->ttft, ttft_ms, sizeof ttft_ms / sizeof *ttft_ms);
  hist_ms(&sv->itl, itl_ms, sizeof itl_ms / sizeof *itl_ms);
  hist_ms(&sv->e2e, e2e_ms, sizeof e2e_ms / sizeof *e2e_ms);
  int rc = mr_http_server_handle(h, "POST", "/v1/chat/completions", true, handle_chat, sv, e);
  if (!rc) rc = mr_http_server_handle(h, "POST", "/v1/completions", true, handle_text, sv, e);
  if (!rc) rc = mr_http_server_handle(h, "GET", "/v1/models", true, handle_models, sv, e);
  if (!rc) rc = mr_http_server_handle(h, "GET", "/health", false, handle_health, sv, e);
  if (!rc) rc = mr_http_server_route(h, "/metrics", NULL, metrics_render, sv, e);
  if (rc) {
    gc_serve_free(sv);
    return rc;
  }
  mr_http_server_probes(h, probe);
  *out = sv;
  return 0;
}

void gc_serve_sched_opts(gc_serve *sv, gc_sched_opts *o) {
  o->on_boundary = on_boundary;
  o->boundary_ud = sv;
}

void gc_serve_attach(gc_serve *sv, const gc_serve_model *m) {
  sv->m = *m;
  atomic_store_explicit(&sv->attached, true, memory_order_release);
  int want = SV_LOADING;
  atomic_compare_exchange_strong_explicit(&sv->state, &want, SV_READY, memory_order_release, memory_order_relaxed);
}

void gc_serve_drain(gc_serve *sv) { atomic_store_explicit(&sv->state, SV_DRAINING, memory_order_release); }

bool gc_serve_ready(const gc_serve *sv) {
  return atomic_load_explicit(&((gc_serve *)sv)->state, memory_order_acquire) == SV_READY;
}

uint64_t gc_serve_cut(const gc_serve *sv) { return atomic_load(&((gc_serve *)sv)->cut); }

void gc_serve_free(gc_serve *sv) {
  if (!sv) return;
  pthread_mutex_destroy(&sv->lock);
  mr_free(sv->model_name);
  mr_free(sv);
}
