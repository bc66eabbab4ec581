"""`sleuth fetch-reference NAME`: find a reference implementation's files and say where each came from.

Exit 0 when the source files resolved, 1 when only docs or pinned facts did, 2 on error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

EXIT_SOURCE, EXIT_DOCS_OR_PINNED, EXIT_ERROR = 0, 1, 2
DEBUG_ENV = "SLEUTH_DEBUG"

_OUTCOME_STYLE = {"ok": "green", "partial": "yellow", "miss": "yellow", "error": "red", "skipped": "dim"}


def fetch_reference(
    name: Annotated[str, typer.Argument(help="Reference name, e.g. speculators (playbooks/references/NAME.yaml).")],
    ref: Annotated[str | None, typer.Option(
        "--ref", help="Branch, tag or commit SHA (default: the reference's default branch).")] = None,
    path: Annotated[Path | None, typer.Option("--path", readable=False,
                                              help="A local git checkout of the reference.")] = None,
    offline: Annotated[bool, typer.Option(
        "--offline", help="Read only local checkouts and the cache; open no socket.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Resolve a reference through local -> git-pull -> raw -> docs -> pinned, and show what each tier gave."""
    from rich.console import Console
    from rich.markup import escape

    from sleuth.redact import RedactingWriter, redact
    from sleuth.reference import ReferenceError, resolve_reference

    errors = Console(file=RedactingWriter(sys.stderr))
    try:
        resolution = resolve_reference(name, ref=ref, path=path, offline=offline)
    except ReferenceError as exc:
        errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        errors.print("[red]error:[/red] interrupted", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_ERROR) from None
    except Exception as exc:
        # A bug in sleuth, not the user's mistake: still one line; SLEUTH_DEBUG=1 shows the traceback.
        if os.environ.get(DEBUG_ENV):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        errors.print(f"[red]error:[/red] internal error ({type(exc).__name__}{escape(': ' + first) if first else ''}); "
                     f"rerun with {DEBUG_ENV}=1 for the traceback", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_ERROR) from None

    if resolution.has_source:
        code = EXIT_SOURCE
    elif resolution.tier in ("docs", "pinned"):
        code = EXIT_DOCS_OR_PINNED
    else:
        code = EXIT_ERROR

    if json_output:
        typer.echo(redact(json.dumps(resolution.model_dump(mode="json"), indent=2)))
    else:
        _print_human(resolution)
    if code == EXIT_ERROR and not json_output:
        errors.print(f"[red]error:[/red] no tier resolved {name!r}; see the trace above", highlight=False,
                     soft_wrap=True)
    if code != EXIT_SOURCE:
        raise typer.Exit(code)


def _print_human(resolution) -> None:  # noqa: ANN001 - Resolution, imported lazily
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from sleuth.escape import terminal
    from sleuth.redact import RedactingWriter

    def plain(value: object) -> Text:  # remote text (a git error line, a path of the reference): never markup
        return Text(terminal(value))

    out = Console(file=RedactingWriter(sys.stdout))
    tiers = Table(title=f"fetch-reference {resolution.reference}", title_justify="left")
    for column in ("tier", "tried", "outcome", "reason", "time"):
        tiers.add_column(column, overflow="fold", justify="right" if column == "time" else "left")
    for attempt in resolution.trace:
        style = _OUTCOME_STYLE.get(attempt.outcome, "")
        tiers.add_row(plain(attempt.tier), plain(attempt.tried), Text(terminal(attempt.outcome), style=style),
                      plain(attempt.reason), f"{attempt.duration_s:.2f}s")
    out.print(tiers)
    for note in resolution.notes:
        out.print(Text("note: ", style="yellow") + plain(note), highlight=False, soft_wrap=True)

    if resolution.files:
        files = Table(title=f"{len(resolution.files)} files from {resolution.tier} at "
                            f"{(resolution.commit or 'an unpinned branch')[:12]}", title_justify="left")
        for column in ("path", "tier", "commit", "sha256", "source"):
            files.add_column(column, overflow="fold")
        for file in resolution.files:
            files.add_row(plain(file.path), plain(file.tier), plain((file.commit or "-")[:7]), plain(file.sha256[:12]),
                          plain(file.source))
        out.print(files)
    if resolution.docs:
        out.print(f"docs: {len(resolution.docs)} page(s), facts from them carry lower confidence:")
        for page in resolution.docs:
            out.print(Text(f"  {terminal(page.path)}  sha256 {terminal(page.sha256[:12])}"), highlight=False,
                      soft_wrap=True)
    if resolution.pinned:
        commits = sorted({str(f.get('commit') or '?')[:7] for f in resolution.pinned.values()})
        out.print(f"pinned: {len(resolution.pinned)} facts at {', '.join(commits)} "
                  f"({', '.join(sorted(resolution.pinned))})", highlight=False)
