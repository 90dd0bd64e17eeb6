"""A dry run reads only the rows it counts (`max_rows`): a shard past them is never read whole."""

from __future__ import annotations

import json
from typing import BinaryIO

from bulkinfer.jobs.object_store.local import LocalObjectStore
from bulkinfer.jobs.planning.estimate import estimate_job
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec


class MeteredStore(LocalObjectStore):
    """The local store, counting the bytes its readers take."""

    bytes_read = 0

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        stream = super().open_read(key, start)
        read = stream.read

        def metered(size: int = -1) -> bytes:
            data = read(size)
            self.bytes_read += len(data)
            return data

        stream.read = metered
        return stream


def test_a_dry_run_stops_reading_at_max_rows(tmp_path) -> None:
    store = MeteredStore(tmp_path)
    rows = [json.dumps({"q": f"row {n}"}) for n in range(5)] + [json.dumps({"q": "x" * (20 << 20)})]
    store.put_bytes("rows.jsonl", "\n".join(rows).encode())
    spec = JobSpec(input_uri="s3://b/rows.jsonl", input_format="jsonl", model="m", prompt_column="q",
                   shard_size=100)
    plan = plan_shards(store, "rows.jsonl", spec)
    store.bytes_read = 0

    estimate = estimate_job(store, "rows.jsonl", spec, plan, tokenizer=None, measured=[], live_workers=0,
                            max_rows=5)

    assert (estimate.rows_read, estimate.rows) == (5, 6)
    assert store.bytes_read < 4 << 20  # the 20 MiB row after them is not read
