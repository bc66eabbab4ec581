"""The DFlash drafter core: anchors, the attention mask, the drafter module, the loss."""

from trainer.model.anchors import sample_anchors
from trainer.model.attention_mask import (
    DraftAttention,
    build_attention_mask,
    decode_window_mask,
    dflash_mask_mod,
    flex_block_mask,
    sdpa_mask,
)
from trainer.model.drafter import DFlashDrafter, crop_cache
from trainer.model.loss import decay_weights, dflash_loss, gather_block_logits, slot_weights

__all__ = [
    "DFlashDrafter",
    "DraftAttention",
    "build_attention_mask",
    "crop_cache",
    "decode_window_mask",
    "decay_weights",
    "dflash_loss",
    "dflash_mask_mod",
    "flex_block_mask",
    "gather_block_logits",
    "sample_anchors",
    "sdpa_mask",
    "slot_weights",
]
