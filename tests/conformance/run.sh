#!/usr/bin/env bash
# tests/conformance/run.sh - checks the reference kernel (kernels/kn_ref.c),
# kn_moe_forward and the whole-model runner (moerpc-client logits) against PyTorch +
# transformers (tests/conformance/README.md).
#
#   tests/conformance/run.sh            uses/creates the venv $MOERPC_CONF_VENV (.venv-conf)
#   BUILD=build/x tests/conformance/run.sh
#
# Builds $BUILD/tests/kn_ref_cli, installs the pinned Python packages into the venv when
# they are missing (about 1 minute and 5.5 GB: PyPI's torch wheel pulls the CUDA runtime
# libraries, which it needs even to import on CPU), then runs the check. Exits non-zero
# on any mismatch; each script ends with its own "...: N passed, N failed" line.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
VENV=${MOERPC_CONF_VENV:-.venv-conf}
PY_PKGS=(torch==2.15.0 transformers==5.24.0 safetensors==0.8.0 numpy)

if ! "$VENV/bin/python" -c 'import torch, transformers, safetensors' >/dev/null 2>&1; then
  echo "conformance: installing ${PY_PKGS[*]} into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PKGS[@]}"
fi

make -s BUILD="$BUILD" SANITIZER="${SANITIZER:-}" "$BUILD/tests/kn_ref_cli" "$BUILD/lib/libmr.a" \
  "$BUILD/bin/moerpc-mkmodel" "$BUILD/bin/moerpc-client"
rc=0
"$VENV/bin/python" tests/conformance/test_kn_ref_torch.py --cli "$BUILD/tests/kn_ref_cli" || rc=1
"$VENV/bin/python" tests/conformance/test_safetensors_python.py --build "$BUILD" || rc=1
"$VENV/bin/python" tests/conformance/test_model_logits.py --client "$BUILD/bin/moerpc-client" || rc=1
exit $rc
