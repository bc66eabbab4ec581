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
