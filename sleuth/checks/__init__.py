"""The train-to-serve contract checks: one function per invariant, each returning one `Finding`.

    dflash.train_serve_gap            train_serve_gap.py    teacher-forced acceptance vs real tau
    dflash.mask_token_distinct        mask_token.py         mask id is not pad/eos/bos nor a data token
    dflash.rope_served_as_trained     rope.py               served rotation = the one the drafter trained with
    dflash.sliding_window_served      sliding_window.py     served layer windows = the trained ones
    dflash.target_tables_resolve      target_tables.py      mask id and embedding / lm_head names exist in the target
    dflash.hidden_state_capture       hidden_states.py      an offline cache recomputed layer by layer
    dflash.chat_template_consistency  chat_template.py      one template for data, prompts and serving
    dflash.export_contract            export_contract.py    an export holds what its loader reads
    dflash2.* / dspark.* / domino.* / jetspec.*  family.py  the variants' config, checkpoint and export rules

The variant under diagnosis (sleuth/evidence/variant.py) scopes them: an invariant the playbook marks for
other `variants` is skipped, and DSpark's anchor-first layout moves two base rules' expected values.

They read the run directory, the target's files and the findings the invariant engine produced
(`train_serve_gap` names which of those explain a gap, so it runs last). `apply_contract_checks` replaces
the engine's placeholder findings for these ids (their playbook entries have no static extractor).
"""

from __future__ import annotations

from collections.abc import Callable

from sleuth.checks.chat_template import check_chat_template_consistency
from sleuth.checks.context import ContractContext
from sleuth.checks.export_contract import check_export_contract
from sleuth.checks.family import FAMILY_CHECKS, applies, apply_variant_scope
from sleuth.checks.hidden_states import check_hidden_state_capture
from sleuth.checks.mask_token import check_mask_token_distinct
from sleuth.checks.rope import check_rope_served_as_trained
from sleuth.checks.sliding_window import check_sliding_window_served
from sleuth.checks.target_tables import check_target_tables_resolve
from sleuth.checks.train_serve_gap import check_train_serve_gap
from sleuth.findings import Finding

# Order matters only for train_serve_gap, which reads the others' verdicts.
CONTRACT_CHECKS: dict[str, Callable[[ContractContext], Finding]] = {
    "dflash.mask_token_distinct": check_mask_token_distinct,
    "dflash.rope_served_as_trained": check_rope_served_as_trained,
    "dflash.sliding_window_served": check_sliding_window_served,
    "dflash.target_tables_resolve": check_target_tables_resolve,
    "dflash.hidden_state_capture": check_hidden_state_capture,
    "dflash.chat_template_consistency": check_chat_template_consistency,
    "dflash.export_contract": check_export_contract,
    **FAMILY_CHECKS,
    "dflash.train_serve_gap": check_train_serve_gap,
}


def apply_contract_checks(findings: list[Finding], ctx: ContractContext) -> list[Finding]:
    """`findings` with each contract invariant's finding replaced by (or, if absent, extended with) its check.

    Only the invariants the playbook lists (ctx.rules) run: the playbook decides what is checked."""
    results = list(findings)
    variant = ctx.variant.kind
    for invariant_id, check in CONTRACT_CHECKS.items():
        if invariant_id not in ctx.rules or not applies(ctx.rules[invariant_id], variant):
            continue
        ctx.findings = results
        finding = check(ctx)
        positions = [i for i, f in enumerate(results) if f.id == invariant_id]
        if positions:
            results[positions[0]] = finding
        else:
            results.append(finding)
    return apply_variant_scope(results, ctx)


__all__ = ["CONTRACT_CHECKS", "ContractContext", "apply_contract_checks"]
