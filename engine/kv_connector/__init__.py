"""Prefix KV in object storage (issue 47), modelled on vLLM V1's KV connector split.

The scheduler side asks how many of a request's prefix tokens can be loaded and holds the request
while a background thread fetches them; the runner side copies fetched blocks into the request's
KV blocks before the forward pass and hands newly computed shared blocks to a background saver
after it. Storage is anything with the small ``KVBlobStore`` interface (blob_store.py): the engine
never imports the service's object store.
"""

from bulkinfer.engine.kv_connector.blob_store import (
    CachedBlobStore,
    KVBlobInfo,
    KVBlobStore,
    LocalFolderBlobStore,
)
from bulkinfer.engine.kv_connector.keys import block_key, namespace

__all__ = ["CachedBlobStore", "KVBlobInfo", "KVBlobStore", "LocalFolderBlobStore", "block_key", "namespace"]
