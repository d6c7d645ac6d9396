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
 * Both checks are the one scan of common/finite.c (mr_nonfinite_find: an integer test of
 * each element's exponent bits, vectorised), run on the bytes as they cross the wire: the
 * gathered payload in, the converted output out. The output is checked after the
 * conversion to the wire dtype, not before: an fp32 value over 65504 is finite but becomes
 * +-Inf in f16, and the client must never get that as OK.
 */

int es_hidden_check_finite(const void *x, mr_dtype dt, uint32_t n_tokens, uint32_t H, mr_err *e) {
  MR_ASSERT(dt == MR_DTYPE_F32 || dt == MR_DTYPE_F16 || dt == MR_DTYPE_BF16); /* validated */
  size_t n = (size_t)n_tokens * H;
  size_t i = mr_nonfinite_find(x, dt, n);
  if (i == n) return 0;
  uint32_t bits;
  const char *what = mr_nonfinite_name(x, dt, i, &bits);
  return mr_err_set(e, MR_EINVAL,
                    "hidden[token %zu, index %zu] = %s (%s bits 0x%0*" PRIx32
                    "): hidden states must be finite",
                    i / H, i % H, what, mr_dtype_name(dt), (int)(2 * mr_dtype_size(dt)), bits);
}

int es_output_check_finite(const void *y, mr_dtype dt, const float *y32, uint32_t layer,
                           uint32_t n_tokens, uint32_t H, mr_err *e) {
  size_t n = (size_t)n_tokens * H;
  size_t i = mr_nonfinite_find(y, dt, n);
  if (i == n) return 0;
  const char *what = mr_nonfinite_name(y, dt, i, NULL);
  if (y32 && isfinite(y32[i]))
    /* Finite in fp32, not in the wire dtype: only f16 can do this at sane sizes (bf16
     * overflows only within half an ulp of FLT_MAX). */
    return mr_err_set(e, MR_ERANGE,
                      "output[token %zu, index %zu] = %s in layer %" PRIu32
                      ": the expert output %.6g does not fit the %s wire dtype (largest finite "
                      "%.6g; hidden states or routing weights too large for this layer); no "
                      "result, bf16 and f32 keep fp32's range",
                      i / H, i % H, what, layer, (double)y32[i], mr_dtype_name(dt),
                      dt == MR_DTYPE_F16 ? 65504.0 : 3.38953139e38);
  if (dt == MR_DTYPE_F32 || y32)
    return mr_err_set(e, MR_ERANGE,
                      "output[token %zu, index %zu] = %s in layer %" PRIu32
                      ": the expert output is not finite in fp32 (hidden states too large for "
                      "this layer's weights); no result",
                      i / H, i % H, what, layer);
  return mr_err_set(e, MR_ERANGE,
                    "output[token %zu, index %zu] = %s in layer %" PRIu32
                    ": the expert output is not finite in %s; no result",
                    i / H, i % H, what, layer, mr_dtype_name(dt));
}
