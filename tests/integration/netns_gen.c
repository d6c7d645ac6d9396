/*
 * netns_gen - a long-lived client for the multi-host tests (tests/integration/netns_*.sh):
 * one model runner (one cluster handle, its streams kept across generations) that runs
 * greedy generations back to back for --seconds and reports each one, so a test can kill
 * or restart a server in its namespace while it runs and see what the client saw.
 *
 *   netns_gen --model DIR --cluster FILE --seconds S [--prompt-ids 1,2,3] [--max-new N]
 *             [--deadline-ms N]
 *
 * Prints one line per generation:
 *   gen 12 t=3456 ok 41 ms same            (tokens equal to the first generation's)
 *   gen 13 t=3501 FAIL MR_EUNAVAIL: layer 0 request 9: server s1 (...): stream ended ...
 * and at the end
 *   netns_gen: 80 generations, 74 ok, 6 failed, 0 mismatched; failures t=1200..2900 ms;
 *              tokens 5,17,...
 * Everything on the reference kernels with an fp32 wire, so two generations that succeed
 * give the same tokens whichever servers computed them. Exit 0 once the run is over
 * (whatever failed: the test judges), 1 if the model or cluster cannot be opened, 2 on a
 * usage error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_client/runner/model.h"

#define NG_MAX_PROMPT 64
#define NG_MAX_NEW 512

int main(int argc, char **argv) {
  const char *model = NULL, *cluster = NULL, *prompt_s = "3,14,15,92,65,35";
  double seconds = 0;
  unsigned max_new = 16, deadline_ms = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--model")) model = argv[i + 1];
    else if (!strcmp(argv[i], "--cluster")) cluster = argv[i + 1];
    else if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--prompt-ids")) prompt_s = argv[i + 1];
    else if (!strcmp(argv[i], "--max-new")) max_new = (unsigned)atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--deadline-ms")) deadline_ms = (unsigned)atoi(argv[i + 1]);
    else {
      fprintf(stderr, "netns_gen: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (!model || !cluster || seconds <= 0 || max_new < 1 || max_new > NG_MAX_NEW) {
    fprintf(stderr, "usage: netns_gen --model DIR --cluster FILE --seconds S [--prompt-ids "
                    "LIST] [--max-new 1..%d] [--deadline-ms N]\n", NG_MAX_NEW);
    return 2;
  }
  int32_t prompt[NG_MAX_PROMPT];
  uint32_t len = 0;
  for (const char *p = prompt_s; *p && len < NG_MAX_PROMPT;) {
    prompt[len++] = (int32_t)strtol(p, (char **)&p, 10);
    if (*p == ',') p++;
    else if (*p) {
      fprintf(stderr, "netns_gen: --prompt-ids '%s': expected ids separated by ','\n", prompt_s);
      return 2;
    }
  }

  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = model;
  o.cluster_path = cluster;
  o.max_seq = len + max_new;
  o.engine.isa = KN_ISA_REF;
  o.engine.threads = 1;
  o.wire = MR_DTYPE_F32;
  o.deadline_ms = deadline_ms;
  o.quiet = true;
  gc_model *m = NULL;
  mr_err e = {0};
  if (gc_model_open(&m, &o, &e)) {
    fprintf(stderr, "netns_gen: open: %s (%s)\n", e.msg, mr_err_name(e.code));
    return 1;
  }
  printf("netns_gen: open, %u-token prompt, %u new tokens per generation, %.1f s\n", len,
         max_new, seconds);
  fflush(stdout);

  static int32_t first[NG_MAX_NEW], out[NG_MAX_NEW];
  bool have_first = false;
  unsigned n = 0, ok = 0, failed = 0, mismatched = 0;
  double fail_t0 = -1, fail_t1 = -1;
  char first_err[600] = "";
  const int32_t *prompts[1] = {prompt};
  const uint32_t lens[1] = {len};
  gc_sampling g = {.temperature = 0, .top_p = 1};
  uint64_t t0 = mr_now_ns();
  for (;;) {
    double t = (double)(mr_now_ns() - t0) / 1e6;
    if (t >= seconds * 1000) break;
    uint64_t g0 = mr_now_ns();
    mr_err ge = {0};
    int rc = gc_model_generate(m, 1, prompts, lens, max_new, &g, out, NULL, &ge);
    double ms = (double)(mr_now_ns() - g0) / 1e6;
    n++;
    if (rc) {
      failed++;
      if (fail_t0 < 0) fail_t0 = t;
      fail_t1 = t;
      if (!first_err[0]) snprintf(first_err, sizeof first_err, "%s: %s", mr_err_name(rc), ge.msg);
      printf("gen %u t=%.0f FAIL %.0f ms %s: %s\n", n, t, ms, mr_err_name(rc), ge.msg);
      usleep(20 * 1000); /* a server that is away fails fast: do not spin on it */
    } else {
      ok++;
      bool same = true;
      if (!have_first) {
        memcpy(first, out, max_new * sizeof *out);
        have_first = true;
      } else {
        same = !memcmp(first, out, max_new * sizeof *out);
        mismatched += !same;
      }
      printf("gen %u t=%.0f ok %.0f ms %s\n", n, t, ms, same ? "same" : "DIFFERENT");
    }
    fflush(stdout);
  }
  printf("netns_gen: %u generations, %u ok, %u failed, %u mismatched; failures t=%.0f..%.0f ms;"
         " first error: %s\n", n, ok, failed, mismatched, fail_t0, fail_t1,
         first_err[0] ? first_err : "none");
  printf("netns_gen: tokens");
  for (unsigned i = 0; have_first && i < max_new; i++) printf("%s%d", i ? "," : " ", first[i]);
  printf("\n");
  gc_model_close(m);
  return 0;
}
