"""moerpc.sglang - select MoeRpcWrapper in sglang-kt with `--kt-method MOERPC`.

sglang-kt (PyPI `sglang-kt`, python/sglang/srt/layers/moe/kt_ep_wrapper.py) builds its CPU
expert wrapper with `kt_kernel.KTMoEWrapper(..., method=server_args.kt_method,
weight_path=server_args.kt_weight_path, ...)` on TP rank 0. install() replaces that factory
with one that returns moerpc.MoeRpcWrapper for method "MOERPC" and calls kt-kernel's own
factory, unchanged, for every other method (so `--kt-method AMXINT4` still means kt-kernel).
The static methods (set_capture_batch_sizes, get_capture_batch_sizes, clear_buffer_cache)
reach both. No file of kt-kernel or sglang is changed.

install() checks the versions it was written against (kt-kernel 0.7.x, sglang-kt 0.7.x when
installed) and the factory's signature, and refuses others with a message naming the
version, unless MOERPC_SGLANG_ANY_VERSION=1.

Processes sglang starts (schedulers, TP workers; multiprocessing "spawn" does not inherit a
patched module) install it themselves: the package puts moerpc-sglang-hook.pth in
site-packages, which, when the environment has MOERPC_SGLANG_HOOK=1 (the launcher sets it),
arranges for install() to run right after kt_kernel is first imported.

    python -m moerpc.sglang --model-path M --kt-method MOERPC --kt-weight-path cluster.json ...
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys

log = logging.getLogger("moerpc")

METHOD = "MOERPC"
KT_VERSIONS = ("0.7.",)      # tested: 0.7.2
SGLANG_VERSIONS = ("0.7.",)  # tested: sglang-kt 0.7.2
ENV_HOOK = "MOERPC_SGLANG_HOOK"
ENV_ANY_VERSION = "MOERPC_SGLANG_ANY_VERSION"
# Parameters of kt-kernel's factory that the hook relies on, in kt-kernel's order.
_KT_PARAMS = ("layer_idx", "num_experts", "num_experts_per_tok", "hidden_size",
              "moe_intermediate_size", "gpu_experts_mask", "cpuinfer_threads", "threadpool_count",
              "weight_path", "chunked_prefill_size", "cpu_save", "max_deferred_experts_per_token",
              "method")


def _dist_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def check_versions() -> dict:
    """The versions found; RuntimeError naming any that is not supported."""
    import kt_kernel
    kt = getattr(kt_kernel, "__version__", None) or _dist_version("kt-kernel")
    sg = _dist_version("sglang-kt")
    bad = []
    if not kt or not kt.startswith(KT_VERSIONS):
        bad.append(f"kt-kernel {kt} (supported: {', '.join(v + 'x' for v in KT_VERSIONS)})")
    if sg is not None and not sg.startswith(SGLANG_VERSIONS):
        bad.append(f"sglang-kt {sg} (supported: {', '.join(v + 'x' for v in SGLANG_VERSIONS)})")
    if bad and os.environ.get(ENV_ANY_VERSION) != "1":
        raise RuntimeError("moerpc.sglang: untested " + " and ".join(bad) + f"; set "
                           f"{ENV_ANY_VERSION}=1 to install the hook anyway")
    return {"kt-kernel": kt, "sglang-kt": sg}


def _make_factory(orig):
    from ..wrapper import MoeRpcWrapper
    sig = inspect.signature(orig.__new__)
    names = list(sig.parameters)[1:]  # without cls
    if tuple(names[:len(_KT_PARAMS)]) != _KT_PARAMS:
        raise RuntimeError("moerpc.sglang: kt_kernel.KTMoEWrapper's parameters are "
                           f"{names[:len(_KT_PARAMS)]}, expected {list(_KT_PARAMS)}: this "
                           "kt-kernel is not the one the hook was written for")

    class KTMoEWrapper(orig):
        """kt-kernel's KTMoEWrapper factory, plus method "MOERPC" (moerpc.MoeRpcWrapper)."""

        _moerpc_hooked = True
        _moerpc_original = orig

        def __new__(cls, *args, **kwargs):
            bound = sig.bind(cls, *args, **kwargs)
            method = bound.arguments.get("method", sig.parameters["method"].default)
            if isinstance(method, str) and method.upper() == METHOD:
                a = dict(bound.arguments)
                a.pop(next(iter(sig.parameters)))  # cls
                a["method"] = METHOD
                extra = a.pop("kwargs", None) or {}
                return MoeRpcWrapper(**a, **extra)
            return orig(*args, **kwargs)

        @staticmethod
        def set_capture_batch_sizes(capture_bs):
            orig.set_capture_batch_sizes(capture_bs)
            MoeRpcWrapper.set_capture_batch_sizes(capture_bs)

        @staticmethod
        def get_capture_batch_sizes():
            return orig.get_capture_batch_sizes()

        @staticmethod
        def clear_buffer_cache():
            orig.clear_buffer_cache()
            MoeRpcWrapper.clear_buffer_cache()

    KTMoEWrapper.__module__ = orig.__module__
    KTMoEWrapper.__qualname__ = orig.__qualname__
    return KTMoEWrapper


def installed() -> bool:
    kt = sys.modules.get("kt_kernel")
    return bool(kt is not None and getattr(getattr(kt, "KTMoEWrapper", None), "_moerpc_hooked", False))


def install(versions: bool = True) -> None:
    """Wraps kt_kernel's KTMoEWrapper factory (idempotent); also in an already imported
    sglang kt_ep_wrapper module. ImportError without kt-kernel; RuntimeError for versions
    or a signature it was not written for."""
    import kt_kernel
    import kt_kernel.experts as experts
    if versions:
        check_versions()
    cur = experts.KTMoEWrapper
    if not getattr(cur, "_moerpc_hooked", False):
        cur = _make_factory(cur)
        experts.KTMoEWrapper = cur
        kt_kernel.KTMoEWrapper = cur
        log.info("moerpc.sglang: kt_kernel.KTMoEWrapper hooked: --kt-method %s -> "
                 "moerpc.MoeRpcWrapper", METHOD)
    ep = sys.modules.get("sglang.srt.layers.moe.kt_ep_wrapper")
    if ep is not None and getattr(ep, "KTMoEWrapper", None) is not cur:
        ep.KTMoEWrapper = cur


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs install() right after kt_kernel (or sglang's kt_ep_wrapper) is imported."""

    NAMES = ("kt_kernel", "sglang.srt.layers.moe.kt_ep_wrapper")

    def find_spec(self, name, path=None, target=None):
        if name not in self.NAMES:
            return None
        for f in sys.meta_path:
            if f is self:
                continue
            spec = f.find_spec(name, path, target) if hasattr(f, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                inner = loader.exec_module

                def exec_module(module, _inner=inner):
                    _inner(module)  # kt_kernel/__init__ is done: its KTMoEWrapper is final
                    install()
                loader.exec_module = exec_module
                return spec
        return None


def install_on_import() -> None:
    """install() now if kt_kernel is imported, else when it is (for processes started with
    MOERPC_SGLANG_HOOK=1, through moerpc-sglang-hook.pth)."""
    if "kt_kernel" in sys.modules:
        install()
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
