"""`dflash.sliding_window_served`: each drafter layer is served with the window it trained with.

The published Qwen3.6-27B drafter has four sliding-window layers (W = 2048) and one full-attention layer.
Served with full attention in those layers it keeps working on short prompts and loses acceptance once the
context passes the window (AEON-7 Qwen3.6-27B-DFlash #6; vLLM PR #40898 added the windows to vLLM's DFlash
drafter); the reverse (a window the drafter never trained with) cuts context it relies on. A config can lose
the window on its way to the server without any error: transformers' Qwen3Config drops `sliding_window`
unless `use_sliding_window` is true, and without `layer_types` it slides only layers >= `max_window_layers`.

Compared (sleuth/checks/served.py): the windows the drafter's attention modules applied in training
(run.json `drafter.layer_windows`, or an export's `dflash_training.drafter`) against the windows a loader
builds from the exported layer config, and speculators' block causality (`sliding_window_non_causal`)
against the trained one. Without a training record, a config whose declared windows its loaders would drop
is still a mismatch (the file itself says the drafter had them).

Then the engines (playbooks/serving/engines.yaml, sleuth/checks/engines.py): even from a correct config the
engines build a sliding layer differently. Our trainer (and speculators / vLLM) counts the window from the
anchor; z-lab's dflash 0.1.0 and SGLang from each query; SpecForge's inference loop ignores it. With the engine
the user serves with named (`sleuth diagnose --served-by ENGINE`), an engine that does not serve the drafter as
trained is a mismatch, with the loss of acceptance measured (a run's eval.json `served_by_engine`, copied into
an export's `dflash_training.served_by_engine`) or, without a measurement, predicted from where the windows
differ. Without --served-by the finding's notes name which engines serve it as trained and which do not. A
full-attention drafter, and an engine that serves as trained, add nothing.
"""

from __future__ import annotations

from typing import Any

from sleuth.checks.context import ContractContext
from sleuth.checks.engines import Engine, EngineError, load_engines, resolve_engine, trained_origin
from sleuth.checks.served import describe_windows, served_attention, served_config, trained_attention, trained_record
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.sliding_window_served"
SERVING_NOTES = [
    "vLLM applies a DFlash drafter's windows from PR #40898 on (earlier versions serve every layer full attention); "
    "SGLang from PR #27469; z-lab's dflash 0.1.0 builds them as an explicit mask (counted from each query)",
]


def check_sliding_window_served(ctx: ContractContext) -> Finding:
    layer, top, served_where = served_config(ctx)
    record, record_where = trained_record(ctx)
    if layer is None:
        return ctx.finding(ID, "unknown", reason="no drafter layer config to read (an export's config.json, "
                           "speculators' transformer_layer_config, or run.json `drafter.draft_config`)")
    served = served_attention(layer, top)
    evidence = [Evidence(kind="config", location=served_where, value=f"served: {describe_windows(served.windows)}")]
    problems: list[str] = []
    patch: dict[str, object] = {}
    if served.gate is not None:
        problems.append(f"the config declares {describe_windows(served.declared)} but {served.gate}: every loader "
                        f"built on it serves {describe_windows(served.windows)}")
        patch = {"use_sliding_window": True, "layer_types": ["sliding_attention" if w else "full_attention"
                                                             for w in served.declared]}
    trained_windows, trained_non_causal = trained_attention(record or {})
    if trained_windows is not None:
        evidence.append(Evidence(kind="config", location=record_where,
                                 value=f"trained: {describe_windows(trained_windows)}"))
        if len(trained_windows) != len(served.windows):
            problems.append(f"trained {len(trained_windows)} layers, the served config has {len(served.windows)}")
        elif trained_windows != served.windows:
            problems.append(f"trained {describe_windows(trained_windows)}, served {describe_windows(served.windows)}")
            windows = [w for w in trained_windows if w is not None]
            patch = {"use_sliding_window": bool(windows), "sliding_window": windows[0] if windows else None,
                     "layer_types": ["sliding_attention" if w else "full_attention" for w in trained_windows]}
        if (any(trained_windows) and trained_non_causal is not None and served.non_causal is not None
                and trained_non_causal != served.non_causal):
            problems.append(f"the sliding layers trained {'bidirectional' if trained_non_causal else 'causal'} within "
                            f"the block, served {'bidirectional' if served.non_causal else 'causal'} "
                            "(sliding_window_non_causal)")
            patch["sliding_window_non_causal"] = trained_non_causal
    engines = _engine_verdicts(ctx, record, trained_windows, trained_non_causal)
    evidence.extend(engines.evidence)
    expected = "the windows the drafter trained with, layer by layer, as the loaders build them"
    if engines.served_by is not None:
        expected += f", and as {engines.served_by.title} builds them"
    if not problems and engines.problem:
        return ctx.finding(
            ID, "mismatch", expected=expected, observed=engines.problem, evidence=evidence,
            confidence=0.6 if engines.no_loss_measured else 0.9 if engines.measured else 0.8,
            reason="the engine you serve with builds the drafter's sliding layers unlike training: past the window "
                   "it drafts from other context than the drafter learned from, and acceptance falls (the output "
                   "stays the target's; only speed is lost)",
            notes=engines.notes, fix=Fix(config_patch={}, applicability="safe", code_hint=engines.fix),
        )
    if problems:
        return ctx.finding(
            ID, "mismatch", expected=expected, observed="; ".join(problems), evidence=evidence, confidence=0.9,
            reason="the drafter attends to other context than it learned from: acceptance falls once prompts "
                   "pass the window (AEON-7 Qwen3.6-27B-DFlash #6)",
            notes=SERVING_NOTES + engines.notes,
            fix=Fix(config_patch={}, applicability="safe",
                    code_hint=f"Fix the exported drafter config (no retraining: the weights are right): {patch}; or "
                              "re-export with `trainer export`, which writes use_sliding_window, layer_types and "
                              "sliding_window together."),
        )
    if trained_windows is None:
        return ctx.finding(
            ID, "unknown", expected=expected, observed=f"served: {describe_windows(served.windows)}", evidence=evidence,
            reason="nothing records the windows the drafter trained with (run.json `drafter.layer_windows`, an "
                   "export's `dflash_training`); the config's own declaration is consistent",
        )
    observed = f"{describe_windows(served.windows)}, trained and served"
    if engines.served_by is not None and any(trained_windows):
        observed += f"; {engines.served_by.title} ({engines.served_by.version}) builds them as trained"
    return ctx.finding(ID, "match", expected=expected, observed=observed, evidence=evidence, confidence=0.9,
                       notes=(SERVING_NOTES + engines.notes) if any(served.windows) else [])


# --- the engines ------------------------------------------------------------------------------------------


class _EngineVerdicts:
    def __init__(self) -> None:
        self.served_by: Engine | None = None
        self.problem: str | None = None  # the named engine does not serve the drafter as trained
        self.fix: str | None = None
        self.measured = False
        self.no_loss_measured = False  # measured, and this run's prompts showed no loss (the windows still differ)
        self.notes: list[str] = []
        self.evidence: list[Evidence] = []


def _engine_verdicts(ctx: ContractContext, record: dict[str, Any] | None, trained_windows: list[int | None] | None,
                     trained_non_causal: bool | None) -> _EngineVerdicts:
    out = _EngineVerdicts()
    if ctx.served_by:
        out.served_by = resolve_engine(ctx.served_by)  # validated by diagnose already; EngineError otherwise
    if not trained_windows or not any(trained_windows):
        return out  # full attention: every engine serves it as trained
    origin = trained_origin(record)
    window = next(w for w in trained_windows if w)
    measured, where = _measured(ctx)
    if where:
        out.evidence.append(Evidence(kind="metrics", location=where, value=", ".join(
            f"{name} tau {row['tau']:.3f} ({row['verify_steps']} verify steps)" for name, row in measured.items())))
    engines = load_engines()
    as_trained = [e for e in engines.values() if e.differences(origin, trained_non_causal) == []]
    unlike = {e.key: e.differences(origin, trained_non_causal) for e in engines.values()}
    baseline = next((measured[e.key] for e in as_trained if e.key in measured), None)
    if out.served_by is None:
        others = [f"{e.title} ({e.version}): {'; '.join(d)}{_loss(measured.get(k), baseline, window)}"
                  for k, e in engines.items() if (d := unlike[k])]
        if as_trained:
            out.notes.append("served as trained by: " + ", ".join(f"{e.title} ({e.version})" for e in as_trained))
        if others:
            out.notes.append("NOT served as trained by: " + " | ".join(others) +
                             " (name yours with `sleuth diagnose --served-by ENGINE`)")
        return out
    engine = out.served_by
    differences = unlike[engine.key]
    if differences is None:
        out.notes.append(f"{engine.title}: {engine.read_from} (basis: {engine.basis}; part of its semantics is not "
                         "documented, so whether it serves the drafter as trained is not known)")
        return out
    if not differences:
        return out
    loss = _loss(measured.get(engine.key), baseline, window)
    out.measured = engine.key in measured and baseline is not None
    out.no_loss_measured = out.measured and measured[engine.key]["tau"] >= baseline["tau"]
    out.problem = f"served by {engine.title}, {engine.version}: {'; '.join(differences)}{loss}"
    out.evidence.append(Evidence(kind="reference", location=f"playbooks/serving/engines.yaml: {engine.key}",
                                 value=f"{engine.read_from} (basis: {engine.basis})"))
    alternatives = ", ".join(f"{e.title} ({e.version})" for e in as_trained) or "no engine in the table"
    out.fix = (f"{engine.title}: {engine.fix}. " if engine.fix else
               f"{engine.title} has no setting that builds the window as trained (none exists). ") + \
              f"Serve with an engine that builds it as trained: {alternatives}; measure each with " \
              f"`trainer eval RUN --served-as ENGINE`."
    return out


def _measured(ctx: ContractContext) -> tuple[dict[str, dict[str, Any]], str]:
    """{engine: {tau, verify_steps}} as decoded at the run's end (eval.json `served_by_engine`, or an export's copy
    in `dflash_training.served_by_engine`), and where it was read."""
    sources: list[tuple[Any, str]] = []
    if ctx.run is not None and isinstance(ctx.run.eval_report, dict):
        sources.append((ctx.run.eval_report.get("served_by_engine"), f"{ctx.run.path / 'eval.json'}: served_by_engine"))
    training = (ctx.config or {}).get("dflash_training")
    if isinstance(training, dict):
        sources.append((training.get("served_by_engine"),
                        f"{ctx.config_source or 'config.json'}: dflash_training.served_by_engine"))
    for table, where in sources:
        if isinstance(table, dict):
            rows = {name: row for name, row in table.items() if isinstance(row, dict)
                    and isinstance(row.get("tau"), (int, float)) and isinstance(row.get("verify_steps"), int)}
            if rows:
                return rows, where
    return {}, ""


def _loss(row: dict[str, Any] | None, baseline: dict[str, Any] | None, window: int) -> str:
    if row is not None and baseline is not None:
        same = (" (no loss on those prompts: the drafts differ too little there; longer contexts and a sharper "
                "drafter show it)") if row["tau"] >= baseline["tau"] else ""
        return (f" — measured at the run's end: tau {row['tau']:.2f} vs {baseline['tau']:.2f} as trained, "
                f"{row['verify_steps']} vs {baseline['verify_steps']} verify steps on the same prompts{same}")
    return (f" — predicted: acceptance falls on every block whose context passes the window ({window} tokens), "
            "not before; measure it with `trainer eval RUN --served-as ENGINE`")
