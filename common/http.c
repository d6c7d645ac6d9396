/*
 * http.c - the /metrics responder (mr.h): a request-head parser (pure, fuzzed by
 * tests/fuzz/fuzz_http_request.c) and a one-connection-at-a-time responder thread.
 *
 * Why a thread of its own and not the server's libuv loop (docs/DESIGN.md 3.8): the client
 * has no event loop and needs the same endpoint, so one implementation (one parser to fuzz)
 * serves both; and a scrape, however slow its peer, never delays the server's drain steps
 * and housekeeping on the admin loop. One connection at a time is enough for a scraper
 * every few seconds; a client that holds a connection without sending is cut at
 * MR_HTTP_TIMEOUT_MS, so it delays other scrapes by at most that.
 *
 * Accepted head (RFC 9112, the subset a scraper sends):
 *   request-line = method SP target SP "HTTP/1." DIGIT CRLF     (LF alone is accepted)
 *   method       = 1..15 of A-Z
 *   target       = "/" then visible ASCII (0x21..0x7e), at most 1023 bytes before any '?'
 *   header       = token ":" *(SP / HTAB / VCHAR / obs-text) CRLF, at most 64 of them
 *   end          = an empty line
 * Anything else (a NUL, a control character, a missing colon, a space before the colon) is
 * 400; HTTP/2 or HTTP/0.9-style heads are 505 / 400. The body, if any, is never read.
 */
#define _GNU_SOURCE /* accept4, pipe2 */
#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/mr.h"

static bool mr__tchar(unsigned char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* One line of [p, end): its length without the line end in *n, the bytes with it in *adv.
 * False when no LF is in the range yet. */
static bool mr__line(const char *p, const char *end, size_t *n, size_t *adv) {
  const char *lf = memchr(p, '\n', (size_t)(end - p));
  if (!lf) return false;
  *adv = (size_t)(lf - p) + 1;
  *n = (size_t)(lf - p);
  if (*n && p[*n - 1] == '\r') (*n)--;
  return true;
}

static int mr__http_fail(mr_http_req *out, int status, mr_err *e, const char *why) {
  out->status = status;
  out->complete = false;
  return mr_err_set(e, status == 431 ? MR_EEXHAUSTED : MR_EFORMAT, "HTTP %d: %s", status, why);
}

/* The request line: method SP target SP version. */
static int mr__http_request_line(const char *l, size_t n, mr_http_req *out, mr_err *e) {
  size_t i = 0;
  while (i < n && l[i] >= 'A' && l[i] <= 'Z') i++;
  if (i == 0 || i >= sizeof out->method || i >= n || l[i] != ' ')
    return mr__http_fail(out, 400, e, "request line: method must be 1..15 capital letters, then a space");
  memcpy(out->method, l, i);
  out->method[i] = '\0';
  size_t t0 = ++i;
  if (i >= n || l[i] != '/') return mr__http_fail(out, 400, e, "request target must start with '/'");
  size_t q = 0; /* where the path ends ('?' or the space) */
  while (i < n && l[i] != ' ') {
    unsigned char c = (unsigned char)l[i];
    if (c < 0x21 || c > 0x7e) return mr__http_fail(out, 400, e, "request target: byte outside 0x21..0x7e");
    if (c == '?' && !q) q = i;
    i++;
  }
  if (!q) q = i;
  if (q - t0 >= sizeof out->path) return mr__http_fail(out, 431, e, "request target over 1023 bytes");
  memcpy(out->path, l + t0, q - t0);
  out->path[q - t0] = '\0';
  if (i >= n) return mr__http_fail(out, 400, e, "request line: no HTTP version");
  i++;
  const char *v = l + i;
  size_t vn = n - i;
  if (vn < 6 || memcmp(v, "HTTP/", 5) != 0)
    return mr__http_fail(out, 400, e, "request line: version must be HTTP/1.0 or HTTP/1.1");
  if (vn != 8 || v[5] != '1' || v[6] != '.' || v[7] < '0' || v[7] > '9')
    return mr__http_fail(out, 505, e, "only HTTP/1.x is served");
  return 0;
}

static int mr__http_header(const char *l, size_t n, mr_http_req *out, mr_err *e) {
  size_t i = 0;
  while (i < n && mr__tchar((unsigned char)l[i])) i++;
  if (i == 0 || i >= n || l[i] != ':')
    return mr__http_fail(out, 400, e, "header line: must be a token, ':' and a value");
  for (i++; i < n; i++) {
    unsigned char c = (unsigned char)l[i];
    if ((c < 0x20 && c != '\t') || c == 0x7f) return mr__http_fail(out, 400, e, "header value: control byte");
  }
  return 0;
}

int mr_http_parse_request(const char *buf, size_t len, size_t max, mr_http_req *out, mr_err *e) {
  memset(out, 0, sizeof *out);
  const char *p = buf, *end = buf + (len < max ? len : max);
  size_t n, adv;
  uint32_t lines = 0;
  /* A request line not yet ended is still checked for what it has: garbage is refused on
   * its first bytes, not after the timeout. */
  if (!mr__line(p, end, &n, &adv)) {
    size_t i = 0;
    while (i < (size_t)(end - p) && p[i] >= 'A' && p[i] <= 'Z') i++;
    if (i < (size_t)(end - p) && (p[i] != ' ' || i == 0))
      return mr__http_fail(out, 400, e, "request line: method must be 1..15 capital letters, then a space");
    if (i >= sizeof out->method) return mr__http_fail(out, 400, e, "request line: method over 15 letters");
    if (len >= max) return mr__http_fail(out, 431, e, "request head over the size limit");
    return 0;
  }
  int rc = mr__http_request_line(p, n, out, e);
  if (rc) return rc;
  p += adv;
  for (;;) {
    if (!mr__line(p, end, &n, &adv)) {
      if (len >= max) return mr__http_fail(out, 431, e, "request head over the size limit");
      return 0;
    }
    if (n == 0) {
      p += adv;
      break;
    }
    if (++lines > MR_HTTP_MAX_HEADERS) return mr__http_fail(out, 431, e, "more than 64 header lines");
    if ((rc = mr__http_header(p, n, out, e))) return rc;
    p += adv;
  }
  out->complete = true;
  out->head_len = (size_t)(p - buf);
  return 0;
}

/* ---- the responder ---------------------------------------------------------------------- */

struct mr_http_server {
  int fd;          /* listening socket */
  int stop_fd[2];  /* a byte on [1] stops the thread */
  int port;
  char *path;
  mr_http_render_fn render;
  void *ud;
  _Atomic(mr_http_probe_fn) probe; /* /healthz and /readyz, or NULL (404) */
  /* Extra paths (mr_http_server_route): entries below n_routes are complete and fixed. */
  struct mr__http_route {
    char *path;
    const char *ctype;
    mr_http_render_fn render;
    void *ud;
  } routes[MR_HTTP_MAX_ROUTES];
  _Atomic uint32_t n_routes;
  pthread_mutex_t route_lock; /* writers of routes[] */
  pthread_t thread;
  bool started;
  mr_prom text;    /* responder thread only */
};

static const char *mr__http_reason(int status) {
  switch (status) {
  case 200: return "OK";
  case 400: return "Bad Request";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 431: return "Request Header Fields Too Large";
  case 500: return "Internal Server Error";
  case 503: return "Service Unavailable";
  case 505: return "HTTP Version Not Supported";
  default: return "Error";
  }
}

/* Waits until fd is ready for events or the deadline; false on timeout, stop or error. */
static bool mr__http_wait(mr_http_server *h, int fd, short events, uint64_t deadline_ms) {
  for (;;) {
    uint64_t now = mr_now_ns() / 1000000u;
    if (now >= deadline_ms) return false;
    struct pollfd pf[2] = {{.fd = fd, .events = events}, {.fd = h->stop_fd[0], .events = POLLIN}};
    int r = poll(pf, 2, (int)(deadline_ms - now));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0 || pf[1].revents) return false;
    return true;
  }
}

static void mr__http_send_all(mr_http_server *h, int fd, const char *b, size_t n, uint64_t deadline_ms) {
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w > 0) {
      b += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && mr__http_wait(h, fd, POLLOUT, deadline_ms))
      continue;
    return; /* peer gone or too slow */
  }
}

/* Answers status with body (NULL: a one-line text reason); HEAD gets the head only. */
static void mr__http_answer_ct(mr_http_server *h, int fd, int status, const char *body,
                               size_t blen, bool head_only, uint64_t deadline_ms,
                               const char *ctype) {
  char err[128];
  if (!body) {
    blen = (size_t)snprintf(err, sizeof err, "%d %s\n", status, mr__http_reason(status));
    body = err;
  }
  char hd[320];
  int n = snprintf(hd, sizeof hd,
                   "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n"
                   "Content-Length: %zu\r\n%sConnection: close\r\n\r\n",
                   status, mr__http_reason(status), ctype, blen,
                   status == 405 ? "Allow: GET, HEAD\r\n" : "");
  mr__http_send_all(h, fd, hd, (size_t)n, deadline_ms);
  if (!head_only) mr__http_send_all(h, fd, body, blen, deadline_ms);
}

#define MR__HTTP_PROM_TYPE "text/plain; version=0.0.4; charset=utf-8"
static void mr__http_answer(mr_http_server *h, int fd, int status, const char *body, size_t blen,
                            bool head_only, uint64_t deadline_ms) {
  mr__http_answer_ct(h, fd, status, body, blen, head_only, deadline_ms, MR__HTTP_PROM_TYPE);
}

/* Renders one path's body into h->text and answers it (500 when out of memory). */
static void mr__http_render(mr_http_server *h, int fd, mr_http_render_fn render, void *ud,
                            const char *ctype, bool head, uint64_t deadline) {
  mr_prom_reset(&h->text);
  render(ud, &h->text);
  if (h->text.oom)
    mr__http_answer(h, fd, 500, NULL, 0, head, deadline);
  else
    mr__http_answer_ct(h, fd, 200, h->text.buf ? h->text.buf : "", h->text.len, head, deadline,
                       ctype);
}

/* The extra route serving path, or NULL. */
static const struct mr__http_route *mr__http_find(mr_http_server *h, const char *path) {
  uint32_t n = atomic_load_explicit(&h->n_routes, memory_order_acquire);
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(h->routes[i].path, path) == 0) return &h->routes[i];
  return NULL;
}

static void mr__http_conn(mr_http_server *h, int fd) {
  char buf[MR_HTTP_MAX_HEAD + 1];
  size_t len = 0;
  uint64_t deadline = mr_now_ns() / 1000000u + MR_HTTP_TIMEOUT_MS;
  mr_http_req req;
  mr_err e;
  for (;;) {
    int rc = mr_http_parse_request(buf, len, MR_HTTP_MAX_HEAD, &req, &e);
    if (rc) {
      mr_log_ratelimited(MR_LOG_WARN, 5, "metrics: %s", e.msg);
      mr__http_answer(h, fd, req.status, NULL, 0, false, deadline);
      return;
    }
    if (req.complete) break;
    if (!mr__http_wait(h, fd, POLLIN, deadline)) return; /* too slow, or stopping */
    ssize_t r = recv(fd, buf + len, MR_HTTP_MAX_HEAD + 1 - len, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) return; /* closed before a whole head */
    len += (size_t)r;
  }
  bool head = strcmp(req.method, "HEAD") == 0;
  if (!head && strcmp(req.method, "GET") != 0) {
    mr__http_answer(h, fd, 405, NULL, 0, false, deadline);
  } else if (strcmp(req.path, h->path) == 0) {
    mr__http_render(h, fd, h->render, h->ud, MR__HTTP_PROM_TYPE, head, deadline);
  } else if (mr__http_find(h, req.path)) {
    const struct mr__http_route *r = mr__http_find(h, req.path);
    mr__http_render(h, fd, r->render, r->ud, r->ctype, head, deadline);
  } else {
    mr_http_probe_fn probe = atomic_load(&h->probe);
    bool ready = strcmp(req.path, "/readyz") == 0;
    if (probe && (ready || strcmp(req.path, "/healthz") == 0)) {
      /* Probes: 200 "ok" or 503 "not ready", for load balancers and kubelet. */
      bool ok = probe(h->ud, ready);
      const char *body = ok ? "ok\n" : ready ? "not ready\n" : "not alive\n";
      mr__http_answer(h, fd, ok ? 200 : 503, body, strlen(body), head, deadline);
    } else {
      mr__http_answer(h, fd, 404, NULL, 0, head, deadline);
    }
  }
}

static void *mr__http_main(void *arg) {
  mr_http_server *h = arg;
  pthread_setname_np(pthread_self(), "mr-metrics");
  for (;;) {
    struct pollfd pf[2] = {{.fd = h->fd, .events = POLLIN}, {.fd = h->stop_fd[0], .events = POLLIN}};
    int r = poll(pf, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 || pf[1].revents) break;
    int c = accept4(h->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EMFILE || errno == ENFILE) usleep(100 * 1000); /* do not spin */
      continue;
    }
    mr__http_conn(h, c);
    close(c);
  }
  return NULL;
}

/* Splits HOST:PORT / [V6]:PORT into host and port text. */
static int mr__http_split(const char *listen, const char *flag, char *host, size_t hlen,
                          const char **port, mr_err *e) {
  const char *colon, *h0 = listen, *h1;
  if (listen[0] == '[') {
    const char *close = strchr(listen, ']');
    if (!close || close == listen + 1 || close[1] != ':') goto bad;
    h0 = listen + 1;
    h1 = close;
    colon = close + 1;
  } else {
    colon = strrchr(listen, ':');
    if (!colon || colon == listen) goto bad;
    h1 = colon;
  }
  if ((size_t)(h1 - h0) >= hlen) goto bad;
  memcpy(host, h0, (size_t)(h1 - h0));
  host[h1 - h0] = '\0';
  *port = colon + 1;
  char *end = NULL;
  unsigned long v = strtoul(*port, &end, 10);
  if (!**port || *end || v > 65535 || (*port)[0] == '-' || (*port)[0] == '+') goto bad;
  return 0;
bad:
  return mr_err_set(e, MR_EINVAL, "%s \"%s\": must be HOST:PORT or [IPV6]:PORT, port 0..65535",
                    flag, listen);
}

int mr_http_server_new(mr_http_server **out, const char *addr, const char *flag,
                       const char *path, mr_http_render_fn render, void *ud, mr_err *e) {
  *out = NULL;
  char host[256];
  const char *port = NULL;
  int rc = mr__http_split(addr, flag, host, sizeof host, &port, e);
  if (rc) return rc;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *ai = NULL;
  int gai = getaddrinfo(host, port, &hints, &ai);
  if (gai) return mr_err_set(e, MR_EINVAL, "%s %s: %s", flag, addr, gai_strerror(gai));
  mr_http_server *h = mr_calloc(1, sizeof *h);
  if (!h) {
    freeaddrinfo(ai);
    return mr_err_set(e, MR_ENOMEM, "out of memory for the %s responder", flag);
  }
  h->fd = h->stop_fd[0] = h->stop_fd[1] = -1;
  pthread_mutex_init(&h->route_lock, NULL);
  mr_prom_init(&h->text);
  h->render = render;
  h->ud = ud;
  h->path = mr_strdup(path);
  int err = 0;
  for (struct addrinfo *a = ai; a && h->fd < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 16) == 0) {
      h->fd = fd;
    } else {
      err = errno;
      close(fd);
    }
  }
  freeaddrinfo(ai);
  if (!h->path) {
    rc = mr_err_set(e, MR_ENOMEM, "out of memory for the %s responder", flag);
    goto out_free;
  }
  if (h->fd < 0) {
    rc = mr_err_set(e, MR_EUNAVAIL, "%s %s: cannot listen there: %s", flag, addr, strerror(err));
    goto out_free;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(h->fd, (struct sockaddr *)&ss, &sl);
  h->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                     : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (pipe2(h->stop_fd, O_CLOEXEC | O_NONBLOCK) != 0) {
    rc = mr_err_set(e, MR_EINTERNAL, "%s: pipe: %s", flag, strerror(errno));
    goto out_free;
  }
  if ((err = pthread_create(&h->thread, NULL, mr__http_main, h)) != 0) {
    rc = mr_err_set(e, MR_EINTERNAL, "%s: cannot start the responder thread: error %d", flag, err);
    goto out_free;
  }
  h->started = true;
  *out = h;
  return 0;
out_free:
  mr_http_server_free(h);
  return rc;
}

int mr_http_server_port(const mr_http_server *h) { return h->port; }

void mr_http_server_probes(mr_http_server *h, mr_http_probe_fn probe) {
  atomic_store(&h->probe, probe);
}

void mr_http_server_free(mr_http_server *h) {
  if (!h) return;
  if (h->started) {
    char b = 1;
    if (write(h->stop_fd[1], &b, 1) < 0) {}
    pthread_join(h->thread, NULL);
  }
  if (h->fd >= 0) close(h->fd);
  if (h->stop_fd[0] >= 0) close(h->stop_fd[0]);
  if (h->stop_fd[1] >= 0) close(h->stop_fd[1]);
  mr_prom_close(&h->text);
  mr_free(h->path);
  for (uint32_t i = 0; i < atomic_load(&h->n_routes); i++) mr_free(h->routes[i].path);
  pthread_mutex_destroy(&h->route_lock);
  mr_free(h);
}

int mr_http_server_route(mr_http_server *h, const char *path, const char *content_type,
                         mr_http_render_fn render, void *ud, mr_err *e) {
  if (!path || path[0] != '/' || strlen(path) > 1023)
    return mr_err_set(e, MR_EINVAL, "http route \"%.64s\": must start with / and have at most "
                      "1023 bytes", path ? path : "(null)");
  pthread_mutex_lock(&h->route_lock);
  int rc = 0;
  uint32_t n = atomic_load(&h->n_routes);
  if (strcmp(path, h->path) == 0 || mr__http_find(h, path))
    rc = mr_err_set(e, MR_EINVAL, "http route %s: already served", path);
  else if (n >= MR_HTTP_MAX_ROUTES)
    rc = mr_err_set(e, MR_ERANGE, "http route %s: at most %u extra routes", path,
                    MR_HTTP_MAX_ROUTES);
  else if (!(h->routes[n].path = mr_strdup(path)))
    rc = mr_err_set(e, MR_ENOMEM, "http route %s: out of memory", path);
  if (!rc) {
    h->routes[n].ctype = content_type ? content_type : MR__HTTP_PROM_TYPE;
    h->routes[n].render = render;
    h->routes[n].ud = ud;
    atomic_store_explicit(&h->n_routes, n + 1, memory_order_release);
  }
  pthread_mutex_unlock(&h->route_lock);
  return rc;
}

/* ---- the one-shot GET client ------------------------------------------------------------ */

/* Waits for events on fd until deadline_ms (monotonic ms); false on timeout or error. */
static bool mr__http_cwait(int fd, short events, uint64_t deadline_ms) {
  for (;;) {
    uint64_t now = mr_now_ns() / 1000000u;
    if (now >= deadline_ms) return false;
    struct pollfd pf = {.fd = fd, .events = events};
    int r = poll(&pf, 1, (int)(deadline_ms - now));
    if (r < 0 && errno == EINTR) continue;
    return r > 0;
  }
}

int mr_http_parse_answer(const char *buf, size_t len, size_t max_body, int *status,
                         size_t *body_off, mr_err *e) {
  *status = 0;
  *body_off = 0;
  size_t end = 0;
  for (size_t i = 0; i + 3 < len && i < MR_HTTP_MAX_HEAD; i++)
    if (memcmp(buf + i, "\r\n\r\n", 4) == 0) {
      end = i + 4;
      break;
    }
  if (!end)
    return mr_err_set(e, MR_EPROTO, "not an HTTP/1.x answer: no end of head within %u bytes "
                      "(%zu received)", MR_HTTP_MAX_HEAD, len);
  /* "HTTP/1.x NNN " or "HTTP/1.x NNN\r": the status line's fixed prefix, byte by byte. */
  if (end < 14 || memcmp(buf, "HTTP/1.", 7) != 0 || (buf[7] != '0' && buf[7] != '1') ||
      buf[8] != ' ' || buf[9] < '1' || buf[9] > '5' || buf[10] < '0' || buf[10] > '9' ||
      buf[11] < '0' || buf[11] > '9' || (buf[12] != ' ' && buf[12] != '\r'))
    return mr_err_set(e, MR_EPROTO, "not an HTTP/1.x status line (want \"HTTP/1.x NNN ...\")");
  if (len - end > max_body)
    return mr_err_set(e, MR_EEXHAUSTED, "answer over %zu bytes of body", max_body);
  *status = (buf[9] - '0') * 100 + (buf[10] - '0') * 10 + (buf[11] - '0');
  *body_off = end;
  return 0;
}

int mr_http_get(const char *url, const char *default_path, size_t max_body, int timeout_ms,
                int *status, char **body, size_t *len, mr_err *e) {
  *status = 0;
  *body = NULL;
  *len = 0;
  const char *p = url;
  if (strncmp(p, "http://", 7) == 0) p += 7;
  else if (strstr(p, "://"))
    return mr_err_set(e, MR_EINVAL, "%.200s: only http:// URLs (HOST:PORT[/PATH])", url);
  char hostport[300], path[1024];
  const char *slash = strchr(p, '/');
  size_t hl = slash ? (size_t)(slash - p) : strlen(p);
  if (hl == 0 || hl >= sizeof hostport)
    return mr_err_set(e, MR_EINVAL, "%.200s: must be http://HOST:PORT[/PATH]", url);
  memcpy(hostport, p, hl);
  hostport[hl] = '\0';
  snprintf(path, sizeof path, "%s", slash && slash[1] ? slash : default_path ? default_path : "/");
  for (const char *c = path; *c; c++)
    if ((unsigned char)*c <= 0x20 || (unsigned char)*c >= 0x7f)
      return mr_err_set(e, MR_EINVAL, "%.200s: the path has a space or a control byte", url);
  char host[256];
  const char *port = NULL;
  int rc = mr__http_split(hostport, url, host, sizeof host, &port, e);
  if (rc) return rc;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_NUMERICSERV}, *ai = NULL;
  int gai = getaddrinfo(host, port, &hints, &ai);
  if (gai) return mr_err_set(e, MR_EINVAL, "%.200s: %s", url, gai_strerror(gai));
  uint64_t deadline = mr_now_ns() / 1000000u + (uint64_t)(timeout_ms > 0 ? timeout_ms : 1);
  int fd = -1, err = ECONNREFUSED;
  for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    int ok = errno == EINPROGRESS && mr__http_cwait(fd, POLLOUT, deadline);
    socklen_t sl = sizeof err;
    if (ok && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) == 0 && err == 0) break;
    if (!ok) err = ETIMEDOUT;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(ai);
  if (fd < 0)
    return mr_err_set(e, err == ETIMEDOUT ? MR_ETIMEDOUT : MR_EUNAVAIL, "%.200s: cannot connect: %s",
                      url, strerror(err));
  char req[1400];
  int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n",
                   path, hostport);
  for (int off = 0; off < n;) {
    ssize_t w = send(fd, req + off, (size_t)(n - off), MSG_NOSIGNAL);
    if (w > 0) {
      off += (int)w;
    } else if (w < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!mr__http_cwait(fd, POLLOUT, deadline)) {
        close(fd);
        return mr_err_set(e, MR_ETIMEDOUT, "%.200s: no answer within %d ms", url, timeout_ms);
      }
    } else {
      rc = mr_err_set(e, MR_EUNAVAIL, "%.200s: send: %s", url, strerror(errno));
      close(fd);
      return rc;
    }
  }
  /* The answer: a head of at most MR_HTTP_MAX_HEAD bytes, then at most max_body. */
  const size_t limit = MR_HTTP_MAX_HEAD + max_body + 1;
  size_t cap = limit < 65536 ? limit : 65536, got = 0;
  char *buf = mr_malloc(cap);
  if (!buf) {
    close(fd);
    return mr_err_set(e, MR_ENOMEM, "%.200s: out of memory for %zu bytes", url, cap);
  }
  for (;;) {
    if (got == cap && cap < limit) { /* grows by doubling up to the limit */
      size_t nc = cap * 2 < limit ? cap * 2 : limit;
      char *nb = mr_realloc(buf, nc);
      if (!nb) {
        rc = mr_err_set(e, MR_ENOMEM, "%.200s: out of memory for %zu bytes", url, nc);
        goto out;
      }
      buf = nb;
      cap = nc;
    }
    if (got == cap) {
      rc = mr_err_set(e, MR_EEXHAUSTED, "%.200s: answer over %zu bytes of body", url, max_body);
      goto out;
    }
    ssize_t r = recv(fd, buf + got, cap - got, 0);
    if (r > 0) {
      got += (size_t)r;
      continue;
    }
    if (r == 0) break;
    if (errno == EINTR) continue;
    if ((errno == EAGAIN || errno == EWOULDBLOCK) && mr__http_cwait(fd, POLLIN, deadline)) continue;
    rc = errno == EAGAIN || errno == EWOULDBLOCK
             ? mr_err_set(e, MR_ETIMEDOUT, "%.200s: no complete answer within %d ms", url, timeout_ms)
             : mr_err_set(e, MR_EUNAVAIL, "%.200s: recv: %s", url, strerror(errno));
    goto out;
  }
  buf[got] = '\0';
  int st = 0;
  size_t body_off = 0;
  if ((rc = mr_http_parse_answer(buf, got, max_body, &st, &body_off, e))) {
    mr_err_prefix(e, rc, "%.200s", url);
    goto out;
  }
  *len = got - body_off;
  memmove(buf, buf + body_off, *len + 1);
  *status = st;
  *body = buf;
  buf = NULL;
out:
  mr_free(buf);
  close(fd);
  return rc;
}
