"""The size of an embed job's vectors, known without running the model, so that every Parquet part
of the job holds one column type (`fixed_size_list<float32>[dim]`): a part written before the model
loaded, or by the expiry sweep in a process that never loaded it, has its rows' vectors null but
the same type as the parts of vectors, and readers that concatenate the parts get one table.

The size is derived from the checkpoint rather than recorded by the first run: a record would be
missing whenever the sweep (or a run expired before its model loaded) writes first, while a run
elsewhere is still loading, and that run's parts would then differ. The checkpoint gives every
writer the same number at any time.
"""

from __future__ import annotations

import json
from pathlib import Path

from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.models.model_files import local_model_dir


def checkpoint_dimension(model_dir: Path) -> int | None:
    """The size of the vectors `bulkinfer.engine.embedder.Embedder` makes from this checkpoint: its hidden
    size (it pools the final hidden states, and refuses the sentence-transformers modules, such as
    Dense, that would change it); None when config.json does not say."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("hidden_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) and size > 0 else None


def job_vector_size(spec: JobSpec, location: str, cache_dir: Path | None = None, *,
                    endpoint_url: str | None = None) -> int | None:
    """An embed job's vector size: its `dimensions`, else the checkpoint's at `location` (a model
    registry's location: resolved as a worker resolves it, from its model cache once fetched)."""
    if not spec.is_embed:
        return None
    if spec.dimensions is not None:
        return spec.dimensions
    return checkpoint_dimension(local_model_dir(location, cache_dir, endpoint_url=endpoint_url))
