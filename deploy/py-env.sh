#!/usr/bin/env bash
# deploy/py-env.sh - makes the Python environment of the conformance and deployment checks
# (torch, transformers, safetensors, numpy, kubernetes-validate), pinned so that the oracle
# does not move under the tests.
#
#   deploy/py-env.sh [VENV]      default $MOERPC_CONF_VENV, else .venv-conf in the repo
#
# Exit 0: VENV is usable (already, or made now). Exit 3: it was not made because this
# machine's disk is too full, said in one line on stderr: the callers turn that into a SKIP
# naming the reason. Exit 1: pip failed otherwise (a pin, the network): an error.
#
# PyPI's torch wheel is a CUDA build: even `import torch` on a CPU needs its CUDA
# libraries, and with them it is 5.7 GB. Where the CUDA toolkit is installed (every build
# machine of this project: nvcc, cuBLAS, cuDNN) the lean layout takes the toolkit's own
# libraries through the dynamic linker's cache and installs from PyPI only the four that
# the toolkit lacks or has too old (NCCL, cuSPARSELt, NVSHMEM, cuFile): 2.4 GB, no triton.
# If torch does not import that way, the full layout (pip's own dependency set) follows.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${MOERPC_CONF_VENV:-.venv-conf}}

TORCH=torch==2.15.0
# Clients the serve tests drive (tests/integration/serve_openai.py): topped up into a venv
# that has the rest, without rebuilding it.
EXTRA=(openai==3.60.0)
# torch's own pure-Python requirements (its METADATA), and the test-side packages.
PURE=(filelock 'typing-extensions>=4.13.0' 'setuptools>=77.0.3' 'sympy>=1.13.3'
      'networkx>=2.5.1' jinja2 'fsspec>=0.8.5'
      transformers==5.24.0 safetensors==0.8.0 numpy kubernetes-validate==1.37.0 "${EXTRA[@]}")
# The CUDA libraries of torch 2.15.0 that CUDA 13.0's toolkit does not carry (cuSPARSELt,
# NVSHMEM, cuFile) or carries too old (NCCL 2.2x lacks ncclCommResume).
LEAN_CUDA=(nvidia-nccl-cu13==2.30.7 nvidia-cusparselt-cu13==0.8.1
           nvidia-nvshmem-cu13==3.7.2 nvidia-cufile==1.17.1.22)
# What the lean layout takes from the toolkit (ldconfig -p must list each).
SYS_LIBS=(libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcudnn.so.9 libcusparse.so.12
          libcufft.so.12 libnvrtc.so.13)
LEAN_MIB=3500   # 2.4 GB installed + the largest wheel (torch, ~0.9 GB) while it unpacks
FULL_MIB=8000

say() { echo "py-env: $*" >&2; }
usable() {
  "$VENV/bin/python" - >/dev/null 2>&1 <<'EOF'
import torch, transformers, safetensors, numpy, kubernetes_validate
a = torch.ones(8, 8)
assert float((a @ a).sum()) == 512.0
EOF
}
free_mib() { # the free MiB of the file system that will hold $VENV
  local d=$VENV
  while [ ! -d "$d" ]; do d=$(dirname "$d"); done
  df -Pm "$d" | awk 'NR == 2 { print $4 }'
}
pip_q() { "$VENV/bin/pip" install -q --no-cache-dir --disable-pip-version-check "$@"; }
has_sys_libs() {
  local l cache
  cache=$(ldconfig -p 2>/dev/null) || return 1
  for l in "${SYS_LIBS[@]}"; do grep -qF "	$l " <<<"$cache" || return 1; done
}
need_disk() { # MiB what
  local have
  have=$(free_mib)
  if [ "$have" -lt "$1" ]; then
    say "not made: $have MiB free on the file system of $VENV, the $2 layout needs $1 MiB"
    exit 3
  fi
}

extras_ok() { "$VENV/bin/python" -c 'import openai' >/dev/null 2>&1; }
if usable; then
  extras_ok && exit 0
  say "adding ${EXTRA[*]} to $VENV"
  pip_q "${EXTRA[@]}" && extras_ok && exit 0
  say "failed to add ${EXTRA[*]}"
  exit 1
fi
log=$(mktemp /tmp/moerpc-py-env.XXXXXX)
trap 'rm -f "$log"' EXIT
t0=$(date +%s)
if has_sys_libs; then
  need_disk $LEAN_MIB lean
  say "installing $TORCH (lean: the CUDA toolkit's libraries) and ${PURE[*]} into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV" >>"$log" 2>&1 &&
    pip_q "${PURE[@]}" >>"$log" 2>&1 &&
    pip_q --no-deps "$TORCH" "${LEAN_CUDA[@]}" >>"$log" 2>&1
  if usable; then
    say "ok: lean layout, $(du -sm "$VENV" | cut -f1) MiB in $(( $(date +%s) - t0 )) s"
    exit 0
  fi
  say "the lean layout does not import torch ($(tail -n 1 "$log")); trying the full one"
fi
need_disk $FULL_MIB full
say "installing $TORCH with all its CUDA libraries (full layout) into $VENV"
rm -rf "$VENV"
if python3 -m venv "$VENV" >>"$log" 2>&1 && pip_q "$TORCH" "${PURE[@]}" >>"$log" 2>&1 && usable; then
  say "ok: full layout, $(du -sm "$VENV" | cut -f1) MiB in $(( $(date +%s) - t0 )) s"
  exit 0
fi
rm -rf "$VENV"
if grep -q 'No space left on device' "$log"; then
  say "not made: the disk filled while installing ($(free_mib) MiB free after cleaning up)"
  exit 3
fi
say "failed: $(grep -m1 -E 'ERROR|Error' "$log" || tail -n 1 "$log")"
exit 1
