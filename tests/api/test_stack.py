"""`bulkinfer demo` and `bulkinfer up` as a user runs them: subprocesses, real Redis, worker and API."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.services import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint for both commands: the first one builds it."""
    return tmp_path_factory.mktemp("models")


def bulkinfer(*args: str, **popen) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "bulkinfer.api.cli", *args], cwd=REPO_ROOT, env=env,
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


def test_demo_runs_a_job_through_the_stack_and_prints_its_figures(tmp_path: Path, models_dir: Path) -> None:
    process = bulkinfer("demo", "--preset", "tiny", "--rows", "12", "--max-tokens", "4", "--shard-size", "4",
                        "--home", str(tmp_path), "--models-dir", str(models_dir), "--dtype", "float32")
    output, _ = process.communicate(timeout=240)
    assert process.returncode == 0, output
    assert "rows 12/12 done, shards 3/3" in output
    assert "rows: 12 (12 succeeded, 0 failed), shards: 3" in output
    figures = r"tokens: prompt \d+, served from prefix cache [1-9]\d* \(\d+%\), completion [1-9]"
    assert re.search(figures, output)
    assert re.search(r"throughput: [\d.]+ rows/s, [\d.]+ output tok/s", output)
    assert "- ticket-0000" in output
    assert "engine dtype: float32" in output
    worker_pid = int(re.search(r"worker  pid (\d+)", output).group(1))
    assert not Path(f"/proc/{worker_pid}").exists()  # the stack was stopped


def test_demo_serves_the_real_model_by_default_and_prints_real_answers(tmp_path: Path, real_model: Path
                                                                        ) -> None:
    process = bulkinfer("demo", "--rows", "8", "--shard-size", "4", "--home", str(tmp_path))
    output, _ = process.communicate(timeout=480)
    assert process.returncode == 0, output
    assert "model 'smollm2-135m-instruct'" in output
    assert '-> {"name": "Alice Martin", "city": "Berlin", "quantity": 3' in output
    right = re.search(r"valid JSON in 8/8 rows; name, city and quantity all right in (\d)/8", output)
    assert right and int(right.group(1)) >= 6, output
    assert re.search(r"engine dtype: (bfloat16|float32) \(chosen by the worker", output)


def test_up_serves_until_ctrl_c_then_stops_every_process(tmp_path: Path, models_dir: Path) -> None:
    port = free_port()
    process = bulkinfer("up", "--preset", "tiny", "--port", str(port), "--home", str(tmp_path),
                        "--models-dir", str(models_dir))
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any("Ctrl-C to stop" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stdout.readline())
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
        assert health == {"status": "ok", "checks": {"redis": "ok", "store": "ok"}}
        assert httpx.get(f"http://127.0.0.1:{port}/models", timeout=10).json() == {"models": ["tiny"]}
        children = [int(pid) for pid in re.findall(r"pid (\d+)", "".join(lines))]
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, "".join(lines) + rest
    assert rest.strip().endswith("stopped")
    assert len(children) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in children)  # redis, worker
    assert (tmp_path / "store").is_dir() and (tmp_path / "redis").is_dir()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_a_second_stack_on_the_same_home_is_refused(tmp_path: Path) -> None:
    from bulkinfer.api.cli.stack import Stack, StackError, StackOptions

    first = Stack(StackOptions(home=tmp_path, port=0))
    first._lock_home()
    try:
        with pytest.raises(StackError, match="another bulkinfer stack is running"):
            Stack(StackOptions(home=tmp_path, port=0)).start()
    finally:
        first.stop()
    again = Stack(StackOptions(home=tmp_path, port=0))
    again._lock_home()  # free again once the first stopped
    again.stop()


def test_demo_offline_runs_the_engine_alone(capsys: pytest.CaptureFixture[str]) -> None:
    from bulkinfer.api.cli.stack_commands import demo

    assert demo(["--offline", "--preset", "tiny", "--rows", "4", "--max-tokens", "2"]) == 0
    output = capsys.readouterr().out
    assert "rows: 4 (0 errors)" in output and "throughput:" in output


def test_model_specs_name_their_location() -> None:
    from bulkinfer.api.cli.stack import StackError, parse_model_spec

    assert parse_model_spec("smollm2-135m-instruct") == ("smollm2-135m-instruct", "smollm2-135m-instruct")
    assert parse_model_spec("mine=/models/llama") == ("mine", "/models/llama")
    assert parse_model_spec("q=s3://bucket/models/q/") == ("q", "s3://bucket/models/q/")
    assert parse_model_spec("/data/SmolLM2.Q4_1.gguf") == ("SmolLM2.Q4_1", "/data/SmolLM2.Q4_1.gguf")
    assert parse_model_spec("./ckpt/tiny/") == ("tiny", "./ckpt/tiny/")
    with pytest.raises(StackError, match="expected NAME=LOCATION"):
        parse_model_spec("=/models/x")


def test_up_serves_every_model_given_and_each_answers_a_job(tmp_path: Path, tiny_checkpoint: Path) -> None:
    from bulkinfer.api.cli.stack import Stack, StackOptions
    from bulkinfer.api.client import Client

    options = StackOptions(home=tmp_path, port=0, models={"first": str(tiny_checkpoint),
                                                          "second": str(tiny_checkpoint)},
                           engine_options={"num_kv_blocks": 64, "max_model_len": 256})
    lines: list[str] = []
    with Stack(options, say=lines.append) as stack, Client(stack.url, timeout=30) as client:
        assert httpx.get(f"{stack.url}/models", timeout=10).json() == {"models": ["first", "second"]}
        assert any("models first, second" in line for line in lines)
        for name in ("first", "second"):
            job = client.jobs.create({"model": name, "prompt_column": "p",
                                      "sampling": {"max_tokens": 2, "temperature": 0}},
                                     input=[{"p": "def f(x):"}, {"p": "import os"}])
            final = client.jobs.wait(job.job_id, timeout=120, progress=False)
            assert final.state.value == "succeeded" and final.rows.succeeded == 2, final.error


def test_up_refuses_a_model_it_cannot_serve_before_starting_anything(tmp_path: Path) -> None:
    process = bulkinfer("up", "--port", "0", "--home", str(tmp_path),
                        "--model", f"broken={tmp_path / 'no-such-folder'}")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 1, output
    assert "bulkinfer up: model 'broken'" in output and "no-such-folder" in output
    assert not (tmp_path / "redis").exists()  # nothing was started
