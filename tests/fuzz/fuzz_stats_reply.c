/*
 * fuzz_stats_reply.c - libFuzzer target: a StatsReply as the client receives it (a byte
 * buffer of several slices, fuzz_bb.h), decoded by pr_decode with the client's control
 * limit (GC__CTL_MAX_BYTES) and checked by gc__stats_reply_check (what gc_cluster_stats
 * runs) against a model of 4 layers x 16 experts.
 *
 * Accepted = decoded and passed the check. Checked beyond "no crash, no leak, no UB": a
 * failure is a documented code with a message naming the message or the server; on
 * success every count is inside the model and the counts are the reply's, in order, and
 * (protocol 1.4) every client is the reply's, within its limits, without control bytes.
 */
#include <stdio.h>
#include <string.h>

#include "gpu_client/rpc/internal.h"
#include "tests/fuzz/fuzz.h"
#include "tests/fuzz/fuzz_bb.h"

#define L 4
#define E 16

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_stats_reply: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  Moerpc__V1__StatsReply *r = (Moerpc__V1__StatsReply *)fuzz_pr_decode(
      "fuzz_stats_reply", bb, &moerpc__v1__stats_reply__descriptor, GC__CTL_MAX_BYTES);
  grpc_byte_buffer_destroy(bb);
  if (!r) return 0;
  mr_err e;
  mr_err_clear(&e);
  int rc;
  gc__server sv;
  memset(&sv, 0, sizeof sv);
  snprintf(sv.cfg.name, sizeof sv.cfg.name, "s1");
  snprintf(sv.cfg.address, sizeof sv.cfg.address, "[::1]:50052");
  gc_stats out;
  memset(&out, 0, sizeof out);
  rc = gc__stats_reply_check(&sv, r, L, E, &out, &e);
  fuzz_verdict_set(rc == 0);
  if (rc) {
    if (rc != MR_EPROTO && rc != MR_ENOMEM) fuzz_fail("undocumented check code", mr_err_name(rc));
    if (!strstr(e.msg, "server s1 ([::1]:50052)")) fuzz_fail("error does not name the server", e.msg);
  } else {
    if (out.n_counts != r->n_counts || out.requests != r->requests || out.errors != r->errors)
      fuzz_fail("counts not copied", "");
    for (size_t i = 0; i < out.n_counts; i++) {
      if (out.counts[i].layer >= L || out.counts[i].expert >= E) fuzz_fail("count outside the model", "");
      if (out.counts[i].tokens != r->counts[i]->tokens) fuzz_fail("tokens differ", "");
    }
    /* 1.4: every client copied, bounded and free of control bytes. */
    if (out.n_clients != r->n_clients) fuzz_fail("clients not copied", "");
    for (size_t i = 0; i < out.n_clients; i++) {
      const gc_client_info *ci = &out.clients[i];
      if (strlen(ci->name) > GC_CLIENT_NAME_MAX || strlen(ci->peer) > GC_CLIENT_PEER_MAX)
        fuzz_fail("client field over its limit", ci->name);
      for (const char *q = ci->name; *q; q++)
        if ((unsigned char)*q < 0x20 || *q == 0x7f) fuzz_fail("control byte in client_name", "");
      for (const char *q = ci->peer; *q; q++)
        if ((unsigned char)*q < 0x20 || *q == 0x7f) fuzz_fail("control byte in peer", "");
      if (strcmp(ci->name, r->clients[i]->client_name ? r->clients[i]->client_name : "") != 0)
        fuzz_fail("client_name differs", ci->name);
      if (ci->streams != r->clients[i]->streams) fuzz_fail("streams differ", "");
    }
  }
  gc_stats_close(&out);
  moerpc__v1__stats_reply__free_unpacked(r, NULL);
  return 0;
}
