"""What a probe reports: one verdict per invariant an experiment decides, and the values it is judged by.

Torch-free, so sleuth's own process reads the worker's answers without importing the heavy stack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

PROBE_STATUSES = ("match", "mismatch", "unknown", "not_applicable")


@dataclass
class Verdict:
    invariant: str
    status: str  # one of PROBE_STATUSES
    experiment: str
    hypothesis: str
    perturbed: str
    measurement: str
    threshold: str
    observed: str = ""
    expected: str = ""
    measured: Any = None
    reason: str = ""
    fix: str = ""
    seconds: float = 0.0  # the experiment's wall time (shared by the verdicts it produced)
    # What the experiment exercised (rows, blocks per row, documents per row, adjacent anchors, anchors at
    # document edges, the weighting mode, which code computed the layer ids, the tensors observed, the
    # config values used and where each came from), and what the run's path needs that it did not.
    coverage: dict[str, Any] = field(default_factory=dict)
    not_exercised: list[str] = field(default_factory=list)
    # Config keys whose value the subject took from the run's config: a match then says "the code does what
    # the config asks", and whether that value is right is the config's finding, not the probe's.
    config_bound: list[str] = field(default_factory=list)

    def gated(self) -> Verdict:
        """A `match` claims the run's path was exercised: with anything left unexercised it is `unknown`."""
        if self.status == "match" and self.not_exercised:
            measured = f"the exercised part agrees ({self.observed})" if self.observed else "the exercised part agrees"
            self.reason = f"not exercised: {'; '.join(self.not_exercised)} ({measured})"
            self.status = "unknown"
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Expectations:
    """Values the reference allows where the rule is a value rather than a structure (read from the playbook)."""

    gamma: float | None = 4.0
    gamma_by_block_size: dict[int, float] = field(default_factory=lambda: {16: 7.0})
    loss_kinds: tuple[str, ...] = ("ce", "kl")

    def to_json(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "gamma_by_block_size": {str(k): v for k, v in self.gamma_by_block_size.items()},
                "loss_kinds": list(self.loss_kinds)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Expectations:
        if not data:
            return cls()
        return cls(
            gamma=data.get("gamma"),
            gamma_by_block_size={int(k): float(v) for k, v in (data.get("gamma_by_block_size") or {}).items()},
            loss_kinds=tuple(data.get("loss_kinds") or ("ce", "kl")),
        )


# Which invariants each experiment decides (for `unknown` verdicts when an experiment cannot run at all).
DECIDES: dict[str, tuple[str, ...]] = {
    "layers-read": ("dflash.fc_input_layers", "dflash.target_layer_ids"),
    "attention": ("dflash.context_excludes_anchor", "dflash.blocks_isolated", "dflash.block_bidirectional"),
    "context-per-layer": ("dflash.kv_injection",),
    "rotary-positions": ("dflash.block_position_ids",),
    "fc-norm": ("dflash.fc_norm",),
    "block-inputs": ("dflash.mask_token_distinct",),
    "loss-gradient": ("dflash.target_logits_source", "dflash.target_shift", "dflash.loss_kind",
                      "dflash.anchor_slot_untrained", "dflash.loss_decay_gamma"),
    "anchor-sampling": ("dflash.anchor_sampling",),
    "optimizer-step": ("dflash.frozen_embed_head",),
}
PROBED_INVARIANTS: tuple[str, ...] = tuple(i for ids in DECIDES.values() for i in ids)
# Invariants only a subject's path_checks speak to (no experiment decides them): the saved config a run exports,
# the rotation a server builds from it, and how its optimizer steps (learning rates, clipping, schedule). A path
# check's verdict on one of them is a match only as far as its coverage reaches (its not_exercised gates it).
PATH_CHECK_INVARIANTS: tuple[str, ...] = ("dflash.export_contract", "dflash.optimizer_schedule",
                                         "dflash.rope_served_as_trained")
# Invariants a path check can show broken but never clear: one part of them is measured (the acceptance metric a run
# reports is one of the train-serve gap's many parts; the token counts behind a draft vocabulary one of the tables a
# drafter borrows), so a check's match is dropped (_merge_path_checks) and an answer that says `match` on one is
# refused (sleuth/probes/answer.py).
MISMATCH_ONLY_INVARIANTS: tuple[str, ...] = ("dflash.train_serve_gap", "dflash.target_tables_resolve",
                                             "dflash.chat_template_consistency", "dflash.sliding_window_served")
ANSWER_INVARIANTS: tuple[str, ...] = PROBED_INVARIANTS + PATH_CHECK_INVARIANTS + MISMATCH_ONLY_INVARIANTS


def guarded(check: Any, lab: Any, invariants: str | tuple[str, ...], name: str) -> list[Verdict]:
    """One of a subject's path checks (`path_checks(lab)`): its verdict(s), or, where it raises, an `unknown` per
    invariant it speaks to, with the error; the other checks and the experiments' verdicts stand either way."""
    try:
        found = check(lab)
    except Exception as exc:  # noqa: BLE001 - a check's failure is reported, never fatal
        text = str(exc).strip().splitlines()
        reason = f"the check failed: {type(exc).__name__}" + (f": {text[0]}" if text else "")
        return [Verdict(invariant=invariant, status="unknown", experiment=name, hypothesis="", perturbed="",
                        measurement="", threshold="", reason=reason)
                for invariant in ((invariants,) if isinstance(invariants, str) else invariants)]
    return list(found) if isinstance(found, (list, tuple)) else [found]
