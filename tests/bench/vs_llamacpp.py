#!/usr/bin/env python3
"""vs_llamacpp.py - whole-model prefill and decode tokens/s, moerpc-client next to llama.cpp.

Both run the same Qwen3-MoE checkpoint on the same thread count:

  ours       build/bin/moerpc-client bench --model DIR --prompt-len P --decode N --batch 1
             --threads T --json            (its prefill_tok_s / decode_tok_s)
  llama.cpp  the PyPI package llama-cpp-python (llama.cpp built from source with
             CMAKE_ARGS=-DGGML_NATIVE=ON) on a GGUF that this script writes from the HF
             checkpoint with the `gguf` package's GGUFWriter (arch qwen3moe; bf16 -> GGUF
             BF16, q8_0 -> GGUF Q8_0 via gguf.quants; norms and the router stay F32)
             prefill: one llama_decode of a P-token prompt into an empty KV cache;
             decode: N greedy single-token steps after an 8-token prompt, timed from the
             first step to the last (wall clock, Python included: a few us per token)

Before timing, the conversion is validated: a small mkmodel checkpoint (2 layers, H 256,
16 experts top-4, 4/2 heads of 32, sharded) goes through the same converter in every
format asked for, and llama.cpp's logits for a 16-token prompt (logits_all) are compared
with transformers' Qwen3MoeForCausalLM in float32 (run in the conformance venv) on the
same checkpoint: relative L2 over [T, vocab] must be <= --validate-limit (0.05; measured:
see tests/bench/README.md) and the argmax must agree on most rows. Without that check the
comparison would mean nothing. --skip-validate skips it.

The two sides run alternately (ours, llama, ours, llama, ...) --repeats times after one
untimed warm-up each; the medians are printed as one JSON line per format:
  {"format", "threads", "prompt_len", "decode", "cpu", "llama_prefill_tok_s",
   "moerpc_prefill_tok_s", "prefill_ratio", "llama_decode_tok_s", "moerpc_decode_tok_s",
   "decode_ratio", ...}       ratio = moerpc / llama (above 1: moerpc is faster)
moerpc fields are null with a "moerpc_note" when the client has no `bench` command.

Environments: the script itself needs only the standard library. The llama.cpp side runs in
--venv (env MOERPC_BENCH_VENV, default .venv-bench at the repository root), created with
numpy, gguf and llama-cpp-python when missing (the llama.cpp build takes ~10 min on
2 cores); the transformers reference runs in MOERPC_CONF_VENV (default .venv-conf, see
tests/conformance/run.sh).

usage: tests/bench/vs_llamacpp.py [--model DIR | --mkmodel-args "..."] [--formats bf16,q8_0]
         [--threads 2] [--prompt-len 128] [--decode 32] [--repeats 3] [--client PATH]
         [--venv DIR] [--work DIR] [--skip-validate] [--only-llama] [--json FILE]
"""
import argparse
import json
import os
import shlex
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MK = ("--layers 4 --hidden 2048 --inter 768 --experts 128 --topk 8 --heads 32 "
              "--kv-heads 4 --head-dim 128 --vocab 32000")   # Qwen3-30B-A3B's layer shapes
VALIDATE_MK = ("--layers 2 --hidden 256 --inter 128 --experts 16 --topk 4 --heads 4 "
               "--kv-heads 2 --head-dim 32 --vocab 512 --shard-mb 1 --seed 7")
LLAMA_PKGS = ["numpy", "gguf", "llama-cpp-python"]
DECODE_PROMPT = 8


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# an HF checkpoint read with numpy alone (bf16 stays raw uint16 bits)

class Checkpoint:
    DT = {"BF16": ("<u2", 2), "F32": ("<f4", 4), "F16": ("<f2", 2)}

    def __init__(self, d):
        self.dir = d
        with open(os.path.join(d, "config.json")) as f:
            self.cfg = json.load(f)
        idx = os.path.join(d, "model.safetensors.index.json")
        files = []
        if os.path.exists(idx):
            with open(idx) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.where = {}
        for fn in files:
            path = os.path.join(d, fn)
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                hdr = json.loads(f.read(n))
            for k, v in hdr.items():
                if k != "__metadata__":
                    self.where[k] = (path, 8 + n, v)

    def raw(self, name):
        """(numpy array in the file's dtype; BF16 as uint16, its source dtype name)."""
        import numpy as np
        path, base, v = self.where[name]
        dt, _ = self.DT[v["dtype"]]
        a, b = v["data_offsets"]
        arr = np.memmap(path, dtype=dt, mode="r", offset=base + a, shape=tuple(v["shape"]))
        return arr, v["dtype"]

    def f32(self, name):
        import numpy as np
        arr, dt = self.raw(name)
        if dt == "BF16":
            return (np.asarray(arr, dtype=np.uint32) << 16).view(np.float32)
        return np.asarray(arr, dtype=np.float32)

    def bf16_bits(self, name):
        import numpy as np
        arr, dt = self.raw(name)
        if dt == "BF16":
            return np.asarray(arr)
        x = np.asarray(arr, dtype=np.float32).view(np.uint32)   # round to nearest even
        return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)


# ---------------------------------------------------------------------------------------
# HF Qwen3-MoE -> GGUF (runs in the llama venv)

def hp(cfg):
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    rp = cfg.get("rope_parameters") or {}
    return dict(
        L=cfg["num_hidden_layers"], H=H, nh=nh, nkv=cfg["num_key_value_heads"],
        hd=cfg.get("head_dim") or H // nh, V=cfg["vocab_size"],
        E=cfg.get("num_experts", cfg.get("num_local_experts")), k=cfg["num_experts_per_tok"],
        I=cfg["moe_intermediate_size"], eps=cfg.get("rms_norm_eps", 1e-6),
        theta=rp.get("rope_theta", cfg.get("rope_theta", 1e6)),
        ctx=cfg.get("max_position_embeddings", 4096),
        tied=bool(cfg.get("tie_word_embeddings", False)))


def placeholder_vocab(w, ckpt_dir, cfg, V):
    """A minimal SentencePiece-style ("llama") vocabulary of the model's size: <unk> <s>
    </s>, the 256 byte tokens llama.cpp looks up (e.g. <0x0A>), then placeholders. Enough
    to load the model and feed it token ids; text does not tokenize as the checkpoint's."""
    if V < 259:
        raise SystemExit(f"vocab {V} < 259: too small for the byte tokens")
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"\u2581t{i}" for i in range(len(toks), V)]
    types = [2, 3, 3] + [6] * 256 + [1] * (V - 259)  # UNKNOWN, CONTROL, BYTE, NORMAL
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(V - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(cfg.get("bos_token_id") or 1)
    w.add_eos_token_id(cfg.get("eos_token_id") or 2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)


def stop_ids(ckpt_dir, cfg):
    """The checkpoint's stop ids: generation_config.json's eos_token_id, else config's."""
    eos = cfg.get("eos_token_id")
    gpath = os.path.join(ckpt_dir, "generation_config.json")
    if os.path.exists(gpath):
        with open(gpath) as f:
            eos = json.load(f).get("eos_token_id", eos)
    if eos is None:
        return []
    return [int(x) for x in (eos if isinstance(eos, list) else [eos])]


def hf_vocab(w, ckpt_dir, cfg, V):
    """The checkpoint's own tokenizer (tokenizer.json: a byte-level BPE model with Qwen2's
    pre-tokenizer, as moerpc-mkmodel writes and Qwen2/Qwen3 ship) as a GGUF "gpt2"
    vocabulary with pre-tokenizer "qwen2": the same text gives llama.cpp the same ids as
    moerpc (serve_vs_llamacpp.py checks that, prompt by prompt). Ids without a token
    (padded embeddings) get "[PAD<i>]" of type UNUSED; added tokens are CONTROL when
    special, else USER_DEFINED. No BOS is added; EOS is the first stop id."""
    tpath = os.path.join(ckpt_dir, "tokenizer.json")
    if not os.path.exists(tpath):
        raise SystemExit(f"{ckpt_dir}: no tokenizer.json (needed for the text vocabulary)")
    with open(tpath, encoding="utf-8") as f:
        tj = json.load(f)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise SystemExit(f"{tpath}: model type {model.get('type')}, only BPE is converted")
    toks, types = [None] * V, [1] * V                 # NORMAL
    for s, i in model["vocab"].items():
        if i < V:
            toks[i] = s
    for a in tj.get("added_tokens") or []:
        if a["id"] < V:
            toks[a["id"]] = a["content"]
            types[a["id"]] = 3 if a.get("special") else 4   # CONTROL, USER_DEFINED
    for i in range(V):
        if toks[i] is None:
            toks[i], types[i] = f"[PAD{i}]", 5           # UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    stops = stop_ids(ckpt_dir, cfg)
    if stops:
        w.add_eos_token_id(stops[0])
    w.add_add_bos_token(False)


def convert(ckpt_dir, out_path, fmt, vocab="placeholder"):
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as QT
    ck = Checkpoint(ckpt_dir)
    cfg = ck.cfg
    if cfg.get("architectures", [None])[0] != "Qwen3MoeForCausalLM":
        raise SystemExit(f"{ckpt_dir}: only Qwen3MoeForCausalLM is converted")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise SystemExit(f"{ckpt_dir}: dense layers are not converted (llama.cpp's qwen3moe "
                         "has MoE in every layer)")
    if not cfg.get("norm_topk_prob", False):
        raise SystemExit(f"{ckpt_dir}: norm_topk_prob false: llama.cpp's qwen3moe always "
                         "renormalises the top-k weights")
    h = hp(cfg)
    qtype = {"bf16": QT.BF16, "q8_0": QT.Q8_0}[fmt]
    ftype = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt]

    w = gguf.GGUFWriter(out_path, "qwen3moe")
    w.add_name(os.path.basename(os.path.normpath(ckpt_dir)))
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(h["ctx"])
    w.add_embedding_length(h["H"])
    w.add_block_count(h["L"])
    w.add_feed_forward_length(cfg.get("intermediate_size", h["I"]))
    w.add_head_count(h["nh"])
    w.add_head_count_kv(h["nkv"])
    w.add_key_length(h["hd"])
    w.add_value_length(h["hd"])
    w.add_rope_freq_base(float(h["theta"]))
    w.add_layer_norm_rms_eps(float(h["eps"]))
    w.add_expert_count(h["E"])
    w.add_expert_used_count(h["k"])
    w.add_expert_feed_forward_length(h["I"])
    V = h["V"]
    (hf_vocab if vocab == "hf" else placeholder_vocab)(w, ckpt_dir, cfg, V)

    def nbytes(shape, qt):
        n = 1
        for s in shape:
            n *= s
        if qt == QT.F32:
            return 4 * n
        if qt == QT.BF16:
            return 2 * n
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        return n // bs * ts

    def enc(name, qt):  # one HF tensor in GGUF type qt
        if qt == QT.F32:
            return ck.f32(name)
        if qt == QT.BF16:
            return ck.bf16_bits(name)   # bf16 in the file: copied bit for bit
        return gguf.quants.quantize(np.ascontiguousarray(ck.f32(name)), qt)

    def experts(li, proj, qt):  # HF experts.E.<proj> [rows, K] -> stacked [E, rows, K]
        out = None
        for e in range(h["E"]):
            m = enc(f"model.layers.{li}.mlp.experts.{e}.{proj}.weight", qt)
            if out is None:
                out = np.empty((h["E"],) + m.shape, m.dtype)
            out[e] = m
        return out

    plan = []  # (gguf name, logical shape (numpy order: [.., rows, K]), type, producer(qt))

    def add(name, shape, qt, fn):
        if qt not in (QT.F32, QT.BF16) and shape[-1] % gguf.GGML_QUANT_SIZES[qt][0]:
            qt = QT.BF16  # K not a multiple of the block: as llama.cpp's converter falls back
        plan.append((name, tuple(shape), qt, fn))

    def t(n):
        return lambda qt: enc(n, qt)

    H, V, E, I, nh, nkv, hd = h["H"], h["V"], h["E"], h["I"], h["nh"], h["nkv"], h["hd"]
    head = "lm_head.weight"
    if "lm_head.weight" not in ck.where:
        if not h["tied"]:
            raise SystemExit(f"{ckpt_dir}: no lm_head.weight and tie_word_embeddings false")
        head = "model.embed_tokens.weight"
    add("token_embd.weight", (V, H), qtype, t("model.embed_tokens.weight"))
    add("output_norm.weight", (H,), QT.F32, t("model.norm.weight"))
    add("output.weight", (V, H), qtype, t(head))
    for li in range(h["L"]):
        p, b = f"model.layers.{li}.", f"blk.{li}."
        add(b + "attn_norm.weight", (H,), QT.F32, t(p + "input_layernorm.weight"))
        add(b + "attn_q.weight", (nh * hd, H), qtype, t(p + "self_attn.q_proj.weight"))
        add(b + "attn_k.weight", (nkv * hd, H), qtype, t(p + "self_attn.k_proj.weight"))
        add(b + "attn_v.weight", (nkv * hd, H), qtype, t(p + "self_attn.v_proj.weight"))
        add(b + "attn_output.weight", (H, nh * hd), qtype, t(p + "self_attn.o_proj.weight"))
        add(b + "attn_q_norm.weight", (hd,), QT.F32, t(p + "self_attn.q_norm.weight"))
        add(b + "attn_k_norm.weight", (hd,), QT.F32, t(p + "self_attn.k_norm.weight"))
        add(b + "ffn_norm.weight", (H,), QT.F32, t(p + "post_attention_layernorm.weight"))
        add(b + "ffn_gate_inp.weight", (E, H), QT.F32, t(p + "mlp.gate.weight"))
        for g_name, proj, shp in (("ffn_gate_exps", "gate_proj", (E, I, H)),
                                  ("ffn_up_exps", "up_proj", (E, I, H)),
                                  ("ffn_down_exps", "down_proj", (E, H, I))):
            add(f"{b}{g_name}.weight", shp, qtype,
                lambda qt, li=li, proj=proj: experts(li, proj, qt))

    for name, shape, qt, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qt, fn in plan:   # one tensor in memory at a time
        w.write_tensor_data(np.ascontiguousarray(fn(qt)))
    w.close()


# ---------------------------------------------------------------------------------------
# llama.cpp side (runs in the llama venv)

def llama_open(gguf_path, threads, n_ctx, logits_all=False):
    from llama_cpp import Llama
    return Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                 n_threads=threads, n_threads_batch=threads, logits_all=logits_all,
                 use_mmap=True, verbose=False, seed=0)


def llama_logits(gguf_path, ids, threads):
    import numpy as np
    llm = llama_open(gguf_path, threads, max(64, len(ids)), logits_all=True)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def prompt(n, vocab, seed):
    import random
    r = random.Random(seed)
    return [r.randrange(259, vocab) if vocab > 300 else r.randrange(3, vocab) for _ in range(n)]


def llama_prefill(llm, ids):
    llm.reset()  # n_tokens = 0; eval() drops the KV cache from there on
    t0 = time.perf_counter()
    llm.eval(ids)
    return len(ids) / (time.perf_counter() - t0)


def llama_decode(llm, ids, n):
    import numpy as np
    llm.reset()
    llm.eval(ids)
    V = llm.n_vocab()
    t0 = time.perf_counter()
    for _ in range(n):
        # without logits_all, Llama.eval does not copy logits into llm.scores: read the
        # last token's row from the context (greedy, as `generate` at temperature 0)
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(V,))))
        llm.eval([tok])
    return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------
# orchestration (any python3)

def venv_python(d):
    return os.path.join(d, "bin", "python")


def ensure_llama_venv(venv, pkgs=LLAMA_PKGS, imports="numpy, gguf, llama_cpp"):
    """venv's python, after installing pkgs there unless `import <imports>` already works."""
    py = venv_python(venv)
    if os.path.exists(py) and subprocess.run(
            [py, "-c", f"import {imports}"], capture_output=True).returncode == 0:
        return py
    log(f"vs_llamacpp: making {venv} with {' '.join(pkgs)} (llama.cpp is compiled "
        "from source with CMAKE_ARGS=-DGGML_NATIVE=ON: ~10 min on 2 cores)")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=ON"),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
                   + pkgs, check=True, env=env)
    return py


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def loadavg():
    """1-minute load average: on a shared 2-core host other jobs skew both sides."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError):
        return None


def mkmodel(args, out, mk_args):
    cfg = os.path.join(out, "config.json")
    stamp = os.path.join(out, ".mkmodel-args")
    if os.path.exists(cfg) and os.path.exists(stamp) and open(stamp).read() == mk_args:
        return out
    mk = os.path.join(os.path.dirname(args.client), "moerpc-mkmodel")
    log(f"vs_llamacpp: {mk} --out {out} {mk_args}")
    subprocess.run([mk, "--out", out] + shlex.split(mk_args), check=True)
    with open(stamp, "w") as f:
        f.write(mk_args)
    return out


def gguf_for(args, py, model, fmt, vocab="placeholder"):
    """The GGUF of model in fmt under args.work, converted when missing or older than the
    checkpoint; vocab "hf" carries the checkpoint's tokenizer (a separate file, .text.gguf)."""
    tag = os.path.basename(os.path.normpath(model))
    out = os.path.join(args.work, f"{tag}.{fmt}{'.text' if vocab == 'hf' else ''}.gguf")
    src_m = max(os.path.getmtime(os.path.join(model, f)) for f in os.listdir(model))
    if os.path.exists(out) and os.path.getmtime(out) > src_m:
        return out
    log(f"vs_llamacpp: converting {model} -> {out}")
    t0 = time.time()
    subprocess.run([py, __file__, "_convert", model, out, fmt, vocab], check=True)
    log(f"vs_llamacpp: wrote {out} ({os.path.getsize(out) / 2**30:.2f} GiB, "
        f"{time.time() - t0:.0f} s)")
    return out


def worker(py, *a):
    r = subprocess.run([py, __file__] + [str(x) for x in a], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, a[:2]))} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def rel_l2(got, ref):
    num = sum((a - b) ** 2 for ra, rb in zip(got, ref) for a, b in zip(ra, rb))
    den = sum(b * b for rb in ref for b in rb)
    return (num / den) ** 0.5


def argmax_agree(got, ref):
    am = lambda r: max(range(len(r)), key=r.__getitem__)  # noqa: E731
    return sum(int(am(a) == am(b)) for a, b in zip(got, ref))


def validate(args, py):
    """llama.cpp on our GGUF vs transformers fp32 on (1) the original checkpoint and (2) the
    GGUF's own weights read back and dequantized (the conversion itself: names, shapes,
    layouts, metadata; what is left is llama.cpp's arithmetic, e.g. activations rounded to
    bf16 / q8_0 in its matmuls)."""
    import tempfile
    small = mkmodel(args, os.path.join(args.work, "validate-small"), VALIDATE_MK)
    with open(os.path.join(small, "config.json")) as f:
        V = json.load(f)["vocab_size"]
    ids = prompt(16, V, 5)
    sids = ",".join(map(str, ids))
    conf = venv_python(os.environ.get("MOERPC_CONF_VENV", os.path.join(ROOT, ".venv-conf")))
    if not os.path.exists(conf):
        raise SystemExit(f"vs_llamacpp: no {conf} (MOERPC_CONF_VENV: the venv with torch and "
                         "transformers, see tests/conformance/run.sh); or --skip-validate")

    def hf(model, out):
        worker(conf, "_hf_logits", model, sids, out)
        with open(out) as f:
            return json.load(f)

    with tempfile.TemporaryDirectory() as td:
        ref = hf(small, os.path.join(td, "ref.json"))
        ok = True
        for fmt in args.formats:
            g = gguf_for(args, py, small, fmt)
            worker(py, "_llama_logits", g, sids, os.path.join(td, f"{fmt}.json"), args.threads)
            with open(os.path.join(td, f"{fmt}.json")) as f:
                got = json.load(f)
            back = os.path.join(td, f"{fmt}-hf")
            worker(py, "_gguf_to_hf", g, small, back)
            ref_stored = hf(back, os.path.join(td, f"{fmt}-ref.json"))
            e_orig = rel_l2(got, ref["logits"])
            e_stored = rel_l2(got, ref_stored["logits"])
            e_quant = rel_l2(ref_stored["logits"], ref["logits"])
            am = argmax_agree(got, ref_stored["logits"])
            good = (e_stored <= args.validate_limit and e_orig <= 5 * args.validate_limit
                    and am >= 0.75 * len(ids))
            ok &= good
            print(json.dumps({
                "validate": fmt, "model": VALIDATE_MK, "tokens": len(ids),
                "rel_l2_llama_vs_hf_same_weights": round(e_stored, 6),
                "rel_l2_llama_vs_hf_original": round(e_orig, 6),
                "rel_l2_hf_gguf_weights_vs_original": round(e_quant, 6),
                "argmax_agree": f"{am}/{len(ids)}", "ref_logit_std": round(ref["std"], 4),
                "limit": args.validate_limit, "ok": good}), flush=True)
    return ok


# The moerpc weight formats that match each GGUF type: bf16 as stored; q8_0 (32-value
# blocks, one fp16 scale) against moerpc's int8 (one fp32 scale per row) for experts and
# dense layers alike, the closest format moerpc has (same bytes per weight, +1/32 for
# q8_0's scales).
MOERPC_FORMAT = {"bf16": [], "q8_0": ["--format", "int8", "--dense-format", "int8"]}


def moerpc_bench(args, model, fmt="bf16"):
    cmd = [args.client, "bench", "--model", model, "--prompt-len", str(args.prompt_len),
           "--decode", str(args.decode), "--batch", "1", "--threads", str(args.threads),
           "--repeats", "1", "--quiet", "--json"] + MOERPC_FORMAT.get(fmt, [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except (OSError, subprocess.TimeoutExpired) as ex:
        return None, f"{' '.join(cmd)}: {ex}"
    if r.returncode != 0:
        msg = (r.stderr or r.stdout).strip().splitlines()
        unk = [m for m in msg if "unknown command" in m]
        return None, (f"moerpc-client has no `bench` command ({unk[0].strip()})" if unk else
                      f"moerpc-client bench exited {r.returncode}: {' | '.join(msg[-3:])}")
    res = {}
    for line in r.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                continue
            for k in ("prefill_tok_s", "decode_tok_s"):
                if k in d:
                    res[k] = float(d[k])
    if not res:
        return None, f"no prefill_tok_s/decode_tok_s in the output of {' '.join(cmd)}"
    return res, None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_format(args, py, model, fmt, cpu):
    g = gguf_for(args, py, model, fmt)
    V = hp(json.load(open(os.path.join(model, "config.json"))))["V"]
    # one long-lived llama worker per format: the model stays loaded between its runs
    lw = subprocess.Popen([py, __file__, "_llama_server", g, str(args.threads),
                           str(args.prompt_len + args.decode + 16)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(req):
        lw.stdin.write(json.dumps(req) + "\n")
        lw.stdin.flush()
        line = lw.stdout.readline()
        if not line:
            raise RuntimeError("llama worker died")
        return json.loads(line)

    pre_ids = prompt(args.prompt_len, V, 11)
    dec_ids = prompt(DECODE_PROMPT, V, 12)
    ours_p, ours_d, ll_p, ll_d = [], [], [], []
    note = None if not args.only_llama else "--only-llama"
    t_load = ask({"op": "ping"})["load_s"]
    load_before = loadavg()
    for rep in range(-1, args.repeats):        # rep -1: untimed warm-up of both
        if note is None:
            res, note = moerpc_bench(args, model, fmt)
            if res and rep >= 0:
                ours_p.append(res.get("prefill_tok_s"))
                ours_d.append(res.get("decode_tok_s"))
            if note:
                log(f"vs_llamacpp: {note}")
        p = ask({"op": "prefill", "ids": pre_ids})["tok_s"]
        d = ask({"op": "decode", "ids": dec_ids, "n": args.decode})["tok_s"]
        if rep >= 0:
            ll_p.append(p)
            ll_d.append(d)
        log(f"vs_llamacpp: {fmt} {'warm-up' if rep < 0 else f'run {rep + 1}/{args.repeats}'}: "
            f"llama prefill {p:.1f} tok/s, decode {d:.2f} tok/s"
            + (f"; moerpc {ours_p[-1]} / {ours_d[-1]}" if ours_p and rep >= 0 else ""))
    lw.stdin.close()
    lw.wait()
    lp, ld, op, od = med(ll_p), med(ll_d), med(ours_p), med(ours_d)
    out = {"format": fmt, "threads": args.threads, "prompt_len": args.prompt_len,
           "decode": args.decode, "batch": 1, "repeats": args.repeats, "cpu": cpu,
           "model": model, "gguf": g, "gguf_gib": round(os.path.getsize(g) / 2**30, 3),
           "llama_load_s": round(t_load, 2), "loadavg_before": load_before,
           "loadavg_after": loadavg(),
           "llama_prefill_tok_s": round(lp, 2), "moerpc_prefill_tok_s": op,
           "prefill_ratio": round(op / lp, 3) if op else None,
           "llama_decode_tok_s": round(ld, 3), "moerpc_decode_tok_s": od,
           "decode_ratio": round(od / ld, 3) if od else None,
           "llama_prefill_runs": [round(x, 2) for x in ll_p],
           "llama_decode_runs": [round(x, 3) for x in ll_d]}
    if note:
        out["moerpc_note"] = note
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", help="HF Qwen3-MoE checkpoint dir (default: made by mkmodel)")
    ap.add_argument("--mkmodel-args", default=DEFAULT_MK,
                    help=f"moerpc-mkmodel flags for the default model (default: {DEFAULT_MK})")
    ap.add_argument("--formats", default="bf16,q8_0", help="GGUF weight types: bf16, q8_0")
    ap.add_argument("--threads", type=int, default=2, help="threads for both sides")
    ap.add_argument("--prompt-len", type=int, default=128, help="prefill prompt tokens")
    ap.add_argument("--decode", type=int, default=32, help="decode steps (greedy)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs of each side, alternating; medians reported")
    ap.add_argument("--client", default=os.path.join(ROOT, "build", "bin", "moerpc-client"),
                    help="moerpc-client (moerpc-mkmodel is taken from the same folder)")
    ap.add_argument("--venv", default=os.environ.get("MOERPC_BENCH_VENV",
                                                     os.path.join(ROOT, ".venv-bench")),
                    help="venv with llama-cpp-python + gguf (made if missing; env "
                         "MOERPC_BENCH_VENV; default .venv-bench)")
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "bench"),
                    help="where models and GGUF files go (default build/bench)")
    ap.add_argument("--validate-limit", type=float, default=0.02,
                    help="rel L2 limit, llama.cpp vs transformers on the GGUF's weights "
                         "(5x this vs the original checkpoint); default 0.02")
    ap.add_argument("--skip-validate", action="store_true")
    ap.add_argument("--only-llama", action="store_true", help="do not run moerpc-client")
    ap.add_argument("--timeout", type=int, default=1800, help="per moerpc-client bench run, s")
    ap.add_argument("--json", help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    for f in args.formats:
        if f not in ("bf16", "q8_0"):
            ap.error(f"unknown format {f} (bf16, q8_0)")
    os.makedirs(args.work, exist_ok=True)
    py = ensure_llama_venv(args.venv)
    cpu = cpu_model()
    lines = []

    def emit(d):
        s = json.dumps(d)
        print(s, flush=True)
        lines.append(s)

    if not args.skip_validate and not validate(args, py):
        log("vs_llamacpp: the GGUF conversion does not reproduce transformers; not timing")
        return 1
    model = args.model or mkmodel(args, os.path.join(args.work, "qwen3moe-bench"),
                                  args.mkmodel_args)
    for fmt in args.formats:
        emit(run_format(args, py, model, fmt, cpu))
    if args.json:
        with open(args.json, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0


# ---------------------------------------------------------------------------------------
# workers (python vs_llamacpp.py _NAME ...), each in the venv that has what it needs

def w_hf_logits(model, ids, out):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ids = [int(x) for x in ids.split(",")]
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        lg = m(torch.tensor([ids]), use_cache=False).logits[0].float()
    with open(out, "w") as f:
        json.dump({"logits": lg.tolist(), "std": float(lg.std()),
                   "rope": dict(m.config.rope_parameters)}, f)
    print(json.dumps({"ok": True}))


GGUF_TO_HF = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def w_gguf_to_hf(g, src, out):
    """Reads a GGUF back (dequantized to f32) into an HF checkpoint dir with src's
    config.json: transformers on it is the oracle over the weights llama.cpp holds."""
    import numpy as np
    import gguf
    r = gguf.GGUFReader(g)
    T = {}
    for t in r.tensors:
        x = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        n = t.name[: -len(".weight")]
        if n == "token_embd":
            T["model.embed_tokens.weight"] = x
        elif n == "output":
            T["lm_head.weight"] = x
        elif n == "output_norm":
            T["model.norm.weight"] = x
        else:
            _, li, what = n.split(".", 2)
            hf = GGUF_TO_HF[what]
            if what.endswith("_exps"):
                for e in range(x.shape[0]):
                    T[f"model.layers.{li}.mlp.experts.{e}.{hf}.weight"] = x[e]
            else:
                T[f"model.layers.{li}.{hf}.weight"] = x
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    hdr, off = {}, 0
    for k in sorted(T):
        hdr[k] = {"dtype": "F32", "shape": list(T[k].shape), "data_offsets": [off, off + T[k].nbytes]}
        off += T[k].nbytes
    hb = json.dumps(hdr).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for k in sorted(T):
            f.write(T[k].tobytes())
    print(json.dumps({"ok": True, "tensors": len(T)}))


def w_llama_logits(g, ids, out, threads):
    ids = [int(x) for x in ids.split(",")]
    lg = llama_logits(g, ids, int(threads))
    with open(out, "w") as f:
        json.dump(lg.tolist(), f)
    print(json.dumps({"ok": True}))


def w_llama_server(g, threads, n_ctx):
    t0 = time.perf_counter()
    llm = llama_open(g, int(threads), int(n_ctx))
    load_s = time.perf_counter() - t0
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "ping":
            res = {"load_s": load_s}
        elif req["op"] == "prefill":
            res = {"tok_s": llama_prefill(llm, req["ids"])}
        else:
            res = {"tok_s": llama_decode(llm, req["ids"], req["n"])}
        sys.stdout.write(json.dumps(res) + "\n")
        sys.stdout.flush()
    llm.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        fn = {"_convert": convert, "_hf_logits": w_hf_logits, "_llama_logits": w_llama_logits,
              "_gguf_to_hf": w_gguf_to_hf,
              "_llama_server": w_llama_server}[sys.argv[1]]
        sys.exit(fn(*sys.argv[2:]) or 0)
    sys.exit(main(sys.argv[1:]))
