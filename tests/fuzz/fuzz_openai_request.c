/*
 * fuzz_openai_request.c - libFuzzer target for serve's request parser (gc_oai_parse, the
 * body of POST /v1/chat/completions and /v1/completions). The first byte picks the
 * endpoint (odd: chat, even: completions: the seeds start with 'c' or 'p'), the rest is
 * the body. On success the request must satisfy what gc_serve.c relies on; every error
 * must carry a message and a param. The UTF-8 repair used on the way into JSON strings is
 * checked too: its output repaired again is unchanged (it is valid UTF-8).
 */
#include "gpu_client/runner/serve.h"
#include "tests/fuzz/fuzz.h"

#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_utf8(const char *s, size_t n) {
  char *a = NULL, *b = NULL;
  size_t al = 0, ac = 0, bl = 0, bc = 0;
  if (!gc_oai_utf8_append(&a, &al, &ac, s, n)) abort();
  if (!gc_oai_utf8_append(&b, &bl, &bc, a, al)) abort();
  if (al != bl || memcmp(a, b, al) != 0 || al < n) abort();
  mr_free(a);
  mr_free(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const gc_oai_kind kind = (data[0] & 1) ? GC_OAI_CHAT : GC_OAI_COMPLETION;
  const char *body = (const char *)data + 1;
  const size_t len = size - 1;
  check_utf8(body, len < 4096 ? len : 4096);
  gc_oai_req r;
  const char *param = NULL;
  mr_err e;
  mr_err_clear(&e);
  int rc = gc_oai_parse(kind, body, len, &r, &param, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc > 0 || e.msg[0] == '\0' || !param || r.root || r.prompt_ids) abort();
    return 0;
  }
  if (!cJSON_IsObject(r.root)) abort();
  if (kind == GC_OAI_CHAT) {
    if (!cJSON_IsArray(r.messages) || cJSON_GetArraySize(r.messages) < 1 || r.prompt || r.n_prompt_ids) abort();
    if (r.tools && !cJSON_IsArray(r.tools)) abort();
    if (r.template_kwargs && !cJSON_IsObject(r.template_kwargs)) abort();
    if (r.top_logprobs > GC_OAI_MAX_TOP_LOGPROBS || (r.top_logprobs && !r.logprobs)) abort();
  } else {
    if (r.messages) abort();
    if (!r.n_prompt_ids && (!r.prompt || r.prompt_len == 0 || strlen(r.prompt) != r.prompt_len)) abort();
    if (r.n_prompt_ids && (!r.prompt_ids || r.n_prompt_ids > GC_OAI_MAX_PROMPT_IDS)) abort();
    for (uint32_t i = 0; i < r.n_prompt_ids; i++)
      if (r.prompt_ids[i] < 0) abort();
    if (r.top_logprobs > GC_OAI_MAX_LOGPROBS) abort();
  }
  if (r.has_max_tokens && (r.max_tokens < 1 || r.max_tokens > GC_OAI_MAX_PROMPT_IDS)) abort();
  if (!(r.temperature >= 0 && r.temperature <= 2)) abort();
  if (!(r.top_p > 0 && r.top_p <= 1)) abort();
  if (r.top_k > (1u << 24)) abort();
  if (r.n_stops > GC_TEXT_MAX_STOPS) abort();
  for (uint32_t i = 0; i < r.n_stops; i++) {
    size_t n = strlen(r.stops[i]);
    if (n < 1 || n > GC_TEXT_MAX_STOP_BYTES) abort();
  }
  if (r.include_usage && !r.stream) abort();
  gc_oai_req_close(&r);
  return 0;
}
