#!/usr/bin/env bash
# deploy/install-deps.sh - installs every build and test dependency of moerpc (idempotent).
#   deploy/install-deps.sh              apt packages + the PyPI packages of the conformance
#                                       tests (torch, transformers: 2.4 GB, ~1 min) in .venv-conf
#                                       (deploy/py-env.sh)
#   deploy/install-deps.sh --no-python  apt packages only (enough to build, serve and demo)
# Debian 12 (bookworm); run as root (or with sudo available).
#   MOERPC_SKIP_APT=1   skip apt (for machines where the packages are already there)
#   MOERPC_CONF_VENV    where the conformance venv goes (default .venv-conf in the repo)
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_PYTHON=1
for a in "$@"; do
  case "$a" in
    --no-python) WITH_PYTHON=0 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "install-deps: unknown option $a (see --help)" >&2; exit 2 ;;
  esac
done

PKGS=(
  build-essential pkg-config make
  clang libclang-rt-14-dev          # libFuzzer targets (make fuzz) and sanitizers
  libgrpc-dev                       # gRPC C core 1.51
  libssl-dev                        # libcrypto: the server checks its certificate's dates
  libprotobuf-c-dev protobuf-c-compiler
  libuv1-dev libhwloc-dev libnuma-dev libcjson-dev
  zlib1g-dev                        # zlib: CRC-32 of the packed-weight cache files (--weight-cache)
  libonig-dev                       # Oniguruma: the tokenizer's split regexes, the engine HF
                                    # tokenizers uses (same syntax, \p{..} and && classes)
  libutf8proc-dev                   # utf8proc: the tokenizer's NFC/NFKC normalizers
  libmicrohttpd-dev                 # libmicrohttpd: the one HTTP server (serve, /metrics,
                                    # probes): epoll, idle timeouts, suspend/resume
  curl                              # make demo's streamed chat request, the serve tests
  hwloc-nox numactl                 # lstopo / numactl for operators
  iproute2                          # ip netns for the multi-host harness
  openssl                           # certificates made at test time (itest_security)
  systemd                           # systemd-analyze verify of deploy/systemd (deploy_check)
  prometheus                        # promtool check metrics (itest_metrics); installed with
                                    # --no-install-recommends (no node-exporter); on a systemd
                                    # host the package enables prometheus.service: stop and
                                    # disable it there if not wanted (only promtool is used)
  python3 python3-venv
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done

if [ "${MOERPC_SKIP_APT:-0}" != 1 ] && [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "install-deps: all ${#PKGS[@]} apt packages present"
fi

# Sanity: the tools the build needs.
for t in gcc make protoc-c pkg-config; do
  command -v "$t" >/dev/null || { echo "install-deps: $t is missing after install" >&2; exit 1; }
done
pkg-config --exists grpc libprotobuf-c libuv hwloc libcjson oniguruma libutf8proc libmicrohttpd || {
  echo "install-deps: pkg-config cannot find grpc/libprotobuf-c/libuv/hwloc/libcjson/oniguruma/libutf8proc/libmicrohttpd" >&2; exit 1; }
echo "install-deps: ok (grpc $(pkg-config --modversion grpc), protobuf-c $(pkg-config --modversion libprotobuf-c), libuv $(pkg-config --modversion libuv), hwloc $(pkg-config --modversion hwloc))"

if [ "$WITH_PYTHON" = 1 ]; then
  # The conformance / deployment-check venv (deploy/py-env.sh: pins, lean CUDA layout). A
  # disk too full for it is not fatal: those tests then SKIP, naming the reason.
  rc=0; bash deploy/py-env.sh || rc=$?
  case $rc in
    0) echo "install-deps: python venv ${MOERPC_CONF_VENV:-.venv-conf} ok" ;;
    3) echo "install-deps: WARNING: no python venv; tests/conformance and the Python checks will SKIP" >&2 ;;
    *) exit 1 ;;
  esac
fi
