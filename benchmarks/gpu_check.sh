#!/usr/bin/env bash
# GPU checks in one command, under 9 minutes on one H100/H200-class GPU: the engine's correctness
# tests on CUDA (every scheduling scenario, fp32 exact and bf16 within noise, against transformers;
# their decode steps replayed as CUDA graphs, and the same steps eager in step_profile's A/B), the
# Triton kernels' tests (where this tree has them), the engine benchmark on the `small` preset in
# fp32 and bf16, and, given a model folder, a decode step on it (under torch.profiler too: where a
# GPU step's host time goes), its roofline (decode steps at 128 and 512 rows of 1,024 tokens beside
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

has_weights() { [ -e "$1/model.safetensors" ] || [ -e "$1/model.safetensors.index.json" ]; }

{
  echo "== bulkinfer GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__,
'| cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" || exit 1

  echo; echo "== engine correctness on $DEVICE"
  timeout 200 "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/engine/test_llm_correctness.py tests/engine/test_model_vs_transformers.py \
    tests/engine/test_decode_graphs.py || status=1

  # The Triton kernels against their PyTorch references; each file only where this tree has it.
  echo; echo "== Triton kernels on $DEVICE"
  triton_tests=()
  for file in tests/engine/test_triton_attention.py tests/engine/test_gpu_layer_ops.py; do
    [ -e "$file" ] && triton_tests+=("$file")
  done
  if [ "${#triton_tests[@]}" -gt 0 ]; then
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider "${triton_tests[@]}" || status=1
  else
    echo "(no Triton kernel tests in this tree)"
  fi

  echo; echo "== engine benchmark on $DEVICE (small preset)"
  timeout 80 "$PY" -m bulkinfer.benchmarks.engine --preset small --device "$DEVICE" --dtype float32,bfloat16 \
    --requests "$REQUESTS" --max-tokens 64 --workloads shared,unique --baseline-batch 64 || status=1

  # Batch invariance with batch_invariant=True: its property test on the device, its cost on the suite.
  echo; echo "== batch invariance on $DEVICE"
  DEVICE="$DEVICE" PYTHON="$PY" INVARIANT_SCALE="$INVARIANT_SCALE" bash benchmarks/batch_invariance_check.sh || status=1

  # MoE: the fixed-shape path's tests (transformers' tokens on every MoE family, captured where
  # grouped_mm records: bf16 on sm90+), then a Mixtral-shaped checkpoint (8 experts, top-2) decoded
  # with CUDA graphs and eagerly: tokens compared, tokens/s of each.
  echo; echo "== MoE decode steps as CUDA graphs on $DEVICE"
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider -x tests/engine/test_moe_fixed_shape.py || status=1
  timeout 120 "$PY" -m bulkinfer.benchmarks.moe_graphs --device "$DEVICE" --preset small --dtype bfloat16,float32 \
    --requests "$REQUESTS" --max-tokens 64 || status=1

  # Tensor parallel where the machine lends 2+ GPUs: TP=2 token-exact with TP=1 in fp32 (prefix hits,
  # chunked prefill, preemption), a rank's death failing the engine, then TP=2 against TP=1 timed.
  GPUS="$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" || echo 0)"
  if [ "$DEVICE" = cuda ] && [ "${GPUS:-0}" -ge 2 ]; then
    echo; echo "== tensor parallel on $DEVICE: 2 of $GPUS GPUs"
    # The 4-rank test (KV heads replicated) needs 4 GPUs.
    only=(); [ "$GPUS" -ge 4 ] || only=(-k "not four_ranks")
    timeout 180 "$PY" -m pytest -q -p no:cacheprovider -x tests/engine/test_tensor_parallel.py "${only[@]}" || status=1
    timeout 120 "$PY" -m bulkinfer.benchmarks.engine --preset small --device "$DEVICE" --dtype bfloat16 \
      --tensor-parallel-size 1,2 --no-baseline --requests "$REQUESTS" --max-tokens 64 --workloads unique || status=1
  else
    echo; echo "== tensor parallel: not run ($GPUS GPU(s) here; TP=2 needs 2)"
  fi

  if [ -n "$MODEL" ]; then
    rm -f "$REPORT_DIR/gpu_suite.json" "$REPORT_DIR/gpu_suite_big.json"  # never compare a stale run's
    if ! has_weights "$MODEL"; then
      echo; echo "== random weights in the shape of $MODEL"
      timeout 60 "$PY" -m bulkinfer.benchmarks.shaped_checkpoint "$MODEL" "$SCRATCH/model" --device "$DEVICE" || status=1
      bench_model="$SCRATCH/model"
    else
      bench_model="$MODEL"
    fi
    echo; echo "== decode step on $DEVICE: $MODEL"
    # At 128 rows under torch.profiler too: the ops by host time and the syncs a step makes.
    timeout 40 "$PY" -m bulkinfer.benchmarks.step_profile --model "$bench_model" --device "$DEVICE" --dtype bfloat16 \
      --rows 128 --steps 20 --trace || status=1
    timeout 30 "$PY" -m bulkinfer.benchmarks.step_profile --model "$bench_model" --device "$DEVICE" --dtype bfloat16 \
      --rows 512 --steps 20 || status=1
    # Meant to take under its 60 s per shape (not yet run on a GPU): mostly the 512 x 1,024-token
    # prefill its steps need.
    echo; echo "== roofline on $DEVICE: $MODEL"
    timeout 60 "$PY" -m bulkinfer.benchmarks.roofline --model "$bench_model" --device "$DEVICE" \
      "${ROOFLINE_ARGS[@]}" --json "$REPORT_DIR/gpu_roofline.json" || status=1
    echo; echo "== suite on $DEVICE: $MODEL (scale $SCALE)"
    timeout 130 "$PY" -m bulkinfer.benchmarks.suite --model "$bench_model" --device "$DEVICE" --dtype bfloat16,float32 \
      --scale "$SCALE" --json "$REPORT_DIR/gpu_suite.json" || status=1
    echo; echo "== roofline and suite on $DEVICE, bfloat16: $BIG_SHAPE under $MODEL's tokenizer"
    # shellcheck disable=SC2086  # BIG_SHAPE is a list of NAME=VALUE words
    if timeout 60 "$PY" -m bulkinfer.benchmarks.shaped_checkpoint "$MODEL" "$SCRATCH/big" --device "$DEVICE" --set $BIG_SHAPE; then
      timeout 60 "$PY" -m bulkinfer.benchmarks.roofline --model "$SCRATCH/big" --device "$DEVICE" \
        "${ROOFLINE_ARGS[@]}" --json "$REPORT_DIR/gpu_roofline_big.json" || status=1
      timeout 100 "$PY" -m bulkinfer.benchmarks.suite --model "$SCRATCH/big" --device "$DEVICE" --dtype bfloat16 \
        --scale "$SCALE" --json "$REPORT_DIR/gpu_suite_big.json" || status=1
    else
      status=1
    fi
    echo; echo "== suite output tok/s beside 2026-12-04's"
    "$PY" -m bulkinfer.benchmarks.gpu_baseline "$bench_model=$REPORT_DIR/gpu_suite.json" \
      "$SCRATCH/big=$REPORT_DIR/gpu_suite_big.json" || status=1
  fi
  rm -rf "$SCRATCH"
  echo; echo "== exit status $status"
  exit "$status"
} 2>&1 | tee "$REPORT"
exit "${PIPESTATUS[0]}"
