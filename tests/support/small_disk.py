"""A real disk that fills up: a tmpfs of a few MiB mounted for the test (needs root, as the CI
runs), filled with a ballast file until writes fail with ENOSPC, then emptied again (the same
disk `bench faults` fills: benchmarks/infra_faults.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bulkinfer.benchmarks.infra_faults import fill_disk, mount_tmpfs, unmount


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.ballast = path / ".ballast"

    def fill(self) -> None:
        """Write until the disk is full (every later write of a byte fails with ENOSPC)."""
        fill_disk(self.ballast)

    def free(self) -> None:
        """Space comes back."""
        self.ballast.unlink(missing_ok=True)


@contextmanager
def small_disk(path: Path, size: str = "4m") -> Iterator[SmallDisk]:
    mount_tmpfs(path, size)
    try:
        yield SmallDisk(path)
    finally:
        unmount(path)
