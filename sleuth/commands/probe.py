"""`sleuth probe init|check`: write a probe entry for a trainer, and check that an entry keeps the protocol.

    sleuth probe init --code PATH [--out FILE] [--config FILE] [--no-run] [--force] [--probe-python PYTHON]
    sleuth probe check --probe-entry MODULE:FUNCTION [--code PATH] [--config FILE] [--probe-python PYTHON]

`init` locates the trainer's pieces (sleuth/probes/locate.py), calls them in the probe child unless `--no-run`
(so each call in the entry uses arguments the code accepted), and writes `probe_entry.py` (beside the code,
or `--out`); every step it could not wire is a TODO that says what is missing. It never overwrites a file
without `--force`. `check` runs the entry's conformance checks in the probe child and prints one line per
method. `--json` prints one JSON object on stdout instead (messages stay on stderr). Exit 0: all good;
1: problems (check); 2: a usage or input error (one line on stderr).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
DEBUG_ENV = "SLEUTH_DEBUG"

app = typer.Typer(name="probe", help="Write a probe entry for your trainer, or check one.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str) -> typer.Exit:
    from rich.console import Console
    from rich.text import Text

    from sleuth.escape import terminal
    from sleuth.redact import RedactingWriter

    console = Console(file=RedactingWriter(sys.stderr), highlight=False)
    console.print(Text("error: ", style="red") + Text(terminal(message)), soft_wrap=True)
    return typer.Exit(EXIT_ERROR)


def _config(path: Path | None) -> dict | None:
    if path is None:
        return None
    from sleuth.investigation.inputs import load_config_file

    try:
        loaded = load_config_file(path)
    except Exception as exc:  # the loader's own errors are one line already
        raise _fail(f"--config {path}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    if not isinstance(loaded, dict):
        raise _fail(f"--config {path} is not a mapping of config keys")
    return loaded


def _what_is_at(path: Path) -> str | None:
    """What is at `path`, links not followed, in words; None when nothing is (a dangling link is something)."""
    import stat as stat_module

    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _fail(f"{path}: {exc.strerror or exc}") from None
    if stat_module.S_ISLNK(mode):
        return "a link"
    if stat_module.S_ISREG(mode):
        return "a regular file"
    return {stat_module.S_IFDIR: "a directory", stat_module.S_IFIFO: "a FIFO", stat_module.S_IFSOCK: "a socket"}.get(
        stat_module.S_IFMT(mode), "a device")


def _echo(line: str, err: bool = False) -> None:
    """One line of output: what the code under diagnosis answered (its errors, its check results) escaped for
    the terminal (sleuth.escape), so it can neither add lines nor send escape sequences."""
    from sleuth.escape import terminal

    typer.echo(terminal(line), err=err)


def _json(data: dict) -> None:
    """The command's result as one JSON object on stdout: strings from the code under diagnosis are stripped
    of control and invisible characters (sleuth.escape) and of recognisable secrets, as on the terminal."""
    from sleuth.escape import dumps, terminal_data
    from sleuth.redact import redact_data

    typer.echo(dumps(redact_data(terminal_data(data)), indent=2))


def _weak_isolation(line: str) -> None:
    """The request is the consent, so what runs is not announced; where the machine allows only process-level
    isolation, the user hears what that leaves the code able to reach (one line on stderr)."""
    from sleuth.probes.sandbox import weak_isolation_warning

    warning = weak_isolation_warning()
    if warning and line.startswith("probes: running"):
        _echo(f"note: {warning}", err=True)


def _guard(fn):  # noqa: ANN001, ANN202 - a command body
    """One line for any unexpected failure (a bug in sleuth), the traceback with SLEUTH_DEBUG=1."""
    try:
        return fn()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        raise _fail("interrupted") from None
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise _fail(f"internal error ({type(exc).__name__}{': ' + first if first else ''}); rerun with "
                    f"{DEBUG_ENV}=1 for the traceback") from None


@app.command("init")
def init_command(
    code: Annotated[Path, typer.Option("--code", readable=False,
                                       metavar="PATH", help="The trainer's source (a file or a tree).")],
    out: Annotated[Path | None, typer.Option("--out", readable=False, metavar="FILE", help="Where to write the entry "
                                             "(default: probe_entry.py beside the code).")] = None,
    config: Annotated[Path | None, typer.Option("--config", readable=False,
                                                metavar="FILE", help="The run configuration the pieces "
                                                "are called with (JSON/YAML).")] = None,
    no_run: Annotated[bool, typer.Option("--no-run", help="Read the code only; do not call its pieces.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing entry file.")] = False,
    probe_python: Annotated[str | None, typer.Option("--probe-python", metavar="PYTHON",
                                                     help="Interpreter the pieces are called in.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Write a probe entry for a trainer, wired to the pieces sleuth locates; TODOs say what is missing."""

    def run() -> None:
        from sleuth.probes.locate import locate
        from sleuth.probes.runner import ProbeError, check_python, plan_for_located, run_plan
        from sleuth.probes.scaffold import write_entry

        from sleuth.artifacts import named_path_error

        for option, path in (("--code", code), ("--config", config)):
            error = path is not None and named_path_error(option, path, directory_ok=option == "--code")
            if error:  # a FIFO or a device refused before anything opens it; "permission denied" said as such
                raise _fail(error)
        target = out or ((code if code.is_dir() else code.parent) / "probe_entry.py")
        there = _what_is_at(target)
        if there is not None and there != "a regular file":
            # Checked before anything runs; the write itself refuses it too (a rename, never through it).
            raise _fail(f"{target} is {there}; sleuth does not write through or replace it: remove it or "
                        "pass --out FILE")
        if there is not None and not force:
            raise _fail(f"{target} exists; pass --force to overwrite it, or --out FILE")
        if not target.stem.isidentifier():
            raise _fail(f"--out {target}: the file name must be a Python module name (e.g. probe_entry.py)")
        values = _config(config)
        try:
            python = check_python(probe_python)
        except ProbeError as exc:
            raise _fail(str(exc)) from None
        located = locate(code, values)
        plan = located.to_json()
        measured = None
        if not no_run:  # called like every probe: on a copy of the code, isolated (the request is the consent)
            outcome = run_plan(plan_for_located(code, located, values), python=python, announce=_weak_isolation)
            if outcome.error:
                _echo(f"note: the pieces could not be called ({outcome.error}); writing from the static reading",
                           err=True)
            else:
                measured = outcome.info
        from sleuth.artifacts import WriteRefused

        try:
            status = write_entry(plan, measured, code, target)
        except WriteRefused as exc:
            raise _fail(str(exc)) from None
        root = (code if code.is_dir() else code.parent).resolve()
        if target.resolve().parent != root:
            _echo(f"note: {target} is outside {root}, the import root its imports need: move it there", err=True)
        todos = sum(1 for s in status.values() if s != "wired")
        check = f"sleuth probe check --probe-entry {target.stem}:subject --code {code}"
        if json_output:
            _json({"entry": str(target), "methods": dict(status), "todos": todos, "check": check,
                   "pieces_called": measured is not None})
            return
        _echo(f"wrote {target}")
        for method, state in status.items():
            _echo(f"  {method:<13} {state}")
        _echo(f"{todos} method(s) to finish (TODO(sleuth) in the file); then: {check}" if todos else
                   f"every method is wired; check it: {check}")

    _guard(run)


@app.command("check")
def check_command(
    probe_entry: Annotated[str, typer.Option("--probe-entry", metavar="MODULE:FUNCTION", help="The entry to check.")],
    code: Annotated[Path | None, typer.Option("--code", readable=False,
                                              metavar="PATH", help="Import root for the entry "
                                              "(its directory, or the file's).")] = None,
    config: Annotated[Path | None, typer.Option("--config", readable=False,
                                                metavar="FILE", help="The run configuration handed to "
                                                "the entry (JSON/YAML).")] = None,
    probe_python: Annotated[str | None, typer.Option("--probe-python", metavar="PYTHON",
                                                     help="Interpreter the entry runs in.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Run a probe entry's conformance checks; one line per protocol method."""

    def run() -> None:
        from sleuth.probes.runner import ProbeError, check_options, plan_for_entry, run_plan

        try:
            check_options(probe_python, probe_entry)
        except ProbeError as exc:
            raise _fail(str(exc)) from None
        from sleuth.artifacts import named_path_error

        for option, path in (("--code", code), ("--config", config)):
            error = path is not None and named_path_error(option, path, directory_ok=option == "--code")
            if error:
                raise _fail(error)
        plan = plan_for_entry(probe_entry, code, None, _config(config))
        plan.spec["mode"] = "check"
        outcome = run_plan(plan, python=probe_python, announce=_weak_isolation)
        checks = outcome.checks
        if outcome.error or not checks:
            raise _fail(f"{probe_entry}: nothing could be checked: {outcome.error or 'the probe process gave no answer'}")
        problems = sum(1 for r in checks.values() if r != "ok" and not r.startswith(("not provided", "not checked")))
        missing = sum(1 for r in checks.values() if r.startswith("not provided"))
        if json_output:
            _json({"entry": probe_entry, "checks": dict(checks), "problems": problems, "not_provided": missing})
        else:
            for method, result in checks.items():
                _echo(f"{method:<19} {result}")
            _echo(f"{problems} problem(s)" + (f"; {missing} method(s) not provided (the probes needing them will "
                                                   "be unknown)" if missing else ""))
        if problems:
            raise typer.Exit(EXIT_PROBLEMS)

    _guard(run)
