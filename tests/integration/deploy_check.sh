#!/usr/bin/env bash
# deploy_check.sh - the deployment files are valid for the tools that consume them:
#   - deploy/systemd/moerpc-server@.service (and an instance with the example drop-in) pass
#     `systemd-analyze verify` without a single warning;
#   - deploy/k8s/render.py's manifests for a model made here pass `kubernetes-validate
#     --strict` (offline schemas, PyPI), and the cluster.json they carry is accepted by the
#     client's own cluster-file parser, and its secret volumes are 0440 with the pods' group
#     as fsGroup (a secret readable by others is refused);
#   - each check is shown to fail on a broken copy, so that it cannot pass by accident.
# A tool that is missing is a SKIP with the reason, never a pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${MOERPC_BIN:-$PWD/build/bin}
BUILD=${MOERPC_BUILD:-$PWD/build}
VENV=${MOERPC_CONF_VENV:-.venv-conf}
tmp=$(mktemp -d /tmp/moerpc-deploy.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
passed=0; failed=0; skipped=0
ok() { echo "ok   deploy_check.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL deploy_check.$1: $2"; failed=$((failed + 1)); }
skip() { echo "skip deploy_check.$1: $2"; skipped=$((skipped + 1)); }

# --- systemd ---------------------------------------------------------------------------
if ! command -v systemd-analyze >/dev/null; then
  skip systemd_units "systemd-analyze not installed (apt: systemd)"
else
  units=$tmp/units
  mkdir -p "$units/moerpc-server@s0.service.d"
  # verify needs ExecStart's binary to exist: point it at the one just built.
  sed "s|/usr/local/bin/moerpc-server|$BIN/moerpc-server|" deploy/systemd/moerpc-server@.service \
    >"$units/moerpc-server@.service"
  cp deploy/systemd/flags.conf.example "$units/moerpc-server@s0.service.d/flags.conf"
  out=$(SYSTEMD_UNIT_PATH=$units: systemd-analyze verify "$units/moerpc-server@.service" \
        moerpc-server@s0.service 2>&1); rc=$?
  if [ $rc -eq 0 ] && [ -z "$out" ]; then ok systemd_units
  else bad systemd_units "rc=$rc: $out"; fi
  sed "s|/usr/local/bin/moerpc-client|$BIN/moerpc-client|" deploy/systemd/moerpc-serve.service \
    >"$units/moerpc-serve.service"
  mkdir -p "$units/moerpc-serve.service.d"
  cp deploy/systemd/serve-flags.conf.example "$units/moerpc-serve.service.d/flags.conf"
  out=$(SYSTEMD_UNIT_PATH=$units: systemd-analyze verify moerpc-serve.service 2>&1); rc=$?
  if [ $rc -eq 0 ] && [ -z "$out" ]; then ok systemd_serve_unit
  else bad systemd_serve_unit "rc=$rc: $out"; fi
  # A misspelt key is only a warning for systemd: the check above must see it.
  echo "Restartt=always" >>"$units/moerpc-server@s0.service.d/flags.conf"
  out=$(SYSTEMD_UNIT_PATH=$units: systemd-analyze verify moerpc-server@s0.service 2>&1)
  if [[ $out == *"Unknown key"* ]]; then ok systemd_check_catches_a_bad_key
  else bad systemd_check_catches_a_bad_key "no warning for Restartt=: $out"; fi
fi

# --- host tuning (tmpfiles.d) -------------------------------------------------------------
# deploy/systemd/moerpc-host-tuning.conf applied to a made-up root as systemd-tmpfiles applies
# it at boot: the values land in the files that exist, a file that does not exist (no haltpoll
# module) is skipped without an error, and the server's own host check (--check-host=DIR) has
# two things to say before (and a summary line) and nothing after.
if ! command -v systemd-tmpfiles >/dev/null; then
  skip host_tuning "systemd-tmpfiles not installed (apt: systemd)"
else
  hr=$tmp/hostroot
  mkdir -p "$hr/sys/module/haltpoll/parameters" "$hr/proc/sys/kernel" \
           "$hr/sys/devices/system/cpu/cpuidle" "$hr/sys/devices/system/node"
  echo 0 >"$hr/sys/module/haltpoll/parameters/guest_halt_poll_ns"
  echo haltpoll >"$hr/sys/devices/system/cpu/cpuidle/current_governor"
  echo 1 >"$hr/proc/sys/kernel/numa_balancing"
  echo 0-1 >"$hr/sys/devices/system/node/online"
  before=$("$BIN/moerpc-server" --check-host="$hr" 2>&1); brc=$?
  out=$(systemd-tmpfiles --create --root="$hr" "$PWD/deploy/systemd/moerpc-host-tuning.conf" 2>&1); rc=$?
  after=$("$BIN/moerpc-server" --check-host="$hr" 2>&1); arc=$?
  hp=$(cat "$hr/sys/module/haltpoll/parameters/guest_halt_poll_ns")
  nb=$(cat "$hr/proc/sys/kernel/numa_balancing")
  if [ $rc -ne 0 ] || [ -n "$out" ]; then bad host_tuning "systemd-tmpfiles rc=$rc: $out"
  elif [ "$hp" != 200000 ] || [ "$nb" != 0 ]; then bad host_tuning "wrote guest_halt_poll_ns=$hp numa_balancing=$nb"
  elif [ $brc -ne 1 ] || [ "$(grep -c '^host: ' <<<"$before")" != 3 ] || [ $arc -ne 0 ] ||
       [[ $after != *"nothing to change"* ]]; then
    bad host_tuning "--check-host before (rc $brc): [$before] after (rc $arc): [$after]"
  else
    rm "$hr/sys/module/haltpoll/parameters/guest_halt_poll_ns"
    out=$(systemd-tmpfiles --create --root="$hr" "$PWD/deploy/systemd/moerpc-host-tuning.conf" 2>&1); rc=$?
    if [ $rc -eq 0 ] && [ -z "$out" ] && [ ! -e "$hr/sys/module/haltpoll/parameters/guest_halt_poll_ns" ]; then
      ok host_tuning
    else bad host_tuning "without the haltpoll module: rc=$rc: $out"; fi
  fi
fi

# --- Kubernetes -------------------------------------------------------------------------
kv=$VENV/bin/kubernetes-validate
model=$tmp/model
if ! "$BIN/moerpc-mkmodel" --out "$model" --layers 2 --experts 8 --topk 2 --hidden 64 \
     --inter 32 --vocab 64 --heads 2 --kv-heads 1 --head-dim 32 >"$tmp/mk.log" 2>&1; then
  bad k8s_manifests "moerpc-mkmodel failed: $(tail -n 3 "$tmp/mk.log")"
elif [ ! -x "$kv" ]; then
  skip k8s_manifests "kubernetes-validate not installed in $VENV (deploy/install-deps.sh)"
else
  all_ok=1
  for reps in 1 2; do
    y=$tmp/k8s-$reps.yaml
    if ! python3 deploy/k8s/render.py --config "$model/config.json" --servers 4 \
         --image registry.example/moerpc:test --model-path /models/m --replicas $reps \
         --format int8 --serve --metrics-token >"$y" 2>"$tmp/render.err"; then
      bad k8s_manifests "render.py --replicas $reps: $(cat "$tmp/render.err")"; all_ok=0; continue
    fi
    if ! out=$("$kv" --strict --quiet "$y" 2>&1); then
      bad k8s_manifests "kubernetes-validate --strict (replicas $reps): $out"; all_ok=0
    fi
    # The ConfigMap's cluster.json must parse as the client's cluster file: the fuzz
    # replay of the cluster parser asserts that a seed named ok_* is accepted.
    mkdir -p "$tmp/cl-$reps"
    python3 -c 'import json,sys
docs=[json.loads(d) for d in open(sys.argv[1]).read().split("\n---\n")[1:]]
cm=[d for d in docs if d["kind"]=="ConfigMap"][0]
open(sys.argv[2],"w").write(cm["data"]["cluster.json"])' "$y" "$tmp/cl-$reps/ok_rendered"
    if ! out=$("$BUILD/tests/replay_fuzz_cluster" "$tmp/cl-$reps" 2>&1); then
      bad k8s_manifests "the rendered cluster.json is refused by the client: $out"; all_ok=0
    fi
  done
  # serve's Deployment: ready on /health (200 only once loaded, 503 from SIGTERM on), and
  # a grace period above its drain
  python3 -c 'import json,sys
docs=[json.loads(d) for d in open(sys.argv[1]).read().split("\n---\n")[1:]]
d=[x for x in docs if x["kind"]=="Deployment" and x["metadata"]["name"]=="moerpc-serve"][0]
c=d["spec"]["template"]["spec"]["containers"][0]
assert c["readinessProbe"]["httpGet"]["path"]=="/health", c["readinessProbe"]
assert " serve " in c["command"][2] and "--api-key-file" in c["command"][2], c["command"]
assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30
assert [x for x in docs if x["kind"]=="Service" and x["metadata"]["name"]=="moerpc-serve"]' "$tmp/k8s-1.yaml" \
    2>"$tmp/serve.err" || { bad k8s_manifests "serve's Deployment: $(tail -n 2 "$tmp/serve.err")"; all_ok=0; }
  # Secrets: the server and the client refuse a key or token file that group or others
  # may read unless root owns it and the group may only read it (DESIGN.md section 11):
  # every secret volume 0440, the pods' own group as fsGroup.
  python3 -c 'import json,sys
docs=[json.loads(d) for d in open(sys.argv[1]).read().split("\n---\n")[1:]]
for d in docs:
  if d["kind"] not in ("StatefulSet", "Deployment"): continue
  spec=d["spec"]["template"]["spec"]
  assert spec["securityContext"]["fsGroup"]==spec["securityContext"]["runAsGroup"], spec["securityContext"]
  for v in spec["volumes"]:
    if "secret" in v and "items" not in v["secret"]:
      assert v["secret"].get("defaultMode")==0o440, (d["metadata"]["name"], v)' "$tmp/k8s-1.yaml" \
    2>"$tmp/secret.err" || { bad k8s_manifests "secret modes: $(tail -n 2 "$tmp/secret.err")"; all_ok=0; }
  [ $all_ok = 1 ] && ok k8s_manifests
  sed 's/"readOnlyRootFilesystem"/"readOnlyRootFilesystm"/' "$tmp/k8s-1.yaml" >"$tmp/broken.yaml"
  if "$kv" --strict --quiet "$tmp/broken.yaml" >/dev/null 2>&1; then
    bad k8s_check_catches_a_bad_field "a misspelt field passed --strict"
  else ok k8s_check_catches_a_bad_field; fi
  if out=$(python3 deploy/k8s/render.py --config "$model/config.json" --servers 0 --image x \
           --model-path /m 2>&1); then
    bad render_refuses_bad_flags "--servers 0 was accepted"
  elif [[ $out == *"--servers 0: must be in 1..1024"* ]]; then ok render_refuses_bad_flags
  else bad render_refuses_bad_flags "unexpected message: $out"; fi
fi

echo "deploy_check: $passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
