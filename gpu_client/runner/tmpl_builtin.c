/*
 * tmpl_builtin.c - the filters, tests, methods and global functions of the chat-template
 * interpreter, each as jinja2 3.1 (filters.py, tests.py) and Python 3 define it, with
 * transformers' own tojson, raise_exception, strftime_now and namespace.
 *
 * Filters that jinja2 writes as generators (map, select, reject, selectattr, rejectattr,
 * items, unique, and reverse of a list) return a generator value here too: always truthy,
 * without a length, used up by the first loop over it. Templates do trip on that
 * (`{% if msgs|selectattr(...) %}` is always true), and so must we.
 */
#include <ctype.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_client/runner/tmpl_internal.h"

static bool eqn(const char *p, size_t n, const char *lit) {
  size_t k = strlen(lit);
  return n == k && memcmp(p, lit, k) == 0;
}

/* ---- case mapping ---------------------------------------------------------------------- */

/* Python's lower_ucs4 for a capital sigma at cps[i]: final (ς) when a cased letter comes
 * before it and none after it, case-ignorable characters skipped both ways. */
static uint32_t sigma(const uint32_t *cps, size_t n, size_t i) {
  size_t j = i;
  while (j > 0 && gc__tmpl_uc_ignorable(cps[j - 1])) j--;
  if (j == 0 || !gc__tmpl_uc_cased(cps[j - 1])) return 0x3c3;
  j = i + 1;
  while (j < n && gc__tmpl_uc_ignorable(cps[j])) j++;
  return j == n || !gc__tmpl_uc_cased(cps[j]) ? 0x3c2 : 0x3c3;
}

/* Appends the mapping of cps[i] ('u', 'l' with the sigma rule, 't') to b at *o. */
static void put_mapped(const uint32_t *cps, size_t n, size_t i, char how, char *b, size_t *o) {
  uint32_t m[3];
  size_t k;
  if (how == 'l' && cps[i] == 0x3a3) {
    m[0] = sigma(cps, n, i);
    k = 1;
  } else {
    k = gc__tmpl_uc_map(cps[i], how, m);
  }
  for (size_t j = 0; j < k; j++) *o += gc__tmpl_u8_put(m[j], b + *o);
}

static bool title_sep(uint32_t c) {
  return c == '-' || gc__tmpl_is_space(c) || c == '(' || c == '{' || c == '[' || c == '<';
}

/* The str methods upper / lower / capitalize / title and jinja2's title filter, each as
 * CPython implements it over Python's Unicode database: full mappings (ß -> SS,
 * ﬁ -> FI, İ -> i̇), title case where Python uses it (capitalize's first character,
 * title's word starts: ǆ -> ǅ), and the final sigma in every lowering. */
int gc__tmpl_case(gc__tmpl_heap *h, gc__tmpl_str s, char how, gc__tmpl_val *out) {
  /* Code points first: the sigma rule looks both ways. A mapping makes at most 3 code
   * points of 4 bytes each out of one code point of at least 1 byte. */
  size_t n = gc__tmpl_u8_count(s.p, s.n);
  if (n > SIZE_MAX / 12 - 1) return mr_err_set(h->e, MR_EEXHAUSTED, "string too long");
  uint32_t *cps = gc__tmpl_alloc(h, (n ? n : 1) * sizeof *cps);
  uint8_t *raw = gc__tmpl_alloc(h, n ? n : 1); /* undecodable bytes stay as they are */
  char *b = gc__tmpl_alloc(h, n * 12 + 1);
  if (!cps || !raw || !b) return h->e->code;
  for (size_t i = 0, k = 0; i < s.n; k++) {
    size_t len = gc__tmpl_u8_next(s.p + i, s.n - i, &cps[k]);
    raw[k] = len == 1 && cps[k] >= 0xdc80 && cps[k] <= 0xdcff;
    i += len;
  }
  size_t o = 0;
  bool prev_cased = false;
  size_t word = 0, end = 0; /* 'T': the current item [word, end) of jinja2's split */
  for (size_t i = 0; i < n; i++) {
    if (raw[i]) {
      b[o++] = (char)(cps[i] - 0xdc00);
      continue;
    }
    switch (how) {
    case 'u': /* str.upper / str.lower: each code point mapped (lower with the sigma rule) */
    case 'l':
      put_mapped(cps, n, i, how, b, &o);
      break;
    case 'c': /* str.capitalize: the first in title case, the rest lower */
      put_mapped(cps, n, i, i == 0 ? 't' : 'l', b, &o);
      break;
    case 't': /* str.title: title case after an uncased character, lower after a cased */
      put_mapped(cps, n, i, prev_cased ? 'l' : 't', b, &o);
      prev_cased = gc__tmpl_uc_cased(cps[i]);
      break;
    default: {
      /* jinja2's title filter: re.split(r"([-\s({\[<]+)") into words and separators,
       * each item[0].upper() + item[1:].lower() (the sigma rule within item[1:]). */
      if (i == 0 || title_sep(cps[i]) != title_sep(cps[i - 1])) {
        word = end = i;
        while (end < n && title_sep(cps[end]) == title_sep(cps[word])) end++;
      }
      if (i == word)
        put_mapped(cps, n, i, 'u', b, &o);
      else
        put_mapped(cps + word + 1, end - word - 1, i - word - 1, 'l', b, &o);
      break;
    }
    }
  }
  b[o] = '\0';
  *out = gc__tmpl_strv(b, o);
  return 0;
}

/* ---- str helpers ---------------------------------------------------------------------- */

static bool in_chars(uint32_t c, const gc__tmpl_str *chars) {
  if (!chars) return gc__tmpl_is_space(c);
  for (size_t i = 0; i < chars->n;) {
    uint32_t d;
    i += gc__tmpl_u8_next(chars->p + i, chars->n - i, &d);
    if (d == c) return true;
  }
  return false;
}

/* str.strip / lstrip / rstrip: chars is a set of code points (NULL: str.isspace). The
 * result is a slice of s, no copy. */
int gc__tmpl_strip(gc__tmpl_heap *h, gc__tmpl_str s, const gc__tmpl_str *chars, bool left,
                   bool right, gc__tmpl_val *out) {
  (void)h;
  size_t a = 0, b = s.n;
  if (left)
    while (a < b) {
      uint32_t c;
      size_t k = gc__tmpl_u8_next(s.p + a, b - a, &c);
      if (!in_chars(c, chars)) break;
      a += k;
    }
  if (right) {
    /* Walk forward, remembering where the last kept character ends. */
    size_t end = a;
    for (size_t i = a; i < b;) {
      uint32_t c;
      size_t k = gc__tmpl_u8_next(s.p + i, b - i, &c);
      i += k;
      if (!in_chars(c, chars)) end = i;
    }
    b = end;
  }
  *out = gc__tmpl_strv(s.p + a, b - a);
  return 0;
}

static const char *memfind(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn == 0) return h;
  if (nn > hn) return NULL;
  for (size_t i = 0; i + nn <= hn;) {
    const char *p = memchr(h + i, nd[0], hn - nn + 1 - i);
    if (!p) return NULL;
    if (memcmp(p, nd, nn) == 0) return p;
    i = (size_t)(p - h) + 1;
  }
  return NULL;
}

static const char *memrfind(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn > hn) return NULL;
  for (size_t i = hn - nn + 1; i-- > 0;)
    if (memcmp(h + i, nd, nn) == 0) return h + i;
  return NULL;
}

/* str.replace(old, new, count): count < 0 replaces all; non-overlapping, left to right;
 * an empty old inserts new before every character and at the end. */
int gc__tmpl_replace(gc__tmpl_heap *h, gc__tmpl_str s, gc__tmpl_str old, gc__tmpl_str nw,
                     int64_t count, gc__tmpl_val *out) {
  gc__tmpl_sb b;
  gc__tmpl_sb_init(&b, h->limit, "memory", h->e);
  int rc = 0;
  int64_t done = 0;
  if (old.n == 0) {
    /* "abc".replace("", "-") is "-a-b-c-": new before every character and at the end. */
    size_t i = 0;
    while (!rc && (count < 0 || done < count)) {
      rc = gc__tmpl_sb_put(&b, nw.p, nw.n);
      done++;
      if (i >= s.n) break;
      uint32_t c;
      size_t k = gc__tmpl_u8_next(s.p + i, s.n - i, &c);
      if (!rc) rc = gc__tmpl_sb_put(&b, s.p + i, k);
      i += k;
    }
    if (!rc && i < s.n) rc = gc__tmpl_sb_put(&b, s.p + i, s.n - i);
  } else {
    size_t i = 0;
    while (!rc) {
      const char *p = (count < 0 || done < count) ? memfind(s.p + i, s.n - i, old.p, old.n) : NULL;
      if (!p) {
        rc = gc__tmpl_sb_put(&b, s.p + i, s.n - i);
        break;
      }
      size_t at = (size_t)(p - s.p);
      rc = gc__tmpl_sb_put(&b, s.p + i, at - i);
      if (!rc) rc = gc__tmpl_sb_put(&b, nw.p, nw.n);
      i = at + old.n;
      done++;
    }
  }
  return gc__tmpl_sb_take(h, &b, rc, out);
}

/* Python's str.splitlines line boundaries: the length of the one at s[i], or 0. "\r\n"
 * is one boundary of two bytes; the others are single code points. */
static size_t line_break_at(gc__tmpl_str s, size_t i) {
  uint32_t c;
  size_t k = gc__tmpl_u8_next(s.p + i, s.n - i, &c);
  if (c == '\r') return i + 1 < s.n && s.p[i + 1] == '\n' ? 2 : 1;
  if (c == '\n' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e || c == 0x85 ||
      c == 0x2028 || c == 0x2029)
    return k;
  return 0;
}

/* str.splitlines(keepends) as a list of slices of s: two passes, one to count the lines
 * and one to fill the list, so the list is allocated once. A final line without a
 * break counts; an empty string has no lines. */
static int splitlines(gc__tmpl_heap *h, gc__tmpl_str s, bool keepends, gc__tmpl_val *out) {
  size_t n = 0;
  for (size_t pass = 0; pass < 2; pass++) {
    size_t start = 0, k = 0;
    for (size_t i = 0; i < s.n;) {
      size_t br = line_break_at(s, i);
      if (br) {
        if (pass) out->u.l->v[k] = gc__tmpl_strv(s.p + start, (keepends ? i + br : i) - start);
        k++;
        i += br;
        start = i;
      } else {
        uint32_t c;
        i += gc__tmpl_u8_next(s.p + i, s.n - i, &c);
      }
    }
    if (start < s.n) {
      if (pass) out->u.l->v[k] = gc__tmpl_strv(s.p + start, s.n - start);
      k++;
    }
    if (!pass) {
      n = k;
      int rc = gc__tmpl_list_new(h, n, GC__TL_LIST, out);
      if (rc) return rc;
    }
  }
  return 0;
}

/* str.split / str.rsplit. With sep: exact splits, empty pieces kept, at most maxsplit
 * of them (from the right for rsplit). Without: runs of whitespace separate, leading and
 * trailing whitespace makes no empty pieces, and once maxsplit pieces are cut the rest
 * is one piece with its leading (rsplit: trailing) whitespace removed. Pieces are
 * slices of s. */
static int split(gc__tmpl_heap *h, gc__tmpl_str s, const gc__tmpl_str *sep, int64_t maxsplit,
                 bool from_right, gc__tmpl_val *out) {
  gc__tmpl_str parts_local[16];
  gc__tmpl_str *parts = parts_local;
  size_t np = 0, cap = 16;
  int rc = 0;
#define PUSH(P, N)                                                                     \
  do {                                                                                 \
    if (np == cap) {                                                                   \
      gc__tmpl_str *g = gc__tmpl_alloc(h, cap * 2 * sizeof *g);                        \
      if (!g) return h->e->code;                                                       \
      memcpy(g, parts, np * sizeof *g);                                                \
      parts = g, cap *= 2;                                                             \
    }                                                                                  \
    parts[np++] = (gc__tmpl_str){(P), (N)};                                            \
  } while (0)
  if (sep) {
    if (!from_right) {
      size_t i = 0;
      for (;;) {
        const char *p = (maxsplit < 0 || (int64_t)np < maxsplit)
                            ? memfind(s.p + i, s.n - i, sep->p, sep->n) : NULL;
        if (!p) {
          PUSH(s.p + i, s.n - i);
          break;
        }
        PUSH(s.p + i, (size_t)(p - s.p) - i);
        i = (size_t)(p - s.p) + sep->n;
      }
    } else {
      size_t end = s.n;
      for (;;) {
        const char *p = (maxsplit < 0 || (int64_t)np < maxsplit)
                            ? memrfind(s.p, end, sep->p, sep->n) : NULL;
        if (!p) {
          PUSH(s.p, end);
          break;
        }
        size_t at = (size_t)(p - s.p);
        PUSH(s.p + at + sep->n, end - at - sep->n);
        end = at;
      }
    }
  } else if (!from_right) {
    size_t i = 0;
    for (;;) {
      /* skip whitespace, then take a word */
      while (i < s.n) {
        uint32_t c;
        size_t k = gc__tmpl_u8_next(s.p + i, s.n - i, &c);
        if (!gc__tmpl_is_space(c)) break;
        i += k;
      }
      if (i >= s.n) break;
      if (maxsplit >= 0 && (int64_t)np >= maxsplit) {
        PUSH(s.p + i, s.n - i);
        break;
      }
      size_t a = i;
      while (i < s.n) {
        uint32_t c;
        size_t k = gc__tmpl_u8_next(s.p + i, s.n - i, &c);
        if (gc__tmpl_is_space(c)) break;
        i += k;
      }
      PUSH(s.p + a, i - a);
    }
  } else {
    /* rsplit on whitespace: the same from the right, over code point boundaries. */
    size_t *offs = gc__tmpl_alloc(h, (s.n + 1) * sizeof *offs);
    if (!offs) return h->e->code;
    size_t nc = 0;
    for (size_t i = 0; i < s.n;) {
      uint32_t c;
      offs[nc++] = i;
      i += gc__tmpl_u8_next(s.p + i, s.n - i, &c);
    }
    offs[nc] = s.n;
#define SPACE_AT(j) (__extension__({ uint32_t c_; gc__tmpl_u8_next(s.p + offs[j], s.n - offs[j], &c_); gc__tmpl_is_space(c_); }))
    size_t j = nc;
    for (;;) {
      while (j > 0 && SPACE_AT(j - 1)) j--;
      if (j == 0) break;
      if (maxsplit >= 0 && (int64_t)np >= maxsplit) {
        PUSH(s.p, offs[j]);
        break;
      }
      size_t b = j;
      while (j > 0 && !SPACE_AT(j - 1)) j--;
      PUSH(s.p + offs[j], offs[b] - offs[j]);
    }
#undef SPACE_AT
  }
#undef PUSH
  if ((rc = gc__tmpl_list_new(h, np, GC__TL_LIST, out))) return rc;
  for (size_t k = 0; k < np; k++) {
    size_t src = from_right ? np - 1 - k : k;
    out->u.l->v[k] = gc__tmpl_strv(parts[src].p, parts[src].n);
  }
  return 0;
}

/* ---- arguments ---------------------------------------------------------------------- */

/* Filters and methods take Python's arguments: positional ones in order, keywords by the
 * parameter names of jinja2's functions. These helpers give the two ways one lookup and
 * reject what Python would reject (too many, unknown keyword, a value given twice). */

/* The argument at position pos or named name (NULL if neither was given). Fails on an
 * argument given both ways. */
static int arg(gc__tmpl_rt *rt, const gc__tmpl_node *n, gc__tmpl_args *a, size_t pos,
               const char *name, const gc__tmpl_val **out) {
  *out = pos < a->npos ? &a->pos[pos] : NULL;
  for (size_t k = 0; k < a->nkw; k++)
    if (eqn(a->kw[k].p, a->kw[k].n, name)) {
      if (*out)
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "got multiple values for argument '%s'", name);
      *out = &a->kwv[k];
    }
  return 0;
}

/* Fails if more than npos positional arguments, or a keyword not in names, was given. */
static int check_args(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_args *a,
                      const char *what, size_t npos, const char *const *names) {
  if (a->npos > npos)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s takes at most %zu argument%s (%zu given)", what,
                            npos, npos == 1 ? "" : "s", a->npos);
  for (size_t k = 0; k < a->nkw; k++) {
    bool ok = false;
    for (const char *const *p = names; p && *p && !ok; p++) ok = eqn(a->kw[k].p, a->kw[k].n, *p);
    if (!ok)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s got an unexpected keyword argument '%.*s'", what,
                              (int)a->kw[k].n, a->kw[k].p);
  }
  return 0;
}

/* Python accepts a bool wherever an int is asked for (True is 1). */
static bool is_intish(const gc__tmpl_val *v) { return v && (v->kind == GC__TV_INT || v->kind == GC__TV_BOOL); }
static int64_t intval(const gc__tmpl_val *v) { return v->kind == GC__TV_BOOL ? v->u.b : v->u.i; }

/* A str argument where Python's method takes only str (no str() conversion): "sep must
 * be str, not int"; an undefined one is jinja2's UndefinedError. */
static int need_str(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v, const char *what) {
  if (v->kind == GC__TV_STR) return 0;
  if (v->kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, v);
  return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s must be str, not %s", what, gc__tmpl_type_name(v));
}

/* soft_str / str(): any value's text (undefined is ""), located at n on failure (a
 * generator has no text). */
static int str_of(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v, gc__tmpl_str *out) {
  gc__tmpl_val s;
  int rc = gc__tmpl_to_str(gc__tmpl_rt_heap(rt), v, &s);
  if (rc) return gc__tmpl_rt_locate(rt, n, rc);
  *out = s.u.s;
  return 0;
}

/* A generator over count items (copied): the form of every lazy filter's result. */
static int make_gen(gc__tmpl_rt *rt, const gc__tmpl_val *items, size_t count, gc__tmpl_val *out) {
  int rc = gc__tmpl_list_new(gc__tmpl_rt_heap(rt), count, GC__TL_GEN, out);
  if (!rc && count) memcpy(out->u.l->v, items, count * sizeof *items);
  return rc;
}

/* jinja2's make_attrgetter: "a.b.0" looks up a, then b, then item 0, each step with
 * environment.getitem (so a missing step is undefined, not an error); an int attribute
 * is one item lookup; none means the item itself. */
static int attr_get(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *attr,
                    const gc__tmpl_val *item, gc__tmpl_val *out) {
  *out = *item;
  if (!attr || attr->kind == GC__TV_NONE) return 0;
  if (is_intish(attr)) return gc__tmpl_getitem(rt, n, item, attr, out);
  if (attr->kind != GC__TV_STR)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "attribute must be a str or an int, not %s",
                            gc__tmpl_type_name(attr));
  const char *p = attr->u.s.p, *end = p + attr->u.s.n;
  while (p <= end) {
    const char *dot = memchr(p, '.', (size_t)(end - p));
    size_t len = dot ? (size_t)(dot - p) : (size_t)(end - p);
    gc__tmpl_val key = gc__tmpl_strv(p, len), cur = *out;
    bool digits = len > 0;
    for (size_t i = 0; i < len; i++) digits = digits && p[i] >= '0' && p[i] <= '9';
    if (digits && len < 18) key = gc__tmpl_int(strtoll(p, NULL, 10));
    int rc = gc__tmpl_getitem(rt, n, &cur, &key, out);
    if (rc) return rc;
    if (!dot) break;
    p = dot + 1;
  }
  return 0;
}

/* ---- tests --------------------------------------------------------------------------- */

static bool str_is_case(gc__tmpl_str s, bool upper) {
  /* str.islower / isupper: some cased character, and none of the other case (a character
   * of the other case is one whose mapping to this case changes it). */
  bool cased = false;
  for (size_t i = 0; i < s.n;) {
    uint32_t c, m[3];
    i += gc__tmpl_u8_next(s.p + i, s.n - i, &c);
    if (!gc__tmpl_uc_cased(c)) continue;
    if (gc__tmpl_uc_map(c, upper ? 'u' : 'l', m) != 1 || m[0] != c) return false;
    cased = true;
  }
  return cased;
}

/* jinja2's tests (tests.py). The type tests follow Python's isinstance: a bool is a
 * number but not an integer; a dict is a sequence (it has len and __getitem__) and so
 * is an undefined value; a namespace is not a mapping. */
int gc__tmpl_call_test(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn, const gc__tmpl_val *v,
                       gc__tmpl_args *args, bool *out) {
  const gc__tmpl_val *x = NULL;
  int rc;
  uint8_t k = v->kind;
  bool one_arg = fn == GC__TT_SAMEAS || fn == GC__TT_IN || fn == GC__TT_DIVISIBLEBY ||
                 (fn >= GC__TT_EQ && fn <= GC__TT_LE);
  if ((rc = check_args(rt, n, args, gc__tmpl_test_name(fn), one_arg ? 1 : 0, NULL))) return rc;
  if (one_arg) {
    if (args->npos < 1)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "test '%s' needs an argument", gc__tmpl_test_name(fn));
    x = &args->pos[0];
  }
  switch (fn) {
  case GC__TT_DEFINED: *out = k != GC__TV_UNDEF; return 0;
  case GC__TT_UNDEFINED: *out = k == GC__TV_UNDEF; return 0;
  case GC__TT_NONE: *out = k == GC__TV_NONE; return 0;
  case GC__TT_BOOLEAN: *out = k == GC__TV_BOOL; return 0;
  case GC__TT_FALSE: *out = k == GC__TV_BOOL && !v->u.b; return 0;
  case GC__TT_TRUE: *out = k == GC__TV_BOOL && v->u.b; return 0;
  case GC__TT_INTEGER: *out = k == GC__TV_INT; return 0;
  case GC__TT_FLOAT: *out = k == GC__TV_FLOAT; return 0;
  case GC__TT_NUMBER: *out = k == GC__TV_INT || k == GC__TV_FLOAT || k == GC__TV_BOOL; return 0;
  case GC__TT_STRING: *out = k == GC__TV_STR; return 0;
  case GC__TT_MAPPING: *out = k == GC__TV_DICT; return 0;
  case GC__TT_ITERABLE:
    *out = k == GC__TV_UNDEF || k == GC__TV_STR || k == GC__TV_LIST || k == GC__TV_DICT ||
           k == GC__TV_LOOP;
    return 0;
  case GC__TT_SEQUENCE: /* has len() and __getitem__ */
    *out = k == GC__TV_UNDEF || k == GC__TV_STR || k == GC__TV_DICT ||
           (k == GC__TV_LIST && (v->u.l->flavour == GC__TL_LIST || v->u.l->flavour == GC__TL_TUPLE ||
                                 v->u.l->flavour == GC__TL_RANGE));
    return 0;
  case GC__TT_CALLABLE: /* Undefined has __call__ (it fails, but callable() is true) */
    *out = k == GC__TV_MACRO || k == GC__TV_FUNC || k == GC__TV_METHOD || k == GC__TV_LOOP ||
           k == GC__TV_UNDEF;
    return 0;
  case GC__TT_ESCAPED: *out = k == GC__TV_STR && (v->flags & GC__TVF_SAFE); return 0;
  case GC__TT_SAMEAS: /* `is`: identity, which only singletons and containers have here */
    /* Identity: singletons and CPython's cached small ints; containers by address. */
    if (k != x->kind) *out = false;
    else if (k == GC__TV_NONE || k == GC__TV_UNDEF) *out = k == GC__TV_NONE;
    else if (k == GC__TV_BOOL) *out = v->u.b == x->u.b;
    else if (k == GC__TV_INT) *out = v->u.i == x->u.i && v->u.i >= -5 && v->u.i <= 256;
    else if (k == GC__TV_LIST) *out = v->u.l == x->u.l;
    else if (k == GC__TV_DICT || k == GC__TV_NS) *out = v->u.d == x->u.d;
    else *out = false;
    return 0;
  case GC__TT_IN:
    return gc__tmpl_contains(rt, n, x, v, out);
  case GC__TT_EQ: *out = gc__tmpl_eq(v, x); return 0;
  case GC__TT_NE: *out = !gc__tmpl_eq(v, x); return 0;
  case GC__TT_GT:
  case GC__TT_GE:
  case GC__TT_LT:
  case GC__TT_LE: {
    static const char *const ops[] = {">", ">=", "<", "<="};
    if (k == GC__TV_UNDEF || x->kind == GC__TV_UNDEF)
      return gc__tmpl_rt_undef(rt, n, k == GC__TV_UNDEF ? v : x);
    int c;
    if ((rc = gc__tmpl_cmp(gc__tmpl_rt_heap(rt)->e, v, x, ops[fn - GC__TT_GT], &c)))
      return gc__tmpl_rt_locate(rt, n, rc);
    *out = fn == GC__TT_GT ? c == 1 : fn == GC__TT_GE ? (c == 1 || c == 0)
           : fn == GC__TT_LT ? c == -1 : (c == -1 || c == 0);
    return 0;
  }
  case GC__TT_ODD: /* value % 2 == 1 with Python's %, so 3.0 is odd and -3 too */
  case GC__TT_EVEN:
  case GC__TT_DIVISIBLEBY: {
    /* value % 2 == 1 (or 0, or value % num == 0), with Python's % on ints and floats. */
    const gc__tmpl_val *d = fn == GC__TT_DIVISIBLEBY ? x : NULL;
    bool num = k == GC__TV_INT || k == GC__TV_BOOL || k == GC__TV_FLOAT;
    bool dnum = !d || d->kind == GC__TV_INT || d->kind == GC__TV_BOOL || d->kind == GC__TV_FLOAT;
    if (k == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, v);
    if (!num || !dnum)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "test '%s' needs numbers, got '%s'",
                              gc__tmpl_test_name(fn), gc__tmpl_type_name(d && num ? d : v));
    if (k != GC__TV_FLOAT && (!d || d->kind != GC__TV_FLOAT)) {
      int64_t a = intval(v), b = d ? intval(d) : 2;
      if (b == 0) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "integer modulo by zero");
      int64_t m = (b == -1) ? 0 : a % b;
      if (m != 0 && ((m < 0) != (b < 0))) m += b;
      *out = fn == GC__TT_ODD ? m == 1 : m == 0;
      return 0;
    }
    double a = k == GC__TV_FLOAT ? v->u.f : (double)intval(v);
    double b = !d ? 2.0 : d->kind == GC__TV_FLOAT ? d->u.f : (double)intval(d);
    if (b == 0.0) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "float modulo by zero");
    double m = fmod(a, b);
    if (m != 0.0 && ((b < 0) != (m < 0))) m += b;
    *out = fn == GC__TT_ODD ? m == 1.0 : m == 0.0;
    return 0;
  }
  case GC__TT_LOWER:
  case GC__TT_UPPER: {
    gc__tmpl_str s = {"", 0};
    if ((rc = str_of(rt, n, v, &s))) return rc;
    *out = str_is_case(s, fn == GC__TT_UPPER);
    return 0;
  }
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINTERNAL, "unknown test %u", fn);
  }
}

/* ---- filters ------------------------------------------------------------------------ */

/* len(): code points of a str, items of a list flavour or dict, 0 for undefined
 * (Undefined.__len__); a generator has no len() (TypeError), which templates hit with
 * x|selectattr(...)|length. */
static int f_len(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v, int64_t *len) {
  switch (v->kind) {
  case GC__TV_UNDEF: *len = 0; return 0;
  case GC__TV_STR: *len = (int64_t)gc__tmpl_u8_count(v->u.s.p, v->u.s.n); return 0;
  case GC__TV_DICT: *len = (int64_t)v->u.d->n; return 0;
  case GC__TV_LOOP: *len = (int64_t)v->u.loop->n; return 0;
  case GC__TV_LIST:
    if (v->u.l->flavour != GC__TL_GEN) {
      *len = (int64_t)v->u.l->n;
      return 0;
    }
    __attribute__((fallthrough)); /* generators have no len() */
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "object of type '%s' has no len()",
                            gc__tmpl_type_name(v));
  }
}

/* The sort key of an item: its attribute (a comma list makes a tuple, so that
 * sort(attribute="age,name") orders by age then name), lower-cased if strings compare
 * without case (jinja2's ignore_case applies to str keys only). */
static int sort_key(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *attr,
                    bool case_sensitive, const gc__tmpl_val *item, gc__tmpl_val *key) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  if (attr && attr->kind == GC__TV_STR && memchr(attr->u.s.p, ',', attr->u.s.n)) {
    size_t parts = 1;
    for (size_t i = 0; i < attr->u.s.n; i++) parts += attr->u.s.p[i] == ',';
    if ((rc = gc__tmpl_list_new(h, parts, GC__TL_TUPLE, key))) return rc;
    const char *p = attr->u.s.p, *end = p + attr->u.s.n;
    for (size_t k = 0; k < parts; k++) {
      const char *c = memchr(p, ',', (size_t)(end - p));
      gc__tmpl_val one = gc__tmpl_strv(p, c ? (size_t)(c - p) : (size_t)(end - p));
      if ((rc = sort_key(rt, n, &one, case_sensitive, item, &key->u.l->v[k]))) return rc;
      p = c ? c + 1 : end;
    }
    return 0;
  }
  if ((rc = attr_get(rt, n, attr, item, key))) return rc;
  if (!case_sensitive && key->kind == GC__TV_STR) return gc__tmpl_case(h, key->u.s, 'l', key);
  return 0;
}

static int key_less(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *a,
                    const gc__tmpl_val *b, bool *less) {
  if (a->kind == GC__TV_UNDEF || b->kind == GC__TV_UNDEF)
    return gc__tmpl_rt_undef(rt, n, a->kind == GC__TV_UNDEF ? a : b);
  int c, rc = gc__tmpl_cmp(gc__tmpl_rt_heap(rt)->e, a, b, "<", &c);
  if (rc) return gc__tmpl_rt_locate(rt, n, rc);
  *less = c == -1;
  return 0;
}

/* Stable merge sort of idx[0..n) by keys (Python's sorted: only `<` is used, and equal
 * items keep their order). A comparison that fails (a str against an int) fails the
 * sort, as Python's TypeError does. */
static int merge_sort(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *keys,
                      size_t *idx, size_t *tmp, size_t cnt, bool reverse) {
  if (cnt < 2) return 0;
  size_t mid = cnt / 2;
  int rc = merge_sort(rt, n, keys, idx, tmp, mid, reverse);
  if (!rc) rc = merge_sort(rt, n, keys, idx + mid, tmp, cnt - mid, reverse);
  if (rc) return rc;
  size_t i = 0, j = mid, o = 0;
  while (i < mid && j < cnt) {
    bool take_right;
    /* reverse keeps the stability of equal items, as Python's reverse=True does */
    rc = reverse ? key_less(rt, n, &keys[idx[i]], &keys[idx[j]], &take_right)
                 : key_less(rt, n, &keys[idx[j]], &keys[idx[i]], &take_right);
    if (rc) return rc;
    tmp[o++] = take_right ? idx[j++] : idx[i++];
  }
  while (i < mid) tmp[o++] = idx[i++];
  while (j < cnt) tmp[o++] = idx[j++];
  memcpy(idx, tmp, cnt * sizeof *idx);
  return 0;
}

/* sort(reverse=false, case_sensitive=false, attribute=none): sorted() with a key of the
 * attribute(s), strings lowered unless case_sensitive; a list. */
static int f_sort(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                  gc__tmpl_args *args, gc__tmpl_val *out) {
  static const char *const names[] = {"reverse", "case_sensitive", "attribute", NULL};
  const gc__tmpl_val *rev, *cs, *attr, *items;
  size_t cnt;
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  if ((rc = check_args(rt, n, args, "sort", 3, names)) || (rc = arg(rt, n, args, 0, "reverse", &rev)) ||
      (rc = arg(rt, n, args, 1, "case_sensitive", &cs)) || (rc = arg(rt, n, args, 2, "attribute", &attr)))
    return rc;
  gc__tmpl_val copy = *v;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  gc__tmpl_val *keys = gc__tmpl_alloc(h, (cnt ? cnt : 1) * sizeof *keys);
  size_t *idx = gc__tmpl_alloc(h, (cnt ? cnt : 1) * sizeof *idx);
  size_t *tmp = gc__tmpl_alloc(h, (cnt ? cnt : 1) * sizeof *tmp);
  if (!keys || !idx || !tmp) return gc__tmpl_rt_locate(rt, n, h->e->code);
  for (size_t i = 0; i < cnt; i++) {
    idx[i] = i;
    if ((rc = sort_key(rt, n, attr, cs && gc__tmpl_truthy(cs), &items[i], &keys[i]))) return rc;
  }
  if ((rc = merge_sort(rt, n, keys, idx, tmp, cnt, rev && gc__tmpl_truthy(rev)))) return rc;
  if ((rc = gc__tmpl_list_new(h, cnt, GC__TL_LIST, out))) return rc;
  for (size_t i = 0; i < cnt; i++) out->u.l->v[i] = items[idx[i]];
  return 0;
}

/* min / max(case_sensitive=false, attribute=none): the first item with the smallest /
 * largest key (Python keeps the first of equals); undefined for an empty sequence. */
static int f_minmax(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                    gc__tmpl_args *args, bool max, gc__tmpl_val *out) {
  static const char *const names[] = {"case_sensitive", "attribute", NULL};
  const gc__tmpl_val *cs, *attr, *items;
  size_t cnt;
  int rc;
  if ((rc = check_args(rt, n, args, max ? "max" : "min", 2, names)) ||
      (rc = arg(rt, n, args, 0, "case_sensitive", &cs)) || (rc = arg(rt, n, args, 1, "attribute", &attr)))
    return rc;
  gc__tmpl_val copy = *v, best_key;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  if (cnt == 0) {
    *out = gc__tmpl_undef_hint("No aggregated item, sequence was empty.");
    return 0;
  }
  size_t best = 0;
  bool sens = cs && gc__tmpl_truthy(cs);
  if ((rc = sort_key(rt, n, attr, sens, &items[0], &best_key))) return rc;
  for (size_t i = 1; i < cnt; i++) {
    gc__tmpl_val k;
    bool better;
    if ((rc = sort_key(rt, n, attr, sens, &items[i], &k))) return rc;
    rc = max ? key_less(rt, n, &best_key, &k, &better) : key_less(rt, n, &k, &best_key, &better);
    if (rc) return rc;
    if (better) best = i, best_key = k;
  }
  *out = items[best];
  return 0;
}

/* select / reject / selectattr / rejectattr: keep the items whose test (or truth) is
 * `keep`, as a generator. The test name and its arguments follow the attribute
 * (selectattr("role", "equalto", "user")); a falsy input yields nothing without looking
 * at the arguments, as jinja2's `if value:` does. */
static int f_select(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                    gc__tmpl_args *args, bool by_attr, bool keep, gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  const gc__tmpl_val *items;
  size_t cnt = 0;
  int rc;
  if (!gc__tmpl_truthy(v)) return make_gen(rt, NULL, 0, out); /* jinja2: `if value:` */
  size_t off = by_attr ? 1 : 0;
  if (by_attr && args->npos < 1)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "missing parameter for attribute name");
  uint16_t test = 0;
  if (args->npos > off) {
    const gc__tmpl_val *tn = &args->pos[off];
    if (tn->kind != GC__TV_STR || !(test = gc__tmpl_test_id(tn->u.s.p, tn->u.s.n)))
      return gc__tmpl_rt_fail(rt, n, MR_ENOTSUP, "no test named '%.*s'",
                              tn->kind == GC__TV_STR ? (int)tn->u.s.n : 1,
                              tn->kind == GC__TV_STR ? tn->u.s.p : "?");
  }
  gc__tmpl_val copy = *v;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  gc__tmpl_val *kept = gc__tmpl_alloc(h, (cnt ? cnt : 1) * sizeof *kept);
  if (!kept) return gc__tmpl_rt_locate(rt, n, h->e->code);
  gc__tmpl_args targs = *args;
  if (args->npos > off) targs.pos = args->pos + off + 1, targs.npos = args->npos - off - 1;
  size_t nk = 0;
  for (size_t i = 0; i < cnt; i++) {
    gc__tmpl_val x;
    bool r;
    if ((rc = attr_get(rt, n, by_attr ? &args->pos[0] : NULL, &items[i], &x))) return rc;
    if (test) {
      if ((rc = gc__tmpl_call_test(rt, n, test, &x, &targs, &r))) return rc;
    } else {
      r = gc__tmpl_truthy(&x);
    }
    if (r == keep) kept[nk++] = items[i];
  }
  return make_gen(rt, kept, nk, out);
}

/* map(attribute=..., default=...) or map("filter", args...): a generator of each item's
 * attribute (the default where it is undefined) or of a filter applied to each item. */
static int f_map(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                 gc__tmpl_args *args, gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  const gc__tmpl_val *items, *attr = NULL, *def = NULL;
  size_t cnt;
  uint16_t filter = 0;
  int rc;
  if (!gc__tmpl_truthy(v)) return make_gen(rt, NULL, 0, out);
  gc__tmpl_args fargs = {0};
  if (args->npos == 0) {
    for (size_t k = 0; k < args->nkw; k++) {
      if (eqn(args->kw[k].p, args->kw[k].n, "attribute")) attr = &args->kwv[k];
      else if (eqn(args->kw[k].p, args->kw[k].n, "default")) def = &args->kwv[k];
      else
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unexpected keyword argument '%.*s'",
                                (int)args->kw[k].n, args->kw[k].p);
    }
    if (!attr) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "map requires a filter argument");
  } else {
    const gc__tmpl_val *fnm = &args->pos[0];
    if (fnm->kind != GC__TV_STR || !(filter = gc__tmpl_filter_id(fnm->u.s.p, fnm->u.s.n)))
      return gc__tmpl_rt_fail(rt, n, MR_ENOTSUP, "no filter named '%.*s'",
                              fnm->kind == GC__TV_STR ? (int)fnm->u.s.n : 1,
                              fnm->kind == GC__TV_STR ? fnm->u.s.p : "?");
    fargs = *args;
    fargs.pos = args->pos + 1, fargs.npos = args->npos - 1;
  }
  gc__tmpl_val copy = *v;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  if ((rc = gc__tmpl_list_new(h, cnt, GC__TL_GEN, out))) return gc__tmpl_rt_locate(rt, n, rc);
  for (size_t i = 0; i < cnt; i++) {
    gc__tmpl_val *x = &out->u.l->v[i];
    if (filter) {
      rc = gc__tmpl_call_filter(rt, n, filter, &items[i], &fargs, x);
    } else {
      rc = attr_get(rt, n, attr, &items[i], x);
      if (!rc && def && def->kind != GC__TV_NONE && x->kind == GC__TV_UNDEF) *x = *def;
    }
    if (rc) return rc;
  }
  return 0;
}

/* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None,
 * sort_keys=False): json.dumps with those arguments (positional ones in that order). An
 * int indent is that many spaces, a str indent is used as it is; with an indent the
 * default item separator loses its space (",") as json.dumps does. */
static int f_tojson(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                    gc__tmpl_args *args, gc__tmpl_val *out) {
  static const char *const names[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
  const gc__tmpl_val *ea, *ind, *sep, *sk;
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  if ((rc = check_args(rt, n, args, "tojson", 4, names)) || (rc = arg(rt, n, args, 0, "ensure_ascii", &ea)) ||
      (rc = arg(rt, n, args, 1, "indent", &ind)) || (rc = arg(rt, n, args, 2, "separators", &sep)) ||
      (rc = arg(rt, n, args, 3, "sort_keys", &sk)))
    return rc;
  gc__tmpl_json_opts o = {0};
  gc__tmpl_str indent;
  o.ensure_ascii = ea && gc__tmpl_truthy(ea);
  o.sort_keys = sk && gc__tmpl_truthy(sk);
  if (ind && ind->kind != GC__TV_NONE) {
    if (ind->kind == GC__TV_STR) {
      indent = ind->u.s;
    } else if (is_intish(ind)) {
      /* json.dumps: an int indent is that many spaces (none below 1, but newlines) */
      int64_t w = intval(ind);
      if (w > 1000) return gc__tmpl_rt_fail(rt, n, MR_ERANGE, "indent %" PRId64 " above 1000", w);
      char *sp = gc__tmpl_alloc(h, (size_t)(w > 0 ? w : 0) + 1);
      if (!sp) return gc__tmpl_rt_locate(rt, n, h->e->code);
      memset(sp, ' ', (size_t)(w > 0 ? w : 0));
      indent = (gc__tmpl_str){sp, (size_t)(w > 0 ? w : 0)};
    } else {
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "tojson: indent must be an int or a str, not %s",
                              gc__tmpl_type_name(ind));
    }
    o.indent = &indent;
  }
  o.item_sep = o.indent ? (gc__tmpl_str){",", 1} : (gc__tmpl_str){", ", 2};
  o.key_sep = (gc__tmpl_str){": ", 2};
  if (sep && sep->kind != GC__TV_NONE) {
    if (sep->kind != GC__TV_LIST || sep->u.l->n != 2 || sep->u.l->v[0].kind != GC__TV_STR ||
        sep->u.l->v[1].kind != GC__TV_STR)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "tojson: separators must be two strings");
    o.item_sep = sep->u.l->v[0].u.s;
    o.key_sep = sep->u.l->v[1].u.s;
  }
  gc__tmpl_sb b;
  gc__tmpl_sb_init(&b, h->limit, "memory", h->e);
  rc = gc__tmpl_tojson_put(&b, h, v, &o);
  rc = gc__tmpl_sb_take(h, &b, rc, out);
  return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
}

/* Python's int(s, base) on a str: whitespace around, a sign, digits with single
 * underscores between, a 0x / 0o / 0b prefix when base is 0 or matches. Letters are
 * digits above 9 for bases up to 36. Beyond 64 bits fails (Python would not): the
 * filter then tries float and then its default, as jinja2 would for a bad string. */
static bool parse_int_str(gc__tmpl_str s, int base, int64_t *out) {
  gc__tmpl_val t;
  gc__tmpl_strip(NULL, s, NULL, true, true, &t);
  const char *p = t.u.s.p, *end = p + t.u.s.n;
  bool neg = false;
  if (p < end && (*p == '+' || *p == '-')) neg = *p++ == '-';
  if (end - p >= 2 && p[0] == '0') {
    char c = (char)(p[1] | 0x20);
    int b = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
    if (b && (base == b || base == 0)) {
      base = b;
      p += 2;
      if (p < end && *p == '_') p++;
    }
  }
  if (base == 0) base = 10;
  if (base < 2 || base > 36 || p >= end) return false;
  uint64_t v = 0;
  bool digit_before = false;
  for (; p < end; p++) {
    if (*p == '_' && digit_before && p + 1 < end && p[1] != '_') {
      digit_before = false;
      continue;
    }
    int d = *p >= '0' && *p <= '9' ? *p - '0' : isalpha((unsigned char)*p) ? (tolower(*p) - 'a' + 10) : 99;
    if (d >= base) return false;
    if (v > (UINT64_MAX - (uint64_t)d) / (uint64_t)base) return false;
    v = v * (uint64_t)base + (uint64_t)d;
    digit_before = true;
  }
  if (!digit_before) return false;
  if (v > (uint64_t)INT64_MAX + (neg ? 1 : 0)) return false;
  *out = neg ? (int64_t)(0 - v) : (int64_t)v;
  return true;
}

/* Python's float(s): whitespace around, a sign, decimal digits (single underscores between
 * them), an exponent, or inf / infinity / nan in any case. Hex floats and "1e" are not
 * Python floats although strtod reads them, so the text is checked first and strtod
 * only converts what passed. */
static bool parse_float_str(gc__tmpl_str s, double *out) {
  gc__tmpl_val t;
  gc__tmpl_strip(NULL, s, NULL, true, true, &t);
  const char *p = t.u.s.p, *end = p + t.u.s.n;
  char buf[128];
  size_t o = 0;
  if (p < end && (*p == '+' || *p == '-')) buf[o++] = *p++;
  size_t rest = (size_t)(end - p);
  if (rest == 3 || rest == 8) {
    char low[9] = {0};
    for (size_t i = 0; i < rest; i++) low[i] = (char)tolower((unsigned char)p[i]);
    if (!strcmp(low, "inf") || !strcmp(low, "infinity") || !strcmp(low, "nan")) {
      double x = low[0] == 'n' ? NAN : INFINITY;
      *out = o && buf[0] == '-' ? -x : x;
      return true;
    }
  }
  bool digits = false, prev_digit = false;
  int part = 0; /* 0 integer, 1 fraction, 2 exponent */
  for (; p < end; p++) {
    char c = *p;
    if (o + 2 >= sizeof buf) return false;
    if (c >= '0' && c <= '9') {
      buf[o++] = c;
      digits = prev_digit = true;
    } else if (c == '_' && prev_digit && p + 1 < end && p[1] >= '0' && p[1] <= '9') {
      prev_digit = false;
    } else if (c == '.' && part == 0) {
      buf[o++] = c, part = 1, prev_digit = false;
    } else if ((c == 'e' || c == 'E') && part < 2 && digits) {
      buf[o++] = 'e', part = 2, prev_digit = false, digits = false;
      if (p + 1 < end && (p[1] == '+' || p[1] == '-')) buf[o++] = *++p;
    } else {
      return false;
    }
  }
  if (!digits) return false;
  buf[o] = '\0';
  *out = strtod(buf, NULL);
  return true;
}

/* int(default=0, base=10): int(value) for numbers, int(value, base) for a str, then
 * int(float(value)) ("2.75"|int is 2), then the default; an undefined value fails
 * (Undefined.__int__ raises, which the filter does not catch). */
static int f_int(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v, gc__tmpl_args *args,
                 gc__tmpl_val *out) {
  static const char *const names[] = {"default", "base", NULL};
  const gc__tmpl_val *def, *base;
  int rc;
  if ((rc = check_args(rt, n, args, "int", 2, names)) || (rc = arg(rt, n, args, 0, "default", &def)) ||
      (rc = arg(rt, n, args, 1, "base", &base)))
    return rc;
  int64_t i;
  double f;
  switch (v->kind) {
  case GC__TV_UNDEF: /* Undefined.__int__ fails (not a TypeError the filter catches) */
    return gc__tmpl_rt_undef(rt, n, v);
  case GC__TV_INT:
  case GC__TV_BOOL:
    *out = gc__tmpl_int(intval(v));
    return 0;
  case GC__TV_FLOAT:
    f = v->u.f;
    goto from_float;
  case GC__TV_STR:
    if (parse_int_str(v->u.s, base && is_intish(base) ? (int)intval(base) : 10, &i)) {
      *out = gc__tmpl_int(i);
      return 0;
    }
    /* "42.23"|int is 42: jinja2 tries int(float(value)) next */
    if (parse_float_str(v->u.s, &f)) goto from_float;
    break;
  default:
    break;
  }
  *out = def ? *def : gc__tmpl_int(0);
  return 0;
from_float:
  if (isnan(f) || isinf(f) || fabs(f) >= 9.2e18) {
    *out = def ? *def : gc__tmpl_int(0);
    return 0;
  }
  *out = gc__tmpl_int((int64_t)f);
  return 0;
}

/* float(default=0.0): float(value), else the default; undefined fails as for int. */
static int f_float(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v, gc__tmpl_args *args,
                   gc__tmpl_val *out) {
  static const char *const names[] = {"default", NULL};
  const gc__tmpl_val *def;
  int rc;
  if ((rc = check_args(rt, n, args, "float", 1, names)) || (rc = arg(rt, n, args, 0, "default", &def)))
    return rc;
  double f;
  if (v->kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, v); /* Undefined.__float__ */
  if (v->kind == GC__TV_FLOAT || v->kind == GC__TV_INT || v->kind == GC__TV_BOOL) {
    *out = gc__tmpl_float(v->kind == GC__TV_FLOAT ? v->u.f : (double)intval(v));
  } else if (v->kind == GC__TV_STR && parse_float_str(v->u.s, &f)) {
    *out = gc__tmpl_float(f);
  } else {
    *out = def ? *def : gc__tmpl_float(0.0);
  }
  return 0;
}

/* indent(width=4, first=false, blank=false): every line but the first (unless first)
 * gets the indent, blank lines only with blank; lines split as str.splitlines. */
static int f_indent(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                    gc__tmpl_args *args, gc__tmpl_val *out) {
  static const char *const names[] = {"width", "first", "blank", NULL};
  const gc__tmpl_val *width, *first, *blank;
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  if ((rc = check_args(rt, n, args, "indent", 3, names)) || (rc = arg(rt, n, args, 0, "width", &width)) ||
      (rc = arg(rt, n, args, 1, "first", &first)) || (rc = arg(rt, n, args, 2, "blank", &blank)))
    return rc;
  gc__tmpl_str ind = {"    ", 4}, s = {"", 0};
  char *sp = NULL;
  if (width && width->kind == GC__TV_STR) {
    ind = width->u.s;
  } else if (width) {
    if (!is_intish(width) || intval(width) > 1000)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "indent: width must be an int up to 1000 or a str");
    int64_t w = intval(width) > 0 ? intval(width) : 0;
    if (!(sp = gc__tmpl_alloc(h, (size_t)w + 1))) return gc__tmpl_rt_locate(rt, n, h->e->code);
    memset(sp, ' ', (size_t)w);
    ind = (gc__tmpl_str){sp, (size_t)w};
  }
  /* s += "\n" needs a str (an undefined or a number fails), then splitlines: the quirk
   * jinja2 relies on. */
  if (v->kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, v);
  if (v->kind != GC__TV_STR)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unsupported operand type(s) for +=: '%s' and 'str'",
                            gc__tmpl_type_name(v));
  s = v->u.s;
  gc__tmpl_val lines;
  char *sn = gc__tmpl_alloc(h, s.n + 2);
  if (!sn) return gc__tmpl_rt_locate(rt, n, h->e->code);
  memcpy(sn, s.p, s.n);
  sn[s.n] = '\n';
  if ((rc = splitlines(h, (gc__tmpl_str){sn, s.n + 1}, false, &lines))) return gc__tmpl_rt_locate(rt, n, rc);
  gc__tmpl_sb b;
  gc__tmpl_sb_init(&b, h->limit, "memory", h->e);
  bool bl = blank && gc__tmpl_truthy(blank);
  if (first && gc__tmpl_truthy(first)) rc = gc__tmpl_sb_put(&b, ind.p, ind.n);
  for (size_t i = 0; i < lines.u.l->n && !rc; i++) {
    const gc__tmpl_str *line = &lines.u.l->v[i].u.s;
    if (i) {
      rc = gc__tmpl_sb_putc(&b, '\n');
      if (!rc && (bl || line->n)) rc = gc__tmpl_sb_put(&b, ind.p, ind.n);
    }
    if (!rc) rc = gc__tmpl_sb_put(&b, line->p, line->n);
  }
  rc = gc__tmpl_sb_take(h, &b, rc, out);
  return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
}

/* join(d='', attribute=none): str(d).join(map(str, items)) (items' attribute first). */
static int f_join(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                  gc__tmpl_args *args, gc__tmpl_val *out) {
  static const char *const names[] = {"d", "attribute", NULL};
  const gc__tmpl_val *d, *attr, *items;
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  size_t cnt;
  int rc;
  if ((rc = check_args(rt, n, args, "join", 2, names)) || (rc = arg(rt, n, args, 0, "d", &d)) ||
      (rc = arg(rt, n, args, 1, "attribute", &attr)))
    return rc;
  gc__tmpl_str sep = {"", 0};
  if (d && (rc = str_of(rt, n, d, &sep))) return rc;
  gc__tmpl_val copy = *v;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  gc__tmpl_sb b;
  gc__tmpl_sb_init(&b, h->limit, "memory", h->e);
  for (size_t i = 0; i < cnt && !rc; i++) {
    gc__tmpl_val x;
    if (i) rc = gc__tmpl_sb_put(&b, sep.p, sep.n);
    if (!rc) rc = attr_get(rt, n, attr, &items[i], &x);
    if (!rc) rc = gc__tmpl_str_put(&b, &x);
  }
  rc = gc__tmpl_sb_take(h, &b, rc, out);
  return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
}

/* unique(case_sensitive=false, attribute=none): the first item of each key, in order,
 * as a generator; keys must be hashable. */
static int f_unique(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                    gc__tmpl_args *args, gc__tmpl_val *out) {
  static const char *const names[] = {"case_sensitive", "attribute", NULL};
  const gc__tmpl_val *cs, *attr, *items;
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  size_t cnt;
  int rc;
  if ((rc = check_args(rt, n, args, "unique", 2, names)) || (rc = arg(rt, n, args, 0, "case_sensitive", &cs)) ||
      (rc = arg(rt, n, args, 1, "attribute", &attr)))
    return rc;
  gc__tmpl_val copy = *v;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  gc__tmpl_val *keys = gc__tmpl_alloc(h, (cnt ? cnt : 1) * sizeof *keys);
  gc__tmpl_val *kept = gc__tmpl_alloc(h, (cnt ? cnt : 1) * sizeof *kept);
  if (!keys || !kept) return gc__tmpl_rt_locate(rt, n, h->e->code);
  size_t nk = 0;
  for (size_t i = 0; i < cnt; i++) {
    gc__tmpl_val k;
    if ((rc = sort_key(rt, n, attr, cs && gc__tmpl_truthy(cs), &items[i], &k))) return rc;
    if (k.kind == GC__TV_DICT || (k.kind == GC__TV_LIST && k.u.l->flavour == GC__TL_LIST))
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unhashable type: '%s'", gc__tmpl_type_name(&k));
    bool seen = false;
    for (size_t j = 0; j < nk && !seen; j++) seen = gc__tmpl_eq(&keys[j], &k);
    if (!seen) keys[nk] = k, kept[nk++] = items[i];
  }
  return make_gen(rt, kept, nk, out);
}

/* reverse: a str reversed (by code points); a sequence as reversed() gives it (an
 * iterator, here a generator); a generator, which reversed() refuses, as a reversed
 * list. */
static int f_reverse(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                     gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  if (v->kind == GC__TV_STR) {
    char *b = gc__tmpl_alloc(h, v->u.s.n + 1);
    if (!b) return gc__tmpl_rt_locate(rt, n, h->e->code);
    size_t o = v->u.s.n;
    for (size_t i = 0; i < v->u.s.n;) { /* code points in reverse order */
      uint32_t c;
      size_t k = gc__tmpl_u8_next(v->u.s.p + i, v->u.s.n - i, &c);
      o -= k;
      memcpy(b + o, v->u.s.p + i, k);
      i += k;
    }
    b[v->u.s.n] = '\0';
    *out = gc__tmpl_strv(b, v->u.s.n);
    return 0;
  }
  const gc__tmpl_val *items;
  size_t cnt;
  bool gen = v->kind == GC__TV_LIST && v->u.l->flavour == GC__TL_GEN;
  if (v->kind != GC__TV_UNDEF && v->kind != GC__TV_LIST && v->kind != GC__TV_DICT)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "argument must be iterable");
  gc__tmpl_val copy = *v;
  if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
  /* reversed() of a sequence is an iterator; a generator is not reversible, so jinja2
   * makes a list of it and reverses that. */
  if ((rc = gc__tmpl_list_new(h, cnt, gen ? GC__TL_LIST : GC__TL_GEN, out)))
    return gc__tmpl_rt_locate(rt, n, rc);
  for (size_t i = 0; i < cnt; i++) out->u.l->v[i] = items[cnt - 1 - i];
  return 0;
}

/* The filters (jinja2's filters.py, transformers' tojson). Each checks its arguments
 * (too many, or an unknown keyword, fails as Python's call would). Filters written with
 * soft_str (trim, upper, lower, capitalize, title, replace, join, safe, string) accept
 * any value and use its str(); the others follow their Python code. */
static int filter_eager(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn,
                        const gc__tmpl_val *v, gc__tmpl_args *args, gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  const gc__tmpl_val *a0 = NULL, *a1 = NULL, *a2 = NULL, *items;
  gc__tmpl_str s = {"", 0};
  size_t cnt;
  int64_t len = 0;
  int rc = 0;
  switch (fn) {
  case GC__TFL_ABS: /* abs(): numbers only */
    if ((rc = check_args(rt, n, args, "abs", 0, NULL))) return rc;
    if (v->kind == GC__TV_FLOAT) *out = gc__tmpl_float(fabs(v->u.f));
    else if (v->kind == GC__TV_INT || v->kind == GC__TV_BOOL) {
      if (intval(v) == INT64_MIN) return gc__tmpl_rt_fail(rt, n, MR_ERANGE, "integer overflow");
      *out = gc__tmpl_int(intval(v) < 0 ? -intval(v) : intval(v));
    } else if (v->kind == GC__TV_UNDEF) {
      return gc__tmpl_rt_undef(rt, n, v);
    } else {
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "bad operand type for abs(): '%s'", gc__tmpl_type_name(v));
    }
    return 0;
  case GC__TFL_CAPITALIZE: /* soft_str(x).capitalize() / .lower() / .upper(), do_title */
  case GC__TFL_LOWER:
  case GC__TFL_UPPER:
  case GC__TFL_TITLE:
    if ((rc = check_args(rt, n, args, gc__tmpl_filter_name(fn), 0, NULL)) || (rc = str_of(rt, n, v, &s))) return rc;
    rc = gc__tmpl_case(h, s, fn == GC__TFL_CAPITALIZE ? 'c' : fn == GC__TFL_LOWER ? 'l' : fn == GC__TFL_UPPER ? 'u' : 'T', out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  case GC__TFL_COUNT: /* len() */
  case GC__TFL_LENGTH:
    if ((rc = check_args(rt, n, args, gc__tmpl_filter_name(fn), 0, NULL)) || (rc = f_len(rt, n, v, &len))) return rc;
    *out = gc__tmpl_int(len);
    return 0;
  case GC__TFL_DEFAULT: { /* undefined (or, with boolean, falsy) -> the default */
    static const char *const names[] = {"default_value", "boolean", NULL};
    if ((rc = check_args(rt, n, args, "default", 2, names)) || (rc = arg(rt, n, args, 0, "default_value", &a0)) ||
        (rc = arg(rt, n, args, 1, "boolean", &a1)))
      return rc;
    if (v->kind == GC__TV_UNDEF || (a1 && gc__tmpl_truthy(a1) && !gc__tmpl_truthy(v)))
      *out = a0 ? *a0 : gc__tmpl_strv("", 0);
    else
      *out = *v;
    return 0;
  }
  case GC__TFL_FIRST: { /* next(iter(x)): a generator gives up one item only */
    if ((rc = check_args(rt, n, args, "first", 0, NULL))) return rc;
    if (v->kind == GC__TV_LIST && v->u.l->flavour == GC__TL_GEN) {
      gc__tmpl_list *l = v->u.l; /* next(): one item of the generator */
      if (l->err && l->pos >= l->err_at) return gc__tmpl_rt_raise(rt, l->err_code, l->err);
      *out = l->pos < l->n ? l->v[l->pos++] : gc__tmpl_undef_hint("No first item, sequence was empty.");
      return 0;
    }
    gc__tmpl_val copy = *v;
    if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
    *out = cnt ? items[0] : gc__tmpl_undef_hint("No first item, sequence was empty.");
    return 0;
  }
  case GC__TFL_LAST: { /* next(reversed(x)): a generator is not reversible */
    if ((rc = check_args(rt, n, args, "last", 0, NULL))) return rc;
    if (v->kind == GC__TV_LIST && v->u.l->flavour == GC__TL_GEN)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "'generator' object is not reversible");
    if (v->kind != GC__TV_UNDEF && v->kind != GC__TV_STR && v->kind != GC__TV_LIST && v->kind != GC__TV_DICT)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "'%s' object is not reversible", gc__tmpl_type_name(v));
    gc__tmpl_val copy = *v;
    if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
    *out = cnt ? items[cnt - 1] : gc__tmpl_undef_hint("No last item, sequence was empty.");
    return 0;
  }
  case GC__TFL_FLOAT:
    return f_float(rt, n, v, args, out);
  case GC__TFL_INDENT:
    return f_indent(rt, n, v, args, out);
  case GC__TFL_INT:
    return f_int(rt, n, v, args, out);
  case GC__TFL_ITEMS: { /* a generator of (key, value); nothing for undefined */
    if ((rc = check_args(rt, n, args, "items", 0, NULL))) return rc;
    if (v->kind == GC__TV_UNDEF) return make_gen(rt, NULL, 0, out);
    if (v->kind != GC__TV_DICT)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "Can only get item pairs from a mapping.");
    const gc__tmpl_dict *d = v->u.d;
    if ((rc = gc__tmpl_list_new(h, d->n, GC__TL_GEN, out))) return gc__tmpl_rt_locate(rt, n, rc);
    for (size_t i = 0; i < d->n; i++) {
      gc__tmpl_val *pair = &out->u.l->v[i];
      if ((rc = gc__tmpl_list_new(h, 2, GC__TL_TUPLE, pair))) return gc__tmpl_rt_locate(rt, n, rc);
      pair->u.l->v[0] = d->k[i], pair->u.l->v[1] = d->v[i];
    }
    return 0;
  }
  case GC__TFL_JOIN:
    return f_join(rt, n, v, args, out);
  case GC__TFL_LIST: { /* list(x): the items as iter() gives them (a str's characters) */
    if ((rc = check_args(rt, n, args, "list", 0, NULL))) return rc;
    gc__tmpl_val copy = *v;
    if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
    if ((rc = gc__tmpl_list_new(h, cnt, GC__TL_LIST, out))) return gc__tmpl_rt_locate(rt, n, rc);
    if (cnt) memcpy(out->u.l->v, items, cnt * sizeof *items);
    return 0;
  }
  case GC__TFL_MAP:
    return f_map(rt, n, v, args, out);
  case GC__TFL_MAX:
  case GC__TFL_MIN:
    return f_minmax(rt, n, v, args, fn == GC__TFL_MAX, out);
  case GC__TFL_REJECT:
  case GC__TFL_SELECT:
    return f_select(rt, n, v, args, false, fn == GC__TFL_SELECT, out);
  case GC__TFL_REJECTATTR:
  case GC__TFL_SELECTATTR:
    return f_select(rt, n, v, args, true, fn == GC__TFL_SELECTATTR, out);
  case GC__TFL_REPLACE: { /* str(s).replace(str(old), str(new), count) */
    static const char *const names[] = {"old", "new", "count", NULL};
    gc__tmpl_str olds, news;
    if ((rc = check_args(rt, n, args, "replace", 3, names)) || (rc = arg(rt, n, args, 0, "old", &a0)) ||
        (rc = arg(rt, n, args, 1, "new", &a1)) || (rc = arg(rt, n, args, 2, "count", &a2)))
      return rc;
    if (!a0 || !a1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "replace needs old and new");
    if (a2 && a2->kind != GC__TV_NONE && !is_intish(a2))
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "replace: count must be an int");
    if ((rc = str_of(rt, n, v, &s)) || (rc = str_of(rt, n, a0, &olds)) || (rc = str_of(rt, n, a1, &news)))
      return rc;
    rc = gc__tmpl_replace(h, s, olds, news, a2 && is_intish(a2) ? intval(a2) : -1, out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  }
  case GC__TFL_REVERSE:
    if ((rc = check_args(rt, n, args, "reverse", 0, NULL))) return rc;
    return f_reverse(rt, n, v, out);
  case GC__TFL_SAFE: /* Markup(str(x)): printing is unchanged, `+` escapes the other side */
    if ((rc = check_args(rt, n, args, "safe", 0, NULL)) || (rc = str_of(rt, n, v, &s))) return rc;
    *out = gc__tmpl_strv(s.p, s.n);
    out->flags |= GC__TVF_SAFE;
    return 0;
  case GC__TFL_SORT:
    return f_sort(rt, n, v, args, out);
  case GC__TFL_STRING: /* soft_str: str(x), a str unchanged */
    if ((rc = check_args(rt, n, args, "string", 0, NULL))) return rc;
    if (v->kind == GC__TV_STR) {
      *out = *v; /* soft_str keeps a |safe string as it is */
      return 0;
    }
    if ((rc = str_of(rt, n, v, &s))) return rc;
    *out = gc__tmpl_strv(s.p, s.n);
    return 0;
  case GC__TFL_SUM: { /* start + items (their attribute), numbers only as Python's sum */
    static const char *const names[] = {"attribute", "start", NULL};
    if ((rc = check_args(rt, n, args, "sum", 2, names)) || (rc = arg(rt, n, args, 0, "attribute", &a0)) ||
        (rc = arg(rt, n, args, 1, "start", &a1)))
      return rc;
    gc__tmpl_val copy = *v, acc = a1 ? *a1 : gc__tmpl_int(0);
    if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
    for (size_t i = 0; i < cnt; i++) {
      gc__tmpl_val x;
      if (acc.kind == GC__TV_STR)
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "sum() can't sum strings [use ''.join(seq) instead]");
      if ((rc = attr_get(rt, n, a0, &items[i], &x))) return rc;
      bool num = (acc.kind == GC__TV_INT || acc.kind == GC__TV_BOOL || acc.kind == GC__TV_FLOAT) &&
                 (x.kind == GC__TV_INT || x.kind == GC__TV_BOOL || x.kind == GC__TV_FLOAT);
      if (!num)
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unsupported operand type(s) for +: '%s' and '%s'",
                                gc__tmpl_type_name(&acc), gc__tmpl_type_name(&x));
      if (acc.kind == GC__TV_FLOAT || x.kind == GC__TV_FLOAT) {
        acc = gc__tmpl_float((acc.kind == GC__TV_FLOAT ? acc.u.f : (double)intval(&acc)) +
                             (x.kind == GC__TV_FLOAT ? x.u.f : (double)intval(&x)));
      } else {
        int64_t r;
        if (__builtin_add_overflow(intval(&acc), intval(&x), &r))
          return gc__tmpl_rt_fail(rt, n, MR_ERANGE, "integer overflow");
        acc = gc__tmpl_int(r);
      }
    }
    *out = acc;
    return 0;
  }
  case GC__TFL_TOJSON:
    return f_tojson(rt, n, v, args, out);
  case GC__TFL_TRIM: { /* soft_str(x).strip(chars) */
    static const char *const names[] = {"chars", NULL};
    gc__tmpl_str chars;
    if ((rc = check_args(rt, n, args, "trim", 1, names)) || (rc = arg(rt, n, args, 0, "chars", &a0)) ||
        (rc = str_of(rt, n, v, &s)))
      return rc;
    if (a0 && a0->kind != GC__TV_NONE) {
      if ((rc = need_str(rt, n, a0, "trim: chars"))) return rc;
      chars = a0->u.s;
    }
    return gc__tmpl_strip(h, s, a0 && a0->kind != GC__TV_NONE ? &chars : NULL, true, true, out);
  }
  case GC__TFL_UNIQUE:
    return f_unique(rt, n, v, args, out);
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINTERNAL, "unknown filter %u", fn);
  }
}

/* The generator filters of jinja2 (items, map, select, reject, selectattr, rejectattr,
 * unique) run nothing until iterated: a failure here is kept in the generator and raised
 * by whoever iterates it (an `if` over it, which only asks its truth, never fails).
 * Limits and internal errors stay immediate. */
int gc__tmpl_call_filter(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn,
                         const gc__tmpl_val *v, gc__tmpl_args *args, gc__tmpl_val *out) {
  bool lazy = fn == GC__TFL_ITEMS || fn == GC__TFL_MAP || fn == GC__TFL_SELECT ||
              fn == GC__TFL_REJECT || fn == GC__TFL_SELECTATTR || fn == GC__TFL_REJECTATTR ||
              fn == GC__TFL_UNIQUE;
  int rc = filter_eager(rt, n, fn, v, args, out);
  if (!lazy || rc >= 0 || rc == MR_EEXHAUSTED || rc == MR_ENOMEM || rc == MR_EINTERNAL) return rc;
  int code;
  const char *msg = gc__tmpl_rt_take_error(rt, &code);
  if (!msg || make_gen(rt, NULL, 0, out)) return rc;
  out->u.l->err = msg, out->u.l->err_code = code, out->u.l->err_at = 0;
  return 0;
}

/* ---- methods -------------------------------------------------------------------------- */

/* str.find / rfind / count need code point positions. */
static int64_t cp_index(gc__tmpl_str s, const char *at) {
  return (int64_t)gc__tmpl_u8_count(s.p, (size_t)(at - s.p));
}

static int m_prefix(gc__tmpl_rt *rt, const gc__tmpl_node *n, gc__tmpl_str s, const gc__tmpl_val *x,
                    bool ends, bool *out) {
  /* startswith / endswith: a str, or a tuple of str */
  *out = false;
  if (x->kind == GC__TV_STR) {
    const gc__tmpl_str *p = &x->u.s;
    *out = p->n <= s.n && memcmp(ends ? s.p + s.n - p->n : s.p, p->p, p->n) == 0;
    return 0;
  }
  if (x->kind == GC__TV_LIST && x->u.l->flavour == GC__TL_TUPLE) {
    for (size_t i = 0; i < x->u.l->n && !*out; i++) {
      if (x->u.l->v[i].kind != GC__TV_STR)
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "tuple for %s must only contain str, not %s",
                                ends ? "endswith" : "startswith", gc__tmpl_type_name(&x->u.l->v[i]));
      int rc = m_prefix(rt, n, s, &x->u.l->v[i], ends, out);
      if (rc) return rc;
    }
    return 0;
  }
  return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s first arg must be str or a tuple of str, not %s",
                          ends ? "endswith" : "startswith", gc__tmpl_type_name(x));
}

/* A call of a bound method: loop.cycle, dict get / items / keys / values (views that
 * print as dict_items([...])), list / tuple count / index, and the str methods with
 * Python's argument rules (positional ones, keywords where Python takes them). */
int gc__tmpl_call_method(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *m,
                         gc__tmpl_args *args, gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  const gc__tmpl_val *self = m->u.self, *a0 = NULL, *a1 = NULL, *a2 = NULL;
  int rc = 0;
  bool b;
  if (m->aux == GC__TM_OTHER)
    return gc__tmpl_rt_fail(rt, n, MR_ENOTSUP,
                            "this method of a '%s' is not supported (the sandbox of transformers "
                            "refuses methods that modify a value)",
                            gc__tmpl_type_name(self));
  if (m->aux == GC__TM_CYCLE) {
    if (args->nkw) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "loop.cycle takes no keyword arguments");
    if (!args->npos) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "no items for cycling given");
    *out = args->pos[self->u.loop->i % args->npos];
    return 0;
  }
  if (self->kind == GC__TV_DICT) {
    const gc__tmpl_dict *d = self->u.d;
    switch (m->aux) {
    case GC__TM_GET:
      if ((rc = check_args(rt, n, args, "get", 2, NULL))) return rc;
      if (args->npos < 1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "get expected at least 1 argument, got 0");
      if (args->pos[0].kind == GC__TV_DICT ||
          (args->pos[0].kind == GC__TV_LIST && args->pos[0].u.l->flavour == GC__TL_LIST))
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unhashable type: '%s'", gc__tmpl_type_name(&args->pos[0]));
      {
        const gc__tmpl_val *x = gc__tmpl_dict_get(d, &args->pos[0]);
        *out = x ? *x : args->npos > 1 ? args->pos[1] : gc__tmpl_none();
      }
      return 0;
    case GC__TM_ITEMS:
    case GC__TM_KEYS:
    case GC__TM_VALUES: {
      if ((rc = check_args(rt, n, args, "items", 0, NULL))) return rc;
      uint8_t fl = m->aux == GC__TM_ITEMS ? GC__TL_ITEMS : m->aux == GC__TM_KEYS ? GC__TL_KEYS : GC__TL_VALUES;
      if ((rc = gc__tmpl_list_new(h, d->n, fl, out))) return gc__tmpl_rt_locate(rt, n, rc);
      for (size_t i = 0; i < d->n; i++) {
        if (fl == GC__TL_KEYS) {
          out->u.l->v[i] = d->k[i];
        } else if (fl == GC__TL_VALUES) {
          out->u.l->v[i] = d->v[i];
        } else {
          gc__tmpl_val *pair = &out->u.l->v[i];
          if ((rc = gc__tmpl_list_new(h, 2, GC__TL_TUPLE, pair))) return gc__tmpl_rt_locate(rt, n, rc);
          pair->u.l->v[0] = d->k[i], pair->u.l->v[1] = d->v[i];
        }
      }
      return 0;
    }
    default:
      break;
    }
  }
  if (self->kind == GC__TV_LIST && (m->aux == GC__TM_COUNT || m->aux == GC__TM_INDEX)) {
    /* list / tuple / range .count(x) and .index(x) */
    const gc__tmpl_list *l = self->u.l;
    if ((rc = check_args(rt, n, args, m->aux == GC__TM_COUNT ? "count" : "index", 1, NULL))) return rc;
    if (args->npos < 1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "count / index need an argument");
    int64_t c = 0;
    for (size_t i = 0; i < l->n; i++)
      if (gc__tmpl_eq(&l->v[i], &args->pos[0])) {
        if (m->aux == GC__TM_INDEX) {
          *out = gc__tmpl_int((int64_t)i);
          return 0;
        }
        c++;
      }
    if (m->aux == GC__TM_INDEX)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s.index(x): x not in %s", gc__tmpl_type_name(self),
                              gc__tmpl_type_name(self));
    *out = gc__tmpl_int(c);
    return 0;
  }
  if (self->kind != GC__TV_STR) return gc__tmpl_rt_fail(rt, n, MR_EINTERNAL, "method of a '%s'", gc__tmpl_type_name(self));
  gc__tmpl_str s = self->u.s;
  switch (m->aux) {
  case GC__TM_STARTSWITH: /* a str or a tuple of str (any of them) */
  case GC__TM_ENDSWITH:
    if ((rc = check_args(rt, n, args, m->aux == GC__TM_STARTSWITH ? "startswith" : "endswith", 1, NULL))) return rc;
    if (args->npos < 1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "startswith / endswith need an argument");
    if ((rc = m_prefix(rt, n, s, &args->pos[0], m->aux == GC__TM_ENDSWITH, &b))) return rc;
    *out = gc__tmpl_bool(b);
    return 0;
  case GC__TM_SPLIT: /* (sep=None, maxsplit=-1), positional or by name; sep "" fails */
  case GC__TM_RSPLIT: {
    static const char *const names[] = {"sep", "maxsplit", NULL};
    if ((rc = check_args(rt, n, args, "split", 2, names)) || (rc = arg(rt, n, args, 0, "sep", &a0)) ||
        (rc = arg(rt, n, args, 1, "maxsplit", &a1)))
      return rc;
    if (a0 && a0->kind != GC__TV_NONE && (rc = need_str(rt, n, a0, "split: sep"))) return rc;
    if (a0 && a0->kind == GC__TV_STR && a0->u.s.n == 0)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "empty separator");
    if (a1 && !is_intish(a1)) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "split: maxsplit must be an int");
    rc = split(h, s, a0 && a0->kind == GC__TV_STR ? &a0->u.s : NULL, a1 ? intval(a1) : -1,
               m->aux == GC__TM_RSPLIT, out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  }
  case GC__TM_STRIP: /* (chars=None): a set of characters, or whitespace */
  case GC__TM_LSTRIP:
  case GC__TM_RSTRIP:
    if ((rc = check_args(rt, n, args, "strip", 1, NULL))) return rc;
    a0 = args->npos ? &args->pos[0] : NULL;
    if (a0 && a0->kind != GC__TV_NONE && (rc = need_str(rt, n, a0, "strip arg"))) return rc;
    return gc__tmpl_strip(h, s, a0 && a0->kind == GC__TV_STR ? &a0->u.s : NULL,
                          m->aux != GC__TM_RSTRIP, m->aux != GC__TM_LSTRIP, out);
  case GC__TM_REPLACE: /* (old, new, count=-1), str arguments only (no str() here) */
    if ((rc = check_args(rt, n, args, "replace", 3, NULL))) return rc;
    if (args->npos < 2) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "replace expected at least 2 arguments");
    a0 = &args->pos[0], a1 = &args->pos[1], a2 = args->npos > 2 ? &args->pos[2] : NULL;
    if ((rc = need_str(rt, n, a0, "replace arg 1")) || (rc = need_str(rt, n, a1, "replace arg 2"))) return rc;
    if (a2 && !is_intish(a2)) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "replace: count must be an int");
    rc = gc__tmpl_replace(h, s, a0->u.s, a1->u.s, a2 ? intval(a2) : -1, out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  case GC__TM_UPPER:
  case GC__TM_LOWER:
  case GC__TM_TITLE:
  case GC__TM_CAPITALIZE:
    if ((rc = check_args(rt, n, args, "upper / lower / title / capitalize", 0, NULL))) return rc;
    rc = gc__tmpl_case(h, s, m->aux == GC__TM_UPPER ? 'u' : m->aux == GC__TM_LOWER ? 'l' : m->aux == GC__TM_TITLE ? 't' : 'c', out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  case GC__TM_FIND: /* positions in code points; -1 (index: ValueError) when absent */
  case GC__TM_RFIND:
  case GC__TM_INDEX:
  case GC__TM_COUNT: { /* non-overlapping; "" is found len + 1 times */
    if ((rc = check_args(rt, n, args, "find / rfind / count", 1, NULL))) return rc;
    if (args->npos < 1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "find / count need an argument");
    if ((rc = need_str(rt, n, &args->pos[0], "find / count arg"))) return rc;
    gc__tmpl_str sub = args->pos[0].u.s;
    if (m->aux == GC__TM_COUNT) {
      int64_t c = 0;
      if (sub.n == 0) {
        c = (int64_t)gc__tmpl_u8_count(s.p, s.n) + 1;
      } else {
        for (size_t i = 0;;) {
          const char *p = memfind(s.p + i, s.n - i, sub.p, sub.n);
          if (!p) break;
          c++;
          i = (size_t)(p - s.p) + sub.n;
        }
      }
      *out = gc__tmpl_int(c);
      return 0;
    }
    const char *p = m->aux == GC__TM_RFIND ? memrfind(s.p, s.n, sub.p, sub.n) : memfind(s.p, s.n, sub.p, sub.n);
    if (!p && m->aux == GC__TM_INDEX) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "substring not found");
    *out = gc__tmpl_int(p ? cp_index(s, p) : -1);
    return 0;
  }
  case GC__TM_JOIN: { /* sep.join(iterable): every item must be a str (no str() here) */
    if ((rc = check_args(rt, n, args, "join", 1, NULL))) return rc;
    if (args->npos < 1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "join() takes exactly one argument");
    const gc__tmpl_val *items;
    size_t cnt;
    gc__tmpl_val copy = args->pos[0];
    if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
    gc__tmpl_sb sb;
    gc__tmpl_sb_init(&sb, h->limit, "memory", h->e);
    for (size_t i = 0; i < cnt && !rc; i++) {
      if (items[i].kind != GC__TV_STR) {
        gc__tmpl_sb_free(&sb);
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "sequence item %zu: expected str instance, %s found", i,
                                gc__tmpl_type_name(&items[i]));
      }
      if (i) rc = gc__tmpl_sb_put(&sb, s.p, s.n);
      if (!rc) rc = gc__tmpl_sb_put(&sb, items[i].u.s.p, items[i].u.s.n);
    }
    rc = gc__tmpl_sb_take(h, &sb, rc, out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  }
  case GC__TM_SPLITLINES: { /* at \n, \r\n, \r, \v, \f, \x1c-\x1e, \x85, U+2028/9 */
    static const char *const names[] = {"keepends", NULL};
    if ((rc = check_args(rt, n, args, "splitlines", 1, names)) || (rc = arg(rt, n, args, 0, "keepends", &a0))) return rc;
    rc = splitlines(h, s, a0 && gc__tmpl_truthy(a0), out);
    return rc ? gc__tmpl_rt_locate(rt, n, rc) : 0;
  }
  case GC__TM_ISSPACE: {
    if ((rc = check_args(rt, n, args, "isspace", 0, NULL))) return rc;
    bool all = s.n > 0;
    for (size_t i = 0; i < s.n && all;) {
      uint32_t c;
      i += gc__tmpl_u8_next(s.p + i, s.n - i, &c);
      all = gc__tmpl_is_space(c);
    }
    *out = gc__tmpl_bool(all);
    return 0;
  }
  case GC__TM_REMOVEPREFIX: /* the str without that prefix / suffix if it has it */
  case GC__TM_REMOVESUFFIX: {
    if ((rc = check_args(rt, n, args, "removeprefix / removesuffix", 1, NULL))) return rc;
    if (args->npos < 1) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "removeprefix / removesuffix need an argument");
    if ((rc = need_str(rt, n, &args->pos[0], "removeprefix / removesuffix arg"))) return rc;
    gc__tmpl_str x = args->pos[0].u.s;
    bool suffix = m->aux == GC__TM_REMOVESUFFIX;
    if (x.n && x.n <= s.n && memcmp(suffix ? s.p + s.n - x.n : s.p, x.p, x.n) == 0)
      *out = gc__tmpl_strv(suffix ? s.p : s.p + x.n, s.n - x.n);
    else
      *out = *self;
    return 0;
  }
  default:
    return gc__tmpl_rt_fail(rt, n, MR_ENOTSUP, "this method of a '%s' is not supported",
                            gc__tmpl_type_name(self));
  }
}

/* ---- global functions ----------------------------------------------------------------- */

/* dict() and namespace() take a mapping or an iterable of pairs, then keywords; the
 * later wins, keeping the first place, as a Python dict update does. */

/* dict(*args, **kwargs) as Python builds it: an optional mapping (or iterable of pairs),
 * then the keywords. */
static int build_dict(gc__tmpl_rt *rt, const gc__tmpl_node *n, gc__tmpl_args *args, bool ns,
                      gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  if (args->npos > 1)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s expected at most 1 argument, got %zu",
                            ns ? "namespace" : "dict", args->npos);
  if ((rc = gc__tmpl_dict_new(h, args->nkw + 4, ns, out))) return gc__tmpl_rt_locate(rt, n, rc);
  if (args->npos) {
    const gc__tmpl_val *src = &args->pos[0];
    if (src->kind == GC__TV_DICT) {
      for (size_t i = 0; i < src->u.d->n; i++)
        if ((rc = gc__tmpl_dict_set(h, out->u.d, src->u.d->k[i], src->u.d->v[i])))
          return gc__tmpl_rt_locate(rt, n, rc);
    } else {
      const gc__tmpl_val *items;
      size_t cnt;
      gc__tmpl_val copy = *src;
      if ((rc = gc__tmpl_iter(rt, n, &copy, &items, &cnt))) return rc;
      for (size_t i = 0; i < cnt; i++) {
        const gc__tmpl_val *it = &items[i];
        if (it->kind != GC__TV_LIST || it->u.l->n != 2 || it->u.l->flavour == GC__TL_GEN)
          return gc__tmpl_rt_fail(rt, n, MR_EINVAL,
                                  "dictionary update sequence element #%zu has the wrong length", i);
        if ((rc = gc__tmpl_dict_set(h, out->u.d, it->u.l->v[0], it->u.l->v[1])))
          return gc__tmpl_rt_locate(rt, n, rc);
      }
    }
  }
  for (size_t k = 0; k < args->nkw; k++)
    if ((rc = gc__tmpl_dict_set(h, out->u.d, gc__tmpl_strv(args->kw[k].p, args->kw[k].n), args->kwv[k])))
      return gc__tmpl_rt_locate(rt, n, rc);
  if (ns)
    for (size_t i = 0; i < out->u.d->n; i++) {
      const gc__tmpl_val *k = &out->u.d->k[i];
      if (k->kind == GC__TV_STR && k->u.s.n && k->u.s.p[0] == '_')
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL,
                                "chat templates cannot store underscore-prefixed attributes on a "
                                "namespace, but got '%.*s'",
                                (int)k->u.s.n, k->u.s.p);
    }
  return 0;
}

/* The globals of transformers' environment: range (bounded as jinja2's sandbox bounds
 * it), namespace (transformers' TemplateNamespace: no "_" attributes), dict,
 * raise_exception (the template's own error) and strftime_now (local time, as
 * datetime.now().strftime). */
int gc__tmpl_call_func(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn, gc__tmpl_args *args,
                       gc__tmpl_val *out) {
  gc__tmpl_heap *h = gc__tmpl_rt_heap(rt);
  int rc;
  switch (fn) {
  case GC__TF_RANGE: {
    if (args->nkw) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "range() takes no keyword arguments");
    if (args->npos < 1 || args->npos > 3)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "range expected 1 to 3 arguments, got %zu", args->npos);
    int64_t v[3];
    for (size_t k = 0; k < args->npos; k++) {
      if (!is_intish(&args->pos[k]))
        return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "'%s' object cannot be interpreted as an integer",
                                gc__tmpl_type_name(&args->pos[k]));
      v[k] = intval(&args->pos[k]);
    }
    int64_t start = args->npos > 1 ? v[0] : 0, stop = args->npos > 1 ? v[1] : v[0];
    int64_t step = args->npos > 2 ? v[2] : 1;
    if (step == 0) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "range() arg 3 must not be zero");
    /* The count, without overflow: (stop - start) in 128 bits. */
    __int128 span = (__int128)stop - start, cnt = 0;
    if (step > 0 && span > 0) cnt = (span + step - 1) / step;
    if (step < 0 && span < 0) cnt = (-span + (-(__int128)step) - 1) / (-(__int128)step);
    if (cnt > GC__TMPL_MAX_RANGE)
      return gc__tmpl_rt_fail(rt, n, MR_EEXHAUSTED,
                              "range too big: the sandbox refuses ranges of more than %d items "
                              "(MAX_RANGE)",
                              GC__TMPL_MAX_RANGE);
    if ((rc = gc__tmpl_list_new(h, (size_t)cnt, GC__TL_RANGE, out))) return gc__tmpl_rt_locate(rt, n, rc);
    for (int64_t i = 0; i < (int64_t)cnt; i++) out->u.l->v[i] = gc__tmpl_int(start + i * step);
    out->u.l->start = start, out->u.l->stop = stop, out->u.l->step = step;
    return 0;
  }
  case GC__TF_NAMESPACE:
  case GC__TF_DICT:
    return build_dict(rt, n, args, fn == GC__TF_NAMESPACE, out);
  case GC__TF_RAISE: {
    if (args->npos != 1 || args->nkw)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "raise_exception() takes exactly one argument");
    gc__tmpl_str s = {"", 0};
    if ((rc = str_of(rt, n, &args->pos[0], &s))) return rc;
    /* The template's own message, bare: it is the caller's answer to its user. The error
     * record holds 511 bytes: a longer one is cut at a character boundary. */
    size_t len = s.n;
    if (len > 500) {
      len = 500;
      while (len > 0 && ((unsigned char)s.p[len] & 0xc0) == 0x80) len--;
    }
    mr_err_set(h->e, MR_EPRECOND, "%.*s", (int)len, s.p);
    return gc__tmpl_rt_locate(rt, NULL, MR_EPRECOND); /* NULL: located, without a place */
  }
  case GC__TF_STRFTIME: {
    if (args->npos != 1 || args->nkw || args->pos[0].kind != GC__TV_STR)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "strftime_now() takes one format string");
    char fmt[256], buf[512];
    const gc__tmpl_str *f = &args->pos[0].u.s;
    if (f->n >= sizeof fmt || memchr(f->p, '\0', f->n))
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "strftime_now: format longer than %zu bytes", sizeof fmt - 1);
    memcpy(fmt, f->p, f->n);
    fmt[f->n] = '\0';
    time_t now = time(NULL);
    struct tm tmv;
    localtime_r(&now, &tmv);
    size_t len = f->n ? strftime(buf, sizeof buf, fmt, &tmv) : 0;
    char *p = gc__tmpl_memdup(h, buf, len);
    if (!p) return gc__tmpl_rt_locate(rt, n, h->e->code);
    *out = gc__tmpl_strv(p, len);
    return 0;
  }
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINTERNAL, "unknown function %u", fn);
  }
}
