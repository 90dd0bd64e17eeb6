"""The memory layout of every KV cache this engine allocates, on every device: per layer and for K
and V, ``[num_blocks, kv_heads, block_size, head_dim]`` ("hnd": one kv head's tokens of a block are
one contiguous run). The CPU kernels, the PyTorch paths and the Triton kernels all read it; stored
prefix blocks are named by it (engine/kv_connector/keys.py), so a worker of another layout, should
one ever exist, never reads these bytes as its own."""

KV_LAYOUT = "hnd"
