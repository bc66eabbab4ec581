"""`trainer hidden-states generate`: the target's layers for a run's data, computed once, read by many runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from trainer.commands.options import Command, Group
from trainer.errors import HIDDEN_STATES_RESUME, user_errors

hidden_states_app = typer.Typer(help="Offline target hidden states (train without the target's body).",
                                no_args_is_help=True, cls=Group)
stderr = Console(stderr=True)


@hidden_states_app.command("generate", cls=Command)
def generate_command(
    out: Annotated[Path, typer.Option("--out", help="Directory for the shards and manifest.json.")],
    preset: Annotated[Optional[str], typer.Option(help="A preset, as for `trainer run`.")] = None,
    config_file: Annotated[Optional[Path], typer.Option("--config", help="YAML or JSON config file.")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="key=value (repeatable).")] = None,
    rows_per_shard: Annotated[int, typer.Option(min=1, max=4096, help="Packed rows per shard file.")] = 16,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
) -> None:
    """Run the target once over the training data of this config; killed, it resumes where it stopped.

    Under `torchrun --nproc_per_node N --no-python trainer hidden-states generate ...` each process writes
    every N-th shard.
    """
    with user_errors(resume_hint=HIDDEN_STATES_RESUME, oom_hint="lower --rows-per-shard or seq_len"):
        from trainer.config import build_config
        from trainer.hidden_states.generate import generate
        from trainer.run.loop import compute_dtype, resolve_device

        config = build_config(preset=preset, config_file=config_file, overrides=overrides)
        from trainer.run.progress import ThrottledLines

        torch_device = resolve_device(device, 0)
        # One line per shard on a terminal; on a pipe or a log, one per 30 s as `trainer run` writes its steps.
        shard_lines = ThrottledLines(lambda line: stderr.print(line, highlight=False, soft_wrap=True))
        manifest = generate(config, out, device=torch_device, dtype=compute_dtype(config, torch_device),
                            rows_per_shard=rows_per_shard, note=shard_lines)
        state = "complete" if manifest["complete"] else "partial (other ranks still writing)"
        typer.echo(f"{out}: {manifest['rows']} rows in {manifest['shards']} shard(s), layers {manifest['layers']}, "
                   f"{state}; teacher logits check max abs diff {manifest['logits_check']['max_abs_logit_diff']:.3g}")
