"""The task of an OpenAI batch file whose job does not name one: its lines' `url` decides, as
`vllm run-batch` takes each line's endpoint from its url. `/v1/embeddings` lines embed; chat,
completions and messages lines generate. One job runs one task, so a file holding both kinds is
refused before anything runs, naming lines of each (split it, or pass the task: the other kind's
lines are then each that line's `unsupported_url` error). `bulkinfer run` reads every line for
this; a submit (`POST /jobs`, a schedule's tick) only the lines of the file's first MiB, as it reads
only the head of an input: a later line of the other kind is that line's error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.json_text import UnreadableJson, loads_untrusted
from bulkinfer.jobs.formats.lines import iter_lines_in_range
from bulkinfer.jobs.formats.openai_embeddings import EMBEDDINGS_URL
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.spec import InputFormat, JobSpec, JobTask

SHOWN_LINES = 3  # line numbers of each kind a refusal names
SUBMIT_SCAN_BYTES = 1 << 20  # a submit (POST /jobs, a tick) reads the lines of the first MiB


class MixedTasks(InputError):
    """An OpenAI batch file with both embeddings and generation lines, and no task to choose."""


@dataclass
class LineTasks:
    """Per task, how many lines ask for it and the numbers (1-based) of the first few."""

    counts: dict[JobTask, int] = field(default_factory=lambda: dict.fromkeys(JobTask, 0))
    first: dict[JobTask, list[int]] = field(default_factory=lambda: {task: [] for task in JobTask})

    def add(self, task: JobTask, number: int) -> None:
        self.counts[task] += 1
        if len(self.first[task]) < SHOWN_LINES:
            self.first[task].append(number)

    def task(self) -> JobTask | None:
        """The one task the lines ask for (None: no line names a url); `MixedTasks` for both."""
        if self.counts[JobTask.EMBED] and self.counts[JobTask.GENERATE]:
            raise MixedTasks(
                f"the file mixes {self._lines(JobTask.EMBED)} with {self._lines(JobTask.GENERATE)}; a job "
                "runs one task: put each kind in a file of its own, or give the task (the spec's `task`, "
                "--task) and each line of the other kind fails with its own error")
        if self.counts[JobTask.EMBED]:
            return JobTask.EMBED
        return JobTask.GENERATE if self.counts[JobTask.GENERATE] else None

    def _lines(self, task: JobTask) -> str:
        kind = f"{EMBEDDINGS_URL} lines" if task == JobTask.EMBED else "text generation lines"
        numbers = ", ".join(map(str, self.first[task]))
        more = ", …" if self.counts[task] > len(self.first[task]) else ""
        label = "line" if self.counts[task] == 1 else "lines"
        return f"{kind} ({self.counts[task]}: {label} {numbers}{more})"


def line_tasks(store: ObjectStore, key: str, end: int | None = None) -> LineTasks:
    """Which lines of the file (those starting before byte `end`; None: all) ask for which task, by
    their `url` (one streaming pass; unreadable lines and lines without a url count for neither:
    they are row errors whatever the task)."""
    tasks = LineTasks()
    limit = store.head(key).size if end is None else end
    for line in iter_lines_in_range(store, key, 0, limit):
        if not line.data.strip():
            continue
        try:
            record = loads_untrusted(line.data)
        except UnreadableJson:
            continue
        url = record.get("url") if isinstance(record, dict) else None
        if isinstance(url, str):
            tasks.add(JobTask.EMBED if url == EMBEDDINGS_URL else JobTask.GENERATE, line.number)
    return tasks


def task_given(spec: JobSpec) -> bool:
    """Whether the user's spec names its task (pydantic's set fields: a spec read back from job.json,
    or revalidated from a dump, names every field)."""
    return "task" in spec.model_fields_set


def with_task_of_lines(spec: JobSpec, given: bool, store: ObjectStore, key: str,
                       end: int | None = None) -> JobSpec:
    """`spec` (input format resolved) with the task its OpenAI batch lines ask for, unless the task
    was `given` or the input is not OpenAI batch; `end`: read the lines before that byte only (None:
    all). Raises `MixedTasks`."""
    if given or spec.input_format != InputFormat.OPENAI_BATCH:
        return spec
    task = line_tasks(store, key, end).task()
    if task is None or task == spec.task:
        return spec
    data = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return JobSpec.model_validate({**data, "task": task.value})
