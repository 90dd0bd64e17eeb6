"""`S3ObjectStore`: any S3 API (AWS, MinIO, moto) through boto3, one bucket per store."""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Iterator
from typing import Any, BinaryIO

from bulkinfer.jobs.object_store.base import (
    AlreadyExists,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectWriter,
    UnfinishedWrite,
)

ENDPOINT_ENV = "BULKINFER_S3_ENDPOINT_URL"
MIN_PART_SIZE = 5 * 1024 * 1024  # S3's minimum size for every multipart part but the last
NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
# 412 is S3's answer to IfNoneMatch='*' on an existing key; 409 when a concurrent write races it.
ALREADY_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict"}


def _error_code(error: Exception) -> str:
    return str(getattr(error, "response", {}).get("Error", {}).get("Code", ""))


# botocore's "standard" retries: 5xx, SlowDown and other throttling, and dropped or reset
# connections, with exponential backoff and jitter (at most 20 s apart), then the error. Every call
# ends within about MAX_ATTEMPTS x (READ_TIMEOUT_S + 20 s); past that a task retries the whole step.
MAX_ATTEMPTS = 8
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60


def make_s3_client(endpoint_url: str | None = None, *, max_attempts: int = MAX_ATTEMPTS,
                   connect_timeout_s: float = CONNECT_TIMEOUT_S,
                   read_timeout_s: float = READ_TIMEOUT_S) -> Any:  # boto3 clients are untyped
    """A boto3 S3 client; the endpoint comes from the argument, else `BULKINFER_S3_ENDPOINT_URL`.
    The defaults suit the job store (a call may wait out a long outage); a cache that can do
    without the store (the KV tier) asks for fewer attempts and shorter timeouts."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": max_attempts},
                    connect_timeout=connect_timeout_s, read_timeout=read_timeout_s)
    return boto3.client("s3", endpoint_url=endpoint_url or os.environ.get(ENDPOINT_ENV) or None,
                        config=config)


class S3ObjectStore(ObjectStore):
    def __init__(self, bucket: str, *, endpoint_url: str | None = None, client: Any = None,
                 part_size: int = 8 * 1024 * 1024, list_page_size: int = 1000) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's multipart minimum)")
        self.bucket = bucket
        self.client = client or make_s3_client(endpoint_url)
        self.part_size = part_size
        self.list_page_size = list_page_size

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> ObjectInfo:
        from botocore.exceptions import ClientError

        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            response = self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        except ClientError as error:
            if _error_code(error) in ALREADY_EXISTS_CODES:
                raise AlreadyExists(key) from None
            raise
        return ObjectInfo(key=key, size=len(data), etag=response["ETag"].strip('"'))

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as stream:
            return stream.read()

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        from botocore.exceptions import ClientError

        extra = {"Range": f"bytes={start}-"} if start > 0 else {}
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key, **extra)
        except ClientError as error:
            if _error_code(error) in NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            if _error_code(error) == "InvalidRange":  # start at or past the end: an empty stream
                self.head(key)
                return io.BytesIO(b"")
            raise
        return response["Body"]

    def read_range(self, key: str, start: int, end: int) -> bytes:
        from botocore.exceptions import ClientError

        if end <= start:
            return b""
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        except ClientError as error:
            if _error_code(error) in NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            if _error_code(error) == "InvalidRange":
                return b""
            raise
        return response["Body"].read()

    def open_write(self, key: str, if_none_match: bool = False) -> ObjectWriter:
        return _S3MultipartWriter(self, key, if_none_match)

    def head(self, key: str) -> ObjectInfo:
        from botocore.exceptions import ClientError

        try:
            response = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as error:
            if _error_code(error) in NOT_FOUND_CODES:
                raise ObjectNotFound(key) from None
            raise
        return ObjectInfo(key=key, size=response["ContentLength"], etag=response["ETag"].strip('"'),
                          modified=response["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=prefix,
                                   PaginationConfig={"PageSize": self.list_page_size})
        for page in pages:
            for item in page.get("Contents", []):
                yield ObjectInfo(key=item["Key"], size=item["Size"], etag=item["ETag"].strip('"'),
                                 modified=item["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def copy(self, source_key: str, key: str) -> None:
        from botocore.exceptions import ClientError

        try:  # boto3's managed copy: server-side, multipart past its threshold
            self.client.copy({"Bucket": self.bucket, "Key": source_key}, self.bucket, key)
        except ClientError as error:
            if _error_code(error) in NOT_FOUND_CODES:
                raise ObjectNotFound(source_key) from None
            raise

    def presign_get(self, key: str, expires: int = 3600) -> str:
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires)

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


    def unfinished_writes(self, prefix: str) -> builtins.list[UnfinishedWrite]:
        paginator = self.client.get_paginator("list_multipart_uploads")
        return [UnfinishedWrite(upload["Key"], upload["Initiated"].timestamp(), upload["UploadId"])
                for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix)
                for upload in page.get("Uploads", [])]

    def abort_write(self, write: UnfinishedWrite) -> None:
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=write.key, UploadId=write.handle)


class _S3MultipartWriter(ObjectWriter):
    """Buffers one part at a time; small objects become a single PUT, large ones a multipart upload."""

    def __init__(self, store: S3ObjectStore, key: str, if_none_match: bool) -> None:
        self._store = store
        self._key = key
        self._if_none_match = if_none_match
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        if self.closed:
            raise ValueError("write to a closed object writer")
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= self._store.part_size:
            self._upload_part(bytes(self._buffer[: self._store.part_size]))
            del self._buffer[: self._store.part_size]
        return len(data)

    def _upload_part(self, data: bytes) -> None:
        client, bucket = self._store.client, self._store.bucket
        if self._upload_id is None:
            self._upload_id = client.create_multipart_upload(Bucket=bucket, Key=self._key)["UploadId"]
        number = len(self._parts) + 1
        response = client.upload_part(Bucket=bucket, Key=self._key, UploadId=self._upload_id,
                                      PartNumber=number, Body=data)
        self._parts.append({"PartNumber": number, "ETag": response["ETag"]})

    def close(self) -> None:
        if self.closed:
            return
        from botocore.exceptions import ClientError

        try:
            if self._upload_id is None:
                self._store.put_bytes(self._key, bytes(self._buffer), if_none_match=self._if_none_match)
            else:
                if self._buffer:
                    self._upload_part(bytes(self._buffer))
                extra = {"IfNoneMatch": "*"} if self._if_none_match else {}
                try:
                    self._store.client.complete_multipart_upload(
                        Bucket=self._store.bucket, Key=self._key, UploadId=self._upload_id,
                        MultipartUpload={"Parts": self._parts}, **extra)
                except ClientError as error:
                    self._abort_upload()
                    if _error_code(error) in ALREADY_EXISTS_CODES:
                        raise AlreadyExists(self._key) from None
                    raise
        except BaseException:
            self._abort_upload()
            raise
        finally:
            self._buffer.clear()
            super().close()

    def abort(self) -> None:
        if self.closed:
            return
        self._abort_upload()
        self._buffer.clear()
        super().close()

    def _abort_upload(self) -> None:
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._store.client.abort_multipart_upload(Bucket=self._store.bucket, Key=self._key,
                                                      UploadId=upload_id)
