"""The settings the embedded stack (`bulkinfer up`, `demo`) runs its API and its worker on.

One `Settings` for both: the user's (flags > variables > config file > defaults, as `up` read them)
with only what the stack decides itself over them: its own Redis, its store under the home folder
and the models it prepared. The worker gets them as variables (`Settings.to_env()`) over this
process's environment, so a setting the user gave reaches it unchanged, never replaced by a default.
"""

from __future__ import annotations

import json
import sys

from bulkinfer.jobs.settings import Settings

HF_OFFLINE = {"HF_HUB_OFFLINE": "1"}  # models are prepared before the worker starts: no Hub calls


def stack_settings(user: Settings, *, broker_url: str, store_uri: str, models: dict[str, str],
                   engine_options: dict[str, object]) -> Settings:
    """`user`'s settings with the stack's Redis, store and models (and `engine_options`, when given:
    a caller without settings of its own passes them here) over them."""
    own: dict[str, object] = {"broker_url": broker_url, "store_uri": store_uri, "models": json.dumps(models)}
    if engine_options:
        own["engine_options"] = json.dumps(engine_options)
    return Settings.model_validate({**user.model_dump(), **own})


def worker_environment(settings: Settings, models: list[str]) -> dict[str, str]:
    """The variables the worker child gets over this process's environment: every setting, and the
    models it loads at start."""
    return {**settings.to_env(), "BULKINFER_WORKER_MODELS": ",".join(models), **HF_OFFLINE}


def worker_command(settings: Settings, queues: list[str], node: str) -> list[str]:
    """The worker child's command line: a Celery worker with `worker_concurrency` task threads."""
    return [sys.executable, "-m", "celery", "-A", "bulkinfer.worker.process.celery_app", "worker",
            "--pool=threads", f"--concurrency={settings.worker_concurrency}", "-Q", ",".join(queues),
            "-n", node, "--loglevel=INFO", "--without-gossip", "--without-mingle"]
