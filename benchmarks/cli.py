"""`bulkinfer bench engine|suite|step|service|faults|spec|batch-apis|embed|lora|kvstore`: which benchmark a
`bench` command line runs."""

from __future__ import annotations

import importlib

TARGETS = {"engine": "benchmarks.engine", "suite": "benchmarks.suite", "step": "benchmarks.step_profile",
           "service": "benchmarks.service", "faults": "benchmarks.faults", "spec": "benchmarks.speculative",
           "batch-apis": "benchmarks.batch_apis", "embed": "benchmarks.embed", "lora": "benchmarks.lora",
           "kvstore": "benchmarks.kvstore"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TARGETS:
        print(f"usage: bulkinfer bench {{{','.join(TARGETS)}}} [--help]")
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    module = importlib.import_module(TARGETS[argv[0]])
    # --model: also a catalog model or a .gguf file
    if argv[0] in {"engine", "suite", "step", "spec", "embed", "lora", "kvstore"}:
        from worker.model_files import local_model_dir

        return module.bench_cli(argv[1:], resolve_model=lambda location: str(local_model_dir(location)))
    return module.bench_cli(argv[1:])
