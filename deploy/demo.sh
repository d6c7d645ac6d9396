#!/usr/bin/env bash
# deploy/demo.sh (make demo) - the main job on a small built-in default:
#   1. installs dependencies and builds,
#   2. makes a small random Qwen3-MoE model (moerpc-mkmodel),
#   3. starts two expert servers on loopback, each owning half of the experts
#      (deploy/local-cluster.sh),
#   4. one chat turn, text in and text out: the model's chat template and tokenizer, hot
#      experts local, the cold ones on the two servers (the weights are random: the text is
#      nonsense, the path is real); then `moerpc-client serve` on the same cluster and one
#      streamed chat request with curl, printed as it arrives, and serve's drain on SIGTERM;
#      then generates with the whole-model runner: hot experts local (--local-experts), the cold
#      ones on the servers, their RPCs overlapped and deferred (--max-deferred); then the
#      same prompts all-local; one comparison line (tokens/s, greedy tokens, and the logits
#      difference that deferral causes by design),
#   5. runs `moerpc-client verify` (every MoE layer through the cluster vs a local kn_ref)
#      and `moerpc-client bench-rpc` (gRPC round trip vs raw TCP ping-pong),
#   6. stops the servers with SIGTERM (they drain and exit 0) and prints a summary.
# Environment: DEMO_DIR (default build/demo), MKMODEL_FLAGS (extra flags for the model),
# SERVER_FLAGS (extra flags for both servers), BENCH_ITERS (default 200), LOCAL_EXPERTS
# (hot experts per layer, default 4), MAX_DEFERRED (default 1), MAX_NEW (default 32).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
DEMO_DIR=${DEMO_DIR:-$BUILD/demo}
BIN=$BUILD/bin
BENCH_ITERS=${BENCH_ITERS:-200}
LOCAL_EXPERTS=${LOCAL_EXPERTS:-4}
MAX_DEFERRED=${MAX_DEFERRED:-1}
MAX_NEW=${MAX_NEW:-32}
PROMPTS="1,17,42,99,7,256,3;5,6,7,8;400,12,77,31,8,9"  # three sequences of different lengths

step() { printf '\n==> %s\n' "$*"; }

step "dependencies"
bash deploy/install-deps.sh --no-python
step "build"
make -j"$(nproc)" all >/dev/null
echo "built $(ls $BIN | tr '\n' ' ')"

rm -rf "$DEMO_DIR"; mkdir -p "$DEMO_DIR"
step "model"
"$BIN/moerpc-mkmodel" --out "$DEMO_DIR/model" --seed 1 ${MKMODEL_FLAGS:-}

. deploy/local-cluster.sh
step "servers: two on loopback, each owning half of the experts"
# shellcheck disable=SC2086 # SERVER_FLAGS is a list of flags
lc_start "$DEMO_DIR" "$DEMO_DIR/model" 2 ${SERVER_FLAGS:-}

step "moerpc-client info"
"$BIN/moerpc-client" info --cluster "$DEMO_DIR/cluster.json"

step "chat: one turn through the two servers (chat template + tokenizer of the model)"
echo "    the model's weights are random, so its answer is nonsense text; the tokens went through"
echo "    its chat template, its tokenizer, the hot experts here and the cold ones on s0 and s1"
printf '    user: %s\n    assistant: ' "What is a mixture of experts?"
"$BIN/moerpc-client" generate --model "$DEMO_DIR/model" --cluster "$DEMO_DIR/cluster.json" \
    --local-experts "$LOCAL_EXPERTS" --chat "What is a mixture of experts?" --max-new 24 \
    --quiet --log warn 2>"$DEMO_DIR/chat.log" || { cat "$DEMO_DIR/chat.log"; exit 1; }
sed 's/^/    /' "$DEMO_DIR/chat.log"

step "serve: the OpenAI-compatible server on the two servers, one streamed chat request with curl"
serve_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN/moerpc-client" serve --model "$DEMO_DIR/model" --cluster "$DEMO_DIR/cluster.json" \
    --local-experts "$LOCAL_EXPERTS" --listen "127.0.0.1:$serve_port" --quiet >"$DEMO_DIR/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$serve_port/health" >/dev/null && break
  kill -0 $serve_pid 2>/dev/null || { cat "$DEMO_DIR/serve.log"; exit 1; }
  sleep 0.1
done
echo "    curl -N http://127.0.0.1:$serve_port/v1/chat/completions -d '{\"messages\": [...], \"stream\": true}'"
printf '    user: %s\n    assistant: ' "Tell me about experts."
curl -sN "http://127.0.0.1:$serve_port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Tell me about experts."}], "max_tokens": 24,
         "stream": true, "stream_options": {"include_usage": true}}' |
  python3 -u -c '
import json, sys
for line in sys.stdin:
    if not line.startswith("data: {"): continue
    d = json.loads(line[6:])
    for c in d["choices"]: print(c["delta"].get("content") or "", end="", flush=True)
    if d.get("usage"): print("\n    (%(prompt_tokens)d prompt + %(completion_tokens)d completion tokens, streamed)" % d["usage"])'
kill -TERM $serve_pid
wait $serve_pid || { echo "serve did not exit 0 after SIGTERM:"; tail -n 5 "$DEMO_DIR/serve.log"; exit 1; }
grep -h -E 'listening|ready|stopped' "$DEMO_DIR/serve.log" | sed 's/^/    /'

step "generate: hot experts local (--local-experts $LOCAL_EXPERTS), cold on s0/s1, --max-deferred $MAX_DEFERRED"
"$BIN/moerpc-client" generate --model "$DEMO_DIR/model" --cluster "$DEMO_DIR/cluster.json" \
    --local-experts "$LOCAL_EXPERTS" --max-deferred "$MAX_DEFERRED" --prompt-ids "$PROMPTS" \
    --max-new "$MAX_NEW" --json >"$DEMO_DIR/gen-remote.jsonl" 2>"$DEMO_DIR/gen-remote.log" \
    || { cat "$DEMO_DIR/gen-remote.log"; exit 1; }
grep -h -E 'model open|cluster open' "$DEMO_DIR/gen-remote.log" | sed 's/^/    /'
cat "$DEMO_DIR/gen-remote.jsonl"

step "generate: the same prompts, every expert local (the baseline)"
"$BIN/moerpc-client" generate --model "$DEMO_DIR/model" --prompt-ids "$PROMPTS" \
    --max-new "$MAX_NEW" --json >"$DEMO_DIR/gen-local.jsonl" 2>"$DEMO_DIR/gen-local.log" \
    || { cat "$DEMO_DIR/gen-local.log"; exit 1; }
cat "$DEMO_DIR/gen-local.jsonl"

step "logits of the first prompt: remote with deferral vs all-local"
first=${PROMPTS%%;*}
"$BIN/moerpc-client" logits --model "$DEMO_DIR/model" --ids "$first" \
    --out "$DEMO_DIR/logits-local.bin" --quiet --log warn
"$BIN/moerpc-client" logits --model "$DEMO_DIR/model" --cluster "$DEMO_DIR/cluster.json" \
    --ids "$first" --local-experts "$LOCAL_EXPERTS" --max-deferred "$MAX_DEFERRED" \
    --out "$DEMO_DIR/logits-remote.bin" --compare "$DEMO_DIR/logits-local.bin" --quiet \
    --log warn | tee "$DEMO_DIR/logits-compare.txt"

step "moerpc-client verify (cluster vs local kn_ref, f32 and bf16 wire)"
"$BIN/moerpc-client" verify --cluster "$DEMO_DIR/cluster.json" --tokens 16 --dtype f32 | tee "$DEMO_DIR/verify-f32.txt"
"$BIN/moerpc-client" verify --cluster "$DEMO_DIR/cluster.json" --tokens 16 --dtype bf16 | tee "$DEMO_DIR/verify-bf16.txt"

step "moerpc-client bench-rpc (gRPC round trip vs raw TCP ping-pong, same bytes, same run)"
"$BIN/moerpc-client" bench-rpc --cluster "$DEMO_DIR/cluster.json" --iters "$BENCH_ITERS" --json \
    >"$DEMO_DIR/bench-rpc.jsonl" 2>"$DEMO_DIR/bench-rpc.log" || { cat "$DEMO_DIR/bench-rpc.log"; exit 1; }
cat "$DEMO_DIR/bench-rpc.log"

step "stop servers (SIGTERM: drain, exit 0)"
lc_stop

step "summary"
E=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_experts"])' "$DEMO_DIR/model/config.json")
echo "model:        $DEMO_DIR/model ($(du -sh "$DEMO_DIR/model" | cut -f1), $E experts)"
echo "verify:       $(tail -n 1 "$DEMO_DIR/verify-f32.txt")"
echo "              $(tail -n 1 "$DEMO_DIR/verify-bf16.txt")"
echo "bench-rpc:    $DEMO_DIR/bench-rpc.jsonl"
python3 - "$DEMO_DIR/bench-rpc.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"): continue
    r = json.loads(line)
    print("              T=%-4s grpc p50 %8.1f us   tcp p50 %7.1f us   ratio %.2f" % (
        r.get("tokens"), r.get("grpc_p50_us", 0), r.get("tcp_p50_us", 0), r.get("ratio_p50", 0)))
PY
python3 - "$DEMO_DIR/gen-remote.jsonl" "$DEMO_DIR/gen-local.jsonl" "$DEMO_DIR/logits-compare.txt" \
    "$MAX_DEFERRED" <<'PY'
import json, sys
def load(p):
    seqs, tim = {}, {}
    for line in open(p):
        r = json.loads(line)
        if "seq" in r: seqs[r["seq"]] = r["ids"]
        else: tim = r
    return seqs, tim
rs, rt = load(sys.argv[1]); ls, lt = load(sys.argv[2])
same = sum(a == b for s in rs for a, b in zip(rs[s], ls[s]))
total = sum(len(v) for v in rs.values())
print("generate:     remote (hot local, K=%s) decode %.1f tok/s vs all-local %.1f tok/s (ratio %.2f);"
      % (sys.argv[4], rt["decode_tok_s"], lt["decode_tok_s"], rt["decode_tok_s"] / max(lt["decode_tok_s"], 1e-9)))
print("              greedy tokens identical %d/%d; %s" % (same, total, open(sys.argv[3]).read().strip()))
PY
echo "logs:         $DEMO_DIR/s0.log $DEMO_DIR/s1.log"
echo "demo: ok"
