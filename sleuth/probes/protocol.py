"""The probe protocol: the few callables sleuth needs to run experiments on a DFlash implementation.

A *subject* is any object with the methods of `ProbeSubject`. sleuth gets one by calling an entry function
`module:function` (`--probe-entry`, or `trainer.probe:probe_subject` in a run's `code/` copy) with one
argument, a dict `context` ({"run_dir": str | None, "code": str | None, "config": dict | None}).
Everything runs in a separate process (`sleuth.probes.worker`), on CPU, with tiny dimensions and no
network. The probe owns the *target*: it builds a synthetic one (random hidden states for every layer,
embeddings, lm_head, final norm: `ProbeTarget`) and hands the subject batches whose answers it knows
(`ProbeBatch`). The subject builds a tiny drafter for that target and runs its own code on those batches.

Conventions the subject must follow (they are what makes the experiments' answers unambiguous):
  * `ProbeBatch.hidden_states` is the target's output in Hugging Face layout: L+1 tensors [N, S, H],
    index 0 the embeddings, index i the output of decoder layer i-1, index L already final-normed
    (`lm_head(hidden_states[L])` are the final logits, `ProbeBatch.logits`). `last_hidden` is the last
    layer's output before the final norm (what speculators calls `verifier_last_hidden_states`).
    The subject selects its layers from these exactly as its own code does.
  * Anchors are given (`anchors`, `anchor_valid`): the subject uses them instead of sampling its own.
  * Block tokens are ordered block-major: token t of the drafter's block stream is slot t % B of block
    t // B. `ProbeHooks.block_embeddings` is applied to the block tokens' input embeddings ([..., A*B, H])
    and `ProbeHooks.draft_logits` to the drafter's logits ([..., A*B, V]) before the loss; the subject
    uses what the hooks return in place of the tensors it passed them.
  * The subject uses the target's `mask_token_id`, embeddings, lm_head and final norm (copies are fine).

Optional, read where present (absent ones leave what they would decide `unknown`, with the reason):
`layer_ids_for(num_target_layers, count=None)` (the subject's layer-id rule for any depth),
`sample_anchors(batch, num_anchors)` (its training sampler: anchors and valid flags [N, n]),
`feature_projection()` (fc, the module the concatenated target features enter), `variants()` (the same code
under other settings, {label: subject}, probed too). describe() may add "configured" ({name: {"value",
"source"}}: weighting, gamma, dpace_alpha, loss, target_layer_ids, and where each came from, "run config
..." when the run's config set it), "max_rows", "documents_per_row", "layer_types",
"sliding_causal_within_block", "anchor_exclusions", "layer_ids_source", "mask_token_source"; it is read
again after build().

This module imports no torch at load time, so sleuth's own process can read it without the heavy stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn

PROTOCOL_VERSION = 1
# The keys of describe()'s answer; layer_id_convention says how the subject's ids map to hidden_states:
#   "zlab": id i is hidden_states[i + 1]; "vllm": id i is hidden_states[i];
#   "external": the subject consumes features selected outside its code (e.g. by vLLM), so which layers
#   it reads is not the subject's to decide and the target_layer_ids probe does not apply.
LAYER_ID_CONVENTIONS = ("zlab", "vllm", "external")


@dataclass(frozen=True)
class ProbeTarget:
    """A synthetic target model: shapes, a Qwen3-style config, and the frozen tensors the drafter shares."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mask_token_id: int
    embed_weight: Tensor  # [V, H]
    lm_head_weight: Tensor  # [V, H]
    norm_weight: Tensor  # [H] the final RMSNorm's gain

    def config_kwargs(self, num_hidden_layers: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `transformers.Qwen3Config` describing this target (or a drafter over it)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": num_hidden_layers or self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
        }

    def qwen3_config(self, num_hidden_layers: int | None = None) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(**self.config_kwargs(num_hidden_layers))


@dataclass(frozen=True)
class ProbeBatch:
    """Packed rows with known answers. N rows of S positions, A anchors per row, blocks of B tokens."""

    input_ids: Tensor  # [N, S] long
    position_ids: Tensor  # [N, S] long, restart at 0 per document
    doc_ids: Tensor  # [N, S] long, -1 = padding
    loss_mask: Tensor  # [N, S] long, 1 = supervised
    anchors: Tensor  # [N, A] long
    anchor_valid: Tensor  # [N, A] bool
    hidden_states: tuple[Tensor, ...]  # L+1 x [N, S, H], Hugging Face layout (see the module docstring)
    last_hidden: Tensor  # [N, S, H] the last layer's output before the final norm
    logits: Tensor  # [N, S, V] lm_head(hidden_states[L]): the target's final logits

    def replace(self, **changes: Any) -> ProbeBatch:
        return replace(self, **changes)


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass
class ProbeHooks:
    """Where an experiment intervenes; the subject calls both on the tensors named and uses the results."""

    block_embeddings: Callable[[Tensor], Tensor] = field(default=_identity)
    draft_logits: Callable[[Tensor], Tensor] = field(default=_identity)


@runtime_checkable
class ProbeSubject(Protocol):
    """What an entry function returns. Methods the probes do not find are reported `unknown`, never guessed."""

    def describe(self) -> dict[str, Any]:
        """{"name": str, "protocol": 1, "block_size": B, "num_target_layers": L (the depth the subject is
        configured for), "layer_ids": the target layer ids it selects, "layer_id_convention": one of
        LAYER_ID_CONVENTIONS, "notes": [str] (what configuration was exercised)}."""

    def build(self, target: ProbeTarget) -> None:
        """Build a tiny drafter for `target` the way the implementation builds it."""

    def parameters(self) -> dict[str, nn.Parameter]:
        """Every parameter the implementation holds: the drafter's, and embeddings / lm_head if it owns copies."""

    def draft_logits(self, batch: ProbeBatch, hooks: ProbeHooks) -> Tensor:
        """The drafter's logits for every block token, [N, A, B, V] (no gradient needed)."""

    def loss(self, batch: ProbeBatch, hooks: ProbeHooks) -> Tensor:
        """The implementation's training loss on `batch`, a scalar with its autograd graph."""

    def train_step(self, batch: ProbeBatch) -> None:
        """One optimizer step, with the optimizer the implementation builds for training."""

    def draft_layers(self) -> list[nn.Module]:
        """The drafter's decoder layers in order; each takes the block tokens' hidden states as its first
        positional argument or as the keyword `hidden_states`."""

    def rotary(self) -> nn.Module | None:
        """The module that turns position ids into rotary embeddings (called as module(x, position_ids))."""
