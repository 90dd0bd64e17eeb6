"""Reading and validating a PEFT LoRA folder's ``adapter_config.json``, without a model.

Only what the engine runs is accepted: plain LoRA (``peft_type`` "LORA") on linear projections,
with ``lora_alpha / r`` scaling, or ``lora_alpha / sqrt(r)`` where ``use_rslora`` says so. Every
other setting that changes the math (DoRA and PEFT's other LoRA variants, bias training, extra
trained modules, per-module ranks or alphas) is refused by name rather than silently served wrong,
and every field read must have its JSON type (engine/lora/config_fields.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bulkinfer.engine.errors import LoRAAdapterError
from bulkinfer.engine.lora.config_fields import check_field_types, shown

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# HF module names the engine can apply LoRA to: Llama-style projections, and Phi-3's fused ones.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "qkv_proj", "gate_up_proj")
# PEFT's LoRA variants (its ``lora_variants``) other than DoRA: each changes the forward pass.
UNSUPPORTED_VARIANTS = ("alora_invocation_tokens", "arrow_config", "use_bdlora", "velora_config",
                        "monteclora_config", "kasa_config")


@dataclass(frozen=True)
class AdapterConfig:
    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    # The module names listed in the config (a PEFT regex or "all-linear" leaves this None: the
    # adapter's tensors then say which modules it changes).
    target_modules: tuple[str, ...] | None
    base_model_name_or_path: str | None
    # The config file's bytes as parsed: part of the adapter's content digest (engine/lora/identity.py).
    raw_bytes: bytes = field(repr=False)

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by (PEFT's ``scaling``)."""
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(path: str | Path) -> AdapterConfig:
    """Validate a PEFT LoRA folder's config (and that its weights file exists); raises
    LoRAAdapterError naming the folder and the problem."""
    folder = Path(path)
    where = f"LoRA adapter {str(folder)!r}"
    if not folder.is_dir():
        raise LoRAAdapterError(f"{where}: not a folder")
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is missing")
    if not weights_path.is_file():
        found = " (only adapter_model.bin, which is not read: save with safetensors)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} is missing{found}")
    try:
        raw_bytes = config_path.read_bytes()
        raw = json.loads(raw_bytes.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not readable JSON ({error})") from None
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    check_field_types(raw, where)
    _refuse_unsupported(raw, where)
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{where}: r must be a positive integer, got {shown(rank)}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{where}: lora_alpha must be a number, got {shown(alpha)}")
    return AdapterConfig(
        path=folder,
        rank=rank,
        lora_alpha=float(alpha),
        use_rslora=raw.get("use_rslora") is True,  # a JSON boolean (checked above); null: false
        target_modules=_target_modules(raw.get("target_modules"), where),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
        raw_bytes=raw_bytes,
    )


def _refuse_unsupported(raw: dict[str, Any], where: str) -> None:
    peft_type = raw.get("peft_type")
    peft_type = "LORA" if peft_type is None else peft_type
    if peft_type.upper() != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    if raw.get("use_dora"):
        raise LoRAAdapterError(f"{where}: DoRA (use_dora) is not supported")
    if raw.get("bias") not in (None, "none"):
        raise LoRAAdapterError(f"{where}: bias={raw['bias']!r} is not supported; only 'none'")
    if raw.get("lora_bias"):
        raise LoRAAdapterError(f"{where}: lora_bias is not supported")
    if raw.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {raw['modules_to_save']!r} is not supported "
                               "(fully trained modules beside the adapter)")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise LoRAAdapterError(f"{where}: {key} (per-module ranks or alphas) is not supported")
    if raw.get("layer_replication"):
        raise LoRAAdapterError(f"{where}: layer_replication is not supported")
    for key in UNSUPPORTED_VARIANTS:
        if raw.get(key):  # set as PEFT tells it (truthy), which then runs another forward pass
            raise LoRAAdapterError(f"{where}: {key} (a LoRA variant) is not supported")


def _target_modules(value: object, where: str) -> tuple[str, ...] | None:
    if not isinstance(value, list):
        return None  # a regex, or "all-linear" (or none): the tensors decide; the type is checked
    names = tuple(sorted({name.rsplit(".", 1)[-1] for name in value}))
    unsupported = [name for name in names if name not in SUPPORTED_MODULES]
    if unsupported:
        raise LoRAAdapterError(f"{where}: target module(s) {unsupported} are not supported "
                               f"(supported: {list(SUPPORTED_MODULES)})")
    return names
