"""What rank 0 tells a rank process (`RankSpec`) and which device rank r uses: shared by the group that
starts the ranks (group.py) and the ranks' loop (rank_worker.py), which builds a model runner."""

from __future__ import annotations

import dataclasses

import torch

from bulkinfer.engine.config import EngineConfig


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a rank process needs to join the group and build its part of the model."""

    rank: int
    world: int
    port: int
    config: EngineConfig  # resolved: dtype and max_model_len set
    threads: int  # intra-op threads on CPU (the host's cores shared among the ranks)
    start_timeout_s: float


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: cuda:(first + r) on GPUs, the host on CPU."""
    base = torch.device(device)
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + rank)
    return base
