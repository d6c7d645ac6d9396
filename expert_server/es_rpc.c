/*
 * es_rpc.c - answering a unary call: the reply batch, the status helpers, the peer's name for
 * log lines, and the names of the methods. The bottom floor of the gRPC side: es_grpc.c (the
 * unary handlers and the dispatcher) and es_control.c (the control calls) use it, and it
 * calls nothing of this folder but the inline helpers of internal.h.
 *
 * Threads: a unary call's reply is started by the CQ thread that accepted it, except a
 * LoadExperts call, which es-ctl-load answers once it has read the model's headers
 * (es_control.c). Either way gRPC posts the reply's completion (ES_TAG_RPC_DONE) to the
 * call's own completion queue, where the CQ thread frees the call (es__rpc_free). gRPC's
 * own ordering between the two threads is invisible to TSan (it is not instrumented), so
 * es__rpc_reply states it with PR_HB_RELEASE and the dispatcher with PR_HB_ACQUIRE.
 */
#include <grpc/support/alloc.h>
#include <stdio.h>
#include <string.h>

#include "expert_server/internal.h"

static const char *const es__method_paths[ES_M_COUNT] = {
    [ES_M_HELLO] = PR_METHOD_HELLO,
    [ES_M_STATS] = PR_METHOD_STATS,
    [ES_M_HEALTH] = PR_METHOD_HEALTH_CHECK,
    [ES_M_FORWARD] = PR_METHOD_FORWARD,
    [ES_M_LOAD] = PR_METHOD_LOAD_EXPERTS,
    [ES_M_LOAD_STATUS] = PR_METHOD_LOAD_STATUS,
    [ES_M_UNLOAD] = PR_METHOD_UNLOAD_EXPERTS,
};
static const char *const es__method_names[ES_M_COUNT] = {
    [ES_M_HELLO] = "Hello", [ES_M_STATS] = "Stats", [ES_M_HEALTH] = "Health",
    [ES_M_FORWARD] = "Forward", [ES_M_LOAD] = "LoadExperts", [ES_M_LOAD_STATUS] = "LoadStatus",
    [ES_M_UNLOAD] = "UnloadExperts",
};

const char *es__method_path(es_method m) { return es__method_paths[m]; }

const char *es__method_name(es_method m) { return es__method_names[m]; }

void es__rpc_free(es_rpc *r) {
  if (r->payload) grpc_byte_buffer_destroy(r->payload);
  if (r->reply) grpc_byte_buffer_destroy(r->reply);
  grpc_metadata_array_destroy(&r->md);
  grpc_slice_unref(r->details);
  if (r->call) grpc_call_unref(r->call);
  mr_free(r);
}

void es__rpc_reply(es_rpc *r, grpc_status_code status, const char *details,
                   grpc_byte_buffer *reply) {
  grpc_op ops[4];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
  n++;
  if (reply) {
    r->reply = reply;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = reply;
    n++;
  }
  r->details = grpc_slice_from_copied_string(details ? details : "");
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = status;
  ops[n].data.send_status_from_server.status_details = &r->details;
  n++;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n].data.recv_close_on_server.cancelled = &r->cancelled;
  n++;
  /* Once the batch starts, the CQ thread may free r at any moment (see the top): r is not
   * read after the release below unless the batch did not start. */
  grpc_call *call = r->call;
  PR_HB_RELEASE(r);
  grpc_call_error ce = grpc_call_start_batch(call, ops, n, &r->t_done, NULL);
  if (ce != GRPC_CALL_OK) {
    mr_log(MR_LOG_ERROR, "grpc: start_batch for %s reply failed: %d", es__method_path(r->m), ce);
    es_server *s = r->srv;
    es__rpc_free(r);
    es__counter_dec(s, &s->live_calls);
  }
}

void es__rpc_reply_err(es_rpc *r, int rc, const char *what, const mr_err *e) {
  char msg[700];
  snprintf(msg, sizeof msg, "%s: %s", what, e->msg);
  es__rpc_reply(r, pr_status_from_mr(rc), msg, NULL);
}

void es__call_peer(grpc_call *call, char *buf, size_t len) {
  char *p = grpc_call_get_peer(call);
  /* Escaped once here: every log line that names a peer uses this copy. */
  mr_log_escape(buf, len, p ? p : "?", p ? strlen(p) : 1);
  gpr_free(p);
}
