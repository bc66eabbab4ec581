"""Run the mutation operators over implementations and score sleuth's static reading.

For one implementation (a directory of Python source): diagnose it unmutated (the baseline), then for every
operator whose invariant the baseline calls `match`, plant the defect at each site the operator finds (at
most `per_operator` sites), diagnose the mutant and classify the planted invariant's status:

    mismatch   detected
    unknown    missed, honestly (the reading said it could not tell)
    match      SILENT FALSE MATCH: the defect is there and sleuth vouched for the code

Operators with a decoy name also run composed with a rename through an intermediate variable (the mutated
expression moved into `last = ...`), the way names fooled the reader before. Meaning-preserving rewrites
must change no verdict: a match turned mismatch is a false alarm, a mismatch turned match a silent false match.
A mismatch on an invariant the operator does not break is a false alarm too.

    python tests/mutation/mutation_harness.py [DIR ...]      prints the table (default: the corpus and trainer/)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for entry in (str(REPO), str(Path(__file__).resolve().parent)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

from mutation_operators import OPERATORS, REWRITES, Mutant, Source, delete_freeze_line, hoist, read_sources  # noqa: E402

from sleuth.invariants import check_invariants, load_playbook  # noqa: E402
from sleuth.trace import Trace  # noqa: E402

CORPUS = REPO / "tests" / "fixtures" / "impls"
# The reference configuration of our trainer (as `trainer run --preset fixed` resolves it for a tiny target).
TRAINER_CONFIG = {
    "block_size": 8, "draft_layers": 5, "target_layer_ids": [1, 2, 3, 4, 5], "fc_layers": None,
    "target_logits_source": "final", "loss": "ce", "loss_decay_gamma": 4.0, "context_includes_anchor": False,
    "max_anchors": 32,
}
# Invariants that a planted defect may break besides its own, because they read the same expression.
RELATED: dict[str, set[str]] = {
    "dflash.block_position_ids": {"dflash.target_shift"},
    "dflash.target_shift": {"dflash.block_position_ids"},
}


@dataclass
class Outcome:
    implementation: str
    mutant: Mutant
    status: str  # the planted invariant's status (for a rewrite: "kept" or what changed)
    false_alarms: list[str] = field(default_factory=list)
    silent: list[str] = field(default_factory=list)  # ids reported match although the mutant breaks them


@dataclass
class Score:
    outcomes: list[Outcome] = field(default_factory=list)
    baseline_false_alarms: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def planted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.mutant.breaks is not None]

    @property
    def detected(self) -> int:
        return sum(o.status == "mismatch" for o in self.planted)

    @property
    def unknown(self) -> int:
        return sum(o.status == "unknown" for o in self.planted)

    @property
    def silent(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.silent]

    @property
    def false_alarms(self) -> list[str]:
        return self.baseline_false_alarms + [f"{o.implementation}: {o.mutant.operator} at {o.mutant.path}:{o.mutant.line}: {a}"
                                             for o in self.outcomes for a in o.false_alarms]

    def summary(self) -> str:
        n = len(self.planted)
        recall = self.detected / n if n else 1.0
        return (f"{n} planted defects: {self.detected} detected (recall {recall:.0%}), {self.unknown} unknown, "
                f"{sum(1 for o in self.planted if o.silent)} silent false matches; "
                f"{len(self.outcomes) - n} rewrites; {len(self.false_alarms)} false alarms")


def diagnose(root: Path, config: dict | None) -> dict[str, tuple[str, list[tuple[str, int]]]]:
    findings = check_invariants(load_playbook("dflash"), reference=None, config=config,
                                config_source="config.json" if config else None, checkpoint=None, code=root, trace=Trace())
    # What the static reader reads: agreement that the engine reports as unknown (not claimed) still counts
    # as "match" here, so a planted defect read as agreement is a silent false match of the reader.
    return {f.id: ("match" if f.static_agreement else f.status,
                   [(e.path, e.line) for e in f.evidence if e.kind == "code" and e.path and e.line])
            for f in findings}


def mutants_for(root: Path, baseline: dict[str, tuple[str, list[tuple[str, int]]]], per_operator: int = 2) -> list[Mutant]:
    sources = {s.path: s for s in read_sources(root)}
    prefix = root.name + "/"

    def cited(invariant: str) -> dict[str, list[int]]:
        lines: dict[str, list[int]] = {}
        for path, line in baseline.get(invariant, ("", []))[1]:
            rel = path[len(prefix):] if path.startswith(prefix) else path
            if rel in sources:
                lines.setdefault(rel, []).append(line)
        return lines

    out: list[Mutant] = []
    for op in OPERATORS:
        if baseline.get(op.breaks, ("",))[0] != "match":
            continue
        count = 0
        for rel, lines in cited(op.breaks).items():
            src = sources[rel]
            for node, edit, what in op.find(src, lines):
                if count >= per_operator:
                    break
                out.append(Mutant(op.name, op.breaks, rel, node.lineno, what, edit))
                count += 1
                if op.decoy:
                    decoyed = hoist(src, node, edit.text, op.decoy) if edit.before is None else None
                    if decoyed is not None:
                        out.append(Mutant(op.name + "+rename", op.breaks, rel, node.lineno,
                                          f"{what}, through a variable named `{op.decoy}`",
                                          _with_append(decoyed, edit.append)))
    if baseline.get("dflash.frozen_embed_head", ("",))[0] == "match":
        for src, node, edit, what in list(delete_freeze_line(list(sources.values())))[:per_operator + 1]:
            out.append(Mutant("delete_one_freeze", "dflash.frozen_embed_head", src.path, node.lineno, what, edit))
    for rewrite in REWRITES:
        for invariant, (status, _) in baseline.items():
            if status not in ("match", "mismatch"):
                continue
            for rel, lines in cited(invariant).items():
                for node, edit, what in rewrite.find(sources[rel], lines):
                    out.append(Mutant(rewrite.name, None, rel, node.lineno, f"{what} (near {invariant})", edit))
                    break
                break
    unique: dict[tuple, Mutant] = {}
    for m in out:
        unique.setdefault((m.operator, m.path, m.edit), m)
    return list(unique.values())


def _with_append(edit, append):
    from dataclasses import replace

    return replace(edit, append=append) if append else edit


def score(roots: Iterable[tuple[Path, dict | None]], per_operator: int = 2) -> Score:
    result = Score()
    for root, config in roots:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / root.name
            shutil.copytree(root, work, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "expected.yaml"))
            baseline = diagnose(work, config)
            planted = _planted(root)
            result.baseline_false_alarms += [f"{root.name}: unmutated: {i}" for i, (s, _) in baseline.items()
                                             if s == "mismatch" and i not in planted]
            for mutant in mutants_for(work, baseline, per_operator):
                path = work / mutant.path
                original = path.read_text(encoding="utf-8")
                path.write_text(mutant.apply(original), encoding="utf-8")
                try:
                    after = diagnose(work, config)
                finally:
                    path.write_text(original, encoding="utf-8")
                result.outcomes.append(_classify(root.name, mutant, baseline, after))
    return result


def _planted(root: Path) -> set[str]:
    spec = root / "expected.yaml"
    if not spec.is_file():
        return set()
    import yaml

    return set((yaml.safe_load(spec.read_text()) or {}).get("planted") or [])


def _classify(name: str, mutant: Mutant, baseline: dict, after: dict) -> Outcome:
    before = {i: s for i, (s, _) in baseline.items()}
    now = {i: s for i, (s, _) in after.items()}
    allowed = {mutant.breaks} | RELATED.get(mutant.breaks or "", set()) if mutant.breaks else set()
    alarms = [i for i, s in now.items() if s == "mismatch" and before.get(i) != "mismatch" and i not in allowed]
    if mutant.breaks is None:
        silent = [i for i, s in now.items() if before.get(i) == "mismatch" and s == "match"]
        changed = [f"{i}: {before.get(i)} -> {s}" for i, s in now.items() if s != before.get(i)]
        return Outcome(name, mutant, "kept" if not changed else "; ".join(changed), alarms, silent)
    status = now.get(mutant.breaks, "absent")
    return Outcome(name, mutant, status, alarms, [mutant.breaks] if status == "match" else [])


def default_roots() -> list[tuple[Path, dict | None]]:
    roots: list[tuple[Path, dict | None]] = [(p, None) for p in sorted(CORPUS.iterdir()) if (p / "expected.yaml").is_file()]
    roots.append((REPO / "trainer", TRAINER_CONFIG))
    return roots


def report(result: Score) -> str:
    lines = []
    for o in result.outcomes:
        flag = "SILENT" if o.silent else ("ALARM" if o.false_alarms else "")
        lines.append(f"{o.implementation:36} {o.mutant.operator:24} {o.mutant.path}:{o.mutant.line:<5} {o.status:10} {flag} "
                     f"{o.mutant.description[:90]}" + (f" alarms={o.false_alarms}" if o.false_alarms else ""))
    lines += [f"false alarm: {a}" for a in result.baseline_false_alarms]
    lines.append(result.summary())
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    roots = [(Path(a), TRAINER_CONFIG if Path(a).name == "trainer" else None) for a in argv[1:]] or default_roots()
    result = score(roots)
    print(report(result))
    return 1 if result.silent or result.false_alarms else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
