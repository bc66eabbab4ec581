"""report.sarif: SARIF 2.1.0 for the mismatches located in code, so editors and code scanning can show them.

Rules come from the playbook (id, title, why); a result is emitted for every mismatch that has code
evidence with a path (the first such evidence is the primary location, the rest related locations).

Text an editor shows (messages, rule descriptions, snippets: names and values from the run or the code) is
written as sleuth.escape.terminal writes it; the file is strict JSON (sleuth.escape.dumps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sleuth.escape import terminal
from sleuth.findings import Evidence, Finding
from sleuth.report.model import Report, Rule

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_VERSION = "2.1.0"
_LEVEL = {"critical": "error", "high": "error", "medium": "warning", "low": "note", "info": "note"}


def code_locations(finding: Finding) -> list[Evidence]:
    return [e for e in finding.evidence if e.kind == "code" and e.path]


def render_sarif(report: Report, *, base: Path | None = None) -> dict[str, Any]:
    """The SARIF log as a dict; paths under `base` (default: the working directory) become relative URIs."""
    base = (base or Path.cwd()).resolve()
    code_root = _code_root(report)
    rules = list(report.rules)
    known = {rule.id for rule in rules}
    # A finding from outside the playbook still needs a rule for its result to point at.
    for finding in report.findings:
        if finding.id not in known:
            rules.append(Rule(id=finding.id, title=finding.title, severity=finding.severity))
            known.add(finding.id)
    index = {rule.id: i for i, rule in enumerate(rules)}
    results = []
    for finding in report.findings:
        located = code_locations(finding)
        if finding.status != "mismatch" or not located:
            continue
        message = finding.title
        if finding.observed or finding.expected:
            message += f": observed {finding.observed or '?'}, expected {finding.expected or '?'}"
        if finding.fix is not None and finding.fix.code_hint:
            message += f". Fix: {finding.fix.code_hint}"
        result: dict[str, Any] = {
            "ruleId": finding.id,
            "ruleIndex": index[finding.id],
            "level": _LEVEL.get(finding.severity, "warning"),
            "message": {"text": terminal(message)},
            "locations": [_location(located[0], base, code_root)],
            "properties": {"confidence": finding.confidence, "severity": finding.severity},
        }
        if len(located) > 1:
            result["relatedLocations"] = [
                {"id": i, **_location(evidence, base, code_root)}
                for i, evidence in enumerate(located[1:], start=1)
            ]
        results.append(result)
    driver: dict[str, Any] = {
        "name": "sleuth",
        "version": report.tool_version or "0",
        "informationUri": "https://github.com/vllm-project/speculators",
        "rules": [_rule(rule) for rule in rules],
    }
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [{"tool": {"driver": driver}, "results": results, "columnKind": "unicodeCodePoints"}],
    }


def _rule(rule: Rule) -> dict[str, Any]:
    # As ruff documents a rule: what it requires, why a violation matters, an example of one.
    full = " ".join(part for part in (rule.what, rule.why) if part) or rule.title or rule.id
    help_text = full + (f" Example: {rule.example}" if rule.example else "")
    return {
        "id": rule.id,
        "name": rule.id.replace(".", "_"),
        "shortDescription": {"text": terminal(rule.title or rule.id)},
        "fullDescription": {"text": terminal(full)},
        "help": {"text": terminal(help_text)},
        "defaultConfiguration": {"level": _LEVEL.get(rule.severity, "warning")},
        "properties": {"severity": rule.severity},
    }


def _code_root(report: Report) -> Path | None:
    if not report.inputs.code:
        return None
    code = Path(report.inputs.code)
    return code.parent if code.is_file() else code


def _location(evidence: Evidence, base: Path, code_root: Path | None) -> dict[str, Any]:
    path = evidence.path or ""
    if code_root is not None and not Path(path).is_absolute():
        # A code path may be relative to the analysed tree ("trainer/x.py"), to the folder holding it
        # ("code/trainer/x.py"), or to the working directory: point at whichever file exists.
        for candidate in (code_root / path, code_root.parent / path, Path(path)):
            if candidate.is_file():
                path = str(candidate.resolve())
                break
    physical: dict[str, Any] = {"artifactLocation": {"uri": _uri(path, base)}}
    if evidence.line is not None and evidence.line >= 1:
        region: dict[str, Any] = {"startLine": evidence.line}
        if evidence.snippet:
            region["snippet"] = {"text": terminal(evidence.snippet)}
        physical["region"] = region
    return {"physicalLocation": physical}


def _uri(path: str, base: Path) -> str:
    candidate = Path(path)
    if not candidate.is_absolute():
        return candidate.as_posix()
    try:
        return candidate.resolve().relative_to(base).as_posix()
    except ValueError:
        return candidate.resolve().as_uri()
