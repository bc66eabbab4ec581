#!/usr/bin/env python3
"""Writes requirements/lock.txt: every package `make setup` installs (pyproject's dependencies and the extras the
Makefile installs), each at one version per Python, resolved by uv for every platform and Python >= 3.10.

torch stays at the version the lock already names unless `--torch VERSION` says otherwise: its CPU build has to
exist where the set-up looks for it (tools/install_torch.sh), which a resolver cannot know.

    .venv/bin/python -m pip install uv && .venv/bin/python tools/lock.py        # or: make lock
    .venv/bin/python tools/lock.py --torch 2.14.0
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
# What `make setup` and `make docs` install from pyproject.toml (the Makefile's `-e '.[...]'`).
EXTRAS = ("test", "docs")


def locked_torch() -> str | None:
    if not LOCK.exists():
        return None
    match = re.search(r"^torch==([^\s;]+)", LOCK.read_text(), flags=re.MULTILINE)
    return match.group(1) if match else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", help="torch version to lock (default: the one the lock names now)")
    args = parser.parse_args()
    torch = args.torch or locked_torch()
    if not torch:
        print("error: no torch version in requirements/lock.txt; give one with --torch", file=sys.stderr)
        return 2
    pyproject = (REPO / "pyproject.toml").read_text()
    extras = [extra for extra in EXTRAS if f"\n{extra} = " in pyproject]
    with tempfile.TemporaryDirectory() as scratch:
        pin = Path(scratch) / "torch.txt"
        pin.write_text(f"torch=={torch}\n")
        command = [sys.executable, "-m", "uv", "pip", "compile", "pyproject.toml", "--universal",
                   "--python-version", "3.10", "--constraint", str(pin), "--no-header", "--quiet",
                   "--output-file", str(LOCK)]
        for extra in extras:
            command += ["--extra", extra]
        LOCK.parent.mkdir(exist_ok=True)
        done = subprocess.run(command, cwd=REPO)
        if done.returncode != 0:
            print("error: uv could not resolve pyproject.toml's dependencies (its message is above)", file=sys.stderr)
            return done.returncode
    body = LOCK.read_text()
    header = ("# The locked set `make setup` installs (a constraints file: pip install -c requirements/lock.txt).\n"
              f"# Written by tools/lock.py (uv pip compile --universal, extras: {', '.join(extras)}; torch {torch});\n"
              "# refresh it with `make lock` after `make test-latest` passed. Do not edit by hand.\n")
    LOCK.write_text(header + body)
    print(f"wrote {LOCK.relative_to(REPO)}: {sum(1 for line in body.splitlines() if '==' in line)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
