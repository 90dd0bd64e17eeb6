"""The prefix KV tier across workers: the engine's KV store over the object store, its settings, `bulkinfer
kv ls|rm` and its metrics."""
