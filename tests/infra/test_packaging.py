"""Installed, bulkinfer is one import namespace: the wheel's only top-level package is `bulkinfer`, so a
user's own `api.py` or `jobs/` (a web project almost always has one) is neither shadowed nor shadows.

The wheel is built from a copy of the checkout (the build writes `build/` and `*.egg-info` beside its
sources) with this environment's setuptools, and installed without its dependencies into a folder of
its own: the environment already has them, and the test stays well under a minute."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.services import REPO_ROOT

FOLDERS = ("api", "engine", "jobs", "worker", "benchmarks")
SOURCES = ("pyproject.toml", "setup.py", "README.md", "bulkinfer", *FOLDERS)

# Run in the user's project folder with only the installed wheel on the path.
PROBE = """
import json, sys
import api, jobs.tasks
from bulkinfer import ApiError, AsyncClient, Client, JobSpec, JobState, WaitTimeout
import bulkinfer, bulkinfer.jobs.spec
print(json.dumps({"api": api.__file__, "jobs": jobs.tasks.__file__, "user": api.WHO + jobs.tasks.WHO,
                  "client": sys.modules[Client.__module__].__file__,
                  "bulkinfer_path": list(bulkinfer.__path__),
                  "spec": bulkinfer.jobs.spec.__file__, "state": JobState.SUCCEEDED.value,
                  "torch": "torch" in sys.modules}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--wheel-dir", str(dist), str(source)], check=True, capture_output=True)
    (built,) = dist.glob("bulkinfer-*.whl")
    return built


def test_the_wheels_only_top_level_package_is_bulkinfer_and_it_holds_every_folder(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"bulkinfer"}
    # Every package folder of the checkout, and the files they read at run time.
    packages = {f"bulkinfer/{init.parent.relative_to(REPO_ROOT).as_posix()}/__init__.py"
                for folder in FOLDERS for init in (REPO_ROOT / folder).rglob("__init__.py")}
    assert packages - set(names) == set()
    assert any(name.startswith("bulkinfer/api/ui/") and name.endswith(".html") for name in names)
    assert any(name.startswith("bulkinfer/engine/cpu_kernels/") and name.endswith(".c") for name in names)
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "bulkinfer = bulkinfer.api.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_next_to_a_users_own_api_and_jobs_both_import_correctly(wheel: Path,
                                                                          tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True)
    project = tmp_path / "project"
    (project / "jobs").mkdir(parents=True)
    (project / "api.py").write_text('WHO = "user-api "\n')
    (project / "jobs" / "__init__.py").write_text("")
    (project / "jobs" / "tasks.py").write_text('WHO = "user-jobs"\n')
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=project, env=env, capture_output=True,
                            text=True, check=True)
    found = json.loads(result.stdout)
    assert found["user"] == "user-api user-jobs"
    assert Path(found["api"]).parent == project and Path(found["jobs"]).parent == project / "jobs"
    assert Path(found["client"]).is_relative_to(site / "bulkinfer" / "api" / "client")
    assert Path(found["spec"]) == site / "bulkinfer" / "jobs" / "spec.py"
    # Installed, the namespace does not reach out of its folder into site-packages.
    assert found["bulkinfer_path"] == [str(site / "bulkinfer")]
    assert found["state"] == "succeeded" and found["torch"] is False


def test_in_a_checkout_bulkinfer_is_the_checkouts_own_folders() -> None:
    """Whatever else the environment has installed (an editable install of another checkout), the
    tests of this checkout import this checkout's code."""
    import bulkinfer.engine
    import bulkinfer.worker.process.tasks

    # Imported through the checkout's links (bulkinfer/engine -> ../engine): the same files.
    assert Path(bulkinfer.engine.__file__).resolve() == (REPO_ROOT / "engine" / "__init__.py").resolve()
    tasks = Path(bulkinfer.worker.process.tasks.__file__).resolve()
    assert tasks == (REPO_ROOT / "worker" / "process" / "tasks.py").resolve()
