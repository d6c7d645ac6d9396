/*
 * tmpl_rt.c - the runtime of one render of the chat-template interpreter, what the
 * builtins (tmpl_builtin.c) and the tree walker (tmpl_eval.c) both stand on: errors
 * located at a node and the limits of a render, attribute and item lookup as jinja2's
 * sandboxed environment does it (getattr, getitem, slices), iteration and `in`.
 *
 * Errors: every failure is located once, at the innermost node that saw it
 * ("origin:line:col: message"); raise_exception's message stays bare.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "gpu_client/runner/tmpl_internal.h"

/* ---- errors and limits ------------------------------------------------------------- */

gc__tmpl_heap *gc__tmpl_rt_heap(gc__tmpl_rt *rt) { return rt->h; }

int gc__tmpl_rt_locate(gc__tmpl_rt *rt, const gc__tmpl_node *n, int code) {
  if (rt->located) return code;
  rt->located = true;
  if (!n) return code; /* a message that must stay bare (raise_exception) */
  char where[128];
  gc__tmpl_where(rt->t->origin, rt->t->src, rt->t->len, n->pos, where, sizeof where);
  return mr_err_prefix(rt->e, code, "%s", where);
}

/* A failure found here (not below): the message replaces whatever was in the record and
 * is located at n at once. */
int gc__tmpl_rt_fail(gc__tmpl_rt *rt, const gc__tmpl_node *n, int code, const char *fmt, ...) {
  char msg[448];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  rt->located = false;
  mr_err_set(rt->e, code, "%s", msg);
  return gc__tmpl_rt_locate(rt, n, code);
}

/* Using an undefined value where jinja2's Undefined raises (its attributes, items,
 * arithmetic, calls): its UndefinedError message, which says how it came to be. */
int gc__tmpl_rt_undef(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *u) {
  char msg[320];
  gc__tmpl_undef_message(u, msg, sizeof msg);
  return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "%s", msg);
}

/* A failure kept for later (a lazy generator's): the message moves to the heap, the
 * record and the "located" flag are cleared so that evaluation goes on. */
const char *gc__tmpl_rt_take_error(gc__tmpl_rt *rt, int *code) {
  char *msg = gc__tmpl_memdup(rt->h, rt->e->msg, strlen(rt->e->msg));
  if (!msg) return NULL;
  *code = rt->e->code;
  mr_err_clear(rt->e);
  rt->located = false;
  return msg;
}

int gc__tmpl_rt_raise(gc__tmpl_rt *rt, int code, const char *msg) {
  mr_err_set(rt->e, code, "%s", msg);
  rt->located = true;
  return code;
}

/* One unit of the step budget: every loop iteration (filtering ones too) and every macro
 * call. With loops bounded by their iterables, which are bounded by memory, this bounds
 * the time of a render whatever the template does. */
int gc__tmpl_rt_step(gc__tmpl_rt *rt, const gc__tmpl_node *n) {
  if (++rt->steps > rt->max_steps)
    return gc__tmpl_rt_fail(rt, n, MR_EEXHAUSTED,
                            "step limit of %" PRIu64 " loop iterations and macro calls reached",
                            rt->max_steps);
  return 0;
}

/* ---- lookups: jinja2's environment.getattr / getitem ------------------------------------ */

/* Templates read the conversation through .attr and [key], and jinja2's rules for them
 * decide what a template sees when a key is missing (undefined, printed as nothing),
 * when a dict key is also a method name (the method), or when an index is out of range
 * (undefined). Most template logic ("message.tool_calls is defined", "messages[0].role")
 * rests on these rules. */

/* Undefined values that remember where they came from, for jinja2's messages ("'dict
 * object' has no attribute 'x'", "list object has no element 5"). The container's kind
 * (and list flavour) is kept, not the container. */
static gc__tmpl_val undef_attr(const gc__tmpl_val *obj, const char *p, size_t n) {
  uint32_t kind = obj->kind;
  if (obj->kind == GC__TV_LIST) kind |= (uint32_t)obj->u.l->flavour << 8;
  return (gc__tmpl_val){.kind = GC__TV_UNDEF, .aux = GC__TU_ATTR, .aux2 = kind, .u.s = {p, n}};
}

static gc__tmpl_val undef_elem(const gc__tmpl_val *obj, int64_t i) {
  uint32_t kind = obj->kind;
  if (obj->kind == GC__TV_LIST) kind |= (uint32_t)obj->u.l->flavour << 8;
  return (gc__tmpl_val){.kind = GC__TV_UNDEF, .aux = GC__TU_ELEM, .aux2 = kind, .u.i = i};
}

static bool str_eq(const char *p, size_t n, const char *lit) {
  size_t k = strlen(lit);
  return n == k && memcmp(p, lit, k) == 0;
}

/* A bound method value (obj.method without the call): Python's attribute lookup finds
 * the method first, so `d.items` is the method even when d has a key "items". */
static int method_value(gc__tmpl_rt *rt, const gc__tmpl_val *obj, uint16_t id,
                        gc__tmpl_val *out) {
  gc__tmpl_val *self = gc__tmpl_alloc(rt->h, sizeof *self);
  if (!self) return rt->e->code;
  *self = *obj;
  *out = (gc__tmpl_val){.kind = GC__TV_METHOD, .aux = id, .u.self = self};
  return 0;
}

/* jinja2's LoopContext attributes. previtem / nextitem are undefined at the ends; an
 * unknown attribute is undefined (LoopContext has neither it nor items). changed() is a
 * method outside the subset. */
static int loop_attr(gc__tmpl_rt *rt, const gc__tmpl_val *obj, const char *p, size_t n,
                     gc__tmpl_val *out) {
  const gc__tmpl_loop *L = obj->u.loop;
  if (str_eq(p, n, "index")) *out = gc__tmpl_int((int64_t)L->i + 1);
  else if (str_eq(p, n, "index0")) *out = gc__tmpl_int((int64_t)L->i);
  else if (str_eq(p, n, "revindex")) *out = gc__tmpl_int((int64_t)(L->n - L->i));
  else if (str_eq(p, n, "revindex0")) *out = gc__tmpl_int((int64_t)(L->n - L->i - 1));
  else if (str_eq(p, n, "first")) *out = gc__tmpl_bool(L->i == 0);
  else if (str_eq(p, n, "last")) *out = gc__tmpl_bool(L->i + 1 == L->n);
  else if (str_eq(p, n, "length")) *out = gc__tmpl_int((int64_t)L->n);
  else if (str_eq(p, n, "depth")) *out = gc__tmpl_int(1);
  else if (str_eq(p, n, "depth0")) *out = gc__tmpl_int(0);
  else if (str_eq(p, n, "previtem"))
    *out = L->i > 0 ? L->items[L->i - 1] : gc__tmpl_undef_hint("there is no previous item");
  else if (str_eq(p, n, "nextitem"))
    *out = L->i + 1 < L->n ? L->items[L->i + 1] : gc__tmpl_undef_hint("there is no next item");
  else if (str_eq(p, n, "cycle") || str_eq(p, n, "changed"))
    return method_value(rt, obj, str_eq(p, n, "cycle") ? GC__TM_CYCLE : GC__TM_OTHER, out);
  else
    *out = undef_attr(obj, p, n);
  return 0;
}

/* obj.name as the sandboxed environment does it: Python's attribute first (a method of
 * str, dict, list), then the item obj["name"]; neither is undefined, not an error. Only
 * an undefined obj fails here, as Undefined.__getattr__ raises. */
int gc__tmpl_getattr(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *obj,
                     const char *p, size_t len, gc__tmpl_val *out) {
  switch (obj->kind) {
  case GC__TV_UNDEF:
    return gc__tmpl_rt_undef(rt, n, obj);
  case GC__TV_DICT: {
    /* The dict's own attributes (its methods) come first, then its items. */
    uint16_t m = gc__tmpl_method_of(obj, p, len);
    if (m) return method_value(rt, obj, m, out);
    const gc__tmpl_val *v = gc__tmpl_dict_get_str(obj->u.d, p, len);
    *out = v ? *v : undef_attr(obj, p, len);
    return 0;
  }
  case GC__TV_NS: {
    /* The sandbox hides attributes that start with "_". */
    const gc__tmpl_val *v = len && p[0] == '_' ? NULL : gc__tmpl_dict_get_str(obj->u.d, p, len);
    *out = v ? *v : undef_attr(obj, p, len);
    return 0;
  }
  case GC__TV_LOOP:
    return loop_attr(rt, obj, p, len, out);
  case GC__TV_STR:
  case GC__TV_LIST: {
    uint16_t m = gc__tmpl_method_of(obj, p, len);
    if (m) return method_value(rt, obj, m, out);
    *out = undef_attr(obj, p, len);
    return 0;
  }
  default:
    *out = undef_attr(obj, p, len);
    return 0;
  }
}

/* Python's slice.indices(len) and the items it selects: start, stop (normalized), step
 * and count. Missing parts default by the step's sign; negative ones count from the end;
 * out-of-range ones clamp to [lower, upper] (which for a negative step are [-1, len-1]).
 * A part that is not an int, bool or None is a TypeError, reported through *bad_type
 * because what it becomes depends on the caller (mark_slices in tmpl_parse.c). */
static int slice_indices(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val sl[3],
                         int64_t len, int64_t *start, int64_t *stop, int64_t *step,
                         int64_t *count, bool *bad_type) {
  int64_t v[3];
  bool given[3];
  *bad_type = false;
  for (int k = 0; k < 3; k++) {
    given[k] = sl[k].kind != GC__TV_NONE && sl[k].kind != GC__TV_UNDEF;
    if (!given[k]) continue;
    if (sl[k].kind == GC__TV_INT)
      v[k] = sl[k].u.i;
    else if (sl[k].kind == GC__TV_BOOL)
      v[k] = sl[k].u.b;
    else {
      *bad_type = true; /* TypeError, which jinja2's getitem turns into undefined */
      return 0;
    }
  }
  int64_t st = given[2] ? v[2] : 1;
  if (st == 0) return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "slice step cannot be zero");
  if (st == INT64_MIN) st = -INT64_MAX;
  int64_t lower = st > 0 ? 0 : -1, upper = st > 0 ? len : len - 1;
  int64_t a, b;
  if (!given[0]) {
    a = st < 0 ? upper : lower;
  } else {
    a = v[0];
    if (a < 0) {
      a = a < -len ? lower : a + len;
      if (a < lower) a = lower;
    } else if (a > upper) {
      a = upper;
    }
  }
  if (!given[1]) {
    b = st < 0 ? lower : upper;
  } else {
    b = v[1];
    if (b < 0) {
      b = b < -len ? lower : b + len;
      if (b < lower) b = lower;
    } else if (b > upper) {
      b = upper;
    }
  }
  int64_t c = 0;
  if (st > 0 && a < b) c = (b - a - 1) / st + 1;
  if (st < 0 && a > b) c = (a - b - 1) / (-st) + 1;
  *start = a, *stop = b, *step = st, *count = c;
  return 0;
}

/* Byte offset of code point k of s (k up to its count), walking from byte `from` which
 * is the offset of code point k0. Text whose count equals its bytes is its own index. */
static size_t cp_offset(gc__tmpl_str s, size_t nch, size_t from, size_t k0, size_t k) {
  if (nch == s.n) return k;
  size_t i = from;
  for (size_t c = k0; c < k && i < s.n; c++) {
    uint32_t cp;
    i += gc__tmpl_u8_next(s.p + i, s.n - i, &cp);
  }
  return i;
}

/* Byte offsets of the code points of s (n + 1 entries, the last = s.n): for slices with a
 * step, which are rare; indexing and plain slices walk (cp_offset) without memory. */
static int char_offsets(gc__tmpl_rt *rt, gc__tmpl_str s, size_t **offs, size_t *count) {
  size_t n = gc__tmpl_u8_count(s.p, s.n);
  size_t *o = gc__tmpl_alloc(rt->h, (n + 1) * sizeof *o);
  if (!o) return rt->e->code;
  size_t k = 0;
  for (size_t i = 0; i < s.n;) {
    uint32_t cp;
    o[k++] = i;
    i += gc__tmpl_u8_next(s.p + i, s.n - i, &cp);
  }
  o[n] = s.n;
  *offs = o, *count = n;
  return 0;
}

/* obj[a:b:c] for a str (by code points), a list, a tuple or a range (a range's slice is
 * a range, as its repr shows). */
int gc__tmpl_slice(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *obj,
                   const gc__tmpl_val sl[3], gc__tmpl_val *out) {
  bool subscriptable =
      obj->kind == GC__TV_STR ||
      (obj->kind == GC__TV_LIST && (obj->u.l->flavour == GC__TL_LIST ||
                                    obj->u.l->flavour == GC__TL_TUPLE ||
                                    obj->u.l->flavour == GC__TL_RANGE));
  /* jinja2 compiles x[a:b] to Python's own subscription (not environment.getitem), so
   * what cannot be sliced fails, it does not become undefined. */
  if (!subscriptable) {
    if (n->op) {
      *out = gc__tmpl_undef_hint("this object cannot be sliced");
      return 0;
    }
    if (obj->kind == GC__TV_DICT)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unhashable type: 'slice'");
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "'%s' object is not subscriptable",
                            gc__tmpl_type_name(obj));
  }
  int64_t len, start = 0, stop = 0, step = 1, count = 0;
  size_t *offs = NULL, nchars = 0;
  int rc;
  if (obj->kind == GC__TV_STR) {
    nchars = gc__tmpl_u8_count(obj->u.s.p, obj->u.s.n);
    len = (int64_t)nchars;
  } else {
    len = (int64_t)obj->u.l->n;
  }
  bool bad;
  if ((rc = slice_indices(rt, n, sl, len, &start, &stop, &step, &count, &bad))) return rc;
  if (bad && n->op) {
    *out = gc__tmpl_undef_hint("slice indices must be integers or None");
    return 0;
  }
  if (bad)
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL,
                            "slice indices must be integers or None or have an __index__ method");
  if (obj->kind == GC__TV_STR) {
    if (step == 1) {
      size_t a = cp_offset(obj->u.s, nchars, 0, 0, (size_t)start);
      size_t b = cp_offset(obj->u.s, nchars, a, (size_t)start, (size_t)(start + count));
      *out = gc__tmpl_strv(obj->u.s.p + a, b - a);
      return 0;
    }
    if ((rc = char_offsets(rt, obj->u.s, &offs, &nchars))) return rc;
    size_t bytes = 0;
    for (int64_t k = 0; k < count; k++) {
      int64_t i = start + k * step;
      bytes += offs[i + 1] - offs[i];
    }
    char *buf = gc__tmpl_alloc(rt->h, bytes + 1);
    if (!buf) return rt->e->code;
    size_t o = 0;
    for (int64_t k = 0; k < count; k++) {
      int64_t i = start + k * step;
      memcpy(buf + o, obj->u.s.p + offs[i], offs[i + 1] - offs[i]);
      o += offs[i + 1] - offs[i];
    }
    *out = gc__tmpl_strv(buf, o);
    return 0;
  }
  const gc__tmpl_list *l = obj->u.l;
  if ((rc = gc__tmpl_list_new(rt->h, (size_t)count, l->flavour, out))) return rc;
  for (int64_t k = 0; k < count; k++) out->u.l->v[k] = l->v[start + k * step];
  if (l->flavour == GC__TL_RANGE) {
    /* range(a, b, s)[i:j:k] is range(a + i*s, a + j*s, s*k) over the normalized i, j. */
    gc__tmpl_list *r = out->u.l;
    r->step = l->step * step;
    r->start = l->start + start * l->step;
    r->stop = l->start + stop * l->step;
  }
  return 0;
}

/* obj[key] as the sandboxed environment's getitem does it: Python's obj[key] first; if
 * that raises TypeError or LookupError (a missing key, an index out of range, a type
 * that is not subscriptable), a str key is tried as an attribute; what is left is
 * undefined. So messages[10] is undefined, d["items"] is the method, none["x"] is
 * undefined: none of these fail until used. */
int gc__tmpl_getitem(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *obj,
                     const gc__tmpl_val *key, gc__tmpl_val *out) {
  if (obj->kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, obj);
  bool int_key = key->kind == GC__TV_INT || key->kind == GC__TV_BOOL;
  int64_t idx = key->kind == GC__TV_BOOL ? key->u.b : key->u.i;
  switch (obj->kind) {
  case GC__TV_DICT: {
    const gc__tmpl_val *v = gc__tmpl_dict_get(obj->u.d, key);
    if (v) {
      *out = *v;
      return 0;
    }
    break; /* KeyError: jinja2 tries the attribute next */
  }
  case GC__TV_STR:
    if (int_key) {
      /* One code point, by index from either end. */
      size_t nch = gc__tmpl_u8_count(obj->u.s.p, obj->u.s.n);
      int64_t i = idx < 0 ? idx + (int64_t)nch : idx;
      if (i < 0 || i >= (int64_t)nch) {
        *out = undef_elem(obj, idx);
        return 0;
      }
      size_t a = cp_offset(obj->u.s, nch, 0, 0, (size_t)i);
      uint32_t cp;
      *out = gc__tmpl_strv(obj->u.s.p + a, gc__tmpl_u8_next(obj->u.s.p + a, obj->u.s.n - a, &cp));
      return 0;
    }
    break;
  case GC__TV_LIST: {
    const gc__tmpl_list *l = obj->u.l;
    bool indexable = l->flavour == GC__TL_LIST || l->flavour == GC__TL_TUPLE ||
                     l->flavour == GC__TL_RANGE;
    if (indexable && int_key) {
      int64_t i = idx < 0 ? idx + (int64_t)l->n : idx;
      if (i < 0 || i >= (int64_t)l->n) {
        *out = undef_elem(obj, idx);
        return 0;
      }
      *out = l->v[i];
      return 0;
    }
    break;
  }
  default:
    break;
  }
  if (key->kind == GC__TV_STR) return gc__tmpl_getattr(rt, n, obj, key->u.s.p, key->u.s.n, out);
  *out = int_key ? undef_elem(obj, idx) : gc__tmpl_undef_hint("no such element");
  return 0;
}

/* ---- iteration ----------------------------------------------------------------------- */

/* What Python's iter() yields: an undefined value nothing (Undefined.__iter__), a str its
 * characters, a dict its keys, a list flavour its items. None, numbers, namespaces and
 * functions are not iterable (TypeError). */
int gc__tmpl_iter(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                  const gc__tmpl_val **items, size_t *count) {
  switch (v->kind) {
  case GC__TV_UNDEF:
    *items = NULL, *count = 0;
    return 0;
  case GC__TV_STR: {
    size_t nch = gc__tmpl_u8_count(v->u.s.p, v->u.s.n);
    gc__tmpl_val *it = gc__tmpl_alloc(rt->h, (nch ? nch : 1) * sizeof *it);
    if (!it) return gc__tmpl_rt_locate(rt, n, rt->e->code);
    size_t k = 0;
    for (size_t i = 0; i < v->u.s.n;) {
      uint32_t cp;
      size_t len = gc__tmpl_u8_next(v->u.s.p + i, v->u.s.n - i, &cp);
      it[k++] = gc__tmpl_strv(v->u.s.p + i, len);
      i += len;
    }
    *items = it, *count = nch;
    return 0;
  }
  case GC__TV_LIST: {
    gc__tmpl_list *l = v->u.l;
    if (l->flavour == GC__TL_GEN) {
      if (l->err) return gc__tmpl_rt_raise(rt, l->err_code, l->err);
      *items = l->v + l->pos, *count = l->n - l->pos;
      l->pos = l->n; /* used up */
      return 0;
    }
    *items = l->v, *count = l->n;
    return 0;
  }
  case GC__TV_DICT:
    *items = v->u.d->k, *count = v->u.d->n;
    return 0;
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "'%s' object is not iterable",
                            gc__tmpl_type_name(v));
  }
}

static bool memfind(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn == 0) return true;
  if (nn > hn) return false;
  for (size_t i = 0; i + nn <= hn; i++) {
    const char *p = memchr(h + i, nd[0], hn - nn + 1 - i);
    if (!p) return false;
    i = (size_t)(p - h);
    if (memcmp(p, nd, nn) == 0) return true;
  }
  return false;
}

/* Python's `a in b`: a substring test for str (a must be a str), a key lookup for dict
 * (a must be hashable), an equality scan for the list flavours (a generator is used up
 * to the match), False for undefined (which iterates empty), TypeError otherwise. */
int gc__tmpl_contains(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *b,
                      const gc__tmpl_val *a, bool *in) {
  *in = false;
  switch (b->kind) {
  case GC__TV_UNDEF:
    return 0;
  case GC__TV_STR:
    if (a->kind != GC__TV_STR)
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL,
                              "'in <string>' requires string as left operand, not %s",
                              gc__tmpl_type_name(a));
    *in = memfind(b->u.s.p, b->u.s.n, a->u.s.p, a->u.s.n);
    return 0;
  case GC__TV_DICT:
    if (a->kind == GC__TV_DICT || (a->kind == GC__TV_LIST && a->u.l->flavour == GC__TL_LIST))
      return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "unhashable type: '%s'", gc__tmpl_type_name(a));
    *in = gc__tmpl_dict_get(b->u.d, a) != NULL;
    return 0;
  case GC__TV_LIST: {
    gc__tmpl_list *l = b->u.l;
    size_t from = l->flavour == GC__TL_GEN ? l->pos : 0;
    size_t to = l->flavour == GC__TL_GEN && l->err && l->err_at < l->n ? l->err_at : l->n;
    for (size_t i = from; i < to; i++)
      if (gc__tmpl_eq(&l->v[i], a)) {
        *in = true;
        if (l->flavour == GC__TL_GEN) l->pos = i + 1; /* a generator is used up to it */
        return 0;
      }
    if (l->flavour == GC__TL_GEN) {
      l->pos = l->n;
      if (l->err) return gc__tmpl_rt_raise(rt, l->err_code, l->err);
    }
    return 0;
  }
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "argument of type '%s' is not iterable",
                            gc__tmpl_type_name(b));
  }
}
