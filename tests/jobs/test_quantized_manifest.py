"""A job's manifest names the quantization scheme of the weights its shards ran (and keeps the bytes
of an unquantized job's manifest as they were)."""

from __future__ import annotations

from datetime import UTC, datetime

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.state.manifest import manifest_of
from bulkinfer.jobs.state.results import PartFile, ShardResult

W4A16 = "compressed-tensors W4A16 int4 (pack-quantized: group 128 weights)"


def _results(quantization: str | None) -> list[ShardResult]:
    part = PartFile(key="k", uri="u", rows=0, bytes=0, sha256="")
    now = datetime.now(UTC)
    rows = [OutputRow(i, str(i), text="t", finish_reason="stop", prompt_tokens=3, cached_tokens=0,
                      completion_tokens=1) for i in range(2)]
    return [ShardResult.from_outputs(ShardPlan(index=i, estimated_rows=1, rows_exact=True), rows[i:i + 1],
                                     output=part, errors=part, started_at=now, finished_at=now,
                                     dtype="float32", quantization=quantization) for i in range(2)]


def test_the_manifest_names_the_weights_quantization() -> None:
    manifest = manifest_of("j", "h", "jsonl", _results(W4A16))
    assert manifest.quantizations == [W4A16]
    assert all(part.quantization == W4A16 for part in manifest.parts)
    assert W4A16 in manifest.to_bytes().decode()


def test_an_unquantized_jobs_manifest_has_no_quantization_keys() -> None:
    text = manifest_of("j", "h", "jsonl", _results(None)).to_bytes().decode()
    assert "quantization" not in text
