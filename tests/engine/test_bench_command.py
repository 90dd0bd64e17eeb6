"""The engine benchmark command runs end to end (figures are not asserted: speed lives in
benchmarks, not tests) and reports what a user reads."""

from __future__ import annotations

import re

import pytest

from bulkinfer.benchmarks.engine import bench_cli
from bulkinfer.engine import model_runner


@pytest.fixture(autouse=True)
def _kv_caches_mapped_on_first_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks build their engines with the default KV budget (GiBs where memory is free), and
    each maps up to kv_populate_seconds (3 s) of it at start: time, and no figure here is asserted.
    Their caches are mapped on first touch instead, as every other engine test's are
    (kv_populate_seconds=0); populating itself is tested in test_kv_memory.py."""
    populate = model_runner.populate_kv_caches
    monkeypatch.setattr(model_runner, "populate_kv_caches",
                        lambda caches, seconds, threads=None: populate(caches, 0.0, threads))


@pytest.mark.timeout(300)
def test_bench_engine_prints_both_runs_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--preset", "tiny", "--requests", "8", "--shared-len", "32", "--tail-len", "8",
                      "--max-tokens", "4", "--baseline-batch", "4"])
    out = capsys.readouterr().out
    assert code == 0
    for workload in ("shared-prefix", "no-shared-prefix"):
        assert f"workload: {workload} — 8 requests, 320 prompt tokens, 4 output tokens each" in out
    assert out.count("/ baseline output tok/s") == 2
    assert "prefix-cache hit rate" in out
    assert "cpu: native bf16 " in out and "dtype auto -> " in out


@pytest.mark.timeout(300)
def test_bench_engine_compares_dtypes_on_a_given_model(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench_cli(["--model", str(tiny_checkpoint), "--dtype", "float32,bfloat16,auto", "--no-baseline",
                      "--workloads", "shared", "--requests", "6", "--shared-len", "32", "--tail-len", "4",
                      "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"model: {tiny_checkpoint}; torch threads: " in out and "dtypes: float32, bfloat16, auto" in out
    assert "bulkinfer engine float32 " in out and "bulkinfer engine bfloat16 " in out
    assert "bulkinfer engine auto->" in out or out.count("bulkinfer engine bfloat16 ") + out.count(
        "bulkinfer engine float32 ") == 4  # auto resolved to a listed dtype: same label
    assert "bfloat16 / float32 output tok/s: " in out and "transformers" not in out


@pytest.mark.timeout(300)
def test_bench_engine_on_a_moe_checkpoint_prints_the_decode_steps_routing_and_expert_shares(
    capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench_cli(["--preset", "tiny", "--arch", "mixtral", "--dtype", "float32", "--workloads", "unique",
                      "--requests", "4", "--shared-len", "16", "--tail-len", "8", "--max-tokens", "4",
                      "--no-baseline", "--moe-profile-steps", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "mixtral-tiny" in out and "bulkinfer engine float32 " in out
    shares = re.search(r"MoE decode step \(4 rows, mean of 4\): [0-9.]+ ms, expert routing ([0-9.]+)% .*"
                       r"expert compute ([0-9.]+)% .*everything else ([0-9.-]+)%", out)
    assert shares, out
    routing, experts, rest = (float(part) for part in shares.groups())
    assert routing > 0 and experts > 0 and routing + experts + rest == pytest.approx(100, abs=0.2)


def test_bench_engine_refuses_an_unknown_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_cli(["--dtype", "float32,fp8"])
    assert exit_info.value.code == 2
    assert "--dtype: 'fp8' is not one of auto, float32, float16, bfloat16" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_bench_engine_structured_prints_both_runs_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--structured", "--preset", "tiny", "--requests", "4", "--prompt-len", "16",
                      "--max-tokens", "24", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "== structured output: 4 requests, 64 prompt tokens, 24 output tokens each" in out
    # Both sides produced every token: the schema is long enough that no output completes early.
    assert out.count("(96 tokens; best of 1)") == 2
    assert "unconstrained" in out and "json_schema" in out
    assert "grammar compile (first request of the schema, then cached): " in out
    assert "structured / unconstrained output tok/s: " in out and "(target >= 0.7x: " in out


@pytest.mark.timeout(300)
def test_bench_spec_prints_each_level_the_tail_job_and_the_cost_curve(
    real_model, capsys: pytest.CaptureFixture[str]
) -> None:
    from bulkinfer.benchmarks.speculative import bench_cli as spec_cli

    code = spec_cli(["--model", str(real_model), "--levels", "1,2", "--rounds", "1", "--max-tokens", "6",
                     "--tasks", "copy-heavy", "--tail-rows", "2", "--draft-layers", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "cpu: native bf16 " in out
    assert "ngram: verify/decode step cost by running requests (4 drafts each): 1: " in out
    for level in (1, 2):
        line = next(line for line in out.splitlines() if line.startswith(f"copy-heavy, {level} running: "))
        assert "off " in line and "ngram " in line and "draft-4L " in line and "identical rows" in line
    assert "mixed-length job (2 rows of 1-10 sentences, run twice): off " in out


def test_bench_spec_refuses_an_unknown_task(capsys: pytest.CaptureFixture[str]) -> None:
    from bulkinfer.benchmarks.speculative import bench_cli as spec_cli

    with pytest.raises(SystemExit):
        spec_cli(["--tasks", "copy-heavy,typos"])
    assert "unknown tasks ['typos']" in capsys.readouterr().err


def test_bench_spec_keeps_n_requests_running_and_returns_rows_in_order(tiny_checkpoint) -> None:
    from bulkinfer.benchmarks.speculative import generate_keeping
    from bulkinfer.engine import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoint), dtype="float32", num_kv_blocks=64)
    prompts = [[5 + i, 9, 11 + i, 4] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    in_flight: list[int] = []
    step = llm.engine.step

    def counting_step() -> list:
        in_flight.append(len(llm.engine.scheduler.running) + len(llm.engine.scheduler.waiting))
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    kept = generate_keeping(llm, prompts, params, running=2)
    llm.engine.step = step  # type: ignore[method-assign]
    assert max(in_flight) == 2 and in_flight.count(2) > len(in_flight) // 2
    assert kept == [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.timeout(300)
def test_bench_engine_times_two_ranks_against_one(tiny_checkpoint,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = bench_cli(["--model", str(tiny_checkpoint), "--dtype", "float32", "--tensor-parallel-size", "1,2",
                      "--no-baseline", "--workloads", "shared", "--requests", "6", "--shared-len", "32",
                      "--tail-len", "4", "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "bulkinfer engine float32 " in out and "bulkinfer engine tp=2 float32 " in out
    assert "tp=2 / tp=1 output tok/s (float32): " in out and "rank 0 in collectives " in out
    with pytest.raises(SystemExit):
        bench_cli(["--tensor-parallel-size", "2,0"])
