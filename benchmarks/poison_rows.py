"""`bench faults`' `poison-row`: a job one of whose rows kills any worker process that runs it.

The bench's workers start with the kill marker in their environment (worker/shards/fault_injection.py:
a row carrying it makes its worker SIGKILL itself, as an out-of-memory kill would) and are replaced
when they die, as a supervisor would. The poison job's shards are split down to the row
(worker/shards/shard_crashes.py); afterwards exactly its poison rows must be `worker_crashed` errors, and
every other row of every job must be in the outputs once.
"""

from __future__ import annotations

import json
from pathlib import Path

POISON_MARKER = "bench-faults-poison-row-5b0c2f7e"


def poison_job_lines(name: str, rows: int) -> tuple[list[str], list[str], list[str]]:
    """(JSONL lines, every row id, the poison row ids): one poison row, in the middle."""
    ids = [f"{name}-r{n:04d}" for n in range(rows)]
    poison = [ids[rows // 2]]
    lines = [json.dumps({"id": row_id, "question": f"def f_{row_id.replace('-', '_')}(x):"
                         + (f" # {POISON_MARKER}" if row_id in poison else "")}) for row_id in ids]
    return lines, ids, poison


def worker_crashed_ids(store_dir: Path, job_ids: list[str]) -> list[str]:
    """The ids of the rows of these jobs whose error is `worker_crashed`, sorted."""
    crashed = []
    for job_id in job_ids:
        for part in sorted((store_dir / "jobs" / job_id / "errors").glob("part-*.jsonl")):
            for line in part.read_text().splitlines():
                record = json.loads(line)
                if (record.get("error") or {}).get("code") == "worker_crashed":
                    crashed.append(record["id"])
    return sorted(crashed)


def check_poison(store_dir: Path, expected: dict[str, list[str]], poison: list[str]) -> dict[str, int]:
    """`poison_rows` injected, `rows_worker_crashed` found, and `worker_crashed_wrong`: poison rows not
    marked plus other rows marked (0 when exactly the poison rows are)."""
    found = worker_crashed_ids(store_dir, list(expected))
    wrong = len(set(poison) ^ set(found)) + len(found) - len(set(found))
    return {"poison_rows": len(poison), "rows_worker_crashed": len(found), "worker_crashed_wrong": wrong}
