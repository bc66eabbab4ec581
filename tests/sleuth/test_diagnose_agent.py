"""The diagnose agent with fake collaborators: steps recorded and adapted, files written, errors mapped.

The fake invariant check reads the config the way a real one would (fc_layers set -> fc mismatch,
context_includes_anchor -> a code-located mismatch, no config -> unknown), so each test can predict the
findings from the inputs it built.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from test_runs import metrics_rows, write_run

from sleuth.diagnose import DiagnoseError, DiagnoseRequest, Engine, diagnose, merge_findings
from sleuth.findings import Evidence, Finding, Fix, TraceStep
from sleuth.reference.model import Attempt, ReferenceError, Resolution

STEPS = list(range(10, 301, 10))

PLAYBOOK = SimpleNamespace(
    name="dflash",
    version=1,
    reference="speculators",
    invariants=[
        SimpleNamespace(id="dflash.context_excludes_anchor", title="Context excludes the anchor", rank=1,
                        why=SimpleNamespace(what="kv < anchor.", why="The anchor's state does not exist yet.",
                                            example="kv <= anchor"), severity="critical"),
        SimpleNamespace(id="dflash.fc_input_layers", title="fc reads all selected layers", rank=2,
                        why=SimpleNamespace(what="fc over all k layers.", why="Dropping one hurts.", example=""),
                        severity="critical"),
        SimpleNamespace(id="dflash.loss_decay_gamma", title="Loss decay gamma", rank=3,
                        why="w_k = exp(-(k-1)/gamma), gamma 4.", severity="medium"),
        SimpleNamespace(id="dflash.fc_norm", title="hidden_norm after fc", rank=4, why="RMSNorm after fc.",
                        severity="high"),
    ],
)


class FakeEngine:
    """Records every call; findings follow from the config, checkpoint and code it is given."""

    def __init__(self, resolution: Resolution | None = None, reference_error: str | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.resolve_calls: list[tuple[str, dict[str, Any]]] = []
        self.resolution = resolution or Resolution(
            reference="speculators", tier="git-pull", commit="c05b95b" + "0" * 33,
            trace=[
                Attempt(tier="local", tried="~/speculators", outcome="partial",
                        reason="checkout at de03273 has no src/speculators/models/dflash"),
                Attempt(tier="git-pull", tried="origin/main", outcome="ok", reason="all files at c05b95b"),
            ],
        )
        self.reference_error = reference_error

    def engine(self) -> Engine:
        return Engine(load_playbook=lambda name: PLAYBOOK, check_invariants=self.check_invariants,
                      resolve_reference=self.resolve_reference, user_errors=(ReferenceError,))

    def resolve_reference(self, name: str, **kwargs: Any) -> Resolution:
        self.resolve_calls.append((name, kwargs))
        if self.reference_error:
            raise ReferenceError(self.reference_error)
        return self.resolution

    def check_invariants(self, playbook: Any, *, reference: Any, config: dict | None, config_source: str | None,
                         checkpoint: Path | None, code: Path | None, trace: Any,
                         config_problem: str | None = None) -> list[Finding]:
        self.calls.append({"config": config, "config_source": config_source, "checkpoint": checkpoint,
                           "code": code, "reference": reference, "config_problem": config_problem})
        with trace.step("fake-read-sources", code=code) as step:
            step.outcome = "ok"
        findings = []
        if config is None:
            findings.append(Finding(id="dflash.loss_decay_gamma", title="Loss decay gamma", status="unknown",
                                    severity="medium", confidence=0.0, reason="no run configuration"))
        else:
            gamma = config.get("loss_decay_gamma")
            findings.append(Finding(
                id="dflash.loss_decay_gamma", title="Loss decay gamma",
                status="match" if gamma == 4.0 else "mismatch", severity="medium", confidence=0.9,
                expected="4.0", observed=str(gamma),
                evidence=[Evidence(kind="config", location=f"{config_source}:loss_decay_gamma", value=str(gamma))],
                fix=Fix(config_patch={"loss_decay_gamma": 4.0}),
            ))
            fc = config.get("fc_layers")
            findings.append(Finding(
                id="dflash.fc_input_layers", title="fc reads all selected layers",
                status="match" if fc is None else "mismatch", severity="critical", confidence=0.95,
                expected="all 5 selected layers", observed="all" if fc is None else f"{len(fc)} of 5",
                evidence=[Evidence(kind="code", location="trainer/model/drafter.py:42", path="trainer/model/drafter.py",
                                   line=42, snippet="self.fc = nn.Linear(len(fc_layers) * H, H)")],
                fix=Fix(config_patch={"fc_layers": None}),
            ))
            leak = bool(config.get("context_includes_anchor"))
            findings.append(Finding(
                id="dflash.context_excludes_anchor", title="Context excludes the anchor",
                status="mismatch" if leak else "match", severity="critical", confidence=0.9,
                expected="kv_pos < anchor", observed="kv_pos <= anchor" if leak else "kv_pos < anchor",
                evidence=[Evidence(kind="code", location="trainer/model/attention_mask.py:17",
                                   path="trainer/model/attention_mask.py", line=17, snippet="kv <= anchor")],
                fix=Fix(code_hint="compare kv_pos < anchor in the mask", applicability="unsafe"),
            ))
        findings.append(Finding(
            id="dflash.fc_norm", title="hidden_norm after fc",
            status="match" if checkpoint is not None else "unknown", severity="high",
            confidence=0.9 if checkpoint is not None else 0.3,
            reason=None if checkpoint is not None else "no checkpoint to read hidden_norm.weight from",
        ))
        return findings


def _runs(tmp_path: Path, **configs: dict[str, Any]) -> Path:
    """Runs v3 (earlier, better) and the given ones, all comparable, in tmp_path/runs."""
    runs = tmp_path / "runs"
    write_run(runs, "v3", created="2026-11-01T09:00:00+00:00", config={"loss_decay_gamma": 4.0},
              rows=metrics_rows(STEPS, acc=[0.002 * s for s in STEPS], streak=[1 + 0.004 * s for s in STEPS]))
    for hour, (name, config) in enumerate(configs.items(), start=10):
        write_run(runs, name, created=f"2026-11-01T{hour}:00:00+00:00", config=config,
                  rows=metrics_rows(STEPS, acc=[0.001 * s for s in STEPS], streak=[1 + 0.002 * s for s in STEPS]))
    return runs


def test_a_regressed_run_with_mismatches_gets_a_full_report(tmp_path: Path) -> None:
    runs = _runs(tmp_path, v5={"fc_layers": [0, 1, 2, 3], "loss_decay_gamma": 7.0})
    fake = FakeEngine()
    shown: list[TraceStep] = []
    result = diagnose(DiagnoseRequest(run="v5", runs_dir=runs), engine=fake.engine(), listener=shown.append)

    assert result.exit_code == 1
    assert result.out_dir == runs / "v5" / "diagnosis"
    for name in ("report.md", "report.json", "report.sarif", "fix.yaml", "chart.png", "trace.jsonl"):
        assert (result.out_dir / name).is_file(), name
    report = result.report
    assert report.regression is not None and report.regression.baseline == "v3"
    assert report.regression.verdict == "regression"
    # Ranked: mismatches first, critical before medium; then unknown, then match.
    assert [(f.id, f.status) for f in report.findings] == [
        ("dflash.fc_input_layers", "mismatch"),
        ("dflash.loss_decay_gamma", "mismatch"),
        ("dflash.context_excludes_anchor", "match"),
        ("dflash.fc_norm", "match"),
    ]
    assert report.reference is not None and report.reference.tier == "git-pull"
    assert report.summary.startswith("v5 regressed against v3: at step 300 acc 0.3 vs v3 0.6")
    assert "2 mismatch(es)" in report.summary
    # The sources handed to the checks are the run's own.
    call = fake.calls[0]
    assert call["config"]["fc_layers"] == [0, 1, 2, 3]
    assert call["config_source"] == str(runs / "v5" / "config.json")
    assert call["checkpoint"] == runs / "v5" / "checkpoints" / "step-00000300" / "drafter.safetensors"
    assert call["code"] == runs / "v5" / "code"
    assert fake.resolve_calls == [("speculators", {"path": None, "offline": False})]
    # Every step was shown live, in order, and saved as JSONL.
    names = [s.step for s in shown]
    assert names[:4] == ["read-run", "regression", "load-playbook", "resolve-reference"]
    assert names.index("fake-read-sources") < names.index("check-invariants") < names.index("rank-findings")
    assert names[-2:] == ["draw-chart", "write-report"]
    saved = [json.loads(line) for line in (result.out_dir / "trace.jsonl").read_text().splitlines()]
    assert [s["step"] for s in saved] == names
    assert all({"step", "inputs", "outcome", "duration_s"} <= set(s) for s in saved)
    resolve_step = next(s for s in saved if s["step"] == "resolve-reference")
    assert resolve_step["outcome"].startswith("git-pull tier answered @ c05b95b")
    assert "local: partial (checkout at de03273 has no src/speculators/models/dflash)" in resolve_step["outcome"]


def test_fix_yaml_is_the_merged_config_patch_plus_code_changes(tmp_path: Path) -> None:
    runs = _runs(tmp_path, v6={"fc_layers": [0, 1, 2, 3], "context_includes_anchor": True, "loss_decay_gamma": 7.0})
    result = diagnose(DiagnoseRequest(run="v6", runs_dir=runs), engine=FakeEngine().engine())
    text = (result.out_dir / "fix.yaml").read_text()
    fix = yaml.safe_load(text)
    config_bytes = (runs / "v6" / "config.json").read_bytes()
    assert fix == {
        "diagnosed_run": "v6",
        "diagnosed_run_path": str(runs / "v6"),
        # which config the patch was computed against: trainer --fixed refuses it for any other
        "diagnosed_config_sha256": hashlib.sha256(config_bytes).hexdigest(),
        "report": str(result.out_dir / "report.md"),
        "config_patch": {"fc_layers": None, "loss_decay_gamma": 4.0},
        "code_changes": [{"id": "dflash.context_excludes_anchor", "hint": "compare kv_pos < anchor in the mask"}],
    }
    assert "# needs a code change (no config key fixes it): dflash.context_excludes_anchor" in text


def test_a_clean_run_exits_zero(tmp_path: Path) -> None:
    runs = _runs(tmp_path, fixed={})
    result = diagnose(DiagnoseRequest(run="fixed", runs_dir=runs), engine=FakeEngine().engine())
    assert result.exit_code == 0
    assert result.report.counts == {"mismatch": 0, "unknown": 0, "match": 4}
    assert yaml.safe_load((result.out_dir / "fix.yaml").read_text())["config_patch"] == {}


def test_out_dir_and_reference_options_are_honoured(tmp_path: Path) -> None:
    runs = _runs(tmp_path, v5={})
    checkout = tmp_path / "speculators"
    checkout.mkdir()
    fake = FakeEngine()
    result = diagnose(
        DiagnoseRequest(run=str(runs / "v5"), reference="other-ref", reference_path=checkout, offline=True,
                        out=tmp_path / "elsewhere"),
        engine=fake.engine(),
    )
    assert result.out_dir == tmp_path / "elsewhere" and (tmp_path / "elsewhere" / "report.json").is_file()
    assert not (runs / "v5" / "diagnosis").exists()
    assert fake.resolve_calls == [("other-ref", {"path": checkout, "offline": True})]
    # The run was given as a path: its parent is the runs dir searched for earlier runs.
    assert result.report.regression is not None and result.report.regression.baseline == "v3"


def test_missing_config_and_checkpoint_make_unknown_findings_with_reasons(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    path = write_run(runs, "broken", checkpoint_step=None)
    (path / "config.json").unlink()
    with (path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 310, "acc": 0.')
    fake = FakeEngine()
    result = diagnose(DiagnoseRequest(run="broken", runs_dir=runs), engine=fake.engine())
    by_id = {f.id: f for f in result.report.findings}
    assert by_id["dflash.loss_decay_gamma"].status == "unknown"
    assert by_id["dflash.loss_decay_gamma"].reason == "no run configuration"
    assert by_id["dflash.fc_norm"].status == "unknown"
    # A run without its config is not clean: exit 1, and the engine is told why the config is missing.
    assert result.exit_code == 1
    assert fake.calls[0]["config_problem"] == "the run's config.json is missing"
    assert result.report.input_problems and "config.json is missing" in result.report.input_problems[0]
    assert "No mismatch" not in result.report.summary
    problems = result.report.run.problems if result.report.run else []
    assert "config.json is missing" in problems
    assert any("skipped 1 truncated or garbled line(s)" in p for p in problems)
    assert "Reading the run: " in result.report.summary
    steps = {s.step: s.outcome for s in result.report.trace}
    assert steps["read-config"].startswith("config.json is missing")
    assert steps["locate-checkpoint"].startswith("no checkpoint")
    # Nothing to compare against: the regression is unknown, with the reason.
    assert result.report.regression is not None and result.report.regression.verdict == "unknown"


def test_code_only_diagnosis_follows_up_weak_findings_with_a_config_beside_the_code(tmp_path: Path) -> None:
    code = tmp_path / "their-dflash"
    (code / "model").mkdir(parents=True)
    (code / "model" / "dflash.py").write_text("class DFlash:\n    pass\n")
    (code / "configs").mkdir()
    (code / "configs" / "train.yaml").write_text("block_size: 16\nloss_decay_gamma: 7.0\nfc_layers: [0, 1]\n")
    (code / "configs" / "unrelated.json").write_text('{"lr": 0.1}')
    fake = FakeEngine()
    result = diagnose(DiagnoseRequest(code=code, out=tmp_path / "out"), engine=fake.engine())

    # First pass: code only; the unknown config-based finding sends the agent to the config it found.
    assert [c["config"] for c in fake.calls] == [None, {"block_size": 16, "loss_decay_gamma": 7.0, "fc_layers": [0, 1]}]
    assert fake.calls[1]["config_source"] == str(code / "configs" / "train.yaml")
    steps = [s.step for s in result.report.trace]
    assert steps.index("check-invariants") < steps.index("look-for-evidence") < steps.index(
        "recheck-invariants") < steps.index("merge-findings")
    merge = next(s for s in result.report.trace if s.step == "merge-findings")
    assert "dflash.loss_decay_gamma" in merge.outcome
    by_id = {f.id: f for f in result.report.findings}
    assert by_id["dflash.loss_decay_gamma"].status == "mismatch"
    assert result.report.run is None and result.report.regression is None
    assert result.report.inputs.config == str(code / "configs" / "train.yaml")
    assert result.exit_code == 1


def test_code_with_an_explicit_config(tmp_path: Path) -> None:
    code = tmp_path / "dflash.py"
    code.write_text("x = 1\n")
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"loss_decay_gamma": 4.0}))
    fake = FakeEngine()
    result = diagnose(DiagnoseRequest(code=code, config=config, out=tmp_path / "out"), engine=fake.engine())
    assert fake.calls[0]["code"] == code and fake.calls[0]["config"] == {"loss_decay_gamma": 4.0}
    assert result.exit_code == 0


@pytest.mark.parametrize(
    ("make_request", "message"),
    [
        (lambda t: DiagnoseRequest(), "nothing to diagnose: give --run NAME|PATH, or --code PATH"),
        (lambda t: DiagnoseRequest(run="v9", runs_dir=t / "runs"), "no run 'v9'"),
        (lambda t: DiagnoseRequest(code=t / "nope.py"), "does not exist"),
        (lambda t: DiagnoseRequest(run="v5", runs_dir=t / "runs", config=t / "missing.yaml"), "--config"),
        (lambda t: DiagnoseRequest(run="v5", runs_dir=t / "runs", reference_path=t / "nowhere"), "--reference-path"),
        (lambda t: DiagnoseRequest(run="v5", runs_dir=t / "runs", baseline="b16"),
         "baseline b16 cannot be compared with v5: other block size (16 vs 8)"),
        (lambda t: DiagnoseRequest(run="v5", runs_dir=t / "runs", baseline="v7"), "no run 'v7'"),
        (lambda t: DiagnoseRequest(run="v5", runs_dir=t / "runs", baseline="v5"),
         "--baseline v5 is the diagnosed run itself"),
    ],
)
def test_user_mistakes_are_one_line_errors(tmp_path: Path, make_request: Any, message: str) -> None:
    runs = _runs(tmp_path, v5={})
    write_run(runs, "b16", config={"block_size": 16})
    with pytest.raises(DiagnoseError) as caught:
        diagnose(make_request(tmp_path), engine=FakeEngine().engine())
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_unparseable_config_file_is_a_one_line_error(tmp_path: Path) -> None:
    code = tmp_path / "dflash.py"
    code.write_text("x = 1\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_size: [8\n")
    with pytest.raises(DiagnoseError, match=r"^config .*bad.yaml does not parse: "):
        diagnose(DiagnoseRequest(code=code, config=bad, out=tmp_path / "o"), engine=FakeEngine().engine())


def test_a_reference_error_is_a_one_line_error(tmp_path: Path) -> None:
    runs = _runs(tmp_path, v5={})
    fake = FakeEngine(reference_error="unknown reference 'nope'; known references: speculators")
    with pytest.raises(DiagnoseError, match="^unknown reference 'nope'; known references: speculators$"):
        diagnose(DiagnoseRequest(run="v5", runs_dir=runs, reference="nope"), engine=fake.engine())


def test_merge_prefers_a_decided_finding_then_confidence() -> None:
    def finding(status: str, confidence: float, fid: str = "a") -> Finding:
        return Finding(id=fid, title=fid, status=status, severity="low", confidence=confidence)  # type: ignore[arg-type]

    merged, improved = merge_findings(
        [finding("unknown", 0.0), finding("match", 0.9, "b"), finding("match", 0.4, "c")],
        [finding("mismatch", 0.5), finding("unknown", 0.0, "b"), finding("match", 0.8, "c"), finding("match", 1.0, "d")],
    )
    assert [(f.id, f.status, f.confidence) for f in merged] == [
        ("a", "mismatch", 0.5), ("b", "match", 0.9), ("c", "match", 0.8), ("d", "match", 1.0)
    ]
    assert improved == ["a", "c"]


def test_the_chart_is_not_redrawn_when_metrics_are_unchanged(tmp_path: Path) -> None:
    runs = _runs(tmp_path, v5={})
    first = diagnose(DiagnoseRequest(run="v5", runs_dir=runs), engine=FakeEngine().engine())
    chart = first.out_dir / "chart.png"
    drawn = chart.read_bytes()
    second = diagnose(DiagnoseRequest(run="v5", runs_dir=runs), engine=FakeEngine().engine())
    outcome = next(s.outcome for s in second.report.trace if s.step == "draw-chart")
    assert outcome == "metrics unchanged: kept the existing chart"
    assert chart.read_bytes() == drawn
    with (runs / "v5" / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 310, "acc": 0.31}) + "\n")
    third = diagnose(DiagnoseRequest(run="v5", runs_dir=runs), engine=FakeEngine().engine())
    assert next(s.outcome for s in third.report.trace if s.step == "draw-chart") == "drawn"


def test_live_listener_shows_agent_steps_and_indents_the_engines(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from sleuth.diagnose import live_listener

    buffer = io.StringIO()
    show = live_listener(Console(file=buffer, width=200, no_color=True))
    show(TraceStep(step="read-run", outcome="v5: 30 metrics rows", duration_s=0.01))
    show(TraceStep(step="analyse-code", outcome="24 file(s) parsed", duration_s=0.3))
    show(TraceStep(step="resolve-reference", outcome="error: boom", duration_s=0.0))
    lines = buffer.getvalue().splitlines()
    assert lines[0].startswith("✓ read-run") and lines[0].endswith("v5: 30 metrics rows  0.01 s")
    assert lines[1].startswith("    ✓ analyse-code")
    assert lines[2].startswith("✗ resolve-reference")


def test_regression_summary_names_the_other_metrics_that_agree(tmp_path: Path) -> None:
    runs = _runs(tmp_path, v5={})
    result = diagnose(DiagnoseRequest(run="v5", runs_dir=runs), engine=FakeEngine().engine())
    assert result.report.regression is not None
    assert result.report.regression.summary == (
        "v5 regressed against v3: at step 300 acc 0.3 vs v3 0.6 (worse; noise threshold 0.0062); "
        "v3 reached v5's final acc 0.3 at step 150, v5 needed 300: 2.0x; streak also worse"
    )


def test_the_chart_shows_the_chosen_baseline_first_among_comparable_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    for name, hour, slope in (("a-worse", "07", 0.0012), ("b-best", "08", 0.003), ("c-mid", "09", 0.002)):
        write_run(runs, name, created=f"2026-11-01T{hour}:00:00+00:00",
                  rows=metrics_rows(STEPS, acc=[slope * s for s in STEPS]))
    write_run(runs, "v5", created="2026-11-01T10:00:00+00:00",
              rows=metrics_rows(STEPS, acc=[0.001 * s for s in STEPS]))
    seen: dict[str, Any] = {}

    def spy(path: Path, series: dict, *, main_label: str) -> str:
        seen["labels"] = list(series)
        return "drawn"

    monkeypatch.setattr("sleuth.report.chart.write_chart", spy)
    result = diagnose(DiagnoseRequest(run="v5", runs_dir=runs), engine=FakeEngine().engine())
    assert result.report.regression is not None and result.report.regression.baseline == "b-best"
    assert seen["labels"] == ["v5", "b-best", "c-mid", "a-worse"]
