"""`sleuth diagnose`: find what is wrong with a DFlash drafter run (or any DFlash implementation's code).

Exit 0: no mismatch; 1: mismatches, or not a clean bill (an input the run must have is unreadable, or the
run's own trusted code/ was not probed); 2: error (one line on stderr, never a traceback for a user's
mistake), including probes asked for (--probe, --probe-entry) with no experiment run. The report files
are written whenever the diagnosis got that far; --format picks what goes to stdout.
"""

from __future__ import annotations

import os
import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

EXIT_CLEAN, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
# Set to see the traceback of an unexpected failure (a bug in sleuth, not a user's mistake).
DEBUG_ENV = "SLEUTH_DEBUG"


class OutputFormat(str, Enum):
    text = "text"
    md = "md"
    json = "json"
    sarif = "sarif"


def diagnose_command(
    run: Annotated[
        str | None,
        typer.Option("--run", metavar="NAME|PATH", help="Run name (in --runs-dir) or path of a run directory."),
    ] = None,
    runs_dir: Annotated[
        Path | None,
        typer.Option("--runs-dir", readable=False,
                     metavar="DIR", help="Where runs live (default ./runs, or the run path's parent)."),
    ] = None,
    baseline: Annotated[
        str | None,
        typer.Option("--baseline", metavar="RUN", help="Compare with this run instead of the best earlier one."),
    ] = None,
    reference: Annotated[
        str | None,
        typer.Option("--reference", metavar="NAME", help="Reference implementation (default: the playbook's)."),
    ] = None,
    reference_path: Annotated[
        Path | None,
        typer.Option("--reference-path", readable=False,
                     metavar="CHECKOUT", help="A local git checkout of the reference."),
    ] = None,
    code: Annotated[
        Path | None,
        typer.Option("--code", readable=False,
                     metavar="PATH", help="Diagnose this DFlash implementation (file or source tree)."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", readable=False,
                     metavar="FILE", help="The run configuration (JSON/YAML) that goes with --code."),
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Resolve the reference from local checkouts and the cache only.")
    ] = False,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="What to print on stdout; the files are always written.")
    ] = OutputFormat.text,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print report.json on stdout (the same as --format json).")
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", readable=False,
                                  metavar="DIR", help="Report directory (default: <run>/diagnosis/).")
    ] = None,
    probe: Annotated[
        bool | None,
        typer.Option("--probe/--no-probe", help="Run experiments on the code, isolated (default: only a run's "
                     "code/ that your own trainer recorded; --code or anyone else's run only with --probe)."),
    ] = None,
    probe_python: Annotated[
        str | None,
        typer.Option("--probe-python", metavar="PYTHON", help="Interpreter the probes run in (default: this one)."),
    ] = None,
    probe_entry: Annotated[
        str | None,
        typer.Option("--probe-entry", metavar="MODULE:FUNCTION", help="Your trainer's probe protocol entry point."),
    ] = None,
    target: Annotated[
        Path | None,
        typer.Option("--target", readable=False,
                     metavar="DIR", help="The target (verifier) model directory, when the run does not name one."),
    ] = None,
    hidden_states: Annotated[
        Path | None,
        typer.Option("--hidden-states", readable=False,
                     metavar="DIR", help="An offline hidden-state cache to recompute and compare."),
    ] = None,
    observe_steps: Annotated[
        int,
        typer.Option("--observe-steps", min=1, max=100, help="Optimizer steps of your command to observe."),
    ] = 1,
    observe_recorded: Annotated[
        bool,
        typer.Option("--observe-recorded", help="With --run and --probe: observe the training command the run "
                     "recorded (run.json / config.json with code/, speculators' run.yaml or train_command.txt), "
                     "as `sleuth diagnose --run DIR --probe` prints it."),
    ] = False,
    command: Annotated[
        list[str] | None,
        typer.Argument(metavar="[-- COMMAND...]", show_default=False,
                       help="Your own training command, run with --probe in a copy of --code (default: the current "
                            "directory) and observed for --observe-steps optimizer steps, then stopped."),
    ] = None,
    served_by: Annotated[
        str | None,
        typer.Option("--served-by", metavar="ENGINE", help="The engine you serve the drafter with: vllm | speculators "
                     "| zlab | sglang | specforge | ik_llama.cpp | vllm-v1 (playbooks/serving/engines.yaml); a "
                     "sliding-window drafter it does not build as trained, or a DFlash2 / DSpark export it reads "
                     "otherwise (config layout, selector, sample_from_anchor), is a mismatch."),
    ] = None,
) -> None:
    """Compare a run with earlier runs and the reference; write report.md/json/sarif, fix.yaml, trace.jsonl.

    With a command after `--` (and --probe), sleuth runs your own trainer for a step and judges what it
    observed: `sleuth diagnose --code . --probe -- python train.py --config small.yaml`.

    Exit codes: 0 no mismatch; 1 mismatches, or not a clean bill (the run's config unreadable, or the
    run's own code/ not probed); 2 an error, or probes asked for (--probe, --probe-entry) with no
    experiment run. Code runs only isolated (no network, read-only view, limits): a run's code/ by default
    only when your own trainer recorded it, anything else only with --probe (docs/security.md).
    """
    from rich.console import Console

    from sleuth.diagnose import DiagnoseError, DiagnoseRequest, diagnose, live_listener
    from sleuth.redact import RedactingWriter

    from rich.text import Text

    from sleuth.escape import terminal

    errors = Console(file=RedactingWriter(sys.stderr), highlight=False)
    if json_output:
        if output_format not in (OutputFormat.text, OutputFormat.json):
            _error(errors, f"--json and --format {output_format.value} ask for two outputs; give one")
            raise typer.Exit(EXIT_ERROR)
        output_format = OutputFormat.json
    code_for_command = code
    recorded = None
    if run is not None and probe and not command:
        from sleuth.observe.recorded import recorded_command
        from sleuth.runs import read_run, resolve_run_dir

        try:
            recorded = recorded_command(read_run(resolve_run_dir(run, runs_dir)))
        except Exception:  # noqa: BLE001 - only an offer: the diagnosis itself says what is wrong with the run
            recorded = None
    if observe_recorded:
        problem = _recorded_problem(run, probe, command, recorded)
        if problem:
            _error(errors, problem)
            raise typer.Exit(EXIT_ERROR)
        assert recorded is not None and recorded.argv is not None
        command = recorded.argv
        if code is None and recorded.code is not None:
            code_for_command = recorded.code
        errors.print(Text(terminal(f"the run's recorded command ({recorded.source}): {recorded.shown()}")),
                     soft_wrap=True)
    request = DiagnoseRequest(
        run=run,
        runs_dir=runs_dir,
        baseline=baseline,
        reference=reference,
        reference_path=reference_path,
        code=code_for_command,
        config=config,
        offline=offline,
        out=out,
        probe=probe,
        probe_python=probe_python,
        probe_entry=probe_entry,
        target=target,
        hidden_states=hidden_states,
        command=list(command) if command else None,
        observe_steps=observe_steps,
        served_by=served_by,
    )
    listener = live_listener(errors) if sys.stderr.isatty() else None

    def announce(line: str) -> None:
        from rich.text import Text

        from sleuth.escape import terminal

        errors.print(Text(terminal(line)), soft_wrap=True)

    try:
        result = diagnose(request, listener=listener, announce=announce)
    except DiagnoseError as exc:
        _error(errors, str(exc))
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        _error(errors, "interrupted")
        raise typer.Exit(EXIT_ERROR) from None
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _error(
            errors,
            f"internal error ({type(exc).__name__}{': ' + first if first else ''}); "
            f"rerun with {DEBUG_ENV}=1 for the traceback",
        )
        raise typer.Exit(EXIT_ERROR) from None

    _print(result, output_format)
    if recorded is not None and not observe_recorded:
        # Offered, never run: observing it is a second decision (--observe-recorded, with the --probe given here).
        if recorded.argv:
            errors.print(Text(terminal(f"the run recorded its training command ({recorded.source}): "
                                       f"{recorded.shown()}; to observe one optimizer step of it: "
                                       f"sleuth diagnose --run {shlex.quote(run)} --probe --observe-recorded")), soft_wrap=True)
        elif recorded.why_not:
            errors.print(Text(terminal(f"no recorded command to observe: {recorded.why_not}")), soft_wrap=True)
    probes = result.report.probes
    if result.exit_code == EXIT_ERROR and probes is not None:
        _error(errors, f"no experiment ran ({probes.subject}): {probes.reason}; the static findings are in "
                       f"{result.out_dir}")
    if result.exit_code != EXIT_CLEAN:
        raise typer.Exit(result.exit_code)


def _recorded_problem(run: str | None, probe: bool | None, command: list[str] | None, recorded) -> str | None:  # noqa: ANN001
    """Why --observe-recorded cannot go ahead, in one line; None when it can."""
    if run is None:
        return "--observe-recorded observes the command a run recorded: give --run NAME|PATH"
    if not probe:
        return ("--observe-recorded runs the run's recorded training command: add --probe to consent "
                f"(sleuth diagnose --run {run} --probe --observe-recorded)")
    if command:
        return "--observe-recorded and a command after -- ask for two commands; give one"
    if recorded is None:
        return f"--observe-recorded: the run {run} cannot be read"
    if not recorded.argv:
        return f"--observe-recorded: no recorded command to observe: {recorded.why_not}"
    return None


def _error(console, message: str) -> None:  # noqa: ANN001 - rich Console, imported lazily
    from rich.text import Text

    from sleuth.escape import terminal

    # One line whatever the terminal width or the names in it; plain text, never rich markup.
    console.print(Text("error: ", style="red") + Text(terminal(message)), soft_wrap=True)


def _print(result, output_format: OutputFormat) -> None:  # noqa: ANN001 - Diagnosis, imported lazily
    if output_format is OutputFormat.text:
        from rich.console import Console

        from sleuth.report.text import print_text

        from sleuth.redact import RedactingWriter

        print_text(result.report, Console(file=RedactingWriter(sys.stdout), highlight=False), result.files)
    elif output_format is OutputFormat.json:
        sys.stdout.write(result.files["report.json"].read_text())
    elif output_format is OutputFormat.md:
        sys.stdout.write(result.files["report.md"].read_text())
    else:
        sys.stdout.write(result.files["report.sarif"].read_text())
    sys.stdout.flush()


# A one-command app, for tests and for running this command alone (`python -m sleuth.commands.diagnose`).
app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command()(diagnose_command)

if __name__ == "__main__":
    app()
