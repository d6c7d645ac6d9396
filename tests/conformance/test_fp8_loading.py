#!/usr/bin/env python3
"""FP8 block-scaled checkpoints (fp8-b128) against numpy and PyTorch.

  * e4m3fn decoding: torch.float8_e4m3fn -> float32 equals the bit formula (numpy) for all
    256 codes, and the code table moerpc uses (checked through the loader below);
  * the writer: `moerpc-mkmodel --dtype fp8` codes and scales equal torch's own block
    quantization of the bf16 model of the same seed (scale = amax / 448 per 128x128 block,
    torch's round-to-nearest-even cast), exactly;
  * the loader: what the server's loader (mr_config_expert_tensors_q +
    kn_layer_load_expert_st) puts in an fp8-b128 layer, decoded by the reference decoder
    (kn_ref_cli --dump), equals numpy's dequantization q.astype(float32) * scale_inv of
    its block, exactly, with 1 and 2 slices, H and I not multiples of 128; re-quantized at
    load to bf16 it equals that dequantization rounded to bf16, exactly.

  test_fp8_loading.py --build build
Prints one line per check and "fp8_loading: N passed, N failed"; exits 1 on any failure.
"""
import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import load_file as np_load
from safetensors.torch import load_file as torch_load

passed = failed = 0


def check(label, ok, detail=""):
    global passed, failed
    print(f"{'ok  ' if ok else 'FAIL'} {label}{': ' + detail if detail else ''}", flush=True)
    if ok:
        passed += 1
    else:
        failed += 1


def e4m3_formula(codes):
    """e4m3fn by its fields, in numpy: subnormal m * 2^-9, normal (1 + m/8) 2^(e-7), S.1111.111 NaN."""
    c = codes.astype(np.int64)
    s = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 15
    m = c & 7
    v = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return (s * v).astype(np.float32)


def torch_decode(codes_u8):
    return torch.from_numpy(codes_u8).view(torch.float8_e4m3fn).float().numpy()


def dequant(q_u8, s):
    """numpy: w = e4m3(q) (float32) * scale_inv of its 128x128 block (float32 multiply)."""
    N, K = q_u8.shape
    big = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:N, :K]
    return torch_decode(q_u8) * big


def torch_quant(w):
    """torch: per 128x128 block scale = amax / 448 (1 for a zero block), q = (w / s) cast."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty((N + 127) // 128, (K + 127) // 128, dtype=torch.float32)
    for i in range(0, N, 128):
        for k in range(0, K, 128):
            blk = w[i:i + 128, k:k + 128]
            sc = blk.abs().max() / 448.0
            sc = torch.where(sc > 0, sc, torch.ones_like(sc))
            s[i // 128, k // 128] = sc
            q[i:i + 128, k:k + 128] = (blk / sc).to(torch.float8_e4m3fn)
    return q, s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--keep", help="keep the files in this directory")
    args = ap.parse_args()
    tmp = args.keep or tempfile.mkdtemp(prefix="fp8-conf-")
    if not args.keep:
        atexit.register(shutil.rmtree, tmp, True)
    os.makedirs(tmp, exist_ok=True)
    mk = os.path.join(args.build, "bin", "moerpc-mkmodel")
    cli = os.path.join(args.build, "tests", "kn_ref_cli")

    codes = np.arange(256, dtype=np.uint8)
    a, b = torch_decode(codes), e4m3_formula(codes)
    check("e4m3fn: torch float8_e4m3fn -> f32 equals the bit formula for all 256 codes",
          bool(np.array_equal(a, b, equal_nan=True)))

    flags = ["--seed", "11", "--layers", "2", "--experts", "3", "--topk", "2", "--hidden", "200",
             "--inter", "300", "--vocab", "64"]
    for name, extra in (("fp8", ["--dtype", "fp8"]), ("bf16", [])):
        r = subprocess.run([mk, "--out", os.path.join(tmp, name)] + flags + extra,
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            check(f"mkmodel {name}", False, r.stderr.strip()[-300:])
            return 1
    f8 = torch_load(os.path.join(tmp, "fp8", "model.safetensors"))
    b16 = torch_load(os.path.join(tmp, "bf16", "model.safetensors"))

    # The writer against torch's quantization of the same bf16 values.
    same = True
    n_w = 0
    for key, t in f8.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        q, s = torch_quant(b16[key].float())
        same &= torch.equal(q.view(torch.uint8), t.view(torch.uint8))
        same &= torch.equal(s, f8[key + "_scale_inv"])
        n_w += 1
    check(f"mkmodel --dtype fp8: codes and scales of {n_w} expert matrices equal torch's block "
          "quantization of the bf16 model", bool(same and n_w == 2 * 3 * 3))
    nonexpert = [k for k, t in f8.items() if ".mlp.experts." not in k and t.dtype != torch.bfloat16]
    check("mkmodel --dtype fp8: every non-expert tensor stays bf16", not nonexpert, str(nonexpert[:3]))

    # The loader, through the reference decoder.
    for layer in (0, 1):
        for split in (1, 2):
            for fmt in ("fp8-b128", "bf16"):
                out = os.path.join(tmp, f"dump-{layer}-{split}-{fmt}.safetensors")
                r = subprocess.run([cli, "--model", os.path.join(tmp, "fp8"), "--layer", str(layer),
                                    "--dump", out, "--split", str(split), "--format", fmt],
                                   capture_output=True, text=True, timeout=120)
                label = f"loader layer {layer} split {split} as {fmt}"
                if r.returncode != 0:
                    check(label, False, r.stderr.strip()[-300:])
                    continue
                got = np_load(out)
                exact = True
                worst = ""
                for x in range(3):
                    for p in ("gate_proj", "up_proj", "down_proj"):
                        key = f"model.layers.{layer}.mlp.experts.{x}.{p}.weight"
                        q = f8[key].view(torch.uint8).numpy()
                        want = dequant(q, f8[key + "_scale_inv"].numpy())
                        if fmt == "bf16":
                            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
                        g = got[f"experts.{x}.{p}.weight"]
                        if g.shape != want.shape or not np.array_equal(g, want):
                            exact = False
                            bad = np.argwhere(g != want) if g.shape == want.shape else []
                            worst = f"{key}: shape {g.shape} vs {want.shape}, {len(bad)} differ"
                what = ("numpy's dequantization" if fmt == "fp8-b128"
                        else "numpy's dequantization rounded to bf16")
                check(f"{label}: the layer holds exactly {what}", exact, worst)
    print(f"fp8_loading: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
