"""`bulkinfer bench faults`: jobs of hundreds of rows on several workers while faults are injected,
then every output counted: rows lost, rows duplicated.

It starts its own Redis (no persistence) and `--workers` Celery worker processes on a local store
and the `tiny` checkpoint (built once), submits `--jobs` jobs, and injects in turn, each once the
jobs have made progress since the last: `kill -9` of a worker in the middle of its shards (a fresh
worker replaces it), a Redis restart with all its data lost, a worker stalled (SIGSTOP) for three
lease TTLs and then resumed (its leases lapse and other runs take its shards over while it sleeps:
the fenced writes keep it from overwriting them), and Redis unreachable (SIGSTOP) for three lease
TTLs; and the faults of benchmarks/infra_faults.py: the store's disk full for three TTLs and on
until a worker's write was refused (a tmpfs mounted for the store: root needed), Redis over its
memory limit for three TTLs, Redis unreachable for five TTLs (the shards it caught running are
counted, and those computed again), and a worker told to stop (SIGTERM) mid-shard; and a row that
kills its worker (`poison-row`: a job one of whose rows carries the kill marker,
benchmarks/poison_rows.py; dead workers are replaced). Leases and
the reaper run with short TTLs (`--lease-ttl`, 4 s; ticks of 1 s), and a step's retries back off
at most one TTL (`retry_max_delay_s`), so the run takes a few minutes. The last line with `--json`
is one object: `faults_injected`, `jobs_completed`, `rows_lost`, `rows_duplicated`, `consumer_stalls`
(workers whose watchdog found their broker consumer stalled), `fault_log` (each
fault: when, how long, what it caught), with `poison-row` `worker_crashed_wrong` (rows wrongly
`worker_crashed` or not), and details.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bulkinfer.api.cli.stack import (
    SOURCE_ROOT,
    StackError,
    free_port,
    redis_server_binary,
    stop_process,
    tail,
    wait_for,
)
from bulkinfer.benchmarks import infra_faults
from bulkinfer.benchmarks.poison_rows import POISON_MARKER, check_poison, poison_job_lines
from bulkinfer.jobs.names import CONTROL_QUEUE, PLAN_JOB, model_queue
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState

LEASE_TTL_S = 4  # the default; --lease-ttl sets it
REDIS_SOCKET_TIMEOUT_S = 10  # the Redis client's (jobs/settings.py): a long outage lasts past it


def pause_s(lease_ttl: float) -> float:
    """A stall or an outage long enough for every lease to lapse."""
    return 3 * lease_ttl


def long_outage_s(lease_ttl: float) -> float:
    """An outage past five leases and past the Redis client's socket timeout."""
    return max(5 * lease_ttl, REDIS_SOCKET_TIMEOUT_S + 2)
INFRA_FAULTS = infra_faults.KINDS
FAULTS = ("worker-kill", "redis-restart", "worker-stall", "redis-pause", *INFRA_FAULTS, "poison-row")
DEFAULT_FAULTS = FAULTS  # each once, in this order
MODEL = "tiny"
CONSUMER_STALL_SIGN = "the broker consumer has stalled"
ENGINE_OPTIONS = {"max_model_len": 256, "num_kv_blocks": 512, "max_num_seqs": 32, "dtype": "float32"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bulkinfer bench faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400, help="rows per job (default 400)")
    parser.add_argument("--jobs", type=int, default=2, help="jobs submitted at once (default 2)")
    parser.add_argument("--shard-size", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lease-ttl", type=float, default=LEASE_TTL_S,
                        help=f"the shards' lease TTL in seconds (default {LEASE_TTL_S}); stalls and outages "
                             "last three TTLs, a long outage five")
    parser.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                        help=f"comma-separated, in order, of: {', '.join(FAULTS)}")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for every job to end")
    parser.add_argument("--home", type=Path, help="working folder (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    return parser.parse_args(argv)


class FaultBench:
    def __init__(self, home: Path, args: argparse.Namespace) -> None:
        self.home = home
        self.args = args
        self.logs = home / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.redis_port = free_port()
        self.redis: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.started_workers = 0
        self.settings: Settings | None = None
        self.store_dir = home / "store"
        self.store_mounted = False
        self.fault_log: list[dict[str, Any]] = []
        self.shards: dict[str, int] = {}  # job id -> its shard count
        self.outage_caught: dict[tuple[str, int], int] = {}
        self.kill_marker: str | None = None  # poison-row: the workers' kill marker
        self.worker_deaths = 0  # workers that died by themselves (a poison row), each replaced
        self.jobs: dict[str, list[str]] = {}
        self.poison: list[str] = []

    # -- processes --------------------------------------------------------------------------

    def start_redis(self) -> None:
        log = self.logs / "redis.log"
        self.redis = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.home)],
            stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the child keeps it
        import redis

        client = redis.Redis.from_url(self.broker_url)
        try:
            wait_for(lambda: bool(client.ping()), 20, "redis-server", self.redis, log)
        finally:
            client.close()

    @property
    def broker_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start_worker(self) -> None:
        assert self.settings is not None
        self.started_workers += 1
        node = f"faults-{self.started_workers}@127.0.0.1"
        log = self.logs / f"worker-{self.started_workers}.log"
        env = {**self.settings.to_env(), "BULKINFER_WORKER_MODELS": MODEL, "HF_HUB_OFFLINE": "1",
               "BULKINFER_ENGINE_OPTIONS": json.dumps(ENGINE_OPTIONS),
               "BULKINFER_SHARD_LEASE_TTL_S": str(self.args.lease_ttl), "BULKINFER_REAPER_INTERVAL_S": "1",
               # a step that met a fault retries within a TTL of its end (not up to a minute later)
               "BULKINFER_RETRY_MAX_DELAY_S": str(self.args.lease_ttl),
               "PYTHONPATH": str(SOURCE_ROOT)}
        if self.kill_marker:
            from bulkinfer.worker.shards.fault_injection import KILL_MARKER_ENV

            env[KILL_MARKER_ENV] = self.kill_marker
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bulkinfer.worker.process.celery_app", "worker",
             "--pool=threads",
             "--concurrency=2", "-Q", f"{CONTROL_QUEUE},{model_queue(MODEL)}", "-n", node,
             "--loglevel=INFO", "--without-gossip", "--without-mingle"],
            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, **env})  # noqa: SIM115
        self.workers.append(worker)

    def replace_dead_workers(self) -> None:
        """A worker that died by itself (a poison row killed it) is replaced, as a supervisor would."""
        for worker in [worker for worker in self.workers if worker.poll() is not None]:
            self.workers.remove(worker)
            self.worker_deaths += 1
            self.start_worker()

    def stop(self) -> None:
        for worker in self.workers:
            stop_process(worker, 20)
        stop_process(self.redis, 10)
        if self.store_mounted:
            infra_faults.unmount(self.store_dir)

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        args = self.args
        faults = [fault.strip() for fault in args.faults.split(",") if fault.strip()]
        unknown = sorted(set(faults) - set(FAULTS))
        if unknown:
            raise StackError(f"unknown fault(s) {', '.join(unknown)} (known: {', '.join(FAULTS)})")
        if "poison-row" in faults:
            self.kill_marker = POISON_MARKER
        if "disk-full" in faults:  # the store on a disk of its own, to fill
            try:
                infra_faults.mount_tmpfs(self.store_dir, infra_faults.STORE_DISK_SIZE)
            except infra_faults.StackFault as error:
                raise StackError(str(error)) from error
            self.store_mounted = True
        self.start_redis()
        self.settings = Settings(broker_url=self.broker_url, store_uri=str(self.store_dir),
                                 models=json.dumps({MODEL: MODEL}))  # a preset: workers build it once
        for _ in range(args.workers):
            self.start_worker()
        repository = self.settings.repository()
        expected = self.jobs  # the poison-row and disk-full faults add a job each
        for job_number in range(args.jobs):
            ids = [f"j{job_number}-r{n:04d}" for n in range(args.rows)]
            self._plan(self._create_job(str(job_number), _question_lines(ids), ids))
        injected: list[str] = []
        started = time.monotonic()
        total_shards = args.jobs * -(-args.rows // args.shard_size)
        for number, fault in enumerate(faults, start=1):
            # Each fault once a share of the shards is done: spread over the run, never after it.
            target = total_shards * number // (len(faults) + 1)
            self._wait_progress(repository, expected, target, started)
            at = time.monotonic()
            notes = self._inject(fault, repository) or {}
            self.fault_log.append({"fault": fault, "at_s": round(at - started, 1),
                                   "seconds": round(time.monotonic() - at, 1), **notes})
            injected.append(fault)
        statuses = self._wait_end(repository, expected, started)
        self._note_outcomes(repository)
        self.worker_deaths += sum(worker.poll() is not None for worker in self.workers)  # not yet replaced
        poisoned = check_poison(self.store_dir, expected, self.poison) if self.poison else {}
        return {**count_rows(self.store_dir, expected), **poisoned, "faults": injected,
                "fault_log": self.fault_log, "worker_deaths": self.worker_deaths,
                "faults_injected": len(injected), "workers_started": self.started_workers,
                # workers whose watchdog found their consumer stalled (worker/process/consumer_watchdog.py)
                "consumer_stalls": infra_faults.count_in_logs(self.logs, CONSUMER_STALL_SIGN),
                "jobs_completed": sum(status == JobState.SUCCEEDED for status in statuses.values()),
                "jobs": len(expected), "rows_per_job": args.rows,
                "seconds": round(time.monotonic() - started, 1)}

    def _inject(self, fault: str, repository: Any) -> dict[str, Any] | None:
        self.replace_dead_workers()  # a poison row may have just killed the worker a fault would pick
        if fault in INFRA_FAULTS:
            return self._inject_infra(fault, repository)
        if fault == "worker-kill":
            victim = next(worker for worker in self.workers if worker.poll() is None)
            victim.kill()  # kill -9: no warm shutdown, its shards' messages stay unacknowledged
            victim.wait(10)
            self.workers.remove(victim)
            self.start_worker()
        elif fault == "redis-restart":
            assert self.redis is not None
            self.redis.kill()
            self.redis.wait(10)
            self.start_redis()  # the same port, nothing kept
        elif fault == "worker-stall":
            victim = next(worker for worker in self.workers if worker.poll() is None)
            pause(victim, pause_s(self.args.lease_ttl))
        elif fault == "redis-pause":
            assert self.redis is not None
            pause(self.redis, pause_s(self.args.lease_ttl))
        elif fault == "poison-row":
            self._submit_poison_job()
        else:
            raise StackError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        return None

    def _inject_infra(self, fault: str, repository: Any) -> dict[str, Any]:
        if fault == "disk-full":
            _, text = infra_faults.LOG_SIGNS[fault]
            before = infra_faults.count_in_logs(self.logs, text)
            # A job planned while the disk is full: its plan must be written, so a worker meets the full
            # disk even when the other jobs' shards happen to be between writes (or all done).
            ids = [f"disk-r{n:04d}" for n in range(self.args.shard_size)]
            job_id = self._create_job("disk-full", _question_lines(ids), ids)
            paused = pause_s(self.args.lease_ttl)
            return infra_faults.disk_full(self.store_dir, paused, longest_s=6 * paused,
                                          felt=lambda: infra_faults.count_in_logs(self.logs, text) > before,
                                          while_full=lambda: self._plan(job_id))
        if fault == "redis-oom":
            return infra_faults.redis_out_of_memory(self.broker_url, pause_s(self.args.lease_ttl))
        if fault == "redis-outage-long":
            assert self.redis is not None
            caught = infra_faults.running_shards(repository, self.shards)
            self.outage_caught.update(caught)
            outage = long_outage_s(self.args.lease_ttl)
            pause(self.redis, outage)
            return {"outage_s": outage, "shards_running": len(caught)}
        victim = next(worker for worker in self.workers if worker.poll() is None)  # worker-term
        stop_process(victim, 60)  # SIGTERM: its running shards are handed back
        self.workers.remove(victim)
        self.start_worker()
        return {}

    def _submit_poison_job(self) -> None:
        name = f"poison{len(self.poison)}"
        lines, ids, poison = poison_job_lines(name, 2 * self.args.shard_size)
        self._plan(self._create_job(name, lines, ids))
        self.poison += poison

    def _create_job(self, name: str, lines: list[str], ids: list[str]) -> str:
        """A job of `lines` in the store (not planned yet), counted as one whose rows must all come back."""
        assert self.settings is not None
        path = self.home / f"input-{name}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        spec = JobSpec(input_uri=str(path), model=MODEL, id_column="id", prompt_column="question",
                       sampling={"temperature": 0.0, "max_tokens": self.args.max_tokens},
                       shard_size=self.args.shard_size)
        job_id = self.settings.repository().create(spec).job_id
        self.jobs[job_id] = ids
        self.shards[job_id] = -(-len(ids) // self.args.shard_size)
        return job_id

    def _plan(self, job_id: str) -> None:
        from celery import Celery

        sender = Celery(broker=self.broker_url)
        try:
            sender.send_task(PLAN_JOB, args=[job_id], queue=CONTROL_QUEUE)
        finally:
            sender.close()

    def _note_outcomes(self, repository: Any) -> None:
        """What each infrastructure fault caused, read once every job ended."""
        for record in self.fault_log:
            fault = record["fault"]
            if fault in infra_faults.LOG_SIGNS:
                name, text = infra_faults.LOG_SIGNS[fault]
                record[name] = infra_faults.count_in_logs(self.logs, text)
            if fault == "redis-outage-long":
                record["shards_recomputed"] = infra_faults.recomputed(repository, self.outage_caught)

    def _wait_progress(self, repository: Any, expected: dict[str, list[str]], shards: int,
                       started: float) -> None:
        while time.monotonic() - started < self.args.timeout:
            try:
                done = sum(repository.get(job_id).shards.done for job_id in expected)
            except Exception:  # noqa: BLE001 - Redis just restarted
                done = 0
            if done >= shards:
                return
            self.replace_dead_workers()
            time.sleep(0.2)
        raise StackError(f"the jobs made no progress to {shards} shards in {self.args.timeout:.0f}s; "
                         f"see {self.logs}:\n{tail(self.logs / f'worker-{self.started_workers}.log')}")

    def _wait_end(self, repository: Any, expected: dict[str, list[str]], started: float
                  ) -> dict[str, JobState]:
        states: dict[str, JobState] = {}
        while time.monotonic() - started < self.args.timeout:
            try:
                states = {job_id: repository.get(job_id).state for job_id in expected}
            except Exception:  # noqa: BLE001 - Redis just restarted
                states = {}
            if states and all(state.is_terminal for state in states.values()):
                return states
            self.replace_dead_workers()
            time.sleep(0.5)
        return states


def _question_lines(ids: list[str]) -> list[str]:
    return [json.dumps({"id": row_id, "question": f"def f_{row_id.replace('-', '_')}(x):"}) for row_id in ids]


def pause(process: subprocess.Popen[bytes], seconds: float) -> None:
    """SIGSTOP the process for `seconds`, then let it go on (always, even if interrupted)."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(process.pid, signal.SIGCONT)


def count_rows(store_dir: Path, expected: dict[str, list[str]]) -> dict[str, int]:
    """Every output row of every job that succeeded, against the ids each should hold once."""
    lost = duplicated = 0
    for job_id, ids in expected.items():
        seen: Counter[str] = Counter()
        for part in sorted((store_dir / "jobs" / job_id / "output").glob("part-*.jsonl")):
            for line in part.read_text().splitlines():
                seen[json.loads(line)["id"]] += 1
        wanted = set(ids)
        lost += sum(1 for row_id in ids if seen[row_id] == 0)
        duplicated += sum(count - 1 for count in seen.values() if count > 1)
        duplicated += sum(count for row_id, count in seen.items() if row_id not in wanted)
    return {"rows_lost": lost, "rows_duplicated": duplicated}


def bench_cli(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bulkinfer-faults-") as scratch:
        home = (args.home or Path(scratch)).resolve()
        bench = FaultBench(home, args)
        print(f"bench faults: {args.jobs} job(s) x {args.rows} rows, shards of {args.shard_size}, "
              f"{args.workers} workers, faults {args.faults} (working in {home})", flush=True)
        try:
            figures = bench.run()
        except StackError as error:
            print(f"bench faults: {error}", file=sys.stderr)
            return 2
        finally:
            bench.stop()
    print(f"  faults injected   {figures['faults_injected']} ({', '.join(figures['faults'])}; "
          f"{figures['workers_started']} worker processes started in all)")
    print(f"  jobs completed    {figures['jobs_completed']} of {figures['jobs']} in {figures['seconds']} s")
    print(f"  rows lost         {figures['rows_lost']}")
    print(f"  rows duplicated   {figures['rows_duplicated']}")
    print(f"  consumer stalls   {figures['consumer_stalls']} (workers that stopped taking work)")
    if "poison_rows" in figures:
        print(f"  worker_crashed    {figures['rows_worker_crashed']} row(s) of {figures['poison_rows']} "
              f"poison row(s), {figures['worker_crashed_wrong']} wrong ({figures['worker_deaths']} workers "
              "killed by them, each replaced)")
    for record in figures["fault_log"]:
        notes = ", ".join(f"{name} {value}" for name, value in record.items()
                          if name not in ("fault", "at_s", "seconds"))
        print(f"    {record['fault']:<18} at {record['at_s']:>6.1f} s for {record['seconds']:>5.1f} s"
              f"{'  (' + notes + ')' if notes else ''}")
    if args.json:
        print(json.dumps(figures))
    whole = figures["jobs_completed"] == figures["jobs"] and not figures["rows_lost"] \
        and not figures["rows_duplicated"] and not figures.get("worker_crashed_wrong")
    return 0 if whole else 1
