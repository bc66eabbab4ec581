"""`sleuth mcp`: serve sleuth's tools to a coding agent over the Model Context Protocol (stdio).

stdout carries only the protocol; logs go to stderr (SLEUTH_DEBUG=1: more of them). The `mcp` SDK is
imported here, when the command runs, so no other command pays for it at start-up.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

EXIT_ERROR = 2


def mcp_command(
    offline: Annotated[bool, typer.Option(
        "--offline", help="Every call reads only local checkouts and the cache; no socket is opened.")] = False,
    runs_dir: Annotated[Path | None, typer.Option(
        "--runs-dir", metavar="DIR", help="Default runs directory for list_runs, compare_runs and diagnose.")] = None,
) -> None:
    """Serve sleuth as an MCP server over stdio (for Claude Code, Codex, Cursor: `sleuth mcp`)."""
    try:
        from sleuth.mcp_server import serve
    except ImportError as exc:
        typer.echo(f"error: the MCP SDK is not installed ({exc}); pip install 'mcp>=2.3,<3'", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    if sys.stdin.isatty():
        typer.echo("sleuth mcp: serving MCP on stdio; a coding agent starts this (see `claude mcp add sleuth -- "
                   "sleuth mcp`). Ctrl-D or Ctrl-C ends it.", err=True)
    try:
        serve(offline=offline, runs_dir=runs_dir)
    except KeyboardInterrupt:
        pass
