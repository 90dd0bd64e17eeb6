"""A finalize cleans up only what its own job's runs left in its output folder."""

from __future__ import annotations

from types import SimpleNamespace

from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.jobs.object_store.local import TEMP_PREFIX
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.shards.job_lifecycle import _abort_unfinished_writes


def test_a_finalize_aborts_its_own_unfinished_writes_and_not_a_retrys_inside_its_folder(tmp_path) -> None:
    out = tmp_path / "out"
    spec = JobSpec.model_validate({"input_uri": "/in/rows.jsonl", "input_format": "jsonl", "model": "m",
                                   "prompt_column": "q", "output_uri": str(out)})
    own = [out / f"{TEMP_PREFIX}part-00000", out / "_temporary" / "g1-abc" / f"{TEMP_PREFIX}part-00001"]
    retrys = out / "retry-job-2" / f"{TEMP_PREFIX}part-00000"  # the retry's folder: it may be running
    for temp in (*own, retrys):
        temp.parent.mkdir(parents=True, exist_ok=True)
        temp.write_bytes(b"half a part")
    context = SimpleNamespace(repository=SimpleNamespace(store=LocalObjectStore(tmp_path / "store")))
    _abort_unfinished_writes(context, spec, JobLayout("job-1"))
    assert [temp.exists() for temp in own] == [False, False]
    assert retrys.exists()
