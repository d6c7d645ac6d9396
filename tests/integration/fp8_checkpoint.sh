#!/usr/bin/env bash
# fp8_checkpoint.sh - FP8 block-scaled checkpoints (issue #9 item 3) through real servers:
#   - `moerpc-mkmodel --dtype fp8` writes F8_E4M3 experts + F32 weight_scale_inv and a
#     quantization_config; a server keeps them as fp8-b128 (Hello says so) and
#     `moerpc-client verify` (kn_ref on the same stored weights) passes;
#   - the same checkpoint re-quantized at load (--quant bf16 / int8 / int4) passes verify in
#     that format; a bf16 checkpoint with --quant fp8 is quantized at load and passes;
#   - local experts on the client (cluster "local") from the fp8 checkpoint;
#   - bad checkpoints are refused at start with the tensor and the limit named: a missing
#     scale, a scale of the wrong shape, zero / negative / NaN scales, weight_block_size
#     other than [128, 128], another quant_method, F8_E4M3 weights without
#     quantization_config.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
passed=0; failed=0
tmp=$(mktemp -d /tmp/moerpc-fp8.XXXXXX)
srv_pid=
trap '[ -n "$srv_pid" ] && kill "$srv_pid" 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$tmp"; echo "fp8_checkpoint: $passed passed, $failed failed, 0 skipped"' EXIT
ok() { echo "ok   fp8_checkpoint.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL fp8_checkpoint.$1: $2"; failed=$((failed + 1)); }

mk() { "$BIN/moerpc-mkmodel" --out "$tmp/$1" --seed 3 --layers 2 --experts 6 --topk 2 \
         --hidden 200 --inter 136 --vocab 64 "${@:2}" >"$tmp/$1.log" 2>&1; }
mk fp8 --dtype fp8 && mk bf16 || { bad setup "moerpc-mkmodel failed: $(tail -1 "$tmp/fp8.log")"; exit 1; }

port=$((20000 + RANDOM % 20000))
# serve NAME MODEL [server flags]: starts a server, waits until it is ready (or exited).
serve() {
  local name=$1 model=$2; shift 2
  "$BIN/moerpc-server" --model "$model" --experts all --listen "127.0.0.1:$port" --threads 1 "$@" \
      >"$tmp/srv-$name.log" 2>&1 &
  srv_pid=$!
  for _ in $(seq 1 100); do
    grep -qs "serving:" "$tmp/srv-$name.log" && return 0
    kill -0 "$srv_pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
stop() { [ -n "$srv_pid" ] && kill "$srv_pid" 2>/dev/null && wait "$srv_pid" 2>/dev/null; srv_pid=; }
echo "{\"servers\": [{\"name\": \"s0\", \"address\": \"127.0.0.1:$port\"}]}" >"$tmp/cluster.json"
echo "{\"servers\": [{\"name\": \"s0\", \"address\": \"127.0.0.1:$port\"}], \"model\": \"$tmp/fp8\",
  \"local\": {\"layers\": \"all\", \"experts\": \"0-1\"}}" >"$tmp/cluster-local.json"

# verify NAME MODEL FORMAT [flags]: a server, Hello's format, verify through it.
verify() {
  local name=$1 model=$2 want=$3; shift 3
  if ! serve "$name" "$model" "$@"; then
    bad "$name" "server did not start: $(tail -2 "$tmp/srv-$name.log")"; stop; return
  fi
  local info; info=$("$BIN/moerpc-client" info --cluster "$tmp/cluster.json" 2>&1)
  if ! grep -q "$want" <<<"$info"; then bad "$name" "Hello does not say $want: $info"; stop; return; fi
  if "$BIN/moerpc-client" verify --cluster "$tmp/cluster.json" --model "$model" \
       >"$tmp/verify-$name.txt" 2>&1; then
    ok "$name ($(grep '^verify:' "$tmp/verify-$name.txt" | sed 's/.*worst/worst/'))"
  else
    bad "$name" "verify failed: $(tail -3 "$tmp/verify-$name.txt")"
  fi
  stop
}
verify fp8_as_stored "$tmp/fp8" fp8-b128
verify fp8_requantized_bf16 "$tmp/fp8" bf16 --quant bf16
verify fp8_requantized_int8 "$tmp/fp8" int8 --quant int8
verify fp8_requantized_int4 "$tmp/fp8" int4-g64 --quant int4
verify bf16_quantized_to_fp8 "$tmp/bf16" fp8-b128 --quant fp8

# Local experts 0-1 on the client from the fp8 checkpoint, the rest on the server.
if serve local "$tmp/fp8"; then
  if "$BIN/moerpc-client" verify --cluster "$tmp/cluster-local.json" >"$tmp/verify-local.txt" 2>&1 &&
     grep -q "local experts: .* as fp8-b128 loaded" "$tmp/verify-local.txt"; then
    ok "local_experts_fp8 ($(grep '^verify:' "$tmp/verify-local.txt" | sed 's/.*worst/worst/'))"
  else bad local_experts_fp8 "$(grep -E 'local|verify' "$tmp/verify-local.txt" | tail -3)"; fi
else bad local_experts_fp8 "server did not start"; fi
stop

# Bad checkpoints: a copy of the fp8 model edited by python (stdlib only), then the server
# must exit non-zero with a message holding every expected fragment.
edit() { # NAME PYTHON-SNIPPET: h = header dict, data = bytearray of the data region, cfg = config dict
  rm -rf "$tmp/$1"; cp -r "$tmp/fp8" "$tmp/$1"
  python3 - "$tmp/$1" "$2" <<'PY'
import json, struct, sys
d, code = sys.argv[1], sys.argv[2]
p = d + "/model.safetensors"
raw = open(p, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n]); data = bytearray(raw[8 + n:])
cfg = json.load(open(d + "/config.json"))
def put_f32(name, values):
    b, e = h[name]["data_offsets"]
    data[b:e] = struct.pack("<%df" % len(values), *values)
exec(code)
hb = json.dumps(h).encode(); hb += b" " * (-len(hb) % 8)
open(p, "wb").write(struct.pack("<Q", len(hb)) + hb + bytes(data))
json.dump(cfg, open(d + "/config.json", "w"))
PY
}
refused() { # NAME FRAGMENT...: the server must fail to start, naming every fragment
  local name=$1; shift
  if serve "$name" "$tmp/$name"; then bad "$name" "server started on a bad checkpoint"; stop; return; fi
  wait "$srv_pid" 2>/dev/null; local rc=$?; srv_pid=
  local log; log=$(cat "$tmp/srv-$name.log")
  for f in "$@"; do
    if ! grep -qF -- "$f" <<<"$log"; then bad "$name" "rc $rc, message lacks \"$f\": $(grep -m1 -E 'ERROR|error' <<<"$log")"; return; fi
  done
  [ "$rc" -ne 0 ] && ok "$name (rc $rc)" || bad "$name" "exit status 0"
}
S=model.layers.1.mlp.experts.4.up_proj.weight_scale_inv
edit scale_missing "h['${S/inv/inx}'] = h.pop('$S')"
refused scale_missing "$S" "not found"
edit scale_shape "h['$S']['shape'] = [1, 4]"
refused scale_shape "$S" "shape = [1, 4], expected [2, 2]" "128x128"
edit scale_zero "put_f32('$S', [1e-3, 0.0, 1e-3, 1e-3])"
refused scale_zero "$S" "scale_inv[0, 1] = 0" "finite and > 0"
edit scale_negative "put_f32('$S', [1e-3, 1e-3, -1e-3, 1e-3])"
refused scale_negative "$S" "scale_inv[1, 0] = -0.001" "finite and > 0"
edit scale_nan "put_f32('$S', [float('nan'), 1e-3, 1e-3, 1e-3])"
refused scale_nan "$S" "scale_inv[0, 0] = nan" "finite and > 0"
edit block_64 "cfg['quantization_config']['weight_block_size'] = [64, 128]"
refused block_64 "weight_block_size = [64, 128]" "only [128, 128]"
edit method_gptq "cfg['quantization_config']['quant_method'] = 'gptq'"
refused method_gptq "quant_method = \"gptq\"" "not supported"
edit no_quant_config "del cfg['quantization_config']"
refused no_quant_config "model.layers.0.mlp.experts.0.gate_proj.weight" "F8_E4M3" "quantization_config"
edit nan_code "b, e = h['model.layers.0.mlp.experts.2.down_proj.weight']['data_offsets']; data[b + 136 * 3 + 5] = 0x7f"
refused nan_code "layer 0 expert 2" "down[3, 5] = nan" "e4m3 NaN code"
[ "$failed" -eq 0 ]
