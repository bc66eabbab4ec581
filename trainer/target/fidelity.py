"""Target fidelity (`dflash.target_forward_fidelity`): packed rows must compute what the model computes.

The drafter learns from the target's features and logits on packed rows. If packing changes them (a
dropped sliding window, a mask that ignores a layer type, a recurrent state flowing across a document
boundary) the drafter trains silently on states the target never produces at serving time. So every run
starts by measuring it: one packed row, [a short lead document | a held-out document longer than any
attention window | padding], against the model's own forward on each document alone (no mask, default
positions). The largest absolute difference over every hidden state and over the logits is recorded in
run.json as `target_fidelity`, and the run refuses to train above the tolerance unless overridden.

The packing mode is chosen by that same measurement: the first of PACKING_MODES whose difference is
within the tolerance (see trainer/target/frozen.py for what each mode does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from trainer.target.frozen import PACKING_MODES, FrozenTarget, PackingMode, TargetError, varlen_available

# float32 packed vs alone differs only by summation order: measured at most 1.6e-5 on hidden states (Gemma4
# text, whose hidden states are the largest; 3.1e-6 on the others) and 9.6e-7 on logits across the tiny
# families of tests/trainer/test_architectures.py, while a dropped window
# differs by 1.6-9.5 (hidden) and 0.015-0.66 (logits) there. In bfloat16 the exact ways measured up to
# 6.2e-2 (hidden) and 3.1e-2 (logits) on the same tiny models and on the embedded target (CPU); real
# checkpoints carry larger hidden states, so a bfloat16 run of one may need target_fidelity_tolerance.
# float16 is not measured; it gets half the bfloat16 bound (three more mantissa bits).
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 1e-1}
PADDING_TAIL = 3  # a few padding positions after the documents, as packed rows have
WINDOW_MARGIN = 16  # the held-out document is at least this much longer than the longest window
LOGIT_CHUNK_BYTES = 64 * 2**20  # float32 logits compared at once
HEAD_CHECK_POSITIONS = 32  # last positions of each document where the head is checked against the model's logits


@dataclass
class FidelityRecord:
    """What run.json stores under `target_fidelity` (the sleuth contract; docs/reference/run-directory.md)."""

    max_abs_hidden_diff: float  # over every hidden state (embeddings and each layer's output), every position
    max_abs_logit_diff: float
    tolerance: float
    tokens: int  # tokens of the held-out document the packed row was checked on
    passed: bool
    packing: PackingMode  # how the run packs rows (the mode that was measured above)
    longest_window: int | None  # the target's longest sliding / chunked window; None: full attention only
    dtype: str
    tried: dict[str, dict[str, Any]] = field(default_factory=dict)  # modes that failed before this one

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def longest_window(config: Any) -> int | None:
    """The longest sliding-window or attention-chunk size any layer of the target uses (None: none)."""
    layer_types = set(getattr(config, "layer_types", None) or [])
    windows = []
    sliding = getattr(config, "sliding_window", None)
    # Configs without layer_types apply sliding_window to every layer unless switched off (Qwen2's flag).
    uses_sliding = "sliding_attention" in layer_types if layer_types else getattr(config, "use_sliding_window", True)
    if isinstance(sliding, int) and sliding > 0 and uses_sliding:
        windows.append(sliding)
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and chunk > 0 and (not layer_types or "chunked_attention" in layer_types):
        windows.append(chunk)
    return max(windows) if windows else None


def check_lengths(target: FrozenTarget, seq_len: int) -> tuple[int, int]:
    """(lead, held-out) document lengths: the row is at least seq_len and the held-out document is longer
    than any window, within the target's maximum position."""
    window = longest_window(target.config)
    lead = max(4, seq_len // 8)
    document = max(seq_len - lead, (window or 0) + WINDOW_MARGIN)
    max_positions = getattr(target.config, "max_position_embeddings", None) or getattr(target.config, "n_positions", None)
    if isinstance(max_positions, int) and max_positions > 0:
        document = min(document, max_positions)
    return lead, document


def token_stream(documents: list[list[int]], length: int) -> list[int]:
    """`length` tokens of the documents laid end to end (cycled when they are fewer)."""
    flat = [token for doc in documents for token in doc]
    if not flat:
        raise TargetError("the fidelity check needs held-out tokens, and the data has none")
    return [flat[i % len(flat)] for i in range(length)]


@torch.no_grad()
def measure(target: FrozenTarget, lead: list[int], document: list[int], packing: PackingMode) -> tuple[float, float]:
    """Max abs (hidden, logit) difference of one packed row, run the `packing` way, against each
    document run alone through the model's own forward.

    Logits are compared the way training takes them: the target's head (FrozenTarget.teacher_head) on the
    final hidden state, packed against alone, a few hundred positions at a time (at a 248k vocabulary a
    whole row of float32 logits is half a GB per copy); and that head against the model's own logits at
    the document's last positions, which the model's forward computes itself (logits_to_keep)."""
    docs = [lead, document]
    length = len(lead) + len(document) + PADDING_TAIL
    input_ids = torch.full((1, length), target.pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((1, length), dtype=torch.long)
    doc_ids = torch.full((1, length), -1, dtype=torch.long)
    offset = 0
    for index, ids in enumerate(docs):
        span = slice(offset, offset + len(ids))
        input_ids[0, span] = torch.tensor(ids)
        position_ids[0, span] = torch.arange(len(ids))
        doc_ids[0, span] = index
        offset += len(ids)
    hidden, _ = target.forward_rows(input_ids, position_ids, doc_ids, packing=packing, with_logits=False)
    hidden_diff = logit_diff = 0.0
    head = target.teacher_head()
    step = max(1, LOGIT_CHUNK_BYTES // (4 * target.vocab_size))
    offset = 0
    for ids in docs:
        keep = min(len(ids), HEAD_CHECK_POSITIONS)
        alone = target.model(
            input_ids=torch.tensor([ids], device=target.device), output_hidden_states=True, use_cache=False,
            **target.keep_logits(keep),
        )
        span = slice(offset, offset + len(ids))
        offset += len(ids)
        for packed_h, alone_h in zip(hidden, alone.hidden_states, strict=True):
            hidden_diff = max(hidden_diff, _max_abs_diff(packed_h[0, span], alone_h[0]))
        packed_final, alone_final = hidden[-1][0, span], alone.hidden_states[-1][0]
        for i in range(0, len(ids), step):
            logit_diff = max(logit_diff, _max_abs_diff(head(packed_final[i:i + step]), head(alone_final[i:i + step])))
        logit_diff = max(logit_diff, _head_diff(head, alone, keep))
    return hidden_diff, logit_diff


def _head_diff(head: Any, output: Any, positions: int) -> float:
    """The head is the model's own: the same logits as its forward (`output`, one document alone) at the
    last `positions` positions, where the forward computed them."""
    return _max_abs_diff(head(output.hidden_states[-1][0, -positions:]), output.logits[0, -positions:])


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs().max()
    return float(diff) if torch.isfinite(diff) else float("inf")


def choose_packing(
    target: FrozenTarget,
    stream: list[int],
    lead_length: int,
    tolerance: float | None = None,
    packing: str = "auto",
) -> FidelityRecord:
    """Measure fidelity and set `target.packing` to the first mode within tolerance ('auto'), or measure
    the one mode asked for. The record says how the run packs and how far that is from the model."""
    tolerance = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(target.dtype, 1e-1)
    lead, document = stream[:lead_length], stream[lead_length:]
    # auto: every way this device can run ("varlen" needs CUDA and flash-linear-attention)
    modes: tuple[PackingMode, ...] = (  # type: ignore[assignment]
        tuple(m for m in PACKING_MODES if m != "varlen" or varlen_available(target.device))
        if packing == "auto" else (packing,)
    )
    tried: dict[str, dict[str, Any]] = {}
    result: tuple[PackingMode, float, float] | None = None
    for mode in modes:
        try:
            hidden_diff, logit_diff = measure(target, lead, document, mode)
        except (MemoryError, torch.cuda.OutOfMemoryError):  # what a bigger device fixes, not the family
            raise
        except Exception as exc:  # a mode this model cannot run (a layer type without a mask builder, a
            # forward that takes no {layer type: mask} mapping) is simply not a way to pack it
            if packing != "auto" and isinstance(exc, TargetError):
                raise  # the one way asked for cannot run here, and says why
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if mode == "per_document":  # the model's own plain forward over one document: nothing to train on
                raise TargetError(f"{type(target.model).__name__} fails in its own forward over one document "
                                  f"({error}); it cannot be used as a target") from exc
            tried[mode] = {"error": error}
            continue
        result = (mode, hidden_diff, logit_diff)
        if max(hidden_diff, logit_diff) <= tolerance:
            break
        tried[mode] = {"max_abs_hidden_diff": hidden_diff, "max_abs_logit_diff": logit_diff}
    if result is None:
        raise TargetError(f"no packing mode could run the target: {tried}")
    mode, hidden_diff, logit_diff = result
    tried.pop(mode, None)
    target.packing = mode
    return FidelityRecord(
        max_abs_hidden_diff=hidden_diff,
        max_abs_logit_diff=logit_diff,
        tolerance=tolerance,
        tokens=len(document),
        passed=max(hidden_diff, logit_diff) <= tolerance,
        packing=mode,
        longest_window=longest_window(target.config),
        dtype=str(target.dtype).removeprefix("torch."),
        tried=tried,
    )
