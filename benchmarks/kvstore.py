"""`bulkinfer bench kvstore`: a fresh worker's first shard with its shared instruction's KV loaded
from the store, against computing it.

One run, on the same rows (a shared instruction of ``--prefix-tokens`` tokens, default 4,000, then
each row's own ``--row-tokens``): first a fresh engine over an empty store computes the shard (and
saves the instruction's blocks, as the first worker of a deployment does), then another fresh
engine over the filled store runs it again, loading them. Engine start is not timed. Prints the
time to the first finished row and the whole shard's time of each and the ratios (target: the
first row >= 5x sooner), the stored bytes per token per dtype and the CPU. ``--break-even`` also
times, on one engine, a single row's prefill computed and loaded at growing prefix lengths: the
shortest length where loading wins is the break-even below which the connector loads nothing
(``kv_store_min_tokens``).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bulkinfer.benchmarks.engine import describe_cpu

if TYPE_CHECKING:
    from bulkinfer.engine import LLM

DEFAULT_MODEL = "smollm2-135m-instruct"
TARGET_FIRST_ROW_SPEEDUP = 5.0
BREAK_EVEN_LENGTHS = (16, 32, 64, 128, 256, 512, 1024)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
BLOCK_SIZE = 16  # the engine's default, which these runs use


def shard_rows(vocab_size: int, special_ids: set[int], prefix_tokens: int, rows: int, row_tokens: int,
               seed: int) -> list[list[int]]:
    """Token rows: one shared instruction, then each row's own tokens (seeded, no special tokens)."""
    rng = random.Random(seed)
    ordinary = [token for token in range(min(vocab_size, 32_000)) if token not in special_ids]
    instruction = [rng.choice(ordinary) for _ in range(prefix_tokens)]
    return [instruction + [rng.choice(ordinary) for _ in range(row_tokens)] for _ in range(rows)]


def time_shard(llm: LLM, rows: Sequence[Sequence[int]],
               max_tokens: int) -> tuple[float, float, list[list[int]]]:
    """(seconds to the first finished row, seconds to the last, greedy outputs in row order)."""
    from bulkinfer.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    for index, row in enumerate(rows):
        engine.add_request(str(index), list(row), params)
    first = None
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.token_ids
            if first is None:
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    return first or total, total, [outputs[str(index)] for index in range(len(rows))]


def bytes_per_token(model_dir: str) -> dict[str, int]:
    """KV bytes one token takes in the store, per dtype (the payload; each block adds a small header)."""
    from bulkinfer.engine.models.loader import model_config_from_dir

    config = model_config_from_dir(model_dir)
    values = config.num_layers * 2 * config.num_kv_heads * config.head_dim
    return {name: values * size for name, size in DTYPE_BYTES.items()}


def run(model_dir: str, dtype: str, prefix_tokens: int, rows: int, row_tokens: int, max_tokens: int,
        seed: int, store_dir: Path, min_tokens: int | None = None, rounds: int = 1,
        out: Callable[[str], None] = print) -> dict[str, float]:
    """`rounds` pairs (computed over a new empty store, then loaded from it), each on fresh engines;
    the best time of each kind is compared (on a shared machine a neighbour adds stalls, never
    removes them)."""
    from bulkinfer.engine import LLM  # noqa: F811 (the runtime import of the type-checking name)
    from bulkinfer.engine.kv_connector import LocalFolderBlobStore

    def fresh_engine(store: LocalFolderBlobStore) -> LLM:
        return LLM(model_dir, dtype=dtype, kv_store=store, kv_store_min_tokens=min_tokens, seed=seed)

    computed: list[tuple[float, float]] = []
    loaded: list[tuple[float, float]] = []
    same = True
    for round_index in range(rounds):
        folder = store_dir / f"round-{round_index}"
        store = LocalFolderBlobStore(folder)
        computing = fresh_engine(store)
        tokenizer = computing.tokenizer
        special = set(tokenizer.all_special_ids)
        shard = shard_rows(len(tokenizer), special, prefix_tokens, rows, row_tokens, seed)
        if round_index == 0:
            out(f"model: {model_dir}, dtype {computing.dtype_choice.dtype}; shard: {rows} rows of a "
                f"{prefix_tokens}-token shared instruction + {row_tokens} own tokens, {max_tokens} output "
                f"tokens each; {rounds} rounds, best of each")
        first, total, computed_outputs = time_shard(computing, shard, max_tokens)
        computed.append((first, total))
        assert computing.engine.kv_connector is not None  # fresh_engine gives it the store
        computing.engine.kv_connector.wait_saved()
        computing.engine.shutdown()
        del computing
        if round_index == 0:
            files = [path for path in folder.rglob("*") if path.is_file()]
            stored = sum(path.stat().st_size for path in files)
            out(f"stored: {len(files)} blocks, {stored / 2**20:.1f} MiB "
                f"({stored / max(1, len(files) * BLOCK_SIZE):.0f} bytes/token with headers)")
            out("bytes per token: " + ", ".join(f"{name} {size:,}"
                                                for name, size in bytes_per_token(model_dir).items()))
        loading = fresh_engine(store)
        first, total, loaded_outputs = time_shard(loading, shard, max_tokens)
        loaded.append((first, total))
        stats = loading.engine.kv_store_stats()
        loading.engine.shutdown()
        same = same and loaded_outputs == computed_outputs
        out(f"round {round_index + 1}: computed first row {computed[-1][0]:.2f} s, "
            f"shard {computed[-1][1]:.2f} s; "
            f"loaded first row {first:.2f} s, shard {total:.2f} s ({int(stats['hits_blocks'])} blocks, "
            f"{stats['loaded_bytes'] / 2**20:.1f} MiB read in {stats['load_seconds']:.2f} s)")
    computed_first, computed_total = min(c[0] for c in computed), min(c[1] for c in computed)
    loaded_first, loaded_total = min(c[0] for c in loaded), min(c[1] for c in loaded)
    out(f"computed (fresh engine, empty store): first row {computed_first:.2f} s, "
        f"shard {computed_total:.2f} s")
    out(f"loaded (fresh engine, filled store):  first row {loaded_first:.2f} s, shard {loaded_total:.2f} s")
    first_ratio = computed_first / loaded_first
    out(f"first row: {first_ratio:.1f}x faster loaded (target >= {TARGET_FIRST_ROW_SPEEDUP:.0f}x: "
        f"{'met' if first_ratio >= TARGET_FIRST_ROW_SPEEDUP else 'NOT met'}); "
        f"shard: {computed_total / loaded_total:.1f}x faster loaded")
    out(f"greedy outputs loaded vs computed: {'identical' if same else 'DIFFERENT'}")
    return {"first_ratio": first_ratio, "identical": float(same)}


def break_even(model_dir: str, dtype: str, lengths: Sequence[int], repeats: int, seed: int, store_dir: Path,
               out: Callable[[str], None] = print) -> int | None:
    """Time one row's prefill (max_tokens 1) computed and loaded at each prefix length, on one engine
    (the local prefix cache reset before each); returns the shortest length where loading wins."""
    from bulkinfer.engine import LLM, SamplingParams
    from bulkinfer.engine.kv_connector import LocalFolderBlobStore

    llm = LLM(model_dir, dtype=dtype, kv_store=LocalFolderBlobStore(store_dir), kv_store_min_hits=1,
              kv_store_min_tokens=0, seed=seed)
    engine = llm.engine
    connector = engine.kv_connector
    assert connector is not None  # built with kv_store
    params = SamplingParams(max_tokens=1, temperature=0)
    tokenizer = llm.tokenizer
    ids = iter(range(1_000_000))

    def one_row(prompt: list[int], load: bool) -> float:
        connector.min_tokens = 0 if load else 1 << 30
        engine.scheduler.reset_prefix_cache()
        started = time.perf_counter()
        engine.add_request(f"row-{next(ids)}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        elapsed = time.perf_counter() - started
        connector.wait_saved()
        return elapsed

    out(f"break-even ({dtype}, one row, prefill only, best of {repeats}): "
        "prefix tokens, computed ms, loaded ms")
    special = set(tokenizer.all_special_ids)
    one_row(shard_rows(len(tokenizer), special, 64, 1, 1, seed + 1)[0], load=False)  # warm-up
    found = None
    for length in lengths:
        prompt = shard_rows(len(tokenizer), special, length, 1, 1, seed + 2 + length)[0]
        one_row(prompt, load=False)  # computes and saves its blocks
        computed = min(one_row(prompt, load=False) for _ in range(repeats))
        loaded = min(one_row(prompt, load=True) for _ in range(repeats))
        wins = "  <- loading wins" if loaded < computed else ""
        out(f"  {length:6d} {computed * 1e3:9.1f} {loaded * 1e3:9.1f}{wins}")
        if found is None and loaded < computed:
            found = length
    out(f"break-even: {found if found is not None else 'not reached'} tokens "
        f"(kv_store_min_tokens default: see engine/kv_connector/policy.py)")
    return found


def bench_cli(argv: list[str] | None = None, resolve_model: Callable[[str], str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkinfer bench kvstore", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a model folder, or from the CLI a catalog name or .gguf "
                             f"(default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--row-tokens", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store-dir", default=None, help="the store's folder (default: a temporary one); "
                        "must be empty")
    parser.add_argument("--min-tokens", type=int, default=None,
                        help="kv_store_min_tokens of both engines (default: the engine's break-even)")
    parser.add_argument("--break-even", action="store_true", help="also measure the break-even prefix length")
    parser.add_argument("--break-even-lengths", default=",".join(map(str, BREAK_EVEN_LENGTHS)))
    parser.add_argument("--repeats", type=int, default=3, help="break-even timings per length (best)")
    parser.add_argument("--rounds", type=int, default=3, help="computed/loaded pairs (best of each)")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model) if resolve_model else args.model
    from bulkinfer.engine.dtype_choice import cpu_model_name

    describe_cpu()
    print(f"cpu: {cpu_model_name()}")
    with tempfile.TemporaryDirectory() as scratch:
        store_dir = Path(args.store_dir) if args.store_dir else Path(scratch, "store")
        if store_dir.exists() and any(store_dir.iterdir()):
            parser.error(f"--store-dir {store_dir} is not empty: the computed run needs an empty store")
        result = run(model_dir, args.dtype, args.prefix_tokens, args.rows, args.row_tokens, args.max_tokens,
                     args.seed, store_dir, args.min_tokens, args.rounds)
        if args.break_even:
            lengths = [int(value) for value in args.break_even_lengths.split(",") if value]
            break_even(model_dir, args.dtype, lengths, args.repeats, args.seed, Path(scratch, "break-even"))
    return 0 if result["identical"] else 1
