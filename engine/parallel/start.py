"""The engine's entry to tensor parallelism: start the other ranks where the config asks for them."""

from __future__ import annotations

from typing import Any

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.parallel.group import TensorParallelGroup
from bulkinfer.engine.parallel.loading import load_rank_model
from bulkinfer.engine.parallel.plan import check_splittable

__all__ = ["load_rank_model", "start_group"]


def start_group(config: EngineConfig, model_config: Any) -> TensorParallelGroup | None:
    """None with one rank; else the started group of ranks 1..N-1 (after checking the model splits
    over N, so a bad size fails here, before any process starts). `config` must be resolved."""
    if config.tensor_parallel_size == 1:
        return None
    check_splittable(model_config, config.tensor_parallel_size)
    return TensorParallelGroup(config)
