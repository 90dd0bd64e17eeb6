"""A real disk that fills up: a tmpfs of a few MiB mounted for the test (needs root, as the CI
runs), filled with a ballast file until writes fail with ENOSPC, then emptied again."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.ballast = path / ".ballast"

    def fill(self) -> None:
        """Write until the disk is full (every later write of a byte fails with ENOSPC)."""
        with open(self.ballast, "ab", buffering=0) as ballast:
            for chunk in (b"\0" * 65536, b"\0"):  # big chunks, then the last few bytes
                try:
                    while ballast.write(chunk):
                        pass
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise

    def free(self) -> None:
        """Space comes back."""
        self.ballast.unlink(missing_ok=True)


@contextmanager
def small_disk(path: Path, size: str = "4m") -> Iterator[SmallDisk]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        raise RuntimeError(f"cannot mount a tmpfs at {path} for a disk that fills up (root needed): "
                           f"{mounted.stderr.strip()}")
    try:
        yield SmallDisk(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
