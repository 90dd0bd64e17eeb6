"""The output lines of an ended job's parts, for the /v1 routes that re-shape them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.results import finished_manifest, part_store
from bulkinfer.jobs.formats.lines import iter_lines_in_range
from bulkinfer.jobs.state.status import JobStatus


def output_records(context: ApiContext, status: JobStatus) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(line without its newline, parsed) for every row of the parts published so far, in input order
    (a job that did not complete: the shards it finished)."""
    manifest = finished_manifest(context, status, partial=True)
    for part in manifest.parts:
        store, key = part_store(context, part.output.uri)
        # A part is the job's own output: a line is never refused for its length here.
        size = part.output.bytes
        for line in iter_lines_in_range(store, key, 0, size, max_line_bytes=size + 1):
            if line.data.strip():
                yield line.data, json.loads(line.data)
