"""Runs and drafters from other trainers: speculators (vLLM) and SpecForge (SGLang).

sleuth's own contract is the run directory `trainer` writes (docs/reference/run-directory.md). Most DFlash drafters are trained
elsewhere, so this package reads the other trainers' layouts into the same `RunInfo` and checks their
configs in their own conventions (vLLM layer ids, `speculators train` flags):

- `speculators.py`: a `speculators train` save directory, one of its checkpoints, a `from_pretrained` dir
- `verifier.py`: the verifier (target) a drafter names, found offline, for its depth and hidden size
- `speculators_checks.py`: config checks in speculators' conventions, returning `Finding`s
- `specforge.py`: a `specforge train` output directory (`{run_id}-step{N}/training_state.pt`, `-best`/`-latest`
  links, `runs/` tensorboard) or one of its checkpoints
- `specforge_checks.py`: DFlash settings checked in SpecForge's conventions (z-lab layer ids, its config keys)
- `tensorboard.py`: training curves from tensorboard event files, with tensorboard's own reader

`sleuth.runs.read_run` asks `read_foreign_run` first; `sleuth.diagnose` hands the findings of the generic
engine to `foreign_findings`, which replaces those a foreign convention decides better.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sleuth.findings import Finding
    from sleuth.run_info import RunInfo

# Files whose presence at the top of a directory marks a run of another trainer (list_run_dirs uses these).
FOREIGN_RUN_MARKERS = ("train_command.txt", "run.yaml")


def is_foreign_save_dir(path: Path) -> bool:
    """A directory whose children are one foreign run's checkpoints (a `speculators train` save directory,
    a `specforge train` output directory)."""
    from sleuth.interop import specforge
    from sleuth.interop.speculators import detect

    return detect(path) == "save_dir" or specforge.detect(path) == "output_dir"


def read_foreign_run(path: Path) -> RunInfo | None:
    """A `RunInfo` for a directory written by another trainer, or None when it is not one."""
    from sleuth.interop.specforge import read_specforge_run
    from sleuth.interop.speculators import read_speculators_run

    return read_speculators_run(path) or read_specforge_run(path)


def foreign_findings(run: RunInfo | None, findings: list[Finding], config: Path | None = None) -> list[Finding]:
    """The engine's findings, with those decided in the foreign trainer's conventions replaced or added.

    `config` (`--config`): for a SpecForge run, the draft config JSON to check against its checkpoint instead of
    the one the checkpoint's provenance names (the JSON about to be exported or served).
    """
    if run is None:
        return findings
    from sleuth.interop.specforge import SpecForgeRun

    if isinstance(run.interop, SpecForgeRun):
        from sleuth.interop.specforge_checks import check_specforge

        if config is not None:
            run.interop.use_draft_config(config)
        return _replace(findings, check_specforge(run.interop), "SpecForge", "specforge")
    from sleuth.interop.speculators import detect, is_speculators_config, read
    from sleuth.interop.speculators_checks import check_speculators

    foreign = run.interop
    if foreign is None and is_speculators_config(run.config) and detect(run.path) == "pretrained":
        foreign = read(run.path, "pretrained")  # a from_pretrained / exported directory: config + weights
    if foreign is None:
        return findings
    decided = {f.id: f for f in check_speculators(foreign)}
    merged = [decided.pop(f.id, f) for f in findings]
    version = getattr(foreign, "speculators_version", None)
    for finding in merged:
        # What stays unknown is speculators' own code; the user can point sleuth at the version that ran.
        if finding.status == "unknown" and "no source code" in (finding.reason or ""):
            finding.notes.append(
                f"trained by speculators {version or '(version not recorded)'}: `--code <speculators checkout>/"
                "src/speculators` checks that source"
            )
    return merged + list(decided.values())


def _replace(findings: list[Finding], decided_list: list[Finding], trainer: str, package: str) -> list[Finding]:
    """Engine findings with the same ids replaced by the trainer-convention ones; the rest appended."""
    decided = {f.id: f for f in decided_list}
    merged = [decided.pop(f.id, f) for f in findings]
    for finding in merged:
        if finding.status == "unknown" and "no source code" in (finding.reason or ""):
            finding.notes.append(f"trained by {trainer}: `--code <{trainer} checkout>/{package}` checks that source")
    return merged + list(decided.values())
