#!/usr/bin/env bash
# py_env_disk.sh - a disk too small for the conformance venv is a named SKIP, never a
# crash or a pass: deploy/py-env.sh exits 3 with the free and the needed MiB, and
# tests/conformance/run.sh turns that into "skip conformance.all: ...". The small disk is a
# 64 MiB tmpfs made here (root only, else the whole script is a SKIP).
set -uo pipefail
cd "$(dirname "$0")/../.."
passed=0; failed=0; skipped=0
ok() { echo "ok   py_env_disk.$1"; passed=$((passed + 1)); }
bad() { echo "FAIL py_env_disk.$1: $2"; failed=$((failed + 1)); }
mnt=$(mktemp -d /tmp/moerpc-small-disk.XXXXXX)
trap 'umount "$mnt" 2>/dev/null; rmdir "$mnt"' EXIT
if [ "$(id -u)" -ne 0 ] || ! mount -t tmpfs -o size=64m tmpfs "$mnt" 2>/dev/null; then
  echo "skip py_env_disk.all: needs root to mount a small tmpfs"
  echo "py_env_disk: 0 passed, 0 failed, 1 skipped"; exit 0
fi

out=$(bash deploy/py-env.sh "$mnt/venv" 2>&1); rc=$?
if [ $rc -eq 3 ] && [[ $out == *"MiB free on the file system of $mnt/venv"*"needs"*"MiB"* ]]; then
  ok refuses_a_small_disk
else bad refuses_a_small_disk "rc=$rc: $out"; fi
[ -e "$mnt/venv" ] && bad leaves_nothing "$mnt/venv was created" || ok leaves_nothing

out=$(MOERPC_CONF_VENV=$mnt/venv bash tests/conformance/run.sh 2>&1); rc=$?
if [ $rc -eq 0 ] && [[ $out == *"skip conformance.all: not made: "*"MiB free"* ]] &&
   [[ $out == *"0 passed, 0 failed, 1 skipped"* ]]; then
  ok conformance_skips_naming_the_disk
else bad conformance_skips_naming_the_disk "rc=$rc: $out"; fi

echo "py_env_disk: $passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ]
