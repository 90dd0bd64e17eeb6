"""`LocalObjectStore`: a directory as an object store (the embedded default, no services)."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from bulkinfer.jobs.object_store.base import (
    AlreadyExists,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectWriter,
    UnfinishedWrite,
)

# Half-written files carry this prefix; `list` never shows them.
TEMP_PREFIX = ".bulkinfer-tmp-"


class LocalObjectStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()

    def path(self, key: str) -> Path:
        path = (self.root / key.lstrip("/")).resolve()
        if path != self.root and self.root not in path.parents:
            raise ValueError(f"key escapes the store root: {key!r}")
        return path

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> ObjectInfo:
        with self.open_write(key, if_none_match=if_none_match) as writer:
            writer.write(data)
        return self.head(key)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None

    def open_read(self, key: str, start: int = 0) -> BinaryIO:
        try:
            file = open(self.path(key), "rb")  # the caller closes the stream
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        file.seek(start)
        return file

    def open_seekable(self, key: str) -> BinaryIO:
        return self.open_read(key)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        with self.open_read(key, start) as file:
            return file.read(end - start)

    def open_write(self, key: str, if_none_match: bool = False) -> ObjectWriter:
        return _LocalWriter(self.path(key), key, if_none_match)

    def unfinished_writes(self, prefix: str) -> list[UnfinishedWrite]:
        base = self.path(prefix)
        folder = base if base.is_dir() else base.parent
        if not folder.is_dir():
            return []
        writes = []
        for temp in folder.rglob(f"{TEMP_PREFIX}*"):
            key = temp.relative_to(self.root).as_posix()
            try:
                writes.append(UnfinishedWrite(key, temp.stat().st_mtime, key))
            except FileNotFoundError:  # finished meanwhile
                continue
        return writes

    def abort_write(self, write: UnfinishedWrite) -> None:
        self.path(write.handle).unlink(missing_ok=True)

    def head(self, key: str) -> ObjectInfo:
        try:
            info = self.path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        if not stat.S_ISREG(info.st_mode):  # a folder is not an object
            raise ObjectNotFound(key)
        return ObjectInfo(key=key, size=info.st_size, etag=f"{info.st_size:x}-{info.st_mtime_ns:x}",
                          modified=info.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the deepest directory the prefix names, then filter by the full prefix.
        directory = self.path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        keys = []
        for dirpath, _dirnames, filenames in os.walk(directory):
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        for key in sorted(keys):
            try:
                yield self.head(key)
            except ObjectNotFound:  # deleted while we listed
                continue

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass

    def presign_get(self, key: str, expires: int = 3600) -> str:
        return self.uri(key)

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()


def _fsync_directory(path: Path) -> None:
    """Make the entries of a directory (a rename, a link, a new sub-folder) durable."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and the ancestors of it that do not exist yet, deepest first."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


class _LocalWriter(ObjectWriter):
    """Writes a temp file beside the target, then renames it (or links it, for write-once).

    A committed object survives a power loss or a kernel crash, as an S3 PUT that answered does: the
    file's bytes are fsynced before it gets its name, then the folder holding the name (and every
    folder this write created, up to one that existed) is fsynced. Otherwise a crash could leave a
    write-once result empty or missing after the job was told it committed.
    """

    def __init__(self, target: Path, key: str, if_none_match: bool) -> None:
        self._target = target
        self._key = key
        self._if_none_match = if_none_match
        self._new_folders = _missing_folders(target.parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=target.parent)
        self._temp = Path(temp_name)
        self._file = os.fdopen(descriptor, "wb")
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        written = self._file.write(data)
        self.size += written
        return written

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self._if_none_match:
                # link() fails if the target exists: an atomic create-if-absent, like O_EXCL,
                # that still never exposes a half-written file.
                try:
                    os.link(self._temp, self._target)
                except FileExistsError:
                    raise AlreadyExists(self._key) from None
            else:
                os.replace(self._temp, self._target)
            self._temp.unlink(missing_ok=True)
            self._fsync_names()
        finally:
            self._temp.unlink(missing_ok=True)
            super().close()

    def _fsync_names(self) -> None:
        _fsync_directory(self._target.parent)
        for folder in self._new_folders:  # each new folder's own name lives in its parent
            _fsync_directory(folder.parent)

    def abort(self) -> None:
        if self.closed:
            return
        self._file.close()
        self._temp.unlink(missing_ok=True)
        super().close()
