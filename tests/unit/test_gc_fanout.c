/*
 * test_gc_fanout.c - the pure parts of the client (gpu_client/gc_fanout.c): the split of a
 * layer call by owner, gather and scatter-add of rows, the finite check of a reply's
 * output, the owner map, the coverage check and its messages, weight-format names. No
 * servers needed.
 */
#include <stdlib.h>
#include <string.h>

#include "gpu_client/rpc/internal.h"
#include "tests/unit/mt.h"

/* ---- the split ---------------------------------------------------------------------------- */

/* The example at the top of gc_fanout.c: experts 0-3 on s0, 4-7 on s1, 8 local. */
static void example_owner(int32_t *owner) {
  for (int x = 0; x < 9; x++) owner[x] = x < 4 ? 0 : x < 8 ? 1 : GC_OWNER_LOCAL;
}

MT_TEST(plan_example) {
  int32_t owner[9];
  example_owner(owner);
  const int32_t ids[] = {0, 2, 1, 5, 6, -1, 8, 3};
  const float w[] = {0.5f, 0.25f, 0.1f, 0.2f, 0.3f, 0.9f, 0.6f, 0.4f};
  mr_arena a;
  mr_arena_init(&a, 4096);
  gc__plan p;
  mr_err err_, *e = &err_;
  MT_OK(gc__plan_build(&p, owner, NULL, 9, 2, 7, 4, 2, ids, w, &a, e), e);
  MT_EQ_INT(p.n_parts, 3);
  MT_EQ_INT(p.n_tokens, 4);
  MT_EQ_INT(p.top_k, 2);

  const gc__part *s0 = &p.parts[0], *s1 = &p.parts[1], *lo = &p.parts[2];
  MT_EQ_INT(s0->target, 0);
  MT_EQ_INT(s1->target, 1);
  MT_EQ_INT(lo->target, GC_OWNER_LOCAL);

  MT_EQ_INT(s0->n_tokens, 3);
  MT_EQ_INT(s0->rows[0], 0);
  MT_EQ_INT(s0->rows[1], 1);
  MT_EQ_INT(s0->rows[2], 3);
  const int32_t s0_ids[] = {0, 2, 1, -1, -1, 3};
  const float s0_w[] = {0.5f, 0.25f, 0.1f, 0.0f, 0.0f, 0.4f};
  for (int i = 0; i < 6; i++) {
    MT_EQ_INT(s0->ids[i], s0_ids[i]);
    MT_NEAR(s0->weights[i], s0_w[i], 0);
  }

  MT_EQ_INT(s1->n_tokens, 2);
  MT_EQ_INT(s1->rows[0], 1);
  MT_EQ_INT(s1->rows[1], 2);
  const int32_t s1_ids[] = {-1, 5, 6, -1};
  for (int i = 0; i < 4; i++) MT_EQ_INT(s1->ids[i], s1_ids[i]);
  MT_NEAR(s1->weights[1], 0.2f, 0);
  MT_NEAR(s1->weights[2], 0.3f, 0);
  MT_NEAR(s1->weights[3], 0.0f, 0); /* the empty slot's weight does not travel */

  MT_EQ_INT(lo->n_tokens, 1);
  MT_EQ_INT(lo->rows[0], 3);
  MT_EQ_INT(lo->ids[0], 8);
  MT_EQ_INT(lo->ids[1], -1);
  MT_NEAR(lo->weights[0], 0.6f, 0);
  mr_arena_close(&a);
}

MT_TEST(plan_parts_only_for_owners_with_tokens) {
  /* Three servers; only server 2 gets slots: one part, rows in order, no local part. */
  int32_t owner[6] = {0, 0, 1, 1, 2, 2};
  const int32_t ids[] = {4, 5, -1, -1, 5, -1};
  const float w[] = {1, 2, 3, 4, 5, 6};
  mr_arena a;
  mr_arena_init(&a, 256); /* small blocks: the plan must survive arena growth */
  gc__plan p;
  mr_err err_, *e = &err_;
  MT_OK(gc__plan_build(&p, owner, NULL, 6, 3, 0, 3, 2, ids, w, &a, e), e);
  MT_EQ_INT(p.n_parts, 1);
  MT_EQ_INT(p.parts[0].target, 2);
  MT_EQ_INT(p.parts[0].n_tokens, 2);
  MT_EQ_INT(p.parts[0].rows[0], 0);
  MT_EQ_INT(p.parts[0].rows[1], 2);
  MT_EQ_INT(p.parts[0].ids[0], 4);
  MT_EQ_INT(p.parts[0].ids[1], 5);
  MT_EQ_INT(p.parts[0].ids[2], 5);
  MT_EQ_INT(p.parts[0].ids[3], -1);
  MT_NEAR(p.parts[0].weights[2], 5, 0);
  mr_arena_close(&a);
}

MT_TEST(plan_all_empty_and_duplicates) {
  int32_t owner[4] = {0, 0, 1, 1};
  const int32_t empty[] = {-1, -1, -1, -1};
  const float w[] = {1, 1, 1, 1};
  mr_arena a;
  mr_arena_init(&a, 4096);
  gc__plan p;
  mr_err err_, *e = &err_;
  MT_OK(gc__plan_build(&p, owner, NULL, 4, 2, 0, 2, 2, empty, w, &a, e), e);
  MT_EQ_INT(p.n_parts, 0);
  MT_EQ_INT(p.n_tokens, 2);
  /* The same expert twice in one token is two slots, both kept. */
  const int32_t dup[] = {3, 3};
  const float wd[] = {0.25f, 0.75f};
  MT_OK(gc__plan_build(&p, owner, NULL, 4, 2, 0, 1, 2, dup, wd, &a, e), e);
  MT_EQ_INT(p.n_parts, 1);
  MT_EQ_INT(p.parts[0].target, 1);
  MT_EQ_INT(p.parts[0].ids[0], 3);
  MT_EQ_INT(p.parts[0].ids[1], 3);
  MT_NEAR(p.parts[0].weights[1], 0.75f, 0);
  mr_arena_close(&a);
}

MT_TEST(plan_errors_name_slot_and_limit) {
  int32_t owner[8] = {0, 0, 0, 0, GC_OWNER_NONE, 1, 1, 1};
  const float w[6] = {0};
  mr_arena a;
  mr_arena_init(&a, 4096);
  gc__plan p;
  mr_err err_, *e = &err_;
  const int32_t too_big[] = {0, 1, 2, 8, 0, 0};
  MT_EQ_INT(gc__plan_build(&p, owner, NULL, 8, 2, 3, 3, 2, too_big, w, &a, e), MR_ERANGE);
  MT_EQ_INT(e->code, MR_ERANGE);
  MT_CONTAINS(e->msg, "layer 3: ids[3] (token 1, slot 1) = 8, must be -1 or < num_experts 8");
  const int32_t negative[] = {0, -2, 0, 0, 0, 0};
  MT_EQ_INT(gc__plan_build(&p, owner, NULL, 8, 2, 3, 3, 2, negative, w, &a, e), MR_ERANGE);
  MT_CONTAINS(e->msg, "ids[1] (token 0, slot 1) = -2");
  const int32_t unowned[] = {0, 1, 2, 3, 5, 4};
  MT_EQ_INT(gc__plan_build(&p, owner, NULL, 8, 2, 3, 3, 2, unowned, w, &a, e), MR_EPRECOND);
  MT_CONTAINS(e->msg, "layer 3 expert 4 (ids[5], token 2) is owned by no server and not local");
  mr_arena_close(&a);
}

/* Property: for a linear "expert" f_x(v) = (x + 1) * v, the per-part results scattered
 * back and summed equal the direct computation, and every non-empty slot lands in exactly
 * one part, at its own slot position. */
static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(uint32_t n) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)(rng % n);
}

MT_TEST(plan_scatter_equals_direct_random) {
  enum { E = 24, NS = 3, H = 5 };
  for (int round = 0; round < 200; round++) {
    int32_t owner[E];
    for (int x = 0; x < E; x++) {
      uint32_t r = rnd(NS + 1);
      owner[x] = r == NS ? GC_OWNER_LOCAL : (int32_t)r;
    }
    uint32_t T = 1 + rnd(40), k = 1 + rnd(8);
    int32_t *ids = malloc(T * k * sizeof *ids);
    float *w = malloc(T * k * sizeof *w);
    float *x = malloc(T * H * sizeof *x);
    float *direct = calloc(T * H, sizeof *direct);
    float *summed = calloc(T * H, sizeof *summed);
    for (uint32_t i = 0; i < T * k; i++) {
      ids[i] = rnd(5) == 0 ? -1 : (int32_t)rnd(E);
      w[i] = (float)(rnd(1000) + 1) / 1000.0f;
    }
    for (uint32_t i = 0; i < T * H; i++) x[i] = (float)rnd(2001) / 1000.0f - 1.0f;
    for (uint32_t t = 0; t < T; t++)
      for (uint32_t j = 0; j < k; j++) {
        int32_t id = ids[t * k + j];
        if (id < 0) continue;
        for (int h = 0; h < H; h++) direct[t * H + h] += w[t * k + j] * (float)(id + 1) * x[t * H + h];
      }

    mr_arena a;
    mr_arena_init(&a, 1024);
    gc__plan p;
    mr_err err_, *e = &err_;
    MT_OK(gc__plan_build(&p, owner, NULL, E, NS, 0, T, k, ids, w, &a, e), e);
    uint32_t seen = 0, nonempty = 0;
    for (uint32_t i = 0; i < T * k; i++) nonempty += ids[i] >= 0;
    int32_t prev_target = -100;
    for (uint32_t pi = 0; pi < p.n_parts; pi++) {
      const gc__part *pt = &p.parts[pi];
      /* Servers in index order, local last. */
      if (pt->target != GC_OWNER_LOCAL) MT_TRUE(pt->target > prev_target);
      if (pi + 1 < p.n_parts) MT_TRUE(pt->target != GC_OWNER_LOCAL);
      prev_target = pt->target;
      MT_TRUE(pt->n_tokens >= 1);
      float *xp = malloc(pt->n_tokens * H * sizeof *xp);
      float *yp = calloc(pt->n_tokens * H, sizeof *yp);
      gc__gather_rows(xp, x, pt->rows, pt->n_tokens, H * sizeof(float));
      for (uint32_t r = 0; r < pt->n_tokens; r++) {
        if (r) MT_TRUE(pt->rows[r] > pt->rows[r - 1]);
        uint32_t t = pt->rows[r];
        bool any = false;
        for (uint32_t j = 0; j < k; j++) {
          int32_t id = pt->ids[r * k + j];
          if (id < 0) continue;
          any = true;
          seen++;
          MT_EQ_INT(id, ids[t * k + j]); /* same slot position */
          MT_EQ_INT(owner[id], pt->target);
          MT_NEAR(pt->weights[r * k + j], w[t * k + j], 0);
          for (int h = 0; h < H; h++)
            yp[r * H + h] += pt->weights[r * k + j] * (float)(id + 1) * xp[r * H + h];
        }
        MT_TRUE(any); /* a part holds only tokens with a slot of its own */
      }
      gc__scatter_add(summed, H, pt->rows, pt->n_tokens, yp, MR_DTYPE_F32);
      free(xp);
      free(yp);
    }
    MT_EQ_INT(seen, nonempty);
    for (uint32_t i = 0; i < T * H; i++) MT_NEAR(summed[i], direct[i], 1e-5 * (1 + fabsf(direct[i])));
    mr_arena_close(&a);
    free(ids);
    free(w);
    free(x);
    free(direct);
    free(summed);
  }
}

/* ---- gather / scatter ---------------------------------------------------------------------- */

MT_TEST(gather_rows_runs_and_gaps) {
  uint16_t src[6][3];
  for (int r = 0; r < 6; r++)
    for (int c = 0; c < 3; c++) src[r][c] = (uint16_t)(r * 10 + c);
  const uint32_t rows[] = {0, 1, 2, 4, 5};
  uint16_t dst[5][3];
  gc__gather_rows(dst, src, rows, 5, sizeof src[0]);
  for (int i = 0; i < 5; i++)
    for (int c = 0; c < 3; c++) MT_EQ_INT(dst[i][c], rows[i] * 10 + c);
}

MT_TEST(scatter_add_dtypes) {
  enum { H = 4 };
  float out[3 * H];
  memset(out, 0, sizeof out);
  const uint32_t rows_a[] = {0, 2}, rows_b[] = {2};
  const float a[2 * H] = {1, 2, 3, 4, -1, -2, -3, -4};
  gc__scatter_add(out, H, rows_a, 2, a, MR_DTYPE_F32);
  uint16_t b16[H], h16[H];
  const float b[H] = {0.5f, 0.25f, 1.5f, -8.0f};
  for (int h = 0; h < H; h++) {
    b16[h] = mr_f32_to_bf16(b[h]);
    h16[h] = mr_f32_to_f16(b[h]);
  }
  gc__scatter_add(out, H, rows_b, 1, b16, MR_DTYPE_BF16);
  gc__scatter_add(out, H, rows_b, 1, h16, MR_DTYPE_F16);
  for (int h = 0; h < H; h++) {
    MT_NEAR(out[0 * H + h], a[h], 0);
    MT_NEAR(out[1 * H + h], 0, 0); /* a token nobody answered for stays 0 */
    MT_NEAR(out[2 * H + h], a[H + h] + 2 * b[h], 0); /* exact in both 16-bit formats */
  }
}

/* ---- the owner map ------------------------------------------------------------------------- */

/* Every OK reply is checked before it is summed: a NaN or an Inf in any wire dtype, at any
 * position, is MR_EPROTO naming the reply row, the call's token and the index; the
 * largest finite values, denormals and -0 pass. */
MT_TEST(reply_check_finite_every_dtype_names_row_and_token) {
  enum { N = 3, HH = 300 }; /* over one block of the scan (256) and not a multiple */
  static uint8_t y[N * HH * 4];
  const uint32_t rows[N] = {2, 5, 11};
  static const struct {
    mr_dtype dt;
    uint32_t maxfin, denorm, nzero, qnan, pinf, ninf;
  } k[] = {{MR_DTYPE_F32, 0x7f7fffffu, 1, 0x80000000u, 0x7fc00000u, 0x7f800000u, 0xff800000u},
           {MR_DTYPE_F16, 0x7bffu, 1, 0x8000u, 0x7e00u, 0x7c00u, 0xfc00u},
           {MR_DTYPE_BF16, 0x7f7fu, 1, 0x8000u, 0x7fc0u, 0x7f80u, 0xff80u}};
  for (size_t q = 0; q < 3; q++) {
    size_t es = mr_dtype_size(k[q].dt);
    const uint32_t pat[] = {k[q].maxfin, k[q].denorm, k[q].nzero, 0};
    struct { size_t at; uint32_t bits; const char *want; } bad[] = {
        {0, k[q].qnan, "reply output[row 0 (token 2 of the call), index 0] = NaN"},
        {HH + 299, k[q].pinf, "reply output[row 1 (token 5 of the call), index 299] = +Inf"},
        {N * HH - 1, k[q].ninf, "reply output[row 2 (token 11 of the call), index 299] = -Inf"},
        {SIZE_MAX, 0, NULL}};
    for (size_t b = 0; b < 4; b++) {
      for (size_t i = 0; i < (size_t)N * HH; i++) {
        uint32_t v = i == bad[b].at ? bad[b].bits : pat[i % 4];
        if (es == 4) memcpy(y + 4 * i, &v, 4);
        else {
          uint16_t h = (uint16_t)v;
          memcpy(y + 2 * i, &h, 2);
        }
      }
      mr_err e;
      mr_err_clear(&e);
      int rc = gc__reply_check_finite(y, k[q].dt, rows, N, HH, &e);
      if (!bad[b].want) {
        MT_OK(rc, &e);
        continue;
      }
      MT_EQ_INT(rc, MR_EPROTO);
      MT_CONTAINS(e.msg, bad[b].want);
      MT_CONTAINS(e.msg, mr_dtype_name(k[q].dt));
      MT_CONTAINS(e.msg, "finite values only");
    }
  }
  mr_err e;
  MT_OK(gc__reply_check_finite(NULL, MR_DTYPE_F32, NULL, 0, 64, &e), &e); /* nothing */
}

MT_TEST(owner_build_local_first_then_first_server) {
  enum { L = 2, E = 4 };
  uint64_t s0[1] = {0}, s1[1] = {0};
  /* s0 announces layer 0 experts 0-2; s1 announces layer 0 experts 2-3 and layer 1 all. */
  for (int x = 0; x < 3; x++) s0[0] |= 1ull << (0 * E + x);
  for (int x = 2; x < 4; x++) s1[0] |= 1ull << (0 * E + x);
  for (int x = 0; x < 4; x++) s1[0] |= 1ull << (1 * E + x);
  const uint64_t *ann[2] = {s0, s1};
  uint8_t local[L * E] = {0};
  local[1 * E + 3] = 1;
  int32_t owner[L * E];
  uint64_t assigned[2];
  gc__owner_build(owner, L, E, 2, ann, local, NULL, assigned);
  const int32_t want[L * E] = {0, 0, 0, 1, 1, 1, 1, GC_OWNER_LOCAL};
  for (int i = 0; i < L * E; i++) MT_EQ_INT(owner[i], want[i]);
  MT_EQ_INT(assigned[0], 3);
  MT_EQ_INT(assigned[1], 4);
  /* Without local experts, layer 1 expert 3 goes to s1. */
  gc__owner_build(owner, L, E, 2, ann, NULL, NULL, NULL);
  MT_EQ_INT(owner[1 * E + 3], 1);
}

/* ---- coverage -------------------------------------------------------------------------------- */

MT_TEST(coverage_messages) {
  enum { L = 6, E = 8 };
  int32_t owner[L * E];
  char msg[512];
  for (int i = 0; i < L * E; i++) owner[i] = 0;
  MT_EQ_INT(gc__coverage_check(owner, L, E, NULL, msg, sizeof msg), 0);
  MT_EQ_STR(msg, "");

  /* Layer 3 misses experts 4-7: the message of the issue. */
  for (int x = 4; x < 8; x++) owner[3 * E + x] = GC_OWNER_NONE;
  MT_EQ_INT(gc__coverage_check(owner, L, E, NULL, msg, sizeof msg), 1);
  MT_EQ_STR(msg, "layer 3: experts 4-7 are owned by no server and not local");

  /* One expert, and a gap list. */
  owner[5 * E + 2] = GC_OWNER_NONE;
  owner[5 * E + 0] = GC_OWNER_LOCAL; /* local counts as covered */
  owner[3 * E + 1] = GC_OWNER_NONE;
  MT_EQ_INT(gc__coverage_check(owner, L, E, NULL, msg, sizeof msg), 2);
  MT_EQ_STR(msg, "layer 3: experts 1,4-7 are owned by no server and not local; "
                 "layer 5: expert 2 is owned by no server and not local");
}

MT_TEST(coverage_must_and_unowned_layers) {
  enum { L = 8, E = 4 };
  int32_t owner[L * E];
  uint8_t must[L] = {0};
  char msg[512];
  for (int i = 0; i < L * E; i++) owner[i] = GC_OWNER_NONE;
  for (int x = 0; x < E; x++) owner[0 * E + x] = 1;
  /* A layer nobody owns at all is fine unless the model says it is an MoE layer. */
  MT_EQ_INT(gc__coverage_check(owner, L, E, NULL, msg, sizeof msg), 0);
  must[2] = 1;
  MT_EQ_INT(gc__coverage_check(owner, L, E, must, msg, sizeof msg), 1);
  MT_EQ_STR(msg, "layer 2: experts 0-3 are owned by no server and not local");
  /* Five bad layers: three described, the rest counted. */
  for (int l = 3; l < 7; l++) must[l] = 1;
  MT_EQ_INT(gc__coverage_check(owner, L, E, must, msg, sizeof msg), 5);
  MT_CONTAINS(msg, "layer 2: experts 0-3");
  MT_CONTAINS(msg, "layer 4: experts 0-3");
  MT_CONTAINS(msg, "; and 2 more incomplete layers");
  MT_TRUE(strstr(msg, "layer 5") == NULL);
  /* A short buffer is truncated, never overrun. */
  char tiny[20];
  memset(tiny, 'x', sizeof tiny);
  MT_EQ_INT(gc__coverage_check(owner, L, E, must, tiny, 12), 5);
  MT_TRUE(strlen(tiny) < 12);
  MT_EQ_INT(tiny[19], 'x');
}

/* ---- weight formats --------------------------------------------------------------------------- */

MT_TEST(weight_format_parse) {
  kn_format f;
  uint32_t g;
  mr_err err_, *e = &err_;
  MT_OK(gc_weight_format_parse("bf16", &f, &g, e), e);
  MT_EQ_INT(f, KN_FMT_BF16);
  MT_OK(gc_weight_format_parse("int8", &f, &g, e), e);
  MT_EQ_INT(f, KN_FMT_INT8);
  MT_OK(gc_weight_format_parse("int4-g64", &f, &g, e), e);
  MT_EQ_INT(f, KN_FMT_INT4);
  MT_EQ_INT(g, 64);
  MT_OK(gc_weight_format_parse("int4-g128", &f, &g, e), e);
  MT_EQ_INT(g, 128);
  MT_EQ_INT(gc_weight_format_parse("int4", &f, &g, e), MR_EINVAL);
  MT_CONTAINS(e->msg, "int4 needs a group");
  MT_EQ_INT(gc_weight_format_parse("int4-g48", &f, &g, e), MR_EINVAL);
  MT_EQ_INT(gc_weight_format_parse("int4-g64x", &f, &g, e), MR_EINVAL);
  MT_OK(gc_weight_format_parse("fp8-b128", &f, &g, e), e); /* DeepSeek-V3 block-scaled fp8 */
  MT_EQ_INT(f, KN_FMT_FP8);
  MT_EQ_INT(g, 0);
  MT_EQ_INT(gc_weight_format_parse("fp8", &f, &g, e), MR_EINVAL); /* a flag alias, not a wire name */
  MT_CONTAINS(e->msg, "weight_format \"fp8\" is unknown");
  MT_CONTAINS(e->msg, "fp8-b128");
  MT_EQ_INT(gc_weight_format_parse("fp8-b64", &f, &g, e), MR_EINVAL);
  MT_EQ_INT(gc_weight_format_parse("", &f, &g, e), MR_EINVAL);
}

/* Deferral split: the K lowest-ranked server slots of each token go to def[]. */
MT_TEST(defer_split_ranks_ties_and_owners) {
  /* experts 0-3 on server 0, 4 on server 1, 5 caller-local, 6 library-local */
  const int32_t owner[7] = {0, 0, 0, 0, 1, GC_OWNER_CALLER, GC_OWNER_LOCAL};
  const uint32_t k = 4;
  const int32_t ids[3 * 4] = {0, 1, 2, 3,    /* weights 0.4 0.3 0.2 0.1: defer 2, 3 */
                              5, 6, 4, 1,    /* lowest two are 4 (server) and 1 (server) */
                              2, 3, -1, 0};  /* ties at 0.25: the latest of three goes */
  const float w[3 * 4] = {0.4f, 0.3f, 0.2f, 0.1f, 0.5f, 0.3f, 0.15f, 0.05f,
                          0.25f, 0.25f, 0.0f, 0.25f};
  int32_t now[12], def[12];
  uint32_t n = gc__defer_split(owner, 7, 3, k, 2, ids, w, now, def);
  const int32_t want_now[12] = {0, 1, -1, -1, 5, 6, -1, -1, 2, 3, -1, -1};
  const int32_t want_def[12] = {-1, -1, 2, 3, -1, -1, 4, 1, -1, -1, -1, 0};
  for (int i = 0; i < 12; i++) {
    MT_EQ_INT(now[i], want_now[i]);
    MT_EQ_INT(def[i], want_def[i]);
  }
  MT_EQ_INT(n, 5);
  /* hot slots in the low ranks are not deferred: only the server ones move */
  const int32_t ids2[4] = {5, 6, 0, 1};
  const float w2[4] = {0.1f, 0.2f, 0.3f, 0.4f};
  n = gc__defer_split(owner, 7, 1, 4, 2, ids2, w2, now, def);
  MT_EQ_INT(n, 0);
  for (int i = 0; i < 4; i++) MT_EQ_INT(now[i], ids2[i]);
  /* K = 0 defers nothing; K >= k defers every server slot */
  MT_EQ_INT(gc__defer_split(owner, 7, 3, k, 0, ids, w, now, def), 0);
  MT_EQ_INT(gc__defer_split(owner, 7, 3, k, 4, ids, w, now, def), 9);
}

MT_MAIN()
