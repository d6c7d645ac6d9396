/*
 * fuzz_load_request.c - libFuzzer target: an LoadRequest (control, protocol 1.2) as the server
 * receives it (a byte buffer of several slices, fuzz_bb.h), decoded by pr_decode with the
 * server's limit (ES_MAX_CONTROL_REQUEST_BYTES_LARGE) and checked as es__on_load does
 * (fuzz_control.h).
 *
 * Accepted = decoded and valid. Checked beyond "no crash, no leak, no UB": a decode failure
 * follows pr_decode's contract (fuzz_pr_decode); a validation failure is MR_EINVAL or
 * MR_EMISMATCH with a message; on success at least one pair is named, every named pair is
 * inside the model and in a MoE layer, and the count is that of the distinct pairs.
 */
#include "tests/fuzz/fuzz_bb.h"
#include "tests/fuzz/fuzz_control.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  grpc_byte_buffer *bb = fuzz_bb_new(data, size);
  if (!bb) return 0;
  Moerpc__V1__LoadRequest *req = (Moerpc__V1__LoadRequest *)fuzz_pr_decode(
      "fuzz_load_request", bb, &moerpc__v1__load_request__descriptor,
      ES_MAX_CONTROL_REQUEST_BYTES_LARGE);
  grpc_byte_buffer_destroy(bb);
  if (!req) return 0;
  fuzz_control_check("fuzz_load_request", req->add, req->n_add, req->model_fingerprint);
  moerpc__v1__load_request__free_unpacked(req, NULL);
  return 0;
}
