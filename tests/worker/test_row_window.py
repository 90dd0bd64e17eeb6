"""A shard's rows go to the engine a window at a time (worker/hosts/row_window.py): the rows a run holds
stay within two windows however long the shard, outcomes keep input order, identical rows run once
across windows, and cancel and the deadline still stop it. A real tiny engine runs every row."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.hosts.model_hosts import HostedModel
from bulkinfer.worker.hosts.row_window import WindowStats, run_rows
from tests.fixtures.hosted_models import hosted_model

pytestmark = pytest.mark.timeout(300)

GREEDY = JobSampling(temperature=0.0, max_tokens=2)
WINDOW = 4


@pytest.fixture(scope="module")
def hosted(tiny_checkpoint: Path) -> Iterator[HostedModel]:
    with hosted_model("tiny", tiny_checkpoint, {"max_model_len": 128, "num_kv_blocks": 64,
                                                "max_num_seqs": 4}) as model:
        yield model


class CountingReader:
    """Rows made one at a time, as a shard's reader makes them; records, at each row asked for, how
    many rows were read but not finished by the engine (futures of the real engine's submissions)."""

    def __init__(self, hosted: HostedModel, prompts: list[str]) -> None:
        self.prompts = prompts
        self.read = 0
        self.finished = 0
        self.held: list[int] = []
        submit = hosted.host.submit

        def counting_submit(requests):  # noqa: ANN001, ANN202 - EngineHost.submit's own signature
            submission = submit(requests)
            for future in submission.futures:
                future.add_done_callback(lambda _: self._finish())
            return submission

        self._restore = lambda: setattr(hosted.host, "submit", submit)
        hosted.host.submit = counting_submit

    def _finish(self) -> None:
        self.finished += 1

    def __iter__(self) -> Iterator[Row | RowError]:
        for index, prompt in enumerate(self.prompts):
            self.read += 1
            self.held.append(self.read - self.finished)
            yield Row(index, f"r{index}", prompt, None, GREEDY, None)

    def close(self) -> None:
        self._restore()


def test_a_long_shard_holds_at_most_two_windows_of_rows_and_keeps_input_order(hosted: HostedModel) -> None:
    prompts = [f"def function_{n}(x):" for n in range(40)]
    reader = CountingReader(hosted, prompts)
    stats = WindowStats()
    try:
        outputs = run_rows(hosted, reader, window_rows=WINDOW, stats=stats)
    finally:
        reader.close()

    assert [output.row_id for output in outputs] == [f"r{n}" for n in range(40)]
    assert all(output.error_code is None and output.completion_tokens == 2 for output in outputs)
    # Measured from outside (the engine's own futures) and inside (the runner's counter).
    assert max(reader.held) <= 2 * WINDOW + 1
    assert stats.peak_rows_held <= 2 * WINDOW and stats.rows_read == 40


def test_identical_rows_in_different_windows_run_once(hosted: HostedModel) -> None:
    prompts = ["def add(a, b):", "import os", "x = 1", "y = 2", "z = 3", "def add(a, b):", "import os", "w"]
    rows = [Row(n, f"r{n}", prompt, None, GREEDY, None) for n, prompt in enumerate(prompts)]
    rows.insert(3, RowError(99, "bad", RowErrorCode.INVALID_JSON, "not JSON"))

    windowed = run_rows(hosted, iter(rows), window_rows=2)
    whole = run_rows(hosted, rows, window_rows=100)

    assert [o.row_id for o in windowed] == [o.row_id for o in whole] == [r.row_id for r in rows]
    assert [(o.text, o.error_code) for o in windowed] == [(o.text, o.error_code) for o in whole]
    assert [o.row_id for o in windowed if o.deduplicated] == [o.row_id for o in whole if o.deduplicated] \
        == ["r5", "r6"]


def test_cancel_stops_reading_and_a_deadline_expires_the_rest(hosted: HostedModel) -> None:
    prompts = [f"print({n})" for n in range(40)]
    cancelled = CountingReader(hosted, prompts)
    try:
        assert run_rows(hosted, cancelled, window_rows=WINDOW, poll_s=0.01,
                        should_stop=lambda: cancelled.finished >= WINDOW) is None
    finally:
        cancelled.close()
    assert cancelled.read <= 3 * WINDOW  # the rest of the shard was never read

    slow = JobSampling(temperature=0.0, max_tokens=100, ignore_eos=True)  # ~1,500 engine steps in all
    rows = [Row(n, f"r{n}", f"while {n}:", None, slow, None) for n in range(60)]
    outputs = run_rows(hosted, iter(rows), window_rows=WINDOW, poll_s=0.01, expires_in_s=0.2)
    assert [o.row_id for o in outputs] == [r.row_id for r in rows]
    assert outputs[-1].error_code == RowErrorCode.EXPIRED
