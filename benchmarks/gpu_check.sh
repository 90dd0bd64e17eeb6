#!/usr/bin/env bash
# GPU checks in one command, under 8 minutes on one H100/H200-class GPU: the engine's correctness
# tests on CUDA (every scheduling scenario, fp32 exact and bf16 within noise, against transformers),
# then the engine benchmark in fp32 and bf16. Every figure goes to one file.
#
#   bash benchmarks/gpu_check.sh [MODEL]     MODEL: a model folder (default: the `small` preset)
#
# Needs only torch, transformers, tokenizers, safetensors and pytest (what a CUDA PyTorch image
# has): the service stack is not loaded (tests/conftest.py, BULKINFER_TEST_DEVICE). Results go to
# $OUT/gpu_check.txt when OUT is set (the device tool's folder), else benchmarks/gpu_check.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT="${OUT:-benchmarks}/gpu_check.txt"
MODEL="${1:-}"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu: a smoke run of this script on a machine without a GPU
REQUESTS="${REQUESTS:-256}"
export BULKINFER_TEST_DEVICE="$DEVICE" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
status=0

{
  echo "== bulkinfer GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" || exit 1

  echo; echo "== engine correctness on $DEVICE"
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/engine/test_llm_correctness.py tests/engine/test_model_vs_transformers.py || status=1

  echo; echo "== engine benchmark on $DEVICE"
  model_args=(--preset small)
  [ -n "$MODEL" ] && model_args=(--model "$MODEL")
  timeout 240 "$PY" -m benchmarks.engine "${model_args[@]}" --device "$DEVICE" --dtype float32,bfloat16 \
    --requests "$REQUESTS" --max-tokens 64 --workloads shared,unique --baseline-batch 64 || status=1
  echo; echo "== exit status $status"
  exit "$status"
} 2>&1 | tee "$REPORT"
exit "${PIPESTATUS[0]}"
