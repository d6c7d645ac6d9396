# deploy/local-cluster.sh - a cluster of moerpc-server processes on loopback, for the demo
# (deploy/demo.sh) and the benchmarks (tests/bench/run.sh). Sourced, not run:
#
#   BIN=build/bin; . deploy/local-cluster.sh
#   lc_start DIR MODEL N [server flags...]   N servers, server i owning the i-th share of
#                                            the model's experts, each on a free port;
#                                            writes DIR/cluster.json and DIR/s<i>.log and
#                                            returns once every server logs "serving"
#   lc_stop                                  SIGTERM every server (they drain) and wait;
#                                            fails unless every one exited 0
#
# An EXIT trap kills servers left running (a failed step under set -e). Needs python3 (free
# ports, the model's expert count).

lc_pids=()
lc_dir=

lc__cleanup() { for p in "${lc_pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
# An EXIT trap the sourcing script set before is kept: it runs after the cleanup.
lc__prev_exit() {
  local p
  p=$(trap -p EXIT)
  [ -n "$p" ] || return 0
  eval "set -- ${p#trap -- }"
  printf '%s' "$1"
}
lc__prev_cmd=$(lc__prev_exit)
trap 'lc__cleanup; eval "$lc__prev_cmd"' EXIT

lc__free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

lc_start() {
  local dir=$1 model=$2 n=$3; shift 3
  local E ports=() i p
  E=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("num_experts") or c.get("n_routed_experts") or c["num_local_experts"])' "$model/config.json")
  lc_dir=$dir
  mkdir -p "$dir"
  for ((i = 0; i < n; i++)); do
    p=$(lc__free_port)
    while [[ " ${ports[*]} " == *" $p "* ]]; do p=$(lc__free_port); done
    ports+=("$p")
  done
  local servers=""
  for ((i = 0; i < n; i++)); do
    local lo=$((E * i / n)) hi=$((E * (i + 1) / n - 1))
    echo "    s$i owns experts $lo-$hi on 127.0.0.1:${ports[$i]}"
    "$BIN/moerpc-server" --model "$model" --listen "127.0.0.1:${ports[$i]}" --experts "$lo-$hi" \
        "$@" >"$dir/s$i.log" 2>&1 &
    lc_pids+=($!)
    servers+="${servers:+,
    }{\"name\": \"s$i\", \"address\": \"127.0.0.1:${ports[$i]}\"}"
  done
  local abs_model
  abs_model=$(cd "$model" && pwd)
  cat >"$dir/cluster.json" <<JSON
{
  "model": "$abs_model",
  "deadline_ms": 10000,
  "servers": [
    $servers
  ]
}
JSON
  # Wait until every server says it is serving (or one dies): at most 60 s.
  local t ok
  for t in $(seq 1 600); do
    ok=0
    for ((i = 0; i < n; i++)); do grep -q 'serving' "$dir/s$i.log" 2>/dev/null && ok=$((ok + 1)); done
    [ $ok -eq "$n" ] && break
    for p in "${lc_pids[@]}"; do
      kill -0 "$p" 2>/dev/null || { echo "a server died:"; tail -n 20 "$dir"/s*.log; return 1; }
    done
    sleep 0.1
  done
  [ $ok -eq "$n" ] || { echo "servers not serving after 60 s:"; tail -n 20 "$dir"/s*.log; return 1; }
  grep -h -E 'loaded|serving' "$dir"/s*.log | sed 's/^/    /'
}

lc_stop() {
  local rc=0 i st
  for i in "${!lc_pids[@]}"; do
    kill -TERM "${lc_pids[$i]}"
    if wait "${lc_pids[$i]}"; then echo "    s$i exited 0"; else st=$?; rc=$st; echo "    s$i exited $st"; fi
  done
  lc_pids=()
  grep -h -E 'draining|stopped' "$lc_dir"/s*.log | sed 's/^/    /'
  return $rc
}
