"""Config evidence: what a run's resolved config says it ran with, key by key.

The resolved config is the strongest observed source for switches: it is what actually ran. Readers
turn raw keys into the canonical values the playbook compares (e.g. fc_layers null -> "all").
Keys may sit at the top level or nested (other trainers' YAML): a key is found by its leaf name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.artifacts import optional_json_object
from sleuth.evidence.registry import config_reader, registered


@dataclass
class ConfigReading:
    value: Any  # canonical value, as the playbook's expected values are written
    key: str  # the config key it was read from (dotted when nested)
    raw: Any  # the raw value there
    confidence: float = 0.95
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    count: int | None = None  # how many target layers feed fc, for the fc reader
    location: str | None = None  # where it was read when not config.json (e.g. run.json:target_fidelity)


@dataclass
class RunMeta:
    """Facts from the run directory beside the config (run.json): the target's depth, where it came from."""

    num_layers: int | None = None
    hidden_size: int | None = None
    source: str | None = None  # path of the run.json read
    target_fidelity: Any = None  # run.json's `target_fidelity` record, as written (None: absent)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        out[dotted] = value
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
    return out


def lookup(config: dict[str, Any] | None, keys: list[str]) -> tuple[str, Any] | None:
    """The first of `keys` present (top level first, then as the leaf of a nested key).

    Below the top level a mapping is a group of settings, not a value: speculators' own run.yaml has a
    `train.loss:` group ({loss_fn: ce}), which is not what `loss: ce` means in a flat config. At the top level
    a mapping is still taken, so a wrong-typed value there is reported as one."""
    if not config:
        return None
    flat = flatten(config)
    for key in keys:
        if key in config:
            return key, config[key]
    for key in keys:
        for dotted, value in flat.items():
            if "." in dotted and dotted.rsplit(".", 1)[-1] == key and not isinstance(value, dict):
                return dotted, value
    return None


def find_run_meta(config_source: str | None, checkpoint: Path | None, config: dict | None = None) -> RunMeta:
    """run.json beside config.json, or two levels above checkpoints/step-*/drafter.safetensors; else the
    config's own `num_target_layers` (what an exported drafter's config.json carries)."""
    candidates: list[Path] = []
    if config_source:
        candidates.append(Path(config_source).parent / "run.json")
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        candidates += [ckpt.parent / "run.json", ckpt.parent.parent / "run.json", ckpt.parent.parent.parent / "run.json"]
    for path in candidates:
        data = optional_json_object(path, None)  # bounded, regular files only: it may be anyone's run.json
        target = data.get("target") if isinstance(data, dict) else None
        if isinstance(target, dict):
            layers, hidden = target.get("num_layers"), target.get("hidden_size")
            return RunMeta(
                num_layers=layers if isinstance(layers, int) else None,
                hidden_size=hidden if isinstance(hidden, int) else None,
                source=str(path),
                target_fidelity=data.get("target_fidelity"),
            )
    found = lookup(config, ["num_target_layers"])
    if found is not None and isinstance(found[1], int) and not isinstance(found[1], bool):
        return RunMeta(num_layers=found[1], source=f"{config_source or 'config'}:{found[0]}")
    return RunMeta()


def zlab_layer_ids(num_layers: int, k: int) -> list[int]:
    """The reference selection (z-lab build_target_layer_ids): k layers evenly from 1 to L-3; one: [L//2]."""
    if k == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def vllm_default_layer_ids(num_layers: int) -> list[int]:
    """speculators' own default, in vLLM's convention (id i = HF hidden_states[i])."""
    return [2, num_layers // 2, num_layers - 3]


# --- config readers: (config, keys, meta) -> ConfigReading | None, registered by the id the playbook names --


@config_reader("target_layer_ids")
def _read_target_layer_ids(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None or not isinstance(found[1], list) or not found[1]:
        return None
    key, ids = found
    if key.rsplit(".", 1)[-1] == "aux_hidden_state_layer_ids":
        # speculators / vLLM count the embeddings as layer 0: their id i is z-lab's id i-1.
        if not all(isinstance(i, int) and i >= 1 for i in ids):
            return None
        ids = [i - 1 for i in ids]
    if meta.num_layers is None:
        return ConfigReading(
            None, key, ids, detail=f"{ids}; the target's depth is unknown (no run.json, no num_target_layers)"
        )
    formula = zlab_layer_ids(meta.num_layers, len(ids))
    if ids == formula:
        return ConfigReading("evenly-1-to-L-3", key, ids, detail=f"{ids} for an L={meta.num_layers} target")
    reading = ConfigReading(f"custom {ids}", key, ids, detail=f"{ids}; the rule gives {formula} for L={meta.num_layers}")
    if len(ids) == 3 and ids == vllm_default_layer_ids(meta.num_layers):
        reading.notes.append(
            "these are speculators' default ids [2, L//2, L-3], in vLLM's convention (id i = HF hidden_states[i]); "
            "read in z-lab's convention they are one layer off"
        )
    return reading


def _rule_count(config: dict, ids: tuple[str, Any] | None, meta: RunMeta) -> int | None:
    """How many layers `target_layer_ids: null` selects, where the run format says: the trainer's rule picks
    k = `draft_layers` layers (docs/reference/config.md), all distinct when the target has room (L >= k + 3)."""
    drafts = lookup(config, ["draft_layers"])
    if ids is None or ids[1] is not None or drafts is None or meta.num_layers is None:
        return None
    k = drafts[1]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or meta.num_layers < k + 3:
        return None
    return k


@config_reader("fc_layers")
def _read_fc_layers(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None:
        return None
    key, value = found
    ids = lookup(config, ["target_layer_ids"])
    k = len(ids[1]) if ids and isinstance(ids[1], list) else _rule_count(config, ids, meta)
    if value is None:
        return ConfigReading("all", key, value, detail=f"fc_layers null: all {k or 'k'} selected layers", count=k)
    if isinstance(value, list):
        if k is not None and any(not isinstance(i, int) or not 0 <= i < k for i in value):
            # Indices past the selected layers cannot describe what fc read: the config is broken.
            return ConfigReading("invalid", key, value, detail=f"fc_layers {value}: indices outside the {k} selected layers")
        if k is not None and sorted(value) == list(range(k)):
            return ConfigReading("all", key, value, detail=f"fc_layers {value} = all {k} selected layers", count=k)
        detail = f"fc_layers {value}: {len(value)} of {k if k is not None else '?'} selected layers"
        if k is None:
            return ConfigReading("subset?", key, value, confidence=0.5, detail=detail + " (target_layer_ids unknown)",
                                 count=len(value))
        return ConfigReading("subset", key, value, detail=detail, count=len(set(value)))
    return None


@config_reader("logits_source")
def _read_logits_source(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None:
        return None
    key, value = found
    if value == "final":
        return ConfigReading("final", key, value, detail="the target model's output logits")
    if isinstance(value, int) and not isinstance(value, bool):
        reading = ConfigReading("intermediate", key, value, detail=f"lm_head(norm(h_{value})) of target layer {value}")
        if meta.num_layers is not None and value >= meta.num_layers - 1:
            reading.notes.append(f"layer {value} is the target's last layer; HF's last hidden state is already normed")
        return reading
    if value == "last_selected":
        return ConfigReading("intermediate", key, value, detail="the last selected target layer")
    return None


@config_reader("context_includes_anchor")
def _read_context_includes_anchor(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None or not isinstance(found[1], bool):
        return None
    key, value = found
    if value:
        return ConfigReading("kv <= anchor", key, value, detail="context includes the anchor position")
    return ConfigReading("kv < anchor", key, value, detail="context strictly before the anchor")


@config_reader("number")
def _read_number(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None:
        return None
    key, value = found
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return ConfigReading(None if value is None else float(value), key, value)
    return None


# Where trainers say which per-slot weighting they use: ours (`loss_weighting`), speculators
# (`per_position_loss_weight`), SpecForge (`training.loss_type`).
WEIGHTING_KEYS = ["loss_weighting", "per_position_loss_weight", "loss_type"]


@config_reader("decay_gamma")
def _read_decay_gamma(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    """The decay's gamma, unless the config chose D-PACE: its weights come from the drafter's confidence and
    no gamma is used (speculators' DFlash default since RFC #979), so a gamma beside it decides nothing."""
    weighting = lookup(config, WEIGHTING_KEYS)
    if weighting is not None and isinstance(weighting[1], str) \
            and weighting[1].strip().lower().replace("-", "").startswith("dpace"):
        return ConfigReading("D-PACE", weighting[0], weighting[1],
                             detail="D-PACE weighting: the weights come from the drafter's confidence; gamma is not used")
    return _read_number(config, keys, meta)


@config_reader("loss_kind")
def _read_loss_kind(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None or not isinstance(found[1], str):
        return None
    key, value = found
    kind = loss_kind_of_word(value)
    if kind is None:
        # a word no rule knows ("my_loss_v2"): not evidence of a wrong loss, so it decides nothing
        return ConfigReading(None, key, value, confidence=0.0,
                             detail=f"the config's loss {value!r} names no loss sleuth can classify")
    return ConfigReading(kind, key, value)


_CE_WORDS = {"ce", "xent", "crossentropy", "cross", "entropy", "nll", "hard", "argmax", "top1"}
_KL_WORDS = {"kl", "kld", "kldiv", "kullback", "soft", "distill", "distillation", "fkl"}
_DATA_WORDS = {"data", "label", "labels", "token", "tokens", "gold", "ground", "truth", "dataset"}
_OTHER_LOSSES = {"mse", "l1", "l2", "huber", "smooth", "cosine", "bce", "rkl", "reverse", "jsd", "js", "tv"}


def loss_kind_of_word(word: str) -> str | None:
    """A config's loss word as the playbook's kind: `ce`, `ce (data tokens)`, `kl`, `other:<word>` for a loss
    that is neither (mse, reverse KL, JSD ...), or None for a word that names none of these.
    Trainers spell it many ways (`ce_target_argmax`, `hard_ce`, `kl_soft_target`, `forward_kl`), so the word
    is read by its parts, not matched whole."""
    lower = word.strip().lower()
    exact = {"ce": "ce", "cross_entropy": "ce", "kl": "kl", "kl_div": "kl", "kld": "kl"}.get(lower)
    if exact:
        return exact
    split = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", word.strip()).lower()  # CrossEntropyLoss, KLDivLoss
    parts = {p for p in re.split(r"[^a-z0-9]+", split) if p}
    if parts & _OTHER_LOSSES:
        return f"other:{word}"
    ce, kl = bool(parts & _CE_WORDS), bool(parts & _KL_WORDS)
    if ce and kl:
        # "soft CE" is KL up to a constant; "hard" / "argmax" beside KL words would be ambiguous
        return "kl" if parts & {"soft"} and not parts & {"hard", "argmax", "top1"} else None
    if ce:
        return "ce (data tokens)" if parts & _DATA_WORDS else "ce"
    if kl:
        return "kl"
    return None


@config_reader("max_anchors")
def _read_max_anchors(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    found = lookup(config, keys)
    if found is None:
        return None
    key, value = found
    # The count is a budget, not the sampling rule: it never decides the status on its own.
    reading = ConfigReading(None, key, value, confidence=0.0, detail=f"max_anchors {value}")
    if isinstance(value, int) and value != 512:
        reading.notes.append(f"max_anchors {value} (speculators' default is 512): fewer blocks per sequence, same rule")
    return reading


@config_reader("target_fidelity")
def _read_target_fidelity(config: dict, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    """run.json's `target_fidelity` record, judged here: max abs hidden / logit difference between the
    trainer's packed target forward and the model's own, against the tolerance the record states."""
    if meta.source is None or not meta.source.endswith("run.json"):
        return ConfigReading(None, "target_fidelity", None, confidence=0.0,
                             detail="no run.json beside the config, where the target-fidelity record is kept")
    location = f"{meta.source}:target_fidelity"
    record = meta.target_fidelity
    if record is None:
        return ConfigReading(
            None, "target_fidelity", None, confidence=0.0, location=location,
            detail="run.json has no target_fidelity record: the trainer never measured its packed target forward "
            "against the model's own (a trainer that predates the check, or another trainer)",
        )
    numbers = {k: record.get(k) if isinstance(record, dict) else None
               for k in ("max_abs_hidden_diff", "max_abs_logit_diff", "tolerance")}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers.values()):
        return ConfigReading(None, "target_fidelity", record, confidence=0.0, location=location,
                             detail=f"run.json's target_fidelity record is incomplete: {record!r}"[:300])
    worst = max(numbers["max_abs_hidden_diff"], numbers["max_abs_logit_diff"])
    tokens, packing = record.get("tokens"), record.get("packing")
    detail = (f"max abs hidden diff {numbers['max_abs_hidden_diff']:.3g}, logit diff {numbers['max_abs_logit_diff']:.3g}, "
              f"tolerance {numbers['tolerance']:.3g}" + (f", on {tokens} held-out tokens" if tokens else "")
              + (f", packing {packing}" if packing else ""))
    reading = ConfigReading("within tolerance" if worst <= numbers["tolerance"] else "above tolerance",
                            "target_fidelity", record, detail=detail, location=location)
    window = record.get("longest_window")
    if isinstance(window, int) and isinstance(tokens, int) and tokens <= window:
        reading.notes.append(f"the checked document ({tokens} tokens) is not longer than the target's window "
                             f"({window}): a dropped window would not show in this record")
    if record.get("passed") is not None and bool(record.get("passed")) != (worst <= numbers["tolerance"]):
        reading.notes.append(f"the record says passed={record.get('passed')}, but its own numbers say otherwise")
    return reading


def read_config(reader: str, config: dict | None, keys: list[str], meta: RunMeta) -> ConfigReading | None:
    if not config:
        return None
    return registered("config")[reader].func(config, keys, meta)
