"""A GGUF file → a Hugging Face model folder that both the engine and `transformers` load.

`transformers` reads GGUF (dequantizing every tensor) and writes safetensors; this module checks
the file first, so a file the engine cannot serve is refused with what is wrong before minutes of
conversion, and writes the folder under a temporary name that is renamed into place at the end:
a crash or a refusal leaves nothing half-made where a model is expected.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bulkinfer.worker.models.gguf_parse_once import parsed_once, reader_class

logger = logging.getLogger(__name__)

# GGUF `general.architecture` values the engine serves (llama.cpp writes Mistral models as llama).
SERVED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
IMPORT_DTYPES = ("float32", "bfloat16", "float16")
GGUF_MAGIC = b"GGUF"
# Written into every imported folder: where it came from and how it was made.
PROVENANCE_FILE = "bulkinfer-import.json"
# Ids llama.cpp records as ending a turn; every one of them ends generation in the engine.
_END_TOKEN_FIELDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                     "tokenizer.ggml.eom_token_id")


class GgufImportError(ValueError):
    """The file cannot be imported; the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class GgufSummary:
    path: Path
    architecture: str
    name: str
    tensor_types: dict[str, int]  # GGML type name → number of tensors
    end_token_ids: tuple[int, ...]
    reader: Any = field(default=None, repr=False, compare=False)  # the parsed gguf.GGUFReader

    @property
    def quantization(self) -> str:
        return "+".join(sorted(self.tensor_types, key=lambda kind: -self.tensor_types[kind]))


def inspect_gguf(path: str | Path) -> GgufSummary:
    """Read the file's header and tensor table and check that it is whole and servable: a GGUF
    file, every tensor's bytes present, an architecture the engine serves, and tensor types that
    can be dequantized. Raises GgufImportError naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise GgufImportError(f"{path}: no such file")
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise GgufImportError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    size = path.stat().st_size
    try:
        # The reader maps every tensor's bytes: a file cut short anywhere fails here.
        reader = reader_class()(path)
    except Exception as error:  # noqa: BLE001 - it raises many kinds on a cut-off file
        raise GgufImportError(f"{path}: truncated or corrupt GGUF file ({size} bytes): "
                              f"{type(error).__name__}: {error}") from None
    if not reader.tensors:
        raise GgufImportError(f"{path}: the GGUF file holds no tensors")
    architecture = str(_field(reader, "general.architecture") or "")
    name = str(_field(reader, "general.name") or path.stem)
    if architecture == "llama" and "mistral" in name.lower():
        architecture = "mistral"
    if architecture not in SERVED_ARCHITECTURES:
        raise GgufImportError(f"{path}: architecture {architecture or '(none given)'!r} is not served by "
                              f"this engine (served: {', '.join(SERVED_ARCHITECTURES)})")
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in types:
            _check_dequantizable(path, tensor)
        types[kind] = types.get(kind, 0) + 1
    end_ids = tuple(dict.fromkeys(int(value) for value in (_field(reader, f) for f in _END_TOKEN_FIELDS)
                                  if value is not None))
    return GgufSummary(path, architecture, name, types, end_ids, reader)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    return field.contents()


def _check_dequantizable(path: Path, tensor: Any) -> None:
    """Dequantize one row of the tensor: proof that this GGML type can be read at all."""
    from gguf import dequantize

    try:
        dequantize(tensor.data[:1], tensor.tensor_type)
    except NotImplementedError:
        raise GgufImportError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, a type that "
                              "cannot be dequantized (supported: F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, "
                              "K-quants and IQ-quants)") from None


def import_gguf(gguf_path: str | Path, target: str | Path, dtype: str = "bfloat16", *,
                overwrite: bool = False) -> Path:
    """Write the HF folder for `gguf_path` at `target` (safetensors in `dtype`, config,
    tokenizer with its chat template, generation config listing every end id) and return it."""
    if dtype not in IMPORT_DTYPES:
        raise GgufImportError(f"dtype must be one of {', '.join(IMPORT_DTYPES)}, got {dtype!r}")
    target = Path(target).expanduser().resolve()
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise GgufImportError(f"{target} exists and is not empty: choose another folder or overwrite it")
    summary = inspect_gguf(gguf_path)
    from bulkinfer.engine.checkpoints import make_readable  # torch and transformers: only once a file is good

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.importing-", dir=target.parent))
    try:
        _convert(summary, staging, dtype)
        make_readable(staging)  # mkdtemp made it private; every worker on the machine reads it
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("imported %s (%s, %s) into %s as %s", summary.path, summary.architecture,
                summary.quantization, target, dtype)
    return target


def _convert(summary: GgufSummary, folder: Path, dtype: str) -> None:
    source = summary.path.resolve()
    with parsed_once(source, summary.reader):
        _convert_parsed(summary, source, folder, dtype)


def _convert_parsed(summary: GgufSummary, source: Path, folder: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # Dequantized in fp32 (transformers' fast path for GGUF), then rounded once to `dtype`.
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32).to(getattr(torch, dtype))
    except (ValueError, KeyError, NotImplementedError) as error:
        raise GgufImportError(f"{source}: transformers cannot read it: {error}") from None
    # A GGUF-loaded model carries its quantizer, and save_pretrained refuses quantized models; the
    # weights are already dequantized, so this is a plain checkpoint now.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    end_ids = list(dict.fromkeys([*summary.end_token_ids, *_ints(tokenizer.eos_token_id)]))
    generation = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=end_ids or None,
                                  pad_token_id=tokenizer.pad_token_id)
    generation.save_pretrained(folder)
    (folder / PROVENANCE_FILE).write_text(json.dumps({
        "source": str(source), "architecture": summary.architecture, "name": summary.name,
        "tensor_types": summary.tensor_types, "dtype": dtype, "end_token_ids": end_ids,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }, indent=1) + "\n")


def _ints(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [item for item in value if isinstance(item, int)] if isinstance(value, list) else []
