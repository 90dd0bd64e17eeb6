"""Logits are fp32 in every compute dtype: the LM head's fp32 sums reach sampling unrounded, so a
near-tie that fp32 orders is not turned into an exact bf16 tie (which the lower token id wins)."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.cpu_kernels import load as load_cpu_kernels
from bulkinfer.engine.models.layers import Linear

KERNELS = load_cpu_kernels()
BF16_ROW_KERNEL = KERNELS is not None and torch.bfloat16 in KERNELS.row_gemm_dtypes


def _bf16_head(generator: torch.Generator, bias: bool) -> Linear:
    head = Linear(128, 3000, bias=bias).requires_grad_(False)
    head.weight.copy_(torch.randn(3000, 128, generator=generator) / 8)
    if bias:
        head.bias.copy_(torch.randn(3000, generator=generator))
    return head.to(torch.bfloat16)


@pytest.mark.parametrize("path", ["row kernel", "pytorch"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_lm_head_gives_bf16_rows_their_fp32_sums(path: str, bias: bool) -> None:
    """Through the row kernel (AMX / AVX512-BF16) and through PyTorch (no kernel: an fp32 copy of
    the weight), the logits are the fp32 products' sums, not those sums rounded to bf16."""
    if path == "row kernel" and not BF16_ROW_KERNEL:
        pytest.skip("this CPU has no bf16 row kernel (needs AMX or AVX512-BF16)")
    generator = torch.Generator().manual_seed(5)
    head = _bf16_head(generator, bias)
    if path == "row kernel":
        assert head.use_row_gemm(KERNELS, None)
    hidden = torch.randn(9, 128, generator=generator).to(torch.bfloat16)
    logits = head.forward_fp32(hidden)
    expected = hidden.float() @ head.weight.float().T + (head.bias.float() if bias else 0)
    assert logits.dtype == torch.float32 and logits.shape == (9, 3000)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9
    if path == "pytorch":  # a new weight (tied embeddings are re-tied after loading): a new copy
        head.weight = torch.nn.Parameter(head.weight * 2, requires_grad=False)
        doubled = expected * 2 - (head.bias.float() if bias else 0)
        torch.testing.assert_close(head.forward_fp32(hidden), doubled, rtol=1e-5, atol=2e-4)


def test_fp32_logits_of_an_fp32_model_are_its_own_logits() -> None:
    generator = torch.Generator().manual_seed(6)
    head = _bf16_head(generator, bias=True).float()
    hidden = torch.randn(4, 128, generator=generator)
    assert torch.equal(head.forward_fp32(hidden), head(hidden))


def test_a_bf16_near_tie_is_decided_by_fp32s_margin_not_by_token_id(tiny_checkpoint) -> None:
    """Two tokens whose LM head rows differ in one weight by one bf16 step: their logits differ
    by far less than a bf16 logit step, so rounded to bf16 they tie and the lower id would win.
    In fp32 the higher one leads, and greedy decoding picks it (its logprob above the other's)."""
    llm = LLM(model=str(tiny_checkpoint), dtype="bfloat16", num_kv_blocks=64)
    model = llm.engine.runner.model
    prompt = [5, 17, 42, 9, 3]
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    [output] = llm.generate([prompt], first)
    leader = output.outputs[0].token_ids[0]
    hidden = _last_hidden(llm, prompt)  # the final hidden row that chose it
    runner_up = leader + 1 if leader + 1 < model.config.vocab_size else leader - 1
    lower, higher = sorted((leader, runner_up))
    weight = model.lm_head.weight
    row = weight[leader].clone()
    nudged, margin = _nudge_to_a_bf16_tie(row, hidden)
    with torch.no_grad():
        weight[lower] = row
        weight[higher] = nudged
    model.use_cpu_kernels(KERNELS)  # repack the head's weight for the row kernel
    logits = model.compute_logits(hidden[None])[0]
    assert float(logits[higher] - logits[lower]) == pytest.approx(margin, rel=1e-2)
    assert logits[higher].bfloat16() == logits[lower].bfloat16()  # rounded to bf16, a tie
    [output] = llm.generate([prompt], first)
    position = output.outputs[0].logprobs[0]
    assert output.outputs[0].token_ids[0] == higher
    assert [t.token_id for t in position.top] == [higher, lower]
    assert position.top[0].logprob - position.top[1].logprob == pytest.approx(margin, abs=2e-5)


def _last_hidden(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The final hidden row the LM head sees for the prompt's last position (hooked on the head)."""
    head = llm.engine.runner.model.lm_head
    seen: list[torch.Tensor] = []
    original = head.forward_fp32
    head.forward_fp32 = lambda x, out=None: (seen.append(x[-1].clone()), original(x, out))[1]  # type: ignore
    try:
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        del head.forward_fp32
    return seen[0]


def _nudge_to_a_bf16_tie(row: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`row` with one weight moved up a bf16 step or a few, so that its logit leads the original's
    by a positive fp32 margin that rounding both logits to bf16 erases; and that margin."""
    base = float(hidden.float() @ row.float())
    for dim in hidden.float().abs().argsort(descending=True)[:16].tolist():
        if row[dim] == 0:
            continue
        for steps in range(1, 4):
            candidate = row.clone()
            value = candidate[dim : dim + 1].view(torch.int16)
            value += steps if (hidden[dim] > 0) == (candidate[dim] >= 0) else -steps  # away from / to zero
            logit = float(hidden.float() @ candidate.float())
            margin = logit - base
            if margin > 1e-4 and torch.tensor(logit).bfloat16() == torch.tensor(base).bfloat16():
                return candidate, margin
    raise AssertionError("no one-weight nudge gives a bf16 tie for this hidden row")
