"""`trainer target build|path`: the embedded default target (tokenizer + small Qwen3), built locally."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from trainer.commands.options import Command, Group, flag
from trainer.errors import user_errors

app = typer.Typer(help="The embedded default target.", no_args_is_help=True, cls=Group)


@app.command("build", cls=Command)
def target_build(
    force: Annotated[bool, flag("--force", help="Rebuild even if a complete build exists.")] = False,
) -> None:
    """Build the embedded target (tokenizer + small Qwen3 model) into the user cache."""
    with user_errors(resume_hint="rerun the command to continue", oom_hint=None):
        from trainer.target.embedded import build_embedded_target, embedded_target_dir, ensure_embedded_target

        path = build_embedded_target(embedded_target_dir()) if force else ensure_embedded_target(progress=True)
        Console().print(str(path), soft_wrap=True, highlight=False)


@app.command("path", cls=Command)
def target_path() -> None:
    """Print where the embedded target lives (built or not)."""
    with user_errors(resume_hint=None, oom_hint=None):
        from trainer.target.embedded import embedded_target_dir

        Console().print(str(embedded_target_dir()), soft_wrap=True, highlight=False)
