#!/usr/bin/env bash
# tests/conformance/run.sh - checks the reference kernel (kernels/kn_ref.c),
# kn_moe_forward, the whole-model runner (moerpc-client logits; Qwen3-MoE, Mixtral and
# DeepSeek-V3 checkpoints) and the chat-template interpreter against PyTorch +
# transformers (tests/conformance/README.md).
#
#   tests/conformance/run.sh            uses/creates the venv $MOERPC_CONF_VENV (.venv-conf)
#   BUILD=build/x tests/conformance/run.sh
#
# Builds $BUILD/tests/kn_ref_cli, makes the venv when it is missing (deploy/py-env.sh: the
# pinned packages, about 1 minute and 2.4 GB), then runs the check. Exits non-zero on any
# mismatch; each script ends with its own "...: N passed, N failed" line. A disk too full
# for the venv is one SKIP naming the free space, never a pass.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
VENV=${MOERPC_CONF_VENV:-.venv-conf}

rc=0; why=$(bash deploy/py-env.sh "$VENV" 2>&1) || rc=$?
if [ $rc -eq 3 ]; then
  echo "skip conformance.all: ${why##*py-env: }"; echo "0 passed, 0 failed, 1 skipped"; exit 0
elif [ $rc -ne 0 ]; then
  echo "$why" >&2; exit 1
fi

make -s BUILD="$BUILD" SANITIZER="${SANITIZER:-}" "$BUILD/tests/kn_ref_cli" "$BUILD/lib/libmr.a" \
  "$BUILD/bin/moerpc-mkmodel" "$BUILD/bin/moerpc-client" "$BUILD/tests/tmpl_cli"
rc=0
"$VENV/bin/python" tests/conformance/test_kn_ref_torch.py --cli "$BUILD/tests/kn_ref_cli" || rc=1
"$VENV/bin/python" tests/conformance/test_safetensors_python.py --build "$BUILD" || rc=1
"$VENV/bin/python" tests/conformance/test_fp8_loading.py --build "$BUILD" || rc=1
"$VENV/bin/python" tests/conformance/test_mkmodel_deepseek.py --build "$BUILD" || rc=1
"$VENV/bin/python" tests/conformance/test_model_logits.py --client "$BUILD/bin/moerpc-client" || rc=1
"$VENV/bin/python" tests/conformance/test_deepseek_logits.py --client "$BUILD/bin/moerpc-client" || rc=1
"$VENV/bin/python" tests/conformance/test_chat_template_jinja.py --cli "$BUILD/tests/tmpl_cli" || rc=1
exit $rc
