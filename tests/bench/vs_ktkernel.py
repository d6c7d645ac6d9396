#!/usr/bin/env python3
"""vs_ktkernel.py - moerpc's CPU MoE kernels side by side with kt-kernel (KTransformers).

Times one MoE layer call on the same shape, token counts and thread count in both:

  ours       build/bin/moerpc-bench-kernels --shape S --tokens T --format F --isa auto
             --threads N --layers L --repeats R --json    (median "us" of its JSON line)
  kt-kernel  KTMoEWrapper(method=M) of the PyPI wheel, weights quantized online from the
             same kind of bf16 tensors (load_weights_from_tensors) or read from a bf16
             safetensors file (BF16), or from an FP8 one in DeepSeek-V3's layout (FP8:
             e4m3 codes and a weight_scale_inv per 128 x 128 block, quantized here from the
             same bf16 tensors), one forward_task per call submitted to its CPUInfer
             and waited for (submit + sync), timed around those two calls from Python

  format pairs: bf16 <-> BF16 (both bf16 weights), int8 <-> AMXINT8 (both one scale per
  row), int4 <-> AMXINT4 (ours: group-wise scales, group 128 here; kt: one scale per row),
  fp8 <-> FP8 (both fp8-b128: e4m3 codes, one scale per 128 x 128 block).

Both sides cycle through L layers with fresh uniform top-k routing per call (k distinct
experts per token), so that the weights a call reads are not in the LLC from the previous
call; both report the median over R calls. The two are run alternately, --rounds times per
case, so that drift of a shared machine hits both; the ratio printed is
median(kt us) / median(our us): above 1 means moerpc is faster.

The script makes its own virtual environment (--venv, default build/venv-kt) and installs
kt-kernel there with pip (--no-deps: kt-kernel pins torch==2.9.1, a ~5 GB download; any
recent torch works for it since its extension does not link libtorch). torch comes from
--torch-site (a site-packages directory that already has torch, added through a .pth file)
or, without it, from PyPI. On a host without a CUDA driver kt-kernel's wrappers cannot even
be constructed (they allocate pinned host buffers); the script then hands kt-kernel a torch
whose tensor factories drop pin_memory (a shim, no kt-kernel code is changed or copied) and
says so. Findings on why each method can or cannot run: docs/BENCHMARKS.md.

usage: tests/bench/vs_ktkernel.py [--shape qwen3-30b-a3b] [--tokens 1,4,16,64]
         [--formats bf16,int8,int4] [--threads N] [--layers L] [--repeats R] [--rounds K]
         [--bench PATH] [--venv DIR] [--torch-site DIR] [--kt-version V] [--json FILE]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {  # hidden, moe_intermediate_size, experts, top-k (as moerpc-bench-kernels)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
}
KT_METHOD = {"bf16": "BF16", "int8": "AMXINT8", "int4": "AMXINT4", "fp8": "FP8"}


def fp8_b128(w):
    """bf16 [rows, cols] -> (e4m3 codes, fp32 scale_inv [rows/128, cols/128]): per 128 x 128
    block scale = amax / 448 (1 where the block is zero), codes = round(w / scale)."""
    import torch
    R, C = w.shape
    b = w.float().reshape(R // 128, 128, C // 128, 128)
    amax = b.abs().amax(dim=(1, 3))
    sc = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (b / sc[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(R, C).contiguous(), sc.contiguous()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--formats", default="bf16,int8,int4")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--layers", type=int, default=4,
                   help="layers cycled through on both sides (weights leave the LLC between calls)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternating ours/kt measurements per case")
    p.add_argument("--group", type=int, default=128, help="our int4 group size")
    p.add_argument("--bench", default=os.path.join(ROOT, "build", "bin", "moerpc-bench-kernels"))
    p.add_argument("--venv", default=os.path.join(ROOT, "build", "venv-kt"))
    p.add_argument("--torch-site", default=os.environ.get("MOERPC_TORCH_SITE"),
                   help="site-packages dir with torch to reuse instead of a PyPI install")
    p.add_argument("--kt-version", default="0.7.2")
    p.add_argument("--json", help="also write one JSON line per case to this file")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    a.tokens = [int(t) for t in a.tokens.split(",")]
    a.formats = a.formats.split(",")
    for f in a.formats:
        if f not in KT_METHOD:
            p.error(f"--formats: {f!r} must be one of {', '.join(KT_METHOD)}")
    if a.threads < 1 or a.layers < 1 or a.repeats < 1 or a.rounds < 1:
        p.error("--threads, --layers, --repeats and --rounds must be >= 1")
    return a


# ---- the virtual environment ---------------------------------------------------------

def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def ensure_venv(a):
    """Creates the venv with kt-kernel in it unless it is there; returns its python."""
    py = venv_python(a.venv)
    if not os.path.exists(py):
        print(f"# creating {a.venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", a.venv], check=True)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    if a.torch_site:
        with open(os.path.join(site, "zz_moerpc_torch_site.pth"), "w") as f:
            f.write(os.path.abspath(a.torch_site) + "\n")
    have = subprocess.run([py, "-c", "import torch, kt_kernel, gguf, safetensors"],
                          capture_output=True, text=True)
    if have.returncode == 0:
        return py
    pip = [py, "-m", "pip", "install", "--quiet"]
    if subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0:
        print("# installing torch from PyPI (large; pass --torch-site to reuse one)", file=sys.stderr)
        subprocess.run(pip + ["torch"], check=True)
    print(f"# installing kt-kernel=={a.kt_version} (--no-deps) and its import-time deps", file=sys.stderr)
    subprocess.run(pip + ["--no-deps", f"kt-kernel=={a.kt_version}"], check=True)
    subprocess.run(pip + ["gguf", "safetensors", "numpy"], check=True)
    return py


# ---- kt-kernel side (runs inside the venv) ---------------------------------------------

def nopin_shim():
    """kt-kernel allocates pinned buffers with pin_memory=True, which torch refuses on a
    host without a CUDA driver ("Found no NVIDIA driver on your system"). Give its modules
    a torch whose factories ignore pin_memory; returns whether the shim was needed."""
    import types
    import torch
    if torch.cuda.is_available():
        return False
    proxy = types.ModuleType("torch_nopin")
    proxy.__dict__.update(torch.__dict__)

    def strip(fn):
        def call(*args, **kw):
            kw.pop("pin_memory", None)
            return fn(*args, **kw)
        return call

    for name in ("zeros", "empty", "full", "ones", "tensor"):
        setattr(proxy, name, strip(getattr(torch, name)))
    import kt_kernel.experts_base as eb
    import kt_kernel.utils.amx as amx
    for mod in (eb, amx):
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy
    return True


class KtCase:
    """L kt-kernel layers of one method, loaded once, timed per token count."""

    def __init__(self, a, method, workdir):
        import torch
        from kt_kernel import KTMoEWrapper
        H, I, E, k = SHAPES[a.shape]
        self.a, self.method, self.k, self.E, self.H = a, method, k, E, H
        g = torch.Generator().manual_seed(a.seed)
        # One set of bf16 weights for all layers: each layer still packs its own copy, so
        # the bytes a call reads are distinct per layer.
        gate = (torch.randn(E, I, H, generator=g) * 0.02).to(torch.bfloat16)
        up = (torch.randn(E, I, H, generator=g) * 0.02).to(torch.bfloat16)
        down = (torch.randn(E, H, I, generator=g) * 0.02).to(torch.bfloat16)
        self.layers = []
        t0 = time.time()
        from_file = method in ("BF16", "FP8")
        if from_file:
            from safetensors.torch import save_file
            path = os.path.join(workdir, method.lower())
            os.makedirs(path, exist_ok=True)
            for layer in range(a.layers):
                t = {}
                for e in range(E):
                    base = f"model.layers.{layer}.mlp.experts.{e}."
                    for name, m in (("gate_proj", gate[e]), ("up_proj", up[e]), ("down_proj", down[e])):
                        if method == "BF16":
                            t[base + name + ".weight"] = m.contiguous()
                        else:
                            t[base + name + ".weight"], t[base + name + ".weight_scale_inv"] = fp8_b128(m)
                save_file(t, os.path.join(path, f"layer{layer}.safetensors"))
                del t
        # kt-kernel's int8/int4 buffers need max_len to be a multiple of M_STEP = 32 (it
        # refuses "max_m and k must be multiple of M_STEP and K_STEP" otherwise).
        chunk = max(32, -(-max(a.tokens) // 32) * 32)
        for layer in range(a.layers):
            wpath = path if from_file else os.path.join(workdir, f"{method}-{layer}")
            os.makedirs(wpath, exist_ok=True)
            w = KTMoEWrapper(layer_idx=layer, num_experts=E, num_experts_per_tok=k, hidden_size=H,
                             moe_intermediate_size=I, gpu_experts_mask=None,
                             cpuinfer_threads=a.threads, threadpool_count=1, weight_path=wpath,
                             chunked_prefill_size=chunk, method=method)
            if from_file:
                w.load_weights(torch.arange(E, dtype=torch.int64))
            else:
                w.load_weights_from_tensors(gate, up, down, torch.arange(E, dtype=torch.int64))
            self.layers.append(w)
        del gate, up, down
        self.load_s = time.time() - t0

    def time_us(self, T, seed):
        """Median wall time of one layer call (submit + sync) over a.repeats calls."""
        import torch
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(T, self.H, generator=g)).to(torch.bfloat16)
        wts = torch.rand(T, self.k, generator=g, dtype=torch.float32)
        out = torch.zeros(T, self.H, dtype=torch.bfloat16)
        bsz = torch.tensor([T], dtype=torch.int32)
        calls = self.a.repeats + len(self.layers)  # one warm-up call per layer
        ids = [torch.stack([torch.randperm(self.E, generator=g)[: self.k] for _ in range(T)]).to(torch.long)
               for _ in range(calls)]
        times = []
        for c in range(calls):
            w = self.layers[c % len(self.layers)]
            task = w.moe.forward_task(bsz.data_ptr(), self.k, ids[c].data_ptr(), wts.data_ptr(),
                                      x.data_ptr(), out.data_ptr(), False)
            t0 = time.perf_counter_ns()
            w.cpu_infer.submit(task)
            w.cpu_infer.sync()
            t1 = time.perf_counter_ns()
            if c >= len(self.layers):
                times.append((t1 - t0) / 1e3)
        return statistics.median(times)


def ours_us(a, fmt, T):
    cmd = [a.bench, "--shape", a.shape, "--tokens", str(T), "--format", fmt, "--isa", "auto",
           "--threads", str(a.threads), "--layers", str(a.layers), "--repeats", str(a.repeats),
           "--seed", str(a.seed), "--json"]
    if fmt == "int4":
        cmd += ["--group", str(a.group)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()[-800:]}")
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    name = "fp8-b128" if fmt == "fp8" else fmt  # the bench names the format in full
    rows = [x for x in rows if x.get("tokens") == T and x.get("format") == name]
    if not rows:
        raise RuntimeError(f"{' '.join(cmd)}: no JSON line for tokens {T} format {fmt}")
    return rows[0]["us"], rows[0]


def run_inside(a):
    import torch
    import kt_kernel
    shimmed = nopin_shim()
    print(f"# kt-kernel {kt_kernel.__version__}: cpu variant {kt_kernel.__cpu_variant__}, int8 kernel "
          f"{kt_kernel.__int8_kernel__}; torch {torch.__version__}"
          f"{'; pin_memory shim (no CUDA driver)' if shimmed else ''}")
    if not os.access(a.bench, os.X_OK):
        sys.exit(f"vs_ktkernel: {a.bench} is not built (make {os.path.relpath(a.bench, ROOT)})")
    H, I, E, k = SHAPES[a.shape]
    print(f"# shape {a.shape} H={H} I={I} E={E} k={k}; {a.threads} thread(s); {a.layers} layers; "
          f"median of {a.repeats} calls; {a.rounds} alternating rounds")
    print(f"{'format':<7} {'kt method':<9} {'T':>5} {'ours us':>10} {'kt us':>10} {'kt/ours':>8}  ours kernel")
    jf = open(a.json, "w") if a.json else None
    work = tempfile.mkdtemp(prefix="vs-kt-", dir=os.path.join(ROOT, "build"))
    try:
        for fmt in a.formats:
            method = KT_METHOD[fmt]
            try:
                kt = KtCase(a, method, work)
            except Exception as ex:  # a method this host or wheel cannot run: say why, go on
                print(f"{fmt:<7} {method:<9} kt-kernel cannot run it here: {type(ex).__name__}: {ex}")
                continue
            for T in a.tokens:
                mine, theirs, row = [], [], None
                for rnd in range(a.rounds):
                    us, row = ours_us(a, fmt, T)
                    mine.append(us)
                    theirs.append(kt.time_us(T, a.seed + 1000 * rnd + T))
                m, t = statistics.median(mine), statistics.median(theirs)
                print(f"{fmt:<7} {method:<9} {T:>5} {m:>10.1f} {t:>10.1f} {t / m:>8.2f}  {row.get('kernel', '?')}",
                      flush=True)
                if jf:
                    jf.write(json.dumps({"shape": a.shape, "format": fmt, "kt_method": method, "tokens": T,
                                         "threads": a.threads, "layers": a.layers, "ours_us": m, "kt_us": t,
                                         "ratio_kt_over_ours": t / m, "ours_rounds": mine,
                                         "kt_rounds": theirs, "ours_kernel": row.get("kernel"),
                                         "kt_variant": kt_kernel.__cpu_variant__}) + "\n")
            del kt
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if jf:
            jf.close()


def main(argv):
    a = parse_args(argv)
    inside = os.path.realpath(sys.prefix) == os.path.realpath(a.venv)
    if not inside:
        py = ensure_venv(a)
        os.execv(py, [py, os.path.abspath(__file__)] + argv)
    run_inside(a)


if __name__ == "__main__":
    main(sys.argv[1:])
