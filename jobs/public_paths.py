"""What a message a user reads calls the places the service stores things in.

An uploaded input lives at `<prefix>/jobs/<job_id>/input/<name>` and a /v1 file at
`<prefix>/files/<owner>/<file_id>/content`: keys the user never gave, under the job store's bucket,
prefix or directory. A message (an HTTP error, a job's `error`) names the upload by its file's name
and the /v1 file by its id, and a path into a job's folder from `jobs/<job_id>/` on, without the
store's location before it. Any other path or URI (the user's own input_uri) is left as it is.
"""

from __future__ import annotations

import re

_BEFORE = r"(?:[^\s'\"(),]*/)?"  # a URI's scheme and bucket, a directory, a key prefix: the store's location
_JOB_ID = r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}"  # layout.JOB_ID_PATTERN
_STORE_PATHS = re.compile(
    _BEFORE + rf"jobs/{_JOB_ID}/input/(?P<upload>[A-Za-z0-9._-]+)"
    + "|" + _BEFORE + r"files/[^\s'\"(),/]+/(?P<file>file-[A-Za-z0-9_-]+)/content"
    + r"|[^\s'\"(),]+/(?P<job_path>jobs/" + _JOB_ID + r"/[^\s'\"(),]*)")


def public_text(text: str) -> str:
    """`text` with every path into the service's own areas written as a user knows it."""
    return _STORE_PATHS.sub(_public_path, text)


def _public_path(match: re.Match[str]) -> str:
    return match["upload"] or match["file"] or match["job_path"]
