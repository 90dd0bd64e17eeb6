"""IncrementalDetokenizer with the tiny checkpoints' byte-level BPE tokenizer: multi-byte characters split
across tokens, streamed deltas, stop strings across token boundaries."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bulkinfer.engine.checkpoints import EOS_TOKEN, IM_END
from bulkinfer.engine.detokenizer import IncrementalDetokenizer

MIXED = "naïve café: 😀 and 世界, then 🎉🎉 done\nnext line ∑ end"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], str | None]:
    """Add tokens one by one, collecting each step's delta; returns (deltas, matched stop)."""
    deltas = []
    for token_id in token_ids:
        matched = detok.add_token(token_id)
        deltas.append(detok.delta())
        if matched is not None:
            return deltas, matched
    return deltas, None


def test_multibyte_characters_are_split_across_tokens(tokenizer):
    # The premise of the other tests: an emoji and a CJK character are several tokens each.
    for char in ("😀", "世"):
        ids = tokenizer.encode(char)
        assert len(ids) > 1
        assert all("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_deltas_never_hold_a_partial_character_and_concatenate_to_decode(tokenizer):
    ids = tokenizer.encode(MIXED)
    detok = IncrementalDetokenizer(tokenizer)
    deltas, matched = feed(detok, ids)
    assert matched is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MIXED == detok.text == tokenizer.decode(ids)
    # Some steps released nothing (the middle of an emoji), others released a whole character.
    assert "" in deltas and any(d in ("😀", " 😀") for d in deltas)


def test_text_never_shows_half_a_character_mid_stream(tokenizer):
    ids = tokenizer.encode("😀")
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in ids[:-1]:
        detok.add_token(token_id)
        assert detok.text == ""
    detok.add_token(ids[-1])
    assert detok.text == "😀"


def test_finish_flushes_an_incomplete_character_as_decode_does(tokenizer):
    ids = tokenizer.encode("ok 😀")[:-1]  # cut mid-emoji, as max_tokens can
    detok = IncrementalDetokenizer(tokenizer)
    deltas, _ = feed(detok, ids)
    assert detok.text == "ok "
    assert detok.finish() is None
    deltas.append(detok.delta())
    assert detok.text == tokenizer.decode(ids) == "".join(deltas)
    assert detok.text.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    ids = tokenizer.encode("hi 世") + [im_end] + tokenizer.encode(" there") + [eos]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas, _ = feed(detok, ids)
    detok.finish()
    deltas.append(detok.delta())
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip) == "".join(deltas)
    assert (IM_END in detok.text) is not skip


def test_stop_string_spanning_tokens_is_excluded_and_nothing_after_it(tokenizer):
    text = "def compute(value): return value + 1\nprint(compute(2))"
    ids = tokenizer.encode(text)
    stop = "return value"
    assert stop not in [tokenizer.decode([i]) for i in ids]  # it spans several tokens
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    deltas, matched = feed(detok, ids)
    assert matched == stop and detok.stop_reason == stop
    assert detok.text == "def compute(value): "
    assert "".join(deltas) == detok.text  # the held-back "return" start was never streamed
    assert detok.add_token(ids[0]) is None and detok.text == "def compute(value): "


def test_stop_string_included_on_request(tokenizer):
    ids = tokenizer.encode("first 😀 second 世界 third")
    detok = IncrementalDetokenizer(
        tokenizer, stop="世界", include_stop_str_in_output=True
    )
    deltas, matched = feed(detok, ids)
    assert matched == "世界"
    assert detok.text == "first 😀 second 世界" == "".join(deltas)


def test_stop_string_inside_one_token_cuts_the_token_text(tokenizer):
    ids = tokenizer.encode(" return")
    assert len(ids) == 1
    detok = IncrementalDetokenizer(tokenizer, stop=["tur"])
    assert detok.add_token(ids[0]) == "tur"
    assert detok.text == " re"
    assert detok.delta() == " re"


def test_multiple_stop_strings_the_first_to_complete_wins(tokenizer):
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["delta", "gamma", "beta gam"])
    _, matched = feed(detok, ids)
    assert matched == "beta gam" and detok.text == "alpha "
    # Completing at the same character, the one that starts first (the longer) wins.
    detok = IncrementalDetokenizer(tokenizer, stop=["ma", "gamma"])
    _, matched = feed(detok, ids)
    assert matched == "gamma" and detok.text == "alpha beta "


def test_stop_string_equal_to_a_prefix_held_back_but_released_at_finish(tokenizer):
    ids = tokenizer.encode("the end is ret")
    detok = IncrementalDetokenizer(tokenizer, stop=["return"])
    deltas, matched = feed(detok, ids)
    assert matched is None
    assert "".join(deltas) == "the end is "  # " ret" could still become "return"
    assert detok.text == "the end is ret"
    detok.finish()
    assert "".join(deltas) + detok.delta() == detok.text


def test_no_stop_strings_stream_everything_at_once(tokenizer):
    ids = tokenizer.encode("plain ascii text")
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.delta() == "plain ascii text"
    assert detok.delta() == ""


@pytest.mark.parametrize("seed", range(5))
def test_random_token_streams_match_decode_and_a_reference_stop_search(tokenizer, seed):
    # Random ids include lone continuation bytes and cut characters: whatever decode renders, text matches.
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=bool(seed % 2))
    deltas, _ = feed(detok, ids)
    detok.finish()
    deltas.append(detok.delta())
    full = tokenizer.decode(ids, skip_special_tokens=bool(seed % 2))
    assert detok.text == full == "".join(deltas)

    # Stop strings taken from the middle of the text: the result is the reference cut of the full text.
    stops = [full[i : i + rng.randrange(2, 6)] for i in sorted(rng.sample(range(20, len(full) - 6), 3))]
    detok = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=bool(seed % 2), stop=stops
    )
    deltas, matched = feed(detok, ids)
    end, start, expected = min((full.find(s) + len(s), full.find(s), s) for s in stops)
    assert matched == expected and detok.text == full[:start] == "".join(deltas)


def test_stops_are_not_checked_before_min_tokens_and_never_matched_in_text_seen_then(tokenizer):
    ids = tokenizer.encode("ab xy ab cd")
    detok = IncrementalDetokenizer(tokenizer, stop=["ab", "zzzzzz"])
    first_ab = len(tokenizer.encode("ab"))  # the tokens of the first "ab": unchecked (before min_tokens)
    assert all(detok.add_token(t, check_stop=False) is None for t in ids[:first_ab])
    matched = None
    for token_id in ids[first_ab:]:  # checked from here: the first "ab" stays, the second one stops
        matched = detok.add_token(token_id)
        if matched:
            break
    assert matched == "ab" and detok.text == "ab xy "
