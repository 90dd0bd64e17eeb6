"""Offline batch API: ``LLM(model=DIR, **config).generate(prompts, params)``, and
``LLM(model=EMBEDDING_DIR).embed(texts)`` for embedding models (vLLM's names)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from bulkinfer.engine.chat import ChatTemplateError, chat_images, chat_token_ids
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.dtype_choice import DtypeChoice
from bulkinfer.engine.embedder import Embedder, EmbeddingOutput, is_embedding_model
from bulkinfer.engine.llm_engine import LLMEngine, RequestOutput
from bulkinfer.engine.lora.request import LoRARequest
from bulkinfer.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


TASKS = ("auto", "generate", "embed")
# The EngineConfig keys an embedding model takes; the others (KV cache, scheduling) are a generator's.
EMBED_CONFIG_KEYS = ("dtype", "device", "dtype_verdicts", "remeasure_dtype")


class LLM:
    """Build an engine once, then ``generate`` (or, for an embedding model, ``embed``) as many
    batches as needed.

    ``task``: "auto" embeds with an embedding model folder (bulkinfer.engine.embedder.is_embedding_model)
    and generates with any other; "embed" makes a decoder model an embedder (``pooling``:
    "last" by default, or "mean"; ``normalize``), with no KV cache; "generate" always generates.
    """

    def __init__(self, model: str, task: str = "auto", pooling: str | None = None,
                 normalize: bool | None = None, **config_kwargs: Any) -> None:
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        embeds = task == "embed" or (task == "auto" and is_embedding_model(model))
        self.task = "embed" if embeds else "generate"
        self._ids = itertools.count()
        self.embedder: Embedder | None = None
        self._engine: LLMEngine | None = None
        if self.task == "embed":
            unused = sorted(set(config_kwargs) - set(EMBED_CONFIG_KEYS))
            if unused:
                raise ValueError(f"{unused} do not apply to an embedding model "
                                 f"(it takes {EMBED_CONFIG_KEYS})")
            self.embedder = Embedder.load(model, pooling=pooling, normalize=normalize, **config_kwargs)
        else:
            if pooling is not None or normalize is not None:
                raise ValueError("pooling and normalize apply to embedding models (task='embed')")
            self._engine = LLMEngine(EngineConfig(model=str(model), **config_kwargs))

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise TypeError("this LLM holds an embedding model: use embed(), not generate()")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self.embedder.tokenizer if self.embedder is not None else self.engine.tokenizer

    @property
    def dtype_choice(self) -> DtypeChoice:
        """The dtype the model runs in and why (``dtype="auto"`` resolves at start-up)."""
        return self.embedder.dtype_choice if self.embedder is not None else self.engine.dtype_choice

    def embed(self, prompts: Prompt | Sequence[Prompt], truncate: bool = False) -> list[EmbeddingOutput]:
        """One float32 vector per prompt (a string or a token-id list), in order, pooled and
        normalized as the model says (engine/embedder.py). A prompt longer than the model's maximum
        raises ValueError naming it, unless ``truncate`` (texts only: token ids are taken as given)."""
        if self.embedder is None:
            raise TypeError("this LLM generates: load it with task='embed' (or an embedding model) to embed")
        prompt_list = _as_prompt_list(prompts)
        texts = [p for p in prompt_list if isinstance(p, str)]
        tokenized = iter(self.embedder.tokenize_batch(texts, truncate=truncate) if texts else [])
        ids = [next(tokenized) if isinstance(p, str) else list(p) for p in prompt_list]
        return self.embedder.embed_token_ids(ids)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. Prompts are strings or token-id lists, or vLLM's
        ``{"prompt": ..., "multi_modal_data": {"image": image or [images]}}`` for a model that takes
        images (the prompt holds one image placeholder per image, e.g. ``<image>``); ``params``
        is one SamplingParams for all, or one per prompt. Bad prompts come back with
        ``finish_reason="error"``; the others are generated normally. ``lora_request``: one adapter
        for all prompts, or one (or None: the base model) per prompt; every adapter is validated
        before any prompt is queued (LoRAAdapterError names a bad one)."""
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")

        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"got {len(lora_list)} LoRA requests for {len(prompt_list)} prompts")
        for adapter in dict.fromkeys(lora for lora in lora_list if lora is not None):
            self.engine.load_lora(adapter)

        ids = [f"generate-{next(self._ids)}" for _ in prompt_list]
        for request_id, prompt, sampling, lora in zip(ids, prompt_list, params_list, lora_list, strict=True):
            text_or_ids, images = prompt_and_images(prompt)
            self.engine.add_request(request_id, text_or_ids, sampling, lora_request=lora, images=images)

        results: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(ids)) if use_tqdm else None
        while len(results) < len(ids) and self.engine.has_unfinished_requests():
            for output in self.engine.step():
                results[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        return [results[request_id] for request_id in ids]


    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """``generate`` for OpenAI-style messages (one conversation or a list of them), rendered with
        the tokenizer's chat template, or ChatML when it has none (engine/chat.py). A conversation
        that cannot be rendered raises ChatTemplateError naming it, before anything runs."""
        many: Sequence[Any] = conversations
        if conversations and isinstance(conversations[0], Mapping):
            many = [conversations]  # one conversation
        prompts: list[Any] = []
        for index, messages in enumerate(many):
            try:
                ids = chat_token_ids(self.tokenizer, messages)  # type: ignore[arg-type]
                images = [image.source for image in chat_images(messages)]  # type: ignore[arg-type]
            except ChatTemplateError as error:
                raise ChatTemplateError(f"conversation {index}: {error}") from None
            prompts.append({"prompt": ids, "multi_modal_data": {"image": images}} if images else ids)
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.get_metrics()


def prompt_and_images(prompt: Any) -> tuple[Any, list[Any] | None]:
    """A prompt as the engine takes it, and its images (vLLM's dict form; None: no images)."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    data = prompt.get("multi_modal_data") or {}
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data {unknown} not supported (images only: 'image')")
    images = data.get("image")
    if images is None:
        return text, None
    return text, list(images) if isinstance(images, (list, tuple)) else [images]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """A single prompt (a string, a flat list of token ids, or a prompt dict) becomes a one-element list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]  # type: ignore[list-item]
    listed: list[Any] = list(prompts)
    if listed and all(isinstance(p, int) and not isinstance(p, bool) for p in listed):
        return [listed]
    return listed


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
