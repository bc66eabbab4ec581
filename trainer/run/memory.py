"""What one training step needs in memory, estimated before anything is written, and the refusal.

A run whose step cannot fit should fail in a second with the numbers, not after minutes of packing with an
allocator traceback (or a swap storm). The estimate adds up the large tensors of a step, each from the
config and the target's dimensions (bytes; e = the compute dtype's element size, N rows per process,
S = seq_len, Q = max_anchors x block_size block tokens, KV = S + Q keys, V the vocabulary the loss scores):

    weights         the target's parameters (resident already) + the drafter's, its gradients and two
                    optimizer states
    target forward  its L+1 hidden states [N, S, H] (output_hidden_states keeps them all), one layer's
                    transients, and the [N, S, S] packed masks
    drafter         what autograd keeps for backward: per layer the block tokens' activations ([N, Q, H],
                    [N, Q, I], the heads) and the keys / values of context and block ([N, KV, kv heads x
                    head dim]), on CPU the dense [N, Q, KV] mask; plus one layer again for backward
    loss            one chunk of float32 logits at a time, [loss_chunk_size, V], a few copies
                    (trainer/model/loss.py), and the gradient of the drafter's output

Each part is what one knob moves: seq_len (and batch_size) the target forward, max_anchors the drafter,
loss_chunk_size the loss. tests/trainer/test_memory.py checks the estimate against the measured peak.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import ConfigError, TrainConfig
from trainer.model.loss import loss_chunk_slots

# Float32 [chunk, V] tensors a loss chunk holds at once (trainer/model/loss.py _forward, measured): CE one (the
# logits, whose softmax and gradient are taken in place); KL four (the drafter's logits and softmax, the
# teacher's log-softmax and softmax). A half-precision head adds its own output and the gradient's cast.
_LOSS_COPIES = {"ce": 1.25, "kl": 4.25}
_HALF_PRECISION_COPIES = 1.0
_OPTIMIZER_COPIES = 4  # parameter, gradient, two optimizer states (AdamW; Muon keeps fewer)


@dataclass(frozen=True)
class StepMemory:
    """Bytes of the parts of one step's peak (see the module docstring)."""

    weights: int
    target_forward: int
    drafter: int
    loss: int

    @property
    def peak(self) -> int:
        # The target's forward is over (its hidden states freed but features and the teacher's) before the
        # drafter runs, so the two do not add up.
        return self.weights + max(self.target_forward, self.drafter + self.loss)

    def largest(self) -> str:
        parts = {"weights": self.weights, "target forward": self.target_forward, "drafter": self.drafter,
                 "loss": self.loss}
        return max(parts, key=lambda name: parts[name])


def estimate_step_memory(config: TrainConfig, target: Any, world_size: int = 1) -> StepMemory:
    from trainer.model.drafter import _intermediate_size, draft_config_from_target

    e = torch.empty((), dtype=target.dtype).element_size()
    n = max(1, config.batch_size // world_size)
    s, b = config.seq_len, config.block_size
    q = config.max_anchors * b
    kv = s + q
    text = target.config
    hidden, layers = target.hidden_size, target.num_layers
    # the drafter as the run builds it: the target's shape overridden by the run's draft_config
    draft = draft_config_from_target(target.model.config, config.draft_layers, config.draft_config.as_shape())
    heads, kv_heads, head_dim, inner = (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim,
                                        draft.intermediate_size)
    features = len(config.fc_layer_ids(layers))
    vocab = min(config.draft_vocab_size or target.vocab_size, target.vocab_size)

    target_params = sum(p.numel() * p.element_size() for p in target.model.parameters() if p.device.type != "meta")
    draft_params = (features * hidden * hidden + config.draft_layers * (
        hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inner))
    weights = target_params + _OPTIMIZER_COPIES * draft_params * e

    cpu = target.device.type != "cuda"
    kept = n * s * (features + 1) * hidden * e  # features and the teacher's hidden states, through the step
    target_forward = (kept + (layers + 1) * n * s * hidden * e
                      + n * s * (3 * _intermediate_size(text) + 4 * hidden) * e + 4 * n * s * s)
    # What autograd keeps per layer and block token: two RMSNorms (2H each), the queries through q_norm and
    # RoPE (5 head widths with attention's own), the MLP's gate, up, activation and product (4I); per key,
    # keys and values through k_norm, RoPE and the segments' copies (7 kv head widths).
    per_layer = n * (q * (4 * hidden + 5 * heads * head_dim + 4 * inner) + kv * 7 * kv_heads * head_dim) * e
    mask = n * q * kv if cpu else n * q * kv // (128 * 128) * 8  # CPU: segments of the bool mask, at most dense
    mask *= len(set(getattr(draft, "layer_types", None) or ["full_attention"]))  # one mask per layer type
    drafter = (kept + (config.draft_layers + 1) * per_layer + mask
               + n * s * 3 * hidden * e + n * kv * head_dim * 4 * e)  # fc + hidden_norm, rotary
    chunk = min(loss_chunk_slots(config.loss_chunk_size, vocab, b), n * q)
    copies = _LOSS_COPIES[config.loss] + (_HALF_PRECISION_COPIES if e < 4 else 0.0)
    loss = chunk * vocab * 4 * copies + n * q * hidden * e
    return StepMemory(weights=int(weights), target_forward=int(target_forward), drafter=int(drafter),
                      loss=int(loss))


def check_fits_memory(config: TrainConfig, target: Any, world_size: int = 1) -> StepMemory:
    """Refuse a config whose estimated step peak exceeds the device's memory: one line with the estimate,
    its parts and the knob that brings the largest part down."""
    memory = estimate_step_memory(config, target, world_size)
    available = _device_memory_bytes(target.device)
    if available is not None and memory.peak > available:
        gib = 2**30
        knob = {
            "target forward": "lower seq_len or batch_size",
            "drafter": "lower max_anchors (or seq_len)",
            "loss": "lower loss_chunk_size",
            "weights": "the weights alone do not fit: shard the target (target_parallelism fsdp2) or use a larger device",
        }[memory.largest()]
        raise ConfigError(
            f"seq_len {config.seq_len} with batch_size {config.batch_size} needs at least {memory.peak / gib:.1f} GiB "
            f"per step (estimated with max_anchors {config.max_anchors} x block_size {config.block_size}, "
            f"loss_chunk_size {config.loss_chunk_size}: weights {memory.weights / gib:.1f}, target forward "
            f"{memory.target_forward / gib:.1f}, drafter {memory.drafter / gib:.1f}, loss {memory.loss / gib:.1f} GiB), "
            f"more than the {available / gib:.1f} GiB of {target.device.type} memory here: {knob}"
        )
    return memory


def _device_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no preflight, the runtime check remains
        return None
