#!/usr/bin/env bash
# Batch invariance (issue 45) on a device, engine option batch_invariant=True: the property test
# (hypothesis-drawn schedules, a row's tokens and logprobs bitwise its own alone; llama fp32/bf16,
# qwen3-MoE bf16) and the fixed-shape ops' tests on $DEVICE (their CPU cases, native kernels off, run
# too; the CUDA ones skip without a GPU), then `bench suite` with batch invariance off and on: each
# dtype's wall and the ratio. A step of benchmarks/gpu_check.sh; alone (DEVICE=cpu: a smoke run):
#
#   DEVICE=cuda bash benchmarks/batch_invariance_check.sh
#
# The tests need hypothesis (pure Python; a CUDA PyTorch image may lack it: pip install hypothesis).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
PY="${PYTHON:-python3}"
INVARIANT_SCALE="${INVARIANT_SCALE:-0.25}"  # the suite's request counts x this, in each of its two runs
export BULKINFER_TEST_DEVICE="$DEVICE" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
status=0

if "$PY" -c "import hypothesis" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -x -rs \
    tests/engine/test_batch_invariance_torch.py tests/engine/test_invariant_ops.py || status=1
else
  echo "hypothesis is not installed (pip install hypothesis): the property test did not run"; status=1
fi
for mode in off on; do
  timeout 150 "$PY" -m bulkinfer.benchmarks.suite --preset small --device "$DEVICE" --dtype bfloat16,float32 \
    --scale "$INVARIANT_SCALE" --batch-invariant "$mode" --json "$SCRATCH/invariant_$mode.json" || status=1
done
"$PY" -m bulkinfer.benchmarks.invariance_cost "$SCRATCH/invariant_off.json" "$SCRATCH/invariant_on.json" || status=1
exit "$status"
