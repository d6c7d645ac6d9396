/*
 * fuzz_hello_reply.c - libFuzzer target: a HelloReply as the client receives it (a byte
 * buffer of several slices, fuzz_bb.h), decoded by pr_decode with the client's control
 * limit (GC__CTL_MAX_BYTES) and checked by the client's own checks (gc__hello_check, the
 * function gc_cluster_open runs on every server's reply).
 *
 * Accepted = decoded and passed the checks. Checked beyond "no crash, no leak, no UB": a
 * decode failure is MR_EFORMAT / MR_EEXHAUSTED naming HelloReply; a check failure is
 * MR_EMISMATCH (protocol) or MR_EPROTO naming the server; on success every dimension the
 * client will size arrays from is in 1..its limit, strings fit their buffers, the
 * instance_id (protocol 1.3) is the reply's, printable ASCII only (it goes into log lines),
 * and the announce bitset counts exactly `announced` pairs, all inside num_layers x
 * num_experts.
 */
#include <stdio.h>
#include <string.h>

#include "gpu_client/rpc/internal.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_hello_reply: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  Moerpc__V1__HelloReply *h = (Moerpc__V1__HelloReply *)fuzz_pr_decode(
      "fuzz_hello_reply", bb, &moerpc__v1__hello_reply__descriptor, GC__CTL_MAX_BYTES);
  grpc_byte_buffer_destroy(bb);
  if (!h) return 0;
  mr_err e;
  mr_err_clear(&e);
  int rc;
  gc__server sv;
  memset(&sv, 0, sizeof sv);
  snprintf(sv.cfg.name, sizeof sv.cfg.name, "s0");
  snprintf(sv.cfg.address, sizeof sv.cfg.address, "127.0.0.1:50051");
  rc = gc__hello_check(&sv, h, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc != MR_EMISMATCH && rc != MR_EPROTO && rc != MR_ENOMEM)
      fuzz_fail("undocumented check code", mr_err_name(rc));
    if (!strstr(e.msg, "server s0 (127.0.0.1:50051)")) fuzz_fail("error does not name the server", e.msg);
  } else {
    if (sv.proto_major != PR_PROTOCOL_MAJOR) fuzz_fail("accepted another protocol", "");
    if (sv.hidden < 1 || sv.hidden > 65536 || sv.inter < 1 || sv.inter > 65536 ||
        sv.layers < 1 || sv.layers > MR_MAX_LAYERS || sv.experts < 1 || sv.experts > 65536 ||
        sv.max_tokens < 1 || sv.max_tokens > GC_MAX_TOKENS)
      fuzz_fail("accepted a dimension out of range", "");
    if ((uint64_t)sv.layers * sv.experts > (1u << 22)) fuzz_fail("accepted too many pairs", "");
    if (!sv.fingerprint[0] || !sv.weight_format[0]) fuzz_fail("accepted an empty string", "");
    if (memchr(sv.fingerprint, 0, sizeof sv.fingerprint) == NULL ||
        memchr(sv.weight_format, 0, sizeof sv.weight_format) == NULL ||
        memchr(sv.instance_id, 0, sizeof sv.instance_id) == NULL)
      fuzz_fail("string not terminated", "");
    if (strcmp(sv.instance_id, h->instance_id ? h->instance_id : "") != 0)
      fuzz_fail("instance_id differs from the reply's", sv.instance_id);
    for (const char *p = sv.instance_id; *p; p++)
      if ((unsigned char)*p < 0x21 || (unsigned char)*p > 0x7e)
        fuzz_fail("accepted an instance_id that is not printable ASCII", "");
    size_t bits = (size_t)sv.layers * sv.experts, set = 0;
    for (size_t w = 0; w < (bits + 63) / 64; w++) set += (size_t)__builtin_popcountll(sv.announce[w]);
    if (set != sv.announced) fuzz_fail("announce bitset and count differ", "");
    if (bits % 64 && sv.announce[bits / 64] >> (bits % 64)) fuzz_fail("bit outside the model", "");
  }
  mr_free(sv.announce);
  moerpc__v1__hello_reply__free_unpacked(h, NULL);
  return 0;
}
