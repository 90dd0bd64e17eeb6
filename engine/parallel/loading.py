"""Build one rank's part of a model and fill it with its slices of the checkpoint.

Each rank reads only its part of every split tensor (safetensors ``get_slice``), so N ranks
together read the checkpoint about once, and no rank ever holds the whole model in memory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from bulkinfer.engine.attention import AttentionBackend
from bulkinfer.engine.models.layers import onednn_linear_available
from bulkinfer.engine.models.llama import LlamaForCausalLM
from bulkinfer.engine.models.loader import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    each_checkpoint_tensor,
    model_config_from_dir,
    tensor_problems,
)
from bulkinfer.engine.parallel.communicator import Communicator
from bulkinfer.engine.parallel.layers import add_reductions, swap_vocab_modules
from bulkinfer.engine.parallel.plan import check_splittable, local_config, shard


def load_rank_model(model_dir: str | Path, backend: AttentionBackend, communicator: Communicator,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    batch_hint: int = 64) -> LlamaForCausalLM:
    """This rank's part of ``model_dir``'s model: 1/N of the heads, KV heads (or one replicated),
    MLP channels and vocabulary; all-reduces after its row-parallel modules. Its ``config`` is the
    rank's (local head counts: the KV cache is sized from them) with the whole vocabulary size."""
    config = model_config_from_dir(model_dir)
    world, rank = communicator.world, communicator.rank
    check_splittable(config, world)
    model_cls = SUPPORTED_ARCHITECTURES[config.architecture]
    with torch.device("meta"):
        whole = model_cls(config, backend)
        model = model_cls(local_config(config, world), backend)
        swap_vocab_modules(model, config.vocab_size, communicator)
    plan = whole.tensor_parallel_plan()
    expected = whole.expected_hf_tensors()
    del whole
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.load_hf_tensors(_read_shards(Path(model_dir), expected, plan, rank, world, dtype,
                                       tied=config.tie_word_embeddings))
    add_reductions(model, plan, communicator)
    model.config = dataclasses.replace(model.config, vocab_size=config.vocab_size)
    model.tensor_parallel_size = world
    if onednn_linear_available(torch.device(device), dtype):
        model.pack_linear_weights(batch_hint)
    return model.eval()


def _read_shards(model_dir: Path, expected: dict[str, tuple[int, ...]], plan: dict, rank: int, world: int,
                 dtype: torch.dtype, tied: bool) -> dict[str, torch.Tensor]:
    """This rank's part of every expected tensor, after checking every name and shape in the files."""
    shapes: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for path, f, name in each_checkpoint_tensor(model_dir):
        where[name] = path
        shapes[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
    problems = tensor_problems(expected, shapes, allowed_extra={"lm_head.weight"} if tied else set())
    if problems:
        raise CheckpointError("; ".join(problems))
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(where.values())):
        with safe_open(str(path), framework="pt") as f:
            for name in expected:
                if where[name] != path:
                    continue
                split = plan.get(name)
                if split is None:
                    tensors[name] = f.get_tensor(name).to(dtype)
                else:
                    part = shard(f.get_slice(name), expected[name], split, rank, world, name)
                    tensors[name] = part.to(dtype)
    return tensors
