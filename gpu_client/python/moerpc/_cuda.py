"""moerpc._cuda - host functions on a CUDA stream (cuLaunchHostFunc of the driver API).

Imported only when a CUDA tensor reaches MoeRpcWrapper, so importing moerpc never needs a
GPU. One ctypes trampoline (kept alive for the life of the process) dispatches on the
userData key to a registered Python callable; keys are never reused, so a CUDA graph that
captured a host node can replay it at any time. The driver runs host functions of one
stream in stream order on its own thread; the callable takes the GIL. A host function must
not call CUDA: the callables here only call libmoerpc-client and touch pinned host memory.

Written against the CUDA driver API documentation (CUresult cuLaunchHostFunc(CUstream,
CUhostFn, void *userData)); run on an H200 by tests/gpu/test_wrapper_cuda.py (CI has no
GPU).
"""
from __future__ import annotations

import ctypes
import itertools
import threading

_HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_lock = threading.Lock()
_callbacks = {}
_keys = itertools.count(1)
_driver = None


def _dispatch(user):
    fn = _callbacks.get(user or 0)
    if fn is not None:
        fn()


_trampoline = _HOSTFN(_dispatch)


def _lib():
    global _driver
    if _driver is None:
        d = ctypes.CDLL("libcuda.so.1")
        d.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOSTFN, ctypes.c_void_p]
        d.cuLaunchHostFunc.restype = ctypes.c_int
        _driver = d
    return _driver


def register(fn) -> int:
    """A key for fn (called with no arguments by the host function)."""
    with _lock:
        k = next(_keys)
        _callbacks[k] = fn
        return k


def launch(stream_handle: int, key: int) -> None:
    """Queues the callable of key on the stream (a cudaStream_t / CUstream as an int)."""
    rc = _lib().cuLaunchHostFunc(ctypes.c_void_p(stream_handle), _trampoline,
                                 ctypes.c_void_p(key))
    if rc != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed: CUresult {rc}")
