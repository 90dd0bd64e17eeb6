"""transformers as the reference: greedy continuations, and the tie checks for any mismatch.

fp32: exact means exact. Engine and transformers greedy tokens must be identical; the only accepted
difference is a true fp32 tie — at the first differing position, the top-2 logit gap is below
``TIE_GAP`` in *both* implementations — which ``assert_same_greedy`` checks instead of loosening.

bf16/fp16 (``assert_greedy_within_noise``): two correct implementations round differently, so a
near-tie can flip and the continuations then part ways for good. Every token the engine emitted is
checked against transformers *in the same dtype on the engine's own context* (teacher forcing):
it must be transformers' argmax on at least ``MIN_AGREEMENT`` of the positions, and wherever it is
not, the two tokens must be within ``NOISE_ULPS`` units in the last place of the dtype at the
logits' scale in both implementations — a proven near-tie, not a wrong token. Mixture-of-experts
models: see ``assert_moe_greedy_within_noise`` (routing flips are no near-ties in the logits).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from bulkinfer.engine.attention import AttentionMetadata
from bulkinfer.engine.models.llama import LlamaForCausalLM

# Where the engine under test runs: benchmarks/gpu_check.sh sets cuda; transformers stays on the CPU.
TEST_DEVICE = os.environ.get("BULKINFER_TEST_DEVICE", "cpu")
TIE_GAP = 1e-5
# The engine's bf16 attention is not transformers' kernel (AMX on CPUs that have it: as close to the
# fp32 result as SDPA's, measured), so on the random checkpoints' near-flat logits about one token
# in 15 flips between proven near-ties; an exact tie in transformers counts as agreeing.
MIN_AGREEMENT = 0.9
# Measured on the tiny checkpoints of all four archs in bf16: flips happen at gaps of 0-6 ulps.
NOISE_ULPS = 8
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


@cache
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_generate(model_dir: str | Path, prompt: Sequence[int], max_new_tokens: int,
                **options: Any) -> list[int]:
    """transformers' greedy `generate` of one unpadded prompt; `options` go to `generate`."""
    model = hf_model(str(model_dir))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=model.config.pad_token_id,
            **options,
        )
    return out[0, len(prompt) :].tolist()


@cache
def _hf_greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    return tuple(hf_generate(model_dir, prompt, max_new_tokens))


def hf_greedy(model_dir: str | Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (stops at EOS like the engine)."""
    return list(_hf_greedy(str(model_dir), tuple(prompt), max_new_tokens))


def hf_last_logits(model_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0, -1].float()


def engine_last_logits(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Our model's logits after ``token_ids``: one prefill into a private KV cache."""
    c = model.config
    num_blocks = math.ceil(len(token_ids) / block_size)
    dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
    caches = [torch.zeros(2, num_blocks, c.num_kv_heads, block_size, c.head_dim, dtype=dtype, device=device)
              for _ in range(c.num_layers)]
    n = len(token_ids)
    metadata = AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.arange(n, device=device),
        num_decodes=0,
        decode_seq_lens=torch.empty(0, dtype=torch.long),
        decode_block_tables=torch.empty(0, 1, dtype=torch.long),
        prefill_query_starts=[0],
        prefill_query_lens=[n],
        prefill_seq_lens=[n],
        prefill_block_tables=[torch.arange(num_blocks, device=device)],
    )
    with torch.inference_mode():
        ids, positions = torch.tensor(token_ids, device=device), torch.arange(n, device=device)
        hidden = model(ids, positions, metadata, caches)
        return model.compute_logits(hidden[-1:])[0].cpu()  # fp32


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(
    ours: list[int], reference: list[int], prompt: list[int], model_dir: str | Path, model: LlamaForCausalLM
) -> None:
    """Identical tokens, or a true fp32 tie at the first difference (then the rest may diverge)."""
    if ours == reference:
        return
    first = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=False)) if a != b), None)
    if first is None:  # one is a prefix of the other: a length difference is never a tie
        raise AssertionError(f"lengths differ: engine {ours} vs transformers {reference}")
    context = prompt + reference[:first]
    hf_gap = top2_gap(hf_last_logits(model_dir, context))
    our_gap = top2_gap(engine_last_logits(model, context))
    assert hf_gap < TIE_GAP and our_gap < TIE_GAP, (
        f"token {first} differs: engine {ours} vs transformers {reference}; top-2 gaps "
        f"{our_gap:.3g} (engine) / {hf_gap:.3g} (transformers) — not an fp32 tie"
    )


def assert_greedy_by_teacher_forcing(outputs: Sequence[tuple[list[int], list[int]]], model_dir: str | Path,
                                     model: LlamaForCausalLM) -> None:
    """fp32: ``outputs`` ((prompt, engine greedy tokens) pairs) are transformers' greedy continuations.
    One transformers forward per prompt over the engine's tokens (teacher forcing) instead of a
    ``generate``: where every engine token is the argmax of transformers' logits on the tokens before
    it, transformers' greedy decoding emits exactly those tokens. A difference goes to
    ``assert_same_greedy`` (which accepts only a proven fp32 tie)."""
    for prompt, tokens in outputs:
        with torch.inference_mode():
            logits = hf_model(str(model_dir))(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        if logits.argmax(dim=-1).tolist() != list(tokens):
            reference = hf_greedy(model_dir, prompt, len(tokens))
            assert_same_greedy(list(tokens), reference, prompt, model_dir, model)


def noise_bound(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """``NOISE_ULPS`` units in the last place of ``dtype`` at the scale of the largest logit."""
    exponent = math.floor(math.log2(max(float(logits.abs().max()), 1e-30)))
    return NOISE_ULPS * 2.0 ** (exponent - MANTISSA_BITS[dtype])


def is_mixture_of_experts(model: torch.nn.Module) -> bool:
    return getattr(model.config, "num_experts", 0) > 0


# Mixture-of-experts in bf16: the engine's tokens must be transformers' bf16 argmax this often, and
# cost no more (by the fp32 model) than transformers' own bf16 choices, within this factor.
MOE_MIN_AGREEMENT = 0.8
MOE_DEFICIT_FACTOR = 1.5


def assert_moe_greedy_within_noise(outputs: Sequence[tuple[list[int], list[int]]], model_dir: str | Path,
                                   dtype: torch.dtype) -> float:
    """bf16/fp16 greedy agreement for a mixture-of-experts model.

    A router picks experts by a top-k over probabilities that rounding moves, so a token routed to
    another expert in bf16 than in fp32 (or in the engine than in transformers) is legitimate, and
    its effect is no near-tie in the logits: transformers' own bf16 greedy choices differ from its
    fp32 ones on 11% (Qwen3-MoE) to 28% (Mixtral) of the tiny checkpoints' tokens, at logit gaps up
    to 7. So the per-flip near-tie proof of dense models cannot hold; `assert_no_worse_than_reference`
    judges it instead, against transformers in `dtype` and in fp32."""
    return assert_no_worse_than_reference(outputs, hf_model(str(model_dir), dtype),
                                          hf_model(str(model_dir), torch.float32), dtype,
                                          MOE_MIN_AGREEMENT, MOE_DEFICIT_FACTOR)


def assert_no_worse_than_reference(outputs: Sequence[tuple[list[int], list[int]]], low: torch.nn.Module,
                                   exact: torch.nn.Module, dtype: torch.dtype, min_agreement: float,
                                   deficit_factor: float) -> float:
    """On the engine's own contexts (teacher forcing): the engine's token is `low`'s argmax (the
    reference in `dtype`) on at least `min_agreement` of the positions, and measured by `exact` (the
    reference in fp32), the engine's tokens lose on average no more than `deficit_factor` times what
    `low`'s argmaxes lose, plus the dtype's noise. This holds whichever unit the CPU computes bf16 on
    (AMX, AVX512-BF16 or emulated), where a per-token bound on rounding does not: a wrong weight,
    scale or route loses far more on most tokens. Returns the agreement."""
    agree = total = 0
    ours_deficit = theirs_deficit = bound = 0.0
    for prompt, tokens in outputs:
        if not tokens:
            continue
        ids = torch.tensor([prompt + tokens])
        with torch.inference_mode():
            low_rows = low(ids).logits[0, len(prompt) - 1 : -1].float()
            exact_rows = exact(ids).logits[0, len(prompt) - 1 : -1].float()
        for ours, row, exact_row in zip(tokens, low_rows, exact_rows, strict=True):
            total += 1
            theirs = int(row.argmax())
            agree += theirs == ours or bool(row[ours] == row[theirs])
            best = exact_row.max()
            ours_deficit += float(best - exact_row[ours])
            theirs_deficit += float(best - exact_row[theirs])
            bound += noise_bound(row, dtype)
    total = max(total, 1)
    agreement = agree / total
    assert agreement >= min_agreement, (
        f"{dtype}: engine tokens are the reference's argmax on {agree}/{total} positions "
        f"({agreement:.1%} < {min_agreement:.0%})")
    ours_mean, theirs_mean, bound_mean = ours_deficit / total, theirs_deficit / total, bound / total
    assert ours_mean <= deficit_factor * theirs_mean + bound_mean, (
        f"{dtype}: the engine's tokens lose {ours_mean:.3g} a token to the fp32 argmax, the reference's "
        f"{dtype} argmaxes {theirs_mean:.3g} (allowed: {deficit_factor} x that + {bound_mean:.3g})")
    return agreement


def assert_greedy_within_noise(
    outputs: Sequence[tuple[list[int], list[int]]], model_dir: str | Path, model: LlamaForCausalLM,
    dtype: torch.dtype, reference: torch.nn.Module | None = None,
) -> float:
    """``outputs``: (prompt, engine greedy tokens) pairs. Returns the agreement (see module doc).
    ``reference``: the model to judge against (teacher forcing) instead of transformers' own load
    of ``model_dir`` (e.g. a peft model with its adapter)."""
    if reference is None:
        if is_mixture_of_experts(model):
            return assert_moe_greedy_within_noise(outputs, model_dir, dtype)
        reference = hf_model(str(model_dir), dtype)
    agree = total = 0
    flips = []
    for prompt, tokens in outputs:
        if not tokens:
            continue
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        for step, (ours, row) in enumerate(zip(tokens, logits, strict=True)):
            total += 1
            theirs = int(row.argmax())
            if theirs == ours or row[ours] == row[theirs]:
                agree += 1
                continue
            context = prompt + tokens[:step]
            our_row = engine_last_logits(model, context)
            hf_gap = float(row[theirs] - row[ours])
            our_gap = float(our_row[ours] - our_row[theirs])
            bound = noise_bound(row, dtype)
            flips.append((len(context), ours, theirs, hf_gap, our_gap))
            assert hf_gap <= bound and our_gap <= bound, (
                f"after {len(context)} tokens the engine chose {ours}, transformers {theirs}: gaps "
                f"{our_gap:.3g} (engine) / {hf_gap:.3g} (transformers) exceed {dtype} noise {bound:.3g}"
            )
    agreement = agree / max(total, 1)
    assert agreement >= MIN_AGREEMENT, (
        f"{dtype}: engine tokens are transformers' argmax on {agree}/{total} positions "
        f"({agreement:.1%} < {MIN_AGREEMENT:.0%}); near-tie flips: {flips}"
    )
    return agreement
