/*
 * itest_deepseek.c - the runner on DeepSeek-V3-layout checkpoints (MLA with a latent KV
 * cache, yarn RoPE, grouped sigmoid routing with e_score_correction_bias, a shared expert,
 * a dense leading layer; moerpc-mkmodel --arch deepseek-v3) against real expert servers on
 * loopback:
 *
 *   distributed == all-local: two servers (fp32 wire, reference kernels everywhere) vs all
 *   experts local within 1e-5, greedy generation identical, the same with hot experts;
 *   FP8 (--dtype fp8: every decoder linear F8_E4M3 with 128x128 block scales): servers
 *   holding fp8-b128 experts vs the client holding them itself, within 1e-5, greedy
 *   identical; the decode through the latent cache equals the prefill;
 *   bad checkpoints are refused naming the tensor and the limit: a missing
 *   e_score_correction_bias, a block scale of the wrong shape, a kv_b_proj of the wrong
 *   shape, a group count that does not divide the experts.
 * The runner against transformers is tests/conformance/test_deepseek_logits.py.
 */
#include <grpc/grpc.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu_client/runner/model.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define SHAPE                                                                               \
  "--arch deepseek-v3 --layers 3 --experts 8 --topk 2 --hidden 64 --inter 32 --vocab 96 " \
  "--heads 4 --groups 4 --topk-groups 2 --dense-layers 1 --shared-experts 1 --yarn 4"
#define V 96u
#define T_PROMPT 10u
#define N_GEN 24u

static char *tmp;
static const int32_t prompt[T_PROMPT] = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38};

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fputs(text, f);
  MT_EQ_INT(fclose(f), 0);
}

static void write_cluster(const char *path, const itu_server *a, const itu_server *b) {
  char text[1024];
  snprintf(text, sizeof text,
           "{\"deadline_ms\": 10000, \"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}, "
           "{\"name\": \"s1\", \"address\": \"%s\"}]}",
           a->address, b->address);
  write_file(path, text);
}

static int open_runner(gc_model **m, const char *dir, const char *cl, int32_t local,
                       mr_err *e) {
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = dir;
  o.cluster_path = cl;
  o.local_experts = local;
  o.max_seq = 64;
  o.engine.isa = KN_ISA_REF;
  o.engine.threads = 2;
  o.wire = MR_DTYPE_F32;
  o.quiet = true;
  return gc_model_open(m, &o, e);
}

static void prefill_logits(gc_model *m, float *out) {
  uint32_t seq[T_PROMPT] = {0}, pos[T_PROMPT];
  for (uint32_t i = 0; i < T_PROMPT; i++) pos[i] = i;
  gc_model_seq_reset(m, 0);
  gc_step s = {.n_tokens = T_PROMPT, .ids = prompt, .seq = seq, .pos = pos, .logits = out};
  mr_err e = {0};
  MT_OK(gc_model_step(m, &s, &e), &e);
}

static void greedy(gc_model *m, int32_t *out, uint32_t n) {
  const int32_t *p[1] = {prompt};
  const uint32_t len[1] = {T_PROMPT};
  gc_sampling g = {0};
  mr_err e = {0};
  MT_OK(gc_model_generate(m, 1, p, len, n, &g, out, NULL, &e), &e);
}

/* All-local vs two servers splitting the experts (and with 3 hot experts per layer). */
static void check_distributed(const char *dir, const char *server_extra) {
  static float local[T_PROMPT * V], two[T_PROMPT * V], hot[T_PROMPT * V];
  int32_t g_local[N_GEN], g_two[N_GEN], g_hot[N_GEN];
  mr_err e = {0};
  gc_model *m = NULL;
  MT_OK(open_runner(&m, dir, NULL, -1, &e), &e);
  prefill_logits(m, local);
  greedy(m, g_local, N_GEN);
  gc_model_close(m);

  itu_server s0, s1;
  char extra0[256], extra1[256], cluster[700];
  snprintf(extra0, sizeof extra0, "--experts 0-3 %s", server_extra);
  snprintf(extra1, sizeof extra1, "--experts 4-7 %s", server_extra);
  itu_server_isa("ref");
  MT_EQ_INT(itu_server_start(&s0, dir, extra0, tmp, 60000), 0);
  MT_EQ_INT(itu_server_start(&s1, dir, extra1, tmp, 60000), 0);
  snprintf(cluster, sizeof cluster, "%s/cluster.json", tmp);
  write_cluster(cluster, &s0, &s1);

  MT_OK(open_runner(&m, dir, cluster, -1, &e), &e);
  prefill_logits(m, two);
  greedy(m, g_two, N_GEN);
  gc_model_close(m);
  MT_OK(open_runner(&m, dir, cluster, 3, &e), &e);
  prefill_logits(m, hot);
  greedy(m, g_hot, N_GEN);
  gc_model_close(m);

  double r2 = kn_rel_l2(two, local, T_PROMPT * V), r3 = kn_rel_l2(hot, local, T_PROMPT * V);
  fprintf(stderr, "  %s: two servers vs all-local rel L2 %.2e, with 3 hot experts %.2e\n", dir,
          r2, r3);
  MT_LE(r2, 1e-5);
  MT_LE(r3, 1e-5);
  MT_TRUE(memcmp(g_two, g_local, sizeof g_local) == 0);
  MT_TRUE(memcmp(g_hot, g_local, sizeof g_local) == 0);
  int st;
  MT_EQ_INT(itu_server_stop(&s0, SIGTERM, 15000, &st), 0);
  MT_EQ_INT(itu_server_stop(&s1, SIGTERM, 15000, &st), 0);
}

MT_TEST(distributed_equals_all_local) {
  grpc_init();
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  char dir[600];
  snprintf(dir, sizeof dir, "%s/ds", tmp);
  MT_EQ_INT(itu_make_model(dir, SHAPE " --seed 31"), 0);
  check_distributed(dir, "");
  itu_rm_rf(tmp);
  grpc_shutdown();
}

MT_TEST(fp8_distributed_equals_all_local_and_decode_equals_prefill) {
  grpc_init();
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  char dir[600];
  snprintf(dir, sizeof dir, "%s/ds-fp8", tmp);
  MT_EQ_INT(itu_make_model(dir, SHAPE " --seed 32 --dtype fp8"), 0);
  /* servers keep the experts as stored: fp8-b128 */
  check_distributed(dir, "");
  /* the latent cache: one token at a time equals the prefill */
  static float full[T_PROMPT * V], one[V];
  mr_err e = {0};
  gc_model *m = NULL;
  MT_OK(open_runner(&m, dir, NULL, -1, &e), &e);
  prefill_logits(m, full);
  gc_model_seq_reset(m, 0);
  double worst = 0;
  for (uint32_t i = 0; i < T_PROMPT; i++) {
    uint32_t seq = 0, pos = i;
    gc_step s = {.n_tokens = 1, .ids = prompt + i, .seq = &seq, .pos = &pos, .logits = one};
    MT_OK(gc_model_step(m, &s, &e), &e);
    double r = kn_rel_l2(one, full + (size_t)i * V, V);
    if (r > worst) worst = r;
  }
  fprintf(stderr, "  decode through the latent cache vs prefill: worst rel L2 %.2e\n", worst);
  MT_LE(worst, 1e-5);
  gc_model_close(m);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

/* ---- bad checkpoints -------------------------------------------------------------------- */

/* Copies the checkpoint src into dst as one model.safetensors, without the tensor `drop`
 * and with the tensor `reshape` (if any) replaced by an F32 one of shape [d0, d1] of ones;
 * config.json copied with `from` replaced by `to` (if from is not NULL). */
static void rewrite(const char *src, const char *dst, const char *drop, const char *reshape,
                    uint64_t d0, uint64_t d1, const char *from, const char *to) {
  MT_EQ_INT(mkdir(dst, 0755), 0);
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, src, &e), &e);
  mr_st_writer *w = NULL;
  MT_EQ_INT(mr_st_writer_new(&w), 0);
  static float ones[4096];
  for (size_t i = 0; i < sizeof ones / sizeof ones[0]; i++) ones[i] = 1.0f;
  for (size_t i = 0; i < mr_st_count(st); i++) {
    const mr_st_tensor *t = mr_st_at(st, i);
    if (drop && strcmp(t->name, drop) == 0) continue;
    if (reshape && strcmp(t->name, reshape) == 0) {
      const uint64_t shape[2] = {d0, d1};
      MT_TRUE(d0 * d1 <= sizeof ones / sizeof ones[0]);
      MT_EQ_INT(mr_st_writer_add(w, t->name, MR_DTYPE_F32, 2, shape, ones), 0);
      continue;
    }
    int rc = mr_st_is_f8e4m3(t) ? mr_st_writer_add_f8e4m3(w, t->name, t->ndim, t->shape, t->data)
                                : mr_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape,
                                                   t->data);
    MT_EQ_INT(rc, 0);
  }
  char path[700];
  snprintf(path, sizeof path, "%s/model.safetensors", dst);
  MT_OK(mr_st_writer_write(w, path, &e), &e);
  mr_st_writer_free(w);
  mr_st_close(st);
  char cin[700], *text = NULL;
  size_t len = 0;
  snprintf(cin, sizeof cin, "%s/config.json", src);
  MT_OK(mr_file_read(cin, 1 << 20, &text, &len, &e), &e);
  char out[16384];
  const char *at = from ? strstr(text, from) : NULL;
  if (from) MT_TRUE(at != NULL);
  if (at)
    snprintf(out, sizeof out, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
  else
    snprintf(out, sizeof out, "%s", text);
  mr_free(text);
  snprintf(path, sizeof path, "%s/config.json", dst);
  write_file(path, out);
}

static void expect_refused(const char *dir, int code, const char *want1, const char *want2) {
  gc_model *m = NULL;
  mr_err e = {0};
  int rc = open_runner(&m, dir, NULL, -1, &e);
  fprintf(stderr, "  %s: %d %s\n", dir, rc, e.msg);
  MT_EQ_INT(rc, code);
  MT_TRUE(m == NULL);
  MT_CONTAINS(e.msg, want1);
  MT_CONTAINS(e.msg, want2);
}

MT_TEST(bad_checkpoints_are_refused_naming_the_tensor) {
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  char ok[600], fp8[600], bad[700];
  snprintf(ok, sizeof ok, "%s/ok", tmp);
  snprintf(fp8, sizeof fp8, "%s/fp8", tmp);
  MT_EQ_INT(itu_make_model(ok, SHAPE " --seed 33"), 0);
  MT_EQ_INT(itu_make_model(fp8, SHAPE " --seed 33 --dtype fp8"), 0);
  gc_model *m = NULL;
  mr_err e = {0};
  MT_OK(open_runner(&m, ok, NULL, -1, &e), &e); /* the originals open */
  gc_model_close(m);
  MT_OK(open_runner(&m, fp8, NULL, -1, &e), &e);
  gc_model_close(m);

  snprintf(bad, sizeof bad, "%s/no-bias", tmp);
  rewrite(ok, bad, "model.layers.2.mlp.gate.e_score_correction_bias", NULL, 0, 0, NULL, NULL);
  expect_refused(bad, MR_ENOTFOUND, "model.layers.2.mlp.gate.e_score_correction_bias is missing",
                 "shape [8]");
  /* kv_b_proj is [heads * (nope + v), kv_lora] */
  snprintf(bad, sizeof bad, "%s/kv-b-shape", tmp);
  rewrite(ok, bad, NULL, "model.layers.1.self_attn.kv_b_proj.weight", 3, 5, NULL, NULL);
  expect_refused(bad, MR_EMISMATCH, "model.layers.1.self_attn.kv_b_proj.weight", "[3, 5]");
  /* a dense linear's block scale of the wrong shape: [1, 1] expected for 64 x 64 */
  snprintf(bad, sizeof bad, "%s/scale-shape", tmp);
  rewrite(fp8, bad, NULL, "model.layers.0.self_attn.o_proj.weight_scale_inv", 2, 1, NULL, NULL);
  expect_refused(bad, MR_EMISMATCH, "model.layers.0.self_attn.o_proj.weight_scale_inv", "[2, 1]");
  /* an expert's block scale of the wrong shape */
  snprintf(bad, sizeof bad, "%s/expert-scale-shape", tmp);
  rewrite(fp8, bad, NULL, "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv", 1, 3,
          NULL, NULL);
  expect_refused(bad, MR_EMISMATCH, "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv",
                 "[1, 3]");
  /* 8 experts in 3 groups */
  snprintf(bad, sizeof bad, "%s/groups", tmp);
  rewrite(ok, bad, NULL, NULL, 0, 0, "\"n_group\": 4", "\"n_group\": 3");
  expect_refused(bad, MR_ERANGE, "n_group = 3 does not divide n_routed_experts = 8", "config");
  itu_rm_rf(tmp);
}

MT_MAIN()
