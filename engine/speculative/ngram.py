"""Prompt-lookup (n-gram) drafts: what followed the last n tokens the last time they occurred."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int] | np.ndarray, num_tokens: int, n_min: int,
                  n_max: int) -> list[int]:
    """Up to `num_tokens` drafts: for the longest n in [n_min, n_max] whose last-n-token suffix
    occurred earlier in `token_ids`, the tokens after its most recent earlier occurrence.
    Empty when nothing matches. Each n is one backwards byte search (C speed) over the tokens as
    int32: a per-row lookup sits on the critical path of every drafting step."""
    length = len(token_ids)
    if num_tokens < 1 or length < n_min + 1:
        return []
    tokens = np.asarray(token_ids)
    if tokens.dtype != np.int32:
        tokens = tokens.astype(np.int32)
    before_last = tokens[: length - 1].tobytes()  # an earlier occurrence ends before the last token
    width = tokens.itemsize
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n :].tobytes()
        end = len(before_last)
        while True:
            found = before_last.rfind(pattern, 0, end)
            if found < 0 or found % width == 0:
                break
            end = found + len(pattern) - 1  # a match across token boundaries: look further back
        if found >= 0:
            after = found // width + n
            return tokens[after : after + num_tokens].tolist()
    return []


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
            buffer, known = np.empty(max(64, 2 * length), dtype=np.int32), 0
        if length > buffer.size:
            grown = np.empty(2 * length, dtype=np.int32)
            grown[:known] = buffer[:known]
            buffer = grown
        if length > known:
            buffer[known:length] = token_ids[known:length]
        self._arrays[request_id] = (buffer, length)
        return buffer[:length]

    def release(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
