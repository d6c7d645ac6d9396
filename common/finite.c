/*
 * finite.c - the one scan for NaN and Inf in wire-dtype data (f32, f16, bf16), shared by
 * the server (hidden states in, expert outputs out: expert_server/es_validate.c) and the
 * client (every ForwardReply's output: gpu_client/rpc/gc_fanout.c). See mr.h for the
 * contracts and docs/DESIGN.md section 5 ("Finite checks") for where each check runs.
 *
 * An IEEE value (f32, f16 or bf16) is NaN or +-Inf exactly when every bit of its exponent
 * is set, so "all finite" is one integer test per element: (bits & exp_mask) == exp_mask.
 * The scan ORs that test over fixed blocks of MR__FIN_BLOCK elements (a fixed trip count,
 * so that GCC's -O2 vectoriser takes the inner loop: SSE2 at least, 4-8 elements per
 * instruction) and leaves the block at the first hit; only then is the element found and
 * classified, off the fast path. Loads go through memcpy: no alignment is assumed.
 */
#include <string.h>

#include "common/mr.h"

#define MR__FIN_BLOCK 256

typedef struct mr__fp_kind {
  size_t size;       /* bytes per element */
  uint32_t exp_mask; /* every exponent bit */
  uint32_t man_mask; /* every mantissa bit */
  uint32_t sign;     /* the sign bit */
} mr__fp_kind;

static const mr__fp_kind mr__fp_f32 = {4, 0x7f800000u, 0x007fffffu, 0x80000000u};
static const mr__fp_kind mr__fp_f16 = {2, 0x7c00u, 0x03ffu, 0x8000u};
static const mr__fp_kind mr__fp_bf16 = {2, 0x7f80u, 0x007fu, 0x8000u};

static const mr__fp_kind *mr__fp_kind_of(mr_dtype dt) {
  switch (dt) {
    case MR_DTYPE_F32:
      return &mr__fp_f32;
    case MR_DTYPE_F16:
      return &mr__fp_f16;
    case MR_DTYPE_BF16:
      return &mr__fp_bf16;
    default:
      MR_ASSERT(!"mr_nonfinite_find: not a wire dtype");
      return NULL;
  }
}

static bool mr__block_bad32(const uint8_t *p, size_t n, uint32_t m) {
  uint32_t bad = 0;
  if (n == MR__FIN_BLOCK) {
    for (size_t j = 0; j < MR__FIN_BLOCK; j++) {
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

static bool mr__block_bad16(const uint8_t *p, size_t n, uint16_t m) {
  uint16_t bad = 0;
  if (n == MR__FIN_BLOCK) {
    for (size_t j = 0; j < MR__FIN_BLOCK; j++) {
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

static uint32_t mr__fp_bits(const uint8_t *p, const mr__fp_kind *k, size_t i) {
  if (k->size == 4) {
    uint32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
  }
  uint16_t v;
  memcpy(&v, p + 2 * i, 2);
  return v;
}

size_t mr_nonfinite_find(const void *x, mr_dtype dt, size_t n) {
  const mr__fp_kind *k = mr__fp_kind_of(dt);
  const uint8_t *p = x;
  MR_ASSERT(p || n == 0);
  for (size_t i = 0; i < n; i += MR__FIN_BLOCK) {
    size_t len = n - i < MR__FIN_BLOCK ? n - i : MR__FIN_BLOCK;
    bool bad = k->size == 4 ? mr__block_bad32(p + 4 * i, len, k->exp_mask)
                            : mr__block_bad16(p + 2 * i, len, (uint16_t)k->exp_mask);
    if (!bad) continue;
    for (size_t j = i; j < i + len; j++)
      if ((mr__fp_bits(p, k, j) & k->exp_mask) == k->exp_mask) return j;
  }
  return n;
}

const char *mr_nonfinite_name(const void *x, mr_dtype dt, size_t i, uint32_t *bits) {
  const mr__fp_kind *k = mr__fp_kind_of(dt);
  uint32_t b = mr__fp_bits(x, k, i);
  if (bits) *bits = b;
  if ((b & k->exp_mask) != k->exp_mask) return "finite";
  if (b & k->man_mask) return "NaN";
  return b & k->sign ? "-Inf" : "+Inf";
}
