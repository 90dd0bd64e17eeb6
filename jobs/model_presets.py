"""Preset model names: `tiny` and `small` are random-weight Llama checkpoints (text is noise,
figures are real) built on this machine the first time one is used and cached after that, the same
folder for every command that takes a model (`run --model small`, `up`, `demo`, a `models` entry
whose location is `small` for `serve worker`, `models list`). A folder, `.gguf` file or catalog
model goes by its location; these by name only.

Named here, apart from the engine that builds them (worker/models/model_files.py resolves a preset
to its folder), so the CLI knows them without importing torch.
"""

from __future__ import annotations

PRESET_NAMES: tuple[str, ...] = ("tiny", "small")
