/*
 * buf.c - mr_buf, the growable text buffer with a sticky out-of-memory flag (mr.h): what the
 * Prometheus writer (metrics.c), the HTTP responder's heads and the JSON documents of
 * /routing and moerpc-stats files are built in. A failed growth sets oom once and every later
 * append is a no-op, so a writer checks one flag at the end instead of every call.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/mr.h"

void mr_buf_init(mr_buf *p) { memset(p, 0, sizeof *p); }

void mr_buf_close(mr_buf *p) {
  mr_free(p->buf);
  memset(p, 0, sizeof *p);
}

void mr_buf_reset(mr_buf *p) {
  p->len = 0;
  p->oom = false;
  if (p->buf) p->buf[0] = '\0';
}

/* Room for n more bytes and the NUL. */
static bool mr__buf_room(mr_buf *p, size_t n) {
  if (p->oom) return false;
  if (p->len + n + 1 <= p->cap) return true;
  size_t cap = p->cap ? p->cap : 4096;
  while (cap < p->len + n + 1) cap *= 2;
  char *b = mr_realloc(p->buf, cap);
  if (!b) {
    p->oom = true;
    return false;
  }
  p->buf = b;
  p->cap = cap;
  return true;
}

void mr_buf_append(mr_buf *p, const char *s, size_t n) {
  if (!mr__buf_room(p, n)) return;
  memcpy(p->buf + p->len, s, n);
  p->len += n;
  p->buf[p->len] = '\0';
}


void mr_buf_printf(mr_buf *p, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char small[256];
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n < sizeof small) {
    mr_buf_append(p, small, (size_t)n);
    return;
  }
  if (!mr__buf_room(p, (size_t)n)) return;
  va_start(ap, fmt);
  vsnprintf(p->buf + p->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  p->len += (size_t)n;
}

void mr_buf_json_str(mr_buf *p, const char *s) {
  mr_buf_append(p, "\"", 1);
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if (*c == '"' || *c == '\\') mr_buf_printf(p, "\\%c", *c);
    else if (*c < 0x20) mr_buf_printf(p, "\\u%04x", *c);
    else mr_buf_append(p, (const char *)c, 1);
  }
  mr_buf_append(p, "\"", 1);
}
