#!/usr/bin/env python3
"""mk_mixtral.py OUT - a small random MixtralForCausalLM checkpoint (bf16 safetensors) made
by transformers itself, for tests/gpu/run.sh (moerpc-mkmodel writes Qwen3-MoE and
DeepSeek-V3 only). Hidden 256, 3 layers, 8 experts top-2, 8 heads / 2 kv heads, vocab 512.
Run on the build host (tests/gpu/run.sh bundle, with the conformance venv); the GPU run
carries the result."""
import sys

import torch
from transformers import MixtralConfig, MixtralForCausalLM

if len(sys.argv) != 2:
    sys.exit("usage: mk_mixtral.py OUT")
torch.manual_seed(5)
cfg = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, sliding_window=None, rms_norm_eps=1e-5,
                    max_position_embeddings=1024, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
m = MixtralForCausalLM(cfg)
with torch.no_grad():  # the default init's 0.02 std leaves every layer near the identity
    for p in m.parameters():
        if p.dim() == 2:
            p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
m.to(torch.bfloat16).save_pretrained(sys.argv[1], safe_serialization=True)
print(f"mk_mixtral: wrote {sys.argv[1]}")
