/*
 * serve.h - the OpenAI-compatible HTTP front of the client process (prefix gc_oai_ for the
 * request parser, gc_serve_ for the server): `moerpc-client serve`.
 *
 *   HTTP (common/http_server.c, libmicrohttpd, its one epoll thread)
 *     POST /v1/chat/completions, /v1/completions
 *        gc_oai_parse -> chat template -> tokenizer -> gc_sched_submit (or 4xx / 429 / 503)
 *     GET  /v1/models, /health, /metrics, /routing, /placement, /healthz, /readyz
 *                                   |
 *   the scheduler thread (sched.h): one step at a time over the model; per produced token
 *   on_token -> streaming detokenizer and stop strings (text.h) -> an SSE chunk written to
 *   the connection, or the text kept for the one JSON answer; on_done -> the last chunk
 *   (finish_reason, usage) and data: [DONE], or the answer, or an error
 *
 * A request's life is tied to its connection: at every step boundary the scheduler thread
 * polls the connections of the requests it holds (mr_http_call_peer_gone) and cancels those
 * whose client left, so a dropped client frees its KV slot within one step.
 *
 * States: LOADING (the process is up, the model is not: 503 on every model route, /health
 * 503), READY, DRAINING (SIGTERM: 503 for new requests, the running ones finish within
 * --drain-timeout, or are cut with an error). /health answers 200 only when READY.
 *
 * Threads: gc_oai_* are pure (any thread). gc_serve_new / _attach / _drain / _free from
 * the process's main thread; the handlers run on the HTTP thread, the callbacks on the
 * scheduler thread. Locks, always in this order: sv->lock (the list of live requests) ->
 * a call's lock (inside mr_http_*) -> the scheduler's lock.
 */
#ifndef GC_SERVE_H
#define GC_SERVE_H

#include "gpu_client/runner/sched.h"
#include "gpu_client/runner/text.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the request parser (gc_oai.c; network input, fuzzed by tests/fuzz/fuzz_openai_request.c) */

typedef enum gc_oai_kind { GC_OAI_CHAT, GC_OAI_COMPLETION } gc_oai_kind;

#define GC_OAI_MAX_TOP_LOGPROBS 20u  /* chat's top_logprobs (OpenAI's limit) */
#define GC_OAI_MAX_LOGPROBS 5u       /* completions' logprobs (OpenAI's limit) */
#define GC_OAI_MAX_PROMPT_IDS (1u << 20)

/* The fields of one request that serve acts on. Unknown fields are ignored (clients send
 * many: user, metadata, ...); known ones of the wrong type or out of range are refused. */
typedef struct gc_oai_req {
  gc_oai_kind kind;
  struct cJSON *root;            /* the parsed body (owned; the pointers below are into it) */
  const char *model;             /* NULL = not given */
  /* chat */
  const struct cJSON *messages;  /* a non-empty array of objects */
  const struct cJSON *tools;     /* an array, or NULL */
  const struct cJSON *template_kwargs; /* chat_template_kwargs: an object, or NULL */
  /* completions: a string, or token ids */
  const char *prompt;
  size_t prompt_len;
  int32_t *prompt_ids;           /* owned; n_prompt_ids > 0 when the prompt was ids */
  uint32_t n_prompt_ids;
  /* both */
  bool has_max_tokens;
  uint32_t max_tokens;           /* max_completion_tokens, else max_tokens */
  bool has_temperature, has_top_p, has_top_k;
  float temperature;             /* 0..2 */
  float top_p;                   /* (0, 1] (0 is taken as the smallest mass: greedy) */
  uint32_t top_k;                /* 0 = all (-1 is accepted as all, vLLM's spelling) */
  bool has_seed;
  uint64_t seed;                 /* a negative seed as its two's complement */
  const char *stops[GC_TEXT_MAX_STOPS];
  uint32_t n_stops;
  bool stream, include_usage;
  bool ignore_eos;               /* vLLM's extension: the model's stop ids do not end it */
  bool logprobs;                 /* chat: logprobs true; completions: logprobs >= 0 */
  uint32_t top_logprobs;         /* chat: top_logprobs; completions: logprobs */
} gc_oai_req;

/* Parses body[0..len) (JSON) into *r. Errors are MR_EINVAL / MR_ERANGE / MR_EFORMAT with a
 * message naming the field and the limit, and *param (when not NULL) set to the field's
 * name (a static string, "" when the body itself is wrong) for OpenAI's error "param".
 * On error *r holds nothing to close; on success gc_oai_req_close(r) frees it. */
int gc_oai_parse(gc_oai_kind kind, const char *body, size_t len, gc_oai_req *r, const char **param, mr_err *e);
void gc_oai_req_close(gc_oai_req *r);

/* Appends s[0..n) to out as valid UTF-8 (each byte of an ill-formed sequence becomes
 * U+FFFD, as Python's errors="replace"): what goes into a JSON string. False when out of
 * memory. */
bool gc_oai_utf8_append(char **out, size_t *len, size_t *cap, const char *s, size_t n);

/* ---- the server (gc_serve.c) -------------------------------------------------------------- */

typedef struct gc_serve gc_serve;

typedef struct gc_serve_opts {
  const char *model_name;        /* what /v1/models lists and requests must name */
  uint32_t drain_timeout_ms;     /* informational, for the cut requests' message */
} gc_serve_opts;

/* What a served model needs, handed over once it is loaded (borrowed: they must outlive
 * the server's use of them, i.e. until gc_serve_free). */
typedef struct gc_serve_model {
  gc_model *model;
  gc_sched *sched;               /* made with gc_serve_sched_opts (its boundary hook) */
  const gc_tok *tok;
  const gc_chat *chat;           /* NULL: /v1/chat/completions answers 400 (no template) */
  const int32_t *stop_ids;       /* the model's stop ids */
  uint32_t n_stop_ids;
  gc_sampling defaults;          /* generation_config.json's sampling, else OpenAI's */
  bool defaults_set;             /* defaults came from generation_config.json */
} gc_serve_model;

/* Registers the routes on h (which must outlive the server) and answers 503 on the model
 * routes until gc_serve_attach. *out is owned by the caller. */
int gc_serve_new(gc_serve **out, mr_http_server *h, const gc_serve_opts *o, mr_err *e);
/* The boundary hook of the scheduler (sched.h) that serve needs: fills o's on_boundary. */
void gc_serve_sched_opts(gc_serve *sv, gc_sched_opts *o);
/* The model is up: READY. Main thread, once. */
void gc_serve_attach(gc_serve *sv, const gc_serve_model *m);
/* DRAINING: new requests get 503, /health 503; the scheduler is asked to drain (the caller
 * passes its drain time to gc_sched_stop). Any thread (the signal thread). */
void gc_serve_drain(gc_serve *sv);
bool gc_serve_ready(const gc_serve *sv);
/* Requests cut by the end of a drain (ended before they finished, their client still
 * there). Read after gc_sched_run returned. */
uint64_t gc_serve_cut(const gc_serve *sv);
/* After the scheduler is freed (every request ended) and the HTTP server stopped. */
void gc_serve_free(gc_serve *sv);

#ifdef __cplusplus
}
#endif
#endif /* GC_SERVE_H */
