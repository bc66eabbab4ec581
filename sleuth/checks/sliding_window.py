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
"""

from __future__ import annotations

from sleuth.checks.context import ContractContext
from sleuth.checks.served import describe_windows, served_attention, served_config, trained_attention, trained_record
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.sliding_window_served"
SERVING_NOTES = [
    "vLLM applies a DFlash drafter's windows from PR #40898 on (earlier versions serve every layer full attention); "
    "SGLang from PR #27469; z-lab's torch loop only under flash-attention (SDPA and eager ignore the window)",
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
    expected = "the windows the drafter trained with, layer by layer, as the loaders build them"
    if problems:
        return ctx.finding(
            ID, "mismatch", expected=expected, observed="; ".join(problems), evidence=evidence, confidence=0.9,
            reason="the drafter attends to other context than it learned from: acceptance falls once prompts "
                   "pass the window (AEON-7 Qwen3.6-27B-DFlash #6)",
            notes=SERVING_NOTES,
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
    return ctx.finding(ID, "match", expected=expected, observed=f"{describe_windows(served.windows)}, trained and served",
                       evidence=evidence, confidence=0.9, notes=SERVING_NOTES if any(served.windows) else [])
