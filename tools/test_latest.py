#!/usr/bin/env python3
"""Upstream drift, seen by us before our users: the suite on the newest release of every dependency.

Builds a fresh virtual environment with the newest release of each package pyproject.toml names (its
dependencies and the test extra, by name: neither the lock's pins nor pyproject's caps), prints which packages
moved against requirements/lock.txt, runs the suite (or the pytest arguments given) and ends with one line per
failing test and an exit code: 0 when the newest releases pass (then `make lock` takes them; README,
Development), 1 when something broke. torch stays at the lock's version (its CPU build is what this machine has)
unless --torch latest.

    python3 tools/test_latest.py --venv .venv-latest                       # make test-latest
    python3 tools/test_latest.py --venv .venv-latest -- -k recurrent -x     # a subset
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pip's vendored copy of the same parser
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "lock.txt"
# Evaluated inside the new environment (packaging is there, pulled in by transformers): the lock's pin for each
# package under this interpreter's markers, and what got installed.
COMPARE = r"""
import json, re, sys
from importlib.metadata import distributions
from packaging.markers import Marker
installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}
locked = {}
for line in open(sys.argv[1]):
    m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)\s*(?:;\s*(.*))?$", line.strip())
    if m and (not m.group(3) or Marker(m.group(3)).evaluate()):
        locked[m.group(1).lower().replace("_", "-")] = m.group(2)
print(json.dumps({"installed": installed, "locked": locked}))
"""


def requirement_names() -> list[str]:
    """The packages pyproject.toml asks for (dependencies and the test extra), without their versions."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
    return [re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0] for requirement in requirements]


def run(command: list[str], **kwargs) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-latest", help="where to build the environment (rebuilt each time)")
    parser.add_argument("--torch", choices=("locked", "latest"), default="locked",
                        help="torch at the lock's version (default; the CPU build here) or the newest release")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (default: the whole suite on 2 workers)")
    args = parser.parse_args()
    venv = REPO / args.venv
    python = str(venv / "bin" / "python")
    shutil.rmtree(venv, ignore_errors=True)
    try:
        run([sys.executable, "-m", "venv", str(venv)])
        run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
        if args.torch == "locked":
            run(["tools/install_torch.sh", python])
        names = [name for name in requirement_names() if args.torch == "latest" or name != "torch"]
        run([python, "-m", "pip", "install", "-q", "--upgrade", *names])
        run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", "."])
    except subprocess.CalledProcessError as exc:
        print(f"test-latest: the newest releases did not install (exit {exc.returncode}; pip's message is above)",
              file=sys.stderr)
        return 1
    facts = json.loads(subprocess.run([python, "-c", COMPARE, str(LOCK)], check=True, capture_output=True,
                                      text=True).stdout)
    moved = sorted((name, facts["locked"][name], version) for name, version in facts["installed"].items()
                   if name in facts["locked"] and version.split("+")[0] != facts["locked"][name])
    installers = {"dflash-sleuth", "pip", "setuptools", "wheel"}  # ours, and what every venv brings
    added = sorted(name for name in facts["installed"] if name not in facts["locked"] and name not in installers)
    print("\nmoved against requirements/lock.txt:" if moved else "\nnothing moved against requirements/lock.txt")
    for name, locked, now in moved:
        print(f"  {name} {locked} -> {now}")
    if added:
        print(f"new packages (not in the lock): {', '.join(added)}")
    pytest_args = args.pytest_args or ["-q", "-n", "2", "--dist", "worksteal"]
    done = subprocess.run([python, "-m", "pytest", "-rfE", "-p", "no:cacheprovider", *pytest_args], cwd=REPO,
                          capture_output=True, text=True)
    sys.stdout.write(done.stdout[-20000:])
    sys.stderr.write(done.stderr[-5000:])
    broke = [line for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if done.returncode == 0:
        print("\ntest-latest: the suite passes on the newest releases; `make lock` takes them (README, Development)")
        return 0
    print(f"\ntest-latest: {len(broke)} test(s) broke on the newest releases "
          f"({', '.join(f'{n} {a} -> {b}' for n, a, b in moved) or 'nothing moved: the break is ours'}):")
    for line in broke:
        print(f"  {line}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
