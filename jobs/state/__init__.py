"""A job's state and what it produced: the repository, live counters, status, shard results, parts,
manifest, progress, usage and merged retry results."""
