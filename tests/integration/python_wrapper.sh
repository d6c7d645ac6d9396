#!/usr/bin/env bash
# python_wrapper.sh - the moerpc Python package (gpu_client/python): MoeRpcWrapper against
# real servers, a torch reference and kt-kernel's own KTMoEWrapper; the sglang-kt hook.
# The cases are in test_python_wrapper.py; this script prepares their virtual environment:
#
#   $BUILD/venv-moerpc    torch (reused read-only from $MOERPC_TORCH_SITE or .venv-conf's
#                         site-packages through a .pth file; .venv-conf is made by
#                         deploy/py-env.sh when neither has it), kt-kernel 0.7.2 --no-deps + gguf, safetensors, numpy (as
#                         tests/bench/vs_ktkernel.py installs it), and the moerpc package
#                         itself, reinstalled each run (pip install ./gpu_client/python)
#   $BUILD/venv-sglang    only with MOERPC_TEST_SGLANG=1: the same plus sglang-kt --no-deps
#                         and the pure-Python modules its kt_ep_wrapper imports
#
# Both are created when missing and kept (cached) under build/. An install that fails
# (PyPI unreachable) is a SKIP naming the step, never a pass. Under a sanitizer build the
# whole script is skipped: an ASan/TSan libmoerpc-client.so cannot be loaded into python.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${MOERPC_BUILD:-$PWD/build}
PYTHON=${MOERPC_PYTHON:-python3}
KT_VERSION=0.7.2
venv=$BUILD/venv-moerpc
log=$(mktemp /tmp/moerpc-pyvenv.XXXXXX)
trap 'rm -f "$log"' EXIT

skip_all() { echo "skip python_wrapper.all: $1"; echo "python_wrapper: 0 passed, 0 failed, 1 skipped"; exit 0; }

if [ -n "${SANITIZER:-}" ]; then
  skip_all "SANITIZER=$SANITIZER: an instrumented libmoerpc-client.so cannot be loaded by ctypes (the sanitizer runtime must come first)"
fi

torch_site() { # a site-packages dir with torch, or nothing
  local d
  for d in "${MOERPC_TORCH_SITE:-}" "${MOERPC_CONF_VENV:-.venv-conf}"/lib/python3*/site-packages; do
    [ -n "$d" ] && [ -d "$d/torch" ] && { realpath "$d"; return; }
  done
}

make_venv() { # dir: a venv with torch, safetensors, numpy, wheel (kt-kernel separately)
  local v=$1 site ts
  if [ ! -x "$v/bin/python" ]; then
    "$PYTHON" -m venv "$v" >>"$log" 2>&1 || return 1
  fi
  site=$("$v/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  ts=$(torch_site)
  if [ -z "$ts" ]; then # make the conformance venv (lean CUDA layout) and borrow its torch
    echo "# making the conformance venv for its torch (deploy/py-env.sh)"
    bash deploy/py-env.sh >>"$log" 2>&1 || return 2
    ts=$(torch_site)
  fi
  [ -n "$ts" ] && echo "$ts" >"$site/zz_moerpc_torch_site.pth"
  "$v/bin/python" -c "import torch" 2>>"$log" || return 2
  "$v/bin/python" -c "import safetensors, numpy, wheel, setuptools" 2>/dev/null ||
    "$v/bin/python" -m pip install -q safetensors numpy wheel setuptools >>"$log" 2>&1 || return 3
  if ! "$v/bin/python" -c "import kt_kernel" 2>/dev/null; then
    "$v/bin/python" -m pip install -q --no-deps "kt-kernel==$KT_VERSION" >>"$log" 2>&1 &&
      "$v/bin/python" -m pip install -q gguf >>"$log" 2>&1 || echo "# kt-kernel not installed: $(tail -n 1 "$log")"
  fi
  "$v/bin/python" -m pip install -q --no-deps --no-build-isolation --force-reinstall \
      ./gpu_client/python >>"$log" 2>&1 || return 4
  rm -rf gpu_client/python/build gpu_client/python/moerpc.egg-info
}

why() {
  case $1 in
    1) echo "python3 -m venv $2 failed: $(tail -n 1 "$log")" ;;
    2) echo "no torch: $(tail -n 1 "$log")" ;;
    3) echo "pip install safetensors numpy wheel failed (PyPI unreachable?): $(tail -n 1 "$log")" ;;
    4) echo "pip install ./gpu_client/python failed: $(tail -n 3 "$log" | tr '\n' ' ')" ;;
  esac
}

make_venv "$venv"; rc=$?
[ $rc -ne 0 ] && skip_all "$(why $rc "$venv")"

if [ "${MOERPC_TEST_SGLANG:-0}" = 1 ]; then
  sv=$BUILD/venv-sglang
  make_venv "$sv"; rc=$?
  if [ $rc -ne 0 ]; then
    export MOERPC_SGLANG_SKIP="$(why $rc "$sv")"
  elif ! bash tests/integration/py/sglang_venv.sh "$sv" >>"$log" 2>&1; then
    export MOERPC_SGLANG_SKIP="installing sglang-kt failed: $(tail -n 2 "$log" | tr '\n' ' ')"
  else
    export MOERPC_SGLANG_PY=$sv/bin/python
  fi
fi

exec "$venv/bin/python" tests/integration/test_python_wrapper.py
