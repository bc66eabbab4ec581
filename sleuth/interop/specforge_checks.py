"""DFlash settings of a SpecForge run, checked in SpecForge's own conventions.

Each check returns a `Finding` under the playbook id it decides (replacing the generic engine's reading),
or under a `specforge.*` id for what only SpecForge records. Remedies name SpecForge's own keys: the draft
config JSON (`model.draft_model_config`: `dflash_config.target_layer_ids`, `dflash_config.mask_token_id`,
`block_size`) and the run YAML (`model.draft_num_hidden_layers`, `model.mask_token_id`,
`model.draft_block_size`, `training.loss_decay_gamma`). Evidence values are `json.dumps` of what was read.

Conventions (SpecForge a6b6b02, `specforge/modeling/draft/dflash.py`):
- layer id i means the output of target decoder layer i: `extract_context_feature` reads HF
  `hidden_states[i + 1]` (offset 1; index 0 is the embeddings), so ids run 0..L-1 (z-lab's convention;
  vLLM's / speculators' is this + 1).
- `build_target_layer_ids(L, n)`: `[L // 2]` for one draft layer, else `round(1 + i*(L-4)/(n-1))`, with n
  the draft's `num_hidden_layers` (the ids `DFlashDraftModel` uses when the config names none).
- `fc = nn.Linear(len(target_layer_ids) * H, H)`: fc reads every listed id.
- The checkpoint's resume contract (`training_state.pt`: `dflash_target_layer_ids`, `dflash_block_size`,
  `dflash_mask_token_id`, `dflash_loss_decay_gamma`, `dflash_loss_type`) is what training resolved and used;
  the draft config is what an export (`specforge.export.to_hf`) and serving read.
"""

from __future__ import annotations

import json
from typing import Any

from sleuth.findings import Evidence, Finding, Fix
from sleuth.interop.specforge import STATE_FILE, SpecForgeRun
from sleuth.oracle import target_layer_ids


def check_specforge(run: SpecForgeRun) -> list[Finding]:
    if run.chosen is None or run.chosen.state is None:
        return []
    return [
        check_target_layer_ids(run),
        check_fc_input_layers(run),
        check_mask_token_id(run),
        check_block_size(run),
        check_loss_decay_gamma(run),
        check_loss_kind(run),
    ]


def quote(value: Any) -> str:
    return json.dumps(_plain(value))


# --- the checks ----------------------------------------------------------------------------------------


def check_target_layer_ids(run: SpecForgeRun) -> Finding:
    config = run.draft_config or {}
    finding = Finding(
        id="dflash.target_layer_ids",
        title="Target layers selected evenly, in SpecForge's layer numbering (id i = HF hidden_states[i+1])",
        status="unknown",
        severity="medium",
        confidence=0.9,
        expected="build_target_layer_ids(L, num draft layers): round(1 + i*(L-4)/(n-1)), ids in 0..L-1",
    )
    trained = _ints(run.chosen.get("dflash_target_layer_ids")) if run.chosen else None
    configured, config_where = _config_ids(run)
    if trained is not None:
        finding.evidence.append(Evidence(kind="checkpoint", location=_state_where(run, "dflash_target_layer_ids"),
                                         value=quote(trained)))
    if config_where is not None:
        finding.evidence.append(Evidence(kind="config", location=config_where, value=quote(configured)))
    depth, depth_where = _target_depth(run)
    if depth_where is not None:
        finding.evidence.append(Evidence(kind="config", location=depth_where, value=quote(depth)))
    ids = configured if configured is not None else trained
    if ids is None:
        finding.reason = "no layer ids: neither the draft config nor the checkpoint's resume contract holds them"
        return finding
    finding.observed = f"{quote(ids)} (vLLM numbering {quote([i + 1 for i in ids])})"
    fc = _fc_layers(run)
    if fc is not None:
        count, shape = fc
        finding.evidence.append(Evidence(kind="checkpoint", location=_state_where(run, "draft_state_dict.fc.weight"),
                                         value=quote(shape)))
        if count != len(ids):
            remedy = trained if trained is not None and len(trained) == count else (
                target_layer_ids(depth, count) if depth else None)
            return _mismatch(
                finding, "high",
                f"the id list names {len(ids)} layer(s) but fc.weight {quote(shape)} reads {count}: the list "
                f"({config_where or 'resume contract'}) is wrong (shortened or edited), the weights are not",
                _ids_fix(run, remedy, count, trained=remedy is not None and remedy == trained),
            )
    differs = configured is not None and trained is not None and configured != trained
    # What to do about a wrong list: restore the ids the weights were trained on when the list was edited
    # after training; else the rule's ids, which means retraining.
    restore = trained if differs and (fc is None or len(trained) == fc[0]) else None
    trained_note = f" (the checkpoint was trained on {quote(trained)})" if differs else ""
    if depth is None:
        if differs:
            return _mismatch(finding, "high", f"the draft config names {quote(configured)} but the checkpoint was "
                             f"trained on {quote(trained)}", _ids_fix(run, trained, len(trained), trained=True))
        finding.reason = f"the target's depth is unknown: {run.verifier.reason or 'no num_target_layers'}"
        return finding
    expected = target_layer_ids(depth, len(ids))
    remedy = _ids_fix(run, restore, len(ids), trained=True) if restore else _ids_fix(run, expected, len(ids))
    out_of_range = [i for i in ids if i < 0 or i >= depth]
    if out_of_range:
        return _mismatch(
            finding, "high",
            f"{quote(out_of_range)} outside [0, {depth - 1}] for a target with {depth} layers (id i reads HF "
            f"hidden_states[i+1]; id {depth - 1} is the last layer's output){trained_note}",
            remedy,
        )
    for shift, convention in ((1, "vLLM's / speculators' numbering (id i = hidden_states[i]) used where SpecForge's "
                                  "(hidden_states[i+1]) is expected"),
                              (-1, "one layer shallower than SpecForge's rule (converted from vLLM numbering twice?)")):
        if [i + shift for i in expected] == ids:
            return _mismatch(
                finding, "high",
                f"{quote(ids)} is {quote(expected)} off by {shift:+d} for L={depth}: {convention}; the drafter reads "
                f"features one layer away from the rule{trained_note}",
                remedy,
            )
    if differs:
        return _mismatch(
            finding, "high",
            f"the draft config names {quote(configured)} but the checkpoint was trained on {quote(trained)}: "
            "an export of this config feeds the drafter other layers than it learned",
            remedy,
        )
    if ids == expected:
        finding.status = "match"
        finding.reason = f"{quote(ids)} is SpecForge's build_target_layer_ids({depth}, {len(ids)})" + (
            ", as trained" if trained is not None else "")
        return finding
    return _mismatch(finding, "low", f"a custom selection; for L={depth} SpecForge's rule picks {quote(expected)}",
                     _ids_fix(run, expected, len(ids)))


def check_fc_input_layers(run: SpecForgeRun) -> Finding:
    finding = Finding(
        id="dflash.fc_input_layers",
        title="fc reads every selected target layer",
        status="unknown",
        severity="high",
        confidence=0.9,
        expected="fc.weight [H, k*H] over all k ids in dflash_config.target_layer_ids",
    )
    fc = _fc_layers(run)
    if fc is None:
        finding.reason = "no fc.weight [H, k*H] in the checkpoint's draft_state_dict"
        return finding
    count, shape = fc
    ids, where = _config_ids(run)
    if ids is None:
        ids, where = _ints(run.chosen.get("dflash_target_layer_ids")), _state_where(run, "dflash_target_layer_ids")
    finding.evidence.append(Evidence(kind="checkpoint", location=_state_where(run, "draft_state_dict.fc.weight"),
                                     value=quote(shape)))
    finding.evidence.append(Evidence(kind="config", location=str(where), value=quote(ids)))
    finding.observed = f"fc reads {count} layer(s) of hidden size {shape[0]}"
    if ids is not None and count == len(ids):
        finding.status, finding.reason = "match", f"{count} ids, fc input {shape[1]} = {count} x {shape[0]}"
    else:
        finding.reason = "fc's shape and the id list disagree: the id list is the defect (see dflash.target_layer_ids)"
    return finding


def check_mask_token_id(run: SpecForgeRun) -> Finding:
    config = run.draft_config or {}
    method = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    trained = run.chosen.get("dflash_mask_token_id") if run.chosen else None
    finding = Finding(
        id="specforge.mask_token_id",
        title="The mask token the drafter fills slots 1..B-1 with is in the draft config, as trained",
        status="unknown",
        severity="high",
        confidence=0.95,
        expected="dflash_config.mask_token_id = the id training resolved (dflash_mask_token_id), inside the vocabulary",
        evidence=[Evidence(kind="checkpoint", location=_state_where(run, "dflash_mask_token_id"), value=quote(trained))],
    )
    where = f"{run.draft_config_path}:dflash_config.mask_token_id"
    if run.draft_config is None:
        finding.reason = "the draft config was not found: what an export would serve is unknown"
        return finding
    value = method.get("mask_token_id")
    finding.evidence.append(Evidence(kind="config", location=where, value=quote(value)))
    finding.observed = quote(value)
    vocab = config.get("vocab_size") if _is_int(config.get("vocab_size")) else run.verifier.vocab_size
    trained_text = f" (training resolved {trained})" if _is_int(trained) else ""
    if not _is_int(value):
        finding.status = "mismatch"
        finding.reason = (
            f"no dflash_config.mask_token_id in the draft config{trained_text}: DFlashDraftModel reads it from there, "
            "so an export (`specforge.export.to_hf`) of this config carries none, and serving fills the block with None"
        )
        finding.fix = _mask_fix(run, trained)
    elif _is_int(trained) and value != trained:
        finding.status = "mismatch"
        finding.reason = f"the draft config names {value} but the checkpoint was trained with {trained}"
        finding.fix = _mask_fix(run, trained)
    elif vocab is not None and not 0 <= value < vocab:
        finding.status = "mismatch"
        finding.reason = f"{value} is outside the vocabulary of {vocab}"
        finding.fix = _mask_fix(run, None)
    else:
        finding.status = "match"
        finding.reason = f"mask_token_id {value}" + (f" < vocab {vocab}" if vocab else "") + (
            ", as trained" if _is_int(trained) else "")
    return finding


def check_block_size(run: SpecForgeRun) -> Finding:
    config = run.draft_config or {}
    trained = run.chosen.get("dflash_block_size") if run.chosen else None
    value = config.get("block_size")
    finding = Finding(
        id="specforge.block_size",
        title="The draft config's block size is the one the drafter was trained with",
        status="unknown",
        severity="high",
        confidence=0.95,
        expected="block_size (draft config) = dflash_block_size (resume contract), an integer >= 2",
        observed=quote(value),
        evidence=[Evidence(kind="checkpoint", location=_state_where(run, "dflash_block_size"), value=quote(trained))],
    )
    if run.draft_config is None:
        finding.reason = "the draft config was not found"
        return finding
    finding.evidence.append(Evidence(kind="config", location=f"{run.draft_config_path}:block_size", value=quote(value)))
    fix = Fix(config_patch={"block_size": trained}, applicability="safe",
              code_hint=f"set block_size to {trained} in {run.draft_config_path} (the block the weights were trained "
              "on; `model.draft_block_size` sets it for a new run)") if _is_int(trained) else None
    if not _is_int(value) or value < 2:
        return _mismatch(finding, "high", f"block_size {quote(value)}: SpecForge needs an integer >= 2", fix)
    if _is_int(trained) and value != trained:
        return _mismatch(finding, "high", f"the draft config says {value}, the checkpoint was trained with {trained}: "
                         "served with another block than it learned", fix)
    finding.status, finding.reason = "match", f"block_size {value}" + (" as trained" if _is_int(trained) else "")
    return finding


def check_loss_decay_gamma(run: SpecForgeRun) -> Finding:
    state = run.chosen.state or {} if run.chosen else {}
    block = state.get("dflash_block_size")
    finding = Finding(
        id="dflash.loss_decay_gamma",
        title="Per-slot loss decay exp(-(k-1)/gamma) with the reference gamma",
        status="unknown",
        severity="medium",
        confidence=0.9,
        expected="training.loss_decay_gamma null (SpecForge's default: no decay), 7.0 with block 16 (its recipes, "
                 "the paper) or 4.0 (speculators)",
    )
    if "dflash_loss_decay_gamma" not in state:
        finding.reason = "the checkpoint's resume contract has no dflash_loss_decay_gamma"
        return finding
    gamma = state["dflash_loss_decay_gamma"]
    finding.evidence += [
        Evidence(kind="checkpoint", location=_state_where(run, "dflash_loss_decay_gamma"), value=quote(gamma)),
        Evidence(kind="checkpoint", location=_state_where(run, "dflash_block_size"), value=quote(block)),
    ]
    finding.observed = f"gamma {quote(gamma)} at block_size {block}"
    if gamma is None or (isinstance(gamma, (int, float)) and gamma <= 0):
        finding.status = "match"
        finding.reason = f"loss_decay_gamma {quote(gamma)}: SpecForge's default, every slot weighs the same"
        finding.notes.append("SpecForge's DFlash recipes set training.loss_decay_gamma: 7.0 with block size 16")
        return finding
    if gamma == 4.0 or (gamma == 7.0 and block == 16):
        finding.status, finding.reason = "match", finding.observed
        return finding
    return _mismatch(
        finding, "medium", f"gamma {gamma} with block_size {block}: late slots weigh more than the reference's",
        Fix(config_patch={"training.loss_decay_gamma": 7.0 if block == 16 else 4.0},
            code_hint="retrain with `training.loss_decay_gamma: 7.0` and block size 16 (SpecForge's recipes), or "
            "leave it unset (no decay)", applicability="unsafe"),
    )


def check_loss_kind(run: SpecForgeRun) -> Finding:
    state = run.chosen.state or {} if run.chosen else {}
    loss = state.get("dflash_loss_type")
    finding = Finding(
        id="dflash.loss_kind",
        title="Loss against the target's tokens (SpecForge: CE against data tokens; D-PACE weighting)",
        status="unknown",
        severity="low",
        confidence=0.9,
        expected="training.loss_type dflash or a dpace variant",
        observed=quote(loss),
        evidence=[Evidence(kind="checkpoint", location=_state_where(run, "dflash_loss_type"), value=quote(loss))],
    )
    if loss is None:
        finding.reason = "the checkpoint's resume contract has no dflash_loss_type"
    elif loss == "dflash" or str(loss).startswith("dpace"):
        finding.status, finding.reason = "match", f"loss_type {loss}"
    else:
        _mismatch(finding, "low", f"loss_type {loss}: not one SpecForge trains DFlash with",
                  Fix(config_patch={"training.loss_type": "dflash"}, code_hint="`training.loss_type: dflash`"))
    return finding


# --- helpers -------------------------------------------------------------------------------------------


def _mismatch(finding: Finding, severity: str, reason: str, fix: Fix | None) -> Finding:
    finding.status, finding.severity, finding.reason, finding.fix = "mismatch", severity, reason, fix
    return finding


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any) -> list[int] | None:
    if isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value):
        return [int(v) for v in value]
    return None


def _state_where(run: SpecForgeRun, key: str) -> str:
    assert run.chosen is not None
    return f"{run.chosen.path / STATE_FILE}:{key}"


def _config_ids(run: SpecForgeRun) -> tuple[list[int] | None, str | None]:
    config = run.draft_config
    if config is None:
        return None, None
    method = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    where = f"{run.draft_config_path}:dflash_config.target_layer_ids"
    if "target_layer_ids" in method:
        return _ints(method["target_layer_ids"]), where
    # DFlashDraftModel's fallback when the config names none
    if _is_int(config.get("num_target_layers")) and _is_int(config.get("num_hidden_layers")):
        return (target_layer_ids(config["num_target_layers"], config["num_hidden_layers"]),
                f"{run.draft_config_path}: no dflash_config.target_layer_ids, so build_target_layer_ids("
                "num_target_layers, num_hidden_layers)")
    return None, where


def _target_depth(run: SpecForgeRun) -> tuple[int | None, str | None]:
    if run.verifier.num_layers is not None:
        return run.verifier.num_layers, f"{run.verifier.config_path}:num_hidden_layers"
    config = run.draft_config or {}
    if _is_int(config.get("num_target_layers")):
        return config["num_target_layers"], f"{run.draft_config_path}:num_target_layers"
    return None, None


def _fc_layers(run: SpecForgeRun) -> tuple[int, list[int]] | None:
    shape = run.chosen.fc_shape if run.chosen else None
    if shape is None or len(shape) != 2 or shape[0] <= 0 or shape[1] % shape[0]:
        return None
    return shape[1] // shape[0], shape


def _ids_fix(run: SpecForgeRun, ids: list[int] | None, count: int, *, trained: bool = False) -> Fix:
    where = run.draft_config_path or "the draft config (model.draft_model_config)"
    if ids is None:
        return Fix(code_hint=f"set dflash_config.target_layer_ids in {where} to {count} ids in SpecForge's numbering "
                   "(id i = HF hidden_states[i+1], 0..L-1)", applicability="unsafe")
    if trained:
        return Fix(config_patch={"dflash_config": {"target_layer_ids": ids}}, applicability="safe",
                   code_hint=f"set dflash_config.target_layer_ids to {quote(ids)} in {where}: the checkpoint was "
                   "trained on those layers (its dflash_target_layer_ids), and fc's weights read them")
    return Fix(config_patch={"dflash_config": {"target_layer_ids": ids}}, applicability="unsafe",
               code_hint=f"set dflash_config.target_layer_ids to {quote(ids)} in {where} (or drop the key and let "
               f"`model.draft_num_hidden_layers: {count}` derive it) and retrain: changing the ids of trained weights "
               "changes the drafter's inputs")


def _mask_fix(run: SpecForgeRun, trained: Any) -> Fix:
    where = run.draft_config_path or "the draft config"
    if _is_int(trained):
        return Fix(config_patch={"dflash_config": {"mask_token_id": trained}}, applicability="safe",
                   code_hint=f"set dflash_config.mask_token_id to {trained} in {where} (the id the checkpoint was "
                   "trained with; `model.mask_token_id` pins it in the run YAML)")
    return Fix(code_hint=f"set dflash_config.mask_token_id in {where} to the tokenizer's mask token id "
               "(`model.mask_token_id` in the run YAML)", applicability="unsafe")
