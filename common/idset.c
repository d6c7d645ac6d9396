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

size_t mr_idset_format(const mr_idset *s, char *buf, size_t len) {
  size_t need = 0;
  if (len) buf[0] = '\0';
  uint32_t i = 0;
  while (i < s->limit) {
    if (!mr_idset_has(s, i)) {
      i++;
      continue;
    }
    uint32_t j = i;
    while (j + 1 < s->limit && mr_idset_has(s, j + 1)) j++;
    char item[32];
    int n = j > i ? snprintf(item, sizeof item, "%s%u-%u", need ? "," : "", i, j)
                  : snprintf(item, sizeof item, "%s%u", need ? "," : "", i);
    /* Copy what fits, keep counting what would be needed (snprintf semantics). */
    if (need + (size_t)n < len) memcpy(buf + need, item, (size_t)n + 1);
    else if (need < len) buf[need] = '\0';
    need += (size_t)n;
    i = j + 1;
    if (j == UINT32_MAX) break;
  }
  return need;
}
