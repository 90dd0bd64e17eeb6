"""A draft model cut from the target: its first layers with its embeddings, final norm and lm_head
(self-speculation, as in LayerSkip). It shares the tokenizer by construction and needs no second
download; how often it agrees with the whole model depends on the model (measure the acceptance)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def write_layer_skip_draft(target: str | Path, out: str | Path, num_layers: int) -> Path:
    """Write a checkpoint of `target`'s first `num_layers` decoder layers to `out` (created;
    replaced if it holds an older draft). Returns `out`."""
    target, out = Path(target), Path(out)
    config = json.loads((target / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers < total:
        raise ValueError(f"a layer-skip draft keeps 1 to {total - 1} of {target}'s {total} layers, "
                         f"not {num_layers}")
    tensors = {}
    for path in sorted(target.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                match = _LAYER.match(name)
                if match is None or int(match.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    if not tensors:
        raise ValueError(f"no safetensors weights in {target}")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in target.iterdir():
        weights = path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json")
        if path.is_file() and not weights:
            shutil.copy2(path, staging / path.name)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer kinds (Gemma 3's local/global)
        config["layer_types"] = config["layer_types"][:num_layers]
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
