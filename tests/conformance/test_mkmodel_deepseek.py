#!/usr/bin/env python3
"""`moerpc-mkmodel --arch deepseek-v3` against transformers' DeepseekV3ForCausalLM.

  test_mkmodel_deepseek.py --build build [--keep DIR]

Checks, for the default shape, for q_lora_rank null (q_proj) + tied head + yarn factor 4 +
4 groups / 2 kept + 2 shared experts + 2 dense layers, and for integer-valued float flags
(routed scale 1, which transformers' strict config refuses when written as an int) + yarn
2.5 + norm_topk_prob false + no shared experts (zero-wide tensors) + no dense layer:
  * from_pretrained(dtype=float32, output_loading_info=True) reports no missing,
    unexpected or mismatched keys and no error;
  * the parsed config says what the flags say (q_lora_rank, n_group, topk_group,
    first_k_dense_replace, n_shared_experts, routed_scaling_factor, rope type, yarn factor
    and original_max_position_embeddings, tie), the attention softmax scale is
    (nope + rope)^-0.5, times mscale^2 with yarn;
  * the loaded parameters equal the file's values (bf16 weights widened, the F32
    e_score_correction_bias exactly), the tied lm_head is the embedding;
  * a forward pass over 24 tokens gives finite logits; the routers' choices (captured
    from DeepseekV3TopkRouter) differ from plain top-k of the sigmoid scores for some
    tokens (the correction bias matters), and with groups every token's experts lie in at
    most topk_group groups.
For --dtype fp8: AutoConfig parses the config and its quantization_config (fp8, e4m3,
dynamic, [128, 128]); every Linear weight of the decoder layers is float8_e4m3fn with a
float32 "<name>_scale_inv" of shape [ceil(N/128), ceil(K/128)], and the router, the
correction bias, norms, embeddings and lm_head are not quantized; the dequantized weights
are within an e4m3 step of the bf16 checkpoint of the same seed.

Without torch or transformers the whole script is one SKIP. Prints one line per check and
"mkmodel_deepseek: N passed, N failed, N skipped"; exits 1 on any failure.
"""
import argparse
import atexit
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

passed = failed = 0


def check(label, ok, detail=""):
    global passed, failed
    print(f"{'ok  ' if ok else 'FAIL'} mkmodel_deepseek.{label}{': ' + detail if detail else ''}",
          flush=True)
    if ok:
        passed += 1
    else:
        failed += 1
    return ok


def mkmodel(build, out, *flags):
    cmd = [os.path.join(build, "bin", "moerpc-mkmodel"), "--out", out, "--arch", "deepseek-v3",
           *flags]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr[-400:]}")


def is_decoder_linear(name):
    """A weight of an nn.Linear inside the decoder layers (not the router)."""
    return (name.startswith("model.layers.") and name.endswith("_proj.weight")
            or name.endswith("kv_a_proj_with_mqa.weight"))


def check_bf16(torch, tr, label, d, want):
    """Loads d with transformers and checks it against want (a dict of expected config
    values and shape facts)."""
    from safetensors.torch import load_file
    m, info = tr.DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                       output_loading_info=True)
    bad = {k: sorted(v)[:4] for k, v in info.items() if v}
    check(f"{label}.load_no_missing_keys", not bad, str(bad) if bad else "")
    c = m.config
    got = {k: getattr(c, k) for k in want["config"]}
    check(f"{label}.config", got == want["config"], f"{got} != {want['config']}" if got != want["config"] else "")
    rp = c.rope_parameters
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    scale = qk ** -0.5
    if want["yarn"]:
        ok = (rp.get("rope_type") == "yarn" and rp.get("factor") == want["yarn"]
              and rp.get("original_max_position_embeddings") == int(4096 / want["yarn"] + 0.5)
              and rp.get("mscale_all_dim") == 1.0 and rp.get("beta_fast") == 32
              and rp.get("beta_slow") == 1)
        check(f"{label}.yarn_parameters", ok, str(rp))
        ms = 0.1 * math.log(want["yarn"]) + 1.0
        scale *= ms * ms
    else:
        check(f"{label}.default_rope", rp.get("rope_type") == "default", str(rp))
    att = m.model.layers[0].self_attn
    check(f"{label}.softmax_scale", abs(att.scaling - scale) < 1e-12, f"{att.scaling} vs {scale}")
    # The loaded parameters are the file's values.
    sd = m.state_dict()
    f = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            f.update(load_file(os.path.join(d, fn)))
    worst = ""
    for k, v in f.items():
        # Per-expert keys load fused (conversion mapping deepseek_v3 -> qwen2_moe):
        # experts.gate_up_proj[e] = cat(gate, up), experts.down_proj[e].
        pre, sep, rest = k.partition(".mlp.experts.")
        if sep:
            e, proj, _ = rest.split(".")
            e = int(e)
            I = c.moe_intermediate_size
            if proj == "down_proj":
                have = sd[f"{pre}.mlp.experts.down_proj"][e]
            else:
                have = sd[f"{pre}.mlp.experts.gate_up_proj"][e][:I] if proj == "gate_proj" else \
                    sd[f"{pre}.mlp.experts.gate_up_proj"][e][I:]
        else:
            have = sd.get(k)
        if have is None or not torch.equal(have, v.float()):
            worst = k
            break
    check(f"{label}.parameters_equal_file", not worst, worst)
    if c.tie_word_embeddings:
        check(f"{label}.tied_head", "lm_head.weight" not in f and
              torch.equal(m.lm_head.weight, m.model.embed_tokens.weight))
    bias = [k for k in f if k.endswith("e_score_correction_bias")]
    check(f"{label}.bias_f32", bool(bias) and all(f[k].dtype == torch.float32 and
                                                  0 < f[k].abs().max() <= 0.05 for k in bias))
    # Forward, capturing every router's input and choice.
    seen = []

    def hook(mod, inp, out):
        seen.append((mod, inp[0].detach().reshape(-1, mod.hidden_dim), out[2].detach()))
    hs = [lyr.mlp.gate.register_forward_hook(hook) for lyr in m.model.layers
          if hasattr(lyr.mlp, "gate") and isinstance(lyr.mlp.gate, torch.nn.Module)
          and hasattr(lyr.mlp.gate, "e_score_correction_bias")]
    ids = (torch.arange(24) * 37 + 5)[None] % c.vocab_size
    with torch.no_grad():
        lg = m(ids).logits
    for h in hs:
        h.remove()
    check(f"{label}.forward_finite", bool(torch.isfinite(lg).all()) and lg.shape[-1] == c.vocab_size,
          f"max |logit| {lg.abs().max().item():.3g}")
    check(f"{label}.moe_layers", len(seen) == c.num_hidden_layers - c.first_k_dense_replace,
          f"{len(seen)} routers")
    differ = total = 0
    groups_ok = True
    for g, x, idx in seen:
        plain = torch.topk(torch.sigmoid(x.float() @ g.weight.float().T), g.top_k, dim=-1)[1]
        a = torch.sort(idx, dim=-1)[0]
        b = torch.sort(plain, dim=-1)[0]
        differ += int((a != b).any(dim=-1).sum())
        total += a.shape[0]
        per = g.num_experts // g.num_group
        ng = torch.tensor([len(set((r // per).tolist())) for r in idx])
        groups_ok &= bool((ng <= g.topk_group).all())
    check(f"{label}.bias_changes_selection", 0 < differ, f"{differ}/{total} token-layers differ "
          "from plain top-k")
    check(f"{label}.group_limited", groups_ok)
    return lg


def check_fp8(torch, tr, d, bf16_dir):
    from safetensors import safe_open
    cfg = tr.AutoConfig.from_pretrained(d)
    q = cfg.quantization_config
    q = q if isinstance(q, dict) else q.to_dict()
    ok = (cfg.model_type == "deepseek_v3" and q.get("quant_method") == "fp8"
          and q.get("fmt") == "e4m3" and q.get("activation_scheme") == "dynamic"
          and list(q.get("weight_block_size")) == [128, 128])
    check("fp8.autoconfig", ok, json.dumps(q))
    lin = notq = 0
    bad = []
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(bf16_dir, "model.safetensors"), "pt") as fb:
        keys = set(f.keys())
        for k in sorted(keys):
            if k.endswith("_scale_inv"):
                if k[:-len("_scale_inv")] not in keys:
                    bad.append(f"{k}: no weight")
                continue
            t = f.get_tensor(k)
            if is_decoder_linear(k):
                lin += 1
                s = f.get_tensor(k + "_scale_inv") if k + "_scale_inv" in keys else None
                n, kk = t.shape
                if t.dtype != torch.float8_e4m3fn or s is None or s.dtype != torch.float32 or \
                        tuple(s.shape) != ((n + 127) // 128, (kk + 127) // 128):
                    bad.append(f"{k}: {t.dtype} scale {None if s is None else (s.dtype, tuple(s.shape))}")
                    continue
                w = fb.get_tensor(k).float()
                big = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :kk]
                dq = t.float() * big
                if not bool(((dq - w).abs() <= torch.maximum(w.abs() / 16, big * 1e-3) * 1.001).all()):
                    bad.append(f"{k}: dequantized values off")
            else:
                notq += 1
                want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
                if t.dtype != want:
                    bad.append(f"{k}: {t.dtype}, expected {want}")
    check("fp8.tensors", not bad and lin > 0, f"{lin} fp8 Linears, {notq} others" +
          (f"; {bad[:3]}" if bad else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--keep", help="write the models here and keep them")
    args = ap.parse_args()
    try:
        import torch
        import transformers as tr
    except ImportError as ex:
        print(f"skip mkmodel_deepseek.all: {ex}")
        print("mkmodel_deepseek: 0 passed, 0 failed, 1 skipped")
        return 0
    torch.manual_seed(0)
    tmp = args.keep or tempfile.mkdtemp(prefix="moerpc-mkds-")
    if not args.keep:
        atexit.register(shutil.rmtree, tmp, True)
    common = ["--seed", "11"]
    try:
        mkmodel(args.build, f"{tmp}/def", *common)
        mkmodel(args.build, f"{tmp}/b", *common, "--q-lora-rank", "0", "--tie", "1", "--yarn",
                "4", "--groups", "4", "--topk-groups", "2", "--shared-experts", "2",
                "--dense-layers", "2")
        mkmodel(args.build, f"{tmp}/c", *common, "--routed-scale", "1", "--yarn", "2.5",
                "--norm-topk", "0", "--groups", "2", "--topk-groups", "1", "--layers", "2",
                "--dense-layers", "0", "--shared-experts", "0")
        mkmodel(args.build, f"{tmp}/fp8", *common, "--dtype", "fp8", "--hidden", "200",
                "--inter", "136", "--q-lora-rank", "130")
        mkmodel(args.build, f"{tmp}/fp8-bf16", *common, "--hidden", "200", "--inter", "136",
                "--q-lora-rank", "130")
    except RuntimeError as ex:
        check("mkmodel", False, str(ex))
        print(f"mkmodel_deepseek: {passed} passed, {failed} failed, 0 skipped")
        return 1
    base = {"num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
            "hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_interleave": True,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    check_bf16(torch, tr, "default", f"{tmp}/def", {
        "config": {**base, "q_lora_rank": 48, "n_group": 1, "topk_group": 1,
                   "n_shared_experts": 1, "first_k_dense_replace": 1,
                   "tie_word_embeddings": False}, "yarn": 0})
    check_bf16(torch, tr, "qproj_tie_yarn_groups", f"{tmp}/b", {
        "config": {**base, "q_lora_rank": None, "n_group": 4, "topk_group": 2,
                   "n_shared_experts": 2, "first_k_dense_replace": 2,
                   "tie_word_embeddings": True}, "yarn": 4})
    check_bf16(torch, tr, "int_floats_no_norm_no_shared", f"{tmp}/c", {
        "config": {**base, "num_hidden_layers": 2, "q_lora_rank": 48, "n_group": 2,
                   "topk_group": 1, "n_shared_experts": 0, "first_k_dense_replace": 0,
                   "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                   "tie_word_embeddings": False}, "yarn": 2.5})
    check_fp8(torch, tr, f"{tmp}/fp8", f"{tmp}/fp8-bf16")
    print(f"mkmodel_deepseek: {passed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
