"""`bench faults`' faults of the infrastructure around the workers, each real: the store's disk
fills up (a tmpfs mounted for the store, filled with a ballast file, then emptied), Redis hits its
memory limit (`CONFIG SET maxmemory`), Redis is unreachable (SIGSTOP) for longer than the lease TTL
and the Redis client's socket timeout (the shards it caught are then looked at: committed by the
run that had them, or computed again), and a worker told to stop (SIGTERM, as a pod deletion or a
scale-in does) mid-shard, replaced by a fresh one.
"""

from __future__ import annotations

import errno
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from bulkinfer.jobs.names import shard_lease_key
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.jobs.state.results import committed_shard_result

KINDS = ("disk-full", "redis-oom", "redis-outage-long", "worker-term")
STORE_DISK_SIZE = "256m"
# What each fault leaves in the workers' logs, counted once every job ended: (figure, text).
LOG_SIGNS = {"disk-full": ("enospc_errors_logged", "No space left on device"),
             "redis-oom": ("oom_errors_logged", "command not allowed when used memory"),
             "worker-term": ("shards_handed_back", "handed back to")}


class StackFault(RuntimeError):
    """A fault that cannot be set up here (e.g. no tmpfs without root)."""


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        raise StackFault(f"cannot mount a tmpfs at {path} for a disk that fills up (root needed): "
                         f"{mounted.stderr.strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill_disk(ballast: Path) -> None:
    """Write `ballast` until its disk is full: every later write of a byte fails with ENOSPC."""
    with open(ballast, "ab", buffering=0) as output:
        for chunk in (b"\0" * 65536, b"\0"):  # big chunks, then the last few bytes
            try:
                while output.write(chunk):
                    pass
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise


def disk_full(store_dir: Path, seconds: float, felt: Callable[[], bool], longest_s: float,
              while_full: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """The store's disk full for `seconds`, and on until a worker `felt` it (a write refused: a
    disk full while every run computes is no fault at all), at most `longest_s`; then space comes
    back. `while_full` runs once the disk is full (the bench plans a job then)."""
    ballast = store_dir / ".ballast"
    fill_disk(ballast)
    started = time.monotonic()
    try:
        while_full()
        time.sleep(seconds)
        while not felt() and time.monotonic() - started < longest_s:
            time.sleep(0.5)
    finally:
        ballast.unlink(missing_ok=True)
    return {"full_s": round(time.monotonic() - started, 1)}


def redis_out_of_memory(broker_url: str, seconds: float) -> dict[str, Any]:
    """Redis refuses every command that may grow memory (OOM) for `seconds`."""
    client = redis.Redis.from_url(broker_url)
    try:
        client.config_set("maxmemory", "1")
        try:
            time.sleep(seconds)
        finally:
            client.config_set("maxmemory", "0")
    finally:
        client.close()
    return {"oom_s": seconds}


def running_shards(repository: JobRepository, shards: dict[str, int]) -> dict[tuple[str, int], int]:
    """(job, shard) -> the lease generation of every shard a run holds now."""
    client, namespace = repository.redis, repository.namespace
    keys = [(job_id, index) for job_id, count in shards.items() for index in range(count)]
    with client.pipeline(transaction=False) as pipe:
        for job_id, index in keys:
            lease = shard_lease_key(namespace, job_id, index)
            pipe.exists(lease)
            pipe.get(f"{lease}:generation")
        answers = pipe.execute()
    return {key: int(answers[2 * n + 1] or 0) for n, key in enumerate(keys) if answers[2 * n]}


def recomputed(repository: JobRepository, caught: dict[tuple[str, int], int]) -> int:
    """How many of the shards an outage caught running were committed by a later run than the one
    that held them (their work thrown away and computed again)."""
    again = 0
    for (job_id, index), generation in caught.items():
        result = committed_shard_result(repository.store, repository.layout(job_id), index)
        if result is None:  # its job failed or was cancelled: the rows are counted as lost
            continue
        fence = result.fence or ""
        again += not fence.startswith(f"g{generation}-")
    return again


def count_in_logs(logs: Path, text: str) -> int:
    return sum(path.read_text(errors="replace").count(text) for path in logs.glob("worker-*.log"))
