#!/usr/bin/env bash
# sglang_venv.sh VENV - adds sglang-kt to a venv made by python_wrapper.sh, without its
# dependency list (sglang-kt pins torch 2.9.1, flashinfer, triton, ...: gigabytes, and CUDA
# builds that cannot run here). Instead it imports sglang's kt_ep_wrapper and installs, one
# at a time and --no-deps, each module the import reports missing (at most 60 rounds); it
# stops at the first error that is not a missing module and prints it. Only for the opt-in
# case (MOERPC_TEST_SGLANG=1); the venv is kept under build/ for the next run.
set -uo pipefail
v=$(realpath "$1")
py=$v/bin/python
SGLANG_VERSION=0.7.2
"$py" -c "import importlib.metadata as m; m.version('sglang-kt')" 2>/dev/null ||
  "$py" -m pip install -q --no-deps "sglang-kt==$SGLANG_VERSION" || exit 1
# sgl_kernel (in the kt-kernel wheel) assembles its CUDA objects from payload modules carried
# by these wheels (PyPI's per-file size limit); without them its import reports common_ops.
"$py" -c "import ktransformers_sgl_kernel_payload, transformers_kt_sgl_kernel_payload, accelerate_kt_sgl_kernel_payload" 2>/dev/null ||
  "$py" -m pip install -q --no-deps "ktransformers==$SGLANG_VERSION" transformers-kt==5.6.0.post6 \
      accelerate-kt==1.14.0.post4 || exit 1
# module name -> PyPI name where they differ
declare -A dist=([yaml]=PyYAML [PIL]=pillow [zmq]=pyzmq [google]=protobuf [sentencepiece]=sentencepiece
  [msgspec]=msgspec [pybase64]=pybase64 [orjson]=orjson [uvloop]=uvloop [setproctitle]=setproctitle
  [partial_json_parser]=partial_json_parser [sklearn]=scikit-learn [cv2]=opencv-python-headless
  [transformers]=transformers-kt==5.6.0.post6 [accelerate]=accelerate-kt==1.14.0.post4
  [compressed_tensors]=compressed-tensors [triton]=triton [grpc]=grpcio [attr]=attrs
  [dateutil]=python-dateutil [multipart]=python-multipart [openai_harmony]=openai-harmony==0.0.4
  [llguidance]=llguidance [outlines]=outlines==0.1.11 [huggingface_hub]=huggingface_hub
  [tvm_ffi]=apache-tvm-ffi==0.1.11 [transformers_kt_sgl_kernel_payload]=transformers-kt==5.6.0.post6 [pynvml]=nvidia-ml-py [einops]=einops)
for i in $(seq 1 60); do
  out=$(cd /tmp && MOERPC_SGLANG_HOOK=1 "$py" -c "import sglang.srt.layers.moe.kt_ep_wrapper" 2>&1)
  [ $? -eq 0 ] && { echo "kt_ep_wrapper imports after $((i - 1)) installs"; exit 0; }
  if [[ $out == *libcuda.so* ]]; then  # a GPU driver is needed: nothing to install
    printf '%s\n' "$out" | grep -m1 libcuda; echo "kt_ep_wrapper needs a GPU driver to import"
    exit 0
  fi
  mod=$(printf '%s\n' "$out" | sed -n "s/.*ModuleNotFoundError: No module named '\([^'.]*\).*/\1/p" | tail -n 1)
  spec=$(printf '%s\n' "$out" | sed -n 's/^ImportError: \([^ ]*\) is required for a normal functioning.*/\1/p' | tail -n 1)
  if [ -z "$mod" ] && [ -n "$spec" ]; then  # transformers' own version pins
    echo "# $spec required: pip install --no-deps $spec"
    "$py" -m pip install -q --no-deps "$spec" || { echo "pip install $spec failed"; exit 1; }
    continue
  fi
  if [ -z "$mod" ]; then
    printf '%s\n' "$out" | tail -n 5
    echo "kt_ep_wrapper does not import (not a missing module, see above)"
    exit 0  # the test records the exact reason
  fi
  pkg=${dist[$mod]:-$mod}
  echo "# $mod missing: pip install --no-deps $pkg"
  "$py" -m pip install -q --no-deps "$pkg" || { echo "pip install $pkg failed"; exit 1; }
done
echo "kt_ep_wrapper: still missing modules after 60 installs"
exit 0
