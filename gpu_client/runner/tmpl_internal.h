/*
 * tmpl_internal.h - the chat-template interpreter's internals (prefix gc__tmpl_), shared by
 *
 *   tmpl_lex.c      source -> tokens (jinja2's lexer: tags, whitespace control,
 *                   trim_blocks / lstrip_blocks, string escapes, numbers)
 *   tmpl_parse.c    tokens -> syntax tree (jinja2's grammar and precedence); every name
 *                   of a filter, test, method and function is resolved here, so that a
 *                   construct outside the subset is refused at compile time
 *   tmpl_value.c    values with Python's semantics: str() and repr(), equality and
 *                   order, truthiness, transformers' tojson, the JSON readers
 *   tmpl_names.c    the names of the subset's filters, tests, functions and methods, and
 *                   the lookups over them (the parser's and the runtime's)
 *   tmpl_rt.c       the runtime of one render: errors located at a node, limits,
 *                   attribute / item lookup, slices, iteration, `in`
 *   tmpl_builtin.c  filters, tests, methods of str / dict / list and the global functions
 *   tmpl_eval.c     the tree walker: scopes, statements, operators, calls
 *   chat_template.c the public API (chat_template.h)
 *
 * Calls go one way, down: chat_template.c calls tmpl_lex.c, tmpl_parse.c and tmpl_eval.c;
 * tmpl_eval.c -> tmpl_builtin.c -> tmpl_rt.c -> tmpl_names.c (the walker calls tmpl_rt.c
 * too, the parser tmpl_names.c); all of them stand on tmpl_value.c and tmpl_unicode.c.
 *
 * Memory: a compiled template owns its normalized source and one arena with the tree and
 * its constants. A render owns one arena (gc__tmpl_heap) with a byte budget: every value
 * the render makes lives there until the render ends, nothing is freed one by one. Values
 * are immutable except namespaces (jinja2's ImmutableSandboxedEnvironment refuses every
 * method that mutates a list or a dict), so they are shared freely.
 */
#ifndef GC_TMPL_INTERNAL_H
#define GC_TMPL_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/mr.h"
#include "gpu_client/runner/chat_template.h"

/* Nesting of values (repr, tojson, equality) and of the syntax tree (parser recursion):
 * deeper is an error naming the limit, never a stack overflow. */
#define GC__TMPL_MAX_NEST 256
/* Recursion of the tree walker (expressions within expressions, statements within
 * statements, macro bodies): a bound on the C stack, whatever the template. */
#define GC__TMPL_MAX_EVAL_NEST 1000
/* jinja2's sandbox refuses range() of more items (MAX_RANGE). */
#define GC__TMPL_MAX_RANGE 100000

/* ---- memory ----------------------------------------------------------------------- */

/* The arena of one compile or one render, with its budget and the error record that any
 * failure below it fills. */
typedef struct gc__tmpl_heap {
  mr_arena arena;
  size_t limit;  /* bytes; an allocation past it fails with MR_EEXHAUSTED */
  mr_err *e;     /* never NULL (points at a scratch record when the caller gave none) */
} gc__tmpl_heap;

/* n bytes, 8-aligned, living until the heap is closed; NULL with e set on failure. */
void *gc__tmpl_alloc(gc__tmpl_heap *h, size_t n);
/* A copy of n bytes (+ a NUL not counted in n). */
char *gc__tmpl_memdup(gc__tmpl_heap *h, const char *p, size_t n);

/* A growable byte buffer on mr_malloc, capped at limit bytes (MR_EEXHAUSTED past it).
 * Used for output and for building long strings (repr, tojson, join). */
typedef struct gc__tmpl_sb {
  char *p;
  size_t n, cap, limit;
  const char *what; /* the limit's name in the message ("output", "memory") */
  mr_err *e;
} gc__tmpl_sb;
void gc__tmpl_sb_init(gc__tmpl_sb *b, size_t limit, const char *what, mr_err *e);
int gc__tmpl_sb_put(gc__tmpl_sb *b, const char *p, size_t n);
int gc__tmpl_sb_putc(gc__tmpl_sb *b, char c);
int gc__tmpl_sb_printf(gc__tmpl_sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void gc__tmpl_sb_free(gc__tmpl_sb *b);

/* ---- values ----------------------------------------------------------------------- */

typedef struct gc__tmpl_str {
  const char *p;
  size_t n;
} gc__tmpl_str;

enum gc__tmpl_kind {
  GC__TV_UNDEF = 0, /* jinja2's default Undefined: prints as "", falsy, iterates empty */
  GC__TV_NONE,
  GC__TV_BOOL,
  GC__TV_INT,    /* Python int, here 64-bit: overflow is an error */
  GC__TV_FLOAT,
  GC__TV_STR,    /* UTF-8 bytes (p, n), not NUL-terminated */
  GC__TV_LIST,   /* list, tuple, generator, range, dict views (gc__tmpl_list.flavour) */
  GC__TV_DICT,
  GC__TV_NS,     /* namespace(): a dict whose items are attributes, the one mutable value */
  GC__TV_MACRO,
  GC__TV_FUNC,   /* a global function (aux = GC__TF_*) */
  GC__TV_METHOD, /* a bound method (aux = GC__TM_*, u.self) */
  GC__TV_LOOP,   /* the `loop` object of a for loop */
};

/* Flavours of GC__TV_LIST. Generators (what map, select, selectattr, items, unique and
 * reverse return in jinja2) are always truthy, cannot be indexed or measured, and are
 * used up by iteration: pos counts the items already taken. */
enum gc__tmpl_flavour {
  GC__TL_LIST = 0,
  GC__TL_TUPLE,
  GC__TL_GEN,
  GC__TL_RANGE,  /* range(): start/stop/step kept for its repr */
  GC__TL_KEYS,   /* dict.keys() */
  GC__TL_VALUES, /* dict.values() */
  GC__TL_ITEMS,  /* dict.items() (items are 2-tuples) */
};

/* How an undefined value came to be, for the message when it is used (jinja2's text). */
enum gc__tmpl_undef_how {
  GC__TU_PLAIN = 0, /* no message (e.g. a missing macro argument's hint is in u.s) */
  GC__TU_NAME,      /* "'x' is undefined"; u.s = x */
  GC__TU_ATTR,      /* "'dict object' has no attribute 'x'"; u.s = x, aux2 = kind */
  GC__TU_ELEM,      /* "'list object' has no element 5"; u.i = 5, aux2 = kind */
  GC__TU_HINT,      /* u.s is the whole message */
};

/* Value flags. */
#define GC__TVF_SAFE 1u /* a str from |safe (markupsafe.Markup): `+` escapes the other side */

typedef struct gc__tmpl_list gc__tmpl_list;
typedef struct gc__tmpl_dict gc__tmpl_dict;
typedef struct gc__tmpl_loop gc__tmpl_loop;
typedef struct gc__tmpl_node gc__tmpl_node;

typedef struct gc__tmpl_val {
  uint8_t kind;  /* enum gc__tmpl_kind */
  uint8_t flags; /* GC__TVF_* */
  uint16_t aux;  /* FUNC: GC__TF_*; METHOD: GC__TM_*; UNDEF: GC__TU_* */
  uint32_t aux2; /* UNDEF ATTR / ELEM: the kind (and flavour << 8) of the container */
  union {
    bool b;
    int64_t i;
    double f;
    gc__tmpl_str s;
    gc__tmpl_list *l;
    gc__tmpl_dict *d;                  /* DICT and NS */
    const gc__tmpl_node *macro;
    struct gc__tmpl_val *self;         /* METHOD: the object it is bound to */
    gc__tmpl_loop *loop;
  } u;
} gc__tmpl_val;

struct gc__tmpl_list {
  gc__tmpl_val *v;
  size_t n;
  uint8_t flavour;           /* enum gc__tmpl_flavour */
  size_t pos;                /* GEN: items used up */
  int64_t start, stop, step; /* RANGE */
  /* GEN: jinja2's generator filters fail lazily, when iterated: a failure met by the
   * filter is kept here (message and code) and raised when a consumer reaches item
   * err_at; err NULL = none. */
  const char *err;
  int err_code;
  size_t err_at;
};

/* Insertion-ordered; keys compare with Python's equality (1 == 1.0 == True). */
struct gc__tmpl_dict {
  gc__tmpl_val *k, *v;
  size_t n, cap;
};

struct gc__tmpl_loop {
  const gc__tmpl_val *items; /* the iterated items (after the loop's `if` filter) */
  size_t n;                  /* loop.length */
  size_t i;                  /* loop.index0 */
};

/* Constructors; the values live in h. */
static inline gc__tmpl_val gc__tmpl_none(void) { return (gc__tmpl_val){.kind = GC__TV_NONE}; }
static inline gc__tmpl_val gc__tmpl_bool(bool b) {
  return (gc__tmpl_val){.kind = GC__TV_BOOL, .u.b = b};
}
static inline gc__tmpl_val gc__tmpl_int(int64_t i) {
  return (gc__tmpl_val){.kind = GC__TV_INT, .u.i = i};
}
static inline gc__tmpl_val gc__tmpl_float(double f) {
  return (gc__tmpl_val){.kind = GC__TV_FLOAT, .u.f = f};
}
static inline gc__tmpl_val gc__tmpl_strv(const char *p, size_t n) {
  return (gc__tmpl_val){.kind = GC__TV_STR, .u.s = {p, n}};
}
/* Ends a buffer built for a string value: when rc is 0 its bytes are copied to the heap as
 * the string *out. The buffer is freed either way. Returns rc, or the heap's error code. */
int gc__tmpl_sb_take(gc__tmpl_heap *h, gc__tmpl_sb *b, int rc, gc__tmpl_val *out);
static inline gc__tmpl_val gc__tmpl_undef_hint(const char *msg) {
  return (gc__tmpl_val){.kind = GC__TV_UNDEF, .aux = GC__TU_HINT, .u.s = {msg, strlen(msg)}};
}
int gc__tmpl_list_new(gc__tmpl_heap *h, size_t n, uint8_t flavour, gc__tmpl_val *out);
int gc__tmpl_dict_new(gc__tmpl_heap *h, size_t cap, bool ns, gc__tmpl_val *out);
/* The value under key, or NULL. Keys of unhashable kinds never match (see dict_set). */
gc__tmpl_val *gc__tmpl_dict_get(const gc__tmpl_dict *d, const gc__tmpl_val *key);
gc__tmpl_val *gc__tmpl_dict_get_str(const gc__tmpl_dict *d, const char *p, size_t n);
/* Sets key to val (an existing key keeps its place). MR_EINVAL for an unhashable key
 * (list, dict), as Python's TypeError. */
int gc__tmpl_dict_set(gc__tmpl_heap *h, gc__tmpl_dict *d, gc__tmpl_val key, gc__tmpl_val val);

/* Python's truth value. */
bool gc__tmpl_truthy(const gc__tmpl_val *v);
/* Python's ==; never fails (deeper than GC__TMPL_MAX_NEST compares unequal). */
bool gc__tmpl_eq(const gc__tmpl_val *a, const gc__tmpl_val *b);
/* Python's ordering of a and b into *res: -1, 0, 1, or 2 when unordered (NaN), so that
 * <, <=, >, >= all follow from it. MR_EINVAL "'<' not supported between instances of
 * 'str' and 'int'" (opname is the operator the template wrote) for kinds without an
 * order. */
int gc__tmpl_cmp(mr_err *e, const gc__tmpl_val *a, const gc__tmpl_val *b, const char *opname,
                 int *res);
/* Python's type name of v ("dict", "str", "NoneType", "generator", ...). */
const char *gc__tmpl_type_name(const gc__tmpl_val *v);
/* jinja2's message for using the undefined value u. */
void gc__tmpl_undef_message(const gc__tmpl_val *u, char *buf, size_t len);

/* str(v) appended to b (Python's str; undefined is ""); repr(v) likewise. MR_EINVAL for
 * what has no stable text (a generator's or a function's address). */
int gc__tmpl_str_put(gc__tmpl_sb *b, const gc__tmpl_val *v);
int gc__tmpl_repr_put(gc__tmpl_sb *b, const gc__tmpl_val *v);
/* str(v) as a value in h (a string stays itself, no copy). */
int gc__tmpl_to_str(gc__tmpl_heap *h, const gc__tmpl_val *v, gc__tmpl_val *out);
/* Python's repr of a float ("1.0", "1e-05", "inf") into buf (>= 32 bytes); returns its
 * length. */
size_t gc__tmpl_fmt_float(double f, char *buf);

/* transformers' tojson: json.dumps(v, ensure_ascii=False, indent=indent,
 * separators=separators, sort_keys=sort_keys). indent: NULL = none, else the string put
 * per level; item_sep / key_sep: the separators. */
typedef struct gc__tmpl_json_opts {
  const gc__tmpl_str *indent;
  gc__tmpl_str item_sep, key_sep;
  bool sort_keys;
  bool ensure_ascii; /* non-ASCII as \uXXXX escapes (surrogate pairs above U+FFFF) */
} gc__tmpl_json_opts;
int gc__tmpl_tojson_put(gc__tmpl_sb *b, gc__tmpl_heap *h, const gc__tmpl_val *v,
                        const gc__tmpl_json_opts *o);

/* JSON text -> values, as Python's json.loads (gc_tmpl_render_json). */
int gc__tmpl_json_parse(gc__tmpl_heap *h, const char *p, size_t n, gc__tmpl_val *out);
/* cJSON tree -> values (gc_tmpl_render). */
int gc__tmpl_from_cjson(gc__tmpl_heap *h, const struct cJSON *j, gc__tmpl_val *out);

/* ---- UTF-8 and Python's str methods ----------------------------------------------- */

/* Decodes the code point at p[0..n) into *cp and returns its length (>= 1). A byte that
 * does not start valid UTF-8 decodes alone, as 0xDC00 + byte (Python's surrogateescape),
 * so that every operation is defined on any bytes. */
size_t gc__tmpl_u8_next(const char *p, size_t n, uint32_t *cp);
/* Code points in p[0..n). */
size_t gc__tmpl_u8_count(const char *p, size_t n);
/* Encodes cp (surrogates too, as Python's surrogatepass) into out (4 bytes); returns its
 * length. */
size_t gc__tmpl_u8_put(uint32_t cp, char *out);
/* Python's str.isspace() for one code point. */
bool gc__tmpl_is_space(uint32_t cp);
/* Python's Unicode database (tmpl_unicode.c, generated): the case mapping of c ('u'
 * upper, 'l' lower, 't' title; 1 to 3 code points into out, their count returned), the
 * Cased and Case_Ignorable properties, and str.isprintable(). */
size_t gc__tmpl_uc_map(uint32_t c, char how, uint32_t out[3]);
bool gc__tmpl_uc_cased(uint32_t c);
bool gc__tmpl_uc_ignorable(uint32_t c);
bool gc__tmpl_uc_printable(uint32_t c);
/* True if the n bytes are valid UTF-8 (no surrogates), like Python's decoder. */
bool gc__tmpl_u8_valid(const char *p, size_t n, size_t *bad_at);

/* ---- the syntax tree -------------------------------------------------------------- */

enum gc__tmpl_node_kind {
  /* statements */
  GC__TN_BODY = 1, /* kids: statements */
  GC__TN_DATA,     /* val: the text */
  GC__TN_PRINT,    /* a: expression */
  GC__TN_IF,       /* a: test, b: body, c: else (a BODY or an IF for elif) or NULL */
  GC__TN_FOR,      /* a: target (NAME / TUPLE of NAMEs), b: iterable, c: filter or NULL,
                    * d: body, e: else body or NULL */
  GC__TN_SET,      /* a: target (NAME, TUPLE of NAMEs, NSREF), b: value */
  GC__TN_SETBLOCK, /* a: target NAME, d: body */
  GC__TN_MACRO,    /* id: name; kids: params (NAME); defs: defaults (NULL where none);
                    * d: body */
  GC__TN_BREAK,
  GC__TN_CONTINUE,
  /* expressions */
  GC__TN_CONST,   /* val */
  GC__TN_NAME,    /* id */
  GC__TN_NSREF,   /* a: NAME, val: attribute (only as a set target) */
  GC__TN_GETATTR, /* a: object, val: attribute name */
  GC__TN_GETITEM, /* a: object, b: key or SLICE; op: 1 = a slice jinja2 folds at compile
                    * time (its failures give undefined, not an error: tmpl_parse.c) */
  GC__TN_SLICE,   /* a, b, c: start, stop, step, each may be NULL */
  GC__TN_CALL,    /* a: callee; kids: positional; kw / kwv: keywords */
  GC__TN_FILTER,  /* fn: GC__TF_*; a: input; kids, kw / kwv */
  GC__TN_TEST,    /* fn: GC__TT_*; a: input; kids, kw / kwv */
  GC__TN_NOT,     /* a */
  GC__TN_NEG,     /* a */
  GC__TN_POS,     /* a */
  GC__TN_BIN,     /* op: GC__TO_*; a, b */
  GC__TN_CONCAT,  /* kids */
  GC__TN_COMPARE, /* a: first operand; kids: the others; ops: one GC__TO_* per kid */
  GC__TN_AND,     /* a, b */
  GC__TN_OR,      /* a, b */
  GC__TN_COND,    /* a: test, b: then, c: else or NULL */
  GC__TN_LIST,    /* kids */
  GC__TN_TUPLE,   /* kids */
  GC__TN_DICT,    /* kids: key, value, key, value, ... */
};

/* Binary and comparison operators. */
enum gc__tmpl_op {
  GC__TO_ADD = 1, GC__TO_SUB, GC__TO_MUL, GC__TO_DIV, GC__TO_FLOORDIV, GC__TO_MOD, GC__TO_POW,
  GC__TO_EQ, GC__TO_NE, GC__TO_LT, GC__TO_LE, GC__TO_GT, GC__TO_GE, GC__TO_IN, GC__TO_NOTIN,
};

struct gc__tmpl_node {
  uint8_t kind;  /* enum gc__tmpl_node_kind */
  uint8_t op;    /* BIN: enum gc__tmpl_op; GETITEM of a SLICE: 1 if jinja2 folds it */
  uint16_t fn;   /* FILTER: GC__TF_*, TEST: GC__TT_* */
  uint32_t pos;  /* byte offset of the construct in the normalized source */
  uint32_t id;   /* NAME, MACRO: the interned name (gc_tmpl.names) */
  uint32_t n;    /* kids */
  uint32_t nkw;  /* keyword arguments */
  gc__tmpl_node *a, *b, *c, *d, *e;
  gc__tmpl_node **kids;
  gc__tmpl_node **defs; /* MACRO: n defaults */
  gc__tmpl_str *kw;     /* keyword names */
  gc__tmpl_node **kwv;  /* keyword values */
  uint8_t *ops;         /* COMPARE */
  gc__tmpl_val val;     /* CONST; DATA text; GETATTR / NSREF attribute */
};

/* The compiled template (chat_template.h). */
struct gc_tmpl {
  char *origin;        /* the template's name in messages, owned */
  char *src;           /* normalized source (newlines as jinja2 makes them), owned */
  size_t len;
  gc__tmpl_heap heap;  /* the tree and its constants */
  mr_err heap_err;     /* the heap's error record after compile */
  gc__tmpl_node *root; /* BODY */
  gc__tmpl_str *names; /* interned identifiers */
  uint32_t nnames;
  uint16_t *name_fn;   /* per name: the global function of that name (GC__TF_*) or 0 */
  uint32_t loop_id;    /* the id of the name "loop", UINT32_MAX if the template has none */
  /* Per name: 1 if jinja2 gives the name a variable of the template's top level that
   * starts undefined (its first top-level reference is an unconditional {% set %} or
   * macro), hiding the render's variable of that name until the set runs: see
   * root_hidden() in tmpl_parse.c. */
  uint8_t *root_hidden;
};

/* "origin:line:col" of byte offset pos of t's source, into buf. */
void gc__tmpl_where(const char *origin, const char *src, size_t len, uint32_t pos, char *buf,
                    size_t buflen);

/* ---- lexer ------------------------------------------------------------------------ */

enum gc__tmpl_tok_kind {
  GC__TK_EOF = 0,
  GC__TK_DATA,
  GC__TK_VAR_BEGIN,
  GC__TK_VAR_END,
  GC__TK_BLOCK_BEGIN,
  GC__TK_BLOCK_END,
  GC__TK_NAME,
  GC__TK_STRING, /* val: the decoded string */
  GC__TK_INT,    /* val */
  GC__TK_FLOAT,  /* val */
  GC__TK_OP,     /* op: one of GC__TK_OP_* below */
};

/* Operator tokens (op field), as jinja2 names them. */
enum gc__tmpl_tok_op {
  GC__TOP_ADD = 1, GC__TOP_SUB, GC__TOP_DIV, GC__TOP_FLOORDIV, GC__TOP_MUL, GC__TOP_MOD,
  GC__TOP_POW, GC__TOP_TILDE, GC__TOP_LBRACKET, GC__TOP_RBRACKET, GC__TOP_LPAREN,
  GC__TOP_RPAREN, GC__TOP_LBRACE, GC__TOP_RBRACE, GC__TOP_EQ, GC__TOP_NE, GC__TOP_GT,
  GC__TOP_GTEQ, GC__TOP_LT, GC__TOP_LTEQ, GC__TOP_ASSIGN, GC__TOP_DOT, GC__TOP_COLON,
  GC__TOP_PIPE, GC__TOP_COMMA, GC__TOP_SEMICOLON,
};

typedef struct gc__tmpl_tok {
  uint8_t kind; /* enum gc__tmpl_tok_kind */
  uint8_t op;   /* enum gc__tmpl_tok_op */
  uint32_t pos; /* byte offset in the normalized source */
  gc__tmpl_str s; /* NAME: the name; DATA: the text (after whitespace control) */
  gc__tmpl_val val;
} gc__tmpl_tok;

/* Tokenizes t->src into *toks (n tokens, the last GC__TK_EOF), an array the caller frees
 * with mr_free; decoded strings live in t->heap, names and data point into t->src.
 * Errors are "origin:line:col: ..." (MR_EFORMAT, MR_ENOTSUP). */
int gc__tmpl_lex(gc_tmpl *t, gc__tmpl_tok **toks, size_t *n, mr_err *e);

/* ---- parser ----------------------------------------------------------------------- */

/* Parses the tokens into t->root, interning names into t->names. */
int gc__tmpl_parse(gc_tmpl *t, const gc__tmpl_tok *toks, size_t n, mr_err *e);

/* ---- names of the builtins (tmpl_names.c) --------------------------------------------- */

/* Global functions (GC__TV_FUNC aux, gc_tmpl.name_fn). */
enum gc__tmpl_func {
  GC__TF_NONE = 0, GC__TF_RANGE, GC__TF_NAMESPACE, GC__TF_DICT, GC__TF_RAISE,
  GC__TF_STRFTIME,
};
/* Filters (node fn). */
enum gc__tmpl_filter {
  GC__TFL_ABS = 1, GC__TFL_CAPITALIZE, GC__TFL_COUNT, GC__TFL_DEFAULT, GC__TFL_FIRST,
  GC__TFL_FLOAT, GC__TFL_INDENT, GC__TFL_INT, GC__TFL_ITEMS, GC__TFL_JOIN, GC__TFL_LAST,
  GC__TFL_LENGTH, GC__TFL_LIST, GC__TFL_LOWER, GC__TFL_MAP, GC__TFL_MAX, GC__TFL_MIN,
  GC__TFL_REJECT, GC__TFL_REJECTATTR, GC__TFL_REPLACE, GC__TFL_REVERSE, GC__TFL_SAFE,
  GC__TFL_SELECT, GC__TFL_SELECTATTR, GC__TFL_SORT, GC__TFL_STRING, GC__TFL_SUM,
  GC__TFL_TITLE, GC__TFL_TOJSON, GC__TFL_TRIM, GC__TFL_UNIQUE, GC__TFL_UPPER,
  GC__TFL_COUNT_,
};
/* Tests (node fn). */
enum gc__tmpl_test {
  GC__TT_DEFINED = 1, GC__TT_UNDEFINED, GC__TT_NONE, GC__TT_BOOLEAN, GC__TT_FALSE, GC__TT_TRUE,
  GC__TT_INTEGER, GC__TT_FLOAT, GC__TT_NUMBER, GC__TT_STRING, GC__TT_MAPPING, GC__TT_ITERABLE,
  GC__TT_SEQUENCE, GC__TT_CALLABLE, GC__TT_SAMEAS, GC__TT_ESCAPED, GC__TT_IN, GC__TT_EQ,
  GC__TT_NE, GC__TT_GT, GC__TT_GE, GC__TT_LT, GC__TT_LE, GC__TT_ODD, GC__TT_EVEN,
  GC__TT_DIVISIBLEBY, GC__TT_LOWER, GC__TT_UPPER, GC__TT_COUNT_,
};
/* Methods (GC__TV_METHOD aux). GC__TM_OTHER is a Python method of the type that the
 * subset does not call (list.append, dict.pop): an attribute that exists, but a call of
 * it fails. */
enum gc__tmpl_method {
  GC__TM_OTHER = 1,
  /* str */
  GC__TM_STARTSWITH, GC__TM_ENDSWITH, GC__TM_SPLIT, GC__TM_RSPLIT, GC__TM_STRIP,
  GC__TM_LSTRIP, GC__TM_RSTRIP, GC__TM_REPLACE, GC__TM_UPPER, GC__TM_LOWER, GC__TM_TITLE,
  GC__TM_CAPITALIZE, GC__TM_FIND, GC__TM_RFIND, GC__TM_COUNT, GC__TM_JOIN,
  GC__TM_SPLITLINES, GC__TM_ISSPACE, GC__TM_REMOVEPREFIX, GC__TM_REMOVESUFFIX, GC__TM_INDEX,
  /* dict */
  GC__TM_GET, GC__TM_ITEMS, GC__TM_KEYS, GC__TM_VALUES,
  /* loop */
  GC__TM_CYCLE,
};

/* Name -> id lookups used by the parser (0 = unknown). */
uint16_t gc__tmpl_filter_id(const char *p, size_t n);
uint16_t gc__tmpl_test_id(const char *p, size_t n);
uint16_t gc__tmpl_func_id(const char *p, size_t n);
/* True if name is a method the subset can call (on some type). */
bool gc__tmpl_method_known(const char *p, size_t n);
/* The method of that name on a value of kind/flavour (GC__TM_OTHER for a Python method
 * outside the subset), or 0 if the type has no such attribute. */
uint16_t gc__tmpl_method_of(const gc__tmpl_val *self, const char *p, size_t n);
const char *gc__tmpl_filter_name(uint16_t id);
const char *gc__tmpl_test_name(uint16_t id);

/* ---- the render's runtime (tmpl_rt.c) ------------------------------------------------- */

struct gc__tmpl_frame; /* a scope of the tree walker (tmpl_eval.c): opaque here */

/* One render: its heap, output, error record, limits and scopes. Single-threaded. */
struct gc__tmpl_rt {
  const gc_tmpl *t;
  gc__tmpl_heap *h;
  gc__tmpl_sb *out;
  mr_err *e;
  gc__tmpl_val *ctx; /* per name id: the render's variable of that name, or undefined */
  struct gc__tmpl_frame *root; /* the top-level scope (a tmpl_eval.c frame) */
  uint64_t steps, max_steps;
  uint32_t calls, max_calls; /* macro calls open now */
  uint32_t nest;             /* tree-walker recursion */
  bool located;              /* the error record already names its place */
};
typedef struct gc__tmpl_rt gc__tmpl_rt;

/* For the builtins and the tree walker: the render's heap, an error at node n
 * ("origin:line:col: msg", MR_EINVAL unless code says otherwise), a limit step, and the
 * use of an undefined value (its jinja2 message at n). */
gc__tmpl_heap *gc__tmpl_rt_heap(gc__tmpl_rt *rt);
int gc__tmpl_rt_fail(gc__tmpl_rt *rt, const gc__tmpl_node *n, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int gc__tmpl_rt_undef(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *u);
/* Prefixes a helper's error (already in the error record) with n's place, once; n NULL
 * marks the error as located without a place (raise_exception's bare message). */
int gc__tmpl_rt_locate(gc__tmpl_rt *rt, const gc__tmpl_node *n, int code);
int gc__tmpl_rt_step(gc__tmpl_rt *rt, const gc__tmpl_node *n);
/* jinja2's environment.getitem / getattr (obj[key], obj.name). */
int gc__tmpl_getitem(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *obj,
                     const gc__tmpl_val *key, gc__tmpl_val *out);
int gc__tmpl_getattr(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *obj,
                     const char *p, size_t len, gc__tmpl_val *out);
/* obj[start:stop:step] (sl, None where a part is missing) as Python's subscription does
 * it, by code points for a str; n->op 1 marks a slice jinja2 folds at compile time, whose
 * failures give undefined instead. */
int gc__tmpl_slice(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *obj,
                   const gc__tmpl_val sl[3], gc__tmpl_val *out);
/* The items of an iterable (a generator is used up), as Python's iter() sees them; a
 * generator with a kept failure raises it. */
int gc__tmpl_iter(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *v,
                  const gc__tmpl_val **items, size_t *count);
/* The failure just reported, taken out of the error record (copied to the heap) so that
 * evaluation goes on; NULL if out of memory (the error then stays). And the raise of a
 * kept failure, as it was. */
const char *gc__tmpl_rt_take_error(gc__tmpl_rt *rt, int *code);
int gc__tmpl_rt_raise(gc__tmpl_rt *rt, int code, const char *msg);
/* `a in b`. */
int gc__tmpl_contains(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *b,
                      const gc__tmpl_val *a, bool *in);

/* ---- builtins (tmpl_builtin.c) -------------------------------------------------------- */

/* Arguments of a call, a filter or a test: positional then keywords. */
typedef struct gc__tmpl_args {
  gc__tmpl_val *pos;
  size_t npos;
  const gc__tmpl_str *kw;
  gc__tmpl_val *kwv;
  size_t nkw;
} gc__tmpl_args;

int gc__tmpl_call_filter(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn,
                         const gc__tmpl_val *in, gc__tmpl_args *args, gc__tmpl_val *out);
int gc__tmpl_call_test(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn,
                       const gc__tmpl_val *in, gc__tmpl_args *args, bool *out);
int gc__tmpl_call_method(gc__tmpl_rt *rt, const gc__tmpl_node *n, const gc__tmpl_val *m,
                         gc__tmpl_args *args, gc__tmpl_val *out);
int gc__tmpl_call_func(gc__tmpl_rt *rt, const gc__tmpl_node *n, uint16_t fn,
                       gc__tmpl_args *args, gc__tmpl_val *out);

/* Python str methods shared by filters and methods (results in h). chars NULL = space. */
int gc__tmpl_strip(gc__tmpl_heap *h, gc__tmpl_str s, const gc__tmpl_str *chars, bool left,
                   bool right, gc__tmpl_val *out);
int gc__tmpl_replace(gc__tmpl_heap *h, gc__tmpl_str s, gc__tmpl_str old, gc__tmpl_str new_,
                     int64_t count, gc__tmpl_val *out);
/* upper / lower / capitalize / str.title() (how: 'u', 'l', 'c', 't') / jinja2's title
 * filter ('T'), with Python's full case mappings and its final-sigma rule. */
int gc__tmpl_case(gc__tmpl_heap *h, gc__tmpl_str s, char how, gc__tmpl_val *out);

/* ---- the tree walker (tmpl_eval.c) ---------------------------------------------------- */

/* Renders t->root; the output is the render's (rt) buffer. See chat_template.c. */
int gc__tmpl_run(const gc_tmpl *t, gc__tmpl_val vars, const gc_tmpl_limits *lim,
                 gc__tmpl_heap *h, gc__tmpl_sb *out, mr_err *e);

#endif /* GC_TMPL_INTERNAL_H */
