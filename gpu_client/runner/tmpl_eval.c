/*
 * tmpl_eval.c - the tree walker of the chat-template interpreter: scopes, statements,
 * operators with Python's semantics and macro calls. What it shares with the builtins
 * (the render's errors and limits, attribute and item lookup, iteration, `in`) is the
 * runtime in tmpl_rt.c, below both; filters, tests, methods and functions are called in
 * tmpl_builtin.c.
 *
 * Scopes, as jinja2 compiles them (checked against it, tests/unit/test_chat_template.c):
 *
 *   root frame     {% set %} at the top level (and inside top-level ifs) lands here
 *     for frame    one per for loop, emptied at every iteration: the loop variables,
 *                  `loop`, and what {% set %} makes inside the body. A name read in the
 *                  body before the body sets it reads the enclosing scope's value, each
 *                  iteration anew; nothing set in the body is seen after the loop.
 *     macro frame  the parameters and what the body sets; its parent is the root frame
 *                  (macros are only defined outside loops and macros: tmpl_parse.c), so a
 *                  macro sees the template's variables as they are when it is called.
 *   below the root: the render's variables, then the global functions (range, namespace,
 *   dict, raise_exception, strftime_now); a name found nowhere is undefined.
 *
 * Namespaces are the one value a loop body can change for the code after it; they are
 * shared by reference, as in Python.
 *
 * Errors: every failure is located once, at the innermost node that saw it
 * ("origin:line:col: message"); raise_exception's message stays bare.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_client/runner/tmpl_internal.h"

enum { CTL_BREAK = 1, CTL_CONTINUE = 2 };

/* A scope: the names set in it (by id) and their values. Few names live in one scope,
 * so a linear search beats any table; the arrays grow in the render's heap. */
typedef struct gc__tmpl_frame {
  struct gc__tmpl_frame *parent; /* the enclosing scope, NULL for the root */
  uint32_t n, cap;
  uint32_t *ids;
  gc__tmpl_val *vals;
} frame;


/* ---- frames ------------------------------------------------------------------------ */

static frame *frame_new(gc__tmpl_rt *rt, frame *parent) {
  frame *f = gc__tmpl_alloc(rt->h, sizeof *f);
  if (f) *f = (frame){.parent = parent};
  return f;
}

/* Sets name id in f (never in a parent: jinja2's assignments are local to the scope). */
static int frame_set(gc__tmpl_rt *rt, frame *f, uint32_t id, gc__tmpl_val v) {
  for (uint32_t i = 0; i < f->n; i++)
    if (f->ids[i] == id) {
      f->vals[i] = v;
      return 0;
    }
  if (f->n == f->cap) {
    uint32_t cap = f->cap ? f->cap * 2 : 8;
    uint32_t *ids = gc__tmpl_alloc(rt->h, cap * sizeof *ids);
    gc__tmpl_val *vals = gc__tmpl_alloc(rt->h, cap * sizeof *vals);
    if (!ids || !vals) return rt->e->code;
    if (f->n) {
      memcpy(ids, f->ids, f->n * sizeof *ids);
      memcpy(vals, f->vals, f->n * sizeof *vals);
    }
    f->ids = ids, f->vals = vals, f->cap = cap;
  }
  f->ids[f->n] = id;
  f->vals[f->n] = v;
  f->n++;
  return 0;
}

/* A name's value: the scopes from f outwards, then the render's variables, then the
 * global functions (so a variable or a {% set %} named "range" hides the function, as
 * jinja2's context hides its globals), else undefined with the name for the message. */
static gc__tmpl_val lookup(gc__tmpl_rt *rt, const frame *f, uint32_t id) {
  for (; f; f = f->parent)
    for (uint32_t i = f->n; i-- > 0;)
      if (f->ids[i] == id) return f->vals[i];
  if (rt->ctx[id].kind != GC__TV_UNDEF) return rt->ctx[id];
  if (rt->t->name_fn[id])
    return (gc__tmpl_val){.kind = GC__TV_FUNC, .aux = rt->t->name_fn[id]};
  return (gc__tmpl_val){.kind = GC__TV_UNDEF, .aux = GC__TU_NAME, .u.s = rt->t->names[id]};
}

/* ---- operators ------------------------------------------------------------------------ */

/* Python's operators on our values. Values carry Python's types (bool < int < float in
 * the numeric tower, str, list, tuple, dict, ...) and every operator checks the pair of
 * types first, so that what would be a TypeError in Python is an error here with the
 * same wording, and never a crash or a silent coercion. Integers are 64-bit; overflow is
 * an error rather than a wrong number. */

static bool is_num(const gc__tmpl_val *v) {
  return v->kind == GC__TV_BOOL || v->kind == GC__TV_INT || v->kind == GC__TV_FLOAT;
}
static int64_t as_int(const gc__tmpl_val *v) { return v->kind == GC__TV_BOOL ? v->u.b : v->u.i; }
static double as_float(const gc__tmpl_val *v) {
  return v->kind == GC__TV_FLOAT ? v->u.f : (double)as_int(v);
}

static const char *op_text(uint8_t op) {
  static const char *const t[] = {"?", "+", "-", "*", "/", "//", "%", "**",
                                  "==", "!=", "<", "<=", ">", ">=", "in", "not in"};
  return op < sizeof t / sizeof t[0] ? t[op] : "?";
}

/* markupsafe.escape of a str (for `+` with a |safe string): |safe makes a Markup, and
 * Markup.__add__ / __radd__ escape the other operand. Only `+` does this; `~` joins
 * str() of both and escapes nothing. */
static int html_escape(gc__tmpl_rt *rt, gc__tmpl_str s, gc__tmpl_str *out) {
  size_t extra = 0;
  for (size_t i = 0; i < s.n; i++) {
    char c = s.p[i];
    extra += c == '&' ? 4 : c == '<' || c == '>' ? 3 : c == '\'' || c == '"' ? 4 : 0;
  }
  if (!extra) {
    *out = s;
    return 0;
  }
  char *b = gc__tmpl_alloc(rt->h, s.n + extra + 1);
  if (!b) return rt->e->code;
  size_t o = 0;
  for (size_t i = 0; i < s.n; i++) {
    const char *r = NULL;
    switch (s.p[i]) {
    case '&': r = "&amp;"; break;
    case '<': r = "&lt;"; break;
    case '>': r = "&gt;"; break;
    case '\'': r = "&#39;"; break;
    case '"': r = "&#34;"; break;
    }
    if (r) {
      memcpy(b + o, r, strlen(r));
      o += strlen(r);
    } else {
      b[o++] = s.p[i];
    }
  }
  *out = (gc__tmpl_str){b, o};
  return 0;
}

static int concat2(gc__tmpl_rt *rt, gc__tmpl_str a, gc__tmpl_str b, gc__tmpl_val *out) {
  if (a.n > SIZE_MAX / 2 || b.n > SIZE_MAX / 2) return mr_err_set(rt->e, MR_EEXHAUSTED, "string too long");
  char *p = gc__tmpl_alloc(rt->h, a.n + b.n + 1);
  if (!p) return rt->e->code;
  if (a.n) memcpy(p, a.p, a.n);
  if (b.n) memcpy(p + a.n, b.p, b.n);
  p[a.n + b.n] = '\0';
  *out = gc__tmpl_strv(p, a.n + b.n);
  return 0;
}

/* str * int and list * int (times <= 0 gives an empty one), checked against the memory
 * budget before anything is allocated, so that 'x' * 10**15 fails at once. */
static int repeat(gc__tmpl_rt *rt, const gc__tmpl_val *seq, int64_t times, gc__tmpl_val *out) {
  if (times < 0) times = 0;
  if (seq->kind == GC__TV_STR) {
    size_t n = seq->u.s.n;
    if (n && (uint64_t)times > rt->h->limit / n)
      return mr_err_set(rt->e, MR_EEXHAUSTED, "memory limit of %zu bytes reached", rt->h->limit);
    size_t total = n * (size_t)times;
    char *p = gc__tmpl_alloc(rt->h, total + 1);
    if (!p) return rt->e->code;
    for (int64_t k = 0; k < times; k++) memcpy(p + (size_t)k * n, seq->u.s.p, n);
    p[total] = '\0';
    *out = gc__tmpl_strv(p, total);
    return 0;
  }
  const gc__tmpl_list *l = seq->u.l;
  if (l->n && (uint64_t)times > rt->h->limit / (l->n * sizeof(gc__tmpl_val)))
    return mr_err_set(rt->e, MR_EEXHAUSTED, "memory limit of %zu bytes reached", rt->h->limit);
  int rc = gc__tmpl_list_new(rt->h, l->n * (size_t)times, l->flavour, out);
  if (rc) return rc;
  for (int64_t k = 0; k < times; k++)
    if (l->n) memcpy(out->u.l->v + (size_t)k * l->n, l->v, l->n * sizeof *l->v);
  return 0;
}

static bool is_seq_list(const gc__tmpl_val *v) {
  return v->kind == GC__TV_LIST && (v->u.l->flavour == GC__TL_LIST || v->u.l->flavour == GC__TL_TUPLE);
}

static int type_error2(gc__tmpl_rt *rt, uint8_t op, const gc__tmpl_val *a, const gc__tmpl_val *b) {
  return mr_err_set(rt->e, MR_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'",
                    op_text(op), gc__tmpl_type_name(a), gc__tmpl_type_name(b));
}

/* CPython's float floor division and modulo (float_divmod): the remainder takes the
 * divisor's sign, and the quotient is corrected so that q * y + r == x as closely as
 * doubles allow (floor() alone is off by one for some inputs). */
static void float_divmod(double vx, double wx, double *floordiv, double *mod) {
  double m = fmod(vx, wx);
  double div = (vx - m) / wx;
  if (m != 0.0) {
    if ((wx < 0) != (m < 0)) {
      m += wx;
      div -= 1.0;
    }
  } else {
    m = copysign(0.0, wx);
  }
  double fd;
  if (div != 0.0) {
    fd = floor(div);
    if (div - fd > 0.5) fd += 1.0;
  } else {
    fd = copysign(0.0, vx / wx);
  }
  *floordiv = fd, *mod = m;
}

/* int ** non-negative int by squaring, failing on overflow (Python would go on with a
 * big int: a known difference). */
static int int_pow(gc__tmpl_rt *rt, int64_t base, int64_t ex, gc__tmpl_val *out) {
  int64_t r = 1, b = base;
  while (ex > 0) {
    if (ex & 1) {
      if (__builtin_mul_overflow(r, b, &r)) goto overflow;
    }
    ex >>= 1;
    if (ex && __builtin_mul_overflow(b, b, &b)) goto overflow;
  }
  *out = gc__tmpl_int(r);
  return 0;
overflow:
  return mr_err_set(rt->e, MR_ERANGE, "integer overflow (integers here are 64-bit)");
}

/* A binary operator with Python's rules. Numbers first: bool counts as int, an int and a
 * float make a float, / is always true division, // and % floor (the remainder has the
 * divisor's sign), ** of ints stays an int unless the exponent is negative. Then the
 * sequences: str + str, list + list, tuple + tuple, sequence * int. Anything else is
 * Python's TypeError with Python's wording; an undefined operand is jinja2's
 * UndefinedError (Undefined's operators all raise). Errors here are not located: the
 * caller (eval) locates them at the operator. */
static int binop(gc__tmpl_rt *rt, uint8_t op, const gc__tmpl_val *a, const gc__tmpl_val *b,
                 gc__tmpl_val *out) {
  if (a->kind == GC__TV_UNDEF || b->kind == GC__TV_UNDEF) {
    char msg[320];
    gc__tmpl_undef_message(a->kind == GC__TV_UNDEF ? a : b, msg, sizeof msg);
    return mr_err_set(rt->e, MR_EINVAL, "%s", msg);
  }
  if (is_num(a) && is_num(b)) {
    bool ints = a->kind != GC__TV_FLOAT && b->kind != GC__TV_FLOAT;
    int64_t x = as_int(a), y = as_int(b), r;
    double fx = as_float(a), fy = as_float(b);
    switch (op) {
    case GC__TO_ADD:
      if (!ints) return *out = gc__tmpl_float(fx + fy), 0;
      if (__builtin_add_overflow(x, y, &r)) goto overflow;
      return *out = gc__tmpl_int(r), 0;
    case GC__TO_SUB:
      if (!ints) return *out = gc__tmpl_float(fx - fy), 0;
      if (__builtin_sub_overflow(x, y, &r)) goto overflow;
      return *out = gc__tmpl_int(r), 0;
    case GC__TO_MUL:
      if (!ints) return *out = gc__tmpl_float(fx * fy), 0;
      if (__builtin_mul_overflow(x, y, &r)) goto overflow;
      return *out = gc__tmpl_int(r), 0;
    case GC__TO_DIV:
      if (fy == 0.0) return mr_err_set(rt->e, MR_EINVAL, "division by zero");
      return *out = gc__tmpl_float(fx / fy), 0;
    case GC__TO_FLOORDIV:
    case GC__TO_MOD:
      if (ints) {
        if (y == 0)
          return mr_err_set(rt->e, MR_EINVAL, "integer %s by zero",
                            op == GC__TO_MOD ? "modulo" : "division or modulo");
        if (x == INT64_MIN && y == -1) {
          if (op == GC__TO_MOD) return *out = gc__tmpl_int(0), 0;
          goto overflow;
        }
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) q -= 1, m += y;
        return *out = gc__tmpl_int(op == GC__TO_MOD ? m : q), 0;
      } else {
        if (fy == 0.0)
          return mr_err_set(rt->e, MR_EINVAL, "float %s by zero",
                            op == GC__TO_MOD ? "modulo" : "floor division");
        double fd, fm;
        float_divmod(fx, fy, &fd, &fm);
        return *out = gc__tmpl_float(op == GC__TO_MOD ? fm : fd), 0;
      }
    case GC__TO_POW:
      if (ints && y >= 0) return int_pow(rt, x, y, out);
      if (fx == 0.0 && fy < 0)
        return mr_err_set(rt->e, MR_EINVAL, "0.0 cannot be raised to a negative power");
      if (fx < 0 && fy != floor(fy))
        return mr_err_set(rt->e, MR_ENOTSUP, "complex results are not supported");
      {
        double p = pow(fx, fy);
        if (isinf(p) && isfinite(fx) && isfinite(fy))
          return mr_err_set(rt->e, MR_ERANGE, "numerical result out of range");
        return *out = gc__tmpl_float(p), 0;
      }
    default:
      break;
    }
  }
  switch (op) {
  case GC__TO_ADD:
    if (a->kind == GC__TV_STR && b->kind == GC__TV_STR) {
      /* markupsafe: a |safe string escapes the other side of a `+`. */
      bool sa = a->flags & GC__TVF_SAFE, sb = b->flags & GC__TVF_SAFE;
      gc__tmpl_str x = a->u.s, y = b->u.s;
      int rc = 0;
      if (sa && !sb) rc = html_escape(rt, y, &y);
      if (sb && !sa) rc = html_escape(rt, x, &x);
      if (!rc) rc = concat2(rt, x, y, out);
      if (!rc && (sa || sb)) out->flags |= GC__TVF_SAFE;
      return rc;
    }
    if (a->kind == GC__TV_STR)
      return mr_err_set(rt->e, MR_EINVAL, "can only concatenate str (not \"%s\") to str",
                        gc__tmpl_type_name(b));
    if (is_seq_list(a)) {
      if (!is_seq_list(b) || b->u.l->flavour != a->u.l->flavour)
        return mr_err_set(rt->e, MR_EINVAL, "can only concatenate %s (not \"%s\") to %s",
                          gc__tmpl_type_name(a), gc__tmpl_type_name(b), gc__tmpl_type_name(a));
      const gc__tmpl_list *x = a->u.l, *y = b->u.l;
      int rc = gc__tmpl_list_new(rt->h, x->n + y->n, x->flavour, out);
      if (rc) return rc;
      if (x->n) memcpy(out->u.l->v, x->v, x->n * sizeof *x->v);
      if (y->n) memcpy(out->u.l->v + x->n, y->v, y->n * sizeof *y->v);
      return 0;
    }
    break;
  case GC__TO_MUL:
    if ((a->kind == GC__TV_STR || is_seq_list(a)) && (b->kind == GC__TV_INT || b->kind == GC__TV_BOOL))
      return repeat(rt, a, as_int(b), out);
    if ((b->kind == GC__TV_STR || is_seq_list(b)) && (a->kind == GC__TV_INT || a->kind == GC__TV_BOOL))
      return repeat(rt, b, as_int(a), out);
    if (a->kind == GC__TV_STR || is_seq_list(a))
      return mr_err_set(rt->e, MR_EINVAL, "can't multiply sequence by non-int of type '%s'",
                        gc__tmpl_type_name(b));
    break;
  case GC__TO_MOD:
    if (a->kind == GC__TV_STR)
      return mr_err_set(rt->e, MR_ENOTSUP, "string formatting with %% is not supported");
    break;
  default:
    break;
  }
  return type_error2(rt, op, a, b);
overflow:
  return mr_err_set(rt->e, MR_ERANGE, "integer overflow (integers here are 64-bit)");
}

/* One comparison of a chain. == and != never fail (different kinds are unequal, two
 * undefined values are equal); ordering fails for kinds Python cannot order, and for an
 * undefined operand (Undefined.__lt__ raises). NaN makes every ordering false. */
static int compare(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint8_t op, const gc__tmpl_val *a,
                   const gc__tmpl_val *b, bool *res) {
  int rc;
  switch (op) {
  case GC__TO_EQ: *res = gc__tmpl_eq(a, b); return 0;
  case GC__TO_NE: *res = !gc__tmpl_eq(a, b); return 0;
  case GC__TO_IN:
  case GC__TO_NOTIN:
    if ((rc = gc__tmpl_contains(rt, n, b, a, res))) return rc;
    if (op == GC__TO_NOTIN) *res = !*res;
    return 0;
  default: {
    if (a->kind == GC__TV_UNDEF || b->kind == GC__TV_UNDEF)
      return gc__tmpl_rt_undef(rt, n, a->kind == GC__TV_UNDEF ? a : b);
    int c;
    if ((rc = gc__tmpl_cmp(rt->e, a, b, op_text(op), &c))) return gc__tmpl_rt_locate(rt, n, rc);
    switch (op) {
    case GC__TO_LT: *res = c == -1; break;
    case GC__TO_LE: *res = c == -1 || c == 0; break;
    case GC__TO_GT: *res = c == 1; break;
    default: *res = c == 1 || c == 0; break;
    }
    return 0;
  }
  }
}

/* ---- expressions ------------------------------------------------------------------------ */

static int eval(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f, gc__tmpl_val *out);
static int exec_node(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f);

/* The arguments of a call, filter or test, positional then keyword, left to right as
 * Python evaluates them. */
static int eval_args(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f, gc__tmpl_args *a) {
  memset(a, 0, sizeof *a);
  size_t total = (size_t)n->n + n->nkw;
  gc__tmpl_val *v = gc__tmpl_alloc(rt->h, (total ? total : 1) * sizeof *v);
  if (!v) return rt->e->code;
  for (uint32_t k = 0; k < n->n; k++) {
    int rc = eval(rt, n->kids[k], f, &v[k]);
    if (rc) return rc;
  }
  for (uint32_t k = 0; k < n->nkw; k++) {
    int rc = eval(rt, n->kwv[k], f, &v[n->n + k]);
    if (rc) return rc;
  }
  a->pos = v, a->npos = n->n;
  a->kw = n->kw, a->kwv = v + n->n, a->nkw = n->nkw;
  return 0;
}

/* A macro call: a new scope under the root (macros see the template's variables as they
 * are now, never the caller's loop), the parameters bound from positional then keyword
 * arguments, defaults evaluated in that scope (so a default may use the parameters
 * before it), missing ones undefined. The body renders into the output buffer; what it
 * wrote is cut off again and becomes the call's value, a str. */
static int call_macro(gc__tmpl_rt *rt, const gc__tmpl_node *call, const gc__tmpl_node *m,
                      gc__tmpl_args *args, gc__tmpl_val *out) {
  const char *name = m->val.u.s.p;
  int nl = (int)m->val.u.s.n;
  if (rt->calls >= rt->max_calls)
    return gc__tmpl_rt_fail(rt, call, MR_EEXHAUSTED,
                            "macro calls nested deeper than the limit of %u", rt->max_calls);
  int rc = gc__tmpl_rt_step(rt, call);
  if (rc) return rc;
  if (args->npos > m->n)
    return gc__tmpl_rt_fail(rt, call, MR_EINVAL, "macro '%.*s' takes not more than %u argument(s)",
                            nl, name, m->n);
  frame *mf = frame_new(rt, rt->root);
  if (!mf) return gc__tmpl_rt_locate(rt, call, rt->e->code);
  /* Which parameter got which value: positional first, then keywords by name. */
  const gc__tmpl_val **given = gc__tmpl_alloc(rt->h, (m->n ? m->n : 1) * sizeof *given);
  if (!given) return gc__tmpl_rt_locate(rt, call, rt->e->code);
  for (uint32_t k = 0; k < m->n; k++) given[k] = k < args->npos ? &args->pos[k] : NULL;
  for (size_t j = 0; j < args->nkw; j++) {
    uint32_t k;
    for (k = 0; k < m->n; k++) {
      const gc__tmpl_str *pn = &rt->t->names[m->kids[k]->id];
      if (pn->n == args->kw[j].n && memcmp(pn->p, args->kw[j].p, pn->n) == 0) break;
    }
    if (k == m->n)
      return gc__tmpl_rt_fail(rt, call, MR_EINVAL, "macro '%.*s' takes no keyword argument '%.*s'",
                              nl, name, (int)args->kw[j].n, args->kw[j].p);
    if (given[k])
      return gc__tmpl_rt_fail(rt, call, MR_EINVAL, "macro '%.*s' got multiple values for argument '%.*s'",
                              nl, name, (int)args->kw[j].n, args->kw[j].p);
    given[k] = &args->kwv[j];
  }
  rt->calls++;
  for (uint32_t k = 0; k < m->n && !rc; k++) {
    gc__tmpl_val v;
    if (given[k]) {
      v = *given[k];
    } else if (m->defs[k]) {
      rc = eval(rt, m->defs[k], mf, &v); /* defaults see the parameters before them */
    } else {
      v = gc__tmpl_undef_hint("a macro parameter was not provided");
      v.aux = GC__TU_NAME, v.u.s = rt->t->names[m->kids[k]->id];
    }
    if (!rc) rc = frame_set(rt, mf, m->kids[k]->id, v);
  }
  size_t mark = rt->out->n;
  if (!rc) rc = exec_node(rt, m->d, mf);
  rt->calls--;
  if (rc < 0) return gc__tmpl_rt_locate(rt, call, rc);
  /* The macro's output is its value: cut it back off the output. */
  size_t len = rt->out->n - mark;
  char *p = gc__tmpl_memdup(rt->h, rt->out->p ? rt->out->p + mark : "", len);
  rt->out->n = mark;
  if (rt->out->p) rt->out->p[mark] = '\0';
  if (!p) return gc__tmpl_rt_locate(rt, call, rt->e->code);
  *out = gc__tmpl_strv(p, len);
  return 0;
}

/* callee(args): a method (x.name(...), the attribute looked up as for x.name), a macro,
 * or a global function. The parser allowed only names and attributes as callees; what
 * they hold at run time decides. */
static int eval_call(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f, gc__tmpl_val *out) {
  gc__tmpl_val callee;
  int rc;
  if (n->a->kind == GC__TN_GETATTR) {
    gc__tmpl_val obj;
    if ((rc = eval(rt, n->a->a, f, &obj))) return rc;
    if ((rc = gc__tmpl_getattr(rt, n->a, &obj, n->a->val.u.s.p, n->a->val.u.s.n, &callee))) return rc;
  } else if ((rc = eval(rt, n->a, f, &callee))) {
    return rc;
  }
  if (callee.kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, &callee);
  gc__tmpl_args args;
  if ((rc = eval_args(rt, n, f, &args))) return rc;
  switch (callee.kind) {
  case GC__TV_MACRO:
    return call_macro(rt, n, callee.u.macro, &args, out);
  case GC__TV_FUNC:
    return gc__tmpl_call_func(rt, n, callee.aux, &args, out);
  case GC__TV_METHOD:
    return gc__tmpl_call_method(rt, n, &callee, &args, out);
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "'%s' object is not callable",
                            gc__tmpl_type_name(&callee));
  }
}

static int eval_list(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f, uint8_t flavour,
                     gc__tmpl_val *out) {
  int rc = gc__tmpl_list_new(rt->h, n->n, flavour, out);
  for (uint32_t k = 0; k < n->n && !rc; k++) rc = eval(rt, n->kids[k], f, &out->u.l->v[k]);
  return rc;
}

/* One expression node (eval wraps it with the nesting bound and the error's place). */
static int eval_inner(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f, gc__tmpl_val *out) {
  gc__tmpl_val a, b;
  int rc;
  switch (n->kind) {
  case GC__TN_CONST:
    *out = n->val;
    return 0;
  case GC__TN_NAME:
    *out = lookup(rt, f, n->id);
    return 0;
  case GC__TN_GETATTR:
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    return gc__tmpl_getattr(rt, n, &a, n->val.u.s.p, n->val.u.s.n, out);
  case GC__TN_GETITEM:
    /* A slice evaluates its parts (missing ones are None) before the object can fail. */
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    if (n->b->kind == GC__TN_SLICE) {
      gc__tmpl_val sl[3] = {gc__tmpl_none(), gc__tmpl_none(), gc__tmpl_none()};
      const gc__tmpl_node *parts[3] = {n->b->a, n->b->b, n->b->c};
      for (int k = 0; k < 3; k++)
        if (parts[k] && (rc = eval(rt, parts[k], f, &sl[k]))) return rc;
      if (a.kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, &a);
      return gc__tmpl_slice(rt, n, &a, sl, out);
    }
    if ((rc = eval(rt, n->b, f, &b))) return rc;
    return gc__tmpl_getitem(rt, n, &a, &b, out);
  case GC__TN_CALL:
    return eval_call(rt, n, f, out);
  case GC__TN_FILTER: {
    gc__tmpl_args args;
    if ((rc = eval(rt, n->a, f, &a)) || (rc = eval_args(rt, n, f, &args))) return rc;
    return gc__tmpl_call_filter(rt, n, n->fn, &a, &args, out);
  }
  case GC__TN_TEST: {
    gc__tmpl_args args;
    bool r;
    if ((rc = eval(rt, n->a, f, &a)) || (rc = eval_args(rt, n, f, &args))) return rc;
    if ((rc = gc__tmpl_call_test(rt, n, n->fn, &a, &args, &r))) return rc;
    *out = gc__tmpl_bool(r);
    return 0;
  }
  case GC__TN_NOT:
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    *out = gc__tmpl_bool(!gc__tmpl_truthy(&a));
    return 0;
  case GC__TN_NEG:
  case GC__TN_POS:
    /* Numbers only (a bool becomes an int: -True is -1); -INT64_MIN overflows. */
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    if (a.kind == GC__TV_UNDEF) return gc__tmpl_rt_undef(rt, n, &a);
    if (a.kind == GC__TV_FLOAT) {
      *out = gc__tmpl_float(n->kind == GC__TN_NEG ? -a.u.f : a.u.f);
      return 0;
    }
    if (a.kind == GC__TV_INT || a.kind == GC__TV_BOOL) {
      int64_t i = as_int(&a);
      if (n->kind == GC__TN_NEG && i == INT64_MIN)
        return gc__tmpl_rt_fail(rt, n, MR_ERANGE, "integer overflow (integers here are 64-bit)");
      *out = gc__tmpl_int(n->kind == GC__TN_NEG ? -i : i);
      return 0;
    }
    return gc__tmpl_rt_fail(rt, n, MR_EINVAL, "bad operand type for unary %c: '%s'",
                            n->kind == GC__TN_NEG ? '-' : '+', gc__tmpl_type_name(&a));
  case GC__TN_BIN:
    if ((rc = eval(rt, n->a, f, &a)) || (rc = eval(rt, n->b, f, &b))) return rc;
    return binop(rt, n->op, &a, &b, out);
  case GC__TN_CONCAT: {
    /* jinja2's str_join: str() of every operand (undefined is ""), no escaping. */
    gc__tmpl_sb sb;
    gc__tmpl_sb_init(&sb, rt->h->limit, "memory", rt->e);
    for (uint32_t k = 0; k < n->n; k++) {
      if ((rc = eval(rt, n->kids[k], f, &a)) || (rc = gc__tmpl_str_put(&sb, &a))) {
        gc__tmpl_sb_free(&sb);
        return rc;
      }
    }
    char *p = gc__tmpl_memdup(rt->h, sb.p ? sb.p : "", sb.n);
    size_t len = sb.n;
    gc__tmpl_sb_free(&sb);
    if (!p) return rt->e->code;
    *out = gc__tmpl_strv(p, len);
    return 0;
  }
  case GC__TN_COMPARE: {
    /* Left to right, stopping at the first false link, each operand evaluated once. */
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    for (uint32_t k = 0; k < n->n; k++) {
      bool r;
      if ((rc = eval(rt, n->kids[k], f, &b))) return rc;
      if ((rc = compare(rt, n, n->ops[k], &a, &b, &r))) return rc;
      if (!r) {
        *out = gc__tmpl_bool(false);
        return 0;
      }
      a = b;
    }
    *out = gc__tmpl_bool(true);
    return 0;
  }
  case GC__TN_AND:
  case GC__TN_OR:
    /* Python's and / or: the deciding operand itself, not a bool; the right one is only
     * evaluated when needed. */
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    if (gc__tmpl_truthy(&a) == (n->kind == GC__TN_OR)) {
      *out = a;
      return 0;
    }
    return eval(rt, n->b, f, out);
  case GC__TN_COND:
    /* Only the chosen branch is evaluated; no else gives jinja2's undefined. */
    if ((rc = eval(rt, n->a, f, &a))) return rc;
    if (gc__tmpl_truthy(&a)) return eval(rt, n->b, f, out);
    if (n->c) return eval(rt, n->c, f, out);
    *out = gc__tmpl_undef_hint("the inline if-expression evaluated to false and no else "
                               "section was defined");
    return 0;
  case GC__TN_LIST:
    return eval_list(rt, n, f, GC__TL_LIST, out);
  case GC__TN_TUPLE:
    return eval_list(rt, n, f, GC__TL_TUPLE, out);
  case GC__TN_DICT:
    /* Keys and values in source order; a repeated key keeps its first place and takes
     * the last value; an unhashable key (a list) fails as in Python. */
    if ((rc = gc__tmpl_dict_new(rt->h, n->n / 2, false, out))) return rc;
    for (uint32_t k = 0; k + 1 < n->n; k += 2) {
      if ((rc = eval(rt, n->kids[k], f, &a)) || (rc = eval(rt, n->kids[k + 1], f, &b))) return rc;
      if ((rc = gc__tmpl_dict_set(rt->h, out->u.d, a, b))) return rc;
    }
    return 0;
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINTERNAL, "cannot evaluate node kind %d", n->kind);
  }
}

/* Evaluates expression n in scope f. Recursion is bounded (GC__TMPL_MAX_EVAL_NEST) so
 * that no template reaches the end of the C stack; a failure gets n's place unless a
 * node below already gave it one. */
static int eval(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f, gc__tmpl_val *out) {
  if (++rt->nest > GC__TMPL_MAX_EVAL_NEST) {
    rt->nest--;
    return gc__tmpl_rt_fail(rt, n, MR_EEXHAUSTED, "expressions nested deeper than %d levels",
                            GC__TMPL_MAX_EVAL_NEST);
  }
  int rc = eval_inner(rt, n, f, out);
  rt->nest--;
  return rc < 0 ? gc__tmpl_rt_locate(rt, n, rc) : rc;
}

/* ---- statements ------------------------------------------------------------------------- */

/* Statements write to the render's output buffer. Control flow is the return code:
 * 0, CTL_BREAK or CTL_CONTINUE (the parser allows these only inside a for body, so they
 * never escape one), or a negative error that unwinds everything. Captures ({% set %}
 * blocks, macro calls) render into the same buffer and cut their text back off, so no
 * second buffer exists and the output limit covers them too. */

/* Binds a for / set target to v in frame f: a name; a tuple of names, unpacking v as
 * Python does (exactly as many items, or ValueError); or ns.attr, which writes into the
 * namespace wherever it lives (its attribute names may not start with "_": transformers'
 * TemplateNamespace). */
static int assign(gc__tmpl_rt *rt, const gc__tmpl_node *target, frame *f, const gc__tmpl_val *v) {
  if (target->kind == GC__TN_NAME) return frame_set(rt, f, target->id, *v);
  if (target->kind == GC__TN_NSREF) {
    gc__tmpl_val ns = lookup(rt, f, target->a->id);
    if (ns.kind != GC__TV_NS)
      return gc__tmpl_rt_fail(rt, target, MR_EINVAL, "cannot assign attribute on non-namespace object");
    const gc__tmpl_str *attr = &target->val.u.s;
    if (attr->n && attr->p[0] == '_')
      return gc__tmpl_rt_fail(rt, target, MR_EINVAL,
                              "chat templates cannot store underscore-prefixed attributes on a "
                              "namespace, but got '%.*s'",
                              (int)attr->n, attr->p);
    return gc__tmpl_dict_set(rt->h, ns.u.d, gc__tmpl_strv(attr->p, attr->n), *v);
  }
  /* A tuple of names: v must hold exactly that many items. */
  const gc__tmpl_val *items;
  size_t count;
  gc__tmpl_val copy = *v;
  int rc = gc__tmpl_iter(rt, target, &copy, &items, &count);
  if (rc) return rc;
  if (count < target->n)
    return gc__tmpl_rt_fail(rt, target, MR_EINVAL,
                            "not enough values to unpack (expected %u, got %zu)", target->n, count);
  if (count > target->n)
    return gc__tmpl_rt_fail(rt, target, MR_EINVAL, "too many values to unpack (expected %u)",
                            target->n);
  for (uint32_t k = 0; k < target->n; k++)
    if ((rc = frame_set(rt, f, target->kids[k]->id, items[k]))) return rc;
  return 0;
}

/* {% for %}: the iterable evaluated once in the enclosing scope; one frame reused for
 * every iteration (emptied each time, which is what jinja2's per-iteration scope
 * amounts to); `loop` bound when the template names it anywhere; the else when no
 * iteration ran to its end; break / continue end here. */
static int exec_for(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f) {
  gc__tmpl_val seq;
  const gc__tmpl_val *items;
  size_t count;
  int rc;
  if ((rc = eval(rt, n->b, f, &seq))) return rc;
  /* A generator that fails at item k runs the body k times first (a break before it
   * means no failure), as jinja2's lazy iteration does. */
  const gc__tmpl_list *pending = NULL;
  if (seq.kind == GC__TV_LIST && seq.u.l->flavour == GC__TL_GEN && seq.u.l->err) {
    gc__tmpl_list *g = seq.u.l;
    size_t to = g->err_at > g->pos ? g->err_at : g->pos;
    items = g->v + g->pos, count = to - g->pos;
    g->pos = g->n;
    pending = g;
  } else if ((rc = gc__tmpl_iter(rt, n->b, &seq, &items, &count))) {
    return rc;
  }
  frame *lf = frame_new(rt, f);
  if (!lf) return rt->e->code;
  if (n->c) {
    /* for x in xs if cond: the loop runs over the items that pass, so that loop.length
     * and loop.last count those only. */
    gc__tmpl_val *kept = gc__tmpl_alloc(rt->h, (count ? count : 1) * sizeof *kept);
    if (!kept) return rt->e->code;
    size_t nk = 0;
    for (size_t i = 0; i < count; i++) {
      gc__tmpl_val c;
      lf->n = 0;
      if ((rc = gc__tmpl_rt_step(rt, n)) || (rc = assign(rt, n->a, lf, &items[i])) ||
          (rc = eval(rt, n->c, lf, &c)))
        return rc;
      if (gc__tmpl_truthy(&c)) kept[nk++] = items[i];
    }
    items = kept, count = nk;
  }
  gc__tmpl_loop *L = gc__tmpl_alloc(rt->h, sizeof *L);
  if (!L) return rt->e->code;
  *L = (gc__tmpl_loop){.items = items, .n = count};
  /* jinja2 clears its "no iteration" flag at the end of the body, which continue and
   * break skip: the else runs when no iteration ran to its end. */
  bool completed = false;
  for (size_t i = 0; i < count; i++) {
    lf->n = 0; /* a fresh scope for every iteration */
    L->i = i;
    if ((rc = gc__tmpl_rt_step(rt, n))) return rc;
    if ((rc = assign(rt, n->a, lf, &items[i]))) return rc;
    if (rt->t->loop_id != UINT32_MAX &&
        (rc = frame_set(rt, lf, rt->t->loop_id, (gc__tmpl_val){.kind = GC__TV_LOOP, .u.loop = L})))
      return rc;
    rc = exec_node(rt, n->d, lf);
    if (rc == CTL_BREAK) break;
    if (rc == CTL_CONTINUE) continue;
    if (rc) return rc;
    completed = true;
  }
  if (rc != CTL_BREAK && pending) return gc__tmpl_rt_raise(rt, pending->err_code, pending->err);
  if (!completed && n->e) {
    frame *ef = frame_new(rt, f);
    if (!ef) return rt->e->code;
    return exec_node(rt, n->e, ef);
  }
  return 0;
}

/* One statement node. Returns 0, CTL_BREAK / CTL_CONTINUE (passed up to the nearest
 * for), or a negative error. */
static int exec_inner(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f) {
  gc__tmpl_val v;
  int rc;
  switch (n->kind) {
  case GC__TN_BODY:
    for (uint32_t k = 0; k < n->n; k++)
      if ((rc = exec_node(rt, n->kids[k], f))) return rc;
    return 0;
  case GC__TN_DATA:
    return gc__tmpl_sb_put(rt->out, n->val.u.s.p, n->val.u.s.n);
  case GC__TN_PRINT:
    /* {{ x }} writes str(x): no autoescaping, undefined writes nothing. */
    if ((rc = eval(rt, n->a, f, &v))) return rc;
    return gc__tmpl_str_put(rt->out, &v);
  case GC__TN_IF:
    /* An if is no scope: what its branches set lands in the enclosing one. */
    if ((rc = eval(rt, n->a, f, &v))) return rc;
    if (gc__tmpl_truthy(&v)) return exec_node(rt, n->b, f);
    return n->c ? exec_node(rt, n->c, f) : 0;
  case GC__TN_FOR:
    return exec_for(rt, n, f);
  case GC__TN_SET:
    if ((rc = eval(rt, n->b, f, &v))) return rc;
    return assign(rt, n->a, f, &v);
  case GC__TN_SETBLOCK: {
    /* The body renders into the output, then its text moves into the value. It is a
     * scope of its own (what it sets stays inside), as jinja2's block frame is. */
    size_t mark = rt->out->n;
    frame *bf = frame_new(rt, f);
    if (!bf) return rt->e->code;
    rc = exec_node(rt, n->d, bf);
    if (rc) {
      rt->out->n = mark;
      return rc;
    }
    char *p = gc__tmpl_memdup(rt->h, rt->out->p ? rt->out->p + mark : "", rt->out->n - mark);
    size_t len = rt->out->n - mark;
    rt->out->n = mark;
    if (!p) return rt->e->code;
    v = gc__tmpl_strv(p, len);
    return assign(rt, n->a, f, &v);
  }
  case GC__TN_MACRO:
    /* A definition is an assignment where it stands: calling a macro above its
     * definition at the top level finds an undefined name, as in jinja2. */
    return frame_set(rt, f, n->id, (gc__tmpl_val){.kind = GC__TV_MACRO, .u.macro = n});
  case GC__TN_BREAK:
    return CTL_BREAK;
  case GC__TN_CONTINUE:
    return CTL_CONTINUE;
  default:
    return gc__tmpl_rt_fail(rt, n, MR_EINTERNAL, "cannot execute node kind %d", n->kind);
  }
}

static int exec_node(gc__tmpl_rt *rt, const gc__tmpl_node *n, frame *f) {
  if (++rt->nest > GC__TMPL_MAX_EVAL_NEST) {
    rt->nest--;
    return gc__tmpl_rt_fail(rt, n, MR_EEXHAUSTED, "statements nested deeper than %d levels",
                            GC__TMPL_MAX_EVAL_NEST);
  }
  int rc = exec_inner(rt, n, f);
  rt->nest--;
  return rc < 0 ? gc__tmpl_rt_locate(rt, n, rc) : rc;
}

/* Renders t with the variables vars (a dict, or undefined for none) into out. */
int gc__tmpl_run(const gc_tmpl *t, gc__tmpl_val vars, const gc_tmpl_limits *lim,
                 gc__tmpl_heap *h, gc__tmpl_sb *out, mr_err *e) {
  gc__tmpl_rt rt = {.t = t, .h = h, .out = out, .e = e};
  rt.max_steps = lim->max_steps;
  rt.max_calls = lim->max_depth;
  rt.ctx = gc__tmpl_alloc(h, (t->nnames ? t->nnames : 1) * sizeof *rt.ctx);
  if (!rt.ctx) return e->code;
  /* The render's variables, by the template's name ids: names the template never
   * mentions are never looked up. */
  for (uint32_t i = 0; i < t->nnames; i++) {
    const gc__tmpl_val *v =
        vars.kind == GC__TV_DICT ? gc__tmpl_dict_get_str(vars.u.d, t->names[i].p, t->names[i].n) : NULL;
    rt.ctx[i] = v ? *v : (gc__tmpl_val){.kind = GC__TV_UNDEF};
  }
  rt.root = frame_new(&rt, NULL);
  if (!rt.root) return e->code;
  /* The top-level names jinja2 starts as undefined (tmpl_parse.c, root_hidden). */
  for (uint32_t i = 0; i < t->nnames; i++)
    if (t->root_hidden[i] &&
        frame_set(&rt, rt.root, i,
                  (gc__tmpl_val){.kind = GC__TV_UNDEF, .aux = GC__TU_NAME, .u.s = t->names[i]}))
      return e->code;
  int rc = exec_node(&rt, t->root, rt.root);
  return rc < 0 ? rc : 0;
}
