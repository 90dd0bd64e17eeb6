import atexit
import os
import shutil
import tempfile
from pathlib import Path

# dtype auto's kept verdicts (engine/dtype_verdict.py) go to this session's own file, never the model
# cache's, so a developer's kept verdict cannot change a test's result; child processes inherit it.
_VERDICTS_DIR = tempfile.mkdtemp(prefix="bulkinfer-test-dtype-verdicts-")
atexit.register(shutil.rmtree, _VERDICTS_DIR, ignore_errors=True)
os.environ["BULKINFER_DTYPE_VERDICTS"] = str(Path(_VERDICTS_DIR) / "cpu-dtype-verdicts.json")

# BULKINFER_TEST_DEVICE=cuda (benchmarks/gpu_check.sh) runs the engine's tests on a GPU machine, which
# has torch and transformers but not the service stack (Redis, moto, Celery): only the engine's
# fixtures are loaded there.
pytest_plugins = ["tests.fixtures.checkpoints"]
if os.environ.get("BULKINFER_TEST_DEVICE", "cpu") == "cpu":
    pytest_plugins.insert(0, "tests.fixtures.services")
