#!/usr/bin/env bash
# tests/bench/text_bench.sh - time to first token of a chat prompt of about PROMPT_TOKENS
# tokens, split into the chat template's render, the tokenizer's encode and the prefill
# (moerpc-client generate --chat --json: template_s, encode_s, first_token_s), all-local on
# Qwen3-30B-A3B's layer shapes (the model of model_bench.sh), ROUNDS runs, medians.
#
#   tests/bench/text_bench.sh                       PROMPT_TOKENS=2048 ROUNDS=3 THREADS=2
#
# JSON lines to $OUT (default build/bench/text_bench.jsonl), one per run plus a summary.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
MODEL=${MODEL:-$BUILD/bench/qwen3-30b-a3b-4l}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-2}
PROMPT_TOKENS=${PROMPT_TOKENS:-2048}
OUT=${OUT:-$BUILD/bench/text_bench.jsonl}
mkdir -p "$(dirname "$OUT")"
: >"$OUT"
if [ ! -f "$MODEL/config.json" ]; then
  echo "text_bench: making $MODEL (Qwen3-30B-A3B layer shapes, 4 layers, vocab 32000)"
  "$BIN/moerpc-mkmodel" --out "$MODEL" --layers 4 --hidden 2048 --inter 768 --experts 128 \
      --topk 8 --heads 32 --kv-heads 4 --head-dim 128 --vocab 32000 --seed 1
fi
# A message of common words (one token each with the model's tokenizer), sized so that the
# rendered prompt has PROMPT_TOKENS tokens.
words="the of and to in is that for it as was with be by on not he this are or"
msg=$(for i in $(seq 1 $((PROMPT_TOKENS / 20 + 1))); do printf '%s ' $words; done)
n=$("$BIN/moerpc-client" tokenize --model "$MODEL" --text "$msg" | wc -w)
msg=$(echo "$msg" | cut -d' ' -f1-$((PROMPT_TOKENS - 12)))
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
for r in $(seq 1 "$ROUNDS"); do
  "$BIN/moerpc-client" generate --model "$MODEL" --chat "$msg" --max-new 1 --max-seq $((PROMPT_TOKENS + 64)) \
      --threads "$THREADS" --json --quiet --log warn | tail -1 |
    sed "s/^{/{\"bench\": \"text-ttft\", \"round\": $r, \"cpu\": \"$cpu\", /" >>"$OUT"
done
python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"text-ttft"' in l]
med = lambda k: statistics.median(r[k] for r in rows)
s = {"bench": "text-ttft-median", "cpu": rows[0]["cpu"], "rounds": len(rows), "prompt_tokens": rows[0]["prompt_tokens"],
     "template_s": med("template_s"), "encode_s": med("encode_s"), "prefill_s": med("first_token_s")}
s["ttft_s"] = s["template_s"] + s["encode_s"] + s["prefill_s"]
print(json.dumps(s))
open(sys.argv[1], "a").write(json.dumps(s) + "\n")
EOF
