#!/usr/bin/env bash
# rpc_pinned.sh - the transport's cost with the server and the client on their own CPUs
# (issue 24 item 3, docs/DESIGN.md section 6):
#   tests/bench/rpc_pinned.sh [ROUNDS]        # default 3 rounds, T = 1,16,256
# One moerpc-server (--threads 1, pinned with taskset to the last CPU this script may use)
# on the default demo model, and `moerpc-client bench-rpc` pinned to the first, its TCP
# peer pinned to the server's CPU (--peer-cpu), so that the gRPC round trip and the raw
# TCP one cross the same two cores. Prints every round's JSON lines, then per T the median
# over rounds of grpc - compute, tcp (instant reply) and tcp_held (the peer holding each
# reply for the server's compute p50, minus the hold), the two ratios, and the client's own
# share (client_submit: gather, encode, queue; client_wake: the reply at the I/O thread ->
# the sum in the caller's hands), the server's own share (server_own: its time with the
# request, ForwardReply.server_us, less queue and compute) and what is left, transport
# (the kernel and gRPC both ways, moerpc's code on neither side), over tcp and tcp_held.
# Needs 2 CPUs.
# Env: BIN (default build/bin), ITERS (bench-rpc calls per T, default 2000), TOKENS, MODEL,
# CLIENT_FLAGS (more bench-rpc flags, e.g. --wait-spin-us 100),
# SERVER_CPUS / CLIENT_CPUS (below).
set -euo pipefail
BIN=${BIN:-build/bin}
rounds=${1:-3}
ITERS=${ITERS:-2000}
TOKENS=${TOKENS:-1,16,256}
CLIENT_FLAGS=${CLIENT_FLAGS:-}
mapfile -t cpus < <(python3 -c 'import os; print(*sorted(os.sched_getaffinity(0)), sep="\n")')
if [ "${#cpus[@]}" -lt 2 ]; then
  echo "rpc_pinned: needs 2 CPUs, this process may use ${#cpus[@]}" >&2
  exit 1
fi
ccpu=${cpus[0]} scpu=${cpus[${#cpus[@]} - 1]}
# SERVER_CPUS / CLIENT_CPUS (taskset lists, e.g. 8-15 / 0-7): give each side several CPUs
# (its gRPC threads then need not share one); the TCP peer stays on the server's last CPU.
scpus=${SERVER_CPUS:-$scpu} ccpus=${CLIENT_CPUS:-$ccpu}
dir=$(mktemp -d /tmp/moerpc-rpc-pinned.XXXXXX)
spid=
cleanup() { [ -n "$spid" ] && kill -9 "$spid" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
# MODEL: another model directory (e.g. build/bench/qwen3-30b-a3b-l2 of load_speed.sh, H = 2048)
MODEL=${MODEL:-$dir/model}
[ -f "$MODEL/config.json" ] || "$BIN/moerpc-mkmodel" --out "$MODEL" --seed 1 >/dev/null 2>&1
CPU=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
echo "rpc_pinned: server on CPU(s) $scpus (--threads 1), client on CPU(s) $ccpus, $rounds rounds, $CPU" >&2
for round in $(seq 1 "$rounds"); do
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  cat >"$dir/cluster.json" <<JSON
{"model": "$MODEL", "deadline_ms": 10000,
 "servers": [{"name": "s0", "address": "127.0.0.1:$port"}]}
JSON
  taskset -c "$scpus" "$BIN/moerpc-server" --model "$MODEL" --listen "127.0.0.1:$port" \
      --experts all --threads 1 >"$dir/server.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 600); do
    grep -q 'serving' "$dir/server.log" && break
    kill -0 "$spid" 2>/dev/null || { tail -5 "$dir/server.log" >&2; exit 1; }
    sleep 0.05
  done
  taskset -c "$ccpus" "$BIN/moerpc-client" bench-rpc --cluster "$dir/cluster.json" \
      --iters "$ITERS" --tokens "$TOKENS" --peer-cpu "$scpu" --json $CLIENT_FLAGS 2>"$dir/client.log" |
      grep '^{' | sed "s/^{/{\"round\":$round,/" | tee -a "$dir/out.jsonl"
  kill -TERM "$spid"
  wait "$spid" || true
  spid=
done
python3 - "$dir/out.jsonl" "$CPU" <<'PY'
import json, statistics as st, sys
rows = {}
for line in open(sys.argv[1]):
    j = json.loads(line)
    rows.setdefault(j["tokens"], []).append(j)
for T, v in sorted(rows.items()):
    m = lambda k: st.median(x[k] for x in v)
    net, tcp, held = m("grpc_minus_compute_p50_us"), m("tcp_p50_us"), m("tcp_held_p50_us")
    print(json.dumps({"bench": "rpc_pinned", "tokens": T, "rounds": len(v),
                      "grpc_p50_us": m("grpc_p50_us"), "compute_p50_us": m("server_compute_us_p50"),
                      "grpc_minus_compute_p50_us": net, "tcp_p50_us": tcp,
                      "tcp_held_p50_us": held, "ratio_vs_tcp": round(net / tcp, 3),
                      "ratio_vs_tcp_held": round(net / held, 3),
                      "client_submit_p50_us": m("client_submit_p50_us"),
                      "client_wake_p50_us": m("client_wake_p50_us"),
                      "server_own_p50_us": m("server_own_p50_us"),
                      "transport_p50_us": m("transport_p50_us"),
                      "transport_over_tcp": round(m("transport_p50_us") / tcp, 3),
                      "transport_over_tcp_held": round(m("transport_p50_us") / held, 3),
                      "cpu": sys.argv[2],
                      # the host's idle polling decides what every wake-up costs on a VM
                      # (docs/deploy.md, "Host tuning"): the rounds' own record of it
                      "cpuidle": v[-1].get("cpuidle", ""),
                      "guest_halt_poll_ns": v[-1].get("guest_halt_poll_ns", -1)}))
PY
