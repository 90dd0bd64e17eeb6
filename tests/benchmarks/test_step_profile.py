"""`bulkinfer bench step`: a decode step's time split into the parts of a step, summing to the whole."""

from __future__ import annotations

import re

import pytest

from bulkinfer.benchmarks.step_profile import CATEGORIES, bench_cli, function_name


def test_cprofile_labels_reduce_to_the_function_names_the_categories_list() -> None:
    assert function_name("<built-in method torch._ops.mkldnn._linear_pointwise>") == "_linear_pointwise"
    assert function_name("<method 'index_select' of 'torch._C.TensorBase' objects>") == "index_select"
    assert function_name("decode_attention") == "decode_attention"
    assert "_linear_pointwise" in CATEGORIES["matmul"] and "decode_attention" in CATEGORIES["attention"]
    # every native attention kernel: fp32 decode groups attend their shared prefix through the
    # causal one, which had been left out and counted as "other" (~57 ms of a 470 ms step)
    assert {"decode_attention", "prefix_attention", "causal_attention"} <= set(CATEGORIES["attention"])


def test_a_step_profile_names_every_part_and_the_shares_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli(["--preset", "tiny", "--dtype", "float32", "--rows", "16", "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "16 rows decoding" in printed and re.search(r"decode step: [\d.]+ ms plain", printed)
    assert re.search(r"Python path [\d.]+ ms plain", printed)  # the native path's step beside it
    shares = dict(re.findall(r"^\| ([a-z][^|]*?) \| [\d.]+ \| (\d+)% \|$", printed, re.M))
    assert set(shares) == {*CATEGORIES, "other (Python, glue)"}
    assert int(shares["matmul"]) > 0 and int(shares["attention"]) > 0
    assert 97 <= sum(map(int, shares.values())) <= 103  # rounded shares of one whole


def test_a_trace_lists_the_ops_by_host_time_and_counts_syncs_per_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli(["--preset", "tiny", "--dtype", "float32", "--rows", "8", "--steps", "2",
                      "--trace"]) == 0
    printed = capsys.readouterr().out
    assert "torch.profiler over 2 decode steps" in printed and "Self CPU" in printed
    assert re.search(r"per step: [\d,]+ kernel launches; tensor reads into Python and device syncs", printed)
