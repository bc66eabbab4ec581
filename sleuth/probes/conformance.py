"""`sleuth probe check`: does a probe entry keep the protocol? One finding per method (the probe child's side).

The experiments trust the subject to wire the probe's inputs into its real code. These checks test that
wiring with inputs whose effect is certain, so a broken adapter is named before it makes a verdict wrong:

    describe      a dict with block_size and num_target_layers (positive ints) and a known layer convention
    build         builds without error
    parameters    name -> tensor; the target's embeddings / lm_head are found among them or used directly
    draft_logits  [N, A, B, V]; the same twice; the block_embeddings hook's result is used (noise it adds changes
                  the logits); the draft_logits hook's result is what is returned; anchors are honoured (moving
                  one anchor changes that block's logits, and only its own)
    loss          a scalar with a graph; the draft_logits hook's result is what the loss is computed from (the
                  gradient reaches it); an anchor marked invalid in anchor_valid does not enter the loss
    train_step    changes some parameter, and not the target's embeddings or lm_head
    draft_layers  modules, each run by draft_logits with the block's hidden states
    rotary        a module run by draft_logits with position ids covering the block tokens

A method the entry does not provide is reported as such (the probes that need it will be unknown).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sleuth.probes.protocol import PROTOCOL_METHODS, NotProvided, PartialSubject, ProbeHooks, check_description
from sleuth.probes.target import make_batch, make_layout, make_target

OK = "ok"


def check_subject(subject: Any, seed: int = 0) -> dict[str, str]:
    """method -> "ok", "not provided: ...", or what is wrong (one line)."""
    partial = PartialSubject(subject)
    results: dict[str, str] = {m: "" for m in PROTOCOL_METHODS}
    for method in partial.missing():
        results[method] = NotProvided(method).reason.replace("not provided by the entry: ", "not provided: ")

    def run(method: str, check: Any) -> Any:
        if results[method]:
            return None
        try:
            found = check()
        except NotProvided as exc:
            results[method] = f"not provided: {exc.reason.split(': ', 1)[1]}"
            return None
        except Exception as exc:
            results[method] = f"raises {_one_line(exc)}"
            return None
        if isinstance(found, str):
            results[method] = found
            return None
        results[method] = results[method] or OK
        return found

    info = run("describe", lambda: _describe(partial))
    if info is None:
        return {m: r or "not checked: describe() must work first" for m, r in results.items()}
    target = make_target(int(info["num_target_layers"]), seed)
    # the experiments' own layout (packed rows, several blocks, a padded anchor slot), so what passes here is
    # what the probes will call
    layout = make_layout(int(info["block_size"]), packed=info.get("documents_per_row") != 1,
                         rows=min(int(info.get("max_rows") or 2), 2))
    batch = make_batch(target, layout, seed + 1)
    torch.manual_seed(seed)
    if run("build", lambda: partial.build(target)) is None and results["build"] != OK:
        return {m: r or "not checked: build() must work first" for m, r in results.items()}
    params = run("parameters", lambda: _parameters(partial, target))
    draft_ok = run("draft_logits", lambda: _draft_logits(partial, info, batch))
    results["embeddings/lm_head"] = ""
    run("embeddings/lm_head", lambda: _shared(partial, target, batch, params or {}) if draft_ok is not None else
        "not checked: draft_logits() must work first")
    run("draft_layers", lambda: _draft_layers(partial, batch) if draft_ok is not None else
        "not checked: draft_logits() must work first")
    run("rotary", lambda: _rotary(partial, info, batch) if draft_ok is not None else
        "not checked: draft_logits() must work first")
    run("loss", lambda: _loss(partial, info, batch))
    run("train_step", lambda: _train_step(partial, target, batch, params))
    return results


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _describe(subject: PartialSubject) -> dict[str, Any] | str:
    try:
        return check_description(subject.describe())
    except ValueError as exc:
        return str(exc)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().float(), b.float())


def _parameters(subject: PartialSubject, target: Any) -> dict[str, Tensor] | str:
    params = subject.parameters()
    if not isinstance(params, dict) or not params:
        return "must return a non-empty dict name -> tensor"
    wrong = [n for n, p in params.items() if not isinstance(p, Tensor)]
    if wrong:
        return f"{', '.join(wrong[:3])} {'is' if len(wrong) == 1 else 'are'} not tensors"
    return params


def _hooks(embeddings: Any = None, logits: Any = None) -> ProbeHooks:
    hooks = ProbeHooks()
    if embeddings is not None:
        hooks.block_embeddings = embeddings
    if logits is not None:
        hooks.draft_logits = logits
    return hooks


def _draft_logits(subject: PartialSubject, info: dict[str, Any], batch: Any) -> Tensor | str:
    n, a = batch.anchors.shape
    b = int(info["block_size"])
    with torch.no_grad():
        first = subject.draft_logits(batch, ProbeHooks())
        if not isinstance(first, Tensor):
            return f"returns {type(first).__name__}, not a tensor"
        if first.numel() % (n * a * b) or first.reshape(n, a, b, -1).shape[-1] < 2:
            return f"returns shape {tuple(first.shape)}, not [N, A, B, V] = [{n}, {a}, {b}, V]"
        if not torch.equal(first, subject.draft_logits(batch, ProbeHooks())):
            return "is not deterministic (two identical calls differ: dropout left on?)"
        base = first.reshape(n, a, b, -1)
        seen: dict[str, Any] = {}

        def noisy(x: Tensor) -> Tensor:
            seen["shape"] = tuple(x.shape)
            g = torch.Generator().manual_seed(5)
            return x + 3.0 * torch.randn(x.shape, generator=g).to(x.dtype)

        bumped = subject.draft_logits(batch, _hooks(embeddings=noisy)).reshape(n, a, b, -1)
        if "shape" not in seen:
            return "never calls hooks.block_embeddings on the block tokens' embeddings"
        if seen["shape"][-2] != a * b:
            return f"calls hooks.block_embeddings with shape {seen['shape']}, not [..., A*B, H] (A*B = {a * b})"
        if torch.equal(bumped, base):
            return "calls hooks.block_embeddings but does not use its result (noise it adds leaves the logits unchanged)"
        marker: dict[str, Tensor] = {}

        def replace(x: Tensor) -> Tensor:
            marker["out"] = torch.full_like(x, 0.25)
            return marker["out"]

        replaced = subject.draft_logits(batch, _hooks(logits=replace))
        if "out" not in marker:
            return "never calls hooks.draft_logits on the drafter's logits"
        if not torch.equal(replaced.reshape(-1), marker["out"].reshape(-1)):
            return "calls hooks.draft_logits but does not return its result"
        last = int(batch.anchor_valid[0].nonzero().max()) if bool(batch.anchor_valid[0].any()) else a - 1
        if a >= 2 and int(batch.anchors[0, last]) >= 1:  # the last real anchor (a padded slot may follow it)
            moved = batch.anchors.clone()
            moved[0, last] = moved[0, last] - 1
            shifted = subject.draft_logits(batch.replace(anchors=moved), ProbeHooks()).reshape(n, a, b, -1)
            if torch.equal(shifted[0, last], base[0, last]):
                return "ignores batch.anchors (moving the last anchor left its block's logits unchanged)"
    return base


def _shared(subject: PartialSubject, target: Any, batch: Any, params: dict[str, Tensor]) -> str | bool:
    """The drafter uses the target's embeddings and lm_head: perturbing them (the target's tensors, or the
    parameters equal to them) changes the logits."""
    with torch.no_grad():
        base = subject.draft_logits(batch, ProbeHooks())
        for role, shared in (("embeddings", target.embed_weight), ("lm_head", target.lm_head_weight)):
            candidates = [shared, *[p for p in params.values() if p is not shared and _same(p, shared)]]
            used = False
            for tensor in candidates:
                saved = tensor.detach().clone()
                tensor.add_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(9)).to(tensor.dtype))
                try:
                    used = not torch.equal(subject.draft_logits(batch, ProbeHooks()), base)
                finally:
                    tensor.copy_(saved)
                if used:
                    break
            if not used:
                return (f"the drafter does not use the target's {role} (neither target.{'embed_weight' if role == 'embeddings' else 'lm_head_weight'}"
                        " nor a parameter equal to it changes the logits)")
    return True


def _draft_layers(subject: PartialSubject, batch: Any) -> str | list:
    layers = subject.draft_layers()
    if not layers:
        return "returns no layers"
    calls: dict[int, bool] = {}
    handles = [layer.register_forward_pre_hook(lambda _m, args, kwargs, i=i: calls.__setitem__(
        i, (bool(args) and isinstance(args[0], Tensor)) or isinstance(kwargs.get("hidden_states"), Tensor)), with_kwargs=True)
        for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            subject.draft_logits(batch, ProbeHooks())
    finally:
        for handle in handles:
            handle.remove()
    unrun = [i for i in range(len(layers)) if i not in calls]
    if unrun:
        return f"layers {unrun} are not run by draft_logits()"
    bad = [i for i, ok in calls.items() if not ok]
    if bad:
        return f"layers {bad} are not called with the hidden states as first argument or `hidden_states=`"
    return list(layers)


def _rotary(subject: PartialSubject, info: dict[str, Any], batch: Any) -> str | Any:
    rotary = subject.rotary()
    if rotary is None:
        return "returns None (the rotary-positions probe is then unknown)"
    seen: list[Tensor] = []

    def hook(_m: Any, args: Any, kwargs: Any) -> None:
        ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(ids, Tensor):
            seen.append(ids)

    handle = rotary.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            subject.draft_logits(batch, ProbeHooks())
    finally:
        handle.remove()
    if not seen:
        return "is not called with position ids during draft_logits() (module(x, position_ids))"
    q = batch.anchors.shape[1] * int(info["block_size"])
    if seen[0].reshape(-1, seen[0].shape[-1])[0].numel() < q:
        return (f"its first call sees {seen[0].shape[-1]} positions, fewer than the {q} block tokens (the block's "
                "positions must come last in the first call)")
    return rotary


def _loss(subject: PartialSubject, info: dict[str, Any], batch: Any) -> str | Tensor:
    n, a = batch.anchors.shape
    b = int(info["block_size"])
    holder: dict[str, Tensor] = {}

    def leaf(x: Tensor) -> Tensor:
        holder["z"] = torch.zeros_like(x).requires_grad_(True)
        return holder["z"]

    loss = subject.loss(batch, _hooks(logits=leaf))
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        return "must return a scalar tensor"
    if "z" not in holder:
        return "never calls hooks.draft_logits on the drafter's logits"
    if not loss.requires_grad:
        return "returns a loss without a graph (computed under no_grad?)"
    (grad,) = torch.autograd.grad(loss, holder["z"], allow_unused=True)
    if grad is None or grad.abs().max().item() == 0:
        return "is not computed from the hooks.draft_logits result (no gradient reaches it)"
    if a >= 2:
        valid = batch.anchor_valid.clone()
        valid[:, -1] = False
        holder.clear()
        masked = subject.loss(batch.replace(anchor_valid=valid), _hooks(logits=leaf))
        (grad,) = torch.autograd.grad(masked, holder["z"], allow_unused=True)
        if grad is not None and grad.reshape(n, a, b, -1)[:, -1].abs().max().item() > 0:
            return "ignores batch.anchor_valid (an anchor marked invalid still enters the loss)"
    return loss


def _train_step(subject: PartialSubject, target: Any, batch: Any, params: dict[str, Tensor] | None) -> str | None:
    params = params if params is not None else {}
    before = {name: p.detach().clone() for name, p in params.items()}
    shared_before = (target.embed_weight.clone(), target.lm_head_weight.clone())
    subject.train_step(batch)
    changed = [name for name, p in params.items() if not torch.equal(before[name], p.detach())]
    if params and not changed:
        return "changes no parameter"
    if not torch.equal(shared_before[0], target.embed_weight) or not torch.equal(shared_before[1], target.lm_head_weight):
        return "changes the target's own embeddings or lm_head tensors"
    return None
