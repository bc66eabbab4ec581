"""`trainer`: train DFlash drafters as named runs, list them, evaluate and export them, build the embedded target.

Each command lives in trainer/commands/<name>.py and runs inside trainer.errors.user_errors(): a user's
mistake or a damaged file is one line on stderr and exit code 2, never a traceback. This file only
assembles them; heavy imports (torch, transformers) happen inside the commands so `trainer --help`
answers at once.
"""

from __future__ import annotations

import typer

from trainer.commands import target
from trainer.commands.eval import eval_command
from trainer.commands.export import export_command
from trainer.commands.hidden_states import hidden_states_app
from trainer.commands.options import Command, Group
from trainer.commands.run import run_command
from trainer.commands.runs import runs_command

app = typer.Typer(
    name="trainer",
    help="Train DFlash block-diffusion drafters on a frozen target, as named runs under ./runs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
)
app.command("run", cls=Command)(run_command)
app.command("runs", cls=Command)(runs_command)
app.command("eval", cls=Command)(eval_command)
app.command("export", cls=Command)(export_command)
app.add_typer(target.app, name="target")
app.add_typer(hidden_states_app, name="hidden-states")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
