"""Worker heartbeats: what each live worker serves and how fast, for the API's /ui and /metrics.

A worker writes its beat every `BEAT_INTERVAL_S` to a Redis key that expires after `BEAT_TTL_S`,
so a worker that died or was stopped drops out of the list by itself within that time.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from pydantic import BaseModel

from bulkinfer.jobs.names import worker_beat_key, worker_beat_pattern

if TYPE_CHECKING:  # the SDK reads WorkerBeat (api/schemas.py) and installs without redis
    import redis

BEAT_INTERVAL_S = 5.0
BEAT_TTL_S = 20


class WorkerModel(BaseModel):
    name: str
    state: str  # "loaded", "loading", "not loaded", "failed: <why>"
    dtype: str | None = None
    device: str | None = None
    running: int = 0  # requests in the engine now
    waiting: int = 0
    tokens_per_s: float = 0.0  # generated tokens per second over the last beat interval
    # Since the engine started: seconds inside steps, and the tokens they computed (prompt + generated).
    busy_s: float = 0.0
    tokens_computed: int = 0


class WorkerBeat(BaseModel):
    # A tenant's key sees `worker-<n>` and no pid (api/routes/observe.py): hosts are the operator's.
    hostname: str
    pid: int | None
    started_at: datetime
    updated_at: datetime
    models: list[WorkerModel]


def anonymous(beats: list[WorkerBeat]) -> list[WorkerBeat]:
    """The beats as a tenant may see them: models and counts, no hostname (a label) and no pid."""
    return [beat.model_copy(update={"hostname": f"worker-{n}", "pid": None})
            for n, beat in enumerate(beats, start=1)]


def write_beat(client: redis.Redis, namespace: str, beat: WorkerBeat) -> None:
    client.set(worker_beat_key(namespace, beat.hostname), beat.model_dump_json(), ex=BEAT_TTL_S)


def clear_beat(client: redis.Redis, namespace: str, hostname: str) -> None:
    client.delete(worker_beat_key(namespace, hostname))


def live_workers(client: redis.Redis, namespace: str) -> list[WorkerBeat]:
    """Every worker that beat within the TTL, by hostname."""
    keys = sorted(client.scan_iter(match=worker_beat_pattern(namespace), count=200))
    beats = []
    for value in client.mget(keys) if keys else []:
        if value:  # expired between the scan and the read
            beats.append(WorkerBeat.model_validate_json(value))
    return sorted(beats, key=lambda beat: beat.hostname)


# How the engine's load error begins for a checkpoint whose architecture it does not implement
# (engine/models/loader.py; it goes on to name the supported ones), and what it says of a quantized
# checkpoint (naming its scheme). A failure of these kinds is the checkpoint's, so it holds on every
# worker: the API refuses jobs for the model (api/submission.py).
UNSUPPORTED_ARCHITECTURE = "unsupported architecture"
QUANTIZED_CHECKPOINT = "is a quantized checkpoint"
CHECKPOINT_REFUSALS = (UNSUPPORTED_ARCHITECTURE, QUANTIZED_CHECKPOINT)


def unservable_reason(beats: list[WorkerBeat], model: str) -> str | None:
    """Why `model` cannot run here, where live workers know: one reports it failed to load because
    of its checkpoint (its architecture, or quantized weights) and none reports it loaded. None
    otherwise (unknown is not unservable)."""
    states = [hosted.state for beat in beats for hosted in beat.models if hosted.name == model]
    if "loaded" in states:
        return None
    refused = [state for state in states
               if state.startswith("failed: ") and any(refusal in state for refusal in CHECKPOINT_REFUSALS)]
    return refused[0].removeprefix("failed: ") if refused else None


MIN_MEASURED_BUSY_S = 1.0  # less engine time than this measures start-up more than throughput


class Throughput(BaseModel):
    """A model's measured speed on one worker: tokens computed (prompt + generated) per engine-busy second."""

    model: str
    tokens_per_busy_s: float
    busy_s: float
    hostname: str
    dtype: str | None = None
    device: str | None = None
    measured_at: datetime


def measured_throughput(beat: WorkerBeat, model: WorkerModel) -> Throughput | None:
    """What a heartbeat's loaded model measured (None before it was busy long enough to tell)."""
    if model.busy_s < MIN_MEASURED_BUSY_S or not model.tokens_computed:
        return None
    return Throughput(model=model.name, tokens_per_busy_s=model.tokens_computed / model.busy_s,
                      busy_s=model.busy_s, hostname=beat.hostname, dtype=model.dtype, device=model.device,
                      measured_at=beat.updated_at)


def throughput_key(namespace: str, model: str) -> str:
    return f"{namespace}:throughput:{model}"


def record_throughput(client: redis.Redis, namespace: str, beat: WorkerBeat) -> None:
    """Keep each loaded model's latest measurement (no expiry: it outlives a scaled-to-zero worker)."""
    for model in beat.models:
        measured = measured_throughput(beat, model)
        if measured is not None:
            client.set(throughput_key(namespace, model.name), measured.model_dump_json())


def last_throughput(client: redis.Redis, namespace: str, model: str) -> Throughput | None:
    value = client.get(throughput_key(namespace, model))
    return Throughput.model_validate_json(value) if value else None
