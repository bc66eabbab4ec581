"""The agent behind `sleuth diagnose`: an investigation as a sequence of recorded steps.

    read run -> regression -> load playbook -> resolve reference -> read config / checkpoint / code
    -> check invariants -> follow up weak findings -> rank -> chart -> write report

Every step goes through `Trace` (inputs, outcome, duration), is shown live through a listener and ends
up in `diagnosis/trace.jsonl`. Later steps use earlier results: the reference chain walks down its tiers
when a tier lacks the module; a missing or damaged source is recorded and the checks that needed it come
out `unknown` instead of stopping the run; findings that stay unknown or low-confidence send the agent
looking for a source it has not used yet (a config or checkpoint beside the code) and re-check them.

The collaborators (playbook loading, invariant checks, the reference chain) are passed in as an `Engine`
so tests can drive the agent with fakes; by default the real ones are imported lazily.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sleuth.artifacts import shown
from sleuth.findings import Finding, TraceStep
from sleuth.investigation.inputs import (  # noqa: F401 - re-exported: usable on their own
    InputDiscovery,
    discover_checkpoint,
    discover_config,
    load_config_file,
)
from sleuth.investigation.report_builder import (  # noqa: F401 - re-exported
    DEFAULT_OUT_WITHOUT_RUN,
    build_summary,
    rules_from_playbook,
    write_diagnosis,
)
from sleuth.investigation.request import DEFAULT_PLAYBOOK, DEFAULT_REFERENCE, DiagnoseError, DiagnoseRequest
from sleuth.regression import Candidate, Regression, RegressionRefused, find_regression
from sleuth.runs import RunError, RunInfo, list_run_dirs, read_run, resolve_run_dir
from sleuth.trace import Trace

if TYPE_CHECKING:
    from rich.console import Console

    from sleuth.report.model import Report, Rule

# Below this a finding is worth a second look with more evidence, if there is more to be had.
LOW_CONFIDENCE = 0.6


@dataclass
class Engine:
    """The agent's collaborators, with the signatures of the team interface."""

    load_playbook: Callable[..., Any]
    check_invariants: Callable[..., list[Finding]]
    resolve_reference: Callable[..., Any]
    # Exceptions that carry a one-line message for the user (bad playbook, unknown reference, ...).
    user_errors: tuple[type[BaseException], ...] = ()

    @classmethod
    def default(cls) -> Engine:
        from sleuth.invariants import PlaybookError, check_invariants, load_playbook
        from sleuth.reference import ReferenceError, resolve_reference

        return cls(
            load_playbook=load_playbook,
            check_invariants=check_invariants,
            resolve_reference=resolve_reference,
            user_errors=(PlaybookError, ReferenceError),
        )


@dataclass
class Diagnosis:
    report: Report
    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return self.report.exit_status


def diagnose(
    request: DiagnoseRequest,
    *,
    engine: Engine | None = None,
    listener: Callable[[TraceStep], None] | None = None,
    announce: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Run the whole investigation and write `<out>/report.{md,json,sarif}`, fix.yaml, chart.png, trace.jsonl.

    Raises DiagnoseError (one line) for a user's mistake; damaged inputs become `unknown` findings instead.
    `announce` hears, before any code under diagnosis runs, what will run and how it is isolated.
    """
    if request.command:
        if not request.probe:
            raise DiagnoseError("sleuth runs your command (after --) only with --probe: running it is your decision "
                                "(sleuth diagnose --code . --probe -- " + " ".join(request.command[:3]) + " ...)")
        if request.code is None:  # the command runs where the user stands: that directory is the code
            request = dataclasses.replace(request, code=Path.cwd())
    if request.run is None and request.code is None:
        raise DiagnoseError("nothing to diagnose: give --run NAME|PATH, or --code PATH for any DFlash implementation")
    investigation = _Investigation(request, engine, Trace(listener), announce)
    try:
        return investigation.run()
    except (RunError, RegressionRefused) as exc:
        raise DiagnoseError(str(exc)) from None
    except Exception as exc:
        if investigation.is_user_error(exc):
            raise DiagnoseError(_one_line(exc)) from None
        raise


# The agent's own steps; any other step is one the invariant engine took inside `check-invariants`.
AGENT_STEPS = frozenset({
    "read-run", "regression", "load-playbook", "resolve-reference", "read-config", "locate-checkpoint",
    "locate-code", "check-invariants", "look-for-evidence", "recheck-invariants", "merge-findings",
    "check-contract", "rank-findings", "draw-chart", "write-report", "run-probes", "apply-probes",
    "check-speculators-config", "located-piece", "observe-command", "observed",
})


def live_listener(console: Console) -> Callable[[TraceStep], None]:
    """Print each step as it finishes: `✓ read-run  v5: 300 metrics rows ...  0.01 s`; the engine's
    inner steps indented and dimmed under the agent's."""
    from rich.text import Text

    from sleuth.escape import terminal

    def show(step: TraceStep) -> None:
        failed = step.outcome.startswith("error")
        inner = step.step not in AGENT_STEPS
        line = Text("    " if inner else "")
        line.append("✗ " if failed else "✓ ", style="red" if failed else ("dim green" if inner else "green"))
        line.append(f"{step.step:<20} ", style="dim" if inner else "bold")
        outcome = terminal(step.outcome, limit=140)  # names from the run: one line, no escape sequence
        line.append(outcome, style="dim" if inner else "")
        line.append(f"  {step.duration_s:.2f} s", style="dim")
        console.print(line, highlight=False, soft_wrap=True)

    return show


# --- the investigation ---------------------------------------------------------------------------------


class _Investigation(InputDiscovery):
    """The agent: input discovery (InputDiscovery), then its own steps (regression, playbook, reference,
    checks, follow-up), then report building (sleuth.investigation.report_builder)."""

    def __init__(self, request: DiagnoseRequest, engine: Engine | None, trace: Trace,
                 announce: Callable[[str], None] | None = None) -> None:
        super().__init__(request, trace)
        self._engine = engine
        self.announce = announce
        self.probe_outcome: Any = None  # sleuth.probes.runner.ProbeOutcome, when a probe was planned
        self.probe_policy: str | None = None
        self.regression: Regression | None = None
        self.baseline_infos: list[RunInfo] = []
        self.playbook: Any = None
        self.rules: list[Rule] = []
        self.resolution: Any = None
        self.variant: str | None = None  # the DFlash-family variant, as the contract checks read it
        self.variant_kind: str | None = None

    @property
    def engine(self) -> Engine:
        # Created on first use, so a mistake found before (no such run) is reported without importing it.
        if self._engine is None:
            self._engine = _default_engine()
        return self._engine

    def is_user_error(self, exc: BaseException) -> bool:
        return self._engine is not None and isinstance(exc, self._engine.user_errors)

    def run(self) -> Diagnosis:
        from sleuth.report import rank_findings

        self.check_paths()
        if self.request.run is not None:
            self.read_run()
            self.compare_with_earlier_runs()
        self.load_playbook()
        self.resolve_reference()
        self.read_config()
        self.read_checkpoint()
        self.read_code()
        findings = self.check_invariants()
        findings = self.follow_up(findings)
        findings = self.check_foreign_conventions(findings)
        findings = self.probe(findings)
        with self.trace.step("rank-findings", count=len(findings)) as step:
            findings = rank_findings(findings, self.rules)
            top = [f"{f.id} ({f.severity})" for f in findings if f.status == "mismatch"][:3]
            step.outcome = "by status, severity, playbook rank" + (f"; top: {', '.join(top)}" if top else "")
        return self.write(findings)

    # --- steps ---------------------------------------------------------------------------------------

    def compare_with_earlier_runs(self) -> None:
        info = self.run_info
        assert info is not None
        runs_dir = self.request.runs_dir if self.request.runs_dir is not None else info.path.parent
        with self.trace.step("regression", runs_dir=runs_dir, baseline=self.request.baseline) as step:
            if self.request.baseline is not None:
                baseline = read_run(resolve_run_dir(self.request.baseline, runs_dir))
                if baseline.path.resolve() == info.path.resolve():
                    raise DiagnoseError(f"--baseline {self.request.baseline} is the diagnosed run itself")
                regression = find_regression(info, [], baseline)
                others = [baseline]
            else:
                others, unreadable = [], []
                for path in list_run_dirs(runs_dir):
                    if path.resolve() == info.path.resolve():
                        continue
                    try:
                        others.append(read_run(path))
                    except Exception as exc:  # noqa: BLE001 - a damaged sibling never stops this run's diagnosis
                        if os.environ.get("SLEUTH_DEBUG") and not isinstance(exc, RunError):
                            raise
                        why = _one_line(exc) if isinstance(exc, RunError) else f"{type(exc).__name__}: {_one_line(exc)}"
                        unreadable.append(Candidate(name=shown(path.name), path=str(path), comparable=False,
                                                    reason=f"cannot be read, skipped ({why[:200]})"))
                regression = find_regression(info, others, skipped=unreadable)
            step.outcome = f"{regression.verdict}: {regression.summary}"
        self.regression = regression
        # The chart shows the chosen baseline first, then the other comparable runs, best first.
        ranked = sorted(
            (c for c in regression.candidates if c.chosen or c.score is not None),
            key=lambda c: (not c.chosen, -(c.score or 0.0)),
        )
        by_path = {str(other.path): other for other in others}
        self.baseline_infos = [by_path[c.path] for c in ranked if c.path in by_path]

    def load_playbook(self) -> None:
        with self.trace.step("load-playbook", playbook=self.request.playbook) as step:
            self.playbook = self.engine.load_playbook(self.request.playbook)
            self.rules = rules_from_playbook(self.playbook)
            step.outcome = f"{len(self.rules)} invariants"

    def resolve_reference(self) -> None:
        request = self.request
        name = request.reference or _playbook_reference(self.playbook) or DEFAULT_REFERENCE
        with self.trace.step(
            "resolve-reference", reference=name, path=request.reference_path, offline=request.offline
        ) as step:
            kwargs: dict[str, Any] = {"path": request.reference_path, "offline": request.offline}
            if request.reference_cache_dir is not None:
                kwargs["cache_dir"] = request.reference_cache_dir
            resolution = self.engine.resolve_reference(name, **kwargs)
            step.outcome = _describe_resolution(resolution)
        self.resolution = resolution

    def check_invariants(
        self, *, config: dict[str, Any] | None = None, config_source: str | None = None, checkpoint: Path | None = None
    ) -> list[Finding]:
        config = config if config is not None else self.config
        config_source = config_source if config_source is not None else self.config_source
        checkpoint = checkpoint if checkpoint is not None else self.checkpoint
        name = "check-invariants" if config is self.config and checkpoint is self.checkpoint else "recheck-invariants"
        # Only a problem with the run's own config is passed on (keeps fakes of the engine signature working).
        extra = {"config_problem": self.config_problem} if self.config_problem is not None and config is None else {}
        with self.trace.step(
            name, config=config_source, checkpoint=checkpoint, code=self.code, reference=_tier_of(self.resolution)
        ) as step:
            findings = list(
                self.engine.check_invariants(
                    self.playbook,
                    reference=self.resolution,
                    config=config,
                    config_source=config_source,
                    checkpoint=checkpoint,
                    code=self.code,
                    trace=self.trace,
                    **extra,
                )
            )
            counts: dict[str, int] = {}
            for finding in findings:
                counts[finding.status] = counts.get(finding.status, 0) + 1
            step.outcome = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no findings"
        return self.check_contract(findings, config, config_source, checkpoint)

    def check_contract(
        self, findings: list[Finding], config: dict[str, Any] | None, config_source: str | None,
        checkpoint: Path | None = None,
    ) -> list[Finding]:
        """The train-to-serve contract checks (sleuth.checks), after the engine: the gap check names which
        of the engine's findings explain it."""
        from sleuth.checks import ContractContext, apply_contract_checks

        with self.trace.step("check-contract", target=self.request.target, hidden_states=self.request.hidden_states) as step:
            rules = {inv.id: inv for inv in getattr(self.playbook, "invariants", []) or []}
            context = ContractContext(
                run=self.run_info, config=config, config_source=config_source, target_dir=self.request.target,
                hidden_states=self.request.hidden_states, rules=rules, served_by=self.request.served_by,
                checkpoint=checkpoint,
            )
            findings = apply_contract_checks(findings, context)
            if self.variant is None or context.variant.marked:
                self.variant, self.variant_kind = context.variant.describe(), context.variant.kind
            step.outcome = ", ".join(f"{f.id.split('.', 1)[-1]} {f.status}" for f in findings
                                     if f.id in _contract_ids()) or "no contract checks"
        return findings

    def check_foreign_conventions(self, findings: list[Finding]) -> list[Finding]:
        """A speculators / SpecForge run's config decided in that trainer's own conventions (sleuth.interop)."""
        from sleuth.interop import foreign_findings

        decided = foreign_findings(self.run_info, findings, config=self.request.config)
        if decided is not findings:
            with self.trace.step("check-speculators-config", run=self.run_info.path if self.run_info else None) as step:
                replaced = [f.id for f, engine in zip(decided, findings) if f is not engine]
                added = [f.id for f in decided[len(findings):]]
                trainer = getattr(self.run_info.interop if self.run_info else None, "trainer", "speculators")
                step.outcome = f"decided in {trainer}'s conventions: " + ", ".join(replaced + added)
        return decided

    def follow_up(self, findings: list[Finding]) -> list[Finding]:
        """Findings still unknown or weak send the agent to a source it has not read yet, if there is one."""
        weak = [f for f in findings if f.status == "unknown" or f.confidence < LOW_CONFIDENCE]
        if not weak or self.code is None or not self.code.is_dir():
            return findings
        extra_config = extra_checkpoint = None
        with self.trace.step("look-for-evidence", weak=[f.id for f in weak], near=self.code) as step:
            # A run whose own config is lost is not rescued by a config file lying in its code/ copy.
            if self.config is None and self.config_problem is None:
                extra_config = discover_config(self.code)
            if self.checkpoint is None:
                extra_checkpoint = discover_checkpoint(self.code)
            found = [str(p) for p in (extra_config, extra_checkpoint) if p is not None]
            step.outcome = f"found {', '.join(found)}" if found else "no config or checkpoint beside the code"
        if extra_config is None and extra_checkpoint is None:
            return findings
        config = load_config_file(extra_config) if extra_config is not None else None
        second = self.check_invariants(
            config=config,
            config_source=str(extra_config) if extra_config is not None else None,
            checkpoint=extra_checkpoint,
        )
        with self.trace.step("merge-findings", weak=len(weak)) as step:
            merged, improved = merge_findings(findings, second)
            if extra_config is not None:
                self.config, self.config_source = config, str(extra_config)
            if extra_checkpoint is not None:
                self.checkpoint = extra_checkpoint
            step.outcome = f"{len(improved)} improved: {', '.join(improved)}" if improved else "nothing improved"
        return merged

    def probe(self, findings: list[Finding]) -> list[Finding]:
        """Experiments on the code under diagnosis (sleuth/probes); their verdicts decide over static readings."""
        from sleuth.probes.agent import probe_findings

        request, info = self.request, self.run_info
        if request.command:  # the user's own command, observed (sleuth/observe): no located pieces, no adapter
            from sleuth.observe.runner import observe_findings

            assert request.code is not None
            findings, self.probe_outcome = observe_findings(
                findings, trace=self.trace, playbook=self.playbook, command=list(request.command), code=request.code,
                python=request.probe_python, timeout_s=request.probe_timeout_s, announce=self.announce,
                steps=request.observe_steps, config=self.config if isinstance(self.config, dict) else None)
            self.probe_policy = "--probe: your command, observed"
            return findings
        findings, self.probe_outcome, self.probe_policy = probe_findings(
            findings, trace=self.trace, playbook=self.playbook, probe=request.probe, entry=request.probe_entry,
            python=request.probe_python, run_dir=info.path if info is not None else None,
            run_name=info.name if info is not None else None, run_code=info.code_dir if info is not None else None,
            code=request.code, config=self.config, timeout_s=request.probe_timeout_s, announce=self.announce,
            config_path=request.config,
        )
        return findings

    def write(self, findings: list[Finding]) -> Diagnosis:
        report, out_dir, files = write_diagnosis(self, findings)
        return Diagnosis(report=report, out_dir=out_dir, files=files)


# --- pieces usable on their own (see also sleuth.investigation) ------------------------------------------


def merge_findings(first: list[Finding], second: list[Finding]) -> tuple[list[Finding], list[str]]:
    """Per invariant, keep the better-evidenced finding: a decided status beats unknown, then confidence."""
    better = {f.id: f for f in second}
    merged, improved = [], []
    for finding in first:
        other = better.pop(finding.id, None)
        if other is not None and _strength(other) > _strength(finding):
            merged.append(other)
            improved.append(finding.id)
        else:
            merged.append(finding)
    merged.extend(better.values())
    return merged, improved


# --- private helpers -----------------------------------------------------------------------------------


def _contract_ids() -> frozenset[str]:
    from sleuth.checks import CONTRACT_CHECKS

    return frozenset(CONTRACT_CHECKS)


def _default_engine() -> Engine:
    try:
        return Engine.default()
    except ImportError as exc:
        raise DiagnoseError(f"sleuth is incompletely installed: {exc}") from None


def _strength(finding: Finding) -> tuple[int, float]:
    return (0 if finding.status == "unknown" else 1, finding.confidence)


def _playbook_reference(playbook: Any) -> str | None:
    value = getattr(playbook, "reference", None)
    if isinstance(value, str):
        return value
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else None


def _tier_of(resolution: Any) -> str | None:
    return getattr(resolution, "tier", None)


def _describe_resolution(resolution: Any) -> str:
    tier = getattr(resolution, "tier", None)
    commit = getattr(resolution, "commit", None)
    head = f"{tier} tier answered" if tier else "no tier answered"
    if commit:
        head += f" @ {commit[:12]}"
    attempts = getattr(resolution, "trace", []) or []
    path = " -> ".join(
        f"{a.tier}: {a.outcome}" + (f" ({a.reason})" if a.outcome not in ("ok", "skipped") and a.reason else "")
        for a in attempts
        if a.outcome != "skipped"
    )
    return head + (f"; chain: {path}" if path else "")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
