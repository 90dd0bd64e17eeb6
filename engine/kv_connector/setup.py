"""Build the engine's KV connector from its config and loaded model."""

from __future__ import annotations

import torch

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.kv_connector.connector import KVConnector
from bulkinfer.engine.kv_connector.keys import namespace
from bulkinfer.engine.kv_connector.policy import DEFAULT_MIN_TOKENS
from bulkinfer.engine.models.llama_config import LlamaFamilyConfig


def build_connector(config: EngineConfig, model_key: str, model_config: LlamaFamilyConfig,
                    dtype: torch.dtype, kv_caches: list[torch.Tensor]) -> KVConnector:
    """`config.dtype` is resolved (not "auto"); `kv_caches` are allocated."""
    block_shape = (model_config.num_layers, 2, model_config.num_kv_heads, config.block_size,
                   model_config.head_dim)
    min_tokens = config.kv_store_min_tokens if config.kv_store_min_tokens is not None else DEFAULT_MIN_TOKENS
    connector = KVConnector(
        config.kv_store, namespace(model_key, config.dtype, 0, 1, config.block_size), config.block_size,
        block_shape, dtype, config.kv_store_min_hits, min_tokens, config.kv_store_budget_bytes,
        config.kv_store_load_timeout_s)
    connector.kv_caches = kv_caches
    return connector
