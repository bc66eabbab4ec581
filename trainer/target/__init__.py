"""The frozen target model: loading any Hugging Face causal LM, and the embedded one built locally."""

from trainer.target.embedded import build_embedded_target, embedded_target_dir, ensure_embedded_target
from trainer.target.frozen import FrozenTarget, TargetError

__all__ = ["FrozenTarget", "TargetError", "build_embedded_target", "embedded_target_dir", "ensure_embedded_target"]
