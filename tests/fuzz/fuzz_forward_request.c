/*
 * fuzz_forward_request.c - libFuzzer target: a ForwardRequest as the server receives it,
 * split across gRPC slices, decoded (pr_forward_request_decode) and validated
 * (es_forward_validate) against fixed limits.
 *
 * Input layout (what the corpus generator gen_forward_request.c writes):
 *
 *   +--------+--------+------------------------------------------------+
 *   | byte 0 | byte 1 | message bytes                                  |
 *   | nseg-1 | seed   | a serialized ForwardRequest (or anything else) |
 *   +--------+--------+------------------------------------------------+
 *
 * The message is cut into 1 + (byte 0 % 8) segments at points derived from the seed, empty
 * segments included, as gRPC hands a message over in several slices.
 *
 * Limits: H = 64, E = 16, max_tokens 32; 6 layers: 0-3 MoE and served with experts 0-7,
 * 4 dense, 5 MoE not served.
 *
 * Checked beyond "no crash, no leak, no UB": a decode or validation failure carries a
 * non-empty message and one of the documented codes; an accepted request really has the
 * lengths the compute thread will rely on, and its payload can be gathered.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/fuzz/fuzz.h"

#define H 64
#define E 16
#define NL 6
#define MAXTOK 32
#define MAXSEG 8

static void fuzz_fail(const char *what, const char *msg) {
  fprintf(stderr, "fuzz_forward_request: %s: %s\n", what, msg);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const uint8_t is_moe[NL] = {1, 1, 1, 1, 0, 1};
  static mr_idset owned_set;
  static const mr_idset *owned[NL];
  static bool inited;
  if (!inited) {
    if (mr_idset_parse(&owned_set, "0-7", E, "experts", NULL) != 0) abort();
    for (int l = 0; l < NL; l++) owned[l] = l <= 3 ? &owned_set : NULL;
    inited = true;
  }
  const es_limits lim = {.num_layers = NL, .num_experts = E, .hidden_size = H,
                         .max_tokens = MAXTOK, .is_moe = is_moe, .owned = owned};
  fuzz_verdict_set(false); /* until decode and validation accept it */
  if (size < 2) return 0;

  /* Cut points: a small LCG from the seed; sorted so that segments are in order. */
  size_t nseg = 1 + data[0] % MAXSEG;
  uint32_t seed = data[1] * 2654435761u + 1u;
  const uint8_t *msg = data + 2;
  size_t len = size - 2;
  size_t cut[MAXSEG + 1];
  cut[0] = 0;
  cut[nseg] = len;
  for (size_t i = 1; i < nseg; i++) {
    seed = seed * 1664525u + 1013904223u;
    cut[i] = len ? (seed >> 8) % (len + 1) : 0;
  }
  for (size_t i = 1; i < nseg; i++) /* insertion sort of cut[1..nseg) */
    for (size_t j = i; j > 1 && cut[j - 1] > cut[j]; j--) {
      size_t t = cut[j];
      cut[j] = cut[j - 1];
      cut[j - 1] = t;
    }
  /* Each segment is copied to its own heap block so that ASan sees any read past a slice. */
  pr_seg segs[MAXSEG];
  uint8_t *blocks[MAXSEG];
  for (size_t i = 0; i < nseg; i++) {
    size_t n = cut[i + 1] - cut[i];
    blocks[i] = malloc(n ? n : 1);
    if (!blocks[i]) abort();
    memcpy(blocks[i], msg + cut[i], n);
    segs[i] = (pr_seg){blocks[i], n};
  }

  pr_split split;
  memset(&split, 0, sizeof split);
  Moerpc__V1__ForwardRequest *req = NULL;
  mr_err e;
  mr_err_clear(&e);
  int rc = pr_forward_request_decode(segs, nseg, &split, &req, &e);
  if (rc) {
    if (!e.msg[0]) fuzz_fail("decode failed without a message", mr_err_name(rc));
    if (req) fuzz_fail("decode failed but returned a header", e.msg);
  } else {
    mr_err_clear(&e);
    rc = es_forward_validate(req, split.payload.len, &lim, &e);
    if (rc) {
      if (rc != MR_EINVAL && rc != MR_EPRECOND && rc != MR_EEXHAUSTED)
        fuzz_fail("undocumented validation code", mr_err_name(rc));
      if (!e.msg[0]) fuzz_fail("validation failed without a message", mr_err_name(rc));
    } else {
      fuzz_verdict_set(true);
      /* What the compute thread relies on. */
      size_t slots = (size_t)req->n_tokens * req->top_k;
      size_t esize = mr_dtype_size((mr_dtype)req->dtype);
      if (req->n_tokens < 1 || req->n_tokens > MAXTOK || req->n_expert_ids != slots ||
          req->n_weights != slots || esize == 0 || split.payload.len != (size_t)req->n_tokens * H * esize)
        fuzz_fail("accepted a request of the wrong shape", "lengths");
      for (size_t i = 0; i < slots; i++) {
        int32_t id = req->expert_ids[i];
        if (id < -1 || id >= 8) fuzz_fail("accepted an id that is not served", "expert_ids");
      }
      uint8_t *buf = malloc(split.payload.len);
      if (!buf) abort();
      pr_payload_gather(&split.payload, buf);
      free(buf);
    }
    moerpc__v1__forward_request__free_unpacked(req, NULL);
  }
  pr_split_free(&split);
  for (size_t i = 0; i < nseg; i++) free(blocks[i]);
  return 0;
}
