/*
 * common/secret.c - bearer tokens read from files and compared in constant time, and the
 * escaping of untrusted text for log lines (mr.h).
 */
#include "common/internal.h"

#include <stdio.h>
#include <string.h>

/* A token file may hold the token, a newline and nothing else; anything much bigger than
 * that is not a token file, and is refused before it is read whole. */
#define SECRET_FILE_MAX_BYTES ((size_t)MR_SECRET_MAX_BYTES + 2)
/* The fixed length mr_secret_equal always walks: a token plus "Bearer " and some room. */
#define SECRET_CMP_BYTES ((size_t)MR_SECRET_MAX_BYTES + 16)

void mr_secret_wipe(void *p, size_t n) {
  volatile unsigned char *v = p;
  while (n--) *v++ = 0;
}

int mr_secret_read(const char *path, const char *what, char *buf, size_t cap, size_t *len,
                   mr_err *e) {
  MR_ASSERT(buf && cap >= (size_t)MR_SECRET_MAX_BYTES + 1 && len);
  char *text = NULL;
  size_t n = 0;
  int rc;
  buf[0] = '\0';
  *len = 0;
  mr_err fe;
  mr_err_clear(&fe);
  rc = mr_file_read_private(path, SECRET_FILE_MAX_BYTES, &text, &n, &fe);
  if (rc == MR_ERANGE)
    return mr_err_set(e, MR_ERANGE, "%s %s: the file is larger than a token of at most %d bytes "
                      "and one newline", what, path, MR_SECRET_MAX_BYTES);
  if (rc) return mr_err_set(e, rc, "%s: %s", what, fe.msg);
  if (n > 0 && text[n - 1] == '\n') n--;
  if (n > 0 && text[n - 1] == '\r') n--;
  if (n == 0) {
    rc = mr_err_set(e, MR_EINVAL, "%s %s: the token is empty (the file must hold a token of "
                    "1..%d printable bytes)", what, path, MR_SECRET_MAX_BYTES);
    goto out_wipe;
  }
  if (n > MR_SECRET_MAX_BYTES) {
    rc = mr_err_set(e, MR_ERANGE, "%s %s: the token is %zu bytes, at most %d", what, path, n,
                    MR_SECRET_MAX_BYTES);
    goto out_wipe;
  }
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)text[i];
    if (c < 0x21 || c > 0x7e) {
      /* The position and the byte value, never the token around it. */
      rc = mr_err_set(e, MR_EINVAL, "%s %s: byte %zu of the token is 0x%02x; a token must be "
                      "printable ASCII 0x21..0x7e (no spaces, at most one trailing newline)",
                      what, path, i, c);
      goto out_wipe;
    }
  }
  memcpy(buf, text, n);
  buf[n] = '\0';
  *len = n;
out_wipe:
  mr_secret_wipe(text, n);
  mr_free(text);
  return rc;
}

bool mr_secret_equal(const char *a, size_t alen, const char *b, size_t blen) {
  unsigned diff = (alen != blen) | (alen > SECRET_CMP_BYTES) | (blen > SECRET_CMP_BYTES);
  /* Always SECRET_CMP_BYTES rounds, whatever the lengths and wherever the first difference. */
  for (size_t i = 0; i < SECRET_CMP_BYTES; i++) {
    unsigned char x = i < alen ? (unsigned char)a[i] : 0;
    unsigned char y = i < blen ? (unsigned char)b[i] : 0;
    diff |= (unsigned)(x ^ y);
  }
  return diff == 0;
}

/* ---- log escaping ------------------------------------------------------------------------ */

/* Length of the valid UTF-8 sequence at s[0..n) (2..4), or 0 if s[0] does not start one.
 * Overlong forms, surrogates and code points above U+10FFFF are invalid (RFC 3629). */
static size_t utf8_seq(const unsigned char *s, size_t n) {
  unsigned char c = s[0];
  size_t len;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) len = 2;
  else if (c == 0xe0) { len = 3; lo = 0xa0; }
  else if (c >= 0xe1 && c <= 0xef) { len = 3; if (c == 0xed) hi = 0x9f; }
  else if (c == 0xf0) { len = 4; lo = 0x90; }
  else if (c >= 0xf1 && c <= 0xf3) len = 4;
  else if (c == 0xf4) { len = 4; hi = 0x8f; }
  else return 0;
  if (n < len) return 0;
  if (s[1] < lo || s[1] > hi) return 0;
  for (size_t k = 2; k < len; k++)
    if (s[k] < 0x80 || s[k] > 0xbf) return 0;
  return len;
}

/* The output of the input unit at s[0..n): written into out (at most 4 bytes), its length
 * returned, *used set to the input bytes it covers. */
static size_t esc_unit(const unsigned char *s, size_t n, char out[4], size_t *used) {
  static const char hex[] = "0123456789abcdef";
  unsigned char c = s[0];
  *used = 1;
  switch (c) {
  case '\n': memcpy(out, "\\n", 2); return 2;
  case '\r': memcpy(out, "\\r", 2); return 2;
  case '\t': memcpy(out, "\\t", 2); return 2;
  case '\\': memcpy(out, "\\\\", 2); return 2;
  default: break;
  }
  if (c >= 0x20 && c < 0x7f) {
    out[0] = (char)c;
    return 1;
  }
  if (c >= 0x80) {
    size_t k = utf8_seq(s, n);
    if (k) {
      memcpy(out, s, k);
      *used = k;
      return k;
    }
  }
  out[0] = '\\';
  out[1] = 'x';
  out[2] = hex[c >> 4];
  out[3] = hex[c & 15];
  return 4;
}

size_t mr_log_escape(char *dst, size_t cap, const char *src, size_t srclen) {
  const unsigned char *s = (const unsigned char *)(src ? src : "");
  if (!src) srclen = 0;
  if (cap == 0) return 0;
  char u[4];
  size_t used, total = 0;
  /* First pass: does the whole text fit? Then nothing is cut and no "..." is needed. */
  for (size_t i = 0; i < srclen; i += used) total += esc_unit(s + i, srclen - i, u, &used);
  size_t limit = total <= cap - 1 ? cap - 1 : (cap - 1 >= 3 ? cap - 1 - 3 : 0);
  size_t o = 0;
  for (size_t i = 0; i < srclen; i += used) {
    size_t k = esc_unit(s + i, srclen - i, u, &used);
    if (o + k > limit) break; /* whole units only: no half escape, no half UTF-8 character */
    memcpy(dst + o, u, k);
    o += k;
  }
  if (total > cap - 1) {
    const char *dots = "...";
    for (size_t k = 0; k < 3 && o < cap - 1; k++) dst[o++] = dots[k];
  }
  dst[o] = '\0';
  return o;
}
