"""Random PEFT LoRA adapters for tests, and the same adapters merged into their base model.

``peft`` builds them as users' training does (``get_peft_model`` + ``save_pretrained``), with
``init_lora_weights=False`` so B is random too (PEFT's default B is zero: a no-op adapter). The
merged reference is ``merge_and_unload`` saved as an ordinary checkpoint next to the adapter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ATTENTION_ONLY = ("q_proj", "k_proj", "v_proj", "o_proj")
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "lora_adapters"


def make_adapter(base_dir: str | Path, seed: int, rank: int = 8, alpha: float = 16.0,
                 targets: tuple[str, ...] = ALL_PROJECTIONS, use_rslora: bool = False,
                 weight_scale: float = 1.0) -> tuple[Path, Path]:
    """(adapter folder, merged checkpoint folder), built once per arguments and cached."""
    key = json.dumps([str(base_dir), seed, rank, alpha, targets, use_rslora, weight_scale])
    folder = CACHE / hashlib.sha256(key.encode()).hexdigest()[:16]
    adapter_dir, merged_dir = folder / "adapter", folder / "merged"
    if (folder / "done").exists():
        return adapter_dir, merged_dir
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(weight_scale)
    model.save_pretrained(str(adapter_dir))
    merged = model.merge_and_unload()
    merged.save_pretrained(str(merged_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        if (Path(base_dir) / name).exists() and not (merged_dir / name).exists():
            shutil.copy(Path(base_dir) / name, merged_dir / name)
    (folder / "done").touch()
    return adapter_dir, merged_dir
