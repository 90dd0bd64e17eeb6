"""Batched token sampling: every row of a step with tensor ops, no per-request loop in the hot path.

Order (vLLM V1's): raw logprobs are taken from the model's logits first; then the grammar bitmask,
min_tokens (EOS / stop ids masked), penalties (repetition on prompt + output, presence/frequency on
output); greedy rows take the argmax of that; random rows go on through temperature, min-p,
top-k, top-p and draw one token by inverse CDF in vocabulary order from a uniform that depends
only on the row's (seed, sample index, output position) — see engine/sampling_random.py — so a
seeded request's tokens never depend on its batch mates.

Filters that need a sort (top-k, top-p) become per-row logit thresholds applied to the unsorted
row, so whether a batch mate uses top-p cannot change how another row's uniform maps to a token.
Everything optional is built only when some row of the step uses it (cheap flags), so an
all-greedy step is one argmax and a plain-temperature step is softmax + cumsum + searchsorted.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from bulkinfer.engine.argmax import argmax_rows
from bulkinfer.engine.sampling_params import GREEDY_EPSILON, SamplingParams
from bulkinfer.engine.sampling_random import split_seed, uniforms
from bulkinfer.engine.scheduler import eos_id_set

INT64_MAX = 2**63 - 1


class SampledRow(Protocol):
    """What the sampler reads from a request (bulkinfer.engine.request.Request satisfies it)."""

    sampling_params: SamplingParams
    sample_seed: int
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class PreviousStep(Protocol):
    """The step before (engine/device_step.py's SampledStep): its sampled ids on the device."""

    device_token_ids: torch.Tensor | None

    def rows_of(self, request_ids: Sequence[str]) -> torch.Tensor: ...


BitmaskApplier = Callable[[torch.Tensor, torch.Tensor], None]
PendingBitmask = tuple[torch.Tensor | None, BitmaskApplier | None]


@dataclass
class Penalties:
    """Rows that use a penalty, their settings, and the token ids their counts come from."""

    rows: torch.Tensor  # [R] row indices
    presence: torch.Tensor  # [R]
    frequency: torch.Tensor  # [R]
    repetition: torch.Tensor  # [R]
    output_rows: torch.Tensor  # flat (row-in-R, token) pairs of output tokens
    output_ids: torch.Tensor
    prompt_rows: torch.Tensor  # flat pairs of prompt tokens (only rows with repetition_penalty != 1)
    prompt_ids: torch.Tensor
    any_repetition: bool = True  # some row's repetition_penalty != 1
    # Async scheduling: output tokens the previous step is still sampling, (row-in-R, request id);
    # `fill_placeholders` turns them into (row, id) pairs read from that step's ids on the device.
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    placeholder_rows: torch.Tensor | None = None
    placeholder_ids: torch.Tensor | None = None


@dataclass
class RandomRows:
    """The rows that sample (temperature > 0) and what they need."""

    rows: torch.Tensor  # [R] row indices
    temperatures: torch.Tensor  # [R]
    seed_lo: torch.Tensor  # [R] int64
    seed_hi: torch.Tensor
    sample_index: torch.Tensor
    position: torch.Tensor  # output position of the token being drawn
    top_k: torch.Tensor | None  # [R] int (vocab-sized = off); None when no row uses top-k
    top_p: torch.Tensor | None  # [R] float; None when no row uses top-p
    min_p: torch.Tensor | None  # [R] float; None when no row uses min-p
    max_top_k: int = 0  # the largest top_k asked (0: none)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step, as tensors; optional parts are None when unused."""

    num_rows: int
    random: RandomRows | None  # None = every row is greedy
    penalties: Penalties | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to set to -inf
    logprob_rows: list[int]  # rows that want logprobs
    num_logprobs: list[int]  # top-k size for each of those rows
    bitmask: torch.Tensor | None = None  # grammar bitmask [num_rows, ceil(vocab / 32)] int32
    apply_bitmask: BitmaskApplier | None = None
    # Async scheduling: (bitmask, applier) still to come from the host; `resolve_bitmask` waits.
    pending_bitmask: concurrent.futures.Future[PendingBitmask] | None = None

    def fill_placeholders(self, previous: PreviousStep) -> None:
        """Penalty rows' tokens still being sampled when this step was built (async scheduling):
        taken from the previous step's sampled ids where they are, on the device (no host read)."""
        pen = self.penalties
        if pen is None or not pen.placeholders:
            return
        previous_ids = previous.device_token_ids
        assert previous_ids is not None, "placeholder tokens need the previous step's sampled ids"
        source = previous.rows_of([request_id for _, request_id in pen.placeholders])
        pen.placeholder_rows = torch.tensor([row for row, _ in pen.placeholders]).to(previous_ids.device)
        pen.placeholder_ids = previous_ids[source.to(previous_ids.device)]

    def resolve_bitmask(self) -> None:
        """Wait for a bitmask the host is still filling (the device's sampling needs it now)."""
        if self.pending_bitmask is not None:
            self.bitmask, self.apply_bitmask = self.pending_bitmask.result()
            self.pending_bitmask = None

    @property
    def plain_greedy(self) -> bool:
        """Nothing to do but argmax."""
        return (
            self.random is None
            and self.penalties is None
            and self.min_tokens_mask is None
            and not self.logprob_rows
            and self.bitmask is None
        )

    @staticmethod
    def build(
        rows: Sequence[SampledRow],
        eos_token_id: int | Sequence[int] | None = None,
        bitmask: torch.Tensor | None = None,
        apply_bitmask: BitmaskApplier | None = None,
    ) -> SamplingBatch:
        random_rows: list[int] = []
        penalty_rows: list[int] = []
        min_token_rows: list[int] = []
        logprob_rows: list[int] = []
        for i, row in enumerate(rows):
            p = row.sampling_params
            if p.temperature >= GREEDY_EPSILON:  # inlined: this loop runs per step
                random_rows.append(i)
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
                penalty_rows.append(i)
            if p.min_tokens and len(row.output_token_ids) + getattr(row, "num_output_placeholders", 0) \
                    < p.min_tokens:
                min_token_rows.append(i)
            if p.logprobs is not None:
                logprob_rows.append(i)
        return SamplingBatch(
            num_rows=len(rows),
            random=_random_rows(rows, random_rows) if random_rows else None,
            penalties=_penalties(rows, penalty_rows) if penalty_rows else None,
            min_tokens_mask=_min_tokens_mask(rows, min_token_rows, eos_token_id) if min_token_rows else None,
            logprob_rows=logprob_rows,
            num_logprobs=[rows[i].sampling_params.logprobs for i in logprob_rows],  # type: ignore[misc]
            bitmask=bitmask,
            apply_bitmask=apply_bitmask,
        )


@dataclass
class RowLogprobs:
    """The model's log-probabilities at one sampled position (raw log-softmax of its logits)."""

    token_id: int  # the sampled token
    chosen: float  # its logprob
    top_ids: list[int]  # the k most likely tokens, most likely first
    top_logprobs: list[float]
    rank: int | None = None  # the token's rank in the distribution (1: the most likely)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[RowLogprobs | None]  # one per row (None where the row did not ask)
    # Rows whose logits held NaN or +inf, or allowed no token at all: their token is meaningless.
    invalid_rows: list[int] = field(default_factory=list)
    # The sampled ids where the logits were (the next step's placeholder inputs read them there).
    device_token_ids: torch.Tensor | None = None


def _invalid_mask(logits: torch.Tensor, tokens: torch.Tensor,
                  random_rows: torch.Tensor | None) -> torch.Tensor:
    """Rows whose chosen logit is not finite (an argmax lands on a NaN or +inf, and on -inf when
    every token is masked), and sampled rows whose largest logit is not (a softmax over NaN draws
    junk), as a bool per row on the device. A cheap gather per step where all is well."""
    chosen = logits.gather(1, tokens[:, None].to(logits.device))[:, 0]
    bad = ~torch.isfinite(chosen)
    if random_rows is not None:  # the row maxima of the whole batch: a pass, not a copy of the rows
        bad[random_rows] |= ~torch.isfinite(logits.amax(dim=-1)[random_rows])
    return bad


def _to_host(tokens: torch.Tensor, invalid: torch.Tensor,
             logprobs: LogprobTensors | None) -> tuple[list[int], list[int], list[list[float]] | None]:
    """The step's one device-to-host copy: the sampled ids with each row's invalid flag (and, only
    where logprobs are asked, one more: their values). Nothing else in a step reads the device."""
    ints = [tokens, invalid.to(torch.int64)]
    if logprobs is not None:
        ints += [logprobs.ranks, logprobs.top_ids.reshape(-1)]
    host = torch.cat(ints).cpu().numpy()
    n = len(tokens)
    flags = host[n : 2 * n]
    floats = None
    if logprobs is not None:
        values = torch.cat([logprobs.chosen[:, None], logprobs.top_values], dim=1).cpu()
        floats = values.tolist()
        rows = len(logprobs.chosen)
        ranks, top_ids = host[2 * n : 2 * n + rows], host[2 * n + rows :].reshape(rows, -1)
        logprobs.host = (ranks.tolist(), top_ids.tolist())
    return host[:n].tolist(), flags.nonzero()[0].tolist(), floats


@dataclass
class LogprobTensors:
    """Logprobs of the rows that ask, on the device until the step's copy."""

    chosen: torch.Tensor  # [R] the sampled token's logprob
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, max k] int64
    top_values: torch.Tensor  # [R, max k]
    host: tuple[list[int], list[list[int]]] | None = None  # (ranks, top ids) once copied


class Sampler:
    @torch.inference_mode()  # the runner's logits are inference tensors, updated in place here
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [N, vocab] (any float dtype; worked on in fp32, in place when already fp32) -> one
        token id per row (+ logprobs). A plain greedy step takes the argmax in the logits' own
        dtype: rounding to fp32 is exact and monotone, so the argmax (ties included) is the same."""
        if batch.plain_greedy:
            tokens = argmax_rows(logits)
            token_list, invalid, _ = _to_host(tokens, _invalid_mask(logits, tokens, None), None)
            return SamplerOutput(token_list, [None] * batch.num_rows, invalid, tokens)
        logits = logits.float()
        raw_logprobs = None
        if batch.logprob_rows:
            rows = torch.tensor(batch.logprob_rows, device=logits.device)
            raw_logprobs = torch.log_softmax(logits[rows], dim=-1)

        if batch.bitmask is not None:
            assert batch.apply_bitmask is not None, "a bitmask needs its applier"
            batch.apply_bitmask(logits, batch.bitmask)
        if batch.min_tokens_mask is not None:
            _mask_until_min_tokens(logits, *batch.min_tokens_mask)
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties)

        random = batch.random
        random_rows = None if random is None else random.rows.to(logits.device)
        if random is not None and len(random.rows) == batch.num_rows:
            tokens = _sample_random(logits, random)  # all rows sample: no argmax, no gather
        else:
            tokens = argmax_rows(logits)
            if random is not None:
                tokens[random_rows] = _sample_random(logits[random_rows], random)
        wanted = _logprob_tensors(raw_logprobs, batch, tokens) if raw_logprobs is not None else None
        token_list, invalid, values = _to_host(tokens, _invalid_mask(logits, tokens, random_rows), wanted)
        return SamplerOutput(token_list, _row_logprobs(wanted, values, batch, token_list), invalid, tokens)


# ---- building the batch ---------------------------------------------------------------------------


def _random_rows(rows: Sequence[SampledRow], indices: list[int]) -> RandomRows:
    temperatures, seed_lo, seed_hi, sample_index, position = [], [], [], [], []
    top_k, top_p, min_p = [], [], []
    for i in indices:
        row = rows[i]
        p = row.sampling_params
        lo, hi = split_seed(row.sample_seed)
        temperatures.append(p.temperature)
        seed_lo.append(lo)
        seed_hi.append(hi)
        sample_index.append(row.sample_index)
        position.append(len(row.output_token_ids) + getattr(row, "num_output_placeholders", 0))
        # Any k past the vocabulary keeps every token; clamped so a huge k fits the int64 tensor.
        top_k.append(min(p.top_k, INT64_MAX) if p.top_k > 0 else 0)
        top_p.append(p.top_p)
        min_p.append(p.min_p)
    return RandomRows(
        rows=torch.tensor(indices),
        temperatures=torch.tensor(temperatures, dtype=torch.float32),
        seed_lo=torch.tensor(seed_lo, dtype=torch.int64),
        seed_hi=torch.tensor(seed_hi, dtype=torch.int64),
        sample_index=torch.tensor(sample_index, dtype=torch.int64),
        position=torch.tensor(position, dtype=torch.int64),
        top_k=torch.tensor(top_k, dtype=torch.int64) if any(top_k) else None,
        top_p=torch.tensor(top_p, dtype=torch.float32) if any(x < 1.0 for x in top_p) else None,
        min_p=torch.tensor(min_p, dtype=torch.float32) if any(min_p) else None,
        max_top_k=max(top_k),
    )


def _penalties(rows: Sequence[SampledRow], indices: list[int]) -> Penalties:
    params = [rows[i].sampling_params for i in indices]
    outputs = [rows[i].output_token_ids for i in indices]
    # A request's token still being sampled (async scheduling: at most the one in flight).
    placeholders = [(j, rows[i].request_id) for j, i in enumerate(indices)  # type: ignore[attr-defined]
                    if getattr(rows[i], "num_output_placeholders", 0)]
    # Prompt tokens only count for the repetition penalty (vLLM / HF semantics).
    prompts = [
        rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else []
        for i, p in zip(indices, params, strict=True)
    ]
    return Penalties(
        rows=torch.tensor(indices),
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        output_rows=_row_ids(outputs),
        output_ids=torch.tensor(list(itertools.chain.from_iterable(outputs)), dtype=torch.int64),
        prompt_rows=_row_ids(prompts),
        prompt_ids=torch.tensor(list(itertools.chain.from_iterable(prompts)), dtype=torch.int64),
        any_repetition=any(p.repetition_penalty != 1.0 for p in params),
        placeholders=placeholders,
    )


def _row_ids(lists: list[list[int]]) -> torch.Tensor:
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(lists)), lengths)


def _min_tokens_mask(
    rows: Sequence[SampledRow], indices: list[int], eos_token_id: int | Sequence[int] | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    eos_ids = sorted(eos_id_set(eos_token_id))
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i in indices:
        p = rows[i].sampling_params
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:  # with ignore_eos, EOS ends nothing
            ids += eos_ids
        mask_rows += [i] * len(ids)
        mask_ids += ids
    if not mask_ids:
        return None
    return torch.tensor(mask_rows, dtype=torch.int64), torch.tensor(mask_ids, dtype=torch.int64)


# ---- applying it --------------------------------------------------------------------------------


def _mask_until_min_tokens(logits: torch.Tensor, mask_rows: torch.Tensor, mask_ids: torch.Tensor) -> None:
    """EOS / stop ids become -inf, except in a row where they are all that is left (a grammar that
    can only end now): there min_tokens yields, since masking would leave no token to sample."""
    keep = mask_ids < logits.shape[-1]
    rows, ids = mask_rows[keep].to(logits.device), mask_ids[keep].to(logits.device)
    saved = logits[rows, ids]
    logits[rows, ids] = float("-inf")
    dead = ~torch.isfinite(logits[rows].amax(dim=-1))  # one entry per (row, id) pair
    # Unconditionally (no read of `dead` on the host): a dead row gets its logits back.
    logits[rows, ids] = torch.where(dead, saved, torch.full_like(saved, float("-inf")))


def _apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    device = logits.device
    rows = pen.rows.to(device)
    sub = logits[rows]
    counts = torch.zeros_like(sub)
    output_rows, output_ids = pen.output_rows.to(device), pen.output_ids.to(device)
    if pen.placeholder_ids is not None and pen.placeholder_rows is not None:
        output_rows = torch.cat([output_rows, pen.placeholder_rows])
        output_ids = torch.cat([output_ids, pen.placeholder_ids])
    if output_ids.numel():
        counts.index_put_((output_rows, output_ids), torch.ones(output_ids.numel(), device=device),
                          accumulate=True)
    seen = counts > 0
    repetition = pen.repetition.to(device)[:, None]
    if pen.any_repetition:
        in_prompt = torch.zeros_like(seen)
        if pen.prompt_ids.numel():
            in_prompt[pen.prompt_rows.to(device), pen.prompt_ids.to(device)] = True
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen | in_prompt, penalized, sub)
    sub = sub - pen.frequency.to(device)[:, None] * counts - pen.presence.to(device)[:, None] * seen
    logits[rows] = sub


def _sample_random(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """Draw one token per row of ``logits`` [R, vocab] (a copy; modified freely)."""
    device = logits.device
    vocab = logits.shape[-1]
    x = logits / random.temperatures.to(device)[:, None]
    neg_inf = float("-inf")
    if random.min_p is not None:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); min_p = 0 gives -inf (keeps all).
        cutoff = x.amax(dim=-1, keepdim=True) + random.min_p.to(device)[:, None].log()
        x = x.masked_fill(x < cutoff, neg_inf)
    if random.top_p is not None:
        x = _top_k_top_p_by_sort(x, random.top_k, random.top_p.to(device))
    elif random.top_k is not None:
        # topk of the largest k asked for (not a full sort); rows without top-k keep everything.
        # The largest k comes from the settings on the host, not from the device.
        k = random.top_k.to(device).clamp(max=vocab)
        kth = x.topk(min(random.max_top_k, vocab), dim=-1).values.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, neg_inf))
        x = x.masked_fill(x < kth, neg_inf)

    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = uniforms(random.seed_lo, random.seed_hi, random.sample_index, random.position).to(device)
    target = u[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    # Rounding put u at the very top of the cdf: take the likeliest (always computed: no host read).
    return torch.where(index >= vocab, probs.argmax(dim=-1), index)


def _top_k_top_p_by_sort(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p through one descending sort, applied as a per-row logit threshold."""
    vocab = x.shape[-1]
    sorted_x = x.sort(dim=-1, descending=True).values
    if top_k is not None:
        k = top_k.to(x.device).clamp(max=vocab)
        k = torch.where(k > 0, k, torch.full_like(k, vocab))
        rank = torch.arange(vocab, device=x.device)[None, :]
        sorted_x = sorted_x.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # Keep a token while the mass strictly before it is below top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    num_finite = (sorted_x > float("-inf")).sum(dim=-1)
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1)
    # top_p = 1 keeps every finite logit even where rounding pushes the mass before it to 1.
    num_kept = torch.where(top_p >= 1.0, num_finite, num_kept.minimum(num_finite)).clamp(min=1)
    threshold = sorted_x.gather(1, (num_kept - 1)[:, None])
    return x.masked_fill(x < threshold, float("-inf"))


def _logprob_tensors(raw: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor) -> LogprobTensors:
    """The asked rows' logprobs, from the sampled ids on the device."""
    rows = torch.tensor(batch.logprob_rows, device=raw.device)
    chosen = raw.gather(1, tokens[rows][:, None])
    ranks = (raw > chosen).sum(dim=-1) + 1
    max_k = max(batch.num_logprobs)
    if max_k:
        top = raw.topk(max_k, dim=-1)
        top_ids, top_values = top.indices, top.values
    else:
        top_ids = torch.empty(len(rows), 0, dtype=torch.int64, device=raw.device)
        top_values = torch.empty(len(rows), 0, dtype=raw.dtype, device=raw.device)
    return LogprobTensors(chosen[:, 0], ranks, top_ids, top_values)


def _row_logprobs(wanted: LogprobTensors | None, values: list[list[float]] | None, batch: SamplingBatch,
                  tokens: list[int]) -> list[RowLogprobs | None]:
    result: list[RowLogprobs | None] = [None] * batch.num_rows
    if wanted is None or values is None or wanted.host is None:
        return result
    ranks, top_ids = wanted.host
    for j, (row, k) in enumerate(zip(batch.logprob_rows, batch.num_logprobs, strict=True)):
        result[row] = RowLogprobs(tokens[row], values[j][0], top_ids[j][:k], values[j][1 : 1 + k], ranks[j])
    return result
