#!/usr/bin/env bash
# tests/conformance/run.sh - checks the reference kernel (kernels/kn_ref.c),
# kn_moe_forward and the whole-model runner (moerpc-client logits; Qwen3-MoE, Mixtral and
# DeepSeek-V3 checkpoints) against PyTorch + transformers, the runner's tokenizer against
# the `tokenizers` package, and the chat-template interpreter against transformers' jinja2
# (tests/conformance/README.md).
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
  echo "skip conformance.all: ${why##*py-env: }"; echo "conformance: 0 passed, 0 failed, 1 skipped"; exit 0
elif [ $rc -ne 0 ]; then
  echo "$why" >&2; exit 1
fi

make -s BUILD="$BUILD" SANITIZER="${SANITIZER:-}" "$BUILD/tests/kn_ref_cli" "$BUILD/lib/libmr.a" \
  "$BUILD/bin/moerpc-mkmodel" "$BUILD/bin/moerpc-client" "$BUILD/tests/tok_cli" "$BUILD/tests/tmpl_cli"
# Each check prints its own cases and ends with "<check>: N passed, N failed[, N skipped]";
# the last line here is their sum, "conformance: ...", the one tests/run.sh counts. A check
# that ends without its line counts as one failure.
rc=0 P=0 F=0 S=0
check() { # script args...
  local out line p f s=0 src=$1
  out=$(mktemp)
  "$VENV/bin/python" "$@" 2>&1 | tee "$out"
  local st=${PIPESTATUS[0]}
  line=$(grep -E '^([A-Za-z0-9_.-]+: )?[0-9]+ passed, [0-9]+ failed(, [0-9]+ skipped)?$' "$out" | tail -n 1)
  rm -f "$out"
  if [ -z "$line" ]; then
    echo "FAIL conformance.$(basename "$src" .py): no summary line (exit $st)"; F=$((F + 1)); rc=1; return
  fi
  line=${line#*: }  # (no-op without a prefix)
  p=${line%% passed*}; f=${line#*passed, }; f=${f%% failed*}
  [[ $line == *skipped ]] && { s=${line##*failed, }; s=${s%% skipped}; }
  P=$((P + p)); F=$((F + f)); S=$((S + s))
  if [ "$st" -ne 0 ]; then rc=1; [ "$f" -eq 0 ] && F=$((F + 1)); fi
}
check tests/conformance/test_kn_ref_torch.py --cli "$BUILD/tests/kn_ref_cli"
check tests/conformance/test_safetensors_python.py --build "$BUILD"
check tests/conformance/test_fp8_loading.py --build "$BUILD"
check tests/conformance/test_mkmodel_deepseek.py --build "$BUILD"
check tests/conformance/test_model_logits.py --client "$BUILD/bin/moerpc-client"
check tests/conformance/test_deepseek_logits.py --client "$BUILD/bin/moerpc-client"
check tests/conformance/test_tokenizer_hf.py --cli "$BUILD/tests/tok_cli"
check tests/conformance/test_chat_template_jinja.py --cli "$BUILD/tests/tmpl_cli"
echo "conformance: $P passed, $F failed, $S skipped"
exit $rc
