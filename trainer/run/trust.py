"""The trust record: code/ trees this user's trainer wrote into its runs, so `sleuth diagnose --run` may probe
them unasked.

sleuth runs a run's `code/` copy by default only when that exact tree is recorded here for that run directory
(docs/security.md); a copied or forged run directory is not, whatever it contains, and neither is
the same code in another run directory. The format is the contract with sleuth (neither imports the other):
in $SLEUTH_TRUST_DIR, else platformdirs `user_data_dir("sleuth")/trusted-code` (a 0700 directory), format 2:
one file `<sha256 of "<tree hash>\\0<resolved run dir>">.json` per run, holding `format`, `tree_sha256`, `run`;
the tree hash is sha256 over `sleuth-tree-2\\0` and, per file sorted by path, the UTF-8 path's length (8
bytes big-endian), the path, the file's sha256 (32 bytes). (Format 1, one file per tree hashed as sorted
`sha256sum` lines, is what older trainers wrote; sleuth still reads it for the run it names.)
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from pathlib import Path

from trainer import safe_io

TRUST_DIR_ENV = "SLEUTH_TRUST_DIR"
TRUST_FORMAT = 2


def trust_dir() -> Path:
    configured = os.environ.get(TRUST_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("sleuth")) / "trusted-code"


def tree_sha256(files: dict[str, str]) -> str:
    digest = hashlib.sha256(b"sleuth-tree-2\0")
    for path, file_digest in sorted(files.items()):
        name = path.encode("utf-8", "surrogateescape")
        digest.update(len(name).to_bytes(8, "big") + name + bytes.fromhex(file_digest))
    return digest.hexdigest()


def record_trusted_code(files: dict[str, str], run_dir: Path, recorded_by: str) -> Path | None:
    """Record the tree `{path relative to code/: sha256}` just written into `run_dir/code`; the record's
    path, or None when it cannot be written (a read-only home): the run goes on, and sleuth then asks
    for --probe before running that code."""
    directory = trust_dir()
    tree = tree_sha256(files)
    run = os.path.realpath(run_dir)
    key = hashlib.sha256(f"{tree}\0{run}".encode("utf-8", "surrogateescape")).hexdigest()
    record = {"format": TRUST_FORMAT, "tree_sha256": tree, "run": run, "files": len(files),
              "recorded_by": recorded_by, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        safe_io.write_json(directory / f"{key}.json", record, indent=None, mode=0o600)
    except (OSError, safe_io.UnsafeFileError):
        return None
    return directory / f"{key}.json"
