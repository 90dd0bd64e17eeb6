"""Prompt-lookup (n-gram) drafts: what followed the last n tokens the last time they occurred."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, num_tokens: int, n_min: int,
                  n_max: int) -> list[int]:
    """Up to `num_tokens` drafts: for the longest n in [n_min, n_max] whose last-n-token suffix
    occurred earlier in `token_ids`, the tokens after its most recent earlier occurrence.
    Empty when nothing matches. O(len) per call: candidates are the earlier positions of the
    last token, checked backwards."""
    length = len(token_ids)
    if num_tokens < 1 or length < n_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Ends of earlier occurrences: positions p < length - 1 holding the last token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    if ends.size == 0:
        return []
    # matched[i]: how many tokens match backwards from ends[i] (capped at n_max).
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(n_max, length - 1)):
        prev = ends - back
        ok = alive & (prev >= 0)
        ok[ok] = tokens[prev[ok]] == tokens[length - 1 - back]
        matched += ok
        alive = ok
        if not alive.any():
            break
    best = int(matched.max())
    if best < n_min:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the most recent of the longest
    return tokens[end + 1 : end + 1 + num_tokens].tolist()


class TokenArrays:
    """Each request's tokens as a numpy array, appended to as it grows: the lookup reads the whole
    sequence every step, and converting a few hundred tokens from a list each time was half its
    cost (bench host, 256 n-gram rows)."""

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id: (buffer, tokens in it)

    def of(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """`token_ids` as an array; only what was appended since the last call is copied."""
        length = len(token_ids)
        buffer, known = self._arrays.get(request_id, (None, 0))
        # Tokens are only appended while a request runs; anything else (or a stale id) starts over.
        if buffer is None or known > length or (known and buffer[known - 1] != token_ids[known - 1]):
            buffer, known = np.empty(max(64, 2 * length), dtype=np.int64), 0
        if length > buffer.size:
            grown = np.empty(2 * length, dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        if length > known:
            buffer[known:length] = token_ids[known:length]
        self._arrays[request_id] = (buffer, length)
        return buffer[:length]

    def release(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
