"""`trainer eval RUN`: real speculative decoding with a run's drafter on held-out prompts.

Prints only: the human summary (or one JSON object with --json) goes to stdout, progress to stderr.
Nothing is written into the run directory; a training run writes its own <run>/eval.json at its end.
torch and transformers are imported inside the command so `trainer --help` stays fast.
"""

from __future__ import annotations

import json
import math
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from trainer.commands.options import flag
from trainer.errors import UsageError, user_errors

HISTOGRAM_WIDTH = 30  # characters of the longest histogram bar


def eval_command(
    run: Annotated[str, typer.Argument(help="Run name under --runs-dir, or the path of a run directory.")],
    runs_dir: Annotated[Path, typer.Option("--runs-dir", help="Where named runs live.")] = Path("runs"),
    prompts: Annotated[
        Optional[int], typer.Option("--prompts", help="Held-out prompts to decode (default: the run's eval_prompts).")
    ] = None,
    max_new_tokens: Annotated[
        Optional[int],
        typer.Option(
            "--max-new-tokens", help="Tokens to generate per prompt (default: the run's eval_max_new_tokens)."
        ),
    ] = None,
    block_size: Annotated[
        Optional[int], typer.Option("--block-size", help="Draft block size B (default: the run's block_size).")
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0 = greedy (lossless is checked); > 0 = rejection sampling.")
    ] = 0.0,
    data: Annotated[
        Optional[str],
        typer.Option(
            "--data", help="Take held-out prompts from this data ('embedded' or a path) instead of the run's."
        ),
    ] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampling seed (default: the run's seed).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto | cpu | cuda")] = "auto",
    as_json: Annotated[bool, flag("--json", help="Print one JSON object on stdout.")] = False,
    target: Annotated[
        Optional[str],
        typer.Option("--target", help="Target for a drafter trained elsewhere (z-lab, speculators, an export): "
                     "'embedded' or a Hugging Face model directory."),
    ] = None,
    against: Annotated[
        Optional[Path], typer.Option("--against", help="A second drafter: both on the same prompts, side by side.")
    ] = None,
    served_as: Annotated[
        Optional[str],
        typer.Option("--served-as", metavar="ENGINE",
                     help="Build the drafter's sliding-window attention as this engine does: speculators (= vllm, "
                          "the default: our training mask) | zlab (dflash 0.1.0) | sglang | specforge "
                          "(playbooks/serving/engines.yaml)."),
    ] = None,
) -> None:
    """Decode held-out prompts with the run's drafter and target (draft-verify loop) and report tau, per-slot
    acceptance, tokens per target forward, speedup over plain decoding and losslessness. Prints only; it
    writes nothing into the run (a run writes its own eval.json when training ends)."""
    stderr = Console(stderr=True)
    with user_errors(resume_hint=None):
        if served_as is not None:
            from trainer.model.served import ServedAsError, served_as as engine_row

            try:
                engine_row(served_as)  # a typo fails before any model loads
            except ServedAsError as exc:
                raise UsageError(f"--served-as: {exc}") from None
        if target is not None or against is not None or _is_foreign(run, runs_dir):
            # Drafters from anywhere (trainer/eval/foreign.py), decoded with the same loop on one target.
            from trainer.eval.foreign import run_foreign_eval

            run_foreign_eval(run, against, target, runs_dir, prompts, max_new_tokens, block_size, temperature, data,
                             seed, device, as_json, stderr, _is_user_error, _print_summary, served_as=served_as)
            return
        report, run_name, step = _evaluate_run(
            run, runs_dir, prompts, max_new_tokens, block_size, temperature, data, seed, device, stderr, served_as
        )
    result = {"run": run_name, "step": step, **report.model_dump()}
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    _print_summary(result, Console())


class _UsageError(ValueError):
    """A bad argument or a missing run: one line, exit 2."""


def _is_user_error(exc: Exception) -> bool:
    if isinstance(exc, (_UsageError, FileNotFoundError)):
        return True
    # The classes are the modules' own; imported here (not at the top) to keep torch out of CLI start-up.
    from trainer.config import ConfigError
    from trainer.eval.speculative import EvalError
    from trainer.run.rundir import RunError

    known: tuple[type[BaseException], ...] = (EvalError, RunError, ConfigError)
    try:
        from trainer.data.datasets import DataError
        from trainer.target.frozen import TargetError

        known = (*known, DataError, TargetError)
    except ImportError:  # pragma: no cover - the data/target modules are part of the package
        pass
    return isinstance(exc, known)


def _is_foreign(run: str, runs_dir: Path) -> bool:
    from trainer.eval.foreign import is_foreign_drafter_dir

    named = "/" not in run and (runs_dir / run).is_dir()
    return not named and Path(run).is_dir() and is_foreign_drafter_dir(Path(run))


def _evaluate_run(
    run: str,
    runs_dir: Path,
    prompts: int | None,
    max_new_tokens: int | None,
    block_size: int | None,
    temperature: float,
    data: str | None,
    seed: int | None,
    device: str,
    stderr: Console,
    served_as: str | None = None,
) -> tuple[Any, str, int]:
    from trainer.config import MAX_BLOCK_SIZE, MAX_EVAL_NEW_TOKENS, MAX_EVAL_PROMPTS  # pydantic: not at start-up

    # Argument checks first: a typo should not cost a model load.
    for name, value in (("--prompts", prompts), ("--max-new-tokens", max_new_tokens), ("--block-size", block_size)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")
    # Upper bounds too: a block of 100,000 or a million new tokens runs for hours on a tiny model.
    for name, value, cap in (("--block-size", block_size, MAX_BLOCK_SIZE), ("--prompts", prompts, MAX_EVAL_PROMPTS),
                             ("--max-new-tokens", max_new_tokens, MAX_EVAL_NEW_TOKENS)):
        if value is not None and value > cap:
            raise UsageError(f"{name} must be at most {cap}, got {value}")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UsageError(f"--temperature must be a finite number >= 0, got {temperature}")
    from trainer.run.rundir import resolve_run

    run_dir = resolve_run(run, runs_dir).path

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trainer.data.datasets import heldout_prompts
    from trainer.eval.speculative import evaluate
    from trainer.run.loop import load_run, training_semantics

    # A transient spinner on a terminal, a line once loaded otherwise: an error while loading (a damaged
    # checkpoint, a missing target) stays the only line on stderr.
    with stderr.status(f"loading run {run_dir.name} ...") if stderr.is_terminal else nullcontext():
        loaded = load_run(run_dir, device)
    stderr.print(f"loading run {run_dir.name} ... done (step {loaded.step})", highlight=False)
    config = loaded.config
    prompt_ids = heldout_prompts(data or config.data, loaded.target.tokenizer, prompts or config.eval_prompts)
    eval_block = block_size or config.block_size
    with Progress(
        TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, transient=True,
    ) as progress:
        task = progress.add_task("decoding", total=len(prompt_ids))
        report = evaluate(
            loaded.proposer(),
            loaded.target,
            prompt_ids,
            feature_layer_ids=loaded.feature_layer_ids,
            block_size=eval_block,
            max_new_tokens=max_new_tokens or config.eval_max_new_tokens,
            temperature=temperature,
            seed=config.seed if seed is None else seed,
            progress=lambda done, total: progress.update(task, completed=done),
            # Scored at the block size the run trained with; another --block-size has no training counterpart.
            # DFlash2 proposes through its selector, which the replay (unary argmax) does not model.
            teacher_forcing=training_semantics(config, loaded.target)
            if eval_block == config.block_size and config.drafter_kind == "dflash" else None,
            served_as=served_as,
        )
    return report, run_dir.name, loaded.step


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _served_as_line(engine: str | None) -> str:
    from trainer.model.served import served_as

    row = served_as(engine)
    return f"{row.engine}: {row.title}, {row.version}  (the drafter's attention as this engine builds it)"


def _print_summary(result: dict[str, Any], out: Console) -> None:
    block = result["block_size"]
    lossless = {True: "[green]yes[/]", False: "[bold red]NO[/]", None: "n/a (T > 0)"}[result["lossless"]]
    if result["lossless"] is False:
        lossless += f" (prompts {', '.join(map(str, result['lossless_mismatch_prompts']))} differ from greedy)"
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("run", f"{result['run']} (step {result['step']})")
    summary.add_row(
        "setup",
        f"{result['prompts']} prompts, {result['max_new_tokens']} new tokens max, block {block}, "
        f"temperature {result['temperature']:g}",
    )
    summary.add_row("served as", _served_as_line(result.get("served_as")))
    summary.add_row("tau", f"{result['tau']:.3f}  (accepted + bonus per verify step; 1 = no help, {block} = all)")
    teacher_forced = result.get("teacher_forced")
    if teacher_forced:
        summary.add_row(
            "training objective",
            f"{teacher_forced['acceptance']:.3f}  (teacher-forced acceptance on the same sequences, scored as the "
            f"run trains: logits {teacher_forced['logits_source']}; far above tau = a train-serve gap)",
        )
    if result.get("stop_token_ids"):
        summary.add_row("stops at", ", ".join(map(str, result["stop_token_ids"])) + "  (eos, generation_config, turn end)")
    summary.add_row("tokens / target forward", f"{result['tokens_per_target_forward']:.3f}")
    summary.add_row(
        "time / token",
        f"{_ms(result['time_per_token_spec_s'])} speculative, {_ms(result['time_per_token_greedy_s'])} plain decoding",
    )
    summary.add_row("speedup", f"{_fmt(result['speedup'], '.2f')}x")
    summary.add_row("lossless", lossless)
    out.print(summary)

    slots = Table("slot", "accepted", "given slot-1 accepted", title="per-position acceptance", title_justify="left")
    for k, (rate, conditional) in enumerate(
        zip(result["per_position_acceptance"], result["per_position_acceptance_conditional"]), start=1
    ):
        slots.add_row(str(k), f"{rate:.3f}", _fmt(conditional, ".3f"))
    if block > 1:
        out.print(slots)

    buckets = Table("prompt tokens", "prompts", "verify steps", "tau", title="tau by prompt length", title_justify="left")
    for bucket in result.get("tau_by_prompt_length") or []:
        buckets.add_row(
            f"{bucket['min_tokens']}-{bucket['max_tokens']}", str(bucket["prompts"]), str(bucket["verify_steps"]),
            _fmt(bucket["tau"], ".3f"),
        )
    if result.get("tau_by_prompt_length"):
        out.print(buckets)

    by_context = result.get("acceptance_by_context_length") or {}
    if by_context.get("buckets"):
        window = by_context.get("sliding_window")
        title = (f"acceptance by context length (drafter window {window}: beyond it only full layers see it all)"
                 if window else "acceptance by context length")
        contexts = Table("context tokens", "verify steps", "tau", "slot 1..3 accepted", title=title,
                         title_justify="left")
        for bucket in by_context["buckets"]:
            span = f"{bucket['min_context']}-{bucket['max_context']}" + (" (beyond)" if bucket["beyond_window"] else "")
            contexts.add_row(span, str(bucket["verify_steps"]), _fmt(bucket["tau"], ".3f"),
                             " ".join(f"{a:.2f}" for a in bucket["per_position_acceptance"][:3]))
        out.print(contexts)

    histogram = Table("length", "steps", "", title="acceptance length histogram", title_justify="left")
    counts = result["acceptance_histogram"]
    top = max(counts, default=0) or 1
    for length, count in enumerate(counts, start=1):
        histogram.add_row(str(length), str(count), "#" * round(HISTOGRAM_WIDTH * count / top))
    out.print(histogram)
