"""The target's cache in draft-verify decoding, and how a rejected block is undone on every family.

A verify pass runs all B block tokens through the target; only the anchor and the accepted drafts are kept,
so the cache must go back to `start + accepted + 1` positions. Two kinds of state:

- attention K/V (full, sliding, chunked) hold one entry per position: cropping the last positions off is
  exact (sliding-window layers keep the positions a crop needs once `activate_past_recording` is on);
- a recurrent state (Gated DeltaNet in Qwen3-Next / Qwen3.5 / Qwen3.6, Kimi Delta Attention, Mamba-2 in
  Granite 4, MiniMax's lightning attention) has folded all B tokens into one tensor: no crop can take the
  rejected ones out (transformers: `is_croppable` False). Cropping anyway, as a plain KV-cache loop does,
  leaves the convolution window right and the recurrent state B - kept tokens ahead: every later step
  verifies against a target that has read tokens that were never committed, so the output drifts from
  greedy decoding (`lossless` false) and tau measures a target that does not exist.

So on a cache that is not croppable the state a crop cannot undo is cloned before each verify pass
(`begin_verify`); after a rejection (`commit` with fewer than B kept) the K/V are cropped back to the
block's start, the clone is put back, and the committed tokens run through the target again from it (one
replay forward of kept tokens). The verify pass's own outputs for the committed slots are the same numbers
(causal layers), so the accept decision and the drafter's new context come from the verify pass as on any
target. Serving engines reach the same state without the replay by keeping the state after every block
position inside their kernels; the replay costs eval time only (counted in `replays`, not in the target
forwards that `tokens_per_target_forward` divides by). A cache that is croppable (attention only) is
cropped as before: no clone, no replay.

The cache is the one the model builds for itself on the first forward: MiniMax refuses any other class.
A cache must also tell the model how many positions it holds, or the causal mask of a multi-token input
is built as if there were no past: MiniMax's (transformers 5.24) answers from its first layer, a lightning
attention layer that stores no positions, so it says 0 and a verify pass over B tokens attends wrongly
(measured: next logits 0.007 off) while a one-token step is right. Such a cache is fed one token at a time.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from trainer.target.frozen import TargetError

RollbackMode = Literal["crop", "state_replay"]
# The per-layer tensors a crop leaves wrong on transformers' linear-attention cache layers (5.x); has_previous_state
# goes with them (a restored state is a state after prefill).
LINEAR_LAYER_STATE = ("recurrent_states", "conv_states", "has_previous_state")


def cache_kwarg(model: nn.Module) -> str:
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns, and goes in
    5.40); 4.x only knows `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: _clone(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(item) for item in value)
    return value


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(item) for item in value)
    return False


def _counted_positions(cache: Any, default: int) -> int:
    """How many positions the cache says it holds, as the model's mask builder asks it."""
    try:
        return int(cache.get_seq_length())
    except ValueError:  # transformers: a cache of linear-attention layers only holds no positions to count, and
        return default  # a model without attention layers builds no causal mask from it
    except AttributeError:
        return default


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


class TargetCache:
    """The target model with its cache, fed left to right from position 0, with an exact rollback."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._kwarg = cache_kwarg(model)
        self.cache: Any = None  # the model's own, from the first forward
        self.length = 0  # positions the cache holds
        self.replays = 0  # forwards that re-ran committed tokens after a rejected block
        self._croppable: bool | None = None
        self._saved: list[tuple[Any, str, Any]] | None = None
        self._stepwise = False  # the cache miscounts its positions: multi-token inputs go one token at a time

    @property
    def rollback(self) -> RollbackMode:
        return "crop" if self.croppable else "state_replay"

    @property
    def croppable(self) -> bool:
        """Whether cropping alone restores the cache (known after the first forward)."""
        if self._croppable is None:
            if self.cache is None:
                raise RuntimeError("the target cache is built by the first forward")
            flag = getattr(self.cache, "is_croppable", None)
            # transformers without the flag: croppable unless state lives outside per-position layers
            self._croppable = flag if isinstance(flag, bool) else not self._state_to_save()
        return self._croppable

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
        """The target over input_ids [1, T] at positions length..length+T-1, extending the cache. Returns the
        model's output (`logits`, and `hidden_states` when asked for)."""
        if self._stepwise and input_ids.shape[1] > 1:
            return self._one_token_at_a_time(input_ids, **kwargs)
        steps = input_ids.shape[1]
        positions = torch.arange(self.length, self.length + steps, device=input_ids.device)[None]  # [1, T]
        try:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=True,
                             **{self._kwarg: self.cache}, **kwargs)
        except (MemoryError, torch.cuda.OutOfMemoryError):  # what a bigger device fixes, not the family
            raise
        except Exception as exc:  # inside the model's own code: a family that cannot decode this way
            raise TargetError(f"{type(self.model).__name__} fails in a cached forward at position {self.length} "
                              f"({type(exc).__name__}: {_first_line(exc)}); it cannot be decoded speculatively "
                              "here") from exc
        if self.cache is None:
            self.cache = getattr(out, "past_key_values", None)
            if self.cache is None:
                raise TargetError(f"{type(self.model).__name__} returns no cache from a forward with use_cache=True "
                                  "(it keeps no state between calls, or keeps it inside the model): it cannot be "
                                  "decoded incrementally, so speculative decoding cannot be evaluated on it")
            if hasattr(self.cache, "activate_past_recording"):
                # sliding windows and convolution windows then keep the positions a crop has to give back
                self.cache.activate_past_recording()
            self._stepwise = _counted_positions(self.cache, steps) != steps
        self.length += steps
        return out

    def _one_token_at_a_time(self, input_ids: Tensor, logits_to_keep: int = 0, **kwargs: Any) -> Any:
        outputs = [self.forward(input_ids[:, i:i + 1], **kwargs) for i in range(input_ids.shape[1])]
        logits = torch.cat([o.logits for o in outputs], dim=1)  # [1, T, V]
        hidden = None
        if outputs[0].hidden_states is not None:
            hidden = tuple(torch.cat(layer, dim=1) for layer in zip(*(o.hidden_states for o in outputs)))
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits,
                               hidden_states=hidden, past_key_values=self.cache)

    def begin_verify(self) -> None:
        """Before a verify pass: keep a copy of the state that no crop can restore (nothing when croppable)."""
        self._saved = None if self.croppable else self._state_to_save()

    def commit(self, block_ids: Tensor, start: int, kept: int) -> None:
        """After verifying block_ids [1, B] at positions start..start+B-1: keep the first `kept` of them."""
        if self.length != start + block_ids.shape[1]:
            raise RuntimeError(f"commit of a block at {start} on a cache of {self.length} positions")
        if self.croppable or kept == block_ids.shape[1]:
            self._crop(start + kept)
        elif self._saved is None:
            raise RuntimeError("a recurrent state cannot be rolled back without begin_verify() before the pass")
        else:
            self._crop(start)
            for owner, name, value in self._saved:
                setattr(owner, name, value)
            self.forward(block_ids[:, :kept], logits_to_keep=1)
            self.replays += 1
        self._saved = None
        self._trim()

    def _state_to_save(self) -> list[tuple[Any, str, Any]]:
        """(owner, attribute, clone) of the state a crop cannot undo: the linear-attention layers' states, and
        tensors the cache keeps outside its per-position layers (MiniMax's lightning-attention state)."""
        saved = []
        for layer in getattr(self.cache, "layers", None) or []:
            for name in LINEAR_LAYER_STATE:
                if hasattr(layer, name) and hasattr(layer, "recurrent_states"):
                    saved.append((layer, name, _clone(getattr(layer, name))))
        for name, value in vars(self.cache).items():
            if name != "layers" and _holds_tensors(value):
                saved.append((self.cache, name, _clone(value)))
        return saved

    def _crop(self, length: int) -> None:
        """Keep the first `length` positions of every per-position layer. Layer by layer: MiniMax's cache
        refuses `crop` as a whole although its attention layers crop exactly (its own state is restored apart)."""
        excess = self.length - length
        if excess <= 0:
            return
        layers = getattr(self.cache, "layers", None)
        # A negative argument means 'remove that many' in every transformers version (5.x rejects positives).
        if layers is None:
            self.cache.crop(-excess)
        else:
            for layer in layers:
                layer.crop(-excess)
        self.length = length

    def _trim(self) -> None:
        """Recording layers keep every position until cropped: cut them back to their working size (a
        sliding window, a convolution kernel) after each block, so a fully accepted block does not grow them."""
        for layer in getattr(self.cache, "layers", None) or []:
            if getattr(layer, "record_past", False):
                layer.crop(0)
