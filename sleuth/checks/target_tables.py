"""`dflash.target_tables_resolve`: what the drafter borrows from its target exists there.

A DFlash drafter has no embeddings or lm_head of its own: its loader takes the target's, by name, and the
mask token is a row of the target's embedding table. On Qwen3.6-27B (`Qwen3_5ForConditionalGeneration`) the
table is `model.language_model.embed_tokens.weight`, not `model.embed_tokens.weight`. Checked against the
target's weight names (its safetensors index or headers, no weights loaded) and config, the way each loader
looks them up:
    * SpecForge: `embedding_key` / `lm_head_key` (its provenance records them; default
      `model.embed_tokens.weight` / `lm_head.weight`), exact names (specforge modeling/draft/base.py
      load_embedding, modeling/target/target_utils.py);
    * speculators (and vLLM's speculators loader): `embed_tokens.weight` and `lm_head.weight` by exact name,
      else the shortest name ending with it, else its aliases (speculators utils/loading.py `_resolve_key`);
      `lm_head` falls back to the embedding table (tied);
    * the mask token id: inside the target's embedding table (`vocab_size`).
"""

from __future__ import annotations

from pathlib import Path

from sleuth.checks.context import ContractContext, int_or_none, read_json, text_config, tokenizer_facts
from sleuth.checks.export_contract import export_format
from sleuth.checks.mask_token import configured_mask_token, resolved_mask
from sleuth.findings import Evidence, Finding, Fix

ID = "dflash.target_tables_resolve"
# speculators 0.9.0 utils/loading.py _WEIGHT_ALIASES
SPECULATORS_ALIASES = {
    "embed_tokens.weight": ("tok_embeddings.weight", "llm.embed.weight", "backbone.embeddings.weight"),
    "lm_head.weight": ("output.weight", "llm.unembed.weight"),
}


def speculators_resolve(name: str, keys: set[str]) -> str | None:
    for candidate in (name, *SPECULATORS_ALIASES.get(name, ())):
        if candidate in keys:
            return candidate
        matches = [k for k in keys if k.endswith(candidate)]
        if matches:
            return min(matches, key=len)
    return None


def target_weight_names(target_dir: Path) -> tuple[set[str] | None, str]:
    """The target's tensor names from model.safetensors.index.json or its safetensors headers."""
    from sleuth.evidence.checkpoint import CheckpointError, read_header

    index = read_json(target_dir / "model.safetensors.index.json")
    if index is not None and isinstance(index.get("weight_map"), dict):
        return set(index["weight_map"]), str(target_dir / "model.safetensors.index.json")
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        return None, f"{target_dir} has no safetensors weights (nor an index)"
    names: set[str] = set()
    try:
        for path in files:
            names |= set(read_header(path))
    except CheckpointError as exc:
        return None, str(exc)
    return names, ", ".join(str(p) for p in files)


def _target(ctx: ContractContext) -> tuple[Path | None, str]:
    target_dir, source = ctx.resolve_target_dir()
    if target_dir is None and ctx.run is not None and getattr(ctx.run.interop, "trainer", None) == "specforge":
        verifier = getattr(ctx.run.interop, "verifier", None)
        config_path = getattr(verifier, "config_path", None)
        if isinstance(config_path, Path) and config_path.is_file():
            return config_path.parent, "SpecForge's recorded target_model (relocated)"
    return target_dir, source


def _specforge_keys(ctx: ContractContext) -> dict[str, str]:
    interop = ctx.run.interop if ctx.run is not None else None
    if getattr(interop, "trainer", None) != "specforge":
        return {}
    keys = {}
    for key in ("embedding_key", "lm_head_key"):
        value = interop.provenance(key)
        if isinstance(value, str) and value:
            keys[key] = value
    return keys


def check_target_tables_resolve(ctx: ContractContext) -> Finding:
    target_dir, source = _target(ctx)
    if target_dir is None:
        return ctx.finding(ID, "unknown", reason=f"the target was not found: {source}")
    target_config = text_config(read_json(target_dir / "config.json") or {})
    vocab = int_or_none(target_config.get("vocab_size"))
    names, names_source = target_weight_names(target_dir)
    evidence: list[Evidence] = []
    problems: list[str] = []
    remedies: list[str] = []
    checked: list[str] = []

    mask, mask_key = configured_mask_token(ctx.config)
    if mask is None and ctx.config is not None and "dflash_config" not in ctx.config:
        # a training run that leaves it to the target: the trainer's rule (docs/reference/config.md: `mask_token_id`)
        mask, mask_key = resolved_mask(tokenizer_facts(target_dir))
    if mask is not None and vocab is not None:
        checked.append(f"mask_token_id {mask} ({mask_key})")
        evidence.append(Evidence(kind="config", location=str(target_dir / "config.json"), value=f"vocab_size {vocab}"))
        if not 0 <= mask < vocab:
            problems.append(f"mask_token_id {mask} ({mask_key}) is outside the target's embedding table (0..{vocab - 1})")
            remedies.append("use the target tokenizer's mask token (or an unused row below vocab_size)")

    if names is not None:
        evidence.append(Evidence(kind="checkpoint", location=names_source, value=f"{len(names)} tensor names"))
        tied = target_config.get("tie_word_embeddings", True) is not False
        for key, name in _specforge_keys(ctx).items():
            checked.append(f"SpecForge {key} {name}")
            if name not in names and not (key == "lm_head_key" and tied):
                found = speculators_resolve("embed_tokens.weight" if key == "embedding_key" else "lm_head.weight", names)
                problems.append(f"SpecForge's {key} {name!r} is not a tensor of the target (SpecForge reads it by "
                                "exact name)" + (f"; the target has {found!r}" if found else ""))
                remedies.append(f"train with --{key.replace('_', '-')} {found}" if found else f"set {key}")
        if export_format(ctx.config) == "speculators" or (ctx.run is not None and getattr(ctx.run.interop, "trainer", None) == "speculators"):
            embed = speculators_resolve("embed_tokens.weight", names)
            head = speculators_resolve("lm_head.weight", names) or embed
            checked.append(f"speculators' lookups (embed_tokens.weight -> {embed}, lm_head.weight -> {head})")
            if embed is None:
                problems.append("speculators finds no embed_tokens.weight (by name, suffix or alias) among the target's "
                                "tensors: from_pretrained fails")
                remedies.append("export with the tables in the checkpoint (trainer export does so for such targets)")
    else:
        evidence.append(Evidence(kind="checkpoint", location=str(target_dir), value=names_source))

    expected = "the mask token and the embedding / lm_head names the drafter's loader reads exist in the target"
    fix = Fix(config_patch={}, applicability="safe", code_hint="; ".join(dict.fromkeys(remedies)) or None)
    if problems:
        return ctx.finding(ID, "mismatch", expected=expected, observed="; ".join(problems), evidence=evidence,
                           confidence=0.9, fix=fix,
                           reason="the drafter's loader cannot borrow what it needs from this target")
    if not checked:
        why = names_source if names is None else "no mask token or table lookup applies to this run"
        return ctx.finding(ID, "unknown", expected=expected, evidence=evidence, reason=f"nothing was checked: {why}")
    return ctx.finding(ID, "match", expected=expected, observed="; ".join(checked) + ": all resolve",
                       evidence=evidence, confidence=0.85)
