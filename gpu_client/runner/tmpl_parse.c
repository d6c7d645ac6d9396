/*
 * tmpl_parse.c - the template parser: jinja2's Parser (parser.py) over our tokens, the
 * same grammar and precedence, producing the tree of tmpl_internal.h. Lowest to highest:
 *
 *   x if c else y  <  or  <  and  <  not  <  comparisons, in, not in (chained)
 *   <  + -  <  ~  <  * / // %  <  **  <  unary - +  <  primary with .attr [key] (args)
 *   and, after the unary, filters |f(args), tests `is [not] t arg` and calls
 *
 * so `-x|abs` is abs(-x) and `'a' + b|trim + 'c'` trims b alone, as in jinja2.
 *
 * What is refused here, each naming the construct and its line:col:
 *   tags: block, extends, include, import, from, with, autoescape, call, filter, do,
 *         trans, recursive loops; unknown tags
 *   names: filters, tests, functions and methods outside the subset (a constant test or
 *          filter name given to select / reject / selectattr / rejectattr / map too);
 *          *args / **kwargs in calls; a filter on {% set %} blocks; nested tuple targets;
 *          macros inside a for loop or another macro (their closures); caller, varargs
 *          and kwargs inside macros
 *   break / continue outside a for loop (a syntax error in jinja2 too)
 * and nesting deeper than GC__TMPL_MAX_NEST.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_client/runner/tmpl_internal.h"

typedef struct parser {
  gc_tmpl *t;
  const gc__tmpl_tok *tk;
  size_t n, i;
  mr_err *e;
  int depth;    /* recursion, bounded by GC__TMPL_MAX_NEST */
  int loops;    /* for bodies around the current statement (break / continue) */
  int closures; /* for bodies and macros around it (a macro may not be defined there) */
  int macros;   /* macro bodies around it */
  /* Interned names: an open-addressing table of ids into names. */
  gc__tmpl_str *names;
  uint32_t nnames, names_cap;
  uint32_t *slots; /* id + 1, 0 = empty */
  uint32_t nslots;
  uint8_t *is_macro; /* per name id: some {% macro %} defines it */
} parser;

/* Fails with "origin:line:col: message" for the byte at pos: MR_ENOTSUP for a construct
 * outside the subset, MR_EFORMAT for what jinja2 itself would reject. */
static int pfail(parser *P, size_t pos, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int pfail(parser *P, size_t pos, int code, const char *fmt, ...) {
  char where[128], msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  gc__tmpl_where(P->t->origin, P->t->src, P->t->len, (uint32_t)pos, where, sizeof where);
  return mr_err_set(P->e, code, "%s: %s", where, msg);
}

/* ---- names ------------------------------------------------------------------------- */

/* Names are resolved at compile time as far as they can be: a filter, test, method or
 * function that the subset lacks is a refusal here; a name that may hold a value is
 * interned and looked up at render time. Macro names are collected in a first pass over
 * the tokens, so that a macro may call one defined further down. */

/* Every identifier gets a small id, so that scopes and the render's variables are
 * arrays indexed by id instead of string lookups, and a template with many names (a
 * fuzzer's) does not make interning quadratic. */
static uint32_t hash_name(const char *p, size_t n) {
  uint32_t h = 2166136261u; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 16777619u;
  return h;
}

/* The id of name p[0..n), a new one the first time; the table doubles at half full. */
static int intern(parser *P, const char *p, size_t n, uint32_t *id) {
  if (2 * (P->nnames + 1) > P->nslots) {
    uint32_t ns = P->nslots ? P->nslots * 2 : 256;
    uint32_t *slots = mr_calloc(ns, sizeof *slots);
    if (!slots) return mr_err_set(P->e, MR_ENOMEM, "out of memory (names)");
    for (uint32_t i = 0; i < P->nnames; i++) {
      uint32_t h = hash_name(P->names[i].p, P->names[i].n) & (ns - 1);
      while (slots[h]) h = (h + 1) & (ns - 1);
      slots[h] = i + 1;
    }
    mr_free(P->slots);
    P->slots = slots, P->nslots = ns;
  }
  uint32_t h = hash_name(p, n) & (P->nslots - 1);
  for (; P->slots[h]; h = (h + 1) & (P->nslots - 1)) {
    const gc__tmpl_str *s = &P->names[P->slots[h] - 1];
    if (s->n == n && memcmp(s->p, p, n) == 0) {
      *id = P->slots[h] - 1;
      return 0;
    }
  }
  if (P->nnames == P->names_cap) {
    uint32_t cap = P->names_cap ? P->names_cap * 2 : 64;
    gc__tmpl_str *g = mr_realloc(P->names, cap * sizeof *g);
    uint8_t *m = mr_realloc(P->is_macro, cap);
    if (m) P->is_macro = m;
    if (!g || !m) {
      if (g) P->names = g;
      return mr_err_set(P->e, MR_ENOMEM, "out of memory (names)");
    }
    P->names = g, P->names_cap = cap;
  }
  P->names[P->nnames] = (gc__tmpl_str){p, n};
  P->is_macro[P->nnames] = 0;
  P->slots[h] = P->nnames + 1;
  *id = P->nnames++;
  return 0;
}

/* ---- tokens ------------------------------------------------------------------------ */

/* The token stream ends in EOF; advance() never moves past it, so every lookahead is
 * safe without bounds checks at the call sites. */
static const gc__tmpl_tok *cur(const parser *P) { return &P->tk[P->i]; }
static const gc__tmpl_tok *peek(const parser *P) {
  return P->i + 1 < P->n ? &P->tk[P->i + 1] : &P->tk[P->n - 1];
}
static const gc__tmpl_tok *advance(parser *P) {
  const gc__tmpl_tok *t = &P->tk[P->i];
  if (P->i + 1 < P->n) P->i++;
  return t;
}
static bool is_op(const gc__tmpl_tok *t, uint8_t op) { return t->kind == GC__TK_OP && t->op == op; }
static bool is_name(const gc__tmpl_tok *t, const char *name) {
  size_t n = strlen(name);
  return t->kind == GC__TK_NAME && t->s.n == n && memcmp(t->s.p, name, n) == 0;
}

/* A token as messages name it (jinja2's describe_token). */
static const char *describe(const gc__tmpl_tok *t, char *buf, size_t len) {
  static const char *const opnames[] = {
      "", "+", "-", "/", "//", "*", "%", "**", "~", "[", "]", "(", ")", "{", "}",
      "==", "!=", ">", ">=", "<", "<=", "=", ".", ":", "|", ",", ";"};
  switch (t->kind) {
  case GC__TK_EOF: return "end of template";
  case GC__TK_DATA: return "template data";
  case GC__TK_VAR_BEGIN: return "begin of print statement";
  case GC__TK_VAR_END: return "end of print statement";
  case GC__TK_BLOCK_BEGIN: return "begin of statement block";
  case GC__TK_BLOCK_END: return "end of statement block";
  case GC__TK_NAME: snprintf(buf, len, "%.*s", (int)(t->s.n > 60 ? 60 : t->s.n), t->s.p); return buf;
  case GC__TK_STRING: return "string";
  case GC__TK_INT: return "integer";
  case GC__TK_FLOAT: return "float";
  default: return t->op < sizeof opnames / sizeof opnames[0] ? opnames[t->op] : "operator";
  }
}

static int expect_op(parser *P, uint8_t op, const char *what) {
  if (is_op(cur(P), op)) {
    advance(P);
    return 0;
  }
  char buf[80];
  return pfail(P, cur(P)->pos, MR_EFORMAT, "expected '%s', got '%s'", what,
               describe(cur(P), buf, sizeof buf));
}

static int expect_kind(parser *P, uint8_t kind, const char *what) {
  if (cur(P)->kind == kind) {
    advance(P);
    return 0;
  }
  char buf[80];
  return pfail(P, cur(P)->pos, MR_EFORMAT, "expected %s, got '%s'", what,
               describe(cur(P), buf, sizeof buf));
}

/* ---- nodes ------------------------------------------------------------------------- */

/* A zeroed node in the template's heap; NULL with the error set when the compile budget
 * is spent. */
static gc__tmpl_node *node(parser *P, uint8_t kind, size_t pos) {
  gc__tmpl_node *n = gc__tmpl_alloc(&P->t->heap, sizeof *n);
  if (!n) return NULL;
  memset(n, 0, sizeof *n);
  n->kind = kind;
  n->pos = (uint32_t)pos;
  return n;
}

/* A growable list of child nodes on mr_malloc, frozen into the heap by freeze(). */
typedef struct nodelist {
  gc__tmpl_node **v;
  uint32_t n, cap;
} nodelist;

static int nl_push(parser *P, nodelist *l, gc__tmpl_node *x) {
  if (l->n == l->cap) {
    uint32_t cap = l->cap ? l->cap * 2 : 8;
    gc__tmpl_node **g = mr_realloc(l->v, cap * sizeof *g);
    if (!g) return mr_err_set(P->e, MR_ENOMEM, "out of memory (tree)");
    l->v = g, l->cap = cap;
  }
  l->v[l->n++] = x;
  return 0;
}

/* The list's nodes as an array in the heap (never NULL on success, even when empty),
 * and the scratch list freed. */
static gc__tmpl_node **freeze(parser *P, nodelist *l) {
  gc__tmpl_node **v = NULL;
  if (l->n) {
    v = gc__tmpl_alloc(&P->t->heap, l->n * sizeof *v);
    if (v) memcpy(v, l->v, l->n * sizeof *v);
  } else {
    v = gc__tmpl_alloc(&P->t->heap, sizeof *v);
  }
  mr_free(l->v);
  l->v = NULL;
  return v;
}

#define ENTER(P, pos)                                                                  \
  do {                                                                                 \
    if (++(P)->depth > GC__TMPL_MAX_NEST)                                              \
      return pfail((P), (pos), MR_ENOTSUP, "nesting deeper than %d levels",            \
                   GC__TMPL_MAX_NEST);                                                 \
  } while (0)
#define LEAVE(P) ((P)->depth--)

/* A chain (a + b + c, x.y.z, x|f|g, elif ...) builds a tree as deep as it is long: each
 * link counts as a level of nesting, so that every tree stays within GC__TMPL_MAX_NEST
 * and the recursive walks over it (evaluation, folding) within the C stack. */
static int chain_link(parser *P, size_t pos, int *links) {
  (*links)++;
  if (++P->depth > GC__TMPL_MAX_NEST)
    return pfail(P, pos, MR_ENOTSUP, "nesting deeper than %d levels (a chain of operators, "
                 "attributes, filters or elifs counts as nesting)", GC__TMPL_MAX_NEST);
  return 0;
}

static int parse_expression(parser *P, bool condexpr, gc__tmpl_node **out);
static int parse_tuple(parser *P, bool simplified, bool condexpr, const char *end_name,
                       bool explicit_parens, bool with_ns, gc__tmpl_node **out);
static int parse_unary(parser *P, bool with_filter, gc__tmpl_node **out);
static int parse_primary(parser *P, bool with_ns, gc__tmpl_node **out);
static int parse_postfix(parser *P, gc__tmpl_node **node);
static int parse_filter_expr(parser *P, gc__tmpl_node **node);
static int subparse(parser *P, const char *const *ends, gc__tmpl_node **out);
static bool is_const(const gc__tmpl_node *n);
static int parse_filter1(parser *P, gc__tmpl_node **node_);

/* ---- expressions ----------------------------------------------------------------- */

/* One function per precedence level, named as in jinja2's parser.py so that the two can
 * be read side by side:
 *
 *   parse_expression -> parse_condexpr   x if c else y
 *   parse_or, parse_and                  left-associative chains (parse_level)
 *   parse_not                            prefix, right-recursive
 *   parse_compare                        one node for a whole chain of comparisons
 *   parse_math1 (+ -), parse_concat (~), parse_math2 (* / // %), parse_pow (**)
 *   parse_unary                          - + prefix, then postfixes, filters, tests
 *   parse_primary                        names, literals, ( ), [ ], { }
 *
 * Note that ** is left-associative in jinja2 (2 ** 3 ** 2 is 64, Python says 512) and
 * binds tighter than unary minus only on its right: -2 ** 2 is (-2) ** 2 = 4. Both are
 * jinja2's, and followed. */

/* One left-associative binary level: operands from `sub`, operators recognized by
 * `op_at` (it returns the node kind and sets *op, or returns 0). */
typedef int (*level_fn)(parser *P, gc__tmpl_node **out);
typedef uint8_t (*op_fn)(const gc__tmpl_tok *t, uint8_t *op);

static int parse_level(parser *P, level_fn sub, op_fn op_at, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  int links = 0;
  int rc = sub(P, out);
  while (!rc) {
    uint8_t op = 0, kind = op_at(cur(P), &op);
    if (!kind) break;
    if ((rc = chain_link(P, cur(P)->pos, &links))) break;
    advance(P);
    gc__tmpl_node *b = node(P, kind, pos);
    if (!b) return P->e->code;
    b->op = op;
    b->a = *out;
    rc = sub(P, &b->b);
    *out = b;
    pos = cur(P)->pos;
  }
  P->depth -= links;
  return rc;
}

static uint8_t op_or(const gc__tmpl_tok *t, uint8_t *op) { return is_name(t, "or") ? GC__TN_OR : 0; }
static uint8_t op_and(const gc__tmpl_tok *t, uint8_t *op) { return is_name(t, "and") ? GC__TN_AND : 0; }
static uint8_t op_math1(const gc__tmpl_tok *t, uint8_t *op) {
  if (is_op(t, GC__TOP_ADD)) return *op = GC__TO_ADD, GC__TN_BIN;
  if (is_op(t, GC__TOP_SUB)) return *op = GC__TO_SUB, GC__TN_BIN;
  return 0;
}
static uint8_t op_math2(const gc__tmpl_tok *t, uint8_t *op) {
  if (is_op(t, GC__TOP_MUL)) return *op = GC__TO_MUL, GC__TN_BIN;
  if (is_op(t, GC__TOP_DIV)) return *op = GC__TO_DIV, GC__TN_BIN;
  if (is_op(t, GC__TOP_FLOORDIV)) return *op = GC__TO_FLOORDIV, GC__TN_BIN;
  if (is_op(t, GC__TOP_MOD)) return *op = GC__TO_MOD, GC__TN_BIN;
  return 0;
}
static uint8_t op_pow(const gc__tmpl_tok *t, uint8_t *op) {
  return is_op(t, GC__TOP_POW) ? (*op = GC__TO_POW, GC__TN_BIN) : 0;
}

static int parse_not(parser *P, gc__tmpl_node **out);
static int parse_compare(parser *P, gc__tmpl_node **out);
static int parse_concat(parser *P, gc__tmpl_node **out);
static int unary_filtered(parser *P, gc__tmpl_node **out) { return parse_unary(P, true, out); }
static int parse_pow(parser *P, gc__tmpl_node **out) { return parse_level(P, unary_filtered, op_pow, out); }
static int parse_math2(parser *P, gc__tmpl_node **out) { return parse_level(P, parse_pow, op_math2, out); }
static int parse_math1(parser *P, gc__tmpl_node **out) { return parse_level(P, parse_concat, op_math1, out); }
static int parse_and(parser *P, gc__tmpl_node **out) { return parse_level(P, parse_not, op_and, out); }
static int parse_or(parser *P, gc__tmpl_node **out) { return parse_level(P, parse_and, op_or, out); }

/* x if c else y, the loosest form; "else" is optional (jinja2 then gives undefined), and
 * it chains to the right: a if b else c if d else e. */
static int parse_condexpr(parser *P, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  int rc = parse_or(P, out);
  while (!rc && is_name(cur(P), "if")) {
    advance(P);
    gc__tmpl_node *c = node(P, GC__TN_COND, pos), *test = NULL, *other = NULL;
    if (!c) return P->e->code;
    if ((rc = parse_or(P, &test))) return rc;
    if (is_name(cur(P), "else")) {
      advance(P);
      ENTER(P, cur(P)->pos);
      rc = parse_condexpr(P, &other);
      LEAVE(P);
      if (rc) return rc;
    }
    c->a = test, c->b = *out, c->c = other;
    *out = c;
    pos = cur(P)->pos;
  }
  return rc;
}

/* A whole expression. condexpr false where jinja2 does not allow an inline if: the
 * iterable of a for (whose "if" is the loop filter) and the test of an if. */
static int parse_expression(parser *P, bool condexpr, gc__tmpl_node **out) {
  ENTER(P, cur(P)->pos);
  int rc = condexpr ? parse_condexpr(P, out) : parse_or(P, out);
  LEAVE(P);
  return rc;
}

/* not binds looser than comparisons: not a == b is not (a == b). */
static int parse_not(parser *P, gc__tmpl_node **out) {
  if (is_name(cur(P), "not")) {
    size_t pos = advance(P)->pos;
    gc__tmpl_node *n = node(P, GC__TN_NOT, pos);
    if (!n) return P->e->code;
    ENTER(P, pos);
    int rc = parse_not(P, &n->a);
    LEAVE(P);
    *out = n;
    return rc;
  }
  return parse_compare(P, out);
}

/* Comparisons chain as in Python: a < b <= c is (a < b) and (b <= c), b evaluated once.
 * "not in" is two tokens; a lone "not" here ends the comparison. */
static int parse_compare(parser *P, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  int rc = parse_math1(P, out);
  if (rc) return rc;
  nodelist kids = {0};
  uint8_t ops[64];
  for (;;) {
    const gc__tmpl_tok *t = cur(P);
    uint8_t op = 0;
    if (t->kind == GC__TK_OP) {
      switch (t->op) {
      case GC__TOP_EQ: op = GC__TO_EQ; break;
      case GC__TOP_NE: op = GC__TO_NE; break;
      case GC__TOP_LT: op = GC__TO_LT; break;
      case GC__TOP_LTEQ: op = GC__TO_LE; break;
      case GC__TOP_GT: op = GC__TO_GT; break;
      case GC__TOP_GTEQ: op = GC__TO_GE; break;
      }
      if (op) advance(P);
    } else if (is_name(t, "in")) {
      op = GC__TO_IN;
      advance(P);
    } else if (is_name(t, "not") && is_name(peek(P), "in")) {
      op = GC__TO_NOTIN;
      advance(P), advance(P);
    }
    if (!op) break;
    if (kids.n == sizeof ops) {
      mr_free(kids.v);
      return pfail(P, t->pos, MR_ENOTSUP, "more than %zu chained comparisons", sizeof ops);
    }
    gc__tmpl_node *x = NULL;
    if ((rc = parse_math1(P, &x)) || (rc = nl_push(P, &kids, x))) {
      mr_free(kids.v);
      return rc;
    }
    ops[kids.n - 1] = op;
  }
  if (kids.n == 0) return 0;
  gc__tmpl_node *c = node(P, GC__TN_COMPARE, pos);
  if (!c) {
    mr_free(kids.v);
    return P->e->code;
  }
  c->a = *out;
  c->n = kids.n;
  c->kids = freeze(P, &kids);
  c->ops = gc__tmpl_alloc(&P->t->heap, c->n);
  if (!c->kids || !c->ops) return P->e->code;
  memcpy(c->ops, ops, c->n);
  *out = c;
  return 0;
}

/* a ~ b ~ c is one node over all operands (each turned to str, then joined): tighter
 * than + and -, looser than * and /, as jinja2 has it. */
static int parse_concat(parser *P, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  int rc = parse_math2(P, out);
  if (rc || !is_op(cur(P), GC__TOP_TILDE)) return rc;
  nodelist kids = {0};
  if ((rc = nl_push(P, &kids, *out))) return rc;
  while (is_op(cur(P), GC__TOP_TILDE)) {
    advance(P);
    gc__tmpl_node *x = NULL;
    if ((rc = parse_math2(P, &x)) || (rc = nl_push(P, &kids, x))) {
      mr_free(kids.v);
      return rc;
    }
  }
  gc__tmpl_node *c = node(P, GC__TN_CONCAT, pos);
  if (!c) {
    mr_free(kids.v);
    return P->e->code;
  }
  c->n = kids.n;
  c->kids = freeze(P, &kids);
  *out = c;
  return c->kids ? 0 : P->e->code;
}

/* Unary minus / plus, the primary with its postfixes, then (with_filter) filters and
 * tests. The operand of - takes no filters itself, so -x|abs is abs(-x) (jinja2's
 * parse_unary(with_filter=False) for the operand). */
static int parse_unary(parser *P, bool with_filter, gc__tmpl_node **out) {
  const gc__tmpl_tok *t = cur(P);
  int rc;
  ENTER(P, t->pos);
  if (is_op(t, GC__TOP_SUB) || is_op(t, GC__TOP_ADD)) {
    advance(P);
    gc__tmpl_node *n = node(P, t->op == GC__TOP_SUB ? GC__TN_NEG : GC__TN_POS, t->pos);
    if (!n) return P->e->code;
    if ((rc = parse_unary(P, false, &n->a))) return rc;
    *out = n;
  } else if ((rc = parse_primary(P, false, out))) {
    return rc;
  }
  if ((rc = parse_postfix(P, out))) return rc;
  if (with_filter) rc = parse_filter_expr(P, out);
  LEAVE(P);
  return rc;
}

/* [a, b, ...] or {k: v, ...}, a trailing comma allowed. */
static int parse_list_like(parser *P, uint8_t kind, uint8_t close, const char *what,
                           gc__tmpl_node **out) {
  size_t pos = advance(P)->pos;
  nodelist kids = {0};
  int rc = 0;
  while (!is_op(cur(P), close)) {
    if (kids.n && (rc = expect_op(P, GC__TOP_COMMA, ","))) break;
    if (is_op(cur(P), close)) break;
    gc__tmpl_node *k = NULL, *v = NULL;
    if ((rc = parse_expression(P, true, &k))) break;
    if ((rc = nl_push(P, &kids, k))) break;
    if (kind == GC__TN_DICT) {
      if ((rc = expect_op(P, GC__TOP_COLON, ":"))) break;
      if ((rc = parse_expression(P, true, &v)) || (rc = nl_push(P, &kids, v))) break;
    }
  }
  if (!rc) rc = expect_op(P, close, what);
  if (rc) {
    mr_free(kids.v);
    return rc;
  }
  gc__tmpl_node *n = node(P, kind, pos);
  if (!n) {
    mr_free(kids.v);
    return P->e->code;
  }
  n->n = kids.n;
  n->kids = freeze(P, &kids);
  *out = n;
  return n->kids ? 0 : P->e->code;
}

/* A name or a literal. true / True / false / False / none / None are constants whatever
 * the scope holds (jinja2 decides this at parse time). with_ns: "ns.attr" is a namespace
 * reference (set targets only). Inside a macro, caller / varargs / kwargs would need
 * jinja2's implicit arguments: refused. */
static int parse_primary(parser *P, bool with_ns, gc__tmpl_node **out) {
  const gc__tmpl_tok *t = cur(P);
  gc__tmpl_node *n;
  int rc;
  switch (t->kind) {
  case GC__TK_NAME:
    advance(P);
    if (is_name(t, "true") || is_name(t, "True") || is_name(t, "false") || is_name(t, "False")) {
      if (!(n = node(P, GC__TN_CONST, t->pos))) return P->e->code;
      n->val = gc__tmpl_bool(t->s.p[0] == 't' || t->s.p[0] == 'T');
    } else if (is_name(t, "none") || is_name(t, "None")) {
      if (!(n = node(P, GC__TN_CONST, t->pos))) return P->e->code;
      n->val = gc__tmpl_none();
    } else if (with_ns && is_op(cur(P), GC__TOP_DOT)) {
      advance(P);
      const gc__tmpl_tok *attr = cur(P);
      if ((rc = expect_kind(P, GC__TK_NAME, "an attribute name"))) return rc;
      gc__tmpl_node *nm = node(P, GC__TN_NAME, t->pos);
      if (!(n = node(P, GC__TN_NSREF, t->pos)) || !nm) return P->e->code;
      if ((rc = intern(P, t->s.p, t->s.n, &nm->id))) return rc;
      n->a = nm;
      n->val = gc__tmpl_strv(attr->s.p, attr->s.n);
    } else {
      if (!(n = node(P, GC__TN_NAME, t->pos))) return P->e->code;
      if ((rc = intern(P, t->s.p, t->s.n, &n->id))) return rc;
      if (P->macros && (is_name(t, "caller") || is_name(t, "varargs") || is_name(t, "kwargs")))
        return pfail(P, t->pos, MR_ENOTSUP, "\"%.*s\" in a macro is not supported", (int)t->s.n,
                     t->s.p);
    }
    *out = n;
    return 0;
  case GC__TK_STRING: {
    /* Adjacent string literals are one string, as in Python. */
    size_t total = 0, j = P->i;
    while (P->tk[j].kind == GC__TK_STRING) total += P->tk[j++].val.u.s.n;
    if (!(n = node(P, GC__TN_CONST, t->pos))) return P->e->code;
    if (j == P->i + 1) {
      n->val = t->val;
      advance(P);
    } else {
      char *buf = gc__tmpl_alloc(&P->t->heap, total + 1);
      if (!buf) return P->e->code;
      size_t o = 0;
      while (cur(P)->kind == GC__TK_STRING) {
        const gc__tmpl_tok *s = advance(P);
        memcpy(buf + o, s->val.u.s.p, s->val.u.s.n);
        o += s->val.u.s.n;
      }
      n->val = gc__tmpl_strv(buf, o);
    }
    *out = n;
    return 0;
  }
  case GC__TK_INT:
  case GC__TK_FLOAT:
    advance(P);
    if (!(n = node(P, GC__TN_CONST, t->pos))) return P->e->code;
    n->val = t->val;
    *out = n;
    return 0;
  case GC__TK_OP:
    if (t->op == GC__TOP_LPAREN) {
      advance(P);
      if ((rc = parse_tuple(P, false, true, NULL, true, false, out))) return rc;
      return expect_op(P, GC__TOP_RPAREN, ")");
    }
    if (t->op == GC__TOP_LBRACKET) return parse_list_like(P, GC__TN_LIST, GC__TOP_RBRACKET, "]", out);
    if (t->op == GC__TOP_LBRACE) return parse_list_like(P, GC__TN_DICT, GC__TOP_RBRACE, "}", out);
    /* fall through */
  default: {
    char buf[80];
    return pfail(P, t->pos, MR_EFORMAT, "unexpected '%s'", describe(t, buf, sizeof buf));
  }
  }
}

/* jinja2's is_tuple_end: a tag end, ")", or the word that follows the tuple. */
static bool tuple_end(const parser *P, const char *end_name) {
  const gc__tmpl_tok *t = cur(P);
  if (t->kind == GC__TK_VAR_END || t->kind == GC__TK_BLOCK_END || is_op(t, GC__TOP_RPAREN))
    return true;
  return end_name && is_name(t, end_name);
}

/* jinja2's parse_tuple: one expression, or a tuple when commas separate several (a
 * trailing comma makes a one-item tuple). It ends at "}}", "%}", ")" or end_name ("in"
 * after a for target, "recursive" after its iterable). simplified: names and literals
 * only (targets). Empty "()" is a tuple only inside explicit parentheses. */
static int parse_tuple(parser *P, bool simplified, bool condexpr, const char *end_name,
                       bool explicit_parens, bool with_ns, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  nodelist items = {0};
  bool is_tuple = false;
  int rc = 0;
  for (;;) {
    if (items.n && (rc = expect_op(P, GC__TOP_COMMA, ","))) break;
    if (tuple_end(P, end_name)) break;
    gc__tmpl_node *x = NULL;
    if (simplified) {
      rc = parse_primary(P, with_ns, &x);
    } else {
      rc = parse_expression(P, condexpr, &x);
    }
    if (rc || (rc = nl_push(P, &items, x))) break;
    if (is_op(cur(P), GC__TOP_COMMA))
      is_tuple = true;
    else
      break;
  }
  if (rc) {
    mr_free(items.v);
    return rc;
  }
  if (!is_tuple) {
    if (items.n) {
      *out = items.v[0];
      mr_free(items.v);
      return 0;
    }
    if (!explicit_parens) {
      char buf[80];
      return pfail(P, cur(P)->pos, MR_EFORMAT, "expected an expression, got '%s'",
                   describe(cur(P), buf, sizeof buf));
    }
  }
  gc__tmpl_node *n = node(P, GC__TN_TUPLE, pos);
  if (!n) {
    mr_free(items.v);
    return P->e->code;
  }
  n->n = items.n;
  n->kids = freeze(P, &items);
  *out = n;
  return n->kids ? 0 : P->e->code;
}

/* ( args ) into n->kids / kw / kwv: positional arguments first, then keywords (a
 * positional one after a keyword is a syntax error, as in Python); a trailing comma is
 * fine; *args and **kwargs are refused. */
static int parse_call_args(parser *P, gc__tmpl_node *n) {
  size_t pos = cur(P)->pos;
  int rc = expect_op(P, GC__TOP_LPAREN, "(");
  if (rc) return rc;
  nodelist args = {0}, kwv = {0};
  gc__tmpl_str kw[32];
  bool need_comma = false;
  while (!is_op(cur(P), GC__TOP_RPAREN)) {
    if (need_comma) {
      if ((rc = expect_op(P, GC__TOP_COMMA, ","))) goto out;
      if (is_op(cur(P), GC__TOP_RPAREN)) break;
    }
    const gc__tmpl_tok *t = cur(P);
    if (is_op(t, GC__TOP_MUL) || is_op(t, GC__TOP_POW)) {
      rc = pfail(P, t->pos, MR_ENOTSUP, "\"%s\" arguments are not supported",
                 t->op == GC__TOP_MUL ? "*args" : "**kwargs");
      goto out;
    }
    gc__tmpl_node *x = NULL;
    if (t->kind == GC__TK_NAME && is_op(peek(P), GC__TOP_ASSIGN)) {
      if (kwv.n == sizeof kw / sizeof kw[0]) {
        rc = pfail(P, t->pos, MR_ENOTSUP, "more than %zu keyword arguments",
                   sizeof kw / sizeof kw[0]);
        goto out;
      }
      for (uint32_t k = 0; k < kwv.n; k++)
        if (kw[k].n == t->s.n && memcmp(kw[k].p, t->s.p, t->s.n) == 0) {
          rc = pfail(P, t->pos, MR_EFORMAT, "keyword argument repeated: %.*s", (int)t->s.n, t->s.p);
          goto out;
        }
      kw[kwv.n] = t->s;
      advance(P), advance(P);
      if ((rc = parse_expression(P, true, &x)) || (rc = nl_push(P, &kwv, x))) goto out;
    } else {
      if (kwv.n) {
        rc = pfail(P, t->pos, MR_EFORMAT, "invalid syntax for function call expression "
                   "(a positional argument after a keyword argument)");
        goto out;
      }
      if ((rc = parse_expression(P, true, &x)) || (rc = nl_push(P, &args, x))) goto out;
    }
    need_comma = true;
  }
  if ((rc = expect_op(P, GC__TOP_RPAREN, ")"))) goto out;
  (void)pos;
  n->n = args.n;
  n->kids = freeze(P, &args);
  n->nkw = kwv.n;
  n->kwv = freeze(P, &kwv);
  n->kw = gc__tmpl_alloc(&P->t->heap, (n->nkw ? n->nkw : 1) * sizeof *n->kw);
  if (!n->kids || !n->kwv || !n->kw) return P->e->code;
  memcpy(n->kw, kw, n->nkw * sizeof *kw);
  return 0;
out:
  mr_free(args.v);
  mr_free(kwv.v);
  return rc;
}

static bool str_is(const gc__tmpl_str *s, const char *lit) {
  size_t n = strlen(lit);
  return s->n == n && memcmp(s->p, lit, n) == 0;
}

/* A call after a postfix or filter expression. Which callees exist is known here: a
 * name is a macro of this template or a global function; an attribute is a method of
 * the subset. Everything else (a Python builtin the sandbox exposes, a context value,
 * a call of a call's result) is refused now rather than failing at some render. */
static int parse_call(parser *P, gc__tmpl_node **node_) {
  gc__tmpl_node *callee = *node_;
  gc__tmpl_node *n = node(P, GC__TN_CALL, cur(P)->pos);
  if (!n) return P->e->code;
  n->a = callee;
  /* What may be called: a global function, a macro of this template, a method of the
   * subset. Anything else would be an expression's result or a context value, which
   * cannot be callable here. */
  if (callee->kind == GC__TN_NAME) {
    const gc__tmpl_str *nm = &P->names[callee->id];
    if (!P->is_macro[callee->id] && !gc__tmpl_func_id(nm->p, nm->n)) {
      if (str_is(nm, "caller") || str_is(nm, "super") || str_is(nm, "self") ||
          str_is(nm, "lipsum") || str_is(nm, "cycler") || str_is(nm, "joiner"))
        return pfail(P, callee->pos, MR_ENOTSUP, "\"%.*s()\" is not supported", (int)nm->n, nm->p);
      return pfail(P, callee->pos, MR_ENOTSUP,
                   "function \"%.*s\" is not supported (not a macro of this template)",
                   (int)(nm->n > 60 ? 60 : nm->n), nm->p);
    }
  } else if (callee->kind == GC__TN_GETATTR) {
    const gc__tmpl_str *nm = &callee->val.u.s;
    if (!gc__tmpl_method_known(nm->p, nm->n))
      return pfail(P, callee->pos, MR_ENOTSUP, "method \"%.*s\" is not supported",
                   (int)(nm->n > 60 ? 60 : nm->n), nm->p);
  } else {
    return pfail(P, n->pos, MR_ENOTSUP,
                 "calling the result of an expression is not supported");
  }
  int rc = parse_call_args(P, n);
  if (rc) return rc;
  *node_ = n;
  return 0;
}

/* One subscript: an expression, or a slice [start]:[stop][:[step]] with any part left
 * out (jinja2's parse_subscribed). */
static int parse_subscribed(parser *P, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  gc__tmpl_node *parts[3] = {NULL, NULL, NULL};
  int rc;
  if (is_op(cur(P), GC__TOP_COLON)) {
    advance(P);
  } else {
    if ((rc = parse_expression(P, true, &parts[0]))) return rc;
    if (!is_op(cur(P), GC__TOP_COLON)) {
      *out = parts[0];
      return 0;
    }
    advance(P);
  }
  if (!is_op(cur(P), GC__TOP_COLON) && !is_op(cur(P), GC__TOP_RBRACKET) &&
      !is_op(cur(P), GC__TOP_COMMA)) {
    if ((rc = parse_expression(P, true, &parts[1]))) return rc;
  }
  if (is_op(cur(P), GC__TOP_COLON)) {
    advance(P);
    if (!is_op(cur(P), GC__TOP_RBRACKET) && !is_op(cur(P), GC__TOP_COMMA))
      if ((rc = parse_expression(P, true, &parts[2]))) return rc;
  }
  gc__tmpl_node *s = node(P, GC__TN_SLICE, pos);
  if (!s) return P->e->code;
  s->a = parts[0], s->b = parts[1], s->c = parts[2];
  *out = s;
  return 0;
}

/* .name, .0 (an integer after the dot is an item, not an attribute), or [subscripts]
 * (several make a tuple key). */
static int parse_subscript(parser *P, gc__tmpl_node **node_) {
  const gc__tmpl_tok *t = advance(P);
  int rc;
  if (t->kind == GC__TK_OP && t->op == GC__TOP_DOT) {
    const gc__tmpl_tok *a = advance(P);
    if (a->kind == GC__TK_NAME) {
      gc__tmpl_node *n = node(P, GC__TN_GETATTR, t->pos);
      if (!n) return P->e->code;
      n->a = *node_;
      n->val = gc__tmpl_strv(a->s.p, a->s.n);
      *node_ = n;
      return 0;
    }
    if (a->kind != GC__TK_INT) return pfail(P, a->pos, MR_EFORMAT, "expected name or number");
    gc__tmpl_node *n = node(P, GC__TN_GETITEM, t->pos), *k = node(P, GC__TN_CONST, a->pos);
    if (!n || !k) return P->e->code;
    k->val = a->val;
    n->a = *node_, n->b = k;
    *node_ = n;
    return 0;
  }
  /* [ key ] or [ a, b ] (a tuple key) or slices */
  nodelist args = {0};
  rc = 0;
  while (!is_op(cur(P), GC__TOP_RBRACKET)) {
    if (args.n && (rc = expect_op(P, GC__TOP_COMMA, ","))) break;
    gc__tmpl_node *x = NULL;
    if ((rc = parse_subscribed(P, &x)) || (rc = nl_push(P, &args, x))) break;
  }
  if (!rc) rc = expect_op(P, GC__TOP_RBRACKET, "]");
  if (!rc && args.n == 0) rc = pfail(P, t->pos, MR_EFORMAT, "expected subscript expression");
  if (rc) {
    mr_free(args.v);
    return rc;
  }
  gc__tmpl_node *n = node(P, GC__TN_GETITEM, t->pos);
  if (!n) {
    mr_free(args.v);
    return P->e->code;
  }
  n->a = *node_;
  if (args.n == 1) {
    n->b = args.v[0];
    mr_free(args.v);
  } else {
    gc__tmpl_node *tup = node(P, GC__TN_TUPLE, t->pos);
    if (!tup) {
      mr_free(args.v);
      return P->e->code;
    }
    tup->n = args.n;
    tup->kids = freeze(P, &args);
    if (!tup->kids) return P->e->code;
    for (uint32_t k = 0; k < tup->n; k++)
      if (tup->kids[k]->kind == GC__TN_SLICE)
        return pfail(P, tup->kids[k]->pos, MR_ENOTSUP, "multi-dimensional slices are not supported");
    n->b = tup;
  }
  *node_ = n;
  return 0;
}

/* True if jinja2 can fold n at compile time (nodes.as_const): literals and what is built
 * from them by operators, tests and the filters that need no context. See mark_slices. */
static bool is_const(const gc__tmpl_node *n) {
  if (!n) return true;
  switch (n->kind) {
  case GC__TN_CONST:
    return true;
  case GC__TN_LIST:
  case GC__TN_TUPLE:
  case GC__TN_DICT:
  case GC__TN_CONCAT:
    for (uint32_t k = 0; k < n->n; k++)
      if (!is_const(n->kids[k])) return false;
    return true;
  case GC__TN_COMPARE:
    for (uint32_t k = 0; k < n->n; k++)
      if (!is_const(n->kids[k])) return false;
    return is_const(n->a);
  case GC__TN_FILTER:
  case GC__TN_TEST:
    if (n->kind == GC__TN_FILTER &&
        (n->fn == GC__TFL_MAP || n->fn == GC__TFL_SELECT || n->fn == GC__TFL_REJECT ||
         n->fn == GC__TFL_SELECTATTR || n->fn == GC__TFL_REJECTATTR))
      return false; /* pass_context filters are never folded */
    for (uint32_t k = 0; k < n->n; k++)
      if (!is_const(n->kids[k])) return false;
    for (uint32_t k = 0; k < n->nkw; k++)
      if (!is_const(n->kwv[k])) return false;
    return is_const(n->a);
  case GC__TN_NOT:
  case GC__TN_NEG:
  case GC__TN_POS:
  case GC__TN_GETATTR:
    return is_const(n->a);
  case GC__TN_BIN:
  case GC__TN_AND:
  case GC__TN_OR:
  case GC__TN_GETITEM:
    return is_const(n->a) && is_const(n->b);
  case GC__TN_SLICE:
  case GC__TN_COND:
    return is_const(n->a) && is_const(n->b) && is_const(n->c);
  default:
    return false;
  }
}

/* Postfixes in any order and number: x.a[0](1).b ... */
static int parse_postfix(parser *P, gc__tmpl_node **node_) {
  int links = 0, rc = 0;
  for (;;) {
    const gc__tmpl_tok *t = cur(P);
    if (is_op(t, GC__TOP_DOT) || is_op(t, GC__TOP_LBRACKET)) {
      if (!(rc = chain_link(P, t->pos, &links))) rc = parse_subscript(P, node_);
    } else if (is_op(t, GC__TOP_LPAREN)) {
      if (!(rc = chain_link(P, t->pos, &links))) rc = parse_call(P, node_);
    } else {
      break;
    }
    if (rc) break;
  }
  P->depth -= links;
  return rc;
}

/* A constant test or filter name given to select / reject / selectattr / rejectattr / map
 * is checked now (it is the common case: selectattr("role", "equalto", "user")); a
 * computed one is checked when called. map(attribute=...) takes no filter name. */
static int check_name_arg(parser *P, gc__tmpl_node *f) {
  uint32_t k;
  bool test;
  switch (f->fn) {
  case GC__TFL_SELECT:
  case GC__TFL_REJECT: k = 0, test = true; break;
  case GC__TFL_SELECTATTR:
  case GC__TFL_REJECTATTR: k = 1, test = true; break;
  case GC__TFL_MAP: k = 0, test = false; break;
  default: return 0;
  }
  if (f->fn == GC__TFL_MAP)
    for (uint32_t j = 0; j < f->nkw; j++)
      if (str_is(&f->kw[j], "attribute")) return 0;
  if (k >= f->n || f->kids[k]->kind != GC__TN_CONST || f->kids[k]->val.kind != GC__TV_STR) return 0;
  const gc__tmpl_str *s = &f->kids[k]->val.u.s;
  bool ok = test ? gc__tmpl_test_id(s->p, s->n) != 0 : gc__tmpl_filter_id(s->p, s->n) != 0;
  if (ok) return 0;
  return pfail(P, f->kids[k]->pos, MR_ENOTSUP, "%s \"%.*s\" is not supported",
               test ? "test" : "filter", (int)(s->n > 60 ? 60 : s->n), s->p);
}

/* |name or |name(args), repeated. The name must be a filter of the subset; jinja2's
 * dotted filter names (from extensions) are refused. */
static int parse_filter(parser *P, gc__tmpl_node **node_) {
  int links = 0, rc = 0;
  while (is_op(cur(P), GC__TOP_PIPE)) {
    if ((rc = chain_link(P, cur(P)->pos, &links))) break;
    rc = parse_filter1(P, node_);
    if (rc) break;
  }
  P->depth -= links;
  return rc;
}

static int parse_filter1(parser *P, gc__tmpl_node **node_) {
  {
    advance(P);
    const gc__tmpl_tok *t = cur(P);
    int rc = expect_kind(P, GC__TK_NAME, "a filter name");
    if (rc) return rc;
    if (is_op(cur(P), GC__TOP_DOT))
      return pfail(P, t->pos, MR_ENOTSUP, "dotted filter names are not supported");
    uint16_t id = gc__tmpl_filter_id(t->s.p, t->s.n);
    if (!id)
      return pfail(P, t->pos, MR_ENOTSUP, "filter \"%.*s\" is not supported",
                   (int)(t->s.n > 60 ? 60 : t->s.n), t->s.p);
    gc__tmpl_node *f = node(P, GC__TN_FILTER, t->pos);
    if (!f) return P->e->code;
    f->fn = id;
    f->a = *node_;
    if (is_op(cur(P), GC__TOP_LPAREN)) {
      if ((rc = parse_call_args(P, f))) return rc;
    } else {
      f->kids = NULL, f->n = 0;
    }
    if ((rc = check_name_arg(P, f))) return rc;
    *node_ = f;
  }
  return 0;
}

/* is [not] name, with arguments in parentheses or one argument without them (jinja2:
 * "x is divisibleby 3", "x is sameas none"), unless the next word ends the expression
 * (else, or, and). "is not t" is not (x is t). */
static int parse_test(parser *P, gc__tmpl_node **node_) {
  size_t pos = advance(P)->pos; /* "is" */
  bool negated = false;
  int rc;
  if (is_name(cur(P), "not")) {
    advance(P);
    negated = true;
  }
  const gc__tmpl_tok *t = cur(P);
  if ((rc = expect_kind(P, GC__TK_NAME, "a test name"))) return rc;
  if (is_op(cur(P), GC__TOP_DOT))
    return pfail(P, t->pos, MR_ENOTSUP, "dotted test names are not supported");
  uint16_t id = gc__tmpl_test_id(t->s.p, t->s.n);
  if (!id)
    return pfail(P, t->pos, MR_ENOTSUP, "test \"%.*s\" is not supported",
                 (int)(t->s.n > 60 ? 60 : t->s.n), t->s.p);
  gc__tmpl_node *n = node(P, GC__TN_TEST, pos);
  if (!n) return P->e->code;
  n->fn = id;
  n->a = *node_;
  const gc__tmpl_tok *c = cur(P);
  if (is_op(c, GC__TOP_LPAREN)) {
    if ((rc = parse_call_args(P, n))) return rc;
  } else if ((c->kind == GC__TK_NAME || c->kind == GC__TK_STRING || c->kind == GC__TK_INT ||
              c->kind == GC__TK_FLOAT || is_op(c, GC__TOP_LBRACKET) ||
              is_op(c, GC__TOP_LBRACE)) &&
             !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
    if (is_name(c, "is")) return pfail(P, c->pos, MR_EFORMAT, "you cannot chain multiple tests with is");
    gc__tmpl_node *arg = NULL;
    if ((rc = parse_primary(P, false, &arg)) || (rc = parse_postfix(P, &arg))) return rc;
    n->kids = gc__tmpl_alloc(&P->t->heap, sizeof *n->kids);
    if (!n->kids) return P->e->code;
    n->kids[0] = arg;
    n->n = 1;
  }
  if (negated) {
    gc__tmpl_node *x = node(P, GC__TN_NOT, pos);
    if (!x) return P->e->code;
    x->a = n;
    n = x;
  }
  *node_ = n;
  return 0;
}

/* Filters, tests and calls after a unary, in any order: x|f is t, x|f(1)(2) ... */
static int parse_filter_expr(parser *P, gc__tmpl_node **node_) {
  int links = 0, rc = 0;
  for (;;) {
    const gc__tmpl_tok *t = cur(P);
    if (!is_op(t, GC__TOP_PIPE) && !is_name(t, "is") && !is_op(t, GC__TOP_LPAREN)) break;
    if ((rc = chain_link(P, t->pos, &links))) break;
    if (is_op(t, GC__TOP_PIPE))
      rc = parse_filter(P, node_);
    else if (is_name(t, "is"))
      rc = parse_test(P, node_);
    else
      rc = parse_call(P, node_);
    if (rc) break;
  }
  P->depth -= links;
  return rc;
}

/* ---- statements ------------------------------------------------------------------ */

/* Each {% tag %} becomes a node (tmpl_internal.h) whose bodies are BODY nodes. The tags
 * of the subset are those the published templates use; the others are refused by name
 * (a template that uses them would render differently or not at all), so that the
 * caller learns at load time, not at the first request, that a model's template is out
 * of reach. */

/* Skips an optional colon, expects the tag's end and parses the body up to one of ends
 * (left as the current token). */
static int parse_statements(parser *P, const char *const *ends, gc__tmpl_node **out) {
  if (is_op(cur(P), GC__TOP_COLON)) advance(P);
  int rc = expect_kind(P, GC__TK_BLOCK_END, "end of statement block");
  if (rc) return rc;
  return subparse(P, ends, out);
}

/* Consumes the end name of a block (endfor, endif, ...); the block end after it is
 * expected by the caller's subparse, as in jinja2's drop_needle. */
static int drop_end(parser *P) {
  advance(P); /* the end name; the caller's subparse expects the block end */
  return 0;
}

/* for / set targets: a name, or a flat tuple of names (NSREF too where with_ns). jinja2
 * allows nested tuples; no template of the families uses them. */
static int check_target(parser *P, gc__tmpl_node *t, bool with_ns) {
  if (t->kind == GC__TN_NAME) return 0;
  if (t->kind == GC__TN_NSREF && with_ns) return 0;
  if (t->kind == GC__TN_TUPLE) {
    for (uint32_t k = 0; k < t->n; k++) {
      if (t->kids[k]->kind == GC__TN_TUPLE)
        return pfail(P, t->kids[k]->pos, MR_ENOTSUP, "nested tuple targets are not supported");
      if (t->kids[k]->kind != GC__TN_NAME)
        return pfail(P, t->kids[k]->pos, MR_EFORMAT, "can't assign to this expression");
    }
    return 0;
  }
  return pfail(P, t->pos, MR_EFORMAT, "can't assign to this expression");
}

/* {% for target in iterable [if filter] [recursive] %} body [{% else %} body] {% endfor %}.
 * break / continue are allowed in the body (loopcontrols); a macro is not (it would close
 * over the loop's scope, which the walker does not model). */
static int parse_for(parser *P, size_t pos, gc__tmpl_node **out) {
  static const char *const ends_body[] = {"endfor", "else", NULL};
  static const char *const ends_else[] = {"endfor", NULL};
  gc__tmpl_node *n = node(P, GC__TN_FOR, pos);
  if (!n) return P->e->code;
  int rc;
  if ((rc = parse_tuple(P, true, true, "in", false, false, &n->a))) return rc;
  if ((rc = check_target(P, n->a, false))) return rc;
  if (!is_name(cur(P), "in")) return pfail(P, cur(P)->pos, MR_EFORMAT, "expected 'in'");
  advance(P);
  if ((rc = parse_tuple(P, false, false, "recursive", false, false, &n->b))) return rc;
  if (is_name(cur(P), "if")) {
    advance(P);
    if ((rc = parse_expression(P, true, &n->c))) return rc;
  }
  if (is_name(cur(P), "recursive"))
    return pfail(P, cur(P)->pos, MR_ENOTSUP, "\"recursive\" loops are not supported");
  P->loops++, P->closures++;
  rc = parse_statements(P, ends_body, &n->d);
  P->loops--, P->closures--;
  if (rc) return rc;
  if (is_name(advance(P), "else")) {
    if ((rc = parse_statements(P, ends_else, &n->e))) return rc;
    drop_end(P);
  }
  *out = n;
  return 0;
}

/* {% if %} ... {% elif %} ... {% else %} ... {% endif %}: each elif an IF in the else
 * slot of the previous one, counted as nesting (chain_link). */
static int parse_if(parser *P, size_t pos, gc__tmpl_node **out) {
  static const char *const ends[] = {"elif", "else", "endif", NULL};
  static const char *const ends_else[] = {"endif", NULL};
  gc__tmpl_node *first = NULL, *n = NULL;
  int rc, links = 0;
  for (;;) {
    if (n && (rc = chain_link(P, pos, &links))) return rc;
    gc__tmpl_node *x = node(P, GC__TN_IF, pos);
    if (!x) return P->e->code;
    if (n)
      n->c = x;
    else
      first = x;
    n = x;
    if ((rc = parse_tuple(P, false, false, NULL, false, false, &n->a))) return rc;
    if ((rc = parse_statements(P, ends, &n->b))) return rc;
    const gc__tmpl_tok *t = advance(P);
    if (is_name(t, "elif")) {
      pos = cur(P)->pos;
      continue;
    }
    if (is_name(t, "else")) {
      if ((rc = parse_statements(P, ends_else, &n->c))) return rc;
      drop_end(P);
    }
    break;
  }
  P->depth -= links;
  *out = first;
  return 0;
}

/* {% set target = value %} (a value list makes a tuple) or {% set target %} body
 * {% endset %} (the body's text is the value). */
static int parse_set(parser *P, size_t pos, gc__tmpl_node **out) {
  static const char *const ends[] = {"endset", NULL};
  gc__tmpl_node *target = NULL;
  int rc;
  if ((rc = parse_tuple(P, true, true, NULL, false, true, &target))) return rc;
  if ((rc = check_target(P, target, true))) return rc;
  if (is_op(cur(P), GC__TOP_ASSIGN)) {
    advance(P);
    gc__tmpl_node *n = node(P, GC__TN_SET, pos);
    if (!n) return P->e->code;
    n->a = target;
    if ((rc = parse_tuple(P, false, true, NULL, false, false, &n->b))) return rc;
    *out = n;
    return 0;
  }
  if (is_op(cur(P), GC__TOP_PIPE))
    return pfail(P, cur(P)->pos, MR_ENOTSUP, "a filter on a {%% set %%} block is not supported");
  if (target->kind == GC__TN_TUPLE)
    return pfail(P, target->pos, MR_EFORMAT, "a {%% set %%} block assigns one name");
  gc__tmpl_node *n = node(P, GC__TN_SETBLOCK, pos);
  if (!n) return P->e->code;
  n->a = target;
  if ((rc = parse_statements(P, ends, &n->d))) return rc;
  drop_end(P);
  *out = n;
  return 0;
}

/* {% macro name(a, b=default, ...) %} body {% endmacro %}. Defaults are expressions,
 * evaluated at each call in the macro's scope; a parameter without default after one
 * with is a syntax error as in Python. */
static int parse_macro(parser *P, size_t pos, gc__tmpl_node **out) {
  static const char *const ends[] = {"endmacro", NULL};
  if (P->closures)
    return pfail(P, pos, MR_ENOTSUP,
                 "\"macro\" inside a for loop or another macro is not supported");
  const gc__tmpl_tok *t = cur(P);
  int rc;
  if ((rc = expect_kind(P, GC__TK_NAME, "a macro name"))) return rc;
  gc__tmpl_node *n = node(P, GC__TN_MACRO, pos);
  if (!n) return P->e->code;
  if ((rc = intern(P, t->s.p, t->s.n, &n->id))) return rc;
  n->val = gc__tmpl_strv(t->s.p, t->s.n);
  if ((rc = expect_op(P, GC__TOP_LPAREN, "("))) return rc;
  nodelist params = {0}, defs = {0};
  bool any_default = false;
  while (!is_op(cur(P), GC__TOP_RPAREN)) {
    if (params.n && (rc = expect_op(P, GC__TOP_COMMA, ","))) goto fail;
    const gc__tmpl_tok *p = cur(P);
    if ((rc = expect_kind(P, GC__TK_NAME, "a parameter name"))) goto fail;
    gc__tmpl_node *pn = node(P, GC__TN_NAME, p->pos), *def = NULL;
    if (!pn) {
      rc = P->e->code;
      goto fail;
    }
    if ((rc = intern(P, p->s.p, p->s.n, &pn->id))) goto fail;
    if (is_op(cur(P), GC__TOP_ASSIGN)) {
      advance(P);
      if ((rc = parse_expression(P, true, &def))) goto fail;
      any_default = true;
    } else if (any_default) {
      rc = pfail(P, p->pos, MR_EFORMAT, "non-default argument follows default argument");
      goto fail;
    }
    if ((rc = nl_push(P, &params, pn)) || (rc = nl_push(P, &defs, def))) goto fail;
  }
  advance(P);
  n->n = params.n;
  n->kids = freeze(P, &params);
  n->defs = freeze(P, &defs);
  if (!n->kids || !n->defs) return P->e->code;
  {
    int loops = P->loops;
    P->loops = 0, P->closures++, P->macros++;
    rc = parse_statements(P, ends, &n->d);
    P->loops = loops, P->closures--, P->macros--;
  }
  if (rc) return rc;
  drop_end(P);
  *out = n;
  return 0;
fail:
  mr_free(params.v);
  mr_free(defs.v);
  return rc;
}

/* One {% tag %}: the statements of the subset, the refused ones by name, unknown tags as
 * jinja2's syntax error. */
static int parse_statement(parser *P, gc__tmpl_node **out) {
  static const char *const refused[] = {
      "block", "extends", "include", "import", "from",  "with", "autoescape",
      "call",  "filter",  "do",      "trans",  "debug", "pluralize"};
  static const char *const ends_gen[] = {"endgeneration", NULL};
  const gc__tmpl_tok *t = cur(P);
  if (t->kind != GC__TK_NAME) return pfail(P, t->pos, MR_EFORMAT, "tag name expected");
  size_t pos = t->pos;
  int rc;
  ENTER(P, pos);
  if (is_name(t, "for")) {
    advance(P);
    rc = parse_for(P, pos, out);
  } else if (is_name(t, "if")) {
    advance(P);
    rc = parse_if(P, pos, out);
  } else if (is_name(t, "set")) {
    advance(P);
    rc = parse_set(P, pos, out);
  } else if (is_name(t, "macro")) {
    advance(P);
    rc = parse_macro(P, pos, out);
  } else if (is_name(t, "break") || is_name(t, "continue")) {
    bool brk = is_name(t, "break");
    advance(P);
    if (!P->loops)
      return pfail(P, pos, MR_EFORMAT, "'%s' outside loop", brk ? "break" : "continue");
    rc = (*out = node(P, brk ? GC__TN_BREAK : GC__TN_CONTINUE, pos)) ? 0 : P->e->code;
  } else if (is_name(t, "print")) {
    advance(P);
    nodelist items = {0};
    rc = 0;
    while (!rc && cur(P)->kind != GC__TK_BLOCK_END) {
      gc__tmpl_node *x = NULL, *pr;
      if (items.n && (rc = expect_op(P, GC__TOP_COMMA, ","))) break;
      if ((rc = parse_expression(P, true, &x))) break;
      if (!(pr = node(P, GC__TN_PRINT, x->pos))) {
        rc = P->e->code;
        break;
      }
      pr->a = x;
      rc = nl_push(P, &items, pr);
    }
    gc__tmpl_node *body = rc ? NULL : node(P, GC__TN_BODY, pos);
    if (body) {
      body->n = items.n;
      body->kids = freeze(P, &items);
      *out = body;
      if (!body->kids) rc = P->e->code;
    } else {
      mr_free(items.v);
      if (!rc) rc = P->e->code;
    }
  } else if (is_name(t, "generation")) {
    /* transformers' AssistantTracker: the body renders as it is. */
    advance(P);
    rc = parse_statements(P, ends_gen, out);
    if (!rc) drop_end(P);
  } else {
    for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++)
      if (is_name(t, refused[k]))
        return pfail(P, pos, MR_ENOTSUP, "\"%s\" is not supported", refused[k]);
    return pfail(P, pos, MR_EFORMAT, "unknown tag \"%.*s\"", (int)(t->s.n > 60 ? 60 : t->s.n),
                 t->s.p);
  }
  LEAVE(P);
  return rc;
}

static bool is_end(const gc__tmpl_tok *t, const char *const *ends) {
  for (; ends && *ends; ends++)
    if (is_name(t, *ends)) return true;
  return false;
}

/* A body: text, {{ }} and statements, up to a {% tag %} named in ends (left current)
 * or the end of the template (only without ends). A stray end tag ("endif" where none
 * is open) is jinja2's "unexpected" error. */
static int subparse(parser *P, const char *const *ends, gc__tmpl_node **out) {
  size_t pos = cur(P)->pos;
  nodelist body = {0};
  int rc = 0;
  ENTER(P, pos);
  for (;;) {
    const gc__tmpl_tok *t = cur(P);
    gc__tmpl_node *x = NULL;
    if (t->kind == GC__TK_EOF) {
      if (ends) {
        const char *const *want = ends; /* name the closing tag: endif, not elif */
        while (want[1] && strncmp(*want, "end", 3) != 0) want++;
        rc = pfail(P, t->pos, MR_EFORMAT, "unexpected end of template, expected '%s'", *want);
      }
      break;
    }
    if (t->kind == GC__TK_DATA) {
      advance(P);
      if (!(x = node(P, GC__TN_DATA, t->pos))) {
        rc = P->e->code;
        break;
      }
      x->val = gc__tmpl_strv(t->s.p, t->s.n);
    } else if (t->kind == GC__TK_VAR_BEGIN) {
      advance(P);
      if (!(x = node(P, GC__TN_PRINT, t->pos))) {
        rc = P->e->code;
        break;
      }
      if ((rc = parse_tuple(P, false, true, NULL, false, false, &x->a))) break;
      if ((rc = expect_kind(P, GC__TK_VAR_END, "end of print statement"))) break;
    } else if (t->kind == GC__TK_BLOCK_BEGIN) {
      advance(P);
      if (is_end(cur(P), ends)) break;
      const gc__tmpl_tok *name = cur(P);
      if (name->kind == GC__TK_NAME && name->s.n > 3 && memcmp(name->s.p, "end", 3) == 0) {
        rc = pfail(P, name->pos, MR_EFORMAT, "unexpected \"%.*s\"%s%s%s",
                   (int)(name->s.n > 60 ? 60 : name->s.n), name->s.p,
                   ends ? ", expected '" : "", ends ? ends[0] : "", ends ? "'" : "");
        break;
      }
      if ((rc = parse_statement(P, &x))) break;
      if ((rc = expect_kind(P, GC__TK_BLOCK_END, "end of statement block"))) break;
    } else {
      rc = pfail(P, t->pos, MR_EINTERNAL, "internal parsing error");
      break;
    }
    if ((rc = nl_push(P, &body, x))) break;
  }
  LEAVE(P);
  if (rc) {
    mr_free(body.v);
    return rc;
  }
  gc__tmpl_node *b = node(P, GC__TN_BODY, pos);
  if (!b) {
    mr_free(body.v);
    return P->e->code;
  }
  b->n = body.n;
  b->kids = freeze(P, &body);
  *out = b;
  return b->kids ? 0 : P->e->code;
}

/* jinja2 compiles x[a:b] to Python's own subscription, where a failure (slicing None,
 * a dict, an int) is an error, except where its compile-time folding evaluates it
 * through environment.getitem, where the failure is an undefined value: when the whole
 * {{ }} expression is constant, or when a constant parent turns the result into a value
 * it can fold (a test, `not`, a comparison, a filter, `~`). Marks those slices (op = 1). */
static void mark_slices(gc__tmpl_node *n, const gc__tmpl_node *parent, bool print_const, int depth) {
  if (!n || depth > 4 * GC__TMPL_MAX_NEST) return;
  if (n->kind == GC__TN_GETITEM && n->b && n->b->kind == GC__TN_SLICE && is_const(n)) {
    bool folding_parent = parent && is_const(parent) &&
                          (parent->kind == GC__TN_TEST || parent->kind == GC__TN_NOT ||
                           parent->kind == GC__TN_COMPARE || parent->kind == GC__TN_FILTER ||
                           parent->kind == GC__TN_CONCAT);
    n->op = print_const || folding_parent;
  }
  bool pc = n->kind == GC__TN_PRINT ? is_const(n->a) : print_const;
  gc__tmpl_node *kids[5] = {n->a, n->b, n->c, n->d, n->e};
  for (int k = 0; k < 5; k++) mark_slices(kids[k], n, pc, depth + 1);
  for (uint32_t k = 0; n->kids && k < n->n; k++) mark_slices(n->kids[k], n, pc, depth + 1);
  for (uint32_t k = 0; n->kwv && k < n->nkw; k++) mark_slices(n->kwv[k], n, pc, depth + 1);
  for (uint32_t k = 0; n->defs && k < n->n; k++) mark_slices(n->defs[k], n, pc, depth + 1);
}

/* jinja2's symbol tracking (idtracking.py) for the top-level frame, as far as it changes
 * what a template sees. jinja2 gives each name referenced at the top level a variable
 * of the render function, initialized once at the start: from the render's variables if
 * the first reference (in source order) is a read, or to undefined if it is a store.
 * So `{% set v = 1 %}` as the first mention of v hides a variable v passed to the render,
 * everywhere (loop bodies and macros read the top-level variable), until the set runs:
 * `{% for i in xs %}{{ v }}{% endfor %}{% set v = 1 %}` prints nothing for v. Inside
 * {% if %} a name stored in only some branches is read from the render's variables
 * (jinja2's branch_update); loop bodies, macro bodies and set blocks are frames of
 * their own and add nothing to the top level (a for contributes its iterable only).
 * state[id]: 0 not seen, 1 first read, 2 first stored. */
enum { REF_NONE = 0, REF_LOAD = 1, REF_STORE = 2 };

static void ref_loads(const gc__tmpl_node *n, uint8_t *state, int depth) {
  if (!n || depth > 4 * GC__TMPL_MAX_NEST) return;
  if (n->kind == GC__TN_NAME && !state[n->id]) state[n->id] = REF_LOAD;
  const gc__tmpl_node *kids[5] = {n->a, n->b, n->c, n->d, n->e};
  for (int k = 0; k < 5; k++) ref_loads(kids[k], state, depth + 1);
  for (uint32_t k = 0; n->kids && k < n->n; k++) ref_loads(n->kids[k], state, depth + 1);
  for (uint32_t k = 0; n->kwv && k < n->nkw; k++) ref_loads(n->kwv[k], state, depth + 1);
}

static void ref_store(const gc__tmpl_node *target, uint8_t *state) {
  if (target->kind == GC__TN_NAME) {
    if (!state[target->id]) state[target->id] = REF_STORE;
  } else if (target->kind == GC__TN_NSREF) {
    if (!state[target->a->id]) state[target->a->id] = REF_LOAD; /* ns.x = ... reads ns */
  } else if (target->kind == GC__TN_TUPLE) {
    for (uint32_t k = 0; k < target->n; k++) ref_store(target->kids[k], state);
  }
}

static int ref_stmts(const gc__tmpl_node *n, uint8_t *state, uint32_t nnames, int depth);

/* An {% if %}: the test, then each branch from a copy of the state; a name first seen
 * in the branches is a store only if every branch (an else included) stores it first. */
static int ref_if(const gc__tmpl_node *n, uint8_t *state, uint32_t nnames, int depth) {
  ref_loads(n->a, state, depth + 1);
  uint8_t *b1 = mr_malloc(nnames ? nnames : 1), *b2 = mr_malloc(nnames ? nnames : 1);
  int rc = b1 && b2 ? 0 : MR_ENOMEM;
  if (!rc) {
    memcpy(b1, state, nnames);
    memcpy(b2, state, nnames);
    rc = ref_stmts(n->b, b1, nnames, depth + 1);
    if (!rc && n->c) rc = ref_stmts(n->c, b2, nnames, depth + 1);
  }
  for (uint32_t i = 0; !rc && i < nnames; i++) {
    if (state[i]) continue;
    if (b1[i] == REF_STORE && b2[i] == REF_STORE)
      state[i] = REF_STORE;
    else if (b1[i] || b2[i])
      state[i] = REF_LOAD;
  }
  mr_free(b1);
  mr_free(b2);
  return rc;
}

static int ref_stmts(const gc__tmpl_node *n, uint8_t *state, uint32_t nnames, int depth) {
  if (!n || depth > 4 * GC__TMPL_MAX_NEST) return 0;
  switch (n->kind) {
  case GC__TN_BODY:
    for (uint32_t k = 0; k < n->n; k++) {
      int rc = ref_stmts(n->kids[k], state, nnames, depth + 1);
      if (rc) return rc;
    }
    return 0;
  case GC__TN_PRINT:
    ref_loads(n->a, state, depth + 1);
    return 0;
  case GC__TN_SET:
    ref_loads(n->b, state, depth + 1); /* the value is read before the target is set */
    ref_store(n->a, state);
    return 0;
  case GC__TN_SETBLOCK:
    ref_store(n->a, state);
    return 0;
  case GC__TN_MACRO:
    if (!state[n->id]) state[n->id] = REF_STORE;
    return 0;
  case GC__TN_FOR:
    ref_loads(n->b, state, depth + 1);
    return 0;
  case GC__TN_IF:
    return ref_if(n, state, nnames, depth);
  default:
    return 0;
  }
}

int gc__tmpl_parse(gc_tmpl *t, const gc__tmpl_tok *toks, size_t n, mr_err *e) {
  parser P = {.t = t, .tk = toks, .n = n, .e = e};
  int rc = 0;
  /* The names every {% macro %} defines, so that calls of macros defined further down
   * (from other macros) are known. */
  for (size_t i = 0; i + 2 < n && !rc; i++)
    if (toks[i].kind == GC__TK_BLOCK_BEGIN && is_name(&toks[i + 1], "macro") &&
        toks[i + 2].kind == GC__TK_NAME) {
      uint32_t id;
      if (!(rc = intern(&P, toks[i + 2].s.p, toks[i + 2].s.n, &id))) P.is_macro[id] = 1;
    }
  if (!rc) rc = subparse(&P, NULL, &t->root);
  if (!rc) mark_slices(t->root, NULL, false, 0);
  if (!rc) {
    t->nnames = P.nnames;
    t->names = gc__tmpl_alloc(&t->heap, (P.nnames ? P.nnames : 1) * sizeof *t->names);
    t->name_fn = gc__tmpl_alloc(&t->heap, (P.nnames ? P.nnames : 1) * sizeof *t->name_fn);
    if (!t->names || !t->name_fn) {
      rc = e->code;
    } else {
      t->loop_id = UINT32_MAX;
      for (uint32_t i = 0; i < P.nnames; i++) {
        t->names[i] = P.names[i];
        t->name_fn[i] = gc__tmpl_func_id(P.names[i].p, P.names[i].n);
        if (str_is(&P.names[i], "loop")) t->loop_id = i;
      }
      t->root_hidden = gc__tmpl_alloc(&t->heap, P.nnames ? P.nnames : 1);
      if (!t->root_hidden) {
        rc = e->code;
      } else {
        memset(t->root_hidden, 0, P.nnames ? P.nnames : 1);
        if (ref_stmts(t->root, t->root_hidden, P.nnames, 0))
          rc = mr_err_set(e, MR_ENOMEM, "out of memory (names)");
        for (uint32_t i = 0; i < P.nnames; i++) t->root_hidden[i] = t->root_hidden[i] == REF_STORE;
      }
    }
  }
  mr_free(P.names);
  mr_free(P.slots);
  mr_free(P.is_macro);
  return rc;
}
