/*
 * gc_backend_open.c - picking a compute backend by name, and loading the CUDA one
 * (libmoerpc-cuda.so) at run time so that the client binaries carry no CUDA dependency.
 */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_client/runner/backend.h"

#define CUDA_LIB_NAME "libmoerpc-cuda.so"

static pthread_once_t cuda_once = PTHREAD_ONCE_INIT;
static gc_cuda_lib cuda_lib;
static int cuda_rc;
static char cuda_why[768];

/* lib/ beside the running binary's directory: build/bin/x -> build/lib/libmoerpc-cuda.so
 * (the same for an installed PREFIX/bin and PREFIX/lib). "" when /proc cannot say. */
static void beside_binary(char *out, size_t n) {
  char exe[PATH_MAX];
  out[0] = '\0';
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) return;
  exe[len] = '\0';
  char *slash = strrchr(exe, '/');
  if (!slash) return;
  *slash = '\0'; /* the binary's directory */
  slash = strrchr(exe, '/');
  if (slash) *slash = '\0'; /* its parent */
  snprintf(out, n, "%s/lib/%s", exe, CUDA_LIB_NAME);
}

static void cuda_load_once(void) {
  char beside[PATH_MAX + 32];
  const char *env = getenv("MOERPC_CUDA_LIB");
  const char *tried[3];
  size_t n_tried = 0;
  void *h = NULL;
  if (env && *env) {
    tried[n_tried++] = env;
    h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
  } else {
    beside_binary(beside, sizeof beside);
    if (beside[0] && access(beside, F_OK) == 0) {
      tried[n_tried++] = beside;
      h = dlopen(beside, RTLD_NOW | RTLD_LOCAL);
    }
    if (!h && n_tried == 0) {
      tried[n_tried++] = CUDA_LIB_NAME;
      h = dlopen(CUDA_LIB_NAME, RTLD_NOW | RTLD_LOCAL);
    }
  }
  if (!h) {
    const char *why = dlerror();
    snprintf(cuda_why, sizeof cuda_why,
             "backend cuda: cannot load %s (%s); a build without nvcc (or with HAVE_CUDA=0) "
             "has no CUDA backend: rebuild with the CUDA toolkit, or set MOERPC_CUDA_LIB",
             tried[0], why ? why : "?");
    cuda_rc = MR_ENOTSUP;
    return;
  }
  gc_cuda_lib_get_fn get = (gc_cuda_lib_get_fn)(uintptr_t)dlsym(h, "gc_cuda_lib_get");
  if (!get) {
    snprintf(cuda_why, sizeof cuda_why, "backend cuda: %s has no symbol gc_cuda_lib_get",
             tried[0]);
    cuda_rc = MR_ENOTSUP;
    return;
  }
  mr_err e = {0};
  memset(&cuda_lib, 0, sizeof cuda_lib);
  if ((cuda_rc = get(&cuda_lib, &e))) {
    snprintf(cuda_why, sizeof cuda_why, "backend cuda: %s: %s", tried[0], e.msg);
    return;
  }
  if (cuda_lib.abi != GC_CUDA_ABI || !cuda_lib.device_count || !cuda_lib.backend_new) {
    snprintf(cuda_why, sizeof cuda_why,
             "backend cuda: %s speaks ABI %u, this binary %u: rebuild both from one tree",
             tried[0], cuda_lib.abi, GC_CUDA_ABI);
    cuda_rc = MR_EMISMATCH;
    return;
  }
  mr_log(MR_LOG_INFO, "backend cuda: loaded %s", tried[0]);
}

int gc_cuda_lib_load(const gc_cuda_lib **out, mr_err *e) {
  pthread_once(&cuda_once, cuda_load_once);
  if (cuda_rc) return mr_err_set(e, cuda_rc, "%s", cuda_why);
  *out = &cuda_lib;
  return 0;
}

int gc_bk_open(gc_backend **out, const char *name, int dev, kn_engine *eng, uint32_t max_seq,
               mr_err *e) {
  *out = NULL;
  if (!name || strcmp(name, "cpu") == 0) return gc_bk_cpu_new(out, eng, max_seq, e);
  if (strcmp(name, "cuda") != 0)
    return mr_err_set(e, MR_EINVAL, "backend = \"%s\": must be cpu or cuda", name);
  const gc_cuda_lib *lib;
  int rc = gc_cuda_lib_load(&lib, e);
  if (rc) return rc;
  mr_err why = {0};
  int n = lib->device_count(&why);
  if (n < 0) {
    *e = why;
    return n;
  }
  if (n == 0) { /* why.msg: the runtime's reason (no driver, too old a driver, none found) */
    const char *r = strncmp(why.msg, "cuda: ", 6) == 0 ? why.msg + 6 : why.msg;
    if (strncmp(r, "no CUDA device", 14) == 0) r += 14;
    while (*r == ' ') r++;
    return mr_err_set(e, MR_ENOTSUP, "backend cuda: no CUDA device on this host%s%s (use "
                      "--backend cpu)", *r ? " " : "", r);
  }
  if (dev < 0 || dev >= n)
    return mr_err_set(e, MR_ERANGE, "cuda device %d: this host has %d (0..%d)", dev, n, n - 1);
  return lib->backend_new(out, dev, eng, max_seq, e);
}
