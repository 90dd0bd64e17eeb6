"""The wheel's packages: `bulkinfer` and, under it, each top-level folder of the repository.

The repository keeps `api/`, `engine/`, `jobs/`, `worker/` and `benchmarks/` at its root; installed,
they are `bulkinfer.api` etc., so the wheel's only top-level package is `bulkinfer` (it never shadows
a user's own `api` or `jobs`). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("api", "engine", "jobs", "worker", "benchmarks")

packages = ["bulkinfer"]
package_dir = {"bulkinfer": "bulkinfer"}
for folder in FOLDERS:
    package_dir[f"bulkinfer.{folder}"] = folder
    packages += [f"bulkinfer.{folder}"] + [f"bulkinfer.{folder}.{name}" for name in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
