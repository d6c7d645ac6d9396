/*
 * test_metrics.c - common/metrics.c and common/http.c: the Prometheus text writer (name
 * and label escaping, number forms, histogram layout), the histogram's buckets, the
 * request-head parser on good and bad heads, and the responder over a real socket (200,
 * HEAD, 404, 405, 400, 431, a client that sends nothing is cut at the timeout and the next
 * one is served).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/mr.h"
#include "tests/unit/mt.h"

MT_TEST(escaping) {
  mr_buf p;
  mr_buf_init(&p);
  mr_prom_family(&p, "moerpc_x_total", MR_PROM_COUNTER, "a \\ back\nslash");
  const char *l[] = {"path", "a\"b\\c\nd", "9bad-name", "v", NULL};
  mr_prom_u64(&p, "moerpc_x_total", l, 7);
  mr_prom_u64(&p, "1bad name", NULL, 1);
  MT_FALSE(p.oom);
  MT_EQ_STR(p.buf, "# HELP moerpc_x_total a \\\\ back\\nslash\n"
                   "# TYPE moerpc_x_total counter\n"
                   "moerpc_x_total{path=\"a\\\"b\\\\c\\nd\",_9bad_name=\"v\"} 7\n"
                   "_1bad_name 1\n");
  MT_EQ_U64(p.len, strlen(p.buf));
  mr_buf_close(&p);
}

MT_TEST(numbers) {
  mr_buf p;
  mr_buf_init(&p);
  mr_prom_double(&p, "a", NULL, 0.005);
  mr_prom_double(&p, "b", NULL, 1.0 / 0.0);
  mr_prom_double(&p, "c", NULL, -1.0 / 0.0);
  mr_prom_double(&p, "d", NULL, 0.0 / 0.0);
  mr_prom_double(&p, "e", NULL, 1754000000.25);
  mr_prom_double(&p, "f", NULL, 0);
  MT_EQ_STR(p.buf, "a 0.005\nb +Inf\nc -Inf\nd NaN\ne 1754000000.25\nf 0\n");
  mr_buf_reset(&p);
  MT_EQ_U64(p.len, 0);
  for (int i = 0; i < 2000; i++) mr_buf_printf(&p, "%s", "0123456789"); /* growth */
  MT_EQ_U64(p.len, 20000);
  mr_buf_close(&p);
}

MT_TEST(histogram) {
  mr_hist h;
  const uint64_t b[] = {10, 100, 1000};
  mr_hist_init(&h, b, 3, 1e-3);
  mr_hist_observe(&h, 0);
  mr_hist_observe(&h, 10);   /* le is inclusive */
  mr_hist_observe(&h, 11);
  mr_hist_observe(&h, 5000); /* +Inf only */
  mr_buf p;
  mr_buf_init(&p);
  mr_prom_family(&p, "t_seconds", MR_PROM_HISTOGRAM, "h");
  const char *l[] = {"layer", "3", NULL};
  mr_prom_hist(&p, "t_seconds", l, &h);
  MT_EQ_STR(p.buf, "# HELP t_seconds h\n# TYPE t_seconds histogram\n"
                   "t_seconds_bucket{layer=\"3\",le=\"0.01\"} 2\n"
                   "t_seconds_bucket{layer=\"3\",le=\"0.1\"} 3\n"
                   "t_seconds_bucket{layer=\"3\",le=\"1\"} 3\n"
                   "t_seconds_bucket{layer=\"3\",le=\"+Inf\"} 4\n"
                   "t_seconds_sum{layer=\"3\"} 5.021\n"
                   "t_seconds_count{layer=\"3\"} 4\n");
  mr_buf_reset(&p);
  mr_hist_init_latency(&h);
  mr_prom_hist(&p, "x", NULL, &h);
  MT_CONTAINS(p.buf, "x_bucket{le=\"5e-05\"} 0\n");
  MT_CONTAINS(p.buf, "x_bucket{le=\"1\"} 0\n");
  MT_CONTAINS(p.buf, "x_count 0\n");
  mr_buf_close(&p);
}

static void render(void *ud, mr_buf *out) {
  mr_prom_family(out, "t_up", MR_PROM_GAUGE, "up");
  mr_prom_u64(out, "t_up", NULL, (uint64_t)(uintptr_t)ud);
}

/* Sends req (len bytes) to port, reads the answer until close into buf. */
static size_t roundtrip(int port, const char *req, size_t len, char *buf, size_t cap) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  MT_EQ_INT(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  if (len) MT_EQ_INT((int)send(fd, req, len, MSG_NOSIGNAL), (int)len);
  size_t n = 0;
  ssize_t r;
  while (n + 1 < cap && (r = recv(fd, buf + n, cap - 1 - n, 0)) > 0) n += (size_t)r;
  buf[n] = '\0';
  close(fd);
  return n;
}

MT_TEST(responder) {
  mr_http_server *h;
  mr_err e;
  mr_http_opts o = {.listen = "127.0.0.1:0", .flag = "--metrics-listen", .idle_timeout_s = 1};
  MT_OK(mr_http_server_start(&h, &o, &e), &e);
  MT_OK(mr_http_server_route(h, "/metrics", NULL, render, (void *)42, &e), &e);
  int port = mr_http_server_port(h);
  MT_TRUE(port > 0);
  static char buf[65536];
  const char *get = "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
  roundtrip(port, get, strlen(get), buf, sizeof buf);
  MT_CONTAINS(buf, "HTTP/1.1 200 OK\r\n");
  MT_CONTAINS(buf, "text/plain; version=0.0.4");
  MT_CONTAINS(buf, "\r\n\r\n# HELP t_up up\n# TYPE t_up gauge\nt_up 42\n");
  const char *head = "HEAD /metrics HTTP/1.0\r\n\r\n";
  roundtrip(port, head, strlen(head), buf, sizeof buf);
  MT_CONTAINS(buf, " 200 OK");
  MT_TRUE(strstr(buf, "t_up 42") == NULL);
  const char *other = "GET /other HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
  roundtrip(port, other, strlen(other), buf, sizeof buf);
  MT_CONTAINS(buf, "HTTP/1.1 404 ");
  const char *post = "POST /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc";
  roundtrip(port, post, strlen(post), buf, sizeof buf);
  MT_CONTAINS(buf, "HTTP/1.1 405 ");
  MT_CONTAINS(buf, "Allow: GET, HEAD");
  /* garbage: a 400, or the connection closed at once (libmicrohttpd's choice per case);
   * either way the server serves the next request */
  roundtrip(port, "\x00\x01\x02garbage\r\n\r\n", 14, buf, sizeof buf);
  MT_TRUE(buf[0] == '\0' || strstr(buf, "HTTP/1.1 400 ") != NULL);
  roundtrip(port, get, strlen(get), buf, sizeof buf);
  MT_CONTAINS(buf, "t_up 42");
  static char big[200 * 1024];
  int n = snprintf(big, sizeof big, "GET /metrics HTTP/1.1\r\nHost: t\r\n");
  while ((size_t)n < sizeof big - 100) n += snprintf(big + n, sizeof big - (size_t)n, "X-Pad: yyyyyyyy\r\n");
  n += snprintf(big + n, sizeof big - (size_t)n, "\r\n");
  roundtrip(port, big, (size_t)n, buf, sizeof buf);
  MT_TRUE(strstr(buf, "HTTP/1.1 431 ") || strstr(buf, "HTTP/1.1 413 "));
  /* A client that sends nothing is cut at the idle timeout (1 s here); others are served
   * meanwhile. */
  uint64_t t0 = mr_now_ns();
  size_t got = roundtrip(port, NULL, 0, buf, sizeof buf);
  uint64_t ms = (mr_now_ns() - t0) / 1000000u;
  MT_EQ_U64(got, 0);
  MT_TRUE(ms >= 900 && ms < 4000);
  roundtrip(port, get, strlen(get), buf, sizeof buf);
  MT_CONTAINS(buf, "t_up 42");
  mr_http_server_free(h);
  mr_http_server_free(NULL);
}

static void render_json(void *ud, mr_buf *out) { mr_buf_printf(out, "{\"n\": %d}\n", *(int *)ud); }
static void render_big(void *ud, mr_buf *out) {
  for (int i = 0; i < 1000; i++) mr_buf_append(out, "0123456789", 10);
}

/* Extra routes (mr_http_server_route) and the one-shot GET client (mr_http_get). */
MT_TEST(routes_and_get) {
  mr_http_server *h;
  mr_err e;
  MT_OK(mr_http_server_new(&h, "127.0.0.1:0", "--metrics-listen", "/metrics", render, (void *)7, &e), &e);
  static int n = 5;
  MT_OK(mr_http_server_route(h, "/routing", "application/json", render_json, &n, &e), &e);
  MT_OK(mr_http_server_route(h, "/big", NULL, render_big, NULL, &e), &e);
  MT_EQ_INT(mr_http_server_route(h, "/routing", NULL, render_json, &n, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "already served");
  MT_EQ_INT(mr_http_server_route(h, "/metrics", NULL, render_json, &n, &e), MR_EINVAL); /* served already */
  MT_EQ_INT(mr_http_server_route(h, "nopath", NULL, render_json, &n, &e), MR_EINVAL);
  char url[80], *body = NULL;
  size_t len = 0;
  int status = 0;
  snprintf(url, sizeof url, "http://127.0.0.1:%d", mr_http_server_port(h));
  MT_OK(mr_http_get(url, "/routing", 1024, 2000, &status, &body, &len, &e), &e);
  MT_EQ_INT(status, 200);
  MT_EQ_STR(body, "{\"n\": 5}\n");
  MT_EQ_U64(len, 9);
  mr_free(body);
  static char buf[4096];
  const char *get = "GET /routing HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n";
  roundtrip(mr_http_server_port(h), get, strlen(get), buf, sizeof buf);
  MT_CONTAINS(buf, "Content-Type: application/json\r\n");
  char u2[96];
  snprintf(u2, sizeof u2, "127.0.0.1:%d/metrics", mr_http_server_port(h));
  MT_OK(mr_http_get(u2, "/routing", 1024, 2000, &status, &body, &len, &e), &e);
  MT_CONTAINS(body, "t_up 7");
  mr_free(body);
  snprintf(u2, sizeof u2, "%s/nothing", url);
  MT_OK(mr_http_get(u2, "/routing", 1024, 2000, &status, &body, &len, &e), &e);
  MT_EQ_INT(status, 404);
  mr_free(body);
  /* A body over the limit, a bad URL, nobody listening. */
  snprintf(u2, sizeof u2, "%s/big", url);
  MT_EQ_INT(mr_http_get(u2, NULL, 1000, 2000, &status, &body, &len, &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "1000 bytes");
  MT_TRUE(body == NULL);
  MT_OK(mr_http_get(u2, NULL, 10000, 2000, &status, &body, &len, &e), &e);
  MT_EQ_U64(len, 10000);
  mr_free(body);
  MT_EQ_INT(mr_http_get("https://127.0.0.1:1/x", NULL, 10, 100, &status, &body, &len, &e), MR_EINVAL);
  MT_EQ_INT(mr_http_get("http://nocolon/x", NULL, 10, 100, &status, &body, &len, &e), MR_EINVAL);
  MT_EQ_INT(mr_http_get("http://127.0.0.1:9/a b", NULL, 10, 100, &status, &body, &len, &e), MR_EINVAL);
  mr_http_server_free(h);
  MT_EQ_INT(mr_http_get(url, "/routing", 10, 500, &status, &body, &len, &e), MR_EUNAVAIL);
  MT_CONTAINS(e.msg, url + 7);
  /* A peer that accepts and never answers: the timeout. */
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  MT_EQ_INT(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
  MT_EQ_INT(listen(lfd, 4), 0);
  socklen_t sl = sizeof a;
  getsockname(lfd, (struct sockaddr *)&a, &sl);
  snprintf(u2, sizeof u2, "http://127.0.0.1:%d/routing", ntohs(a.sin_port));
  uint64_t t0 = mr_now_ns();
  MT_EQ_INT(mr_http_get(u2, NULL, 10, 300, &status, &body, &len, &e), MR_ETIMEDOUT);
  MT_TRUE((mr_now_ns() - t0) / 1000000u < 2000);
  close(lfd);
}

MT_TEST(responder_bad_address) {
  mr_http_server *h;
  mr_err e;
  MT_EQ_INT(mr_http_server_new(&h, "nocolon", "--metrics-listen", "/metrics", render, NULL, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "--metrics-listen");
  MT_EQ_INT(mr_http_server_new(&h, "127.0.0.1:99999", "--metrics-listen", "/metrics", render, NULL, &e),
            MR_EINVAL);
  MT_OK(mr_http_server_new(&h, "127.0.0.1:0", "--metrics-listen", "/metrics", render, NULL, &e), &e);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", mr_http_server_port(h));
  mr_http_server *h2;
  MT_EQ_INT(mr_http_server_new(&h2, addr, "--metrics-listen", "/metrics", render, NULL, &e), MR_EUNAVAIL);
  MT_CONTAINS(e.msg, addr);
  mr_http_server_free(h);
}

MT_MAIN()
