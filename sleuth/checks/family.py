"""The DFlash family's variant invariants (shared DFLASH_FAMILY.md): what a config, a checkpoint header or an
export decides for DFlash2, DSpark, Domino and JetSpec, one function per playbook id.

    dflash2.anchor_is_bonus         sample_from_anchor false; speculative_tokens = B-1
    dflash2.full_vocab              draft vocabulary = verifier vocabulary; selector_top_k <= V; codebooks [V, r]
    dflash2.conv_shapes             H % g == 0; k <= B; base_kernel [2,k,H]; kernel_projection [2k*H/g, H]
    dflash2.noncausal_swa           sliding layers bidirectional in the block, trained and served
    dflash2.served_layout           the config layout the serving engine reads (flat vs nested), selector served
    dspark.anchor_slot_trained      speculative_tokens = B with sample_from_anchor; slot 0 not zeroed then
    dspark.sample_from_anchor_served  an export states its layout; the engine reads it as trained
    dspark.markov_shapes            W1 [V_verifier, r], W2 [V_draft, r]; with_markov needs markov_rank > 0
    domino.suffix_start             emb_dim / gru_hidden_dim nested; 0 <= pure_draft_prefix_len < B
    jetspec.causal_stamp            dflash_config.causal true

Static reading decides only a `mismatch` (a field, a shape, a layout that contradicts the rule); agreement is
reported as `unknown` with `static_agreement`, never claimed as a `match`. Each check names what it read.
An invariant of another variant than the run's is skipped (`apply_variant_scope`), not reported unknown.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sleuth.checks.context import ContractContext, int_or_none
from sleuth.checks.engines import Engine, load_engines, resolve_engine
from sleuth.checks.served import layer_config, served_attention, trained_record
from sleuth.evidence.variant import DFLASH2, DOMINO, DSPARK, JETSPEC
from sleuth.findings import Evidence, Finding, Fix

# The layout a base invariant expects with the anchor as a bonus token, and with slot 0 drafting from the anchor
# (speculators 0.9.0 models/dflash/core.py:243-259, 436-452): DSpark's default is the second.
ANCHOR_FIRST_VALUES = {
    "dflash.anchor_slot_untrained": ("weight 0", "trained"),
    "dflash.target_shift": ("p+j-1", "p+j"),
}


@dataclass
class Reading:
    """What one check read: problems (each a mismatch), agreements, evidence."""

    problems: list[str] = field(default_factory=list)
    agreements: list[str] = field(default_factory=list)
    evidence: list[Evidence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # what would have decided it and was absent


# --- reading a config in either layout --------------------------------------------------------------------


def setting(config: dict[str, Any] | None, key: str) -> tuple[str, Any] | None:
    """A family field, flat (speculators, our trainer) or nested (`dflash_config`, [Z] / SGLang / SpecForge)."""
    if not isinstance(config, dict):
        return None
    if key in config:
        return key, config[key]
    nested = config.get("dflash_config")
    if isinstance(nested, dict) and key in nested:
        return f"dflash_config.{key}", nested[key]
    return None


def _where(ctx: ContractContext) -> str:
    return ctx.config_source or (str(ctx.run.config_path) if ctx.run is not None else "config.json")


def is_export(config: dict[str, Any] | None) -> bool:
    """A serving config (what a server loads), not a training run's config."""
    return isinstance(config, dict) and (isinstance(config.get("speculators_model_type"), str)
                                         or isinstance(config.get("dflash_config"), dict))


def _layer(ctx: ContractContext) -> dict[str, Any]:
    layer, _ = layer_config(ctx.config)
    if layer is None:
        record, _ = trained_record(ctx)
        layer = (record or {}).get("draft_config") if isinstance(record, dict) else None
    return layer if isinstance(layer, dict) else {}


def hidden_size(ctx: ContractContext) -> int | None:
    value = int_or_none(_layer(ctx).get("hidden_size"))
    if value is None and ctx.run is not None and isinstance(ctx.run.run_json, dict):
        value = int_or_none((ctx.run.run_json.get("target") or {}).get("hidden_size"))
    return value


def verifier_vocab(ctx: ContractContext) -> tuple[int | None, str]:
    """The verifier's vocabulary: the layer config's vocab_size (speculators copies the verifier's), else run.json."""
    value = int_or_none(_layer(ctx).get("vocab_size"))
    if value is not None:
        return value, "vocab_size of the drafter's layer config (the verifier's)"
    if ctx.run is not None and isinstance(ctx.run.run_json, dict):
        value = int_or_none((ctx.run.run_json.get("target") or {}).get("vocab_size"))
        if value is not None:
            return value, "run.json target.vocab_size"
    return None, ""


def block_size(config: dict[str, Any] | None) -> int | None:
    found = setting(config, "block_size")
    return int_or_none(found[1]) if found else None


def sample_from_anchor(config: dict[str, Any] | None) -> tuple[str, bool] | None:
    found = setting(config, "sample_from_anchor")
    return (found[0], found[1]) if found is not None and isinstance(found[1], bool) else None


def anchor_first(ctx: ContractContext) -> tuple[bool | None, str]:
    """Whether the drafter drafts from the anchor, and why: the config's sample_from_anchor, else DSpark's layout
    in every reference (speculators 0.9.0 dspark/config.py:73 defaults it true; DeepSpec and SpecForge are
    anchor-first), else unknown."""
    stated = sample_from_anchor(ctx.config)
    if stated is not None:
        return stated[1], f"sample_from_anchor {str(stated[1]).lower()}"
    if ctx.variant.kind == DSPARK:
        return True, "DSpark, no sample_from_anchor stated: anchor-first in every reference"
    return None, ""


def speculative_tokens(config: dict[str, Any] | None) -> int | None:
    methods = ((config or {}).get("speculators_config") or {}).get("proposal_methods") if isinstance(
        (config or {}).get("speculators_config"), dict) else None
    if isinstance(methods, list) and methods and isinstance(methods[0], dict):
        return int_or_none(methods[0].get("speculative_tokens"))
    return None


def tensors_matching(ctx: ContractContext, suffix: str) -> list[Any]:
    pattern = re.compile(r"(^|\.)" + re.escape(suffix) + "$")
    return [t for name, t in sorted(ctx.tensors().items()) if pattern.search(name)]


def _shape(t: Any) -> list[int]:
    return list(t.shape)


# --- the finding --------------------------------------------------------------------------------------------


def _finish(ctx: ContractContext, invariant_id: str, reading: Reading, expected: str, *, fix: str,
            reason: str, applicability: str = "safe") -> Finding:
    if reading.problems:
        return ctx.finding(invariant_id, "mismatch", expected=expected, observed="; ".join(reading.problems),
                           evidence=reading.evidence, confidence=0.85, reason=reason, notes=reading.notes,
                           fix=Fix(code_hint=fix, applicability=applicability))  # type: ignore[arg-type]
    if reading.agreements:
        finding = ctx.finding(
            invariant_id, "unknown", expected=expected, observed="; ".join(reading.agreements),
            evidence=reading.evidence, notes=reading.notes,
            reason="read from the config / checkpoint header and consistent with the rule; a static reading is "
                   "reported, not claimed as a match" + (f" ({'; '.join(reading.missing)} not read)" if reading.missing else ""))
        return finding.model_copy(update={"static_agreement": True})
    return ctx.finding(invariant_id, "unknown", expected=expected, evidence=reading.evidence, notes=reading.notes,
                       reason=("nothing decides it: " + "; ".join(reading.missing) if reading.missing
                               else "nothing in the inputs decides it"))


# --- DFlash2 ------------------------------------------------------------------------------------------------


def check_dflash2_anchor_is_bonus(ctx: ContractContext) -> Finding:
    """dflash2.anchor_is_bonus: speculators #1006 states it; [S090] dflash/core.py:259; [Z] propose."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    block, layout, drafted = block_size(config), sample_from_anchor(config), speculative_tokens(config)
    if layout is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{layout[0]}", value=str(layout[1]).lower()))
        if layout[1]:
            reading.problems.append("sample_from_anchor true: slot 0 drafts from the anchor, but DFlash2's selector "
                                    "walk starts with the anchor as its first predecessor and proposes slots 1..B-1")
        else:
            reading.agreements.append("sample_from_anchor false (the anchor is the bonus token)")
    else:
        reading.missing.append("sample_from_anchor")
    if drafted is not None and block is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:speculators_config.proposal_methods[0]."
                                         "speculative_tokens", value=str(drafted)))
        if drafted != block - 1:
            reading.problems.append(f"speculative_tokens {drafted} with block_size {block}: DFlash2 proposes B-1 = "
                                    f"{block - 1}")
        else:
            reading.agreements.append(f"speculative_tokens {drafted} = B-1")
    return _finish(ctx, "dflash2.anchor_is_bonus", reading, "sample_from_anchor false; speculative_tokens = block_size - 1",
                   fix="Write sample_from_anchor false and speculative_tokens block_size - 1 (retrain if the drafter "
                       "was trained anchor-first).",
                   reason="the server proposes from other slots than the drafter trained: every draft is one slot off")


def check_dflash2_full_vocab(ctx: ContractContext) -> Finding:
    """dflash2.full_vocab: [S090] dflash2/core.py:38-48."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    vocab, vocab_where = verifier_vocab(ctx)
    if vocab is None:
        reading.missing.append("the verifier's vocab_size")
    draft = setting(config, "draft_vocab_size")
    if draft is not None and int_or_none(draft[1]) is not None and vocab is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{draft[0]}", value=str(draft[1])))
        if draft[1] != vocab:
            reading.problems.append(f"draft_vocab_size {draft[1]} but the verifier's vocabulary is {vocab} "
                                    f"({vocab_where}): DFlash2's selector scores the full vocabulary")
        else:
            reading.agreements.append(f"draft_vocab_size {vocab} = the verifier's")
    top_k = setting(config, "selector_top_k")
    if top_k is not None and int_or_none(top_k[1]) is not None and vocab is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{top_k[0]}", value=str(top_k[1])))
        if top_k[1] > vocab:
            reading.problems.append(f"selector_top_k {top_k[1]} exceeds the vocabulary {vocab}")
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.predecessor_codebook.weight", "candidate_selector.successor_codebook.weight",
                 "lm_head.weight"):
        for tensor in tensors_matching(ctx, name):
            reading.evidence.append(Evidence(kind="checkpoint", location=f"{ctx.checkpoint_path()}:{tensor.name}",
                                             value=str(_shape(tensor))))
            if vocab is not None and tensor.shape and tensor.shape[0] != vocab:
                reading.problems.append(f"{tensor.name} has {tensor.shape[0]} rows, the verifier's vocabulary {vocab}")
            elif vocab is not None:
                reading.agreements.append(f"{tensor.name} [{vocab}, ...]")
    reduced = [n for n in ("d2t", "t2d") if n in ctx.tensors()]
    if reduced:
        reading.problems.append(f"the checkpoint holds the reduced-vocabulary map(s) {', '.join(reduced)}")
    return _finish(ctx, "dflash2.full_vocab", reading, "draft_vocab_size = the verifier's vocabulary; selector_top_k <= V",
                   fix="Train DFlash2 over the verifier's whole vocabulary (no d2t / t2d), with selector_top_k <= V.",
                   applicability="unsafe",
                   reason="speculators' DFlash2DraftModel refuses a reduced vocabulary, and the selector's codebooks "
                          "index verifier token ids: a reduced head scores other tokens than the codebooks name")


def _conv_params(config: dict[str, Any] | None) -> tuple[int | None, int | None, str]:
    """(k, g, how) from the config; speculators' flat config defaults k=2, g=16 ([S090] dflash2/config.py:26-35)."""
    k, g = setting(config, "conv_kernel_size"), setting(config, "conv_group_size")
    flat = isinstance(config, dict) and config.get("speculators_model_type") == DFLASH2
    k_value = int_or_none(k[1]) if k else (2 if flat else None)
    g_value = int_or_none(g[1]) if g else (16 if flat else None)
    how = "config" if k and g else "speculators' defaults" if flat else "config (partial)"
    return k_value, g_value, how


def _projection_problem(shape: list[int], k: int, hidden: int, group: int | None) -> str | None:
    """kernel_projection.weight is [2*k*H/g, H]: one delta per tap and channel group, for the input and output
    convolutions. Without g from the config, its rows must still be 2k times a group count that divides H."""
    if len(shape) != 2 or shape[1] != hidden:
        return f"not [2*k*H/g, {hidden}]"
    if group:
        want = 2 * k * (hidden // group)
        return None if hidden % group == 0 and shape[0] == want else f"the rule gives [{want}, {hidden}] for k={k}, g={group}"
    groups, rest = divmod(shape[0], 2 * k)
    return None if not rest and groups and hidden % groups == 0 else f"{shape[0]} rows are not 2*k*(H/g) for k={k}"


def check_dflash2_conv_shapes(ctx: ContractContext) -> Finding:
    """dflash2.conv_shapes: [S090] dflash2/model_definitions.py:57-78, 117-135."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    hidden, block = hidden_size(ctx), block_size(config)
    k, g, how = _conv_params(config)
    if k is not None and g is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:conv_kernel_size/conv_group_size",
                                         value=f"k={k}, g={g} ({how})"))
        if g > 0 and hidden is not None:
            if hidden % g:
                reading.problems.append(f"hidden_size {hidden} is not divisible by conv_group_size {g}")
            else:
                reading.agreements.append(f"H {hidden} % g {g} == 0")
        if block is not None:
            if k > block:
                reading.problems.append(f"conv_kernel_size {k} exceeds block_size {block}")
            else:
                reading.agreements.append(f"k {k} <= B {block}")
    bases = tensors_matching(ctx, "base_kernel")
    projections = {t.name.rsplit(".", 2)[0]: t for t in tensors_matching(ctx, "kernel_projection.weight")}
    for base in bases:
        module = base.name.rsplit(".", 1)[0]
        shape = _shape(base)
        reading.evidence.append(Evidence(kind="checkpoint", location=f"{ctx.checkpoint_path()}:{base.name}", value=str(shape)))
        if len(shape) != 3 or shape[0] != 2:
            reading.problems.append(f"{base.name} {shape}, not [2, k, H]")
            continue
        k_ckpt, h_ckpt = shape[1], shape[2]
        if k is not None and k_ckpt != k:
            reading.problems.append(f"{base.name} {shape} holds k={k_ckpt} taps, the config says {k}")
        if hidden is not None and h_ckpt != hidden:
            reading.problems.append(f"{base.name} {shape} is over H={h_ckpt}, the drafter's hidden size is {hidden}")
        projection = projections.get(module)
        if projection is not None:
            problem = _projection_problem(_shape(projection), k_ckpt, h_ckpt, g)
            if problem:
                reading.problems.append(f"{projection.name} {_shape(projection)}: {problem}")
        else:
            reading.problems.append(f"{module}.kernel_projection.weight is missing beside {base.name}")
    if bases and not reading.problems:
        reading.agreements.append(f"{len(bases)} convolution(s): base_kernel [2, k, H] with its kernel_projection")
    if not bases and ctx.tensors():
        reading.problems.append("the checkpoint holds no DFlash2 convolution (no *.base_kernel): a DFlash checkpoint "
                                "labelled DFlash2, or the convolutions were not saved")
    elif not ctx.tensors():
        reading.missing.append("the checkpoint's tensors")
    return _finish(ctx, "dflash2.conv_shapes", reading, "H % g == 0; k <= B; base_kernel [2,k,H]; kernel_projection [2k*H/g, H]",
                   fix="Build each GroupedDynamicCausalConv with the config's k and g (H divisible by g, k <= B) and "
                       "save both convolutions of every layer.", applicability="unsafe",
                   reason="a loader builds the convolutions from the config: shapes that differ fail to load or, "
                          "with k or g misread, convolve with the wrong taps")


def check_dflash2_noncausal_swa(ctx: ContractContext) -> Finding:
    """dflash2.noncausal_swa: [S090] dflash2/config.py:22-25, dflash/core.py:250; [Z] dflash2-config.json."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    layer = _layer(ctx)
    sliding = bool(layer) and any(served_attention(layer, config or {}).declared)
    record, record_where = trained_record(ctx)
    trained = (record or {}).get("sliding_window_non_causal") if isinstance(record, dict) else None
    flat = setting(config, "sliding_window_non_causal")
    if not isinstance(trained, bool) and flat is not None and isinstance(flat[1], bool) and not is_export(config):
        trained, record_where = flat[1], f"{where}:{flat[0]}"
    if isinstance(trained, bool):
        reading.evidence.append(Evidence(kind="config", location=record_where, value=str(trained).lower()))
    if not layer:
        reading.missing.append("the drafter's layer config")
    elif not sliding:
        reading.agreements.append("no sliding-window layer")
    if sliding and trained is False:
        reading.problems.append("the sliding layers trained causal within the block; DFlash2's are bidirectional "
                                "(sliding_window_non_causal true)")
    served: bool | None = None  # served bidirectional
    if is_export(config) and sliding:
        if isinstance(config.get("dflash_config"), dict) and config.get("speculators_model_type") is None:
            causal = config.get("is_causal")
            reading.evidence.append(Evidence(kind="config", location=f"{where}:is_causal",
                                             value="absent" if causal is None else str(causal).lower()))
            served = causal is False
            if causal is None:
                reading.notes.append("z-lab's loader builds a sliding layer causal unless the config sets is_causal false")
        elif flat is not None and isinstance(flat[1], bool):
            reading.evidence.append(Evidence(kind="config", location=f"{where}:{flat[0]}", value=str(flat[1]).lower()))
            served = flat[1]
        if served is False:
            reading.problems.append("the export serves the sliding layers causal within the block" +
                                    (" (is_causal not false)" if flat is None else " (sliding_window_non_causal false)"))
        elif served:
            reading.agreements.append("served bidirectional")
    return _finish(ctx, "dflash2.noncausal_swa", reading, "sliding layers bidirectional within the block, trained and served",
                   fix="Train with sliding_window_non_causal true and export is_causal false (nested) or "
                       "sliding_window_non_causal true (flat).",
                   reason="a drafter trained with bidirectional blocks and served causal drafts slot k without "
                          "the later slots it learned to read: acceptance falls")


def _named_engine(ctx: ContractContext) -> Engine | None:
    return resolve_engine(ctx.served_by) if ctx.served_by else None


def check_dflash2_served_layout(ctx: ContractContext) -> Finding:
    """dflash2.served_layout: [S090] writes flat fields; [Z], vLLM #52816 and SGLang #35371 read nested ones."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    expected = "the config layout the serving engine reads, with the selector and convolutions enabled"
    if not is_export(config):
        return ctx.finding("dflash2.served_layout", "unknown", expected=expected,
                           reason="not a serving config (an export's config.json): how a server reads it is not known")
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else None
    layout = "nested" if nested is not None else "flat"
    reading.evidence.append(Evidence(kind="config", location=where, value=f"{layout} DFlash2 fields"))
    if nested is not None:
        off = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
               if not int_or_none(nested.get(k))]
        if off:
            reading.problems.append(f"dflash_config lacks {', '.join(off)} (read as 0): [Z] and SGLang #35371 then "
                                    "leave those modules off and serve plain DFlash")
        architectures = config.get("architectures") or []
        if "DFlash2DraftModel" not in architectures:
            reading.problems.append(f"architectures {architectures}: vLLM #52816 dispatches DFlash2 on "
                                    "DFlash2DraftModel")
    engine = _named_engine(ctx)
    engines = load_engines()
    if engine is not None:
        family = engine.family.get(DFLASH2)
        if family is None:
            reading.problems.append(f"{engine.title} has no DFlash2 runtime in the engine table")
        else:
            reading.evidence.append(Evidence(kind="reference", location=f"playbooks/serving/engines.yaml: {engine.key}",
                                             value=str(family.get("source", ""))))
            if family.get("selector") is False:
                reading.problems.append(f"{engine.title} does not run the candidate selector: it serves DFlash2 as "
                                        "plain DFlash")
            if family.get("config") not in (None, layout, "either"):
                reading.problems.append(f"{engine.title} reads the {family.get('config')} layout; this export is {layout}")
            if not reading.problems:
                reading.agreements.append(f"{layout} layout, as {engine.title} reads it")
    else:
        readers = [e.title for e in engines.values() if e.family.get(DFLASH2, {}).get("config") not in (None, layout, "either")]
        if readers and not reading.problems:
            reading.notes.append(f"{layout} fields are not read by: {', '.join(readers)} (name yours with --served-by)")
        if layout == "nested" and not reading.problems:
            reading.agreements.append("nested dflash_config with every module's fields")
        reading.missing.append("the serving engine (--served-by)")
    return _finish(ctx, "dflash2.served_layout", reading, expected,
                   fix="Export the layout the engine reads (nested dflash_config with conv / selector fields, "
                       "architectures [\"DFlash2DraftModel\"]) and serve on a runtime that runs the selector "
                       "(vLLM's V2 model runner, PR #52816).",
                   reason="a server that misses the DFlash2 fields serves the checkpoint as plain DFlash, silently: "
                          "the convolutions and the selector it trained with are dropped")


# --- DSpark -------------------------------------------------------------------------------------------------


def _behind_switch(finding: Finding) -> bool:
    """A code reading taken behind a runtime switch (the engine says `behind `...``): which branch ran is the
    config's, so it is no evidence of the anchor-first branch."""
    return "behind `" in (finding.reason or "")


def _anchor_first_findings(ctx: ContractContext) -> dict[str, Finding]:
    return {f.id: f for f in ctx.findings if f.id in ANCHOR_FIRST_VALUES}


def check_dspark_anchor_slot_trained(ctx: ContractContext) -> Finding:
    """dspark.anchor_slot_trained: [S090] dflash/core.py:259, 438-442, 482-484; speculators #737."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    block, layout, drafted = block_size(config), sample_from_anchor(config), speculative_tokens(config)
    if layout is None:
        reading.missing.append("sample_from_anchor")
    else:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{layout[0]}", value=str(layout[1]).lower()))
    if layout is not None and drafted is not None and block is not None:
        want = block if layout[1] else block - 1
        reading.evidence.append(Evidence(kind="config", location=f"{where}:speculators_config.proposal_methods[0]."
                                         "speculative_tokens", value=str(drafted)))
        if drafted != want:
            reading.problems.append(f"speculative_tokens {drafted} with block_size {block} and sample_from_anchor "
                                    f"{str(layout[1]).lower()}: the drafter proposes {want} (speculators #737)")
        else:
            reading.agreements.append(f"speculative_tokens {drafted} for block_size {block}")
    base = _anchor_first_findings(ctx).get("dflash.anchor_slot_untrained")
    if (anchor_first(ctx)[0] and base is not None and base.observed in ANCHOR_FIRST_VALUES[base.id]
            and not _behind_switch(base)):
        code = [e for e in base.evidence if e.kind in ("code", "probe")]
        if base.observed == ANCHOR_FIRST_VALUES[base.id][0] and code:
            reading.evidence += code[:2]
            reading.problems.append("slot 0 gets loss weight 0 although sample_from_anchor trains it (slot 0 "
                                    "predicts the token after the anchor)")
        elif code:
            reading.evidence += code[:1]
            reading.agreements.append("slot 0 trained")
    return _finish(ctx, "dspark.anchor_slot_trained", reading,
                   "with sample_from_anchor: slot 0 trained (w_0 = 1), B proposals; without: B-1",
                   fix="Write speculative_tokens = block_size with sample_from_anchor (block_size - 1 without), and "
                       "train slot 0 when the drafter drafts from the anchor.",
                   reason="a server that proposes one token fewer (or more) than trained wastes the last slot or "
                          "verifies an untrained one")


def _dspark_served(engine: Engine, config: dict[str, Any]) -> tuple[bool | None, str]:
    """(the layout engine serves: True = anchor-first, why) for this export."""
    rule = engine.family.get(DSPARK)
    if rule is None:
        return None, f"{engine.title} has no DSpark runtime in the engine table"
    stated = sample_from_anchor(config)
    reads = rule.get("sample_from_anchor")
    absent = rule.get("when_absent")
    if stated is not None and (reads == "read" or (reads == "speculators_model_type"
                                                   and config.get("speculators_model_type") == DSPARK)):
        return stated[1], f"{engine.title} reads sample_from_anchor {str(stated[1]).lower()}"
    why = ("ignores sample_from_anchor" if reads == "ignored" else "reads sample_from_anchor only with "
           "speculators_model_type dspark" if reads == "speculators_model_type" and stated is not None
           else "finds no sample_from_anchor")
    return (absent if isinstance(absent, bool) else None), f"{engine.title} {why} and assumes " + (
        "anchor-first" if absent else "anchor-as-bonus" if absent is False else "an undocumented layout")


def check_dspark_sample_from_anchor_served(ctx: ContractContext) -> Finding:
    """dspark.sample_from_anchor_served: vLLM #48639 (absent = true), llama.cpp #26275 (absent = false), SGLang
    #30852 (a speculators-layout checkpoint read anchor-first, one slot early)."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    expected = "the export states sample_from_anchor, and the serving engine reads it as trained"
    if not is_export(config):
        return ctx.finding("dspark.sample_from_anchor_served", "unknown", expected=expected,
                           reason="not a serving config (an export's config.json): what a server reads is not known")
    stated = sample_from_anchor(config)
    engines = load_engines()
    defaults = {e.title: e.family[DSPARK].get("when_absent") for e in engines.values() if DSPARK in e.family}
    if stated is None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:sample_from_anchor", value="absent"))
        split = ", ".join(f"{t} assumes {'true' if v else 'false'}" for t, v in defaults.items() if isinstance(v, bool))
        reading.problems.append(f"sample_from_anchor is absent and servers disagree on its default ({split})")
    else:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{stated[0]}", value=str(stated[1]).lower()))
    engine = _named_engine(ctx)
    trained = stated[1] if stated is not None else None
    if engine is not None:
        served, why = _dspark_served(engine, config)
        reading.evidence.append(Evidence(kind="reference", location=f"playbooks/serving/engines.yaml: {engine.key}",
                                         value=str(engine.family.get(DSPARK, {}).get("source", why))))
        if served is None:
            reading.problems.append(why)
        elif trained is not None and served != trained:
            reading.problems.append(f"{why}; the drafter trained sample_from_anchor {str(trained).lower()}: every "
                                    f"slot is read one position {'early' if served else 'late'}")
        elif trained is not None:
            reading.agreements.append(why)
        elif served is False:
            reading.problems.append(f"{why}; DSpark trains anchor-first unless told otherwise (speculators 0.9.0 "
                                    "dspark/config.py:73, DeepSpec): every slot would be read one position late")
    elif stated is not None:
        wrong = [e.title for e in engines.values() if DSPARK in e.family and _dspark_served(e, config)[0] not in (None, stated[1])]
        if wrong:
            reading.notes.append(f"read with the other layout by: {', '.join(wrong)} (name yours with --served-by)")
        reading.agreements.append(f"sample_from_anchor {str(stated[1]).lower()} stated")
        reading.missing.append("the serving engine (--served-by)")
    return _finish(ctx, "dspark.sample_from_anchor_served", reading, expected,
                   fix="Write sample_from_anchor into the export (top level and dflash_config) as trained, and serve "
                       "with an engine that reads it (vLLM PR #48639; SGLang after PR #30982 needs "
                       "speculators_model_type dspark).",
                   reason="a server that assumes the other layout reads every slot one position off: acceptance "
                          "collapses to about one token (SGLang #30852: 1.1 vs 4.05)")


def check_dspark_markov_shapes(ctx: ContractContext) -> Finding:
    """dspark.markov_shapes / conf_target: [S090] dspark/model_definitions.py:35-37, core.py:55-62."""
    config, where, reading = ctx.config, _where(ctx), Reading()
    rank = setting(config, "markov_rank")
    with_markov = setting(config, "confidence_head_with_markov")
    conf_on = setting(config, "enable_confidence_head")
    rank_value = int_or_none(rank[1]) if rank else None
    if rank is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{rank[0]}", value=str(rank[1])))
    if with_markov is not None and with_markov[1] is True and (conf_on is None or conf_on[1] is not False):
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{with_markov[0]}", value="true"))
        if rank_value is not None and rank_value <= 0:
            reading.problems.append(f"confidence_head_with_markov true with markov_rank {rank_value}: the confidence "
                                    "head's Markov input does not exist")
        elif rank_value is not None:
            reading.agreements.append(f"confidence head with Markov input, markov_rank {rank_value}")
    vocab, vocab_where = verifier_vocab(ctx)
    draft = setting(config, "draft_vocab_size")
    draft_vocab = int_or_none(draft[1]) if draft else vocab
    hidden = hidden_size(ctx)
    w1 = tensors_matching(ctx, "markov_w1.weight")
    w2 = tensors_matching(ctx, "markov_w2.weight")
    for tensor in w1:
        shape = _shape(tensor)
        reading.evidence.append(Evidence(kind="checkpoint", location=f"{ctx.checkpoint_path()}:{tensor.name}", value=str(shape)))
        if vocab is not None and shape[0] != vocab:
            reading.problems.append(f"{tensor.name} {shape}: W1 is indexed by the previous token's verifier id and "
                                    f"needs {vocab} rows ({vocab_where})")
        if rank_value is not None and len(shape) == 2 and shape[1] != rank_value:
            reading.problems.append(f"{tensor.name} {shape} has rank {shape[1]}, the config's markov_rank is {rank_value}")
    for tensor in w2:
        shape = _shape(tensor)
        reading.evidence.append(Evidence(kind="checkpoint", location=f"{ctx.checkpoint_path()}:{tensor.name}", value=str(shape)))
        if draft_vocab is not None and shape[0] != draft_vocab:
            reading.problems.append(f"{tensor.name} {shape}: W2 projects to the {draft_vocab}-token draft vocabulary")
    conf = tensors_matching(ctx, "confidence_head.proj.weight")
    with_markov_on = with_markov[1] if with_markov and isinstance(with_markov[1], bool) else None
    for tensor in conf:
        shape = _shape(tensor)
        reading.evidence.append(Evidence(kind="checkpoint", location=f"{ctx.checkpoint_path()}:{tensor.name}", value=str(shape)))
        r = (w1[0].shape[1] if w1 and len(w1[0].shape) == 2 else rank_value) or 0
        if hidden is not None and with_markov_on is not None:
            want = hidden + (r if with_markov_on else 0)
            if shape[-1] != want:
                reading.problems.append(f"{tensor.name} {shape}: its input is H{' + r' if with_markov_on else ''} = {want}")
    if rank_value and ctx.tensors() and not w1:
        reading.problems.append(f"markov_rank {rank_value} but the checkpoint holds no markov_head.markov_w1")
    if (w1 or w2) and not reading.problems:
        reading.agreements.append("Markov head W1 [V_verifier, r], W2 [V_draft, r]")
    if not ctx.tensors():
        reading.missing.append("the checkpoint's tensors")
    return _finish(ctx, "dspark.markov_shapes", reading,
                   "W1 [V_verifier, r]; W2 [V_draft, r]; confidence input H + r*with_markov; with_markov needs markov_rank > 0",
                   fix="Size W1 by the verifier's vocabulary and W2 by the draft vocabulary, both at markov_rank; "
                       "enable confidence_head_with_markov only with markov_rank > 0.", applicability="unsafe",
                   reason="a server sizes the Markov head from the verifier's vocabulary (vLLM #47093): other shapes "
                          "do not load, or index other tokens")


# --- Domino, JetSpec ----------------------------------------------------------------------------------------


def check_domino_suffix_start(ctx: ContractContext) -> Finding:
    """domino.suffix_start: [F] modeling/draft/domino.py:37-40, 56-62; vLLM #48241 (fields at the top level)."""
    config, where, reading = ctx.config or {}, _where(ctx), Reading()
    nested = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else None
    block = block_size(config)
    for key in ("emb_dim", "gru_hidden_dim"):
        if is_export(config) and (nested is None or int_or_none(nested.get(key)) is None):
            top = "at the top level, " if key in config else ""
            reading.problems.append(f"dflash_config.{key} is missing ({top}where SpecForge's Domino loader does "
                                    "not read it; vLLM #48241)")
    prefix = setting(config, "pure_draft_prefix_len")
    p = int_or_none(prefix[1]) if prefix else (0 if nested is not None else None)
    if prefix is not None:
        reading.evidence.append(Evidence(kind="config", location=f"{where}:{prefix[0]}", value=str(prefix[1])))
    if p is not None and block is not None:
        if not 0 <= p < block:
            reading.problems.append(f"pure_draft_prefix_len {p} outside 0..B-1 = 0..{block - 1}")
        else:
            reading.agreements.append(f"0 <= pure_draft_prefix_len {p} < B {block}")
    return _finish(ctx, "domino.suffix_start", reading, "emb_dim, gru_hidden_dim in dflash_config; 0 <= p < B",
                   fix="Write emb_dim, gru_hidden_dim and pure_draft_prefix_len (0 <= p < block_size) inside dflash_config.",
                   reason="a loader without the GRU's sizes cannot build the correction head; a prefix length past "
                          "the block leaves every slot uncorrected")


def check_jetspec_causal_stamp(ctx: ContractContext) -> Finding:
    """jetspec.causal_stamp: [NA] jetspec_core.py (causal=True); NeMo #2913."""
    config, where, reading = ctx.config or {}, _where(ctx), Reading()
    expected = "dflash_config.causal true"
    if not is_export(config):
        return ctx.finding("jetspec.causal_stamp", "unknown", expected=expected,
                           reason="not a serving config (an export's config.json)")
    causal = setting(config, "causal")
    reading.evidence.append(Evidence(kind="config", location=f"{where}:{causal[0] if causal else 'dflash_config.causal'}",
                                     value="absent" if causal is None else str(causal[1]).lower()))
    if causal is None or causal[1] is not True:
        reading.problems.append("dflash_config.causal is " + ("absent" if causal is None else str(causal[1]).lower()) +
                                ": vLLM runs the JetSpec draft bidirectionally in the block")
    else:
        reading.agreements.append("dflash_config.causal true")
    return _finish(ctx, "jetspec.causal_stamp", reading, expected,
                   fix="Write dflash_config.causal true into the export.",
                   reason="JetSpec trains the block causally; served bidirectionally each slot reads later slots it "
                          "never saw in training")


FAMILY_CHECKS: dict[str, Callable[[ContractContext], Finding]] = {
    "dflash2.anchor_is_bonus": check_dflash2_anchor_is_bonus,
    "dflash2.full_vocab": check_dflash2_full_vocab,
    "dflash2.conv_shapes": check_dflash2_conv_shapes,
    "dflash2.noncausal_swa": check_dflash2_noncausal_swa,
    "dflash2.served_layout": check_dflash2_served_layout,
    "dspark.anchor_slot_trained": check_dspark_anchor_slot_trained,
    "dspark.sample_from_anchor_served": check_dspark_sample_from_anchor_served,
    "dspark.markov_shapes": check_dspark_markov_shapes,
    "domino.suffix_start": check_domino_suffix_start,
    "jetspec.causal_stamp": check_jetspec_causal_stamp,
}


# --- scope: which invariants apply to this run's variant ----------------------------------------------------


def applies(rule: Any, variant: str) -> bool:
    variants = getattr(rule, "variants", None) or []
    return not variants or variant in variants


def apply_variant_scope(findings: list[Finding], ctx: ContractContext) -> list[Finding]:
    """Drop the findings of invariants for another variant; re-judge the base invariants whose expected value
    moves with DSpark's anchor-first layout (slot 0 trained, targets at a+k)."""
    variant = ctx.variant.kind
    kept = [f for f in findings if f.id not in ctx.rules or applies(ctx.rules[f.id], variant)]
    first_layout, why = anchor_first(ctx)
    if not first_layout:
        return kept
    out = []
    for finding in kept:
        values = ANCHOR_FIRST_VALUES.get(finding.id)
        if values is None or finding.observed not in values or _behind_switch(finding):
            out.append(finding)
            continue
        bonus, first = values
        note = (f"the drafter drafts from the anchor ({why}; variant {ctx.variant.describe()}): the rule's value is "
                f"{first!r}, not {bonus!r}")
        if finding.observed == first and finding.status == "mismatch":
            measured = any(e.kind == "probe" for e in finding.evidence)
            finding = finding.model_copy(update={
                "status": "match" if measured else "unknown", "static_agreement": not measured,
                "expected": first, "fix": None, "confidence": finding.confidence if measured else 0.0,
                "reason": f"{finding.reason}; {note}", "notes": [*finding.notes, note]})
        elif finding.observed == bonus:
            finding = finding.model_copy(update={
                "status": "mismatch", "static_agreement": False, "expected": first,
                "confidence": max(finding.confidence, 0.6), "reason": f"{note}; observed {bonus!r}",
                "notes": [*finding.notes, note]})
        out.append(finding)
    return out
