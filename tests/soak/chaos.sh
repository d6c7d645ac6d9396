#!/usr/bin/env bash
# tests/soak/chaos.sh - the chaos soak (issue 23, item 8; tests/soak/README.md): three
# expert servers with every expert on two of them, each in a network namespace, and
# `moerpc-client serve` in the client's namespace under a steady load of greedy streamed
# completions, each answer compared with the all-local one, while a seeded schedule kills
# (SIGKILL) and restarts servers, moves experts with `moerpc-place apply`, flaps links and
# drains servers (SIGTERM under traffic) and restarts them - one event at a time, so every
# expert always has a live copy.
#
#   tests/soak/chaos.sh [--long | --seconds N] [--seed S] [--keep] [--events LIST]
#                         [--no-unload] [--inject-crash]
#     --seconds N   how long the load and the schedule run (default 45: the short soak of
#                   make test, about 60 s with the set-up; 30 under a sanitizer)
#     --long        the long soak: --seconds 1800
#     --seed S      the schedule's seed (default: drawn); printed first, replay with it
#     --keep        keep the work directory (logs, report) and say where it is
#     --events LIST the event kinds, a subset of kill9,term,apply,flap (default all)
#     --no-unload   apply moves keep the old copies (moerpc-place apply --no-unload): the
#                   routing moves, the bytes after the first few plans do not
#     --inject-crash  the soak's self-check: half-way through, s0 gets SIGSEGV behind the
#                   schedule's back; the run must then FAIL (no_crash, clean_shutdown)
#
# Output: "chaos_soak: seed S" first; then one line per event as it runs; at the end the
# report as JSON lines (also in DIR/report.jsonl), a human summary, one verdict line per
# case ("ok   chaos_soak.NAME" / "FAIL chaos_soak.NAME: why" / "skip chaos_soak.NAME: why")
# and "chaos_soak: N passed, N failed, N skipped". Exit 0 unless a case failed. Without
# network namespaces (not root) every case is skipped with the reason, never passed.
#
# Every process runs in the run's namespaces (deploy/netns/netns.sh), so the teardown
# (on exit, on INT/TERM, or when the run overruns --seconds + 300 s) kills them all by
# namespace and deletes the namespaces.
set -u
SRC=${MOERPC_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
BIN=${MOERPC_BIN:-$SRC/build/bin}
SOAK=$SRC/tests/soak
SECONDS_RUN=45
case "$BIN" in *san-*) SECONDS_RUN=30 ;; esac   # CI's sanitizer runs: the budget (tests/README.md)
SEED=
KEEP=0
ALL_EVENTS=kill9,term,apply,flap
EVENTS=$ALL_EVENTS
APPLY_UNLOAD=1
INJECT_CRASH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_RUN=${2:-}; shift 2 ;;
    --long) SECONDS_RUN=1800; shift ;;
    --seed) SEED=${2:-}; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --events) EVENTS=${2:-}; shift 2 ;;
    --no-unload) APPLY_UNLOAD=0; shift ;;
    --inject-crash) INJECT_CRASH=1; shift ;;
    -h|--help) sed -n '2,31p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "chaos.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$SECONDS_RUN" =~ ^[0-9]+$ ]] || [ "$SECONDS_RUN" -lt 10 ]; then
  echo "chaos.sh: --seconds '$SECONDS_RUN': expected a whole number >= 10" >&2; exit 2
fi
[ -z "$SEED" ] && SEED=$(( $(od -An -N4 -tu4 /dev/urandom | tr -d ' ') % 1000000 ))
[[ "$SEED" =~ ^[0-9]+$ ]] || { echo "chaos.sh: --seed '$SEED': expected a whole number" >&2; exit 2; }
for k in ${EVENTS//,/ }; do
  [[ ",$ALL_EVENTS," == *",$k,"* ]] || { echo "chaos.sh: --events: unknown kind '$k' ($ALL_EVENTS)" >&2; exit 2; }
done
UNLOAD_FLAG=(--no-unload)
[ "$APPLY_UNLOAD" = 1 ] && UNLOAD_FLAG=()
REPLAY="tests/soak/chaos.sh --seconds $SECONDS_RUN --seed $SEED$([ "$EVENTS" != "$ALL_EVENTS" ] && echo " --events $EVENTS")$([ "$APPLY_UNLOAD" = 0 ] && echo " --no-unload")$([ "$INJECT_CRASH" = 1 ] && echo " --inject-crash")"
echo "chaos_soak: seed $SEED (replay: $REPLAY)"

CASES=(load_ran no_failed_steps no_failed_requests answers_match_reference no_hang no_crash events_completed
       clean_shutdown)
passed=0; failed=0; skipped=0
cs_pass() { echo "ok   chaos_soak.$1"; passed=$((passed + 1)); }
cs_fail() { echo "FAIL chaos_soak.$1: $2"; failed=$((failed + 1)); }
cs_skip() { echo "skip chaos_soak.$1: $2"; skipped=$((skipped + 1)); }
cs_summary() { echo "chaos_soak: $passed passed, $failed failed, $skipped skipped"; }

# shellcheck source=deploy/netns/netns.sh
. "$SRC/deploy/netns/netns.sh"
# shellcheck source=deploy/netns/cluster.sh
. "$SRC/deploy/netns/cluster.sh"
if ! nn_check; then
  for c in "${CASES[@]}"; do cs_skip "$c" "cannot create network namespaces here: $NN_WHY"; done
  cs_summary; exit 0
fi
for t in curl python3; do
  command -v $t >/dev/null || {
    for c in "${CASES[@]}"; do cs_skip "$c" "'$t' is not installed"; done; cs_summary; exit 0; }
done

export MOERPC_ISA=ref             # reference kernels everywhere: answers comparable bit for bit
N=3                               # servers
LAYERS=4; EXPERTS=16
MAXTOK=24                         # tokens per answer (ignore_eos: always this many)
WORKERS=3                         # concurrent streams
PROMPTS=("Once upon a time, in a land of many experts," "The quick brown fox" "MoE layers route"
         "A server restarted in its namespace" "Replicas keep every expert alive" "Hello, world")
TMP=$(mktemp -d "${TMPDIR:-/tmp}/moerpc-chaos.XXXXXX")
D=$TMP/run
mkdir -p "$D"
STOP=$D/stop                      # the load stops when it exists
SAMPLER_STOP=$D/stop-sampler      # the sampler: after the load, so that it scrapes the final counts
BG=()          # background helpers in the root namespace (watchdog): ended by pid
SERVE_PID="" LOAD_PID="" SAMPLER_PID=""
T0=$(date +%s.%N)
CUR_PLAN=$D/plan-0.json
PLANS=("$CUR_PLAN")               # every plan applied (a restarted server gets the union)
PLACEMENT=$D/placement.json       # the serve client's --placement (apply rewrites it)
FINISHED=0

now() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.3f", b - a}'; }
jstr() { printf '%s' "$1" | tr '\n\t' '  ' | sed 's/\\/\\\\/g; s/"/\\"/g'; }
# ev KIND OK SERVER DETAIL [extra JSON members]: one event, in events.jsonl and on stdout.
EV_BAD=0                          # an event did not complete: the schedule stops there
ev() {
  local t; t=$(now)
  [ "$2" = false ] && EV_BAD=1
  printf '{"t": %s, "kind": "%s", "ok": %s, "server": "%s", "detail": "%s"%s}\n' \
      "$t" "$1" "$2" "$3" "$(jstr "$4")" "${5:+, $5}" >>"$D/events.jsonl"
  printf '  [%7.1f s] %-8s %-3s %s%s\n' "$t" "$1" "$3" "$4" "$([ "$2" = false ] && echo '  <-- FAILED')"
}
# rss NAME PID: the process's VmHWM (peak RSS) now, in rss.jsonl; the report keeps the max.
rss() {
  local kb
  kb=$(awk '/^VmHWM:/ {print $2}' "/proc/$2/status" 2>/dev/null)
  [ -n "$kb" ] && printf '{"proc": "%s", "pid": %s, "vmhwm_kb": %s}\n' "$1" "$2" "$kb" >>"$D/rss.jsonl"
  return 0
}
rss_all() {
  local j
  [ -n "$SERVE_PID" ] && rss serve "$SERVE_PID"
  [ -n "$LOAD_PID" ] && rss load.py "$LOAD_PID"
  [ -n "$SAMPLER_PID" ] && rss sampler "$SAMPLER_PID"
  for ((j = 0; j < N; j++)); do
    [ -n "${MH_SPID[$j]:-}" ] && rss "s$j" "${MH_SPID[$j]}"
    [ -n "${MH_RPID[$j]:-}" ] && rss "relay-s$j" "${MH_RPID[$j]}"
  done
}
pause() { sleep "$1" & wait $!; }   # a sleep that lets INT/TERM traps run at once

teardown() {
  local why=$1
  trap - EXIT INT TERM
  touch "$STOP" "$SAMPLER_STOP" 2>/dev/null
  local p
  for p in "${BG[@]}"; do kill "$p" 2>/dev/null; done
  { nn_down; wait; } 2>/dev/null          # every process in the run's namespaces, then them
  if [ "$FINISHED" = 0 ]; then
    cs_fail run "$why (logs: $([ "$KEEP" = 1 ] && echo "$TMP" || echo "rerun with --keep"))"
    cs_summary
  fi
  [ "$KEEP" = 1 ] || rm -rf "$TMP"
}
on_signal() { teardown "interrupted by SIG$1 at $(now) s"; exit "$2"; }

# ---- set-up ---------------------------------------------------------------------------------
# The traps: here for the temp dir; nn_up (in mh_start) puts its own, replaced again below.
trap 'teardown "exited early at $(now) s"' EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
setup_fail() { cs_fail setup "$1"; FINISHED=1; KEEP=1; teardown ""; echo "logs: $TMP"; cs_summary; exit 1; }
"$BIN/moerpc-mkmodel" --out "$TMP/model" --seed 3 --topk 1 --layers $LAYERS --experts $EXPERTS \
    >/dev/null 2>&1 || setup_fail "moerpc-mkmodel failed"
M=$TMP/model
printf 'chaos-soak-token-0123456789\n' >"$TMP/tok"; chmod 600 "$TMP/tok"
python3 "$SOAK/chaos_lib.py" plan --out "$CUR_PLAN" --layers $LAYERS --experts $EXPERTS --servers $N --initial
cp "$CUR_PLAN" "$PLACEMENT"
python3 "$SOAK/chaos_lib.py" schedule --seed "$SEED" --servers $N --kinds "$EVENTS" >"$D/schedule.txt"

echo "setting up: $N servers in namespaces (replicas: every expert on two), 25gbe links"
# The top-1 model makes every placement and every failover bit-exact on the reference
# kernels with an fp32 wire (docs/DESIGN.md section 15, "Exactness"); deadline 4 s, so a
# stalled server is given up after 1 s (section 3.7).
MH_TOKEN_FILE=$TMP/tok MH_DEADLINE_MS=4000 mh_start "$D" "$M" $N replicas 25gbe --threads 1 \
    --auth-token-file "$TMP/tok" --drain-timeout-ms 5000 || setup_fail "the servers did not start"
trap 'teardown "exited early at $(now) s"' EXIT
trap 'on_signal INT 130' INT
trap 'on_signal TERM 143' TERM
# The watchdog: a run that overruns by 300 s is a hang; TERM tears it down like an interrupt.
( trap 'kill $w 2>/dev/null; exit 0' TERM; sleep $((SECONDS_RUN + 300)) & w=$!; wait $w && kill -TERM $$ ) 2>/dev/null &
BG+=($!)
echo "latency and loss by: $MH_MECH; run $NN_PREFIX"
A0=$(nn_addr 0)
URL=http://$A0:8000

# serve_start PORT LOG [flags]: serve in the client's namespace, its pid in SV_PID (a
# child of this shell, so that its exit status can be waited for: started with
# `ip netns exec ... &`, never `nn_exec ... &`, which would put a subshell between);
# waits for /health 200.
serve_start() {
  local port=$1 log=$2; shift 2
  ip netns exec "$(nn_ns 0)" "$BIN/moerpc-client" serve --model "$M" --listen "$A0:$port" --served-model-name soak \
      --threads 1 --max-batch 8 --max-seq 256 --quiet "$@" >"$log" 2>&1 &
  SV_PID=$!
  local t
  for ((t = 0; t < 600; t++)); do
    nn_exec 0 curl -sf -o /dev/null "http://$A0:$port/health" && return 0
    kill -0 $SV_PID 2>/dev/null || { SV_WHY="serve exited: $(tail -n 3 "$log" | tr '\n' ' ')"; return 1; }
    sleep 0.1
  done
  SV_WHY="serve not ready after 60 s: $(tail -n 3 "$log" | tr '\n' ' ')"; return 1
}

# The reference: the same prompts on an all-local serve (no servers at all).
serve_start 8001 "$D/serve-ref.log" || setup_fail "the all-local serve did not start: $SV_WHY"
REF_PID=$SV_PID
nn_exec 0 python3 "$SOAK/load.py" ref --url "http://$A0:8001" --model soak --max-tokens $MAXTOK \
    --out "$D/ref.json" "${PROMPTS[@]}" 2>"$D/ref.err" || setup_fail "reference: $(tail -n 2 "$D/ref.err")"
rss serve-ref "$REF_PID"
kill -TERM "$REF_PID"; wait "$REF_PID"
echo "reference: ${#PROMPTS[@]} prompts, $MAXTOK tokens each, all-local"

serve_start 8000 "$D/serve.log" --cluster "$D/cluster.json" --wire f32 \
    --placement "$PLACEMENT" --watch-placement --drain-timeout 20 || setup_fail "serve did not start: $SV_WHY"
SERVE_PID=$SV_PID
T0=$(date +%s.%N)
ip netns exec "$(nn_ns 0)" python3 "$SOAK/chaos_lib.py" sample --url "$URL" --out "$D/samples.jsonl" \
    --stop-file "$SAMPLER_STOP" --t0 "$T0" >"$D/sampler.log" 2>&1 &
SAMPLER_PID=$!
ip netns exec "$(nn_ns 0)" python3 "$SOAK/load.py" run --url "$URL" --model soak --ref "$D/ref.json" \
    --workers $WORKERS --log "$D/load.jsonl" --stop-file "$STOP" --seed "$SEED" \
    >"$D/load-summary.json" 2>"$D/load.err" &
LOAD_PID=$!
echo "load: $WORKERS streams of $MAXTOK tokens against serve at $URL for $SECONDS_RUN s; events: $EVENTS"

# ---- events ---------------------------------------------------------------------------------
metric_down() { # prints the servers the client marks down ("" when none; "?" if no answer)
  local m
  m=$(nn_exec 0 curl -sf -m 2 "$URL/metrics") || { echo "?"; return; }
  echo "$m" | awk '/^moerpc_client_server_down\{/ && $2 != 0 {sub(/.*server="/, ""); sub(/".*/, ""); printf "%s ", $0}'
}
# wait_all_up S: until the client marks no server down (S seconds at most). Prints the wait.
wait_all_up() {
  local t0 d
  t0=$(date +%s%N)
  while :; do
    d=$(metric_down)
    [ -z "$d" ] && { echo $(( ($(date +%s%N) - t0) / 1000000 )); return 0; }
    [ $(( ($(date +%s%N) - t0) / 1000000000 )) -ge "$1" ] && { echo "still down after $1 s: $d"; return 1; }
    sleep 0.1
  done
}
# exit_of PID: the exit status of a child that is gone ("signal N" for a signal).
exit_of() {
  local st=0
  wait "$1" 2>/dev/null || st=$?
  if [ "$st" -gt 128 ]; then echo "signal $((st - 128))"; else echo "status $st"; fi
}
CRASHED=0
alive_check() { # every server, relay and serve still running (a crash is a finding); once
  local j
  [ "$CRASHED" = 1 ] && return 1
  for ((j = 0; j < N; j++)); do
    kill -0 "${MH_SPID[$j]}" 2>/dev/null && continue
    CRASHED=1
    ev crash false "s$j" "s$j exited by itself ($(exit_of "${MH_SPID[$j]}")): $(tail -n 1 "$D/s$j.log")"
    MH_SPID[j]=                   # reaped: mh_stop must not count it twice
    return 1
  done
  for ((j = 0; j < N; j++)); do
    [ -z "${MH_RPID[$j]:-}" ] || kill -0 "${MH_RPID[$j]}" 2>/dev/null && continue
    CRASHED=1
    ev crash false "s$j" "the relay of s$j exited by itself ($(exit_of "${MH_RPID[$j]}")): $(tail -n 1 "$D/relay-s$j.log")"
    MH_RPID[j]=
    return 1
  done
  kill -0 "$SERVE_PID" 2>/dev/null && return 0
  CRASHED=1
  ev crash false serve "serve exited by itself ($(exit_of "$SERVE_PID")): $(tail -n 1 "$D/serve.log")"
  SERVE_PID=
  return 1
}
# restart J: sJ started again with the experts the current plan gives it; waits until the
# client has it back (a refused return is a failed event).
restart() {
  local j=$1 t0 w
  MH_SPEC[j]=$(python3 "$SOAK/chaos_lib.py" spec --server "$j" "${PLANS[@]}")
  t0=$(date +%s%N)
  if ! mh_server_start "$j" >"$D/restart.out" 2>&1; then
    ev restart false "s$j" "did not start: $(tail -n 3 "$D/restart.out" | tr '\n' ' ')"; return 1
  fi
  ev restart true "s$j" "serving $(( ($(date +%s%N) - t0) / 1000000 )) ms after its start, experts ${MH_SPEC[$j]}"
  pause 0.3
  if w=$(wait_all_up 30); then
    ev back true "s$j" "the client marks no server down ($w ms)"
  else
    ev back false "s$j" "$w; $(grep -E 'refused|down:' "$D/serve.log" | tail -n 2 | tr '\n' ' ')"
    return 1
  fi
}
do_kill9() {
  local j=$1 down=$2
  rss "s$j" "${MH_SPID[$j]}"
  mh_server_kill "$j" KILL
  ev kill9 true "s$j" "SIGKILL; away for $down s"
  pause "$down"
  restart "$j"
}
do_term() {
  local j=$1 down=$2 pid=${MH_SPID[$1]} st t0
  rss "s$j" "$pid"
  t0=$(date +%s%N)
  kill -TERM "$pid"
  wait "$pid"; st=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 )) line
  line=$(grep 'stopped' "$D/s$j.log" | tail -n 1)
  if [ "$st" = 0 ]; then
    ev term true "s$j" "SIGTERM under load: drained, exit 0 after $ms ms ($line); away for $down s"
  else
    ev term false "s$j" "SIGTERM under load: exit $st after $ms ms, expected 0 (every accepted request answered): $line"
  fi
  pause "$down"
  restart "$j"
}
APPLY_N=0
do_apply() {
  local seed=$1 plan rc t0 out dry
  APPLY_N=$((APPLY_N + 1))
  plan=$D/plan-$APPLY_N.json
  python3 "$SOAK/chaos_lib.py" plan --out "$plan" --layers $LAYERS --experts $EXPERTS --servers $N --seed "$seed"
  t0=$(date +%s%N)
  nn_exec 0 python3 "$SOAK/chaos_lib.py" rss --out "$D/rss.jsonl" --name moerpc-place-apply -- \
      "$BIN/moerpc-place" apply --cluster "$D/cluster.json" "$plan" --client-placement "$PLACEMENT" \
      --client "$URL" --switch-timeout-s 30 "${UNLOAD_FLAG[@]}" >"$D/apply-$APPLY_N.log" 2>&1
  rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  dry=$(nn_exec 0 "$BIN/moerpc-place" apply --cluster "$D/cluster.json" "$plan" --dry-run 2>/dev/null |
        sed -n 's/^dry run: \([0-9]*\) experts to load, \([0-9]*\) to unload.*/\1 \2/p')
  out=$(grep -E '^applied s[0-9]' "$D/apply-$APPLY_N.log" | sed 's/^applied //; s/  */ /g' | tr '\n' ';')
  PLANS+=("$plan")                # from the first load on, the servers may hold its pairs
  if [ $rc = 0 ] && [ "${dry%% *}" = 0 ] && { [ "$APPLY_UNLOAD" = 0 ] || [ "$dry" = "0 0" ]; }; then
    CUR_PLAN=$plan
    # With unloads the servers now hold this plan's pairs alone: a restart gets those.
    [ "$APPLY_UNLOAD" = 1 ] && PLANS=("$plan")
    ev apply true "" "plan $APPLY_N (seed $seed) applied in $ms ms, the client switched, every planned pair served: $out"
  else
    # The plan may be partly in: servers are restarted with the union of both (nothing lost).
    ev apply false "" "plan $APPLY_N (seed $seed): apply exit $rc after $ms ms, dry run after: '$dry': $(tail -n 3 "$D/apply-$APPLY_N.log" | tr '\n' ' ')"
  fi
  local w
  w=$(wait_all_up 30) || ev back false "" "after apply: $w"
}
do_flap() {
  local j=$1 mode=$2 hold=$3 a=$4 b=$5 w
  local h=$((j + 1))
  [ -n "${MH_RPID[$j]:-}" ] && rss "relay-s$j" "${MH_RPID[$j]}"
  if [ "$mode" = rate ]; then
    mh_link "$j" "$a" "${NN_LINK_DELAY_US[$h]}" "${NN_LINK_LOSS[$h]}" ||
      { ev flap false "s$j" "could not set the rate"; return 1; }
    ev flap true "s$j" "link rate $a for $hold s"
  else
    mh_link "$j" 1gbit "$a" "$b" || { ev flap false "s$j" "could not set delay/loss"; return 1; }
    ev flap true "s$j" "link 1gbit, +$a us and loss $b per direction (by $NN_LAT_MECH$([ "$NN_LAT_MECH" = relay ] && echo ': relay restarted, its connections reset; loss = 200 ms stalls')) for $hold s"
  fi
  pause "$hold"
  [ -n "${MH_RPID[$j]:-}" ] && rss "relay-s$j" "${MH_RPID[$j]}"
  mh_link_profile "$j" 25gbe || { ev flap false "s$j" "could not restore 25gbe"; return 1; }
  ev unflap true "s$j" "link back to 25gbe"
  if w=$(wait_all_up 30); then ev back true "s$j" "the client marks no server down ($w ms)"
  else ev back false "s$j" "$w"; fi
}

END_T=$SECONDS_RUN
while read -r gap kind a1 a2 a3 a4 a5; do
  t=$(now)
  awk -v t="$t" -v g="$gap" -v e="$END_T" 'BEGIN{exit !(t + g + 8 < e)}' || break
  pause "$gap"
  if [ "$INJECT_CRASH" = 1 ] && awk -v t="$(now)" -v e="$END_T" 'BEGIN{exit !(t > e / 2)}'; then
    kill -SEGV "${MH_SPID[0]}" 2>/dev/null
    INJECT_CRASH=sent
    pause 0.5
  fi
  alive_check || break
  if [ "$EV_BAD" = 1 ]; then
    # A server may still be away: another event could take a pair's last copy, and the
    # steps it failed would not be the finding. The load goes on to the end.
    echo "  the schedule stops after the failed event (every pair must keep a live copy)"
    break
  fi
  kill -0 "$LOAD_PID" 2>/dev/null || { ev crash false load "the load generator exited: $(tail -n 2 "$D/load.err")"; break; }
  case "$kind" in
    kill9) do_kill9 "$a1" "$a2" ;;
    term) do_term "$a1" "$a2" ;;
    apply) do_apply "$a1" ;;
    flap) do_flap "$a1" "$a2" "$a3" "$a4" "$a5" ;;
  esac
  rss_all
done <"$D/schedule.txt"
if [ "$CRASHED" = 0 ]; then
  rest=$(awk -v t="$(now)" -v e="$END_T" 'BEGIN{d = e - t; if (d < 0) d = 0; printf "%.2f", d}')
  pause "$rest"
  alive_check
fi

# ---- the end: stop the load, scrape, shut down, report ----------------------------------------
rss_all
touch "$STOP"
t_stop=$(date +%s)
while kill -0 "$LOAD_PID" 2>/dev/null && [ $(( $(date +%s) - t_stop )) -lt 90 ]; do sleep 0.2; done
if kill -0 "$LOAD_PID" 2>/dev/null; then
  ev hang false load "requests still running 90 s after the end: serve does not answer"
  kill "$LOAD_PID" 2>/dev/null
fi
wait "$LOAD_PID" 2>/dev/null
touch "$SAMPLER_STOP"
wait "$SAMPLER_PID" 2>/dev/null
rss_all
why=
if [ -n "$SERVE_PID" ]; then
  kill -TERM "$SERVE_PID"; wait "$SERVE_PID"; st=$?
  [ "$st" = 0 ] || why="serve exited $st on SIGTERM (expected 0: nothing left to drain): $(tail -n 2 "$D/serve.log" | tr '\n' ' ')"
else
  why="serve had crashed"
fi
prefix=$NN_PREFIX
mh_stop >"$D/stop.out" 2>&1 ||
  why="${why:+$why; }a server did not drain and exit 0 at the end: $(tr '\n' ' ' <"$D/stop.out")"
left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -c "^$prefix-")
[ "$left" = 0 ] || why="${why:+$why; }$left namespaces left after the teardown"
san=$(grep -l -E 'WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:' "$D"/*.log 2>/dev/null | tr '\n' ' ')
[ -n "$san" ] && why="${why:+$why; }sanitizer reports in: $san"

python3 "$SOAK/chaos_lib.py" report --dir "$D" --seed "$SEED" --seconds "$SECONDS_RUN" --kinds "$EVENTS" --replay "$REPLAY" \
    >"$D/report.txt" 2>&1
grep '^{' "$D/report.txt" >"$D/report.jsonl"
cat "$D/report.txt"
passed=$((passed + $(grep -c '^ok   chaos_soak\.' "$D/report.txt")))
failed=$((failed + $(grep -c '^FAIL chaos_soak\.' "$D/report.txt")))
grep -q '^ok   chaos_soak\.' "$D/report.txt" || cs_fail report "the report did not run: $(tail -n 3 "$D/report.txt")"
if [ -z "$why" ]; then cs_pass clean_shutdown; else cs_fail clean_shutdown "$why"; fi
FINISHED=1
if [ "$failed" -gt 0 ]; then KEEP=1; fi
[ "$KEEP" = 1 ] && echo "logs, report and events kept in $D"
teardown ""
cs_summary
[ "$failed" -eq 0 ]
