/*
 * test_es_validate.c - es_forward_validate: every kind of bad ForwardRequest gets the right
 * MR code, hence the right gRPC status (pr_status_from_mr), and a message that names the
 * field, the value and the limit; good requests of every dtype pass. The finite checks
 * (es_hidden_check_finite, es_output_check_finite): NaN, +Inf and -Inf in each dtype at the
 * first, a middle and the last position are refused naming the token and the index;
 * denormals, zeros and the largest finite value pass; an fp32 output that is finite but
 * overflows the wire dtype (f16 over 65504) is refused naming the layer and the value.
 *
 * Limits used: H = 64, E = 16, max_tokens 32; 6 layers: 0-3 MoE and served (experts 0-7),
 * 4 dense, 5 MoE but not served.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "expert_server/es.h"
#include "proto/pr.h"
#include "tests/unit/mt.h"

#define H 64
#define E 16
#define NL 6
#define MAXTOK 32

static const uint8_t is_moe[NL] = {1, 1, 1, 1, 0, 1};
static mr_idset owned_set;
static const mr_idset *owned[NL];
static es_limits lim;

static void setup(void) {
  mr_err e;
  MT_OK(mr_idset_parse(&owned_set, "0-7", E, "experts", &e), &e);
  for (int l = 0; l < NL; l++) owned[l] = (l <= 3) ? &owned_set : NULL;
  lim = (es_limits){.num_layers = NL, .num_experts = E, .hidden_size = H, .max_tokens = MAXTOK,
                    .is_moe = is_moe, .owned = owned};
}

/* A valid request: T tokens, k slots, ids cycling over the served experts with one empty
 * slot per token, f32. The arrays are static and big enough for T <= MAXTOK + 1, k <= E. */
static int32_t ids[(MAXTOK + 1) * E];
static float w[(MAXTOK + 1) * E];
static Moerpc__V1__ForwardRequest good(uint32_t T, uint32_t k) {
  Moerpc__V1__ForwardRequest r = MOERPC__V1__FORWARD_REQUEST__INIT;
  for (uint32_t i = 0; i < T * k; i++) {
    ids[i] = (i % k == k - 1 && k > 1) ? -1 : (int32_t)(i % 8);
    w[i] = 0.5f;
  }
  r.id = 42;
  r.layer = 1;
  r.n_tokens = T;
  r.top_k = k;
  r.n_expert_ids = r.n_weights = (size_t)T * k;
  r.expert_ids = ids;
  r.weights = w;
  r.dtype = MOERPC__V1__DTYPE__DTYPE_F32;
  return r;
}
static size_t hidden_len(uint32_t T, size_t esize) { return (size_t)T * H * esize; }

/* Checks code, status and that the message holds each of the needles. */
static void expect(const Moerpc__V1__ForwardRequest *r, size_t hlen, int code, int status,
                   const char *n1, const char *n2) {
  mr_err e;
  mr_err_clear(&e);
  int rc = es_forward_validate(r, hlen, &lim, &e);
  fprintf(stderr, "  -> %s (%d): %s\n", mr_err_name(rc), pr_status_from_mr(rc), e.msg);
  MT_EQ_INT(rc, code);
  MT_EQ_INT(e.code, code);
  MT_EQ_INT(pr_status_from_mr(rc), status);
  if (n1) MT_CONTAINS(e.msg, n1);
  if (n2) MT_CONTAINS(e.msg, n2);
}

MT_TEST(good_requests_pass) {
  setup();
  mr_err e;
  Moerpc__V1__ForwardRequest r = good(1, 1);
  MT_OK(es_forward_validate(&r, hidden_len(1, 4), &lim, &e), &e);
  r = good(MAXTOK, 4); /* exactly max_tokens, with empty slots */
  MT_OK(es_forward_validate(&r, hidden_len(MAXTOK, 4), &lim, &e), &e);
  r = good(3, E); /* top_k = num_experts */
  MT_OK(es_forward_validate(&r, hidden_len(3, 4), &lim, &e), &e);
  r = good(5, 2);
  r.dtype = MOERPC__V1__DTYPE__DTYPE_BF16;
  MT_OK(es_forward_validate(&r, hidden_len(5, 2), &lim, &e), &e);
  r.dtype = MOERPC__V1__DTYPE__DTYPE_F16;
  r.layer = 3;
  MT_OK(es_forward_validate(&r, hidden_len(5, 2), &lim, &e), &e);
  /* All slots empty: valid, the output is zeros. */
  r = good(2, 2);
  for (int i = 0; i < 4; i++) ids[i] = -1;
  MT_OK(es_forward_validate(&r, hidden_len(2, 4), &lim, &e), &e);
  /* A NULL error record is allowed. */
  MT_EQ_INT(es_forward_validate(&r, hidden_len(2, 4), &lim, NULL), 0);
  r.layer = 5;
  MT_EQ_INT(es_forward_validate(&r, hidden_len(2, 4), &lim, NULL), MR_EPRECOND);
}

MT_TEST(layer_out_of_range_or_dense_is_invalid_argument) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  r.layer = NL;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "layer = 6", "num_layers = 6");
  r.layer = UINT32_MAX;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "layer = 4294967295", "num_layers = 6");
  r.layer = 4;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "layer = 4", "not a MoE layer");
}

MT_TEST(layer_not_served_is_failed_precondition) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  r.layer = 5;
  expect(&r, hidden_len(2, 4), MR_EPRECOND, 9, "layer = 5", "serves layers 0-3");
}

MT_TEST(shape_fields_are_invalid_argument) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  r.n_tokens = 0;
  expect(&r, 0, MR_EINVAL, 3, "n_tokens = 0", "max_tokens = 32");
  r = good(2, 4);
  r.top_k = 0;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "top_k = 0", "num_experts = 16");
  r.top_k = E + 1;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "top_k = 17", "num_experts = 16");
  r = good(2, 4);
  r.n_expert_ids = 7;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "expert_ids has 7 entries", "n_tokens * top_k = 2 * 4 = 8");
  r = good(2, 4);
  r.n_weights = 9;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "weights has 9 entries", "= 8");
  /* A product that overflows 32 bits is compared in 64: no wrap-around to a small count. */
  r = good(2, 4);
  r.n_tokens = MAXTOK;
  r.top_k = E;
  r.n_expert_ids = r.n_weights = (size_t)MAXTOK * E - 1;
  expect(&r, hidden_len(MAXTOK, 4), MR_EINVAL, 3, "expert_ids has 511 entries", "= 512");
}

MT_TEST(too_many_tokens_is_resource_exhausted) {
  setup();
  Moerpc__V1__ForwardRequest r = good(MAXTOK + 1, 2);
  expect(&r, hidden_len(MAXTOK + 1, 4), MR_EEXHAUSTED, 8, "n_tokens = 33", "max_tokens = 32");
  /* Huge n_tokens with tiny arrays: refused before any length is computed from it. */
  r.n_tokens = UINT32_MAX;
  expect(&r, 0, MR_EEXHAUSTED, 8, "n_tokens = 4294967295", "max_tokens = 32");
}

MT_TEST(expert_id_out_of_range_is_invalid_argument) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  ids[5] = E;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "expert_ids[5] = 16", "0..15 (num_experts = 16)");
  ids[5] = -2;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "expert_ids[5] = -2", "-1 (empty slot)");
  ids[5] = INT32_MIN;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "expert_ids[5] = -2147483648", "0..15");
  /* Range beats ownership: an unowned id earlier in the list does not hide a bad one. */
  ids[0] = 12;
  ids[6] = 99;
  ids[5] = 1;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "expert_ids[6] = 99", "0..15");
}

MT_TEST(expert_not_served_is_failed_precondition) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  ids[6] = 12;
  expect(&r, hidden_len(2, 4), MR_EPRECOND, 9, "expert_ids[6] = 12", "serves experts 0-7");
  mr_err e; /* the layer is named too */
  es_forward_validate(&r, hidden_len(2, 4), &lim, &e);
  MT_CONTAINS(e.msg, "expert 12 of layer 1");
}

MT_TEST(dtype_and_hidden_length_are_invalid_argument) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  r.dtype = MOERPC__V1__DTYPE__DTYPE_UNSPECIFIED;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "dtype = 0 (DTYPE_UNSPECIFIED)", "DTYPE_BF16 (3)");
  r.dtype = (Moerpc__V1__DType)4;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "dtype = 4", "DTYPE_F32 (1)");
  r.dtype = MOERPC__V1__DTYPE__DTYPE_F32;
  expect(&r, hidden_len(2, 4) - 1, MR_EINVAL, 3, "hidden has 511 bytes", "2 * 64 * 4 = 512 bytes");
  expect(&r, 0, MR_EINVAL, 3, "hidden has 0 bytes", "= 512 bytes");
  r.dtype = MOERPC__V1__DTYPE__DTYPE_BF16;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "hidden has 512 bytes", "(bf16) = 2 * 64 * 2 = 256");
}

MT_TEST(non_finite_weight_is_invalid_argument) {
  setup();
  Moerpc__V1__ForwardRequest r = good(2, 4);
  w[2] = NAN;
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "weights[2] = nan", "finite");
  w[2] = 0.5f;
  w[7] = -INFINITY; /* an empty slot's weight is checked too */
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "weights[7] = -inf", "finite");
}

MT_TEST(first_problem_in_documented_order_is_reported) {
  setup();
  /* Everything wrong at once: the layer is reported. */
  Moerpc__V1__ForwardRequest r = good(2, 4);
  r.layer = 4;
  r.n_tokens = 0;
  r.dtype = MOERPC__V1__DTYPE__DTYPE_UNSPECIFIED;
  expect(&r, 3, MR_EINVAL, 3, "layer = 4", NULL);
  /* Not served beats the shape fields. */
  r.layer = 5;
  expect(&r, 3, MR_EPRECOND, 9, "layer = 5", NULL);
  /* Too many tokens beats a length mismatch. */
  r = good(2, 4);
  r.n_tokens = MAXTOK + 5;
  expect(&r, 3, MR_EEXHAUSTED, 8, "n_tokens", NULL);
  /* An unowned id beats a bad dtype; a bad dtype beats the hidden length; the hidden length
   * beats a bad weight. */
  r = good(2, 4);
  ids[1] = 9;
  r.dtype = MOERPC__V1__DTYPE__DTYPE_UNSPECIFIED;
  expect(&r, 3, MR_EPRECOND, 9, "expert_ids[1] = 9", NULL);
  ids[1] = 1;
  w[0] = NAN;
  expect(&r, 3, MR_EINVAL, 3, "dtype = 0", NULL);
  r.dtype = MOERPC__V1__DTYPE__DTYPE_F32;
  expect(&r, 3, MR_EINVAL, 3, "hidden has 3 bytes", NULL);
  expect(&r, hidden_len(2, 4), MR_EINVAL, 3, "weights[0]", NULL);
}

MT_TEST(long_owned_sets_are_cut_not_overflowed) {
  /* 4096 experts, every other one owned: the set spec is ~20 KB; the message stays within
   * mr_err.msg and says that it was cut. */
  static uint8_t moe1[1] = {1};
  mr_idset big;
  MT_EQ_INT(mr_idset_init(&big, 4096), 0);
  for (uint32_t i = 0; i < 4096; i += 2) mr_idset_add(&big, i);
  const mr_idset *own1[1] = {&big};
  es_limits L = {.num_layers = 1, .num_experts = 4096, .hidden_size = 8, .max_tokens = 4,
                 .is_moe = moe1, .owned = own1};
  int32_t id1[1] = {3};
  float w1[1] = {1.0f};
  Moerpc__V1__ForwardRequest r = MOERPC__V1__FORWARD_REQUEST__INIT;
  r.n_tokens = 1;
  r.top_k = 1;
  r.n_expert_ids = r.n_weights = 1;
  r.expert_ids = id1;
  r.weights = w1;
  r.dtype = MOERPC__V1__DTYPE__DTYPE_F32;
  mr_err e;
  MT_EQ_INT(es_forward_validate(&r, 32, &L, &e), MR_EPRECOND);
  MT_CONTAINS(e.msg, "expert_ids[0] = 3");
  MT_CONTAINS(e.msg, "0,2,4,6");
  MT_CONTAINS(e.msg, "...");
  MT_LE(strlen(e.msg), sizeof e.msg - 1);
  mr_idset_close(&big);
}

/* ---- finite checks -------------------------------------------------------------------- */

/* Bit patterns per dtype: NaN (quiet and signalling), +Inf, -Inf, the smallest denormal,
 * the largest finite value (both signs), -0. */
typedef struct fp_bits {
  mr_dtype dt;
  uint32_t qnan, snan, pinf, ninf, denorm, maxfin, nmaxfin, nzero;
} fp_bits;
static const fp_bits kinds[] = {
    {MR_DTYPE_F32, 0x7fc00000u, 0xff800001u, 0x7f800000u, 0xff800000u, 0x00000001u,
     0x7f7fffffu, 0xff7fffffu, 0x80000000u},
    {MR_DTYPE_F16, 0x7e00u, 0xfc01u, 0x7c00u, 0xfc00u, 0x0001u, 0x7bffu, 0xfbffu, 0x8000u},
    {MR_DTYPE_BF16, 0x7fc0u, 0xff81u, 0x7f80u, 0xff80u, 0x0001u, 0x7f7fu, 0xff7fu, 0x8000u},
};

/* T x HH elements of kind k, every one a finite value (a pattern through the denormals,
 * 1.0, the largest finite and -0), except element `at` (if < T * HH) set to `bits`. */
#define FT 5
#define FH 300 /* over one block of the scan (256) and not a multiple: both loops run */
static uint8_t fbuf[FT * FH * 4];
static void fill(const fp_bits *k, size_t at, uint32_t bits) {
  size_t es = mr_dtype_size(k->dt), n = (size_t)FT * FH;
  uint32_t one = k->dt == MR_DTYPE_F32 ? 0x3f800000u : k->dt == MR_DTYPE_F16 ? 0x3c00u : 0x3f80u;
  uint32_t pat[] = {k->denorm, one, k->maxfin, k->nmaxfin, k->nzero, 0};
  for (size_t i = 0; i < n; i++) {
    uint32_t v = i == at ? bits : pat[i % 6];
    if (es == 4) memcpy(fbuf + 4 * i, &v, 4);
    else {
      uint16_t h = (uint16_t)v;
      memcpy(fbuf + 2 * i, &h, 2);
    }
  }
}

MT_TEST(finite_hidden_passes_with_denormals_and_largest_values) {
  for (size_t q = 0; q < sizeof kinds / sizeof kinds[0]; q++) {
    mr_err e;
    mr_err_clear(&e);
    fill(&kinds[q], SIZE_MAX, 0);
    MT_OK(es_hidden_check_finite(fbuf, kinds[q].dt, FT, FH, &e), &e);
    MT_OK(es_hidden_check_finite(fbuf + 1, kinds[q].dt, 0, FH, &e), &e); /* nothing, unaligned */
  }
}

MT_TEST(non_finite_hidden_is_invalid_argument_naming_token_and_index) {
  const size_t n = (size_t)FT * FH;
  const size_t pos[] = {0, n / 2, n - 1, FH - 1, FH};
  for (size_t q = 0; q < sizeof kinds / sizeof kinds[0]; q++) {
    const fp_bits *k = &kinds[q];
    struct { uint32_t bits; const char *name; } bad[] = {
        {k->qnan, "= NaN"}, {k->snan, "= NaN"}, {k->pinf, "= +Inf"}, {k->ninf, "= -Inf"}};
    for (size_t b = 0; b < 4; b++)
      for (size_t p = 0; p < sizeof pos / sizeof pos[0]; p++) {
        fill(k, pos[p], bad[b].bits);
        mr_err e;
        mr_err_clear(&e);
        int rc = es_hidden_check_finite(fbuf, k->dt, FT, FH, &e);
        fprintf(stderr, "  %s at %zu -> %s\n", mr_dtype_name(k->dt), pos[p], e.msg);
        MT_EQ_INT(rc, MR_EINVAL);
        MT_EQ_INT(pr_status_from_mr(rc), 3);
        char want[64];
        snprintf(want, sizeof want, "hidden[token %zu, index %zu] %s", pos[p] / FH, pos[p] % FH,
                 bad[b].name);
        MT_CONTAINS(e.msg, want);
        MT_CONTAINS(e.msg, mr_dtype_name(k->dt));
        MT_CONTAINS(e.msg, "must be finite");
      }
    /* Two bad elements: the first in memory order is named. */
    fill(k, 2 * FH + 7, k->pinf);
    uint32_t v = k->qnan;
    if (k->dt == MR_DTYPE_F32) memcpy(fbuf + 4 * (3 * FH + 1), &v, 4);
    else {
      uint16_t h = (uint16_t)v;
      memcpy(fbuf + 2 * (3 * FH + 1), &h, 2);
    }
    mr_err e;
    MT_EQ_INT(es_hidden_check_finite(fbuf, k->dt, FT, FH, &e), MR_EINVAL);
    MT_CONTAINS(e.msg, "hidden[token 2, index 7] = +Inf");
  }
}

MT_TEST(non_finite_output_names_layer_token_and_index) {
  static float y[3 * 70];
  mr_err e;
  for (size_t i = 0; i < 3 * 70; i++) y[i] = (float)i * 1e30f; /* finite, large */
  y[5] = FLT_MAX;
  MT_OK(es_output_check_finite(y, MR_DTYPE_F32, y, 4, 3, 70, &e), &e);
  y[70 + 69] = INFINITY;
  MT_EQ_INT(es_output_check_finite(y, MR_DTYPE_F32, y, 4, 3, 70, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "output[token 1, index 69] = +Inf in layer 4");
  MT_CONTAINS(e.msg, "not finite in fp32");
  y[2] = NAN;
  MT_EQ_INT(es_output_check_finite(y, MR_DTYPE_F32, NULL, 4, 3, 70, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "output[token 0, index 2] = NaN in layer 4");
  y[2] = -INFINITY;
  MT_EQ_INT(es_output_check_finite(y, MR_DTYPE_F32, y, 0, 3, 70, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "= -Inf in layer 0");
}

/* The issue-23 defect: finite fp32 outputs over 65504 became +-Inf on the f16 wire and went
 * out as OK. The check runs on the converted bytes, so the wire dtype decides: the same
 * fp32 rows pass in f32 and bf16 and are refused in f16, naming layer, token, index and the
 * fp32 value; 65519 still rounds to 65504 (passes), 65520 rounds to Inf (refused). */
MT_TEST(output_that_overflows_the_wire_dtype_is_refused) {
  enum { T = 2, HH = 300 };
  static float y[T * HH];
  static uint8_t wire[T * HH * 4];
  for (size_t i = 0; i < T * HH; i++) y[i] = (float)((int)(i % 13) - 6) * 5000.0f; /* |y| <= 30000 */
  y[HH + 7] = 65519.0f;
  y[HH + 8] = -65519.0f;
  const mr_dtype dts[] = {MR_DTYPE_F32, MR_DTYPE_F16, MR_DTYPE_BF16};
  mr_err e;
  for (size_t q = 0; q < 3; q++) {
    mr_convert_from_f32(wire, dts[q], y, T * HH);
    MT_OK(es_output_check_finite(wire, dts[q], y, 9, T, HH, &e), &e);
  }
  y[HH + 9] = -65520.0f; /* token 1, index 9: -Inf in f16 */
  y[HH + 20] = 3e5f;
  for (size_t q = 0; q < 3; q++) {
    mr_convert_from_f32(wire, dts[q], y, T * HH);
    int rc = es_output_check_finite(wire, dts[q], y, 9, T, HH, &e);
    if (dts[q] != MR_DTYPE_F16) {
      MT_OK(rc, &e);
      continue;
    }
    fprintf(stderr, "  f16: %s\n", e.msg);
    MT_EQ_INT(rc, MR_ERANGE);
    MT_CONTAINS(e.msg, "output[token 1, index 9] = -Inf in layer 9");
    MT_CONTAINS(e.msg, "-65520");
    MT_CONTAINS(e.msg, "does not fit the f16 wire dtype");
    MT_CONTAINS(e.msg, "65504");
    /* Without the fp32 rows the message still names the element and the dtype. */
    MT_EQ_INT(es_output_check_finite(wire, dts[q], NULL, 9, T, HH, &e), MR_ERANGE);
    MT_CONTAINS(e.msg, "output[token 1, index 9] = -Inf in layer 9");
    MT_CONTAINS(e.msg, "not finite in f16");
  }
  /* bf16 overflows only next to FLT_MAX: 3.4e38 rounds up to Inf, fp32 itself is finite. */
  y[3] = 3.4e38f;
  mr_convert_from_f32(wire, MR_DTYPE_BF16, y, T * HH);
  MT_EQ_INT(es_output_check_finite(wire, MR_DTYPE_BF16, y, 2, T, HH, &e), MR_ERANGE);
  MT_CONTAINS(e.msg, "output[token 0, index 3] = +Inf in layer 2");
  MT_CONTAINS(e.msg, "does not fit the bf16 wire dtype");
  mr_convert_from_f32(wire, MR_DTYPE_F32, y, T * HH);
  MT_OK(es_output_check_finite(wire, MR_DTYPE_F32, y, 2, T, HH, &e), &e);
}

MT_MAIN()
