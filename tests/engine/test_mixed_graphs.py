"""Steps with prefill chunks on the fixed-shape path (engine/mixed_graphs.py; CUDA graphs on a GPU):
padded tokens and sequences change no real row's tokens, chunked prefill beside decode rows and
prefix-cache hits included, and steps the graphs cannot hold run eagerly.

On CPU the Triton kernels run under the interpreter (slow): the scenario is small."""

from __future__ import annotations

import os

if os.environ.get("BULKINFER_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from bulkinfer.engine import LLM, SamplingParams  # noqa: E402
from bulkinfer.engine.mixed_graphs import TOKEN_BUCKETS, MixedGraphs  # noqa: E402
from tests.engine.hf_reference import TEST_DEVICE, assert_greedy_by_teacher_forcing  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _device_functions_run_under_their_launchs_patch() -> Iterator[None]:
    """Under Triton's interpreter a launch patches triton.language for its kernel (and restores it
    after), and every call of a @triton.jit device function in it (_rounded, _cast: several per
    program) patches the same modules again, never restoring: each an inspect.getmembers pass over
    them, a third of this file's interpreting. A device function of the launched kernel's own module
    (so the same language modules) skips that repeat; anything else patches as before. The kernels
    run the same code and give the same bits. Left alone where the interpreter is not in use or
    Triton's internals differ from 3.9's."""
    try:
        from triton.runtime import interpreter

        launch, patch_lang, empty_scope = (interpreter.GridExecutor.__call__, interpreter._patch_lang,
                                           interpreter._LangPatchScope)
    except (ImportError, AttributeError):
        launch = None
    if os.environ.get("TRITON_INTERPRET") != "1" or launch is None:
        yield
        return
    patched: list[dict | None] = []  # per running launch: its kernel's globals once it has patched

    def launching(self, *args, **kwargs):
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def patching(fn):
        if patched and patched[-1] is fn.__globals__:
            return empty_scope()  # the launch's patch of these very modules is in place
        scope = patch_lang(fn)
        if patched and patched[-1] is None:
            patched[-1] = fn.__globals__  # the launch's own patch
        return scope

    interpreter.GridExecutor.__call__, interpreter._patch_lang = launching, patching
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__, interpreter._patch_lang = launch, patch_lang


def prompts() -> list[list[int]]:
    """Two rows sharing a 2-block instruction, and rows of their own, of lengths that chunk."""
    rng = random.Random(7)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 2048) for _ in range(n)]

    shared = tokens(32)
    return [shared + tokens(5), tokens(3), shared + tokens(11), tokens(29)]


def test_token_buckets_grow_by_at_most_half():
    assert TOKEN_BUCKETS[0] == 16
    assert all(b > a and b <= 1.5 * a for a, b in zip(TOKEN_BUCKETS, TOKEN_BUCKETS[1:], strict=False))


# Gemma 3: sliding-window layers beside global ones; Mixtral: Llama's attention, with the experts'
# fixed-shape path (plain Llama adds nothing these two do not run, under a slow interpreter).
@pytest.fixture(scope="module", params=["gemma3", "mixtral"])
def mixed_run(request, checkpoint_factory):
    """One engine on the kernels with fixed-shape steps, rows of different lengths joining while
    others decode, and a count of the mixed steps the fixed-shape path ran."""
    model_dir = str(checkpoint_factory(arch=request.param))
    llm = LLM(model_dir, device=TEST_DEVICE, dtype="float32", num_kv_blocks=64,
              triton_kernels=True, decode_graphs=True, batch_invariant=False, max_num_batched_tokens=24,
              kv_populate_seconds=0)
    ran: list[tuple[int, int, int]] = []
    original = MixedGraphs._replay

    def counting(self, key):
        ran.append(key)
        return original(self, key)

    MixedGraphs._replay = counting
    try:
        batch = prompts()
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 2, 3, 2)]
        first = llm.generate(batch[:1], params[0])  # cached: the third row hits its instruction
        rest = llm.generate(batch[1:], params[1:])
    finally:
        MixedGraphs._replay = original
    return llm, batch, first + rest, ran, model_dir


def test_mixed_steps_on_the_fixed_shape_path_give_transformers_tokens(mixed_run):
    llm, batch, outputs, ran, model_dir = mixed_run
    assert ran, "no step with a prefill chunk took the fixed-shape path"
    assert all(tokens in TOKEN_BUCKETS and seqs >= 2 for tokens, seqs, _ in ran)
    assert outputs[2].num_cached_tokens >= 32  # the shared instruction came from the cache
    for output in outputs:
        assert output.error is None, output.error
    assert_greedy_by_teacher_forcing([(prompt, output.token_ids) for prompt, output in
                                      zip(batch, outputs, strict=True)], model_dir, llm.engine.model)


def test_steps_pad_to_buckets_and_too_large_ones_run_eagerly(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), device=TEST_DEVICE, dtype="float32", num_kv_blocks=16,
              triton_kernels=True, decode_graphs=True, batch_invariant=False, max_num_batched_tokens=24,
              kv_populate_seconds=0)
    graphs = llm.engine.runner._mixed_graphs()
    assert graphs is not None
    assert graphs.shape_for(TOKEN_BUCKETS[-1] * 64, 1, 1) is None  # past the largest token bucket
    tokens, seqs, long = graphs.shape_for(20, 3, 70)
    assert (tokens, seqs, long) == (24, 4, 1)


def test_batch_invariant_engines_keep_mixed_steps_eager(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), device=TEST_DEVICE, dtype="float32", num_kv_blocks=16,
              triton_kernels=True, decode_graphs=True, batch_invariant=True, max_num_batched_tokens=16,
              kv_populate_seconds=0)
    assert llm.engine.runner._decode_graphs() is not None
    assert llm.engine.runner._mixed_graphs() is None


def test_two_ranks_run_decode_and_mixed_steps_on_the_fixed_shape_path_with_one_ranks_tokens(tiny_checkpoint,
                                                                                        monkeypatch):
    """Tensor parallel with fixed-shape steps: every rank builds the same step from the same rows,
    so each pads it to the same shape and their collectives pair up (a rank left eager would
    all-reduce other sizes and fail the step); the tokens are one rank's."""
    from bulkinfer.engine.decode_graphs import DecodeGraphs

    options = dict(device=TEST_DEVICE, dtype="float32", num_kv_blocks=64, triton_kernels=True,
                   decode_graphs=True, batch_invariant=False, max_num_batched_tokens=24,
                   kv_populate_seconds=0)
    batch = prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 2, 3, 2)]
    single = LLM(str(tiny_checkpoint), **options)
    expected = [output.outputs[0].token_ids for output in single.generate(batch, params)]
    ran: list[str] = []
    for graphs in (DecodeGraphs, MixedGraphs):
        monkeypatch.setattr(graphs, "_replay", lambda self, key, replay=graphs._replay: (
            ran.append(type(self).__name__), replay(self, key))[1])
    parallel = LLM(str(tiny_checkpoint), tensor_parallel_size=2, **options)
    try:
        got = [output.outputs[0].token_ids for output in parallel.generate(batch, params)]
        runner = parallel.engine.runner
        assert runner.decode_graphs is not None and runner.decode_graphs.strict
        assert runner.mixed_graphs is not None and runner.mixed_graphs.strict
    finally:
        parallel.engine.shutdown()
    assert got == expected
    assert {"DecodeGraphs", "MixedGraphs"} <= set(ran)  # rank 0 ran both kinds of fixed-shape step
