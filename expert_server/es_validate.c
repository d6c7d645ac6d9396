/*
 * es_validate.c - validation of one decoded ForwardRequest against the server's limits.
 *
 * This is the one place where a Forward request from the network is checked (STYLE.md 4):
 * everything the compute thread and the kernels later rely on (ids in range and owned, the
 * lengths of ids, weights and hidden, finite weights) is established here, so the kernels'
 * own checks never fire on peer input. The function is pure (no I/O, no allocation, no
 * globals) so that it can be unit-tested exhaustively and fuzzed in-process.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "proto/pr.h"
#include "expert_server/es.h"

/* Formats an id set for an error message into buf, cut with "..." if it does not fit, so
 * that a message never overflows mr_err.msg however sparse the set is. */
static const char *es__set_str(const mr_idset *s, char *buf, size_t len) {
  mr_idlist w;
  mr_idlist_init(&w, buf, len);
  mr_idlist_add_set(&w, s);
  mr_idlist_end(&w, true);
  return buf;
}

/* Formats the layers served (lim->owned[l] != NULL) the same way, "none" if there are none. */
static const char *es__layers_str(const es_limits *lim, char *buf, size_t len) {
  mr_idlist w;
  mr_idlist_init(&w, buf, len);
  for (uint32_t l = 0; l < lim->num_layers; l++)
    if (lim->owned[l]) mr_idlist_add(&w, l);
  if (mr_idlist_end(&w, true) == 0) snprintf(buf, len, "none");
  return buf;
}

static const char *es__dtype_enum_name(int dt) {
  switch (dt) {
  case MR_DTYPE_UNSPECIFIED: return "DTYPE_UNSPECIFIED";
  case MR_DTYPE_F32: return "DTYPE_F32";
  case MR_DTYPE_F16: return "DTYPE_F16";
  case MR_DTYPE_BF16: return "DTYPE_BF16";
  default: return "unknown";
  }
}

int es_forward_validate(const Moerpc__V1__ForwardRequest *req, size_t hidden_len,
                        const es_limits *lim, mr_err *e) {
  char set[96];
  MR_ASSERT(req && lim && lim->is_moe && lim->owned);

  /* Layer: in range, a MoE layer, and served here. */
  if (req->layer >= lim->num_layers)
    return mr_err_set(e, MR_EINVAL, "layer = %" PRIu32 ", must be < num_layers = %" PRIu32,
                      req->layer, lim->num_layers);
  if (!lim->is_moe[req->layer])
    return mr_err_set(e, MR_EINVAL,
                      "layer = %" PRIu32 " is not a MoE layer of this model (its MLP is dense); "
                      "it has no routed experts",
                      req->layer);
  const mr_idset *owned = lim->owned[req->layer];
  if (!owned)
    return mr_err_set(e, MR_EPRECOND,
                      "layer = %" PRIu32 " is not served by this server (it serves layers %s)",
                      req->layer, es__layers_str(lim, set, sizeof set));

  /* Shape. Products are formed in 64 bits: both factors are < 2^32. */
  if (req->n_tokens == 0)
    return mr_err_set(e, MR_EINVAL, "n_tokens = 0, must be in 1..max_tokens = %" PRIu32,
                      lim->max_tokens);
  uint32_t max_k = lim->max_top_k ? lim->max_top_k : lim->num_experts;
  if (req->top_k == 0 || req->top_k > max_k)
    return mr_err_set(e, MR_EINVAL,
                      "top_k = %" PRIu32 ", must be in 1..max_top_k = %" PRIu32
                      " (num_experts_per_tok x %u, at most num_experts = %" PRIu32 ")",
                      req->top_k, max_k, ES_TOP_K_FACTOR, lim->num_experts);
  if (req->n_tokens > lim->max_tokens)
    return mr_err_set(e, MR_EEXHAUSTED,
                      "n_tokens = %" PRIu32 ", over max_tokens = %" PRIu32
                      " of this server (split the request)",
                      req->n_tokens, lim->max_tokens);
  uint64_t slots = (uint64_t)req->n_tokens * req->top_k;
  if (req->n_expert_ids != slots)
    return mr_err_set(e, MR_EINVAL,
                      "expert_ids has %zu entries, must be n_tokens * top_k = %" PRIu32
                      " * %" PRIu32 " = %" PRIu64,
                      req->n_expert_ids, req->n_tokens, req->top_k, slots);
  if (req->n_weights != slots)
    return mr_err_set(e, MR_EINVAL,
                      "weights has %zu entries, must be n_tokens * top_k = %" PRIu32 " * %" PRIu32
                      " = %" PRIu64,
                      req->n_weights, req->n_tokens, req->top_k, slots);

  /* Ids: first every range, then every ownership (see es.h). */
  for (uint64_t i = 0; i < slots; i++) {
    int32_t id = req->expert_ids[i];
    if (id < -1 || (id >= 0 && (uint32_t)id >= lim->num_experts))
      return mr_err_set(e, MR_EINVAL,
                        "expert_ids[%" PRIu64 "] = %" PRId32
                        ", must be -1 (empty slot) or in 0..%" PRIu32 " (num_experts = %" PRIu32
                        ")",
                        i, id, lim->num_experts - 1, lim->num_experts);
  }
  for (uint64_t i = 0; i < slots; i++) {
    int32_t id = req->expert_ids[i];
    if (id >= 0 && !mr_idset_has(owned, (uint32_t)id))
      return mr_err_set(e, MR_EPRECOND,
                        "expert_ids[%" PRIu64 "] = %" PRId32 ": expert %" PRId32 " of layer %" PRIu32
                        " is not served by this server (it serves experts %s)",
                        i, id, id, req->layer, es__set_str(owned, set, sizeof set));
  }

  /* Payload. */
  int dt = (int)req->dtype;
  if (dt != MR_DTYPE_F32 && dt != MR_DTYPE_F16 && dt != MR_DTYPE_BF16)
    return mr_err_set(e, MR_EINVAL,
                      "dtype = %d (%s), must be DTYPE_F32 (1), DTYPE_F16 (2) or DTYPE_BF16 (3)", dt,
                      es__dtype_enum_name(dt));
  size_t esize = mr_dtype_size((mr_dtype)dt);
  uint64_t want = (uint64_t)req->n_tokens * lim->hidden_size * esize;
  if ((uint64_t)hidden_len != want)
    return mr_err_set(e, MR_EINVAL,
                      "hidden has %zu bytes, must be n_tokens * hidden_size * %zu (%s) = %" PRIu32
                      " * %" PRIu32 " * %zu = %" PRIu64 " bytes",
                      hidden_len, esize, mr_dtype_name((mr_dtype)dt), req->n_tokens,
                      lim->hidden_size, esize, want);

  for (uint64_t i = 0; i < slots; i++)
    if (!isfinite(req->weights[i]))
      return mr_err_set(e, MR_EINVAL, "weights[%" PRIu64 "] = %g, must be finite", i,
                        (double)req->weights[i]);
  return 0;
}

/* ---- finite checks ------------------------------------------------------------------------
 *
 * An IEEE value (f32, f16 or bf16) is NaN or +-Inf exactly when every bit of its exponent is
 * set, so "all finite" is one integer test per element: (bits & exp_mask) == exp_mask. The
 * scan ORs that test over fixed blocks of ES__FIN_BLOCK elements (a fixed trip count, so
 * that GCC's -O2 vectoriser takes the inner loop: SSE2 at least, 4-8 elements per
 * instruction) and leaves the block at the first hit; only then is the element found and
 * classified, off the fast path. Loads go through memcpy: no alignment is assumed.
 */
#define ES__FIN_BLOCK 256

typedef struct es__fp_kind {
  size_t size;       /* bytes per element */
  uint32_t exp_mask; /* every exponent bit */
  uint32_t man_mask; /* every mantissa bit */
  uint32_t sign;     /* the sign bit */
} es__fp_kind;

static const es__fp_kind es__fp_f32 = {4, 0x7f800000u, 0x007fffffu, 0x80000000u};
static const es__fp_kind es__fp_f16 = {2, 0x7c00u, 0x03ffu, 0x8000u};
static const es__fp_kind es__fp_bf16 = {2, 0x7f80u, 0x007fu, 0x8000u};

static bool es__block_bad32(const uint8_t *p, size_t n, uint32_t m) {
  uint32_t bad = 0;
  if (n == ES__FIN_BLOCK) {
    for (size_t j = 0; j < ES__FIN_BLOCK; j++) {
      uint32_t v;
      memcpy(&v, p + 4 * j, 4);
      bad |= (v & m) == m;
    }
  } else {
    for (size_t j = 0; j < n; j++) {
      uint32_t v;
      memcpy(&v, p + 4 * j, 4);
      bad |= (v & m) == m;
    }
  }
  return bad != 0;
}

static bool es__block_bad16(const uint8_t *p, size_t n, uint16_t m) {
  uint16_t bad = 0;
  if (n == ES__FIN_BLOCK) {
    for (size_t j = 0; j < ES__FIN_BLOCK; j++) {
      uint16_t v;
      memcpy(&v, p + 2 * j, 2);
      bad |= (uint16_t)((v & m) == m);
    }
  } else {
    for (size_t j = 0; j < n; j++) {
      uint16_t v;
      memcpy(&v, p + 2 * j, 2);
      bad |= (uint16_t)((v & m) == m);
    }
  }
  return bad != 0;
}

static uint32_t es__fp_bits(const uint8_t *p, const es__fp_kind *k, size_t i) {
  if (k->size == 4) {
    uint32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
  }
  uint16_t v;
  memcpy(&v, p + 2 * i, 2);
  return v;
}

/* The index of the first non-finite element of p[0..n), or n if every one is finite. */
static size_t es__find_nonfinite(const uint8_t *p, const es__fp_kind *k, size_t n) {
  for (size_t i = 0; i < n; i += ES__FIN_BLOCK) {
    size_t len = n - i < ES__FIN_BLOCK ? n - i : ES__FIN_BLOCK;
    bool bad = k->size == 4 ? es__block_bad32(p + 4 * i, len, k->exp_mask)
                            : es__block_bad16(p + 2 * i, len, (uint16_t)k->exp_mask);
    if (!bad) continue;
    for (size_t j = i; j < i + len; j++)
      if ((es__fp_bits(p, k, j) & k->exp_mask) == k->exp_mask) return j;
  }
  return n;
}

/* "NaN", "+Inf" or "-Inf" for the bits of a non-finite value. */
static const char *es__nonfinite_name(uint32_t bits, const es__fp_kind *k) {
  if (bits & k->man_mask) return "NaN";
  return bits & k->sign ? "-Inf" : "+Inf";
}

int es_hidden_check_finite(const void *x, mr_dtype dt, uint32_t n_tokens, uint32_t H, mr_err *e) {
  const es__fp_kind *k = dt == MR_DTYPE_F32    ? &es__fp_f32
                         : dt == MR_DTYPE_F16  ? &es__fp_f16
                         : dt == MR_DTYPE_BF16 ? &es__fp_bf16
                                               : NULL;
  MR_ASSERT(k && (x || (size_t)n_tokens * H == 0)); /* es_forward_validate checked dtype */
  size_t n = (size_t)n_tokens * H;
  size_t i = es__find_nonfinite(x, k, n);
  if (i == n) return 0;
  uint32_t bits = es__fp_bits(x, k, i);
  return mr_err_set(e, MR_EINVAL,
                    "hidden[token %zu, index %zu] = %s (%s bits 0x%0*" PRIx32
                    "): hidden states must be finite",
                    i / H, i % H, es__nonfinite_name(bits, k), mr_dtype_name(dt),
                    (int)(2 * k->size), bits);
}

int es_output_check_finite(const float *y, uint32_t layer, uint32_t n_tokens, uint32_t H,
                           mr_err *e) {
  MR_ASSERT(y || (size_t)n_tokens * H == 0);
  size_t n = (size_t)n_tokens * H;
  size_t i = es__find_nonfinite((const uint8_t *)y, &es__fp_f32, n);
  if (i == n) return 0;
  uint32_t bits = es__fp_bits((const uint8_t *)y, &es__fp_f32, i);
  return mr_err_set(e, MR_ERANGE,
                    "output[token %zu, index %zu] = %s in layer %" PRIu32
                    ": the expert output is not finite in fp32 (hidden states too large for "
                    "this layer's weights); no result",
                    i / H, i % H, es__nonfinite_name(bits, &es__fp_f32), layer);
}
