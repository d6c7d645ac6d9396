/*
 * tmpl_lex.c - the template lexer: jinja2's Lexer (lexer.py) for transformers'
 * environment (trim_blocks=True, lstrip_blocks=True, default delimiters, no line
 * statements), byte for byte in what it keeps of the text between tags.
 *
 * The source is already normalized (chat_template.c): every \r\n and \r is \n and one
 * trailing newline is gone, as jinja2's tokeniter does first. Then, in the root state:
 *
 *   text {%  /  {{  /  {#     the earliest tag start ends the text before it; a sign after
 *                             the delimiter strips that text: '-' every trailing space
 *                             (Python's str.rstrip), '+' nothing; otherwise, for {% and
 *                             {# only (lstrip_blocks), spaces and tabs (any str.isspace
 *                             character but \n) between the last newline of the text, or
 *                             the start of a line, and the tag
 *   {% raw %} ... {% endraw %} the body is text, taken verbatim
 *   {# ... #}                 dropped; "-#}" also eats the whitespace after it, "#}" one
 *                             newline (trim_blocks)
 *   {% ... %}                 tokens; "-%}" eats the whitespace after, "%}" one newline
 *                             (trim_blocks), "+%}" nothing
 *   {{ ... }}                 tokens; "-}}" eats the whitespace after
 *
 * "The start of a line" is jinja2's line_starting: the previous match (a tag end) ended
 * in a newline, or this is the first text of the template. Inside a tag the end is only
 * recognized while no bracket is open, so "{{ {'a': 1}}}" ends at the last "}}".
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_client/runner/tmpl_internal.h"

/* One tokenization. Tokens point into the source (names, text) or into the template's
 * heap (decoded strings); the array itself grows on mr_realloc and goes to the parser. */
typedef struct lexer {
  gc_tmpl *t;
  const char *s;      /* the normalized source */
  size_t n;
  gc__tmpl_tok *toks; /* the tokens so far */
  size_t ntoks, cap;
  mr_err *e;
  /* jinja2's balancing_stack: the closer each open ( [ { expects. While it is not empty
   * "}}" and "%}" are operators, not the tag's end. 64 deep is far beyond any template
   * and keeps the parser's recursion over brackets bounded too. */
  char stack[64];
  int depth;
} lexer;

/* Fails with "origin:line:col: message" for the byte at pos. */
static int lfail(lexer *L, size_t pos, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int lfail(lexer *L, size_t pos, int code, const char *fmt, ...) {
  char where[128], msg[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  gc__tmpl_where(L->t->origin, L->s, L->n, (uint32_t)pos, where, sizeof where);
  return mr_err_set(L->e, code, "%s: %s", where, msg);
}

/* Appends a zeroed token of kind at pos; NULL (with the error set) when out of memory. */
static gc__tmpl_tok *push(lexer *L, uint8_t kind, size_t pos) {
  if (L->ntoks == L->cap) {
    size_t cap = L->cap ? L->cap * 2 : 256;
    gc__tmpl_tok *g = mr_realloc(L->toks, cap * sizeof *g);
    if (!g) {
      mr_err_set(L->e, MR_ENOMEM, "out of memory (%zu tokens)", cap);
      return NULL;
    }
    L->toks = g, L->cap = cap;
  }
  gc__tmpl_tok *k = &L->toks[L->ntoks++];
  memset(k, 0, sizeof *k);
  k->kind = kind;
  k->pos = (uint32_t)pos;
  return k;
}

/* Python's \s at s[i] (a whole code point): its length, or 0 if not whitespace. jinja2's
 * regexes run on str, where \s is every character str.isspace() accepts: NBSP, U+3000
 * and the other Unicode spaces strip like tabs. */
static size_t space_at(const lexer *L, size_t i) {
  if (i >= L->n) return 0;
  unsigned char c = (unsigned char)L->s[i];
  if (c < 0x80) return gc__tmpl_is_space(c) ? 1 : 0;
  uint32_t cp;
  size_t k = gc__tmpl_u8_next(L->s + i, L->n - i, &cp);
  return gc__tmpl_is_space(cp) ? k : 0;
}

static size_t skip_space(const lexer *L, size_t i) {
  size_t k;
  while ((k = space_at(L, i)) > 0) i += k;
  return i;
}

/* End of text [a, b) after Python's rstrip() (what "{%-" / "{{-" do to the text before
 * them). Forward, since UTF-8 cannot be walked backwards code point by code point
 * without care; the text is short. */
static size_t rstrip_end(const lexer *L, size_t a, size_t b) {
  size_t end = a;
  for (size_t i = a; i < b;) {
    size_t k = space_at(L, i);
    if (k) {
      i += k;
    } else {
      uint32_t cp;
      i += gc__tmpl_u8_next(L->s + i, b - i, &cp);
      end = i;
    }
  }
  return end;
}

/* Emits the text [a, b) before a tag whose sign is `sign`, with jinja2's stripping
 * (Lexer.tokeniter, the OptionalLStrip branch):
 *   '-'  text.rstrip(): every trailing whitespace, newlines included;
 *   '+'  nothing (the tag opts out of lstrip_blocks);
 *   none with lstrip_blocks, for {% and {# only: if the text after its last newline (or
 *        the whole text when the previous match ended a line) is only whitespace, that
 *        whitespace goes. "line_starting" is jinja2's flag for the second case: a tag
 *        end that consumed a newline (trim_blocks, "-%}") leaves us at a line start.
 * Empty text makes no token (jinja2 drops empty data). */
static int text_before_tag(lexer *L, size_t a, size_t b, char sign, bool lstrip,
                           bool line_starting) {
  if (sign == '-') {
    b = rstrip_end(L, a, b);
  } else if (sign != '+' && lstrip) {
    size_t l = a;
    for (size_t i = b; i > a; i--)
      if (L->s[i - 1] == '\n') {
        l = i;
        break;
      }
    /* Only whitespace from the line start to the tag (and at least one character of
     * it: jinja2 matches \s+). */
    if ((l > a || line_starting) && l < b) {
      size_t i = l, k;
      while (i < b && (k = space_at(L, i)) > 0) i += k;
      if (i == b) b = l;
    }
  }
  if (b > a) {
    gc__tmpl_tok *k = push(L, GC__TK_DATA, a);
    if (!k) return L->e->code;
    k->s = (gc__tmpl_str){L->s + a, b - a};
  }
  return 0;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_hex(char c) {
  return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}
static bool name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool name_char(char c) { return name_start(c) || is_digit(c); }

/* Numbers follow jinja2's regexes, ASCII digits only (Python's \d also takes other
 * scripts' digits; a template with those is refused as an unexpected character). */

/* (\d+_)*\d+ at i: its end, or 0 if no digit there. A single '_' may separate digit
 * runs; a trailing or doubled one ends the number. */
static size_t digits_end(const lexer *L, size_t i) {
  if (i >= L->n || !is_digit(L->s[i])) return 0;
  for (;;) {
    while (i < L->n && is_digit(L->s[i])) i++;
    if (i + 1 < L->n && L->s[i] == '_' && is_digit(L->s[i + 1])) {
      i++;
      continue;
    }
    return i;
  }
}

/* jinja2's float_re at i: its end, or 0. Digits, then either an optional fraction and an
 * exponent, or a fraction alone: "1e5", "1.5", "1.5e-3" are floats, "1." and "1e" are
 * not (the int rule takes "1", the rest is another token). The regex's (?<!\.) keeps
 * "x.1.2" from reading "1.2" after a dot. */
static size_t float_end(const lexer *L, size_t i) {
  if (i > 0 && L->s[i - 1] == '.') return 0; /* (?<!\.) */
  size_t a = digits_end(L, i);
  if (!a) return 0;
  size_t f = 0;
  if (a < L->n && L->s[a] == '.') f = digits_end(L, a + 1);
  size_t x = f ? f : a; /* where an exponent may start */
  if (x < L->n && (L->s[x] == 'e' || L->s[x] == 'E')) {
    size_t y = x + 1;
    if (y < L->n && (L->s[y] == '+' || L->s[y] == '-')) y++;
    size_t z = digits_end(L, y);
    if (z) return z;
  }
  return f; /* a fraction without exponent, or no float */
}

/* jinja2's integer_re at i: its end, or 0; *base gets 2, 8, 16 or 10. The alternatives
 * in the regex's order: 0b / 0o / 0x with at least one digit of that base, a decimal
 * that does not start with 0, or zeros ("007" lexes as "00" then "7", a parse error as
 * in jinja2). */
static size_t int_end(const lexer *L, size_t i, int *base) {
  const char *s = L->s;
  if (i >= L->n || !is_digit(s[i])) return 0;
  if (s[i] == '0' && i + 1 < L->n) {
    char p = (char)(s[i + 1] | 0x20);
    if (p == 'b' || p == 'o' || p == 'x') {
      size_t j = i + 2, start = j;
      for (;;) {
        size_t k = j;
        if (k < L->n && s[k] == '_') k++;
        if (k >= L->n) break;
        bool ok = p == 'b' ? (s[k] == '0' || s[k] == '1')
                  : p == 'o' ? (s[k] >= '0' && s[k] <= '7')
                             : is_hex(s[k]);
        if (!ok) break;
        j = k + 1;
      }
      if (j > start) {
        *base = p == 'b' ? 2 : p == 'o' ? 8 : 16;
        return j;
      }
    }
  }
  *base = 10;
  if (s[i] == '0') { /* 0(_?0)* */
    size_t j = i + 1;
    for (;;) {
      size_t k = j < L->n && s[j] == '_' ? j + 1 : j;
      if (k < L->n && s[k] == '0')
        j = k + 1;
      else
        return j;
    }
  }
  size_t j = i + 1; /* [1-9](_?\d)* */
  for (;;) {
    size_t k = j < L->n && s[j] == '_' ? j + 1 : j;
    if (k < L->n && is_digit(s[k]))
      j = k + 1;
    else
      return j;
  }
}

/* A number token at i: the float rule first, as jinja2 orders them. Values beyond 64
 * bits are refused (Python would have a big int). */
static int lex_number(lexer *L, size_t i, size_t *next) {
  char buf[80];
  size_t fe = float_end(L, i);
  if (fe) {
    size_t k = 0;
    for (size_t j = i; j < fe; j++)
      if (L->s[j] != '_') {
        if (k + 1 >= sizeof buf) return lfail(L, i, MR_ENOTSUP, "number literal too long");
        buf[k++] = L->s[j];
      }
    buf[k] = '\0';
    gc__tmpl_tok *t = push(L, GC__TK_FLOAT, i);
    if (!t) return L->e->code;
    t->val = gc__tmpl_float(strtod(buf, NULL));
    *next = fe;
    return 0;
  }
  int base;
  size_t ie = int_end(L, i, &base);
  size_t k = 0;
  for (size_t j = i + (base == 10 ? 0 : 2); j < ie; j++)
    if (L->s[j] != '_') {
      if (k + 1 >= sizeof buf) return lfail(L, i, MR_ENOTSUP, "integer literal beyond 64 bits");
      buf[k++] = L->s[j];
    }
  buf[k] = '\0';
  errno = 0;
  unsigned long long v = strtoull(buf, NULL, base);
  if (errno == ERANGE || v > (unsigned long long)INT64_MAX)
    return lfail(L, i, MR_ENOTSUP, "integer literal beyond 64 bits");
  gc__tmpl_tok *t = push(L, GC__TK_INT, i);
  if (!t) return L->e->code;
  t->val = gc__tmpl_int((int64_t)v);
  *next = ie;
  return 0;
}

static int hexval(char c) {
  return is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10;
}

/* Decodes a string literal's body [a, b) the way jinja2 does:
 * body.encode("ascii", "backslashreplace").decode("unicode-escape"). That is Python's
 * escapes (\n \t \\ \' \" \a \b \f \v \r, octal up to 3 digits, \xHH, \uHHHH,
 * \UHHHHHHHH, backslash-newline as nothing), an unknown escape kept as written, and one
 * quirk of the round trip: a backslash before a non-ASCII character escapes the
 * backslash that backslashreplace put in, so "\é" becomes the four characters \xe9.
 * \N{name} needs Python's name table: refused. The output is at most twice the input. */
static int lex_string(lexer *L, size_t q, size_t a, size_t b) {
  char *out = gc__tmpl_alloc(&L->t->heap, (b - a) * 2 + 1);
  if (!out) return L->e->code;
  size_t o = 0;
  for (size_t i = a; i < b;) {
    char c = L->s[i];
    if (c != '\\') {
      out[o++] = c;
      i++;
      continue;
    }
    size_t at = i;
    i++; /* the regex guarantees a character after every backslash */
    char x = L->s[i];
    if ((unsigned char)x >= 0x80) {
      /* backslashreplace turned the character into its own escape, whose backslash the
       * decoder then reads as an escaped backslash: "\\é" becomes "\\xe9". */
      uint32_t cp;
      size_t k = gc__tmpl_u8_next(L->s + i, b - i, &cp);
      char esc[16];
      int el = cp < 0x100 ? sprintf(esc, "\\x%02x", (unsigned)cp)
               : cp < 0x10000 ? sprintf(esc, "\\u%04x", (unsigned)cp)
                              : sprintf(esc, "\\U%08x", (unsigned)cp);
      memcpy(out + o, esc, (size_t)el);
      o += (size_t)el;
      i += k;
      continue;
    }
    i++;
    uint32_t cp = 0;
    int want = 0;
    switch (x) {
    case '\n': break; /* line continuation */
    case '\\': out[o++] = '\\'; break;
    case '\'': out[o++] = '\''; break;
    case '"': out[o++] = '"'; break;
    case 'a': out[o++] = '\a'; break;
    case 'b': out[o++] = '\b'; break;
    case 'f': out[o++] = '\f'; break;
    case 'n': out[o++] = '\n'; break;
    case 'r': out[o++] = '\r'; break;
    case 't': out[o++] = '\t'; break;
    case 'v': out[o++] = '\v'; break;
    case 'x': want = 2; break;
    case 'u': want = 4; break;
    case 'U': want = 8; break;
    case 'N':
      return lfail(L, at, MR_ENOTSUP, "\\N{...} escapes are not supported");
    default:
      if (x >= '0' && x <= '7') {
        cp = (uint32_t)(x - '0');
        for (int d = 0; d < 2 && i < b && L->s[i] >= '0' && L->s[i] <= '7'; d++)
          cp = cp * 8 + (uint32_t)(L->s[i++] - '0');
        o += gc__tmpl_u8_put(cp, out + o);
      } else { /* an unknown escape stays as written */
        out[o++] = '\\';
        out[o++] = x;
      }
    }
    if (want) {
      for (int d = 0; d < want; d++) {
        if (i >= b || !is_hex(L->s[i]))
          return lfail(L, at, MR_EFORMAT, "truncated \\%c escape in a string", x);
        cp = cp * 16 + (uint32_t)hexval(L->s[i++]);
      }
      if (cp > 0x10ffff)
        return lfail(L, at, MR_EFORMAT, "illegal Unicode character in a string");
      o += gc__tmpl_u8_put(cp, out + o);
    }
  }
  out[o] = '\0';
  gc__tmpl_tok *t = push(L, GC__TK_STRING, q);
  if (!t) return L->e->code;
  t->val = gc__tmpl_strv(out, o);
  return 0;
}

/* jinja2's operators, two-character ones first so that the longest match wins ("//"
 * before "/", "**" before "*", "==" before "="). "!" alone is not one. */
static const struct {
  const char *text;
  uint8_t op;
} ops[] = {
    {"//", GC__TOP_FLOORDIV}, {"**", GC__TOP_POW},      {"==", GC__TOP_EQ},
    {"!=", GC__TOP_NE},       {">=", GC__TOP_GTEQ},     {"<=", GC__TOP_LTEQ},
    {"+", GC__TOP_ADD},       {"-", GC__TOP_SUB},       {"/", GC__TOP_DIV},
    {"*", GC__TOP_MUL},       {"%", GC__TOP_MOD},       {"~", GC__TOP_TILDE},
    {"[", GC__TOP_LBRACKET},  {"]", GC__TOP_RBRACKET},  {"(", GC__TOP_LPAREN},
    {")", GC__TOP_RPAREN},    {"{", GC__TOP_LBRACE},    {"}", GC__TOP_RBRACE},
    {">", GC__TOP_GT},        {"<", GC__TOP_LT},        {"=", GC__TOP_ASSIGN},
    {".", GC__TOP_DOT},       {":", GC__TOP_COLON},     {"|", GC__TOP_PIPE},
    {",", GC__TOP_COMMA},     {";", GC__TOP_SEMICOLON},
};

/* One tag's tokens, from i (after the opening delimiter) through its end. var: {{ }}.
 * *next: the position after the end; *line_start: the end consumed a newline last.
 * jinja2 tries the end rule before the token rules at every position, so "-%}" ends a
 * tag even right after an operand ("x-%}" is x, then the end with whitespace control),
 * but only while no bracket is open. The end rules: "+%}" (no trim), "-%}" and the
 * whitespace after it, "%}" and one newline (trim_blocks); "-}}" and the whitespace
 * after it, "}}" (variables have no trim_blocks). */
static int lex_tag(lexer *L, size_t i, bool var, size_t *next, bool *line_start) {
  L->depth = 0;
  for (;;) {
    if (i >= L->n)
      return lfail(L, i, MR_EFORMAT, "unexpected end of template inside a %s tag",
                   var ? "{{ }}" : "{% %}");
    const char *s = L->s + i;
    size_t left = L->n - i;
    if (L->depth == 0) {
      size_t end = 0;
      bool eat_space = false, eat_nl = false;
      if (!var && left >= 3 && s[0] == '+' && s[1] == '%' && s[2] == '}') {
        end = 3;
      } else if (left >= 3 && s[0] == '-' && s[1] == (var ? '}' : '%') && s[2] == '}') {
        end = 3, eat_space = true;
      } else if (left >= 2 && s[0] == (var ? '}' : '%') && s[1] == '}') {
        end = 2, eat_nl = !var;
      }
      if (end) {
        gc__tmpl_tok *t = push(L, var ? GC__TK_VAR_END : GC__TK_BLOCK_END, i);
        if (!t) return L->e->code;
        size_t j = i + end;
        if (eat_space) j = skip_space(L, j);
        if (eat_nl && j < L->n && L->s[j] == '\n') j++;
        *line_start = j > i + end && L->s[j - 1] == '\n';
        *next = j;
        return 0;
      }
    }
    size_t k = space_at(L, i);
    if (k) {
      i += k;
      continue;
    }
    char c = s[0];
    if (is_digit(c)) {
      int rc = lex_number(L, i, &i);
      if (rc) return rc;
      continue;
    }
    if (name_start(c)) {
      size_t j = i + 1;
      while (j < L->n && name_char(L->s[j])) j++;
      if (j < L->n && (unsigned char)L->s[j] >= 0x80)
        return lfail(L, i, MR_ENOTSUP, "non-ASCII identifiers are not supported");
      gc__tmpl_tok *t = push(L, GC__TK_NAME, i);
      if (!t) return L->e->code;
      t->s = (gc__tmpl_str){L->s + i, j - i};
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      /* A backslash escapes anything, the quote and a newline included (re.S). */
      size_t j = i + 1;
      while (j < L->n && L->s[j] != c) j += L->s[j] == '\\' && j + 1 < L->n ? 2 : 1;
      if (j >= L->n) return lfail(L, i, MR_EFORMAT, "unterminated string");
      int rc = lex_string(L, i, i + 1, j);
      if (rc) return rc;
      i = j + 1;
      continue;
    }
    size_t o;
    for (o = 0; o < sizeof ops / sizeof ops[0]; o++) {
      size_t len = strlen(ops[o].text);
      if (left >= len && memcmp(s, ops[o].text, len) == 0) break;
    }
    if (o == sizeof ops / sizeof ops[0]) {
      if ((unsigned char)c >= 0x80)
        return lfail(L, i, MR_ENOTSUP, "non-ASCII identifiers are not supported");
      return lfail(L, i, MR_EFORMAT, "unexpected char '%c'", c);
    }
    uint8_t op = ops[o].op;
    if (op == GC__TOP_LBRACE || op == GC__TOP_LPAREN || op == GC__TOP_LBRACKET) {
      if (L->depth == (int)sizeof L->stack)
        return lfail(L, i, MR_ENOTSUP, "brackets nested deeper than %zu", sizeof L->stack);
      L->stack[L->depth++] = op == GC__TOP_LBRACE ? '}' : op == GC__TOP_LPAREN ? ')' : ']';
    } else if (op == GC__TOP_RBRACE || op == GC__TOP_RPAREN || op == GC__TOP_RBRACKET) {
      if (L->depth == 0) return lfail(L, i, MR_EFORMAT, "unexpected '%c'", c);
      char want = L->stack[--L->depth];
      if (want != c) return lfail(L, i, MR_EFORMAT, "unexpected '%c', expected '%c'", c, want);
    }
    gc__tmpl_tok *t = push(L, GC__TK_OP, i);
    if (!t) return L->e->code;
    t->op = op;
    i += strlen(ops[o].text);
  }
}

/* {% raw %} at i: true (1) and *body = where its content starts, or 0. Matches
 * jinja2's {%(-|+|)\s*raw\s*(?:-%}\s*|%}): note that "%}" here applies no trim_blocks,
 * so a newline right after {% raw %} stays in the content. */
static size_t raw_begin(const lexer *L, size_t i, size_t *body) {
  size_t j = i + 2;
  if (j < L->n && (L->s[j] == '-' || L->s[j] == '+')) j++;
  j = skip_space(L, j);
  if (L->n - j < 3 || memcmp(L->s + j, "raw", 3) != 0) return 0;
  j = skip_space(L, j + 3);
  if (L->n - j >= 3 && memcmp(L->s + j, "-%}", 3) == 0) {
    *body = skip_space(L, j + 3);
    return 1;
  }
  if (L->n - j >= 2 && memcmp(L->s + j, "%}", 2) == 0) {
    *body = j + 2;
    return 1;
  }
  return 0;
}

/* {% endraw %} searched from i: the text end, the sign and the position after it. The
 * first "{%" that reads as endraw closes the block; the content before it gets the
 * same stripping as text before a tag (the sign, lstrip_blocks). */
static bool raw_end(const lexer *L, size_t i, size_t *text_end, char *sign, size_t *next) {
  for (size_t a = i; a + 1 < L->n; a++) {
    if (L->s[a] != '{' || L->s[a + 1] != '%') continue;
    size_t j = a + 2;
    char sg = 0;
    if (j < L->n && (L->s[j] == '-' || L->s[j] == '+')) sg = L->s[j++];
    j = skip_space(L, j);
    if (L->n - j < 6 || memcmp(L->s + j, "endraw", 6) != 0) continue;
    j = skip_space(L, j + 6);
    if (L->n - j >= 3 && memcmp(L->s + j, "+%}", 3) == 0) {
      j += 3;
    } else if (L->n - j >= 3 && memcmp(L->s + j, "-%}", 3) == 0) {
      j = skip_space(L, j + 3);
    } else if (L->n - j >= 2 && memcmp(L->s + j, "%}", 2) == 0) {
      j += 2;
      if (j < L->n && L->s[j] == '\n') j++;
    } else {
      continue;
    }
    *text_end = a, *sign = sg, *next = j;
    return true;
  }
  return false;
}

/* The root state: text up to the earliest "{{", "{%" or "{#" (jinja2's root regex is
 * (.*?)(?:raw|{#|{%|{{) with the sign after the delimiter), then the tag. */
int gc__tmpl_lex(gc_tmpl *t, gc__tmpl_tok **toks, size_t *ntoks, mr_err *e) {
  lexer L = {.t = t, .s = t->src, .n = t->len, .e = e};
  size_t pos = 0;
  bool line_starting = true; /* the start of the template counts as a line start */
  int rc = 0;
  while (pos < L.n) {
    /* The earliest tag start: a '{' followed by one of "{%#". */
    size_t i = pos;
    const char *hit = NULL;
    while (i + 1 < L.n) {
      hit = memchr(L.s + i, '{', L.n - 1 - i);
      if (!hit) break;
      i = (size_t)(hit - L.s);
      char k = L.s[i + 1];
      if (k == '{' || k == '%' || k == '#') break;
      i++;
      hit = NULL;
    }
    if (!hit) {
      gc__tmpl_tok *k = push(&L, GC__TK_DATA, pos);
      if (!k) goto fail;
      k->s = (gc__tmpl_str){L.s + pos, L.n - pos};
      break;
    }
    char kind = L.s[i + 1];
    char sign = i + 2 < L.n && (L.s[i + 2] == '-' || L.s[i + 2] == '+') ? L.s[i + 2] : 0;
    size_t body = 0;
    bool raw = kind == '%' && raw_begin(&L, i, &body);
    if ((rc = text_before_tag(&L, pos, i, sign, kind != '{', line_starting))) goto fail;
    if (raw) {
      /* The match ends at body: after "%}" or after "-%}" and the whitespace it eats. */
      bool ls = body > i && L.s[body - 1] == '\n';
      size_t te, next;
      char sg;
      if (!raw_end(&L, body, &te, &sg, &next)) {
        rc = lfail(&L, i, MR_EFORMAT, "missing end of raw directive");
        goto fail;
      }
      if ((rc = text_before_tag(&L, body, te, sg, true, ls))) goto fail;
      line_starting = next > te && L.s[next - 1] == '\n';
      pos = next;
      continue;
    }
    size_t after = i + 2 + (sign ? 1 : 0);
    if (kind == '#') {
      /* jinja2's comment end: the first of "+#}", "-#}" (and the whitespace after it)
       * or "#}" (and one newline: trim_blocks applies to comments too). The comment's
       * text is dropped; a comment never makes a token. */
      size_t j, end = 0;
      for (j = after; j + 1 < L.n; j++) {
        if ((L.s[j] == '+' || L.s[j] == '-') && j + 2 < L.n && L.s[j + 1] == '#' &&
            L.s[j + 2] == '}') {
          end = L.s[j] == '-' ? skip_space(&L, j + 3) : j + 3;
          break;
        }
        if (L.s[j] == '#' && L.s[j + 1] == '}') {
          end = j + 2;
          if (end < L.n && L.s[end] == '\n') end++;
          break;
        }
      }
      if (!end) {
        rc = lfail(&L, i, MR_EFORMAT, "missing end of comment tag");
        goto fail;
      }
      line_starting = L.s[end - 1] == '\n';
      pos = end;
      continue;
    }
    bool var = kind == '{';
    if (!push(&L, var ? GC__TK_VAR_BEGIN : GC__TK_BLOCK_BEGIN, i)) goto fail;
    if ((rc = lex_tag(&L, after, var, &pos, &line_starting))) goto fail;
  }
  if (!push(&L, GC__TK_EOF, L.n)) goto fail;
  *toks = L.toks;
  *ntoks = L.ntoks;
  return 0;
fail:
  mr_free(L.toks);
  *toks = NULL;
  *ntoks = 0;
  return rc ? rc : e->code;
}
