"""moerpc - Python binding of libmoerpc-client.

MoeRpcWrapper is kt-kernel's KTMoEWrapper contract (the CPU-expert wrapper of sglang-kt)
with the experts on moerpc expert servers; moerpc.sglang selects it in sglang-kt with
`--kt-method MOERPC --kt-weight-path cluster.json` (python -m moerpc.sglang ...).
See gpu_client/python/README.md and docs/sglang.md.

The names below are loaded on first use, so that `import moerpc.sglang` (run at start-up of
every process by moerpc-sglang-hook.pth when MOERPC_SGLANG_HOOK=1, possibly before torch is
on sys.path) imports neither torch nor the C library.
"""
__version__ = "0.1.0"
__all__ = ["MoeRpcWrapper", "MoeRpcError", "close_all", "__version__"]


def __getattr__(name):
    if name == "MoeRpcError":
        from ._lib import MoeRpcError
        return MoeRpcError
    if name in ("MoeRpcWrapper", "close_all"):
        from . import wrapper
        return getattr(wrapper, name)
    raise AttributeError(f"module 'moerpc' has no attribute {name!r}")
