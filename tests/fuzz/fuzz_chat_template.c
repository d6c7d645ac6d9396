/*
 * fuzz_chat_template.c - libFuzzer target for the chat-template interpreter: the input is
 * template text, compiled and rendered against one fixed conversation (a system prompt,
 * turns with a tool call and its result, content parts, tools, floats, unicode), under
 * small limits so that every input ends quickly. Accepted = compiled and rendered.
 *
 * Checks besides the sanitizers: a failure has a negative code and a message; a success
 * has a NUL-terminated output of the length reported, within the output limit; a second
 * render of the same template gives the same text (renders share nothing).
 */
#include <stdlib.h>
#include <string.h>

#include "common/mr.h"
#include "gpu_client/runner/chat_template.h"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool contains(const uint8_t *p, size_t n, const char *s) {
  size_t k = strlen(s);
  for (size_t i = 0; i + k <= n; i++)
    if (memcmp(p + i, s, k) == 0) return true;
  return false;
}

static const char vars[] =
    "{\"messages\": ["
    "{\"role\": \"system\", \"content\": \"You are terse. \xce\xa3\xce\xb1\xcf\x82\"},"
    "{\"role\": \"user\", \"content\": \"Weather in Paris? \xf0\x9f\x98\x80 {{ not a tag }}\"},"
    "{\"role\": \"assistant\", \"content\": \"<think>\\nhm\\n</think>\\n\\n\", \"reasoning_content\": \"hm\","
    " \"tool_calls\": [{\"id\": \"call00001\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\","
    " \"arguments\": {\"city\": \"Paris\", \"days\": 2, \"x\": [1.5, null, true]}}}]},"
    "{\"role\": \"tool\", \"tool_call_id\": \"call00001\", \"content\": \"21.5\"},"
    "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"and \"}, {\"type\": \"image\"}]},"
    "{\"role\": \"assistant\", \"content\": \"\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"d\","
    " \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"},"
    " \"limit\": {\"type\": \"number\", \"default\": 1.0}}}}}],"
    " \"documents\": null, \"add_generation_prompt\": true, \"enable_thinking\": false,"
    " \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  gc_tmpl_limits lim = {.max_output = 1 << 20, .max_memory = 32 << 20, .max_steps = 20000,
                        .max_depth = 16};
  gc_tmpl *t = NULL;
  mr_err e;
  int rc = gc_tmpl_compile(&t, (const char *)data, size, "fuzz", &e);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0' || t) abort();
    fuzz_verdict_set(false);
    return 0;
  }
  char *out = NULL, *again = NULL;
  size_t len = 0, len2 = 0;
  rc = gc_tmpl_render_json(t, vars, sizeof vars - 1, &lim, &out, &len, &e);
  if (rc != 0) {
    if (rc > 0 || e.msg[0] == '\0' || out) abort();
  } else {
    if (!out || out[len] != '\0' || len > lim.max_output) abort();
    /* strftime_now is the only source of difference between two renders */
    if (!contains(data, size, "strftime")) {
      if (gc_tmpl_render_json(t, vars, sizeof vars - 1, &lim, &again, &len2, &e) != 0) abort();
      if (len2 != len || memcmp(out, again, len) != 0) abort();
    }
  }
  fuzz_verdict_set(rc == 0);
  mr_free(out);
  mr_free(again);
  gc_tmpl_free(t);
  return 0;
}
