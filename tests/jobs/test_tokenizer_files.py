"""The tokenizer a worker publishes for dry runs counts what the worker computes: the real model's
tokenizer, rebuilt with `tokenizers` and rendered with jinja2 (no transformers), gives the same token
ids as the worker's PromptRenderer for completion and chat rows; and the constants it mirrors from the
engine are the engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

from bulkinfer.engine.chat import DEFAULT_CHAT_TEMPLATE as ENGINE_CHAT_TEMPLATE
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.object_store.local import LocalObjectStore
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.tokenizer_files import DEFAULT_CHAT_TEMPLATE, load_tokenizer, publish_tokenizer
from bulkinfer.worker.hosts.prompt_renderer import PromptRenderer

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Peru?"},
     {"role": "assistant", "content": "Lima."},
     {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "Chile?"}]}],
]
PROMPTS = ["Once upon a time", "déjà vu — naïve café ☕", ""]


def _row(prompt: str | None = None, messages: list | None = None) -> Row:
    return Row(0, "0", prompt, messages, JobSampling(), None)


@pytest.mark.parametrize("checkpoint", ["real_model", "tiny_checkpoint"])
def test_the_published_tokenizer_counts_what_the_worker_computes(checkpoint: str, tmp_path: Path,
                                                                 request: pytest.FixtureRequest) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(checkpoint))
    store = LocalObjectStore(tmp_path)
    assert load_tokenizer(store, "pre", "m") is None  # nothing published yet
    assert publish_tokenizer(store, "pre", "m", tokenizer, "worker-1")
    published = load_tokenizer(store, "pre", "m")
    assert published is not None and published.published_by == "worker-1"
    has_template = checkpoint == "real_model"  # SmolLM2's own template; the tiny one falls back to ChatML
    assert (published.chat_template != DEFAULT_CHAT_TEMPLATE) == has_template
    renderer = PromptRenderer(tokenizer)
    for prompt in PROMPTS:
        assert published.completion_tokens(prompt) == renderer.token_ids(_row(prompt=prompt))
    for messages in MESSAGES:
        assert published.chat_tokens(messages) == renderer.token_ids(_row(messages=messages))


def test_the_mirrored_engine_constants_are_the_engines() -> None:
    assert DEFAULT_CHAT_TEMPLATE == ENGINE_CHAT_TEMPLATE


def test_a_vision_models_tokenizer_counts_image_tokens(tmp_path: Path) -> None:
    """A dry run counts an image's span as the worker expands it: exactly with `detail: "low"`, and
    at most (the largest tiling) otherwise, since the API never reads the picture."""
    from transformers import AutoTokenizer

    from bulkinfer.engine.multimodal.families import image_family
    from bulkinfer.engine.multimodal.processing import expand_prompt
    from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint
    from bulkinfer.worker.hosts.model_hosts import image_spans
    from tests.support.vision_reference import picture

    model = cached_vision_checkpoint("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model)
    family = image_family(model, tokenizer)
    store = LocalObjectStore(tmp_path)
    assert publish_tokenizer(store, "pre", "vlm", tokenizer, "worker-1", image_spans(family))
    published = load_tokenizer(store, "pre", "vlm")
    assert published is not None and published.image_spans is not None
    renderer = PromptRenderer(tokenizer, image_family=family)
    image = picture(3, 200, 300)  # splits into the most tiles the tiny processor makes
    for detail in ("low", "auto"):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,", "detail": detail}},
            {"type": "text", "text": "Caption it."}]}]
        rendered = renderer.token_ids(_row(messages=messages))
        expanded = expand_prompt(rendered, [image], family, [detail]).token_ids
        counted = published.chat_tokens(messages)
        assert len(counted) == len(expanded) and counted[:4] == expanded[:4], detail
