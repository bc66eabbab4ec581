"""One report model, many renderings: JSON round trip, Markdown, SARIF 2.1.0, fix.yaml, ranking, text."""

from __future__ import annotations

import io
import json
from pathlib import Path

import yaml

from sleuth.findings import Evidence, Finding, Fix, TraceStep
from sleuth.regression import Regression
from sleuth.report import REPORT_FILES, Report, Rule, count_findings, rank_findings, render_json, write_report
from sleuth.report.fix import build_fix
from sleuth.report.markdown import render_markdown
from sleuth.report.model import ReferenceSummary, RunSummary
from sleuth.report.sarif import render_sarif

RULES = [
    Rule(id="dflash.target_logits_source", title="Targets from the final layer", what="lm_head(norm(h_L)).",
         why="Acceptance is decided by the final logits.", severity="critical", rank=1),
    Rule(id="dflash.fc_input_layers", title="fc reads all layers", what="fc over all k layers.",
         why="Dropping one lowers acceptance.", example="fc_layers [0,1,2,3]", severity="critical", rank=2),
    Rule(id="dflash.loss_decay_gamma", title="Decay gamma", why="gamma 4 in speculators.", severity="medium", rank=3),
    Rule(id="dflash.fc_norm", title="hidden_norm after fc", why="RMSNorm after fc.", severity="high", rank=4),
]


def finding(fid: str, status: str, severity: str, confidence: float = 0.9, **extra: object) -> Finding:
    return Finding(id=fid, title=fid.split(".")[-1], status=status, severity=severity,  # type: ignore[arg-type]
                   confidence=confidence, **extra)  # type: ignore[arg-type]


def sample_report(tmp_path: Path) -> Report:
    code_file = tmp_path / "code" / "trainer" / "model" / "drafter.py"
    findings = [
        finding("dflash.fc_norm", "unknown", "high", 0.0, reason="checkpoint is corrupt: header is not JSON"),
        finding("dflash.loss_decay_gamma", "mismatch", "medium", expected="4.0", observed="7.0",
                evidence=[Evidence(kind="config", location="config.json:loss_decay_gamma", value="7.0")],
                fix=Fix(config_patch={"loss_decay_gamma": 4.0})),
        finding("dflash.fc_input_layers", "mismatch", "critical", expected="5 layers", observed="4 layers",
                evidence=[Evidence(kind="code", location=f"{code_file}:42", path=str(code_file), line=42,
                                   snippet="self.fc = nn.Linear(4 * H, H)"),
                          Evidence(kind="checkpoint", location="fc.weight", value="[8, 32]"),
                          Evidence(kind="code", location="trainer/run/step.py:7", path="trainer/run/step.py", line=7)],
                fix=Fix(config_patch={"fc_layers": None, "loss_decay_gamma": 7.0})),
        finding("dflash.target_logits_source", "mismatch", "critical", expected="final", observed="layer 9",
                evidence=[Evidence(kind="code", location="trainer/target/frozen.py:88", path="trainer/target/frozen.py",
                                   line=88, commit="abc123")],
                fix=Fix(config_patch={"target_logits_source": "final"}, code_hint="use the model's own logits")),
        finding("dflash.context_excludes_anchor", "mismatch", "critical", 0.7, expected="<", observed="<=",
                fix=Fix(code_hint="use kv_pos < anchor", applicability="unsafe")),
        finding("dflash.block_bidirectional", "match", "high"),
    ]
    ranked = rank_findings(findings, RULES)
    return Report(
        tool_version="0.1.0",
        generated_at="2026-11-30T00:00:00+00:00",
        run=RunSummary(name="v5", path=str(tmp_path), problems=["metrics.jsonl: skipped 1 truncated line"]),
        reference=ReferenceSummary(name="speculators", tier="local", commit="c05b95b" + "0" * 33,
                                   attempts=[{"tier": "local", "tried": "~/spec", "outcome": "ok", "reason": "a|b"}]),
        regression=Regression(run="v5", verdict="unknown", reason="no comparable earlier run in the runs directory",
                              summary="no comparable earlier run in the runs directory"),
        findings=ranked,
        rules=RULES,
        counts=count_findings(ranked),
        summary="v5 has 4 mismatches.",
        trace=[TraceStep(step="read-run", outcome="ok", duration_s=0.01)],
        exit_status=1,
    )


def test_ranking_is_status_then_severity_then_playbook_rank_then_confidence(tmp_path: Path) -> None:
    assert [f.id for f in sample_report(tmp_path).findings] == [
        "dflash.target_logits_source",   # mismatch, critical, rank 1
        "dflash.fc_input_layers",        # mismatch, critical, rank 2
        "dflash.context_excludes_anchor",  # mismatch, critical, not in the playbook: after the ranked ones
        "dflash.loss_decay_gamma",       # mismatch, medium
        "dflash.fc_norm",                # unknown
        "dflash.block_bidirectional",    # match
    ]


def test_json_round_trips_through_the_model(tmp_path: Path) -> None:
    report = sample_report(tmp_path)
    data = json.loads(render_json(report))
    assert data["schema_version"] == 1
    assert Report.model_validate(data) == report


def test_markdown_has_summary_chart_ranked_findings_and_trace_in_order(tmp_path: Path) -> None:
    report = sample_report(tmp_path).model_copy(update={"chart": "chart.png"})
    md = render_markdown(report)
    order = ["## Summary", "v5 has 4 mismatches.", "![", "## Regression", "## Findings, ranked by expected impact",
             "### 1. ✗ mismatch: target_logits_source", "### 2. ✗ mismatch: fc_input_layers", "## Reference",
             "## Trace"]
    positions = [md.index(marker) for marker in order]
    assert positions == sorted(positions)
    assert "- **Expected:** 5 layers" in md and "- **Observed:** 4 layers" in md
    assert "- **Fix (safe):** set `fc_layers: null`, `loss_decay_gamma: 7.0` (in fix.yaml)" in md
    assert "- **Why unknown:** checkpoint is corrupt: header is not JSON" in md
    assert "| local | \\~/spec | ok | a\\|b |" in md  # a pipe in a cell does not break the table (nor ~ strike)
    assert "metrics.jsonl: skipped 1 truncated line" in md


def test_sarif_is_2_1_0_with_rules_and_code_located_mismatches_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    log = render_sarif(sample_report(tmp_path))
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "sleuth"
    rule_ids = [r["id"] for r in driver["rules"]]
    assert rule_ids[:4] == [r.id for r in RULES]
    fc_rule = driver["rules"][1]
    assert fc_rule["shortDescription"]["text"] == "fc reads all layers"
    assert fc_rule["fullDescription"]["text"] == "fc over all k layers. Dropping one lowers acceptance."
    assert fc_rule["help"]["text"] == (
        "fc over all k layers. Dropping one lowers acceptance. Example: fc_layers [0,1,2,3]"
    )
    results = run["results"]
    # Only mismatches with code evidence: the anchor finding has none, gamma is config-only.
    assert [r["ruleId"] for r in results] == ["dflash.target_logits_source", "dflash.fc_input_layers"]
    for result in results:
        assert result["level"] == "error"
        assert driver["rules"][result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["message"]["text"]
        location = result["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uri"] and location["region"]["startLine"] >= 1
    fc = results[1]
    # An absolute path under the working directory becomes a relative URI.
    assert fc["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "code/trainer/model/drafter.py"
    assert fc["locations"][0]["physicalLocation"]["region"]["startLine"] == 42
    assert fc["relatedLocations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "trainer/run/step.py"


def test_sarif_paths_relative_to_the_analysed_code_point_at_the_files(tmp_path: Path, monkeypatch) -> None:
    code = tmp_path / "runs" / "v5" / "code"
    (code / "trainer" / "target").mkdir(parents=True)
    (code / "trainer" / "target" / "frozen.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    report = sample_report(tmp_path)
    report.inputs.code = str(code)
    results = render_sarif(report)["runs"][0]["results"]
    uri = results[0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert uri == "runs/v5/code/trainer/target/frozen.py"
    # The same file named relative to the folder holding the tree ("code/trainer/...").
    report.findings[0].evidence[0].path = "code/trainer/target/frozen.py"
    results = render_sarif(report)["runs"][0]["results"]
    assert results[0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == uri


def test_fix_merges_config_patches_in_rank_order_and_lists_code_changes(tmp_path: Path) -> None:
    document, comments = build_fix(sample_report(tmp_path), "runs/v5/diagnosis/report.md")
    # fc_input_layers (ranked above gamma) wants gamma 7.0; the gamma finding's own 4.0 loses to it and
    # the conflict is named. The target-source finding has a config patch, so it is not a code change.
    assert document == {
        "diagnosed_run": "v5",
        "diagnosed_run_path": str(tmp_path),
        "diagnosed_config_sha256": None,  # the sample run records none: trainer --fixed then checks the name
        "report": "runs/v5/diagnosis/report.md",
        "config_patch": {"target_logits_source": "final", "fc_layers": None, "loss_decay_gamma": 7.0},
        "code_changes": [{"id": "dflash.context_excludes_anchor", "hint": "use kv_pos < anchor"}],
    }
    assert comments[0] == "needs a code change (no config key fixes it): dflash.context_excludes_anchor"
    assert "dflash.loss_decay_gamma also wants loss_decay_gamma: 4.0; kept 7.0 from dflash.fc_input_layers" in comments


def test_write_report_writes_every_file_as_valid_documents(tmp_path: Path) -> None:
    report = sample_report(tmp_path)
    files = write_report(report, tmp_path / "diagnosis")
    assert sorted(files) == sorted(REPORT_FILES)
    assert json.loads(files["report.json"].read_text())["run"]["name"] == "v5"
    assert json.loads(files["report.sarif"].read_text())["version"] == "2.1.0"
    fix = yaml.safe_load(files["fix.yaml"].read_text())
    assert set(fix) == {"diagnosed_run", "diagnosed_run_path", "diagnosed_config_sha256", "report", "config_patch",
                        "code_changes"}
    assert files["report.md"].read_text().startswith("# sleuth diagnosis: v5")
    assert not [p for p in (tmp_path / "diagnosis").iterdir() if p.name.endswith(".partial")]


def test_text_summary_shows_counts_and_the_non_matching_findings(tmp_path: Path) -> None:
    from rich.console import Console

    from sleuth.report.text import print_text

    buffer = io.StringIO()
    print_text(sample_report(tmp_path), Console(file=buffer, width=200, no_color=True), {"report.md": Path("r.md")})
    text = buffer.getvalue()
    assert text.splitlines()[0] == "sleuth diagnose v5: 4 mismatch(es), 1 unknown, 1 match"
    assert "reference: speculators (local tier @ c05b95b00000)" in text
    assert "dflash.fc_input_layers" in text and "4 layers" in text
    assert "unknown (1): fc_norm" in text  # unknowns by id; their reasons are in the report
    assert "block_bidirectional" not in text  # matches stay in the report
    assert text.rstrip().endswith("report: r.md")


def test_text_summary_keeps_each_finding_to_one_short_line(tmp_path: Path) -> None:
    """A finding whose observed value is a paragraph (the train-serve gap's is) is one row of the table, cut at
    its first clause; the paragraph stays in report.md."""
    from rich.console import Console

    from sleuth.findings import Finding
    from sleuth.report.text import brief, print_text

    report = sample_report(tmp_path)
    long = ("real tau falls short of what training measures by 2.41 (11.3 standard errors over prompts); "
            + "explained by the broken invariant(s) this diagnosis found: dflash.context_excludes_anchor " * 6)
    report.findings.insert(0, Finding(id="dflash.train_serve_gap", title="gap", status="mismatch", severity="critical",
                                      observed=long, expected="a gap within noise\nof what training measures",
                                      confidence=0.85))
    buffer = io.StringIO()
    print_text(report, Console(file=buffer, width=140, no_color=True), {"report.md": Path("r.md")})
    rows = [line for line in buffer.getvalue().splitlines() if "dflash.train_serve_gap" in line]
    assert len(rows) == 1
    assert "real tau falls short of what training measures by 2.41 …" in rows[0]
    assert not any("explained by the broken" in line for line in buffer.getvalue().splitlines())
    assert brief("short") == "short" and len(brief("x" * 200)) <= 60
