"""`bulkinfer bench embed` runs end to end on a tiny sentence-transformers checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bulkinfer.benchmarks.cli import main
from bulkinfer.benchmarks.embed_corpus import mixed_length_texts
from tests.fixtures.encoder_checkpoints import build_sentence_transformer


def test_bench_embed_prints_both_rates_the_ratio_and_the_worst_cosine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = build_sentence_transformer(tmp_path, max_seq_length=48)
    code = main(["embed", "--model", str(folder), "--texts", "24", "--dtype", "float32",
                 "--batch-sizes", "4,8", "--probe-texts", "12"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("machine: ") and "cores" in out
    assert "texts: 24, tokens per text" in out
    row = re.search(r"\| float32 \| ([\d,.]+) \| ([\d,.]+) \(batch (4|8)\) \| ([\d.]+)x \| ([\d.]+) \| - \|",
                    out)
    assert row, out
    ours, reference, _, ratio, cosine = row.groups()
    assert float(ours.replace(",", "")) > 0 and float(reference.replace(",", "")) > 0
    assert abs(float(ratio) - float(ours.replace(",", "")) / float(reference.replace(",", ""))) < 0.01
    assert 0.99999 <= float(cosine) <= 1.000001


def test_the_corpus_spreads_over_the_asked_token_lengths(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_sentence_transformer(tmp_path)))
    texts = mixed_length_texts(tokenizer, 200, min_tokens=5, max_tokens=40, seed=1)
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    assert min(lengths) >= 4 and max(lengths) <= 42  # decode/re-encode may move a cut by a token
    assert len(set(lengths)) >= 25  # spread, not one length
    assert texts == mixed_length_texts(tokenizer, 200, min_tokens=5, max_tokens=40, seed=1)


def test_the_bf16_bar_takes_the_nearer_reference() -> None:
    from bulkinfer.benchmarks.embed import MIN_COSINE, Row, judged_cosine

    fp32 = Row("float32", 10.0, 5.0, 32, 0.99998)
    assert judged_cosine(fp32) < MIN_COSINE["float32"]  # fp32: its own vectors, no second chance
    reference_off = Row("bfloat16", 10.0, 5.0, 32, 0.9963, worst_cosine_fp32=0.9999)
    assert judged_cosine(reference_off) >= MIN_COSINE["bfloat16"]
    ours_off = Row("bfloat16", 10.0, 5.0, 32, 0.998, worst_cosine_fp32=0.997)
    assert judged_cosine(ours_off) < MIN_COSINE["bfloat16"]
    assert reference_off.ratio == 2.0
