"""A token id's exact bytes and display text, for logprobs (cached per token id)."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte-fallback tokens


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table (transformers' own), inverted: byte-level BPE character -> byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """`token_bytes.get(token_id) -> (text, bytes)` for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id in self._special:
            return text, list(text.encode())
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level:
                decoder = _byte_decoder()
                if all(ch in decoder for ch in piece):
                    return text, [decoder[ch] for ch in piece]
            match = _HEX_BYTE.fullmatch(piece)
            if match:
                return text, [int(match.group(1), 16)]
            if "\u2581" in piece:  # sentencepiece word boundary
                return text, list(piece.replace("\u2581", " ").encode())
        return text, list(text.encode())
