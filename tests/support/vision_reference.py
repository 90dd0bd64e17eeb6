"""transformers' Idefics3 as the reference for the engine's vision tests: its processor (the prompt
span and pixels) and its model (greedy tokens) over a random checkpoint of engine/vision_checkpoints.py."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from PIL import Image

from bulkinfer.engine.vision_checkpoints import image_seq_len


def picture(seed: int, height: int, width: int) -> Image.Image:
    """A deterministic RGB noise image."""
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@functools.lru_cache(maxsize=2)
def hf_processor(model_dir: str, preset: str = "tiny") -> Any:
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(model_dir), tokenizer,
                             image_seq_len=image_seq_len(preset), chat_template=tokenizer.chat_template)


@functools.lru_cache(maxsize=4)
def hf_vision_model(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()


def chat_text(model_dir: str, question: str, num_images: int = 1) -> str:
    """SmolVLM's chat prompt for one user turn: the images first, then the question."""
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return hf_processor(model_dir).apply_chat_template([{"role": "user", "content": content}],
                                                       add_generation_prompt=True)


def hf_inputs(model_dir: str, text: str, images: list[Image.Image], **kwargs: Any) -> dict[str, torch.Tensor]:
    return dict(hf_processor(model_dir)(text=text, images=images or None, return_tensors="pt", **kwargs))


def hf_logits(model_dir: str, text: str, images: list[Image.Image], tokens: list[int],
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits at the positions that predict `tokens` after the prompt (teacher forcing:
    where the engine's greedy tokens are these rows' argmax, transformers' greedy decoding gives them)."""
    inputs = hf_inputs(model_dir, text, images)
    prompt = inputs["input_ids"]
    inputs["input_ids"] = torch.cat([prompt, torch.tensor([tokens])], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    with torch.inference_mode():
        logits = hf_vision_model(model_dir, dtype)(**inputs).logits[0]
    return logits[prompt.shape[1] - 1:-1].float()


def hf_greedy_check(model_dir: str, text: str, images: list[Image.Image], tokens: list[int]) -> list[int]:
    """transformers' fp32 argmax at each of `tokens`' positions (compare with `tokens`)."""
    return hf_logits(model_dir, text, images, tokens).argmax(dim=-1).tolist()


def qwen_chat_text(model_dir: str, question: str, num_images: int = 1) -> str:
    """Qwen2.5-VL's chat prompt for one user turn: the images first, then the question."""
    from transformers import AutoTokenizer

    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)


@functools.lru_cache(maxsize=4)
def hf_qwen_model(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()


def hf_qwen_logits(model_dir: str, prompt_ids: list[int], images: list[Image.Image], tokens: list[int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' Qwen2.5-VL logits predicting `tokens` after the engine's expanded prompt (its
    processor needs torchvision for videos: the image processor alone gives the pixels and grids)."""
    from transformers import Qwen2VLImageProcessorPil

    model = hf_qwen_model(model_dir, dtype)
    ids = torch.tensor([prompt_ids + tokens])
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                              "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if images:
        encoded = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=images, return_tensors="pt")
        inputs["pixel_values"] = encoded["pixel_values"].to(dtype)
        inputs["image_grid_thw"] = encoded["image_grid_thw"]
    with torch.inference_mode():
        logits = model(**inputs).logits[0]
    return logits[len(prompt_ids) - 1:-1].float()


class PrecomputedLogits:
    """Logits computed per sequence beforehand, called as assert_no_worse_than_reference calls a model."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, ...], tuple[torch.Tensor, int]] = {}

    def add(self, prompt: list[int], tokens: list[int], rows: torch.Tensor) -> None:
        self.rows[tuple(prompt + tokens)] = (rows, len(prompt))

    def __call__(self, ids: torch.Tensor) -> Any:
        rows, prompt_len = self.rows[tuple(ids[0].tolist())]
        full = torch.zeros(1, ids.shape[1], rows.shape[1])
        full[0, prompt_len - 1:-1] = rows
        return type("Output", (), {"logits": full})()


def greedy_outputs(llm: Any, requests: dict[str, tuple], params: Any,
                   lora_request: Any = None) -> dict[str, list[int]]:
    """Each request's tokens (id -> (prompt, images)) through an `LLMEngine`, none of them failed."""
    for request_id, (prompt, images) in requests.items():
        llm.add_request(request_id, prompt, params, images=images, lora_request=lora_request)
    outputs = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                assert output.outputs[0].finish_reason != "error", output.outputs[0]
                outputs[output.request_id] = output.outputs[0].token_ids
    return outputs
