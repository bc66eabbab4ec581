"""Options shared by the trainer's commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

RunsDir = Annotated[Path, typer.Option("--runs-dir", metavar="DIR", help="Where named runs live.")]


def flag(*names: str, help: str) -> Any:  # noqa: A002 - typer's own keyword
    """A boolean option shown as a flag (`--resume`), not as `--resume <bool>`: it takes no value."""
    return typer.Option(*names, help=help, metavar="")


def _help_as_flag(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # typer would show `--help <bool>`
    return option


class Command(TyperCommand):
    """A trainer command whose `--help` is shown as the flag it is."""

    def get_help_option(self, ctx: Any) -> Any:
        return _help_as_flag(super().get_help_option(ctx))


class Group(TyperGroup):
    """A trainer command group whose `--help` is shown as the flag it is."""

    def get_help_option(self, ctx: Any) -> Any:
        return _help_as_flag(super().get_help_option(ctx))
