import os

# BULKINFER_TEST_DEVICE=cuda (benchmarks/gpu_check.sh) runs the engine's tests on a GPU machine, which
# has torch and transformers but not the service stack (Redis, moto, Celery): only the engine's
# fixtures are loaded there.
pytest_plugins = ["tests.fixtures.checkpoints"]
if os.environ.get("BULKINFER_TEST_DEVICE", "cpu") == "cpu":
    pytest_plugins.insert(0, "tests.fixtures.services")
