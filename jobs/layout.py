"""Where a job's objects live in the store (see ARCHITECTURE.md, "Object-store layout").

    <prefix>/jobs/<job_id>/job.json                 the spec, written once at submit
    <prefix>/jobs/<job_id>/status.json              the job's state, rewritten on every transition
    <prefix>/jobs/<job_id>/plan.json                the shard plan, written once by plan_job
    <prefix>/jobs/<job_id>/input/<name>             the input, when uploaded through the API
    <prefix>/jobs/<job_id>/output/part-00000.<ext>  one output part per shard (or under output_uri)
    <prefix>/jobs/<job_id>/errors/part-00000.jsonl  the shard's failed rows, with reasons
    .../output/_temporary/<fence>/part-00000.<ext>  a run's staged parts (and errors/_temporary/),
                                                    copied to the part keys once its result commits
    <prefix>/jobs/<job_id>/shards/part-00000.json   the shard's result, written after its parts
    <prefix>/jobs/<job_id>/manifest.json            written last
    <prefix>/files/<owner>/<file_id>/content        a /v1 file's bytes (api/v1/files.py)
    <prefix>/files/<owner>/<file_id>/meta.json      its record, written once after the content
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.spec import InputFormat, JobSpec

JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")
PART_EXTENSIONS = {
    InputFormat.PARQUET: "parquet", InputFormat.JSONL: "jsonl", InputFormat.OPENAI_BATCH: "jsonl",
    InputFormat.CSV: "csv", InputFormat.TSV: "tsv"}


# Folders directly under the store prefix that the service itself writes: never a job's input or
# output (a tenant's own folder, `tenants/<tenant>/`, is the tenant's data, not one of these).
# `files/` holds the /v1/files uploads and batch outputs, `batches/` the /v1 batch records: what a
# tenant reaches there goes through those routes and their owner checks, never through a job's URIs.
# `kv/` holds every tenant's prefix KV blocks (worker/kv/store.py): a job reading it would read
# another tenant's prompts' KV.
KV_STORE_AREA = "kv"  # the engine's block keys start with it (engine/kv_connector/keys.py)
STORE_AREAS = ("jobs", "schedules", "models", "files", "batches", KV_STORE_AREA)
TENANTS_FOLDER = "tenants"
# A /v1 file: `files/<owner>/<file_id>/` holds its content, then (written last) its record.
FILE_CONTENT_NAME = "content"
FILE_RECORD_NAME = "meta.json"
# Left when a batch's output or error file is deleted (or expires): the batch never publishes it again.
FILE_TOMBSTONE_NAME = "deleted"


def area_root(area: str, prefix: str = "") -> str:
    """The folder (with its trailing '/') of one of the STORE_AREAS: `<prefix>/<area>/`."""
    if area not in STORE_AREAS:
        raise ValueError(f"{area!r} is not one of the store's areas {STORE_AREAS}")
    prefix = prefix.strip("/")
    return f"{prefix}/{area}/" if prefix else f"{area}/"


def jobs_root(prefix: str = "") -> str:
    """The folder (with its trailing '/') every job's folder sits in: `<prefix>/jobs/`."""
    return area_root("jobs", prefix)


def part_name(shard_index: int, extension: str) -> str:
    return f"part-{shard_index:05d}.{extension}"


@dataclass(frozen=True)
class JobLayout:
    job_id: str
    prefix: str = ""

    def __post_init__(self) -> None:
        if not JOB_ID_PATTERN.match(self.job_id):
            raise ValueError(f"job id {self.job_id!r} must be 1-128 letters, digits, '-' or '_'")
        object.__setattr__(self, "prefix", self.prefix.strip("/"))

    @property
    def job_dir(self) -> str:
        return f"{jobs_root(self.prefix)}{self.job_id}"

    @property
    def spec_key(self) -> str:
        return f"{self.job_dir}/job.json"

    @property
    def status_key(self) -> str:
        return f"{self.job_dir}/status.json"

    @property
    def plan_key(self) -> str:
        return f"{self.job_dir}/plan.json"

    @property
    def manifest_key(self) -> str:
        return f"{self.job_dir}/manifest.json"

    @property
    def output_dir(self) -> str:
        return f"{self.job_dir}/output"

    @property
    def shard_results_dir(self) -> str:
        return f"{self.job_dir}/shards"

    def input_key(self, name: str) -> str:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"input name {name!r} must be a plain file name")
        return f"{self.job_dir}/input/{name}"

    @property
    def errors_dir(self) -> str:
        return f"{self.job_dir}/errors"

    def error_part_key(self, shard_index: int) -> str:
        return f"{self.errors_dir}/{part_name(shard_index, 'jsonl')}"

    def shard_result_key(self, shard_index: int) -> str:
        return f"{self.shard_results_dir}/{part_name(shard_index, 'json')}"


@dataclass(frozen=True)
class OutputLocation:
    """Where output parts go: the job's own folder, or the folder `output_uri` names."""

    store: ObjectStore
    directory: str
    extension: str

    def part_key(self, shard_index: int) -> str:
        name = part_name(shard_index, self.extension)
        return f"{self.directory}/{name}" if self.directory else name

    def holds_own(self, key: str) -> bool:
        """Whether `key` is this job's own in the folder: a part directly in it, or a run's staged
        part under `_temporary/`. Any other folder inside (a retry's `retry-<id>/`) is another job's."""
        folder = f"{self.directory}/" if self.directory else ""
        if not key.startswith(folder):
            return False
        name = key[len(folder):]
        return "/" not in name or name.startswith("_temporary/")  # part_publication.STAGING_DIR


def output_location(spec: JobSpec, job_store: ObjectStore, layout: JobLayout) -> OutputLocation:
    """Parts of a resolved spec's job. An `output_uri` is a folder that should be this job's alone:
    parts are written once, so a second job writing there fails instead of mixing rows.
    """
    if spec.effective_output_format is None:
        raise ValueError("output_location needs a resolved spec (see formats.detect.resolve_spec)")
    extension = PART_EXTENSIONS[spec.effective_output_format]
    if spec.output_uri is None:
        return OutputLocation(job_store, layout.output_dir, extension)
    store, key = store_for_uri(spec.output_uri)
    return OutputLocation(store, key.rstrip("/"), extension)
