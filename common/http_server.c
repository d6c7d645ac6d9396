/*
 * http_server.c - the one HTTP server of moerpc (mr.h "HTTP server"), on libmicrohttpd:
 * the expert server's and the client's /metrics, /healthz, /readyz, /routing, /placement,
 * and the OpenAI-compatible API of `moerpc-client serve`.
 *
 * Why libmicrohttpd (GNU, Debian's libmicrohttpd-dev): it parses HTTP/1.1 (heads, chunked
 * bodies, keep-alive, pipelining) so that we do not, serves thousands of connections from
 * one epoll thread with per-connection idle timeouts (an idle or slowloris connection costs
 * a socket, never a thread, and never delays a probe), and lets a request be suspended and
 * resumed from another thread, which is what a reply produced later (a completion computed
 * by the scheduler) and a stream of server-sent events need. libh2o would bring HTTP/2 and
 * its own event loop we do not need; the client has no libuv loop to share.
 *
 * One request, as the MHD thread sees it (access handler calls):
 *
 *   head ............ mr_http_call made; Content-Length over max_body -> 413 at once
 *   body chunks ..... appended (a body that grows past max_body -> 413)
 *   end of body ..... route: probes and GET renders answer at once; an auth route without
 *                     the bearer token -> 401; a handler route calls handle(ud, call):
 *                       the handler replied          -> queued now
 *                       it did not (the app replies later, from any thread)
 *                                                    -> the connection is suspended
 *   app replies ..... the response is stored and the connection resumed: MHD calls the
 *                     access handler again, which queues it
 *   stream .......... mr_http_stream_begin queues a response whose body comes from a
 *                     reader: it hands out what mr_http_stream_write buffered, suspends
 *                     the connection when there is nothing (a write resumes it), and ends
 *                     the chunked body after mr_http_stream_end
 *   completed ....... MHD's completion callback: the call is over on the wire (sent, or
 *                     the peer went away, or a timeout); the app's on_close hears it
 *
 * Ownership: a call has two references, MHD's (dropped at completion) and the app's
 * (dropped by its one terminal call: mr_http_reply or mr_http_stream_end; a handler that
 * replies before returning has made it). The last one frees the call, so the app may reply
 * to a call whose peer is long gone, and MHD may complete a call the app still holds.
 *
 * Locks: h->lock guards the list of live calls and the stopping flag; call->lock guards
 * the call's state and buffers. MHD functions are called with call->lock held only by the
 * MHD thread itself (suspend, from the access handler and the reader, as MHD allows); other
 * threads call MHD_resume_connection after releasing call->lock, having cleared
 * `suspended` under it, so a resume always follows the suspend it undoes.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <microhttpd.h>

#include "common/internal.h"
#include "common/mr.h"

#define MR__HTTP_PROM_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define MR__HTTP_MAX_ROUTES 32u
#define MR__HTTP_N_CODES 11u

typedef struct mr__route {
  char *method;               /* NULL = GET and HEAD (a render route) */
  char *path;
  const char *ctype;          /* render routes */
  mr_http_render_fn render;
  mr_http_handler_fn handle;
  void *ud;
  bool auth;
} mr__route;

struct mr_http_call {
  pthread_mutex_t lock;
  int refs;                   /* MHD's + the app's (see the top of the file) */
  mr_http_server *h;
  struct MHD_Connection *conn;
  struct mr_http_call *prev, *next; /* h's live list (MHD side) */
  char method[16];
  char path[1024];
  char *body;
  size_t body_len, body_cap;
  bool too_big;               /* the body grew past max_body: 413 answered */
  bool dispatched;            /* the route ran */
  bool suspended;             /* the connection is suspended (MHD thread set it) */
  bool mhd_done;              /* completed on the wire */
  bool app_done;              /* the app made its terminal call */
  struct MHD_Response *resp;  /* a reply waiting to be queued */
  int status;
  bool streaming, stream_end;
  char *sbuf;                 /* streamed bytes not yet handed to MHD: [soff, slen) */
  size_t slen, scap, soff;
  int fd;                     /* the connection's socket (peer-gone checks) */
  void (*on_close)(void *ud); /* the peer went away before the app's terminal call */
  void *close_ud;
};

struct mr_http_server {
  struct MHD_Daemon *d;
  int fd;                     /* our listening socket, handed to MHD */
  int port;
  mr_http_opts o;
  char *token;                /* copy of o.token */
  char *listen_copy, *flag_copy, *auth_body_copy;
  pthread_mutex_t lock;       /* routes, calls, stopping */
  mr__route routes[MR__HTTP_MAX_ROUTES];
  uint32_t n_routes;
  _Atomic(mr_http_probe_fn) probe;
  void *probe_ud;
  struct mr_http_call *calls; /* live calls (MHD side) */
  bool stopping;
  _Atomic uint64_t answered[MR__HTTP_N_CODES]; /* answers queued, by status (code_slot) */
};

/* The statuses counted one by one; the rest go to the last slot ("other"). */
static const int mr__http_codes[MR__HTTP_N_CODES - 1] = {200, 400, 401, 404, 405, 408, 413, 429, 500, 503};

static size_t code_slot(int status) {
  for (size_t i = 0; i < MR__HTTP_N_CODES - 1; i++)
    if (mr__http_codes[i] == status) return i;
  return MR__HTTP_N_CODES - 1;
}

/* Every answer goes through here (the per-status counters of mr_http_server_render_answers). */
static enum MHD_Result queue(mr_http_server *h, struct MHD_Connection *conn, unsigned status, struct MHD_Response *r) {
  atomic_fetch_add_explicit(&h->answered[code_slot((int)status)], 1, memory_order_relaxed);
  return MHD_queue_response(conn, status, r);
}

static void call_unref(struct mr_http_call *c) {
  pthread_mutex_lock(&c->lock);
  const int left = --c->refs;
  pthread_mutex_unlock(&c->lock);
  if (left > 0) return;
  if (c->resp) MHD_destroy_response(c->resp);
  pthread_mutex_destroy(&c->lock);
  mr_free(c->body);
  mr_free(c->sbuf);
  mr_free(c);
}

/* ---- responses ------------------------------------------------------------------------------ */

static struct MHD_Response *text_response(const char *body, size_t len, const char *ctype) {
  struct MHD_Response *r = MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
  if (r && ctype) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  return r;
}

/* An answer the server makes itself (probes, 401, 404, 405, 413, 503): msg as a text line,
 * or, with o.json_errors and a status >= 400, as {"error": {"message", "type", "code"}}
 * (OpenAI's shape, which its clients parse). */
static enum MHD_Result queue_text(mr_http_server *h, struct MHD_Connection *conn, unsigned status, const char *msg,
                                  const char *ctype) {
  char buf[512];
  const char *body = msg;
  if (!ctype && status >= 400 && h->o.json_errors) {
    const char *type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error"
                       : status >= 500 ? "server_error" : "invalid_request_error";
    size_t n = (size_t)snprintf(buf, sizeof buf, "{\"error\":{\"message\":\"");
    for (const char *p = msg; *p && *p != '\n' && n < sizeof buf - 64; p++) /* ours: ASCII */
      if (*p != '"' && *p != '\\') buf[n++] = *p;
    snprintf(buf + n, sizeof buf - n, "\",\"type\":\"%s\",\"param\":null,\"code\":%u}}", type, status);
    body = buf;
    ctype = "application/json";
  }
  struct MHD_Response *r = text_response(body, strlen(body), ctype ? ctype : "text/plain; charset=utf-8");
  if (!r) return MHD_NO;
  if (status == 401) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
  if (status == 405) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result rc = queue(h, conn, status, r);
  MHD_destroy_response(r);
  return rc;
}

/* ---- streaming reader (MHD thread) ---------------------------------------------------------- */

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
  (void)pos;
  struct mr_http_call *c = cls;
  pthread_mutex_lock(&c->lock);
  ssize_t n;
  if (c->soff < c->slen) {
    size_t k = c->slen - c->soff < max ? c->slen - c->soff : max;
    memcpy(buf, c->sbuf + c->soff, k);
    c->soff += k;
    if (c->soff == c->slen) c->soff = c->slen = 0;
    n = (ssize_t)k;
  } else if (c->stream_end) {
    n = MHD_CONTENT_READER_END_OF_STREAM;
  } else if (c->h->stopping) {
    n = MHD_CONTENT_READER_END_WITH_ERROR;
  } else {
    c->suspended = true; /* a write resumes it */
    MHD_suspend_connection(c->conn);
    n = 0;
  }
  pthread_mutex_unlock(&c->lock);
  return n;
}

static void stream_free(void *cls) { call_unref(cls); } /* the response's reference */

/* ---- the access handler (MHD thread) --------------------------------------------------------- */

static const mr__route *route_find(mr_http_server *h, const char *method, const char *path, bool *path_known) {
  *path_known = false;
  for (uint32_t i = 0; i < h->n_routes; i++) {
    const mr__route *r = &h->routes[i];
    if (strcmp(r->path, path) != 0) continue;
    *path_known = true;
    if (r->method ? strcmp(r->method, method) == 0 : (strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0))
      return r;
  }
  return NULL;
}

static bool token_ok(mr_http_server *h, struct MHD_Connection *conn) {
  if (!h->token) return true;
  const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
  if (!v || strncmp(v, "Bearer ", 7) != 0) return false;
  v += 7;
  const size_t n = strlen(h->token), m = strlen(v);
  unsigned char diff = (unsigned char)(n != m);
  for (size_t i = 0; i < n; i++) diff |= (unsigned char)(h->token[i] ^ (i < m ? v[i] : 0)); /* constant time */
  return diff == 0;
}

/* Runs the route of a complete request; queues its answer or suspends for the app's. */
static enum MHD_Result dispatch(mr_http_server *h, struct mr_http_call *c) {
  struct MHD_Connection *conn = c->conn;
  bool known;
  pthread_mutex_lock(&h->lock);
  const mr__route *r = route_find(h, c->method, c->path, &known);
  mr__route rt = r ? *r : (mr__route){0};
  const bool stopping = h->stopping;
  pthread_mutex_unlock(&h->lock);
  c->dispatched = true;
  const bool head = strcmp(c->method, "HEAD") == 0, get = head || strcmp(c->method, "GET") == 0;
  if (stopping) return queue_text(h, conn, 503, "503 shutting down\n", NULL);
  mr_http_probe_fn probe = atomic_load(&h->probe);
  if (!r && get && probe && (strcmp(c->path, "/healthz") == 0 || strcmp(c->path, "/readyz") == 0)) {
    const bool ready = strcmp(c->path, "/readyz") == 0, ok = probe(h->probe_ud, ready);
    return queue_text(h, conn, ok ? 200 : 503, ok ? "ok\n" : ready ? "not ready\n" : "not alive\n", NULL);
  }
  if (!r) return known ? queue_text(h, conn, 405, "405 Method Not Allowed\n", NULL) : queue_text(h, conn, 404, "404 Not Found\n", NULL);
  if (rt.auth && !token_ok(h, conn))
    return queue_text(h, conn, 401, h->auth_body_copy ? h->auth_body_copy : "401 Unauthorized\n",
                      h->auth_body_copy ? h->o.auth_ctype : NULL);
  if (rt.render) {
    mr_buf p;
    mr_buf_init(&p);
    rt.render(rt.ud, &p);
    enum MHD_Result rc = p.oom ? queue_text(h, conn, 500, "500 Internal Server Error\n", NULL) : MHD_NO;
    if (!p.oom) {
      struct MHD_Response *resp = text_response(p.buf ? p.buf : "", p.len, rt.ctype);
      rc = resp ? queue(h, conn, 200, resp) : MHD_NO;
      if (resp) MHD_destroy_response(resp);
    }
    mr_buf_close(&p);
    return rc;
  }
  /* A handler: the app's reference lives until its terminal call. */
  pthread_mutex_lock(&c->lock);
  c->refs++;
  pthread_mutex_unlock(&c->lock);
  rt.handle(rt.ud, c);
  pthread_mutex_lock(&c->lock);
  struct MHD_Response *resp = c->resp;
  c->resp = NULL;
  if (!resp) { /* the app answers later: wait suspended */
    c->suspended = true;
    MHD_suspend_connection(conn);
  }
  const int status = c->status;
  pthread_mutex_unlock(&c->lock);
  if (!resp) return MHD_YES;
  enum MHD_Result rc = queue(h, conn, (unsigned)status, resp);
  MHD_destroy_response(resp);
  return rc;
}

static enum MHD_Result access_handler(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                      const char *version, const char *upload_data, size_t *upload_size,
                                      void **con_cls) {
  (void)version;
  mr_http_server *h = cls;
  struct mr_http_call *c = *con_cls;
  if (!c) { /* the head */
    c = mr_calloc(1, sizeof *c);
    if (!c) return MHD_NO;
    pthread_mutex_init(&c->lock, NULL);
    c->refs = 1; /* MHD's */
    c->h = h;
    c->conn = conn;
    c->fd = -1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) c->fd = ci->connect_fd;
    snprintf(c->method, sizeof c->method, "%s", method);
    snprintf(c->path, sizeof c->path, "%s", url);
    pthread_mutex_lock(&h->lock);
    c->next = h->calls;
    if (h->calls) h->calls->prev = c;
    h->calls = c;
    pthread_mutex_unlock(&h->lock);
    *con_cls = c;
    const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl && strtoull(cl, NULL, 10) > h->o.max_body) {
      c->too_big = true;
      c->dispatched = true;
      char msg[160];
      snprintf(msg, sizeof msg, "413 request body of %s bytes, at most %zu\n", cl, h->o.max_body);
      return queue_text(h, conn, 413, msg, NULL);
    }
    return MHD_YES;
  }
  if (*upload_size) { /* a chunk of the body */
    const size_t n = *upload_size;
    *upload_size = 0;
    if (c->too_big || c->body_len + n > h->o.max_body) { /* swallowed; 413 at its end */
      c->too_big = true;
      return MHD_YES;
    }
    if (c->body_len + n + 1 > c->body_cap) {
      size_t cap = c->body_cap ? c->body_cap : 4096;
      while (cap < c->body_len + n + 1) cap *= 2;
      char *b = mr_realloc(c->body, cap);
      if (!b) return MHD_NO;
      c->body = b;
      c->body_cap = cap;
    }
    memcpy(c->body + c->body_len, upload_data, n);
    c->body_len += n;
    c->body[c->body_len] = '\0';
    return MHD_YES;
  }
  if (c->too_big) {
    if (c->dispatched) return MHD_YES; /* answered 413 already (from Content-Length) */
    c->dispatched = true;
    char msg[160];
    snprintf(msg, sizeof msg, "413 request body over %zu bytes\n", h->o.max_body);
    return queue_text(h, conn, 413, msg, NULL);
  }
  if (!c->dispatched) return dispatch(h, c);
  /* resumed: the app's reply is here (or the server stops) */
  pthread_mutex_lock(&c->lock);
  struct MHD_Response *resp = c->resp;
  c->resp = NULL;
  const int status = c->status;
  const bool stopping = h->stopping;
  if (!resp && !stopping) { /* a spurious wake-up: wait on */
    c->suspended = true;
    MHD_suspend_connection(conn);
  }
  pthread_mutex_unlock(&c->lock);
  if (!resp) return stopping ? queue_text(h, conn, 503, "503 shutting down\n", NULL) : MHD_YES;
  enum MHD_Result rc = queue(h, conn, (unsigned)status, resp);
  MHD_destroy_response(resp);
  return rc;
}

static void completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe) {
  (void)conn;
  mr_http_server *h = cls;
  struct mr_http_call *c = *con_cls;
  if (!c) return;
  *con_cls = NULL;
  pthread_mutex_lock(&h->lock);
  if (c->prev) c->prev->next = c->next;
  else h->calls = c->next;
  if (c->next) c->next->prev = c->prev;
  pthread_mutex_unlock(&h->lock);
  (void)toe;
  pthread_mutex_lock(&c->lock);
  c->mhd_done = true;
  c->suspended = false;
  /* Under the lock: the app's terminal call cannot slip in between, so once it has
   * returned, on_close never runs (its ud may be gone). */
  if (!c->app_done && c->on_close) c->on_close(c->close_ud);
  pthread_mutex_unlock(&c->lock);
  call_unref(c);
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
  /* A peer that leaves mid-answer is ordinary (a client cancels a stream): debug, not a
   * warning an operator has to read. */
  const bool peer_left = strstr(msg, "no longer available") || strstr(msg, "Connection reset") ||
                         strstr(msg, "closed by remote") || strstr(msg, "Broken pipe");
  mr_log_ratelimited(peer_left ? MR_LOG_DEBUG : MR_LOG_WARN, 5, "http: %s", msg);
}

/* ---- the app's side (any thread) --------------------------------------------------------------- */

const char *mr_http_call_method(const mr_http_call *c) { return c->method; }
const char *mr_http_call_path(const mr_http_call *c) { return c->path; }
const char *mr_http_call_body(const mr_http_call *c, size_t *len) {
  if (len) *len = c->body_len;
  return c->body ? c->body : "";
}
const char *mr_http_call_header(mr_http_call *c, const char *name) {
  /* only from the handler (the MHD thread, the request still being processed) */
  return MHD_lookup_connection_value(c->conn, MHD_HEADER_KIND, name);
}

void mr_http_call_on_close(mr_http_call *c, void (*fn)(void *ud), void *ud) {
  pthread_mutex_lock(&c->lock);
  c->on_close = fn;
  c->close_ud = ud;
  if (c->mhd_done && !c->app_done && fn) fn(ud);
  pthread_mutex_unlock(&c->lock);
}

/* Makes the app's reply visible to the MHD thread and wakes the connection. */
static void hand_over(mr_http_call *c, struct MHD_Response *resp, int status) {
  pthread_mutex_lock(&c->lock);
  bool wake = false;
  if (c->mhd_done || c->resp) {
    if (resp) MHD_destroy_response(resp); /* the peer is gone: nothing to send */
  } else {
    c->resp = resp;
    c->status = status;
    wake = c->suspended;
    c->suspended = false;
  }
  pthread_mutex_unlock(&c->lock);
  if (wake) MHD_resume_connection(c->conn);
}

void mr_http_reply(mr_http_call *c, int status, const char *ctype, const char *body, size_t len,
                   const char *const *headers) {
  pthread_mutex_lock(&c->lock);
  const bool twice = c->app_done || c->streaming;
  c->app_done = true;
  pthread_mutex_unlock(&c->lock);
  MR_ASSERT(!twice); /* one terminal call per call: our bug otherwise */
  struct MHD_Response *r = text_response(body ? body : "", body ? len : 0, ctype);
  for (size_t i = 0; r && headers && headers[i] && headers[i + 1]; i += 2) MHD_add_response_header(r, headers[i], headers[i + 1]);
  hand_over(c, r, status);
  call_unref(c);
}

int mr_http_stream_begin(mr_http_call *c, int status, const char *ctype, const char *const *headers) {
  struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_reader, c, stream_free);
  if (!r) return MR_ENOMEM;
  pthread_mutex_lock(&c->lock);
  MR_ASSERT(!c->streaming && !c->app_done);
  c->streaming = true;
  c->refs++; /* the response's reference (dropped by stream_free) */
  pthread_mutex_unlock(&c->lock);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
  for (size_t i = 0; headers && headers[i] && headers[i + 1]; i += 2) MHD_add_response_header(r, headers[i], headers[i + 1]);
  hand_over(c, r, status);
  return 0;
}

int mr_http_stream_write(mr_http_call *c, const char *data, size_t n) {
  pthread_mutex_lock(&c->lock);
  int rc = 0;
  bool wake = false;
  if (c->mhd_done) {
    rc = MR_EUNAVAIL; /* the peer went away */
  } else if (c->slen - c->soff + n > c->h->o.max_stream_buffer) {
    rc = MR_EEXHAUSTED; /* a peer that does not read */
  } else {
    if (c->slen + n > c->scap) {
      size_t cap = c->scap ? c->scap : 4096;
      while (cap < c->slen + n) cap *= 2;
      char *b = mr_realloc(c->sbuf, cap);
      if (!b) rc = MR_ENOMEM;
      else {
        c->sbuf = b;
        c->scap = cap;
      }
    }
    if (!rc) {
      memcpy(c->sbuf + c->slen, data, n);
      c->slen += n;
      wake = c->suspended && !c->resp; /* suspended by the reader (not waiting to queue) */
      if (wake) c->suspended = false;
    }
  }
  pthread_mutex_unlock(&c->lock);
  if (wake) MHD_resume_connection(c->conn);
  return rc;
}

void mr_http_stream_end(mr_http_call *c) {
  pthread_mutex_lock(&c->lock);
  MR_ASSERT(c->streaming && !c->app_done);
  c->app_done = true;
  c->stream_end = true;
  const bool wake = c->suspended && !c->resp && !c->mhd_done;
  if (wake) c->suspended = false;
  pthread_mutex_unlock(&c->lock);
  if (wake) MHD_resume_connection(c->conn);
  call_unref(c);
}

bool mr_http_call_peer_gone(mr_http_call *c) {
  pthread_mutex_lock(&c->lock);
  bool gone = c->mhd_done;
  /* Only while suspended: MHD neither reads nor closes the socket then, so the descriptor
   * is still this connection's. */
  if (!gone && c->suspended && c->fd >= 0) {
    struct pollfd p = {.fd = c->fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) gone = true;
  }
  pthread_mutex_unlock(&c->lock);
  return gone;
}

/* ---- the server ------------------------------------------------------------------------------- */

/* Raises the soft limit on open files to the hard one (a server of 10k connections needs
 * more than the usual 1024), once per process. */
static void raise_nofile(void) {
  static atomic_flag done = ATOMIC_FLAG_INIT;
  if (atomic_flag_test_and_set(&done)) return;
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

static int bind_listen(mr_http_server *h, mr_err *e) {
  char host[256];
  const char *port = NULL;
  int rc = mr__http_split(h->o.listen, h->o.flag, host, sizeof host, &port, e);
  if (rc) return rc;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                  *ai = NULL;
  int gai = getaddrinfo(host, port, &hints, &ai);
  if (gai) return mr_err_set(e, MR_EINVAL, "%s %s: %s", h->o.flag, h->o.listen, gai_strerror(gai));
  int err = 0;
  for (struct addrinfo *a = ai; a && h->fd < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      h->fd = fd;
    } else {
      err = errno;
      close(fd);
    }
  }
  freeaddrinfo(ai);
  if (h->fd < 0) return mr_err_set(e, MR_EUNAVAIL, "%s %s: cannot listen there: %s", h->o.flag, h->o.listen, strerror(err));
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(h->fd, (struct sockaddr *)&ss, &sl);
  h->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                     : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  return 0;
}

int mr_http_server_start(mr_http_server **out, const mr_http_opts *o, mr_err *e) {
  *out = NULL;
  mr_http_server *h = mr_calloc(1, sizeof *h);
  if (!h) return mr_err_set(e, MR_ENOMEM, "out of memory for the HTTP server");
  h->fd = -1;
  pthread_mutex_init(&h->lock, NULL);
  h->o = *o;
  h->probe_ud = o->probe_ud;
  if (!h->o.flag) h->o.flag = "--listen";
  if (!h->o.max_conns) h->o.max_conns = 4096;
  if (!h->o.idle_timeout_s) h->o.idle_timeout_s = 10;
  if (!h->o.max_body) h->o.max_body = 1u << 20;
  if (!h->o.max_stream_buffer) h->o.max_stream_buffer = 8u << 20;
  h->listen_copy = mr_strdup(o->listen ? o->listen : "");
  h->flag_copy = mr_strdup(h->o.flag);
  h->token = o->token ? mr_strdup(o->token) : NULL;
  h->auth_body_copy = o->auth_body ? mr_strdup(o->auth_body) : NULL;
  int rc = 0;
  if (!h->listen_copy || !h->flag_copy || (o->token && !h->token) || (o->auth_body && !h->auth_body_copy)) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for the HTTP server");
    goto fail;
  }
  h->o.listen = h->listen_copy;
  h->o.flag = h->flag_copy;
  if (!h->o.auth_ctype) h->o.auth_ctype = "application/json";
  if ((rc = bind_listen(h, e))) goto fail;
  raise_nofile();
  h->d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                              MHD_USE_ERROR_LOG,
                          0, NULL, NULL, access_handler, h,
                          MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h, /* first: MHD warns otherwise */
                          MHD_OPTION_LISTEN_SOCKET, h->fd,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned int)h->o.max_conns,
                          MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)h->o.idle_timeout_s,
                          MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                          MHD_OPTION_NOTIFY_COMPLETED, completed, h,
                          MHD_OPTION_END);
  if (!h->d) {
    rc = mr_err_set(e, MR_EUNAVAIL, "%s %s: the HTTP server (libmicrohttpd) did not start", h->o.flag, h->o.listen);
    goto fail;
  }
  h->fd = -1; /* MHD owns it now */
  *out = h;
  return 0;
fail:
  mr_http_server_free(h);
  return rc;
}

int mr_http_server_new(mr_http_server **out, const char *listen, const char *flag, const char *path,
                       mr_http_render_fn render, void *ud, mr_err *e) {
  mr_http_opts o = {.listen = listen, .flag = flag, .probe_ud = ud};
  int rc = mr_http_server_start(out, &o, e);
  if (!rc && path && render && (rc = mr_http_server_route(*out, path, NULL, render, ud, e))) {
    mr_http_server_free(*out);
    *out = NULL;
  }
  return rc;
}

int mr_http_server_port(const mr_http_server *h) { return h->port; }

void mr_http_server_probes(mr_http_server *h, mr_http_probe_fn probe) { atomic_store(&h->probe, probe); }

void mr_http_server_render_answers(mr_http_server *h, mr_buf *p, const char *name) {
  char code[16];
  for (size_t i = 0; i < MR__HTTP_N_CODES; i++) {
    const uint64_t v = atomic_load_explicit(&h->answered[i], memory_order_relaxed);
    if (i < MR__HTTP_N_CODES - 1) snprintf(code, sizeof code, "%d", mr__http_codes[i]);
    else snprintf(code, sizeof code, "other");
    const char *lab[] = {"code", code, NULL};
    mr_prom_u64(p, name, lab, v);
  }
}

static int route_add(mr_http_server *h, const mr__route *r, mr_err *e) {
  if (!r->path || r->path[0] != '/' || strlen(r->path) > 1023)
    return mr_err_set(e, MR_EINVAL, "http route \"%.64s\": must start with / and have at most 1023 bytes",
                      r->path ? r->path : "(null)");
  pthread_mutex_lock(&h->lock);
  int rc = 0;
  bool known;
  if (route_find(h, r->method ? r->method : "GET", r->path, &known))
    rc = mr_err_set(e, MR_EINVAL, "http route %s %s: already served", r->method ? r->method : "GET", r->path);
  else if (h->n_routes >= MR__HTTP_MAX_ROUTES)
    rc = mr_err_set(e, MR_ERANGE, "http route %s: at most %u routes", r->path, MR__HTTP_MAX_ROUTES);
  else {
    mr__route *d = &h->routes[h->n_routes];
    *d = *r;
    d->path = mr_strdup(r->path);
    d->method = r->method ? mr_strdup(r->method) : NULL;
    if (!d->path || (r->method && !d->method)) {
      mr_free(d->path);
      mr_free(d->method);
      rc = mr_err_set(e, MR_ENOMEM, "http route %s: out of memory", r->path);
    } else {
      h->n_routes++;
    }
  }
  pthread_mutex_unlock(&h->lock);
  return rc;
}

int mr_http_server_route(mr_http_server *h, const char *path, const char *content_type, mr_http_render_fn render,
                         void *ud, mr_err *e) {
  mr__route r = {.path = (char *)path, .ctype = content_type ? content_type : MR__HTTP_PROM_TYPE, .render = render,
                 .ud = ud, .auth = h->o.token_on_renders};
  return route_add(h, &r, e);
}

int mr_http_server_handle(mr_http_server *h, const char *method, const char *path, bool auth,
                          mr_http_handler_fn handle, void *ud, mr_err *e) {
  mr__route r = {.method = (char *)method, .path = (char *)path, .handle = handle, .ud = ud, .auth = auth};
  return route_add(h, &r, e);
}

/* True while an answer the app has finished is still going out (its bytes not all taken
 * by the peer yet). */
static bool answers_in_flight(mr_http_server *h) {
  bool busy = false;
  pthread_mutex_lock(&h->lock);
  for (mr_http_call *c = h->calls; c && !busy; c = c->next) {
    pthread_mutex_lock(&c->lock);
    busy = c->app_done && !c->mhd_done;
    pthread_mutex_unlock(&c->lock);
  }
  pthread_mutex_unlock(&h->lock);
  return busy;
}

void mr_http_server_free(mr_http_server *h) {
  if (!h) return;
  /* Answers already made (the last events of a drained stream, a reply) go out first, for
   * at most 2 s: a client that does not read them is not waited for. */
  for (int i = 0; h->d && i < 200 && answers_in_flight(h); i++) usleep(10000);
  if (h->d) {
    /* MHD must not be stopped with suspended connections: wake them all; they see
     * `stopping` and end (503, or the stream's end with an error). */
    pthread_mutex_lock(&h->lock);
    h->stopping = true;
    for (mr_http_call *c = h->calls; c; c = c->next) {
      pthread_mutex_lock(&c->lock);
      const bool wake = c->suspended;
      c->suspended = false;
      pthread_mutex_unlock(&c->lock);
      if (wake) MHD_resume_connection(c->conn);
    }
    pthread_mutex_unlock(&h->lock);
    MHD_stop_daemon(h->d);
  }
  if (h->fd >= 0) close(h->fd);
  for (uint32_t i = 0; i < h->n_routes; i++) {
    mr_free(h->routes[i].path);
    mr_free(h->routes[i].method);
  }
  pthread_mutex_destroy(&h->lock);
  mr_free(h->token);
  mr_free(h->listen_copy);
  mr_free(h->flag_copy);
  mr_free(h->auth_body_copy);
  mr_free(h);
}
