"""sleuth on defects planted in speculators 0.9.0's real source (bench/upstream_defects), as a black box.

The benchmark copies the installed speculators package once per defect, plants that one defect (exact
text edits from bench/upstream_defects/defects.yaml), runs `sleuth diagnose --code COPY --offline` through
the CLI of the main environment and classifies the verdict on the broken invariant. The bar the issue sets:
no false alarm on the unmodified source, and no silent `match` on a planted defect.

It needs speculators' source (the parity environment: `make parity`) and the main environment that runs
sleuth (`<repo>/.venv`, or a command in $UPSTREAM_BENCH_SLEUTH); without them the benchmark tests skip and
only the harness's own tests run. $UPSTREAM_BENCH_OUT=FILE keeps the full results as JSON (one file per
catalog: FILE's name with `-defects` / `-defects_heldout` added).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from bench.upstream_defects.__main__ import main as bench_main
from bench.upstream_defects.catalog import (
    CATALOG_PATH,
    SOURCE_NAMES,
    CatalogError,
    Defect,
    Edit,
    check_defects_apply,
    copy_with_defect,
    load_catalog,
    resolve_catalog_path,
    resolve_source,
)
from bench.upstream_defects.harness import Diagnosis, classify, run_benchmark, sleuth_command

REQUIRED = os.environ.get("SPECULATORS_PARITY_REQUIRED") == "1"
DFLASH_INVARIANTS = {
    "dflash.target_layer_ids", "dflash.fc_input_layers", "dflash.fc_norm", "dflash.kv_injection",
    "dflash.context_excludes_anchor", "dflash.block_bidirectional", "dflash.blocks_isolated",
    "dflash.block_position_ids", "dflash.target_logits_source", "dflash.target_shift",
    "dflash.anchor_slot_untrained", "dflash.loss_decay_gamma", "dflash.loss_kind", "dflash.frozen_embed_head",
    "dflash.anchor_sampling",
}


# ---- the harness itself: runs anywhere ------------------------------------------------------------------

def _defect(*edits: tuple[str, str, str]) -> Defect:
    return Defect(id="d", source="speculators", invariant="dflash.fc_norm", what="test",
                  edits=[Edit(file=f, find=a, replace=b) for f, a, b in edits])


@pytest.fixture
def tiny_package(tmp_path: Path) -> Path:
    root = tmp_path / "speculators"
    (root / "models").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "models" / "core.py").write_text("x = norm(fc(h))\ny = fc(h)\ny = fc(h)\n")
    return root


def test_catalog_covers_every_invariant_with_enough_defects():
    catalog = load_catalog()
    speculators = [d for d in catalog.defects if d.source == "speculators"]
    assert len(speculators) >= 30
    assert {d.invariant for d in catalog.defects} == DFLASH_INVARIANTS
    assert {d.invariant for d in speculators} == DFLASH_INVARIANTS


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("models/core.py", "y = fc(h)", "y = h"), "occurs 2 times"),
        (("models/core.py", "z = 1", "z = 2"), "occurs 0 times"),
        (("models/core.py", "x = norm(fc(h))", "x = norm(fc(h)"), "no longer parses"),
        (("models/other.py", "a", "b"), "does not exist"),
    ],
)
def test_a_defect_that_does_not_plant_exactly_stops_the_run(tiny_package: Path, edit, message):
    with pytest.raises(CatalogError, match=message):
        check_defects_apply(tiny_package, [_defect(edit)])


def test_the_copy_carries_the_defect_and_the_source_is_untouched(tiny_package: Path, tmp_path: Path):
    original = (tiny_package / "models" / "core.py").read_text()
    copy = copy_with_defect(tiny_package, tmp_path / "copy" / "speculators",
                            _defect(("models/core.py", "x = norm(fc(h))", "x = fc(h)")))
    assert (copy / "models" / "core.py").read_text().startswith("x = fc(h)\n")
    assert (tiny_package / "models" / "core.py").read_text() == original


def _finding(status: str, observed: str | None = "x") -> dict:
    return {"status": status, "observed": observed, "where": None, "reason": ""}


@pytest.mark.parametrize(
    ("status", "others", "unmodified", "error", "expected"),
    [
        ("mismatch", [], {}, None, "detected"),
        ("match", ["dflash.kv_injection"], {}, None, "silent_false_match"),
        ("unknown", ["dflash.kv_injection"], {}, None, "detected_elsewhere"),
        # a mismatch the unmodified source has too is no news
        ("unknown", ["dflash.kv_injection"], {"dflash.kv_injection": _finding("mismatch", None)}, None, "unknown"),
        ("mismatch", [], {"dflash.fc_norm": _finding("mismatch")}, None, "same_as_unmodified"),
        ("mismatch", [], {"dflash.fc_norm": _finding("mismatch", "y")}, None, "detected"),  # told apart
        (None, [], {}, None, "unknown"),  # the invariant is not in the report at all
        (None, [], {}, "exit 2: boom", "error"),
    ],
)
def test_classification(status, others, unmodified, error, expected):
    findings = {i: _finding("mismatch", None) for i in others}
    if status is not None:
        findings["dflash.fc_norm"] = _finding(status)
    result = classify(_defect(("f.py", "a", "b")), Diagnosis(1, 0.1, findings, error), Diagnosis(0, 0.1, unmodified))
    assert result.classification == expected


# ---- the held-out catalog and --catalog: run anywhere ---------------------------------------------------

HELDOUT = "defects_heldout.yaml"


def test_heldout_catalog_is_new_and_covers_every_invariant_and_source():
    heldout = load_catalog(resolve_catalog_path(HELDOUT))
    known = load_catalog()
    assert len(heldout.defects) >= 40
    assert {d.invariant for d in heldout.defects} == DFLASH_INVARIANTS
    assert {d.source for d in heldout.defects} == set(SOURCE_NAMES)
    assert not {d.id for d in heldout.defects} & {d.id for d in known.defects}
    # not one of the known defects under a new name: no held-out edit repeats a known edit
    known_edits = {(d.source, e.file, e.find, e.replace) for d in known.defects for e in d.edits}
    repeated = [d.id for d in heldout.defects if any((d.source, e.file, e.find, e.replace) in known_edits
                                                     for e in d.edits)]
    assert not repeated


@pytest.mark.parametrize("source", SOURCE_NAMES)
def test_every_heldout_defect_plants_once_and_parses(source: str):
    """Needs the source: speculators from the parity venv or $UPSTREAM_SPECULATORS_PATH, SpecForge and z-lab
    from $UPSTREAM_SPECFORGE_PATH / $UPSTREAM_ZLAB_PATH (skipped where absent)."""
    catalog = load_catalog(resolve_catalog_path(HELDOUT))
    root, how = resolve_source(source, catalog.sources[source], None)
    if root is None:
        if REQUIRED and source == "speculators":
            pytest.fail(f"SPECULATORS_PARITY_REQUIRED=1 but {how}", pytrace=False)
        pytest.skip(how)
    check_defects_apply(root, catalog.for_sources([source]))  # raises CatalogError naming the first that fails


def test_catalog_path_resolution(tmp_path: Path):
    assert resolve_catalog_path("defects.yaml") == CATALOG_PATH.resolve()
    assert resolve_catalog_path(HELDOUT).name == HELDOUT
    own = tmp_path / "mine.yaml"
    own.write_text(CATALOG_PATH.read_text())
    assert resolve_catalog_path(own) == own.resolve()
    with pytest.raises(CatalogError, match="no catalog file"):
        resolve_catalog_path(tmp_path / "missing.yaml")


@pytest.mark.parametrize(("text", "message"), [("defects: [", "not valid YAML"), ("[1, 2]", "validation error")])
def test_a_broken_catalog_is_one_line_and_exit_2(tmp_path: Path, capsys, text: str, message: str):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert bench_main(["--catalog", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


# A stand-in for sleuth's CLI, so that the harness (not sleuth) is what this test exercises: it reports
# fc_norm `mismatch` when the code it is given no longer calls hidden_norm, `match` otherwise.
FAKE_SLEUTH = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
code, out = Path(args[args.index("--code") + 1]), Path(args[args.index("--out") + 1])
text = "".join(p.read_text() for p in sorted(code.rglob("*.py")))
status = "match" if "hidden_norm(" in text else "mismatch"
out.mkdir(parents=True)
(out / "report.json").write_text(json.dumps({"findings": [
    {"id": "dflash.fc_norm", "status": status, "observed": "none" if status == "mismatch" else "rmsnorm"}]}))
"""


def test_catalog_option_runs_the_given_catalog(tmp_path: Path, capsys):
    package = tmp_path / "src" / "speculators"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text("def forward(fc, hidden_norm, h):\n    return hidden_norm(fc(h))\n")
    catalog = tmp_path / "tiny.yaml"
    catalog.write_text(yaml.safe_dump({
        "sources": {"speculators": {"package": "speculators", "written_against": "test", "env": "UNUSED_ENV"}},
        "defects": [
            {"id": "tiny-norm-removed", "source": "speculators", "invariant": "dflash.fc_norm", "what": "norm dropped",
             "edits": [{"file": "core.py", "find": "hidden_norm(fc(h))", "replace": "fc(h)"}]},
            {"id": "tiny-norm-kept", "source": "speculators", "invariant": "dflash.fc_norm", "what": "a comment",
             "edits": [{"file": "core.py", "find": "h):", "replace": "h):  # a comment"}]},
        ],
    }))
    fake = tmp_path / "fake_sleuth.py"
    fake.write_text(FAKE_SLEUTH)
    out = tmp_path / "result.json"
    code = bench_main(["--catalog", str(catalog), "--sources", "speculators", "--speculators", str(package),
                       "--sleuth", f"{sys.executable} {fake}", "--jobs", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["catalog"] == str(catalog.resolve())
    assert {r["id"]: r["classification"] for r in result["defects"]} == {
        "tiny-norm-removed": "detected", "tiny-norm-kept": "silent_false_match"}
    assert f"catalog: {catalog.resolve()}" in capsys.readouterr().out


def test_a_rewrite_is_kept_unless_it_turns_something_mismatch():
    from bench.upstream_defects.catalog import Expectation

    rewrite = _defect(("f.py", "a", "b")).model_copy(update={"expect": Expectation(status="clean")})
    unmodified = Diagnosis(0, 0.1, {"dflash.kv_injection": _finding("mismatch")})
    kept = classify(rewrite, Diagnosis(0, 0.1, {"dflash.kv_injection": _finding("mismatch"),
                                                "dflash.fc_norm": _finding("match")}), unmodified)
    alarm = classify(rewrite, Diagnosis(1, 0.1, {"dflash.fc_norm": _finding("mismatch")}), unmodified)
    assert (kept.classification, alarm.classification) == ("kept", "false_alarm")


# ---- the benchmark on speculators' real source: the parity environment ---------------------------------

# Both catalogs: the 65 defects sleuth's readers were fixed against, and the 45 planted blind afterwards
# (held out: the measure of whether a fix generalises).
@pytest.fixture(scope="module", params=["defects.yaml", HELDOUT])
def speculators_result(request) -> dict:
    catalog = load_catalog(resolve_catalog_path(request.param))
    if importlib.util.find_spec("speculators") is None and not os.environ.get("UPSTREAM_SPECULATORS_PATH"):
        if REQUIRED:
            pytest.fail("SPECULATORS_PARITY_REQUIRED=1 but speculators is not installed here", pytrace=False)
        pytest.skip("speculators is not installed in this environment; the benchmark runs in the parity venv "
                    "(`make parity`)")
    root, how = resolve_source("speculators", catalog.sources["speculators"], None)
    if root is None:
        pytest.fail(f"speculators is importable but its source was not found: {how}", pytrace=False)
    try:
        command = sleuth_command()
    except CatalogError as exc:
        pytest.skip(f"no environment to run sleuth in: {exc}")
    result = run_benchmark(catalog, ["speculators"], {}, command, jobs=2)
    if out := os.environ.get("UPSTREAM_BENCH_OUT"):  # keep the numbers behind a CI verdict
        path = Path(out)
        path.with_name(f"{path.stem}-{Path(request.param).stem}{path.suffix}").write_text(json.dumps(result, indent=2) + "\n")
    return result


@pytest.mark.slow
def test_every_speculators_defect_was_diagnosed(speculators_result: dict):
    errors = {r["id"]: r["error"] for r in speculators_result["defects"] if r["classification"] == "error"}
    assert not errors, f"sleuth failed on planted defects: {errors}"
    assert speculators_result["unmodified"]["speculators"]["error"] is None


@pytest.mark.slow
def test_no_false_alarm_on_unmodified_speculators(speculators_result: dict):
    assert speculators_result["unmodified"]["speculators"]["false_alarms"] == []


@pytest.mark.slow
def test_no_silent_false_match_on_planted_speculators_defects(speculators_result: dict):
    silent = [f"{r['id']} ({r['invariant']} reported match, observed {r['observed']!r})"
              for r in speculators_result["defects"] if r["classification"] == "silent_false_match"]
    assert not silent, f"{len(silent)} silent false matches: " + "; ".join(silent)


# ---- does a planted defect change behaviour? (bench.upstream_defects.behaviour, parity venv) -----------

@pytest.mark.slow
def test_behaviour_probe_tells_a_real_defect_from_a_no_op(tmp_path: Path, capsys):
    """The probe that checks every catalogued defect changes what speculators computes: a held-out defect
    moves the loss, a comment-only edit moves nothing."""
    pytest.importorskip("speculators", reason="the probes import speculators: run in the parity venv")
    from bench.upstream_defects.behaviour.__main__ import main as behaviour_main

    heldout = yaml.safe_load(resolve_catalog_path(HELDOUT).read_text())
    real = next(d for d in heldout["defects"] if d["id"] == "hs-spec-gamma-scaled-by-block")
    no_op = {"id": "comment-only", "source": "speculators", "invariant": "dflash.loss_decay_gamma",
             "what": "a comment", "edits": [{"file": real["edits"][0]["file"], "find": real["edits"][0]["find"],
                                             "replace": real["edits"][0]["find"] + "  # a comment"}]}
    catalog = tmp_path / "probe.yaml"
    catalog.write_text(yaml.safe_dump({"sources": heldout["sources"], "defects": [real, no_op]}))
    assert behaviour_main(["--catalog", str(catalog), "--sources", "speculators"]) == 0
    out = capsys.readouterr().out
    assert "hs-spec-gamma-scaled-by-block: changed (loss_T32_fixed-exp-decay" in out
    assert "comment-only: not exercised" in out


# ---- with probes: the blind catalog of defects for the probes (defects_probes.yaml, parity venv) ----------

PROBES_CATALOG = "defects_probes.yaml"  # 30 defects and 7 rewrites planted blind in speculators 0.9.0 and SpecForge 0.2.0


@pytest.fixture(scope="module")
def probes_result() -> dict:
    from bench.upstream_defects.harness import ProbeOptions

    catalog = load_catalog(resolve_catalog_path(PROBES_CATALOG))
    for name in ("speculators", "specforge"):
        if importlib.util.find_spec(name) is None:
            if REQUIRED:
                pytest.fail(f"SPECULATORS_PARITY_REQUIRED=1 but {name} is not installed here", pytrace=False)
            pytest.skip(f"{name} is not installed here: the probe benchmark runs in the parity venv (`make parity`)")
    try:
        command = sleuth_command()
    except CatalogError as exc:
        pytest.skip(f"no environment to run sleuth in: {exc}")
    result = run_benchmark(catalog, ["speculators", "specforge"], {}, command, jobs=2,
                           probes=ProbeOptions(python=sys.executable))
    if out := os.environ.get("UPSTREAM_BENCH_OUT"):
        path = Path(out)
        path.with_name(f"{path.stem}-{Path(PROBES_CATALOG).stem}{path.suffix}").write_text(json.dumps(result, indent=2) + "\n")
    return result


# The bar, as measured (BENCHMARKS.md, "Probes on planted upstream defects"): a later change may find more,
# never fewer, and never trade a find for a silent match or a false alarm.
PROBES_CATALOG_FOUND = 30  # of 30, at 5e1bba5


@pytest.mark.slow
@pytest.mark.catalog
def test_probes_catalog_meets_its_bar(probes_result: dict):
    """With --probe: every copy diagnosed; no planted defect reported `match`; no mismatch on the unmodified
    sources, and every behaviour-preserving rewrite kept; at least the measured number of defects found."""
    t = probes_result["totals"]
    rows = {r["id"]: (r["classification"], r["status"], str(r["observed"])[:80]) for r in probes_result["defects"]}
    assert t["error"] == 0 and t["unmodified_errors"] == 0, rows
    silent = {k: v for k, v in rows.items() if v[0] == "silent_false_match" or (v[1] == "match" and v[0] != "kept")}
    assert not silent, silent
    assert t["false_alarms"] == 0, ({n: u["false_alarms"] for n, u in probes_result["unmodified"].items()},
                                   {k: v for k, v in rows.items() if v[0] == "false_alarm"})
    assert t["rewrites"] == 7 and t["kept"] == 7, rows
    assert t["detected"] >= PROBES_CATALOG_FOUND, rows
