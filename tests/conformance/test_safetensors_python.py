#!/usr/bin/env python3
"""Checks common/'s safetensors writer and reader, and moerpc-mkmodel, against the HF
reference: the `safetensors` package (Rust core) and, when installed, `transformers`.

  test_safetensors_python.py [--build build] [--keep DIR]

Checks:
  1. mr_st_writer (eager path, mixed F32/F16/BF16, scalar, empty, names needing JSON
     escapes): the Python package loads the file, every tensor's bytes equal what the C side
     wrote, and re-saving the same tensors with safetensors' own writer gives a
     byte-identical file (same layout, header and padding).
  2. The reverse: a file written by Python's safetensors opens with mr_st_open and every
     tensor's name, dtype, shape and bytes (FNV-1a) match.
  3. moerpc-mkmodel (the streaming writer), single-file and sharded: loads with
     safetensors; byte-identical to a re-save; a few tensors recomputed here with an
     independent Python implementation of the generator (splitmix64 + xoshiro256** +
     bf16 round-to-nearest-even) match bit for bit; the sharded and single-file models hold
     the same tensors; the index lists every tensor.
  4. If transformers is importable: Qwen3MoeForCausalLM.from_pretrained loads the mkmodel
     output with no missing or unexpected weights, and a forward pass gives finite logits
     of O(1) size, equal for the sharded and single-file copies.

A tiny C helper (embedded below) is compiled against $BUILD/lib/libmr.a with the system
compiler for checks 1 and 2. Prints one line per check and "N passed, N failed"; exits 1
on any failure.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file

HELPER_C = r"""
/* st_helper write PATH   : writes a fixed mixed-dtype file with mr_st_writer
 * st_helper dump PATH    : opens PATH with mr_st_open, prints one line per tensor:
 *                          name \t dtype_name \t shape,... \t nbytes \t fnv1a64(bytes) */
#include "common/mr.h"
#include <stdio.h>
#include <string.h>

static uint64_t fnv(const void *p, uint64_t n) {
  const unsigned char *b = p; uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
  return h;
}

int main(int argc, char **argv) {
  mr_err e = {0};
  if (argc != 3) return 2;
  if (strcmp(argv[1], "write") == 0) {
    mr_st_writer *w; if (mr_st_writer_new(&w)) return 1;
    static float f32[3 * 5]; static uint16_t f16[7], bf[2 * 3 * 4]; float one = 1.5f;
    for (int i = 0; i < 15; i++) f32[i] = (float)i * 0.25f - 1.0f;
    for (int i = 0; i < 7; i++) f16[i] = mr_f32_to_f16((float)i / 3.0f);
    for (int i = 0; i < 24; i++) bf[i] = mr_f32_to_bf16((float)i * 0.5f - 3.0f);
    uint64_t s35[2] = {3, 5}, s7[1] = {7}, s234[3] = {2, 3, 4}, s0[2] = {4, 0};
    int rc = mr_st_writer_add(w, "f32.weight", MR_DTYPE_F32, 2, s35, f32)
          || mr_st_writer_add(w, "odd.f16", MR_DTYPE_F16, 1, s7, f16)
          || mr_st_writer_add(w, "b.bf16 \"q\"\\x", MR_DTYPE_BF16, 3, s234, bf)
          || mr_st_writer_add(w, "scalar", MR_DTYPE_F32, 0, NULL, &one)
          || mr_st_writer_add(w, "empty", MR_DTYPE_BF16, 2, s0, bf)
          || mr_st_writer_add(w, "a.after_odd", MR_DTYPE_F16, 1, s7, f16);
    if (!rc) rc = mr_st_writer_write(w, argv[2], &e);
    mr_st_writer_free(w);
    if (rc) { fprintf(stderr, "%s\n", e.msg); return 1; }
    return 0;
  }
  mr_st *st;
  if (mr_st_open(&st, argv[2], &e)) { fprintf(stderr, "%s\n", e.msg); return 1; }
  for (size_t i = 0; i < mr_st_count(st); i++) {
    const mr_st_tensor *t = mr_st_at(st, i);
    printf("%s\t%s\t", t->name, t->dtype_name);
    for (uint32_t d = 0; d < t->ndim; d++) printf("%s%llu", d ? "," : "", (unsigned long long)t->shape[d]);
    printf("\t%llu\t%016llx\n", (unsigned long long)t->nbytes, (unsigned long long)fnv(t->data, t->nbytes));
  }
  mr_st_close(st);
  return 0;
}
"""

results = []


def check(name, ok, detail=""):
    results.append(ok)
    print(f"{'ok  ' if ok else 'FAIL'} {name}{(': ' + detail) if detail else ''}", flush=True)
    return ok


def fnv(b):
    h = 0xCBF29CE484222325
    for x in b:
        h = ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def raw_tensors(path):
    """Reads a safetensors file by hand (independently of both implementations):
    {name: (dtype, shape, bytes)} and the metadata."""
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    hdr = json.loads(buf[8:8 + n])
    data = buf[8 + n:]
    meta = hdr.pop("__metadata__", None)
    out = {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
           for k, v in hdr.items()}
    return out, meta, n


def resave_identical(path, tmp):
    """Re-saves every tensor of path with safetensors' own writer (the torch flavour, which
    has a real bfloat16); True if the two files are byte-identical. None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from safetensors.torch import load_file, save_file
    t = load_file(path)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    out = os.path.join(tmp, "resaved_torch.safetensors")
    save_file(t, out, metadata=meta)
    with open(path, "rb") as a, open(out, "rb") as b:
        return a.read() == b.read()


# ---- an independent implementation of moerpc-mkmodel's generator -------------------------

M64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & M64


def xoshiro_seed(seed, name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & M64
    _, mixed = splitmix64(h)
    x = seed ^ mixed
    s = []
    for _ in range(4):
        x, v = splitmix64(x)
        s.append(v)
    return s


def xoshiro_next(s):
    result = (rotl((s[1] * 5) & M64, 7) * 9) & M64
    t = (s[1] << 17) & M64
    s[2] ^= s[0]
    s[3] ^= s[1]
    s[1] ^= s[2]
    s[0] ^= s[3]
    s[2] ^= t
    s[3] = rotl(s[3], 45)
    return result


def f32_to_bf16(x):
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def mkmodel_values(seed, name, count, scale, base):
    """bf16 values of one mkmodel tensor, computed in float32 like the C code."""
    f32 = np.float32
    s = xoshiro_seed(seed, name)
    out = []
    inv24 = f32(1.0 / 16777216.0)
    for i in range(0, count, 2):
        r = xoshiro_next(s)
        for u in (r >> 40, (r >> 16) & 0xFFFFFF):
            if len(out) == count:
                break
            uf = f32(u) * inv24
            v = f32(base) + f32(scale) * (f32(2.0) * uf - f32(1.0))
            out.append(f32_to_bf16(float(v)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
    ap.add_argument("--keep", default=None, help="keep the files in this directory")
    args = ap.parse_args()
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    build = os.path.join(root, args.build)
    libmr = os.path.join(build, "lib", "libmr.a")
    mkmodel = os.path.join(build, "bin", "moerpc-mkmodel")
    for p in (libmr, mkmodel):
        if not os.path.exists(p):
            print(f"missing {p}: build it first (make BUILD={args.build})", file=sys.stderr)
            return 2
    tmp = args.keep or tempfile.mkdtemp(prefix="mr-conf-st-")
    os.makedirs(tmp, exist_ok=True)
    try:
        return run(root, tmp, libmr, mkmodel)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def run(root, tmp, libmr, mkmodel):
    cc = os.environ.get("CC", "cc")
    src = os.path.join(tmp, "st_helper.c")
    helper = os.path.join(tmp, "st_helper")
    with open(src, "w") as f:
        f.write(HELPER_C)
    # A sanitizer build's libmr.a needs the same flags (make test passes them).
    san = os.environ.get("MOERPC_SAN_FLAGS", "").split()
    subprocess.run([cc, "-std=gnu11", "-O1", *san, "-I", root, "-o", helper, src, libmr,
                    "-lcjson", "-lm", "-pthread"], check=True)

    # 1. C writer -> Python reader, and byte identity with the reference writer.
    mine = os.path.join(tmp, "c_written.safetensors")
    subprocess.run([helper, "write", mine], check=True)
    raw, meta, hlen = raw_tensors(mine)
    with safe_open(mine, "np") as f:
        keys = set(f.keys())
        check("writer: safetensors opens the file", keys == set(raw), f"{sorted(keys)}")
        check("writer: metadata", f.metadata() == {"format": "pt"}, str(f.metadata()))
        f32 = f.get_tensor("f32.weight")
        want = (np.arange(15, dtype=np.float32) * 0.25 - 1.0).reshape(3, 5)
        check("writer: F32 values", f32.shape == (3, 5) and np.array_equal(f32, want))
        f16 = f.get_tensor("odd.f16")
        check("writer: F16 values",
              np.array_equal(f16, (np.arange(7, dtype=np.float32) / 3.0).astype(np.float16)))
        sc = f.get_tensor("scalar")
        check("writer: scalar", sc.shape == () and float(sc) == 1.5)
    check("writer: header padded to 8 bytes", (8 + hlen) % 8 == 0, f"8 + {hlen}")
    bfv = np.frombuffer(raw['b.bf16 "q"\\x'][2], dtype=np.uint16).astype(np.uint32) << 16
    want_bf = np.arange(24, dtype=np.float32) * 0.5 - 3.0
    check("writer: BF16 bytes and escaped name", raw['b.bf16 "q"\\x'][1] == (2, 3, 4) and
          np.array_equal(bfv.view(np.float32), want_bf))
    check("writer: empty tensor", raw["empty"][1] == (4, 0) and raw["empty"][2] == b"")
    same = resave_identical(mine, tmp)
    if same is None:
        print("skip byte-identity checks: torch is not installed")
    else:
        check("writer: byte-identical to safetensors' writer", same)

    # 2. Python writer -> C reader.
    rng = np.random.default_rng(7)
    py = {"x.f32": rng.standard_normal((5, 3)).astype(np.float32),
          "y.f16": rng.standard_normal((7,)).astype(np.float16),
          "z.i64": np.arange(3, dtype=np.int64),
          "u8": np.arange(5, dtype=np.uint8),
          "scal": np.array(2.0, dtype=np.float32)}
    pyfile = os.path.join(tmp, "py_written.safetensors")
    np_save_file(py, pyfile, metadata={"format": "pt", "note": "x"})
    out = subprocess.run([helper, "dump", pyfile], check=True, capture_output=True, text=True)
    rows = {r.split("\t")[0]: r.split("\t") for r in out.stdout.strip().split("\n")}
    npname = {np.float32: "F32", np.float16: "F16", np.int64: "I64", np.uint8: "U8"}
    ok = set(rows) == set(py)
    for k, a in py.items():
        r = rows.get(k)
        shape = ",".join(str(d) for d in a.shape)
        ok = ok and r is not None and r[1] == npname[a.dtype.type] and r[2] == shape and \
            int(r[3]) == a.nbytes and int(r[4], 16) == fnv(a.tobytes())
    check("reader: mr_st_open reads safetensors' output (names, dtypes, shapes, bytes)", ok,
          out.stdout.strip().replace("\n", " | ") if not ok else "")

    # 3. moerpc-mkmodel, single file and sharded.
    flags = ["--layers", "2", "--experts", "4", "--topk", "2", "--hidden", "64", "--inter", "32",
             "--vocab", "4096", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--seed", "42"]
    single, sharded = os.path.join(tmp, "single"), os.path.join(tmp, "sharded")
    subprocess.run([mkmodel, "--out", single] + flags, check=True, capture_output=True)
    subprocess.run([mkmodel, "--out", sharded, "--shard-mb", "1"] + flags, check=True,
                   capture_output=True)
    st1 = os.path.join(single, "model.safetensors")
    raw1, _, _ = raw_tensors(st1)
    cfg = json.load(open(os.path.join(single, "config.json")))
    H, I, V, E, L = 64, 32, 4096, 4, 2
    expected = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
                "lm_head.weight": (V, H)}
    for l in range(L):
        p = f"model.layers.{l}."
        expected.update({p + "input_layernorm.weight": (H,),
                         p + "post_attention_layernorm.weight": (H,),
                         p + "self_attn.q_proj.weight": (64, H), p + "self_attn.k_proj.weight": (32, H),
                         p + "self_attn.v_proj.weight": (32, H), p + "self_attn.o_proj.weight": (H, 64),
                         p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                         p + "mlp.gate.weight": (E, H)})
        for e in range(E):
            for proj, shp in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                expected[f"{p}mlp.experts.{e}.{proj}.weight"] = shp
    got = {k: v[1] for k, v in raw1.items()}
    check("mkmodel: every Qwen3-MoE tensor with the right shape", got == expected,
          str(set(got) ^ set(expected)))
    check("mkmodel: all BF16", all(v[0] == "BF16" for v in raw1.values()))
    check("mkmodel: config fields", cfg["architectures"] == ["Qwen3MoeForCausalLM"] and
          cfg["num_experts"] == E and cfg["moe_intermediate_size"] == I and
          cfg["num_hidden_layers"] == L and cfg["hidden_size"] == H and cfg["head_dim"] == 16)
    with safe_open(st1, "np") as f:
        check("mkmodel: safetensors opens the single file", set(f.keys()) == set(expected))
    same = resave_identical(st1, tmp)
    if same is not None:
        check("mkmodel: byte-identical to safetensors' writer", same)
    # Values, recomputed independently.
    for name, base, scale in (("model.layers.1.mlp.experts.3.down_proj.weight", 0.0,
                               (3.0 ** 0.5) / (I ** 0.5)),
                              ("model.layers.0.self_attn.k_norm.weight", 1.0, 0.05),
                              ("model.embed_tokens.weight", 0.0, 3.0 ** 0.5)):
        shape = expected[name]
        count = min(int(np.prod(shape)), 4096)  # the stream is sequential: a prefix will do
        want = mkmodel_values(42, name, count, np.float32(scale), base)
        have = [int(x) for x in np.frombuffer(raw1[name][2], dtype=np.uint16)[:count]]
        check(f"mkmodel: values of {name} match an independent generator", have == want,
              f"first {have[:4]} vs {want[:4]}")
    w = (np.frombuffer(raw1["model.layers.0.mlp.experts.0.gate_proj.weight"][2],
                       dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    check("mkmodel: weight std ~ 1/sqrt(fan_in)", abs(w.std() * (H ** 0.5) - 1.0) < 0.1,
          f"std {w.std():.4f}, want {1 / H ** 0.5:.4f}")
    # Sharded copy: same tensors, same bytes, index complete.
    idx = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    shards = sorted(set(idx["weight_map"].values()))
    merged = {}
    index_ok = True
    for s in shards:
        path = os.path.join(sharded, s)
        r, _, _ = raw_tensors(path)
        index_ok = index_ok and all(idx["weight_map"].get(k) == s for k in r)
        with safe_open(path, "np") as f:
            index_ok = index_ok and set(f.keys()) == set(r)
        merged.update(r)
    check("mkmodel: sharded into several files", len(shards) > 1, f"{shards}")
    check("mkmodel: index lists every tensor in its shard", set(idx["weight_map"]) == set(expected)
          and ok)
    check("mkmodel: sharded bytes equal single-file bytes",
          all(merged[k][2] == raw1[k][2] for k in expected) and set(merged) == set(expected))
    check("mkmodel: index total_size", idx["metadata"]["total_size"] ==
          sum(len(v[2]) for v in raw1.values()))

    # 4. transformers, when present.
    try:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except Exception as ex:  # noqa: BLE001
        print(f"skip transformers checks: {ex}")
        torch = None
    if torch is not None:
        logits = []
        for d in (single, sharded):
            m, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                           output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                                  "mismatched_keys")}
            check(f"transformers: {type(m).__name__} loads {os.path.basename(d)} with every weight",
                  type(m).__name__ == "Qwen3MoeForCausalLM" and not bad, str(bad))
            with torch.no_grad():
                out = m(torch.tensor([[1, 5, 9, 77]])).logits
            logits.append(out)
        l0 = logits[0]
        check("transformers: logits finite and O(1)", bool(torch.isfinite(l0).all()) and
              0.05 < float(l0.std()) < 20, f"std {float(l0.std()):.3f}")
        check("transformers: sharded == single", torch.equal(logits[0], logits[1]))

    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
