/*
 * test_chat_template.c - the chat-template interpreter (gpu_client/runner/chat_template.h):
 * each construct against what jinja2 renders (expected strings checked with transformers'
 * environment when written), whitespace control, scoping, every kind of refusal and
 * runtime error (code, and a message naming the construct and line:col), the limits,
 * the two variable readers, checkpoint directories, threads and failing allocations.
 * tests/conformance/test_chat_template_jinja.py compares whole family templates.
 */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/mr.h"
#include "gpu_client/runner/chat_template.h"
#include "tests/unit/mt.h"

/* Renders src with the variables in json (NULL = "{}") into a static buffer; returns the
 * code, e gets the error. */
static char got[1 << 16];
static int render_lim(const char *src, const char *json, const gc_tmpl_limits *lim, mr_err *e) {
  gc_tmpl *t = NULL;
  got[0] = '\0';
  int rc = gc_tmpl_compile(&t, src, strlen(src), NULL, e);
  if (rc) return rc;
  char *out = NULL;
  size_t len = 0;
  if (!json) json = "{}";
  rc = gc_tmpl_render_json(t, json, strlen(json), lim, &out, &len, e);
  if (rc == 0) {
    MT_EQ_INT(strlen(out), len);
    snprintf(got, sizeof got, "%s", out);
  }
  mr_free(out);
  gc_tmpl_free(t);
  return rc;
}
static int render(const char *src, const char *json, mr_err *e) { return render_lim(src, json, NULL, e); }

#define EXPECT(src, json, want)                                                        \
  do {                                                                                 \
    mr_err e_;                                                                         \
    MT_OK(render((src), (json), &e_), &e_);                                            \
    MT_EQ_STR(got, (want));                                                            \
  } while (0)

/* Expects failure with code and a message containing each of the two substrings. */
#define EXPECT_ERR(src, json, code, sub1, sub2)                                        \
  do {                                                                                 \
    mr_err e_;                                                                         \
    int rc_ = render((src), (json), &e_);                                              \
    MT_EQ_INT(rc_, (code));                                                            \
    MT_CONTAINS(e_.msg, (sub1));                                                       \
    MT_CONTAINS(e_.msg, (sub2));                                                       \
  } while (0)

MT_TEST(text_and_printing) {
  EXPECT("plain text", NULL, "plain text");
  EXPECT("{{ 'a' ~ 1 ~ none ~ true }}|{{ none }}|{{ false }}", NULL, "a1NoneTrue|None|False");
  EXPECT("{{ 1.0 }} {{ 1e-5 }} {{ 1e16 }} {{ 1e15 }} {{ 0.1 + 0.2 }} {{ -0.0 }} {{ 2.5e-7 }}", NULL,
         "1.0 1e-05 1e+16 1000000000000000.0 0.30000000000000004 -0.0 2.5e-07");
  EXPECT("{{ [1, 'a', none, 1.5, {'k': \"it's\"}, (1,), ()] }}", NULL,
         "[1, 'a', None, 1.5, {'k': \"it's\"}, (1,), ()]");
  EXPECT("{{ ['tab\\t', 'nl\\n', '\\x01', '\\u00e9', '\\u200b'] }}", NULL,
         "['tab\\t', 'nl\\n', '\\x01', '\xc3\xa9', '\\u200b']");
  EXPECT("{{ 'a' 'b' \"c\" }}{{ '\\x41\\u00e9\\101\\z\\'' }}", NULL, "abcA\xc3\xa9" "A\\z'");
  EXPECT("{{ 0x1f }} {{ 0b101 }} {{ 0o17 }} {{ 1_000 }} {{ 1_0.5 }}", NULL, "31 5 15 1000 10.5");
  EXPECT("{{ undefined_name }}|{{ d.missing }}", "{\"d\": {}}", "|");
  EXPECT("{{ namespace(a=1) }} {{ range(3) }} {{ range(1, 9, 2) }} {{ {'a': 1}.items() }}", NULL,
         "<Namespace {'a': 1}> range(0, 3) range(1, 9, 2) dict_items([('a', 1)])");
}

MT_TEST(whitespace_control) {
  /* trim_blocks: the newline after a block tag goes; lstrip_blocks: the indentation
   * before it goes. */
  EXPECT("{% if true %}\n  x\n  {% endif %}\ny", NULL, "  x\ny");
  EXPECT("a  {%- if true -%}  b  {%- endif -%}  c", NULL, "abc");
  EXPECT("a\n  {%+ if true %}b{% endif +%}\nc", NULL, "a\n  b\nc");
  EXPECT("a {{- ' b ' -}} c", NULL, "a b c");
  EXPECT("  {# comment #}\nx {#- c -#} y", NULL, "xy");
  EXPECT("{{ 'v' }}\n  {{ 'w' }}\n", NULL, "v\n  w"); /* one trailing newline dropped */
  EXPECT("a\r\nb\rc\r\n\r\n", NULL, "a\nb\nc\n");       /* newlines normalized */
  EXPECT("  {% raw %}{{ x }} {% if %}{% endraw %}!", NULL, "{{ x }} {% if %}!");
  EXPECT("{{ {'a': {'b': 1}}}}", NULL, "{'a': {'b': 1}}"); /* }}} closes the dict first */
  EXPECT("x\n\t {% set y = 1 %}\ny", NULL, "x\ny");
  EXPECT("x\n\xc2\xa0 {% set y = 1 %}z", NULL, "x\nz"); /* str.isspace: NBSP is stripped */
}

MT_TEST(for_loops) {
  EXPECT("{% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
         "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
         NULL, "1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;");
  EXPECT("{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('o', 'e') }};"
         "{% endfor %}",
         NULL, "-2-o;1-3-e;2--o;");
  EXPECT("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}/{{ loop.length }}{% endfor %}", NULL, "2/24/2");
  EXPECT("{% for x in [] %}x{% else %}empty{% endfor %}", NULL, "empty");
  EXPECT("{% for x in [1] if false %}x{% else %}none{% endfor %}", NULL, "none");
  /* jinja2 runs the else when no iteration ran to its end: continue and break skip it. */
  EXPECT("{% for x in [1, 2] %}{% continue %}{% else %}E{% endfor %}", NULL, "E");
  EXPECT("{% for x in [1, 2] %}{% break %}{% else %}E{% endfor %}", NULL, "E");
  EXPECT("{% for x in [1, 2] %}{% if x == 2 %}{% break %}{% endif %}{% else %}E{% endfor %}", NULL, "");
  EXPECT("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}"
         "{% if x == 4 %}{% break %}{% endif %}{{ x }}{% else %}E{% endfor %}",
         NULL, "13");
  EXPECT("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}", NULL, "a=1;b=2;");
  EXPECT("{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}{% for c in 'h\xc3\xa9' %}[{{ c }}]{% endfor %}",
         NULL, "ab[h][\xc3\xa9]");
  EXPECT("{% for m in messages[::-1] %}{{ m }}{% endfor %}", "{\"messages\": [1, 2, 3]}", "321");
  EXPECT_ERR("\n{% for a, b in [[1, 2], [3]] %}{% endfor %}", NULL, MR_EINVAL, "chat_template:2:",
             "not enough values to unpack (expected 2, got 1)");
  EXPECT_ERR("{% for x in none %}{% endfor %}", NULL, MR_EINVAL, "chat_template:1:",
             "'NoneType' object is not iterable");
  EXPECT("{% for x in undefined %}x{% endfor %}ok", NULL, "ok");
}

MT_TEST(scoping) {
  /* A loop body reads the outer value each iteration; what it sets stays inside. */
  EXPECT("{% set x = 'top' %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}|{{ x }}",
         NULL, "top1top2|top");
  EXPECT("{% for i in [1, 2] %}{% if i == 2 %}[{{ y }}]{% endif %}{% set y = i %}{% endfor %}", NULL,
         "[]");
  EXPECT("{% set ns = namespace(n=0) %}{% for i in [1, 2, 3] %}{% set ns.n = ns.n + i %}{% endfor %}"
         "{{ ns.n }}",
         NULL, "6");
  EXPECT("{% if true %}{% set z = 5 %}{% endif %}{{ z }}", NULL, "5");
  /* Macros see the template's variables as they are at call time, not the loop's. */
  EXPECT("{% macro m() %}{{ x }}{% endmacro %}{% set x = 1 %}{{ m() }}"
         "{% for x in [9] %}{{ m() }}{% endfor %}",
         NULL, "11");
  EXPECT("{% set x = 1 %}{% macro m() %}{{ x }}{% set x = 2 %}{{ x }}{% endmacro %}{{ m() }}{{ x }}",
         NULL, "121");
  /* The render's variables are shadowed by {% set %}, the globals by both. */
  EXPECT("{{ tools }}{% set tools = [] %}{{ tools }}", "{\"tools\": null}", "None[]");
  EXPECT("{% set block %}a{{ 1 + 1 }}{% endset %}[{{ block }}]{{ block|length }}", NULL, "[a2]2");
  EXPECT("{% set a, b = 1, 2 %}{{ b }}{{ a }}", NULL, "21");
  /* A set block's body is a scope of its own. */
  EXPECT("{% set a %}{% set b = 1 %}x{% endset %}[{{ a }}][{{ b }}]", NULL, "[x][]");
  /* A name whose first top-level mention is an unconditional set starts undefined, the
   * render's variable of that name hidden (in loops and macros too) until the set... */
  EXPECT("{% macro m() %}[{{ v }}]{% endmacro %}{% for i in [1] %}({{ v }}){% endfor %}{{ m() }}"
         "{% set v = 1 %}{{ m() }}",
         "{\"v\": \"ctx\"}", "()[][1]");
  /* ...but a read first, or a set in only some branches, leaves it visible. */
  EXPECT("{{ v }}{% set v = 1 %}{{ v }}|{% if false %}{% set w = 1 %}{% endif %}{{ w }}",
         "{\"v\": \"ctx\", \"w\": \"W\"}", "ctx1|W");
  EXPECT_ERR("{% set d = {} %}{% set d.x = 1 %}", NULL, MR_EINVAL, "chat_template:1:",
             "cannot assign attribute on non-namespace object");
  EXPECT_ERR("{% set ns = namespace() %}{% set ns._x = 1 %}", NULL, MR_EINVAL, "chat_template:1:",
             "underscore-prefixed");
}

MT_TEST(macros) {
  EXPECT("{% macro m(a, b=2, c='x') %}[{{ a }}{{ b }}{{ c }}]{% endmacro %}"
         "{{ m(1) }}{{ m(1, 3) }}{{ m(a=5, c='y') }}{{ m() }}",
         NULL, "[12x][13x][52y][2x]");
  EXPECT("{% macro fact(n) %}{% if n > 1 %}{{ n * fact(n - 1)|int }}{% else %}1{% endif %}{% endmacro %}"
         "{{ fact(5) }}",
         NULL, "120");
  EXPECT("{{ m }}{% macro m() %}{% endmacro %}|{{ m }}", NULL, "|<Macro 'm'>");
  EXPECT_ERR("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL, MR_EINVAL, "chat_template:1:",
             "takes not more than 1 argument");
  EXPECT_ERR("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}", NULL, MR_EINVAL, "chat_template:1:",
             "no keyword argument 'b'");
  EXPECT_ERR("{{ m() }}{% macro m() %}{% endmacro %}", NULL, MR_EINVAL, "chat_template:1:",
             "'m' is undefined");
}

MT_TEST(operators) {
  EXPECT("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 2 ** 10 }} "
         "{{ 2 ** -1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ -2 ** 2 }}",
         NULL, "3 -4 2 -2 3.5 2.0 1024 0.5 3.0 0.5 4");
  EXPECT("{{ 'ab' * 2 }}{{ 2 * [1] }}{{ [1] + [2] }}{{ (1,) + (2,) }}{{ true + 1 }}", NULL,
         "abab[1, 1][1, 2](1, 2)2");
  EXPECT("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ [1, 2] < [1, 3] }} {{ 'a' < 'b' }} "
         "{{ {'a': 1} == {'a': 1} }} {{ [1] == (1,) }}",
         NULL, "True False True True True True False");
  EXPECT("{{ 'b' in 'abc' }} {{ 2 not in [1, 3] }} {{ 'k' in {'k': 1} }} {{ 'x' in undefined }}",
         NULL, "True True True False");
  EXPECT("{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ none and 1 }} {{ not '' }}", NULL, "x b None True");
  EXPECT("{{ 'y' if 1 else 'n' }}|{{ 'y' if 0 }}|{{ 'a' if false else 'b' if true }}", NULL, "y||b");
  /* ~ binds tighter than + and looser than *; a filter binds to its operand alone */
  EXPECT("{{ -1|abs }} {{ 'x' ~ 2 * 3 }} {{ 'a' + 'b'|upper + 'c' }}", NULL, "1 x6 aBc");
  EXPECT_ERR("{{ 1 + 2 ~ 3 }}", NULL, MR_EINVAL, "chat_template:1:",
             "unsupported operand type(s) for +: 'int' and 'str'");
  EXPECT_ERR("\n\n  {{ 'a' + 1 }}", NULL, MR_EINVAL, "chat_template:3:",
             "can only concatenate str (not \"int\") to str");
  EXPECT_ERR("{{ 1 / 0 }}", NULL, MR_EINVAL, "chat_template:1:", "division by zero");
  EXPECT_ERR("{{ 'a' < 1 }}", NULL, MR_EINVAL, "chat_template:1:",
             "'<' not supported between instances of 'str' and 'int'");
  EXPECT_ERR("{{ 1 in 'abc' }}", NULL, MR_EINVAL, "chat_template:1:",
             "'in <string>' requires string as left operand");
  EXPECT_ERR("{{ 9223372036854775807 + 1 }}", NULL, MR_ERANGE, "chat_template:1:", "integer overflow");
  EXPECT_ERR("{{ '%s' % 1 }}", NULL, MR_ENOTSUP, "chat_template:1:", "string formatting with %");
}

MT_TEST(undefined_values) {
  EXPECT("[{{ x }}][{{ x|default('d') }}][{{ x is defined }}][{{ x|length }}][{{ x ~ 'a' }}]"
         "[{{ x == y }}][{{ x|list }}][{{ not x }}]",
         NULL, "[][d][False][0][a][True][[]][True]");
  EXPECT_ERR("line\n  {{ x.y }}", NULL, MR_EINVAL, "chat_template:2:", "'x' is undefined");
  EXPECT_ERR("{{ d.a.b }}", "{\"d\": {}}", MR_EINVAL, "chat_template:1:",
             "'dict object' has no attribute 'a'");
  EXPECT_ERR("{{ x + 1 }}", NULL, MR_EINVAL, "chat_template:1:", "'x' is undefined");
  EXPECT_ERR("{{ x|tojson }}", NULL, MR_EINVAL, "chat_template:1:",
             "Object of type Undefined is not JSON serializable");
  EXPECT_ERR("{{ x|int }}", NULL, MR_EINVAL, "chat_template:1:", "'x' is undefined");
  EXPECT_ERR("{{ x() }}", NULL, MR_ENOTSUP, "chat_template:1:", "function \"x\" is not supported");
  EXPECT_ERR("{{ messages[5].content }}", "{\"messages\": []}", MR_EINVAL, "chat_template:1:",
             "list object has no element 5");
}

MT_TEST(filters) {
  EXPECT("[{{ '  a b  '|trim }}][{{ 'xxaxx'|trim('x') }}][{{ 'h\xc3\xa9'|length }}][{{ [1, 2]|count }}]"
         "[{{ 3|string }}][{{ 'aBc'|lower }}{{ 'aBc'|upper }}][{{ 'hELLO wORLD'|capitalize }}]"
         "[{{ 'hello-wORLD (x'|title }}]",
         NULL, "[a b][a][2][2][3][abcABC][Hello world][Hello-World (X]");
  EXPECT("{{ ''|default('d') }}{{ ''|default('d', true) }}{{ none|default('d') }}{{ 0|d(5, boolean=true) }}",
         NULL, "dNone5");
  EXPECT("{{ [3, 1, 2]|first }}{{ [3, 1, 2]|last }}{{ []|first }}|{{ 'abc'|last }}{{ {'a': 1}|first }}",
         NULL, "32|ca");
  EXPECT("{{ [1, 2]|join(', ') }}|{{ [{'a': 1}, {'a': 'x'}]|join('-', attribute='a') }}|{{ 'ab'|join('.') }}",
         NULL, "1, 2|1-x|a.b");
  EXPECT("{{ 'aaa'|replace('a', 'b', 2) }}{{ 'abc'|replace('', '-') }}", NULL, "bba-a-b-c-");
  EXPECT("{% for k, v in {'x': 1, 'y': 2}|items %}{{ k }}{{ v }}{% endfor %}{{ undefined|items|list }}",
         NULL, "x1y2[]");
  EXPECT("{{ msgs|selectattr('role', 'equalto', 'user')|map(attribute='c')|list }}"
         "{{ msgs|rejectattr('role', 'eq', 'user')|map(attribute='c')|join }}"
         "{{ msgs|map(attribute='zz', default='-')|join }}",
         "{\"msgs\": [{\"role\": \"user\", \"c\": 1}, {\"role\": \"bot\", \"c\": 2}, {\"role\": \"user\", \"c\": 3}]}",
         "[1, 3]2---");
  EXPECT("{{ [1, 2, 3, 4]|select('odd')|list }}{{ ['a', 'b']|reject('in', ['a'])|list }}"
         "{{ [0, 1, '']|select|list }}{{ ['1', 2]|map('int')|list }}",
         NULL, "[1, 3]['b'][1][1, 2]");
  EXPECT("{{ 'a<b>'|safe + '<i>' }}|{{ '<i>' + 'x'|safe }}|{{ '<i>' ~ 'x'|safe }}|{{ 'x'|safe is escaped }}",
         NULL, "a<b>&lt;i&gt;|&lt;i&gt;x|<i>x|True");
  EXPECT("{{ '12'|int + 1 }} {{ '2.75'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ '0x1f'|int(base=16) }} "
         "{{ 3.9|int }} {{ '1e3'|float }} {{ 'x'|float }} {{ ' 4 '|float }}",
         NULL, "13 2 0 7 31 3 1000.0 0.0 4.0");
  EXPECT("{{ 'ab'|list }}{{ {'k': 1}|list }}{{ ['b', 'A', 'a', 'B']|unique|list }}"
         "{{ ['b', 'A', 'c']|sort }}{{ [3, 1, 2]|sort(reverse=true) }}"
         "{{ [{'n': 2}, {'n': 1}]|sort(attribute='n')|map(attribute='n')|list }}",
         NULL, "['a', 'b']['k']['b', 'A']['A', 'b', 'c'][3, 2, 1][1, 2]");
  EXPECT("{{ [1, 2]|reverse|list }}{{ 'abc'|reverse }}{{ [1, 2.5]|sum }}{{ [3, 1]|min }}{{ ['a', 'B']|max }}",
         NULL, "[2, 1]cba3.51B");
  EXPECT("{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent('> ', first=true) }}", NULL,
         "a\n  b\n\n  c|> a\n> b");
  EXPECT("{{ {'b': [1, {}], 'a': none}|tojson }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}|"
         "{{ [1, 'x']|tojson(indent=2) }}|{{ {'a': [1]}|tojson(separators=(',', ':')) }}|"
         "{{ '\xc3\xa9\"\\n\\x01\x7f'|tojson }}|{{ '\xc3\xa9\xf0\x9f\x98\x80'|tojson(ensure_ascii=true) }}|"
         "{{ [1.0, 2, 1e20]|tojson }}|{{ {}|tojson(indent=2) }}",
         NULL,
         "{\"b\": [1, {}], \"a\": null}|{\"a\": 2, \"b\": 1}|[\n  1,\n  \"x\"\n]|{\"a\":[1]}|"
         "\"\xc3\xa9\\\"\\n\\u0001\x7f\"|\"\\u00e9\\ud83d\\ude00\"|[1.0, 2, 1e+20]|{}");
  EXPECT_ERR("{{ 5|items|list }}", NULL, MR_EINVAL, "chat_template:1:", "Can only get item pairs");
}

MT_TEST(filters_lazy_and_generators) {
  /* jinja2's generator filters: always true, one use, no length, failures when iterated. */
  EXPECT("{% if []|select %}T{% endif %}{% set g = [1, 2]|select %}{{ g|list }}{{ g|list }}", NULL,
         "T[1, 2][]");
  EXPECT("{% if 5|items %}lazy{% endif %}", NULL, "lazy");
  EXPECT("{% set g = [1, 2, 3]|select %}{{ 2 in g }}{{ g|list }}", NULL, "True[3]");
  EXPECT_ERR("{{ [1]|select|length }}", NULL, MR_EINVAL, "chat_template:1:",
             "object of type 'generator' has no len()");
  EXPECT_ERR("{{ [1]|select }}", NULL, MR_EINVAL, "chat_template:1:", "cannot print a generator");
  EXPECT_ERR("{{ [1]|select|last }}", NULL, MR_EINVAL, "chat_template:1:", "not reversible");
}

MT_TEST(tests) {
  EXPECT("{{ x is defined }}{{ x is undefined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}"
         "{{ [] is iterable }}{{ 'a' is sequence }}{{ {} is sequence }}{{ 1 is number }}{{ true is number }}"
         "{{ true is integer }}{{ 1 is integer }}{{ 1.0 is float }}{{ true is boolean }}{{ false is false }}"
         "{{ 1 is true }}",
         NULL,
         "FalseTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrueFalse");
  EXPECT("{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 2 is in [1, 2] }}"
         "{{ 1 is eq 1 }}{{ 2 is gt 1 }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ x is callable }}"
         "{{ none is sameas none }}{{ 1 is not none }}",
         NULL, "TrueTrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrue");
}

MT_TEST(methods) {
  EXPECT("{{ 'Hello'.startswith('He') }}{{ 'Hello'.startswith(('x', 'H')) }}{{ 'a.py'.endswith('.py') }}",
         NULL, "TrueTrueTrue");
  EXPECT("{{ ' a  b '.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}"
         "{{ 'a b c'.rsplit(None, 1) }}{{ 'x</think>y</think>z'.split('</think>', 1)[1] }}",
         NULL, "['a', 'b']['a', 'b', '', 'c']['a', 'b,c']['a b', 'c']y</think>z");
  EXPECT("[{{ ' x '.strip() }}][{{ '\\nx\\n'.lstrip('\\n') }}][{{ 'x..'.rstrip('.') }}]"
         "[{{ 'aaa'.replace('a', 'b', 1) }}][{{ 'abcb'.find('b') }}{{ 'abcb'.rfind('b') }}"
         "{{ 'abcb'.find('z') }}{{ 'abcb'.count('b') }}{{ 'abcb'.index('c') }}]",
         NULL, "[x][x\n][x][baa][13-122]");
  EXPECT("{{ ', '.join(['a', 'b']) }}|{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ 'hello wORLD'.title() }}|"
         "{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'ab'.capitalize() }}|{{ 'x_y'.removeprefix('x_') }}",
         NULL, "a, b|['a', 'b', 'c']|Hello World|ABabAb|y");
  EXPECT("{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 5) }}{{ d.keys()|list }}{{ d.values()|list }}"
         "{{ d.items()|list }}",
         "{\"d\": {\"a\": 1}}", "1None5['a'][1][('a', 1)]");
  EXPECT("{{ [1, 2, 2].count(2) }}{{ (1, 2).index(2) }}", NULL, "21");
  EXPECT_ERR("{{ [1].append(2) }}", NULL, MR_ENOTSUP, "chat_template:1:", "not supported");
  EXPECT_ERR("{{ 'abc'.index('z') }}", NULL, MR_EINVAL, "chat_template:1:", "substring not found");
}

MT_TEST(unicode_case) {
  /* Python's full mappings and the final sigma. */
  EXPECT("{{ 'stra\xc3\x9f\xc3\xa9'|upper }}|{{ '\xce\x9f\xce\x94\xce\x9f\xce\xa3'|lower }}|"
         "{{ '\xef\xac\x81'|upper }}|{{ '\xc4\xb0'|lower|length }}|{{ '\xc7\x86" "a'|capitalize }}",
         NULL,
         "STRASS\xc3\x89|\xce\xbf\xce\xb4\xce\xbf\xcf\x82|FI|2|\xc7\x85" "a");
}

MT_TEST(globals) {
  EXPECT("{{ range(3)|list }}{{ range(5, 0, -2)|list }}{{ range(10)[2:5] }}{{ range(5)[::2] }}", NULL,
         "[0, 1, 2][5, 3, 1]range(2, 5)range(0, 5, 2)");
  EXPECT("{% set ns = namespace(a=1, b=[]) %}{{ ns.a }}{{ ns.b }}{{ ns.c }}|{{ namespace({'x': 2}).x }}|"
         "{{ dict(a=1, b=2) }}",
         NULL, "1[]|2|{'a': 1, 'b': 2}");
  EXPECT_ERR("{{ range(200000) }}", NULL, MR_EEXHAUSTED, "chat_template:1:", "range too big");
  EXPECT_ERR("{{ namespace(_x=1) }}", NULL, MR_EINVAL, "chat_template:1:", "underscore-prefixed");
  mr_err e;
  MT_OK(render("{{ strftime_now('%Y') }}", NULL, &e), &e);
  MT_EQ_INT(strlen(got), 4);
}

MT_TEST(raise_exception_is_bare) {
  mr_err e;
  int rc = render("{% for m in messages %}\n{% if m.role != 'user' %}"
                  "{{ raise_exception('Roles must alternate: ' ~ m.role) }}{% endif %}{% endfor %}",
                  "{\"messages\": [{\"role\": \"user\"}, {\"role\": \"critic\"}]}", &e);
  MT_EQ_INT(rc, MR_EPRECOND);
  MT_EQ_STR(e.msg, "Roles must alternate: critic");
}

MT_TEST(refusals_name_construct_and_place) {
  static const struct {
    const char *src;
    int code;
    const char *where, *what;
  } cases[] = {
      {"{% include 'x' %}", MR_ENOTSUP, "chat_template:1:4:", "\"include\" is not supported"},
      {"a\n  {% extends 'b' %}", MR_ENOTSUP, "chat_template:2:6:", "\"extends\" is not supported"},
      {"{% import 'm' as m %}", MR_ENOTSUP, "chat_template:1:4:", "\"import\""},
      {"{% from 'm' import x %}", MR_ENOTSUP, "chat_template:1:4:", "\"from\""},
      {"{% block b %}{% endblock %}", MR_ENOTSUP, "chat_template:1:4:", "\"block\""},
      {"{% with a = 1 %}{% endwith %}", MR_ENOTSUP, "chat_template:1:4:", "\"with\""},
      {"{% call m() %}{% endcall %}", MR_ENOTSUP, "chat_template:1:4:", "\"call\""},
      {"{% filter upper %}x{% endfilter %}", MR_ENOTSUP, "chat_template:1:4:", "\"filter\""},
      {"{% do x %}", MR_ENOTSUP, "chat_template:1:4:", "\"do\""},
      {"{% for x in y %}\n{% macro m() %}{% endmacro %}{% endfor %}", MR_ENOTSUP, "chat_template:2:4:",
       "\"macro\" inside a for loop"},
      {"{% macro m() %}{{ caller() }}{% endmacro %}", MR_ENOTSUP, "chat_template:1:19:", "\"caller\""},
      {"{{ x|wordwrap }}", MR_ENOTSUP, "chat_template:1:6:", "filter \"wordwrap\" is not supported"},
      {"{{ x is oddish }}", MR_ENOTSUP, "chat_template:1:9:", "test \"oddish\" is not supported"},
      {"{{ x|select('nope') }}", MR_ENOTSUP, "chat_template:1:13:", "test \"nope\" is not supported"},
      {"{{ x|map('nope') }}", MR_ENOTSUP, "chat_template:1:10:", "filter \"nope\" is not supported"},
      {"{{ '{}'.format(1) }}", MR_ENOTSUP, "chat_template:1:8:", "method \"format\" is not supported"},
      {"{{ lipsum() }}", MR_ENOTSUP, "chat_template:1:4:", "\"lipsum()\" is not supported"},
      {"{{ f(1) }}", MR_ENOTSUP, "chat_template:1:4:", "function \"f\" is not supported"},
      {"{{ 'a'.upper()() }}", MR_ENOTSUP, "chat_template:1:", "calling the result of an expression"},
      {"{% for x in y recursive %}{% endfor %}", MR_ENOTSUP, "chat_template:1:15:", "\"recursive\""},
      {"{% macro f(a) %}{% endmacro %}{{ f(*a) }}", MR_ENOTSUP, "chat_template:1:36:", "\"*args\""},
      {"{{ '\\N{BULLET}' }}", MR_ENOTSUP, "chat_template:1:5:", "\\N{...}"},
      {"{{ caf\xc3\xa9 }}", MR_ENOTSUP, "chat_template:1:4:", "non-ASCII identifiers"},
      {"{% set x | upper %}a{% endset %}", MR_ENOTSUP, "chat_template:1:", "a filter on a {% set %} block"},
      {"{% frobnicate %}", MR_EFORMAT, "chat_template:1:4:", "unknown tag \"frobnicate\""},
      {"x\n{% break %}", MR_EFORMAT, "chat_template:2:4:", "'break' outside loop"},
      {"{% if x %}", MR_EFORMAT, "chat_template:1:11:", "expected 'endif'"},
      {"{% endif %}", MR_EFORMAT, "chat_template:1:4:", "unexpected \"endif\""},
      {"{{ 'abc }}", MR_EFORMAT, "chat_template:1:4:", "unterminated string"},
      {"{{ x ! y }}", MR_EFORMAT, "chat_template:1:6:", "unexpected char '!'"},
      {"{{ (x }}", MR_EFORMAT, "chat_template:1:7:", "unexpected '}', expected ')'"},
      {"{# open", MR_EFORMAT, "chat_template:1:1:", "missing end of comment tag"},
      {"{{ x", MR_EFORMAT, "chat_template:1:", "unexpected end of template"},
      {"{% macro m(a=1, b) %}{% endmacro %}", MR_EFORMAT, "chat_template:1:", "non-default argument"},
      {"ok\n\xff", MR_EFORMAT, "chat_template:2:1:", "invalid UTF-8"},
      {"{{ 99999999999999999999 }}", MR_ENOTSUP, "chat_template:1:4:", "beyond 64 bits"},
      {"{{ 1 is defined is defined }}", MR_EFORMAT, "chat_template:1:", "chain multiple tests"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gc_tmpl *t = (gc_tmpl *)1;
    mr_err e;
    int rc = gc_tmpl_compile(&t, cases[i].src, strlen(cases[i].src), NULL, &e);
    if (rc != cases[i].code || !strstr(e.msg, cases[i].where) || !strstr(e.msg, cases[i].what) || t)
      MT__FAIL("case %zu (%s): rc %d, msg \"%s\"; want %d \"%s\" \"%s\"", i, cases[i].src, rc, e.msg,
               cases[i].code, cases[i].where, cases[i].what);
  }
  /* origin names the template in messages */
  gc_tmpl *t;
  mr_err e;
  MT_EQ_INT(gc_tmpl_compile(&t, "{% do %}", 8, "m/tokenizer_config.json", &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "m/tokenizer_config.json:1:4: \"do\"");
  /* the source size limit */
  size_t big = GC_TMPL_MAX_SOURCE + 1;
  char *src = malloc(big);
  MT_TRUE(src != NULL);
  memset(src, 'a', big);
  MT_EQ_INT(gc_tmpl_compile(&t, src, big, NULL, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "limit");
  free(src);
  /* chains and nesting deeper than the parser's limit */
  char deep[4096] = "{{ ";
  for (int k = 0; k < 400; k++) strcat(deep, "1+");
  strcat(deep, "1 }}");
  MT_EQ_INT(gc_tmpl_compile(&t, deep, strlen(deep), NULL, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "nesting deeper than");
  strcpy(deep, "{{ ");
  for (int k = 0; k < 300; k++) strcat(deep, "not ");
  strcat(deep, "1 }}");
  MT_EQ_INT(gc_tmpl_compile(&t, deep, strlen(deep), NULL, &e), MR_ENOTSUP);
  MT_CONTAINS(e.msg, "nesting deeper than");
}

MT_TEST(limits) {
  mr_err e;
  gc_tmpl_limits lim = {.max_output = 1000};
  MT_EQ_INT(render_lim("{% for i in range(2000) %}x{% endfor %}", NULL, &lim, &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "output limit of 1000 bytes");
  MT_CONTAINS(e.msg, "chat_template:1:");
  lim = (gc_tmpl_limits){.max_memory = 1 << 20};
  MT_EQ_INT(render_lim("{% set s = 'x' * 2000000 %}", NULL, &lim, &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "memory limit");
  lim = (gc_tmpl_limits){.max_memory = 4 << 20};
  MT_EQ_INT(render_lim("{% set ns = namespace(s='x') %}{% for i in range(100) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                       NULL, &lim, &e),
            MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "memory limit");
  lim = (gc_tmpl_limits){.max_steps = 5000};
  MT_EQ_INT(render_lim("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}", NULL,
                       &lim, &e),
            MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "step limit of 5000");
  /* a hostile default: 10^10 iterations stop at the default step limit */
  MT_EQ_INT(render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL,
                   &e),
            MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "step limit");
  MT_EQ_INT(render("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", NULL, &e), MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "macro calls nested deeper than the limit of 64");
  /* values nested deeper than repr / tojson go */
  MT_EQ_INT(render("{% set ns = namespace(v=[]) %}{% for i in range(300) %}{% set ns.v = [ns.v] %}"
                   "{% endfor %}{{ ns.v|tojson }}",
                   NULL, &e),
            MR_EEXHAUSTED);
  MT_CONTAINS(e.msg, "nested deeper than 256");
  MT_EQ_INT(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", NULL, &e), 0);
  MT_EQ_STR(got, "<Namespace {'me': <Namespace {...}>}>");
}

MT_TEST(variables_json) {
  EXPECT("{{ a }} {{ b }} {{ c }} {{ d }} {{ e }} {{ f }} {{ g }}",
         "{\"a\": 1, \"b\": 1.0, \"c\": 1e2, \"d\": -0.0, \"e\": NaN, \"f\": -Infinity, \"g\": 12345678901234}",
         "1 1.0 100.0 -0.0 nan -inf 12345678901234");
  EXPECT("{{ x }}|{{ x|tojson }}", "{\"x\": {\"k\": 1, \"j\": 2, \"k\": 3}}",
         "{'k': 3, 'j': 2}|{\"k\": 3, \"j\": 2}");
  EXPECT("{{ s|length }}{{ s|tojson }}", "{\"s\": \"\\ud83d\\ude00\\u00e9\\n\"}", "3\"\xf0\x9f\x98\x80\xc3\xa9\\n\"");
  mr_err e;
  MT_EQ_INT(render("x", "{\"a\": 123456789012345678901}", &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "beyond 64 bits");
  MT_EQ_INT(render("x", "{\"a\": [1, }", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "at byte");
  MT_EQ_INT(render("x", "[1]", &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "a JSON object expected");
  MT_EQ_INT(render("x", "{\"a\": \"\x01\"}", &e), MR_EFORMAT);
  MT_EQ_INT(render("x", "{\"a\": 1} x", &e), MR_EFORMAT);
  MT_EQ_INT(render("x", "{\"a\": \"\xff\"}", &e), MR_EFORMAT);
}

MT_TEST(variables_cjson) {
  gc_tmpl *t;
  mr_err e;
  const char *src = "{{ n }} {{ f }} {{ r }} {{ s }} {{ l }} {{ m.k }}";
  MT_OK(gc_tmpl_compile(&t, src, strlen(src), NULL, &e), &e);
  cJSON *v = cJSON_CreateObject();
  cJSON_AddNumberToObject(v, "n", 3);
  cJSON_AddNumberToObject(v, "f", 2.5);
  cJSON_AddRawToObject(v, "r", "1.0"); /* a float that stays a float */
  cJSON_AddStringToObject(v, "s", "x");
  cJSON *l = cJSON_AddArrayToObject(v, "l");
  cJSON_AddItemToArray(l, cJSON_CreateNull());
  cJSON_AddItemToArray(l, cJSON_CreateTrue());
  cJSON *m = cJSON_AddObjectToObject(v, "m");
  cJSON_AddStringToObject(m, "k", "v");
  char *out;
  size_t len;
  MT_OK(gc_tmpl_render(t, v, NULL, &out, &len, &e), &e);
  MT_EQ_STR(out, "3 2.5 1.0 x [None, True] v");
  mr_free(out);
  cJSON_Delete(v);
  gc_tmpl_free(t);
  MT_OK(gc_tmpl_compile(&t, "[{{ n }}]", 9, NULL, &e), &e);
  MT_OK(gc_tmpl_render(t, NULL, NULL, &out, NULL, &e), &e); /* no variables */
  MT_EQ_STR(out, "[]");
  mr_free(out);
  gc_tmpl_free(t);
  gc_tmpl_free(NULL);
}

static char tmpdir[64];
static void rm_tmpdir(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
  if (system(cmd)) {
  }
}

static void write_file(const char *dir, const char *name, const char *text) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fputs(text, f);
  fclose(f);
}

static const char *render_dir(const char *dir, const char *name, mr_err *e, int *rc) {
  gc_tmpl *t;
  *rc = gc_tmpl_load_dir(&t, dir, name, e);
  if (*rc) return NULL;
  char *out;
  *rc = gc_tmpl_render_json(t, "{}", 2, NULL, &out, NULL, e);
  gc_tmpl_free(t);
  if (*rc) return NULL;
  snprintf(got, sizeof got, "%s", out);
  mr_free(out);
  return got;
}

MT_TEST(load_dir) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/test_chat_template.XXXXXX");
  MT_TRUE(mkdtemp(tmpdir) != NULL);
  mt_defer(rm_tmpdir);
  mr_err e;
  int rc;
  MT_TRUE(render_dir(tmpdir, NULL, &e, &rc) == NULL);
  MT_EQ_INT(rc, MR_ENOTFOUND);
  write_file(tmpdir, "tokenizer_config.json",
             "{\"chat_template\": [{\"name\": \"default\", \"template\": \"D{{ 1 }}\"},"
             " {\"name\": \"tool_use\", \"template\": \"T\"}], \"eos_token\": \"</s>\"}");
  MT_TRUE(render_dir(tmpdir, NULL, &e, &rc) != NULL);
  MT_EQ_STR(got, "D1");
  MT_TRUE(render_dir(tmpdir, "tool_use", &e, &rc) != NULL);
  MT_EQ_STR(got, "T");
  MT_TRUE(render_dir(tmpdir, "rag", &e, &rc) == NULL);
  MT_EQ_INT(rc, MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "no chat template named \"rag\"");
  write_file(tmpdir, "chat_template.jinja", "J{{ 2 }}\n");
  MT_TRUE(render_dir(tmpdir, "default", &e, &rc) != NULL);
  MT_EQ_STR(got, "J2");
  write_file(tmpdir, "tokenizer_config.json", "{\"chat_template\": \"S{% include 'x' %}\"}");
  rmdir(tmpdir); /* (fails: not empty) */
  char p[256];
  snprintf(p, sizeof p, "%s/chat_template.jinja", tmpdir);
  unlink(p);
  MT_TRUE(render_dir(tmpdir, NULL, &e, &rc) == NULL);
  MT_EQ_INT(rc, MR_ENOTSUP);
  MT_CONTAINS(e.msg, "tokenizer_config.json:chat_template:1:5: \"include\"");
  MT_TRUE(render_dir(tmpdir, "../x", &e, &rc) == NULL);
  MT_EQ_INT(rc, MR_EINVAL);
}

/* A template in the Qwen3 style, whole: tools, a tool call with object arguments, the tool
 * result, and the generation prompt without thinking (checked against transformers). */
MT_TEST(qwen3_style_conversation) {
  const char *src =
      "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
      "{{- '<|im_end|>\\n' }}{%- endif %}\n"
      "{%- for message in messages %}\n"
      "    {%- if message.role == 'assistant' and message.tool_calls %}\n"
      "        {{- '<|im_start|>assistant' }}\n"
      "        {%- for tc in message.tool_calls %}\n"
      "            {%- set tc = tc.function if tc.function else tc %}\n"
      "            {{- '\\n<tool_call>\\n{\"name\": \"' + tc.name + '\", \"arguments\": ' }}\n"
      "            {{- tc.arguments if tc.arguments is string else tc.arguments | tojson }}\n"
      "            {{- '}\\n</tool_call>' }}\n"
      "        {%- endfor %}\n"
      "        {{- '<|im_end|>\\n' }}\n"
      "    {%- else %}\n"
      "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
      "    {%- endif %}\n"
      "{%- endfor %}\n"
      "{%- if add_generation_prompt %}\n"
      "    {{- '<|im_start|>assistant\\n' }}\n"
      "    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
      "{%- endif %}\n";
  const char *vars =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"},"
      " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"type\": \"function\","
      "  \"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}}]},"
      " {\"role\": \"tool\", \"content\": \"21.5\"}],"
      " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}],"
      " \"documents\": null, \"add_generation_prompt\": true, \"enable_thinking\": false}";
  EXPECT(src, vars,
         "<|im_start|>system\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}<|im_end|>\n"
         "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
         "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
         "\"days\": 2}}\n</tool_call><|im_end|>\n"
         "<|im_start|>tool\n21.5<|im_end|>\n"
         "<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

/* Any number of threads may render one compiled template at once. */
static gc_tmpl *shared_t;
static void *render_thread(void *arg) {
  (void)arg;
  for (int k = 0; k < 200; k++) {
    char *out;
    mr_err e;
    const char *vars = "{\"messages\": [\"a\", \"b\", \"c\"]}";
    if (gc_tmpl_render_json(shared_t, vars, strlen(vars), NULL, &out, NULL, &e) != 0) return (void *)1;
    int bad = strcmp(out, "0a,1b,2c|['a', 'b', 'c']") != 0;
    mr_free(out);
    if (bad) return (void *)1;
  }
  return NULL;
}

MT_TEST(threads_share_a_template) {
  const char *src = "{% set g = messages|select %}{% for m in g %}{{ loop.index0 }}{{ m }}{% if not loop.last %},"
                    "{% endif %}{% endfor %}|{{ messages|list }}";
  mr_err e;
  MT_OK(gc_tmpl_compile(&shared_t, src, strlen(src), NULL, &e), &e);
  pthread_t th[4];
  for (int i = 0; i < 4; i++) MT_EQ_INT(pthread_create(&th[i], NULL, render_thread, NULL), 0);
  for (int i = 0; i < 4; i++) {
    void *r;
    pthread_join(th[i], &r);
    MT_TRUE(r == NULL);
  }
  gc_tmpl_free(shared_t);
}

/* Every allocation of a compile and a render may fail: a clean MR_ENOMEM (or
 * MR_EEXHAUSTED), never a crash or a leak (the sanitizer build checks the leak). */
MT_TEST(allocation_failures) {
  const char *src = "{% macro m(x) %}[{{ x|tojson }}]{% endmacro %}{% set ns = namespace(a=[]) %}"
                    "{% for k, v in d|items %}{{ m(v) }}{% set ns.a = ns.a + [k|upper] %}{% endfor %}"
                    "{{ ns.a|join(',') }}{{ 'x y'.split() }}";
  const char *vars = "{\"d\": {\"a\": [1, 2.5], \"b\": {\"c\": \"\xc3\xa9\"}}}";
  int ok = 0, failed = 0;
  for (long n = 1; n < 400; n++) {
    gc_tmpl *t = NULL;
    mr_err e;
    char *out = NULL;
    mr_alloc_fail_after(n);
    int rc = gc_tmpl_compile(&t, src, strlen(src), NULL, &e);
    if (rc == 0) rc = gc_tmpl_render_json(t, vars, strlen(vars), NULL, &out, NULL, &e);
    mr_alloc_fail_after(0);
    if (rc == 0) {
      MT_EQ_STR(out, "[[1, 2.5]][{\"c\": \"\xc3\xa9\"}]A,B['x', 'y']");
      ok++;
    } else {
      if (rc != MR_ENOMEM && rc != MR_EEXHAUSTED) MT__FAIL("n=%ld: rc %d (%s)", n, rc, e.msg);
      failed++;
    }
    mr_free(out);
    gc_tmpl_free(t);
  }
  MT_TRUE(failed > 10);
  MT_TRUE(ok > 0);
}

MT_MAIN()
