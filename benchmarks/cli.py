"""`bulkinfer bench engine|suite|step|service|faults|spec|batch-apis|embed|lora|kvstore|host|quant|vision`:
which benchmark a `bench` command line runs."""

from __future__ import annotations

import importlib

TARGETS = {"engine": "bulkinfer.benchmarks.engine", "suite": "bulkinfer.benchmarks.suite",
           "step": "bulkinfer.benchmarks.step_profile",
           "service": "bulkinfer.benchmarks.service", "faults": "bulkinfer.benchmarks.faults",
           "spec": "bulkinfer.benchmarks.speculative",
           "batch-apis": "bulkinfer.benchmarks.batch_apis", "embed": "bulkinfer.benchmarks.embed",
           "lora": "bulkinfer.benchmarks.lora",
           "kvstore": "bulkinfer.benchmarks.kvstore", "host": "bulkinfer.benchmarks.host_bench",
           "quant": "bulkinfer.benchmarks.quant", "vision": "bulkinfer.benchmarks.vision"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TARGETS:
        print(f"usage: bulkinfer bench {{{','.join(TARGETS)}}} [--help]")
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    module = importlib.import_module(TARGETS[argv[0]])
    # --model: also a catalog model or a .gguf file
    if argv[0] in {"engine", "suite", "step", "spec", "embed", "lora", "kvstore", "host", "quant"}:
        from bulkinfer.worker.models.model_files import local_model_dir

        return module.bench_cli(argv[1:], resolve_model=lambda location: str(local_model_dir(location)))
    return module.bench_cli(argv[1:])
