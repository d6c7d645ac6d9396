#!/usr/bin/env bash
# tests/integration/netns_restart.sh - a server restarted in its namespace while a client
# generates is used again. Three servers in namespaces (experts split, 25gbe profile); one
# long-lived client (build/tests/netns_gen: one model runner, generations back to back)
# runs for 8 s; s1 is killed (SIGKILL) 1.5 s in and started again in the same namespace
# on the same address. Checks: generations fail only while s1 is away, each failure names
# s1 (with replicas in the client, none may fail at all); generations succeed again once
# it is back, the last three of the run among them; every successful generation gives the
# all-local tokens; the restarted s1 answered requests (its Stats count from its restart).
# shellcheck source=tests/integration/netns/common.sh
. "$(dirname "$0")/netns/common.sh"
nt_init netns_restart
if [ "$NT_CAN" = 0 ]; then nt_skip restarted_server_used_again "$NT_WHY"; nt_done; fi
P="3,14,15,92,65,35"
M=$NT_TMP/model
c=restarted_server_used_again
ref=$(nt_local_tokens "$P" 16) || { nt_fail setup "all-local generate failed"; nt_done; }
d=$NT_TMP/restart
MH_DEADLINE_MS=2000 mh_start "$d" "$M" 3 split 25gbe --threads 1 || { nt_fail $c "servers did not start"; nt_done; }
ip netns exec "$(nn_ns 0)" "$NT_GEN" --model "$M" --cluster "$d/cluster.json" --prompt-ids "$P" \
    --max-new 16 --seconds 8 >"$d/gen.out" 2>"$d/gen.log" &
gpid=$!
sleep 1.5
mh_server_kill 1 KILL
echo "s1 killed at $(grep -c '^gen ' "$d/gen.out") generations"
sleep 0.3
mh_server_start 1 || { nt_fail $c "s1 did not start again"; nt_done; }
echo "s1 serving again at $(grep -c '^gen ' "$d/gen.out") generations"
wait $gpid
grep -E '^gen .*FAIL' "$d/gen.out" | head -n 3
tail -n 2 "$d/gen.out"
why=
sum=$(grep '^netns_gen: [0-9]* generations' "$d/gen.out")
[ -n "$sum" ] || why="netns_gen did not finish: $(tail -n 3 "$d/gen.log")"
ok=$(echo "$sum" | sed -n 's/.* \([0-9]*\) ok,.*/\1/p')
bad=$(echo "$sum" | sed -n 's/.* \([0-9]*\) mismatched.*/\1/p')
[ "${ok:-0}" -gt 0 ] || why="${why:+$why; }no generation succeeded"
[ "${bad:-1}" = 0 ] || why="${why:+$why; }$bad generations gave other tokens"
toks=$(sed -n 's/^netns_gen: tokens //p' "$d/gen.out")
[ "$toks" = "$ref" ] || why="${why:+$why; }tokens $toks, all-local $ref"
if grep '^gen .*FAIL' "$d/gen.out" | grep -v -q 'server s1'; then
  why="${why:+$why; }a failure that does not name s1: $(grep '^gen .*FAIL' "$d/gen.out" | grep -v 'server s1' | head -n 1)"
fi
last3=$(grep '^gen ' "$d/gen.out" | tail -n 3 | grep -c ' ok ')
[ "$last3" = 3 ] || why="${why:+$why; }the last generations still fail after s1 came back"
stats=$(mh_client "$BIN/moerpc-client" stats --cluster "$d/cluster.json" --log warn 2>&1)
echo "$stats" | grep '^server'
n=$(echo "$stats" | sed -n 's/^server s1 .*requests \([0-9]*\),.*/\1/p')
[ "${n:-0}" -gt 0 ] || why="${why:+$why; }the restarted s1 answered no request (stats: ${n:-none})"
echo "restarted s1 answered ${n:-0} requests; latency by $MH_MECH"
mh_stop || why="${why:+$why; }a server did not drain and exit 0"
if [ -z "$why" ]; then nt_pass $c; else nt_fail $c "$why"; fi
nt_done
