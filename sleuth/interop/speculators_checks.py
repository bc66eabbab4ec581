"""Config checks for speculators DFlash drafters, in speculators' own conventions.

Each check returns a `Finding` under the playbook id it decides (so it replaces the generic engine's
reading, which assumes our trainer's conventions), or under a `speculators.*` id for what only speculators
has. Remedies are written as the `speculators train` flag to change, or the config.json key to edit.
Evidence values are the file's own text: `json.dumps` of the value as parsed (what the file holds, with
JSON's spelling: `null`, `true`).

Conventions (speculators 0.9.0, `models/utils.py` `resolve_target_layer_ids`):
- `aux_hidden_state_layer_ids`: id i = HF `hidden_states[i]` (0 is the embeddings; i = L is the final
  hidden state, which `launch_vllm.py` appends on its own and speculators accepts). Its default is
  `[2, L//2, L-3]`; z-lab's rule `round(1 + i*(L-4)/(k-1))` converted to this convention is that + 1.
- `fc.weight` is `[H, k*H]` over all k listed layers (`models/dflash/core.py`).
- `sample_from_anchor`: false for DFlash, true for DSpark (`_build_base_config_kwargs`); the greedy
  proposal's `speculative_tokens` is `block_size - 1` (false) or `block_size` (true).
- `--dflash-decay-gamma` (default 4.0) weighs slot k by exp(-(k-1)/gamma) with `--per-position-loss-weight
  fixed-exp-decay`; with `dpace` (speculators' current default) gamma is unused.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from sleuth.findings import Evidence, Finding, Fix
from sleuth.interop.speculators import SpeculatorsRun
from sleuth.oracle import speculators_default_layer_ids, target_layer_ids

TRAIN = "speculators train"


def check_speculators(run: SpeculatorsRun) -> list[Finding]:
    if run.config is None or run.chosen is None:
        return []
    return [
        check_target_layer_ids(run),
        check_fc_input_layers(run),
        check_mask_token_id(run),
        check_sample_from_anchor(run),
        check_loss_decay_gamma(run),
        check_loss_kind(run),
    ]


def quote(value: Any) -> str:
    """A config value as the JSON file spells it."""
    return json.dumps(value)


def zlab_rule_in_vllm_ids(num_layers: int, k: int) -> list[int]:
    return [i + 1 for i in target_layer_ids(num_layers, k)]  # vLLM id i+1 = HF hidden_states[i+1] = layer i


def accepted_selections(num_layers: int, k: int) -> list[list[int]]:
    """The selections speculators and the paper's authors would make for k layers of an L-layer verifier."""
    options = [zlab_rule_in_vllm_ids(num_layers, k)]
    if k == 3:
        options.insert(0, speculators_default_layer_ids(num_layers))
    return options


# --- the checks ----------------------------------------------------------------------------------------


def check_target_layer_ids(run: SpeculatorsRun) -> Finding:
    config, where = run.config or {}, _where(run)
    finding = Finding(
        id="dflash.target_layer_ids",
        title="Target layers selected evenly, in vLLM's layer numbering",
        status="unknown",
        severity="medium",
        confidence=0.9,
        expected="speculators' default [2, L//2, L-3] or z-lab's rule + 1 (id i = HF hidden_states[i])",
    )
    ids = config.get("aux_hidden_state_layer_ids")
    finding.evidence.append(Evidence(kind="config", location=f"{where}:aux_hidden_state_layer_ids", value=quote(ids)))
    verifier = run.verifier
    if verifier.num_layers is not None:
        finding.evidence.append(Evidence(
            kind="config", location=f"{verifier.config_path}:num_hidden_layers", value=quote(verifier.num_layers),
        ))
    elif _is_int(config.get("num_target_layers")):
        # `trainer export --format speculators` records the target's depth beside the ids.
        verifier = replace(verifier, num_layers=config["num_target_layers"])
        finding.evidence.append(Evidence(
            kind="config", location=f"{where}:num_target_layers", value=quote(config["num_target_layers"]),
        ))
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        finding.reason = f"aux_hidden_state_layer_ids is {quote(ids)}, not a list of layer ids"
        finding.status, finding.severity = "mismatch", "high"
        finding.observed = quote(ids)
        return finding
    finding.observed = f"{quote(ids)} (z-lab numbering {quote([i - 1 for i in ids])})"
    fc_layers = _fc_layer_count(run)
    if fc_layers is not None:
        count, shape, tensor = fc_layers
        finding.evidence.append(Evidence(kind="checkpoint", location=tensor, value=quote(shape)))
        if count != len(ids):
            trained_ids = _trained_ids(run, count)
            remedy = trained_ids or (accepted_selections(verifier.num_layers, count)[0] if verifier.num_layers else None)
            finding.status, finding.severity = "mismatch", "high"
            finding.reason = (
                f"the id list names {len(ids)} layer(s) but {tensor} {quote(shape)} reads {count}: the list in "
                f"{where} is wrong (shortened or edited), the weights are not"
            )
            finding.fix = _ids_fix(remedy, count, trained=trained_ids is not None)
            return finding
    if 0 in ids:
        finding.status, finding.severity = "mismatch", "high"
        finding.reason = "id 0 is HF hidden_states[0], the token embeddings, not a decoder layer's output"
        finding.fix = _ids_fix(accepted_selections(verifier.num_layers, len(ids))[0] if verifier.num_layers else None, len(ids))
        return finding
    if verifier.num_layers is None:
        finding.reason = f"the verifier's depth is unknown: {verifier.reason}"
        return finding
    depth = verifier.num_layers
    out_of_range = [i for i in ids if i < 0 or i > depth]
    accepted = accepted_selections(depth, len(ids))
    if out_of_range:
        finding.status, finding.severity = "mismatch", "high"
        finding.reason = (
            f"{quote(out_of_range)} outside [1, {depth}] for a verifier with {depth} layers "
            f"(id {depth} is the final hidden state)"
        )
        finding.fix = _ids_fix(accepted[0], len(ids))
        return finding
    if ids in accepted:
        finding.status = "match"
        which = "speculators' default [2, L//2, L-3]" if len(ids) == 3 and ids == speculators_default_layer_ids(depth) else "z-lab's rule + 1"
        finding.reason = f"{quote(ids)} is {which} for L={depth}"
        return finding
    for option in accepted:
        for shift in (-1, 1):
            if [i + shift for i in option] == ids:
                finding.status, finding.severity = "mismatch", "high"
                convention = (
                    "z-lab's numbering (id i = hidden_states[i+1]) used where vLLM's is expected"
                    if shift == -1 else "converted to vLLM's numbering twice"
                )
                finding.reason = (
                    f"{quote(ids)} is {quote(option)} off by {shift:+d} for L={depth}: {convention}; the drafter "
                    "reads features one layer away from what it is served"
                )
                finding.fix = _ids_fix(option, len(ids))
                return finding
    finding.status, finding.severity = "mismatch", "low"
    finding.reason = f"a custom selection; for L={depth} the reference picks {quote(accepted[0])}"
    finding.fix = _ids_fix(accepted[0], len(ids))
    return finding


def check_fc_input_layers(run: SpeculatorsRun) -> Finding:
    finding = Finding(
        id="dflash.fc_input_layers",
        title="fc reads every selected target layer",
        status="unknown",
        severity="high",
        confidence=0.9,
        expected="fc.weight [H, k*H] over all k ids in aux_hidden_state_layer_ids",
    )
    ids = (run.config or {}).get("aux_hidden_state_layer_ids")
    fc_layers = _fc_layer_count(run)
    if fc_layers is None:
        finding.reason = "no readable fc.weight in the checkpoint"
        return finding
    count, shape, tensor = fc_layers
    finding.evidence.append(Evidence(kind="checkpoint", location=tensor, value=quote(shape)))
    finding.evidence.append(Evidence(kind="config", location=f"{_where(run)}:aux_hidden_state_layer_ids", value=quote(ids)))
    finding.observed = f"fc reads {count} layer(s) of hidden size {shape[0]}"
    if isinstance(ids, list) and count == len(ids):
        finding.status = "match"
        finding.reason = f"{count} ids, fc input {shape[1]} = {count} x {shape[0]}"
    else:
        finding.reason = "fc's shape and the id list disagree: the id list is the defect (see dflash.target_layer_ids)"
    return finding


def check_mask_token_id(run: SpeculatorsRun) -> Finding:
    config, where = run.config or {}, _where(run)
    value = config.get("mask_token_id")
    finding = Finding(
        id="speculators.mask_token_id",
        title="The mask token the drafter fills slots 1..B-1 with is recorded",
        status="match",
        severity="high",
        confidence=0.95,
        expected="an integer token id inside the verifier's vocabulary",
        observed=quote(value),
        evidence=[Evidence(kind="config", location=f"{where}:mask_token_id", value=quote(value))],
    )
    vocab = run.verifier.vocab_size
    if "mask_token_id" not in config:
        finding.status = "unknown"
        finding.reason = f"{where} has no mask_token_id key (speculators always writes one)"
    elif not isinstance(value, int) or isinstance(value, bool):
        finding.status = "mismatch"
        finding.reason = (
            "no mask token id: vLLM's DFlash proposer fills the block's slots 1..B-1 with it and cannot serve "
            "this drafter as trained"
        )
        finding.fix = Fix(
            config_patch={"mask_token_id": None},
            code_hint=f"set mask_token_id in {where} to the id the drafter was trained with (the tokenizer's mask "
            f"token; `{TRAIN} --mask-token-id N` sets it at training time)",
            applicability="unsafe",
        )
    elif vocab is not None and not 0 <= value < vocab:
        finding.status = "mismatch"
        finding.reason = f"{value} is outside the verifier's vocabulary of {vocab}"
        finding.fix = Fix(code_hint=f"`{TRAIN} --mask-token-id N` with N < {vocab}", applicability="unsafe")
    else:
        finding.reason = f"mask_token_id {value}" + (f" < vocab {vocab}" if vocab else "")
    return finding


def check_sample_from_anchor(run: SpeculatorsRun) -> Finding:
    config, where = run.config or {}, _where(run)
    algorithm = (config.get("speculators_config") or {}).get("algorithm") or config.get("speculators_model_type")
    value = config.get("sample_from_anchor")
    expected = algorithm == "dspark"
    finding = Finding(
        id="dflash.anchor_slot_untrained",
        title="Slot 0 (the anchor) is not drafted: sample_from_anchor matches the algorithm",
        status="unknown",
        severity="high",
        confidence=0.9,
        expected=f"sample_from_anchor {quote(expected)} for {algorithm}",
        observed=quote(value),
        evidence=[
            Evidence(kind="config", location=f"{where}:speculators_config.algorithm", value=quote(algorithm)),
            Evidence(kind="config", location=f"{where}:sample_from_anchor", value=quote(value)),
        ],
    )
    if not isinstance(value, bool) or algorithm not in ("dflash", "dspark", "dflash2"):
        finding.reason = f"cannot decide: algorithm {quote(algorithm)}, sample_from_anchor {quote(value)}"
        return finding
    if value == expected:
        finding.status, finding.reason = "match", f"{algorithm} with sample_from_anchor {quote(value)}"
    else:
        finding.status = "mismatch"
        finding.reason = (
            f"{algorithm} drafts slots 1..B-1 after a verified anchor; sample_from_anchor {quote(value)} trains and "
            "serves slot 0 as a draft too (the DSpark variant)" if algorithm != "dspark"
            else "DSpark samples from the anchor; sample_from_anchor false leaves its slot 0 untrained"
        )
        flag = "--sample-from-anchor" if expected else "--no-sample-from-anchor"
        finding.fix = Fix(
            config_patch={"sample_from_anchor": expected},
            code_hint=f"retrain with `{TRAIN} {flag}` (or set sample_from_anchor: {quote(expected)} in {where} if "
            "the weights were trained that way)",
            applicability="unsafe",
        )
    block = config.get("block_size")
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or []
    tokens = proposals[0].get("speculative_tokens") if proposals and isinstance(proposals[0], dict) else None
    if isinstance(block, int) and isinstance(tokens, int) and isinstance(value, bool):
        finding.evidence.append(Evidence(
            kind="config", location=f"{where}:speculators_config.proposal_methods[0].speculative_tokens", value=quote(tokens),
        ))
        if tokens != (block if value else block - 1):
            finding.notes.append(
                f"speculative_tokens {tokens} with block_size {block}: speculators writes {block if value else block - 1}"
            )
    return finding


def check_loss_decay_gamma(run: SpeculatorsRun) -> Finding:
    config = run.config or {}
    block = config.get("block_size")
    finding = Finding(
        id="dflash.loss_decay_gamma",
        title="Per-slot loss decay exp(-(k-1)/gamma) with the reference gamma",
        status="unknown",
        severity="medium",
        confidence=0.9,
        expected="gamma 4.0 (speculators' default; 7.0 only with block_size 16, as in the paper)",
        evidence=[Evidence(kind="config", location=f"{_where(run)}:block_size", value=quote(block))],
    )
    if run.run_yaml is None and run.train_command is None:
        finding.reason = "no run.yaml or train_command.txt beside the checkpoint: the loss settings are unknown"
        return finding
    algorithm = _algorithm(run)
    gamma = _setting(run, "dflash_decay_gamma", "--dflash-decay-gamma") or _default(run, "dflash_decay_gamma", 4.0)
    weighting = _setting(run, "per_position_loss_weight", "--per-position-loss-weight") or _default(
        run, "per_position_loss_weight", "dpace" if algorithm == "dflash" else "fixed-exp-decay")
    for found in (gamma, weighting):
        if found is not None:
            finding.evidence.append(Evidence(kind="config", location=found[0], value=found[2]))
    if weighting is not None and weighting[1] == "dpace":
        finding.status, finding.observed = "match", "D-PACE weights (gamma unused)"
        finding.reason = "per_position_loss_weight dpace: weights come from the drafter's confidence; gamma is not used"
        return finding
    value = gamma[1]
    finding.observed = f"gamma {value} at block_size {block}"
    try:
        number = float(value)
    except (TypeError, ValueError):
        finding.reason = f"dflash_decay_gamma {value!r} is not a number"
        return finding
    if number == 4.0 or (number == 7.0 and block == 16):
        finding.status, finding.reason = "match", finding.observed
    else:
        finding.status = "mismatch"
        finding.reason = f"gamma {value} with block_size {block}: late slots weigh more than the reference's"
        finding.fix = Fix(
            config_patch={"dflash_decay_gamma": 4.0},
            code_hint=f"retrain with `{TRAIN} --dflash-decay-gamma 4.0` (or 7.0 with `--block-size 16`)",
        )
    return finding


def check_loss_kind(run: SpeculatorsRun) -> Finding:
    finding = Finding(
        id="dflash.loss_kind",
        title="Loss against the target's distribution (CE to its argmax, or KL)",
        status="unknown",
        severity="low",
        confidence=0.9,
        expected="ce (speculators' DFlash default) or kl_div",
    )
    if run.run_yaml is None and run.train_command is None:
        finding.reason = "no run.yaml or train_command.txt beside the checkpoint: the loss is unknown"
        return finding
    found = _setting(run, "loss_fn", "--loss-fn") or _default(run, "loss_fn", "ce" if _algorithm(run) == "dflash" else "kl_div")
    finding.evidence.append(Evidence(kind="config", location=found[0], value=found[2]))
    finding.observed = str(found[1])
    if found[1] in ("ce", "kl_div"):
        finding.status, finding.reason = "match", f"loss_fn {found[1]}"
    else:
        finding.status, finding.severity = "mismatch", "low"
        finding.reason = f"loss_fn {found[1]}: neither the CE nor the KL the references train DFlash with"
        finding.fix = Fix(config_patch={"loss_fn": "ce"}, code_hint=f"retrain with `{TRAIN} --loss-fn ce`")
    return finding


# --- helpers -------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _algorithm(run: SpeculatorsRun) -> str | None:
    config = run.config or {}
    return (config.get("speculators_config") or {}).get("algorithm") or config.get("speculators_model_type")


def _default(run: SpeculatorsRun, key: str, value: Any) -> tuple[str, Any, str]:
    """A setting absent from run.yaml and the argv: speculators resolved its own default (run.yaml omits them)."""
    version = run.speculators_version or "?"
    where = run.run_yaml_path or run.train_command_path
    return f"{where} (no {key}: speculators {version} default)", value, quote(value)



def _where(run: SpeculatorsRun) -> str:
    chosen = run.chosen
    assert chosen is not None
    return str(chosen.path / "config.json")


def _fc_layer_count(run: SpeculatorsRun) -> tuple[int, list[int], str] | None:
    """(k, fc.weight shape, tensor location) from the safetensors header; None if unreadable."""
    chosen = run.chosen
    if chosen is None or chosen.weights is None:
        return None
    from sleuth.evidence.checkpoint import CheckpointError, read_header

    try:
        tensors = read_header(chosen.weights)
    except (CheckpointError, OSError):
        return None
    for name in ("fc.weight", "model.fc.weight"):
        info = tensors.get(name)
        if info is not None and len(info.shape) == 2 and info.shape[0] > 0 and info.shape[1] % info.shape[0] == 0:
            return info.shape[1] // info.shape[0], list(info.shape), f"{chosen.weights}:{name}"
    return None


def _setting(run: SpeculatorsRun, key: str, flag: str) -> tuple[str, Any, str] | None:
    """(location, value, value as written) from train_command.txt's argv, else run.yaml."""
    given = run.train_arg(flag)
    if given:
        return f"{run.train_command_path}:{flag}", given[0], given[0]
    found = run.run_setting(key)
    if found is not None and found[1] is not None:
        return f"{run.run_yaml_path}:{found[0]}", found[1], quote(found[1])
    return None


def _trained_ids(run: SpeculatorsRun, count: int) -> list[int] | None:
    """The ids the run was launched with (train_command.txt, else run.yaml), when they fit fc."""
    given = run.train_arg("--target-layer-ids")
    candidates: list[Any] = []
    if given:
        candidates.append(given)
    found = run.run_setting("target_layer_ids")
    if found is not None:
        candidates.append(found[1])
    for values in candidates:
        try:
            ids = [int(v) for v in values]
        except (TypeError, ValueError):
            continue
        if len(ids) == count:
            return ids
    return None


def _ids_fix(ids: list[int] | None, count: int, *, trained: bool = False) -> Fix:
    if ids is None:
        return Fix(
            code_hint=f"choose {count} ids in vLLM's numbering (id i = HF hidden_states[i]) and pass them to "
            f"`{TRAIN} --target-layer-ids ...`",
            applicability="unsafe",
        )
    flag = f"`{TRAIN} --target-layer-ids {' '.join(map(str, ids))}`"
    if trained:
        hint = (f"set aux_hidden_state_layer_ids to {quote(ids)} in config.json: the run was trained with "
                f"{flag}, and fc's weights read those layers")
        return Fix(config_patch={"aux_hidden_state_layer_ids": ids}, code_hint=hint, applicability="safe")
    return Fix(
        config_patch={"aux_hidden_state_layer_ids": ids},
        code_hint=f"retrain with {flag} (changing the ids of trained weights changes the drafter's inputs)",
        applicability="unsafe",
    )
