"""Recall and false alarms of the invariant engine on the implementation corpus (tests/fixtures/impls).

Each case is a directory of Python source (never imported) with an expected.yaml:
    planted:  [ids of the defects planted in it]
    expected: {id: match | mismatch | unknown}   (the statuses the engine must give, exactly)

    recall       = planted defects reported as mismatch / planted defects
    false alarms = mismatches reported for ids that are not planted defects

Run it to print the table the lead can quote:
    .venv/bin/python tests/sleuth/corpus_metrics.py [corpus_dir]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sleuth.invariants import check_invariants, load_playbook  # noqa: E402
from sleuth.trace import Trace  # noqa: E402

CORPUS = REPO / "tests" / "fixtures" / "impls"


@dataclass
class CaseResult:
    name: str
    statuses: dict[str, str]
    planted: list[str]
    expected: dict[str, str]
    found: list[str] = field(default_factory=list)  # planted defects reported as mismatch
    missed: list[str] = field(default_factory=list)
    false_alarms: list[str] = field(default_factory=list)
    wrong: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (expected, got)


def load_case(case_dir: Path) -> tuple[list[str], dict[str, str]]:
    spec = yaml.safe_load((case_dir / "expected.yaml").read_text()) or {}
    return list(spec.get("planted") or []), dict(spec.get("expected") or {})


def run_case(case_dir: Path, playbook=None) -> CaseResult:
    playbook = playbook or load_playbook("dflash")
    findings = check_invariants(playbook, reference=None, config=None, config_source=None, checkpoint=None,
                                code=case_dir, trace=Trace())
    # The corpus measures what the static reader reads: agreement that the engine reports as unknown (not
    # claimed without a traced path or a probe) counts as "match" here, a defect read as agreement as silent.
    statuses = {f.id: "match" if f.static_agreement else f.status for f in findings}
    planted, expected = load_case(case_dir)
    result = CaseResult(case_dir.name, statuses, planted, expected)
    for inv in planted:
        (result.found if statuses.get(inv) == "mismatch" else result.missed).append(inv)
    result.false_alarms = [i for i, s in statuses.items() if s == "mismatch" and i not in planted]
    result.wrong = {i: (s, statuses.get(i, "absent")) for i, s in expected.items() if statuses.get(i) != s}
    return result


def corpus_cases(corpus: Path = CORPUS) -> list[Path]:
    return sorted(p for p in corpus.iterdir() if (p / "expected.yaml").is_file())


def summarise(results: list[CaseResult]) -> dict[str, float]:
    planted = sum(len(r.planted) for r in results)
    found = sum(len(r.found) for r in results)
    alarms = sum(len(r.false_alarms) for r in results)
    checked = sum(len(r.statuses) for r in results)
    gaps = sum(1 for r in results for e, g in r.wrong.values() if (e, g) == ("match", "unknown"))
    silent = sum(1 for r in results for i in r.planted if r.statuses.get(i) == "match")
    return {"cases": len(results), "planted": planted, "found": found, "recall": found / planted if planted else 1.0,
            "false_alarms": alarms, "checks": checked, "gaps": gaps, "silent": silent}


def main(argv: list[str]) -> int:
    corpus = Path(argv[1]) if len(argv) > 1 else CORPUS
    playbook = load_playbook("dflash")
    results = [run_case(c, playbook) for c in corpus_cases(corpus)]
    for r in results:
        print(f"{r.name:34} planted {len(r.planted)} found {len(r.found)} missed {r.missed or '-'} "
              f"false alarms {r.false_alarms or '-'}" + (f" wrong {r.wrong}" if r.wrong else ""))
    s = summarise(results)
    print(f"\n{s['cases']} cases, {s['checks']} checks: recall {s['found']}/{s['planted']} = {s['recall']:.0%}, "
          f"false alarms {s['false_alarms']}, silent false matches {s['silent']}, "
          f"expected match answered unknown {s['gaps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
