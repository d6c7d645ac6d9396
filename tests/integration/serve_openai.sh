#!/usr/bin/env bash
# tests/integration/serve_openai.sh - moerpc-client serve against the `openai` Python package
# and raw sockets (the cases are in serve_openai.py, which says what each proves). This
# script finds the Python environment: deploy/py-env.sh's venv (openai, transformers), made
# or topped up when missing; a machine whose disk cannot hold it is a SKIP naming the
# reason, a pip failure a FAIL.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
VENV=${MOERPC_CONF_VENV:-.venv-conf}
bash deploy/py-env.sh "$VENV"
rc=$?
if [ $rc -eq 3 ]; then
  echo "skip serve_openai.all: the Python environment was not made (disk; see the py-env line above)"
  echo "serve_openai: 0 passed, 0 failed, 1 skipped"
  exit 0
fi
if [ $rc -ne 0 ]; then
  echo "FAIL serve_openai.venv: deploy/py-env.sh $VENV exited $rc"
  echo "serve_openai: 0 passed, 1 failed, 0 skipped"
  exit 1
fi
exec "$VENV/bin/python" tests/integration/serve_openai.py "$BUILD"
