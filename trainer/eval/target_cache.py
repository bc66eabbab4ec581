"""The target's cache in draft-verify decoding, and how a rejected block is undone on every family.

A verify pass runs all B block tokens through the target; only the anchor and the accepted drafts are kept,
so the cache must go back to `start + accepted + 1` positions. Two kinds of state:

- attention K/V (full, sliding, chunked) hold one entry per position: cropping the last positions off is
  exact (sliding-window layers keep the positions a crop needs once `activate_past_recording` is on);
- a recurrent state (Gated DeltaNet in Qwen3-Next / Qwen3.5 / Qwen3.6, Kimi Delta Attention, Mamba-2 in
  Granite 4, MiniMax's lightning attention) has folded all B tokens into one tensor: no crop can take the
  rejected ones out by itself (transformers 5.24: `is_croppable` False). Cropping anyway, as a plain KV-cache loop
  does, leaves the convolution window right and the recurrent state B - kept tokens ahead: every later step
  verifies against a target that has read tokens that were never committed, so the output drifts from
  greedy decoding (`lossless` false) and tau measures a target that does not exist.

Two exact ways back, chosen per verify pass from what the cache itself holds:

- `state_history` (transformers >= 5.25): the cache is told, once at the first verify pass (a prefill or a plain
  decode records nothing), to record the recurrent state after each of the last `verify_tokens` positions of every
  forward (`activate_past_recording(recurrent_states_to_keep=...)`); the model then runs those positions through
  its sequential kernel and the layer keeps each state, so `crop(-k)` puts back the state after the last kept
  token. This is what serving engines do inside their kernels: no extra forward. It is taken only where it is
  exact: every recurrent layer must have recorded one state per position the pass fed, each state slot in a list
  of its own (a layer whose model does not compute intermediate states records one per forward; 5.25 lets the
  slots of a multi-state layer share one list), and no state may live outside the per-layer caches (MiniMax's
  lightning attention).
- `state_replay` (everything else, transformers 5.24 included): the state a crop cannot undo is cloned before
  each verify pass (`begin_verify`); after a rejection the K/V are cropped back to the block's start, the clone
  is put back, and the committed tokens run through the target again from it (one replay forward of kept
  tokens, counted in `replays`, not in the target forwards that `tokens_per_target_forward` divides by).

Either way the verify pass's own outputs for the committed slots are the numbers the accept decision and the
drafter's new context come from, as on any target. A cache of attention layers only is cropped: no clone, no
replay (`crop`).

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

RollbackMode = Literal["crop", "state_history", "state_replay"]
# The per-layer tensors a crop leaves wrong on transformers' linear-attention cache layers (5.x) when the layer did
# not record its states: has_previous_state goes with them (a restored state is a state after prefill), and so does
# the layer's own position count, which a hybrid model's mask builder may ask (Qwen3.5's first layer is linear).
LINEAR_LAYER_STATE = ("recurrent_states", "conv_states", "has_previous_state", "cumulative_length_linear")


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
    """The target model with its cache, fed left to right from position 0, with an exact rollback.

    `verify_tokens`: the most tokens one verify pass feeds (the block size); a pass of more falls back to the
    replay, since the cache records the states of that many positions only. `record_states=False` never asks the
    cache for per-position states (every rollback a replay: what bench/recurrent_rollback.py compares against)."""

    def __init__(self, model: nn.Module, verify_tokens: int = 1, record_states: bool = True) -> None:
        self.model = model
        self.verify_tokens = max(1, int(verify_tokens))
        self.record_states = record_states
        self._kwarg = cache_kwarg(model)
        self.cache: Any = None  # the model's own, from the first forward
        self.length = 0  # positions the cache holds
        self.replays = 0  # forwards that re-ran committed tokens after a rejected block
        self._recurrent: bool | None = None
        self._recording = False  # activate_past_recording was called (at the first verify pass, not at prefill)
        self._records_states = False  # and the cache was asked to keep a state per position (transformers >= 5.25)
        self._history_exact: bool | None = None  # every pass so far recorded a state per position it fed
        self._marks: list[tuple[list, int]] | None = None  # (a layer's state history, its length before the pass)
        self._saved: list[tuple[Any, str, Any]] | None = None
        self._stepwise = False  # the cache miscounts its positions: multi-token inputs go one token at a time

    @property
    def recurrent(self) -> bool:
        """Whether the cache holds a state that cropping positions off does not undo (known after the first forward)."""
        if self._recurrent is None:
            if self.cache is None:
                raise RuntimeError("the target cache is built by the first forward")
            self._recurrent = bool(self._state_owners())
        return self._recurrent

    @property
    def croppable(self) -> bool:
        """Whether cropping alone restores the cache without recorded states (attention only)."""
        return not self.recurrent

    @property
    def rollback(self) -> RollbackMode:
        """How rejected drafts leave the cache: what every rollback so far used, or will use before the first."""
        if not self.recurrent:
            return "crop"
        if self.replays or self._history_exact is False or not self._records_states:
            return "state_replay"
        return "state_history"

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

    def begin_verify(self, tokens: int | None = None) -> None:
        """Before a verify pass of `tokens` (default verify_tokens): start recording what a rollback needs, and keep
        a copy of the state no crop can restore unless the cache's own records are known to be exact."""
        tokens = self.verify_tokens if tokens is None else tokens
        self._start_recording()
        self._marks = self._history_marks() if self.recurrent and self._records_states else None
        trusted = self._history_exact is True and self._marks is not None and tokens <= self.verify_tokens
        self._saved = self._state_to_save() if self.recurrent and not trusted else None

    def commit(self, block_ids: Tensor, start: int, kept: int) -> None:
        """After verifying block_ids [1, B] at positions start..start+B-1: keep the first `kept` of them."""
        fed = block_ids.shape[1]
        if self.length != start + fed:
            raise RuntimeError(f"commit of a block at {start} on a cache of {self.length} positions")
        if self.recurrent:
            recorded = self._recorded_every_position(fed)
            if self._history_exact is not False:
                self._history_exact = recorded
        if not self.recurrent or kept == fed:
            self._crop(start + kept)
        elif recorded:
            self._crop(start + kept)  # the layers put back the state recorded after the last kept position
        elif self._saved is None:
            raise RuntimeError("a recurrent state cannot be rolled back: the pass fed more positions than the cache "
                               "recorded states for, and begin_verify() saved none before it")
        else:
            self._forget_recorded_states(fed)
            self._crop(start)  # K/V (a layer may hold K/V beside its state), then the state as it was before the pass
            for owner, name, value in self._saved:
                setattr(owner, name, value)
            self.forward(block_ids[:, :kept], logits_to_keep=1)
            self.replays += 1
        self._saved = None
        self._marks = None
        self._trim()

    def _start_recording(self) -> None:
        """Sliding windows, convolution windows and (transformers >= 5.25) recurrent states then keep what a crop
        has to give back. Only from the first verify pass on: a plain decode or the prefill records nothing."""
        if self._recording or self.cache is None or not hasattr(self.cache, "activate_past_recording"):
            return
        can_record = any(
            "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters
            for layer in getattr(self.cache, "layers", None) or []
            if hasattr(layer, "activate_past_recording"))
        self._records_states = can_record and self.record_states
        if can_record:  # 5.25's models read the count on every multi-token forward: None is not "none"
            self.cache.activate_past_recording(recurrent_states_to_keep=self.verify_tokens if self.record_states else 0)
        else:
            self.cache.activate_past_recording()
        self._recording = True

    def _state_layers(self) -> list[Any]:
        """The cache's per-layer entries that carry a recurrent or convolution state."""
        return [layer for layer in getattr(self.cache, "layers", None) or [] if hasattr(layer, "recurrent_states")]

    def _state_owners(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of the state a crop cannot undo by itself: the linear-attention layers' states, and
        tensors the cache keeps outside its per-layer entries (MiniMax's lightning-attention state)."""
        owners = [(layer, name) for layer in self._state_layers() for name in LINEAR_LAYER_STATE if hasattr(layer, name)]
        owners += [(self.cache, name) for name, value in vars(self.cache).items()
                   if name != "layers" and _holds_tensors(value)]
        return owners

    def _state_to_save(self) -> list[tuple[Any, str, Any]]:
        return [(owner, name, _clone(getattr(owner, name))) for owner, name in self._state_owners()]

    def _history_marks(self) -> list[tuple[list, int]] | None:
        """Each recorded state history with its length now; None where the cache's records cannot be exact: state
        outside the per-layer entries, a state layer that does not record, or two state slots sharing one list."""
        if any(owner is self.cache for owner, _ in self._state_owners()):
            return None
        marks: list[tuple[list, int]] = []
        seen: set[int] = set()
        for layer in self._state_layers():
            if not getattr(layer, "record_past", False):
                return None
            initialized = getattr(layer, "is_recurrent_states_initialized", {}) or {}
            histories = getattr(layer, "recurrent_states_history", None)
            for slot, ready in initialized.items():
                if not ready:
                    continue
                history = (histories or {}).get(slot)
                if not isinstance(history, list) or id(history) in seen:
                    return None
                seen.add(id(history))
                marks.append((history, len(history)))
        return marks

    def _recorded_every_position(self, fed: int) -> bool:
        """Whether this pass left one recorded state per position it fed, in every recurrent layer."""
        if self._marks is None or fed > self.verify_tokens:
            return False
        return all(len(history) - before == fed for history, before in self._marks)

    def _forget_recorded_states(self, fed: int) -> None:
        """Before a crop that the restored clone overrides: a recording layer's crop takes its new state from its
        history, which here holds fewer states than positions (the model did not record one per position), so
        give it placeholders to take; the clone put back after the crop is the state that counts."""
        for layer in self._state_layers():
            histories = getattr(layer, "recurrent_states_history", None)
            if isinstance(histories, dict):
                for slot in histories:
                    histories[slot] = [None] * fed

    def _crop(self, length: int) -> None:
        """Keep the first `length` positions of every per-position layer. Layer by layer: MiniMax's cache refuses
        `crop` as a whole although its attention layers crop exactly (its own state is restored apart)."""
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
        """Recording layers keep every position (and state) until cropped: cut them back to their working size (a
        sliding window, a convolution kernel) after each block, so a fully accepted block does not grow them."""
        for layer in getattr(self.cache, "layers", None) or []:
            if getattr(layer, "record_past", False):
                layer.crop(0)
