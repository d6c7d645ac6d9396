/*
 * test_gc_oai.c - serve's OpenAI request parser (gc_oai.c): the values it takes (OpenAI's
 * defaults, max_completion_tokens over max_tokens, a negative seed, vLLM's top_k -1,
 * top_p 0, one stop string, a prompt as a batch of one), the errors a client meets (each
 * names the field in the message and in param), and the UTF-8 repair of text going into
 * JSON strings (Python's errors="replace": one U+FFFD per bad byte, what is valid kept).
 * The fuzz target (tests/fuzz/fuzz_openai_request.c) covers the rest of the input space.
 */
#include "gpu_client/runner/serve.h"
#include "tests/unit/mt.h"

#include <string.h>

#include <cjson/cJSON.h>

static int parse(gc_oai_kind k, const char *body, gc_oai_req *r, const char **param, mr_err *e) {
  mr_err_clear(e);
  return gc_oai_parse(k, body, strlen(body), r, param, e);
}

MT_TEST(chat_defaults_and_values) {
  gc_oai_req r;
  const char *param;
  mr_err e;
  MT_OK(parse(GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r, &param, &e), &e);
  MT_TRUE(r.model == NULL);
  MT_FALSE(r.has_max_tokens);
  MT_FALSE(r.has_temperature);
  MT_NEAR(r.temperature, 1.0, 0);
  MT_NEAR(r.top_p, 1.0, 0);
  MT_EQ_INT(r.top_k, 0);
  MT_FALSE(r.stream);
  MT_EQ_INT(r.n_stops, 0);
  MT_EQ_INT(cJSON_GetArraySize(r.messages), 1);
  gc_oai_req_close(&r);
  MT_OK(parse(GC_OAI_CHAT,
              "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":9,"
              "\"max_completion_tokens\":7,\"seed\":-1,\"top_k\":-1,\"top_p\":0,\"stop\":\"END\",\"stream\":true,"
              "\"stream_options\":{\"include_usage\":true},\"logprobs\":true,\"top_logprobs\":20,"
              "\"unknown_field\":{\"deep\":[1,2]},\"ignore_eos\":true}",
              &r, &param, &e), &e);
  MT_EQ_STR(r.model, "m");
  MT_TRUE(r.has_max_tokens);
  MT_EQ_INT(r.max_tokens, 7);
  MT_TRUE(r.has_seed);
  MT_EQ_U64(r.seed, UINT64_MAX);
  MT_TRUE(r.has_top_k);
  MT_EQ_INT(r.top_k, 0);
  MT_TRUE(r.top_p > 0 && r.top_p < 1e-6);
  MT_EQ_INT(r.n_stops, 1);
  MT_EQ_STR(r.stops[0], "END");
  MT_TRUE(r.stream && r.include_usage && r.logprobs && r.ignore_eos);
  MT_EQ_INT(r.top_logprobs, 20);
  gc_oai_req_close(&r);
}

MT_TEST(completion_prompts) {
  gc_oai_req r;
  const char *param;
  mr_err e;
  MT_OK(parse(GC_OAI_COMPLETION, "{\"prompt\":\"Once\",\"logprobs\":3}", &r, &param, &e), &e);
  MT_EQ_STR(r.prompt, "Once");
  MT_EQ_INT(r.prompt_len, 4);
  MT_TRUE(r.logprobs);
  MT_EQ_INT(r.top_logprobs, 3);
  gc_oai_req_close(&r);
  MT_OK(parse(GC_OAI_COMPLETION, "{\"prompt\":[[5,6,7]]}", &r, &param, &e), &e);
  MT_EQ_INT(r.n_prompt_ids, 3);
  MT_EQ_INT(r.prompt_ids[2], 7);
  gc_oai_req_close(&r);
  MT_OK(parse(GC_OAI_COMPLETION, "{\"prompt\":[\"only\"],\"logprobs\":0}", &r, &param, &e), &e);
  MT_EQ_STR(r.prompt, "only");
  MT_TRUE(r.logprobs); /* logprobs 0: the chosen token's logprob, no alternatives */
  MT_EQ_INT(r.top_logprobs, 0);
  gc_oai_req_close(&r);
}

/* Each refusal: the code, the param and a message naming the field. */
MT_TEST(refusals_name_the_field) {
  static const struct {
    gc_oai_kind k;
    const char *body, *param, *msg;
    int code;
  } cases[] = {
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":\"hot\"}", "temperature",
       "temperature = \"hot\", must be a number", MR_EINVAL},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":2.5}", "temperature",
       "must be in 0..2", MR_ERANGE},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":-1}", "max_tokens",
       "max_tokens = -1, must be in 1..", MR_ERANGE},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":3}", "n", "n = 3", MR_ERANGE},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":21,\"logprobs\":true}",
       "top_logprobs", "must be in 0..20", MR_ERANGE},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":7,\"content\":\"x\"}]}", "messages", "messages[0].role", MR_EINVAL},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":1}", "stream",
       "must be true or false", MR_EINVAL},
      {GC_OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"model\":5}", "model", "model: must be a string",
       MR_EINVAL},
      {GC_OAI_CHAT, "{}", "messages", "messages: required", MR_EINVAL},
      {GC_OAI_COMPLETION, "{\"prompt\":\"x\",\"stop\":[\"a\",null]}", "stop", "stop[1]", MR_EINVAL},
      {GC_OAI_COMPLETION, "{\"prompt\":[1,2.5]}", "prompt", "prompt[1]", MR_EINVAL},
      {GC_OAI_COMPLETION, "{\"prompt\":\"x\",\"logprobs\":true}", "logprobs", "logprobs = true, must be an integer",
       MR_EINVAL},
      {GC_OAI_COMPLETION, "{\"prompt\":", "", "invalid JSON", MR_EFORMAT},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    gc_oai_req r;
    const char *param = NULL;
    mr_err e;
    int rc = parse(cases[i].k, cases[i].body, &r, &param, &e);
    MT_EQ_INT(rc, cases[i].code);
    MT_EQ_STR(param, cases[i].param);
    MT_CONTAINS(e.msg, cases[i].msg);
    MT_TRUE(r.root == NULL && r.prompt_ids == NULL);
  }
}

MT_TEST(utf8_repair_as_python_replace) {
  static const struct {
    const char *in, *out;
  } cases[] = {
      {"plain", "plain"},
      {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
      {"a\xff" "b", "a\xef\xbf\xbd" "b"},
      {"\xc3", "\xef\xbf\xbd"},                         /* cut short */
      {"\xe2\x82", "\xef\xbf\xbd"},                 /* a cut sequence: one */
      {"\xe2\x82x", "\xef\xbf\xbdx"},
      {"\xf0\x9f\x98", "\xef\xbf\xbd"},
      {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},         /* overlong */
      {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* a surrogate */
      {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* over U+10FFFF */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *out = NULL;
    size_t len = 0, cap = 0;
    MT_TRUE(gc_oai_utf8_append(&out, &len, &cap, cases[i].in, strlen(cases[i].in)));
    MT_EQ_STR(out, cases[i].out);
    MT_EQ_INT(len, strlen(cases[i].out));
    mr_free(out);
  }
}

MT_MAIN()
