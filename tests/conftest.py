import os
import sys
from pathlib import Path

# Under pytest-xdist each worker gets one core: torch's default of one thread per core would make the
# workers fight over the same two cores (tiny matmuls were 7x slower that way). Set before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
