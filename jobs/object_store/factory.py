"""`store_for_uri`: from a user's `s3://bucket/key`, `file:///path` or `/path` to (store, key)."""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from bulkinfer.jobs.object_store.base import ObjectStore


def split_uri(uri: str) -> tuple[str, str, str]:
    """(`s3` or `file`, bucket or '' , key) for a URI the job spec accepts; raises ValueError."""
    scheme, bucket, key = _split(uri)
    _check_characters(uri, bucket + key)
    return scheme, bucket, key


def _check_characters(uri: str, name: str) -> None:
    """No file or key name holds a NUL, and none is stored from a lone surrogate (not UTF-8)."""
    shown = uri.encode("utf-8", "backslashreplace").decode("utf-8")[:200]
    if "\0" in name:
        raise ValueError(f"{shown!r} contains a NUL character, which no file or object name may hold")
    if any("\ud800" <= char <= "\udfff" for char in name):
        raise ValueError(f"{shown!r} contains a lone surrogate (half of a UTF-16 pair), which no file or "
                         "object name may hold")


def _split(uri: str) -> tuple[str, str, str]:
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"s3 URI has no bucket: {uri!r} (expected s3://bucket/key)")
        return "s3", bucket, key
    if uri.startswith("file://"):
        parsed = urlparse(uri)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI must be local (file:///abs/path): {uri!r}")
        path = unquote(parsed.path)
    elif "://" in uri:
        raise ValueError(f"unsupported URI scheme in {uri!r}: use s3://bucket/key, file:///path or /path")
    else:
        path = uri
    if not path.startswith("/"):
        raise ValueError(f"local paths must be absolute: {uri!r}")
    return "file", "", path.lstrip("/")


def store_for_uri(uri: str, *, endpoint_url: str | None = None) -> tuple[ObjectStore, str]:
    """The store that holds `uri` and the key inside it.

    Local paths map to a `LocalObjectStore` rooted at `/`, so a key is the absolute path without
    its leading slash and `store.uri(key)` gives the same file back.
    """
    scheme, bucket, key = split_uri(uri)
    if scheme == "s3":
        from bulkinfer.jobs.object_store.s3 import S3ObjectStore

        return S3ObjectStore(bucket, endpoint_url=endpoint_url), key
    from bulkinfer.jobs.object_store.local import LocalObjectStore

    return LocalObjectStore("/"), key
