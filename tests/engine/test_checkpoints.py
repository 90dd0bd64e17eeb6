"""Deterministic local HF-format checkpoints: they load in transformers, generate, and are reproducible."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import unicodedata
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bulkinfer.engine import checkpoints as ck

TIED = {"llama": False, "qwen2": True, "qwen3": True, "mistral": False, "gemma3": True, "phi3": False,
        "qwen3_moe": False, "mixtral": False, "qwen2_moe": False}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # transformers' model_type where it is not the arch's name
MOE = {"qwen3_moe", "mixtral", "qwen2_moe"}
PROMPT = "def fibonacci(n):\n    return"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def file_hashes(path: Path) -> dict[str, str]:
    return {name: sha256(path / name) for name in ck.CHECKPOINT_FILES}


@pytest.fixture(scope="module")
def loaded(checkpoint_factory):
    """arch -> (path, model, tokenizer, loading info) for the tiny preset; loaded once per module."""
    cache = {}

    def load(arch: str):
        if arch not in cache:
            path = checkpoint_factory(arch=arch)
            model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
            cache[arch] = (path, model.eval(), AutoTokenizer.from_pretrained(path), info)
        return cache[arch]

    return load


def test_hub_is_offline():
    # Set by tests/fixtures/checkpoints.py before transformers is imported: every load here is local.
    assert hf_constants.HF_HUB_OFFLINE


def test_archs_are_the_documented_ones():
    assert set(ck.ARCHS) == set(TIED)
    # Both tied and untied embeddings are covered.
    assert {ck.make_config("tiny", arch).tie_word_embeddings for arch in ck.ARCHS} == {True, False}


@pytest.mark.parametrize("arch", sorted(TIED))
def test_tiny_loads_in_transformers_and_generates(loaded, arch):
    path, model, tokenizer, info = loaded(arch)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPES.get(arch, arch)
    assert config["architectures"] == [type(model).__name__]
    assert model.dtype == torch.float32

    ids = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new_tokens = out[0, ids.input_ids.shape[1] :].tolist()
    assert len(new_tokens) == 8
    assert all(0 <= t < config["vocab_size"] for t in new_tokens)
    assert len(set(new_tokens)) > 1, f"greedy decoding collapsed to one token: {new_tokens}"


@pytest.mark.parametrize("arch", sorted(TIED))
def test_tiny_parameter_count_and_tying(loaded, arch):
    path, model, _, _ = loaded(arch)
    count = ck.count_parameters(path)
    assert count == model.num_parameters() == ck.num_parameters("tiny", arch)
    if TIED[arch]:
        assert 0.9e6 <= count <= 1.1e6
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        # Mixture of experts: the tiny preset's attention and embeddings plus 8 experts a layer.
        assert 1.1e6 <= count <= (7e6 if arch in MOE else 1.4e6)
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert ("lm_head.weight" in load_file(path / "model.safetensors")) is not TIED[arch]


@pytest.mark.parametrize("arch", sorted(TIED))
@pytest.mark.parametrize("preset", sorted(ck.PRESETS))
def test_tensor_names_and_shapes_match_transformers(preset, arch):
    # The meta device builds the HF module tree without allocating: cheap even for `small`.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ck.make_config(preset, arch))
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if TIED[arch]:
        expected.pop("lm_head.weight")  # the same tensor as embed_tokens; HF files omit it
    ours = ck.tensor_shapes(preset, arch)
    if arch in MOE:
        # transformers holds each layer's experts as fused [E, 2I, H] / [E, H, I] tensors and reads
        # the published per-expert names into them (test_tiny_loads_in_transformers: nothing missing
        # or unexpected); everything else has the same shape, under its name (Mixtral's
        # `block_sparse_moe` is transformers' `mlp`).
        expected = {name: shape for name, shape in expected.items() if ".experts." not in name}
        ours = {name.replace(".block_sparse_moe.", ".mlp."): shape for name, shape in ours.items()
                if ".experts." not in name}
    assert ours == expected
    assert ck.num_parameters(preset, arch) == model.num_parameters()


def test_parameter_counts_per_preset():
    assert ck.num_parameters("small", "llama") == pytest.approx(32e6, rel=0.05)
    assert ck.num_parameters("small", "qwen2") == pytest.approx(27.8e6, rel=0.05)
    assert ck.num_parameters("tiny", "qwen3") == pytest.approx(1e6, rel=0.05)


def test_logits_are_not_degenerate_and_depend_on_context(loaded):
    _, model, tokenizer, _ = loaded("llama")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits[0]
        other = model(changed).logits[0, -1]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 1e-2, "greedy decoding would be decided by rounding"
    assert logits[-1].std() > 0.5
    # The first token reaches the last position through attention.
    assert (logits[-1] - other).abs().max() > 1e-2


def test_special_tokens_match_config(loaded):
    path, _, tokenizer, _ = loaded("qwen2")
    config = AutoConfig.from_pretrained(path)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|pad|>",
    )
    assert tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer.pad_token_id == config.pad_token_id
    assert len({config.bos_token_id, config.eos_token_id, config.pad_token_id}) == 3
    assert len(tokenizer) <= config.vocab_size
    for token in ck.SPECIAL_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["bos_token_id"] == config.bos_token_id
    assert generation["eos_token_id"] == config.eos_token_id
    assert generation.get("do_sample", False) is False


ROUND_TRIP_TEXTS = [
    "hello world",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "emoji 🦙🚀 and a family 👨‍👩‍👧‍👦 and flags 🇯🇵",
    "中文字符和日本語のテキスト、한국어",
    "digits 1234567890 and 3.14159, zero width:\u200b, nul:\x00, bell:\x07",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # ✓",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.parametrize("arch", sorted(TIED))
def test_tokenizer_round_trips_utf8(loaded, arch):
    path, _, tokenizer, _ = loaded(arch)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(tokenizer) == raw.get_vocab_size() <= tokenizer.vocab_size
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        # transformers and the bare tokenizers library agree, whichever class transformers picked.
        assert raw.encode(text, add_special_tokens=False).ids == ids
    # No BOS/EOS is added on encode.
    assert tokenizer.encode("abc") == tokenizer.encode("abc", add_special_tokens=False)


@pytest.mark.parametrize("arch", sorted(TIED))
def test_tokenizer_normalization(loaded, arch):
    _, _, tokenizer, _ = loaded(arch)
    decomposed = "cafe\u0301 \u212b"  # NFD e + combining acute, Angstrom sign
    decoded = tokenizer.decode(tokenizer.encode(decomposed, add_special_tokens=False))
    # transformers 5 forces NFC on model_type=qwen2 (Qwen2Tokenizer); the others keep bytes exactly.
    assert decoded == (unicodedata.normalize("NFC", decomposed) if arch == "qwen2" else decomposed)


def test_chat_template_renders_chatml(loaded):
    _, _, tokenizer, _ = loaded("qwen3")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 👋<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert without.endswith("<|im_end|>\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 4


def test_same_seed_gives_identical_bytes(tmp_path, checkpoint_factory):
    ck._trained_tokenizer_json.cache_clear()  # retrain: tokenizer training itself must be deterministic
    first = ck.build_checkpoint(tmp_path / "a", seed=0)
    ck._trained_tokenizer_json.cache_clear()
    second = ck.build_checkpoint(tmp_path / "b", seed=0)
    assert file_hashes(first) == file_hashes(second)
    # The cached one may come from an earlier process: determinism holds across processes too.
    assert file_hashes(checkpoint_factory()) == file_hashes(first)


def test_different_seed_gives_different_weights(tmp_path):
    a = load_file(ck.build_checkpoint(tmp_path / "a", seed=0) / "model.safetensors")
    b = load_file(ck.build_checkpoint(tmp_path / "b", seed=1) / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], b[name]), name
    assert sha256(tmp_path / "a" / "tokenizer.json") == sha256(tmp_path / "b" / "tokenizer.json")


def test_a_tiny_checkpoint_builds_with_a_freshly_trained_tokenizer(tmp_path):
    ck._trained_tokenizer_json.cache_clear()  # train the tokenizer again, as a fresh machine does
    path = ck.build_checkpoint(tmp_path / "tiny", preset="tiny", arch="mistral", seed=5)
    assert json.loads((path / "config.json").read_text())["model_type"] == "mistral"
    assert ck.count_parameters(path) == ck.num_parameters("tiny", "mistral")
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.decode(tokenizer.encode("def add(a, b):", add_special_tokens=False)) == "def add(a, b):"


def test_small_builds_and_runs(tmp_path):
    path = ck.build_checkpoint(tmp_path / "small", preset="small", arch="qwen3", seed=0)
    assert ck.count_parameters(path) == ck.num_parameters("small", "qwen3")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size == 8192
    with torch.no_grad():
        logits = model(tokenizer(PROMPT, return_tensors="pt").input_ids).logits[0, -1]
    top2 = logits.topk(2).values
    assert top2[0] - top2[1] > 1e-5


def test_unknown_preset_or_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        ck.build_checkpoint(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="unknown arch"):
        ck.build_checkpoint(tmp_path / "x", arch="gpt2")
    assert not (tmp_path / "x").exists()


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        ck.build_checkpoint(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_is_kept_unless_overwrite(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        ck.build_checkpoint(target)
    assert (target / "keep.txt").read_text() == "mine"
    ck.build_checkpoint(target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == sorted(ck.CHECKPOINT_FILES)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_empty_target_folder_is_filled(tmp_path):
    (tmp_path / "ckpt").mkdir()
    path = ck.build_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in path.iterdir()) == sorted(ck.CHECKPOINT_FILES)


def test_published_checkpoint_is_world_readable(tmp_path):
    umask = os.umask(0o022)
    try:
        path = ck.build_checkpoint(tmp_path / "ckpt")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # not mkdtemp's 0700
    assert {stat.S_IMODE(child.stat().st_mode) for child in path.iterdir()} == {0o644}


def test_cache_dir_prefers_env_then_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("BULKINFER_CACHE_DIR", str(tmp_path / "c"))
    assert ck.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("BULKINFER_CACHE_DIR")
    repo = Path(ck.__file__).resolve().parents[1]
    assert ck.cache_dir() == repo / ".cache" / "checkpoints"


def test_cached_checkpoint_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("BULKINFER_CACHE_DIR", str(tmp_path))
    first = ck.cached_checkpoint(arch="qwen2", seed=7)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ck.cached_checkpoint(arch="qwen2", seed=7) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert ck.cached_checkpoint(arch="qwen2", seed=8) != first


def test_cached_checkpoint_loser_of_a_race_uses_the_winner(tmp_path, monkeypatch):
    """Another process publishes the same checkpoint while we are still writing ours."""
    monkeypatch.setenv("BULKINFER_CACHE_DIR", str(tmp_path))
    real_write = ck._write_checkpoint
    winners: list[Path] = []

    def write_then_lose(out, config, preset, arch, seed):
        real_write(out, config, preset, arch, seed)
        if not winners:  # the "other process" finishes first, between our write and our rename
            winners.append(out.parent / out.name[1:].split(".tmp-")[0])  # out is ".<target>.tmp-XXXX"
            ck.build_checkpoint(winners[0], preset, arch, seed)

    monkeypatch.setattr(ck, "_write_checkpoint", write_then_lose)
    path = ck.cached_checkpoint(arch="llama", seed=3)
    assert winners == [path]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp folder left behind
    assert sorted(p.name for p in path.iterdir()) == sorted(ck.CHECKPOINT_FILES)


def test_cached_checkpoint_from_two_threads_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("BULKINFER_CACHE_DIR", str(tmp_path))
    barrier = threading.Barrier(2)
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        barrier.wait()
        try:
            results.append(ck.cached_checkpoint(arch="mistral", seed=11))
        except BaseException as exc:  # reported below; a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]


def test_cli_builds_and_reports_parameters(tmp_path, capsys):
    target = tmp_path / "cli"
    assert ck.make_checkpoint_cli([str(target), "--preset", "tiny", "--arch", "qwen2", "--seed", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(target.resolve())
    assert out[1] == f"parameters: {ck.num_parameters('tiny', 'qwen2'):,}"
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen2"
    assert ck.make_checkpoint_cli([str(target)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert ck.make_checkpoint_cli([str(target), "--force", "--seed", "9"]) == 0


def test_cli_rejects_unknown_arch(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        ck.make_checkpoint_cli([str(tmp_path / "x"), "--arch", "gpt2"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
