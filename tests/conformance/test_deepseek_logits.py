#!/usr/bin/env python3
"""Checks the DeepSeek-V3 runner (moerpc-client logits / generate) against transformers.

Five small random checkpoints are written by transformers itself (DeepseekV3Config +
DeepseekV3ForCausalLM, save_pretrained, safetensors), with fixed seeds; hidden 64, vocab
256, num_key_value_heads = num_attention_heads = 4, qk_nope 16, qk_rope 8, v_head 16,
kv_lora_rank 32, moe_intermediate 32, dense intermediate 96:

  ds-a  3 layers, first_k_dense_replace 1, 8 routed experts top-2 in n_group 4 /
        topk_group 2, 1 shared expert, q_lora_rank 48, yarn {factor 4, beta_fast 32,
        beta_slow 1, mscale 1, mscale_all_dim 1, original_max_position_embeddings 128,
        rope_theta 1e4} with max_position_embeddings 512, rope_interleave, norm_topk_prob,
        routed_scaling_factor 2.5, untied lm_head; bf16, SHARDED, e_score_correction_bias
        stored F32 (as in DeepSeek-V3's own files)
  ds-b  2 layers, first_k_dense_replace 1, q_lora_rank null (q_proj), default RoPE
        (rotate-half, rope_interleave false), n_group 1 / topk_group 1, norm_topk_prob
        false, routed_scaling_factor 1, 2 shared experts (moe_intermediate * 2), tied
        embeddings (no lm_head.weight in the file); f32, one file
  ds-c  Kimi-K2-like: 4 layers, 2 dense, 16 experts top-4, n_group 1, yarn factor 8 with
        beta_fast = beta_slow = 1 (the ramp's singular case) and mscale 0.707 /
        mscale_all_dim 1 (attention_factor != 1: cos/sin scaled), routed_scaling 2.827;
        config.json rewritten to the hub layout of the real checkpoints ("rope_scaling"
        with "type": "yarn", "rope_theta" at the top level); bf16 (bias bf16, as
        transformers writes it), one file
  ds-d  2 layers, yarn factor 4 with mscale_all_dim 0 (no softmax-scale change;
        attention_factor = 0.1 ln(factor) + 1, mscale ignored), rope_interleave false,
        8 experts top-3 in n_group 2 / topk_group 1; f32, one file
  ds-fp8  ds-a's model in 2 layers with a dense intermediate of 256, rewritten in
        DeepSeek-V3's FP8 layout: every decoder Linear F8_E4M3 with an F32 "_scale_inv"
        per 128x128 block (so the dense MLP has 2 blocks along one side) and
        quantization_config; the reference runs on torch's F32 dequantization of it

For each, a 12-token prompt goes through

  * the checkpoint check: the tensor names and shapes in the file are exactly those the
    config implies (per-expert gate/up/down, no fused gate_up_proj), the correction bias
    is there, non-zero and loaded back by transformers;
  * the reference: the checkpoint loaded back by transformers with dtype=float32 (eager
    attention), eval, no grad -> logits [T, vocab]; hooks record each router's choice;
  * `spec_forward`: an independent float64 numpy re-derivation from the raw safetensors
    tensors and config.json, held to rel L2 <= 1e-5 against the reference. MLA is
    computed both EXPANDED (k = [kv_b(c)_nope, k_rot], v = kv_b(c)_v) and ABSORBED
    (q_lat = W_uk^T q_nope; score = q_lat . c + q_rot . k_rot; out = W_uv (sum_t p c_t)),
    the form the C runner uses with its latent cache; the two agree to 1e-9. The yarn
    inv_freq / attention_factor / softmax scale and the routing (sigmoid, bias for the
    selection only, group-limited top-k, normalisation, routed_scaling_factor) are
    checked against transformers' own values, and the bias and the group limit must
    each change at least one choice (so a runner that ignores them fails);
  * ours: `MOERPC_ISA=ref moerpc-client logits --model DIR --ids ... --out FILE` (fp32
    [T, vocab] row-major little-endian): rel L2 of the whole matrix <= 1e-3 and the argmax
    of every row identical;
  * decode: `MOERPC_ISA=ref moerpc-client generate --prompt-ids P1;P2 --max-new 6 --json`
    (the 12-token prompt and a 7-token one prefilled together, then 5 single-token steps
    of both through their latent KV caches) must give transformers' greedy tokens.

A client that refuses the model FAILS (it is not skipped). `--only-reference` only builds
the checkpoints and runs the reference and spec checks. `--wrong-spec WHAT` perturbs the
spec on purpose (bias-in-weights, no-bias, no-groups, no-mscale, no-attn-factor,
rope-halves, expanded-only-scale) to show the spec check fails. Reference ids and logits
(ids.txt, ref_logits.f32 raw + ref_logits.npy, ref_greedy.txt, command.txt) go to a temp
directory that is printed on failure and kept; `--keep DIR` keeps everything in DIR.

  test_deepseek_logits.py --client build/bin/moerpc-client [--threads N] [--verbose]
  test_deepseek_logits.py --only-reference [--verbose] [--cases ds-a,ds-b]
Prints one line per check and "conformance-deepseek: N passed, N failed"; exits 1 on any
failure.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

REL_L2_LIMIT = 1e-3   # ours (fp32 scalar reference kernels) vs transformers fp32
FP8_EXACT_LIMIT = 1e-5  # ds-fp8 with the dense weights as fp8-b128 or f32: exact weights
SPEC_LIMIT = 1e-5     # float64 re-derivation vs transformers fp32
MLA_FORMS_LIMIT = 1e-9  # expanded vs absorbed MLA, both float64
T_PROMPT = 12
MAX_NEW = 6           # generate: 1 token from the prefill + 5 decode steps
WRONG = ("bias-in-weights", "no-bias", "no-groups", "no-mscale", "no-attn-factor",
         "rope-halves", "expanded-only-scale")


# ---------------------------------------------------------------------------------------
# the checkpoints

def ds_config(**over):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
              routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
              v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
              first_k_dense_replace=1, norm_topk_prob=True, rms_norm_eps=1e-6,
              max_position_embeddings=512, rope_interleave=True, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 128})
    kw.update(over)
    return DeepseekV3Config(**kw)


def hub_layout(cfg):
    """config.json as the real DeepSeek-V3 / Kimi-K2 checkpoints spell it: "rope_scaling"
    with "type", "rope_theta" at the top level, no "rope_parameters"; the routing keys
    transformers 5 does not write (topk_method, scoring_func, moe_layer_freq) present;
    no "head_dim" / "qk_head_dim" (transformers writes head_dim = qk_rope_head_dim)."""
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    for k in ("head_dim", "qk_head_dim"):
        cfg.pop(k, None)
    cfg.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
    return cfg


# config.json keys the runner reads (tests/conformance/README.md); the rope dict is
# checked by rope_params / rope_tables
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "n_shared_experts", "n_routed_experts", "num_experts_per_tok",
               "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
               "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
               "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps",
               "tie_word_embeddings", "rope_interleave", "max_position_embeddings")


FP8_BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def is_fp8_linear(name):
    """The weights DeepSeek-V3 ships as F8_E4M3: every nn.Linear inside the decoder layers
    (attention with kv_a_proj_with_mqa, dense MLP, shared and routed experts), not the
    router."""
    return name.startswith("model.layers.") and (name.endswith("proj.weight")
                                                  or name.endswith("proj_with_mqa.weight"))


def to_fp8(ckpt):
    """Rewrites a one-file checkpoint as DeepSeek-V3's FP8 layout: each decoder Linear as
    F8_E4M3 codes q = (w / s) with s = amax / 448 of its 128x128 block (1 for a zero block;
    ceil(N/128) x ceil(K/128) blocks, the last ones short) and "<name>_scale_inv" = s (F32);
    quantization_config added to config.json."""
    from safetensors.torch import save_file
    path = os.path.join(ckpt, "model.safetensors")
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for k, t in tensors.items():
        if not is_fp8_linear(k):
            out[k] = t
            continue
        w = t.float()
        nb, kb = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
        sc = torch.ones(nb, kb, dtype=torch.float32)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        for i in range(nb):
            for j in range(kb):
                blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
                amax = float(blk.abs().max())
                if amax > 0:
                    sc[i, j] = amax / 448.0
                q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = \
                    (blk / sc[i, j]).to(torch.float8_e4m3fn)
        out[k], out[k + "_scale_inv"] = q, sc
    save_file(out, path, metadata={"format": "pt"})
    cpath = os.path.join(ckpt, "config.json")
    with open(cpath) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(FP8_CONFIG)
    with open(cpath, "w") as f:
        json.dump(cfg, f, indent=2)


def dequant_copy(ckpt):
    """The reference's copy of an FP8 checkpoint: torch dequantizes every F8_E4M3 weight with
    its block scale into F32 (a second implementation besides numpy's dequant_fp8), and
    config.json loses quantization_config. (transformers' own FP8 loader needs accelerate,
    which the venv does not pin, and would quantize for real on a GPU.)"""
    from safetensors.torch import save_file
    dst = ckpt + "-dequant"
    os.makedirs(dst, exist_ok=True)
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for k, v in t.items():
        if k.endswith("_scale_inv"):
            continue
        sc = t.get(k + "_scale_inv")
        if sc is not None:
            full = sc.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
            v = v.to(torch.float32) * full[: v.shape[0], : v.shape[1]]
        out[k] = v.to(torch.float32)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = read_config(ckpt)
    cfg.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


# name: (config factory, dtype saved, max_shard_size or None, seed, bias dtype or None
#        (= as transformers writes it), rewrite of the saved checkpoint dir or None)
CASES = {
    "ds-a": (lambda: ds_config(), torch.bfloat16, "100KB", 21, torch.float32, None),
    "ds-b": (lambda: ds_config(num_hidden_layers=2, q_lora_rank=None, n_group=1, topk_group=1,
                               norm_topk_prob=False, routed_scaling_factor=1.0,
                               n_shared_experts=2, tie_word_embeddings=True,
                               rope_interleave=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
             torch.float32, None, 22, None, None),
    "ds-c": (lambda: ds_config(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=16,
                               num_experts_per_tok=4, n_group=1, topk_group=1,
                               routed_scaling_factor=2.827, max_position_embeddings=1024,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0,
                                                "factor": 8.0, "beta_fast": 1.0,
                                                "beta_slow": 1.0, "mscale": 0.707,
                                                "mscale_all_dim": 1.0,
                                                "original_max_position_embeddings": 128}),
             torch.bfloat16, None, 23, None, hub_layout),
    "ds-d": (lambda: ds_config(num_hidden_layers=2, n_group=2, topk_group=1,
                               num_experts_per_tok=3, rope_interleave=False,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                                "mscale": 0.707, "mscale_all_dim": 0,
                                                "original_max_position_embeddings": 128}),
             torch.float32, None, 24, None, None),
    "ds-fp8": (lambda: ds_config(num_hidden_layers=2, intermediate_size=256),
               torch.bfloat16, None, 25, torch.float32, to_fp8),
}


def init_weights(model, seed):
    """Deterministic weights, large enough that logits, attention and routing are not
    trivial: norm weights 1 + 0.2 N(0,1) (so a skipped norm weight shows), embeddings
    N(0, 0.5), projections (and the experts' fused gate_up_proj / down_proj) N(0, 0.06),
    routers N(0, 0.3), lm_head N(0, 0.1); the e_score_correction_bias buffers N(0, 0.1)
    (transformers initialises them to 0, which would hide a runner that ignores them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                v = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif name.endswith("embed_tokens.weight"):
                v = 0.5 * torch.randn(p.shape, generator=g)
            elif name.endswith("mlp.gate.weight"):  # the router
                v = 0.3 * torch.randn(p.shape, generator=g)
            elif name.endswith("lm_head.weight"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            else:
                v = 0.06 * torch.randn(p.shape, generator=g)
            p.copy_(v)
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_checkpoint(name, out_dir):
    cfg_fn, dtype, shard, seed, bias_dtype, rewrite = CASES[name]
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg_fn())
    init_weights(model, seed)
    full = {n: b.detach().clone() for n, b in model.named_buffers()}
    model = model.to(dtype)
    bias = {}
    for mname, mod in model.named_modules():
        if hasattr(mod, "e_score_correction_bias"):
            if bias_dtype is not None:  # from the f32 values, not from their `dtype` rounding
                mod.e_score_correction_bias = full[mname + ".e_score_correction_bias"].to(bias_dtype)
            bias[mname + ".e_score_correction_bias"] = mod.e_score_correction_bias.detach().clone()
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kw)
    if rewrite is to_fp8:
        to_fp8(out_dir)
    elif rewrite:
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump(rewrite(cfg), f, indent=2)
    return bias


def prompt_ids(seed, vocab):
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, vocab - 1, (T_PROMPT,), generator=g)
    ids[3] = 0            # the first and last rows of the embedding table
    ids[7] = vocab - 1
    ids[9] = ids[2]       # a repeated token at another position (RoPE must tell them apart)
    return [int(i) for i in ids]


def second_prompt(seed, vocab):
    """A shorter prompt for the second sequence of the decode check (7 tokens)."""
    g = torch.Generator().manual_seed(2000 + seed)
    return [int(i) for i in torch.randint(0, vocab, (7,), generator=g)]


def load_reference(ckpt):
    return DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 attn_implementation="eager").eval()


def reference_run(model, ids):
    """Logits [T, vocab] and, per MoE layer, the router's (ids [T, k], weights [T, k])."""
    routes, hooks = {}, []
    for li, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            def hook(_m, _inp, out, li=li):
                routes[li] = (out[2].numpy().copy(), out[1].double().numpy().copy())
            hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].float().contiguous().numpy(), routes


def loaded_equals_file(model, W, cfg):
    """Whether every parameter/buffer transformers loaded (float32) equals the file's tensor
    as this file reads it (float64; FP8 dequantized by numpy), the experts' fused
    gate_up_proj [E, 2I, H] / down_proj [E, H, I] against the per-expert tensors.
    Returns (all equal, tensors compared, the first that differs)."""
    sd = {k: v.double().numpy() for k, v in model.state_dict().items()}
    n, worst = 0, ""
    for k, v in sorted(sd.items()):
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            pre = k.rsplit(".", 1)[0]
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    parts = [W[f"{pre}.{e}.gate_proj.weight"], W[f"{pre}.{e}.up_proj.weight"]]
                    want = np.concatenate(parts, 0)
                    n += 2
                else:
                    want = W[f"{pre}.{e}.down_proj.weight"]
                    n += 1
                if not np.array_equal(v[e], want):
                    worst = worst or f"{k}[{e}]"
            continue
        if k not in W:
            if k == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                continue
            worst = worst or f"{k} (not in the file)"
            continue
        n += 1
        if not np.array_equal(v, W[k]):
            worst = worst or k
    return not worst, n, worst


def reference_greedy(model, ids, n):
    """Greedy tokens by full recomputation (no cache), and the top-1 minus top-2 logit
    margin of each step."""
    seq, gen, margins = list(ids), [], []
    with torch.no_grad():
        for _ in range(n):
            last = model(torch.tensor([seq]), use_cache=False).logits[0, -1].double()
            top = torch.topk(last, 2)
            gen.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(gen[-1])
    return gen, margins


# ---------------------------------------------------------------------------------------
# the checkpoint as the C loader sees it: config.json + safetensors (single or sharded)

def tensor_files(ckpt):
    idx = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            wm = json.load(f)["weight_map"]
        return {k: os.path.join(ckpt, v) for k, v in wm.items()}, True
    single = os.path.join(ckpt, "model.safetensors")
    with safe_open(single, "pt") as s:
        return {k: single for k in s.keys()}, False


def dequant_fp8(q, scale_inv):
    """numpy: w = e4m3(q) * scale_inv of its 128x128 block, multiplied in float32 (as the
    servers' loader does, tests/conformance/README.md); the block grid from the weight's
    shape, DeepSeek's convention: ceil(N/128) x ceil(K/128), the last blocks short."""
    n, k = q.shape
    if scale_inv.shape != (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)):
        raise ValueError(f"scale_inv {scale_inv.shape} does not match {q.shape} in 128x128 blocks")
    s = np.repeat(np.repeat(scale_inv, FP8_BLOCK, 0), FP8_BLOCK, 1)[:n, :k]
    return (q.astype(np.float32) * s.astype(np.float32)).astype(np.float64)  # an f32 product


def load_tensors(ckpt):
    """Every tensor as float64 numpy (FP8 weights dequantized with their scale_inv, which
    are then dropped), and (shape, dtype, file) per name as stored."""
    files, _ = tensor_files(ckpt)
    out, info, by_file = {}, {}, {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    for f, keys in by_file.items():
        with safe_open(f, "pt") as s:
            for k in keys:
                t = s.get_tensor(k)
                info[k] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), os.path.basename(f))
                out[k] = t.to(torch.float32).to(torch.float64).numpy()
    for k in [k for k in out if k + "_scale_inv" in out]:
        out[k] = dequant_fp8(out[k], out.pop(k + "_scale_inv"))
    return out, info


def read_config(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)


def rope_params(cfg):
    """The RoPE dict whichever way config.json spells it (5.x "rope_parameters" or the
    hub's "rope_scaling" + top-level "rope_theta")."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp.setdefault("rope_type", rp.pop("type", "default"))
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rp


def expected_tensors(cfg):
    """name -> shape of every tensor the config implies (ds-shared.md's layout)."""
    H, V, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r, ql = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    E, I, Im = cfg["n_routed_experts"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    Is = Im * cfg["n_shared_experts"]
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = (V, H)
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        t[p + "input_layernorm.weight"] = (H,)
        t[p + "post_attention_layernorm.weight"] = (H,)
        a = p + "self_attn."
        if ql is None:
            t[a + "q_proj.weight"] = (nh * (nope + rope), H)
        else:
            t[a + "q_a_proj.weight"] = (ql, H)
            t[a + "q_a_layernorm.weight"] = (ql,)
            t[a + "q_b_proj.weight"] = (nh * (nope + rope), ql)
        t[a + "kv_a_proj_with_mqa.weight"] = (r + rope, H)
        t[a + "kv_a_layernorm.weight"] = (r,)
        t[a + "kv_b_proj.weight"] = (nh * (nope + vd), r)
        t[a + "o_proj.weight"] = (H, nh * vd)
        m = p + "mlp."
        if li < cfg["first_k_dense_replace"]:
            t.update({m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H),
                      m + "down_proj.weight": (H, I)})
            continue
        t[m + "gate.weight"] = (E, H)
        t[m + "gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            x = f"{m}experts.{e}."
            t.update({x + "gate_proj.weight": (Im, H), x + "up_proj.weight": (Im, H),
                      x + "down_proj.weight": (H, Im)})
        t.update({m + "shared_experts.gate_proj.weight": (Is, H),
                  m + "shared_experts.up_proj.weight": (Is, H),
                  m + "shared_experts.down_proj.weight": (H, Is)})
    if cfg.get("quantization_config"):
        b = FP8_BLOCK
        for k, shp in list(t.items()):
            if is_fp8_linear(k):
                t[k + "_scale_inv"] = (-(-shp[0] // b), -(-shp[1] // b))
    return t


# ---------------------------------------------------------------------------------------
# the float64 re-derivation

def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def yarn_mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_tables(cfg, wrong=None):
    """(inv_freq [d/2], attention_factor, softmax scale) from config.json, written from the
    YaRN paper's recipe as transformers applies it (dim = qk_rope_head_dim, correction range
    floored/ceiled, ramp over d/2 frequencies)."""
    rp = rope_params(cfg)
    d = cfg["qk_rope_head_dim"]
    base = float(rp["rope_theta"])
    scale = float(cfg["qk_nope_head_dim"] + d) ** -0.5
    pos_freq = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if rp["rope_type"] == "default":
        return 1.0 / pos_freq, 1.0, scale
    assert rp["rope_type"] == "yarn", rp
    factor = float(rp["factor"])
    orig = float(rp["original_max_position_embeddings"])
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
    m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
    af = rp.get("attention_factor")
    if af is None:
        af = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if (m and m_all) \
            else yarn_mscale(factor, 1.0)
    if wrong == "no-attn-factor":
        af = 1.0

    def corr_dim(rot):  # the dimension whose wavelength makes `rot` turns over `orig`
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(beta_fast)), 0)
    hi = min(math.ceil(corr_dim(beta_slow)), d - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    extrap = 1.0 - ramp                 # 1: keep the original frequency (high frequencies)
    inv = (1.0 / (factor * pos_freq)) * (1.0 - extrap) + (1.0 / pos_freq) * extrap
    if m_all and wrong != "no-mscale":
        scale *= yarn_mscale(factor, m_all) ** 2
    return inv, af, scale


def route(cfg, logits, bias, wrong=None):
    """DeepSeek-V3 noaux_tc routing of one token: sigmoid scores, bias added for the choice
    only, groups ranked by the sum of their top-2 choice scores, top-k among the kept
    groups (ties to the lower index). Returns (ids, weights)."""
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    G, TG = cfg["n_group"], cfg["topk_group"]
    if wrong == "no-groups":
        G = TG = 1
    s = 1.0 / (1.0 + np.exp(-logits))
    choice = s + (0.0 if wrong == "no-bias" else bias)
    per = E // G
    gsc = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(G)]
    keep = sorted(range(G), key=lambda g: (-gsc[g], g))[:TG]
    cand = [e for e in range(E) if e // per in keep]
    ids = sorted(cand, key=lambda e: (-choice[e], e))[:k]
    w = (s + bias)[ids] if wrong == "bias-in-weights" else s[ids]
    if cfg.get("norm_topk_prob"):
        w = w / (w.sum() + 1e-20)
    return ids, w * cfg["routed_scaling_factor"]


def spec_forward(cfg, W, ids, wrong=None):
    """Float64 forward pass of DeepseekV3ForCausalLM. Returns (logits [T, V], per MoE layer
    the (ids, weights) lists, the largest expanded-vs-absorbed MLA difference, per MoE layer
    how many tokens' choice changes without the bias / without the group limit)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    assert cfg["num_key_value_heads"] == nh and not cfg.get("attention_bias")
    assert cfg.get("scoring_func", "sigmoid") == "sigmoid"
    assert cfg.get("topk_method", "noaux_tc") == "noaux_tc"
    assert cfg.get("moe_layer_freq", 1) == 1 and cfg.get("hidden_act", "silu") == "silu"
    nope, d, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    r, ql, eps = cfg["kv_lora_rank"], cfg.get("q_lora_rank"), cfg["rms_norm_eps"]
    T = len(ids)
    inv, af, scale = rope_tables(cfg, wrong)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]          # [T, d/2]
    cos, sin = np.cos(ang) * af, np.sin(ang) * af

    def rope(v):  # v [T, n, d]
        c, s_ = cos[:, None, :], sin[:, None, :]
        if cfg.get("rope_interleave", True) and wrong != "rope-halves":
            a, b = v[..., 0::2], v[..., 1::2]   # pairs (2i, 2i+1), kept in place
            out = np.empty_like(v)
            out[..., 0::2], out[..., 1::2] = a * c - b * s_, b * c + a * s_
            return out
        a, b = v[..., : d // 2], v[..., d // 2:]  # rotate-half pairs (i, i + d/2)
        return np.concatenate([a * c - b * s_, b * c + a * s_], axis=-1)

    future = np.triu(np.ones((T, T), dtype=bool), 1)

    def softmax(sc):
        sc = np.where(future[None], -np.inf, sc)
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        return sc / sc.sum(-1, keepdims=True)

    x = W["model.embed_tokens.weight"][np.asarray(ids)]
    routes, mla_diff, sensitivity = {}, 0.0, {}
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        a_ = p + "self_attn."
        h = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        if ql is None:
            q = h @ W[a_ + "q_proj.weight"].T
        else:
            qa = rms_norm(h @ W[a_ + "q_a_proj.weight"].T, W[a_ + "q_a_layernorm.weight"], eps)
            q = qa @ W[a_ + "q_b_proj.weight"].T
        q = q.reshape(T, nh, nope + d)
        q_nope, q_rot = q[..., :nope], rope(q[..., nope:])
        kva = h @ W[a_ + "kv_a_proj_with_mqa.weight"].T                     # [T, r + d]
        c = rms_norm(kva[:, :r], W[a_ + "kv_a_layernorm.weight"], eps)    # the cached latent
        k_rot = rope(kva[:, None, r:])[:, 0, :]                            # shared, [T, d]
        kvb = W[a_ + "kv_b_proj.weight"].reshape(nh, nope + vd, r)
        w_uk, w_uv = kvb[:, :nope, :], kvb[:, nope:, :]                    # [nh, nope|v, r]
        # expanded: per-head keys and values, as transformers builds them
        k_nope = np.einsum("hnr,tr->thn", w_uk, c)
        v = np.einsum("hvr,tr->thv", w_uv, c)
        k = np.concatenate([k_nope, np.broadcast_to(k_rot[:, None, :], (T, nh, d))], -1)
        qf = np.concatenate([q_nope, q_rot], -1)
        pe = softmax(np.einsum("qhd,khd->hqk", qf, k) * scale)
        o_exp = np.einsum("hqk,khv->qhv", pe, v)
        # absorbed: attend over the latent c and the shared k_rot, expand once at the end
        q_lat = np.einsum("hnr,qhn->qhr", w_uk, q_nope)
        sc = np.einsum("qhr,kr->hqk", q_lat, c) + np.einsum("qhd,kd->hqk", q_rot, k_rot)
        pa = softmax(sc * (scale if wrong != "expanded-only-scale" else 1.0))
        o_abs = np.einsum("hvr,qhr->qhv", w_uv, np.einsum("hqk,kr->qhr", pa, c))
        mla_diff = max(mla_diff, float(np.linalg.norm(o_abs - o_exp) / np.linalg.norm(o_exp)))
        o = o_exp.reshape(T, nh * vd)
        x = x + o @ W[a_ + "o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        if li < cfg["first_k_dense_replace"]:
            g, u = h @ W[m + "gate_proj.weight"].T, h @ W[m + "up_proj.weight"].T
            x = x + (silu(g) * u) @ W[m + "down_proj.weight"].T
            continue
        logits = h @ W[m + "gate.weight"].T                                # [T, E]
        bias = W[m + "gate.e_score_correction_bias"]
        y = np.zeros_like(x)
        rl, nb, ng = [], 0, 0
        for t in range(T):
            sel, wsel = route(cfg, logits[t], bias, wrong)
            rl.append((sel, wsel))
            nb += set(route(cfg, logits[t], bias, "no-bias")[0]) != set(sel)
            ng += set(route(cfg, logits[t], bias, "no-groups")[0]) != set(sel)
            for e, we in zip(sel, wsel):
                ep = f"{m}experts.{e}."
                g, u = h[t] @ W[ep + "gate_proj.weight"].T, h[t] @ W[ep + "up_proj.weight"].T
                y[t] += we * ((silu(g) * u) @ W[ep + "down_proj.weight"].T)
        sh = m + "shared_experts."
        g, u = h @ W[sh + "gate_proj.weight"].T, h @ W[sh + "up_proj.weight"].T
        y += (silu(g) * u) @ W[sh + "down_proj.weight"].T
        x = x + y
        routes[li], sensitivity[li] = rl, (nb, ng)
    x = rms_norm(x, W["model.norm.weight"], eps)
    head = W.get("lm_head.weight")
    if head is None:  # tie_word_embeddings: the file has no lm_head.weight
        assert cfg.get("tie_word_embeddings"), "no lm_head.weight and not tied"
        head = W["model.embed_tokens.weight"]
    return x @ head.T, routes, mla_diff, sensitivity


# ---------------------------------------------------------------------------------------

def rel_l2(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    num = np.linalg.norm(y - ref)
    return float(num / den) if den > 0 else (0.0 if num == 0 else float("inf"))


def run_client(args, sub, ckpt, extra, logf):
    cmd = [args.client, sub, "--model", ckpt] + extra
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, MOERPC_ISA="ref")
    with open(logf, "a") as f:
        f.write("MOERPC_ISA=ref " + " ".join(cmd) + "\n")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def refusal(args, sub, r):
    msg = (r.stderr or r.stdout).strip().splitlines()
    unknown = [m for m in msg if "unknown command" in m]
    if unknown:
        return f"{args.client} has no `{sub}` command (exit {r.returncode}: {unknown[0].strip()})"
    return (f"moerpc-client {sub} exited {r.returncode}: "
            f"{' | '.join(m for m in msg[-3:] if m.strip())}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--client", default=os.path.join(os.environ.get("MOERPC_BIN", "build/bin"),
                                                     "moerpc-client"))
    ap.add_argument("--only-reference", action="store_true",
                    help="only build the checkpoints and run the reference and spec checks")
    ap.add_argument("--wrong-spec", choices=WRONG,
                    help="perturb the spec on purpose (its checks must then fail)")
    ap.add_argument("--verbose", action="store_true",
                    help="print each checkpoint's config.json and tensor names")
    ap.add_argument("--threads", type=int, default=0, help="--threads for the client (0: its default)")
    ap.add_argument("--keep", help="write everything to this directory and keep it")
    ap.add_argument("--cases", default="", help="comma-separated subset of " + ",".join(CASES))
    args = ap.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    tmp = args.keep or tempfile.mkdtemp(prefix="deepseek-conf-")
    os.makedirs(tmp, exist_ok=True)
    passed = failed = 0

    def check(ok, msg):
        nonlocal passed, failed
        print(f"{'ok  ' if ok else 'FAIL'} {msg}", flush=True)
        if ok:
            passed += 1
        else:
            failed += 1
        return ok

    want = set(filter(None, args.cases.split(",")))
    bad = want - set(CASES)
    if bad:
        ap.error(f"--cases: unknown {sorted(bad)}, known: {','.join(CASES)}")
    for name in CASES:
        if want and name not in want:
            continue
        cdir = os.path.join(tmp, name)
        ckpt = os.path.join(cdir, "ckpt")
        shutil.rmtree(cdir, ignore_errors=True)
        os.makedirs(cdir)
        set_bias = build_checkpoint(name, ckpt)
        cfg = read_config(ckpt)
        ids = prompt_ids(CASES[name][3], cfg["vocab_size"])
        W, info = load_tensors(ckpt)
        sharded = tensor_files(ckpt)[1]
        if args.verbose:
            print(f"--- {name}: {ckpt}/config.json")
            print(json.dumps(cfg, indent=2))
            print(f"--- {name}: {len(info)} tensors ({'sharded' if sharded else 'one file'})")
            for k in sorted(info):
                shp, dt, fn = info[k]
                print(f"    {k} {list(shp)} {dt} {fn}")

        # 0. the file holds what the C loader is written against
        absent = [k for k in CONFIG_KEYS if k not in cfg]
        not_written = [k for k in ("topk_method", "scoring_func", "moe_layer_freq")
                       if k not in cfg]
        check(not absent and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
              and cfg["model_type"] == "deepseek_v3",
              f"{name}: config.json has every key the runner reads (absent: "
              f"{absent or 'none'}); rope {'rope_scaling' if 'rope_scaling' in cfg else 'rope_parameters'}"
              f" {rope_params(cfg)['rope_type']}; head_dim {cfg.get('head_dim', 'absent')}; "
              f"not written (defaults apply): {','.join(not_written) or 'none'}")
        exp = expected_tensors(cfg)
        missing = sorted(set(exp) - set(info))
        extra = sorted(set(info) - set(exp))
        wrong_shape = sorted(k for k in exp if k in info and info[k][0] != exp[k])
        check(not missing and not extra and not wrong_shape,
              f"{name}: {len(info)} tensors, exactly the config's layout (missing "
              f"{missing[:3] or 'none'}, unexpected {extra[:3] or 'none'}, wrong shape "
              f"{wrong_shape[:3] or 'none'}); {'sharded' if sharded else 'one file'}")
        model = load_reference(dequant_copy(ckpt) if cfg.get("quantization_config") else ckpt)
        loaded = dict(model.named_buffers())
        bias_ok, bias_dt = True, set()
        for k, b in set_bias.items():
            bias_dt.add(info.get(k, ((), "absent", ""))[1])
            in_file = W.get(k)
            bias_ok &= in_file is not None and np.array_equal(in_file, b.double().numpy()) \
                and bool(np.any(in_file != 0)) \
                and np.array_equal(loaded[k].double().numpy(), in_file)
        check(bias_ok and len(set_bias) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"],
              f"{name}: e_score_correction_bias of {len(set_bias)} MoE layers saved as set "
              f"(non-zero, {'/'.join(sorted(bias_dt))}) and loaded back by transformers")

        same, n_cmp, worst = loaded_equals_file(model, W, cfg)
        fp8 = sorted({info[k][1] for k in info if is_fp8_linear(k)})
        check(same and n_cmp == len(W),
              f"{name}: transformers holds exactly the file's values ({n_cmp} tensors "
              f"compared{'' if same else ', first different: ' + worst}; decoder linears "
              f"stored {'/'.join(fp8)}{', numpy 128x128 dequantization' if cfg.get('quantization_config') else ''})")

        ref, ref_routes = reference_run(model, ids)
        T, V = ref.shape
        prompts = [ids, second_prompt(CASES[name][3], cfg["vocab_size"])]
        greedy = [reference_greedy(model, pr, MAX_NEW) for pr in prompts]
        gens = [g for g, _ in greedy]
        margin = min(min(m) for _, m in greedy)
        with open(os.path.join(cdir, "ids.txt"), "w") as f:
            f.write(",".join(map(str, ids)) + "\n")
        with open(os.path.join(cdir, "ref_greedy.txt"), "w") as f:
            for pr, g in zip(prompts, gens):
                f.write(",".join(map(str, pr)) + " -> " + ",".join(map(str, g)) + "\n")
        ref.astype("<f4").tofile(os.path.join(cdir, "ref_logits.f32"))
        np.save(os.path.join(cdir, "ref_logits.npy"), ref)

        # 1. transformers does what we think it does
        inv, af, scale = rope_tables(cfg, args.wrong_spec)
        rot = model.model.rotary_emb
        attn0 = model.model.layers[0].self_attn
        inv_err = rel_l2(inv, rot.inv_freq.double().numpy())
        check(inv_err <= 1e-6 and abs(af - rot.attention_scaling) <= 1e-6 * abs(af)
              and abs(scale - attn0.scaling) <= 1e-6 * scale,
              f"{name}: RoPE {rope_params(cfg)['rope_type']}: inv_freq rel {inv_err:.2g}, "
              f"attention_factor {af:.6g} (transformers {rot.attention_scaling:.6g}), softmax "
              f"scale {scale:.6g} (transformers {attn0.scaling:.6g})")
        spec, routes, mla_diff, sens = spec_forward(cfg, W, ids, args.wrong_spec)
        err = rel_l2(ref, spec)
        check(err <= SPEC_LIMIT, f"{name}: transformers fp32 vs float64 spec re-derivation: "
              f"rel L2 {err:.3g} (limit {SPEC_LIMIT:.0e})")
        check(mla_diff <= MLA_FORMS_LIMIT,
              f"{name}: MLA absorbed (latent cache) vs expanded, float64: max rel L2 "
              f"{mla_diff:.3g} over layers (limit {MLA_FORMS_LIMIT:.0e})")
        same_ids, w_err = True, 0.0
        for li, rl in routes.items():
            t_ids, t_w = ref_routes.get(li, (None, None))
            if t_ids is None:
                same_ids = False
                continue
            for t, (sel, wsel) in enumerate(rl):
                order = np.argsort(t_ids[t])
                same_ids &= sorted(sel) == sorted(int(i) for i in t_ids[t])
                mine = np.asarray(wsel)[np.argsort(sel)]
                w_err = max(w_err, float(np.abs(mine - t_w[t][order]).max()))
        check(same_ids and len(routes) == len(ref_routes) and w_err <= 1e-5,
              f"{name}: routing of {len(routes)} MoE layers x {T} tokens: expert sets "
              f"{'identical' if same_ids else 'DIFFER'}, max weight error {w_err:.2g} (limit 1e-5)")
        nb = sum(v[0] for v in sens.values())
        ng = sum(v[1] for v in sens.values())
        grouped = cfg["n_group"] > 1 and cfg["topk_group"] < cfg["n_group"]
        lstd = float(ref.std())
        spread = len(set(ref.argmax(-1).tolist()))
        check(lstd > 0.3 and spread > 1 and nb > 0 and (ng > 0 or not grouped),
              f"{name}: reference is not trivial: logit std {lstd:.3g}, {spread} distinct "
              f"argmax over {T} rows; without the bias {nb}, without the group limit {ng} "
              f"of {len(sens) * T} token choices change"
              f"{'' if grouped else ' (n_group 1: no limit)'}; greedy {gens}, smallest "
              f"top-2 margin {margin:.3g}")
        if args.only_reference:
            continue

        # 2. ours: the prefill
        out = os.path.join(cdir, "ours_logits.f32")
        logf = os.path.join(cdir, "command.txt")
        try:
            r = run_client(args, "logits", ckpt,
                           ["--ids", ",".join(map(str, ids)), "--out", out], logf)
        except (OSError, subprocess.TimeoutExpired) as ex:
            check(False, f"{name}: cannot run {args.client}: {ex}")
            continue
        if r.returncode != 0:
            check(False, f"{name}: {refusal(args, 'logits', r)}")
        else:
            got = np.fromfile(out, dtype="<f4") if os.path.exists(out) else np.zeros(0, "<f4")
            if got.size != T * V:
                check(False, f"{name}: {out} holds {got.size} floats, expected T*vocab = {T}*{V}")
            elif not np.isfinite(got).all():
                check(False, f"{name}: ours has non-finite logits")
            else:
                got = got.reshape(T, V)
                err = rel_l2(got, ref)
                bad_rows = [int(i) for i in np.nonzero(ref.argmax(-1) != got.argmax(-1))[0]]
                worst = max(range(T), key=lambda t: rel_l2(got[t], ref[t]))
                ok = check(err <= REL_L2_LIMIT and not bad_rows,
                           f"{name}: moerpc-client logits vs transformers fp32: rel L2 {err:.3g} "
                           f"(limit {REL_L2_LIMIT:.0e}), argmax differs in rows "
                           f"{bad_rows or 'none'}; worst row {worst}: "
                           f"{rel_l2(got[worst], ref[worst]):.3g}")
                if not ok:
                    print(f"     rel L2 per row: "
                          f"{' '.join(f'{rel_l2(got[t], ref[t]):.2g}' for t in range(T))}")

        # 2b. an FP8 checkpoint: the runner keeps the dense weights as fp8-b128 by default
        #     (the codes and block scales), which the reference kernels decode exactly, so
        #     the default logits (above) and --dense-format f32's (the exact dequantization)
        #     must match as closely as the float checkpoints' do; --dense-format bf16 keeps
        #     the dequantized weights rounded to bf16 (what the cuda backend holds): 1e-3
        with open(os.path.join(ckpt, "config.json")) as f:
            is_fp8 = "quantization_config" in json.load(f)
        if is_fp8:
            for fmt, limit, what in (("", FP8_EXACT_LIMIT, "default: fp8-b128 as stored"),
                                     ("f32", FP8_EXACT_LIMIT, "--dense-format f32: exact dequantization"),
                                     ("bf16", REL_L2_LIMIT, "--dense-format bf16: dequantized to bf16")):
                outf = os.path.join(cdir, f"ours_logits_dense_{fmt or 'default'}.f32")
                extra = ["--dense-format", fmt] if fmt else []
                r = run_client(args, "logits", ckpt, ["--ids", ",".join(map(str, ids)), "--out", outf]
                               + extra, logf)
                if r.returncode != 0:
                    check(False, f"{name}: {refusal(args, 'logits', r)}")
                    continue
                got = np.fromfile(outf, dtype="<f4")
                err = rel_l2(got.reshape(T, V), ref) if got.size == T * V else float("inf")
                check(err <= limit, f"{name}: moerpc-client logits ({what}) vs transformers fp32: "
                      f"rel L2 {err:.3g} (limit {limit:.0e})")

        # 3. ours: both prompts prefilled in one step, then single-token decode steps of
        #    the two sequences together (each its own latent KV cache, different lengths)
        try:
            r = run_client(args, "generate", ckpt,
                           ["--prompt-ids", ";".join(",".join(map(str, pr)) for pr in prompts),
                            "--max-new", str(MAX_NEW), "--json", "--quiet"], logf)
        except (OSError, subprocess.TimeoutExpired) as ex:
            check(False, f"{name}: cannot run {args.client} generate: {ex}")
            continue
        if r.returncode != 0:
            check(False, f"{name}: {refusal(args, 'generate', r)}")
            continue
        ours = [None] * len(prompts)
        for line in r.stdout.splitlines():
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if isinstance(j, dict) and j.get("seq") in (0, 1) and "ids" in j:
                ours[j["seq"]] = [int(i) for i in j["ids"]]
        check(ours == gens, f"{name}: moerpc-client generate (2 sequences of {len(prompts[0])} "
              f"and {len(prompts[1])} tokens, prefill + {MAX_NEW - 1} decode steps, greedy) "
              f"{ours} vs transformers {gens} (smallest top-2 margin {margin:.3g})")

    if failed:
        print(f"conformance-deepseek: debug files (ids.txt, ref_logits.f32/.npy [T, vocab] f32, "
              f"ref_greedy.txt, ours_logits.f32, command.txt, ckpt/) kept in {tmp}")
    elif not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"conformance-deepseek: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
