import os
import subprocess
import sys
from pathlib import Path

from bulkinfer.engine.prefix_hash import extend_block_hashes, hash_block_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_same_tokens_and_parent_give_the_same_hash():
    parent = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(parent, [5, 6, 7, 8]) == hash_block_tokens(parent, [5, 6, 7, 8])
    assert isinstance(parent, bytes) and len(parent) == 32


def test_hash_depends_on_parent_tokens_and_extra_keys():
    parent_a = hash_block_tokens(None, [1, 2, 3, 4])
    parent_b = hash_block_tokens(None, [1, 2, 3, 5])
    block = [9, 9, 9, 9]
    assert hash_block_tokens(parent_a, block) != hash_block_tokens(parent_b, block)
    assert hash_block_tokens(None, block) != hash_block_tokens(parent_a, block)
    assert hash_block_tokens(None, block) != hash_block_tokens(None, [9, 9, 9, 8])
    assert hash_block_tokens(None, block, ("salt:a",)) != hash_block_tokens(None, block, ("salt:b",))
    assert hash_block_tokens(None, block, ("salt:a",)) != hash_block_tokens(None, block)


def test_encoding_is_unambiguous_between_tokens_and_keys():
    # Same bytes concatenated differently must not collide.
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1], ())


# Loads prefix_hash.py by path: importing the `engine` package would pull in torch (seconds).
_HASH_SCRIPT = (
    "import importlib.util, sys; "
    "spec = importlib.util.spec_from_file_location('prefix_hash', sys.argv[1]); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); hashes = []; "
    "module.extend_block_hashes(hashes, list(range(40)), 16, ('model', 'salt:x')); "
    "print(','.join(h.hex() for h in hashes))"
)


def _hashes_in_subprocess(python_hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": python_hash_seed}
    result = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT, str(REPO_ROOT / "engine" / "prefix_hash.py")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def test_hashes_are_stable_across_processes():
    first, second = _hashes_in_subprocess("1"), _hashes_in_subprocess("12345")
    hashes: list = []
    extend_block_hashes(hashes, list(range(40)), 16, ("model", "salt:x"))
    assert first == second == ",".join(h.hex() for h in hashes)
    assert len(first.split(",")) == 2


def test_extend_hashes_only_new_full_blocks_and_chains_them():
    tokens = list(range(10))
    hashes: list = []
    extend_block_hashes(hashes, tokens, 4, ("m",))
    assert len(hashes) == 2  # the partial third block is not hashed
    first_two = list(hashes)
    tokens += [10, 11]
    extend_block_hashes(hashes, tokens, 4, ("m",))
    assert hashes[:2] == first_two and len(hashes) == 3
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3], ("m",))
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])
