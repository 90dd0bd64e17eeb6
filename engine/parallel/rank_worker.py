"""The loop of ranks 1..N-1: build this rank's part of the model, then run every forward rank 0
asks for, in the order it asks (each forward's collectives pair with rank 0's).

Started as ``python -m bulkinfer.engine.parallel.rank_main`` (not multiprocessing's spawn, which re-runs
the parent's main module: a user's script without a ``__main__`` guard would start its engine
again in every rank). Its argument is the file descriptor of its end of a socket pair with rank 0,
over which the spec and every later message come.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from bulkinfer.engine.parallel.rank_spec import RankSpec, rank_device


def run_rank(spec: RankSpec, conn: Connection) -> None:
    """Process entry point. Exits when rank 0 says stop or goes away (its end of the pipe closes);
    an exception is sent to rank 0 (which fails the engine with it) before this process exits."""
    try:
        runner = _build(spec, conn)
        conn.send(("ready", None))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            follow(runner, message)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return  # rank 0 is gone: nothing to report to
    except BaseException:  # noqa: BLE001 - reported to rank 0, which fails the engine with it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)


def _build(spec: RankSpec, conn: Connection) -> Any:
    from bulkinfer.engine import cpu_kernels
    from bulkinfer.engine.dtype_choice import DTYPES
    from bulkinfer.engine.gpu_kernels.choice import (
        build_attention_backend,
        use_triton_kernels,
        use_triton_layer_ops,
    )
    from bulkinfer.engine.invariant.cuda_settings import use_invariant_cuda_settings
    from bulkinfer.engine.model_runner import ModelRunner
    from bulkinfer.engine.parallel.communicator import Communicator
    from bulkinfer.engine.parallel.loading import load_rank_model

    device = rank_device(spec.config.device, spec.rank)
    if device.type == "cpu":
        torch.set_num_threads(spec.threads)
    else:
        torch.cuda.set_device(device)
    conn.send(("joining", None))  # imports done: rank 0 may now wait in the group's rendezvous
    communicator = Communicator.connect(spec.rank, spec.world, spec.port, device, spec.start_timeout_s)
    uses_triton = use_triton_kernels(spec.config.triton_kernels, device.type)
    kernels = cpu_kernels.load() if device.type == "cpu" and not uses_triton else None
    attention = build_attention_backend(uses_triton, kernels, spec.config.batch_invariant_on)
    if spec.config.batch_invariant_on and device.type == "cuda":
        use_invariant_cuda_settings()
    model = load_rank_model(spec.config.model, attention, communicator,
                            dtype=DTYPES[spec.config.dtype], device=device,
                            batch_hint=spec.config.max_num_batched_tokens)
    model.use_cpu_kernels(kernels)
    use_triton_layer_ops(model, uses_triton)
    if hasattr(model, "use_batch_invariance"):
        model.use_batch_invariance(spec.config.batch_invariant_on)
    return ModelRunner(dataclasses.replace(spec.config, device=str(device)), model)


def follow(runner: Any, message: tuple) -> None:
    """Run what rank 0's runner runs (engine/model_runner.py sends these)."""
    kind, *args = message
    if kind == "profile":
        runner.profile_run()
    elif kind == "allocate":
        runner.allocate_kv_cache(*args)
    elif kind == "probe":
        runner.probe_forward(*args)
    elif kind == "step":
        runner.forward_rows(*args)
    else:
        raise ValueError(f"unknown tensor-parallel message {kind!r}")

