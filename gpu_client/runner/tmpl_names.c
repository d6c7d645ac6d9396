/*
 * tmpl_names.c - the names of the chat-template subset: the tables of its filters, tests,
 * global functions and methods, and the pure lookups over them (name -> id, id -> name,
 * the method of a name on a value's type). The parser (tmpl_parse.c) resolves every name
 * with them at compile time; the runtime (tmpl_rt.c) finds a value's methods with them,
 * and the builtins (tmpl_builtin.c) name filters and tests in messages.
 */
#include <string.h>

#include "gpu_client/runner/tmpl_internal.h"

/* ---- names ------------------------------------------------------------------------------ */

/* The subset's names. Filters and tests are found by name at compile time (and at run
 * time for the names given to select / map); methods are found by the type of the value
 * at run time, since the parser cannot know it. Python's other attribute names are
 * listed so that `x.pop` is a method that fails when called (as the sandbox makes it)
 * rather than an undefined value. */

typedef struct named {
  const char *name;
  uint16_t id;
} named;

static const named filters[] = {
    {"abs", GC__TFL_ABS},           {"capitalize", GC__TFL_CAPITALIZE},
    {"count", GC__TFL_COUNT},       {"d", GC__TFL_DEFAULT},
    {"default", GC__TFL_DEFAULT},   {"first", GC__TFL_FIRST},
    {"float", GC__TFL_FLOAT},       {"indent", GC__TFL_INDENT},
    {"int", GC__TFL_INT},           {"items", GC__TFL_ITEMS},
    {"join", GC__TFL_JOIN},         {"last", GC__TFL_LAST},
    {"length", GC__TFL_LENGTH},     {"list", GC__TFL_LIST},
    {"lower", GC__TFL_LOWER},       {"map", GC__TFL_MAP},
    {"max", GC__TFL_MAX},           {"min", GC__TFL_MIN},
    {"reject", GC__TFL_REJECT},     {"rejectattr", GC__TFL_REJECTATTR},
    {"replace", GC__TFL_REPLACE},   {"reverse", GC__TFL_REVERSE},
    {"safe", GC__TFL_SAFE},         {"select", GC__TFL_SELECT},
    {"selectattr", GC__TFL_SELECTATTR}, {"sort", GC__TFL_SORT},
    {"string", GC__TFL_STRING},     {"sum", GC__TFL_SUM},
    {"title", GC__TFL_TITLE},       {"tojson", GC__TFL_TOJSON},
    {"trim", GC__TFL_TRIM},         {"unique", GC__TFL_UNIQUE},
    {"upper", GC__TFL_UPPER},
};

static const named tests[] = {
    {"defined", GC__TT_DEFINED},   {"undefined", GC__TT_UNDEFINED}, {"none", GC__TT_NONE},
    {"boolean", GC__TT_BOOLEAN},   {"false", GC__TT_FALSE},         {"true", GC__TT_TRUE},
    {"integer", GC__TT_INTEGER},   {"float", GC__TT_FLOAT},         {"number", GC__TT_NUMBER},
    {"string", GC__TT_STRING},     {"mapping", GC__TT_MAPPING},     {"iterable", GC__TT_ITERABLE},
    {"sequence", GC__TT_SEQUENCE}, {"callable", GC__TT_CALLABLE},   {"sameas", GC__TT_SAMEAS},
    {"escaped", GC__TT_ESCAPED},   {"in", GC__TT_IN},               {"eq", GC__TT_EQ},
    {"equalto", GC__TT_EQ},        {"==", GC__TT_EQ},               {"ne", GC__TT_NE},
    {"!=", GC__TT_NE},             {"gt", GC__TT_GT},               {"greaterthan", GC__TT_GT},
    {">", GC__TT_GT},              {"ge", GC__TT_GE},               {">=", GC__TT_GE},
    {"lt", GC__TT_LT},             {"lessthan", GC__TT_LT},         {"<", GC__TT_LT},
    {"le", GC__TT_LE},             {"<=", GC__TT_LE},               {"odd", GC__TT_ODD},
    {"even", GC__TT_EVEN},         {"divisibleby", GC__TT_DIVISIBLEBY},
    {"lower", GC__TT_LOWER},       {"upper", GC__TT_UPPER},
};

static const named funcs[] = {
    {"range", GC__TF_RANGE},           {"namespace", GC__TF_NAMESPACE}, {"dict", GC__TF_DICT},
    {"raise_exception", GC__TF_RAISE}, {"strftime_now", GC__TF_STRFTIME},
};

static const named str_methods[] = {
    {"startswith", GC__TM_STARTSWITH}, {"endswith", GC__TM_ENDSWITH},
    {"split", GC__TM_SPLIT},           {"rsplit", GC__TM_RSPLIT},
    {"strip", GC__TM_STRIP},           {"lstrip", GC__TM_LSTRIP},
    {"rstrip", GC__TM_RSTRIP},         {"replace", GC__TM_REPLACE},
    {"upper", GC__TM_UPPER},           {"lower", GC__TM_LOWER},
    {"title", GC__TM_TITLE},           {"capitalize", GC__TM_CAPITALIZE},
    {"find", GC__TM_FIND},             {"rfind", GC__TM_RFIND},
    {"count", GC__TM_COUNT},           {"join", GC__TM_JOIN},
    {"splitlines", GC__TM_SPLITLINES}, {"isspace", GC__TM_ISSPACE},
    {"removeprefix", GC__TM_REMOVEPREFIX}, {"removesuffix", GC__TM_REMOVESUFFIX},
    {"index", GC__TM_INDEX},
};

static const named dict_methods[] = {
    {"get", GC__TM_GET}, {"items", GC__TM_ITEMS}, {"keys", GC__TM_KEYS}, {"values", GC__TM_VALUES},
};

/* Python's other attributes of these types: they exist (so `x.pop` is not undefined),
 * but calling them is outside the subset (jinja2's sandbox refuses those that mutate). */
static const char *const str_others[] = {
    "casefold", "center", "encode", "expandtabs", "format", "format_map",
    "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower",
    "isnumeric", "isprintable", "istitle", "isupper", "ljust", "maketrans", "partition",
    "rindex", "rjust", "rpartition", "swapcase", "translate", "zfill", NULL};
static const char *const dict_others[] = {"clear", "copy", "fromkeys", "pop", "popitem",
                                          "setdefault", "update", NULL};
static const char *const list_others[] = {"append", "clear", "copy", "extend", "insert",
                                          "pop", "remove", "reverse", "sort", NULL};

static bool eqn(const char *p, size_t n, const char *lit) {
  size_t k = strlen(lit);
  return n == k && memcmp(p, lit, k) == 0;
}

static uint16_t find_named(const named *t, size_t count, const char *p, size_t n) {
  for (size_t i = 0; i < count; i++)
    if (eqn(p, n, t[i].name)) return t[i].id;
  return 0;
}

static bool in_list(const char *const *l, const char *p, size_t n) {
  for (; *l; l++)
    if (eqn(p, n, *l)) return true;
  return false;
}

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

uint16_t gc__tmpl_filter_id(const char *p, size_t n) { return find_named(filters, COUNT(filters), p, n); }
uint16_t gc__tmpl_test_id(const char *p, size_t n) { return find_named(tests, COUNT(tests), p, n); }
uint16_t gc__tmpl_func_id(const char *p, size_t n) { return find_named(funcs, COUNT(funcs), p, n); }

bool gc__tmpl_method_known(const char *p, size_t n) {
  return find_named(str_methods, COUNT(str_methods), p, n) ||
         find_named(dict_methods, COUNT(dict_methods), p, n) || eqn(p, n, "cycle");
}

uint16_t gc__tmpl_method_of(const gc__tmpl_val *self, const char *p, size_t n) {
  uint16_t id;
  switch (self->kind) {
  case GC__TV_STR:
    if ((id = find_named(str_methods, COUNT(str_methods), p, n))) return id;
    return in_list(str_others, p, n) ? GC__TM_OTHER : 0;
  case GC__TV_DICT:
    if ((id = find_named(dict_methods, COUNT(dict_methods), p, n))) return id;
    return in_list(dict_others, p, n) ? GC__TM_OTHER : 0;
  case GC__TV_LIST: {
    uint8_t fl = self->u.l->flavour;
    if (fl != GC__TL_LIST && fl != GC__TL_TUPLE && fl != GC__TL_RANGE) return 0;
    if (eqn(p, n, "count")) return GC__TM_COUNT;
    if (eqn(p, n, "index")) return GC__TM_INDEX;
    return fl == GC__TL_LIST && in_list(list_others, p, n) ? GC__TM_OTHER : 0;
  }
  default:
    return 0;
  }
}

const char *gc__tmpl_filter_name(uint16_t id) {
  for (size_t i = 0; i < COUNT(filters); i++)
    if (filters[i].id == id) return filters[i].name;
  return "?";
}

const char *gc__tmpl_test_name(uint16_t id) {
  for (size_t i = 0; i < COUNT(tests); i++)
    if (tests[i].id == id) return tests[i].name;
  return "?";
}
