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

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sleuth.findings import Finding, TraceStep
from sleuth.regression import Regression, RegressionRefused, find_regression
from sleuth.runs import RunError, RunInfo, list_run_dirs, read_run, resolve_run_dir, safetensors_header_problem
from sleuth.trace import Trace

if TYPE_CHECKING:
    from rich.console import Console

    from sleuth.report.model import Report, Rule

DEFAULT_PLAYBOOK = "dflash"
DEFAULT_REFERENCE = "speculators"
DEFAULT_OUT_WITHOUT_RUN = Path("diagnosis")
# Below this a finding is worth a second look with more evidence, if there is more to be had.
LOW_CONFIDENCE = 0.6
# Looking for a config or checkpoint beside someone's code must not crawl a whole monorepo.
_DISCOVERY_MAX_DEPTH = 3
_DISCOVERY_MAX_FILES = 400
_CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
_LOCATE_MAX_FILES = 20_000
_SKIPPED_FOLDERS = frozenset({"__pycache__", "node_modules", "venv", "site-packages", "build", "dist"})


class DiagnoseError(Exception):
    """A user's mistake or an unreadable input that stops the diagnosis; the message is one line."""


@dataclass
class DiagnoseRequest:
    """What `sleuth diagnose` was asked; the CLI options one to one."""

    run: str | None = None
    runs_dir: Path | None = None
    baseline: str | None = None
    reference: str | None = None
    reference_path: Path | None = None
    code: Path | None = None
    config: Path | None = None
    offline: bool = False
    out: Path | None = None
    playbook: str = DEFAULT_PLAYBOOK
    reference_cache_dir: Path | None = None


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
) -> Diagnosis:
    """Run the whole investigation and write `<out>/report.{md,json,sarif}`, fix.yaml, chart.png, trace.jsonl.

    Raises DiagnoseError (one line) for a user's mistake; damaged inputs become `unknown` findings instead.
    """
    if request.run is None and request.code is None:
        raise DiagnoseError("nothing to diagnose: give --run NAME|PATH, or --code PATH for any DFlash implementation")
    investigation = _Investigation(request, engine, Trace(listener))
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
    "rank-findings", "draw-chart", "write-report", "check-speculators-config",
})


def live_listener(console: Console) -> Callable[[TraceStep], None]:
    """Print each step as it finishes: `✓ read-run  v5: 300 metrics rows ...  0.01 s`; the engine's
    inner steps indented and dimmed under the agent's."""
    from rich.text import Text

    def show(step: TraceStep) -> None:
        failed = step.outcome.startswith("error")
        inner = step.step not in AGENT_STEPS
        line = Text("    " if inner else "")
        line.append("✗ " if failed else "✓ ", style="red" if failed else ("dim green" if inner else "green"))
        line.append(f"{step.step:<20} ", style="dim" if inner else "bold")
        outcome = step.outcome if len(step.outcome) <= 140 else step.outcome[:137] + "..."
        line.append(outcome, style="dim" if inner else "")
        line.append(f"  {step.duration_s:.2f} s", style="dim")
        console.print(line, highlight=False, soft_wrap=True)

    return show


# --- the investigation ---------------------------------------------------------------------------------


class _Investigation:
    def __init__(self, request: DiagnoseRequest, engine: Engine | None, trace: Trace) -> None:
        self.request, self._engine, self.trace = request, engine, trace
        self.run_info: RunInfo | None = None
        self.regression: Regression | None = None
        self.baseline_infos: list[RunInfo] = []
        self.playbook: Any = None
        self.rules: list[Rule] = []
        self.resolution: Any = None
        self.config: dict[str, Any] | None = None
        self.config_source: str | None = None
        self.checkpoint: Path | None = None
        self.code: Path | None = None

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
        with self.trace.step("rank-findings", count=len(findings)) as step:
            findings = rank_findings(findings, self.rules)
            top = [f"{f.id} ({f.severity})" for f in findings if f.status == "mismatch"][:3]
            step.outcome = "by status, severity, playbook rank" + (f"; top: {', '.join(top)}" if top else "")
        return self.write(findings)

    # --- steps ---------------------------------------------------------------------------------------

    def check_paths(self) -> None:
        """Paths the user named must exist: say so at once, before any slow step."""
        request = self.request
        for option, path in (("--code", request.code), ("--config", request.config),
                             ("--reference-path", request.reference_path)):
            if path is not None and not path.exists():
                raise DiagnoseError(f"{option} {path} does not exist")
        if request.config is not None and not request.config.is_file():
            raise DiagnoseError(f"--config {request.config} is not a file")

    def read_run(self) -> None:
        request = self.request
        with self.trace.step("read-run", run=request.run, runs_dir=request.runs_dir) as step:
            info = read_run(resolve_run_dir(request.run or "", request.runs_dir))
            checkpoint = info.checkpoint.parent.name if info.checkpoint else "none"
            step.outcome = (
                f"{info.name} ({info.path}): {len(info.metrics)} metrics rows, config "
                f"{'read' if info.config is not None else 'missing'}, checkpoint {checkpoint}, "
                f"code/ {'present' if info.code_dir else 'missing'}"
            )
            if info.problems:
                step.outcome += "; problems: " + "; ".join(info.problems)
        self.run_info = info

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
                others = []
                for path in list_run_dirs(runs_dir):
                    if path.resolve() == info.path.resolve():
                        continue
                    try:
                        others.append(read_run(path))
                    except RunError:
                        continue
                regression = find_regression(info, others)
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

    def read_config(self) -> None:
        request, info = self.request, self.run_info
        if request.config is not None:
            source = request.config
        elif info is not None:
            source = info.config_path
        else:
            with self.trace.step("read-config", source=None) as step:
                step.outcome = "none given (--config): checks that need the run configuration rely on the code"
            return
        with self.trace.step("read-config", source=source) as step:
            if request.config is not None:
                self.config = load_config_file(request.config)
            else:
                assert info is not None
                self.config = info.config
            if self.config is None:
                reason = next((p for p in info.problems if p.startswith("config.json")), "unreadable") if info else ""
                step.outcome = f"{reason}: checks that need the config will be unknown"
                return
            self.config_source = str(source)
            keys = ("block_size", "target_layer_ids", "loss_decay_gamma")
            shown = {k: self.config[k] for k in keys if k in self.config}
            step.outcome = f"{len(self.config)} keys; " + ", ".join(f"{k}={v}" for k, v in shown.items())

    def read_checkpoint(self) -> None:
        info = self.run_info
        if info is None:
            return
        with self.trace.step("locate-checkpoint", path=info.checkpoint) as step:
            if info.checkpoint is None:
                step.outcome = "no checkpoint: checks that need the weights will rely on config and code"
                return
            problem = safetensors_header_problem(info.checkpoint)
            # A damaged file is still handed to the checks: they report what they could not read as unknown.
            self.checkpoint = info.checkpoint
            step.outcome = (
                f"{info.checkpoint.parent.name}: {problem}" if problem else f"{info.checkpoint.parent.name}: header ok"
            )

    def read_code(self) -> None:
        request, info = self.request, self.run_info
        code = request.code if request.code is not None else (info.code_dir if info is not None else None)
        with self.trace.step("locate-code", path=code) as step:
            if code is None:
                step.outcome = "no code/ copy in the run: code checks will be unknown"
                return
            if code.is_file():
                step.outcome = f"one file, {_line_count(code)} lines"
            else:
                count = sum(1 for p in _walk_files(code, _LOCATE_MAX_FILES, max_depth=None) if p.suffix == ".py")
                step.outcome = f"{count}{'+' if count >= _LOCATE_MAX_FILES else ''} Python files"
            self.code = code

    def check_invariants(
        self, *, config: dict[str, Any] | None = None, config_source: str | None = None, checkpoint: Path | None = None
    ) -> list[Finding]:
        config = config if config is not None else self.config
        config_source = config_source if config_source is not None else self.config_source
        checkpoint = checkpoint if checkpoint is not None else self.checkpoint
        name = "check-invariants" if config is self.config and checkpoint is self.checkpoint else "recheck-invariants"
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
                )
            )
            counts: dict[str, int] = {}
            for finding in findings:
                counts[finding.status] = counts.get(finding.status, 0) + 1
            step.outcome = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no findings"
        return findings

    def check_foreign_conventions(self, findings: list[Finding]) -> list[Finding]:
        """A speculators run's config decided in speculators' own conventions (sleuth.interop)."""
        from sleuth.interop import foreign_findings

        decided = foreign_findings(self.run_info, findings)
        if decided is not findings:
            with self.trace.step("check-speculators-config", run=self.run_info.path if self.run_info else None) as step:
                replaced = [f.id for f, engine in zip(decided, findings) if f is not engine]
                added = [f.id for f in decided[len(findings):]]
                step.outcome = "decided in speculators' conventions: " + ", ".join(replaced + added)
        return decided

    def follow_up(self, findings: list[Finding]) -> list[Finding]:
        """Findings still unknown or weak send the agent to a source it has not read yet, if there is one."""
        weak = [f for f in findings if f.status == "unknown" or f.confidence < LOW_CONFIDENCE]
        if not weak or self.code is None or not self.code.is_dir():
            return findings
        extra_config = extra_checkpoint = None
        with self.trace.step("look-for-evidence", weak=[f.id for f in weak], near=self.code) as step:
            if self.config is None:
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

    def write(self, findings: list[Finding]) -> Diagnosis:
        from sleuth import __version__
        from sleuth.report import count_findings, write_report
        from sleuth.report.chart import write_chart
        from sleuth.report.model import Inputs, Report

        out_dir = self.out_dir()
        counts = count_findings(findings)
        chart_name: str | None = None
        if self.run_info is not None and self.run_info.metrics:
            with self.trace.step("draw-chart", out=out_dir / "chart.png") as step:
                try:
                    outcome = write_chart(out_dir / "chart.png", self.chart_series(), main_label=self.run_info.name)
                except OSError as exc:
                    raise DiagnoseError(f"cannot write the chart to {out_dir}: {exc.strerror or exc}") from None
                step.outcome = {
                    "drawn": "drawn",
                    "cached": "metrics unchanged: kept the existing chart",
                    "empty": "no acc/streak/tau/loss to plot",
                }[outcome]
                chart_name = "chart.png" if outcome != "empty" else None
        report = Report(
            tool_version=__version__,
            generated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            run=_run_summary(self.run_info) if self.run_info is not None else None,
            inputs=Inputs(
                config=self.config_source,
                checkpoint=str(self.checkpoint) if self.checkpoint else None,
                code=str(self.code) if self.code else None,
                playbook=_playbook_name(self.playbook, self.request.playbook),
            ),
            reference=_reference_summary(self.resolution),
            regression=self.regression,
            findings=findings,
            rules=self.rules,
            counts=counts,
            summary=build_summary(self.regression, findings, self.run_info),
            chart=chart_name,
            trace=list(self.trace.steps),
            exit_status=1 if counts.get("mismatch") else 0,
        )
        with self.trace.step("write-report", out=out_dir) as step:
            try:
                files = write_report(report, out_dir)
                files["chart.png"] = out_dir / "chart.png"
                files["trace.jsonl"] = out_dir / "trace.jsonl"
            except OSError as exc:
                raise DiagnoseError(f"cannot write the report to {out_dir}: {exc.strerror or exc}") from None
            step.outcome = ", ".join(name for name, path in files.items() if name != "chart.png" or chart_name)
        if chart_name is None:
            files.pop("chart.png")
        try:
            self.trace.write_jsonl(files["trace.jsonl"])
        except OSError as exc:
            raise DiagnoseError(f"cannot write the trace to {out_dir}: {exc.strerror or exc}") from None
        return Diagnosis(report=report, out_dir=out_dir, files=files)

    # --- helpers -------------------------------------------------------------------------------------

    def out_dir(self) -> Path:
        if self.request.out is not None:
            return self.request.out
        if self.run_info is not None:
            return self.run_info.path / "diagnosis"
        return DEFAULT_OUT_WITHOUT_RUN

    def chart_series(self) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
        from sleuth.report.chart import CHART_METRICS

        assert self.run_info is not None
        runs = [self.run_info, *self.baseline_infos[:3]]
        return {info.name: {m: info.series(m) for m in CHART_METRICS if info.series(m)[0]} for info in runs}


# --- pieces usable on their own ------------------------------------------------------------------------


def load_config_file(path: Path) -> dict[str, Any]:
    """A run configuration from JSON or YAML (a mapping of config keys); DiagnoseError if unreadable."""
    from sleuth.safe_yaml import YamlLimitError, describe_decode_error, load_yaml, read_text_file

    try:
        text = read_text_file(path, what="config")
    except UnicodeDecodeError as exc:
        raise DiagnoseError(f"config {path} {describe_decode_error(exc)}") from None
    except (OSError, YamlLimitError) as exc:
        raise DiagnoseError(f"cannot read config {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        # YAML aliases are expanded under a bound: an alias bomb is refused in milliseconds, not hung on.
        data = json.loads(text) if path.suffix == ".json" else load_yaml(text)
    except YamlLimitError as exc:
        raise DiagnoseError(f"config {path}: {exc}") from None
    except (json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise DiagnoseError(f"config {path} does not parse: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # yaml.YAMLError, without importing yaml for JSON configs
        raise DiagnoseError(f"config {path} does not parse: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise DiagnoseError(f"config {path} must hold a mapping of config keys")
    return data


def rules_from_playbook(playbook: Any) -> list[Rule]:
    """The playbook's invariants as report rules (id, title, what/why/example, severity, rank)."""
    from sleuth.report.model import Rule

    rules = []
    for position, invariant in enumerate(getattr(playbook, "invariants", None) or [], start=1):
        identifier = getattr(invariant, "id", None)
        if not identifier:
            continue
        why = getattr(invariant, "why", None)
        if isinstance(why, str):  # a plain sentence rather than what/why/example
            what_text, why_text, example = "", why, ""
        else:
            what_text, why_text, example = (str(getattr(why, key, "") or "") for key in ("what", "why", "example"))
        severity = getattr(invariant, "severity", None)
        rank = getattr(invariant, "rank", None)
        rules.append(
            Rule(
                id=str(identifier),
                title=str(getattr(invariant, "title", None) or identifier),
                what=" ".join(what_text.split()),
                why=" ".join(why_text.split()),
                example=" ".join(example.split()),
                severity=severity if severity in ("critical", "high", "medium", "low", "info") else "medium",
                rank=rank if isinstance(rank, int) else position,
            )
        )
    return rules


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


def discover_config(code: Path) -> Path | None:
    """A run configuration beside the code: a JSON/YAML mapping that names a block_size."""
    for path in _nearby_files(code, _CONFIG_SUFFIXES):
        if path.stat().st_size > 1_000_000:
            continue
        try:
            data = load_config_file(path)
        except DiagnoseError:
            continue
        if "block_size" in data:
            return path
    return None


def discover_checkpoint(code: Path) -> Path | None:
    """A readable safetensors file beside the code (a drafter checkpoint someone shipped with it)."""
    for path in _nearby_files(code, (".safetensors",)):
        if safetensors_header_problem(path) is None:
            return path
    return None


def build_summary(regression: Regression | None, findings: list[Finding], run: RunInfo | None) -> str:
    """One paragraph: the regression verdict with numbers, then the mismatches and what stayed unknown."""
    parts: list[str] = []
    if regression is not None:
        parts.append(regression.summary.rstrip(".") + "." if regression.summary else "")
    mismatches = [f for f in findings if f.status == "mismatch"]
    unknown = [f for f in findings if f.status == "unknown"]
    if mismatches:
        named = "; ".join(
            f"{f.title} ({f.id}, {f.severity}" + (f": {f.observed}" if f.observed else "") + ")" for f in mismatches
        )
        parts.append(f"{len(mismatches)} mismatch(es) with the reference: {named}.")
    elif findings:
        parts.append("No mismatch with the reference.")
    if unknown:
        parts.append(f"{len(unknown)} check(s) stayed unknown: " + ", ".join(f.id for f in unknown) + ".")
    if run is not None and run.problems:
        parts.append("Reading the run: " + "; ".join(run.problems) + ".")
    return " ".join(p for p in parts if p)


# --- private helpers -----------------------------------------------------------------------------------


def _default_engine() -> Engine:
    try:
        return Engine.default()
    except ImportError as exc:
        raise DiagnoseError(f"sleuth is incompletely installed: {exc}") from None


def _strength(finding: Finding) -> tuple[int, float]:
    return (0 if finding.status == "unknown" else 1, finding.confidence)


def _nearby_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(
        p for p in _walk_files(root, _DISCOVERY_MAX_FILES, max_depth=_DISCOVERY_MAX_DEPTH) if p.suffix in suffixes
    )


def _walk_files(root: Path, limit: int, *, max_depth: int | None) -> list[Path]:
    """Files under `root`, skipping hidden and environment folders, at most `limit` of them."""
    import os

    found: list[Path] = []
    base_depth = len(root.parts)
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        depth = len(here.parts) - base_depth
        subfolders[:] = sorted(
            d for d in subfolders
            if not d.startswith(".") and d not in _SKIPPED_FOLDERS and (max_depth is None or depth < max_depth)
        )
        for name in sorted(files):
            found.append(here / name)
            if len(found) >= limit:
                return found
    return found


def _line_count(path: Path) -> int:
    try:
        return len(path.read_bytes().splitlines())
    except OSError:
        return 0


def _playbook_reference(playbook: Any) -> str | None:
    value = getattr(playbook, "reference", None)
    if isinstance(value, str):
        return value
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else None


def _playbook_name(playbook: Any, requested: str) -> str:
    name = getattr(playbook, "name", None) or requested
    version = getattr(playbook, "version", None)
    return f"{name} v{version}" if version is not None else str(name)


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


def _reference_summary(resolution: Any) -> Any:
    from sleuth.report.model import ReferenceSummary

    if resolution is None:
        return None
    attempts = [
        a.model_dump(mode="json") if hasattr(a, "model_dump") else dict(a) for a in getattr(resolution, "trace", [])
    ]
    return ReferenceSummary(
        name=getattr(resolution, "reference", DEFAULT_REFERENCE),
        tier=getattr(resolution, "tier", None),
        commit=getattr(resolution, "commit", None),
        files=[f.path for f in getattr(resolution, "files", [])],
        docs=[d.path for d in getattr(resolution, "docs", [])],
        attempts=attempts,
        notes=list(getattr(resolution, "notes", [])),
    )


def _run_summary(info: RunInfo) -> Any:
    from sleuth.report.model import RunSummary

    run_json = info.run_json or {}
    return RunSummary(
        name=info.name,
        path=str(info.path),
        preset=run_json.get("preset") if isinstance(run_json.get("preset"), str) else None,
        status=info.status,
        steps_done=info.steps_done,
        created=run_json.get("created") if isinstance(run_json.get("created"), str) else None,
        target_fingerprint=info.target_fingerprint,
        data_fingerprint=info.data_fingerprint,
        block_size=info.block_size,
        metrics_rows=len(info.metrics),
        checkpoint=str(info.checkpoint) if info.checkpoint else None,
        checkpoint_step=info.checkpoint_step,
        problems=list(info.problems),
    )


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
