"""`bulkinfer bench vision`: captioning rows with images, the engine against transformers' `generate`.

A random-weight checkpoint in a real model's shape (`smolvlm-256m`: SmolVLM-256M's SigLIP tower at
512 px and SmolLM2-135M's decoder; `--preset tiny` for a smoke run), 256 rows over 64 distinct
images (every image in four rows, each row its own question after one shared instruction), greedy,
`--max-tokens` new tokens a row. `--scale` multiplies rows and images (0.25: 64 rows over 16 images,
for a slow CPU). `--detail low` (the default here) sends each image as one 512 px view (SmolVLM's
global image, 64 tokens), `auto` splits it into tiles too, as SmolVLM does by default.

The engine runs all rows in one `generate` (its encoder cache runs each distinct image once, its
prefix cache shares an image's prompt between that image's rows, rows batch continuously); the
baseline runs transformers' `generate` over the same prompts and pixels in batches of `--hf-batch`,
left-padded. Prints rows/s of each and their ratio (target >= 2x in fp32, and in bf16 where the CPU
multiplies bf16 natively), the encoder cache's hits and the prefix cache's hit rate, the CPU kind.
``--json``: one record per family and dtype: family, dtype, rows_per_s, baseline_rows_per_s, ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image, ImageDraw

from bulkinfer.benchmarks.engine import describe_cpu

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
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                     add_generation_prompt=True, tokenize=False))
        row_images.append(images[row % distinct])
    return prompts, row_images


def run_engine(model_dir: str, dtype: str, prompts: list[str], images: list[Image.Image], detail: str,
               max_tokens: int) -> tuple[float, dict]:
    from bulkinfer.engine.llm import LLM
    from bulkinfer.engine.sampling_params import SamplingParams

    llm = LLM(model_dir, dtype=dtype)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    pairs = zip(prompts, images, strict=True)
    expanded = [engine.process_prompt(prompt, [image], [detail]) for prompt, image in pairs]
    outputs = llm.generate(expanded, params)
    seconds = time.perf_counter() - started
    assert all(output.outputs[0].finish_reason == "length" for output in outputs), outputs[0]
    cache = engine.images.cache
    metrics = engine.get_metrics()
    return seconds, {"encoder_cache_hits": cache.hits, "encoder_cache_misses": cache.misses,
                     "prefix_cache_hit_rate": round(float(metrics.get("prefix_cache_hit_rate", 0.0)), 3)}


def run_transformers(model_dir: str, dtype: torch.dtype, prompts: list[str], images: list[Image.Image],
                     detail: str, max_tokens: int, batch: int) -> float:
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
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            pictures = [[image] for image in images[start:start + batch]]
            inputs = processor(text=prompts[start:start + batch], images=pictures,
                               do_image_splitting=detail != "low", padding=True, return_tensors="pt")
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
            model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return time.perf_counter() - started


def run(model_dir: str, dtypes: list[str], rows: int, distinct: int, detail: str, max_tokens: int,
        hf_batch: int, out: Callable[[str], None] = print) -> list[dict]:
    describe_cpu(out)
    prompts, images = workload(model_dir, rows, distinct)
    out(f"workload: {rows} rows over {distinct} images, detail {detail}, {max_tokens} new tokens a row")
    records = []
    for dtype in dtypes:
        engine_s, caches = run_engine(model_dir, dtype, prompts, images, detail, max_tokens)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        baseline_s = run_transformers(model_dir, torch_dtype, prompts, images, detail, max_tokens, hf_batch)
        record = {"family": "idefics3", "dtype": dtype, "rows_per_s": round(rows / engine_s, 3),
                  "baseline_rows_per_s": round(rows / baseline_s, 3),
                  "ratio": round(baseline_s / engine_s, 2), **caches}
        out(f"idefics3 {dtype}: engine {record['rows_per_s']} rows/s, transformers "
            f"{record['baseline_rows_per_s']} rows/s: {record['ratio']}x (target >= {TARGET_RATIO}x); "
            f"encoder cache {caches['encoder_cache_hits']} hits / {caches['encoder_cache_misses']} misses, "
            f"prefix cache hit rate {caches['prefix_cache_hit_rate']}")
        records.append(record)
    return records


def bench_cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench vision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smolvlm-256m", help="smolvlm-256m (default) or tiny")
    parser.add_argument("--model", default=None, help="a vision-language checkpoint folder instead")
    parser.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="rows and images x this (default 256 over 64)")
    parser.add_argument("--detail", choices=("low", "auto"), default="low")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hf-batch", type=int, default=8, help="transformers' rows per generate call")
    parser.add_argument("--json", action="store_true", help="print one JSON record per family and dtype")
    args = parser.parse_args(argv)
    from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint

    model_dir = args.model or str(cached_vision_checkpoint(args.preset))
    rows, distinct = max(4, round(256 * args.scale)), max(1, round(64 * args.scale))
    records = run(model_dir, args.dtype.split(","), rows, distinct, args.detail, args.max_tokens,
                  args.hf_batch)
    if args.json:
        for record in records:
            print(json.dumps(record))
    return 0
