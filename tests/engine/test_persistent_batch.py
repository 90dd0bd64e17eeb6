"""The persistent block tables (engine/persistent_batch.py): a request's row follows its block list
whatever happens to it between steps, and rows of requests gone are reused."""

from __future__ import annotations

import numpy as np
import pytest

from bulkinfer.engine.persistent_batch import BlockTables


def row(tables: BlockTables, request_id: str, blocks: list[int], width: int = 6) -> list[int]:
    [slot] = tables.rows([request_id], [blocks])
    return tables.table[slot, :width].tolist()


def test_rows_follow_growth_replacement_and_shrinking():
    tables = BlockTables(num_rows=4, max_blocks=6)
    blocks = [3, 4]
    assert row(tables, "a", blocks) == [3, 4, 0, 0, 0, 0]
    blocks.append(9)  # grown in place: only the new block is written
    assert row(tables, "a", blocks) == [3, 4, 9, 0, 0, 0]
    replaced = [0, 0, 9, 11]  # a new list (blocks dropped behind a window): written whole
    assert row(tables, "a", replaced) == [0, 0, 9, 11, 0, 0]
    assert row(tables, "a", [5]) == [5, 0, 0, 0, 0, 0]  # preempted and readmitted: the tail is cleared


def test_rows_of_requests_no_longer_scheduled_are_reused_and_never_leak():
    tables = BlockTables(num_rows=2, max_blocks=4)
    first = tables.rows(["a", "b"], [[1, 2], [3]])
    second = tables.rows(["c", "d"], [[7], [8, 9]])  # a and b are gone: their rows are taken over
    assert sorted(first.tolist()) == sorted(second.tolist())
    assert np.array_equal(tables.table[second], [[7, 0, 0, 0], [8, 9, 0, 0]])
    with pytest.raises(ValueError, match="more requests in a step than the 2 block-table rows"):
        tables.rows(["x", "y", "z"], [[1], [2], [3]])


def test_a_table_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="holds 3 blocks, past the table's 2"):
        BlockTables(num_rows=1, max_blocks=2).rows(["a"], [[1, 2, 3]])
