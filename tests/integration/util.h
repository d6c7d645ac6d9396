/*
 * util.h - helpers for the multi-process integration tests: start and stop real
 * moerpc-server processes on loopback, make models, and talk raw gRPC to a server (for
 * requests no well-behaved client would send).
 *
 * Threads: single-threaded; each itu_call owns its own completion queue.
 */
#ifndef ITU_H
#define ITU_H

#include <grpc/grpc.h>
#include <stdbool.h>
#include <sys/types.h>

#include "common/mr.h"
#include "gpu_client/rpc/moerpc_client.h"
#include "proto/pr.h"

/* Path of a built binary: $MOERPC_BIN/name (MOERPC_BIN is set by tests/run.sh). */
const char *itu_bin(const char *name);
/* A fresh temporary directory (mkdtemp under $TMPDIR or /tmp); removed by itu_rm_rf. */
char *itu_tmpdir(void);
void itu_rm_rf(const char *dir);
/* A TCP port on 127.0.0.1 that was free a moment ago. */
int itu_free_port(void);
/* Runs moerpc-mkmodel --out dir with extra flags (space separated); returns its exit code. */
int itu_make_model(const char *dir, const char *flags);

typedef struct itu_server {
  pid_t pid;
  int port;
  char address[64]; /* "127.0.0.1:port" */
  char log[512];    /* path of its stderr log */
} itu_server;
/* Starts moerpc-server --model model --listen 127.0.0.1:<free port> plus extra args
 * (space separated) and waits until its health service answers SERVING (timeout_ms).
 * Returns 0, or -1 with the tail of its log printed. */
int itu_server_start(itu_server *s, const char *model, const char *extra, const char *logdir,
                     int timeout_ms);
/* Starts the server of s again on the same port (after it died or was stopped; a live one
 * is killed first), as itu_server_start. */
int itu_server_restart(itu_server *s, const char *model, const char *extra, const char *logdir,
                       int timeout_ms);
/* MOERPC_ISA for servers started from now on (NULL: inherit). Tests that compare servers
 * with kn_ref at 1e-5 force "ref": fast paths are only within the format tolerances of
 * docs/DESIGN.md section 5 of the reference. */
void itu_server_isa(const char *isa);
/* Host in the --listen of servers started from now on (NULL: 127.0.0.1). The health probe
 * and itu_server.address still use 127.0.0.1, which a wildcard address also serves. */
void itu_server_listen_host(const char *host);
/* How itu_call_open (and so itu_health and itu_server_start's probe) connects from now on:
 * TLS when ca_pem is not NULL (PEM text, not a path; cert_pem/key_pem for mTLS, may be
 * NULL; server_name overrides the name checked, may be NULL), and the metadata
 * "authorization: Bearer <token>" when token is not NULL. All NULL: plaintext, no token.
 * The strings are borrowed until the next call. */
void itu_client_security(const char *ca_pem, const char *cert_pem, const char *key_pem,
                         const char *server_name, const char *token);
/* Sends sig and waits up to timeout_ms for the exit; *status gets the wait status.
 * Kills with SIGKILL after the timeout and returns -1. */
int itu_server_stop(itu_server *s, int sig, int timeout_ms, int *status);
/* Stops the server (SIGSTOP) and returns once every one of its threads has stopped (the
 * wait status says so), or -1 after timeout_ms. kill() alone does not wait: it wakes one
 * thread to start the group stop, and on a busy host the others (the gRPC thread with a
 * request) can run on for milliseconds first. itu_server_resume sends SIGCONT. */
int itu_server_pause(itu_server *s, int timeout_ms);
void itu_server_resume(itu_server *s);

/* Like itu_server_start, without waiting: returns once the process is forked (0, or -1). */
int itu_server_spawn(itu_server *s, const char *model, const char *extra, const char *logdir);

/* Health check of address; returns the serving status or -1 on RPC failure. */
int itu_health(const char *address, int timeout_ms);
/* The same for one service name ("" = the whole server). */
int itu_health_service(const char *address, const char *service, int timeout_ms);

/* Sends len bytes of req to 127.0.0.1:port (len 0: nothing) and reads the answer until the
 * peer closes (10 s at most) into buf (NUL-terminated). Returns the bytes read. */
size_t itu_http(int port, const char *req, size_t len, char *buf, size_t cap);
/* The value of the sample whose text before the value is exactly sample
 * ("moerpc_errors_total{status=\"INTERNAL\"}") in Prometheus text, -1 if absent. */
double itu_metric(const char *text, const char *sample);

/* A raw client call (unary or stream) on its own channel and completion queue. */
typedef struct itu_call {
  grpc_channel *ch;
  grpc_completion_queue *cq;
  grpc_call *call;
  grpc_metadata_array md_initial, md_trailing;
  grpc_status_code status;
  grpc_slice details;
  bool got_initial;
} itu_call;
/* Opens method on address; deadline_ms from now. */
int itu_call_open(itu_call *c, const char *address, const char *method, int deadline_ms);
/* Sends one message (takes ownership of bb). Returns 0 or -1. */
int itu_call_send(itu_call *c, grpc_byte_buffer *bb, int timeout_ms);
/* Receives one message into *bb (NULL at end of stream). Returns 0, or -1 on timeout. */
int itu_call_recv(itu_call *c, grpc_byte_buffer **bb, int timeout_ms);
/* Half-closes, waits for the status (c->status, c->details). */
int itu_call_finish(itu_call *c, int timeout_ms);
void itu_call_close(itu_call *c);
/* One unary call of method on an existing channel (so on its connection, beside whatever else
 * it carries); takes req. Its latency in microseconds when answered OK with a message within
 * deadline_ms, else -1. */
double itu_unary_on(grpc_channel *ch, const char *method, grpc_byte_buffer *req, int deadline_ms);
/* itu_unary_on that also hands over the OK reply's message in *reply (the caller destroys
 * it; NULL when the call did not answer OK with one). */
double itu_unary_reply_on(grpc_channel *ch, const char *method, grpc_byte_buffer *req, int deadline_ms,
                          grpc_byte_buffer **reply);

/* Encodes a ForwardRequest with payload (copied into a malloc'ed buffer released by the
 * slice). */
grpc_byte_buffer *itu_forward_request(uint64_t id, uint32_t layer, uint32_t n_tokens,
                                      uint32_t top_k, const int32_t *ids, size_t n_ids,
                                      const float *w, size_t n_w, int dtype, const void *hidden,
                                      size_t hidden_len);
/* The same with ForwardRequest.budget_us (0 = no deadline). */
grpc_byte_buffer *itu_forward_request_budget(uint64_t id, uint32_t layer, uint32_t n_tokens,
                                         uint32_t top_k, const int32_t *ids, size_t n_ids,
                                         const float *w, size_t n_w, int dtype,
                                         const void *hidden, size_t hidden_len,
                                         uint32_t budget_us);
/* Decodes a ForwardReply; *out (malloc'ed, caller frees) gets the payload. */
int itu_forward_reply(grpc_byte_buffer *bb, Moerpc__V1__ForwardReply **hdr, void **out,
                      size_t *out_len);

/* The first MiB of s's log (a static buffer, overwritten by the next call). */
const char *itu_log_text(const itu_server *s);
/* The port of a server started with --metrics-listen HOST:0 (or 0): read from its
 * "metrics: http://HOST:PORT/metrics" log line, waited for up to timeout_ms; -1 if none.
 * (A port picked free by the test can be taken before the server binds it; 0 cannot.) */
int itu_metrics_port(const itu_server *s, int timeout_ms);
/* LoadExperts of the pairs want[l * E + x] != 0 (L layers, E experts) on the server at
 * address (bearer token from token_file; a cluster file written into dir), waited for
 * until DONE (itu_load_wait, timeout_ms); *pairs gets the distinct pairs the server counted.
 * 0, or -1 with e saying why. */
int itu_load_pairs(const char *address, const char *token_file, const char *dir,
                   const uint8_t *want, uint32_t L, uint32_t E, int timeout_ms, uint64_t *pairs,
                   mr_err *e);
/* Polls LoadStatus of load load_id on server 0 of the control cluster ctl every 10 ms until
 * it is DONE: 0; -1 when it FAILED, a status call failed or timeout_ms passed (e says). */
int itu_load_wait(gc_cluster *ctl, uint64_t load_id, int timeout_ms, mr_err *e);

#endif

#include "kernels/kn.h"
/* The local reference for one layer of a model: loads the experts of `layer` that a's ids
 * name into a kn_layer of `format` (kn_format) and runs kn_ref_moe_forward. Returns 0 or a
 * negative MR code (e names the cause). */
int itu_ref_forward(const char *model, uint32_t layer, kn_format format, uint32_t group,
                    const kn_moe_args *a, mr_err *e);
