"""moerpc.wrapper - MoeRpcWrapper: kt-kernel's KTMoEWrapper contract over libmoerpc-client.

kt-kernel (kvcache-ai/ktransformers, `kt-kernel/python/experts_base.py`) computes the routed
experts the GPU does not hold on the local CPU; MoeRpcWrapper sends them to moerpc expert
servers instead. Same constructor, same methods, same numbers up to the kernels' rounding:

  out[t] = sum over slots j of token t that are kept of topk_weights[t, j] * expert(x[t])

in fp32, returned in hidden_states' dtype, routed_scaling_factor not applied. A slot is
kept when 0 <= id < num_experts and not gpu_experts_mask[id] (the mask is this wrapper's own
tensor, read at every call: update it in place, as sglang-kt's update_kt_wrapper_masks
does). With max_deferred_experts_per_token = K > 0, kt-kernel's select_deferred_experts
decides what runs now: per token the k - K slots of largest weight are "protected", and a
slot runs now when its expert is protected for *any* token of the batch (an expert whose
weights are read anyway is not deferred); the other kept slots go out as a separate call
whose sum is added to the output of the next layer's sync_forward (layer_idx + 1). sglang-kt
gives its last MoE layer K = 0, so nothing is left over at the end of a pass.

One gc_cluster per cluster file per process is shared by the wrappers of every layer
(kt-kernel likewise shares one CPUInfer): the layer index is the servers' layer.

Calls and threads:
  * CPU tensors: submit_forward sends the requests and returns (the servers work while the
    caller does); sync_forward waits and returns the sum. Everything runs on the calling
    thread; the C library's own I/O thread carries the RPCs. ctypes drops the GIL inside
    the library, so Python threads run meanwhile.
  * CUDA tensors: submit_forward queues, on cuda_stream, the D2H copies into pinned staging
    buffers and a host function (cuLaunchHostFunc) that sends the requests; sync_forward
    queues a host function that waits and writes the fp32 sum into pinned memory, then the
    H2D copy. Nothing blocks the Python thread, and a CUDA graph can capture the whole
    sequence (buffers are kept per captured batch size, see set_capture_batch_sizes). The
    host functions are Python (ctypes callbacks), so they take the GIL. Tested on an H200
    by tests/gpu/test_wrapper_cuda.py (CI has no GPU). An error inside a host function
    cannot raise on the stream; it is logged and raised by the next submit_forward /
    sync_forward.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from typing import Dict, List, Optional

import torch

from . import _lib as L
from ._lib import MoeRpcError

log = logging.getLogger("moerpc")

_WIRE = {torch.bfloat16: L.MR_DTYPE_BF16, torch.float16: L.MR_DTYPE_F16,
         torch.float32: L.MR_DTYPE_F32}


def _pin() -> bool:
    """Pinned host memory needs a CUDA driver; without one (tests, CPU hosts) plain memory."""
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


class _Stage:
    """Staging buffers of one batch size T (pinned when CUDA is there). Inputs are copied by
    gc_layer_submit before it returns, so one set serves every layer; the result buffers on
    the device alternate by layer parity, as kt-kernel's output buffers do."""

    def __init__(self, lib, T: int, k: int, H: int, device: torch.device, xdtype):
        pin = _pin()
        self.T = T
        self.ids_now = torch.full((T, k), -1, dtype=torch.int32, pin_memory=pin)
        self.ids_def = torch.full((T, k), -1, dtype=torch.int32, pin_memory=pin)
        # the GPU's slots (gpu_experts_mask), counted by the library's routing statistics
        self.ids_gpu = torch.full((T, k), -1, dtype=torch.int32, pin_memory=pin)
        self.w = torch.zeros((T, k), dtype=torch.float32, pin_memory=pin)
        self.out = torch.zeros((T, H), dtype=torch.float32, pin_memory=pin)
        self.x = None  # [T, H] wire dtype; always on the CUDA path, on demand on the CPU one
        self.req_now = lib.new("gc_layer_req")
        self.req_def = lib.new("gc_layer_req")
        if device.type == "cuda":
            self.x = torch.empty((T, H), dtype=xdtype, pin_memory=pin)
            self.out_dev = torch.empty((T, H), dtype=torch.float32, device=device)
            self.result = [torch.empty((T, H), dtype=xdtype, device=device) for _ in range(2)]


class _Cluster:
    """The per-process state of one cluster file: the gc_cluster, what every layer's wrapper
    registered, the deferred call waiting for the next layer, the staging buffers."""

    _all: Dict[str, "_Cluster"] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, path: str) -> "_Cluster":
        key = os.path.realpath(path)
        with cls._lock:
            c = cls._all.get(key)
            if c is None or c.pid != os.getpid():  # a forked child opens its own
                c = cls(key)
                cls._all[key] = c
            return c

    @classmethod
    def close_all(cls):
        with cls._lock:
            for c in cls._all.values():
                c.close()
            cls._all.clear()

    def __init__(self, path: str):
        self.path = path
        self.pid = os.getpid()
        self.lib = L.lib()
        self.handle = None          # gc_cluster *
        self.info = None            # dict of gc_cluster_info
        self.masks: Dict[int, torch.Tensor] = {}  # layer -> its wrapper's live mask
        self.servable = None        # bool [num_layers, num_experts]: a server or library-local
        self.caller_pairs = 0
        self.coverage_gap = False   # a plain open found experts no server serves
        self.first_error = None     # the MoeRpcError of the plain open
        self.deferred = None        # (layer, T, gc_pending *) of the last submitted layer
        self.stages: Dict[tuple, _Stage] = {}
        self.temp_stage = None
        self.err = self.lib.new("mr_err")
        self._keep = []

    # ---- open / close ------------------------------------------------------------------

    def _options(self, caller_local: Optional[bytes]):
        lib = self.lib
        o = lib.new("gc_options")
        lib.so.gc_options_init(o.ptr)
        name = ctypes.create_string_buffer(f"moerpc-python pid {os.getpid()}".encode())
        self._keep = [name]
        o.set("client_name", ctypes.c_void_p, ctypes.addressof(name))
        for env, field in (("MOERPC_DEADLINE_MS", "deadline_ms"),
                           ("MOERPC_CONNECT_TIMEOUT_MS", "connect_timeout_ms")):
            v = os.environ.get(env)
            if v:
                try:
                    o.set(field, ctypes.c_uint32, int(v))
                except ValueError:
                    raise ValueError(f"{env}={v!r}: not a number of milliseconds") from None
        v = os.environ.get("MOERPC_WAIT_SPIN_US")
        if v:
            try:
                us = int(v)
            except ValueError:
                raise ValueError(f"MOERPC_WAIT_SPIN_US={v!r}: not a number of microseconds") from None
            if us < 0:
                raise ValueError(f"MOERPC_WAIT_SPIN_US={v!r}: must be 0 or more microseconds")
            o.set("wait_spin_us", ctypes.c_uint32, us)  # the library checks the range at open
        v = os.environ.get("MOERPC_LOCAL_MAP_WEIGHTS")
        if v:
            if v not in ("0", "1"):
                raise ValueError(f"MOERPC_LOCAL_MAP_WEIGHTS={v!r}: must be 0 or 1")
            if lib.layout("gc_options.local_map_weights", strict=False) < 0:
                raise ImportError(f"{lib.path}: MOERPC_LOCAL_MAP_WEIGHTS needs a library that "
                                  "knows gc_options.local_map_weights (rebuild it)")
            o.set("local_map_weights", ctypes.c_bool, v == "1")
        if caller_local is not None:
            buf = ctypes.create_string_buffer(caller_local, len(caller_local))
            self._keep.append(buf)
            o.set("caller_local", ctypes.c_void_p, ctypes.addressof(buf))
            o.set("caller_local_len", ctypes.c_size_t, len(caller_local))
        return o

    def _try_open(self, caller_local: Optional[bytes]) -> int:
        o = self._options(caller_local)
        h = ctypes.c_void_p()
        rc = self.lib.so.gc_cluster_open(ctypes.byref(h), self.path.encode(), o.ptr, self.err.ptr)
        if rc == 0:
            self.handle = h
        return rc

    def _num_layers_hint(self) -> Optional[int]:
        """The servers' layer count before open, for caller_local: MOERPC_NUM_LAYERS or the
        config.json of the cluster file's "model"."""
        v = os.environ.get("MOERPC_NUM_LAYERS")
        if v:
            return int(v)
        try:
            with open(self.path) as f:
                model = json.load(f).get("model")
            if model:
                with open(os.path.join(model, "config.json")) as f:
                    return int(json.load(f)["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    def open(self, E: int, allow_caller_local: bool = True) -> None:
        """Opens the cluster once. First with every pair routable (so that a mask that changes
        later can still send any expert to a server); if the servers do not cover every
        expert (MR_EPRECOND), again with the GPU's experts of every layer registered so far as
        caller_local (they then need no server, but cannot be sent to one later)."""
        if self.handle is not None:
            return
        if self.coverage_gap and allow_caller_local and self.first_error is not None:
            rc = L.MR_EPRECOND  # the plain open already failed on coverage
        else:
            rc = self._try_open(None)
            if rc:
                self.first_error = self.lib.error(rc, self.err, f"cluster {self.path}")
        if rc == L.MR_EPRECOND and self.masks and allow_caller_local:
            first = self.first_error
            n_layers = self._num_layers_hint()
            if n_layers is None:
                raise MoeRpcError(rc, first.name, f"{first}; the GPU's experts could be left to "
                                  "the GPU (caller_local) if the layer count were known: set "
                                  "\"model\" in the cluster file or MOERPC_NUM_LAYERS")
            cl = bytearray(n_layers * E)
            for layer, m in self.masks.items():
                if layer < n_layers:
                    for x in torch.nonzero(m.to(torch.bool).cpu()).flatten().tolist():
                        cl[layer * E + x] = 1
            rc = self._try_open(bytes(cl))
        if rc:
            raise (self.first_error if rc == L.MR_EPRECOND and not allow_caller_local
                   else self.lib.error(rc, self.err, f"cluster {self.path}"))
        info = self.lib.new("gc_cluster_info")
        self.lib.so.gc_cluster_info_get(self.handle, info.ptr)
        u32 = ctypes.c_uint32
        self.info = {f: info.get(f, u32) for f in ("hidden_size", "intermediate_size",
                                                   "num_layers", "num_experts", "max_tokens",
                                                   "n_servers")}
        self.info["weight_format"] = info.get_str("weight_format", 32)
        self.caller_pairs = info.get("caller_pairs", ctypes.c_uint64)
        for f in ("local_pairs", "local_mapped"):  # the cluster file's "local" experts
            self.info[f] = (info.get(f, ctypes.c_uint64)
                            if self.lib.layout(f"gc_cluster_info.{f}", strict=False) >= 0 else 0)
        nl, ne = self.info["num_layers"], self.info["num_experts"]
        owner = torch.tensor([[self.lib.so.gc_cluster_owner(self.handle, l, x) for x in range(ne)]
                              for l in range(nl)], dtype=torch.int32)
        self.servable = (owner >= 0) | (owner == L.GC_OWNER_LOCAL)
        log.info("moerpc: cluster %s open: %d server(s), %d layers x %d experts, hidden %d, "
                 "weights %s, %d local pairs (%d in place)", self.path, self.info["n_servers"],
                 nl, ne, self.info["hidden_size"], self.info["weight_format"],
                 self.info["local_pairs"], self.info["local_mapped"])

    def close(self) -> None:
        if self.handle is None or self.pid != os.getpid():
            return
        self.drop_deferred()
        self.lib.so.gc_cluster_close(self.handle)
        self.handle = None

    # ---- calls -------------------------------------------------------------------------

    def cancel(self, pending) -> None:
        if pending is not None and self.handle is not None:
            self.lib.so.gc_layer_cancel(self.handle, pending)

    def drop_deferred(self) -> None:
        if self.deferred is not None:
            self.cancel(self.deferred[2])
            self.deferred = None

    def save_routing_stats(self, path: str, total: bool = False) -> None:
        """The library's routing counters (every slot of every layer, GPU ones included) as
        a moerpc-stats file at path: the sliding window, or with total the counts since
        open (gpu_client/README.md "Routing statistics")."""
        if self.handle is None:
            raise RuntimeError(f"{self.path}: the cluster is not open yet")
        so = self.lib.so
        if not hasattr(so, "gc_routing_save"):
            raise RuntimeError(f"{self.lib.path} has no routing statistics: rebuild it")
        r = so.gc_cluster_routing(self.handle)
        rc = so.gc_routing_save(r, 1 if total else 0, b"", os.fsencode(path), self.err.ptr)
        if rc:
            raise self.lib.error(rc, self.err)

    def submit(self, req) -> ctypes.c_void_p:
        p = ctypes.c_void_p()
        rc = self.lib.so.gc_layer_submit(self.handle, req.ptr, ctypes.byref(p), self.err.ptr)
        if rc:
            raise self.lib.error(rc, self.err)
        return p

    def wait_into(self, pending, out: torch.Tensor) -> None:
        """out += the call's sum (fp32); frees pending in every case."""
        rc = self.lib.so.gc_layer_wait_timed(self.handle, pending, ctypes.c_void_p(out.data_ptr()),
                                          self.lib.wait_accumulate, None, self.err.ptr)
        if rc:
            raise self.lib.error(rc, self.err)

    def stage(self, T: int, k: int, H: int, device: torch.device, xdtype) -> _Stage:
        key = (T, k, device.type, device.index, xdtype)
        st = self.stages.get(key)
        if st is not None:
            return st
        if self.temp_stage is not None and self.temp_stage[0] == key:
            return self.temp_stage[1]
        st = _Stage(self.lib, T, k, H, device, xdtype)
        if T in MoeRpcWrapper._capture_bs:
            self.stages[key] = st
        else:
            self.temp_stage = (key, st)
        return st


class MoeRpcWrapper:
    """kt-kernel's inference wrapper (BaseMoEWrapper) with the experts on moerpc servers.

    The constructor takes KTMoEWrapper's arguments. weight_path names the cluster file (the
    JSON of gpu_client/README.md); method must be "MOERPC". cpuinfer_threads,
    threadpool_count, numa_nodes, cpu_save and chunked_prefill_size are accepted and not
    used (the servers have their own threads; requests larger than a server's max_tokens are
    split by the library); other keyword arguments kt-kernel takes (mode, swiglu_limit,
    swiglu_alpha, ...) are accepted when they have kt-kernel's default meaning, and refused
    (ValueError naming them) otherwise, since the servers would not honour them."""

    _capture_bs: List[int] = []

    def __init__(self, layer_idx: int, num_experts: int, num_experts_per_tok: int,
                 hidden_size: int, moe_intermediate_size: int,
                 gpu_experts_mask: Optional[torch.Tensor], cpuinfer_threads: int = 0,
                 threadpool_count: int = 1, weight_path: str = "",
                 chunked_prefill_size: int = 0, cpu_save: bool = False,
                 max_deferred_experts_per_token: Optional[int] = None, method: str = "MOERPC",
                 numa_nodes: Optional[List[int]] = None, mode: str = "inference",
                 swiglu_limit: float = 0.0, swiglu_alpha: float = 0.0, **extra):
        if method != "MOERPC":
            raise ValueError(f"MoeRpcWrapper: method {method!r}: only 'MOERPC' (other methods "
                             "are kt-kernel's)")
        if mode != "inference":
            raise ValueError(f"MoeRpcWrapper: mode {mode!r}: only 'inference' (no SFT)")
        if swiglu_limit or swiglu_alpha:
            raise ValueError(f"MoeRpcWrapper: swiglu_limit={swiglu_limit}, swiglu_alpha="
                             f"{swiglu_alpha}: the servers compute plain SiLU experts only")
        if extra:
            log.debug("MoeRpcWrapper: ignoring %s", ", ".join(sorted(extra)))
        for name, v in (("num_experts", num_experts), ("num_experts_per_tok", num_experts_per_tok),
                        ("hidden_size", hidden_size),
                        ("moe_intermediate_size", moe_intermediate_size)):
            if int(v) <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if num_experts_per_tok > num_experts:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) cannot exceed "
                             f"num_experts ({num_experts})")
        if layer_idx < 0:
            raise ValueError(f"layer_idx must be >= 0, got {layer_idx}")
        if not weight_path or not os.path.isfile(weight_path):
            raise ValueError(f"MoeRpcWrapper: weight_path {weight_path!r} must name the moerpc "
                             "cluster file (--kt-weight-path cluster.json)")
        K = int(max_deferred_experts_per_token or 0)
        if K < 0 or K > num_experts_per_tok:
            raise ValueError(f"max_deferred_experts_per_token {K} must be in 0..{num_experts_per_tok}")
        self.layer_idx = int(layer_idx)
        self.num_experts = int(num_experts)
        self.num_experts_per_tok = int(num_experts_per_tok)
        self.hidden_size = int(hidden_size)
        self.moe_intermediate_size = int(moe_intermediate_size)
        self.weight_path = weight_path
        self.chunked_prefill_size = chunked_prefill_size
        self.cpu_save = cpu_save
        self.method = method
        self.max_deferred_experts_per_token = K
        # Our own copy, as kt-kernel keeps one (its C++ holds the pointer): read at every call.
        self.gpu_experts_mask = torch.zeros(num_experts, dtype=torch.bool, pin_memory=_pin())
        if gpu_experts_mask is not None:
            if tuple(gpu_experts_mask.shape) != (num_experts,):
                raise ValueError(f"gpu_experts_mask has shape {tuple(gpu_experts_mask.shape)}, "
                                 f"expected ({num_experts},)")
            self.gpu_experts_mask.copy_(gpu_experts_mask)
        self.num_gpu_experts = int(self.gpu_experts_mask.sum().item())
        self._p2l = None          # physical -> logical expert ids (load_weights), None = identity
        self._mask_dev = None     # device copy of the mask (CUDA path)
        self._pending = None      # this layer's immediate call, submitted, not waited
        self._prev_def = None     # the previous layer's deferred call, waited by our sync
        self._inflight = None     # (stage, T, device, dtype) between submit and sync
        self._cuda_error = None
        self._cuda_keys = {}
        self._ctx = _Cluster.get(weight_path)
        self._ctx.masks[self.layer_idx] = self.gpu_experts_mask
        if not self._ctx.coverage_gap:
            try:  # fail fast on a wrong cluster; a coverage gap waits for every layer's mask
                self._ensure_open(first_try=True)
            except MoeRpcError as ex:
                if ex.code != L.MR_EPRECOND:
                    raise
                self._ctx.coverage_gap = True
                log.info("moerpc: %s: %s; opening again at the first load_weights or "
                         "submit_forward with the GPU's experts left to the GPU", weight_path, ex)

    # ---- open and checks ---------------------------------------------------------------

    def _ensure_open(self, first_try: bool = False) -> None:
        ctx = self._ctx
        if ctx.handle is None:
            ctx.open(self.num_experts, allow_caller_local=not first_try)
        i = ctx.info
        for ours, theirs, what in ((self.hidden_size, i["hidden_size"], "hidden_size"),
                                   (self.moe_intermediate_size, i["intermediate_size"],
                                    "moe_intermediate_size"),
                                   (self.num_experts, i["num_experts"], "num_experts")):
            if ours != theirs:
                raise ValueError(f"layer {self.layer_idx}: {what} = {ours}, but the servers of "
                                 f"{ctx.path} serve {what} = {theirs}")
        if self.layer_idx >= i["num_layers"]:
            raise ValueError(f"layer_idx {self.layer_idx}: the servers' model has "
                             f"{i['num_layers']} layers")
        if not bool(ctx.servable[self.layer_idx].any()) and ctx.caller_pairs == 0:
            raise ValueError(f"layer {self.layer_idx}: no server of {ctx.path} serves it")

    def load_weights(self, physical_to_logical_map_cpu: Optional[torch.Tensor] = None) -> None:
        """Nothing to load (the servers hold the weights): opens the cluster if not yet open
        and keeps the physical -> logical expert map that sglang's EPLB passes."""
        m = physical_to_logical_map_cpu
        if m is not None:
            m = m.to(torch.long).cpu().flatten()
            if m.numel() != self.num_experts:
                raise ValueError(f"physical_to_logical_map_cpu has {m.numel()} entries, "
                                 f"expected num_experts = {self.num_experts}")
            self._p2l = None if torch.equal(m, torch.arange(self.num_experts)) else m
        self._ensure_open()

    def load_weights_from_tensors(self, gate_proj, up_proj, down_proj,
                                  physical_to_logical_map_cpu) -> None:
        """kt-kernel's online quantization entry: the tensors are not used (the servers own
        the weights); same as load_weights."""
        self.load_weights(physical_to_logical_map_cpu)

    # ---- the routing split (kt-kernel's select_deferred_experts + the mask) -------------

    def _split(self, ids: torch.Tensor, w: torch.Tensor, mask: torch.Tensor):
        """(now, deferred, gpu) int32 [T, k] of logical ids, -1 where a slot is not in that
        call; deferred is None without deferral; gpu = the slots the mask keeps on the GPU
        (only counted, for the routing statistics). Shape-static torch ops only (capturable)."""
        E, k = self.num_experts, ids.shape[-1]
        ids = ids.to(torch.long)
        valid = (ids >= 0) & (ids < E)
        safe = torch.where(valid, ids, torch.zeros_like(ids))
        kept = valid & ~mask[safe]
        logical = safe if self._p2l is None else self._p2l.to(ids.device)[safe]
        gpu = torch.where(valid & ~kept, logical, -1).to(torch.int32)
        K = self.max_deferred_experts_per_token
        if K == 0:
            return torch.where(kept, logical, -1).to(torch.int32), None, gpu
        pk = k - K
        if pk <= 0:
            prot = torch.zeros_like(valid)
        else:
            score = w.to(torch.float32).masked_fill(~valid, float("-inf"))
            top = torch.topk(score, pk, dim=-1, largest=True, sorted=False).indices
            pid = torch.gather(ids, -1, top)
            pvalid = torch.gather(valid, -1, top)
            flag = torch.zeros(E + 1, dtype=torch.bool, device=ids.device)
            flag.scatter_(0, torch.where(pvalid, pid, E).reshape(-1), True)
            prot = valid & flag[safe]
        now = torch.where(kept & prot, logical, -1).to(torch.int32)
        dfr = torch.where(kept & ~prot, logical, -1).to(torch.int32)
        return now, dfr, gpu

    # ---- the host side of one call (CPU path: directly; CUDA path: host functions) ------

    def _check_servable(self, ids: torch.Tensor) -> None:
        ctx = self._ctx
        if ctx.caller_pairs == 0:
            return
        row = ctx.servable[self.layer_idx]
        bad = (ids >= 0) & ~row[ids.clamp(min=0).to(torch.long)]
        if bool(bad.any()):
            x = int(ids[bad][0])
            raise ValueError(f"layer {self.layer_idx}: expert {x} is not in gpu_experts_mask now, "
                             f"but no server serves it (it was the GPU's when {ctx.path} was "
                             "opened, so it was left to the GPU)")

    def _fill(self, req, ids, st: _Stage, T: int, x_ptr: int, code: int,
              part: bool = False, followed: bool = False) -> None:
        vp, u32 = ctypes.c_void_p, ctypes.c_uint32
        lib = self._ctx.lib
        if lib.layout("gc_layer_req.caller_ids", strict=False) >= 0:  # routing statistics
            req.set("caller_ids", vp, None if part else st.ids_gpu.data_ptr())
            flags = lib.layout("GC_REQ_PART") if part else 0
            if followed:  # the deferred part is submitted right after (a newer library)
                flags |= max(lib.layout("GC_REQ_FOLLOWED", strict=False), 0)
            req.set("flags", u32, flags)
        req.set("layer", u32, self.layer_idx)
        req.set("n_tokens", u32, T)
        req.set("top_k", u32, self.num_experts_per_tok)
        req.set("ids", vp, ids.data_ptr())
        req.set("weights", vp, st.w.data_ptr())
        req.set("x", vp, x_ptr)
        req.set("dtype", ctypes.c_int, code)

    def _host_submit(self, st: _Stage, T: int, x_ptr: int, code: int, has_def: bool) -> None:
        ctx = self._ctx
        d = ctx.deferred
        self._prev_def = None
        if d is not None:
            ctx.deferred = None
            if d[0] == self.layer_idx - 1 and d[1] == T:
                self._prev_def = d[2]
            else:  # kt-kernel loses it the same way (its buffers are keyed by layer and T)
                log.warning("moerpc: layer %d (T=%d) dropped the deferred experts of layer %d "
                            "(T=%d): only layer %d can take them", self.layer_idx, T, d[0], d[1],
                            d[0] + 1)
                ctx.cancel(d[2])
        self._check_servable(st.ids_now)
        if has_def:
            self._check_servable(st.ids_def)
        self._fill(st.req_now, st.ids_now, st, T, x_ptr, code, followed=has_def)
        try:
            self._pending = ctx.submit(st.req_now)
            if has_def:
                self._fill(st.req_def, st.ids_def, st, T, x_ptr, code, part=True)
                ctx.deferred = (self.layer_idx, T, ctx.submit(st.req_def))
        except BaseException:
            ctx.cancel(self._pending)
            ctx.cancel(self._prev_def)
            self._pending = self._prev_def = None
            raise

    def _host_wait(self, st: _Stage) -> None:
        ctx = self._ctx
        p, prev = self._pending, self._prev_def
        self._pending = self._prev_def = None
        st.out.zero_()
        if p is None:  # the submit failed (CUDA path: already recorded)
            ctx.cancel(prev)
            return
        try:
            ctx.wait_into(p, st.out)
        except BaseException:
            ctx.cancel(prev)
            ctx.drop_deferred()
            raise
        if prev is not None:
            try:
                ctx.wait_into(prev, st.out)
            except MoeRpcError as ex:
                ctx.drop_deferred()
                raise MoeRpcError(ex.code, ex.name, f"deferred experts of layer "
                                  f"{self.layer_idx - 1}: {ex}") from None

    # ---- the contract ------------------------------------------------------------------

    def submit_forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, cuda_stream=None) -> None:
        """Starts this layer's call (non-blocking). Must be followed by sync_forward."""
        if self._inflight is not None:
            raise RuntimeError(f"layer {self.layer_idx}: submit_forward twice without sync_forward")
        self._raise_cuda_error()
        if self._ctx.handle is None:
            self._ensure_open()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        T, k, H = x.shape[0], self.num_experts_per_tok, self.hidden_size
        if x.shape[-1] != H:
            raise ValueError(f"layer {self.layer_idx}: hidden_states has {x.shape[-1]} columns, "
                             f"expected hidden_size = {H}")
        if tuple(topk_ids.shape) != (T, k) or tuple(topk_weights.shape) != (T, k):
            raise ValueError(f"layer {self.layer_idx}: topk_ids {tuple(topk_ids.shape)} and "
                             f"topk_weights {tuple(topk_weights.shape)} must both be ({T}, {k})")
        xdtype = x.dtype if x.dtype in _WIRE else torch.bfloat16
        dev = x.device
        if T == 0:
            self._inflight = (None, 0, dev, x.dtype)
            return
        st = self._ctx.stage(T, k, H, dev, xdtype)
        if dev.type == "cpu":
            now, dfr, gpu = self._split(topk_ids.cpu(), topk_weights.cpu(), self.gpu_experts_mask)
            st.ids_now.copy_(now)
            st.ids_gpu.copy_(gpu)
            has_def = dfr is not None and bool((dfr >= 0).any())
            if has_def:
                st.ids_def.copy_(dfr)
            st.w.copy_(topk_weights)
            if x.dtype in _WIRE and x.is_contiguous():
                xs = x                      # sent from the caller's memory: no copy
            else:
                if st.x is None or st.x.dtype != xdtype:
                    st.x = torch.empty((T, H), dtype=xdtype)
                st.x.copy_(x)
                xs = st.x
            self._host_submit(st, T, xs.data_ptr(), _WIRE[xdtype], has_def)
        elif dev.type == "cuda":
            self._submit_cuda(st, x, topk_ids, topk_weights, cuda_stream, xdtype)
        else:
            raise ValueError(f"layer {self.layer_idx}: hidden_states on {dev}: only cpu and cuda")
        self._inflight = (st, T, dev, x.dtype)

    def sync_forward(self, hidden_states: torch.Tensor, cuda_stream=None) -> torch.Tensor:
        """Waits for this layer's call (and the previous layer's deferred one) and returns the
        sum, [T, hidden_size] in hidden_states' dtype on its device. CPU: a new tensor. CUDA:
        a buffer kept per batch size and layer parity (valid until the sync of layer + 2),
        filled in stream order."""
        if self._inflight is None:
            raise RuntimeError(f"layer {self.layer_idx}: sync_forward without submit_forward")
        st, T, dev, dtype = self._inflight
        self._inflight = None
        if st is None:
            return torch.zeros((0, self.hidden_size), dtype=dtype, device=dev)
        if dev.type == "cuda":
            return self._sync_cuda(st, cuda_stream)
        self._host_wait(st)
        return st.out.to(dtype) if dtype != torch.float32 else st.out.clone()

    def save_routing_stats(self, path: str, total: bool = False) -> None:
        """Writes the cluster's routing counters (all layers, GPU-masked slots included) to
        path as moerpc-stats JSON (input of moerpc-place plan); see _Cluster."""
        if self._ctx.handle is None:
            self._ensure_open()
        self._ctx.save_routing_stats(path, total)

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, cuda_stream=None) -> torch.Tensor:
        """submit_forward + sync_forward."""
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    @staticmethod
    def set_capture_batch_sizes(capture_bs: List[int]) -> None:
        """Batch sizes whose staging buffers are kept (CUDA graphs capture their addresses);
        others share one buffer set that the next other size replaces."""
        MoeRpcWrapper._capture_bs = list(capture_bs)

    @staticmethod
    def get_capture_batch_sizes() -> List[int]:
        return MoeRpcWrapper._capture_bs

    @staticmethod
    def clear_buffer_cache() -> None:
        for c in list(_Cluster._all.values()):
            c.stages.clear()
            c.temp_stage = None

    # ---- CUDA (tests/gpu/test_wrapper_cuda.py, on a GPU machine) ------------------------

    def _raise_cuda_error(self) -> None:
        if self._cuda_error is not None:
            ex, self._cuda_error = self._cuda_error, None
            raise ex

    def _host_call(self, fn):
        def call():
            try:
                fn()
            except BaseException as ex:  # cannot raise on the stream: keep it for the caller
                log.error("moerpc: layer %d: %s", self.layer_idx, ex)
                self._cuda_error = ex
        return call

    def _stream(self, cuda_stream, dev):
        if cuda_stream is None or cuda_stream == 0:
            return torch.cuda.current_stream(dev)
        if isinstance(cuda_stream, torch.cuda.Stream):
            return cuda_stream
        return torch.cuda.ExternalStream(int(cuda_stream), device=dev)

    def _submit_cuda(self, st, x, topk_ids, topk_weights, cuda_stream, xdtype):
        from . import _cuda
        stream = self._stream(cuda_stream, x.device)
        if self._mask_dev is None or self._mask_dev.device != x.device:
            self._mask_dev = torch.zeros(self.num_experts, dtype=torch.bool, device=x.device)
        with torch.cuda.stream(stream):
            self._mask_dev.copy_(self.gpu_experts_mask, non_blocking=True)
            now, dfr, gpu = self._split(topk_ids, topk_weights, self._mask_dev)
            st.ids_now.copy_(now, non_blocking=True)
            st.ids_gpu.copy_(gpu, non_blocking=True)
            if dfr is not None:
                st.ids_def.copy_(dfr, non_blocking=True)
            st.w.copy_(topk_weights.to(torch.float32), non_blocking=True)
            st.x.copy_(x.to(xdtype), non_blocking=True)
            key = ("submit", id(st))
            if key not in self._cuda_keys:
                K = self.max_deferred_experts_per_token
                self._cuda_keys[key] = _cuda.register(self._host_call(
                    lambda: self._host_submit(st, st.T, st.x.data_ptr(), _WIRE[xdtype],
                                              K > 0 and bool((st.ids_def >= 0).any()))))
            _cuda.launch(stream.cuda_stream, self._cuda_keys[key])

    def _sync_cuda(self, st, cuda_stream):
        from . import _cuda
        stream = self._stream(cuda_stream, st.out_dev.device)
        with torch.cuda.stream(stream):
            key = ("wait", id(st))
            if key not in self._cuda_keys:
                self._cuda_keys[key] = _cuda.register(self._host_call(lambda: self._host_wait(st)))
            _cuda.launch(stream.cuda_stream, self._cuda_keys[key])
            st.out_dev.copy_(st.out, non_blocking=True)
            res = st.result[self.layer_idx % 2]
            res.copy_(st.out_dev)
        return res


def close_all() -> None:
    """Closes every cluster this process opened (tests; at exit the OS does it)."""
    _Cluster.close_all()
