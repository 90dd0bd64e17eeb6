"""`bulkinfer bench vision`: captioning rows with images, the engine against transformers' `generate`.

A random-weight checkpoint in a real model's shape per `--family`: `idefics3` (SmolVLM-256M's SigLIP
tower at 512 px and SmolLM2-135M's decoder) and `qwen2_5_vl` (Qwen2.5-VL-3B-Instruct's windowed ViT
and 36-layer decoder, 3.75 B parameters: 15 GB in fp32); `--preset tiny` for a smoke run of each.
256 rows over 64 distinct images (every image in four rows, each row its own question after one
shared instruction), greedy, `--max-tokens` new tokens a row. `--scale` multiplies rows and images
(0.25: 64 rows over 16 images, for a slow CPU). `--detail low` (the default here) sends each image
at the model's low resolution (SmolVLM's one 512 px global view, 64 tokens; Qwen2.5-VL capped at
448 x 448 pixels, at most 256 tokens), `auto` at its default (SmolVLM's tiles too, Qwen's full size).

The engine runs all rows in one `generate` (its encoder cache runs each distinct image once, its
prefix cache shares an image's prompt between that image's rows, rows batch continuously); the
baseline runs transformers' `generate` over the same prompts and pixels in batches of `--hf-batch`,
left-padded. Each side runs in its own process, one after the other, so a big model is in memory once.
Prints rows/s of each and their ratio (target >= 2x in fp32, and in bf16 where the CPU multiplies
bf16 natively), the encoder cache's hits and the prefix cache's hit rate, the CPU kind.
``--json``: one record per family and dtype: family, dtype, rows_per_s, baseline_rows_per_s, ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from PIL import Image, ImageDraw

from bulkinfer.benchmarks.engine import describe_cpu

if TYPE_CHECKING:
    from transformers import GenerationMixin

INSTRUCTION = "You label product photos for a catalog. Answer in a few words."
TARGET_RATIO = 2.0


def bench_images(count: int, seed: int = 0) -> list[Image.Image]:
    """Distinct 640x480 pictures: noise under a few coloured shapes."""
    rng = np.random.RandomState(seed)
    images = []
    for _ in range(count):
        image = Image.fromarray((rng.rand(480, 640, 3) * 64).astype("uint8"))
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            x, y = int(rng.randint(0, 560)), int(rng.randint(0, 400))
            draw.ellipse((x, y, x + 80, y + 80), fill=tuple(int(v) for v in rng.randint(0, 255, 3)))
        images.append(image)
    return images


def workload(model_dir: str, rows: int, distinct: int) -> tuple[list[str], list[Image.Image]]:
    """Each row's chat prompt (one image placeholder) and its image."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = bench_images(distinct)
    prompts, row_images = [], []
    for row in range(rows):
        content = [{"type": "text", "text": INSTRUCTION}, {"type": "image"},
                   {"type": "text", "text": f"Question {row // distinct}: what is shown, item {row}?"}]
        message: dict[str, Any] = {"role": "user", "content": content}
        prompts.append(cast(str, tokenizer.apply_chat_template([message], add_generation_prompt=True,
                                                               tokenize=False)))  # text: tokenize=False
        row_images.append(images[row % distinct])
    return prompts, row_images


def run_engine(model_dir: str, dtype: str, rows: int, distinct: int, detail: str,
               max_tokens: int) -> tuple[float, dict]:
    from bulkinfer.engine.llm import LLM
    from bulkinfer.engine.sampling_params import SamplingParams

    prompts, images = workload(model_dir, rows, distinct)
    llm = LLM(model_dir, dtype=dtype)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    pairs = zip(prompts, images, strict=True)
    expanded = [engine.process_prompt(prompt, [image], [detail]) for prompt, image in pairs]
    # LLM.generate takes the engine's MultiModalPrompt too (LLMEngine.add_request does), though its
    # Prompt type names only text and token ids.
    outputs = llm.generate(cast(list[Any], expanded), params)
    seconds = time.perf_counter() - started
    assert all(output.outputs[0].finish_reason == "length" for output in outputs), outputs[0]
    assert engine.images is not None  # process_prompt above raised otherwise
    cache = engine.images.cache
    metrics = engine.get_metrics()
    return seconds, {"encoder_cache_hits": cache.hits, "encoder_cache_misses": cache.misses,
                     "prefix_cache_hit_rate": round(float(metrics.get("prefix_cache_hit_rate", 0.0)), 3)}


BatchInputs = Callable[[list[str], list[Image.Image]], dict]


def idefics3_side(model_dir: str, dtype: torch.dtype, detail: str) -> tuple[GenerationMixin, BatchInputs]:
    from transformers import (
        AutoTokenizer,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    vision = model.config.vision_config
    seq_len = (vision.image_size // vision.patch_size) ** 2 // model.config.scale_factor ** 2
    processor = Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(model_dir), tokenizer,
                                  image_seq_len=seq_len)

    def batch_inputs(prompts: list[str], images: list[Image.Image]) -> dict:
        inputs = processor(text=prompts, images=[[image] for image in images],
                           do_image_splitting=detail != "low", padding=True, return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        return dict(inputs)

    return model, batch_inputs


def qwen2_5_vl_side(model_dir: str, dtype: torch.dtype, detail: str) -> tuple[GenerationMixin, BatchInputs]:
    """Qwen2.5-VL's processor needs torchvision for videos; its image processor and tokenizer do what
    it does for images: each `<|image_pad|>` repeated once per merged patch."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from bulkinfer.engine.models.qwen2_5_vl_processing import IMAGE_PAD_TOKEN, LOW_DETAIL_PIXELS

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    size = dict(processor.size)
    if detail == "low":
        size["longest_edge"] = min(LOW_DETAIL_PIXELS, int(size["longest_edge"]))
    merged = model.config.vision_config.spatial_merge_size ** 2

    def batch_inputs(prompts: list[str], images: list[Image.Image]) -> dict:
        encoded = processor(images=images, size=size, return_tensors="pt")
        texts = [prompt.replace(IMAGE_PAD_TOKEN, IMAGE_PAD_TOKEN * (int(grid.prod()) // merged), 1)
                 for prompt, grid in zip(prompts, encoded["image_grid_thw"], strict=True)]
        inputs = dict(tokenizer(texts, padding=True, return_tensors="pt"))
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == model.config.image_token_id).int()
        inputs["pixel_values"] = encoded["pixel_values"].to(dtype)
        inputs["image_grid_thw"] = encoded["image_grid_thw"]
        return inputs

    return model, batch_inputs


def run_transformers(model_dir: str, dtype: str, rows: int, distinct: int, detail: str, max_tokens: int,
                     batch: int) -> float:
    prompts, images = workload(model_dir, rows, distinct)
    side = {"idefics3": idefics3_side, "qwen2_5_vl": qwen2_5_vl_side}[family_of(model_dir)]
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model, batch_inputs = side(model_dir, torch_dtype, detail)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            inputs = batch_inputs(prompts[start:start + batch], images[start:start + batch])
            model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return time.perf_counter() - started


FAMILY_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "idefics3",
                        "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
DEFAULT_PRESETS = {"idefics3": "smolvlm-256m", "qwen2_5_vl": "qwen2.5-vl-3b"}


def family_of(model_dir: str) -> str:
    architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    for architecture in architectures:
        if architecture in FAMILY_ARCHITECTURES:
            return FAMILY_ARCHITECTURES[architecture]
    raise SystemExit(f"bench vision: {model_dir} is not an Idefics3 or Qwen2.5-VL checkpoint "
                     f"(architectures: {architectures})")


def bench_checkpoint(family: str, preset: str | None) -> str:
    """The family's random-weight checkpoint, built once per machine."""
    if family == "idefics3":
        from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint

        return str(cached_vision_checkpoint(preset or DEFAULT_PRESETS[family]))
    from bulkinfer.engine.qwen_vl_checkpoint import cached_qwen_vl_checkpoint

    return str(cached_qwen_vl_checkpoint(preset=preset or DEFAULT_PRESETS[family]))


def in_own_process(function: Callable[..., Any], *args: Any) -> Any:
    """Run one side in a fresh process, so its model is gone before the other side loads its own."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def run(model_dirs: list[str], dtypes: list[str], rows: int, distinct: int, detail: str, max_tokens: int,
        hf_batch: int, out: Callable[[str], None] = print) -> list[dict]:
    describe_cpu(out)
    out(f"workload: {rows} rows over {distinct} images, detail {detail}, {max_tokens} new tokens a row")
    records = []
    for model_dir in model_dirs:
        family = family_of(model_dir)
        for dtype in dtypes:
            engine_s, caches = in_own_process(run_engine, model_dir, dtype, rows, distinct, detail,
                                              max_tokens)
            baseline_s = in_own_process(run_transformers, model_dir, dtype, rows, distinct, detail,
                                        max_tokens, hf_batch)
            record = {"family": family, "dtype": dtype, "rows_per_s": round(rows / engine_s, 3),
                      "baseline_rows_per_s": round(rows / baseline_s, 3),
                      "ratio": round(baseline_s / engine_s, 2), **caches}
            out(f"{family} {dtype}: engine {record['rows_per_s']} rows/s, transformers "
                f"{record['baseline_rows_per_s']} rows/s: {record['ratio']}x (target >= {TARGET_RATIO}x); "
                f"encoder cache {caches['encoder_cache_hits']} hits / {caches['encoder_cache_misses']} "
                f"misses, prefix cache hit rate {caches['prefix_cache_hit_rate']}")
            records.append(record)
    return records


def bench_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="idefics3",
                        help="comma list of idefics3 (default), qwen2_5_vl (a 3.75 B model: 15 GB in fp32)")
    parser.add_argument("--preset", default=None,
                        help="tiny, or the family's real shape (default: smolvlm-256m, qwen2.5-vl-3b)")
    parser.add_argument("--model", default=None, help="a vision-language checkpoint folder instead")
    parser.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="rows and images x this (default 256 over 64)")
    parser.add_argument("--detail", choices=("low", "auto"), default="low")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=8, help="transformers' rows per generate call")
    parser.add_argument("--json", action="store_true", help="print one JSON record per family and dtype")
    args = parser.parse_args(argv)
    families = [family.strip() for family in args.family.split(",") if family.strip()]
    unknown = sorted(set(families) - set(DEFAULT_PRESETS))
    if unknown:
        parser.error(f"unknown --family {', '.join(unknown)} (known: {', '.join(DEFAULT_PRESETS)})")
    model_dirs = [args.model] if args.model else [bench_checkpoint(name, args.preset) for name in families]
    rows, distinct = max(4, round(256 * args.scale)), max(1, round(64 * args.scale))
    records = run(model_dirs, args.dtype.split(","), rows, distinct, args.detail, args.max_tokens,
                  args.hf_batch)
    if args.json:
        for record in records:
            print(json.dumps(record))
    return 0
