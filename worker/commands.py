"""CLI commands that need the engine; `api.cli` imports this module by name, only when one is run."""

from __future__ import annotations


def demo(argv: list[str]) -> int:
    from worker.offline_demo import demo_cli

    return demo_cli(argv)


def make_checkpoint(argv: list[str]) -> int:
    from engine.checkpoints import make_checkpoint_cli

    return make_checkpoint_cli(argv)


def models(argv: list[str]) -> int:
    from worker.model_commands import models_cli

    return models_cli(argv)


def bench(argv: list[str]) -> int:
    targets = {"engine": "engine.bench"}
    if not argv or argv[0] not in targets:
        print(f"usage: bulkinfer bench {{{','.join(targets)}}} [--help]")
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    import importlib

    if argv[0] == "engine":  # --model may name a catalog model or a .gguf file: resolved like the worker's
        from engine.bench import bench_cli
        from worker.model_files import local_model_dir

        return bench_cli(argv[1:], resolve_model=lambda location: str(local_model_dir(location)))
    return importlib.import_module(targets[argv[0]]).bench_cli(argv[1:])


def serve_worker(argv: list[str]) -> int:
    """`bulkinfer serve worker`: a Celery worker hosting the engine (see worker/main.py)."""
    from worker.main import serve_worker as run

    return run(argv)


def run(argv: list[str]) -> int:
    """`bulkinfer run FILE -o OUT --model M`: a file through the engine here (see worker/local_run.py)."""
    from worker.local_run_cli import run_cli

    return run_cli(argv)
