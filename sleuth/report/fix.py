"""fix.yaml: the config patch that repairs every mismatch a config change can repair.

`trainer run --fixed --from RUN` reads it, so it stays a plain YAML mapping:

    diagnosed_run: v5
    diagnosed_run_path: /abs/runs/v5
    diagnosed_config_sha256: 3f1c...   # the config.json bytes the patch was computed against
    report: runs/v5/diagnosis/report.md
    config_patch: {fc_layers: null, target_logits_source: final}
    code_changes: [{id: dflash.context_excludes_anchor, hint: ...}]

The run's name, path and config hash say which run the patch was written for: `--fixed --from v3` refuses a
fix.yaml that was written for v5 (copied, or written there with `--out`), and `--fixed` alone applies only a
fix.yaml whose recorded path and hash are those of the run directory it sits in.

Every string in it (the run's name and path, keys, hints, the comment lines) is written as
sleuth.escape.terminal writes it: the file always parses back with `yaml.safe_load`, no value can start a
line of its own (a comment or a key), and a control or invisible character shows as its escape.

Findings are merged in ranked order, so when two mismatches want different values for one key the
higher-ranked one wins (the loser is named in a comment).
"""

from __future__ import annotations

import json
import os
from typing import Any

from sleuth.escape import terminal, terminal_data
from sleuth.report.model import Report


def build_fix(report: Report, report_path: str) -> tuple[dict[str, Any], list[str]]:
    """The fix.yaml mapping, and comment lines explaining what it does not contain."""
    patch: dict[str, Any] = {}
    patched_by: dict[str, str] = {}
    code_changes: list[dict[str, str]] = []
    comments: list[str] = []
    for finding in report.findings:
        if finding.status != "mismatch" or finding.fix is None:
            continue
        for key, value in finding.fix.config_patch.items():
            if key in patch and patch[key] != _plain(value):
                wanted, kept = json.dumps(_plain(value)), json.dumps(patch[key])
                comments.append(f"{finding.id} also wants {key}: {wanted}; kept {kept} from {patched_by[key]}")
                continue
            patch[key] = _plain(value)
            patched_by.setdefault(key, finding.id)
        if finding.fix.code_hint and not finding.fix.config_patch:
            code_changes.append({"id": finding.id, "hint": finding.fix.code_hint})
    unfixable = [
        f.id
        for f in report.findings
        if f.status == "mismatch" and (f.fix is None or not (f.fix.config_patch or f.fix.code_hint))
    ]
    if code_changes:
        needing_code = ", ".join(change["id"] for change in code_changes)
        comments.insert(0, f"needs a code change (no config key fixes it): {needing_code}")
    if unfixable:
        comments.append("mismatches without a known fix: " + ", ".join(unfixable))
    document = {
        "diagnosed_run": report.run.name if report.run is not None else None,
        # absolute, so that `trainer run --fixed` can tell this run's own diagnosis from one copied beside it
        "diagnosed_run_path": os.path.abspath(report.run.path) if report.run is not None else None,
        "diagnosed_config_sha256": report.run.config_sha256 if report.run is not None else None,
        "report": report_path,
        "config_patch": patch,
        "code_changes": code_changes,
    }
    return terminal_data(document), [terminal(line) for line in comments]


def render_fix_yaml(report: Report, report_path: str) -> str:
    import yaml

    document, comments = build_fix(report, report_path)
    header = [f"# sleuth diagnosis of {terminal(report.subject)}: the config patch for its mismatches."]
    header += [f"# {line}" for line in comments]
    # one line per value, never folded: a long name cannot put text at the start of a line either
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False, allow_unicode=True, width=2**31 - 1)
    return "\n".join(header) + "\n" + body


def _plain(value: object) -> object:
    """Only YAML's plain types (a tuple would be written as a Python-specific tag)."""
    return json.loads(json.dumps(value, default=str))
