/*
 * cli_text.c - the text tools of moerpc-client, for when a model's output looks wrong:
 *
 *   tokenize       --model DIR (--text T | --file F) [--json] [--add-special-tokens]
 *                  the ids of the text; with --json one JSON array per input line
 *   detokenize     --model DIR --ids 1,2,3 [--skip-special-tokens]
 *   chat-template  --model DIR --messages FILE.json [--add-generation-prompt]
 *                  [--chat-template FILE] [--tools FILE.json] [--var KEY=JSON]...
 *                  the rendered prompt, exactly what `generate --chat` and serve feed in
 *
 * None of them loads weights: they read the tokenizer files (gc_tok), the chat template
 * (gc_chat) and nothing else. Exit status: 0 ok, 1 failure, 2 usage error.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "gpu_client/runner/cli.h"
#include "gpu_client/runner/text.h"

#define PROG "moerpc-client"
#define TXT_MAX_FILE (64u << 20)

enum { T_MODEL = 3000, T_TEXT, T_FILE, T_JSON, T_SPECIAL, T_IDS, T_SKIP, T_MSGS, T_AGP, T_TMPL, T_TOOLS, T_VAR,
       T_HELP };

static int fail(int rc, const mr_err *e) {
  fprintf(stderr, PROG ": %s: %s\n", mr_err_name(rc), e->msg);
  return 1;
}

/* Prints ids as "[1, 2, 3]" (json) or "1 2 3". */
static void print_ids(const gc_tok_ids *ids, bool json) {
  if (json) putchar('[');
  for (size_t i = 0; i < ids->n; i++) printf(json ? "%s%d" : "%s%d", i ? (json ? ", " : " ") : "", ids->v[i]);
  printf(json ? "]\n" : "\n");
}

static const char TOK_HELP[] =
    "usage: " PROG " tokenize --model DIR (--text T | --file F) [--json] [--add-special-tokens]\n"
    "Prints the token ids of the text with the model's tokenizer (tokenizer.json, or Kimi's\n"
    "tiktoken.model). Special tokens written in the text (<|im_start|>, ...) are matched as\n"
    "tokenizer.encode does; --add-special-tokens also runs the post-processor (a BOS token,\n"
    "...), as tokenizer(text) does. Without --json the whole text is one input; with --json\n"
    "each line of it is one, and one JSON array of ids is printed per line.\n";

int gc__cli_tokenize(int argc, char **argv) {
  static const struct option lo[] = {{"model", required_argument, NULL, T_MODEL}, {"text", required_argument, NULL, T_TEXT},
                                     {"file", required_argument, NULL, T_FILE},   {"json", no_argument, NULL, T_JSON},
                                     {"add-special-tokens", no_argument, NULL, T_SPECIAL},
                                     {"help", no_argument, NULL, T_HELP},         {NULL, 0, NULL, 0}};
  const char *model = NULL, *text = NULL, *file = NULL;
  bool json = false, special = false;
  optind = 1;
  opterr = 0;
  for (int opt; (opt = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
    switch (opt) {
    case T_MODEL: model = optarg; break;
    case T_TEXT: text = optarg; break;
    case T_FILE: file = optarg; break;
    case T_JSON: json = true; break;
    case T_SPECIAL: special = true; break;
    case T_HELP: fputs(TOK_HELP, stdout); return 0;
    default: fprintf(stderr, PROG " tokenize: bad or incomplete option (see --help)\n"); return 2;
    }
  }
  if (!model || (!text == !file) || optind < argc) {
    fprintf(stderr, PROG " tokenize: --model DIR and one of --text T or --file F are required (see --help)\n");
    return 2;
  }
  mr_err e;
  mr_err_clear(&e);
  gc_tok *tok = NULL;
  char *buf = NULL;
  size_t len = 0;
  int rc = gc_tok_load(&tok, model, &e);
  if (!rc && file) rc = mr_file_read(file, TXT_MAX_FILE, &buf, &len, &e);
  if (rc) {
    gc_tok_free(tok);
    return fail(rc, &e);
  }
  const char *t = file ? buf : text;
  if (!file) len = strlen(text);
  gc_tok_ids ids = {0};
  int status = 0;
  if (!json) {
    rc = gc_tok_encode(tok, t, len, special, &ids, &e);
    if (rc) status = fail(rc, &e);
    else print_ids(&ids, false);
  } else {
    for (size_t at = 0; at <= len && !status;) { /* one array per line (a trailing newline ends the last) */
      const char *nl = memchr(t + at, '\n', len - at);
      size_t n = nl ? (size_t)(nl - (t + at)) : len - at;
      if (!nl && n == 0 && at > 0) break;
      rc = gc_tok_encode(tok, t + at, n, special, &ids, &e);
      if (rc) status = fail(rc, &e);
      else print_ids(&ids, true);
      at += n + 1;
    }
  }
  mr_free(ids.v);
  mr_free(buf);
  gc_tok_free(tok);
  return status;
}

static const char DETOK_HELP[] =
    "usage: " PROG " detokenize --model DIR --ids 1,2,3 [--skip-special-tokens]\n"
    "Prints the text of the ids with the model's tokenizer (its decoder: byte-level, metaspace,\n"
    "byte fallback). Ids out of the vocabulary are refused by name.\n";

int gc__cli_detokenize(int argc, char **argv) {
  static const struct option lo[] = {{"model", required_argument, NULL, T_MODEL}, {"ids", required_argument, NULL, T_IDS},
                                     {"skip-special-tokens", no_argument, NULL, T_SKIP},
                                     {"help", no_argument, NULL, T_HELP},           {NULL, 0, NULL, 0}};
  const char *model = NULL, *list = NULL;
  bool skip = false;
  optind = 1;
  opterr = 0;
  for (int opt; (opt = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
    switch (opt) {
    case T_MODEL: model = optarg; break;
    case T_IDS: list = optarg; break;
    case T_SKIP: skip = true; break;
    case T_HELP: fputs(DETOK_HELP, stdout); return 0;
    default: fprintf(stderr, PROG " detokenize: bad or incomplete option (see --help)\n"); return 2;
    }
  }
  if (!model || !list || optind < argc) {
    fprintf(stderr, PROG " detokenize: --model DIR and --ids LIST are required (see --help)\n");
    return 2;
  }
  mr_err e;
  mr_err_clear(&e);
  gc_tok *tok = NULL;
  int rc = gc_tok_load(&tok, model, &e);
  if (rc) return fail(rc, &e);
  const uint32_t V = gc_tok_vocab_size(tok);
  size_t cap = strlen(list) / 2 + 2, n = 0;
  int32_t *ids = mr_malloc(cap * sizeof *ids);
  int status = ids ? 0 : 1;
  for (const char *p = list; status == 0 && *p;) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 0 || (uint64_t)v >= V || (*end && *end != ',')) {
      fprintf(stderr, PROG " detokenize: --ids: \"%.*s\" at item %zu, must be an id in 0..%u\n",
              (int)strcspn(p, ","), p, n, V - 1);
      status = 2;
      break;
    }
    ids[n++] = (int32_t)v;
    p = *end ? end + 1 : end;
  }
  gc_tok_text out = {0};
  if (!status) {
    rc = gc_tok_decode(tok, ids, n, skip, &out, &e);
    if (rc) status = fail(rc, &e);
    else printf("%s\n", out.s ? out.s : "");
  }
  mr_free(out.s);
  mr_free(ids);
  gc_tok_free(tok);
  return status;
}

static const char TMPL_HELP[] =
    "usage: " PROG " chat-template --model DIR --messages FILE.json [--add-generation-prompt]\n"
    "                [--chat-template FILE] [--tools FILE.json] [--var KEY=JSON]...\n"
    "Prints the prompt the model's chat template (tokenizer_config.json's chat_template, or\n"
    "chat_template.jinja; --chat-template FILE instead) renders for the messages: a JSON list\n"
    "of {\"role\", \"content\", ...}, or an object with a \"messages\" list (and optionally\n"
    "\"tools\"), as the OpenAI API takes them. --var adds a template variable, e.g.\n"
    "--var enable_thinking=false. The same text `generate --chat` and serve tokenize.\n";

int gc__cli_chat_template(int argc, char **argv) {
  static const struct option lo[] = {{"model", required_argument, NULL, T_MODEL},
                                     {"messages", required_argument, NULL, T_MSGS},
                                     {"add-generation-prompt", no_argument, NULL, T_AGP},
                                     {"chat-template", required_argument, NULL, T_TMPL},
                                     {"tools", required_argument, NULL, T_TOOLS},
                                     {"var", required_argument, NULL, T_VAR},
                                     {"help", no_argument, NULL, T_HELP},
                                     {NULL, 0, NULL, 0}};
  const char *model = NULL, *msgs = NULL, *tmpl = NULL, *tools_path = NULL;
  bool agp = false;
  cJSON *extra = cJSON_CreateObject();
  int status = 0;
  optind = 1;
  opterr = 0;
  for (int opt; status == 0 && (opt = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
    switch (opt) {
    case T_MODEL: model = optarg; break;
    case T_MSGS: msgs = optarg; break;
    case T_AGP: agp = true; break;
    case T_TMPL: tmpl = optarg; break;
    case T_TOOLS: tools_path = optarg; break;
    case T_VAR: {
      const char *eq = strchr(optarg, '=');
      cJSON *v = eq ? cJSON_Parse(eq + 1) : NULL;
      if (!eq || eq == optarg || !v) {
        fprintf(stderr, PROG " chat-template: --var \"%s\": must be KEY=JSON (e.g. enable_thinking=false)\n", optarg);
        cJSON_Delete(v);
        status = 2;
        break;
      }
      char key[128];
      snprintf(key, sizeof key, "%.*s", (int)(eq - optarg), optarg);
      cJSON_AddItemToObject(extra, key, v);
      break;
    }
    case T_HELP: fputs(TMPL_HELP, stdout); cJSON_Delete(extra); return 0;
    default: fprintf(stderr, PROG " chat-template: bad or incomplete option (see --help)\n"); status = 2;
    }
  }
  if (!status && (!model || !msgs || optind < argc)) {
    fprintf(stderr, PROG " chat-template: --model DIR and --messages FILE are required (see --help)\n");
    status = 2;
  }
  mr_err e;
  mr_err_clear(&e);
  gc_chat *chat = NULL;
  char *text = NULL, *out = NULL;
  size_t len = 0, olen = 0;
  cJSON *doc = NULL, *tools = NULL;
  int rc = 0;
  if (!status) {
    if (!(rc = mr_file_read(msgs, TXT_MAX_FILE, &text, &len, &e)) && !(doc = cJSON_ParseWithLength(text, len)))
      rc = mr_err_set(&e, MR_EFORMAT, "%s: not JSON", msgs);
    mr_free(text);
    text = NULL;
  }
  if (!status && !rc && tools_path) {
    if (!(rc = mr_file_read(tools_path, TXT_MAX_FILE, &text, &len, &e)) && !(tools = cJSON_ParseWithLength(text, len)))
      rc = mr_err_set(&e, MR_EFORMAT, "%s: not JSON", tools_path);
    mr_free(text);
  }
  if (!status && !rc) rc = gc_chat_load(&chat, model, tmpl, &e);
  if (!status && !rc) {
    const cJSON *list = cJSON_IsObject(doc) ? cJSON_GetObjectItemCaseSensitive(doc, "messages") : doc;
    const cJSON *tl = tools ? tools : cJSON_IsObject(doc) ? cJSON_GetObjectItemCaseSensitive(doc, "tools") : NULL;
    rc = gc_chat_render(chat, list, cJSON_IsArray(tl) ? tl : NULL, agp, extra, &out, &olen, &e);
  }
  if (!status && rc) status = fail(rc, &e);
  if (!status) fwrite(out, 1, olen, stdout);
  mr_free(out);
  gc_chat_free(chat);
  cJSON_Delete(doc);
  cJSON_Delete(tools);
  cJSON_Delete(extra);
  return status;
}
