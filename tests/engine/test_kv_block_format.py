"""A stored KV block reads back bit for bit, and anything else (truncated, corrupted, another layout)
is refused with a reason, never loaded."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine.kv_connector.block_format import CorruptBlockError, decode_block, encode_block

SHAPE = (3, 2, 2, 16, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_round_trips_bit_for_bit(dtype) -> None:
    block = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(dtype)
    decoded = decode_block(encode_block(block), dtype, SHAPE)
    assert decoded.dtype == dtype and decoded.shape == SHAPE
    assert torch.equal(decoded.view(torch.uint8), block.contiguous().view(torch.uint8))


def test_block_from_a_strided_view_is_stored_whole() -> None:
    cache = torch.arange(2 * 5 * 2 * 16 * 8, dtype=torch.float32).view(2, 5, 2, 16, 8)
    view = cache[:, 3]  # one block of one layer, not contiguous
    decoded = decode_block(encode_block(view), torch.float32, (2, 2, 16, 8))
    assert torch.equal(decoded, view)


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:-1], "payload is"),
    (lambda data: data[:20], "truncated header|expected"),
    (lambda data: data[:-7] + bytes([data[-7] ^ 1]) + data[-6:], "checksum"),
    (lambda data: b"XXXX" + data[4:], "not a KV block"),
    (lambda data: b"", "truncated header"),
])
def test_damaged_block_is_refused_with_its_reason(damage, reason) -> None:
    data = encode_block(torch.ones(SHAPE))
    with pytest.raises(CorruptBlockError, match=reason):
        decode_block(damage(data), torch.float32, SHAPE)


def test_block_of_another_dtype_or_shape_is_refused() -> None:
    data = encode_block(torch.ones(SHAPE))
    with pytest.raises(CorruptBlockError, match="expected bfloat16"):
        decode_block(data, torch.bfloat16, SHAPE)
    with pytest.raises(CorruptBlockError, match="expected float32"):
        decode_block(data, torch.float32, (3, 2, 2, 32, 4))
