"""What the engine asks of the device each step, and how a step runs ahead of the host.

The engine never touches logits: it prepares a step on the host (`prepare_step`: the flattened
batch of the scheduled chunks) and hands it, with the step's sampling settings, to the device
(`sample_step`), which runs the forward pass and the sampler and gives back only the sampled ids (and
logprobs where asked): a `SampledStep`. `ModelRunner` is the real device; the host benchmark's
stand-in (benchmarks/host_bench.py) is another.

With async scheduling the device runs on its own thread (`StepQueue`, what a CUDA stream is to
the host): the host schedules and prepares step N+1 and processes step N-1's outputs while step N
runs. A row that decodes a token step N is still sampling has a placeholder as its input token;
the device fills it from step N's sampled ids (`PlaceholderInputs`) before step N+1's forward.
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.sampler import RowLogprobs, SamplingBatch
from bulkinfer.engine.scheduler import SchedulerOutput


@dataclass
class SampledStep:
    """What a step hands back to the host: one token per sampled row (in the rows' order), their
    logprobs (None where not asked), the rows whose logits were not finite, and the prompt
    positions scored for prompt_logprobs, by request id."""

    token_ids: list[int]
    logprobs: list[RowLogprobs | None]
    invalid_rows: list[int] = field(default_factory=list)
    prompt_logprobs: dict[str, list[RowLogprobs]] = field(default_factory=dict)
    # The sampled ids on the device and each sampled row's request id: where the next step's
    # placeholder inputs come from (async scheduling).
    device_token_ids: torch.Tensor | None = None
    row_ids: Sequence[str] = ()

    def rows_of(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The rows of these requests' sampled tokens (built only when a next step asks)."""
        row_of = {request_id: row for row, request_id in enumerate(self.row_ids)}
        return torch.tensor([row_of[request_id] for request_id in request_ids], dtype=torch.long)


@dataclass(frozen=True)
class PlaceholderInputs:
    """Input positions of a prepared step whose token the previous step is still sampling: flat
    index in the step's input ids, and the request whose sampled token goes there."""

    flat_index: list[int]
    request_ids: list[str]

    def values(self, previous: SampledStep) -> list[int]:
        """The tokens that go into `flat_index`, from the previous step's ids on the host (read back
        once it ended): what the other tensor-parallel ranks are sent with the step's rows."""
        return [previous.token_ids[row] for row in previous.rows_of(self.request_ids).tolist()]

    def fill(self, input_ids: torch.Tensor, previous: SampledStep) -> None:
        """Write the previous step's sampled ids into their places (on the device, no sync)."""
        assert previous.device_token_ids is not None, "the previous step kept no sampled ids"
        rows = previous.rows_of(self.request_ids)
        index = torch.tensor(self.flat_index, dtype=torch.long)
        device = input_ids.device
        input_ids[index.to(device)] = previous.device_token_ids[rows.to(device)].to(input_ids.dtype)


class StepDevice(Protocol):
    """The device side of a step (engine/model_runner.py's ModelRunner, or a stand-in)."""

    def prepare_step(self, output: SchedulerOutput) -> Any:
        """Host work: the step's flattened inputs (None when no row computes anything)."""

    def sample_step(self, prepared: Any, batch: SamplingBatch, sampled_rows: Sequence[str],
                previous: SampledStep | None = None) -> SampledStep:
        """Device work: forward `prepared`, sample its rows with `batch`; `sampled_rows` are the
        sampled rows' request ids (their order); `previous` fills placeholder inputs."""


SWITCH_INTERVAL_S = 0.0005


class StepQueue:
    """Runs steps on one thread, in order, as a device stream does: a step submitted while the
    previous one runs starts when it ends, and reads its sampled ids."""

    def __init__(self) -> None:
        # The step thread needs the GIL for a moment when its step ends, to hand the result back and
        # start the next: at Python's default 5 ms switch interval the engine thread, busy with the
        # host work, kept it waiting that long while the device idled (bench host: 512 rows, wall
        # 1.17x the host time; 1.06x at 0.5 ms). Process-wide; an engine's worker is its own process.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                             thread_name_prefix="bulkinfer-step")
        self._last: concurrent.futures.Future[SampledStep] | None = None

    def submit(self, device: StepDevice, prepared: Any, batch: SamplingBatch,
               sampled_rows: Sequence[str]) -> concurrent.futures.Future[SampledStep]:
        previous = self._last

        def run() -> SampledStep:
            # Done by now (one thread, in order); a failed previous step fails this one too.
            before = previous.result() if previous is not None else None
            return device.sample_step(prepared, batch, sampled_rows, before)

        self._last = self._thread.submit(run)
        return self._last

    def call(self, work: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run `work` on the step thread after every step submitted so far, before any later one."""
        return self._thread.submit(work)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def resolve_async_scheduling(config: EngineConfig) -> bool:
    """The async_scheduling setting, or by default: on a GPU (with speculation and tensor parallel
    too)."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return config.device.startswith("cuda")
