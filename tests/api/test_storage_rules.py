"""Output folder claims on a store: a retry's folder inside its parent's is the one exception, and a
claim no job stands behind is void."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bulkinfer.api.errors import HttpError
from bulkinfer.api.storage_rules import (
    OWNER_MARKER,
    UNCREATED_CLAIM_GRACE_S,
    StorageRules,
    check_location,
    claim_output_folder,
    release_output_folder,
)
from bulkinfer.jobs.object_store import LocalObjectStore
from bulkinfer.jobs.settings import Settings


def test_a_retrys_folder_may_lie_inside_the_folder_of_the_job_it_retries(tmp_path) -> None:
    store = LocalObjectStore(tmp_path)
    claim_output_folder(store, "out", "/out", "parent")
    claim_output_folder(store, "out/retry-child", "/out/retry-child", "child",
                        related=lambda owner: owner == "parent")
    claim_output_folder(store, "out/retry-child", "/out/retry-child", "child")  # its own: again is fine
    with pytest.raises(HttpError) as refused:
        claim_output_folder(store, "out/other", "/out/other", "stranger")
    assert refused.value.status_code == 409 and "output folder of job parent" in refused.value.message


def test_a_claim_left_by_a_submit_that_never_created_its_job_is_taken_over_once(tmp_path) -> None:
    """A submit that died between its claim and its create: while it could still be creating its job
    the claim holds; after the grace exactly one of many racing claims takes the folder."""
    store = LocalObjectStore(tmp_path)
    claim_output_folder(store, "out", "/out", "job-crashed")
    never_created = lambda _owner, _folder: None  # noqa: E731 - no job behind any claim
    with pytest.raises(HttpError) as young:
        claim_output_folder(store, "out", "/out", "job-next", backs=never_created)
    assert young.value.status_code == 409
    old = time.time() - UNCREATED_CLAIM_GRACE_S - 60
    os.utime(tmp_path / "out" / OWNER_MARKER, (old, old))
    barrier = threading.Barrier(8)

    def claim(job_id: str) -> str | None:
        barrier.wait()
        try:
            claim_output_folder(store, "out", "/out", job_id, backs=never_created)
        except HttpError as refused:
            return refused.message
        return None

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(claim, [f"job-{n}" for n in range(8)]))
    winners = [f"job-{n}" for n, answer in enumerate(answers) if answer is None]
    assert len(winners) == 1, answers
    assert (tmp_path / "out" / OWNER_MARKER).read_text() == winners[0]


def test_a_claim_by_a_job_whose_output_is_elsewhere_is_void_and_a_released_one_is_gone(tmp_path) -> None:
    store = LocalObjectStore(tmp_path)
    claim_output_folder(store, "out", "/out", "job-conflicted")  # its submit then met a 409
    claim_output_folder(store, "out", "/out", "job-next",
                        backs=lambda owner, folder: False if owner == "job-conflicted" else None)
    assert (tmp_path / "out" / OWNER_MARKER).read_text() == "job-next"
    release_output_folder(store, "out/", "job-other")  # not its claim: nothing changes
    assert (tmp_path / "out" / OWNER_MARKER).read_text() == "job-next"
    release_output_folder(store, "out/", "job-next")
    claim_output_folder(store, "out", "/out", "job-third")


class _ClaimRacingStore(LocalObjectStore):
    """A real local store where another submit's claim runs just after the marker is read once."""

    def __init__(self, root, race) -> None:  # noqa: ANN001
        super().__init__(root)
        self.race = race

    def get_bytes(self, key: str) -> bytes:
        data = super().get_bytes(key)
        if key.endswith(OWNER_MARKER) and self.race is not None:
            race, self.race = self.race, None
            race()
        return data


def test_a_release_racing_a_takeover_of_the_same_void_claim_leaves_one_owner(tmp_path) -> None:
    """A submit whose create met an idempotency conflict releases its claim while another claim, seeing
    it void (its job writes elsewhere), takes the folder over: the folder stays the taker's."""
    conflicted = lambda owner, _folder: False if owner == "job-conflicted" else None  # noqa: E731
    store = _ClaimRacingStore(tmp_path, race=None)
    claim_output_folder(store, "out", "/out", "job-conflicted")
    store.race = lambda: claim_output_folder(store, "out", "/out", "job-taker", backs=conflicted)
    release_output_folder(store, "out", "job-conflicted")  # read the marker, then the taker ran
    with pytest.raises(HttpError) as refused:
        claim_output_folder(store, "out", "/out", "job-third", backs=conflicted)
    assert refused.value.status_code == 409 and "job-taker" in refused.value.message


def test_a_takeover_that_died_before_rewriting_the_marker_still_owns_the_folder(tmp_path) -> None:
    store = LocalObjectStore(tmp_path)
    claim_output_folder(store, "out", "/out", "job-crashed")
    old = time.time() - UNCREATED_CLAIM_GRACE_S - 60
    os.utime(tmp_path / "out" / OWNER_MARKER, (old, old))
    (tmp_path / "out" / f"{OWNER_MARKER}.void-job-crashed").write_text("job-taker")  # its record, no more
    with pytest.raises(HttpError) as refused:
        claim_output_folder(store, "out", "/out", "job-next", backs=lambda _owner, _folder: None)
    assert refused.value.status_code == 409 and "job-taker" in refused.value.message
    claim_output_folder(store, "out", "/out", "job-taker")  # the taker's own submit, again: its folder


def test_a_kv_store_kept_outside_the_job_store_is_no_jobs_input_or_output(tmp_path) -> None:
    """Its kv/ folder holds every tenant's prefix KV blocks (worker/kv/store.py): no job reads or
    writes there, an admin's included, wherever kv_store_uri puts it."""
    rules = StorageRules.of(Settings(store_uri=str(tmp_path / "store"), kv_store_uri="s3://kv-cache/team"))
    block = "s3://kv-cache/team/kv/0f1e/fp32/tp0of1/b16/9a8b"
    refused_places = ((block, "object"), ("s3://kv-cache/team/", "folder"),
                      ("s3://kv-cache/team/k", "prefix"))
    for location, kind in refused_places:
        with pytest.raises(HttpError) as refused:
            check_location(rules, None, location, "input_uri", location, kind)
        assert refused.value.status_code == 403 and "kv/ folder" in refused.value.message
    check_location(rules, None, "s3://kv-cache/team/rows.jsonl", "input_uri", "s3://kv-cache/team/rows.jsonl",
                   "object")  # beside it: the deployment's business
