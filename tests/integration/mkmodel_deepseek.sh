#!/usr/bin/env bash
# mkmodel_deepseek.sh - `moerpc-mkmodel --arch deepseek-v3` end to end, and the qwen3-moe
# output kept as it was:
#   - qwen3-moe (the default, and --arch qwen3-moe) writes byte for byte what mkmodel wrote
#     before --arch existed: sha256 of config.json and model.safetensors for the default
#     flags, a small fp8 model and a --router-skew model, recorded from the binary of
#     main at 7fdf320 (the commit this work started from);
#   - deepseek-v3, bf16 and fp8, served by a real moerpc-server: Hello says bf16 / fp8-b128,
#     `moerpc-client verify` (kn_ref on the stored weights) passes on its MoE layers, the
#     dense leading layer has no experts;
#   - the same flags twice give identical files;
#   - qwen3-moe and deepseek-v3 with --tie 1: no lm_head, tie_word_embeddings true;
#   - bad flags exit 2 naming the flags and the limit, and write nothing.
# The layout tensor by tensor is checked by test_safetensors (mkmodel_deepseek_*), the
# transformers load by tests/conformance/test_mkmodel_deepseek.py.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
tmp=$(mktemp -d /tmp/moerpc-mkds.XXXXXX)
srv_pid=
trap '[ -n "$srv_pid" ] && kill "$srv_pid" 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$tmp"; echo "mkmodel_deepseek: $passed passed, $failed failed, 0 skipped"' EXIT
ok() { echo "ok   mkmodel_deepseek.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL mkmodel_deepseek.$1: $2"; failed=$((failed + 1)); }
MK="$BIN/moerpc-mkmodel"

# ---- qwen3-moe unchanged --------------------------------------------------------------
golden() { # NAME SUM-CONFIG SUM-WEIGHTS FLAGS...
  local name=$1 sc=$2 sw=$3; shift 3
  if ! "$MK" --out "$tmp/$name" "$@" >"$tmp/$name.log" 2>&1; then
    bad "$name" "mkmodel failed: $(tail -1 "$tmp/$name.log")"; return
  fi
  local gc gw
  gc=$(sha256sum <"$tmp/$name/config.json" | cut -c1-64)
  gw=$(sha256sum <"$tmp/$name/model.safetensors" | cut -c1-64)
  if [ "$gc" = "$sc" ] && [ "$gw" = "$sw" ]; then ok "$name"
  else bad "$name" "sha256 config $gc weights $gw, expected $sc $sw"; fi
}
golden qwen_default_unchanged \
  e05ca0e0226bb603e1889768542ba2c23eef613befe21e95b017d5e9b93a8809 \
  383d915e581299145f1679b35cc2c1c4eb3ee320fe41031def444b7b5c923c22
golden qwen_arch_flag_unchanged \
  e05ca0e0226bb603e1889768542ba2c23eef613befe21e95b017d5e9b93a8809 \
  383d915e581299145f1679b35cc2c1c4eb3ee320fe41031def444b7b5c923c22 --arch qwen3-moe
golden qwen_fp8_unchanged \
  f49833c5b3b93c91865349364155a50de5c5a89baf2769811c0fa28714c2354e \
  491af9598fd415cd3edccf67367ab83c0fcac91fbc75a14b7a6efa9543938c34 --dtype fp8 --hidden 200 --inter 136
golden qwen_skew_unchanged \
  1f50293ab0459eec78b2559bb954fd9e8c2d419282b7e935b66c6bdd9822f1be \
  98ce9cf3ae160cba6361c5668003558da875a60a089ad7a298e37c6369eb6b02 --router-skew 1.5
golden qwen_small_unchanged \
  93dc951b25742820991fd0981e60461dba6844c2c24d6c45de0c8674b9feb3e3 \
  315e38bbb13bd582986f38422bd8d334ebe71813711a185ff0867d6ec008d1db \
  --layers 2 --experts 4 --topk 2 --hidden 64 --inter 32 --vocab 64 --heads 2 --kv-heads 1 \
  --head-dim 16 --seed 9

# ---- deepseek-v3 through a real server ------------------------------------------------
ds() { "$MK" --out "$tmp/$1" --arch deepseek-v3 --seed 3 --layers 3 --experts 8 --topk 2 \
         --vocab 64 --groups 2 --topk-groups 1 "${@:2}" >"$tmp/$1.log" 2>&1; }
ds dsb --hidden 128 --inter 64 && ds ds8 --hidden 200 --inter 136 --dtype fp8 &&
  ds dsb2 --hidden 128 --inter 64 ||
  { bad setup "moerpc-mkmodel --arch deepseek-v3 failed: $(tail -1 "$tmp"/ds*.log)"; exit 1; }

port=$((20000 + RANDOM % 20000))
echo "{\"servers\": [{\"name\": \"s0\", \"address\": \"127.0.0.1:$port\"}]}" >"$tmp/cluster.json"
serve() { # NAME MODEL
  "$BIN/moerpc-server" --model "$2" --experts all --listen "127.0.0.1:$port" --threads 1 \
      >"$tmp/srv-$1.log" 2>&1 &
  srv_pid=$!
  for _ in $(seq 1 100); do
    grep -qs "serving:" "$tmp/srv-$1.log" && return 0
    kill -0 "$srv_pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
stop() { [ -n "$srv_pid" ] && kill "$srv_pid" 2>/dev/null && wait "$srv_pid" 2>/dev/null; srv_pid=; }
served() { # NAME MODEL FORMAT
  local name=$1 model=$2 want=$3
  if ! serve "$name" "$model"; then bad "$name" "server did not start: $(tail -2 "$tmp/srv-$name.log")"; stop; return; fi
  local info; info=$("$BIN/moerpc-client" info --cluster "$tmp/cluster.json" 2>&1)
  if ! grep -q "$want" <<<"$info"; then bad "$name" "Hello does not say $want: $info"; stop; return; fi
  if ! grep -qE "layer +0 +nobody" <<<"$info"; then bad "$name" "layer 0 is not dense: $info"; stop; return; fi
  if "$BIN/moerpc-client" verify --cluster "$tmp/cluster.json" --model "$model" >"$tmp/verify-$name.txt" 2>&1 &&
     grep -q "^verify: 2 MoE layers, 0 failed" "$tmp/verify-$name.txt"; then
    ok "$name ($(grep '^verify:' "$tmp/verify-$name.txt" | sed 's/.*worst/worst/'))"
  else
    bad "$name" "verify failed: $(tail -3 "$tmp/verify-$name.txt")"
  fi
  stop
}
served deepseek_bf16_served "$tmp/dsb" bf16
served deepseek_fp8_served "$tmp/ds8" fp8-b128

if cmp -s "$tmp/dsb/model.safetensors" "$tmp/dsb2/model.safetensors" &&
   cmp -s "$tmp/dsb/config.json" "$tmp/dsb2/config.json"; then ok deepseek_deterministic
else bad deepseek_deterministic "two runs with the same flags differ"; fi

# ---- --tie 1 ----------------------------------------------------------------------------
tied() { # NAME FLAGS...
  local name=$1; shift
  if ! "$MK" --out "$tmp/$name" --layers 2 --experts 4 --topk 2 --hidden 64 --inter 32 --vocab 64 \
       --tie 1 "$@" >"$tmp/$name.log" 2>&1; then bad "$name" "mkmodel failed: $(tail -1 "$tmp/$name.log")"; return; fi
  local why
  why=$(python3 - "$tmp/$name" <<'PY'
import json, struct, sys
d = sys.argv[1]
raw = open(d + "/model.safetensors", "rb").read()
h = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
cfg = json.load(open(d + "/config.json"))
if "lm_head.weight" in h: print("lm_head.weight present")
elif cfg.get("tie_word_embeddings") is not True: print("tie_word_embeddings =", cfg.get("tie_word_embeddings"))
elif "model.embed_tokens.weight" not in h: print("no embedding")
PY
)
  [ -z "$why" ] && ok "$name" || bad "$name" "$why"
}
tied qwen_tied
tied deepseek_tied --arch deepseek-v3

# ---- refusals ---------------------------------------------------------------------------
refused() { # NAME "FLAGS" FRAGMENT
  local out rc
  out=$("$MK" --out "$tmp/refused-$1" $2 2>&1); rc=$?
  if [ "$rc" -eq 2 ] && grep -qF -- "$3" <<<"$out" && [ ! -e "$tmp/refused-$1" ]; then ok "refuses_$1"
  else bad "refuses_$1" "rc $rc, output: $out"; fi
}
refused head_dim "--arch deepseek-v3 --head-dim 32" "--head-dim does not apply to --arch deepseek-v3"
refused groups "--arch deepseek-v3 --groups 5" "--groups = 5, must divide --experts (16)"
refused topk_groups "--arch deepseek-v3 --groups 4 --topk-groups 1 --topk 5" \
  "--topk = 5, more than the 4 experts of the --topk-groups (1) kept groups"
refused rope_odd "--arch deepseek-v3 --qk-rope-dim 5" "--qk-rope-dim = 5, must be even"
refused ds_flag_on_qwen "--shared-experts 2" "--shared-experts applies to --arch deepseek-v3 only"
[ "$failed" -eq 0 ]
