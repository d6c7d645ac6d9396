/*
 * itest_shutdown.c - SIGTERM while a stream of pipelined requests is in flight: the server
 * drains (answers every request it accepted, refuses later ones with UNAVAILABLE), every
 * answer reaches the client with a correct result, and the server exits 0.
 *
 * The client keeps one SEND and one RECV in flight on one completion queue (the gRPC rule
 * of at most one of each per call) and sends SIGTERM after the first replies arrive.
 *
 * A batch still computing when the drain times out is waited for: its reply goes out, the
 * queued requests behind it are answered UNAVAILABLE, and nothing accepted is lost.
 */
#include <grpc/byte_buffer.h>
#include <grpc/support/time.h>

#include "tests/integration/util.h"
#include "tests/unit/mt.h"

#define H 64
#define T 16
#define K 4
#define N_REQ 400

enum { TAG_SEND = 1, TAG_RECV = 2, TAG_STATUS = 3 };

/* The model both cases serve: 2 layers x 8 experts, hidden 64, at tmp/model. */
static void make_model(const char *tmp, char *model, size_t len) {
  snprintf(model, len, "%s/model", tmp);
  MT_EQ_INT(itu_make_model(model, "--layers 2 --experts 8 --topk 4 --hidden 64 --inter 64 "
                                  "--vocab 64 --heads 2 --kv-heads 1 --head-dim 32 --seed 3"),
            0);
}

MT_TEST(sigterm_during_stream_loses_no_answered_request) {
  grpc_init();
  itu_server_isa("ref"); /* compared with kn_ref at 1e-5 */
  char *tmp = itu_tmpdir();
  char model[600];
  make_model(tmp, model, sizeof model);
  itu_server srv;
  MT_EQ_INT(itu_server_start(&srv, model, "--experts all --max-tokens 64", tmp, 60000), 0);

  /* One fixed request body, checked against the local reference. */
  static float x[T * H], ref[T * H];
  int32_t ids[T * K];
  float w[T * K];
  for (int i = 0; i < T * H; i++) x[i] = (float)((i * 7919) % 200 - 100) / 100.0f;
  for (int i = 0; i < T * K; i++) {
    ids[i] = (i * 5) % 8;
    w[i] = 0.25f;
  }
  kn_moe_args a = {.n_tokens = T, .top_k = K, .ids = ids, .weights = w, .x = x,
                   .x_dtype = MR_DTYPE_F32, .out = ref};
  mr_err e = {0};
  MT_OK(itu_ref_forward(model, 1, KN_FMT_BF16, 0, &a, &e), &e);

  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  static uint8_t seen[N_REQ + 1];
  int sent = 0, ok = 0, unavailable = 0, other = 0, replies = 0;
  bool stop_sending = false, send_busy = false, recv_busy = false, stream_done = false, signalled = false;
  grpc_byte_buffer *rb = NULL, *send_bb = NULL; /* send_bb lives until its SEND completes */
  grpc_metadata_array md;
  grpc_metadata_array_init(&md);
  uint64_t t_end = mr_now_ns() + 60ull * 1000000000ull;
  while (!stream_done && mr_now_ns() < t_end) {
    if (!send_busy && !stop_sending && sent < N_REQ) {
      send_bb = itu_forward_request((uint64_t)sent + 1, 1, T, K, ids, T * K, w, T * K, 1, x,
                                    sizeof x);
      grpc_op op = {.op = GRPC_OP_SEND_MESSAGE};
      op.data.send_message.send_message = send_bb;
      MT_EQ_INT(grpc_call_start_batch(c.call, &op, 1, (void *)TAG_SEND, NULL), GRPC_CALL_OK);
      send_busy = true;
      sent++;
    }
    if (!recv_busy) {
      grpc_op ops[2];
      size_t n = 0;
      memset(ops, 0, sizeof ops);
      if (!c.got_initial) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n++].data.recv_initial_metadata.recv_initial_metadata = &md;
        c.got_initial = true;
      }
      ops[n].op = GRPC_OP_RECV_MESSAGE;
      ops[n++].data.recv_message.recv_message = &rb;
      MT_EQ_INT(grpc_call_start_batch(c.call, ops, n, (void *)TAG_RECV, NULL), GRPC_CALL_OK);
      recv_busy = true;
    }
    grpc_event ev = grpc_completion_queue_next(
        c.cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(10000, GPR_TIMESPAN)),
        NULL);
    MT_TRUE(ev.type == GRPC_OP_COMPLETE);
    if (ev.tag == (void *)TAG_SEND) {
      send_busy = false;
      grpc_byte_buffer_destroy(send_bb);
      send_bb = NULL;
      if (!ev.success) { /* the stream is closing: stop sending; this one was not sent */
        sent--;
        stop_sending = true;
      }
    } else if (ev.tag == (void *)TAG_RECV) {
      recv_busy = false;
      if (!rb) {
        stream_done = true;
        break;
      }
      Moerpc__V1__ForwardReply *r = NULL;
      void *out = NULL;
      size_t out_len = 0;
      MT_EQ_INT(itu_forward_reply(rb, &r, &out, &out_len), 0);
      grpc_byte_buffer_destroy(rb);
      rb = NULL;
      MT_TRUE(r->id >= 1 && r->id <= (uint64_t)sent);
      MT_EQ_INT(seen[r->id], 0); /* each request answered once */
      seen[r->id] = 1;
      replies++;
      if (r->status == 0) {
        MT_EQ_INT(out_len, sizeof ref);
        MT_LE(kn_rel_l2(out, ref, T * H), 1e-5);
        ok++;
      } else if (r->status == GRPC_STATUS_UNAVAILABLE) {
        unavailable++;
      } else {
        fprintf(stderr, "  unexpected status %u: %s\n", r->status, r->error);
        other++;
      }
      moerpc__v1__forward_reply__free_unpacked(r, NULL);
      free(out);
      if (replies == 20 && !signalled) {
        kill(srv.pid, SIGTERM);
        signalled = true;
      }
      if (replies == sent && sent == N_REQ) break; /* everything answered */
    }
  }
  /* Drain the outstanding ops and read the status. */
  if (recv_busy || send_busy) {
    if (!stream_done) grpc_call_cancel(c.call, NULL);
    while (recv_busy || send_busy) {
      grpc_event ev = grpc_completion_queue_next(c.cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
      if (ev.tag == (void *)TAG_SEND) {
        send_busy = false;
        grpc_byte_buffer_destroy(send_bb);
      }
      if (ev.tag == (void *)TAG_RECV) {
        recv_busy = false;
        if (rb) grpc_byte_buffer_destroy(rb);
      }
    }
  }
  grpc_metadata_array_destroy(&md);
  c.got_initial = true;
  itu_call_finish(&c, 10000);
  fprintf(stderr, "  sent %d, replies %d: ok %d, unavailable %d, other %d; stream status %d\n",
          sent, replies, ok, unavailable, other, c.status);
  itu_call_close(&c);

  int st = 0;
  MT_EQ_INT(itu_server_stop(&srv, 0, 30000, &st), 0); /* signal 0: just wait for the exit */
  MT_TRUE(WIFEXITED(st));
  MT_EQ_INT(WEXITSTATUS(st), 0);
  MT_TRUE(signalled);
  MT_EQ_INT(other, 0);
  MT_TRUE(ok >= 20);
  /* Every request the server counted was answered and the answer arrived: compare with the
   * server's own final count ("... requests N ..." on its stopped line). */
  char cmd[800], line[512] = "";
  snprintf(cmd, sizeof cmd, "grep -E 'stopped' '%s' | tail -n 1", srv.log);
  FILE *p = popen(cmd, "r");
  if (p) {
    if (!fgets(line, sizeof line, p)) line[0] = 0;
    pclose(p);
  }
  fprintf(stderr, "  server: %s", line);
  const char *q = strstr(line, "requests ");
  MT_TRUE(q != NULL);
  long counted = strtol(q + 9, NULL, 10);
  MT_EQ_INT(counted, replies);
  itu_rm_rf(tmp);
  grpc_shutdown();
}

MT_TEST(a_batch_computing_past_the_drain_timeout_is_answered) {
  grpc_init();
  itu_server_isa(NULL);
  char *tmp = itu_tmpdir();
  char model[600];
  make_model(tmp, model, sizeof model);
  /* Every batch takes 3 s; the drain gives up waiting after 0.2 s, so the batch computing
   * then outlives the drain timeout and the 1 s the calls get after it. */
  setenv("MOERPC_TEST_BATCH_DELAY_MS", "3000", 1);
  itu_server srv;
  int rc = itu_server_start(&srv, model, "--experts all --max-tokens 64 --drain-timeout-ms 200",
                            tmp, 60000);
  unsetenv("MOERPC_TEST_BATCH_DELAY_MS");
  MT_EQ_INT(rc, 0);
  /* 48 tokens: over the inline limit (es_inline.c), so each request is queued and is its own
   * batch (two would exceed --max-tokens 64). */
  enum { TB = 48 };
  static float x[TB * H];
  int32_t ids[TB * K];
  float w[TB * K];
  for (int i = 0; i < TB * H; i++) x[i] = (float)(i % 17) / 17.0f;
  for (int i = 0; i < TB * K; i++) {
    ids[i] = i % 8;
    w[i] = 0.25f;
  }
  itu_call c;
  MT_EQ_INT(itu_call_open(&c, srv.address, PR_METHOD_FORWARD, 60000), 0);
  enum { N = 6 };
  for (int i = 0; i < N; i++)
    MT_EQ_INT(itu_call_send(&c, itu_forward_request((uint64_t)i + 1, 1, TB, K, ids, TB * K, w, TB * K,
                                                    1, x, sizeof x), 10000), 0);
  usleep(400 * 1000); /* the first batch is computing */
  uint64_t t0 = mr_now_ns();
  MT_EQ_INT(kill(srv.pid, SIGTERM), 0);
  int ok = 0, unavailable = 0, other = 0, got = 0;
  for (; got < N; got++) {
    grpc_byte_buffer *rb = NULL;
    if (itu_call_recv(&c, &rb, 20000) != 0 || !rb) break;
    Moerpc__V1__ForwardReply *r = NULL;
    void *out = NULL;
    size_t out_len = 0;
    MT_EQ_INT(itu_forward_reply(rb, &r, &out, &out_len), 0);
    ok += r->status == 0;
    unavailable += r->status == GRPC_STATUS_UNAVAILABLE;
    other += r->status != 0 && r->status != GRPC_STATUS_UNAVAILABLE;
    moerpc__v1__forward_reply__free_unpacked(r, NULL);
    free(out);
    grpc_byte_buffer_destroy(rb);
  }
  fprintf(stderr, "  %d replies of %d: ok %d, unavailable %d, other %d after %.2f s\n", got, N, ok,
          unavailable, other, (double)(mr_now_ns() - t0) / 1e9);
  itu_call_finish(&c, 10000);
  itu_call_close(&c);
  int st = 0;
  MT_EQ_INT(itu_server_stop(&srv, 0, 30000, &st), 0);
  MT_EQ_INT(got, N);
  MT_TRUE(ok >= 1); /* the batch that was computing */
  MT_TRUE(unavailable >= 1);
  MT_EQ_INT(other, 0);
  MT_TRUE(WIFEXITED(st));
  MT_EQ_INT(WEXITSTATUS(st), 0); /* 3 would mean an accepted request went unanswered */
  itu_rm_rf(tmp);
  grpc_shutdown();
}

MT_MAIN()
