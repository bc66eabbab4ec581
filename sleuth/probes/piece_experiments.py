"""Experiments on located pieces: each kind of piece is called on a synthetic scene whose answer is known.

The scene is one packed row of two documents with three anchors: blocks 0 and 1 overlap (anchors two apart:
a cross-block leak shows), block 2 sits in the second document, whose positions restart at 0. The target's
logits put their argmax on a different token at every position and the data tokens differ from those, so
a slot's target names the one position it was taken from. Every verdict states what it exercised, and a
`match` is given only when that covers the run's path: the piece is the one the run calls, bound the way
the run binds it (or at its defaults), on inputs with several blocks and documents.

    layer_ids   f(L, k) for several target depths, against round(1 + i*(L-4)/(k-1))
    features    each hidden_states[i] perturbed: which layers the gather reads
    mask        the dense mask (bool, additive or a mask_mod evaluated on every pair) against the rule
    positions   the block tokens' positions against position_ids[anchor] + j
    teacher     which position each slot's target comes from (p+j-1 for logits, p+j for data tokens)
    final_logits  which layer the recomputed teacher logits come from
    weights     slot 0's weight, the decay's gamma
    loss        d loss / d logits at a uniform draft: per slot the target (one-hot: CE; softmax: KL) and weight
"""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from sleuth.probes.binding import COMMON_VOCABULARY, LOSS_VOCABULARY, Role, RoleBook, factory
from sleuth.probes.experiments import reference_layer_ids
from sleuth.probes.protocol import ProbeTarget
from sleuth.probes.target import RMS_EPS, rms_norm
from sleuth.probes.verdict import Expectations, Verdict

NUM_TARGET_LAYERS = 8
MAX_BLOCK = 16
# Sizes no drafter module is built with by accident: the vocabulary (80) is no multiple of the hidden size (32)
# a constructor multiplies (2H, 4H, the MLP's 64), so a Linear(H, 80) is an output head and nothing else.
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 80, 32, 4, 2, 8, 64


def make_probe_target(seed: int = 0) -> ProbeTarget:
    g = torch.Generator().manual_seed(seed)
    return ProbeTarget(num_layers=NUM_TARGET_LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=HEADS,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, intermediate_size=INTERMEDIATE, rms_norm_eps=RMS_EPS,
                       rope_theta=10000.0, mask_token_id=VOCAB - 1,
                       embed_weight=torch.randn(VOCAB, HIDDEN, generator=g),
                       lm_head_weight=torch.randn(VOCAB, HIDDEN, generator=g) * 0.35,
                       norm_weight=1.0 + 0.1 * torch.randn(HIDDEN, generator=g))
GAMMA_RTOL = 0.01
EXP_FIT = 0.01
AGREEMENT = 0.9


@dataclass
class Scene:
    """One packed row: documents [0, doc_end) and [doc_end, S); anchors a0, a0 + 2 (document 0), a2 (document 1)."""

    block: int
    seq_len: int
    doc_end: int
    anchors: list[int]
    vocab: int
    hidden: int
    input_ids: Tensor  # [1, S]
    position_ids: Tensor  # [1, S] restarting per document
    doc_ids: Tensor  # [1, S]
    logits: Tensor  # [1, S, V]: argmax at position p is logit_token[p]
    hidden_states: tuple[Tensor, ...]  # L+1 x [1, S, H], HF layout (index L final-normed)
    target: Any  # the ProbeTarget (embeddings, lm_head, final norm)
    logit_token: list[int] = field(default_factory=list)

    @property
    def queries(self) -> int:
        return len(self.anchors) * self.block

    @property
    def cu_seqlens(self) -> Tensor:
        return torch.tensor([0, self.doc_end, self.seq_len], dtype=torch.int32)

    def doc_of(self, position: int) -> int:
        return 0 if position < self.doc_end else 1

    def position(self, index: int) -> int:
        return int(self.position_ids[0, index])


def make_scene(block: int, seed: int = 0) -> Scene:
    b = max(block, 1)
    room = max(b, MAX_BLOCK)
    a0 = 5
    doc_end = a0 + 2 + room + 4
    a2 = doc_end + 3
    seq_len = a2 + room + 4
    target = make_probe_target(seed)
    v, h = target.vocab_size, target.hidden_size
    g = torch.Generator().manual_seed(seed + 11)
    logit_token = [(p * 7 + 3) % v for p in range(seq_len)]  # distinct for S <= V (7 is prime to V)
    logits = torch.randn(1, seq_len, v, generator=g) * 0.5
    logits[0, torch.arange(seq_len), torch.tensor(logit_token)] += 4.0
    input_ids = torch.tensor([[(p * 13 + 5) % (v - 1) for p in range(seq_len)]])  # never the mask token (V-1)
    position_ids = torch.cat([torch.arange(doc_end), torch.arange(seq_len - doc_end)])[None]
    doc_ids = torch.zeros(1, seq_len, dtype=torch.long)
    doc_ids[0, doc_end:] = 1
    hidden = [target.embed_weight[input_ids]]
    hidden += [torch.randn(1, seq_len, h, generator=g) for _ in range(NUM_TARGET_LAYERS - 1)]
    hidden.append(rms_norm(torch.randn(1, seq_len, h, generator=g), target.norm_weight, target.rms_norm_eps))
    return Scene(b, seq_len, doc_end, [a0, a0 + 2, a2], v, h, input_ids, position_ids, doc_ids, logits, tuple(hidden),
                 target, logit_token)


# --- roles: what the probe can hand a piece ---------------------------------------------------------------------


class _Norm(nn.Module):
    def __init__(self, weight: Tensor, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(weight.clone(), requires_grad=False), eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def target_modules(scene: Scene) -> dict[str, nn.Module]:
    t = scene.target
    embed = nn.Embedding(t.vocab_size, t.hidden_size)
    head = nn.Linear(t.hidden_size, t.vocab_size, bias=False)
    with torch.no_grad():
        embed.weight.copy_(t.embed_weight)
        head.weight.copy_(t.lm_head_weight)
    # like a model fresh from from_pretrained: trainable until the trainer's own code freezes it
    return {"embed": embed, "lm_head": head, "norm": _Norm(t.norm_weight, t.rms_norm_eps)}


def hf_config(target: Any, layers: int) -> Any:
    config = target.qwen3_config(num_hidden_layers=layers)
    config._attn_implementation = "eager"
    return config


class StandInTarget(nn.Module):
    """What a trainer needs from a Hugging Face causal LM, answering with the scene's tensors: `model(ids,
    output_hidden_states=True)` (and `model.model(...)`) give the scene's hidden states and logits; its
    embeddings, final norm and lm_head are the scene's. Like a model fresh from from_pretrained, its parameters
    require grad until the trainer's own code freezes them."""

    def __init__(self, scene: Scene) -> None:
        super().__init__()
        modules = target_modules(scene)
        self.config = hf_config(scene.target, scene.target.num_layers)
        self.model = _StandInBody(self, modules)
        self.lm_head = modules["lm_head"].requires_grad_(True)
        self.scene = scene
        self.hidden_states = scene.hidden_states  # an experiment may put perturbed ones here
        for module in (self.model.embed_tokens, self.model.norm):
            module.requires_grad_(True)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def answer(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.scene.logits, hidden_states=self.hidden_states,
                               last_hidden_state=self.hidden_states[-1])

    def forward(self, *_args: Any, **_kwargs: Any) -> Any:
        return self.answer()


class _StandInBody(nn.Module):
    def __init__(self, owner: StandInTarget, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        self.embed_tokens, self.norm = modules["embed"], modules["norm"]
        object.__setattr__(self, "_owner", owner)  # not a submodule: no cycle in the module tree

    def forward(self, *_args: Any, **_kwargs: Any) -> Any:
        return self._owner.answer()


def scene_roles(scene: Scene, gamma: Any = None) -> dict[str, Role]:
    """Every role with the shapes it is tried in, for this scene."""
    s, a, b, v = scene.seq_len, torch.tensor(scene.anchors), scene.block, scene.vocab
    per_query = a.repeat_interleave(b)
    modules = target_modules(scene)
    t = scene.target

    def both(name: str, row: Tensor) -> Role:  # [1, ...] first (a batch of one row), then the row alone
        return Role(name, [("[N, ...]", factory(lambda r=row: r.clone())), ("[...] (one row)", factory(lambda r=row: r[0].clone()))])

    roles = {
        "anchors": Role("anchors", [("[N, A]", factory(lambda: a[None].clone())), ("[A]", factory(lambda: a.clone())),
                                    ("a list", factory(lambda: list(scene.anchors)))]),
        "anchors_per_query": Role("anchors per query", [("[N, A*B]", factory(lambda: per_query[None].clone())),
                                                        ("[A*B]", factory(lambda: per_query.clone()))]),
        "anchor_valid": Role("anchor_valid", [("[N, A] all true", factory(lambda: torch.ones(1, len(scene.anchors), dtype=torch.bool))),
                                              ("[A] all true", factory(lambda: torch.ones(len(scene.anchors), dtype=torch.bool)))]),
        "num_anchors": Role("the number of anchors", [(str(len(scene.anchors)), len(scene.anchors))]),
        "block_size": Role("the block size", [(str(b), b)]),
        "seq_len": Role("the row length", [(str(s), s)]),
        "q_len": Role("the query length", [(str(scene.queries), scene.queries)]),
        "kv_len": Role("the key length", [(str(s + scene.queries), s + scene.queries)]),
        "doc_ids": both("document ids", scene.doc_ids),
        "doc_of_query": Role("each query's document", [("[N, A*B]", factory(lambda: scene.doc_ids[0, per_query][None].clone())),
                                                       ("[A*B]", factory(lambda: scene.doc_ids[0, per_query].clone()))]),
        "cu_seqlens": Role("document offsets", [("[D+1]", factory(lambda: scene.cu_seqlens.clone()))]),
        "position_ids": both("position ids", scene.position_ids),
        "input_ids": both("token ids", scene.input_ids),
        "loss_mask": both("loss mask", torch.ones(1, s, dtype=torch.long)),
        "target_logits": Role("the target's logits", [("[N, S, V]", factory(lambda: scene.logits.clone())),
                                                      ("[S, V]", factory(lambda: scene.logits[0].clone())),
                                                      ("[N, S] top-1", factory(lambda: scene.logits.argmax(-1))),
                                                      ("[S] top-1", factory(lambda: scene.logits[0].argmax(-1)))]),
        "stand_in_target": Role("a stand-in causal LM", [("answering with the scene", factory(lambda: StandInTarget(scene)))]),
        "step_index": Role("a step counter", [("0", 0)]),
        "hidden_states": Role("hidden states", [("L+1 x [N, S, H]", factory(lambda: tuple(h.clone() for h in scene.hidden_states))),
                                                ("L+1 x [S, H]", factory(lambda: tuple(h[0].clone() for h in scene.hidden_states)))]),
        "layer_ids": Role("layer ids", [(str(reference_layer_ids(NUM_TARGET_LAYERS, 3)),
                                         factory(lambda: reference_layer_ids(NUM_TARGET_LAYERS, 3)))]),
        "lm_head": Role("the target's lm_head", [("nn.Linear(H, V)", modules["lm_head"])]),
        "final_norm": Role("the target's final norm", [("RMSNorm(H)", modules["norm"])]),
        "embed": Role("the target's embeddings", [("nn.Embedding(V, H)", modules["embed"])]),
        "mask_token_id": Role("the mask token id", [(str(t.mask_token_id), t.mask_token_id)]),
        "vocab_size": Role("the vocabulary size", [(str(v), v)]),
        "hidden_size": Role("the hidden size", [(str(t.hidden_size), t.hidden_size)]),
        "num_heads": Role("the head count", [(str(t.num_heads), t.num_heads)]),
        "num_kv_heads": Role("the key/value head count", [(str(t.num_kv_heads), t.num_kv_heads)]),
        "head_dim": Role("the head size", [(str(t.head_dim), t.head_dim)]),
        "intermediate_size": Role("the MLP size", [(str(t.intermediate_size), t.intermediate_size)]),
        "device": Role("the device", [("cpu", "cpu")]),
        "dtype": Role("the dtype", [("float32", torch.float32)]),
        "generator": Role("a seeded generator", [("torch.Generator", factory(lambda: torch.Generator().manual_seed(0)))]),
    }
    if gamma is not None:
        roles["gamma"] = Role("gamma", [(f"{gamma:g}", gamma)])
    return roles


def book(roles: dict[str, Role], extra: dict[str, list] | None = None, drop: tuple[str, ...] = ()) -> RoleBook:
    vocabulary = {**(extra or {}), **{k: v for k, v in COMMON_VOCABULARY.items() if k not in drop}}
    return RoleBook(roles, vocabulary)


def config_answer(scene: Scene, settings: dict[str, Any], gamma: Any = None):
    """Answers `args.x` / `cfg.x`: the scene's sizes, then the run's settings (its --config, then code defaults)."""
    t = scene.target
    sizes = {"block_size": scene.block, "block": scene.block, "block_len": scene.block, "blk": scene.block,
             "mask_token_id": t.mask_token_id, "mask_id": t.mask_token_id, "mask_token": t.mask_token_id,
             "vocab_size": scene.vocab, "vocab": scene.vocab, "n_vocab": scene.vocab,
             "hidden_size": scene.hidden, "hidden": scene.hidden, "d_model": scene.hidden, "dim": scene.hidden,
             "heads": t.num_heads, "num_heads": t.num_heads, "n_heads": t.num_heads, "n_q": t.num_heads,
             "num_attention_heads": t.num_heads, "kv_heads": t.num_kv_heads, "num_kv_heads": t.num_kv_heads,
             "n_kv": t.num_kv_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
             "intermediate": t.intermediate_size, "intermediate_size": t.intermediate_size,
             "target_layers": t.num_layers, "num_target_layers": t.num_layers, "seq_len": scene.seq_len,
             "eps": t.rms_norm_eps, "rms_norm_eps": t.rms_norm_eps}
    from sleuth.probes.binding import NO_VALUE

    def answer(name: str) -> Any:
        if name in sizes:
            return sizes[name]
        if name in ("gamma", "loss_decay_gamma", "decay_gamma") and gamma is not None:
            return gamma
        if name in settings:
            return settings[name]
        return NO_VALUE

    return answer


# --- verdicts ---------------------------------------------------------------------------------------------------


def verdict(invariant: str, kind: str, where: str, called: str, *, status: str = "unknown", hypothesis: str = "",
            measurement: str = "", threshold: str = "", observed: str = "", expected: str = "", reason: str = "",
            fix: str = "", measured: Any = None, exercised: str = "") -> Verdict:
    perturbed = f"called {where} with {called}" + (f"; exercised: {exercised}" if exercised else "")
    return Verdict(invariant=invariant, status=status, experiment=f"located-{kind}", hypothesis=hypothesis,
                   perturbed=perturbed, measurement=measurement, threshold=threshold, observed=observed,
                   expected=expected, measured=measured, reason=reason, fix=fix,
                   coverage={"piece": where, "called with": called, **({"scene": exercised} if exercised else {})})


def exercised_scene(scene: Scene, documents: bool = True) -> str:
    a = scene.anchors
    text = (f"{len(a)} blocks of B={scene.block} in one row of {scene.seq_len} positions, blocks 0 and 1 overlapping "
            f"(anchors {a[0]} and {a[1]})")
    if documents:
        text += f", block 2 in a second document (anchor {a[2]}, document positions restarting at {scene.doc_end})"
    return text


# --- layer ids ---------------------------------------------------------------------------------------------------

LAYER_TESTS = ((36, 5), (64, 5), (28, 3), (12, 1))


@dataclass
class LayerRule:
    convention: str | None  # "zlab" (the reference ids), "vllm" (reference + 1), None (neither)
    observed: dict[str, list[int]]


def measure_layer_rule(call: Any, k_run: int | None) -> LayerRule:
    """`call(L, k)` -> ids for several depths (the run's k among them)."""
    tests = list(LAYER_TESTS) + ([(36, k_run), (64, k_run)] if k_run and k_run > 1 else [])
    observed: dict[str, list[int]] = {}
    zlab = vllm = True
    for depth, k in tests:
        ids = [int(i) for i in call(depth, k)]
        observed[f"L={depth},k={k}"] = ids
        ref = reference_layer_ids(depth, k)
        zlab &= ids == ref
        vllm &= ids == [i + 1 for i in ref]
    return LayerRule("zlab" if zlab else "vllm" if vllm else None, observed)


# --- the mask ------------------------------------------------------------------------------------------------


@dataclass
class MaskReading:
    allowed: Tensor  # [Q, K] bool, True = may attend
    layout: str  # "context|block" / "block|context" / "context" / "block"
    polarity: str
    disagreement: float


def dense_mask(result: Any, scene: Scene) -> list[tuple[str, Tensor]]:
    """Candidate readings of a builder's result as [Q, K] "may attend" matrices (several polarities)."""
    q = scene.queries
    if callable(result) and not isinstance(result, Tensor):
        tensor = evaluate_mask_mod(result, q, scene.seq_len + q)
        if tensor is None:
            tensor = evaluate_mask_mod(result, q, scene.seq_len)
        if tensor is None:
            return []
        return [("mask_mod True = attend", tensor.bool())]
    if isinstance(result, (tuple, list)) or isinstance(result, dict) or dataclasses.is_dataclass(result):
        # A builder that returns its mask with other things (`allow, q_pos, kv_pos = build(...)`, a dict, a
        # dataclass): every element is read, and an integer tensor (positions, indices) is not taken for a
        # mask when a boolean or float element is one.
        items = (list(result.items()) if isinstance(result, dict)
                 else [(f.name, getattr(result, f.name)) for f in dataclasses.fields(result)]
                 if dataclasses.is_dataclass(result) and not isinstance(result, type)
                 else list(enumerate(result)) if isinstance(result, (tuple, list)) else [])
        found = [(f"element {key}: {how}", tensor, isinstance(value, Tensor) and not value.dtype.is_floating_point
                  and value.dtype != torch.bool)
                 for key, value in items[:16] if not isinstance(value, (tuple, list, dict))
                 for how, tensor in dense_mask(value, scene)]
        if any(not integer for *_, integer in found):
            found = [f for f in found if not f[2]]
        return [(how, tensor) for how, tensor, _ in found]
    if not isinstance(result, Tensor):
        return []
    x = result.detach()
    while x.dim() > 2:
        if x.shape[0] != 1 and x.dim() == 3 and x.shape[0] == q:
            break
        x = x[0]  # batch / head dimensions of size one (or identical heads)
    if x.dim() != 2:
        return []
    if x.shape[0] != q and x.shape[0] > q:  # the context's own rows first, then the block's
        x = x[-q:]
    if x.shape[0] != q:
        return []
    if x.dtype == torch.bool:
        return [("bool True = attend", x), ("bool True = blocked", ~x)]
    if x.is_floating_point():
        if x.max() <= 0 and x.min() < -1e3:
            return [("additive 0 / -inf", x > -1e3)]
        return [("float 1 = attend", x > 0.5), ("float 1 = blocked", x <= 0.5)]
    return [("int 1 = attend", x != 0), ("int 1 = blocked", x == 0)]


def evaluate_mask_mod(mod: Any, q_len: int, kv_len: int) -> Tensor | None:
    """A mask_mod / predicate on every (query, key) pair: broadcast tensors, else vmap, else one pair at a time."""
    import inspect

    try:
        n_params = len([p for p in inspect.signature(mod).parameters.values() if p.default is p.empty])
    except (TypeError, ValueError):
        n_params = 4
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)

    def args(qi: Tensor, ki: Tensor) -> tuple:
        return (zero, zero, qi, ki) if n_params >= 4 else (qi, ki)

    try:
        out = mod(*args(q, kv))
        if isinstance(out, Tensor) and out.shape == (q_len, kv_len):
            return out.bool()
    except Exception:
        pass
    try:
        inner = torch.vmap(lambda qi, ki: mod(*args(qi, ki)), in_dims=(None, 0))
        out = torch.vmap(inner, in_dims=(0, None))(torch.arange(q_len), torch.arange(kv_len))
        if isinstance(out, Tensor) and out.shape == (q_len, kv_len):
            return out.bool()
    except Exception:
        pass
    try:
        rows = [[bool(mod(*args(torch.tensor(i), torch.tensor(j)))) for j in range(kv_len)] for i in range(q_len)]
        return torch.tensor(rows)
    except Exception:
        return None


def reference_mask(scene: Scene, layout: str, documents: bool = True) -> Tensor:
    """The DFlash rule: block queries see same-document context strictly before their anchor, and their own
    block. A builder given no document ids is judged on one-document rows (`documents=False`)."""
    s, q, b = scene.seq_len, scene.queries, scene.block
    block_of = torch.arange(q) // b
    anchor = torch.tensor(scene.anchors)[block_of]
    kv = torch.arange(s)
    doc = scene.doc_ids[0] if documents else torch.zeros(s, dtype=torch.long)
    context = (kv[None, :] < anchor[:, None]) & (doc[None, :] == doc[anchor][:, None])
    own = block_of[:, None] == block_of[None, :]
    return {"context|block": torch.cat([context, own], 1), "block|context": torch.cat([own, context], 1),
            "context": context, "block": own}[layout]


def read_mask(candidates: list[tuple[str, Tensor]], scene: Scene, documents: bool = True) -> MaskReading | None:
    """The (polarity, key layout) reading closest to the rule; None when even the closest is far from it."""
    s, q = scene.seq_len, scene.queries
    best: MaskReading | None = None
    for polarity, allowed in candidates:
        k = allowed.shape[1]
        layouts = ["context|block", "block|context"] if k == s + q else ["context"] if k == s else ["block"] if k == q else []
        for layout in layouts:
            ref = reference_mask(scene, layout, documents)
            disagreement = (allowed != ref).float().mean().item()
            if best is None or disagreement < best.disagreement:
                best = MaskReading(allowed, layout, polarity, disagreement)
    if best is None or best.disagreement > 0.25:
        return None
    return best


def judge_mask(reading: MaskReading, scene: Scene, has_documents: bool, packs_documents: str | None,
               where: str, called: str) -> list[Verdict]:
    s, q, b = scene.seq_len, scene.queries, scene.block
    allowed = reading.allowed
    context_cols = slice(0, s) if reading.layout in ("context|block", "context") else slice(q, q + s) if \
        reading.layout == "block|context" else None
    block_cols = slice(s, s + q) if reading.layout == "context|block" else slice(0, q) if reading.layout in (
        "block|context", "block") else None
    doc = scene.doc_ids[0] if has_documents else torch.zeros(s, dtype=torch.long)
    exercised = exercised_scene(scene, has_documents) + f"; mask read as {reading.polarity}, keys {reading.layout}"
    threshold = "exact, on every (query, key) pair"
    base = dict(kind="mask", where=where, called=called, threshold=threshold, exercised=exercised)
    sees_anchor, sees_later, sees_other_doc, hides_context = [], [], [], []
    if context_cols is not None:
        ctx = allowed[:, context_cols]
        for row in range(q):
            anchor = scene.anchors[row // b]
            for key in range(s):
                same = doc[key] == doc[anchor]
                if ctx[row, key] and key == anchor:
                    sees_anchor.append(row)
                elif ctx[row, key] and key > anchor and same:
                    sees_later.append(row)
                elif ctx[row, key] and not same:
                    sees_other_doc.append(row)
                elif not ctx[row, key] and key < anchor and same:
                    hides_context.append((row, key))
    other_block, causal = [], []
    if block_cols is not None:
        blk = allowed[:, block_cols]
        for row in range(q):
            for col in range(q):
                if row // b != col // b and blk[row, col]:
                    other_block.append((row, col))
                elif row // b == col // b and not blk[row, col]:
                    causal.append((row, col))
    verdicts = []
    anchor_v = verdict("dflash.context_excludes_anchor", hypothesis="a block's queries see same-document context "
                       "strictly before their anchor, not the anchor's own position", expected="kv < anchor", **base)
    if context_cols is None:
        anchor_v.reason = "not exercised: the mask holds no context keys (the context is attended elsewhere)"
    elif sees_anchor:
        anchor_v.status, anchor_v.observed = "mismatch", f"queries of {len({r // b for r in sees_anchor})} blocks see " \
                                                         "their anchor's own context position (kv <= anchor)"
        anchor_v.fix = "Mask context keys at or after the anchor: kv_pos < anchor, not <=."
    elif sees_other_doc:
        # DFLASH.md: context strictly before the anchor, *same document only* (the document rule is this one's)
        anchor_v.status = "mismatch"
        anchor_v.observed = (f"queries of {len({r // b for r in sees_other_doc})} blocks see another document's context "
                             "(the rule is: same document only)")
        anchor_v.fix = "Let a block see context of its own document only (doc[kv] == doc[anchor])."
    elif not has_documents and packs_documents:
        anchor_v.reason = (f"not exercised: the mask builder takes no document ids, but the code tracks documents "
                           f"({packs_documents}): whether a block sees another document cannot show")
    elif hides_context:
        anchor_v.reason = (f"the mask hides context the rule lets a block see ({len(hides_context)} (query, key) "
                           "pairs before the anchor): a window or a stricter rule, not judged here")
    else:
        anchor_v.status, anchor_v.observed = "match", "context strictly before the anchor; the anchor's position hidden"
    verdicts.append(anchor_v)

    isolated = verdict("dflash.blocks_isolated", hypothesis="a block sees neither another block's tokens, nor "
                       "context after its anchor", expected="no leak", **base)
    leaks = []
    if other_block:
        leaks.append(f"another block's tokens ({len(other_block)} pairs)")
    if sees_later:
        leaks.append("context after its anchor")
    if context_cols is None or block_cols is None:
        isolated.reason = "not exercised: the mask covers only " + ("block" if context_cols is None else "context") + " keys"
    elif leaks:
        isolated.status, isolated.observed = "mismatch", "blocks see " + ", ".join(leaks)
        isolated.fix = "A block's queries may see its own block's tokens and same-document context before its anchor only."

    else:
        isolated.status = "match"
        isolated.observed = "no leak from other blocks or later context" + (
            "" if has_documents else " (rows hold one document: no document ids in the code)")
    verdicts.append(isolated)

    bidi = verdict("dflash.block_bidirectional", hypothesis="slots of a block see each other in both directions",
                   expected="every slot sees every slot of its block", **base)
    if block_cols is None:
        bidi.reason = "not exercised: the mask holds no block keys"
    elif causal:
        later = all(col > row for row, col in causal)
        bidi.status = "mismatch"
        bidi.observed = "causal within the block (earlier slots do not see later ones)" if later else \
            f"{len(causal)} within-block pairs hidden"
        bidi.fix = "Let every slot attend to every slot of its own block (non-causal within the block)."
    else:
        bidi.status, bidi.observed = "match", "slots see each other both ways"
    verdicts.append(bidi)
    return verdicts


# --- positions -----------------------------------------------------------------------------------------------


def judge_positions(result: Any, scene: Scene, given_positions: bool, where: str, called: str) -> Verdict | str:
    """A verdict, or why the result is not a position tensor (the trial call is then rejected)."""
    if not isinstance(result, Tensor) or result.is_floating_point():
        return "not an integer tensor"
    flat = result.detach().reshape(-1) if result.dim() <= 1 or result.shape[0] != 1 else result.detach()[0].reshape(-1)
    q, s, b = scene.queries, scene.seq_len, scene.block
    by_doc = torch.cat([scene.position(a) + torch.arange(b) for a in scene.anchors])
    by_index = torch.cat([a + torch.arange(b) for a in scene.anchors])
    expected = by_doc if given_positions else by_index
    own_context = scene.position_ids[0] if given_positions else torch.arange(s)
    if flat.numel() == s + q:
        # the context's positions and the block's, in one of two orders: the order whose context part is the
        # row's own positions says which part is the block's; neither: the parts cannot be told apart
        orders = [(flat[:s], flat[s:]), (flat[q:], flat[:q])]
        fitting = [(c, blk) for c, blk in orders if torch.equal(c, own_context)]
        if not fitting:
            return "neither the first nor the last S positions are the row's own context positions"
        context, block = fitting[0]
    elif flat.numel() == q:
        context, block = None, flat
    else:
        return f"{flat.numel()} positions, not the {q} block tokens"
    v = verdict("dflash.block_position_ids", "positions", where, called,
                hypothesis="block token j of the block anchored at p sits at position p + j (the document's position)",
                threshold="exact", expected=f"block positions {expected.tolist()}",
                measurement=f"block positions {block.tolist()}", measured={"block_positions": block.tolist()},
                exercised=exercised_scene(scene, given_positions) + ("" if given_positions else
                                                                     "; the function takes no position ids (positions are row indices)"))
    if torch.equal(block, expected):
        v.status, v.observed = "match", "anchor + j"
    elif given_positions and torch.equal(block, by_index):
        v.status, v.observed = "mismatch", "the row index of the anchor + j, not its position in its document"
        v.fix = "Take the anchor's position from the position ids (per document in packed rows), then add j."
    else:
        shift = (block - expected).unique()
        v.status = "mismatch"
        v.observed = f"anchor + j {int(shift[0]):+d}" if shift.numel() == 1 else f"block positions {block.tolist()}"
        v.fix = "Give block token j the position of its anchor plus j."
    return v


# --- teacher ---------------------------------------------------------------------------------------------------


def slot_sources(result: Any, scene: Scene) -> tuple[str, Tensor] | str:
    """(source, [A, B] positions each slot's target was taken from) or why the result is not slot targets."""
    if not isinstance(result, Tensor):
        return "not a tensor"
    a, b, v = len(scene.anchors), scene.block, scene.vocab
    x = result.detach()
    if x.is_floating_point():
        if x.shape[-1] != v or x.numel() != a * b * v:
            return f"shape {tuple(x.shape)} is not [A, B, V] targets"
        tokens = x.reshape(a, b, v).argmax(-1)
        source = "logits"
    else:
        if x.numel() != a * b:
            return f"shape {tuple(x.shape)} is not [A, B] target ids"
        tokens = x.reshape(a, b)
        source = "ids"
    by_logit = {tok: p for p, tok in enumerate(scene.logit_token)}
    by_data = {int(tok): p for p, tok in enumerate(scene.input_ids[0].tolist())}
    logit_hits = sum(int(t) in by_logit for t in tokens.flatten().tolist())
    data_hits = sum(int(t) in by_data for t in tokens.flatten().tolist())
    table, name = (by_logit, "the target's predictions") if logit_hits >= data_hits else (by_data, "the data tokens")
    positions = torch.tensor([[table.get(int(t), -10_000) for t in row] for row in tokens.tolist()])
    return (name if source == "logits" or name == "the data tokens" else name), positions


def judge_teacher(sources: tuple[str, Tensor], scene: Scene, where: str, called: str) -> Verdict:
    name, positions = sources
    b = scene.block
    offsets = positions - (torch.tensor(scene.anchors)[:, None] + torch.arange(b))
    trained = offsets[:, 1:]  # slot 0 is the anchor: its target is never trained
    values, counts = trained.flatten().unique(return_counts=True)
    best = int(values[counts.argmax()])
    share = counts.max().item() / trained.numel()
    wanted = -1 if name == "the target's predictions" else 0
    v = verdict("dflash.target_shift", "teacher", where, called,
                hypothesis="slot j of the block at p is trained toward the target's prediction at p+j-1 (the data "
                           "token at p+j)",
                threshold=f"the same offset on >= {AGREEMENT:.0%} of slots 1..B-1",
                measurement=f"slots take {name} at p+j{best:+d} ({share:.0%} of slots 1..B-1)",
                expected="the target's prediction at p+j-1, or the data token at p+j",
                measured={"source": name, "offset": best, "share": share}, exercised=exercised_scene(scene))
    if share < AGREEMENT or best < -50:
        v.reason = f"no single offset explains the slot targets (best p+j{best:+d} on {share:.0%})"
    elif best == wanted:
        v.status, v.observed = "match", f"slot j learns {name} at p+j{best:+d}"
    else:
        v.status, v.observed = "mismatch", f"slot j learns {name} at p+j{best:+d}" + (
            " (no shift: it learns the token after its own)" if name == "the target's predictions" and best == 0 else "")
        v.fix = "Gather the teacher logits at p+j-1 for slot j (roll the target logits by one)."
    return v


# --- teacher logits recomputed from hidden states ----------------------------------------------------------------


def judge_final_logits(result: Any, scene: Scene, where: str, called: str) -> Verdict | str:
    if not isinstance(result, Tensor) or not result.is_floating_point() or result.shape[-1] != scene.vocab:
        return "not logits over the vocabulary"
    x = result.detach().reshape(-1, scene.vocab)
    if x.shape[0] != scene.seq_len:
        return f"{x.shape[0]} rows of logits, not one per position ({scene.seq_len})"
    t = scene.target
    candidates = {"the final logits lm_head(norm(h_L))": scene.logits[0]}
    for i in range(1, len(scene.hidden_states) - 1):
        candidates[f"lm_head(norm(hidden_states[{i}])), the output of layer {i - 1}"] = \
            rms_norm(scene.hidden_states[i][0], t.norm_weight, t.rms_norm_eps) @ t.lm_head_weight.T
    agreement = {name: (x.argmax(-1) == c.argmax(-1)).float().mean().item() for name, c in candidates.items()}
    best = max(agreement, key=agreement.get)
    v = verdict("dflash.target_logits_source", "final_logits", where, called,
                hypothesis="the teacher logits are the target's real output, lm_head(final_norm(h_L))",
                threshold=f"argmax agreement >= {AGREEMENT:.0%} with one source",
                measurement=f"argmax agrees with {best} on {agreement[best]:.0%} of positions",
                expected="the final logits", measured=agreement,
                exercised=f"the target's {len(scene.hidden_states)} hidden states (index 0 the embeddings, the last final-normed)")
    if agreement[best] < AGREEMENT:
        v.reason = f"no source explains the logits (best {best}: {agreement[best]:.0%})"
    elif best.startswith("the final"):
        v.status, v.observed = "match", best
    else:
        v.status, v.observed = "mismatch", best
        v.fix = "Take the teacher logits from the target's real output: lm_head(final_norm(h_L))."
    return v


# --- slot weights ------------------------------------------------------------------------------------------------


def slot_weights(result: Any, block: int) -> Tensor | str:
    """Per-slot weights [B] from a weights tensor ([B], [A, B], [N, A, B], [A*B]); why not otherwise."""
    if not isinstance(result, Tensor) or not result.is_floating_point():
        return "not a float tensor"
    x = result.detach().double()
    if x.shape[-1] == block:
        rows = x.reshape(-1, block)
    elif x.dim() >= 1 and x.numel() % block == 0 and x.dim() <= 2:
        rows = x.reshape(-1, block)
    else:
        return f"shape {tuple(x.shape)} has no slot axis of {block}"
    if (rows - rows[0]).abs().max().item() > 1e-6 * max(rows.abs().max().item(), 1e-12):
        return "the weights differ between blocks (data-dependent)"
    return rows[0]


def judge_weights(weights: Tensor, block: int, gamma_given: float | None, expectations: Expectations, kind: str,
                  where: str, called: str, exercised: str, block_known: bool = True,
                  gamma_from_config: bool = False) -> list[Verdict]:
    """Slot 0's weight and the decay. A gamma the piece was handed from the run's --config and applies is a
    `match` bound to that config (`config_bound`): the code follows the config, and whether the value is right
    is the config's finding (sleuth/probes/merge.py), never the probe's."""
    w = weights.double()
    common = dict(kind=kind, where=where, called=called, exercised=exercised,
                  measurement="slot weights " + ", ".join(f"{x:.4g}" for x in w.tolist()), measured={"weights": w.tolist()})
    slot0 = verdict("dflash.anchor_slot_untrained", hypothesis="slot 0 (the anchor) gets loss weight 0",
                    threshold="exactly 0", expected="slot 0 weight 0", **common)
    if block < 2 or w[1] <= 0:
        slot0.reason = "slot 1 gets no weight: the slot weights cannot be read"
    elif w[0] == 0:
        slot0.status, slot0.observed = "match", "slot 0 weighs 0"
    else:
        slot0.status, slot0.observed = "mismatch", f"slot 0 weighs {w[0].item() / w[1].item():.3g} x slot 1"
        slot0.fix = "Give slot 0 (the anchor, an input) weight 0 in the loss."
    accepted = {expectations.gamma} if expectations.gamma is not None else set()
    if block in expectations.gamma_by_block_size:
        accepted.add(expectations.gamma_by_block_size[block])
    # The accepted gamma depends on B; with the run's B unknown, only a gamma no block size accepts is wrong.
    elsewhere = set(expectations.gamma_by_block_size.values()) - accepted if not block_known else set()
    gamma_v = verdict("dflash.loss_decay_gamma", hypothesis="slot k >= 1 weighs exp(-(k-1)/gamma)",
                      threshold=f"log-residual <= {EXP_FIT}; gamma within {GAMMA_RTOL:.0%}",
                      expected=f"gamma {' or '.join(f'{g:g}' for g in sorted(accepted))} at B={block}", **common)
    if block < 3 or w[1] <= 0:
        gamma_v.reason = "fewer than two trained slots: no decay to fit"
        return [slot0, gamma_v]
    ratios = (w[1:] / w[1]).clamp_min(1e-300)
    k = torch.arange(block - 1, dtype=torch.float64)
    logs = ratios.log()
    if logs.abs().max().item() < 1e-9:
        gamma = math.inf
        gamma_v.observed = "no decay: every slot k >= 1 weighs the same (gamma = infinity)"
    else:
        gamma = -(k * k).sum().item() / (k * logs).sum().item()
        residual = (logs + k / gamma).abs().max().item()
        if gamma <= 0 or residual > EXP_FIT:
            gamma_v.reason = f"the slot weights are not exp(-(k-1)/gamma) (residual {residual:.3g} of log-weights)"
            return [slot0, gamma_v]
        gamma_v.observed = f"gamma {gamma:.4g} (weights exp(-(k-1)/{gamma:.4g}))"
    gamma_v.measured = {**common["measured"], "gamma": gamma if math.isfinite(gamma) else "inf"}
    if gamma_given is not None and math.isfinite(gamma) and abs(gamma - gamma_given) > GAMMA_RTOL * gamma_given:
        gamma_v.status = "mismatch"
        gamma_v.observed += f": the code was given gamma {gamma_given:g} and decays with {gamma:.4g}"
        gamma_v.fix = "Weigh slot k >= 1 by exp(-(k-1)/gamma) with the configured gamma (divide by gamma)."
    elif gamma_given is not None and gamma_from_config and math.isfinite(gamma):
        gamma_v.status, gamma_v.config_bound = "match", ["gamma"]
        gamma_v.observed += f": the code applies the configured gamma {gamma_given:g}"
    elif not accepted:
        gamma_v.reason = "no expected gamma to compare with"
    elif any(math.isfinite(gamma) and abs(gamma - g) <= GAMMA_RTOL * g for g in accepted):
        gamma_v.status = "match"
    elif any(math.isfinite(gamma) and abs(gamma - g) <= GAMMA_RTOL * g for g in elsewhere):
        gamma_v.reason = (f"gamma {gamma:.4g} is the accepted value at another block size, and the run's block size "
                          f"is not known (the piece was called with B={block})")
    else:
        gamma_v.status = "mismatch"
        gamma_v.fix = f"Weigh slot k >= 1 by exp(-(k-1)/{min(accepted):g})."
    return [slot0, gamma_v]


# --- the loss --------------------------------------------------------------------------------------------------


@dataclass
class LossInputs:
    """What a loss piece is handed: zero draft logits (a uniform draft) and per-slot teachers it can be judged by."""

    logits: Tensor  # [A, B, V] the leaf the gradient is taken at
    teacher: Tensor  # [A, B, V] per-slot teacher logits (distinct per slot)


def loss_roles(scene: Scene, inputs: LossInputs) -> dict[str, Role]:
    a, b, v = len(scene.anchors), scene.block, scene.vocab
    z = inputs.logits

    def views(name: str, base: Tensor, grad: bool) -> Role:
        shapes = [("[A, B, V]", lambda: base), ("[N, A, B, V]", lambda: base[None]), ("[A*B, V]", lambda: base.reshape(a * b, v)),
                  ("[N, A*B, V]", lambda: base.reshape(1, a * b, v))]
        return Role(name, [(d, factory(fn)) for d, fn in shapes])

    teacher_ids = inputs.teacher.argmax(-1)
    return {
        "draft_logits": views("the draft logits", z, True),
        "teacher_slots": views("per-slot teacher logits", inputs.teacher, False),
        "teacher_probs": Role("per-slot teacher probabilities", [("[A, B, V]", factory(lambda: inputs.teacher.softmax(-1))),
                                                                 ("[N, A, B, V]", factory(lambda: inputs.teacher.softmax(-1)[None]))]),
        "labels": Role("per-slot target ids", [("[A, B]", factory(lambda: teacher_ids.clone())),
                                               ("[N, A, B]", factory(lambda: teacher_ids[None].clone())),
                                               ("[A*B]", factory(lambda: teacher_ids.reshape(-1).clone()))]),
        "weights": Role("uniform slot weights", [("[B] ones", factory(lambda: torch.ones(b))),
                                                 ("[A, B] ones", factory(lambda: torch.ones(a, b)))]),
        "slot_valid": Role("valid slots", [("[N, A] all true", factory(lambda: torch.ones(1, a, dtype=torch.bool))),
                                           ("[A] all true", factory(lambda: torch.ones(a, dtype=torch.bool))),
                                           ("[A, B] ones", factory(lambda: torch.ones(a, b)))]),
    }


def gradient(call: Any, z: Tensor) -> Tensor | str:
    """d loss / d z for the accepted call's result, [A, B, V]; why not otherwise."""
    loss = call.result
    if isinstance(loss, Tensor) and loss.numel() == z.shape[0] * z.shape[1] and loss.requires_grad:
        loss = loss.sum()  # per-slot losses: the caller weighs and reduces them
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
        return "not a scalar (or per-slot losses) with a graph"
    (grad,) = torch.autograd.grad(loss, z, allow_unused=True)
    if grad is None or grad.abs().max().item() == 0:
        return "the loss does not depend on the logits it was given"
    return grad.detach().double()


def judge_loss(grad: Tensor, inputs: LossInputs, scene: Scene, takes_weights: bool, expectations: Expectations,
               where: str, called: str, block_known: bool = True) -> list[Verdict]:
    """From grad = w * (p - q) at a uniform draft p: the target q (one-hot: CE; softmax of the teacher: KL) and w."""
    a, b, v = grad.shape
    p = 1.0 / v
    w_hat = grad.max(dim=-1).values * v
    trained = w_hat > 1e-9 * w_hat.max()
    q_hat = (p - grad / w_hat.clamp_min(1e-30)[..., None]).clamp_min(0)
    q_hat = q_hat / q_hat.sum(-1, keepdim=True).clamp_min(1e-30)
    teacher = inputs.teacher.double()
    one_hot = bool((q_hat.max(-1).values[trained] >= 0.99).all())
    agree = (q_hat.argmax(-1) == teacher.argmax(-1))[trained].float().mean().item()
    soft_tv = 0.5 * (q_hat - teacher.softmax(-1)).abs().sum(-1)[trained].mean().item()
    kind = "ce" if one_hot else ("kl" if soft_tv < 0.05 else None)
    # a loss on the draft's distribution (CE, KL: through log_softmax) has per-slot gradients summing to zero over
    # the vocabulary; one that does not is computed from the raw logits (a regression), whatever it matches
    imbalance = (grad.sum(-1).abs() / grad.abs().amax(-1).clamp_min(1e-30))[trained].max().item() if trained.any() else 0.0
    exercised = f"{a} blocks of B={b}, a uniform draft (zero logits) and a distinct teacher per slot"
    measurement = (f"recovered targets {'one-hot' if one_hot else f'soft (total variation to the teacher softmax {soft_tv:.3f})'}"
                   f", argmax agreeing with the teacher on {agree:.0%} of trained slots")
    kind_v = verdict("dflash.loss_kind", "loss", where, called, hypothesis="the loss pulls each slot toward the teacher "
                     "(one-hot argmax for CE, softmax for KL)", threshold="one-hot >= 0.99; soft: total variation < 0.05",
                     measurement=measurement, expected=" or ".join(expectations.loss_kinds), exercised=exercised,
                     measured={"one_hot": one_hot, "soft_tv": soft_tv, "agreement": agree})
    if imbalance > 1e-3:
        kind_v.status = "mismatch"
        kind_v.observed = (f"not a loss on the draft's distribution: its gradient does not sum to zero over the vocabulary "
                           f"(imbalance {imbalance:.3g}); a regression on the raw logits")
        kind_v.measured["imbalance"] = imbalance
        kind_v.fix = "Train with cross-entropy (or KL) on the draft's log-softmax against the target."
        return [kind_v]
    if agree < AGREEMENT:
        kind_v.reason = f"the recovered targets are not the teacher it was given (argmax agreement {agree:.0%})"
    elif kind is None:
        kind_v.reason = f"the recovered targets are neither one-hot nor the teacher's softmax (total variation {soft_tv:.3f})"
    else:
        kind_v.observed = "ce (one-hot to the teacher's argmax)" if kind == "ce" else "kl (the teacher's soft distribution)"
        kind_v.status = "match" if kind in expectations.loss_kinds else "mismatch"
    verdicts = [kind_v]
    if takes_weights:
        return verdicts  # the caller's weights decide slot 0 and gamma (the weights piece measures them)
    if kind is not None and agree >= AGREEMENT:
        q = torch.nn.functional.one_hot(teacher.argmax(-1), v).double() if kind == "ce" else teacher.softmax(-1)
        direction = p - q
        weights = (grad * direction).sum(-1) / (direction * direction).sum(-1).clamp_min(1e-30)
    else:
        weights = w_hat
    per_slot = weights.mean(0)
    verdicts += judge_weights(per_slot, b, None, expectations, "loss", where, called, exercised, block_known)
    return verdicts


def loss_shift(grad: Tensor, scene: Scene, where: str, called: str) -> tuple[Verdict, Tensor | None]:
    """For a loss that gathers its own targets from the target's row: which position each slot's recovered
    target comes from (the shift), and the per-slot teacher logits at those positions (for the kind and weights)."""
    a, b, v = grad.shape
    w_hat = grad.max(dim=-1).values * v
    trained = w_hat > 1e-9 * w_hat.max()
    q_hat = (1.0 / v - grad / w_hat.clamp_min(1e-30)[..., None]).clamp_min(0)
    tokens = q_hat.argmax(-1)  # [A, B]
    by_logit = {tok: p for p, tok in enumerate(scene.logit_token)}
    by_data = {int(tok): p for p, tok in enumerate(scene.input_ids[0].tolist())}
    logit_hits = sum(int(t) in by_logit for t in tokens[trained].tolist())
    data_hits = sum(int(t) in by_data for t in tokens[trained].tolist())
    table, name = (by_logit, "the target's predictions") if logit_hits >= data_hits else (by_data, "the data tokens")
    positions = torch.tensor([[table.get(int(t), -10_000) for t in row] for row in tokens.tolist()])
    offsets = (positions - (torch.tensor(scene.anchors)[:, None] + torch.arange(b)))[trained]
    values, counts = offsets.unique(return_counts=True)
    best = int(values[counts.argmax()]) if values.numel() else -10_000
    share = counts.max().item() / max(offsets.numel(), 1) if values.numel() else 0.0
    v_shift = verdict("dflash.target_shift", "loss", where, called,
                      hypothesis="slot j of the block at p is trained toward the target's prediction at p+j-1 (the "
                                 "data token at p+j)",
                      threshold=f"the same offset on >= {AGREEMENT:.0%} of trained slots",
                      measurement=f"trained slots pulled toward {name} at p+j{best:+d} ({share:.0%})",
                      expected="the target's prediction at p+j-1", measured={"source": name, "offset": best, "share": share},
                      exercised=exercised_scene(scene) + "; the loss gathered its own targets from the row")
    if share < AGREEMENT or best < -50:
        v_shift.reason = f"no single offset explains the recovered targets (best p+j{best:+d} on {share:.0%})"
        return v_shift, None
    wanted = -1 if name == "the target's predictions" else 0
    if best == wanted:
        v_shift.status, v_shift.observed = "match", f"slot j learns {name} at p+j{best:+d}"
    else:
        v_shift.status, v_shift.observed = "mismatch", f"slot j learns {name} at p+j{best:+d}"
        v_shift.fix = "Gather the teacher logits at p+j-1 for slot j (roll the target logits by one)."
    index = (torch.tensor(scene.anchors)[:, None] + torch.arange(b) + best).clamp(0, scene.seq_len - 1)
    teacher = scene.logits[0][index] if name == "the target's predictions" else \
        torch.nn.functional.one_hot(scene.input_ids[0][index], v).double() * 60.0 - 30.0
    return v_shift, teacher
