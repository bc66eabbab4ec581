"""The trust record: code/ trees this user's trainer wrote, so `sleuth diagnose --run` may probe them unasked.

sleuth runs a run's `code/` copy by default only when that exact tree is recorded here (README "Security
model"); a copied or forged run directory is not, whatever it contains. The format is the contract with
sleuth (neither imports the other): in $SLEUTH_TRUST_DIR, else platformdirs `user_data_dir("sleuth")/
trusted-code` (a 0700 directory), one file `<tree sha256>.json` per tree, where the tree hash is the sha256
of the sorted lines `<file sha256>  <path relative to code/>\\n`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

TRUST_DIR_ENV = "SLEUTH_TRUST_DIR"
TRUST_FORMAT = 1


def trust_dir() -> Path:
    configured = os.environ.get(TRUST_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("sleuth")) / "trusted-code"


def tree_sha256(files: dict[str, str]) -> str:
    lines = "".join(f"{digest}  {path}\n" for path, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()


def record_trusted_code(files: dict[str, str], run_dir: Path, recorded_by: str) -> Path | None:
    """Record the tree `{path relative to code/: sha256}` just written into `run_dir/code`; the record's
    path, or None when it cannot be written (a read-only home): the run goes on, and sleuth then asks
    for --probe before running that code."""
    directory = trust_dir()
    tree = tree_sha256(files)
    record = {"format": TRUST_FORMAT, "tree_sha256": tree, "files": len(files), "recorded_by": recorded_by,
              "run": str(run_dir.resolve()), "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{tree}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(tmp, directory / f"{tree}.json")
    except OSError:
        return None
    return directory / f"{tree}.json"
