"""Incremental detokenization with stop strings, safe for byte-level BPE.

A byte-level BPE token can hold part of a UTF-8 character (an emoji is often 4 one-byte tokens), so
decoding token by token would emit U+FFFD halves. Like vLLM, we decode a small window of tokens
`ids[prefix_offset:]` and compare it with the window's already-emitted part `ids[prefix_offset:read_offset]`;
new text is released only when the window does not end in U+FFFD (an incomplete character). Both offsets
sit on character boundaries, so the released pieces concatenate to `tokenizer.decode(output_ids)`.

Stop strings are matched on the released text, across token boundaries: only the new text plus the
last `max_stop_len - 1` characters before it can hold a match that was not seen already. When several
stop strings match, the one that completes first wins (ties: the one that starts first), which is
what a character-by-character stream would see whatever the tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns output token ids into text as they arrive; see the module docstring.

    `text` is the output so far (the stop string excluded unless `include_stop_str_in_output`; text
    after a stop string is never included). `delta()` returns the new text since its last call for
    streaming; when stop strings are set (and not included), it holds back a tail that could still
    become a stop string, so the deltas always concatenate to `text`. Call `finish()` when the
    request ends for another reason (EOS, max_tokens): it releases held-back text and an incomplete
    trailing character (as U+FFFD, exactly as `tokenizer.decode` renders it).

    The output is decoded on its own (never with the prompt), so a finished `text` equals
    `tokenizer.decode(token_ids, skip_special_tokens=...)`.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop)
        self._stop = [s for s in stops if s]  # an empty stop string would match everywhere
        self._include_stop = include_stop_str_in_output
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the text, if one did
        self._prefix_offset = 0
        self._read_offset = 0
        self._pieces: list[str] = []  # released text (joined lazily by `text`)
        self._tail = ""  # the last `_tail_len` characters of released text, for matching across tokens
        self._unsent: list[str] = []  # released text not yet returned by delta()
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once a stop string matched or `finish()` was called; later tokens are ignored."""
        return self._finished or self.stop_reason is not None

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one output token; return the stop string it completed, or None. With
        `check_stop=False` (before `min_tokens`, as in vLLM) the text grows but nothing stops it; a
        stop string that completes later still matches, one that completed meanwhile never does."""
        if self.finished:
            return None
        self.token_ids.append(token_id)
        new_text = self._decode_window(final=False)
        return self._release(new_text, check_stop) if new_text else None

    def finish(self) -> str | None:
        """End the text: release an incomplete trailing character (as decode renders it) and any
        held-back tail. Returns a stop string if the flushed text completed one, else None."""
        if self.finished:
            return None
        new_text = self._decode_window(final=True)
        matched = self._release(new_text) if new_text else None
        self._finished = True
        return matched

    def delta(self) -> str:
        """New complete text since the last call (streaming); the deltas concatenate to `text`."""
        unsent = "".join(self._unsent)
        hold = min(self._held_back(), len(unsent))
        self._unsent = [unsent[len(unsent) - hold :]] if hold else []
        return unsent[: len(unsent) - hold]

    # ------------------------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """The text that the tokens past `read_offset` add, or "" while it ends mid-character."""
        ids = self.token_ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or (window_text.endswith(_REPLACEMENT) and not final):
            return ""  # nothing visible yet (skipped special token) or an incomplete character
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return window_text[len(prefix_text) :]

    def _release(self, new_text: str, check_stop: bool = True) -> str | None:
        window = self._tail + new_text
        # Only matches that complete in the new text: the tail was checked before (or not to be).
        match = _earliest_stop(window, self._stop, min_end=len(self._tail) + 1) if check_stop else None
        if match is None:
            self._append(new_text)
            self._tail = window[max(0, len(window) - self._tail_len) :] if self._tail_len else ""
            return None
        stop, start = match
        cut = start + len(stop) if self._include_stop else start
        keep = cut - len(self._tail)  # in new_text's coordinates
        if keep >= 0:
            self._append(new_text[:keep])
        else:
            self._drop(-keep)  # the stop string began in released (held-back) text
        self.stop_reason = stop
        return stop

    def _append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._unsent.append(text)

    def _drop(self, count: int) -> None:
        # Only held-back text is dropped (see _held_back), so it was never returned by delta().
        text = self.text
        self._pieces = [text[: len(text) - count]]
        unsent = "".join(self._unsent)
        self._unsent = [unsent[: len(unsent) - count]]

    def _held_back(self) -> int:
        """How many trailing characters delta() must keep: the longest tail of the text that is the
        start of a stop string (it may yet be cut off). None once the text is final."""
        if self._include_stop or self.finished or not self._stop:
            return 0
        for size in range(len(self._tail), 0, -1):
            suffix = self._tail[len(self._tail) - size :]  # size >= 1: never the whole-string slice
            if any(s.startswith(suffix) for s in self._stop):
                return size
        return 0


def _earliest_stop(text: str, stops: list[str], min_end: int = 0) -> tuple[str, int] | None:
    """The stop string that completes first in `text` at or after `min_end` (ties: the one
    starting first) and its start."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, min_end - len(stop)))
        if start >= 0:
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[2], best[1])
