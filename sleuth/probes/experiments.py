"""The experiments: each perturbs one thing, measures one number and compares it with a stated threshold.

Every experiment returns `Verdict`s, one per invariant it decides: the hypothesis, what was perturbed,
what was measured (with the number), the threshold, and match / mismatch / unknown (with the reason).
They run inside the probe worker, on a subject that follows `sleuth.probes.protocol`.

Influence is measured as the largest change of the drafter's logits relative to their largest value.
Masked attention contributes exactly nothing, so "does not see" is a change at rounding level
(<= NO_EFFECT) and "sees" is a change far above it (>= EFFECT); anything between is reported unknown.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sleuth.probes.protocol import ProbeBatch, ProbeHooks, ProbeTarget
from sleuth.probes.target import Layout, make_batch, make_layout, perturb_layer, perturb_positions, rms_norm
from sleuth.probes.verdict import Expectations, Verdict

NO_EFFECT = 1e-6  # relative change of the logits at or below this: the perturbed input is not seen
EFFECT = 1e-3  # at or above this: it is seen
AGREEMENT = 0.9  # share of trained slots whose recovered target must agree with a candidate teacher
ONE_HOT = 0.99  # a recovered target distribution with this much mass on one token is one-hot
SOFT_TV = 0.05  # total variation below which a recovered soft target equals a candidate's softmax
GAMMA_RTOL = 0.01  # a fitted gamma within 1 % of an accepted value matches it
EXP_FIT = 0.01  # largest residual of log-weights allowed for "exp(-(k-1)/gamma)"
DATA_DEPENDENT = 1e-3  # relative change of the slot weights between two confidence levels


def influence(before: Tensor, after: Tensor) -> float:
    """max |after - before| / max |before|: how much a perturbation moved these outputs."""
    scale = before.abs().max().item()
    return (after - before).abs().max().item() / max(scale, 1e-12)


def seen(change: float) -> bool | None:
    if change >= EFFECT:
        return True
    if change <= NO_EFFECT:
        return False
    return None


class Lab:
    """One subject with its synthetic target and batch, and helpers to run it perturbed."""

    def __init__(self, subject: Any, info: dict[str, Any], target: ProbeTarget, expectations: Expectations,
                 seed: int = 0) -> None:
        self.subject, self.info, self.target, self.expectations, self.seed = subject, info, target, expectations, seed
        self.block_size = int(info["block_size"])
        # A subject whose rows never hold two documents (describe()["documents_per_row"] = 1) is probed on
        # one-document rows: packing rules (positions restarting, document masks) are not its to follow.
        self.layout: Layout = make_layout(self.block_size, 1 if info.get("documents_per_row") == 1 else 2)
        self.batch: ProbeBatch = make_batch(target, self.layout, seed + 1)
        self._baseline: Tensor | None = None

    def logits(self, batch: ProbeBatch | None = None, hooks: ProbeHooks | None = None) -> Tensor:  # [A, B, V]
        batch = batch or self.batch
        with torch.no_grad():
            out = self.subject.draft_logits(batch, hooks or ProbeHooks())
        a, b = batch.anchors.shape[1], self.block_size
        return out.detach().float().reshape(-1, a, b, out.shape[-1])[0]

    def only_anchor(self, index: int, batch: ProbeBatch | None = None) -> ProbeBatch:
        """The batch with a single block: a leak through another block cannot confound what it sees."""
        batch = batch or self.batch
        return batch.replace(anchors=batch.anchors[:, index : index + 1],
                             anchor_valid=batch.anchor_valid[:, index : index + 1])

    @property
    def baseline(self) -> Tensor:
        if self._baseline is None:
            self._baseline = self.logits()
        return self._baseline

    def bump_block_tokens(self, tokens: list[int], seed: int, scale: float = 3.0) -> ProbeHooks:
        """Hooks that add noise to the input embeddings of these block-stream tokens (index a*B + j)."""

        def hook(x: Tensor) -> Tensor:
            g = torch.Generator().manual_seed(seed)
            x = x.clone()
            index = torch.tensor(tokens, dtype=torch.long)
            noise = torch.randn(x.index_select(-2, index).shape, generator=g).to(x.dtype)
            x.index_add_(x.dim() - 2, index, scale * noise)
            return x

        return ProbeHooks(block_embeddings=hook)


def randomize_drafter(subject: Any, target: ProbeTarget, seed: int) -> int:
    """Give every drafter weight a visible random value, so every path carries signal.

    A fresh drafter (N(0, 0.02) linears, unit norms) passes perturbations through at 1e-5 scale, too close
    to rounding to call. Tensors equal to the target's (embeddings, lm_head, final norm) are left alone.
    """
    g = torch.Generator().manual_seed(seed)
    shared = (target.embed_weight, target.lm_head_weight, target.norm_weight)
    changed = 0
    with torch.no_grad():
        for param in subject.parameters().values():
            if not param.is_floating_point() or any(_same(param, t) for t in shared):
                continue
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=g))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=g) / math.sqrt(fan_in))
            changed += 1
    return changed


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().float(), b.float())


# --- which target layers the drafter reads -------------------------------------------------------------------


def probe_layers_read(lab: Lab) -> list[Verdict]:
    n_layers = lab.target.num_layers
    changes = {i: influence(lab.baseline, lab.logits(perturb_layer(lab.batch, i, seed=100 + i))) for i in range(n_layers + 1)}
    common = dict(
        experiment="layers-read",
        perturbed=f"hidden_states[i] of the target, one layer at a time, i = 0..{n_layers} (noise of scale 3)",
        measurement="relative change of the drafter's logits per perturbed layer: "
        + ", ".join(f"{i}: {c:.2g}" for i, c in changes.items()),
        threshold=f"read: change >= {EFFECT:g}; not read: <= {NO_EFFECT:g}",
        measured={str(i): c for i, c in changes.items()},
    )
    ambiguous = [i for i, c in changes.items() if seen(c) is None]
    read = sorted(i for i, c in changes.items() if seen(c))
    declared = [int(i) for i in lab.info.get("layer_ids") or []]
    convention = lab.info.get("layer_id_convention", "zlab")
    verdicts: list[Verdict] = []
    fc = Verdict(
        invariant="dflash.fc_input_layers",
        hypothesis=f"fc reads all {len(declared)} selected target layers",
        status="unknown",
        expected=f"{len(declared)} of {len(declared)} selected layers read",
        **common,
    )
    if ambiguous:
        fc.reason = f"layers {ambiguous} changed the logits by an amount between the thresholds"
    elif not declared:
        fc.reason = "the subject did not say which layers it selects"
    elif not read:
        fc.reason = "no target layer changes the drafter's output: the context does not reach it at all"
    else:
        fc.status = "match" if len(read) == len(declared) else "mismatch"
        fc.observed = f"{len(read)} of {len(declared)} selected layers read (hidden_states {read})"
        if fc.status == "mismatch":
            fc.fix = "Concatenate every selected layer into fc: Linear(k*H, H) over all k target_layer_ids."
    verdicts.append(fc)

    ids = Verdict(
        invariant="dflash.target_layer_ids",
        hypothesis="the layers read are the selected ids in the z-lab convention (id i = hidden_states[i+1]), "
        "and the ids follow round(1 + i*(L-4)/(k-1))",
        status="unknown",
        **common,
    )
    if convention == "external":
        ids.status = "not_applicable"
        ids.reason = "the subject receives features selected outside its code; the selection is not its to probe"
    elif ambiguous or not read or not declared:
        ids.reason = fc.reason or "nothing read"
    else:
        offset = 1 if convention == "zlab" else 0
        read_ids = [i - offset for i in read]
        rule = reference_layer_ids(n_layers, len(declared))
        ids.expected = f"ids {rule} (hidden_states {[i + 1 for i in rule]}) for an L={n_layers} target"
        ids.observed = f"reads hidden_states {read} = ids {read_ids} ({convention} convention); declared {declared}"
        if not set(read_ids) <= set(declared):
            ids.status = "mismatch"
            shifted = [i for i in read if i not in {d + offset for d in declared}]
            if set(read) <= {d + offset - 1 for d in declared} or set(read) <= {d + offset + 1 for d in declared}:
                ids.observed += f": off by one (hidden_states {shifted} are not the declared layers)"
            ids.fix = "Read hidden_states[id + 1] for z-lab layer id `id` (hidden_states[0] is the embeddings)."
        elif convention == "zlab" and declared != rule:
            ids.status = "mismatch"
            ids.fix = "Select round(1 + i*(L-4)/(k-1)) for i < k."
        elif convention == "vllm" and [d - 1 for d in declared] != rule:
            ids.status = "mismatch"
            ids.fix = "Select round(1 + i*(L-4)/(k-1)) + 1 in vLLM's convention."
        else:
            ids.status = "match"
    verdicts.append(ids)
    return verdicts


def reference_layer_ids(num_layers: int, k: int) -> list[int]:
    """z-lab's rule (DFLASH.md `dflash.target_layer_ids`): k layers evenly from 1 to L-3; one layer: [L//2]."""
    if k == 1:
        return [num_layers // 2]
    return [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]


# --- what a block attends to ----------------------------------------------------------------------------------


def probe_attention(lab: Lab) -> list[Verdict]:
    layout, b = lab.layout, lab.block_size
    a0, a1, a2 = layout.anchors
    base = lab.baseline

    def block_change(batch: ProbeBatch | None, block: int, hooks: ProbeHooks | None = None) -> float:
        return influence(base[block], lab.logits(batch, hooks)[block])

    def alone_change(block: int, positions: list[int], seed: int) -> float:
        """Change of a block run on its own when every layer's hidden state at `positions` is perturbed."""
        alone = lab.only_anchor(block)
        return influence(lab.logits(alone)[0], lab.logits(perturb_positions(alone, positions, seed))[0])

    # Context at the anchor itself, with context just before it as the control.
    at_anchor = alone_change(0, [a0], seed=201)
    before_anchor = alone_change(0, [a0 - 1], seed=202)
    anchor = Verdict(
        invariant="dflash.context_excludes_anchor",
        experiment="anchor-context",
        hypothesis=f"the block anchored at p={a0} sees context strictly before p, not position p itself",
        perturbed=f"every target layer's hidden state at position p={a0} only, the block run alone "
        f"(control: position {a0 - 1})",
        measurement=f"change of that block's logits: {at_anchor:.2g} (control {before_anchor:.2g})",
        threshold=f"not seen <= {NO_EFFECT:g}; seen >= {EFFECT:g}",
        measured={"anchor": at_anchor, "control": before_anchor},
        expected="context position p not seen (kv < anchor)",
        status="unknown",
    )
    if seen(before_anchor) is not True:
        anchor.reason = "the control (context just before the anchor) did not change the block: context is not seen at all"
    elif seen(at_anchor) is None:
        anchor.reason = "the change is between the thresholds"
    elif seen(at_anchor):
        anchor.status, anchor.observed = "mismatch", f"the block sees its anchor's own context position (change {at_anchor:.2g})"
        anchor.fix = "Mask context keys at or after the anchor: kv_pos < anchor, not <=."
    else:
        anchor.status, anchor.observed = "match", "context at the anchor position is not seen; context before it is"
    verdicts = [anchor]

    # Blocks isolated: other blocks' tokens, context after the anchor, and another document's context.
    other_block = lab.bump_block_tokens(list(range(b)), seed=203)  # every token of block 0
    own = block_change(None, 0, other_block)
    leak_tokens = max(block_change(None, 1, other_block), block_change(None, 2, other_block))
    later = list(range(a0 + 1, a1 + b))
    leak_future = alone_change(0, later, seed=204)
    doc1_control = alone_change(2, [a2 - 1], seed=206)
    packed = layout.documents == 2
    leak_doc = alone_change(2, list(range(0, layout.doc0_end)), seed=205) if packed else 0.0
    isolated = Verdict(
        invariant="dflash.blocks_isolated",
        experiment="block-isolation",
        hypothesis="a block sees neither another block's tokens, nor context after its anchor, nor another document",
        perturbed=f"(1) the input embeddings of block 0's tokens; (2) context positions {later[0]}..{later[-1]} "
        f"after block 0's anchor {a0}, block 0 run alone; (3) all of document 0, seen from block 2 (in "
        "document 1) run alone",
        measurement=f"(1) change of blocks 1-2: {leak_tokens:.2g} (block 0 itself: {own:.2g}); "
        f"(2) change of block 0: {leak_future:.2g}; "
        + (f"(3) change of block 2: {leak_doc:.2g}" if packed else "(3) not run: the subject never packs documents")
        + f" (control, block 2's own context: {doc1_control:.2g})",
        threshold=f"isolated: every leak <= {NO_EFFECT:g}; the controls >= {EFFECT:g}",
        measured={"other_block_tokens": leak_tokens, "own_block": own, "later_context": leak_future,
                  "other_document": leak_doc, "own_document_control": doc1_control},
        expected="no leak",
        status="unknown",
    )
    leaks = {"another block's tokens": leak_tokens, "context after its anchor": leak_future}
    if packed:
        leaks["another document's context"] = leak_doc
    if seen(own) is not True or seen(doc1_control) is not True:
        isolated.reason = "a control did not change: the block does not see its own tokens or its own context"
    elif any(seen(v) is None for v in leaks.values()):
        isolated.reason = "a leak measurement is between the thresholds"
    elif any(seen(v) for v in leaks.values()):
        isolated.status = "mismatch"
        isolated.observed = "blocks see " + ", ".join(k for k, v in leaks.items() if seen(v))
        isolated.fix = "A block's queries may see its own block's tokens and same-document context before its anchor only."
    else:
        isolated.status, isolated.observed = "match", "no leak from other blocks, later context or other documents"
    verdicts.append(isolated)

    # Bidirectional within the block: a late slot reaches an early one and the other way round.
    first, last = (1, b - 1) if b >= 3 else (0, b - 1)
    late_to_early = influence(base[0, first], lab.logits(None, lab.bump_block_tokens([last], seed=207))[0, first])
    early_to_late = influence(base[0, last], lab.logits(None, lab.bump_block_tokens([first], seed=208))[0, last])
    bidi = Verdict(
        invariant="dflash.block_bidirectional",
        experiment="within-block",
        hypothesis="slots of a block see each other in both directions",
        perturbed=f"the input embedding of slot {last} (then of slot {first}) of block 0",
        measurement=f"change of slot {first}'s logits: {late_to_early:.2g}; of slot {last}'s: {early_to_late:.2g}",
        threshold=f"seen >= {EFFECT:g}; not seen <= {NO_EFFECT:g}",
        measured={"later_to_earlier": late_to_early, "earlier_to_later": early_to_late},
        expected="both directions seen",
        status="unknown",
    )
    if b < 2:
        bidi.status, bidi.reason = "not_applicable", "a block of one token has no other slot"
    elif seen(late_to_early) is None or seen(early_to_late) is None:
        bidi.reason = "a change is between the thresholds"
    elif seen(late_to_early) and seen(early_to_late):
        bidi.status, bidi.observed = "match", "slots see each other both ways"
    else:
        bidi.status = "mismatch"
        bidi.observed = ("causal within the block (earlier slots do not see later ones)" if seen(early_to_late)
                         else "slots do not see each other")
        bidi.fix = "Let every slot attend to every slot of its own block (non-causal within the block)."
    verdicts.append(bidi)
    return verdicts


# --- context reaches every layer ------------------------------------------------------------------------------


def probe_kv_injection(lab: Lab) -> list[Verdict]:
    verdict = Verdict(
        invariant="dflash.kv_injection",
        experiment="context-per-layer",
        hypothesis="every drafter layer takes the context directly (its own K/V projection of it)",
        perturbed="every target hidden state at every position, while each layer's block-token input is held "
        "at its unperturbed value",
        measurement="",
        threshold=f"reached: change of the layer's output >= {EFFECT:g}; not reached: <= {NO_EFFECT:g}",
        expected="every layer",
        status="unknown",
    )
    layers = list(lab.subject.draft_layers() or [])
    if not layers:
        verdict.reason = "the subject exposes no draft layers"
        return [verdict]
    inputs: dict[int, Tensor] = {}
    outputs: dict[int, Tensor] = {}
    freeze = {"on": False}

    def pre_hook(index: int):
        def hook(module, args, kwargs):
            if freeze["on"]:
                held = inputs[index]
                if args and isinstance(args[0], Tensor):
                    return (held, *args[1:]), kwargs
                if isinstance(kwargs.get("hidden_states"), Tensor):
                    return args, {**kwargs, "hidden_states": held}
                raise RuntimeError(f"layer {index} takes no hidden_states to hold")
            if args and isinstance(args[0], Tensor):
                inputs[index] = args[0].detach().clone()
            elif isinstance(kwargs.get("hidden_states"), Tensor):
                inputs[index] = kwargs["hidden_states"].detach().clone()
            return None

        return hook

    def post_hook(index: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            outputs[index] = out.detach().float().clone()

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook(i)))
    try:
        lab.logits()
        before = dict(outputs)
        if len(inputs) != len(layers):
            verdict.reason = f"only {len(inputs)} of {len(layers)} layers ran with a block-token input"
            return [verdict]
        freeze["on"] = True
        all_positions = list(range(lab.layout.seq_len))
        lab.logits(perturb_positions(lab.batch, all_positions, seed=301))
    finally:
        for handle in handles:
            handle.remove()
    changes = [influence(before[i], outputs[i]) for i in range(len(layers))]
    verdict.measured = changes
    verdict.measurement = "change of each layer's output: " + ", ".join(f"{i}: {c:.2g}" for i, c in enumerate(changes))
    if any(seen(c) is None for c in changes):
        verdict.reason = "a layer's change is between the thresholds"
    elif all(seen(c) for c in changes):
        verdict.status, verdict.observed = "match", f"all {len(layers)} layers take the context directly"
    else:
        missing = [i for i, c in enumerate(changes) if not seen(c)]
        verdict.status = "mismatch"
        verdict.observed = f"context does not reach layers {missing} of {len(layers)} directly"
        verdict.fix = "Project the fused context with every layer's own k_proj/v_proj and prepend it to that layer's K/V."
    return [verdict]


# --- block position ids ---------------------------------------------------------------------------------------


def probe_positions(lab: Lab) -> list[Verdict]:
    layout, b = lab.layout, lab.block_size
    expected_block = torch.cat([lab.batch.position_ids[0, a] + torch.arange(b) for a in layout.anchors])
    verdict = Verdict(
        invariant="dflash.block_position_ids",
        experiment="rotary-positions",
        hypothesis="block token j of the block anchored at p sits at position_ids[p] + j; context keeps its own",
        perturbed="nothing: the rotary embedding's position ids are recorded",
        measurement="",
        threshold="exact equality",
        expected=f"block positions {expected_block.tolist()}",
        status="unknown",
    )
    rotary = lab.subject.rotary()
    if rotary is None:
        verdict.reason = "the subject exposes no rotary embedding module"
        return [verdict]
    seen_ids: list[Tensor] = []

    def hook(module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(ids, Tensor):
            seen_ids.append(ids.detach().clone())

    handle = rotary.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        lab.logits()
    finally:
        handle.remove()
    if not seen_ids:
        verdict.reason = "the rotary module was not called with position ids"
        return [verdict]
    row = seen_ids[0].reshape(-1, seen_ids[0].shape[-1])[0]
    q = layout.num_anchors * b
    if row.numel() < q:
        verdict.reason = f"the rotary module saw {row.numel()} positions, fewer than the {q} block tokens"
        return [verdict]
    observed = row[-q:]
    offset = observed - expected_block
    verdict.measured = {"block_positions": observed.tolist()}
    verdict.measurement = f"position ids of the block tokens: {observed.tolist()}"
    context = row[:-q]
    # The context's own positions are judged only where the rotary call lays them out before the block's.
    context_laid_out = context.numel() == layout.seq_len
    context_ok = context_laid_out and torch.equal(context, lab.batch.position_ids[0])
    if context_laid_out and not context_ok:
        verdict.status = "mismatch"
        verdict.observed = f"context positions {context.tolist()} are not the target's {lab.batch.position_ids[0].tolist()}"
        verdict.fix = "Keep the context at the target's own position ids (per document in packed rows)."
    elif torch.equal(observed, expected_block):
        verdict.status = "match"
        verdict.observed = "anchor + j" + ("; context keeps its positions" if context_ok else "")
    else:
        verdict.status = "mismatch"
        shift = offset.unique()
        verdict.observed = (f"anchor + j {int(shift[0]):+d}" if shift.numel() == 1
                            else f"block positions {observed.tolist()}")
        verdict.fix = "Give block token j the position of its anchor plus j."
    return [verdict]


# --- what the loss trains each slot toward ---------------------------------------------------------------------


def _gradient_at(lab: Lab, logits: Tensor) -> Tensor | None:
    """d loss / d draft logits when the drafter's logits are replaced by `logits` [A, B, V]."""
    holder: dict[str, Tensor] = {}

    def hook(x: Tensor) -> Tensor:
        if "z" not in holder:
            holder["z"] = logits.to(x.dtype).reshape(x.shape).detach().requires_grad_(True)
        return holder["z"]

    loss = lab.subject.loss(lab.batch, ProbeHooks(draft_logits=hook))
    if "z" not in holder or not loss.requires_grad:
        return None
    (grad,) = torch.autograd.grad(loss, holder["z"], allow_unused=True)
    if grad is None:
        return None
    a, b = lab.layout.num_anchors, lab.block_size
    return grad.detach().double().reshape(-1, a, b, grad.shape[-1])[0]  # [A, B, V]


def _candidates(lab: Lab) -> dict[str, Tensor]:
    """Teachers a loss could use, as logits over the row [S, V]: final, each intermediate layer, data tokens."""
    batch, target = lab.batch, lab.target
    found = {"final": batch.logits[0].double()}
    for i in range(1, target.num_layers):
        normed = rms_norm(batch.hidden_states[i][0], target.norm_weight, target.rms_norm_eps)
        found[f"layer:{i}"] = (normed @ target.lm_head_weight.T).double()
    data = torch.full((lab.layout.seq_len, target.vocab_size), -30.0, dtype=torch.float64)
    data[torch.arange(lab.layout.seq_len), batch.input_ids[0]] = 30.0
    found["data"] = data
    return found


def _describe_source(name: str) -> str:
    if name == "final":
        return "the target's final logits lm_head(norm(h_L))"
    if name == "data":
        return "the data tokens"
    layer = int(name.split(":")[1])
    return f"lm_head(norm(hidden_states[{layer}])), the output of layer {layer - 1}"


def probe_loss(lab: Lab) -> list[Verdict]:
    layout, b = lab.layout, lab.block_size
    v = lab.target.vocab_size
    a = layout.num_anchors
    ids = ("dflash.target_logits_source", "dflash.target_shift", "dflash.loss_kind",
           "dflash.anchor_slot_untrained", "dflash.loss_decay_gamma")
    common = dict(
        experiment="loss-gradient",
        perturbed="the drafter's logits, replaced by zeros (uniform draft); then by confident logits on half the slots",
        threshold=f"a teacher explains the slot targets when >= {AGREEMENT:.0%} of trained slots agree; one-hot at "
        f">= {ONE_HOT} mass; soft when total variation < {SOFT_TV}",
    )
    zero = torch.zeros(a, b, v, dtype=torch.float64)
    grad = _gradient_at(lab, zero)
    if grad is None or grad.abs().max().item() == 0.0:
        reason = "the loss does not depend on the drafter's logits (no gradient reached them)"
        return [Verdict(invariant=i, status="unknown", hypothesis="", measurement="", reason=reason, **common) for i in ids]

    # With a uniform draft p = 1/V, CE and KL both give grad = w * (p - q): q is the target, w the slot weight.
    p = 1.0 / v
    w_hat = grad.max(dim=-1).values * v  # exact for one-hot q, within V*min(q) for soft q
    trained = w_hat > 1e-9 * w_hat.max()
    q_hat = torch.where(trained[..., None], p - grad / w_hat.clamp_min(1e-30)[..., None], torch.zeros_like(grad))
    q_hat = q_hat.clamp_min(0)
    q_hat = q_hat / q_hat.sum(-1, keepdim=True).clamp_min(1e-30)

    candidates = _candidates(lab)
    anchors = torch.tensor(layout.anchors)
    slots = torch.arange(b)
    scores: dict[tuple[str, int], float] = {}
    for name, cand in candidates.items():
        for offset in (-2, -1, 0, 1):
            pos = anchors[:, None] + slots[None, :] + offset  # [A, B]
            ok = trained & (pos >= 0) & (pos < layout.seq_len)
            if ok.sum() == 0:
                continue
            cand_argmax = cand.argmax(-1)[pos.clamp(0, layout.seq_len - 1)]  # [A, B]
            agree = (cand_argmax == q_hat.argmax(-1)) & ok
            scores[(name, offset)] = agree.sum().item() / trained.sum().item()
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0][0] != "final", kv[0][1] != -1))
    (best_name, best_offset), best = ranked[0]
    runner_up = next((s for key, s in ranked[1:] if key[0] != best_name or key[1] != best_offset), 0.0)
    pos = (anchors[:, None] + slots[None, :] + best_offset).clamp(0, layout.seq_len - 1)
    teacher_logits = candidates[best_name][pos]  # [A, B, V]
    one_hot = bool((q_hat.max(-1).values[trained] >= ONE_HOT).all())
    soft_tv = 0.5 * (q_hat - torch.softmax(teacher_logits, -1)).abs().sum(-1)[trained].mean().item()
    kind = "ce" if one_hot else ("kl" if soft_tv < SOFT_TV else None)
    measurement = (f"best teacher: {_describe_source(best_name)} at p+j{best_offset:+d} explains {best:.0%} of trained "
                   f"slots (next best {runner_up:.0%}); recovered targets "
                   + ("one-hot" if one_hot else f"soft (total variation to its softmax {soft_tv:.3f})"))
    measured = {"best": [best_name, best_offset, best], "runner_up": runner_up, "one_hot": one_hot, "soft_tv": soft_tv}
    verdicts: list[Verdict] = []
    decided = best >= AGREEMENT and runner_up < 0.5

    source = Verdict(invariant=ids[0], status="unknown", hypothesis="each slot is trained toward the target's final "
                     "logits", measurement=measurement, measured=measured, expected=_describe_source("final"), **common)
    shift = Verdict(invariant=ids[1], status="unknown", hypothesis="slot j of the block at p is trained toward the "
                    "target's prediction at p+j-1", measurement=measurement, measured=measured,
                    expected="p+j-1", **common)
    if not decided:
        reason = (f"no teacher explains the recovered targets (best {_describe_source(best_name)} at "
                  f"p+j{best_offset:+d}: {best:.0%}, next {runner_up:.0%})")
        source.reason = shift.reason = reason
    elif best_name == "data":
        source.reason = ("the loss trains toward the data tokens: that is the target's output only if the data "
                         "was regenerated by the target")
        shift.status = "match" if best_offset == 0 else "mismatch"
        shift.observed = f"slot j learns the data token at p+j{best_offset:+d}"
    else:
        source.status = "match" if best_name == "final" else "mismatch"
        source.observed = _describe_source(best_name)
        if source.status == "mismatch":
            source.fix = "Take the teacher logits from the target's real output: lm_head(final_norm(h_L))."
        shift.status = "match" if best_offset == -1 else "mismatch"
        shift.observed = f"slot j learns the target's prediction at p+j{best_offset:+d}"
        if best_offset == 0:
            shift.observed += " (no shift: it learns the token after its own)"
        if shift.status == "mismatch":
            shift.fix = "Gather the teacher logits at p+j-1 for slot j (roll the target logits by one)."
    verdicts += [source, shift]

    kind_verdict = Verdict(invariant=ids[2], status="unknown", hypothesis="the loss pulls each slot toward the "
                           "target's distribution (one-hot argmax for CE, softmax for KL)", measurement=measurement,
                           measured=measured, expected=" or ".join(lab.expectations.loss_kinds), **common)
    if kind is None:
        kind_verdict.reason = ("the recovered targets are neither one-hot nor the teacher's softmax "
                               f"(total variation {soft_tv:.3f})")
    elif not decided:
        kind_verdict.reason = source.reason
    else:
        kind_verdict.observed = ("ce (one-hot to the teacher's argmax)" if kind == "ce"
                                 else "kl (the teacher's soft distribution)")
        kind_verdict.status = "match" if kind in lab.expectations.loss_kinds else "mismatch"
    verdicts.append(kind_verdict)

    # Slot weights, refined against the identified teacher where there is one: grad = w * (p - q).
    if decided and kind is not None:
        q = (torch.nn.functional.one_hot(teacher_logits.argmax(-1), v).double() if kind == "ce"
             else torch.softmax(teacher_logits, -1))
    else:
        q = q_hat
    weights = _weights(grad, torch.full_like(grad, p), q)
    weights = torch.where(trained, weights, torch.zeros_like(weights))
    mean_w = weights.mean(0)  # [B] over anchors (all valid, all labels supervised)
    slot0 = Verdict(invariant=ids[3], status="unknown", hypothesis="slot 0 (the anchor) gets loss weight 0",
                    measurement="slot weights (relative to slot 1): "
                    + ", ".join(f"{k}: {x:.4g}" for k, x in enumerate((mean_w / mean_w[1].clamp_min(1e-30)).tolist()))
                    if b > 1 else "", measured={"weights": mean_w.tolist()}, expected="slot 0 weight 0", **common)
    if b < 2 or mean_w[1] <= 0:
        slot0.reason = "slot 1 gets no weight: the slot weights cannot be read"
    elif weights[:, 0].abs().max().item() == 0.0:
        slot0.status, slot0.observed = "match", "slot 0 gets no gradient"
    else:
        slot0.status = "mismatch"
        slot0.observed = f"slot 0 weighs {mean_w[0].item() / mean_w[1].item():.3g} x slot 1"
        slot0.fix = "Give slot 0 (the anchor, an input) weight 0 in the loss."
    verdicts.append(slot0)
    verdicts.append(_gamma_verdict(lab, grad, weights, q, trained, kind, common))
    return verdicts


def _weights(grad: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """Least-squares w per slot in grad = w * (p - q)."""
    direction = p - q
    return (grad * direction).sum(-1) / (direction * direction).sum(-1).clamp_min(1e-30)


def _gamma_verdict(lab: Lab, grad: Tensor, weights: Tensor, q: Tensor, trained: Tensor, kind: str | None,
                   common: dict[str, Any]) -> Verdict:
    b, v = lab.block_size, lab.target.vocab_size
    expect = lab.expectations
    accepted = {expect.gamma} if expect.gamma is not None else set()
    if b in expect.gamma_by_block_size:
        accepted.add(expect.gamma_by_block_size[b])
    verdict = Verdict(invariant="dflash.loss_decay_gamma", status="unknown",
                      hypothesis="slot k >= 1 weighs exp(-(k-1)/gamma), independent of the drafter's confidence",
                      measurement="", expected=f"gamma {' or '.join(f'{g:g}' for g in sorted(accepted))} at B={b}",
                      **common)
    if b < 3:
        verdict.reason = "fewer than two trained slots per block: no decay to fit"
        return verdict
    mean_w = weights.mean(0)
    if mean_w[1] <= 0:
        verdict.reason = "slot 1 gets no weight"
        return verdict
    ratios = (mean_w[1:] / mean_w[1]).tolist()  # r_k for k = 1..B-1

    # The same slots at a second confidence level: a fixed decay gives the same ratios, D-PACE does not.
    confident = torch.zeros_like(grad)
    target_ids = q.argmax(-1)  # [A, B]
    for j in range(0, b, 2):
        confident[:, j].scatter_(-1, target_ids[:, j : j + 1], 3.0)
    grad2 = _gradient_at(lab, confident)
    p2 = torch.softmax(confident, -1)
    weights2 = torch.where(trained, _weights(grad2, p2, q), torch.zeros_like(weights)) if grad2 is not None else None
    ratios2 = (weights2[:, 1:] / weights2[:, 1:2].clamp_min(1e-30)) if weights2 is not None else None
    ratios1 = weights[:, 1:] / weights[:, 1:2].clamp_min(1e-30)
    drift = (ratios2 - ratios1).abs().max().item() if ratios2 is not None else 0.0
    verdict.measured = {"ratios": ratios, "confidence_drift": drift}
    verdict.measurement = (f"slot weights w_k/w_1, k = 1..{b - 1}: " + ", ".join(f"{r:.4g}" for r in ratios)
                           + f"; change with the drafter's confidence: {drift:.2g}")
    if drift > DATA_DEPENDENT:
        alpha, error = _fit_dpace(lab, [(torch.full_like(grad, 1.0 / v), weights), (p2, weights2)], q, trained)
        if error < 0.01:
            verdict.status = "match"
            verdict.observed = (f"D-PACE weighting (alpha {alpha:.2f}): data-dependent, so gamma does not apply; "
                                "it is speculators' DFlash training default")
        else:
            verdict.reason = (f"data-dependent slot weights (they change by {drift:.2g} with the drafter's confidence) "
                              "that are not D-PACE: a gamma does not describe them")
        return verdict
    k = torch.arange(1, b, dtype=torch.float64) - 1  # k - 1
    logs = torch.log(torch.tensor(ratios, dtype=torch.float64).clamp_min(1e-300))
    if logs.abs().max().item() < 1e-6:
        gamma = math.inf
        verdict.observed = "no decay: every slot k >= 1 weighs the same (gamma = infinity)"
    else:
        gamma = -(k * k).sum().item() / (k * logs).sum().item()
        residual = (logs + k / gamma).abs().max().item()
        if gamma <= 0 or residual > EXP_FIT:
            verdict.reason = f"the slot weights are not exp(-(k-1)/gamma) (residual {residual:.3g} of log-weights)"
            return verdict
        verdict.observed = f"gamma {gamma:.4g} (weights exp(-(k-1)/{gamma:.4g}))"
    verdict.measured["gamma"] = gamma if math.isfinite(gamma) else "inf"
    if not accepted:
        verdict.reason = "no expected gamma to compare with"
    elif any(math.isfinite(gamma) and abs(gamma - g) <= GAMMA_RTOL * g for g in accepted):
        verdict.status = "match"
    else:
        verdict.status = "mismatch"
        verdict.fix = f"Weigh slot k >= 1 by exp(-(k-1)/{min(accepted):g})."
    return verdict


def _fit_dpace(lab: Lab, runs: list[tuple[Tensor, Tensor | None]], q: Tensor, trained: Tensor) -> tuple[float, float]:
    """Best alpha of speculators' D-PACE weights for the measured weights at each draft; (alpha, max rel error)."""
    best = (math.nan, math.inf)
    mask = trained.double()
    for step in range(1, 101):
        alpha = step / 100
        error = 0.0
        for p, measured in runs:
            if measured is None:
                return best
            confidence = (p * q).sum(-1)  # exp(-CE) of a one-hot target is p(target)
            smooth = torch.where(mask > 0, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
            prefix = torch.cumprod(smooth, -1)
            weight = torch.flip(torch.cumsum(torch.flip(prefix * mask, [-1]), -1), [-1]) * mask
            model = weight[:, 1:] / weight[:, 1:2].clamp_min(1e-30)
            seen_ = measured[:, 1:] / measured[:, 1:2].clamp_min(1e-30)
            error = max(error, ((model - seen_).abs() / model.clamp_min(1e-30)).max().item())
        if error < best[1]:
            best = (alpha, error)
    return best


# --- what one optimizer step changes ---------------------------------------------------------------------------


def probe_frozen(lab: Lab) -> list[Verdict]:
    target = lab.target
    verdict = Verdict(
        invariant="dflash.frozen_embed_head",
        experiment="optimizer-step",
        hypothesis="one optimizer step leaves the embeddings and lm_head (the target's) unchanged",
        perturbed="nothing: one training step with the implementation's own optimizer",
        measurement="",
        threshold="any changed element counts",
        expected="embeddings and lm_head unchanged",
        status="unknown",
    )
    params = lab.subject.parameters()
    roles = {name: role for name, param in params.items()
             for role, ref in (("embeddings", target.embed_weight), ("lm_head", target.lm_head_weight))
             if _same(param, ref)}
    before = {name: param.detach().clone() for name, param in params.items()}
    shared_before = (target.embed_weight.clone(), target.lm_head_weight.clone())
    lab.subject.train_step(lab.batch)
    changed = [name for name, param in params.items() if not torch.equal(before[name], param.detach())]
    shared_changed = [role for role, old, new in (("embeddings", shared_before[0], target.embed_weight),
                                                  ("lm_head", shared_before[1], target.lm_head_weight))
                      if not torch.equal(old, new)]
    moved = sorted({roles[n] for n in changed if n in roles} | set(shared_changed))
    verdict.measured = {"changed": changed, "roles": roles}
    verdict.measurement = (f"{len(changed)} of {len(params)} parameter tensors changed; the target's embeddings / "
                           f"lm_head found as {sorted(roles) or 'no parameter (used directly)'}")
    if moved:
        verdict.status = "mismatch"
        names = [n for n in changed if n in roles]
        verdict.observed = f"{' and '.join(moved)} trained ({', '.join(names) or 'the target tensors themselves'} changed)"
        verdict.fix = "Freeze the embeddings and lm_head (requires_grad False, and keep them out of the optimizer)."
    elif not [n for n in changed if n not in roles]:
        verdict.reason = "the optimizer step changed no parameter at all"
    else:
        verdict.status = "match"
        verdict.observed = "embeddings and lm_head unchanged; the drafter's weights changed"
    return [verdict]


EXPERIMENTS: dict[str, Callable[[Lab], list[Verdict]]] = {
    "layers-read": probe_layers_read,
    "attention": probe_attention,
    "context-per-layer": probe_kv_injection,
    "rotary-positions": probe_positions,
    "loss-gradient": probe_loss,
    "optimizer-step": probe_frozen,  # last: it changes the weights
}

