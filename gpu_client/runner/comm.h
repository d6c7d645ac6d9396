/*
 * comm.h - the tensor-parallel communicator of the model runner (prefix gc_comm_): the
 * collective that joins the G ranks of one client process, each rank a thread with its own
 * compute backend (backend.h) holding 1/G of the attention heads and dense MLP columns.
 *
 * The runner's decomposition (gc_model.c, docs/DESIGN.md section 19): per decoder layer
 *   attention: q/k/v rows (heads) split, o_proj columns split -> partial x_r; all_reduce
 *   MLP:       gate/up rows split, down columns split          -> partial y_r; all_reduce
 *   MoE:       router replicated (every rank routes the same, bit for bit), hot experts
 *              split by expert between ranks, shared experts as the MLP; rank 0 alone
 *              sends the cold slots to the servers and adds their sum    -> all_reduce
 * Embedding, norms and the residual stream are replicated; lm_head is rank 0's.
 *
 * Contract of all_reduce_sum:
 *   - every rank calls it with the same n, in the same order of calls;
 *   - it is ordered on the rank's backend like any backend op (a device communicator
 *     enqueues on the backend's stream, gc_bk_ops.native_stream);
 *   - every rank ends with the same bits, so that replicated work (routing) stays
 *     identical across ranks (the CPU communicator sums in rank order 0..G-1; NCCL's ring
 *     reduces each chunk once and hands every rank that result).
 * abort wakes every rank blocked in (or later entering) a collective with MR_ECANCELED, so
 * that one rank's failure ends the step on all of them instead of hanging; a communicator
 * once aborted stays aborted (reopen the model).
 *
 * Implementations: gc_comm_cpu_new (gc_comm_cpu.c: threads of one process over shared
 * memory, for the CPU backend and CI); gc_comm_nccl_new in libmoerpc-cuda.so (kernels/cuda/,
 * ncclCommInitAll over the devices of one host), reached through gc_cuda_lib (backend.h).
 */
#ifndef GC_COMM_H
#define GC_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "common/mr.h"
#include "gpu_client/runner/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Ranks of one client process (tensor-parallel degree). */
#define GC_COMM_MAX_RANKS 16u

typedef struct gc_comm gc_comm;
typedef struct gc_comm_ops {
  const char *name; /* "cpu", "nccl" */
  /* dev[0..n) = sum over ranks of their dev[0..n) (fp32, in place), on b's stream. */
  int (*all_reduce_sum)(gc_comm *c, uint32_t rank, gc_backend *b, float *dev, size_t n,
                        mr_err *e);
  void (*abort)(gc_comm *c);
  void (*destroy)(gc_comm *c);
} gc_comm_ops;

struct gc_comm {
  const gc_comm_ops *ops;
  uint32_t n_ranks;
};

/* The CPU communicator: n_ranks threads of this process (1..GC_COMM_MAX_RANKS). Buffers
 * are host memory (the CPU backend's "device" memory). MR_EINVAL names n_ranks and its
 * limit; MR_ENOMEM. */
int gc_comm_cpu_new(gc_comm **out, uint32_t n_ranks, mr_err *e);

#ifdef __cplusplus
}
#endif
#endif /* GC_COMM_H */
