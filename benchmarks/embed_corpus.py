"""Deterministic texts of mixed lengths for embedding benchmarks and tests.

Sentences made of common English words, numbers and punctuation, each cut to a token length drawn
uniformly from [min_tokens, max_tokens] (the model's special tokens included), so a batch of them
has the spread of lengths real corpora have and padding would waste about half of a padded batch.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be "
    "or has had not but first one their its new after who they have two been other when there all "
    "during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made government "
    "while three also since around became both people high born before under north between south "
    "number several well long part river war film series team season early district county music "
    "album band game group church history however area family being film name public major system "
    "league station based following until these four second including each although record line "
    "search index embedding vector model batch corpus query document retrieval similarity cluster "
    "dedup rows shard worker engine token sentence paragraph summary question answer data science"
).split()
PUNCTUATION = (",", ".", ";", ":", "!", "?", " -", " (1998)", " 42", " 3.14", " #7", " 2026-12-05")


def mixed_length_texts(tokenizer: Any, count: int, *, min_tokens: int = 5, max_tokens: int = 250,
                       seed: int = 0) -> list[str]:
    """`count` texts whose token counts (with special tokens, by `tokenizer`) spread over
    [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    special = len(tokenizer("", add_special_tokens=True)["input_ids"])
    texts = []
    for _ in range(count):
        target = rng.randint(min_tokens, max_tokens) - special
        words = []
        for _ in range(target + 4):  # a word is at least one token: enough words to cut from
            word = rng.choice(WORDS)
            words.append(word + (rng.choice(PUNCTUATION) if rng.random() < 0.12 else ""))
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:max(target, 1)]
        texts.append(tokenizer.decode(ids).strip())
    return texts
