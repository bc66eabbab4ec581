"""The observed child's first process: make the code copy its working directory, then run the user's command.

Runs inside the probe isolation (standard library only). The box's code/ copy is read-only to the child, and a
trainer writes where it runs (checkpoints, logs), so the copy is copied again into the child's scratch work
folder (a size-capped tmpfs under namespaces) and the command runs there, at the same place relative to the
code as the user ran it. The observer (observer.py, loaded by site/sitecustomize.py in every Python the command
starts) writes the answer; where the command ends without one, this process says how it ended.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

ANSWER_ENV = "SLEUTH_OBSERVE_ANSWER"
STEPS_ENV = "SLEUTH_OBSERVE_STEPS"


def _write(answer: str, data: dict) -> None:
    with open(answer, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as handle:
        spec = json.load(handle)
    answer, command = spec["answer"], list(spec["command"])
    workdir = os.path.join(os.getcwd(), spec["name"])
    shutil.copytree(spec["code"], workdir, symlinks=True)
    here = os.path.normpath(os.path.join(workdir, spec.get("cwd") or "."))
    os.chdir(here if os.path.isdir(here) else workdir)
    executable = shutil.which(command[0]) if os.sep not in command[0] else command[0]
    if executable is None or not os.path.exists(executable):
        _write(answer, {"ended": "not_found", "error": f"the command {command[0]!r} is not found in the probe "
                        f"environment (PATH: {os.environ.get('PATH', '')})"})
        return 0
    env = dict(os.environ, **{ANSWER_ENV: answer, STEPS_ENV: str(spec.get("steps", 1))})
    env["SLEUTH_OBSERVE_WORKDIR"] = workdir
    env["SLEUTH_OBSERVE_SCHEDULE"] = str(spec.get("schedule") or "")
    returncode = subprocess.call(command, env=env)
    if os.path.getsize(answer) == 0:
        _write(answer, {"ended": "no_observation", "returncode": returncode})
        return 0
    try:  # the observer's own account of a command that ended early: add how it ended
        with open(answer, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return 0
    if isinstance(data, dict) and data.get("ended") != "observed" and "returncode" not in data:
        _write(answer, {**data, "returncode": returncode})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
