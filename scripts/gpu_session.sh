#!/usr/bin/env bash
# The GPU checks on a machine whose python3 has torch, transformers and triton but not the rest of raylm's
# dependencies and no network (the device tool's machines). The offline path needs none of Ray, FastAPI or uvicorn,
# only pydantic and its three helpers, gguf (the loader's block formats), xgrammar with its tvm-ffi and llguidance (the
# grammar backends): `wheels` downloads them here into .whl/ (ignored by git; ~10 MB, for the target's Python), `run`
# installs them there and runs the GPU tests and scripts/gpu_check.py, writing to $OUT when it is set.
#   here:  scripts/gpu_session.sh wheels [python-version, default 3.12]
#   there: scripts/gpu_session.sh run [gpu_check.py's arguments, e.g. --sections 3 4]   (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0
        xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1)
case "${1:-}" in
  wheels)
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${2:-3.12}" --implementation cp \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "${WHEELS[@]}" && ls .whl ;;
  run)
    # The gpu tests (<= 150 s) and gpu_check (a 270 s budget for starting sections, 330 s at most): the whole run
    # took 190-230 s on an H200 (2026-12-04: the tests 45 s, gpu_check 145-175 s), the start-up aside.
    out="${OUT:-/tmp/gpu-session}"; mkdir -p "$out"
    if ! python3 -c "import pydantic, gguf, xgrammar, llguidance" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
      export PYTHONPATH=/tmp/site
    fi
    export PYTHONUNBUFFERED=1
    start=$SECONDS
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_graph.py tests/test_gpu_no_sync.py \
      tests/test_attention_flash.py tests/test_attention_triton.py tests/test_triton_block_gemm.py \
      tests/test_hybrid_kv.py 2>&1 \
      | tee "$out/pytest-gpu.log"
    tests=${PIPESTATUS[0]}
    timeout 330 python3 scripts/gpu_check.py --budget-s 270 --output-json "$out/gpu_check.json" "${@:2}" 2>&1 \
      | tee "$out/gpu_check.log"
    check=${PIPESTATUS[0]}
    echo "gpu tests exit $tests, gpu_check exit $check, $((SECONDS - start)) s" | tee "$out/summary.txt"
    [ "$tests" -eq 0 ] && [ "$check" -eq 0 ] ;;
  *) echo "usage: $0 wheels [python-version] | run" >&2; exit 2 ;;
esac
