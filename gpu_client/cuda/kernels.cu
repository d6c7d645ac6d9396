/*
 * kernels.cu - the device kernels of the CUDA backend (internal.h): everything cuBLAS does
 * not do. Elementwise ops, RMSNorm, RoPE, the KV / latent cache stores, causal attention
 * (a split-K decode kernel with a combine pass, and a tiled prefill kernel), the MLA core
 * over the latent cache, routing (one block per token) and the hot experts' gather and
 * deterministic combine.
 *
 * Numerics follow gc_backend_cpu.c op by op: expf (not __expf), RMSNorm's sum of squares
 * in fp64, RoPE's cos / sin of the fp32 angle in fp64, softmax weights of the router from
 * an fp64 sum. What differs is the order of fp32 sums (rounding only).
 *
 * Launch shapes are written next to each kernel. No kernel uses atomics, so every result
 * is the same bits from run to run.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include "gpu_client/runner/backend.h"
#include "gpu_client/cuda/internal.h"

#define FULL_MASK 0xffffffffu

/* Blocks for a grid-stride loop over n items of 256 threads. */
static unsigned grid_for(size_t n) {
  size_t b = (n + 255) / 256;
  if (b > (1u << 20)) b = 1u << 20;
  return b ? (unsigned)b : 1u;
}

static __device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
static __device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

/* Block-wide sum / max of blockDim.x (a multiple of 32, <= 1024) threads; every thread gets
 * the result. red: 32 shared slots. */
template <typename T>
static __device__ T block_sum(T v, T *red) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  __syncthreads(); /* red may hold a previous reduction's values */
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = 0;
  for (unsigned w = 0; w < nw; w++) r += red[w];
  return r;
}
static __device__ float block_max(float v, float *red) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = -INFINITY;
  for (unsigned w = 0; w < nw; w++) r = fmaxf(r, red[w]);
  return r;
}

/* ---- elementwise ----------------------------------------------------------------------- */

__global__ void k_f32_to_bf16(uint16_t *dst, const float *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
}
__global__ void k_f32_to_f16(uint16_t *dst, const float *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dst[i] = __half_as_ushort(__float2half_rn(src[i]));
}
cudaError_t cu__f32_to_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s) {
  if (!n) return cudaSuccess;
  k_f32_to_bf16<<<grid_for(n), 256, 0, s>>>(dst, src, n);
  return cudaGetLastError();
}
/* Two-term bf16 split: hi = bf16(x), lo = bf16(x - hi) (x - hi is exact in fp32), so
 * hi + lo carries x to 2^-17 relative; a bf16 GEMM with fp32 accumulation over the rows of
 * both (the products of bf16 are exact in fp32) gives W x to about fp32 accuracy. hi goes to
 * dst[i], lo to dst[n + i]. */
static __device__ __forceinline__ void split_bf16(float x, uint16_t *hi, uint16_t *lo) {
  const __nv_bfloat16 h = __float2bfloat16_rn(x);
  *hi = __bfloat16_as_ushort(h);
  *lo = __bfloat16_as_ushort(__float2bfloat16_rn(x - __bfloat162float(h)));
}
__global__ void k_split_bf16(uint16_t *dst, const float *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    split_bf16(src[i], dst + i, dst + n + i);
}
cudaError_t cu__split_bf16(uint16_t *dst, const float *src, size_t n, cudaStream_t s) {
  if (!n) return cudaSuccess;
  k_split_bf16<<<grid_for(n), 256, 0, s>>>(dst, src, n);
  return cudaGetLastError();
}
/* y[i] = y2[i] + y2[n + i] (+ bias[i % N]): the two halves of a split GEMM's output. */
__global__ void k_fold(float *y, const float *y2, size_t n, const float *bias, uint32_t N) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float v = y2[i] + y2[n + i];
    if (bias) v += bias[i % N];
    y[i] = v;
  }
}
cudaError_t cu__fold(float *y, const float *y2, size_t n, const float *bias, uint32_t N,
                     cudaStream_t s) {
  if (!n) return cudaSuccess;
  k_fold<<<grid_for(n), 256, 0, s>>>(y, y2, n, bias, N);
  return cudaGetLastError();
}
cudaError_t cu__f32_to_half(void *dst, mr_dtype dt, const float *src, size_t n, cudaStream_t s) {
  if (!n) return cudaSuccess;
  if (dt == MR_DTYPE_BF16) k_f32_to_bf16<<<grid_for(n), 256, 0, s>>>((uint16_t *)dst, src, n);
  else k_f32_to_f16<<<grid_for(n), 256, 0, s>>>((uint16_t *)dst, src, n);
  return cudaGetLastError();
}

__global__ void k_add(float *y, const float *x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] += x[i];
}
cudaError_t cu__add(float *y, const float *x, size_t n, cudaStream_t s) {
  if (!n) return cudaSuccess;
  k_add<<<grid_for(n), 256, 0, s>>>(y, x, n);
  return cudaGetLastError();
}

__global__ void k_bias_add(float *y, const float *bias, size_t total, uint32_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x)
    y[i] += bias[i % n];
}
cudaError_t cu__bias_add(float *y, const float *bias, uint32_t T, uint32_t n, cudaStream_t s) {
  size_t total = (size_t)T * n;
  if (!total) return cudaSuccess;
  k_bias_add<<<grid_for(total), 256, 0, s>>>(y, bias, total, n);
  return cudaGetLastError();
}

/* grid (T), 256 threads over the row */
__global__ void k_embed(float *out, const void *table, bool bf16, uint32_t dim,
                        const int32_t *ids) {
  const size_t row = (size_t)ids[blockIdx.x] * dim;
  float *o = out + (size_t)blockIdx.x * dim;
  for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
    o[i] = bf16 ? __bfloat162float(__ushort_as_bfloat16(((const uint16_t *)table)[row + i]))
                : ((const float *)table)[row + i];
}
cudaError_t cu__embed(float *out, const void *table, bool bf16, uint32_t dim, const int32_t *ids,
                      uint32_t T, cudaStream_t s) {
  if (!T) return cudaSuccess;
  k_embed<<<T, 256, 0, s>>>(out, table, bf16, dim, ids);
  return cudaGetLastError();
}

/* grid (n), 256 threads over the row */
__global__ void k_gather_rows(float *dst, const float *src, uint32_t dim, const uint32_t *rows) {
  const float *x = src + (size_t)rows[blockIdx.x] * dim;
  float *y = dst + (size_t)blockIdx.x * dim;
  for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) y[i] = x[i];
}
cudaError_t cu__gather_rows(float *dst, const float *src, uint32_t dim, const uint32_t *rows,
                            uint32_t n, cudaStream_t s) {
  if (!n) return cudaSuccess;
  k_gather_rows<<<n, 256, 0, s>>>(dst, src, dim, rows);
  return cudaGetLastError();
}

/* grid (rows), 256 threads. Each thread writes only the elements it read, after the
 * reduction's barriers, so that y may equal x. */
__global__ void k_rmsnorm(float *y, size_t ldy, const float *x, size_t ldx, const float *w,
                          uint32_t dim, float eps) {
  __shared__ double red[32];
  const float *xr = x + blockIdx.x * ldx;
  float *yr = y + blockIdx.x * ldy;
  double ss = 0;
  for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) ss += (double)xr[i] * xr[i];
  ss = block_sum<double>(ss, red);
  const float inv = (float)(1.0 / sqrt(ss / dim + (double)eps));
  for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = (xr[i] * inv) * w[i];
}
cudaError_t cu__rmsnorm(float *y, size_t ldy, const float *x, size_t ldx, const float *w,
                        uint32_t rows, uint32_t dim, float eps, cudaStream_t s) {
  if (!rows) return cudaSuccess;
  k_rmsnorm<<<rows, 256, 0, s>>>(y, ldy, x, ldx, w, dim, eps);
  return cudaGetLastError();
}

/* grid (T), threads over the dim / 2 pairs, each looping over the heads. */
__global__ void k_rope(float *x, size_t ld, uint32_t n_heads, uint32_t head_stride,
                       uint32_t offset, uint32_t dim, bool interleave, float scale,
                       const uint32_t *pos, const float *inv_freq) {
  const uint32_t t = blockIdx.x, half = dim / 2;
  const float p = (float)pos[t];
  float *row = x + t * ld + offset;
  const uint32_t lo_step = interleave ? 2 : 1, hi_off = interleave ? 1 : half;
  for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
    const float ang = p * inv_freq[i]; /* fp32 angle, as transformers */
    const float c = (float)cos((double)ang) * scale, sn = (float)sin((double)ang) * scale;
    for (uint32_t h = 0; h < n_heads; h++) {
      float *v = row + (size_t)h * head_stride + (size_t)i * lo_step;
      const float a = v[0], b = v[hi_off];
      v[0] = a * c - b * sn;
      v[hi_off] = b * c + a * sn;
    }
  }
}
cudaError_t cu__rope(float *x, size_t ld, uint32_t T, uint32_t n_heads, uint32_t head_stride,
                     uint32_t offset, uint32_t dim, bool interleave, float scale,
                     const uint32_t *pos, const float *inv_freq, cudaStream_t s) {
  if (!T || dim < 2) return cudaSuccess;
  unsigned th = dim / 2 < 128 ? ((dim / 2 + 31) / 32) * 32 : 128;
  k_rope<<<T, th, 0, s>>>(x, ld, n_heads, head_stride, offset, dim, interleave, scale, pos,
                          inv_freq);
  return cudaGetLastError();
}

__global__ void k_silu_mul(float *h, const float *gu, size_t total, uint32_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t t = i / n, c = i % n;
    const float g = gu[t * 2 * n + c], u = gu[t * 2 * n + n + c];
    h[i] = g / (1.0f + expf(-g)) * u;
  }
}
cudaError_t cu__silu_mul(float *h, const float *gu, uint32_t T, uint32_t n, cudaStream_t s) {
  size_t total = (size_t)T * n;
  if (!total) return cudaSuccess;
  k_silu_mul<<<grid_for(total), 256, 0, s>>>(h, gu, total, n);
  return cudaGetLastError();
}

/* ---- attention ------------------------------------------------------------------------- */

/* grid (T), 256 threads over the row */
__global__ void k_cache_store(float *cache, const float *src, size_t ld, uint32_t w,
                              const uint32_t *seq, const uint32_t *pos, uint32_t max_seq) {
  const uint32_t t = blockIdx.x;
  float *dst = cache + ((size_t)seq[t] * max_seq + pos[t]) * w;
  const float *x = src + (size_t)t * ld;
  for (uint32_t i = threadIdx.x; i < w; i += blockDim.x) dst[i] = x[i];
}
cudaError_t cu__cache_store(float *cache, const float *src, size_t ld, uint32_t w,
                            const uint32_t *seq, const uint32_t *pos, uint32_t max_seq,
                            uint32_t T, cudaStream_t s) {
  if (!T) return cudaSuccess;
  k_cache_store<<<T, 256, 0, s>>>(cache, src, ld, w, seq, pos, max_seq);
  return cudaGetLastError();
}

static __device__ __forceinline__ uint32_t first_key(uint32_t pos, uint32_t window) {
  return window && pos + 1 > window ? pos + 1 - window : 0;
}

/* Split-K decode attention. grid (T, n_heads, n_chunks), 128 threads (4 warps); dynamic
 * shared memory: q [head_dim] + scores [CU_ATTN_CHUNK] + 32 reduction slots.
 *
 *   chunk c of (t, h) covers key positions [c * CHUNK, (c + 1) * CHUNK) of its window:
 *     scores (a warp per key), m = max, p = exp(s - m), l = sum p, o = sum p v
 *   part_o[(t, h), c, :] = o (unnormalised), part_ml[(t, h), c] = (m, l); an empty chunk
 *   writes m = -inf and no o. The combine kernel rescales the chunks to their common max.
 */
__global__ void k_attn_decode(cu__attn_args a, float *part_o, float *part_ml) {
  extern __shared__ float sm[];
  const uint32_t hd = a.head_dim, t = blockIdx.x, h = blockIdx.y, c = blockIdx.z;
  const uint32_t n_chunks = gridDim.z;
  float *qs = sm, *sc = sm + hd, *red = sc + CU_ATTN_CHUNK;
  const uint32_t pos = a.pos[t], first = first_key(pos, a.window);
  uint32_t p0 = c * CU_ATTN_CHUNK, p1 = p0 + CU_ATTN_CHUNK;
  if (p0 < first) p0 = first;
  if (p1 > pos + 1) p1 = pos + 1;
  const size_t item = (size_t)t * a.n_heads + h;
  float *po = part_o + (item * n_chunks + c) * hd;
  float *pml = part_ml + (item * n_chunks + c) * 2;
  if (p0 >= p1) {
    if (threadIdx.x == 0) pml[0] = -INFINITY, pml[1] = 0.0f;
    return;
  }
  const uint32_t n = p1 - p0, kvw = a.n_kv_heads * hd;
  const uint32_t g = h / (a.n_heads / a.n_kv_heads);
  const float *q = a.q + t * a.ld + (size_t)h * hd;
  for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[d];
  __syncthreads();
  const size_t base = (size_t)a.seq[t] * a.max_seq * kvw + (size_t)g * hd;
  const float *kc = a.k_cache + base, *vc = a.v_cache + base;
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (uint32_t i = warp; i < n; i += nw) {
    const float *kr = kc + (size_t)(p0 + i) * kvw;
    float d = 0;
    for (uint32_t j = lane; j < hd; j += 32) d += qs[j] * kr[j];
    d = warp_sum(d);
    if (lane == 0) sc[i] = d * a.scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, sc[i]);
  mx = block_max(mx, red);
  float l = 0;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float p = expf(sc[i] - mx);
    sc[i] = p;
    l += p;
  }
  l = block_sum<float>(l, red); /* its barriers also publish sc */
  for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0;
    for (uint32_t i = 0; i < n; i++) o += sc[i] * vc[(size_t)(p0 + i) * kvw + d];
    po[d] = o;
  }
  if (threadIdx.x == 0) pml[0] = mx, pml[1] = l;
}

/* grid (T * n_heads), 128 threads over head_dim. */
__global__ void k_attn_combine(const float *part_o, const float *part_ml, uint32_t n_chunks,
                               uint32_t hd, float *out) {
  const size_t item = blockIdx.x;
  const float *ml = part_ml + item * n_chunks * 2;
  float M = -INFINITY;
  for (uint32_t c = 0; c < n_chunks; c++) M = fmaxf(M, ml[2 * c]);
  float L = 0;
  for (uint32_t c = 0; c < n_chunks; c++)
    if (ml[2 * c] != -INFINITY) L += ml[2 * c + 1] * expf(ml[2 * c] - M);
  const float inv = 1.0f / L;
  for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0;
    for (uint32_t c = 0; c < n_chunks; c++)
      if (ml[2 * c] != -INFINITY)
        o += part_o[(item * n_chunks + c) * hd + d] * expf(ml[2 * c] - M);
    out[item * hd + d] = o * inv;
  }
}

cudaError_t cu__attn_decode(const cu__attn_args *a, float *part_o, float *part_ml,
                            cudaStream_t s) {
  if (!a->T) return cudaSuccess;
  const uint32_t n_chunks = a->max_pos / CU_ATTN_CHUNK + 1;
  dim3 grid(a->T, a->n_heads, n_chunks);
  size_t smem = (a->head_dim + CU_ATTN_CHUNK + 32) * sizeof(float);
  k_attn_decode<<<grid, 128, smem, s>>>(*a, part_o, part_ml);
  cudaError_t rc = cudaGetLastError();
  if (rc != cudaSuccess) return rc;
  k_attn_combine<<<a->T * a->n_heads, 128, 0, s>>>(part_o, part_ml, n_chunks, a->head_dim,
                                                   a->out);
  return cudaGetLastError();
}

/* Tiled causal prefill attention. grid (n_tiles, n_heads), 256 threads = CU_PREFILL_QT
 * queries x 16 threads. Shared memory (dynamic): Q [QT, hd] | K [KT, hd] | V [KT, hd].
 *
 *   for each key tile kb of [kmin, kmax] (block-uniform bounds):
 *     thread j of a query's 16 scores key kb + j (masked: -inf outside [first, pos]),
 *     online softmax per query: m' = max(m, tile max), f = exp(m - m'), p_j = exp(s_j - m'),
 *     l = l f + sum p_j, acc[d] = acc[d] f + sum_j p_j V[j, d]
 *   each thread owns the output dims d = j + 16 i (i < hd / 16, <= 16 registers).
 * The dot products walk d from a per-thread offset (d + j) mod hd, so that the 16 threads
 * of a query read 16 different banks of K. */
__global__ void k_attn_prefill(cu__attn_args a, const cu__qtile *tiles) {
  extern __shared__ float sm[];
  const cu__qtile tl = tiles[blockIdx.x];
  const uint32_t h = blockIdx.y, hd = a.head_dim, kvw = a.n_kv_heads * hd;
  const uint32_t g = h / (a.n_heads / a.n_kv_heads);
  float *Qs = sm, *Ks = Qs + CU_PREFILL_QT * hd, *Vs = Ks + CU_PREFILL_KT * hd;
  const uint32_t qi = threadIdx.x / 16, lj = threadIdx.x % 16;
  const bool valid = qi < tl.n;
  const uint32_t t = tl.t0 + (valid ? qi : 0);
  for (uint32_t i = threadIdx.x; i < CU_PREFILL_QT * hd; i += blockDim.x) {
    const uint32_t r = i / hd, d = i % hd;
    Qs[i] = r < tl.n ? a.q[(size_t)(tl.t0 + r) * a.ld + (size_t)h * hd + d] : 0.0f;
  }
  const uint32_t pos = a.pos[t], first = first_key(pos, a.window);
  const size_t base = (size_t)a.seq[tl.t0] * a.max_seq * kvw + (size_t)g * hd;
  const float *kc = a.k_cache + base, *vc = a.v_cache + base;
  float m = -INFINITY, l = 0.0f, acc[CU_PREFILL_MAX_HD / 16];
#pragma unroll
  for (int i = 0; i < (int)(CU_PREFILL_MAX_HD / 16); i++) acc[i] = 0.0f;
  const float *qrow = Qs + qi * hd;
  for (uint32_t kb = tl.kmin; kb <= tl.kmax; kb += CU_PREFILL_KT) {
    __syncthreads(); /* the previous tile is consumed (and Q is loaded, the first time) */
    for (uint32_t i = threadIdx.x; i < CU_PREFILL_KT * hd; i += blockDim.x) {
      const uint32_t r = i / hd, d = i % hd, kp = kb + r;
      const bool in = kp <= tl.kmax;
      Ks[i] = in ? kc[(size_t)kp * kvw + d] : 0.0f;
      Vs[i] = in ? vc[(size_t)kp * kvw + d] : 0.0f;
    }
    __syncthreads();
    const uint32_t kp = kb + lj;
    float s = -INFINITY;
    if (valid && kp >= first && kp <= pos) {
      const float *krow = Ks + lj * hd;
      float d = 0.0f;
      uint32_t j = lj % hd;
      for (uint32_t c = 0; c < hd; c++) {
        d += qrow[j] * krow[j];
        if (++j == hd) j = 0;
      }
      s = d * a.scale;
    }
    float mt = s;
    for (int o = 8; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, o, 16));
    const float mn = fmaxf(m, mt);
    const float f = m == -INFINITY ? 0.0f : expf(m - mn);
    const float p = s == -INFINITY ? 0.0f : expf(s - mn);
    float ps = p;
    for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(FULL_MASK, ps, o, 16);
    l = l * f + ps;
#pragma unroll
    for (int i = 0; i < (int)(CU_PREFILL_MAX_HD / 16); i++) acc[i] *= f;
    for (uint32_t j = 0; j < CU_PREFILL_KT; j++) {
      const float pj = __shfl_sync(FULL_MASK, p, (int)j, 16);
      const float *vr = Vs + j * hd;
#pragma unroll
      for (int i = 0; i < (int)(CU_PREFILL_MAX_HD / 16); i++) {
        const uint32_t d = lj + 16u * i;
        if (d < hd) acc[i] += pj * vr[d];
      }
    }
    m = mn;
  }
  if (!valid) return;
  float *o = a.out + (size_t)t * a.n_heads * hd + (size_t)h * hd;
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < (int)(CU_PREFILL_MAX_HD / 16); i++) {
    const uint32_t d = lj + 16u * i;
    if (d < hd) o[d] = acc[i] * inv;
  }
}

cudaError_t cu__attn_prefill(const cu__attn_args *a, const cu__qtile *tiles, uint32_t n_tiles,
                             cudaStream_t s) {
  if (!n_tiles) return cudaSuccess;
  dim3 grid(n_tiles, a->n_heads);
  size_t smem = (size_t)(CU_PREFILL_QT + 2 * CU_PREFILL_KT) * a->head_dim * sizeof(float);
  k_attn_prefill<<<grid, CU_PREFILL_QT * 16, smem, s>>>(*a, tiles);
  return cudaGetLastError();
}

/* MLA core. grid (T, n_heads), 256 threads (8 warps); dynamic shared memory:
 * q_lat [R] | q_rot [rope] | per-warp (m, l) [16] | per-warp acc [8, R].
 * Each warp runs an online softmax over the positions p = warp, warp + 8, ... <= pos with
 * the latent in registers (lane owns r = lane + 32 i); the warps are merged at the end. */
#define MLA_WARPS 8
__global__ void k_mla_core(float *o_lat, const float *q_lat, const float *q, size_t ldq,
                           uint32_t qh, uint32_t nope, uint32_t rope, uint32_t R,
                           const float *cache, uint32_t max_seq, const uint32_t *seq,
                           const uint32_t *pos, float scale) {
  extern __shared__ float sm[];
  const uint32_t t = blockIdx.x, h = blockIdx.y, nh = gridDim.y, lw = R + rope;
  float *ql = sm, *qr = ql + R, *wml = qr + rope, *accw = wml + 2 * MLA_WARPS;
  const size_t item = (size_t)t * nh + h;
  for (uint32_t r = threadIdx.x; r < R; r += blockDim.x) ql[r] = q_lat[item * R + r];
  for (uint32_t r = threadIdx.x; r < rope; r += blockDim.x) qr[r] = q[t * ldq + (size_t)h * qh + nope + r];
  __syncthreads();
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, P = pos[t];
  const float *ct = cache + (size_t)seq[t] * max_seq * lw;
  float m = -INFINITY, l = 0.0f, acc[CU_MLA_MAX_R / 32];
#pragma unroll
  for (int i = 0; i < (int)(CU_MLA_MAX_R / 32); i++) acc[i] = 0.0f;
  for (uint32_t p = warp; p <= P; p += MLA_WARPS) {
    const float *c = ct + (size_t)p * lw;
    float d = 0.0f;
    for (uint32_t r = lane; r < R; r += 32) d += ql[r] * c[r];
    for (uint32_t r = lane; r < rope; r += 32) d += qr[r] * c[R + r];
    const float s = warp_sum(d) * scale;
    const float mn = fmaxf(m, s);
    const float f = m == -INFINITY ? 0.0f : expf(m - mn);
    const float pw = expf(s - mn);
    l = l * f + pw;
#pragma unroll
    for (int i = 0; i < (int)(CU_MLA_MAX_R / 32); i++) {
      const uint32_t r = lane + 32u * i;
      if (r < R) acc[i] = acc[i] * f + pw * c[r];
    }
    m = mn;
  }
  if (lane == 0) wml[2 * warp] = m, wml[2 * warp + 1] = l;
#pragma unroll
  for (int i = 0; i < (int)(CU_MLA_MAX_R / 32); i++) {
    const uint32_t r = lane + 32u * i;
    if (r < R) accw[warp * R + r] = acc[i];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < MLA_WARPS; w++) M = fmaxf(M, wml[2 * w]);
  float L = 0.0f, sc[MLA_WARPS];
  for (int w = 0; w < MLA_WARPS; w++) {
    sc[w] = wml[2 * w] == -INFINITY ? 0.0f : expf(wml[2 * w] - M);
    L += wml[2 * w + 1] * sc[w];
  }
  const float inv = 1.0f / L;
  for (uint32_t r = threadIdx.x; r < R; r += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < MLA_WARPS; w++)
      if (sc[w] != 0.0f) o += accw[w * R + r] * sc[w];
    o_lat[item * R + r] = o * inv;
  }
}

cudaError_t cu__mla_core(float *o_lat, const float *q_lat, const float *q, size_t ldq,
                         uint32_t qh, uint32_t nope, uint32_t rope, uint32_t R,
                         uint32_t n_heads, const float *cache, uint32_t max_seq,
                         const uint32_t *seq, const uint32_t *pos, uint32_t T, float scale,
                         cudaStream_t s) {
  if (!T) return cudaSuccess;
  dim3 grid(T, n_heads);
  size_t smem = ((size_t)R + rope + 2 * MLA_WARPS + (size_t)MLA_WARPS * R) * sizeof(float);
  k_mla_core<<<grid, 32 * MLA_WARPS, smem, s>>>(o_lat, q_lat, q, ldq, qh, nope, rope, R, cache,
                                                max_seq, seq, pos, scale);
  return cudaGetLastError();
}

/* ---- routing --------------------------------------------------------------------------- */

/* The block's best candidate by (value desc, id asc); red: 64 shared slots. Threads pass
 * (-inf, UINT32_MAX) for none; returns the winner's id to every thread. */
static __device__ uint32_t block_argmax(float v, uint32_t x, float *redv, uint32_t *redx) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(FULL_MASK, v, o);
    uint32_t ox = __shfl_xor_sync(FULL_MASK, x, o);
    if (ox != UINT32_MAX && (x == UINT32_MAX || ov > v || (ov == v && ox < x))) v = ov, x = ox;
  }
  __syncthreads();
  if (lane == 0) redv[warp] = v, redx[warp] = x;
  __syncthreads();
  float bv = -INFINITY;
  uint32_t bx = UINT32_MAX;
  for (unsigned w = 0; w < nw; w++)
    if (redx[w] != UINT32_MAX && (bx == UINT32_MAX || redv[w] > bv || (redv[w] == bv && redx[w] < bx)))
      bv = redv[w], bx = redx[w];
  return bx;
}

/* grid (T), 256 threads. work[t] = s [E] | choice [E]: s the sigmoid scores (NOAUX_TC) and
 * choice the selection keys (biased scores, or the logits for GREEDY), a chosen entry being
 * set to NaN so that no comparison picks it again. */
#define ROUTE_THREADS 256
__global__ void k_route(cu__route_args a) {
  __shared__ float redv[32], gkey[GC_ROUTE_MAX_GROUPS];
  __shared__ uint32_t redx[32];
  __shared__ double redd[32];
  __shared__ uint8_t keep[GC_ROUTE_MAX_GROUPS];
  __shared__ int32_t sel[64];
  const uint32_t t = blockIdx.x, E = a.E, k = a.k;
  const float *lg = a.logits + (size_t)t * E;
  float *s = a.work + (size_t)t * 2 * E, *ch = s + E;
  float mx = -INFINITY;
  for (uint32_t x = threadIdx.x; x < E; x += blockDim.x) {
    const float l = lg[x];
    if (a.noaux_tc) {
      const float sv = 1.0f / (1.0f + expf(-l));
      s[x] = sv;
      ch[x] = sv + (a.bias ? a.bias[x] : 0.0f);
    } else {
      ch[x] = l;
      mx = fmaxf(mx, l);
    }
  }
  double sum = 0;
  const bool softmax = !a.noaux_tc && !a.sigmoid;
  if (softmax) {
    mx = block_max(mx, redv);
    for (uint32_t x = threadIdx.x; x < E; x += blockDim.x) sum += expf(lg[x] - mx);
    sum = block_sum<double>(sum, redd);
  }
  const uint32_t G = a.noaux_tc ? a.n_group : 1, per = E / G;
  for (uint32_t gi = threadIdx.x; gi < G; gi += blockDim.x) keep[gi] = G > 1 ? 0 : 1;
  __syncthreads(); /* ch, s and keep are written */
  if (G > 1) {
    for (uint32_t gi = threadIdx.x; gi < G; gi += blockDim.x) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (uint32_t x = gi * per; x < (gi + 1) * per; x++) {
        const float v = ch[x];
        if (v > b1) b2 = b1, b1 = v;
        else if (v > b2) b2 = v;
      }
      gkey[gi] = b1 + b2;
    }
    for (uint32_t j = 0; j < a.topk_group; j++) {
      __syncthreads(); /* gkey is written / the last winner is marked */
      float bv = -INFINITY;
      uint32_t bx = UINT32_MAX;
      for (uint32_t gi = threadIdx.x; gi < G; gi += blockDim.x) {
        const float v = gkey[gi];
        if (v != v) continue; /* taken */
        if (bx == UINT32_MAX || v > bv) bv = v, bx = gi;
      }
      const uint32_t w = block_argmax(bv, bx, redv, redx);
      if (threadIdx.x == 0 && w != UINT32_MAX) keep[w] = 1, gkey[w] = NAN;
    }
    __syncthreads();
  }
  for (uint32_t j = 0; j < k; j++) {
    float bv = -INFINITY;
    uint32_t bx = UINT32_MAX;
    for (uint32_t x = threadIdx.x; x < E; x += blockDim.x) {
      if (!keep[x / per]) continue;
      const float v = ch[x];
      if (v != v) continue; /* taken */
      if (bx == UINT32_MAX || v > bv) bv = v, bx = x; /* x increases: ties keep the lower */
    }
    const uint32_t w = block_argmax(bv, bx, redv, redx);
    if (threadIdx.x == 0) {
      sel[j] = (int32_t)w;
      if (w != UINT32_MAX) ch[w] = NAN;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  int32_t *ids = a.ids + (size_t)t * k;
  float *wt = a.weights + (size_t)t * k;
  float key[64];
  if (a.noaux_tc) {
    for (uint32_t j = 0; j < k; j++) ids[j] = sel[j], key[j] = s[sel[j]];
    /* by weight, ties to the lower id (the CPU's insertion sort) */
    for (uint32_t i = 1; i < k; i++)
      for (uint32_t b = i; b > 0 && (key[b] > key[b - 1] ||
                                     (key[b] == key[b - 1] && ids[b] < ids[b - 1])); b--) {
        float tk = key[b]; key[b] = key[b - 1]; key[b - 1] = tk;
        int32_t ti = ids[b]; ids[b] = ids[b - 1]; ids[b - 1] = ti;
      }
    float sm = 0;
    for (uint32_t j = 0; j < k; j++) sm += (wt[j] = key[j]);
    if (a.norm_topk)
      for (uint32_t j = 0; j < k; j++) wt[j] /= sm + 1e-20f;
  } else {
    float sm = 0;
    for (uint32_t j = 0; j < k; j++) {
      ids[j] = sel[j];
      const float l = lg[sel[j]];
      wt[j] = softmax ? (float)(expf(l - mx) / sum) : 1.0f / (1.0f + expf(-l));
      sm += wt[j];
    }
    if (a.norm_topk)
      for (uint32_t j = 0; j < k; j++) wt[j] /= softmax ? sm : sm + 1e-20f;
  }
  if (a.scale != 1.0f)
    for (uint32_t j = 0; j < k; j++) wt[j] *= a.scale;
}

cudaError_t cu__route(const cu__route_args *a, cudaStream_t s) {
  if (!a->T) return cudaSuccess;
  k_route<<<a->T, ROUTE_THREADS, 0, s>>>(*a);
  return cudaGetLastError();
}

/* ---- hot experts ----------------------------------------------------------------------- */

/* The hot experts' rows. Slot s (grouped by expert) has its bf16 row at rows[s]; with the
 * split, the lo row of slot s is at rows[S + s] (rows == NULL: row s, no split). */
static __device__ __forceinline__ void put_row(uint16_t *dst, const int32_t *rows, uint32_t S,
                                               uint32_t s, uint32_t dim, uint32_t i, float v) {
  if (!rows) {
    dst[(size_t)s * dim + i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    return;
  }
  split_bf16(v, dst + (size_t)rows[s] * dim + i, dst + (size_t)rows[S + s] * dim + i);
}
static __device__ __forceinline__ float get_row(const float *src, const int32_t *rows,
                                                uint32_t S, uint32_t s, uint32_t dim,
                                                uint32_t i) {
  if (!rows) return src[(size_t)s * dim + i];
  return src[(size_t)rows[s] * dim + i] + src[(size_t)rows[S + s] * dim + i];
}

/* grid (S), 256 threads over the row */
__global__ void k_gather_bf16(uint16_t *xs, const float *x, const int32_t *tok,
                              const int32_t *rows, uint32_t S, uint32_t H) {
  const uint32_t s = blockIdx.x;
  const float *r = x + (size_t)tok[s] * H;
  for (uint32_t i = threadIdx.x; i < H; i += blockDim.x) put_row(xs, rows, S, s, H, i, r[i]);
}
cudaError_t cu__gather_bf16(uint16_t *xs, const float *x, const int32_t *tok,
                            const int32_t *rows, uint32_t S, uint32_t H, cudaStream_t s) {
  if (!S) return cudaSuccess;
  k_gather_bf16<<<S, 256, 0, s>>>(xs, x, tok, rows, S, H);
  return cudaGetLastError();
}

/* grid (S), 256 threads over I: hb = bf16 rows of silu(g) * u, gu = the gate_up GEMM's rows */
__global__ void k_ex_silu_mul(uint16_t *hb, const float *gu, const int32_t *rows, uint32_t S,
                              uint32_t I) {
  const uint32_t s = blockIdx.x;
  for (uint32_t c = threadIdx.x; c < I; c += blockDim.x) {
    const float g = get_row(gu, rows, S, s, 2 * I, c), u = get_row(gu, rows, S, s, 2 * I, I + c);
    put_row(hb, rows, S, s, I, c, g / (1.0f + expf(-g)) * u);
  }
}
cudaError_t cu__ex_silu_mul(uint16_t *hb, const float *gu, const int32_t *rows, uint32_t S,
                            uint32_t I, cudaStream_t s) {
  if (!S) return cudaSuccess;
  k_ex_silu_mul<<<S, 256, 0, s>>>(hb, gu, rows, S, I);
  return cudaGetLastError();
}

/* grid (T), 256 threads over H; slot order j = 0..k-1 for every element (deterministic). */
__global__ void k_moe_combine(float *out, const float *y, const int32_t *idx, const float *w,
                              const int32_t *rows, uint32_t S, uint32_t k, uint32_t H) {
  const uint32_t t = blockIdx.x;
  const int32_t *ix = idx + (size_t)t * k;
  const float *wt = w + (size_t)t * k;
  for (uint32_t d = threadIdx.x; d < H; d += blockDim.x) {
    float acc = 0.0f;
    for (uint32_t j = 0; j < k; j++)
      if (ix[j] >= 0) acc += wt[j] * get_row(y, rows, S, (uint32_t)ix[j], H, d);
    out[(size_t)t * H + d] = acc;
  }
}
cudaError_t cu__moe_combine(float *out, const float *y, const int32_t *idx, const float *w,
                            const int32_t *rows, uint32_t S, uint32_t T, uint32_t k,
                            uint32_t H, cudaStream_t s) {
  if (!T) return cudaSuccess;
  k_moe_combine<<<T, 256, 0, s>>>(out, y, idx, w, rows, S, k, H);
  return cudaGetLastError();
}
