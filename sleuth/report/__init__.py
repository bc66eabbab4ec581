"""The diagnosis report: one model (`model.Report`), rendered as text, Markdown, JSON, SARIF and fix.yaml.

`write_report` writes every file into the diagnosis directory; the renderers are also usable alone.
"""

from __future__ import annotations

from pathlib import Path

from sleuth.report.model import REPORT_SCHEMA_VERSION, Report, Rule, count_findings, rank_findings

REPORT_FILES = ("report.md", "report.json", "report.sarif", "fix.yaml")

__all__ = [
    "REPORT_FILES",
    "REPORT_SCHEMA_VERSION",
    "Report",
    "Rule",
    "count_findings",
    "rank_findings",
    "render_json",
    "write_report",
]


def render_json(report: Report) -> str:
    """report.json: the model's data unchanged, as strict JSON (sleuth.escape.dumps: a non-finite number is
    null, a control or invisible character a `\\uXXXX` escape)."""
    from sleuth.escape import dumps

    return dumps(report.model_dump(mode="json"), indent=2)


def write_report(report: Report, out_dir: Path) -> dict[str, Path]:
    """Write report.md, report.json, report.sarif and fix.yaml into `out_dir`; returns name -> path.

    Each file is written by `sleuth.artifacts.write_atomic` (a fresh temporary file, then a rename): a link
    or FIFO a shipped run directory plants under any of these names is replaced, never written through."""
    from sleuth.artifacts import prepare_dir
    from sleuth.escape import dumps
    from sleuth.report.fix import render_fix_yaml
    from sleuth.report.markdown import render_markdown
    from sleuth.report.sarif import render_sarif

    prepare_dir(out_dir, allow_link=True)  # the caller has refused a link where the user did not ask for one
    files = {name: out_dir / name for name in REPORT_FILES}
    _write_atomic(files["report.md"], render_markdown(report))
    _write_atomic(files["report.json"], render_json(report) + "\n")
    _write_atomic(files["report.sarif"], dumps(render_sarif(report), indent=2) + "\n")
    _write_atomic(files["fix.yaml"], render_fix_yaml(report, str(files["report.md"])))
    return files


def printable_report(report: Report) -> Report:
    """The report with every string printable (a non-UTF-8 file name spelled with \\xNN escapes), so no
    renderer or terminal meets a lone surrogate."""
    from sleuth.artifacts import printable_data

    return Report.model_validate(printable_data(report.model_dump()))


def _write_atomic(path: Path, text: str) -> None:
    # A reader (the trainer's --fixed, an editor's SARIF viewer) never sees a half-written file.
    # The last gate before disk: no URL secret reaches a report, whatever path it took into the model.
    from sleuth.artifacts import printable, write_atomic
    from sleuth.redact import redact

    write_atomic(path, printable(redact(text)))
