"""`sleuth`: fetch the reference, diagnose a drafter run, write a fix report with evidence.

Each command lives in sleuth/commands/<name>.py; this file only assembles them. Results go to stdout,
progress and messages to stderr; exit 0 clean, 1 findings (or only docs/pinned facts), 2 error.
"""

from __future__ import annotations

import typer

from sleuth.commands.diagnose import diagnose_command
from sleuth.commands.fetch_reference import fetch_reference
from sleuth.commands.mcp import mcp_command
from sleuth.commands.probe import app as probe_app

app = typer.Typer(
    name="sleuth",
    help="Find what is wrong with a DFlash drafter run, with evidence for every claim.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("fetch-reference")(fetch_reference)
app.command("diagnose")(diagnose_command)
app.add_typer(probe_app, name="probe")
app.command("mcp")(mcp_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
