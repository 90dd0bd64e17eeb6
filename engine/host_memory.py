"""How much memory this process can still take: the host's MemAvailable, or less where the process's
memory cgroup (a container's limit, a systemd slice) leaves less.

A container sees the host's /proc/meminfo, so sizing the KV cache from MemAvailable alone could plan
for memory its limit does not allow; with the cache mapped at start the kernel would then kill the
worker while it starts (or, mapped lazily, in the middle of a job). Also the /proc readings the
KV budget takes around its profiling pass (RSS, its peak, and resetting that peak).
"""

from __future__ import annotations

import re
from pathlib import Path

# cgroup v1 writes "no limit" as a huge page-aligned number (9223372036854771712 on x86-64).
UNLIMITED = 1 << 60


def available_memory_bytes(proc: Path = Path("/proc"),
                           cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """min(MemAvailable, the tightest cgroup's limit minus its usage); None without MemAvailable.
    Usage counts the cgroup's page cache too: the figure errs low, as a budget should."""
    available = read_proc_kib(proc / "meminfo", "MemAvailable")
    if available is None:
        return None
    headroom = cgroup_headroom_bytes(proc / "self" / "cgroup", cgroup_root)
    return min(available * 1024, headroom) if headroom is not None else available * 1024


def cgroup_headroom_bytes(cgroup_file: Path, cgroup_root: Path) -> int | None:
    """Limit minus usage of the tightest memory cgroup holding this process (its own and every
    ancestor's, v2 or v1); None where none sets a limit or none is readable."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    headrooms: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            headrooms += _headrooms(cgroup_root, path, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            headrooms += _headrooms(cgroup_root / "memory", path, "memory.limit_in_bytes",
                                    "memory.usage_in_bytes")
    return max(0, min(headrooms)) if headrooms else None


def _headrooms(root: Path, path: str, limit_name: str, usage_name: str) -> list[int]:
    """Limit minus usage at `path` and each directory above it up to `root` (inside a container
    the cgroup path may name directories its namespace cannot see: those are skipped)."""
    found = []
    directory = root / path.strip("/")
    while True:
        limit = _read_int(directory / limit_name)
        usage = _read_int(directory / usage_name)
        if limit is not None and usage is not None and limit < UNLIMITED:
            found.append(limit - usage)
        if directory == root or root not in directory.parents:
            return found
        directory = directory.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2's "max" means no limit


def read_proc_kib(path: Path, field: str) -> int | None:
    """A ``Field:   123 kB`` value from a /proc file, in KiB; None when absent (non-Linux)."""
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", path.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_rss() -> None:
    """Start the process's peak RSS (VmHWM) over from its current RSS, so that the peak read after
    the profiling pass is that pass's: an engine built and dropped earlier in the process (its KV
    cache mapped at start) left a peak gigabytes above, which read as activations and made the
    budget negative. Linux only; elsewhere the peak stays the process's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
