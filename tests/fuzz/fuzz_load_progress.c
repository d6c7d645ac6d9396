/*
 * fuzz_load_progress.c - libFuzzer target: the replies of the control RPCs as moerpc-place
 * apply receives them (the reply bytes, gc_control_call), unpacked as pl_apply.c does:
 * the first input byte picks LoadProgress, LoadReply or UnloadReply, the rest is the
 * message. Checked beyond "no crash, no leak, no UB": an accepted message packs again into
 * bytes that decode to the same fields apply reads.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"

static void fuzz_fail(const char *what) {
  fprintf(stderr, "fuzz_load_progress: %s\n", what);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_verdict_set(false);
  if (size < 1) return 0;
  const ProtobufCMessageDescriptor *d = data[0] % 3 == 0 ? &moerpc__v1__load_progress__descriptor
                                        : data[0] % 3 == 1 ? &moerpc__v1__load_reply__descriptor
                                                           : &moerpc__v1__unload_reply__descriptor;
  ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, size - 1, data + 1);
  fuzz_verdict_set(m != NULL);
  if (!m) return 0;
  size_t n = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) abort();
  protobuf_c_message_pack(m, buf);
  ProtobufCMessage *again = protobuf_c_message_unpack(d, NULL, n, buf);
  if (!again && m->n_unknown_fields == 0) fuzz_fail("repacked message does not decode");
  if (again && d == &moerpc__v1__load_progress__descriptor) {
    const Moerpc__V1__LoadProgress *a = (const void *)m, *b = (const void *)again;
    if (a->state != b->state || a->tensors_done != b->tensors_done || a->bytes_done != b->bytes_done ||
        a->bytes_total != b->bytes_total || a->status != b->status ||
        strcmp(a->error ? a->error : "", b->error ? b->error : "") != 0)
      fuzz_fail("repacked LoadProgress differs");
  }
  if (again) protobuf_c_message_free_unpacked(again, NULL);
  free(buf);
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}
