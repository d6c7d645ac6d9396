#!/usr/bin/env python3
"""test_wrapper_cuda.py - the SGLang adapter's CUDA-tensor path (moerpc.MoeRpcWrapper with
hidden states, ids and weights on a GPU) against the same calls made with CPU tensors, on
two real moerpc-server processes on loopback. Needs a CUDA device and torch with CUDA; run
by tests/gpu/run.sh on the GPU machine (PYTHONPATH=gpu_client/python, MOERPC_LIB and
MOERPC_BIN set there). The servers, the model and the reference are those of
tests/integration/test_python_wrapper.py (imported). The CPU-tensor path itself is checked against an fp32 reference in
tests/integration/test_python_wrapper.py; here each CUDA result must equal the CPU path's
for the same inputs (both are the servers' fp32 sums rounded to the caller's dtype), and
the first case also checks the reference directly.

Cases (each prints ok / FAIL; the last line is "wrapper_cuda: N passed, N failed"):
  stream_order   submit on a side stream given as an int (sglang's cuda_stream), a GPU
                 matmul queued after it, sync on that stream, the result consumed by a
                 kernel on the same stream before any host synchronisation; T = 1, 5, 17;
                 vs the CPU path and vs the fp32 reference
  deferral       K = 2 on layers 0 and 1, K = 0 on the last: CUDA == CPU path per layer
  graph_capture  every layer's submit + sync captured in one CUDA graph (T = 4, a captured
                 batch size), replayed three times on fresh inputs copied into the static
                 tensors; K = 0 and K = 2; each replay == the CPU path on the same inputs
"""
import os
import sys
import tempfile
import time
import traceback

import torch

# the servers, the model and the fp32 reference are the CPU-tensor test's own
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "integration"))
from test_python_wrapper import E, H, I, K_TOP, LAYERS, Cluster, kept, rel  # noqa: E402

TOL_REF = 1e-2   # servers' bf16 weights + bf16 output vs the fp32 reference
TOL_SAME = 1e-6  # CUDA path vs CPU path: the same server sums, the same rounding
res = {"passed": 0, "failed": 0}


def same(got, want, what, tol=TOL_SAME):
    r = rel(got.cpu(), want.cpu())
    if not r <= tol:
        raise AssertionError(f"{what}: relative L2 {r:.3g} > {tol}")
    return r


def case(fn):
    t0 = time.time()
    try:
        r = fn()
    except Exception:
        print(f"FAIL wrapper_cuda.{fn.__name__}:\n{traceback.format_exc()}", flush=True)
        res["failed"] += 1
        return
    print(f"ok   wrapper_cuda.{fn.__name__} ({time.time() - t0:.1f} s{'; ' + r if r else ''})",
          flush=True)
    res["passed"] += 1


def reference(layer, x, ids, w):
    """fp32 sum over the valid slots of w * expert(x), on the CPU."""
    ids = ids.cpu()
    return CL.ref(layer, x.cpu(), ids, w.cpu(), kept(ids, torch.zeros(E, dtype=torch.bool)))


def wrappers(K=0):
    import moerpc
    out = []
    for layer in range(LAYERS):
        kd = K if layer < LAYERS - 1 else 0
        w = moerpc.MoeRpcWrapper(layer, E, K_TOP, H, I, None, 1, 1, CL.path, 64,
                                 max_deferred_experts_per_token=kd, method="MOERPC")
        w.load_weights(torch.arange(E))
        out.append(w)
    return out


def inputs(g, T, n=LAYERS):
    """n layers of (x bf16, ids, w) on the CPU; ids include -1 and out-of-range slots."""
    out = []
    for _ in range(n):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K_TOP] for _ in range(T)]).to(torch.long)
        if T >= 2:
            ids[0, 1] = -1
            ids[1, 3] = E + 2
        out.append((x, ids, torch.rand(T, K_TOP, generator=g)))
    return out


def run_cpu(ws, layers_in):
    return [wr.forward(x, ids, w, 0) for wr, (x, ids, w) in zip(ws, layers_in)]


def stream_order():
    ws = wrappers()
    s = torch.cuda.Stream()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2048, 2048, device="cuda")
    worst_ref = 0.0
    for T in (1, 5, 17):
        lin = inputs(g, T)
        want = run_cpu(ws, lin)
        for layer, (wr, (x, ids, w)) in enumerate(zip(ws, lin)):
            with torch.cuda.stream(s):
                xc, ic, wc = x.cuda(), ids.cuda(), w.cuda()
                wr.submit_forward(xc, ic, wc, s.cuda_stream)
                busy = (a @ a).sum()            # GPU work that overlaps the call
                out = wr.sync_forward(xc, s.cuda_stream)
                y = out.float() * 2.0           # consumed in stream order, no host sync yet
            s.synchronize()
            if out.device.type != "cuda" or out.dtype != torch.bfloat16 or tuple(out.shape) != (T, H):
                raise AssertionError(f"output {out.device} {out.dtype} {tuple(out.shape)}")
            same(y / 2.0, want[layer], f"T={T} layer {layer} vs the CPU path")
            worst_ref = max(worst_ref, same(out, reference(layer, x, ids, w),
                                            f"T={T} layer {layer} vs the reference", TOL_REF))
            del busy
    return f"worst vs reference {worst_ref:.2e}"


def deferral():
    g = torch.Generator().manual_seed(2)
    T = 6
    lin = inputs(g, T)
    want = run_cpu(wrappers(K=2), lin)
    nodef = run_cpu(wrappers(K=0), lin)
    if rel(want[1], nodef[1]) < 1e-3:
        raise AssertionError("K=2 changed nothing on layer 1: the case tests nothing")
    ws = wrappers(K=2)
    s = torch.cuda.current_stream()
    outs = []
    for wr, (x, ids, w) in zip(ws, lin):
        xc = x.cuda()
        wr.submit_forward(xc, ids.cuda(), w.cuda(), s.cuda_stream)
        outs.append(wr.sync_forward(xc, s.cuda_stream).clone())
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        same(outs[layer], want[layer], f"layer {layer} (K=2) vs the CPU path")
    return ""


def graph_capture():
    import moerpc
    T = 4
    moerpc.MoeRpcWrapper.set_capture_batch_sizes([T])
    msgs = []
    for K in (0, 2):
        ws = wrappers(K=K)
        g = torch.Generator().manual_seed(3 + K)
        static = [(x.cuda(), ids.cuda(), w.cuda()) for x, ids, w in inputs(g, T)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())

        def step():
            outs = []
            for wr, (x, ids, w) in zip(ws, static):
                wr.submit_forward(x, ids, w, torch.cuda.current_stream().cuda_stream)
                outs.append(wr.sync_forward(x, torch.cuda.current_stream().cuda_stream).clone())
            return outs

        with torch.cuda.stream(s):          # warm-up (allocations, host-function keys)
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for rnd in range(3):
            lin = inputs(g, T)
            for (sx, si, sw), (x, ids, w) in zip(static, lin):
                sx.copy_(x)
                si.copy_(ids)
                sw.copy_(w)
            graph.replay()
            torch.cuda.synchronize()
            want = run_cpu(wrappers(K=K), lin)
            for layer in range(LAYERS):
                same(outs[layer], want[layer], f"K={K} replay {rnd} layer {layer} vs the CPU path")
        msgs.append(f"K={K}: 3 replays")
        del graph
    return ", ".join(msgs)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("wrapper_cuda: no CUDA device visible to torch")
        sys.exit(1)
    print(f"wrapper_cuda: torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    with tempfile.TemporaryDirectory() as work:
        CL = Cluster(work)
        try:
            for c in (stream_order, deferral, graph_capture):
                case(c)
        finally:
            import moerpc
            moerpc.close_all()
            CL.stop()
    print(f"wrapper_cuda: {res['passed']} passed, {res['failed']} failed", flush=True)
    sys.exit(1 if res["failed"] else 0)
