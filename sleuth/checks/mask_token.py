"""`dflash.mask_token_distinct`: the mask token is a dedicated id, never pad, eos, bos or a data token.

Slots 1..B-1 of every block hold the mask token. If that id is also eos (or pad, or bos, or any token the
training data contains), the drafter cannot tell "predict here" from "the text ended here", and the
embedding it learns for the slot is pulled both ways. NeMo Automodel #2461: a mask token aliased to
pad/eos "quietly erodes acceptance". Read from the run's config (or an exported config), the target's
tokenizer files, and the data record's count of the mask id in the training tokens where the run has it.
"""

from __future__ import annotations

from typing import Any

from sleuth.checks.context import ContractContext, TokenizerFacts, int_or_none, tokenizer_facts
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.mask_token_distinct"


def configured_mask_token(config: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """The mask id a config states, and the key it was read from (ours, z-lab's, speculators')."""
    config = config or {}
    for key, holder in (("mask_token_id", config), ("dflash_config.mask_token_id", config.get("dflash_config") or {})):
        value = int_or_none(holder.get(key.rsplit(".", 1)[-1])) if isinstance(holder, dict) else None
        if value is not None:
            return value, key
    return None, None


def resolved_mask(facts: TokenizerFacts) -> tuple[int | None, str]:
    """What a trainer resolves when the config leaves the mask unset: the tokenizer's mask token, else
    the first embedding row no token maps to (docs/reference/config.md: `mask_token_id`)."""
    if facts.special.get("mask"):
        return facts.special["mask"][0], f"the tokenizer's mask token ({facts.sources['mask']})"
    if facts.tokenizer_size is not None and facts.vocab_size is not None and facts.tokenizer_size < facts.vocab_size:
        return facts.tokenizer_size, "the first unused embedding row (config leaves mask_token_id unset)"
    return None, "the config leaves mask_token_id unset and the tokenizer has no mask token"


def check_mask_token_distinct(ctx: ContractContext) -> Finding:
    mask, key = configured_mask_token(ctx.config)
    target_dir, target_source = ctx.resolve_target_dir()
    facts = tokenizer_facts(target_dir) if target_dir is not None else None
    evidence: list[Evidence] = []
    if mask is not None:
        evidence.append(Evidence(kind="config", location=f"{ctx.config_source or 'config'}: {key}", value=str(mask)))
    elif facts is not None:
        mask, how = resolved_mask(facts)
        if mask is not None:
            evidence.append(Evidence(kind="config", location=f"{target_dir}: {how}", value=str(mask)))
    if mask is None:
        return ctx.finding(ID, "unknown", reason="the mask token id is not stated in the config"
                           + (f" and cannot be resolved from the target ({target_source})" if facts is None else ""))
    expected = "a dedicated id: not pad, eos or bos, and absent from the training tokens"
    clashes = [f"{kind} ({facts.sources[kind]})" for kind in ("eos", "pad", "bos")
               if facts is not None and mask in facts.special.get(kind, [])]
    data = ((ctx.run.run_json or {}).get("data") if ctx.run is not None else None) or {}
    occurrences = int_or_none(data.get("mask_token_count")) if isinstance(data, dict) else None
    if occurrences is not None:
        evidence.append(Evidence(kind="metrics", location="run.json data.mask_token_count", value=str(occurrences)))
    fix = Fix(config_patch={"mask_token_id": None},
              code_hint="Use a dedicated mask token (add one to the tokenizer, or an unused embedding row); "
              "never pad, eos, bos or a token that occurs in the data.", applicability="unsafe")
    if clashes or (occurrences or 0) > 0:
        problems = [f"is the target's {c}" for c in clashes]
        if occurrences:
            problems.append(f"occurs {occurrences} times in the training tokens")
        return ctx.finding(ID, "mismatch", expected=expected, observed=f"mask_token_id {mask} " + " and ".join(problems),
                           evidence=evidence, confidence=0.95, fix=fix,
                           reason="the drafter's block slots cannot be told apart from real tokens")
    if facts is None:
        return ctx.finding(ID, "unknown", expected=expected, observed=f"mask_token_id {mask}", evidence=evidence,
                           reason=f"the target's tokenizer was not read: {target_source}")
    evidence.append(Evidence(kind="config", location=f"{target_dir}: special tokens",
                             value=", ".join(f"{k} {v}" for k, v in sorted(facts.special.items()))))
    kinds = [kind for kind in ("pad", "eos", "bos") if facts.special.get(kind)]
    checked = ", ".join(kinds) or "the special tokens (none declared)"
    checked += " and the training tokens" if occurrences is not None else ""
    notes = [] if occurrences is not None else ["the run records no count of the mask id in its training tokens "
                                                "(run.json data.mask_token_count); only the special tokens were checked"]
    return ctx.finding(ID, "match", expected=expected, observed=f"mask_token_id {mask}, distinct from {checked}",
                       evidence=evidence, confidence=0.9 if occurrences is not None else 0.75, notes=notes)
