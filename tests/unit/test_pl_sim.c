/*
 * test_pl_sim.c - the throughput model of `moerpc-place simulate` (placement/pl_sim.c):
 * properties of the model (more hosts never slower when the link is not the bottleneck,
 * a host twice as fast takes half the time, the bottleneck named, skewed routing on an
 * uneven placement shows the imbalance), and the readers of its measured inputs refusing
 * bad lines with the field named.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "placement/pl.h"
#include "tests/unit/mt.h"

/* A bench-kernels table: 40 GB/s at T = 1, 20 GB/s at T = 256 (a 128-expert pool, top-8). */
#define KLINE(T, G)                                                                          \
  "{\"shape\":\"qwen3-30b-a3b\",\"format\":\"bf16\",\"group\":0,\"isa\":\"avx512\",\"tokens\":" #T \
  ",\"top_k\":8,\"threads\":2,\"experts_pool\":128,\"weight_gbps\":" #G "}\n"
static const char KERNELS[] = KLINE(1, 40) KLINE(256, 20)
    "{\"mode\":\"linear\",\"format\":\"bf16\",\"tokens\":1,\"weight_gbps\":1}\n";

static pl_rates rates;

static void load_rates(void) {
  mr_err e = {0};
  int rc = pl_rates_parse(&rates, KERNELS, strlen(KERNELS), "bf16", "k.jsonl", &e);
  if (rc) {
    fprintf(stderr, "rates: %s\n", e.msg);
    abort();
  }
}

/* L x E model of the qwen3 shape, N hosts with contiguous ranges, no RPC or link cost. */
typedef struct fixture {
  pl_sim_input in;
  pl_sim_host hosts[16];
  int32_t route[4 * 128];
  uint8_t local[4 * 128];
  uint64_t counts[4 * 128];
} fixture;

static void fixture_init(fixture *f, uint32_t N) {
  load_rates();
  memset(f, 0, sizeof *f);
  pl_sim_input *in = &f->in;
  in->hidden = 2048, in->inter = 768, in->num_experts = 128, in->top_k = 8, in->num_layers = 4;
  in->expert_bytes = pl_sim_expert_bytes("bf16", 2048, 768);
  in->wire_bytes = 2;
  in->n_hosts = N;
  in->hosts = f->hosts;
  in->route = f->route;
  in->local = f->local;
  in->client_rates = &rates;
  in->decode_other_us = 5000;
  in->prefill_other_us = 50000;
  in->batch = 1, in->prompt_len = 64, in->samples = 512, in->seed = 7;
  for (uint32_t h = 0; h < N; h++) {
    snprintf(f->hosts[h].name, sizeof f->hosts[h].name, "s%u", h);
    f->hosts[h].rates = &rates;
    f->hosts[h].speed = 1;
  }
  for (uint32_t p = 0; p < 4 * 128; p++) f->route[p] = N ? (int32_t)((p % 128) * N / 128) : -1;
}

static pl_sim_result run(const fixture *f) {
  pl_sim_result r;
  mr_err e = {0};
  int rc = pl_sim_run(&f->in, &r, &e);
  if (rc) {
    fprintf(stderr, "pl_sim_run: %s\n", e.msg);
    abort();
  }
  return r;
}

MT_TEST(expert_bytes_by_format) {
  MT_NEAR(pl_sim_expert_bytes("bf16", 2048, 768), 3.0 * 2048 * 768 * 2, 0);
  MT_NEAR(pl_sim_expert_bytes("int8", 2048, 768), 3.0 * 2048 * 768 + 4 * (2 * 768 + 2048), 0);
  /* int4 g64: half a byte per weight, a fp32 scale per 64 */
  MT_NEAR(pl_sim_expert_bytes("int4", 2048, 768), 3.0 * 2048 * 768 / 2 + 4 * (2 * 768 * 32 + 2048 * 12), 0);
  MT_NEAR(pl_sim_expert_bytes("int4-g128", 7168, 2048), 3.0 * 7168 * 2048 / 2 + 4 * (2 * 2048 * 56 + 7168 * 16), 0);
  /* fp8-b128: the kernels repeat the block scale on each row: 2048 gate/up rows x 56 blocks,
   * 7168 down rows x 16 */
  MT_NEAR(pl_sim_expert_bytes("fp8", 7168, 2048), 3.0 * 7168 * 2048 + 4 * (2 * 2048 * 56 + 7168 * 16), 0);
  MT_NEAR(pl_sim_expert_bytes("int4-g48", 64, 64), 0, 0);
  MT_NEAR(pl_sim_expert_bytes("q4_k", 64, 64), 0, 0);
}

MT_TEST(rates_interpolate_by_tokens_per_expert) {
  load_rates();
  MT_EQ_INT(rates.n, 2);
  MT_EQ_INT(rates.threads, 2);
  MT_NEAR(rates.pt[0].u, 1.0, 1e-12);
  MT_NEAR(pl_rates_gbps(&rates, 1.0), 40, 1e-9);
  MT_NEAR(pl_rates_gbps(&rates, 0.5), 40, 1e-9);     /* clamped */
  MT_NEAR(pl_rates_gbps(&rates, 1e6), 20, 1e-9);     /* clamped */
  double mid = pl_rates_gbps(&rates, sqrt(rates.pt[1].u));
  MT_NEAR(mid, sqrt(40.0 * 20.0), 1e-9);             /* log-linear halfway */
  /* format filter: no int8 line */
  mr_err e = {0};
  pl_rates r;
  MT_EQ_INT(pl_rates_parse(&r, KERNELS, strlen(KERNELS), "int8", "k.jsonl", &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "k.jsonl: no moerpc-bench-kernels line of format int8");
}

MT_TEST(more_hosts_never_slower_without_link_bottleneck) {
  double prev_d = 0, prev_p = 0;
  for (uint32_t N = 1; N <= 16; N *= 2) {
    fixture f;
    fixture_init(&f, N);
    f.in.rpc.fixed_us = 50;
    f.in.rpc.per_byte_us = 0.001;
    pl_sim_result r = run(&f);
    MT_TRUE(r.decode.tok_s >= prev_d * 0.999);
    MT_TRUE(r.prefill.tok_s >= prev_p * 0.999);
    MT_TRUE(strcmp(pl_sim_component_name(&f.in, r.decode.bottleneck), "link") != 0);
    prev_d = r.decode.tok_s;
    prev_p = r.prefill.tok_s;
    pl_sim_result_close(&r);
  }
}

MT_TEST(doubling_a_host_speed_halves_its_part) {
  fixture f;
  fixture_init(&f, 1);
  pl_sim_result a = run(&f);
  f.hosts[0].speed = 2;
  pl_sim_result b = run(&f);
  /* no RPC or link cost: the MoE part is the host's compute alone */
  double moe_a = a.decode.step_us - f.in.decode_other_us, moe_b = b.decode.step_us - f.in.decode_other_us;
  MT_NEAR(moe_b, moe_a / 2, 1e-9 * moe_a);
  MT_NEAR(b.decode.host_busy_us[0], a.decode.host_busy_us[0] / 2, 1e-9 * a.decode.host_busy_us[0]);
  double pa = a.prefill.step_us - f.in.prefill_other_us, pb = b.prefill.step_us - f.in.prefill_other_us;
  MT_NEAR(pb, pa / 2, 1e-9 * pa);
  /* batch 1, one host: the step reads 8 experts per layer at 40 GB/s */
  MT_NEAR(moe_a, 4 * 8 * f.in.expert_bytes / 40e3, 1e-6 * moe_a);
  MT_NEAR(a.decode.tok_s, 1e6 / a.decode.step_us, 1e-9);
  pl_sim_result_close(&a);
  pl_sim_result_close(&b);
}

MT_TEST(deterministic_for_a_seed) {
  fixture f;
  fixture_init(&f, 3);
  pl_sim_result a = run(&f), b = run(&f);
  MT_NEAR(a.decode.step_us, b.decode.step_us, 0);
  MT_NEAR(a.prefill.step_us, b.prefill.step_us, 0);
  pl_sim_result_close(&a);
  pl_sim_result_close(&b);
}

MT_TEST(bottleneck_is_named) {
  fixture f;
  /* client: a long step of its own */
  fixture_init(&f, 2);
  f.in.decode_other_us = 1e6;
  pl_sim_result r = run(&f);
  MT_EQ_STR(pl_sim_component_name(&f.in, r.decode.bottleneck), "client");
  MT_TRUE(r.decode.share[0] > 0.9);
  double sum = 0;
  for (uint32_t c = 0; c < 4; c++) sum += r.decode.share[c];
  MT_NEAR(sum, 1.0, 1e-9);
  pl_sim_result_close(&r);
  /* one slow host */
  fixture_init(&f, 2);
  f.in.decode_other_us = 0;
  f.hosts[1].speed = 0.05;
  r = run(&f);
  MT_EQ_STR(pl_sim_component_name(&f.in, r.decode.bottleneck), "s1");
  MT_TRUE(r.decode.share[3] > 0.8);
  pl_sim_result_close(&r);
  /* a thin link: 0.01 Gbit/s, 4 KB per call */
  fixture_init(&f, 2);
  f.in.decode_other_us = 0;
  f.hosts[0].link_gbps = f.hosts[1].link_gbps = 0.01;
  r = run(&f);
  MT_EQ_STR(pl_sim_component_name(&f.in, r.decode.bottleneck), "link");
  pl_sim_result_close(&r);
  /* the client's own link, crossed by both hosts' bytes */
  fixture_init(&f, 2);
  f.in.decode_other_us = 0;
  f.in.client_link_gbps = 0.01;
  r = run(&f);
  MT_EQ_STR(pl_sim_component_name(&f.in, r.decode.bottleneck), "link");
  MT_TRUE(r.decode.share[1] > 0.9);
  pl_sim_result_close(&r);
}

MT_TEST(skewed_routing_on_uneven_placement_is_imbalanced) {
  fixture f;
  fixture_init(&f, 2);
  f.in.batch = 8;
  /* uniform routing, half the experts each: balanced */
  pl_sim_result u = run(&f);
  MT_TRUE(u.decode.imbalance < 1.05);
  MT_TRUE(u.prefill.imbalance < 1.05);
  /* 90 % of the tokens to experts 0..15, all on s0 */
  for (uint32_t l = 0; l < 4; l++)
    for (uint32_t x = 0; x < 128; x++) f.counts[l * 128 + x] = x < 16 ? 90 * 8 : 10;
  f.in.counts = f.counts;
  pl_sim_result s = run(&f);
  MT_TRUE(s.decode.host_busy_us[0] > s.decode.host_busy_us[1]);
  MT_TRUE(s.decode.imbalance > 1.3);
  MT_TRUE(s.prefill.host_busy_us[0] > s.prefill.host_busy_us[1]);
  /* the same skew with the popular experts split over both hosts: evener */
  for (uint32_t p = 0; p < 4 * 128; p++) f.route[p] = (int32_t)(p % 2);
  pl_sim_result b = run(&f);
  MT_TRUE(b.decode.imbalance < s.decode.imbalance);
  MT_TRUE(b.decode.imbalance < 1.1);
  MT_TRUE(b.decode.step_us < s.decode.step_us);
  pl_sim_result_close(&u);
  pl_sim_result_close(&s);
  pl_sim_result_close(&b);
}

MT_TEST(hot_experts_overlap_unless_cores_are_shared) {
  fixture f;
  fixture_init(&f, 1);
  f.in.decode_other_us = 0;
  for (uint32_t p = 0; p < 4 * 128; p++)
    if (p % 128 < 64) f.local[p] = 1, f.route[p] = -1;
  pl_sim_result ov = run(&f);
  f.in.shared_cores = true;
  pl_sim_result sh = run(&f);
  /* serialized: hot + remote; overlapped: max(hot, remote) */
  MT_TRUE(sh.decode.step_us > ov.decode.step_us * 1.5);
  MT_TRUE(sh.decode.share[0] > 0.3);
  pl_sim_result_close(&ov);
  pl_sim_result_close(&sh);
  /* deferral hides the deferred calls behind the next layer when the cores are not shared */
  fixture_init(&f, 2);
  f.in.decode_other_us = 4 * 8 * f.in.expert_bytes / 40e3; /* as long as the experts */
  pl_sim_result k0 = run(&f);
  f.in.max_deferred = 4;
  pl_sim_result k4 = run(&f);
  MT_TRUE(k4.decode.step_us < k0.decode.step_us);
  f.in.shared_cores = true;
  pl_sim_result k4s = run(&f);
  MT_TRUE(k4s.decode.step_us >= k0.decode.step_us * 0.999);
  pl_sim_result_close(&k0);
  pl_sim_result_close(&k4);
  pl_sim_result_close(&k4s);
}

MT_TEST(shared_cores_hosts_read_no_faster_than_the_machine) {
  /* two hosts on the client's own machine, each as fast as the whole machine: together
   * they still read at the machine's rate, so the step is the one-host step */
  fixture f;
  fixture_init(&f, 1);
  f.in.shared_cores = true;
  pl_sim_result one = run(&f);
  fixture_init(&f, 2);
  f.in.shared_cores = true;
  pl_sim_result two = run(&f);
  MT_NEAR(two.decode.step_us, one.decode.step_us, 1e-9 * one.decode.step_us);
  /* each at half the machine's rate (one core of two): the busier host decides, slower */
  f.hosts[0].speed = f.hosts[1].speed = 0.5;
  pl_sim_result half = run(&f);
  MT_TRUE(half.decode.step_us > one.decode.step_us * 1.1);
  /* without --shared-cores two full-speed hosts halve the experts' time, roughly */
  f.in.shared_cores = false;
  f.hosts[0].speed = f.hosts[1].speed = 1;
  pl_sim_result apart = run(&f);
  MT_TRUE(apart.decode.step_us < one.decode.step_us);
  pl_sim_result_close(&one);
  pl_sim_result_close(&two);
  pl_sim_result_close(&half);
  pl_sim_result_close(&apart);
}

MT_TEST(bad_inputs_are_refused) {
  fixture f;
  fixture_init(&f, 2);
  mr_err e = {0};
  pl_sim_result r;
  f.hosts[1].speed = -1;
  MT_EQ_INT(pl_sim_run(&f.in, &r, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "host s1: speed = -1, must be > 0");
  pl_sim_result_close(&r);
  fixture_init(&f, 2);
  f.route[5] = 7;
  MT_EQ_INT(pl_sim_run(&f.in, &r, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "layer 0 expert 5 routed to host 7, only 2 hosts");
  fixture_init(&f, 2);
  f.hosts[0].rates = NULL;
  MT_EQ_INT(pl_sim_run(&f.in, &r, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "host s0 has no kernel rates");
  fixture_init(&f, 0);
  MT_EQ_INT(pl_sim_run(&f.in, &r, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "is not local and there is no host");
  fixture_init(&f, 1);
  f.in.top_k = 200;
  MT_EQ_INT(pl_sim_run(&f.in, &r, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "top_k = 200");
  fixture_init(&f, 1);
  f.in.rpc.fixed_us = -3;
  MT_EQ_INT(pl_sim_run(&f.in, &r, &e), MR_EINVAL);
  MT_CONTAINS(e.msg, "rpc fixed -3 us");
}

static void expect_rates_error(const char *text, int code, const char *want) {
  pl_rates r;
  mr_err e = {0};
  int rc = pl_rates_parse(&r, text, strlen(text), "bf16", "k.jsonl", &e);
  if (rc != code || !strstr(e.msg, want)) {
    fprintf(stderr, "input %s: rc %d (want %d), message \"%s\" (want \"%s\")\n", text, rc, code,
            e.msg, want);
    abort();
  }
}

MT_TEST(bad_kernel_lines_name_the_field) {
  expect_rates_error("{\"format\":\"bf16\",\"tokens\":1,\"top_k\":8,\"threads\":2,\"experts_pool\":128}\n",
                     MR_EFORMAT, "k.jsonl: line 1: weight_gbps = (missing), must be a number > 0");
  expect_rates_error("\n{\"format\":\"bf16\",\"tokens\":1,\"top_k\":8,\"threads\":2,\"experts_pool\":128,\"weight_gbps\":-4}\n",
                     MR_ERANGE, "line 2: weight_gbps = -4, must be a finite number > 0");
  expect_rates_error("{\"format\":\"bf16\",\"top_k\":8,\"threads\":2,\"experts_pool\":128,\"weight_gbps\":4}\n",
                     MR_EFORMAT, "line 1: tokens = (missing)");
  expect_rates_error("{\"format\":\"bf16\",\"tokens\":0,\"top_k\":8,\"threads\":2,\"experts_pool\":128,\"weight_gbps\":4}\n",
                     MR_ERANGE, "line 1: tokens = 0, must be an integer in 1..2147483648");
  expect_rates_error("{\"format\":\"bf16\",\"tokens\":1,\"top_k\":9,\"threads\":2,\"experts_pool\":8,\"weight_gbps\":4}\n",
                     MR_ERANGE, "top_k = 9, must be <= experts_pool 8");
  expect_rates_error("{\"tokens\":1}\n", MR_EFORMAT, "line 1: format = (missing), must be a string");
  expect_rates_error("{\"format\":\"bf16\",\"tokens\":1,\n", MR_EFORMAT, "k.jsonl: line 1");
  expect_rates_error(KLINE(1, 40) "{\"format\":\"bf16\",\"tokens\":4,\"top_k\":8,\"threads\":1,\"experts_pool\":128,\"weight_gbps\":4}\n",
                     MR_EINVAL, "line 2: threads = 1, but earlier lines have 2");
  expect_rates_error("T  us\n", MR_ENOTFOUND, "no moerpc-bench-kernels line");
}

MT_TEST(rpc_cost_fit) {
  pl_rpc_cost c;
  mr_err e = {0};
  /* 50 us + 0.01 us per byte, exactly */
  const char *t = "T req reply\n"
                  "{\"bench\":\"rpc\",\"tokens\":1,\"req_bytes\":500,\"reply_bytes\":500,\"grpc_p50_us\":90,\"server_compute_us_p50\":30}\n"
                  "{\"bench\":\"rpc\",\"tokens\":16,\"req_bytes\":5000,\"reply_bytes\":5000,\"grpc_p50_us\":250,\"server_compute_us_p50\":100}\n";
  MT_OK(pl_rpc_parse(&c, t, strlen(t), "rpc.jsonl", &e), &e);
  MT_NEAR(c.fixed_us, 50, 1e-9);
  MT_NEAR(c.per_byte_us, 0.01, 1e-12);
  MT_EQ_INT(c.n_lines, 2);
  /* a negative slope (noise) becomes a fixed cost */
  const char *n = "{\"bench\":\"rpc\",\"tokens\":1,\"req_bytes\":100,\"reply_bytes\":100,\"grpc_p50_us\":100,\"server_compute_us_p50\":0}\n"
                  "{\"bench\":\"rpc\",\"tokens\":2,\"req_bytes\":200,\"reply_bytes\":200,\"grpc_p50_us\":80,\"server_compute_us_p50\":0}\n";
  MT_OK(pl_rpc_parse(&c, n, strlen(n), "rpc.jsonl", &e), &e);
  MT_NEAR(c.per_byte_us, 0, 0);
  MT_NEAR(c.fixed_us, 90, 1e-9);
  const char *bad = "{\"bench\":\"rpc\",\"tokens\":1,\"req_bytes\":-1,\"reply_bytes\":1,\"grpc_p50_us\":1,\"server_compute_us_p50\":0}\n";
  MT_EQ_INT(pl_rpc_parse(&c, bad, strlen(bad), "rpc.jsonl", &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "rpc.jsonl: line 1: req_bytes = -1, must be a finite number >= 0");
  const char *miss = "{\"bench\":\"rpc\",\"tokens\":1,\"req_bytes\":1,\"reply_bytes\":1,\"grpc_p50_us\":1}\n";
  MT_EQ_INT(pl_rpc_parse(&c, miss, strlen(miss), "rpc.jsonl", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "server_compute_us_p50 = (missing)");
  MT_EQ_INT(pl_rpc_parse(&c, "{\"bench\":\"model\"}", 17, "rpc.jsonl", &e), MR_ENOTFOUND);
  MT_CONTAINS(e.msg, "no \"bench\": \"rpc\" line");
}

MT_TEST(client_bench_reader) {
  pl_client_bench b;
  mr_err e = {0};
  const char *t =
      "{\"bench\": \"model\", \"threads\": 2, \"servers\": 0, \"batch\": 1, \"prompt_len\": 32, "
      "\"prefill_tok_s\": 200.5, \"step_ms\": 14.0}\n"
      "{\"bench\": \"model-layer\", \"layer\": 0, \"moe\": true, \"local_us\": 2000}\n"
      "{\"bench\": \"model-layer\", \"layer\": 1, \"moe\": false, \"local_us\": 900}\n"
      "{\"bench\": \"model-layer\", \"layer\": 2, \"moe\": true, \"local_us\": 2100}\n";
  MT_OK(pl_client_bench_parse(&b, t, strlen(t), "c.jsonl", &e), &e);
  MT_NEAR(b.step_us, 14000, 1e-9);
  MT_NEAR(b.expert_us, 4100, 1e-9);
  MT_NEAR(b.prefill_tok_s, 200.5, 0);
  MT_EQ_INT(b.prompt_len, 32);
  MT_EQ_INT(b.layers, 3);
  const char *remote = "{\"bench\": \"model\", \"threads\": 2, \"servers\": 2, \"batch\": 1, "
                       "\"prompt_len\": 32, \"prefill_tok_s\": 200.5, \"step_ms\": 14.0}\n";
  MT_EQ_INT(pl_client_bench_parse(&b, remote, strlen(remote), "c.jsonl", &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "all-local run");
  MT_CONTAINS(e.msg, "servers = 2");
  const char *neg = "{\"bench\": \"model\", \"threads\": 2, \"servers\": 0, \"batch\": 1, "
                    "\"prompt_len\": 32, \"prefill_tok_s\": 200.5, \"step_ms\": -1}\n";
  MT_EQ_INT(pl_client_bench_parse(&b, neg, strlen(neg), "c.jsonl", &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "c.jsonl: line 1: step_ms = -1, must be a finite number > 0");
  const char *lay = "{\"bench\": \"model\", \"threads\": 2, \"servers\": 0, \"batch\": 1, "
                    "\"prompt_len\": 32, \"prefill_tok_s\": 200.5, \"step_ms\": 1}\n"
                    "{\"bench\": \"model-layer\", \"layer\": 0, \"moe\": \"yes\", \"local_us\": 2}\n";
  MT_EQ_INT(pl_client_bench_parse(&b, lay, strlen(lay), "c.jsonl", &e), MR_EFORMAT);
  MT_CONTAINS(e.msg, "line 2: moe = \"yes\", must be true or false");
  MT_EQ_INT(pl_client_bench_parse(&b, "", 0, "c.jsonl", &e), MR_ENOTFOUND);
}

MT_MAIN()
