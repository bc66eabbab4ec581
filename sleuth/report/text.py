"""The short summary `sleuth diagnose` prints by default: verdict, regression, top findings, where the files are."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sleuth.escape import terminal
from sleuth.report.model import Report

if TYPE_CHECKING:
    from rich.console import Console

_STYLE = {"mismatch": "bold red", "unknown": "yellow", "match": "green"}
_MAX_ROWS = 12
# A run's name heads the summary line; a longer one is cut there (the report has it in full).
_MAX_NAME = 120
_CELL = 60  # characters of observed / expected shown per row; the whole text and its evidence are in report.md


def brief(text: str | None, limit: int = _CELL) -> str:
    """One line of at most `limit` characters: the first clause of `text` (where findings put the measured
    value and its number), whitespace collapsed, cut with an ellipsis."""
    line = " ".join(str(text or "").split())
    if len(line) <= limit:
        return line
    for stop in ("; ", " (", ": ", ", "):
        cut = line.find(stop, 12)
        if 0 < cut <= limit:
            return line[:cut] + " …"
    return line[: limit - 2].rstrip() + " …"


def print_text(report: Report, console: Console, files: dict[str, Path] | None = None) -> None:
    """Every string from the run or the code goes through sleuth.escape.terminal (one line, no escape
    sequence, no newline), into a rich Text (never parsed as markup), printed without wrapping: no value can
    make a line of its own, let alone one that looks like the summary line."""
    from rich.table import Table
    from rich.text import Text

    counts = report.counts
    head = Text(f"sleuth diagnose {terminal(report.subject, limit=_MAX_NAME)}: ", style="bold")
    head.append(f"{counts.get('mismatch', 0)} mismatch(es)", style=_STYLE["mismatch"] if counts.get("mismatch") else "")
    head.append(f", {counts.get('unknown', 0)} unknown, {counts.get('match', 0)} match")
    console.print(head, soft_wrap=True)
    if report.inputs.variant:
        console.print(Text("variant: ", style="bold") + Text(terminal(report.inputs.variant)), soft_wrap=True)
    for problem in report.input_problems:
        console.print(Text("not clean: ", style="bold red") + Text(terminal(problem)), soft_wrap=True)
    if report.regression is not None:
        style = {"regression": "red", "improvement": "green"}.get(report.regression.verdict, "")
        console.print(Text("regression: ", style="bold") + Text(terminal(report.regression.summary), style=style),
                      soft_wrap=True)
    if report.reference is not None:
        ref = report.reference
        where = (f"{ref.tier} tier" + (f" @ {ref.commit[:12]}" if ref.commit else "")) if ref.tier else "unresolved"
        console.print(Text("reference: ", style="bold") + Text(terminal(f"{ref.name} ({where})")), soft_wrap=True)
    mismatches = [f for f in report.findings if f.status == "mismatch"]
    if mismatches:
        table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        table.add_column("severity", no_wrap=True, min_width=8)
        table.add_column("mismatch", no_wrap=True, style=_STYLE["mismatch"], min_width=20)
        table.add_column("observed", no_wrap=True, overflow="ellipsis")
        table.add_column("expected", no_wrap=True, overflow="ellipsis")
        for finding in mismatches[:_MAX_ROWS]:
            # Text cells: a str cell would be read as rich markup ("[link=...]" from a probe's answer); one short
            # line each (the first clause, where findings put the measured value), the rest in report.md
            table.add_row(*(Text(terminal(cell)) for cell in (finding.severity, finding.id, brief(finding.observed),
                                                              brief(finding.expected, _CELL // 2))))
        console.print(table)
        if len(mismatches) > _MAX_ROWS:
            console.print(f"... and {len(mismatches) - _MAX_ROWS} more mismatches in the report")
    unknown = [f for f in report.findings if f.status == "unknown"]
    if unknown:
        # Unknowns are listed by id only; the report gives each one's reason.
        line = Text(f"unknown ({len(unknown)}): ", style=_STYLE["unknown"])
        line.append(", ".join(terminal(f.id.removeprefix("dflash.")) + ("*" if f.static_agreement else "")
                              for f in unknown))
        console.print(line, soft_wrap=True)
        if any(f.static_agreement for f in unknown):
            console.print("  * the code reads as the rule requires at the cited site, but its whole path was not "
                          "traced: not claimed (--probe measures it)")
    if files:
        # A path is copied, never read as prose: it must not be wrapped at the terminal's width.
        console.print(Text("report: ", style="bold") + Text(terminal(files.get("report.md", ""))), soft_wrap=True)
