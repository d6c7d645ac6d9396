/*
 * tmpl_value.c - values of the chat-template interpreter with Python's semantics: what
 * str() and repr() print, ==, ordering, truth, transformers' tojson (json.dumps with
 * ensure_ascii=False), and the two readers of the render's variables (JSON text as
 * Python's json.loads reads it; a cJSON tree).
 *
 * Strings are UTF-8 byte slices. Byte order of valid UTF-8 is code-point order, so string
 * comparison is memcmp; only the operations that count characters (len, slices, repr)
 * decode.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_client/runner/tmpl_internal.h"

/* ---- memory ----------------------------------------------------------------------- */

/* The budget counts every byte handed out, so a render that builds too much stops with
 * a message naming the limit instead of taking the host's memory. */
void *gc__tmpl_alloc(gc__tmpl_heap *h, size_t n) {
  if (n > h->limit || h->arena.used > h->limit - n) {
    mr_err_set(h->e, MR_EEXHAUSTED, "memory limit of %zu bytes reached", h->limit);
    return NULL;
  }
  void *p = mr_arena_alloc(&h->arena, n ? n : 1, 8);
  if (!p) mr_err_set(h->e, MR_ENOMEM, "out of memory (%zu bytes)", n);
  return p;
}

char *gc__tmpl_memdup(gc__tmpl_heap *h, const char *p, size_t n) {
  if (n == SIZE_MAX) {
    mr_err_set(h->e, MR_EEXHAUSTED, "string too long");
    return NULL;
  }
  char *q = gc__tmpl_alloc(h, n + 1);
  if (!q) return NULL;
  if (n) memcpy(q, p, n);
  q[n] = '\0';
  return q;
}

void gc__tmpl_sb_init(gc__tmpl_sb *b, size_t limit, const char *what, mr_err *e) {
  b->p = NULL;
  b->n = b->cap = 0;
  b->limit = limit;
  b->what = what;
  b->e = e;
}

/* Appends n bytes, keeping a NUL after them; doubles the buffer as it grows. */
int gc__tmpl_sb_put(gc__tmpl_sb *b, const char *p, size_t n) {
  if (n == 0) return 0;
  if (n > b->limit || b->n > b->limit - n)
    return mr_err_set(b->e, MR_EEXHAUSTED, "%s limit of %zu bytes reached", b->what, b->limit);
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap = cap > SIZE_MAX / 2 ? b->n + n + 1 : cap * 2;
    char *q = mr_realloc(b->p, cap);
    if (!q) return mr_err_set(b->e, MR_ENOMEM, "out of memory (%zu bytes)", cap);
    b->p = q;
    b->cap = cap;
  }
  memcpy(b->p + b->n, p, n);
  b->n += n;
  b->p[b->n] = '\0';
  return 0;
}

int gc__tmpl_sb_putc(gc__tmpl_sb *b, char c) { return gc__tmpl_sb_put(b, &c, 1); }

int gc__tmpl_sb_printf(gc__tmpl_sb *b, const char *fmt, ...) {
  char buf[128];
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (k < 0) return mr_err_set(b->e, MR_EINTERNAL, "format failed");
  return gc__tmpl_sb_put(b, buf, (size_t)k < sizeof buf ? (size_t)k : sizeof buf - 1);
}

void gc__tmpl_sb_free(gc__tmpl_sb *b) {
  mr_free(b->p);
  b->p = NULL;
  b->n = b->cap = 0;
}

/* ---- UTF-8 -------------------------------------------------------------------------- */

/* Shortest forms only (no overlong encodings), up to U+10FFFF; a truncated or invalid
 * sequence decodes its first byte alone. */
size_t gc__tmpl_u8_next(const char *s, size_t n, uint32_t *cp) {
  const unsigned char *p = (const unsigned char *)s;
  unsigned c = p[0];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len;
  uint32_t v, min;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2, v = c & 0x1f, min = 0x80;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3, v = c & 0x0f, min = 0x800;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4, v = c & 0x07, min = 0x10000;
  } else {
    goto bad;
  }
  if (n < len) goto bad;
  for (size_t i = 1; i < len; i++) {
    if ((p[i] & 0xc0) != 0x80) goto bad;
    v = (v << 6) | (p[i] & 0x3f);
  }
  /* Surrogates (ED A0..BF xx) are accepted: they come from JSON's lone \ud800 escapes,
   * which Python keeps in its strings. */
  if (v < min || v > 0x10ffff) goto bad;
  *cp = v;
  return len;
bad:
  *cp = 0xdc00 + c;
  return 1;
}

size_t gc__tmpl_u8_count(const char *p, size_t n) {
  size_t k = 0;
  for (size_t i = 0; i < n; k++) {
    if ((unsigned char)p[i] < 0x80) {
      i++;
      continue;
    }
    uint32_t cp;
    i += gc__tmpl_u8_next(p + i, n - i, &cp);
  }
  return k;
}

size_t gc__tmpl_u8_put(uint32_t cp, char *o) {
  unsigned char *out = (unsigned char *)o;
  if (cp < 0x80) {
    out[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    out[0] = (unsigned char)(0xc0 | (cp >> 6));
    out[1] = (unsigned char)(0x80 | (cp & 0x3f));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (unsigned char)(0xe0 | (cp >> 12));
    out[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
    out[2] = (unsigned char)(0x80 | (cp & 0x3f));
    return 3;
  }
  out[0] = (unsigned char)(0xf0 | (cp >> 18));
  out[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3f));
  out[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3f));
  out[3] = (unsigned char)(0x80 | (cp & 0x3f));
  return 4;
}

bool gc__tmpl_is_space(uint32_t c) {
  /* Python's str.isspace(): bidirectional class WS, B or S, or category Zs. */
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

bool gc__tmpl_u8_valid(const char *p, size_t n, size_t *bad_at) {
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    size_t k = gc__tmpl_u8_next(p + i, n - i, &cp);
    if ((cp >= 0xd800 && cp <= 0xdfff)) {
      if (bad_at) *bad_at = i;
      return false;
    }
    i += k;
  }
  return true;
}

/* ---- lists and dicts ---------------------------------------------------------------- */

int gc__tmpl_list_new(gc__tmpl_heap *h, size_t n, uint8_t flavour, gc__tmpl_val *out) {
  gc__tmpl_list *l = gc__tmpl_alloc(h, sizeof *l);
  if (!l) return h->e->code;
  memset(l, 0, sizeof *l);
  /* Never a NULL array, even when empty: l->v + l->pos is then always defined. */
  if (n > SIZE_MAX / sizeof(gc__tmpl_val) - 1)
    return mr_err_set(h->e, MR_EEXHAUSTED, "list of %zu items too long", n);
  l->v = gc__tmpl_alloc(h, (n ? n : 1) * sizeof(gc__tmpl_val));
  if (!l->v) return h->e->code;
  memset(l->v, 0, (n ? n : 1) * sizeof(gc__tmpl_val));
  l->n = n;
  l->flavour = flavour;
  l->step = 1;
  *out = (gc__tmpl_val){.kind = GC__TV_LIST, .u.l = l};
  return 0;
}

int gc__tmpl_dict_new(gc__tmpl_heap *h, size_t cap, bool ns, gc__tmpl_val *out) {
  gc__tmpl_dict *d = gc__tmpl_alloc(h, sizeof *d);
  if (!d) return h->e->code;
  memset(d, 0, sizeof *d);
  if (cap) {
    if (cap > SIZE_MAX / (2 * sizeof(gc__tmpl_val)))
      return mr_err_set(h->e, MR_EEXHAUSTED, "dict of %zu items too large", cap);
    d->k = gc__tmpl_alloc(h, cap * sizeof(gc__tmpl_val));
    d->v = gc__tmpl_alloc(h, cap * sizeof(gc__tmpl_val));
    if (!d->k || !d->v) return h->e->code;
    d->cap = cap;
  }
  *out = (gc__tmpl_val){.kind = ns ? GC__TV_NS : GC__TV_DICT, .u.d = d};
  return 0;
}

/* Hashable in Python: scalars and tuples of hashables (namespaces and functions are,
 * by identity, but never appear as keys in practice). Lists and dicts are not: a dict
 * literal with such a key, or one used with `in` / get(), is Python's TypeError. */
static bool hashable(const gc__tmpl_val *v, int depth) {
  if (depth > GC__TMPL_MAX_NEST) return false;
  if (v->kind == GC__TV_DICT) return false;
  if (v->kind != GC__TV_LIST) return true;
  if (v->u.l->flavour != GC__TL_TUPLE) return v->u.l->flavour == GC__TL_GEN ||
                                               v->u.l->flavour == GC__TL_RANGE;
  for (size_t i = 0; i < v->u.l->n; i++)
    if (!hashable(&v->u.l->v[i], depth + 1)) return false;
  return true;
}

/* Linear: the dicts of a conversation have a handful of keys; a str key compares bytes,
 * any other Python's == (so d[1] finds the key 1.0 or True). */
gc__tmpl_val *gc__tmpl_dict_get(const gc__tmpl_dict *d, const gc__tmpl_val *key) {
  if (key->kind == GC__TV_STR) return gc__tmpl_dict_get_str(d, key->u.s.p, key->u.s.n);
  for (size_t i = 0; i < d->n; i++)
    if (gc__tmpl_eq(&d->k[i], key)) return &d->v[i];
  return NULL;
}

gc__tmpl_val *gc__tmpl_dict_get_str(const gc__tmpl_dict *d, const char *p, size_t n) {
  for (size_t i = 0; i < d->n; i++) {
    const gc__tmpl_val *k = &d->k[i];
    if (k->kind == GC__TV_STR && k->u.s.n == n && (n == 0 || memcmp(k->u.s.p, p, n) == 0))
      return &d->v[i];
  }
  return NULL;
}

int gc__tmpl_dict_set(gc__tmpl_heap *h, gc__tmpl_dict *d, gc__tmpl_val key, gc__tmpl_val val) {
  if (!hashable(&key, 0))
    return mr_err_set(h->e, MR_EINVAL, "unhashable type: '%s'", gc__tmpl_type_name(&key));
  gc__tmpl_val *slot = gc__tmpl_dict_get(d, &key);
  if (slot) {
    *slot = val;
    return 0;
  }
  if (d->n == d->cap) {
    /* Arena memory is not given back: growing doubles, so a dict of n items costs
     * under 4n slots in all. */
    size_t cap = d->cap ? d->cap * 2 : 4;
    gc__tmpl_val *k = gc__tmpl_alloc(h, cap * sizeof *k);
    gc__tmpl_val *v = gc__tmpl_alloc(h, cap * sizeof *v);
    if (!k || !v) return h->e->code;
    if (d->n) {
      memcpy(k, d->k, d->n * sizeof *k);
      memcpy(v, d->v, d->n * sizeof *v);
    }
    d->k = k, d->v = v, d->cap = cap;
  }
  d->k[d->n] = key;
  d->v[d->n] = val;
  d->n++;
  return 0;
}

/* ---- truth, equality, order --------------------------------------------------------- */

/* Templates branch on truth ("if message.content", "if tools") and compare roles and
 * indices all the time; each follows Python exactly, including the corners templates
 * do hit: an empty generator is true, "0.0" is a true str, 1 == True, a dict equals a
 * dict of the same items in another order. */

bool gc__tmpl_truthy(const gc__tmpl_val *v) {
  switch (v->kind) {
  case GC__TV_UNDEF:
  case GC__TV_NONE:
    return false;
  case GC__TV_BOOL:
    return v->u.b;
  case GC__TV_INT:
    return v->u.i != 0;
  case GC__TV_FLOAT:
    return v->u.f != 0.0; /* NaN is true, as in Python */
  case GC__TV_STR:
    return v->u.s.n > 0;
  case GC__TV_LIST:
    return v->u.l->flavour == GC__TL_GEN || v->u.l->n > 0;
  case GC__TV_DICT:
    return v->u.d->n > 0;
  case GC__TV_LOOP:
    return v->u.loop->n > 0;
  default: /* namespaces, macros, functions, methods: objects without __bool__ */
    return true;
  }
}

static bool is_num(const gc__tmpl_val *v) {
  return v->kind == GC__TV_BOOL || v->kind == GC__TV_INT || v->kind == GC__TV_FLOAT;
}
static int64_t num_int(const gc__tmpl_val *v) {
  return v->kind == GC__TV_BOOL ? (int64_t)v->u.b : v->u.i;
}

/* Exact three-way comparison of two Python numbers; 2 = unordered (NaN). Python compares
 * an int with a float exactly, not by converting the int to a double (2**53 + 1 > 2.0**53
 * is True): the int is compared with the float's integer part, then the fraction
 * decides. */
static int num_cmp(const gc__tmpl_val *a, const gc__tmpl_val *b) {
  if (a->kind != GC__TV_FLOAT && b->kind != GC__TV_FLOAT) {
    int64_t x = num_int(a), y = num_int(b);
    return x < y ? -1 : x > y;
  }
  if (a->kind == GC__TV_FLOAT && b->kind == GC__TV_FLOAT) {
    double x = a->u.f, y = b->u.f;
    if (isnan(x) || isnan(y)) return 2;
    return x < y ? -1 : x > y;
  }
  /* int against float, exactly (no rounding of the int through double). */
  bool flip = a->kind == GC__TV_FLOAT;
  int64_t i = flip ? num_int(b) : num_int(a);
  double f = flip ? a->u.f : b->u.f;
  int r;
  if (isnan(f)) return 2;
  if (f >= 9223372036854775808.0) {
    r = -1;
  } else if (f < -9223372036854775808.0) {
    r = 1;
  } else {
    double t = trunc(f);
    int64_t ti = (int64_t)t;
    if (i != ti) {
      r = i < ti ? -1 : 1;
    } else {
      r = f > t ? -1 : f < t ? 1 : 0; /* i == trunc(f): the fraction decides */
    }
  }
  return flip ? -r : r;
}

static bool eq_depth(const gc__tmpl_val *a, const gc__tmpl_val *b, int depth);

static bool list_eq(const gc__tmpl_list *x, const gc__tmpl_list *y, int depth) {
  if (x->n != y->n) return false;
  for (size_t i = 0; i < x->n; i++)
    if (!eq_depth(&x->v[i], &y->v[i], depth + 1)) return false;
  return true;
}

static bool dict_eq(const gc__tmpl_dict *x, const gc__tmpl_dict *y, int depth) {
  if (x->n != y->n) return false;
  for (size_t i = 0; i < x->n; i++) {
    const gc__tmpl_val *w = gc__tmpl_dict_get(y, &x->k[i]);
    if (!w || !eq_depth(&x->v[i], w, depth + 1)) return false;
  }
  return true;
}

/* Python's ==. Numbers across kinds by value; a list never equals a tuple; dicts by
 * their items whatever the order; namespaces, macros and generators by identity;
 * jinja2's Undefined equals any undefined. */
static bool eq_depth(const gc__tmpl_val *a, const gc__tmpl_val *b, int depth) {
  if (depth > GC__TMPL_MAX_NEST) return false;
  if (is_num(a) && is_num(b)) return num_cmp(a, b) == 0;
  if (a->kind != b->kind) return false;
  switch (a->kind) {
  case GC__TV_UNDEF: /* Undefined.__eq__: any two undefined values are equal */
  case GC__TV_NONE:
    return true;
  case GC__TV_STR:
    return a->u.s.n == b->u.s.n && (a->u.s.n == 0 || memcmp(a->u.s.p, b->u.s.p, a->u.s.n) == 0);
  case GC__TV_LIST: {
    const gc__tmpl_list *x = a->u.l, *y = b->u.l;
    if (x == y) return true;
    if (x->flavour != y->flavour) return false;
    switch (x->flavour) {
    case GC__TL_LIST:
    case GC__TL_TUPLE:
    case GC__TL_RANGE: /* ranges are equal when they hold the same numbers */
      return list_eq(x, y, depth);
    case GC__TL_KEYS:
    case GC__TL_ITEMS: /* set-like views */
      if (x->n != y->n) return false;
      for (size_t i = 0; i < x->n; i++) {
        bool found = false;
        for (size_t j = 0; j < y->n && !found; j++) found = eq_depth(&x->v[i], &y->v[j], depth + 1);
        if (!found) return false;
      }
      return true;
    default: /* generators and values() views compare by identity */
      return false;
    }
  }
  case GC__TV_DICT:
    return a->u.d == b->u.d || dict_eq(a->u.d, b->u.d, depth);
  case GC__TV_NS:
    return a->u.d == b->u.d;
  case GC__TV_MACRO:
    return a->u.macro == b->u.macro;
  case GC__TV_FUNC:
    return a->aux == b->aux;
  case GC__TV_METHOD:
    return a->aux == b->aux && eq_depth(a->u.self, b->u.self, depth + 1);
  case GC__TV_LOOP:
    return a->u.loop == b->u.loop;
  default:
    return false;
  }
}

bool gc__tmpl_eq(const gc__tmpl_val *a, const gc__tmpl_val *b) { return eq_depth(a, b, 0); }

/* Python's ordering: numbers, str (code point order, which is UTF-8 byte order), and
 * lists with lists / tuples with tuples lexicographically (the first unequal items
 * decide, then the length). Everything else is a TypeError naming both types. */
static int cmp_depth(mr_err *e, const gc__tmpl_val *a, const gc__tmpl_val *b, const char *op,
                     int *res, int depth) {
  if (depth > GC__TMPL_MAX_NEST)
    return mr_err_set(e, MR_EEXHAUSTED, "values nested deeper than %d levels",
                      GC__TMPL_MAX_NEST);
  if (is_num(a) && is_num(b)) {
    *res = num_cmp(a, b);
    return 0;
  }
  if (a->kind == GC__TV_STR && b->kind == GC__TV_STR) {
    size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
    int c = n ? memcmp(a->u.s.p, b->u.s.p, n) : 0;
    *res = c < 0 ? -1 : c > 0 ? 1 : a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n;
    return 0;
  }
  if (a->kind == GC__TV_LIST && b->kind == GC__TV_LIST &&
      a->u.l->flavour == b->u.l->flavour &&
      (a->u.l->flavour == GC__TL_LIST || a->u.l->flavour == GC__TL_TUPLE)) {
    const gc__tmpl_list *x = a->u.l, *y = b->u.l;
    size_t n = x->n < y->n ? x->n : y->n;
    for (size_t i = 0; i < n; i++) {
      if (eq_depth(&x->v[i], &y->v[i], depth + 1)) continue;
      return cmp_depth(e, &x->v[i], &y->v[i], op, res, depth + 1);
    }
    *res = x->n < y->n ? -1 : x->n > y->n;
    return 0;
  }
  return mr_err_set(e, MR_EINVAL, "'%s' not supported between instances of '%s' and '%s'", op,
                    gc__tmpl_type_name(a), gc__tmpl_type_name(b));
}

int gc__tmpl_cmp(mr_err *e, const gc__tmpl_val *a, const gc__tmpl_val *b, const char *opname,
                 int *res) {
  return cmp_depth(e, a, b, opname, res, 0);
}

const char *gc__tmpl_type_name(const gc__tmpl_val *v) {
  static const char *const flavours[] = {"list", "tuple", "generator", "range",
                                         "dict_keys", "dict_values", "dict_items"};
  switch (v->kind) {
  case GC__TV_UNDEF: return "Undefined";
  case GC__TV_NONE: return "NoneType";
  case GC__TV_BOOL: return "bool";
  case GC__TV_INT: return "int";
  case GC__TV_FLOAT: return "float";
  case GC__TV_STR: return (v->flags & GC__TVF_SAFE) ? "Markup" : "str";
  case GC__TV_LIST: return v->u.l->flavour < 7 ? flavours[v->u.l->flavour] : "list";
  case GC__TV_DICT: return "dict";
  case GC__TV_NS: return "TemplateNamespace";
  case GC__TV_MACRO: return "Macro";
  case GC__TV_FUNC: return "function";
  case GC__TV_METHOD: return "builtin_function_or_method";
  case GC__TV_LOOP: return "LoopContext";
  default: return "object";
  }
}

/* jinja2's object_type_repr of a container kind recorded in an undefined (aux2). */
static void container_repr(uint32_t aux2, char *buf, size_t len) {
  gc__tmpl_list l = {.flavour = (uint8_t)(aux2 >> 8)};
  gc__tmpl_val v = {.kind = (uint8_t)(aux2 & 0xff)};
  if (v.kind == GC__TV_LIST) v.u.l = &l;
  if (v.kind == GC__TV_NONE)
    snprintf(buf, len, "None");
  else
    snprintf(buf, len, "%s object", gc__tmpl_type_name(&v));
}

void gc__tmpl_undef_message(const gc__tmpl_val *u, char *buf, size_t len) {
  char type[48];
  int n = (int)(u->u.s.n > 200 ? 200 : u->u.s.n);
  switch (u->aux) {
  case GC__TU_NAME:
    snprintf(buf, len, "'%.*s' is undefined", n, u->u.s.p);
    break;
  case GC__TU_ATTR:
    container_repr(u->aux2, type, sizeof type);
    snprintf(buf, len, "'%s' has no attribute '%.*s'", type, n, u->u.s.p);
    break;
  case GC__TU_ELEM:
    container_repr(u->aux2, type, sizeof type);
    snprintf(buf, len, "%s has no element %" PRId64, type, u->u.i);
    break;
  case GC__TU_HINT:
    snprintf(buf, len, "%.*s", n, u->u.s.p);
    break;
  default:
    snprintf(buf, len, "an undefined value was used");
  }
}

/* ---- str() and repr() ----------------------------------------------------------------- */

/* What {{ x }} prints is Python's str(x): templates print numbers ("loop.index"), None
 * ("{{ message.name }}" when it is null), booleans and, now and then, whole lists or
 * dicts (a tool's arguments without tojson), which appear in the prompt as Python's
 * repr. Every byte of that is the model's input, so each rule of repr is followed. */

/* Python's float repr: the fewest significant digits that read back as the same double
 * (found by trying precisions 1..17, which is what repr's shortest mode produces), then
 * positional notation when the exponent is in [-4, 16), else scientific with at least
 * two exponent digits; a float always shows a point or an exponent ("1.0", "1e+16"). */
size_t gc__tmpl_fmt_float(double f, char *buf) {
  if (isnan(f)) return (size_t)sprintf(buf, "nan");
  if (isinf(f)) return (size_t)sprintf(buf, f < 0 ? "-inf" : "inf");
  /* The shortest digits that read back as f (Python's repr, David Gay's mode 0). */
  char tmp[40];
  int prec;
  for (prec = 1; prec <= 17; prec++) {
    snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
    if (strtod(tmp, NULL) == f) break;
  }
  /* tmp is "[-]d.ddde[+-]XX": collect the digits and the exponent. */
  char digits[24];
  int nd = 0;
  const char *p = tmp;
  bool neg = *p == '-';
  if (neg) p++;
  for (; *p && *p != 'e'; p++)
    if (*p >= '0' && *p <= '9' && nd < 20) digits[nd++] = *p;
  int exp10 = *p == 'e' ? atoi(p + 1) : 0;
  while (nd > 1 && digits[nd - 1] == '0') nd--;
  char *o = buf;
  if (neg) *o++ = '-';
  if (exp10 < -4 || exp10 >= 16) {
    /* 1e-05, 1.5e+16: one digit, the rest after a point, an exponent of >= 2 digits. */
    *o++ = digits[0];
    if (nd > 1) {
      *o++ = '.';
      memcpy(o, digits + 1, (size_t)nd - 1);
      o += nd - 1;
    }
    o += sprintf(o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
  } else if (exp10 >= 0) {
    for (int i = 0; i <= exp10; i++) *o++ = i < nd ? digits[i] : '0';
    *o++ = '.';
    if (nd > exp10 + 1) {
      memcpy(o, digits + exp10 + 1, (size_t)(nd - exp10 - 1));
      o += nd - exp10 - 1;
    } else {
      *o++ = '0';
    }
  } else {
    *o++ = '0';
    *o++ = '.';
    for (int i = 0; i < -exp10 - 1; i++) *o++ = '0';
    memcpy(o, digits, (size_t)nd);
    o += nd;
  }
  *o = '\0';
  return (size_t)(o - buf);
}

/* Python's repr of a str: single quotes unless the text has a single quote and no double
 * one; backslash, the quote, \t \n \r escaped; other non-printable characters as \xHH,
 * \uHHHH or \UHHHHHHHH; printable ones (str.isprintable, tmpl_unicode.c) as they are.
 * Runs of plain bytes are copied in one go. */
static int repr_str(gc__tmpl_sb *b, const char *p, size_t n) {
  bool sq = memchr(p, '\'', n) != NULL, dq = memchr(p, '"', n) != NULL;
  char quote = sq && !dq ? '"' : '\'';
  int rc = gc__tmpl_sb_putc(b, quote);
  size_t run = 0; /* bytes copied as they are, flushed in one put */
  for (size_t i = 0; i < n && !rc;) {
    uint32_t c;
    size_t k = gc__tmpl_u8_next(p + i, n - i, &c);
    char esc[16];
    int el = -1;
    if (c == (uint32_t)quote || c == '\\') {
      el = sprintf(esc, "\\%c", (char)c);
    } else if (c == '\t') {
      el = sprintf(esc, "\\t");
    } else if (c == '\n') {
      el = sprintf(esc, "\\n");
    } else if (c == '\r') {
      el = sprintf(esc, "\\r");
    } else if (!gc__tmpl_uc_printable(c) || (c >= 0xd800 && c <= 0xdfff)) {
      if (c <= 0xff)
        el = sprintf(esc, "\\x%02x", (unsigned)c);
      else if (c <= 0xffff)
        el = sprintf(esc, "\\u%04x", (unsigned)c);
      else
        el = sprintf(esc, "\\U%08x", (unsigned)c);
    }
    if (el >= 0) {
      rc = gc__tmpl_sb_put(b, p + i - run, run);
      run = 0;
      if (!rc) rc = gc__tmpl_sb_put(b, esc, (size_t)el);
    } else {
      run += k;
    }
    i += k;
    if (i == n && !rc) rc = gc__tmpl_sb_put(b, p + i - run, run);
  }
  if (!rc) rc = gc__tmpl_sb_putc(b, quote);
  return rc;
}

/* The namespaces being printed, for Python's "{...}" on a cycle (a namespace holding
 * itself). Printing is single-threaded per render; the stack lives on the C stack. */
typedef struct ns_stack {
  const gc__tmpl_dict *d;
  const struct ns_stack *up;
} ns_stack;

static int repr_depth(gc__tmpl_sb *b, const gc__tmpl_val *v, int depth, const ns_stack *st);

static int repr_items(gc__tmpl_sb *b, const gc__tmpl_list *l, int depth, const ns_stack *st) {
  int rc = 0;
  for (size_t i = 0; i < l->n && !rc; i++) {
    if (i) rc = gc__tmpl_sb_put(b, ", ", 2);
    if (!rc) rc = repr_depth(b, &l->v[i], depth + 1, st);
  }
  return rc;
}

static int repr_dict(gc__tmpl_sb *b, const gc__tmpl_dict *d, int depth, const ns_stack *st) {
  int rc = gc__tmpl_sb_putc(b, '{');
  for (size_t i = 0; i < d->n && !rc; i++) {
    if (i) rc = gc__tmpl_sb_put(b, ", ", 2);
    if (!rc) rc = repr_depth(b, &d->k[i], depth + 1, st);
    if (!rc) rc = gc__tmpl_sb_put(b, ": ", 2);
    if (!rc) rc = repr_depth(b, &d->v[i], depth + 1, st);
  }
  return rc ? rc : gc__tmpl_sb_putc(b, '}');
}

/* repr(v), as str() of a container prints its items: lists [..], tuples (..) with the
 * one-item comma, range(a, b[, s]), dict views dict_keys([..]), dicts {k: v}, jinja2's
 * <Namespace {..}>, <Macro 'name'>, <LoopContext i/n>, and Undefined. Values Python
 * shows by address (generators, functions) fail: no stable text exists. */
static int repr_depth(gc__tmpl_sb *b, const gc__tmpl_val *v, int depth, const ns_stack *st) {
  if (depth > GC__TMPL_MAX_NEST)
    return mr_err_set(b->e, MR_EEXHAUSTED, "values nested deeper than %d levels",
                      GC__TMPL_MAX_NEST);
  char num[40];
  switch (v->kind) {
  case GC__TV_UNDEF:
    return gc__tmpl_sb_put(b, "Undefined", 9);
  case GC__TV_STR:
    return repr_str(b, v->u.s.p, v->u.s.n);
  case GC__TV_LIST: {
    const gc__tmpl_list *l = v->u.l;
    int rc;
    switch (l->flavour) {
    case GC__TL_LIST:
      rc = gc__tmpl_sb_putc(b, '[');
      if (!rc) rc = repr_items(b, l, depth, st);
      return rc ? rc : gc__tmpl_sb_putc(b, ']');
    case GC__TL_TUPLE:
      rc = gc__tmpl_sb_putc(b, '(');
      if (!rc) rc = repr_items(b, l, depth, st);
      if (!rc && l->n == 1) rc = gc__tmpl_sb_putc(b, ',');
      return rc ? rc : gc__tmpl_sb_putc(b, ')');
    case GC__TL_RANGE:
      if (l->step == 1)
        return gc__tmpl_sb_printf(b, "range(%" PRId64 ", %" PRId64 ")", l->start, l->stop);
      return gc__tmpl_sb_printf(b, "range(%" PRId64 ", %" PRId64 ", %" PRId64 ")", l->start,
                                l->stop, l->step);
    case GC__TL_KEYS:
    case GC__TL_VALUES:
    case GC__TL_ITEMS:
      rc = gc__tmpl_sb_printf(b, "%s([", l->flavour == GC__TL_KEYS     ? "dict_keys"
                                         : l->flavour == GC__TL_VALUES ? "dict_values"
                                                                       : "dict_items");
      if (!rc) rc = repr_items(b, l, depth, st);
      return rc ? rc : gc__tmpl_sb_put(b, "])", 2);
    default:
      return mr_err_set(b->e, MR_EINVAL,
                        "cannot print a generator (Python prints its memory address); "
                        "convert it with |list");
    }
  }
  case GC__TV_DICT:
    return repr_dict(b, v->u.d, depth, st);
  case GC__TV_NS: {
    for (const ns_stack *s = st; s; s = s->up)
      if (s->d == v->u.d) return gc__tmpl_sb_put(b, "<Namespace {...}>", 17);
    ns_stack here = {v->u.d, st};
    int rc = gc__tmpl_sb_put(b, "<Namespace ", 11);
    if (!rc) rc = repr_dict(b, v->u.d, depth, &here);
    return rc ? rc : gc__tmpl_sb_putc(b, '>');
  }
  case GC__TV_MACRO:
    return gc__tmpl_sb_printf(b, "<Macro '%.*s'>", (int)v->u.macro->val.u.s.n,
                              v->u.macro->val.u.s.p);
  case GC__TV_LOOP:
    return gc__tmpl_sb_printf(b, "<LoopContext %zu/%zu>", v->u.loop->i + 1, v->u.loop->n);
  case GC__TV_FUNC:
  case GC__TV_METHOD:
    return mr_err_set(b->e, MR_EINVAL, "cannot print a %s (Python prints its memory address)",
                      gc__tmpl_type_name(v));
  case GC__TV_FLOAT: {
    size_t k = gc__tmpl_fmt_float(v->u.f, num);
    return gc__tmpl_sb_put(b, num, k);
  }
  default:
    return gc__tmpl_str_put(b, v);
  }
}

int gc__tmpl_repr_put(gc__tmpl_sb *b, const gc__tmpl_val *v) { return repr_depth(b, v, 0, NULL); }

/* Python's str(): scalars in their own text, a str as it is, undefined as nothing (the
 * default Undefined's __str__), containers as repr. */
int gc__tmpl_str_put(gc__tmpl_sb *b, const gc__tmpl_val *v) {
  char num[40];
  switch (v->kind) {
  case GC__TV_UNDEF:
    return 0;
  case GC__TV_NONE:
    return gc__tmpl_sb_put(b, "None", 4);
  case GC__TV_BOOL:
    return v->u.b ? gc__tmpl_sb_put(b, "True", 4) : gc__tmpl_sb_put(b, "False", 5);
  case GC__TV_INT:
    return gc__tmpl_sb_printf(b, "%" PRId64, v->u.i);
  case GC__TV_FLOAT: {
    size_t k = gc__tmpl_fmt_float(v->u.f, num);
    return gc__tmpl_sb_put(b, num, k);
  }
  case GC__TV_STR:
    return gc__tmpl_sb_put(b, v->u.s.p, v->u.s.n);
  default:
    return gc__tmpl_repr_put(b, v);
  }
}

int gc__tmpl_sb_take(gc__tmpl_heap *h, gc__tmpl_sb *b, int rc, gc__tmpl_val *out) {
  if (!rc) {
    char *p = gc__tmpl_memdup(h, b->p ? b->p : "", b->n);
    if (!p)
      rc = h->e->code;
    else
      *out = gc__tmpl_strv(p, b->n);
  }
  gc__tmpl_sb_free(b);
  return rc;
}

int gc__tmpl_to_str(gc__tmpl_heap *h, const gc__tmpl_val *v, gc__tmpl_val *out) {
  if (v->kind == GC__TV_STR) {
    *out = gc__tmpl_strv(v->u.s.p, v->u.s.n);
    return 0;
  }
  if (v->kind == GC__TV_UNDEF) {
    *out = gc__tmpl_strv("", 0);
    return 0;
  }
  gc__tmpl_sb b;
  gc__tmpl_sb_init(&b, h->limit, "memory", h->e);
  return gc__tmpl_sb_take(h, &b, gc__tmpl_str_put(&b, v), out);
}

/* ---- tojson --------------------------------------------------------------------------- */

/* Tools and tool-call arguments reach the model as tojson text: the same key order as
 * the input (no sorting unless asked), ", " and ": " separators, non-ASCII kept, floats
 * as Python prints them (1.0 stays 1.0). */

/* A JSON string as Python's json module writes it: " \\ \n \r \t \b \f escaped by
 * name, other bytes below 0x20 as \u00XX (lower-case hex); with ensure_ascii also DEL
 * and everything above it as \uXXXX (surrogate pairs above U+FFFF); UTF-8 otherwise
 * copied as it is (transformers' tojson has ensure_ascii=False). */
static int json_str(gc__tmpl_sb *b, const char *p, size_t n, bool ascii) {
  int rc = gc__tmpl_sb_putc(b, '"');
  size_t run = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    unsigned char c = (unsigned char)p[i];
    char esc[16];
    int el = -1;
    if (ascii && c >= 0x7f) {
      /* ensure_ascii: \uXXXX, a surrogate pair above U+FFFF. */
      uint32_t cp;
      size_t k = gc__tmpl_u8_next(p + i, n - i, &cp);
      if (cp >= 0x10000)
        el = sprintf(esc, "\\u%04x\\u%04x", 0xd800 + ((cp - 0x10000) >> 10),
                     0xdc00 + ((cp - 0x10000) & 0x3ff));
      else
        el = sprintf(esc, "\\u%04x", (unsigned)cp);
      rc = gc__tmpl_sb_put(b, p + i - run, run);
      run = 0;
      if (!rc) rc = gc__tmpl_sb_put(b, esc, (size_t)el);
      i += k - 1;
      continue;
    }
    switch (c) {
    case '"': el = sprintf(esc, "\\\""); break;
    case '\\': el = sprintf(esc, "\\\\"); break;
    case '\n': el = sprintf(esc, "\\n"); break;
    case '\r': el = sprintf(esc, "\\r"); break;
    case '\t': el = sprintf(esc, "\\t"); break;
    case '\b': el = sprintf(esc, "\\b"); break;
    case '\f': el = sprintf(esc, "\\f"); break;
    default:
      if (c < 0x20) el = sprintf(esc, "\\u%04x", c);
    }
    if (el >= 0) {
      rc = gc__tmpl_sb_put(b, p + i - run, run);
      run = 0;
      if (!rc) rc = gc__tmpl_sb_put(b, esc, (size_t)el);
    } else {
      run++;
    }
  }
  if (!rc) rc = gc__tmpl_sb_put(b, p + n - run, run);
  return rc ? rc : gc__tmpl_sb_putc(b, '"');
}

/* float.__repr__, and json's NaN / Infinity / -Infinity for the values JSON lacks. */
static int json_float(gc__tmpl_sb *b, double f) {
  if (isnan(f)) return gc__tmpl_sb_put(b, "NaN", 3);
  if (isinf(f)) return f < 0 ? gc__tmpl_sb_put(b, "-Infinity", 9) : gc__tmpl_sb_put(b, "Infinity", 8);
  char num[40];
  size_t k = gc__tmpl_fmt_float(f, num);
  return gc__tmpl_sb_put(b, num, k);
}

/* With an indent, json puts each item on a line of its own, indented by level. */
static int json_newline(gc__tmpl_sb *b, const gc__tmpl_json_opts *o, int level) {
  int rc = gc__tmpl_sb_putc(b, '\n');
  for (int i = 0; i < level && !rc; i++) rc = gc__tmpl_sb_put(b, o->indent->p, o->indent->n);
  return rc;
}

/* The text of a dict key as json.dumps writes it, or MR_EINVAL for a key kind it
 * refuses. */
static int json_key(gc__tmpl_sb *b, const gc__tmpl_val *k, bool a) {
  char num[40];
  size_t n;
  switch (k->kind) {
  case GC__TV_STR: return json_str(b, k->u.s.p, k->u.s.n, a);
  case GC__TV_BOOL: return json_str(b, k->u.b ? "true" : "false", k->u.b ? 4 : 5, a);
  case GC__TV_NONE: return json_str(b, "null", 4, a);
  case GC__TV_INT:
    n = (size_t)sprintf(num, "%" PRId64, k->u.i);
    return json_str(b, num, n, a);
  case GC__TV_FLOAT:
    if (isnan(k->u.f)) return json_str(b, "NaN", 3, a);
    if (isinf(k->u.f)) return json_str(b, k->u.f < 0 ? "-Infinity" : "Infinity", k->u.f < 0 ? 9 : 8, a);
    n = gc__tmpl_fmt_float(k->u.f, num);
    return json_str(b, num, n, a);
  default:
    return mr_err_set(b->e, MR_EINVAL, "keys must be str, int, float, bool or None, not %s",
                      gc__tmpl_type_name(k));
  }
}

static int json_val(gc__tmpl_sb *b, gc__tmpl_heap *h, const gc__tmpl_val *v,
                    const gc__tmpl_json_opts *o, int level);

/* {} stays "{}" even with an indent; otherwise "{", the items separated by item_sep
 * (each on its own line with an indent), key_sep between key and value, "}". */
static int json_dict(gc__tmpl_sb *b, gc__tmpl_heap *h, const gc__tmpl_dict *d,
                     const gc__tmpl_json_opts *o, int level) {
  if (d->n == 0) return gc__tmpl_sb_put(b, "{}", 2);
  /* sort_keys sorts the items like Python's sorted(d.items()); keys are distinct, so the
   * keys alone decide, and keys of kinds without an order fail as in Python. */
  size_t *order = mr_malloc(d->n * sizeof *order);
  if (!order) return mr_err_set(b->e, MR_ENOMEM, "out of memory");
  int rc = 0;
  for (size_t i = 0; i < d->n; i++) order[i] = i;
  if (o->sort_keys) {
    /* Insertion sort: stable, and each comparison may fail (TypeError). Dicts in
     * chat templates hold tens of keys. */
    for (size_t i = 1; i < d->n && !rc; i++) {
      size_t x = order[i], j = i;
      while (j > 0) {
        int r = 0;
        rc = gc__tmpl_cmp(b->e, &d->k[x], &d->k[order[j - 1]], "<", &r);
        if (rc || r != -1) break;
        order[j] = order[j - 1];
        j--;
      }
      order[j] = x;
    }
  }
  if (!rc) rc = gc__tmpl_sb_putc(b, '{');
  for (size_t i = 0; i < d->n && !rc; i++) {
    size_t x = order[i];
    if (i) rc = gc__tmpl_sb_put(b, o->item_sep.p, o->item_sep.n);
    if (!rc && o->indent) rc = json_newline(b, o, level + 1);
    if (!rc) rc = json_key(b, &d->k[x], o->ensure_ascii);
    if (!rc) rc = gc__tmpl_sb_put(b, o->key_sep.p, o->key_sep.n);
    if (!rc) rc = json_val(b, h, &d->v[x], o, level + 1);
  }
  if (!rc && o->indent) rc = json_newline(b, o, level);
  if (!rc) rc = gc__tmpl_sb_putc(b, '}');
  mr_free(order);
  return rc;
}

/* json.dumps of one value: JSON's types and tuples (as arrays); what json cannot encode
 * (undefined, generators, ranges, views, namespaces, macros) is its TypeError. */
static int json_val(gc__tmpl_sb *b, gc__tmpl_heap *h, const gc__tmpl_val *v,
                    const gc__tmpl_json_opts *o, int level) {
  if (level > GC__TMPL_MAX_NEST)
    return mr_err_set(b->e, MR_EEXHAUSTED, "values nested deeper than %d levels",
                      GC__TMPL_MAX_NEST);
  switch (v->kind) {
  case GC__TV_NONE: return gc__tmpl_sb_put(b, "null", 4);
  case GC__TV_BOOL: return v->u.b ? gc__tmpl_sb_put(b, "true", 4) : gc__tmpl_sb_put(b, "false", 5);
  case GC__TV_INT: return gc__tmpl_sb_printf(b, "%" PRId64, v->u.i);
  case GC__TV_FLOAT: return json_float(b, v->u.f);
  case GC__TV_STR: return json_str(b, v->u.s.p, v->u.s.n, o->ensure_ascii);
  case GC__TV_DICT: return json_dict(b, h, v->u.d, o, level);
  case GC__TV_LIST:
    if (v->u.l->flavour == GC__TL_LIST || v->u.l->flavour == GC__TL_TUPLE) {
      const gc__tmpl_list *l = v->u.l;
      if (l->n == 0) return gc__tmpl_sb_put(b, "[]", 2);
      int rc = gc__tmpl_sb_putc(b, '[');
      for (size_t i = 0; i < l->n && !rc; i++) {
        if (i) rc = gc__tmpl_sb_put(b, o->item_sep.p, o->item_sep.n);
        if (!rc && o->indent) rc = json_newline(b, o, level + 1);
        if (!rc) rc = json_val(b, h, &l->v[i], o, level + 1);
      }
      if (!rc && o->indent) rc = json_newline(b, o, level);
      return rc ? rc : gc__tmpl_sb_putc(b, ']');
    }
    __attribute__((fallthrough)); /* ranges, generators and views are not serializable */
  default:
    return mr_err_set(b->e, MR_EINVAL, "Object of type %s is not JSON serializable",
                      gc__tmpl_type_name(v));
  }
}

int gc__tmpl_tojson_put(gc__tmpl_sb *b, gc__tmpl_heap *h, const gc__tmpl_val *v,
                        const gc__tmpl_json_opts *o) {
  return json_val(b, h, v, o, 0);
}

/* ---- JSON text -> values (Python's json.loads) ------------------------------------------ */

/* A recursive-descent reader with json.loads' grammar: RFC 8259 plus NaN, Infinity and
 * -Infinity; control characters inside strings are errors (strict mode); numbers with a
 * fraction or an exponent are floats, the others ints. */
typedef struct jreader {
  const char *p;
  size_t n, i;
  gc__tmpl_heap *h;
} jreader;

static int jfail(jreader *r, const char *what) {
  return mr_err_set(r->h->e, MR_EFORMAT, "variables: %s at byte %zu", what, r->i);
}

static void jws(jreader *r) {
  while (r->i < r->n && (r->p[r->i] == ' ' || r->p[r->i] == '\t' || r->p[r->i] == '\n' ||
                         r->p[r->i] == '\r'))
    r->i++;
}

static bool jlit(jreader *r, const char *lit) {
  size_t k = strlen(lit);
  if (r->n - r->i < k || memcmp(r->p + r->i, lit, k) != 0) return false;
  r->i += k;
  return true;
}

static int jhex4(jreader *r, uint32_t *out) {
  if (r->n - r->i < 4) return jfail(r, "truncated \\u escape");
  uint32_t v = 0;
  for (int k = 0; k < 4; k++) {
    char c = r->p[r->i + (size_t)k];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
    else return jfail(r, "invalid \\u escape");
  }
  r->i += 4;
  *out = v;
  return 0;
}

/* A string: the text itself when it has no escapes (no copy), else decoded into the
 * heap. The opening quote is at r->i. */
static int jstring(jreader *r, gc__tmpl_val *out) {
  r->i++; /* the opening quote */
  size_t start = r->i;
  bool plain = true;
  /* First pass: find the end; strings without escapes are not copied. */
  for (;;) {
    if (r->i >= r->n) return jfail(r, "unterminated string");
    unsigned char c = (unsigned char)r->p[r->i];
    if (c == '"') break;
    if (c < 0x20) return jfail(r, "control character in a string");
    if (c == '\\') {
      plain = false;
      r->i++;
      if (r->i >= r->n) return jfail(r, "unterminated string");
    }
    r->i++;
  }
  size_t end = r->i;
  r->i++;
  if (plain) {
    *out = gc__tmpl_strv(r->p + start, end - start);
    return 0;
  }
  char *buf = gc__tmpl_alloc(r->h, end - start + 1);
  if (!buf) return r->h->e->code;
  size_t o = 0;
  size_t save = r->i;
  for (r->i = start; r->i < end;) {
    char c = r->p[r->i++];
    if (c != '\\') {
      buf[o++] = c;
      continue;
    }
    char x = r->p[r->i++];
    switch (x) {
    case '"': buf[o++] = '"'; break;
    case '\\': buf[o++] = '\\'; break;
    case '/': buf[o++] = '/'; break;
    case 'b': buf[o++] = '\b'; break;
    case 'f': buf[o++] = '\f'; break;
    case 'n': buf[o++] = '\n'; break;
    case 'r': buf[o++] = '\r'; break;
    case 't': buf[o++] = '\t'; break;
    case 'u': {
      uint32_t cp, lo;
      int rc = jhex4(r, &cp);
      if (rc) return rc;
      /* A high surrogate followed by \u low surrogate is one code point; a lone one
       * stays a surrogate, as in Python (6 bytes of escape give at most 4 of UTF-8). */
      if (cp >= 0xd800 && cp <= 0xdbff && end - r->i >= 6 && r->p[r->i] == '\\' &&
          r->p[r->i + 1] == 'u') {
        size_t back = r->i;
        r->i += 2;
        if (jhex4(r, &lo) == 0 && lo >= 0xdc00 && lo <= 0xdfff)
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        else
          r->i = back;
        mr_err_clear(r->h->e);
      }
      o += gc__tmpl_u8_put(cp, buf + o);
      break;
    }
    default:
      r->i -= 2;
      return jfail(r, "invalid escape in a string");
    }
  }
  r->i = save;
  buf[o] = '\0';
  *out = gc__tmpl_strv(buf, o);
  return 0;
}

/* A number: -?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?, or -Infinity. A "." or "e" not
 * followed by digits is not part of it (and then fails as extra data). */
static int jnumber(jreader *r, gc__tmpl_val *out) {
  size_t s = r->i;
  if (r->p[r->i] == '-') r->i++;
  if (r->i < r->n && r->p[r->i] == 'I') {
    if (!jlit(r, "Infinity")) return jfail(r, "invalid number");
    *out = gc__tmpl_float(-INFINITY);
    return 0;
  }
  if (r->i >= r->n || r->p[r->i] < '0' || r->p[r->i] > '9') return jfail(r, "invalid number");
  if (r->p[r->i] == '0')
    r->i++;
  else
    while (r->i < r->n && r->p[r->i] >= '0' && r->p[r->i] <= '9') r->i++;
  bool isf = false;
  if (r->i + 1 < r->n && r->p[r->i] == '.' && r->p[r->i + 1] >= '0' && r->p[r->i + 1] <= '9') {
    isf = true;
    r->i++;
    while (r->i < r->n && r->p[r->i] >= '0' && r->p[r->i] <= '9') r->i++;
  }
  if (r->i < r->n && (r->p[r->i] == 'e' || r->p[r->i] == 'E')) {
    size_t e = r->i + 1;
    if (e < r->n && (r->p[e] == '+' || r->p[e] == '-')) e++;
    if (e < r->n && r->p[e] >= '0' && r->p[e] <= '9') {
      isf = true;
      r->i = e;
      while (r->i < r->n && r->p[r->i] >= '0' && r->p[r->i] <= '9') r->i++;
    }
  }
  char tmp[64];
  size_t len = r->i - s;
  if (isf) {
    /* strtod needs a NUL; a number longer than tmp is read from a heap copy. */
    char *q = len < sizeof tmp ? tmp : gc__tmpl_memdup(r->h, r->p + s, len);
    if (!q) return r->h->e->code;
    if (q == tmp) memcpy(tmp, r->p + s, len), tmp[len] = '\0';
    *out = gc__tmpl_float(strtod(q, NULL));
    return 0;
  }
  if (len >= sizeof tmp) return mr_err_set(r->h->e, MR_ERANGE, "variables: integer at byte %zu beyond 64 bits", s);
  memcpy(tmp, r->p + s, len);
  tmp[len] = '\0';
  char *endp;
  errno = 0;
  long long v = strtoll(tmp, &endp, 10);
  if (errno == ERANGE)
    return mr_err_set(r->h->e, MR_ERANGE, "variables: integer %s at byte %zu beyond 64 bits", tmp, s);
  *out = gc__tmpl_int((int64_t)v);
  return 0;
}

static int jvalue(jreader *r, gc__tmpl_val *out, int depth) {
  if (depth > GC__TMPL_MAX_NEST)
    return mr_err_set(r->h->e, MR_ERANGE, "variables: nested deeper than %d levels at byte %zu",
                      GC__TMPL_MAX_NEST, r->i);
  jws(r);
  if (r->i >= r->n) return jfail(r, "expected a value");
  char c = r->p[r->i];
  int rc;
  if (c == '{') {
    r->i++;
    rc = gc__tmpl_dict_new(r->h, 0, false, out);
    if (rc) return rc;
    jws(r);
    if (r->i < r->n && r->p[r->i] == '}') {
      r->i++;
      return 0;
    }
    for (;;) {
      jws(r);
      if (r->i >= r->n || r->p[r->i] != '"') return jfail(r, "expected a key string");
      gc__tmpl_val k, v;
      if ((rc = jstring(r, &k))) return rc;
      jws(r);
      if (r->i >= r->n || r->p[r->i] != ':') return jfail(r, "expected ':'");
      r->i++;
      if ((rc = jvalue(r, &v, depth + 1))) return rc;
      if ((rc = gc__tmpl_dict_set(r->h, out->u.d, k, v))) return rc;
      jws(r);
      if (r->i < r->n && r->p[r->i] == ',') {
        r->i++;
        continue;
      }
      if (r->i < r->n && r->p[r->i] == '}') {
        r->i++;
        return 0;
      }
      return jfail(r, "expected ',' or '}'");
    }
  }
  if (c == '[') {
    r->i++;
    /* Items go to a growing scratch array first (the count is unknown). */
    size_t n = 0, cap = 8;
    gc__tmpl_val *items = gc__tmpl_alloc(r->h, cap * sizeof *items);
    if (!items) return r->h->e->code;
    jws(r);
    if (r->i < r->n && r->p[r->i] == ']') {
      r->i++;
    } else {
      for (;;) {
        if (n == cap) {
          gc__tmpl_val *g = gc__tmpl_alloc(r->h, 2 * cap * sizeof *g);
          if (!g) return r->h->e->code;
          memcpy(g, items, n * sizeof *g);
          items = g, cap *= 2;
        }
        if ((rc = jvalue(r, &items[n], depth + 1))) return rc;
        n++;
        jws(r);
        if (r->i < r->n && r->p[r->i] == ',') {
          r->i++;
          continue;
        }
        if (r->i < r->n && r->p[r->i] == ']') {
          r->i++;
          break;
        }
        return jfail(r, "expected ',' or ']'");
      }
    }
    if ((rc = gc__tmpl_list_new(r->h, 0, GC__TL_LIST, out))) return rc;
    out->u.l->v = items;
    out->u.l->n = n;
    return 0;
  }
  if (c == '"') return jstring(r, out);
  if (c == '-' || (c >= '0' && c <= '9')) return jnumber(r, out);
  if (jlit(r, "true")) {
    *out = gc__tmpl_bool(true);
    return 0;
  }
  if (jlit(r, "false")) {
    *out = gc__tmpl_bool(false);
    return 0;
  }
  if (jlit(r, "null")) {
    *out = gc__tmpl_none();
    return 0;
  }
  if (jlit(r, "NaN")) {
    *out = gc__tmpl_float(NAN);
    return 0;
  }
  if (jlit(r, "Infinity")) {
    *out = gc__tmpl_float(INFINITY);
    return 0;
  }
  return jfail(r, "expected a value");
}

int gc__tmpl_json_parse(gc__tmpl_heap *h, const char *p, size_t n, gc__tmpl_val *out) {
  size_t bad;
  if (!gc__tmpl_u8_valid(p, n, &bad))
    return mr_err_set(h->e, MR_EFORMAT, "variables: invalid UTF-8 at byte %zu", bad);
  jreader r = {p, n, 0, h};
  int rc = jvalue(&r, out, 0);
  if (rc) return rc;
  jws(&r);
  if (r.i != n) return jfail(&r, "extra data after the value");
  return 0;
}

/* ---- cJSON -> values ------------------------------------------------------------------- */

/* A cJSON item as a value. cJSON keeps numbers as doubles only, so an integral number
 * within 2^53 becomes an int (what JSON text usually meant), others a float; a Raw item
 * is read as JSON text, which is how a caller keeps "1.0" a float. */
static int cj_value(gc__tmpl_heap *h, const cJSON *j, gc__tmpl_val *out, int depth) {
  if (depth > GC__TMPL_MAX_NEST)
    return mr_err_set(h->e, MR_ERANGE, "variables: nested deeper than %d levels",
                      GC__TMPL_MAX_NEST);
  int rc;
  switch (j->type & 0xff) {
  case cJSON_False: *out = gc__tmpl_bool(false); return 0;
  case cJSON_True: *out = gc__tmpl_bool(true); return 0;
  case cJSON_NULL: *out = gc__tmpl_none(); return 0;
  case cJSON_Number: {
    double d = j->valuedouble;
    if (d == trunc(d) && fabs(d) <= 9007199254740992.0)
      *out = gc__tmpl_int((int64_t)d);
    else
      *out = gc__tmpl_float(d);
    return 0;
  }
  case cJSON_String:
  case cJSON_Raw: {
    const char *s = j->valuestring ? j->valuestring : "";
    if ((j->type & 0xff) == cJSON_Raw) return gc__tmpl_json_parse(h, s, strlen(s), out);
    *out = gc__tmpl_strv(s, strlen(s));
    return 0;
  }
  case cJSON_Array: {
    size_t n = 0;
    for (const cJSON *c = j->child; c; c = c->next) n++;
    if ((rc = gc__tmpl_list_new(h, n, GC__TL_LIST, out))) return rc;
    size_t i = 0;
    for (const cJSON *c = j->child; c; c = c->next, i++)
      if ((rc = cj_value(h, c, &out->u.l->v[i], depth + 1))) return rc;
    return 0;
  }
  case cJSON_Object: {
    size_t n = 0;
    for (const cJSON *c = j->child; c; c = c->next) n++;
    if ((rc = gc__tmpl_dict_new(h, n, false, out))) return rc;
    for (const cJSON *c = j->child; c; c = c->next) {
      gc__tmpl_val v;
      const char *k = c->string ? c->string : "";
      if ((rc = cj_value(h, c, &v, depth + 1))) return rc;
      if ((rc = gc__tmpl_dict_set(h, out->u.d, gc__tmpl_strv(k, strlen(k)), v))) return rc;
    }
    return 0;
  }
  default:
    return mr_err_set(h->e, MR_EINVAL, "variables: invalid cJSON item (type %d)", j->type);
  }
}

int gc__tmpl_from_cjson(gc__tmpl_heap *h, const cJSON *j, gc__tmpl_val *out) {
  return cj_value(h, j, out, 0);
}

/* ---- places ------------------------------------------------------------------------------ */

/* Lines and columns count from 1, columns in code points, as an editor shows them. The
 * place is computed only when a message needs it, so tokens and nodes keep a byte
 * offset alone. */
void gc__tmpl_where(const char *origin, const char *src, size_t len, uint32_t pos, char *buf,
                    size_t buflen) {
  unsigned line = 1, col = 1;
  if (pos > len) pos = (uint32_t)len;
  for (size_t i = 0; i < pos;) {
    if (src[i] == '\n') {
      line++, col = 1, i++;
      continue;
    }
    uint32_t cp;
    i += gc__tmpl_u8_next(src + i, pos - i, &cp);
    col++;
  }
  snprintf(buf, buflen, "%s:%u:%u", origin, line, col);
}
