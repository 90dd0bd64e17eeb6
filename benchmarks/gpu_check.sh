#!/usr/bin/env bash
# GPU checks in one command, within BUDGET_S (450 s: a 15-minute loan leaves room for start-up and a
# rerun), the most telling first and what the budget does not reach skipped and said: the engine's correctness
# tests on CUDA (every scheduling scenario, fp32 exact and bf16 within noise, against transformers;
# their decode steps replayed as CUDA graphs, and the same steps eager in step_profile's A/B), the
# Triton kernels' tests (where this tree has them), the engine benchmark on the `small` preset in
# fp32 and bf16, and, given a model folder, a decode step on it (under torch.profiler too: where a
# GPU step's host time goes), its roofline (with async scheduling, then the synchronous loop to show
# what overlapping the host buys; decode steps at 128 and 512 rows of 1,024 tokens beside
# bytes / copy bandwidth and FLOPs / matmul rate, a 4k-token prefill's MFU) and the benchmark suite,
# then the roofline and suite on a 1B-class model under its tokenizer, every new figure beside the
# 2026-12-04 ones (benchmarks/gpu_baseline_2026-12-04.json); MoE decode steps as CUDA graphs (grouped_mm
# over stacked experts) against eager ones on a locally built Mixtral-shaped checkpoint; batch
# invariance (its property test on the GPU, its cost on the suite); with 2+ GPUs,
# tensor parallel (TP=2 exact with TP=1, a dead rank failing cleanly, TP=2 vs TP=1 timed). Every
# figure goes to one file.
#
#   bash benchmarks/gpu_check.sh [MODEL]
#
# MODEL: a model folder. Without weights in it (config.json and the tokenizer only: what fits the
# device machine's small working tree), the model is benched with random weights in its shape
# (benchmarks/shaped_checkpoint.py), which measure its speed as well as its own weights would.
# Needs only torch, transformers, tokenizers, safetensors and pytest (what a CUDA PyTorch image
# has): the service stack is not loaded (tests/conftest.py, BULKINFER_TEST_DEVICE). Results go to
# $OUT/gpu_check.txt when OUT is set (the device tool's folder), else benchmarks/gpu_check.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT_DIR="${OUT:-benchmarks}"
REPORT="$REPORT_DIR/gpu_check.txt"
MODEL="${1:-}"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu: a smoke run of this script on a machine without a GPU
REQUESTS="${REQUESTS:-256}"
SCALE="${SCALE:-1}"        # suite request counts x this
INVARIANT_SCALE="${INVARIANT_SCALE:-0.25}"  # the batch-invariance cost's suite runs (two of them)
BIG_SHAPE="${BIG_SHAPE:-hidden_size=2048 num_hidden_layers=16 num_attention_heads=32 num_key_value_heads=8 intermediate_size=8192}"
# On a GPU the roofline's defaults (128 and 512 rows, 1,024 tokens of context, a 4,096-token prefill);
# a CPU smoke run only checks that it runs (fp32: bf16 crawls on a CPU without native bf16).
ROOFLINE_ARGS=(--dtype bfloat16)
[ "$DEVICE" = cpu ] && ROOFLINE_ARGS=(--dtype float32 --rows 1,2 --context 32 --prefill-tokens 32 --warmup 0 --steps 1 --prefill-reps 1)
export BULKINFER_TEST_DEVICE="$DEVICE" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
SCRATCH="$(mktemp -d)"
status=0
BUDGET_S="${BUDGET_S:-450}"  # the whole check; what is left when it is spent is skipped, and said
START=$SECONDS

# run LIMIT CMD...: CMD under a timeout of LIMIT seconds or what is left of the budget, whichever
# is less; skipped (status 1) once under 15 s are left.
run() {
  local limit=$1 left
  shift
  left=$((BUDGET_S - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then
    echo "(skipped: the check's $BUDGET_S s are spent) $*"
    status=1
    return 1
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout "$limit" "$@" || { status=1; return 1; }
}

has_weights() { [ -e "$1/model.safetensors" ] || [ -e "$1/model.safetensors.index.json" ]; }

{
  echo "== bulkinfer GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" || exit 1

  # Sections in order of what a short GPU loan must answer first: are the compiled kernels and the
  # engine on them correct, how close is a decode step to its roofline (and to the PyTorch path it
  # replaced), then throughput beside 2026-12-04's, then the rest.
  echo; echo "== Triton kernels on $DEVICE"
  triton_tests=()
  for file in tests/engine/test_triton_attention.py tests/engine/test_gpu_layer_ops.py tests/engine/test_triton_engine.py \
      tests/engine/test_mixed_graphs.py; do
    [ -e "$file" ] && triton_tests+=("$file")
  done
  if [ "${#triton_tests[@]}" -gt 0 ]; then
    run 120 "$PY" -m pytest -q -p no:cacheprovider "${triton_tests[@]}"
  else
    echo "(no Triton kernel tests in this tree)"
  fi

  echo; echo "== engine correctness on $DEVICE (the Triton path where triton imports: its default on CUDA)"
  run 200 "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/engine/test_llm_correctness.py tests/engine/test_model_vs_transformers.py \
    tests/engine/test_decode_graphs.py

  if [ -n "$MODEL" ]; then
    rm -f "$REPORT_DIR/gpu_suite.json" "$REPORT_DIR/gpu_suite_big.json"  # never compare a stale run's
    if ! has_weights "$MODEL"; then
      echo; echo "== random weights in the shape of $MODEL"
      run 60 "$PY" -m bulkinfer.benchmarks.shaped_checkpoint "$MODEL" "$SCRATCH/model" --device "$DEVICE"
      bench_model="$SCRATCH/model"
    else
      bench_model="$MODEL"
    fi
    # Decode steps at 128 and 512 rows of 1,024 tokens beside their roofline, a 4k prefill's MFU:
    # the default path, then the PyTorch attention path it replaced (today's path as it was).
    echo; echo "== roofline on $DEVICE: $MODEL"
    run 60 "$PY" -m bulkinfer.benchmarks.roofline --model "$bench_model" --device "$DEVICE" \
      "${ROOFLINE_ARGS[@]}" --json "$REPORT_DIR/gpu_roofline.json"
    echo; echo "== roofline on $DEVICE, the synchronous loop (async_scheduling off): $MODEL"
    run 60 "$PY" -m bulkinfer.benchmarks.roofline --model "$bench_model" --device "$DEVICE" \
      "${ROOFLINE_ARGS[@]}" --async-scheduling off --json "$REPORT_DIR/gpu_roofline_sync.json"
    echo; echo "== roofline on $DEVICE, PyTorch attention (triton_kernels off): $MODEL"
    run 60 "$PY" -m bulkinfer.benchmarks.roofline --model "$bench_model" --device "$DEVICE" \
      "${ROOFLINE_ARGS[@]}" --triton-kernels off --json "$REPORT_DIR/gpu_roofline_torch.json"
    echo; echo "== roofline and suite on $DEVICE, bfloat16: $BIG_SHAPE under $MODEL's tokenizer"
    # shellcheck disable=SC2086  # BIG_SHAPE is a list of NAME=VALUE words
    if run 60 "$PY" -m bulkinfer.benchmarks.shaped_checkpoint "$MODEL" "$SCRATCH/big" --device "$DEVICE" --set $BIG_SHAPE \
        && [ -e "$SCRATCH/big/config.json" ]; then
      run 60 "$PY" -m bulkinfer.benchmarks.roofline --model "$SCRATCH/big" --device "$DEVICE" \
        "${ROOFLINE_ARGS[@]}" --json "$REPORT_DIR/gpu_roofline_big.json"
      run 100 "$PY" -m bulkinfer.benchmarks.suite --model "$SCRATCH/big" --device "$DEVICE" --dtype bfloat16 \
        --scale "$SCALE" --json "$REPORT_DIR/gpu_suite_big.json"
    else
      status=1
    fi
    echo; echo "== suite on $DEVICE: $MODEL (scale $SCALE)"
    run 130 "$PY" -m bulkinfer.benchmarks.suite --model "$bench_model" --device "$DEVICE" --dtype bfloat16,float32 \
      --scale "$SCALE" --json "$REPORT_DIR/gpu_suite.json"
    echo; echo "== suite output tok/s beside 2026-12-04's"
    "$PY" -m bulkinfer.benchmarks.gpu_baseline "$bench_model=$REPORT_DIR/gpu_suite.json" \
      "$SCRATCH/big=$REPORT_DIR/gpu_suite_big.json" || status=1
    echo; echo "== decode step on $DEVICE: $MODEL"
    # At 128 rows under torch.profiler too: the ops by host time and the syncs a step makes.
    run 40 "$PY" -m bulkinfer.benchmarks.step_profile --model "$bench_model" --device "$DEVICE" --dtype bfloat16 \
      --rows 128 --steps 20 --trace
    run 30 "$PY" -m bulkinfer.benchmarks.step_profile --model "$bench_model" --device "$DEVICE" --dtype bfloat16 \
      --rows 512 --steps 20
  fi

  echo; echo "== engine benchmark on $DEVICE (small preset)"
  run 80 "$PY" -m bulkinfer.benchmarks.engine --preset small --device "$DEVICE" --dtype float32,bfloat16 \
    --requests "$REQUESTS" --max-tokens 64 --workloads shared,unique --baseline-batch 64

  # Batch invariance with batch_invariant=True: its property test on the device, its cost on the suite.
  echo; echo "== batch invariance on $DEVICE"
  run 150 env DEVICE="$DEVICE" PYTHON="$PY" INVARIANT_SCALE="$INVARIANT_SCALE" bash benchmarks/batch_invariance_check.sh

  # MoE: the fixed-shape path's tests (transformers' tokens on every MoE family, captured where
  # grouped_mm records: bf16 on sm90+), then a Mixtral-shaped checkpoint (8 experts, top-2) decoded
  # with CUDA graphs and eagerly: tokens compared, tokens/s of each.
  echo; echo "== MoE decode steps as CUDA graphs on $DEVICE"
  run 120 "$PY" -m pytest -q -p no:cacheprovider -x tests/engine/test_moe_fixed_shape.py
  run 120 "$PY" -m bulkinfer.benchmarks.moe_graphs --device "$DEVICE" --preset small --dtype bfloat16,float32 \
    --requests "$REQUESTS" --max-tokens 64

  # Tensor parallel where the machine lends 2+ GPUs: TP=2 token-exact with TP=1 in fp32 (prefix hits,
  # chunked prefill, preemption), a rank's death failing the engine, then TP=2 against TP=1 timed.
  GPUS="$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" || echo 0)"
  if [ "$DEVICE" = cuda ] && [ "${GPUS:-0}" -ge 2 ]; then
    echo; echo "== tensor parallel on $DEVICE: 2 of $GPUS GPUs"
    # The 4-rank test (KV heads replicated) needs 4 GPUs.
    only=(); [ "$GPUS" -ge 4 ] || only=(-k "not four_ranks")
    run 180 "$PY" -m pytest -q -p no:cacheprovider -x tests/engine/test_tensor_parallel.py "${only[@]}"
    run 120 "$PY" -m bulkinfer.benchmarks.engine --preset small --device "$DEVICE" --dtype bfloat16 \
      --tensor-parallel-size 1,2 --no-baseline --requests "$REQUESTS" --max-tokens 64 --workloads unique
  else
    echo; echo "== tensor parallel: not run ($GPUS GPU(s) here; TP=2 needs 2)"
  fi
  rm -rf "$SCRATCH"
  echo; echo "== exit status $status"
  exit "$status"
} 2>&1 | tee "$REPORT"
exit "${PIPESTATUS[0]}"
