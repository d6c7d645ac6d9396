#!/usr/bin/env bash
# deploy/netns/cluster.sh - moerpc-server processes on hosts made of network namespaces
# (deploy/netns/netns.sh), for `make demo-multihost` and tests/integration/netns_*.sh.
# Sourced, not run (after netns.sh; BIN = the directory of the built binaries):
#
#   mh_start DIR MODEL N LAYOUT PROFILE [server flags...]
#       N + 1 hosts: host 0 is the client, host j + 1 runs server s<j> on
#       $(nn_addr j+1):50051 (--insecure: plaintext on a private bridge). LAYOUT split:
#       server j owns the j-th share of the experts; replicas: shares j and j + 1 (mod N),
#       so every expert is on two servers (N >= 2). PROFILE goes on every host link. When
#       the profile has latency or loss and the kernel has no netem, a moerpc-relay in
#       each server's namespace (port 50061) adds them, and the cluster file names the
#       relays. Writes DIR/cluster.json, DIR/s<j>.log, DIR/relay-s<j>.log; returns once
#       every server logs "serving" (60 s at most).
#   mh_client CMD...          runs CMD in the client's namespace
#   mh_server_kill J [SIG]    signals server J (default SIGKILL) and waits for its exit
#   mh_server_start J         starts server J again, same flags, log appended; waits
#   mh_link J RATE D L        server J's host link at RATE (tbf; - none), D us one-way
#                             delay and loss L per direction (nn_link_set); where a relay
#                             stands in for netem it is restarted with the path's new
#                             delay and stall rate (its connections reset: a link drop)
#   mh_link_profile J PROFILE the same with a named profile (back to normal after mh_link)
#   mh_stop                   SIGTERM every server (they drain) and relay; fails unless
#                             every server exited 0; then tears the hosts down
#   MH_MECH                   what adds latency/loss: netem, relay or none (for figures)
#   MH_FORCE_RELAY=1          a relay in front of every server even without delay (to
#                             measure what the relay itself costs); MH_DEADLINE_MS the
#                             cluster file's deadline_ms (default 10000); MH_TOKEN_FILE the
#                             cluster file's token_file (the servers then need
#                             --auth-token-file among the server flags)
#
# Everything lives in the run's namespaces, so nn_down (the EXIT trap of nn_up) also ends
# whatever a failed step left running.

MH_PORT=50051
MH_RELAY_PORT=50061
MH_N=0
MH_DIR=
MH_MODEL=
MH_MECH=none
MH_SPEC=()
MH_SPID=()
MH_RPID=()
MH_RDELAY=()
MH_RLOSS=()
MH_FLAGS=()

mh__range() { # E N i: the i-th of N shares of E experts, as "lo-hi"
  local e=$1 n=$2 i=$3
  echo "$((e * i / n))-$((e * (i + 1) / n - 1))"
}

mh__wait_log() { # file pattern pid seconds
  local f=$1 pat=$2 pid=$3 t
  for ((t = 0; t < $4 * 10; t++)); do
    grep -q "$pat" "$f" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "mh: process $pid exited; $f:"; tail -n 20 "$f"; return 1; }
    sleep 0.1
  done
  echo "mh: no '$pat' in $f after $4 s:"; tail -n 20 "$f"
  return 1
}

mh_server_start() {
  local j=$1 h=$(($1 + 1))
  local lines0
  : >>"$MH_DIR/s$j.log"
  lines0=$(wc -l <"$MH_DIR/s$j.log")
  ip netns exec "$(nn_ns "$h")" "$BIN/moerpc-server" --model "$MH_MODEL" \
      --listen "$(nn_addr "$h"):$MH_PORT" --insecure --experts "${MH_SPEC[$j]}" \
      "${MH_FLAGS[@]}" >>"$MH_DIR/s$j.log" 2>&1 &
  MH_SPID[j]=$!
  # Wait for a "serving" line written after this start.
  local t
  for ((t = 0; t < 600; t++)); do
    tail -n +"$((lines0 + 1))" "$MH_DIR/s$j.log" | grep -q serving && return 0
    kill -0 "${MH_SPID[$j]}" 2>/dev/null || { echo "mh: s$j died:"; tail -n 20 "$MH_DIR/s$j.log"; return 1; }
    sleep 0.1
  done
  echo "mh: s$j not serving after 60 s"; tail -n 20 "$MH_DIR/s$j.log"; return 1
}

mh_server_kill() {
  local j=$1 sig=${2:-KILL}
  kill -s "$sig" "${MH_SPID[$j]}" 2>/dev/null || true
  wait "${MH_SPID[$j]}" 2>/dev/null || true
}

mh_start() {
  local dir=$1 model=$2 n=$3 layout=$4 profile=$5 j
  shift 5
  MH_FLAGS=("$@")
  MH_N=$n
  MH_DIR=$dir
  MH_MODEL=$(cd "$model" && pwd)
  mkdir -p "$dir"
  local E
  E=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("num_experts") or c.get("n_routed_experts") or c["num_local_experts"])' "$model/config.json")
  case "$layout" in
    split) for ((j = 0; j < n; j++)); do MH_SPEC[j]=$(mh__range "$E" "$n" "$j"); done ;;
    replicas)
      [ "$n" -ge 2 ] || { echo "mh: replicas need 2 servers or more" >&2; return 1; }
      for ((j = 0; j < n; j++)); do
        MH_SPEC[j]="$(mh__range "$E" "$n" "$j"),$(mh__range "$E" "$n" $(((j + 1) % n)))"
      done ;;
    *) echo "mh: layout '$layout': expected split or replicas" >&2; return 1 ;;
  esac
  nn_up $((n + 1)) || return 1
  for ((j = 0; j <= n; j++)); do nn_link_profile "$j" "$profile" || return 1; done
  MH_MECH=$(nn_path_mech 0 1)
  [ "${MH_FORCE_RELAY:-0}" = 1 ] && [ "$MH_MECH" = none ] && MH_MECH="relay (0 delay)"
  local servers=""
  for ((j = 0; j < n; j++)); do
    local h=$((j + 1)) addr d loss
    addr="$(nn_addr "$h"):$MH_PORT"
    echo "    s$j on host $h ($(nn_ns "$h")) $addr owns experts ${MH_SPEC[$j]}"
    mh_server_start "$j" || return 1
    if ! mh__relay_start "$j" "$(nn_path_delay_us 0 "$h")" "$(nn_path_loss 0 "$h")"; then
      return 1
    fi
    [ -n "${MH_RPID[$j]:-}" ] && addr="$(nn_addr "$h"):$MH_RELAY_PORT"
    servers+="${servers:+,
    }{\"name\": \"s$j\", \"address\": \"$addr\"}"
  done
  local tok=""
  [ -n "${MH_TOKEN_FILE:-}" ] && tok="
  \"token_file\": \"$MH_TOKEN_FILE\","
  cat >"$dir/cluster.json" <<JSON
{
  "model": "$MH_MODEL",
  "deadline_ms": ${MH_DEADLINE_MS:-10000},$tok
  "servers": [
    $servers
  ]
}
JSON
}

# mh__relay_start J DELAY_US LOSS: a relay in front of server J when the path needs one
# (a delay or loss that netem does not make, or MH_FORCE_RELAY=1); sets MH_RPID[J] (empty
# when none is needed). Its log is appended to DIR/relay-s<J>.log.
mh__relay_start() {
  local j=$1 d=$2 loss=$3 h=$(($1 + 1)) lines0
  MH_RPID[j]=
  MH_RDELAY[j]=$d; MH_RLOSS[j]=$loss
  [ "$d" != 0 ] || [ "$loss" != 0 ] || [ "${MH_FORCE_RELAY:-0}" = 1 ] || return 0
  : >>"$MH_DIR/relay-s$j.log"
  lines0=$(wc -l <"$MH_DIR/relay-s$j.log")
  ip netns exec "$(nn_ns "$h")" "$BIN/moerpc-relay" --listen "$(nn_addr "$h"):$MH_RELAY_PORT" \
      --target "$(nn_addr "$h"):$MH_PORT" --delay-us "$d" --loss "$loss" --seed "$h" \
      >>"$MH_DIR/relay-s$j.log" 2>&1 &
  MH_RPID[j]=$!
  local t
  for ((t = 0; t < 100; t++)); do
    tail -n +"$((lines0 + 1))" "$MH_DIR/relay-s$j.log" | grep -q listening && break
    kill -0 "${MH_RPID[$j]}" 2>/dev/null || { echo "mh: relay of s$j died:"; tail -n 5 "$MH_DIR/relay-s$j.log"; return 1; }
    sleep 0.1
  done
  [ "$t" -lt 100 ] || { echo "mh: relay of s$j not listening after 10 s"; return 1; }
  echo "    relay in front of s$j: $(nn_addr "$h"):$MH_RELAY_PORT, +$d us each way, stall rate $loss"
}

# mh__relay_follow J: after a link change, the relay of server J (if it has one) restarted
# when the path's delay or stall rate changed (the cluster file names the relay, so one
# stays even when the path no longer needs a delay: it then adds none).
mh__relay_follow() {
  local j=$1 h=$(($1 + 1))
  [ -n "${MH_RPID[$j]:-}" ] || return 0
  [ "$(nn_path_delay_us 0 "$h")" = "${MH_RDELAY[$j]}" ] &&
    [ "$(nn_path_loss 0 "$h")" = "${MH_RLOSS[$j]}" ] && return 0
  kill -TERM "${MH_RPID[$j]}" 2>/dev/null || true
  wait "${MH_RPID[$j]}" 2>/dev/null || true
  local save=${MH_FORCE_RELAY:-0}
  MH_FORCE_RELAY=1 mh__relay_start "$j" "$(nn_path_delay_us 0 "$h")" "$(nn_path_loss 0 "$h")" >/dev/null
  local rc=$?
  MH_FORCE_RELAY=$save
  return $rc
}

mh_link() {
  nn_link_set $(($1 + 1)) "$2" "$3" "$4" || return 1
  mh__relay_follow "$1"
}

mh_link_profile() {
  nn_link_profile $(($1 + 1)) "$2" || return 1
  mh__relay_follow "$1"
}

mh_client() { nn_exec 0 "$@"; }

mh_stop() {
  local rc=0 j st
  for ((j = 0; j < MH_N; j++)); do
    [ -n "${MH_SPID[$j]:-}" ] || continue
    kill -TERM "${MH_SPID[$j]}" 2>/dev/null || true
    if wait "${MH_SPID[$j]}"; then st=0; else st=$?; fi
    [ "$st" = 0 ] || { rc=1; echo "    s$j exited $st"; }
  done
  for ((j = 0; j < MH_N; j++)); do
    [ -n "${MH_RPID[$j]:-}" ] || continue
    kill -TERM "${MH_RPID[$j]}" 2>/dev/null || true
    wait "${MH_RPID[$j]}" 2>/dev/null || true
  done
  MH_SPID=(); MH_RPID=()
  nn_down
  return $rc
}
