"""`bulkinfer demo --offline`: the demo rows through the engine alone, every row processed."""

from __future__ import annotations

import pytest

from bulkinfer.worker.run.offline_demo import demo_cli


@pytest.mark.timeout(300)
def test_offline_demo_processes_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_cli(["--preset", "tiny", "--rows", "6", "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "rows: 6 (0 errors)" in out
    assert "completion 18" in out
