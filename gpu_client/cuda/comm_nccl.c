/*
 * comm_nccl.c - the NCCL communicator of the model runner (gpu_client/comm.h): one rank per
 * device of this process, over ncclCommInitAll. all_reduce_sum enqueues ncclAllReduce (in
 * place, fp32, sum) on the rank's backend stream (gc_bk_ops.native_stream), so that it is
 * ordered like any backend op; NCCL's ring hands every rank the same bits.
 *
 * Threads: each rank's thread calls all_reduce_sum for its own rank (one thread per
 * device, which NCCL needs no group calls for). abort may come from any thread: it marks
 * the communicator aborted (later calls return MR_ECANCELED at once) and ncclCommAbort's
 * every rank, which ends collectives already running on the devices, so that a rank
 * waiting in its stream's sync returns with an error instead of hanging.
 */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "gpu_client/runner/comm.h"
#include "gpu_client/cuda/internal.h"

typedef struct nccl_comm {
  gc_comm base;
  int devs[GC_COMM_MAX_RANKS];
  ncclComm_t comms[GC_COMM_MAX_RANKS];
  int aborted; /* set once (atomically), never cleared */
} nccl_comm;

static int nccl_fail(mr_err *e, ncclResult_t r, const char *op) {
  return mr_err_set(e, r == ncclSystemError ? MR_EIO : r == ncclInvalidArgument ? MR_EINVAL
                                                                               : MR_EIO,
                    "nccl %s: %s", op, ncclGetErrorString(r));
}

static int nccl_all_reduce_sum(gc_comm *c, uint32_t rank, gc_backend *b, float *dev, size_t n,
                               mr_err *e) {
  nccl_comm *nc = (nccl_comm *)c;
  if (__atomic_load_n(&nc->aborted, __ATOMIC_ACQUIRE))
    return mr_err_set(e, MR_ECANCELED, "nccl all_reduce: the communicator was aborted");
  if (rank >= c->n_ranks)
    return mr_err_set(e, MR_EINVAL, "nccl all_reduce: rank %u, must be < %u", rank, c->n_ranks);
  if (!n) return 0;
  cudaError_t cr = cudaSetDevice(nc->devs[rank]);
  if (cr != cudaSuccess) {
    (void)cudaGetLastError();
    return mr_err_set(e, MR_EIO, "cuda cudaSetDevice(%d): %s", nc->devs[rank],
                      cudaGetErrorString(cr));
  }
  cudaStream_t s = (cudaStream_t)b->ops->native_stream(b);
  ncclResult_t r = ncclAllReduce(dev, dev, n, ncclFloat, ncclSum, nc->comms[rank], s);
  if (r != ncclSuccess) return nccl_fail(e, r, "ncclAllReduce");
  return 0;
}

static void nccl_abort(gc_comm *c) {
  nccl_comm *nc = (nccl_comm *)c;
  if (__atomic_exchange_n(&nc->aborted, 1, __ATOMIC_ACQ_REL)) return;
  for (uint32_t i = 0; i < c->n_ranks; i++)
    if (nc->comms[i]) {
      ncclResult_t r = ncclCommAbort(nc->comms[i]);
      if (r != ncclSuccess)
        mr_log(MR_LOG_ERROR, "nccl ncclCommAbort(rank %u): %s", i, ncclGetErrorString(r));
      nc->comms[i] = NULL;
    }
}

static void nccl_destroy(gc_comm *c) {
  nccl_comm *nc = (nccl_comm *)c;
  if (!nc) return;
  for (uint32_t i = 0; i < c->n_ranks; i++)
    if (nc->comms[i]) {
      ncclResult_t r = ncclCommDestroy(nc->comms[i]);
      if (r != ncclSuccess)
        mr_log(MR_LOG_ERROR, "nccl ncclCommDestroy(rank %u): %s", i, ncclGetErrorString(r));
    }
  mr_free(nc);
}

static const gc_comm_ops nccl_ops = {
    .name = "nccl",
    .all_reduce_sum = nccl_all_reduce_sum,
    .abort = nccl_abort,
    .destroy = nccl_destroy,
};

int cu__comm_nccl_new(gc_comm **out, uint32_t n, const int *devs, mr_err *e) {
  *out = NULL;
  if (n < 1 || n > GC_COMM_MAX_RANKS)
    return mr_err_set(e, MR_EINVAL, "nccl: %u ranks, must be in 1..%u", n, GC_COMM_MAX_RANKS);
  if (!devs) return mr_err_set(e, MR_EINVAL, "nccl: the device list is required");
  int count = 0;
  cudaError_t cr = cudaGetDeviceCount(&count);
  if (cr != cudaSuccess) {
    (void)cudaGetLastError();
    return mr_err_set(e, MR_ENOTSUP, "nccl: no CUDA device (%s)", cudaGetErrorString(cr));
  }
  for (uint32_t i = 0; i < n; i++) {
    if (devs[i] < 0 || devs[i] >= count)
      return mr_err_set(e, MR_ERANGE, "nccl: devs[%u] = %d, this host has %d devices (0..%d)", i,
                        devs[i], count, count - 1);
    for (uint32_t j = 0; j < i; j++)
      if (devs[j] == devs[i])
        return mr_err_set(e, MR_EINVAL, "nccl: device %d is listed twice (ranks %u and %u)",
                          devs[i], j, i);
  }
  nccl_comm *nc = mr_calloc(1, sizeof *nc);
  if (!nc) return mr_err_set(e, MR_ENOMEM, "nccl: out of memory");
  nc->base.ops = &nccl_ops;
  nc->base.n_ranks = n;
  memcpy(nc->devs, devs, n * sizeof *devs);
  ncclResult_t r = ncclCommInitAll(nc->comms, (int)n, nc->devs);
  if (r != ncclSuccess) {
    mr_free(nc);
    return nccl_fail(e, r, "ncclCommInitAll");
  }
  *out = &nc->base;
  return 0;
}
