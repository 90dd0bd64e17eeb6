"""StructuredOutputManager unit tests: the compile cache, failures and timeouts, the bitmask, and
tokens followed to termination. Logits are random (temperature 1.0); the tokenizer is the tiny
checkpoint's byte-level BPE."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from bulkinfer.engine.structured_output import (
    GrammarError,
    StructuredOutputManager,
    StructuredSpec,
    check_spec,
)
from tests.engine.structured_schemas import sample_with_random_logits

PADDED_VOCAB = 2048 + 40  # the model's vocab may be larger than the tokenizer's (padding ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


@pytest.fixture
def manager(tokenizer):
    manager = StructuredOutputManager(tokenizer, PADDED_VOCAB, max_num_seqs=64)
    yield manager
    manager.shutdown()


class GatedManager(StructuredOutputManager):
    """Compiles wait for ``gate``; records the compiling thread."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.threads: list[str] = []

    def _compile(self, spec: StructuredSpec):
        self.threads.append(threading.current_thread().name)
        self.gate.wait(10)
        return super()._compile(spec)


def wait_state(manager: StructuredOutputManager, request_id: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while (state := manager.state(request_id)) == "compiling" and time.monotonic() < deadline:
        time.sleep(0.005)
    return state


def test_register_does_not_wait_for_the_compile_and_a_key_compiles_once(tokenizer) -> None:
    manager = GatedManager(tokenizer, PADDED_VOCAB, max_num_seqs=8)
    spec = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    for request_id in ("r1", "r2", "r3"):
        manager.register(request_id, spec)  # returns while the compile is held at the gate
    assert [manager.state(r) for r in ("r1", "r2", "r3")] == ["compiling"] * 3
    assert manager.num_compiles == 1
    manager.gate.set()
    assert [wait_state(manager, r) for r in ("r1", "r2", "r3")] == ["ready"] * 3
    assert manager.threads and all(name.startswith("grammar-compile") for name in manager.threads)

    # Same schema, keys in another order: the same canonical key, so no new compile.
    same = StructuredSpec.json_schema({"properties": {"a": {"type": "integer"}}, "type": "object"})
    manager.register("r4", same)
    assert wait_state(manager, "r4") == "ready"
    assert manager.num_compiles == 1
    manager.register("r5", StructuredSpec.regex("[ab]+"))
    assert wait_state(manager, "r5") == "ready"
    assert manager.num_compiles == 2
    manager.shutdown()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredSpec.regex("(unclosed"), "grammar for regex failed to compile: "),
        (StructuredSpec.grammar('root ::= "a" undefined_rule'), "grammar for grammar failed to compile: "),
        (
            StructuredSpec("json", '{"type": "integer", "minimum": 1.5}'),
            "grammar for json_schema failed to compile: Integer constraint must be a whole number",
        ),
        (StructuredSpec("json", "{not json"), "grammar for json_schema failed to compile: "),
        (
            StructuredSpec.json_schema({"type": "array", "uniqueItems": True}),
            "grammar for json_schema failed to compile: 'uniqueItems' is not enforced by the grammar engine "
            "(at #/uniqueItems)",
        ),
    ],
)
def test_a_failed_compile_fails_that_request_alone_with_the_reason(manager, spec, message) -> None:
    manager.register("bad", spec)
    manager.register("good", StructuredSpec.choice(["x", "y"]))
    assert wait_state(manager, "bad") == "failed"
    assert manager.error("bad").startswith(message), manager.error("bad")
    assert wait_state(manager, "good") == "ready"
    assert manager.error("good") is None
    # The failure is cached like a success: the same spec fails again without a new compile.
    compiles = manager.num_compiles
    manager.register("bad-again", spec)
    assert wait_state(manager, "bad-again") == "failed"
    assert manager.num_compiles == compiles


def test_a_compile_past_the_time_limit_fails_the_request_and_later_ones_reuse_the_result(tokenizer) -> None:
    manager = GatedManager(tokenizer, PADDED_VOCAB, max_num_seqs=8, compile_timeout_s=0.05)
    spec = StructuredSpec.regex("[0-9]{3}")
    manager.register("slow", spec)
    assert manager.state("slow") == "compiling"
    assert wait_state(manager, "slow") == "failed"
    assert manager.error("slow") == "grammar for regex did not compile within 0.05 s (compile_timeout_s)"
    manager.gate.set()  # the compile thread finishes after all
    manager.register("later", spec)
    assert wait_state(manager, "later") == "ready"
    assert manager.state("slow") == "failed"  # a timed-out request stays failed
    assert manager.num_compiles == 1
    manager.shutdown()


def test_a_compile_still_running_does_not_hold_up_the_process_exit(tiny_checkpoint: Path) -> None:
    script = textwrap.dedent(f"""
        import time
        from transformers import AutoTokenizer
        from bulkinfer.engine.structured_output import StructuredOutputManager, StructuredSpec

        class Stuck(StructuredOutputManager):
            def _compile(self, spec):
                time.sleep(3600)

        tokenizer = AutoTokenizer.from_pretrained({str(tiny_checkpoint)!r})
        manager = Stuck(tokenizer, 2048, 4, compile_timeout_s=0.01)
        manager.register("r", StructuredSpec.regex("a"))
        while manager.state("r") == "compiling":
            time.sleep(0.01)
        print(manager.error("r"), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "grammar for regex did not compile within 0.01 s (compile_timeout_s)"


def test_bitmask_rows_without_grammar_allow_everything_and_padding_ids_are_masked(manager, tokenizer) -> None:
    assert manager.fill_bitmask([None, None]) is None
    manager.register("g", StructuredSpec.choice(["yes", "no"]))
    assert wait_state(manager, "g") == "ready"
    bitmask = manager.fill_bitmask([None, "g", None])
    words = (PADDED_VOCAB + 31) // 32
    assert bitmask.dtype == torch.int32 and tuple(bitmask.shape) == (3, words)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()

    logits = torch.zeros(3, PADDED_VOCAB)
    manager.apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all(t < len(tokenizer) for t in allowed)  # padding ids never allowed
    texts = {tokenizer.decode([t]) for t in allowed}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def test_the_stop_token_is_allowed_only_once_the_grammar_is_complete(manager, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    manager.register("c", StructuredSpec.choice(["ab"]))
    assert wait_state(manager, "c") == "ready"

    def allowed() -> set[int]:
        logits = torch.zeros(1, PADDED_VOCAB)
        manager.apply_bitmask(logits, manager.fill_bitmask(["c"]))
        return set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist())

    assert eos not in allowed()
    for token_id in tokenizer.encode("ab"):
        assert manager.accept_token("c", token_id)
    assert allowed() == {eos}
    assert not manager.is_terminated("c")
    assert manager.accept_token("c", eos)
    assert manager.is_terminated("c")
    assert manager.fill_bitmask(["c"]) is None  # a terminated grammar constrains nothing
    assert not manager.accept_token("c", eos)


def _run(manager, tokenizer, spec: StructuredSpec, count: int, seed: int = 0) -> list[str | None]:
    ids = [f"{spec.kind}-{i}" for i in range(count)]
    for request_id in ids:
        manager.register(request_id, spec)
    assert all(wait_state(manager, r) == "ready" for r in ids)
    tokens = sample_with_random_logits(manager, ids, PADDED_VOCAB, seed=seed)
    for request_id in ids:
        manager.release(request_id)
    return [None if t is None else tokenizer.decode(t) for t in tokens.values()]


def test_choice_outputs_are_exactly_one_of_the_choices(manager, tokenizer) -> None:
    choices = ['say "hi"', "back\\slash", "tab\tand\nnewline", "ünï", "a", "ab", "abc"]
    texts = _run(manager, tokenizer, StructuredSpec.choice(choices), 60)
    assert all(text in choices for text in texts), texts
    assert len(set(texts)) > 3  # random logits reach several choices


def test_regex_outputs_match(manager, tokenizer) -> None:
    pattern = r"[a-z]{2,5}-[0-9]{1,3}(\.[0-9]{1,2})?"
    texts = _run(manager, tokenizer, StructuredSpec.regex(pattern), 60)
    assert all(text is not None and re.fullmatch(pattern, text) for text in texts), texts


def test_regex_dot_outputs_valid_utf8(manager, tokenizer) -> None:
    """xgrammar's own ``.`` admits overlong UTF-8 and encoded surrogates (decoded: U+FFFD)."""
    spec = StructuredSpec.regex(".{1,5}")
    texts = [t for seed in range(5) for t in _run(manager, tokenizer, spec, 64, seed)]
    assert all(text is not None and re.fullmatch(".{1,5}", text) for text in texts), texts


def test_ebnf_grammar_outputs_match(manager, tokenizer) -> None:
    grammar = 'root ::= "(" num (" + " num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
    texts = _run(manager, tokenizer, StructuredSpec.grammar(grammar), 60)
    expected = r"\([1-9][0-9]{0,2}( \+ [1-9][0-9]{0,2}){0,3}\)"
    assert all(text is not None and re.fullmatch(expected, text) for text in texts), texts


def test_any_json_object_is_an_object(manager, tokenizer) -> None:
    texts = _run(manager, tokenizer, StructuredSpec.json_schema(True), 40)
    finished = [t for t in texts if t is not None]
    # Unbounded strings and nesting: random logits may wander past max_steps; what ends is an object.
    assert finished
    assert all(isinstance(json.loads(text), dict) for text in finished), finished


def allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def test_drafted_rows_see_the_grammar_after_their_drafts(manager, tokenizer) -> None:
    """Speculative decoding: a row after drafts is filled as if they were accepted, then the grammar
    is rolled back; a row after a refused draft is left unconstrained; rows may outnumber
    max_num_seqs (each request has 1 + drafts rows)."""
    manager.register("r", StructuredSpec.regex("ab+c"))
    assert wait_state(manager, "r") == "ready"
    a, b, c = (tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    ids = ["r", "r", "r", "r"] + [None] * 62  # 66 rows
    drafts = [(), (a,), (a, b), (a, c)] + [()] * 62
    bitmask = manager.fill_bitmask(ids, drafts).clone()
    assert allowed(bitmask, 0, a) and not allowed(bitmask, 0, b)  # start: only "a"
    assert allowed(bitmask, 1, b) and not allowed(bitmask, 1, c)  # after "a": "b"
    assert allowed(bitmask, 2, b) and allowed(bitmask, 2, c)  # after "ab": "b" or "c"
    assert manager.num_drafts_refused == 0
    # Rolled back: a plain fill sees the start state again.
    assert manager.fill_bitmask(["r"])[0].equal(bitmask[0])
    refused = manager.fill_bitmask(["r", "r", "r"], [(), (b,), (b, b)]).clone()
    assert manager.num_drafts_refused == 1  # "b" cannot start; the row after it is unconstrained
    assert int((refused[1] != -1).sum()) == 0 and int((refused[2] != -1).sum()) == 0
    assert manager.accept_token("r", a)  # the real grammar state was never moved


def test_release_forgets_the_request(manager) -> None:
    manager.register("r", StructuredSpec.regex("a"))
    with pytest.raises(ValueError, match="already has a grammar"):
        manager.register("r", StructuredSpec.regex("a"))
    manager.release("r")
    assert not manager.has_request("r") and manager.error("r") is None
    manager.register("r", StructuredSpec.regex("a"))  # the id can be used again
    assert wait_state(manager, "r") == "ready"


def test_spec_keys() -> None:
    assert StructuredSpec.json_schema(True) == StructuredSpec("json", "")
    assert StructuredSpec.json_schema({"b": 1, "a": 2}) == StructuredSpec.json_schema({"a": 2, "b": 1})
    # The order of properties is the output's field order: it is part of the key.
    z, a = {"type": "integer", "minimum": 0}, {"type": "string"}
    first = {"type": "object", "properties": {"z": z, "a": a}}
    same = {"properties": {"z": dict(reversed(z.items())), "a": a}, "type": "object"}
    swapped = {"type": "object", "properties": {"a": a, "z": z}}
    assert StructuredSpec.json_schema(first) == StructuredSpec.json_schema(same)
    assert StructuredSpec.json_schema(first) != StructuredSpec.json_schema(swapped)
    nested = {"properties": {"properties": {"properties": {"b": {}, "a": {}}}}}
    assert json.loads(StructuredSpec.json_schema(nested).value) == nested  # "properties" named so, kept
    assert StructuredSpec.choice(["a", "b"]) != StructuredSpec.choice(["b", "a"])
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredSpec("yaml", "")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty list of strings"):
        StructuredSpec.choice([])


def test_check_spec_finds_what_a_compile_would_refuse_without_a_tokenizer() -> None:
    for good in (StructuredSpec.json_schema(True), StructuredSpec.regex("[a-z]{2}"),
                 StructuredSpec.choice(["a", "b"]), StructuredSpec.grammar('root ::= "x" | "y"')):
        check_spec(good)
    for bad, reason in ((StructuredSpec.json_schema({"$ref": "#/$defs/nowhere"}), "Cannot find field"),
                        (StructuredSpec.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
                        (StructuredSpec.grammar("root ::= undefined_rule"), "undefined_rule")):
        with pytest.raises(GrammarError, match=f"^grammar for {bad.kind_name} failed to compile: .*{reason}"):
            check_spec(bad)
