"""The kinds of piece sleuth locates in a trainer without an adapter, and the invariants each decides.

Shared by the locator (sleuth/probes/locate.py, sleuth's process: it reads the code) and the generic
subject (sleuth/probes/adapters/generic.py, the probe child: it calls the pieces). The child gets a copy of
`sleuth/probes/` only, so this table lives here rather than beside the locator's static-reading imports.
"""

from __future__ import annotations

PIECE_KINDS: dict[str, tuple[str, ...]] = {
    "layer_ids": ("dflash.target_layer_ids",),
    "features": ("dflash.fc_input_layers", "dflash.target_layer_ids"),
    "mask": ("dflash.context_excludes_anchor", "dflash.blocks_isolated", "dflash.block_bidirectional"),
    "positions": ("dflash.block_position_ids",),
    "teacher": ("dflash.target_shift",),
    "final_logits": ("dflash.target_logits_source",),
    "weights": ("dflash.anchor_slot_untrained", "dflash.loss_decay_gamma"),
    "loss": ("dflash.loss_kind", "dflash.anchor_slot_untrained", "dflash.loss_decay_gamma"),
    "optimizer": ("dflash.frozen_embed_head",),
}
# Kinds the locator reports besides: what a piece's module lives on, and the optimizer probe's helpers.
HELPER_KINDS = ("freeze", "drafter")

__all__ = ["HELPER_KINDS", "PIECE_KINDS"]
