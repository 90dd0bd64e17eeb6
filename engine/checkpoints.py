"""Small deterministic Hugging Face-format checkpoints for tests, demos and benchmarks.

No model can be downloaded on our machines, so the engine is tested against checkpoints we build
ourselves: a random-weight model (llama, qwen2, qwen3, mistral, gemma3, phi3; the mixture-of-experts
qwen3_moe, mixtral, qwen2_moe, with per-expert tensors under the published checkpoints' names) plus a
byte-level BPE tokenizer trained on Python's own stdlib sources. The same (preset, arch, seed) gives
byte-identical files for the same Python / torch / tokenizers versions.

Tied embeddings: qwen2, qwen3 and gemma3 tie `lm_head` to `embed_tokens` (as small Qwen models and
every Gemma do, no `lm_head.weight` in the file); llama, mistral and phi3 keep a separate one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

# Bump when the layout, init or tokenizer recipe changes: it invalidates cached checkpoints.
FORMAT_VERSION = 4

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: bos=0, eos=1, pad=2, im_start=3, im_end=4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Gemma 3's own template (google/gemma-3-*-it, less its image parts): a system message is folded into
# the first user turn, roles must alternate, the assistant is "model". Its turn markers are plain
# text to our tokenizer (the real one has them as special tokens); BOS comes from the template.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def chat_template(arch: str) -> str:
    return GEMMA3_CHAT_TEMPLATE if arch == "gemma3" else CHAT_TEMPLATE


CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# Stdlib modules that exist (as these paths) in CPython 3.11+; missing ones are skipped.
# About 2 MB of code and English docstrings: BPE training takes well under a second.
_CORPUS_FILES = (
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "email/message.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "http/client.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "mailbox.py",
    "pickle.py",
    "pprint.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "uuid.py",
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


PRESETS: dict[str, Preset] = {
    # ~1.0M params tied, ~1.25M untied.
    "tiny": Preset(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=344, vocab_size=2048
    ),
    # ~27.8M params tied, ~32.0M untied.
    "small": Preset(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408, vocab_size=8192
    ),
}

_ARCH_CONFIGS: dict[str, tuple[type[PretrainedConfig], str, bool]] = {
    # arch: (config class, architectures entry, tie_word_embeddings)
    "llama": (LlamaConfig, "LlamaForCausalLM", False),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", True),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", True),
    "mistral": (MistralConfig, "MistralForCausalLM", False),
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM", True),
    "phi3": (Phi3Config, "Phi3ForCausalLM", False),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", False),
    "mixtral": (MixtralConfig, "MixtralForCausalLM", False),
    "qwen2_moe": (Qwen2MoeConfig, "Qwen2MoeForCausalLM", False),
}

# Gemma 3 scaled down: local and global layers alternating (the real models: 5 local : 1 global),
# a window that the tests' prompts cross, its own rotary base per layer kind (global: linear
# scaling, as the 4B-27B models), a query scale that is not head_dim ** -0.5 (as the 27B model),
# and the final-logit soft-cap Gemma 2 used (Gemma 3 leaves it null; set here so it is tested).
GEMMA3_SLIDING_WINDOW = 20
GEMMA3_EXTRA: dict[str, object] = dict(
    sliding_window=GEMMA3_SLIDING_WINDOW,
    sliding_window_pattern=2,
    query_pre_attn_scalar=48,
    final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh",
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)
# Phi-3-mini-128k scaled down: longrope with per-frequency short/long factors; its original context
# (256) is past every prompt of the correctness suite (transformers switches factors per forward
# pass, we per position: the same for prompts up to that length), and generation may cross it.
PHI3_ORIGINAL_CONTEXT = 256


def _phi3_rope(head_dim: int) -> dict[str, object]:
    half = head_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.0 + 0.6 * i for i in range(half)],
        "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
    }
ARCHS = tuple(_ARCH_CONFIGS)


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts arch's sparse MLP, as its real configs proportion it to the hidden size
    (each width rounded up to 32, whole AMX tiles for the bf16 row kernel)."""

    num_experts: int
    top_k: int
    expert_ratio: float  # an expert's width / hidden size
    shared_ratio: float = 0.0  # the shared expert's width / hidden size (Qwen2-MoE)
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()

    def width(self, hidden: int, ratio: float) -> int:
        return -(-int(hidden * ratio) // 32) * 32


_MOE_SHAPES: dict[str, MoeShape] = {
    # Qwen3-30B-A3B: 128 experts, top-8, 768 wide at hidden 2048, norm_topk_prob. Layer 1 dense here
    # (mlp_only_layers) so every test also runs a dense MLP layer among sparse ones.
    "qwen3_moe": MoeShape(num_experts=8, top_k=2, expert_ratio=0.375, mlp_only_layers=(1,)),
    # Mixtral-8x7B: 8 experts, top-2, 14336 wide at hidden 4096; always renormalised.
    "mixtral": MoeShape(num_experts=8, top_k=2, expert_ratio=3.5),
    # Qwen1.5-MoE-A2.7B: 60 experts, top-4, 1408 wide plus a 5632-wide shared expert at hidden 2048,
    # top-k probabilities not renormalised.
    "qwen2_moe": MoeShape(num_experts=8, top_k=4, expert_ratio=0.6875, shared_ratio=2.75,
                          norm_topk_prob=False),
}

# Init scales, chosen by measuring tiny and small models of every arch (see _init_tensor).
_EMBED_GAIN = 2.0
_LINEAR_GAIN = 1.5


# ---------------------------------------------------------------------------------------------
# config


def make_config(preset: str = "tiny", arch: str = "llama") -> PretrainedConfig:
    """The transformers config of a preset/arch, with our tokenizer's special-token ids."""
    p = _preset(preset)
    config_cls, architecture, tied = _arch(arch)
    kwargs: dict[str, Any] = dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        architectures=[architecture],
        dtype="float32",
    )
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None  # full attention: the engine needs no window support for it
    if arch == "gemma3":
        del kwargs["rope_theta"]
        kwargs.update(GEMMA3_EXTRA)
    if arch == "phi3":
        del kwargs["rope_theta"]
        kwargs.update(rope_parameters=_phi3_rope(p.head_dim),
                      max_position_embeddings=4 * PHI3_ORIGINAL_CONTEXT,  # attention factor ~1.13
                      original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT)
    moe = _MOE_SHAPES.get(arch)
    if arch == "mixtral" and moe is not None:
        kwargs.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                      intermediate_size=moe.width(p.hidden_size, moe.expert_ratio))
    elif moe is not None:
        kwargs.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=moe.width(p.hidden_size, moe.expert_ratio),
                      norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=list(moe.mlp_only_layers))
        if moe.shared_ratio:
            kwargs["shared_expert_intermediate_size"] = moe.width(p.hidden_size, moe.shared_ratio)
    return config_cls(**kwargs)


def _preset(preset: str) -> Preset:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    return PRESETS[preset]


def _arch(arch: str) -> tuple[type[PretrainedConfig], str, bool]:
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(_ARCH_CONFIGS)}")
    return _ARCH_CONFIGS[arch]


# ---------------------------------------------------------------------------------------------
# weights


def tensor_shapes(preset: str = "tiny", arch: str = "llama") -> dict[str, tuple[int, ...]]:
    """Every tensor in model.safetensors (HF names) and its shape."""
    p = _preset(preset)
    _, _, tied = _arch(arch)
    h, d, q_out, kv_out = p.hidden_size, p.head_dim, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (p.vocab_size, h)}
    for i in range(p.num_layers):
        pre = f"model.layers.{i}"
        shapes[f"{pre}.input_layernorm.weight"] = (h,)
        shapes[f"{pre}.post_attention_layernorm.weight"] = (h,)
        if arch == "phi3":  # fused in the checkpoint
            shapes[f"{pre}.self_attn.qkv_proj.weight"] = (q_out + 2 * kv_out, h)
            shapes[f"{pre}.self_attn.o_proj.weight"] = (h, q_out)
            shapes[f"{pre}.mlp.gate_up_proj.weight"] = (2 * p.intermediate_size, h)
            shapes[f"{pre}.mlp.down_proj.weight"] = (h, p.intermediate_size)
            continue
        if arch == "gemma3":
            shapes[f"{pre}.pre_feedforward_layernorm.weight"] = (h,)
            shapes[f"{pre}.post_feedforward_layernorm.weight"] = (h,)
        shapes[f"{pre}.self_attn.q_proj.weight"] = (q_out, h)
        shapes[f"{pre}.self_attn.k_proj.weight"] = (kv_out, h)
        shapes[f"{pre}.self_attn.v_proj.weight"] = (kv_out, h)
        shapes[f"{pre}.self_attn.o_proj.weight"] = (h, q_out)
        if arch in ("qwen2", "qwen2_moe"):
            shapes[f"{pre}.self_attn.q_proj.bias"] = (q_out,)
            shapes[f"{pre}.self_attn.k_proj.bias"] = (kv_out,)
            shapes[f"{pre}.self_attn.v_proj.bias"] = (kv_out,)
        if arch in ("qwen3", "gemma3", "qwen3_moe"):
            shapes[f"{pre}.self_attn.q_norm.weight"] = (d,)
            shapes[f"{pre}.self_attn.k_norm.weight"] = (d,)
        moe = _MOE_SHAPES.get(arch)
        if moe is not None and i not in moe.mlp_only_layers:
            shapes.update(_moe_tensor_shapes(arch, moe, pre, h))
            continue
        shapes[f"{pre}.mlp.gate_proj.weight"] = (p.intermediate_size, h)
        shapes[f"{pre}.mlp.up_proj.weight"] = (p.intermediate_size, h)
        shapes[f"{pre}.mlp.down_proj.weight"] = (h, p.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not tied:
        shapes["lm_head.weight"] = (p.vocab_size, h)
    return shapes


def _moe_tensor_shapes(arch: str, moe: MoeShape, pre: str, h: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's tensors under the names the family's published checkpoints use."""
    width = moe.width(h, moe.expert_ratio)
    block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral"
                               else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    shapes: dict[str, tuple[int, ...]] = {f"{pre}.{block}.gate.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        shapes[f"{pre}.{block}.experts.{e}.{gate}.weight"] = (width, h)
        shapes[f"{pre}.{block}.experts.{e}.{up}.weight"] = (width, h)
        shapes[f"{pre}.{block}.experts.{e}.{down}.weight"] = (h, width)
    if moe.shared_ratio:
        shared = moe.width(h, moe.shared_ratio)
        shapes[f"{pre}.{block}.shared_expert.gate_proj.weight"] = (shared, h)
        shapes[f"{pre}.{block}.shared_expert.up_proj.weight"] = (shared, h)
        shapes[f"{pre}.{block}.shared_expert.down_proj.weight"] = (h, shared)
        shapes[f"{pre}.{block}.shared_expert_gate.weight"] = (1, h)
    return shapes


def num_parameters(preset: str = "tiny", arch: str = "llama") -> int:
    """Parameter count without building anything (tied embeddings counted once)."""
    total = 0
    for shape in tensor_shapes(preset, arch).values():
        n = 1
        for dim in shape:
            n *= dim
        total += n
    return total


def make_weights(preset: str = "tiny", arch: str = "llama", seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights. Each tensor has its own generator seeded from (seed, name), so
    adding a tensor to one arch never shifts the values of the others."""
    hidden = _preset(preset).hidden_size
    weights = {}
    for name, shape in tensor_shapes(preset, arch).items():
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        weights[name] = _init_tensor(name, shape, hidden, gen)
        if arch == "gemma3":
            weights[name] = _gemma3_init(name, weights[name])
    return weights


def _gemma3_init(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Gemma scales norms by (1 + weight) and embeddings by sqrt(hidden). Random tied embeddings
    scaled so would make every token predict itself (the embedding outweighs every layer's
    output): the embedding is 4x smaller and the final norm's gain 4x larger (the logits keep the
    other archs' scale); the post-attention/-feedforward norms keep gains ~2 and the q/k norms
    get ~1.5 (so each layer's output counts and attention is sharp, as _LINEAR_GAIN makes them for
    the other archs), the input and pre-feedforward norms get gains ~1."""
    if name == "model.embed_tokens.weight":
        return tensor / GEMMA3_EMBED_SHRINK
    if name == "model.norm.weight":
        return tensor * GEMMA3_EMBED_SHRINK - 1.0
    if name.endswith(("input_layernorm.weight", "pre_feedforward_layernorm.weight")):
        return tensor - 1.0
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return tensor - 0.5
    return tensor


GEMMA3_EMBED_SHRINK = 4.0


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_tensor(name: str, shape: tuple[int, ...], hidden: int, gen: torch.Generator) -> torch.Tensor:
    if "norm" in name:
        # Not all ones: an engine that forgets to apply a norm weight must give different logits.
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        # Non-zero for the same reason: a dropped qkv bias must show.
        return 0.1 * torch.randn(shape, generator=gen)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        # Logits get std ~2 (tied or not): clear top-1 gaps, yet sampling still has choices.
        return torch.randn(shape, generator=gen) * (_EMBED_GAIN * hidden**-0.5)
    # Gain > 1 over 1/sqrt(fan_in): each layer's output outweighs the token's own embedding in the
    # residual, so attention scores are sharp (~2 std), outputs depend on context and positions,
    # and greedy decoding does not collapse to repeating one token (it does with std 0.02).
    return torch.randn(shape, generator=gen) * (_LINEAR_GAIN * shape[-1] ** -0.5)


def count_parameters(checkpoint: str | Path) -> int:
    """Parameter count of a built checkpoint, read from the safetensors header."""
    total = 0
    with safe_open(str(Path(checkpoint) / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            n = 1
            for dim in f.get_slice(key).get_shape():
                n *= dim
            total += n
    return total


# ---------------------------------------------------------------------------------------------
# tokenizer


def _corpus_paths() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / rel for rel in sorted(_CORPUS_FILES) if (root / rel).is_file()]


# The split pattern transformers' Qwen2Tokenizer hard-codes (Llama-3-like, single digits). transformers 5
# rebuilds every model_type=qwen2 tokenizer from vocab + merges with this pattern and an NFC normalizer,
# whatever tokenizer.json says; using the same pipeline keeps every loader on the same token ids.
_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per vocab size per process (the archs of a preset share a tokenizer)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in _corpus_paths()]
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int, arch: str = "llama") -> PreTrainedTokenizerFast:
    """Byte-level BPE with our special tokens and ChatML template. No BOS is added on encode, so
    decode(encode(s)) == s for any UTF-8 text; for qwen2 only for NFC text (see _SPLIT_PATTERN)."""
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    if arch == "qwen2":
        tok.normalizer = normalizers.NFC()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chat_template(arch),
        model_max_length=PRESETS["tiny"].max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path, arch: str = "llama") -> None:
    tokenizer.save_pretrained(str(out))
    # Some transformers versions fold special_tokens_map.json into tokenizer_config.json; write it
    # anyway, older loaders and other tools still read it.
    special_map = out / "special_tokens_map.json"
    if not special_map.exists():
        _write_json(
            special_map,
            {
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "additional_special_tokens": [IM_START, IM_END],
            },
        )
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes its own class name ("TokenizersBackend"); the generic fast class loads
    # with transformers 4.x too. The chat template must live here, not in a separate .jinja file.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Qwen2Tokenizer (see _SPLIT_PATTERN) would otherwise add an "<|endoftext|>" unk token past the vocab.
    config["unk_token"] = None
    config["chat_template"] = chat_template(arch)
    _write_json(config_path, config)
    (out / "chat_template.jinja").unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# building


def build_checkpoint(
    path: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0, overwrite: bool = False
) -> Path:
    """Write a HF-format checkpoint folder at `path` and return it.

    The folder is built next to the target and renamed into place, so `path` either does not exist
    or is complete. An existing non-empty `path` raises FileExistsError unless `overwrite`.
    """
    target = Path(path).expanduser().resolve()
    if _exists_nonempty(target) and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty")
    config = make_config(preset, arch)  # validates preset/arch before any work
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_checkpoint(tmp, config, preset, arch, seed)
        _publish(tmp, target, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    return target


def _write_checkpoint(out: Path, config: PretrainedConfig, preset: str, arch: str, seed: int) -> None:
    config.save_pretrained(str(out))
    save_file(make_weights(preset, arch, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    _save_tokenizer(build_tokenizer(config.vocab_size, arch), out, arch)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(str(out))
    missing = [name for name in CHECKPOINT_FILES if not (out / name).is_file()]
    if missing:
        raise RuntimeError(f"checkpoint build did not write {missing}")
    make_readable(out)


def make_readable(out: Path) -> None:
    """mkdtemp creates the folder 0700 (and some writers 0600 files); give the published checkpoint
    ordinary umask-based permissions so other users and containers can read it."""
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for child in out.iterdir():
        child.chmod(0o666 & ~umask)


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished build into place. Raises FileExistsError if someone else got there first
    (and overwrite is off)."""
    if overwrite and target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        # rename() onto an empty directory replaces it; onto a non-empty one it fails.
        os.rename(tmp, target)
    except OSError as exc:
        if _exists_nonempty(target):
            raise FileExistsError(f"{target} already exists and is not empty") from exc
        raise


def _exists_nonempty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


# ---------------------------------------------------------------------------------------------
# cache


CACHE_DIR_ENV = "BULKINFER_CACHE_DIR"  # where presets and test checkpoints are built (not a setting)


def cache_dir() -> Path:
    """$BULKINFER_CACHE_DIR, else <repo>/.cache/checkpoints in a source checkout, else
    ~/.cache/bulkinfer/checkpoints."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[1]
    if (repo / "pyproject.toml").is_file() and (repo / ".git").exists():
        return repo / ".cache" / "checkpoints"
    return Path.home() / ".cache" / "bulkinfer" / "checkpoints"


def cached_checkpoint_path(preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Where `cached_checkpoint` keeps this checkpoint, built or not (`is_cached` says which)."""
    config = make_config(preset, arch)  # validate early
    # The config's own hash too: a changed arch config must not reuse a stale build.
    config_key = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:6]
    return cache_dir() / f"{arch}-{preset}-seed{seed}-{_cache_key()}{config_key}"


def is_cached(path: Path) -> bool:
    """Whether a cached checkpoint's folder is whole."""
    return _is_complete(path)


def cached_checkpoint(preset: str = "tiny", arch: str = "llama", seed: int = 0) -> Path:
    """Build a checkpoint once and reuse it. Two processes building the same one at once is safe:
    each builds privately, the first rename wins and the other uses the winner's folder."""
    target = cached_checkpoint_path(preset, arch, seed)
    if _is_complete(target):
        return target
    try:
        return build_checkpoint(target, preset, arch, seed)
    except FileExistsError:
        if _is_complete(target):
            return target
        raise


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in CHECKPOINT_FILES)


@lru_cache(maxsize=1)
def _cache_key() -> str:
    # Bytes depend on the recipe and on these versions (stdlib text, RNG, BPE trainer, file writers).
    import tokenizers
    import transformers

    parts = (
        FORMAT_VERSION,
        f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
        torch.__version__,
        tokenizers.__version__,
        transformers.__version__,
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:10]


# ---------------------------------------------------------------------------------------------
# CLI


def make_checkpoint_cli(argv: list[str] | None = None) -> int:
    """`make-checkpoint DIR --preset tiny|small --arch llama|qwen2|...|phi3|qwen3_moe|... --seed N`."""
    parser = argparse.ArgumentParser(
        prog="make-checkpoint", description="Build a deterministic random-weight HF-format checkpoint."
    )
    parser.add_argument("dir", type=Path, help="output folder (must not exist or be empty)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=list(ARCHS), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing folder")
    args = parser.parse_args(argv)
    try:
        path = build_checkpoint(args.dir, args.preset, args.arch, args.seed, overwrite=args.force)
    except FileExistsError as exc:
        print(f"make-checkpoint: {exc} (use --force to replace it)", file=sys.stderr)
        return 1
    print(path)
    print(f"parameters: {count_parameters(path):,}")
    return 0


if __name__ == "__main__":
    sys.exit(make_checkpoint_cli())
