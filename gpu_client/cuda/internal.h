/*
 * kernels/cuda/internal.h - what the files of the CUDA backend share (prefix cu__): the
 * device kernels' launchers (kernels.cu), called by the host side (backend_cuda.cu), and
 * the NCCL communicator's constructor (comm_nccl.c). Nothing here is exported from
 * libmoerpc-cuda.so (built with -fvisibility=hidden; only gc_cuda_lib_get is public).
 *
 * Every launcher enqueues on the stream it is given and returns the launch status
 * (cudaGetLastError after the launch); none of them synchronises. Pointers are device
 * pointers unless the comment says host.
 */
#ifndef CU_INTERNAL_H
#define CU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "common/mr.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The NCCL communicator over devs[0..n) (comm.h; comm_nccl.c). */
struct gc_comm;
int cu__comm_nccl_new(struct gc_comm **out, uint32_t n, const int *devs, mr_err *e);

#ifdef __cplusplus
}

/* ---- elementwise (kernels.cu) ---------------------------------------------------------- */
/* dst[0..n) = bf16(src), round to nearest even. dst holds uint16_t bf16 bit patterns. */
cudaError_t cu__f32_to_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s);
/* The two-term split of the activations (MOERPC_CUDA_ACT=split, the default): dst[i] =
 * bf16(src[i]) and dst[n + i] = bf16(src[i] - dst[i]), so that one bf16 GEMM over both row
 * sets, folded by cu__fold, computes W x to about fp32 accuracy. */
cudaError_t cu__split_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s);
/* y[i] = y2[i] + y2[n + i] (+ bias[i % N] when bias), i < n */
cudaError_t cu__fold(float *y, const float *y2, size_t n, const float *bias, uint32_t N,
                     cudaStream_t s);
/* dst (dtype dt: f16 or bf16 bit patterns) = src converted, round to nearest even. */
cudaError_t cu__f32_to_half(void *dst, mr_dtype dt, const float *src, size_t n, cudaStream_t s);
/* y[0..n) += x[0..n) */
cudaError_t cu__add(float *y, const float *x, size_t n, cudaStream_t s);
/* y[t, i] += bias[i], t < T, i < n */
cudaError_t cu__bias_add(float *y, const float *bias, uint32_t T, uint32_t n, cudaStream_t s);
/* out[t, :] = table[ids[t], :] (table bf16 when bf16, else f32), ids device [T]. */
cudaError_t cu__embed(float *out, const void *table, bool bf16, uint32_t dim, const int32_t *ids,
                      uint32_t T, cudaStream_t s);
/* dst[i, :] = src[rows[i], :], rows device [n]. */
cudaError_t cu__gather_rows(float *dst, const float *src, uint32_t dim, const uint32_t *rows,
                            uint32_t n, cudaStream_t s);
/* y[r, :] = x[r, :] / sqrt(mean(x[r]^2) + eps) * w (one block per row; y may equal x). */
cudaError_t cu__rmsnorm(float *y, size_t ldy, const float *x, size_t ldx, const float *w,
                        uint32_t rows, uint32_t dim, float eps, cudaStream_t s);
/* RoPE in place on T rows (gc_bk_rope), pos device [T]. */
cudaError_t cu__rope(float *x, size_t ld, uint32_t T, uint32_t n_heads, uint32_t head_stride,
                     uint32_t offset, uint32_t dim, bool interleave, float scale,
                     const uint32_t *pos, const float *inv_freq, cudaStream_t s);
/* h[t, i] = silu(gu[t, i]) * gu[t, n + i], fp32 (the hot experts use cu__ex_silu_mul). */
cudaError_t cu__silu_mul(float *h, const float *gu, uint32_t T, uint32_t n, cudaStream_t s);

/* ---- attention (kernels.cu) ------------------------------------------------------------ */
/* cache rows (seq[t] * max_seq + pos[t]) of width w = src rows t of stride ld (T rows). */
cudaError_t cu__cache_store(float *cache, const float *src, size_t ld, uint32_t w,
                            const uint32_t *seq, const uint32_t *pos, uint32_t max_seq,
                            uint32_t T, cudaStream_t s);

typedef struct cu__attn_args {
  uint32_t T, n_heads, n_kv_heads, head_dim, max_seq, window;
  uint32_t max_pos;    /* the largest pos[t] (bounds the decode kernel's chunks) */
  float scale;
  const float *q;      /* [T, *] stride ld */
  size_t ld;
  const float *k_cache, *v_cache;
  const uint32_t *seq, *pos; /* device [T] */
  float *out;          /* [T, n_heads * head_dim] */
} cu__attn_args;
/* Positions per split-K chunk of the decode kernel. */
#define CU_ATTN_CHUNK 256u
/* Split-K decode attention: part_o [T * n_heads, n_chunks, head_dim], part_ml [T * n_heads,
 * n_chunks, 2] scratch with n_chunks = max_pos / CU_ATTN_CHUNK + 1. head_dim <= 8192. */
cudaError_t cu__attn_decode(const cu__attn_args *a, float *part_o, float *part_ml,
                            cudaStream_t s);
/* One query tile of the prefill kernel: tokens t0..t0+n-1 (one sequence slot) and the key
 * positions kmin..kmax that any of them reads. */
typedef struct cu__qtile {
  uint32_t t0, n, kmin, kmax;
} cu__qtile;
#define CU_PREFILL_QT 16u      /* queries per tile */
#define CU_PREFILL_KT 16u      /* keys per shared-memory tile */
#define CU_PREFILL_MAX_HD 256u /* head_dim limit of the prefill kernel */
cudaError_t cu__attn_prefill(const cu__attn_args *a, const cu__qtile *tiles, uint32_t n_tiles,
                             cudaStream_t s);

/* MLA core over the latent cache: o_lat[t, h, :] = sum_p softmax_p(scale * (q_lat[t, h] . c_p +
 * q_rot[t, h] . k_rot_p)) c_p, p <= pos[t]; q_lat [T, n_heads, R], q_rot in q (stride ldq,
 * head stride qh, at offset nope). R <= CU_MLA_MAX_R, rope <= 128. */
#define CU_MLA_MAX_R 1024u
cudaError_t cu__mla_core(float *o_lat, const float *q_lat, const float *q, size_t ldq,
                         uint32_t qh, uint32_t nope, uint32_t rope, uint32_t R,
                         uint32_t n_heads, const float *cache, uint32_t max_seq,
                         const uint32_t *seq, const uint32_t *pos, uint32_t T, float scale,
                         cudaStream_t s);

/* ---- routing and experts (kernels.cu) -------------------------------------------------- */
typedef struct cu__route_args {
  uint32_t T, E, k;
  bool norm_topk, sigmoid, noaux_tc;
  const float *bias;      /* NOAUX_TC, may be NULL */
  uint32_t n_group, topk_group;
  float scale;
  const float *logits;    /* [T, E] */
  float *work;            /* [T, 2E] scratch */
  int32_t *ids;           /* [T, k] out */
  float *weights;         /* [T, k] out */
} cu__route_args;
cudaError_t cu__route(const cu__route_args *a, cudaStream_t s);

/* The hot experts' row maps: rows == NULL, slot s's bf16 row is row s; else (the split)
 * its hi row is rows[s] and its lo row rows[S + s] (per expert, the hi rows of its slots
 * then their lo rows, so that one GEMM per expert covers both), and a GEMM output row of
 * slot s is the sum of its two rows.
 * xs[s, :] = bf16(x[tok[s], :]) (or its split), s < S, rows of H. */
cudaError_t cu__gather_bf16(uint16_t *xs, const float *x, const int32_t *tok,
                            const int32_t *rows, uint32_t S, uint32_t H, cudaStream_t s);
/* hb[s, :] = bf16(silu(g) * u) (or its split) of the gate_up rows gu[s] = g | u, [S, 2I] */
cudaError_t cu__ex_silu_mul(uint16_t *hb, const float *gu, const int32_t *rows, uint32_t S,
                            uint32_t I, cudaStream_t s);
/* out[t, :] = sum_{j < k, idx[t, j] >= 0} w[t, j] * y[idx[t, j], :] in slot order (0 if none). */
cudaError_t cu__moe_combine(float *out, const float *y, const int32_t *idx, const float *w,
                            const int32_t *rows, uint32_t S, uint32_t T, uint32_t k,
                            uint32_t H, cudaStream_t s);
#endif /* __cplusplus */

#endif /* CU_INTERNAL_H */
