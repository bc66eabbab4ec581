"""Evaluate a playbook's invariants against a run: expected from the reference, observed from the run.

Rules of evidence:
  * every status cites where its values were read (reference path:line@commit, config key, tensor, code
    path:line); no evidence -> `unknown` with the reason, never `mismatch` from absence of evidence;
  * observed precedence: the run's resolved config (what actually ran) decides config-driven switches;
    the checkpoint's shapes corroborate (or contradict) it; static code analysis gives hard-coded
    behaviour and defaults. A code reading that is behind a runtime switch sends the engine to the config
    and the checkpoint, and the trace shows that step;
  * expected precedence: the reference's source files (read with the same static extractors), else its
    docs (lower confidence), else the pinned fact at its stated commit (lower confidence, said so);
  * a run whose own config cannot be read (missing, not JSON, not a mapping, not UTF-8): every invariant
    the config decides is `unknown` with that reason; the code's defaults never stand in for it (only a
    hard-coded violation, which no config could change, is still a mismatch). A config value of the wrong
    type for a rule makes that rule `unknown` the same way;
  * conflicts are findings: when config, checkpoint and hard-coded code disagree, the notes say
    `conflict:`, the confidence is scaled by CONFLICT_FACTOR, and the code decides code-level facts.

Readers are looked up by id in sleuth/evidence/registry.py; nothing here is specific to one invariant.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sleuth.evidence import checkpoint as ckpt
from sleuth.evidence.config import ConfigReading, RunMeta, find_run_meta, lookup, read_config
from sleuth.evidence.registry import registered
from sleuth.findings import Evidence, Finding, Fix
from sleuth.invariants.playbook import Invariant, Playbook
from sleuth.trace import Trace

if TYPE_CHECKING:  # the source analyser is imported only when there is source to read
    from sleuth.evidence.source import CodeReading, SourceFacts

SOURCE_TIERS = ("local", "git-pull", "raw")
# How much an expected value is trusted, by where it came from.
EXPECTED_FACTOR = {"reference": 1.0, "docs": 0.6, "pinned": 0.85, "playbook": 0.8}
# Marks a config note that says the run's value for a rule is present but unreadable.
CONFIG_VALUE_INVALID = "config value invalid: "
# When two sources disagree, the finding says `conflict` and its confidence is scaled by this.
CONFLICT_FACTOR = 0.8
# Code readings at or above this confidence may overrule a config that claims the reference behaviour.
HARDCODED_OVERRULE = 0.75


class ResolvedFileLike(Protocol):
    path: str
    commit: str | None
    text: str


class ResolutionLike(Protocol):
    """Duck type of sleuth.reference.Resolution (not imported: the engine must not depend on it)."""

    reference: str
    tier: str | None
    commit: str | None
    files: list[Any]
    docs: list[Any]
    pinned: dict


@dataclass
class ExpectedValue:
    value: object
    accept: list[object]
    source: str  # reference | docs | pinned | playbook
    evidence: list[Evidence]
    notes: list[str] = field(default_factory=list)

    @property
    def factor(self) -> float:
        return EXPECTED_FACTOR[self.source]


@dataclass
class Observation:
    value: object
    source: str  # config | checkpoint | code
    confidence: float
    evidence: list[Evidence]
    detail: str = ""
    count: int | None = None  # a layer count the reading implies (fc inputs), to compare sources exactly
    mode: str = "read"  # for code: hardcoded | default | switch (how the behaviour is set)


class _Run:
    """Everything read once per check: run metadata, code facts, checkpoint header, reference facts."""

    def __init__(self, reference, config, config_source, checkpoint, code, trace: Trace, config_problem: str | None = None):
        self.reference = reference
        self.config = config if isinstance(config, dict) else None
        self.config_source = config_source or "config"
        # Why the run's own config could not be read, when it should have been there: what ran is then
        # unknown, and the code's defaults must not stand in for it.
        if config_problem is None and config is not None and not isinstance(config, dict):
            config_problem = f"the run's config is a {type(config).__name__}, not a mapping of config keys"
        self.config_problem = config_problem
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.code = Path(code) if code is not None else None
        self.trace = trace
        self.meta: RunMeta = find_run_meta(config_source, self.checkpoint, self.config)
        self._code_facts: SourceFacts | None = None
        self._ref_facts: SourceFacts | None = None
        self._header: dict | None = None
        self.header_error: str | None = None
        self._header_read = False

    # --- code ------------------------------------------------------------------------------------------
    @property
    def code_facts(self) -> SourceFacts | None:
        if self.code is None:
            return None
        if self._code_facts is None:
            from sleuth.evidence.source import analyse_path

            with self.trace.step("analyse-code", path=str(self.code)) as step:
                self._code_facts = analyse_path(self.code)
                bad = ", ".join(f"{e.path} ({e.message})" for e in self._code_facts.errors)
                harness = ", ".join(f"{path} ({why})" for path, why in self._code_facts.excluded.items())
                step.outcome = f"{len(self._code_facts.files)} file(s) parsed statically" + (
                    f"; not analysed: {bad}" if bad else "") + (f"; not the implementation: {harness}" if harness else "")
        return self._code_facts

    # --- checkpoint ------------------------------------------------------------------------------------
    @property
    def header(self) -> dict | None:
        if self.checkpoint is None:
            return None
        if not self._header_read:
            self._header_read = True
            with self.trace.step("read-checkpoint", path=str(self.checkpoint)) as step:
                try:
                    self._header = ckpt.read_header(self.checkpoint)
                    step.outcome = f"{len(self._header)} tensors in the safetensors header"
                except ckpt.CheckpointError as exc:
                    self.header_error = str(exc)
                    step.outcome = f"unreadable: {exc}"
        return self._header

    # --- reference -------------------------------------------------------------------------------------
    @property
    def has_reference_source(self) -> bool:
        ref = self.reference
        return ref is not None and getattr(ref, "tier", None) in SOURCE_TIERS and bool(getattr(ref, "files", None))

    @property
    def reference_facts(self) -> SourceFacts | None:
        if not self.has_reference_source:
            return None
        if self._ref_facts is None:
            from sleuth.evidence.source import analyse_texts

            files = [f for f in self.reference.files if str(getattr(f, "path", "")).endswith(".py")]
            with self.trace.step("analyse-reference", reference=getattr(self.reference, "reference", None),
                                 commit=getattr(self.reference, "commit", None), files=len(files)) as step:
                self._ref_facts = analyse_texts(
                    (f.path, getattr(f, "text", "") or "", getattr(f, "commit", None) or getattr(self.reference, "commit", None))
                    for f in files
                )
                step.outcome = f"{len(self._ref_facts.files)} reference file(s) parsed statically"
        return self._ref_facts

    def reference_paths(self) -> set[str]:
        return {str(f.path) for f in getattr(self.reference, "files", []) or []}

    def block_size(self) -> tuple[int | None, Evidence | None]:
        found = lookup(self.config, ["block_size"])
        if found is not None and isinstance(found[1], int):
            return found[1], Evidence(kind="config", location=f"{self.config_source}:{found[0]}", value=str(found[1]))
        facts = self.code_facts
        if facts is not None and self.config_problem is None:
            readings = facts.readings.get("block_size", [])
            if readings:
                r = readings[0]
                return int(r.value), _code_evidence(r)
        return None, None


def check_invariants(
    playbook: Playbook,
    *,
    reference: ResolutionLike | None = None,
    config: dict | None = None,
    config_source: str | None = None,
    checkpoint: Path | None = None,
    code: Path | None = None,
    trace: Trace | None = None,
    config_problem: str | None = None,
) -> list[Finding]:
    """One Finding per invariant of the playbook, in rank order (largest expected impact first).

    `config_problem` says why a run's config, which should exist, could not be read: every invariant the
    config decides is then `unknown` with that reason (the code's defaults are not what ran)."""
    trace = trace if trace is not None else Trace()
    run = _Run(reference, config, config_source, checkpoint, code, trace, config_problem)
    # An invariant the playbook scopes to other DFlash-family variants is not checked (no placeholder either).
    from sleuth.evidence.variant import detect_variant

    kind = detect_variant(run.config, tensor_names=run.header or {}).kind
    scoped = [i for i in playbook.invariants if not i.variants or kind in i.variants]
    return [_evaluate(invariant, run) for invariant in sorted(scoped, key=lambda i: i.rank)]


# ---------------------------------------------------------------------------------------------------------
# expected


def _expected(inv: Invariant, run: _Run) -> ExpectedValue:
    spec = inv.expected
    with run.trace.step("read-expected", invariant=inv.id) as step:
        facts = run.reference_facts
        notes: list[str] = []
        if facts is not None and spec.extractor:
            present = run.reference_paths()
            wanted = [p for p in spec.reference_files if p]
            missing = [p for p in wanted if p not in present]
            readings = [r for r in facts.readings.get(spec.extractor, []) if r.mode != "variant"]
            if wanted:
                readings = [r for r in readings if r.path in wanted]
            found = _expected_from_readings(inv, readings, run)
            if found is not None:
                step.outcome = f"{found.value!r} from the reference source ({found.evidence[0].location})"
                return found
            if missing:
                notes.append(f"reference files missing from the resolution: {', '.join(missing)}; using the pinned fact")
            else:
                notes.append("the reference source did not show this rule statically; using the pinned fact")
        elif facts is not None and not spec.extractor:
            notes.append("no static extractor reads this rule from the reference; using the pinned fact")
        elif run.reference is not None and getattr(run.reference, "docs", None) and spec.docs_pattern:
            found = _expected_from_docs(inv, run)
            if found is not None:
                step.outcome = f"{found.value!r} from the reference docs (low confidence)"
                return found
            notes.append("the reference docs do not state it; using the pinned fact")
        elif run.reference is None:
            notes.append("no reference was resolved; using the playbook's pinned fact")
        else:
            notes.append(f"the reference resolved to tier {getattr(run.reference, 'tier', None)!r} without source files; using the pinned fact")
        result = _expected_pinned(inv, run)
        result.notes = notes + result.notes
        step.outcome = f"{result.value!r} from the pinned fact ({result.evidence[0].location if result.evidence else 'playbook'})"
        return result


def _expected_from_readings(inv: Invariant, readings: list[CodeReading], run: _Run) -> ExpectedValue | None:
    spec = inv.expected
    if not readings:
        return None
    if _is_number(spec.value) or spec.value is None:
        numbers = [r for r in readings if r.mode in ("hardcoded", "default") and (_is_number(r.value) or r.value is None)]
        if not numbers:
            return None
        counts = Counter(r.value for r in numbers)
        value, _ = counts.most_common(1)[0]
        chosen = [r for r in numbers if r.value == value]
        notes = []
        if len(counts) > 1:
            notes.append("the reference sets several values: " + ", ".join(f"{v!r} ({n}x)" for v, n in counts.items()))
        return ExpectedValue(value, list(spec.accept), "reference", [_code_evidence(r, kind="reference") for r in chosen[:3]], notes)
    confirming = [r for r in readings if r.value == spec.value]
    if confirming:
        best = sorted(confirming, key=lambda r: (r.mode != "hardcoded", -r.confidence))
        return ExpectedValue(spec.value, list(spec.accept), "reference", [_code_evidence(r, kind="reference") for r in best[:2]])
    # Only a certain reading may overrule the playbook's rule: an extractor's guess (`final?`, "named as the
    # last layer, origin not traced") outranking the rule turned a correct run into a critical mismatch.
    decisive = [r for r in readings if r.mode == "hardcoded" and not _uncertain(r)]
    if decisive:
        top = max(decisive, key=lambda r: r.confidence)
        return ExpectedValue(top.value, list(spec.accept), "reference", [_code_evidence(top, kind="reference")],
                             [f"the reference's code says {top.value!r}, the playbook's rule says {spec.value!r}: the reference wins"])
    return None


def _uncertain(reading: CodeReading) -> bool:
    """A reading the extractor itself marks as a guess: a value ending in `?`, or confidence below one half."""
    return (isinstance(reading.value, str) and reading.value.endswith("?")) or reading.confidence < 0.5


def _expected_from_docs(inv: Invariant, run: _Run) -> ExpectedValue | None:
    pattern = re.compile(inv.expected.docs_pattern or "", re.I)
    for doc in run.reference.docs:
        text = getattr(doc, "text", "") or ""
        match = pattern.search(text)
        if match:
            raw = match.group(1)
            value: object = float(raw) if _is_number(inv.expected.value) else raw
            line = text.count("\n", 0, match.start()) + 1
            evidence = Evidence(kind="docs", location=f"{doc.path}:{line}", value=str(value), snippet=match.group(0)[:200],
                                path=str(doc.path), line=line, commit=getattr(doc, "commit", None))
            return ExpectedValue(value, list(inv.expected.accept), "docs", [evidence], ["read from documentation, not source: lower confidence"])
    return None


def _expected_pinned(inv: Invariant, run: _Run) -> ExpectedValue:
    spec = inv.expected
    pinned_facts = getattr(run.reference, "pinned", None) or {}
    fact = pinned_facts.get(inv.id) if isinstance(pinned_facts, dict) else None
    value = spec.pinned.value if spec.pinned is not None else spec.value
    if fact:
        fact = fact if isinstance(fact, dict) else dict(fact)
        commit = fact.get("commit") or getattr(run.reference, "commit", None)
        described = fact.get("expected")
        if _is_number(spec.value) and isinstance(described, dict):
            numbers = [v for k, v in described.items() if _is_number(v) and "gamma" in str(k)]
            value = float(numbers[0]) if numbers else value
        location = f"{fact.get('location')}@{(commit or '?')[:12]}"
        evidence = Evidence(kind="pinned", location=location, value=str(value),
                            snippet=str(described)[:300] if described is not None else None, commit=commit)
        notes = [f"pinned fact of reference {getattr(run.reference, 'reference', '?')} at commit {(commit or '?')[:12]}, not read from live source"]
        if fact.get("note"):
            notes.append(str(fact["note"]))
        return ExpectedValue(value, list(spec.accept), "pinned", [evidence], notes)
    if spec.pinned is not None:
        location = f"{spec.pinned.location}@{spec.pinned.commit or '?'}"
        evidence = Evidence(kind="pinned", location=location, value=str(value), commit=spec.pinned.commit)
        return ExpectedValue(value, list(spec.accept), "pinned", [evidence],
                             [f"pinned in the playbook at commit {spec.pinned.commit}, not read from live source"])
    return ExpectedValue(value, list(spec.accept), "playbook", [], ["the playbook's rule; no reference location known"])


# ---------------------------------------------------------------------------------------------------------
# observed


def _config_observation(inv: Invariant, run: _Run) -> tuple[Observation | None, list[str]]:
    spec = inv.observed.config
    if spec is None or run.config is None:
        return None, []
    with run.trace.step("read-observed", invariant=inv.id, source="config", keys=spec.keys) as step:
        reading: ConfigReading | None = read_config(spec.reader, run.config, spec.keys, run.meta)
        if reading is None:
            present = lookup(run.config, spec.keys)
            if present is not None and present[1] is not None:
                # The key is there but its value is not one this rule knows (wrong type, unknown word):
                # what ran is unreadable, and the code's default must not stand in for it. A null is
                # different: it is the config saying "the code decides" (target_layer_ids null = the rule
                # derived from the target's depth), so the code's reading stands.
                problem = f"{run.config_source}:{present[0]} = {_text(present[1])[:80]!r} is not a valid value for this rule"
                step.outcome = problem
                return None, [CONFIG_VALUE_INVALID + problem]
            step.outcome = f"none of {spec.keys} in {run.config_source}"
            return None, []
        location = reading.location or f"{run.config_source}:{reading.key}"
        evidence = Evidence(kind="config", location=location, value=_text(reading.raw))
        # for a number, null is a value (gamma null = no decay); elsewhere None means "does not decide"
        decides = reading.confidence > 0 and (reading.value is not None or spec.reader in ("number", "decay_gamma"))
        if not decides:
            step.outcome = f"{reading.key} = {reading.raw!r}: does not decide this rule ({reading.detail})"
            extra = [reading.detail] if spec.reader in ("target_layer_ids", "target_fidelity") and reading.detail else []
            return None, reading.notes + extra
        step.outcome = f"{reading.key} = {reading.raw!r} -> {reading.value!r}"
        observation = Observation(reading.value, "config", reading.confidence, [evidence], reading.detail, reading.count)
        return observation, reading.notes


def _checkpoint_observation(inv: Invariant, run: _Run) -> tuple[Observation | None, str | None]:
    spec = inv.observed.checkpoint
    if spec is None or run.checkpoint is None:
        return None, None
    header = run.header
    if header is None:
        return None, f"checkpoint {run.checkpoint} is unreadable: {run.header_error}"
    with run.trace.step("read-observed", invariant=inv.id, source="checkpoint", extractor=spec.extractor) as step:
        reader = registered("checkpoint")[spec.extractor].func
        reading = reader(ckpt.CheckpointInput(run.checkpoint, header, list(spec.tensors), run.config, run.config_source))
        step.outcome = reading.outcome
        if reading.value is None:
            return None, reading.reason
        evidence = [Evidence(kind=kind, location=location, value=value) for kind, location, value in reading.evidence]
        return Observation(reading.value, "checkpoint", reading.confidence, evidence, reading.detail, reading.count), None


def _code_observation(inv: Invariant, run: _Run, ok) -> tuple[Observation | None, str | None, list[str]]:
    """(observation, reason when undecided, notes). `ok(value)` says whether a value satisfies the rule."""
    if inv.observed.code is None or run.code is None:
        return None, None, []
    facts = run.code_facts
    with run.trace.step("read-observed", invariant=inv.id, source="code", extractor=inv.observed.code) as step:
        readings = [r for r in facts.readings.get(inv.observed.code, []) if r.mode != "variant"]
        errors = facts.errors
        error_note = ("; not analysed (parse errors): " + ", ".join(f"{e.path} ({e.message})" for e in errors)) if errors else ""
        readings = [_resolve_count(r, run) for r in readings]
        decisive = [r for r in readings if r.mode in ("hardcoded", "default") and r.value is not None and not str(r.value).startswith("count:")]
        switches = [r for r in readings if r.mode == "switch" or r.value is None or str(r.value).startswith("count:")]
        if decisive:
            agree = [r for r in decisive if ok(r.value) is True]
            disagree = [r for r in decisive if ok(r.value) is False]
            undecided = [r for r in decisive if ok(r.value) is None]
            notes = []
            if disagree and (not agree or max(r.confidence for r in disagree) >= max(r.confidence for r in agree)):
                top = max(disagree, key=lambda r: (r.mode == "hardcoded", r.confidence))
                if agree:
                    notes.append("other code agrees with the rule: " + ", ".join(f"{r.path}:{r.line}" for r in agree[:3]))
                conf = top.confidence * (0.8 if top.mode == "default" else 1.0)
                step.outcome = f"{top.value!r} at {top.path}:{top.line} ({top.mode}, confidence {conf:.2f})"
                return Observation(top.value, "code", conf, [_code_evidence(top)] + [_code_evidence(r) for r in disagree if r is not top][:2], top.detail, mode=top.mode), None, notes
            if agree:
                top = max(agree, key=lambda r: (r.mode == "hardcoded", r.confidence))
                if disagree:
                    notes.append("some code disagrees (lower confidence): " + ", ".join(f"{r.path}:{r.line} {r.value!r}" for r in disagree[:3]))
                conf = top.confidence * (0.8 if top.mode == "default" else 1.0)
                step.outcome = f"{top.value!r} at {top.path}:{top.line} ({top.mode}, confidence {conf:.2f})"
                return Observation(top.value, "code", conf, [_code_evidence(top)], top.detail, mode=top.mode), None, notes
            if undecided:
                top = undecided[0]
                step.outcome = f"{top.value!r} at {top.path}:{top.line}: cannot be judged without more context"
                return Observation(top.value, "code", top.confidence * 0.5, [_code_evidence(top)], top.detail, mode=top.mode), None, notes
        if switches:
            values = {str(r.value) for r in switches if r.value is not None}
            where = ", ".join(f"{r.path}:{r.line}" for r in switches[:3])
            switch_names = sorted({r.switch for r in switches if r.switch})
            oks = [ok(r.value) for r in switches if r.value is not None and not str(r.value).startswith("count:")]
            if oks and all(o is True for o in oks) and len(values) == 1:
                top = switches[0]
                step.outcome = f"{top.value!r} behind `{top.switch}` at {top.path}:{top.line}; no alternative seen"
                return Observation(top.value, "code", 0.55, [_code_evidence(r) for r in switches[:2]], mode="switch", detail=
                                   f"{top.detail} (behind `{top.switch}`; no other branch seen)"), None, []
            off_by_default = [r for r in switches if r.mode == "default" and r.value is None]
            if off_by_default and len(off_by_default) == len(switches):
                what = f"the code's default is None (off unless a config sets it) at {where}"
            else:
                what = f"the code sets this at run time ({', '.join(f'`{s}`' for s in switch_names[:2]) or 'a runtime value'} at {where})"
            step.outcome = f"config-driven: {what}; deferring to the run's config / checkpoint"
            return None, f"{what}; the run's config or checkpoint must say which was used" + error_note, []
        step.outcome = "no reading in the code" + error_note
        return None, (f"the code does not show this rule statically ({len(facts.files)} file(s) analysed{error_note})"), []


def _resolve_count(r: CodeReading, run: _Run) -> CodeReading:
    """A hard-coded layer count ('count:4', e.g. fc's inputs) becomes all/subset once the number of selected
    layers is known."""
    if not str(r.value).startswith("count:"):
        return r
    from sleuth.evidence.source import CodeReading

    n = int(str(r.value).split(":", 1)[1])
    ids = lookup(run.config, ["target_layer_ids", "aux_hidden_state_layer_ids"])
    if ids is not None and isinstance(ids[1], list):
        value = "all" if n == len(ids[1]) else "subset"
        return CodeReading(r.invariant, value, r.path, r.line, r.snippet, r.confidence, r.mode, r.switch,
                           f"{r.detail}; {len(ids[1])} layers selected", r.commit, r.scope)
    return r


# ---------------------------------------------------------------------------------------------------------
# decision


def _evaluate(inv: Invariant, run: _Run) -> Finding:
    expected = _expected(inv, run)
    notes = list(expected.notes) + list(inv.notes)
    if run.config_problem is not None and inv.observed.config is not None:
        return _config_unreadable(inv, run, expected, notes, run.config_problem)
    block_size, block_evidence = run.block_size() if inv.expected.conditional_accept else (None, None)

    def ok(value: object) -> bool | None:
        return _satisfies(inv, expected, value, block_size)

    code_obs, code_reason, code_notes = _code_observation(inv, run, ok)
    low_confidence_code = code_obs is None or code_obs.confidence < 0.6
    # (an invariant that no source extractor reads, e.g. one judged from run.json, skips this step)
    if (low_confidence_code and inv.observed.code and (inv.observed.config is not None or inv.observed.checkpoint is not None)
            and run.code is not None):
        # the code alone does not settle it: go to what the run actually used
        with run.trace.step("defer", invariant=inv.id, source="code",
                            to=[s for s in ("config", "checkpoint") if getattr(inv.observed, s) is not None]) as step:
            step.outcome = (code_reason or f"code reading has low confidence ({code_obs.confidence:.2f})") + \
                " -> reading the run's config / checkpoint"
    config_obs, config_notes = _config_observation(inv, run)
    invalid = [n.removeprefix(CONFIG_VALUE_INVALID) for n in config_notes if n.startswith(CONFIG_VALUE_INVALID)]
    if invalid:
        # A wrongly typed value is an input problem, not a quiet unknown: the run is not reported clean.
        finding = _config_unreadable(inv, run, expected, notes + code_notes, invalid[0])
        finding.input_problem = invalid[0]
        return finding
    ckpt_obs, ckpt_reason = _checkpoint_observation(inv, run)
    notes += config_notes + code_notes

    with run.trace.step("decide", invariant=inv.id) as step:
        chosen: Observation | None = None
        corroboration: list[Evidence] = []
        if config_obs is not None:
            chosen = config_obs
            if ckpt_obs is not None:
                if ckpt_obs.value == config_obs.value and (ckpt_obs.count is None or config_obs.count is None
                                                            or ckpt_obs.count == config_obs.count):
                    corroboration += ckpt_obs.evidence
                    chosen = Observation(config_obs.value, "config", min(0.99, config_obs.confidence + 0.03),
                                         config_obs.evidence, config_obs.detail + "; the checkpoint agrees")
                elif ok(ckpt_obs.value) == ok(config_obs.value):
                    # Same verdict, different facts: say so rather than call it agreement.
                    corroboration += ckpt_obs.evidence
                    notes.append(f"the config ({config_obs.detail}) and the checkpoint ({ckpt_obs.detail}) "
                                 "reach the same verdict but disagree on the details")
                else:
                    notes.append(f"conflict: the config says {config_obs.value!r} but the checkpoint says {ckpt_obs.value!r}: "
                                 "the weights show what was trained")
                    chosen = Observation(ckpt_obs.value, "checkpoint", ckpt_obs.confidence * CONFLICT_FACTOR,
                                         ckpt_obs.evidence + config_obs.evidence, ckpt_obs.detail)
            elif ckpt_reason and run.checkpoint is not None:
                notes.append(f"checkpoint not used: {ckpt_reason}")
            if (code_obs is not None and ok(code_obs.value) is False and ok(chosen.value) is True
                    and code_obs.confidence >= HARDCODED_OVERRULE and code_obs.mode == "hardcoded"):
                # The code decides code-level facts: a config value that no code reads does not make it so.
                notes.append(f"conflict: the config says {chosen.value!r} but the code hard-codes {code_obs.value!r}: "
                             "the config switch does not reach this code")
                chosen = Observation(code_obs.value, "code", code_obs.confidence * CONFLICT_FACTOR,
                                     code_obs.evidence + chosen.evidence, code_obs.detail, code_obs.count, code_obs.mode)
            elif code_obs is not None and ok(code_obs.value) == ok(chosen.value):
                corroboration += code_obs.evidence[:1]
                if code_obs.mode == "hardcoded" and _differs(code_obs.value, chosen.value):
                    notes.append(f"conflict: the config says {chosen.value!r}, the code hard-codes {code_obs.value!r} "
                                 "(same verdict; which one ran is not certain)")
                    chosen = Observation(chosen.value, chosen.source, chosen.confidence * CONFLICT_FACTOR,
                                         chosen.evidence, chosen.detail, chosen.count, chosen.mode)
            step.outcome = f"observed from {chosen.source}"
        elif ckpt_obs is not None:
            chosen = ckpt_obs
            if code_obs is not None and ok(code_obs.value) != ok(ckpt_obs.value):
                notes.append(f"the code suggests {code_obs.value!r}; the checkpoint's shapes decide")
            elif code_obs is not None:
                corroboration += code_obs.evidence[:1]
            step.outcome = "observed from the checkpoint" + (" (code was config-driven)" if code_reason else "")
        elif code_obs is not None:
            chosen = code_obs
            step.outcome = "observed from the code"
        if chosen is None:
            reasons = [r for r in (code_reason, ckpt_reason) if r]
            if run.config is None and inv.observed.config is not None:
                reasons.append("no run config was given")
            elif inv.observed.config is not None and run.config is not None and not code_reason:
                # a record read from run.json says itself why it cannot decide (the last note it added)
                own = inv.observed.config.reader == "target_fidelity" and config_notes
                reasons.append(config_notes[-1] if own else f"the run's config has none of {inv.observed.config.keys}")
            if run.code is None and inv.observed.code:
                reasons.append("no source code was given")
            probe_only = inv.observed.code is None and inv.observed.config is None and inv.observed.checkpoint is None
            reason = "; ".join(reasons) or ("only the probes decide this rule (run with --probe: the trainer's own "
                                            "code is run)" if probe_only else "no evidence for this rule in the inputs")
            step.outcome = f"unknown: {reason}"
            return _finding(inv, "unknown", expected, None, [], 0.0, reason, notes, run, block_evidence)

        verdict = ok(chosen.value)
        if verdict is None:
            reason = _undecided_reason(inv, chosen, block_size)
            step.outcome = f"unknown: {reason}"
            return _finding(inv, "unknown", expected, chosen, corroboration, 0.0, reason, notes, run, block_evidence)
        status = "match" if verdict else "mismatch"
        if verdict and chosen.source == "code":
            # A static reading that agrees is a claim about the cited site only. On defects planted blind in
            # real upstream code, most wrong all-clears came from a correct-looking site whose value had been
            # broken one step earlier (an argument, a reassignment, a partial, a default overridden), so
            # agreement read from code alone is reported, not claimed. A probe (or the run's config) can
            # still make it a match; a disagreeing reading stays a mismatch.
            reason = (_reason("match", inv, expected, chosen) + "; reported, not claimed: static reading did "
                      "not follow that value's whole path (run with --probe to measure it)")
            step.outcome = f"unknown: static agreement from code ({chosen.value!r}), not claimed"
            finding = _finding(inv, "unknown", expected, chosen, corroboration, 0.0, reason, notes, run, block_evidence)
            return finding.model_copy(update={"static_agreement": True})
        confidence = round(max(0.05, min(1.0, chosen.confidence * expected.factor)), 2)
        reason = _reason(status, inv, expected, chosen)
        for cond in inv.expected.conditional_accept:
            if _is_number(chosen.value) and math.isclose(float(chosen.value), float(cond.value)):
                if verdict:
                    reason = f"{chosen.value} is accepted at block size {block_size}: {cond.note}"
                else:
                    notes.append(f"{chosen.value} would be right only at block size {cond.block_size}; this run uses {block_size}")
        step.outcome = f"{status} from {chosen.source} ({chosen.value!r} vs {expected.value!r}, confidence {confidence})"
        return _finding(inv, status, expected, chosen, corroboration, confidence, reason, notes, run, block_evidence)


def _config_unreadable(inv: Invariant, run: _Run, expected: ExpectedValue, notes: list[str], problem: str) -> Finding:
    """A config-level rule on a run whose config cannot be read.

    A default in the code is what the code does when the config does not say otherwise, and the config that
    ran is lost: so a default (or a switch) is never the observation, and agreement is never a `match`.
    Only code that hard-codes a violation, whatever any config says, is still a mismatch."""
    reason = f"{problem}: what this run used for {inv.observed.config.keys[0]} is unknown"

    def ok(value: object) -> bool | None:
        return _satisfies(inv, expected, value, None)

    code_obs, _, code_notes = _code_observation(inv, run, ok)
    with run.trace.step("decide", invariant=inv.id) as step:
        if (code_obs is not None and code_obs.mode == "hardcoded" and ok(code_obs.value) is False
                and code_obs.confidence >= HARDCODED_OVERRULE):
            notes = notes + code_notes + [f"{problem}; the code hard-codes this, so no config could change it"]
            confidence = round(max(0.05, min(1.0, code_obs.confidence * expected.factor * 0.9)), 2)
            step.outcome = f"mismatch from hard-coded code ({code_obs.value!r}); the config is unreadable"
            return _finding(inv, "mismatch", expected, code_obs, [], confidence,
                            _reason("mismatch", inv, expected, code_obs), notes, run, None)
        if code_obs is not None:
            where = code_obs.evidence[0].location if code_obs.evidence else "the code"
            notes.append(f"the code's reading {code_obs.value!r} at {where} is not evidence of what ran")
        step.outcome = f"unknown: {reason}"
    return _finding(inv, "unknown", expected, None, [], 0.0, reason, notes, run, None)


def _satisfies(inv: Invariant, expected: ExpectedValue, value: object, block_size: int | None) -> bool | None:
    """True / False, or None when the value alone cannot decide (e.g. gamma 7 with an unknown block size)."""
    if isinstance(value, str) and value.endswith("?"):
        return None
    if value == "none" and (_is_number(expected.value) or expected.value is None):
        value = None  # a numeric setting the code switches off (no decay), as `null` in a config
    if _is_number(expected.value) or (expected.value is None and _is_number(value)):
        if value is None:
            return expected.value is None
        if isinstance(value, str) and value in expected.accept:
            return True  # a named alternative to the number (D-PACE instead of a gamma)
        if not _is_number(value):
            return None
        for cond in inv.expected.conditional_accept:
            if _is_number(cond.value) and math.isclose(float(value), float(cond.value)):
                if block_size is None:
                    return None
                return block_size == cond.block_size
        accepted = [expected.value, *expected.accept]
        return any(_is_number(a) and math.isclose(float(value), float(a)) for a in accepted)
    if isinstance(value, str) and value.startswith("count:"):
        return None
    return value == expected.value or value in expected.accept


def _undecided_reason(inv: Invariant, chosen: Observation, block_size: int | None) -> str:
    for cond in inv.expected.conditional_accept:
        if _is_number(chosen.value) and math.isclose(float(chosen.value), float(cond.value)) and block_size is None:
            return (f"{chosen.value} is right only for block size {cond.block_size} ({cond.note}); "
                    "the block size was not found in the config or the code")
    return f"{chosen.value!r} cannot be compared with the rule without more context ({chosen.detail})"


def _reason(status: str, inv: Invariant, expected: ExpectedValue, chosen: Observation) -> str:
    where = {"config": "the run's config", "checkpoint": "the checkpoint", "code": "the code"}[chosen.source]
    # The detail explains the observed value, so it sits right after it.
    observed = f"{chosen.value!r}" + (f" ({chosen.detail})" if chosen.detail else "")
    if status == "match":
        alternative = _accepted_alternative(expected, chosen.value)
        if alternative is not None:
            # an accepted alternative is not the expected value: say which rule admits it
            return (f"{where} shows {observed}, not the reference's {expected.value!r} but one the rule accepts "
                    f"(accepted: {', '.join(repr(a) for a in expected.accept)})")
        return f"{where} shows {observed}, as the rule requires"
    return f"{where} shows {observed}; the reference has {expected.value!r}"


def _finding(inv: Invariant, status: str, expected: ExpectedValue, chosen: Observation | None, corroboration: list[Evidence],
             confidence: float, reason: str, notes: list[str], run: _Run, block_evidence: Evidence | None) -> Finding:
    evidence = list(expected.evidence)
    if chosen is not None:
        evidence += chosen.evidence
    evidence += [e for e in corroboration if e not in evidence]
    if block_evidence is not None and chosen is not None and inv.expected.conditional_accept:
        evidence.append(block_evidence)
    fix = None
    if status == "mismatch":
        fix = _fix(inv, expected, run)
    seen: set[str] = set()
    unique_notes = [n for n in notes if n and not (n in seen or seen.add(n))]
    return Finding(
        id=inv.id,
        title=inv.title,
        status=status,  # type: ignore[arg-type]
        severity=inv.severity,
        expected=_text(expected.value) if status == "mismatch" or chosen is None or _accepted_alternative(expected, chosen.value) is None
        else f"{_text(expected.value)} (or accepted: {_text(chosen.value)})",
        observed=None if chosen is None else _text(chosen.value),
        evidence=evidence,
        confidence=confidence if status != "unknown" else 0.0,
        fix=fix,
        reason=reason,
        notes=unique_notes,
    )


def _fix(inv: Invariant, expected: ExpectedValue, run: _Run) -> Fix | None:
    spec = inv.fix
    patch: dict[str, object] = {}
    if spec.config_patch and run.config is not None and all(lookup(run.config, [k]) is not None for k in spec.config_patch):
        patch = {k: (expected.value if v == "$expected" else v) for k, v in spec.config_patch.items()}
    hint = spec.code_hint
    if spec.why_unsafe:
        hint = f"{hint} ({spec.why_unsafe})" if hint else spec.why_unsafe
    if not patch and not hint:
        return None
    return Fix(config_patch=patch, code_hint=hint, applicability=spec.applicability)


# ---------------------------------------------------------------------------------------------------------


def _code_evidence(r: CodeReading, kind: str = "code") -> Evidence:
    commit = r.commit
    location = f"{r.path}:{r.line}" + (f"@{commit[:12]}" if commit else "")
    return Evidence(kind=kind, location=location, value=_text(r.value), snippet=r.snippet or None, path=r.path,
                    line=r.line, commit=commit)


def _accepted_alternative(expected: ExpectedValue, value: object) -> object | None:
    """The observed value when it satisfies the rule only as one of `accept` (KL where CE is the reference's)."""
    if _is_number(value) or not expected.accept or not _differs(value, expected.value):
        return None
    return value if value in expected.accept else None


def _differs(a: object, b: object) -> bool:
    if _is_number(a) and _is_number(b):
        return not math.isclose(float(a), float(b))
    return a != b


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return "null"
    return str(value)
