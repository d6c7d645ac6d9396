/*
 * itest_tp.c - tensor parallelism in the runner (--tp G, comm.h) on the CPU backend and the
 * CPU communicator, against the same runner with one rank:
 *
 *   Qwen3-MoE (GQA, q/k norms) and DeepSeek-V3 (MLA with q_lora and with q_proj, a dense
 *   layer, a shared expert, grouped routing; and in FP8, its dense linears fp8-b128, their
 *   column slices cut at whole 128-column blocks or, below that, dequantized into f32):
 *   G = 2 and 4 ranks give the logits of G = 1
 *   within 1e-5 (the partial sums of the heads and MLP columns are added in another order)
 *   and 32 greedy tokens identical; with hot experts spread over the ranks and two real
 *   expert servers; the KV cache continues: decode after prefill equals G = 1's;
 *   a server killed mid-run fails the step naming it on every rank (no rank hangs);
 *   what cannot be split is refused naming the field: --tp 3 with 4 heads, --tp 0/17;
 *   --backend cuda without a GPU (or without libmoerpc-cuda.so) fails naming the reason;
 *   --map-weights (row slices of dense weights and the experts served in place, column
 *   slices packed) gives the packed model's logits and tokens bit for bit at G = 1, 2, 4.
 */
#include <grpc/grpc.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "gpu_client/runner/model.h"
#include "tests/integration/util.h"
#include "tests/unit/mt.h"
#include "tests/unit/st_poke.h"

#define QWEN "--layers 3 --experts 8 --topk 2 --hidden 64 --inter 32 --vocab 96 --heads 8 " \
             "--kv-heads 4 --head-dim 8"
#define DSV3 "--arch deepseek-v3 --layers 3 --experts 8 --topk 2 --hidden 64 --inter 32 "   \
             "--vocab 96 --heads 4 --groups 4 --topk-groups 2 --dense-layers 1 "            \
             "--shared-experts 1 --yarn 4"
#define V 96u
#define T_PROMPT 10u
#define N_GEN 32u

static char *tmp;
static char qwen[600], dsv3[600], dsv3_q[600], dsv3_8[600];
static const int32_t prompt[T_PROMPT] = {3, 14, 15, 92, 65, 35, 89, 79, 32, 38};

static int open_tp_map(gc_model **m, const char *dir, uint32_t tp, const char *cl, int32_t local,
                       bool map, mr_err *e) {
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = dir;
  o.cluster_path = cl;
  o.local_experts = local;
  o.max_seq = 64;
  o.engine.isa = KN_ISA_REF;
  o.engine.threads = tp; /* one per rank */
  o.wire = MR_DTYPE_F32;
  o.quiet = true;
  o.tp = tp;
  o.map_weights = map;
  return gc_model_open(m, &o, e);
}
static int open_tp(gc_model **m, const char *dir, uint32_t tp, const char *cl, int32_t local,
                   mr_err *e) {
  return open_tp_map(m, dir, tp, cl, local, false, e);
}

/* Prefill logits [T_PROMPT, V], one decode step's [V] after it, and N_GEN greedy tokens. */
static void run(gc_model *m, float *pre, float *dec, int32_t *gen) {
  uint32_t seq[T_PROMPT] = {0}, pos[T_PROMPT];
  for (uint32_t i = 0; i < T_PROMPT; i++) pos[i] = i;
  mr_err e = {0};
  gc_model_seq_reset(m, 0);
  gc_step s = {.n_tokens = T_PROMPT, .ids = prompt, .seq = seq, .pos = pos, .logits = pre};
  MT_OK(gc_model_step(m, &s, &e), &e);
  const int32_t next = 7;
  const uint32_t p1 = T_PROMPT, s1 = 0;
  gc_step d = {.n_tokens = 1, .ids = &next, .seq = &s1, .pos = &p1, .logits = dec};
  MT_OK(gc_model_step(m, &d, &e), &e);
  const int32_t *p[1] = {prompt};
  const uint32_t len[1] = {T_PROMPT};
  gc_sampling g = {0};
  MT_OK(gc_model_generate(m, 1, p, len, N_GEN, &g, gen, NULL, &e), &e);
}

static void check_tp(const char *dir, const char *cl, int32_t local) {
  static float pre1[T_PROMPT * V], dec1[V], pre[T_PROMPT * V], dec[V];
  int32_t gen1[N_GEN], gen[N_GEN];
  mr_err e = {0};
  gc_model *m = NULL;
  MT_OK(open_tp(&m, dir, 1, cl, local, &e), &e);
  run(m, pre1, dec1, gen1);
  gc_model_close(m);
  for (uint32_t tp = 2; tp <= 4; tp *= 2) {
    MT_OK(open_tp(&m, dir, tp, cl, local, &e), &e);
    run(m, pre, dec, gen);
    gc_model_close(m);
    double rp = kn_rel_l2(pre, pre1, T_PROMPT * V), rd = kn_rel_l2(dec, dec1, V);
    fprintf(stderr, "  %s%s local %d: tp %u vs 1: prefill rel L2 %.2e, decode %.2e\n",
            strrchr(dir, '/') + 1, cl ? " + 2 servers" : "", local, tp, rp, rd);
    MT_LE(rp, 1e-5);
    MT_LE(rd, 1e-5);
    MT_TRUE(memcmp(gen, gen1, sizeof gen) == 0);
  }
}

static void write_cluster(const char *path, const itu_server *a, const itu_server *b) {
  FILE *f = fopen(path, "w");
  MT_TRUE(f != NULL);
  fprintf(f, "{\"deadline_ms\": 10000, \"servers\": [{\"name\": \"s0\", \"address\": \"%s\"}, "
             "{\"name\": \"s1\", \"address\": \"%s\"}]}", a->address, b->address);
  MT_EQ_INT(fclose(f), 0);
}

/* Scales column block c of every F32 "_scale_inv" tensor of the one-file checkpoint in dir
 * by 1 + c / 2: moerpc-mkmodel draws every block to the same amax, so that a column slice
 * given another block's scales would go unnoticed; the weights stay valid, just others. */
static void vary_block_scales(const char *dir) {
  mr_st *st = NULL;
  mr_err e = {0};
  MT_OK(mr_st_open(&st, dir, &e), &e);
  char path[700];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  int changed = 0;
  for (size_t i = 0; i < mr_st_count(st); i++) {
    const mr_st_tensor *t = mr_st_at(st, i);
    if (!strstr(t->name, "_scale_inv") || t->dtype != MR_DTYPE_F32 || t->ndim != 2 || t->shape[1] < 2) continue;
    const size_t cnt = t->shape[0] * t->shape[1];
    float *v = malloc(cnt * sizeof *v);
    memcpy(v, t->data, cnt * sizeof *v);
    for (size_t j = 0; j < cnt; j++) v[j] *= 1.0f + (float)(j % t->shape[1]) / 2;
    st_poke(path, t->name, 0, v, cnt * sizeof *v);
    free(v);
    changed++;
  }
  MT_TRUE(changed > 0);
  mr_st_close(st);
}

/* Each test is a forked process of its own (mt.h): it makes the models it needs and
 * removes them at its end. */
static void setup(void) {
  grpc_init();
  tmp = itu_tmpdir();
  MT_TRUE(tmp != NULL);
  snprintf(qwen, sizeof qwen, "%s/qwen3", tmp);
  snprintf(dsv3, sizeof dsv3, "%s/dsv3", tmp);
  snprintf(dsv3_q, sizeof dsv3_q, "%s/dsv3-qproj", tmp);
  MT_EQ_INT(itu_make_model(qwen, QWEN " --seed 31"), 0);
  MT_EQ_INT(itu_make_model(dsv3, DSV3 " --seed 32"), 0);
  MT_EQ_INT(itu_make_model(dsv3_q, DSV3 " --q-lora-rank 0 --seed 33"), 0);
  /* FP8 (dense linears kept as fp8-b128): the shared experts' 256 columns (--inter) cut at
   * 128 for 2 ranks (whole blocks: codes and block scales sliced) and at 64 for 4 (a cut
   * block: f32); the dense MLP's 512 at 256 and 128; o_proj's 64 at 32 and 16 (f32) */
  snprintf(dsv3_8, sizeof dsv3_8, "%s/dsv3-fp8", tmp);
  MT_EQ_INT(itu_make_model(dsv3_8, DSV3 " --inter 256 --dtype fp8 --seed 34"), 0);
  vary_block_scales(dsv3_8);
}

static void cleanup(void) { itu_rm_rf(tmp); }

/* --map-weights with G ranks: bit-identical to the packed model with G ranks. fp8: the
 * dense linears kept in fp8-b128 at G = 1, 2, 4 (all ranks), or NULL. */
static void check_map(const char *dir, const uint64_t *fp8) {
  static float pre0[T_PROMPT * V], dec0[V], pre[T_PROMPT * V], dec[V];
  int32_t gen0[N_GEN], gen[N_GEN];
  mr_err e = {0};
  for (uint32_t tp = 1; tp <= 4; tp *= 2) {
    gc_model *m = NULL;
    MT_OK(open_tp_map(&m, dir, tp, NULL, -1, false, &e), &e);
    MT_EQ_U64(gc_model_mapped_dense_bytes(m), 0);
    MT_EQ_U64(gc_model_fp8_linears(m), fp8 ? fp8[tp / 2] : 0);
    run(m, pre0, dec0, gen0);
    gc_model_close(m);
    MT_OK(open_tp_map(&m, dir, tp, NULL, -1, true, &e), &e);
    const uint64_t mapped = gc_model_mapped_dense_bytes(m), experts = gc_model_mapped_experts(m);
    run(m, pre, dec, gen);
    gc_model_close(m);
    fprintf(stderr, "  %s tp %u --map-weights: %llu dense bytes, %llu experts in place\n",
            strrchr(dir, '/') + 1, tp, (unsigned long long)mapped, (unsigned long long)experts);
    MT_TRUE(mapped > 0);
    MT_TRUE(experts > 0);
    MT_TRUE(memcmp(pre, pre0, sizeof pre) == 0);
    MT_TRUE(memcmp(dec, dec0, sizeof dec) == 0);
    MT_TRUE(memcmp(gen, gen0, sizeof gen) == 0);
  }
}

MT_TEST(tp_with_map_weights_equals_packed) {
  setup();
  check_map(qwen, NULL);
  check_map(dsv3, NULL);
  check_map(dsv3_q, NULL);
  /* per rank: q_a | kv_a and q_b in 3 layers (row slices), gate | up and down of the dense
   * MLP and of the 2 shared experts; o_proj at G = 1 only; the shared down_proj not at
   * G = 4 */
  const uint64_t fp8[3] = {15, 2 * 12, 4 * 10};
  check_map(dsv3_8, fp8);
  cleanup();
}

MT_TEST(tp_equals_one_rank_all_local) {
  setup();
  check_tp(qwen, NULL, -1);
  check_tp(dsv3, NULL, -1);
  check_tp(dsv3_q, NULL, -1);
  check_tp(dsv3_8, NULL, -1);
  cleanup();
}

MT_TEST(tp_with_servers_and_hot_experts_equals_one_rank) {
  setup();
  const char *dirs[2] = {qwen, dsv3};
  for (int i = 0; i < 2; i++) {
    itu_server s0, s1;
    char cl[700];
    itu_server_isa("ref");
    MT_EQ_INT(itu_server_start(&s0, dirs[i], "--experts 0-3", tmp, 60000), 0);
    MT_EQ_INT(itu_server_start(&s1, dirs[i], "--experts 4-7", tmp, 60000), 0);
    snprintf(cl, sizeof cl, "%s/cluster-%d.json", tmp, i);
    write_cluster(cl, &s0, &s1);
    check_tp(dirs[i], cl, 0);
    check_tp(dirs[i], cl, 3); /* 3 hot experts per layer over the ranks in turn */
    int st;
    if (i == 0) {
      /* a server dies: rank 0's RPC fails, the other ranks finish the step with it, and
       * the step fails naming the server instead of hanging; the next step too */
      gc_model *m = NULL;
      mr_err e = {0};
      MT_OK(open_tp(&m, dirs[i], 2, cl, 3, &e), &e);
      MT_EQ_INT(itu_server_stop(&s1, SIGKILL, 15000, &st), 0);
      static float out[T_PROMPT * V];
      uint32_t seq[T_PROMPT] = {0}, pos[T_PROMPT];
      for (uint32_t t = 0; t < T_PROMPT; t++) pos[t] = t;
      gc_step s = {.n_tokens = T_PROMPT, .ids = prompt, .seq = seq, .pos = pos, .logits = out};
      for (int round = 0; round < 2; round++) {
        gc_model_seq_reset(m, 0);
        int rc = gc_model_step(m, &s, &e);
        fprintf(stderr, "  tp 2, s1 killed: %s\n", e.msg);
        MT_TRUE(rc != 0);
        MT_TRUE(strstr(e.msg, "s1") != NULL);
      }
      gc_model_close(m);
    } else {
      MT_EQ_INT(itu_server_stop(&s1, SIGTERM, 15000, &st), 0);
    }
    MT_EQ_INT(itu_server_stop(&s0, SIGTERM, 15000, &st), 0);
  }
  cleanup();
}

MT_TEST(what_cannot_be_split_is_refused_naming_the_field) {
  setup();
  gc_model *m = NULL;
  mr_err e = {0};
  MT_EQ_INT(open_tp(&m, qwen, 3, NULL, -1, &e), MR_EINVAL);
  MT_TRUE(strstr(e.msg, "--tp 3") && strstr(e.msg, "num_attention_heads = 8"));
  MT_TRUE(m == NULL);
  MT_EQ_INT(open_tp(&m, qwen, 17, NULL, -1, &e), MR_ERANGE);
  MT_TRUE(strstr(e.msg, "--tp = 17") && strstr(e.msg, "1..16"));
  /* 8 heads but 4 kv heads: 8 ranks cannot share 4 kv heads */
  MT_EQ_INT(open_tp(&m, qwen, 8, NULL, -1, &e), MR_EINVAL);
  MT_TRUE(strstr(e.msg, "num_key_value_heads = 4"));
  /* 4 heads of MLA, but the dense layer's intermediate_size 64 and the shared expert's 32
   * divide by 4: fine; 3 does not divide the heads */
  MT_EQ_INT(open_tp(&m, dsv3, 3, NULL, -1, &e), MR_EINVAL);
  MT_TRUE(strstr(e.msg, "num_attention_heads = 4"));
  cleanup();
}

MT_TEST(backend_cuda_without_a_gpu_fails_naming_why) {
  setup();
  gc_model_opts o;
  gc_model_opts_init(&o);
  o.model_dir = qwen;
  o.quiet = true;
  o.backend = "cuda";
  gc_model *m = NULL;
  mr_err e = {0};
  int rc = gc_model_open(&m, &o, &e);
  fprintf(stderr, "  --backend cuda here: %s (%s)\n", e.msg, mr_strerror(rc));
  MT_EQ_INT(rc, MR_ENOTSUP);
  MT_TRUE(m == NULL);
  MT_TRUE(strstr(e.msg, "no CUDA device") || strstr(e.msg, "has no CUDA backend"));
  o.backend = "tpu";
  MT_EQ_INT(gc_model_open(&m, &o, &e), MR_EINVAL);
  MT_TRUE(strstr(e.msg, "backend = \"tpu\""));
  cleanup();
}

MT_MAIN()
