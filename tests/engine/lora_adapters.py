"""Random PEFT LoRA adapters for tests, and the same adapters merged into their base model.

``peft`` builds them as users' training does (``get_peft_model`` + ``save_pretrained``), with
``init_lora_weights=False`` so B is random too (PEFT's default B is zero: a no-op adapter). The
merged reference is ``merge_and_unload`` saved as an ordinary checkpoint next to the adapter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ATTENTION_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "lora_adapters"


def make_adapter(base_dir: str | Path, seed: int, rank: int = 8, alpha: float = 16.0,
                 targets: tuple[str, ...] = ALL_PROJECTIONS, use_rslora: bool = False,
                 weight_scale: float = 1.0) -> tuple[Path, Path]:
    """(adapter folder, merged checkpoint folder), built once per arguments and cached."""

    def build(adapter_dir: Path, merged_dir: Path) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                            init_lora_weights=False, lora_dropout=0.0)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_" in name:
                    parameter.mul_(weight_scale)
        save_adapter_and_merged(model, base_dir, adapter_dir, merged_dir,
                                ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                 "generation_config.json"))

    return cached_adapter([str(base_dir), seed, rank, alpha, targets, use_rslora, weight_scale], build)


def cached_adapter(key: list, build: Callable[[Path, Path], None]) -> tuple[Path, Path]:
    """(adapter folder, merged checkpoint folder) that `build` fills, once per `key` on this machine."""
    folder = CACHE / hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    adapter_dir, merged_dir = folder / "adapter", folder / "merged"
    if not (folder / "done").exists():
        shutil.rmtree(folder, ignore_errors=True)
        build(adapter_dir, merged_dir)
        (folder / "done").touch()
    return adapter_dir, merged_dir


def save_adapter_and_merged(model: Any, base_dir: str | Path, adapter_dir: Path, merged_dir: Path,
                            files: Iterable[str]) -> None:
    """The PEFT model's adapter (`save_pretrained`) and its merged model, with the base's `files`
    (tokenizer, templates, processors) beside the merged weights."""
    model.save_pretrained(str(adapter_dir))
    model.merge_and_unload().save_pretrained(str(merged_dir))
    for name in files:
        if (Path(base_dir) / name).exists() and not (merged_dir / name).exists():
            shutil.copy(Path(base_dir) / name, merged_dir / name)
