/*
 * gen_control_seeds.c - writes the seed corpora of the control-message and finite-check
 * fuzz targets: hello_request, stats_request, hello_reply, stats_reply, health_request,
 * load_request, unload_request, load_progress (control, protocol 1.2),
 * health_response (each input = one split byte + the message, fuzz_bb.h) and hidden_finite
 * (dtype byte, H - 1 byte, payload; fuzz_hidden_finite.c). ok_* seeds must be accepted and
 * bad_* refused (fuzz.h). Not built by make; rebuild the corpora with:
 *
 *   make build/gen/proto/moe.pb-c.c
 *   cc -std=gnu11 -I. -Ibuild/gen/proto -o /tmp/gen_cs tests/fuzz/gen_control_seeds.c \
 *      build/gen/proto/moe.pb-c.c -lprotobuf-c
 *   /tmp/gen_cs tests/fuzz/corpus
 *
 * The hello_reply seeds aim at the client's checks (gc__hello_check), stats_reply at a
 * model of 4 layers x 16 experts and, from protocol 1.4, the clients list (client_name at
 * most 128 bytes, no control bytes in it or the peer; fuzz_stats_reply.c).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.pb-c.h"

static const char *root;
static int written;

/* Writes [pre][msg] to root/dir/name. */
static void put(const char *dir, const char *name, const uint8_t *pre, size_t npre,
                const void *msg, size_t len) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s/%s", root, dir, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(pre, 1, npre, f) != npre || (len && fwrite(msg, 1, len, f) != len) ||
      fclose(f) != 0) {
    perror(path);
    exit(1);
  }
  written++;
}

/* A control message with split byte `split` (fuzz_bb.h). */
static void put_msg(const char *dir, const char *name, uint8_t split, const void *msg, size_t len) {
  put(dir, name, &split, 1, msg, len);
}

static uint8_t buf[1 << 17];
static size_t pack(const ProtobufCMessage *m) {
  size_t n = protobuf_c_message_get_packed_size(m);
  if (n > sizeof buf) abort();
  return protobuf_c_message_pack(m, buf);
}

static size_t varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}

static void hello_request(void) {
  const char *d = "hello_request";
  Moerpc__V1__HelloRequest q = MOERPC__V1__HELLO_REQUEST__INIT;
  q.protocol_major = 1;
  q.client_name = "moerpc-client";
  size_t n = pack(&q.base);
  put_msg(d, "ok_typical", 0, buf, n);
  put_msg(d, "ok_typical_four_slices", 0x0f, buf, n);
  put_msg(d, "ok_empty_message", 1, buf, 0);
  q.protocol_major = 2; /* decodes; the server then answers FAILED_PRECONDITION */
  q.protocol_minor = 7;
  n = pack(&q.base);
  put_msg(d, "ok_other_major", 2, buf, n);
  q.protocol_major = 1;
  n = pack(&q.base);
  n += varint(buf + n, 99 << 3 | 2), n += varint(buf + n, 3), memcpy(buf + n, "abc", 3), n += 3;
  put_msg(d, "ok_unknown_field", 3, buf, n);
  /* client_name with a NUL and an escape byte inside (the server logs all of it, escaped),
   * then given twice (the last wins). */
  static const uint8_t nul[] = {0x08, 0x01, 0x1a, 0x06, 'a', 'b', 0x00, 'c', 0x1b, 'd'};
  put_msg(d, "ok_nul_in_client_name", 0x21, nul, sizeof nul);
  static const uint8_t twice[] = {0x1a, 0x01, 'x', 0x08, 0x01, 0x1a, 0x02, 'y', 0x00};
  put_msg(d, "ok_client_name_twice", 4, twice, sizeof twice);
  static const uint8_t name_varint[] = {0x08, 0x01, 0x18, 0x05};
  put_msg(d, "bad_client_name_not_a_string", 1, name_varint, sizeof name_varint);
  static const uint8_t trunc[] = {0x08, 0x81};
  put_msg(d, "bad_truncated_varint", 0, trunc, sizeof trunc);
  static const uint8_t past[] = {0x08, 0x01, 0x1a, 0x20, 'a', 'b'};
  put_msg(d, "bad_string_past_end", 1, past, sizeof past);
  static const uint8_t group[] = {0x08, 0x01, 0x0b};
  put_msg(d, "bad_wire_type_group", 2, group, sizeof group);
  /* A client_name making the message just over 64 KiB. */
  static char big[(64 << 10) + 1];
  memset(big, 'x', sizeof big - 1);
  q.client_name = big;
  n = pack(&q.base);
  put_msg(d, "bad_over_64k", 3, buf, n);
}

static void stats_request(void) {
  const char *d = "stats_request";
  Moerpc__V1__StatsRequest q = MOERPC__V1__STATS_REQUEST__INIT;
  put_msg(d, "ok_empty_message", 0, buf, 0);
  q.reset = 1;
  size_t n = pack(&q.base);
  put_msg(d, "ok_reset", 1, buf, n);
  static const uint8_t unk[] = {0x10, 0x05, 0x08, 0x01, 0x1d, 1, 2, 3, 4};
  put_msg(d, "ok_unknown_fields", 2, unk, sizeof unk);
  static const uint8_t trunc[] = {0x08};
  put_msg(d, "bad_truncated", 0, trunc, sizeof trunc);
  static const uint8_t fixed[] = {0x08, 0x01, 0x11, 1, 2};
  put_msg(d, "bad_fixed64_truncated", 3, fixed, sizeof fixed);
  static uint8_t big[(64 << 10) + 8];
  size_t k = 0;
  k += varint(big + k, 9 << 3 | 2), k += varint(big + k, 64 << 10);
  put_msg(d, "bad_over_64k", 1, big, k + (64 << 10));
}

/* A valid HelloReply of the integration tests' model: H 64, I 32, 3 layers, 16 experts,
 * layers 0-1 experts 0-7 owned, bf16, max_tokens 8. */
static uint32_t owned_ids[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static Moerpc__V1__LayerExperts le[3];
static Moerpc__V1__LayerExperts *lep[3] = {&le[0], &le[1], &le[2]};
static Moerpc__V1__HelloReply hello_reply_good(void) {
  Moerpc__V1__HelloReply r = MOERPC__V1__HELLO_REPLY__INIT;
  r.protocol_major = 1;
  r.model_fingerprint = "0123456789abcdef";
  r.hidden_size = 64;
  r.intermediate_size = 32;
  r.num_layers = 3;
  r.num_experts = 16;
  for (int l = 0; l < 3; l++) {
    Moerpc__V1__LayerExperts x = MOERPC__V1__LAYER_EXPERTS__INIT;
    le[l] = x;
    le[l].layer = (uint32_t)l;
    le[l].n_experts = 8;
    le[l].experts = owned_ids;
  }
  r.n_owned = 2;
  r.owned = lep;
  r.weight_format = "bf16";
  r.max_tokens = 8;
  return r;
}

static void hello_reply(void) {
  const char *d = "hello_reply";
  Moerpc__V1__HelloReply r = hello_reply_good();
  size_t n = pack(&r.base);
  put_msg(d, "ok_typical", 0, buf, n);
  put_msg(d, "ok_typical_four_slices", 0x53, buf, n);
  r.n_owned = 0;
  put_msg(d, "ok_nothing_owned", 1, buf, pack(&r.base));
  r = hello_reply_good();
  le[1].n_experts = 16; /* experts 0-15 = all, duplicates across entries are fine */
  r.n_owned = 3;
  le[2].layer = 1;
  put_msg(d, "ok_layer_listed_twice", 2, buf, pack(&r.base));
  r = hello_reply_good();
  r.protocol_minor = 9;
  r.weight_format = "int4-g128";
  r.num_layers = 1024;
  r.num_experts = 4096;
  r.max_tokens = 1u << 20;
  put_msg(d, "ok_largest_dims", 3, buf, pack(&r.base));
  r = hello_reply_good(); /* protocol 1.3: the server process's id */
  r.protocol_minor = 3;
  r.instance_id = "5f0c2a9e61d84b7d93a1c0e4b2f87d16";
  put_msg(d, "ok_instance_id", 0x12, buf, pack(&r.base));
  r.instance_id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"; /* 64 */
  put_msg(d, "ok_instance_id_64_bytes", 1, buf, pack(&r.base));

  struct { const char *name; int what; } bad[] = {
      {"bad_protocol_2", 0}, {"bad_hidden_zero", 1}, {"bad_max_tokens_over", 2},
      {"bad_layer_out_of_range", 3}, {"bad_expert_out_of_range", 4}, {"bad_too_many_pairs", 5},
      {"bad_empty_fingerprint", 6}, {"bad_long_weight_format", 7}, {"bad_num_layers_over", 8},
      {"bad_inter_over", 9}, {"bad_instance_id_65_bytes", 10},
      {"bad_instance_id_control_byte", 11},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    r = hello_reply_good();
    switch (bad[i].what) {
    case 0: r.protocol_major = 2; break;
    case 1: r.hidden_size = 0; break;
    case 2: r.max_tokens = (1u << 20) + 1; break;
    case 3: le[1].layer = 3; break;
    case 4: owned_ids[7] = 16; break;
    case 5: r.num_layers = 1024, r.num_experts = 4097; break;
    case 6: r.model_fingerprint = ""; break;
    case 7: r.weight_format = "a-weight-format-name-of-40-characters-xx"; break;
    case 8: r.num_layers = 1025; break;
    case 9: r.intermediate_size = 65537; break;
    case 10: r.instance_id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0"; break;
    case 11: r.instance_id = "id\x1b[31m"; break;
    }
    put_msg(d, bad[i].name, (uint8_t)i, buf, pack(&r.base));
    owned_ids[7] = 7;
  }
  r = hello_reply_good();
  n = pack(&r.base);
  put_msg(d, "bad_truncated", 1, buf, n - 3);
}

static void stats_reply(void) {
  const char *d = "stats_reply";
  Moerpc__V1__ExpertCount c[3];
  Moerpc__V1__ExpertCount *cp[3] = {&c[0], &c[1], &c[2]};
  for (int i = 0; i < 3; i++) {
    Moerpc__V1__ExpertCount x = MOERPC__V1__EXPERT_COUNT__INIT;
    c[i] = x;
    c[i].layer = (uint32_t)i;
    c[i].expert = (uint32_t)(5 * i);
    c[i].tokens = 1000u + (uint64_t)i;
  }
  c[2].layer = 3;
  c[2].expert = 15;
  c[2].tokens = UINT64_MAX;
  Moerpc__V1__StatsReply r = MOERPC__V1__STATS_REPLY__INIT;
  r.n_counts = 3;
  r.counts = cp;
  r.requests = 77;
  r.errors = 3;
  size_t n = pack(&r.base);
  put_msg(d, "ok_counts", 0, buf, n);
  put_msg(d, "ok_counts_four_slices", 0x27, buf, n);
  put_msg(d, "ok_empty_message", 1, buf, 0);
  c[1].layer = 4;
  put_msg(d, "bad_layer_outside_model", 2, buf, pack(&r.base));
  c[1].layer = 1;
  c[1].expert = 16;
  put_msg(d, "bad_expert_outside_model", 3, buf, pack(&r.base));
  c[1].expert = 5;
  n = pack(&r.base);
  put_msg(d, "bad_truncated", 1, buf, n - 1);

  /* Protocol 1.4: the clients with an open Forward stream. */
  Moerpc__V1__ClientInfo ci[2];
  Moerpc__V1__ClientInfo *cip[2] = {&ci[0], &ci[1]};
  for (int i = 0; i < 2; i++) {
    Moerpc__V1__ClientInfo x = MOERPC__V1__CLIENT_INFO__INIT;
    ci[i] = x;
    ci[i].streams = 1;
  }
  ci[0].client_name = "moerpc-client model pid=4242";
  ci[0].peer = "ipv4:127.0.0.1:53122";
  ci[0].hello_generation = 3;
  ci[0].hello_age_ms = 1500;
  ci[1].client_name = ""; /* a client older than 1.4 sends no name */
  ci[1].peer = "ipv6:[::1]:40000";
  r.n_clients = 2;
  r.clients = cip;
  put_msg(d, "ok_clients", 0, buf, pack(&r.base));
  char name128[129], name129[130];
  memset(name128, 'n', 128);
  name128[128] = '\0';
  memset(name129, 'n', 129);
  name129[129] = '\0';
  ci[0].client_name = name128;
  put_msg(d, "ok_client_name_128_bytes", 0, buf, pack(&r.base));
  ci[0].client_name = name129;
  put_msg(d, "bad_client_name_129_bytes", 0, buf, pack(&r.base));
  ci[0].client_name = "evil\nname";
  put_msg(d, "bad_client_name_control_byte", 0, buf, pack(&r.base));
  ci[0].client_name = "moerpc-client model pid=4242";
  ci[1].peer = "ipv4:127.0.0.1:1\x1b[2J";
  put_msg(d, "bad_client_peer_control_byte", 0, buf, pack(&r.base));
  r.n_clients = 0;
  r.clients = NULL;
}

static void health(void) {
  const char *d = "health_request";
  put_msg(d, "ok_empty_message", 0, buf, 0);
  static const uint8_t svc[] = "\x0a\x17moerpc.v1.ExpertService";
  put_msg(d, "ok_expert_service", 1, svc, sizeof svc - 1);
  static const uint8_t unk[] = "\x10\x01\x0a\x01x\x1a\x00\x0a\x02ok";
  put_msg(d, "ok_unknown_fields_last_wins", 2, unk, sizeof unk - 1);
  uint8_t big[300];
  big[0] = 0x0a, big[1] = 0xff, big[2] = 0x01; /* length 255 */
  memset(big + 3, 's', 255);
  put_msg(d, "ok_255_bytes", 3, big, 3 + 255);
  big[1] = 0x80, big[2] = 0x02; /* length 256: over the server's 256-byte buffer */
  memset(big + 3, 's', 256);
  put_msg(d, "bad_256_bytes", 0, big, 3 + 256);
  static const uint8_t wt[] = {0x08, 0x01};
  put_msg(d, "bad_service_as_varint", 1, wt, sizeof wt);
  static const uint8_t past[] = {0x0a, 0x05, 'a'};
  put_msg(d, "bad_length_past_end", 2, past, sizeof past);
  static const uint8_t tag[] = {0x0a, 0x01, 'a', 0x80};
  put_msg(d, "bad_truncated_tag", 3, tag, sizeof tag);

  d = "health_response";
  static const uint8_t serving[] = {0x08, 0x01}, not_serving[] = {0x08, 0x02};
  put_msg(d, "ok_serving", 0, serving, 2);
  put_msg(d, "ok_not_serving", 1, not_serving, 2);
  put_msg(d, "ok_unknown_empty", 2, buf, 0);
  static const uint8_t neg[] = {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  put_msg(d, "ok_negative_enum", 3, neg, sizeof neg);
  static const uint8_t len[] = {0x0a, 0x01, 0x01};
  put_msg(d, "bad_status_length_delimited", 0, len, sizeof len);
  static const uint8_t trunc[] = {0x08, 0x80};
  put_msg(d, "bad_truncated_varint", 1, trunc, sizeof trunc);
  static const uint8_t v11[] = {0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  put_msg(d, "bad_varint_11_bytes", 2, v11, sizeof v11);
}

/* hidden_finite: [dtype | unaligned << 2][H - 1][T rows]. */
static void put_hidden(const char *name, uint8_t dt, int unaligned, unsigned H, const void *x,
                       size_t len) { /* H 1..256 */
  uint8_t pre[2] = {(uint8_t)(dt | (unaligned ? 4 : 0)), (uint8_t)(H - 1)};
  put("hidden_finite", name, pre, 2, x, len);
}

static void hidden_finite(void) {
  static uint32_t f[3 * 64];
  static uint16_t h[3 * 64];
  static const uint32_t f_ok[] = {0, 0x80000000u, 1, 0x007fffffu, 0x3f800000u, 0x7f7fffffu, 0xff7fffffu};
  static const uint16_t f16_ok[] = {0, 0x8000, 1, 0x03ff, 0x3c00, 0x7bff, 0xfbff};
  static const uint16_t bf_ok[] = {0, 0x8000, 1, 0x007f, 0x3f80, 0x7f7f, 0xff7f};
  for (int i = 0; i < 3 * 64; i++) f[i] = f_ok[i % 7];
  put_hidden("ok_f32_denormals_and_max", 0, 0, 64, f, sizeof f);
  put_hidden("ok_f32_unaligned", 0, 1, 64, f, sizeof f);
  put_hidden("ok_no_whole_row", 0, 0, 200, f, 10);
  f[64 + 17] = 0x7fc00000u;
  put_hidden("bad_f32_nan_token1", 0, 0, 64, f, sizeof f);
  f[64 + 17] = 0x3f800000u;
  f[3 * 64 - 1] = 0xff800000u;
  put_hidden("bad_f32_neg_inf_last", 0, 0, 64, f, sizeof f);
  for (int i = 0; i < 3 * 64; i++) h[i] = f16_ok[i % 7];
  put_hidden("ok_f16_denormals_and_max", 1, 0, 64, h, sizeof h);
  h[0] = 0x7c00;
  put_hidden("bad_f16_inf_first", 1, 1, 64, h, sizeof h);
  for (int i = 0; i < 3 * 64; i++) h[i] = bf_ok[i % 7];
  put_hidden("ok_bf16_denormals_and_max", 2, 0, 64, h, sizeof h);
  put_hidden("ok_bf16_h1", 2, 1, 1, h, 20);
  h[2 * 64 + 5] = 0xff81;
  put_hidden("bad_bf16_nan_unaligned", 2, 1, 64, h, sizeof h);
  h[2 * 64 + 5] = 0x3f80;
  h[63] = 0x7f80;
  put_hidden("bad_bf16_inf_row_end", 2, 0, 64, h, sizeof h);
  /* Output and reply rows as the server converts them (issue 23): f16 at +-65504, the
   * largest finite, passes; an fp32 value over it became -Inf (token 2, index 200, in the
   * third block of the scan); bf16 next to FLT_MAX rounds up to +Inf; an f32 NaN with a
   * payload at the end of a 256-element block. */
  static uint16_t o16[4 * 256];
  static uint32_t o32[2 * 256];
  for (int i = 0; i < 4 * 256; i++) o16[i] = i % 2 ? 0xfbff : 0x7bff;
  put_hidden("ok_f16_output_largest_4_rows", 1, 0, 256, o16, sizeof o16);
  o16[2 * 256 + 200] = 0xfc00;
  put_hidden("bad_f16_output_overflow_token2", 1, 1, 256, o16, 3 * 256 * 2);
  for (int i = 0; i < 4 * 256; i++) o16[i] = i % 2 ? 0xff7f : 0x7f7f;
  o16[256 + 3] = 0x7f80;
  put_hidden("bad_bf16_output_overflow_token1", 2, 0, 256, o16, 2 * 256 * 2);
  for (int i = 0; i < 2 * 256; i++) o32[i] = 0x477fe000u; /* 65504.0f */
  o32[255] = 0x7f800001u;
  put_hidden("bad_f32_output_nan_payload_block_end", 0, 0, 256, o32, sizeof o32);
}

/* Control requests (protocol 1.2), against 4 layers (layer 0 dense) x 16 experts. */
static void control_requests(void) {
  static uint32_t ids[] = {0, 3, 15}, bad_ids[] = {16};
  Moerpc__V1__LayerExperts it = MOERPC__V1__LAYER_EXPERTS__INIT, *items[1] = {&it};
  it.layer = 1;
  it.experts = ids;
  it.n_experts = 3;
  for (int k = 0; k < 2; k++) {
    const char *d = k ? "unload_request" : "load_request";
    Moerpc__V1__LoadRequest lq = MOERPC__V1__LOAD_REQUEST__INIT;
    Moerpc__V1__UnloadRequest uq = MOERPC__V1__UNLOAD_REQUEST__INIT;
    ProtobufCMessage *m = k ? &uq.base : &lq.base;
    if (k) uq.n_drop = 1, uq.drop = items;
    else lq.n_add = 1, lq.add = items;
    it.layer = 1, it.experts = ids, it.n_experts = 3;
    put_msg(d, "ok_three_pairs", 0, buf, pack(m));
    if (k) uq.model_fingerprint = "0123456789abcdef";
    else lq.model_fingerprint = "0123456789abcdef";
    put_msg(d, "ok_fingerprint", 2, buf, pack(m));
    if (k) uq.model_fingerprint = "ffffffffffffffff";
    else lq.model_fingerprint = "ffffffffffffffff";
    put_msg(d, "bad_other_model", 1, buf, pack(m));
    if (k) uq.model_fingerprint = "";
    else lq.model_fingerprint = "";
    it.layer = 0;
    put_msg(d, "bad_dense_layer", 0, buf, pack(m));
    it.layer = 4;
    put_msg(d, "bad_layer_range", 3, buf, pack(m));
    it.layer = 2, it.experts = bad_ids, it.n_experts = 1;
    put_msg(d, "bad_expert_range", 1, buf, pack(m));
    it.n_experts = 0;
    put_msg(d, "bad_no_expert", 0, buf, pack(m));
    put_msg(d, "bad_empty_message", 0, buf, 0);
    static const uint8_t trunc[] = {0x0a, 0x05, 0x08};
    put_msg(d, "bad_truncated", 0, trunc, sizeof trunc);
  }
  /* Replies apply reads: first byte 0 LoadProgress, 1 LoadReply, 2 UnloadReply. */
  const char *d = "load_progress";
  Moerpc__V1__LoadProgress p = MOERPC__V1__LOAD_PROGRESS__INIT;
  p.load_id = 3, p.state = MOERPC__V1__LOAD_STATE__LOAD_STATE_RUNNING, p.tensors_done = 9;
  p.tensors_total = 48, p.bytes_done = 1 << 20, p.bytes_total = 3 << 20, p.seconds = 0.25;
  size_t n = pack(&p.base);
  uint8_t pre = 0;
  put(d, "ok_running", &pre, 1, buf, n);
  p.state = MOERPC__V1__LOAD_STATE__LOAD_STATE_FAILED, p.status = 8, p.error = "out of memory";
  n = pack(&p.base);
  put(d, "ok_failed", &pre, 1, buf, n);
  Moerpc__V1__LoadReply lr = MOERPC__V1__LOAD_REPLY__INIT;
  lr.load_id = 1, lr.pairs = 16, lr.tensors_total = 48, lr.bytes_total = 3 << 20;
  n = pack(&lr.base);
  pre = 1;
  put(d, "ok_load_reply", &pre, 1, buf, n);
  Moerpc__V1__UnloadReply ur = MOERPC__V1__UNLOAD_REPLY__INIT;
  ur.pairs = 16, ur.bytes_freed = 3 << 20, ur.owned_generation = 4;
  n = pack(&ur.base);
  pre = 2;
  put(d, "ok_unload_reply", &pre, 1, buf, n);
  static const uint8_t trunc[] = {0x08};
  pre = 0;
  put(d, "bad_truncated", &pre, 1, trunc, sizeof trunc);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s CORPUS_ROOT\n", argv[0]);
    return 2;
  }
  root = argv[1];
  static const char *dirs[] = {"hello_request", "stats_request", "hello_reply", "stats_reply",
                               "health_request", "health_response", "hidden_finite",
                               "load_request", "unload_request", "load_progress"};
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/%s'", root, dirs[i]);
    if (system(cmd) != 0) return 1;
  }
  hello_request();
  stats_request();
  hello_reply();
  stats_reply();
  health();
  hidden_finite();
  control_requests();
  printf("%d seeds written under %s\n", written, root);
  return 0;
}
