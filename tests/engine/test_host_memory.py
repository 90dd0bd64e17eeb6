"""The memory a worker may plan its KV cache in: the host's, or its cgroup's where that is tighter
(unit tests over fake /proc and /sys/fs/cgroup trees)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bulkinfer.engine.host_memory import available_memory_bytes

GIB = 1 << 30


def fake_host(tmp_path: Path, cgroup_lines: str, available_kib: int = 16 * 1024 * 1024) -> tuple[Path, Path]:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       33554432 kB\nMemAvailable:   {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    return proc, tmp_path / "cgroup"


def write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text + "\n")


def test_without_a_memory_limit_the_host_figure_stands(tmp_path: Path) -> None:
    proc, root = fake_host(tmp_path, "0::/user.slice/session-1.scope\n")
    write(root / "user.slice" / "session-1.scope", memory_max="max", memory_current=str(GIB))
    assert available_memory_bytes(proc, root) == 16 * GIB


def test_a_container_limit_under_the_host_figure_wins(tmp_path: Path) -> None:
    proc, root = fake_host(tmp_path, "0::/\n")  # a container's own namespace
    write(root, memory_max=str(6 * GIB), memory_current=str(2 * GIB))
    assert available_memory_bytes(proc, root) == 4 * GIB


def test_the_tightest_ancestor_counts(tmp_path: Path) -> None:
    proc, root = fake_host(tmp_path, "0::/kubepods/pod1/worker\n")
    write(root / "kubepods", memory_max=str(64 * GIB), memory_current=str(10 * GIB))
    write(root / "kubepods" / "pod1", memory_max=str(8 * GIB), memory_current=str(5 * GIB))
    write(root / "kubepods" / "pod1" / "worker", memory_max="max", memory_current=str(5 * GIB))
    assert available_memory_bytes(proc, root) == 3 * GIB


def test_cgroup_v1_memory_controller_is_read_too(tmp_path: Path) -> None:
    proc, root = fake_host(tmp_path, "5:cpu,cpuacct:/\n4:memory:/process_api/abc\n0::/\n")
    write(root / "memory" / "process_api" / "abc", memory_limit_in_bytes=str(3 * GIB),
          memory_usage_in_bytes=str(GIB))
    write(root / "memory", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes=str(GIB))
    assert available_memory_bytes(proc, root) == 2 * GIB


def test_a_cgroup_over_its_limit_leaves_nothing(tmp_path: Path) -> None:
    proc, root = fake_host(tmp_path, "0::/\n")
    write(root, memory_max=str(GIB), memory_current=str(2 * GIB))
    assert available_memory_bytes(proc, root) == 0


@pytest.mark.parametrize("cgroup_lines", ["", "0::/gone\n"])
def test_an_unreadable_cgroup_falls_back_to_the_host(tmp_path: Path, cgroup_lines: str) -> None:
    proc, root = fake_host(tmp_path, cgroup_lines)
    assert available_memory_bytes(proc, root) == 16 * GIB


def test_no_meminfo_means_no_figure(tmp_path: Path) -> None:
    assert available_memory_bytes(tmp_path / "nowhere", tmp_path) is None
