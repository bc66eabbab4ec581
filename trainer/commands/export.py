"""`trainer export RUN --out DIR`: a run's drafter as a serving directory (z-lab or speculators layout).

The output directory's path goes to stdout, progress and messages to stderr. User mistakes (no such run,
no checkpoint yet, a non-empty --out without --force, a layout that cannot express the run) end in one
line and exit code 2. torch and transformers are imported inside the command so `trainer --help` stays fast.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from trainer.commands.options import flag
from trainer.errors import UsageError, user_errors


class ExportFormatOption(str, Enum):
    zlab = "zlab"
    speculators = "speculators"


class DtypeOption(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def export_command(
    run: Annotated[str, typer.Argument(help="Run name under --runs-dir, or the path of a run directory.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write config.json and model.safetensors into.")],
    export_format: Annotated[
        ExportFormatOption,
        typer.Option(
            "--format",
            help="zlab: z-lab's DFlashDraftModel layout (dflash_config, z-lab layer ids). speculators: "
            "speculators' / vLLM's layout (aux_hidden_state_layer_ids = z-lab ids + 1).",
        ),
    ] = ExportFormatOption.zlab,
    runs_dir: Annotated[Path, typer.Option("--runs-dir", help="Where named runs live.")] = Path("runs"),
    force: Annotated[bool, flag("--force", help="Overwrite an export already in a non-empty --out.")] = False,
    dtype: Annotated[
        DtypeOption, typer.Option("--dtype", help="Weight dtype to write (auto: as the checkpoint holds them).")
    ] = DtypeOption.auto,
    verifier: Annotated[
        Optional[str],
        typer.Option(
            "--verifier",
            help="speculators only: the target as the server will name it (hub id or path); default: the run's "
            "target directory. speculators loads the embeddings and lm_head from it (not for targets whose "
            "tables the export carries itself: Gemma, GPT-2, GPT-NeoX).",
        ),
    ] = None,
) -> None:
    """Export the run's latest checkpoint for serving: config.json + model.safetensors (drafter body only;
    the target's embeddings and lm_head are borrowed at inference)."""
    stderr = Console(stderr=True)
    # a missing run, a damaged checkpoint, --out not writable, a full disk: one line
    with user_errors(resume_hint="rerun the export (with --force over the partial one)", oom_hint=None):
        from trainer.export import export_run
        from trainer.run.rundir import resolve_run

        if verifier is not None and export_format is not ExportFormatOption.speculators:
            raise UsageError("--verifier only applies to --format speculators")
        run_dir = resolve_run(run, runs_dir).path
        result = export_run(run_dir, out, export_format.value, force=force, dtype=dtype.value, verifier=verifier)
    if result.other_files:
        others = ", ".join(result.other_files)
        stderr.print(f"[yellow]note:[/] {out} also holds files the export did not write: {others}",
                     highlight=False, soft_wrap=True)
    for note in result.notes:
        stderr.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    ids_key = "target_layer_ids (z-lab)" if result.format == "zlab" else "aux_hidden_state_layer_ids (vLLM)"
    stderr.print(
        f"exported run {result.run} step {result.step} ({result.format} layout): {result.tensors} tensors, "
        f"{ids_key} {result.target_layer_ids}",
        highlight=False, soft_wrap=True,
    )
    sys.stdout.write(f"{result.path}\n")
