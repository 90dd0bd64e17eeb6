"""Output folder claims on a store: a retry's folder inside its parent's is the one exception."""

from __future__ import annotations

import pytest

from api.errors import HttpError
from api.storage_rules import claim_output_folder
from jobs.object_store import LocalObjectStore


def test_a_retrys_folder_may_lie_inside_the_folder_of_the_job_it_retries(tmp_path) -> None:
    store = LocalObjectStore(tmp_path)
    claim_output_folder(store, "out", "/out", "parent")
    claim_output_folder(store, "out/retry-child", "/out/retry-child", "child",
                        related=lambda owner: owner == "parent")
    claim_output_folder(store, "out/retry-child", "/out/retry-child", "child")  # its own: again is fine
    with pytest.raises(HttpError) as refused:
        claim_output_folder(store, "out/other", "/out/other", "stranger")
    assert refused.value.status_code == 409 and "output folder of job parent" in refused.value.message
