#!/usr/bin/env python3
"""test_python_wrapper.py - the moerpc Python package (gpu_client/python) against real
moerpc-server processes on loopback, kt-kernel's own KTMoEWrapper and sglang-kt.

Run by tests/integration/python_wrapper.sh inside the venv it prepares (torch on the CPU,
kt-kernel 0.7.2 --no-deps, the moerpc package installed with pip). One model made by
moerpc-mkmodel (3 MoE layers, 8 experts, top-4, H 128, I 64, bf16), two servers (experts
0-3, 4-7). The reference MoE is computed here in torch, fp32, from the same safetensors.

Cases (each prints ok / FAIL / skip; the last line is "python_wrapper: N passed, N failed, N skipped"):
  sglang_sequence      submit, other work, sync per layer; -1, out-of-range (E, E+5, 1000)
                       and GPU-masked ids; T = 1, 3, 5, 17 (1 and 3 captured)
  mask_live            the wrapper's mask changed in place between calls is honoured
  deferral             K = 2 on layers 0 and 1, K = 0 on the last: layer l's output is its
                       protected slots + layer l-1's deferred ones (kt-kernel's batch-wide
                       rule), checked against an independent reference, and shown to differ
                       from no deferral
  capture_sizes        captured batch sizes keep their buffers, others share one; results
                       stay right while sizes alternate
  bad_input            wrong hidden_size / layer / method / cluster path refused, naming them
  vs_ktkernel          kt-kernel's KTMoEWrapper (BF16, CPU) and ours, same weights and call
                       sequence, with and without deferral: within 1e-2 relative L2
  hook                 moerpc.sglang.install(): MOERPC -> ours, BF16 -> kt-kernel's,
                       unknown -> kt-kernel's ValueError; the .pth hooks a child process
                       started with MOERPC_SGLANG_HOOK=1 (and only then); the launcher's
                       dry run
  sglang_kt            (MOERPC_TEST_SGLANG=1, own venv) sglang-kt's kt_ep_wrapper imports
                       with the hook and its KTMoEWrapper constructs ours
  local_in_place       the cluster file's "local" experts (the library's own, on this CPU)
                       served in place with MOERPC_LOCAL_MAP_WEIGHTS=1: the packed numbers,
                       every pair counted as mapped; another value refused naming it
  wait_spin            MOERPC_WAIT_SPIN_US=200 gives the same results; -1, x and 10001
                       refused naming it
  server_killed        a server killed: sync_forward raises MoeRpcError naming it
"""
import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("MOERPC_BIN", os.path.join(ROOT, "build", "bin"))
E, K_TOP, H, I, LAYERS = 8, 4, 128, 64, 3
TOL = 1e-2  # relative L2: bf16 weights on the servers' AVX-512 BF16 kernel + bf16 output
results = {"passed": 0, "failed": 0, "skipped": 0}


def case(fn):
    name = fn.__name__
    try:
        r = fn()
    except Skip as s:
        print(f"skip python_wrapper.{name}: {s}", flush=True)
        results["skipped"] += 1
        return
    except Exception:
        print(f"FAIL python_wrapper.{name}:\n{traceback.format_exc()}", flush=True)
        results["failed"] += 1
        return
    print(f"ok   python_wrapper.{name}{(' (' + r + ')') if r else ''}", flush=True)
    results["passed"] += 1


class Skip(Exception):
    pass


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def check_close(got, want, what, tol=TOL):
    r = rel(got, want)
    if not r <= tol:
        raise AssertionError(f"{what}: relative L2 {r:.3g} > {tol}")
    return r


# ---- the model, the servers, the reference -----------------------------------------

class Cluster:
    def __init__(self, work):
        self.work = work
        self.model = os.path.join(work, "model")
        subprocess.run([os.path.join(BIN, "moerpc-mkmodel"), "--out", self.model, "--layers",
                        str(LAYERS), "--experts", str(E), "--topk", str(K_TOP), "--hidden", str(H),
                        "--inter", str(I), "--seed", "7"], check=True, capture_output=True)
        self.procs, servers = [], []
        for i, spec in enumerate(("0-3", "4-7")):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            log = open(os.path.join(work, f"s{i}.log"), "w")
            p = subprocess.Popen([os.path.join(BIN, "moerpc-server"), "--model", self.model,
                                  "--listen", f"127.0.0.1:{port}", "--experts", spec,
                                  "--threads", "1"], stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(p)
            servers.append(f'{{"name": "s{i}", "address": "127.0.0.1:{port}"}}')
        self.servers = servers
        self.path = os.path.join(work, "cluster.json")
        with open(self.path, "w") as f:
            f.write('{"deadline_ms": 10000, "servers": [' + ", ".join(servers) + "]}\n")
        t0 = time.time()
        while time.time() - t0 < 60:
            up = sum("serving" in open(os.path.join(work, f"s{i}.log")).read() for i in range(2))
            if up == 2:
                break
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a server died: " + open(os.path.join(work, "s0.log")).read()[-2000:])
            time.sleep(0.05)
        else:
            raise RuntimeError("servers not serving after 60 s")
        from safetensors.torch import load_file
        self.w = {}
        for f in glob.glob(os.path.join(self.model, "*.safetensors")):
            self.w.update(load_file(f))

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            p.wait(timeout=20)

    def expert(self, layer, e, x):
        p = f"model.layers.{layer}.mlp.experts.{e}."
        g = self.w[p + "gate_proj.weight"].float()
        u = self.w[p + "up_proj.weight"].float()
        d = self.w[p + "down_proj.weight"].float()
        xf = x.float()
        return (torch.nn.functional.silu(xf @ g.T) * (xf @ u.T)) @ d.T

    def ref(self, layer, x, ids, w, run):
        """sum over slots with run[t, j] of w * expert(x): fp32, written slot by slot."""
        out = torch.zeros(x.shape[0], H)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                if run[t][j]:
                    out[t] += float(w[t, j]) * self.expert(layer, int(ids[t, j]), x[t:t + 1])[0]
        return out


def kept(ids, mask):
    return [[0 <= int(e) < E and not bool(mask[int(e)]) for e in row] for row in ids]


def split_kt(ids, w, mask, K):
    """kt-kernel's select_deferred_experts, written independently: per token the k-K
    largest weights are protected; an expert protected for any token runs now everywhere."""
    T, k = ids.shape
    protected = set()
    for t in range(T):
        order = sorted((j for j in range(k) if 0 <= int(ids[t, j]) < E), key=lambda j: -float(w[t, j]))
        protected.update(int(ids[t, j]) for j in order[:max(0, k - K)])
    kp = kept(ids, mask)
    now = [[kp[t][j] and int(ids[t, j]) in protected for j in range(k)] for t in range(T)]
    dfr = [[kp[t][j] and int(ids[t, j]) not in protected for j in range(k)] for t in range(T)]
    return now, dfr


def routing(g, T, special=True):
    ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)]).to(torch.long)
    if special and T >= 2:
        ids[0, 1] = -1
        ids[1, 0] = E
        ids[1, 3] = E + 5
        ids[-1, 2] = 1000
    w = torch.rand(T, K_TOP, generator=g)
    return ids, w


def wrappers(cl, K=0, mask=None, layers=LAYERS, method="MOERPC"):
    import moerpc
    out = []
    for layer in range(layers):
        kd = K if layer < layers - 1 else 0  # sglang-kt: the last layer never defers
        w = moerpc.MoeRpcWrapper(layer, E, K_TOP, H, I, mask, 1, 1, cl.path, 64,
                                 max_deferred_experts_per_token=kd, method=method)
        w.load_weights(torch.arange(E))
        out.append(w)
    return out


def other_work():
    a = torch.randn(64, 64)
    return (a @ a).sum()


# ---- cases ----------------------------------------------------------------------------

def sglang_sequence():
    import moerpc
    moerpc.MoeRpcWrapper.set_capture_batch_sizes([1, 3])
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[2, 5]] = True
    ws = wrappers(CL, mask=mask)
    g = torch.Generator().manual_seed(11)
    worst = 0.0
    for T in (1, 3, 5, 17):
        for layer, wr in enumerate(ws):
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            ids, w = routing(g, T)
            wr.submit_forward(x, ids, w, 0)
            other_work()
            out = wr.sync_forward(x, 0)
            if out.dtype != torch.bfloat16 or tuple(out.shape) != (T, H):
                raise AssertionError(f"output {out.dtype} {tuple(out.shape)}")
            want = CL.ref(layer, x, ids, w, kept(ids, mask))
            worst = max(worst, check_close(out, want, f"T={T} layer {layer}"))
    # a token whose slots are all skipped gives exactly 0
    x = torch.randn(2, H).to(torch.bfloat16)
    ids = torch.tensor([[2, 5, -1, 9], [0, 1, 3, 4]])
    out = ws[0].forward(x, ids, torch.rand(2, K_TOP), 0)
    if float(out[0].abs().max()) != 0.0:
        raise AssertionError("a token with only masked / empty / out-of-range slots is not 0")
    return f"worst rel L2 {worst:.2e}"


def routing_stats():
    """The library counts every slot, GPU-masked ones included, and a deferred part is no
    extra step: one pass of T tokens over every layer gives rows of T x k and one step."""
    import json
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[2, 5]] = True
    ws = wrappers(CL, K=2, mask=mask)
    path = os.path.join(CL.work, "routing0.json")
    ws[0].save_routing_stats(path, total=True)
    before = json.load(open(path))
    g = torch.Generator().manual_seed(21)
    T = 5
    want = [[0] * E for _ in range(LAYERS)]
    for layer, wr in enumerate(ws):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids, w = routing(g, T, special=False)
        for e in ids.reshape(-1).tolist():
            want[layer][e] += 1
        wr.forward(x, ids, w, 0)
    ws[0].save_routing_stats(path, total=True)
    s = json.load(open(path))
    got = [[a - b for a, b in zip(r, r0)] for r, r0 in zip(s["counts"], before["counts"])]
    if s["format"] != "moerpc-stats" or s["window"]["kind"] != "since_reset":
        raise AssertionError(f"header {s['window']}")
    if got != want:
        raise AssertionError(f"counts {got}, want the ids' histogram {want}")
    if s["window"]["steps"] - before["window"]["steps"] != 1:
        raise AssertionError(f"steps {before['window']['steps']} -> {s['window']['steps']}, want one more")
    gpu = sum(want[l][2] + want[l][5] for l in range(LAYERS))
    return f"{gpu} GPU-masked slots counted"


def mask_live():
    ws = wrappers(CL)
    wr = ws[1]
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, H, generator=g).to(torch.bfloat16)
    ids, w = routing(g, 6, special=False)
    out0 = wr.forward(x, ids, w, 0)
    check_close(out0, CL.ref(1, x, ids, w, kept(ids, torch.zeros(E, dtype=torch.bool))), "mask none")
    wr.gpu_experts_mask[[0, 4, 7]] = True  # in place, as sglang-kt's update_kt_wrapper_masks
    new = wr.gpu_experts_mask.clone()
    out1 = wr.forward(x, ids, w, 0)
    check_close(out1, CL.ref(1, x, ids, w, kept(ids, new)), "mask 0,4,7")
    if rel(out1, out0) < 0.05:
        raise AssertionError("changing the mask did not change the output")
    wr.gpu_experts_mask.zero_()
    check_close(wr.forward(x, ids, w, 0), out0, "mask cleared again", 1e-6)


def deferral():
    Kd = 2
    mask = torch.zeros(E, dtype=torch.bool)
    mask[6] = True
    ws = wrappers(CL, K=Kd, mask=mask)
    g = torch.Generator().manual_seed(13)
    T = 5
    moved = 0
    for rnd in range(2):  # two passes: nothing may leak from one pass into the next
        prev = None
        for layer, wr in enumerate(ws):
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            ids, w = routing(g, T, special=(layer == 1))
            kd = Kd if layer < LAYERS - 1 else 0
            now, dfr = split_kt(ids, w, mask, kd) if kd else (kept(ids, mask), None)
            wr.submit_forward(x, ids, w, 0)
            other_work()
            out = wr.sync_forward(x, 0)
            want = CL.ref(layer, x, ids, w, now)
            if prev is not None:
                want += prev
            check_close(out, want, f"pass {rnd} layer {layer} (K={kd})")
            nodef = CL.ref(layer, x, ids, w, kept(ids, mask))
            if dfr is not None and any(any(r) for r in dfr):
                moved += 1
                prev = CL.ref(layer, x, ids, w, dfr)
                if rel(out, nodef) < 5 * TOL and prev is not None and layer == 0:
                    raise AssertionError("deferral changed nothing measurable")
            else:
                prev = None
    if moved == 0:
        raise AssertionError("no slot was deferred: the case tests nothing")
    return f"{moved} layer calls deferred slots"


def capture_sizes():
    import moerpc
    from moerpc.wrapper import _Cluster
    moerpc.MoeRpcWrapper.set_capture_batch_sizes([4])
    if moerpc.MoeRpcWrapper.get_capture_batch_sizes() != [4]:
        raise AssertionError("get_capture_batch_sizes")
    moerpc.MoeRpcWrapper.clear_buffer_cache()
    ws = wrappers(CL)
    ctx = _Cluster.get(CL.path)
    g = torch.Generator().manual_seed(14)
    for T in (4, 7, 4, 9, 7, 4):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids, w = routing(g, T)
        check_close(ws[2].forward(x, ids, w, 0), CL.ref(2, x, ids, w, kept(ids, torch.zeros(E))),
                    f"T={T}")
    keys = sorted(k[0] for k in ctx.stages)
    if keys != [4] or ctx.temp_stage is None or ctx.temp_stage[0][0] != 7:
        raise AssertionError(f"captured stages {keys}, temp {ctx.temp_stage and ctx.temp_stage[0]}")
    moerpc.MoeRpcWrapper.clear_buffer_cache()
    if ctx.stages or ctx.temp_stage is not None:
        raise AssertionError("clear_buffer_cache kept buffers")


def bad_input():
    import moerpc

    def refused(what, exc, **kw):
        a = dict(layer_idx=0, num_experts=E, num_experts_per_tok=K_TOP, hidden_size=H,
                 moe_intermediate_size=I, gpu_experts_mask=None, cpuinfer_threads=1,
                 threadpool_count=1, weight_path=CL.path, chunked_prefill_size=64,
                 method="MOERPC")
        a.update(kw)
        try:
            moerpc.MoeRpcWrapper(**a)
        except exc as ex:
            if what not in str(ex):
                raise AssertionError(f"{kw}: message {ex!r} does not name {what!r}")
            return
        raise AssertionError(f"{kw} was accepted")

    refused("hidden_size", ValueError, hidden_size=H * 2)
    refused("moe_intermediate_size", ValueError, moe_intermediate_size=I + 1)
    refused("layer_idx 3", ValueError, layer_idx=3)
    refused("MOERPC", ValueError, method="BF16")
    refused("cluster file", ValueError, weight_path=os.path.join(CL.work, "nope.json"))
    refused("max_deferred", ValueError, max_deferred_experts_per_token=5)
    wr = wrappers(CL, layers=1)[0]
    try:
        wr.submit_forward(torch.zeros(2, H), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 0)
    except ValueError as ex:
        if "topk_ids" not in str(ex):
            raise
    else:
        raise AssertionError("wrong top-k shape accepted")


def vs_ktkernel():
    os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"  # kt-kernel's synchronous path (no CUDA stream)
    try:
        import kt_kernel
        sys.path.insert(0, os.path.join(ROOT, "tests", "bench"))
        from vs_ktkernel import nopin_shim
        shim = nopin_shim()
    except Exception as ex:
        raise Skip(f"kt-kernel cannot be imported here: {type(ex).__name__}: {ex}")
    from kt_kernel import KTMoEWrapper
    import moerpc.sglang
    if moerpc.sglang.installed():
        KTMoEWrapper = KTMoEWrapper._moerpc_original
    worst = {}
    for Kd in (0, 2):
        mask = torch.zeros(E, dtype=torch.bool)
        mask[3] = True
        try:
            kt = []
            for layer in range(LAYERS):
                w = KTMoEWrapper(layer_idx=layer, num_experts=E, num_experts_per_tok=K_TOP,
                                 hidden_size=H, moe_intermediate_size=I, gpu_experts_mask=mask,
                                 cpuinfer_threads=1, threadpool_count=1, weight_path=CL.model,
                                 chunked_prefill_size=64, method="BF16",
                                 max_deferred_experts_per_token=Kd if layer < LAYERS - 1 else 0)
                w.load_weights(torch.arange(E, dtype=torch.int64))
                kt.append(w)
        except Exception as ex:
            raise Skip(f"kt-kernel's BF16 wrapper cannot run here: {type(ex).__name__}: {ex}")
        ours = wrappers(CL, K=Kd, mask=mask)
        g = torch.Generator().manual_seed(20 + Kd)
        r_max = 0.0
        for T in (1, 6):
            for rnd in range(2):
                for layer in range(LAYERS):
                    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
                    # kt-kernel's deferral cannot take -1 / out-of-range ids (its scatter_)
                    ids, w = routing(g, T, special=(Kd == 0))
                    if rnd == 1 and layer == 1:  # a mask change between calls, on both sides
                        kt[layer].gpu_experts_mask[[1, 6]] = True
                        ours[layer].gpu_experts_mask[[1, 6]] = True
                    outs = []
                    for wr in (kt[layer], ours[layer]):
                        wr.submit_forward(x, ids, w, 0)
                        other_work()
                        outs.append(wr.sync_forward(x, 0).clone())
                    r_max = max(r_max, check_close(outs[1], outs[0], f"K={Kd} T={T} layer {layer}"))
        worst[Kd] = r_max
        del kt
    return (f"rel L2 ours vs kt-kernel: K=0 {worst[0]:.2e}, K=2 {worst[2]:.2e}; kt-kernel "
            f"{kt_kernel.__version__} {kt_kernel.__cpu_variant__}{', pin_memory shim' if shim else ''}")


def hook():
    try:
        import kt_kernel
    except Exception as ex:
        raise Skip(f"kt-kernel cannot be imported here: {type(ex).__name__}: {ex}")
    import moerpc
    import moerpc.sglang as ms
    orig = kt_kernel.KTMoEWrapper
    ms.install()
    ms.install()  # idempotent
    F = kt_kernel.KTMoEWrapper
    if not ms.installed() or F is orig and not getattr(orig, "_moerpc_hooked", False):
        raise AssertionError("install() did not replace kt_kernel.KTMoEWrapper")
    if kt_kernel.experts.KTMoEWrapper is not F:
        raise AssertionError("kt_kernel.experts.KTMoEWrapper not replaced")
    args = (0, E, K_TOP, H, I, None, 1, 1, CL.path, 64)
    w = F(*args, method="MOERPC")
    if not isinstance(w, moerpc.MoeRpcWrapper):
        raise AssertionError(f"MOERPC gave {type(w)}")
    w2 = F(*args, False, 1, "MOERPC")  # positional method, as a caller may pass it
    if not isinstance(w2, moerpc.MoeRpcWrapper) or w2.max_deferred_experts_per_token != 1:
        raise AssertionError("positional MOERPC")
    from kt_kernel.experts_base import BaseMoEWrapper
    kt_args = (0, E, K_TOP, H, I, None, 1, 1, CL.model, 64)
    try:
        b = F(*kt_args, method="BF16")
        if not isinstance(b, BaseMoEWrapper) or isinstance(b, moerpc.MoeRpcWrapper):
            raise AssertionError(f"BF16 gave {type(b)}")
    except RuntimeError as ex:  # no CUDA driver: kt-kernel's own pinned allocation
        if "NVIDIA driver" not in str(ex):
            raise
    try:
        F(*kt_args, method="NOPE")
    except ValueError as ex:
        if "NOPE" not in str(ex):
            raise
    else:
        raise AssertionError("unknown method accepted")
    F.set_capture_batch_sizes([2, 8])
    if moerpc.MoeRpcWrapper.get_capture_batch_sizes() != [2, 8] or F.get_capture_batch_sizes() != [2, 8]:
        raise AssertionError("set_capture_batch_sizes did not reach both")
    F.clear_buffer_cache()
    # a child process: hooked through the .pth only with MOERPC_SGLANG_HOOK=1
    prog = "import kt_kernel; print(getattr(kt_kernel.KTMoEWrapper, '_moerpc_hooked', False))"
    env = dict(os.environ)
    for val, want in (("1", "True"), ("", "False")):
        env["MOERPC_SGLANG_HOOK"] = val
        r = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True)
        if r.returncode != 0 or r.stdout.strip().splitlines()[-1:] != [want]:
            raise AssertionError(f"child with MOERPC_SGLANG_HOOK={val!r}: rc {r.returncode} "
                                 f"out {r.stdout[-300:]!r} err {r.stderr[-600:]!r}")
    # the launcher
    r = subprocess.run([sys.executable, "-m", "moerpc.sglang", "--moerpc-dry-run", "--model-path",
                        "m", "--kt-method", "MOERPC", "--kt-weight-path", CL.path],
                       capture_output=True, text=True)
    if r.returncode != 0 or "hook installed" not in r.stdout or "warning" in r.stderr:
        raise AssertionError(f"launcher dry run: rc {r.returncode} {r.stdout!r} {r.stderr[-600:]!r}")
    r = subprocess.run([sys.executable, "-m", "moerpc.sglang", "--moerpc-dry-run", "--kt-method",
                        "MOERPC", "--kt-weight-path", os.path.join(CL.work, "missing.json")],
                       capture_output=True, text=True)
    if r.returncode == 0 or "no such file" not in r.stderr:
        raise AssertionError(f"launcher took a missing cluster file: {r.returncode} {r.stderr!r}")


def sglang_kt():
    py = os.environ.get("MOERPC_SGLANG_PY")
    if not py:
        raise Skip(os.environ.get("MOERPC_SGLANG_SKIP", "opt-in: MOERPC_TEST_SGLANG=1 "
                                  "(installs sglang-kt in build/venv-sglang)"))
    prog = r"""
import os, sys, json
os.environ["MOERPC_SGLANG_HOOK"] = "1"
import moerpc.sglang as ms
ms.install_on_import()
try:
    import sglang.srt.layers.moe.kt_ep_wrapper as ep
except Exception as ex:
    import traceback
    print(json.dumps({"import_error": f"{type(ex).__name__}: {ex}", "tb": traceback.format_exc()[-1500:]}))
    sys.exit(0)
import moerpc, torch
F = ep.KTMoEWrapper
w = F(layer_idx=1, num_experts=%d, num_experts_per_tok=%d, hidden_size=%d, moe_intermediate_size=%d,
      gpu_experts_mask=torch.zeros(%d, dtype=torch.bool), cpuinfer_threads=1, threadpool_count=1,
      weight_path=%r, chunked_prefill_size=64, method="MOERPC", max_deferred_experts_per_token=0,
      swiglu_limit=0.0, swiglu_alpha=0.0)
print(json.dumps({"available": ep.KTRANSFORMERS_AVAILABLE, "hooked": getattr(F, "_moerpc_hooked", False),
                  "type": type(w).__name__, "ours": isinstance(w, moerpc.MoeRpcWrapper)}))
""" % (E, K_TOP, H, I, E, CL.path)
    r = subprocess.run([py, "-c", prog], capture_output=True, text=True, timeout=600)
    import json
    line = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode != 0 or not line:
        raise AssertionError(f"rc {r.returncode}: {r.stderr[-2000:]}")
    d = json.loads(line[-1])
    if "import_error" in d and "libcuda.so.1" in d["import_error"] + d["tb"]:
        raise Skip("sglang-kt's kt_ep_wrapper cannot be imported without a GPU driver: "
                   "sglang.srt.layers.moe -> moe_runner/deep_gemm.py `from sgl_kernel import "
                   "silu_and_mul` -> sgl_kernel loads sm100/common_ops.abi3.so, which needs "
                   "libcuda.so.1 (" + d["import_error"][:200] + ")")
    if "import_error" in d:
        raise AssertionError("kt_ep_wrapper does not import here: " + d["import_error"] + "\n" + d["tb"])
    if not (d["available"] and d["hooked"] and d["ours"]):
        raise AssertionError(f"kt_ep_wrapper: {d}")
    return f"kt_ep_wrapper.KTMoEWrapper(method=MOERPC) -> {d['type']}"


def local_in_place():
    """The cluster file's "local" experts (computed by the library on this host's CPU, as
    kt-kernel's are), served in place from the model's files with MOERPC_LOCAL_MAP_WEIGHTS=1
    (gc_options.local_map_weights): the same numbers as packed, and the library says how many
    pairs it mapped. A value other than 0 / 1 is refused naming it."""
    import moerpc
    from moerpc import wrapper as W
    outs = []
    g = torch.Generator().manual_seed(23)
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    ids, w = routing(g, 5, special=False)
    for v in ("0", "1"):
        path = os.path.join(CL.work, f"local{v}.json")
        with open(path, "w") as f:
            f.write('{"model": "%s", "deadline_ms": 10000, "servers": [%s], '
                    '"local": {"layers": "all", "experts": "4-7"}}\n' % (CL.model, CL.servers[0]))
        os.environ["MOERPC_LOCAL_MAP_WEIGHTS"] = v
        try:
            wr = moerpc.MoeRpcWrapper(0, E, K_TOP, H, I, None, 1, 1, path, 64)
            wr.load_weights(torch.arange(E))
            outs.append(wr.forward(x, ids, w, 0))
        finally:
            del os.environ["MOERPC_LOCAL_MAP_WEIGHTS"]
        info = W._Cluster.get(path).info
        if info["local_pairs"] != LAYERS * 4 or info["local_mapped"] != (LAYERS * 4 if v == "1" else 0):
            raise AssertionError(f"MOERPC_LOCAL_MAP_WEIGHTS={v}: local_pairs "
                                 f"{info['local_pairs']}, local_mapped {info['local_mapped']}")
    if not torch.equal(outs[0], outs[1]):
        raise AssertionError("local experts in place differ from packed ones")
    want = CL.ref(0, x, ids, w, kept(ids, torch.zeros(E, dtype=torch.bool)))
    err = check_close(outs[1], want, "local in place")
    path = os.path.join(CL.work, "local2.json")
    with open(path, "w") as f:
        f.write(open(os.path.join(CL.work, "local1.json")).read())
    os.environ["MOERPC_LOCAL_MAP_WEIGHTS"] = "yes"
    try:
        wr = moerpc.MoeRpcWrapper(0, E, K_TOP, H, I, None, 1, 1, path, 64)
        wr.load_weights(torch.arange(E))
        wr.forward(x, ids, w, 0)
        raise AssertionError("MOERPC_LOCAL_MAP_WEIGHTS=yes was accepted")
    except ValueError as e:
        if "MOERPC_LOCAL_MAP_WEIGHTS='yes'" not in str(e):
            raise
    finally:
        del os.environ["MOERPC_LOCAL_MAP_WEIGHTS"]
    return f"{LAYERS * 4} pairs in place, rel L2 {err:.2e}"


def wait_spin():
    """MOERPC_WAIT_SPIN_US (gc_options.wait_spin_us): the waiter watches for the replies
    before sleeping: the same numbers; a negative or non-numeric value is refused naming it,
    one over the library's limit by the library."""
    import moerpc
    g = torch.Generator().manual_seed(29)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    ids, w = routing(g, 3, special=False)
    mask = torch.zeros(E, dtype=torch.bool)
    outs = []
    for i, v in enumerate(("0", "200", "-1", "x", "10001")):
        path = os.path.join(CL.work, f"spin{i}.json")
        with open(path, "w") as f:
            f.write(open(CL.path).read())
        os.environ["MOERPC_WAIT_SPIN_US"] = v
        try:
            wr = moerpc.MoeRpcWrapper(0, E, K_TOP, H, I, mask, 1, 1, path, 64)
            wr.load_weights(torch.arange(E))
            outs.append(wr.forward(x, ids, w, 0))
            if i >= 2:
                raise AssertionError(f"MOERPC_WAIT_SPIN_US={v} was accepted")
        except (ValueError, moerpc.MoeRpcError) as e:
            if i < 2 or ("MOERPC_WAIT_SPIN_US" not in str(e) and "wait_spin_us" not in str(e)):
                raise
        finally:
            del os.environ["MOERPC_WAIT_SPIN_US"]
    if not torch.equal(outs[0], outs[1]):
        raise AssertionError("results differ with MOERPC_WAIT_SPIN_US=200")
    return "same results; -1, x and 10001 refused"


def server_killed():
    import moerpc
    ws = wrappers(CL, layers=1)
    CL.procs[1].kill()
    CL.procs[1].wait()
    x = torch.randn(4, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 4, 5, 6]] * 4)
    try:
        ws[0].submit_forward(x, ids, torch.rand(4, K_TOP), 0)
        ws[0].sync_forward(x, 0)
    except moerpc.MoeRpcError as ex:
        if "s1" not in str(ex):
            raise AssertionError(f"error does not name the server: {ex}")
        return f"{ex.name}: {str(ex)[:100]}"
    raise AssertionError("no error with a server killed")


def main():
    global CL
    if not torch.__version__:
        raise SystemExit("no torch")
    work = tempfile.mkdtemp(prefix="moerpc-py-", dir=os.environ.get("TMPDIR", "/tmp"))
    CL = Cluster(work)
    try:
        for fn in (sglang_sequence, mask_live, routing_stats, deferral, capture_sizes, bad_input, vs_ktkernel,
                   hook, sglang_kt, local_in_place, wait_spin, server_killed):
            case(fn)
    finally:
        import moerpc
        moerpc.close_all()
        CL.stop()
    print(f"python_wrapper: {results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped")
    sys.exit(1 if results["failed"] else 0)


if __name__ == "__main__":
    main()
