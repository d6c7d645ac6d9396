"""moerpc._lib - libmoerpc-client through ctypes.

The library is found, in order, at:
  1. $MOERPC_LIB (a path to libmoerpc-client.so);
  2. the copy installed with this package (moerpc/lib/libmoerpc-client.so, put there by
     `pip install ./gpu_client/python`, which runs `make build/lib/libmoerpc-client.so`);
  3. <repo>/build/lib/libmoerpc-client.so when the package is imported from a source tree;
  4. the system's search path (ctypes.util.find_library("moerpc-client")).

No struct of the C header is mirrored by hand: the sizes and offsets of gc_options,
gc_layer_req, gc_cluster_info and mr_err come from the library itself (gc_abi_layout), so
a field added to the header needs nothing here, and a field this module uses that is gone
is refused at load with a message naming it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

# moerpc_client.h: values of gc_cluster_owner() besides a server index.
GC_OWNER_NONE = -1
GC_OWNER_LOCAL = -2
GC_OWNER_CALLER = -3
# common/mr.h, mr_dtype.
MR_DTYPE_F32 = 1
MR_DTYPE_F16 = 2
MR_DTYPE_BF16 = 3
MR_EPRECOND = -10

_LIB_NAME = "libmoerpc-client.so"


class MoeRpcError(RuntimeError):
    """A libmoerpc-client call failed. code is the MR_E* code (negative), name its name
    ("EUNAVAIL"), and the message is the library's (it names the server, the request id
    and the layer where they apply)."""

    def __init__(self, code: int, name: str, message: str):
        super().__init__(f"{message} ({name})" if message else name)
        self.code = code
        self.name = name


def candidate_paths():
    """The paths tried, in order (for error messages and docs)."""
    out = []
    env = os.environ.get("MOERPC_LIB")
    if env:
        out.append(env)
    here = os.path.dirname(os.path.abspath(__file__))
    out.append(os.path.join(here, "lib", _LIB_NAME))
    # gpu_client/python/moerpc -> repository root
    repo = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    out.append(os.path.join(repo, "build", "lib", _LIB_NAME))
    found = ctypes.util.find_library("moerpc-client")
    if found:
        out.append(found)
    return out


class _Raw:
    """A C struct as bytes, written and read at the offsets the library states."""

    def __init__(self, lib: "Lib", struct: str):
        self._lib = lib
        self._struct = struct
        self.buf = ctypes.create_string_buffer(lib.layout(struct))

    def _at(self, field: str, ctype):
        return ctype.from_buffer(self.buf, self._lib.layout(f"{self._struct}.{field}"))

    def set(self, field: str, ctype, value):
        self._at(field, ctype).value = value

    def get(self, field: str, ctype):
        return self._at(field, ctype).value

    def get_str(self, field: str, size: int) -> str:
        off = self._lib.layout(f"{self._struct}.{field}")
        raw = ctypes.string_at(ctypes.addressof(self.buf) + off, size)
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    @property
    def ptr(self):
        return ctypes.cast(self.buf, ctypes.c_void_p)


class Lib:
    """The loaded library, its functions typed, and its struct layout."""

    _NEEDED = [
        "mr_err", "mr_err.code", "mr_err.msg",
        "gc_options", "gc_options.client_name", "gc_options.deadline_ms",
        "gc_options.connect_timeout_ms", "gc_options.model_dir", "gc_options.no_local",
        "gc_options.caller_local", "gc_options.caller_local_len",
        "gc_layer_req", "gc_layer_req.layer", "gc_layer_req.n_tokens", "gc_layer_req.top_k",
        "gc_layer_req.ids", "gc_layer_req.weights", "gc_layer_req.x", "gc_layer_req.dtype",
        "gc_cluster_info", "gc_cluster_info.hidden_size", "gc_cluster_info.intermediate_size",
        "gc_cluster_info.num_layers", "gc_cluster_info.num_experts",
        "gc_cluster_info.weight_format", "gc_cluster_info.max_tokens",
        "gc_cluster_info.n_servers", "gc_cluster_info.caller_pairs", "gc_cluster_info.model_dir",
        "GC_WAIT_ACCUMULATE",
    ]

    def __init__(self, path: str):
        self.path = path
        self.so = ctypes.CDLL(path)
        so = self.so
        vp, i32, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32
        if not hasattr(so, "gc_abi_layout"):
            raise ImportError(f"{path} has no gc_abi_layout: it predates the Python binding; "
                              f"rebuild it (make build/lib/{_LIB_NAME})")
        so.gc_abi_layout.argtypes = [ctypes.c_char_p]
        so.gc_abi_layout.restype = ctypes.c_long
        self._layout = {}
        missing = [n for n in self._NEEDED if self.layout(n, strict=False) < 0]
        if missing:
            raise ImportError(f"{path}: gc_abi_layout does not know {', '.join(missing)}: the "
                              "library and this package are from different versions")
        for name, args, res in [
            ("gc_options_init", [vp], None),
            ("gc_cluster_open", [ctypes.POINTER(vp), ctypes.c_char_p, vp, vp], i32),
            ("gc_cluster_close", [vp], None),
            ("gc_cluster_info_get", [vp, vp], None),
            ("gc_cluster_owner", [vp, u32, u32], i32),
            ("gc_layer_submit", [vp, vp, ctypes.POINTER(vp), vp], i32),
            ("gc_layer_wait_timed", [vp, vp, vp, u32, vp, vp], i32),
            ("gc_layer_cancel", [vp, vp], None),
            ("gc_pending_empty", [vp], ctypes.c_bool),
            ("mr_err_name", [i32], ctypes.c_char_p),
            ("gc_cluster_routing", [vp], vp),
            ("gc_routing_save", [vp, i32, ctypes.c_char_p, ctypes.c_char_p, vp], i32),
        ]:
            if not hasattr(so, name) and name in ("gc_cluster_routing", "gc_routing_save"):
                continue  # an older library: no routing statistics
            f = getattr(so, name)
            f.argtypes = args
            f.restype = res
        self.wait_accumulate = self.layout("GC_WAIT_ACCUMULATE")

    def layout(self, name: str, strict: bool = True) -> int:
        v = self._layout.get(name)
        if v is None:
            v = int(self.so.gc_abi_layout(name.encode()))
            self._layout[name] = v
        if strict and v < 0:
            raise RuntimeError(f"gc_abi_layout({name!r}) is unknown to {self.path}")
        return v

    def new(self, struct: str) -> _Raw:
        return _Raw(self, struct)

    def error(self, rc: int, err: _Raw, what: str = "") -> MoeRpcError:
        name = self.so.mr_err_name(rc)
        name = name.decode() if name else str(rc)
        msg = err.get_str("msg", self.layout("mr_err") - self.layout("mr_err.msg"))
        if what:
            msg = f"{what}: {msg}" if msg else what
        return MoeRpcError(rc, name, msg)


_lib = None
_lib_lock = threading.Lock()


def lib() -> Lib:
    """The library (loaded once per process). ImportError naming every path tried."""
    global _lib
    with _lib_lock:
        if _lib is None:
            tried = []
            for p in candidate_paths():
                if not os.path.isfile(p) and os.sep in p:
                    tried.append(f"{p} (not there)")
                    continue
                try:
                    _lib = Lib(p)
                    break
                except OSError as ex:
                    tried.append(f"{p} ({ex})")
            if _lib is None:
                raise ImportError("libmoerpc-client not found; tried: " + "; ".join(tried) +
                                  ". Build it with `make build/lib/libmoerpc-client.so` in the "
                                  "moerpc tree or point MOERPC_LIB at it.")
        return _lib
