import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Under pytest-xdist each worker gets one core: torch's default of one thread per core would make the
# workers fight over the same two cores (tiny matmuls were 7x slower that way). Set before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The trust record (trainer writes it for every run's code/, sleuth reads it: README "Security model") goes to
# a scratch directory for the whole session, inherited by every trainer and sleuth the tests start, never to
# the user's own data directory.
if "SLEUTH_TRUST_DIR" not in os.environ:
    _trust_dir = tempfile.mkdtemp(prefix="sleuth-trust-tests-")
    os.environ["SLEUTH_TRUST_DIR"] = _trust_dir
    atexit.register(shutil.rmtree, _trust_dir, True)


import pytest  # noqa: E402 (after the environment above, which must be set before torch loads)


@pytest.fixture(scope="session")
def embedded_small_target(tmp_path_factory) -> Path:
    """The embedded target's small twin (the real build: 120 training steps), built once per session (once per
    xdist worker) and shared read-only: about 15 s of CPU that each module using it used to repeat."""
    from trainer.target.embedded import build_embedded_target

    return build_embedded_target(tmp_path_factory.mktemp("embedded-small") / "small", small=True, progress=False)
