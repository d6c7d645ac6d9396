#!/usr/bin/env bash
# tests/bench/deepseek_bench.sh - DeepSeek-V3 end to end on its real layer shapes (fewer
# layers and experts): decode and prefill tokens/s all-local vs 2 expert servers (and K=2
# deferral), through tests/bench/model_bench.sh (rounds interleaved, medians, the ratio to
# all-local taken within each round).
#
#   tests/bench/deepseek_bench.sh            makes build/bench/deepseek-v3-3l-fp8 if missing
#   ROUNDS=3 THREADS=2 PROMPT=16 DECODE=8 CONFIGS="all-local 2-servers 2-servers-K2" ...
#
# The checkpoint (moerpc-mkmodel --arch deepseek-v3 --dtype fp8, like the released one:
# every decoder linear F8_E4M3 with 128x128 block scales): H 7168, MLA (128 heads,
# q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128), yarn factor 40,
# layer 0 dense (intermediate 18432), layers 1-2 MoE with a shared expert, I 2048, top-8 of
# EXPERTS routed experts (default 64: DeepSeek-V3 has 256; a decode step reads the same 8
# per token whatever the count, and 256 x 2 layers of fp8 (22.6 GB) does not fit twice in
# this host's 24 GB), n_group 8, topk_group 4, vocab 4096 (the head is not a layer shape).
# About 5.6 GB of fp8 experts and 1 GB of dense weights; the client keeps the dense ones in
# fp8-b128 (bf16 with CONFIGS all-local-dense-bf16; kv_b_proj in fp32 for the absorbed MLA),
# the servers the experts in fp8-b128.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
EXPERTS=${EXPERTS:-64}
MODEL=${MODEL:-$BUILD/bench/deepseek-v3-3l-fp8-e$EXPERTS}
if [ ! -f "$MODEL/config.json" ]; then
  echo "deepseek_bench: making $MODEL (DeepSeek-V3 layer shapes, 3 layers, $EXPERTS experts, fp8)"
  "$BUILD/bin/moerpc-mkmodel" --out "$MODEL" --arch deepseek-v3 --dtype fp8 --layers 3 \
      --dense-layers 1 --hidden 7168 --inter 2048 --dense-inter 18432 --experts "$EXPERTS" \
      --topk 8 --groups 8 --topk-groups 4 --shared-experts 1 --heads 128 --q-lora-rank 1536 \
      --kv-lora-rank 512 --qk-nope-dim 128 --qk-rope-dim 64 --v-head-dim 128 --yarn 40 \
      --vocab 4096 --seed 1
fi
export MODEL
export PROMPT=${PROMPT:-16} DECODE=${DECODE:-8}
export CONFIGS=${CONFIGS:-all-local 2-servers 2-servers-K2}
export OUT=${OUT:-$BUILD/bench/deepseek_bench.jsonl}
exec bash tests/bench/model_bench.sh
