/*
 * http.c - the one-shot HTTP GET client of our own endpoints (mr.h: mr_http_get, and its
 * pure part mr_http_parse_answer, fuzzed by tests/fuzz/fuzz_http_answer.c): moerpc-place
 * reads a client's GET /routing and GET /placement with it. The server side is
 * http_server.c (libmicrohttpd).
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/internal.h"
#include "common/mr.h"

/* Splits HOST:PORT / [V6]:PORT into host and port text. */
int mr__http_split(const char *listen, const char *flag, char *host, size_t hlen, const char **port, mr_err *e) {
  const char *colon, *h0 = listen, *h1;
  if (listen[0] && strspn(listen, "0123456789") == strlen(listen)) { /* a port alone: loopback */
    if (hlen < sizeof "127.0.0.1" || strlen(listen) > 5 || strtoul(listen, NULL, 10) > 65535) goto bad;
    snprintf(host, hlen, "127.0.0.1");
    *port = listen;
    return 0;
  }
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
  return mr_err_set(e, MR_EINVAL, "%s \"%s\": must be HOST:PORT, [IPV6]:PORT or PORT (loopback), port 0..65535",
                    flag, listen);
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
