/*
 * common/idset.c - sets of small ids (layers, experts) parsed from "all", "" or
 * "0-7,12,20-23" and printed back in the same canonical form.
 *
 * Grammar (spaces around tokens are allowed):
 *   spec  := "all" | "" | item ("," item)*
 *   item  := id | id "-" id          inclusive range, first <= last
 *   id    := [0-9]+                   < limit
 */
#include "common/internal.h"

#include <stdio.h>
#include <string.h>

int mr_idset_init(mr_idset *s, uint32_t limit) {
  size_t words = ((size_t)limit + 63) / 64;
  s->limit = limit;
  /* At least one word so that bits is never NULL for a valid set. */
  s->bits = mr_calloc(words ? words : 1, sizeof *s->bits);
  if (!s->bits) {
    s->limit = 0;
    return MR_ENOMEM;
  }
  return 0;
}

void mr_idset_close(mr_idset *s) {
  if (!s) return;
  mr_free(s->bits);
  s->bits = NULL;
  s->limit = 0;
}

void mr_idset_add(mr_idset *s, uint32_t id) {
  MR_ASSERT(id < s->limit);
  s->bits[id >> 6] |= (uint64_t)1 << (id & 63);
}

uint32_t mr_idset_count(const mr_idset *s) {
  uint32_t n = 0;
  size_t words = ((size_t)s->limit + 63) / 64;
  for (size_t i = 0; i < words; i++) n += (uint32_t)__builtin_popcountll(s->bits[i]);
  return n;
}

static bool idset_space(char c) { return c == ' ' || c == '\t'; }

/* Parses a decimal id at *p (after skipping spaces); advances *p past it. Returns false if
 * there are no digits or the value exceeds UINT32_MAX. */
static bool idset_number(const char **p, uint64_t *out) {
  const char *s = *p;
  while (idset_space(*s)) s++;
  if (*s < '0' || *s > '9') return false;
  uint64_t v = 0;
  while (*s >= '0' && *s <= '9') {
    v = v * 10 + (uint64_t)(*s - '0');
    if (v > UINT32_MAX) return false;
    s++;
  }
  while (idset_space(*s)) s++;
  *p = s;
  *out = v;
  return true;
}

int mr_idset_parse(mr_idset *s, const char *spec, uint32_t limit, const char *what, mr_err *e) {
  s->bits = NULL;
  s->limit = 0;
  if (!what) what = "id set";
  if (!spec) spec = "";
  int rc = mr_idset_init(s, limit);
  if (rc) return mr_err_set(e, rc, "%s: out of memory for %u ids", what, limit);

  const char *p = spec;
  while (idset_space(*p)) p++;
  if (*p == '\0') return 0; /* the empty set */
  if (strncmp(p, "all", 3) == 0) {
    const char *q = p + 3;
    while (idset_space(*q)) q++;
    if (*q == '\0') {
      for (uint32_t i = 0; i < limit; i++) mr_idset_add(s, i);
      return 0;
    }
  }
  for (;;) {
    const char *tok = p;
    /* The token's text for messages: up to the next comma. */
    size_t toklen = strcspn(tok, ",");
    uint64_t a, b;
    const char *q = p;
    if (!idset_number(&q, &a)) goto bad_token;
    b = a;
    if (*q == '-') {
      q++;
      if (!idset_number(&q, &b)) goto bad_token;
    }
    if (*q != ',' && *q != '\0') goto bad_token;
    if (a > b) {
      rc = mr_err_set(e, MR_EINVAL, "%s: range \"%.*s\" is reversed (%llu > %llu)", what,
                      (int)(toklen > 64 ? 64 : toklen), tok, (unsigned long long)a,
                      (unsigned long long)b);
      goto out_close;
    }
    if (b >= limit) {
      rc = mr_err_set(e, MR_ERANGE, "%s: id %llu in \"%.*s\" is out of range, ids must be < %u",
                      what, (unsigned long long)b, (int)(toklen > 64 ? 64 : toklen), tok, limit);
      goto out_close;
    }
    for (uint64_t i = a; i <= b; i++) mr_idset_add(s, (uint32_t)i);
    if (*q == '\0') return 0;
    p = q + 1; /* past the comma; an empty token after it is an error */
    continue;
  bad_token:
    rc = mr_err_set(e, MR_EINVAL,
                    "%s: bad token \"%.*s\" in \"%.128s\", expected an id, a range \"a-b\" or "
                    "\"all\" (ids < %u)",
                    what, (int)(toklen > 64 ? 64 : toklen), tok, spec, limit);
    goto out_close;
  }
out_close:
  mr_idset_close(s);
  return rc;
}

void mr_idlist_init(mr_idlist *w, char *buf, size_t len) {
  w->buf = buf;
  w->len = buf ? len : 0;
  w->need = 0;
  w->first = w->last = 0;
  w->open = false;
  if (w->len) buf[0] = '\0';
}

/* Appends the pending run as one item; copies it only if the whole item fits (the text is
 * cut at an item, never inside one), counting its length either way. */
static void idlist_flush(mr_idlist *w) {
  if (!w->open) return;
  char item[32];
  const char *sep = w->need ? "," : "";
  int n = w->last > w->first ? snprintf(item, sizeof item, "%s%u-%u", sep, w->first, w->last)
                             : snprintf(item, sizeof item, "%s%u", sep, w->first);
  if (w->need + (size_t)n < w->len) memcpy(w->buf + w->need, item, (size_t)n + 1);
  w->need += (size_t)n;
  w->open = false;
}

void mr_idlist_add(mr_idlist *w, uint32_t id) {
  if (w->open && w->last != UINT32_MAX && id == w->last + 1) {
    w->last = id;
    return;
  }
  idlist_flush(w);
  w->first = w->last = id;
  w->open = true;
}

size_t mr_idlist_end(mr_idlist *w, bool ellipsis) {
  idlist_flush(w);
  if (ellipsis && w->need >= w->len && w->len > 4) {
    size_t pos = strlen(w->buf);
    if (pos > w->len - 4) pos = w->len - 4;
    memcpy(w->buf + pos, "...", 4);
  }
  return w->need;
}

void mr_idlist_add_set(mr_idlist *w, const mr_idset *s) {
  for (uint32_t i = 0; i < s->limit; i++)
    if (mr_idset_has(s, i)) mr_idlist_add(w, i);
}

size_t mr_idset_format(const mr_idset *s, char *buf, size_t len) {
  mr_idlist w;
  mr_idlist_init(&w, buf, len);
  mr_idlist_add_set(&w, s);
  return mr_idlist_end(&w, false);
}
