"""The drafter's attention as the observed step called it (inside the user's process; torch).

What a DFlash mask decides is which keys each block slot's query may weigh. Whatever a trainer writes, it reduces
to one of three calls, and each is watched here:
  * `scaled_dot_product_attention` (the functional entry HF, SpecForge-style and hand-written drafters share):
    the mask as called (boolean or additive, any broadcast shape) or `is_causal`;
  * softmax over the last dimension (`torch.softmax`, `Tensor.softmax`, `nn.functional.softmax`, which
    `nn.MultiheadAttention`'s weight path, eager attention and hand-written matmul + masked_fill call): the
    scores as applied, where a key is blocked exactly when its score was pushed to -inf (or far below its row's
    best) before the softmax;
  * `flex_attention`: its BlockMask's mask_mod, evaluated element by element (create_mask).
A call counts as the drafter's when its queries (or scores) carry gradient with grad mode on: the target runs
frozen or under no_grad, the drafter's projections are trained (whether or not a module wraps the call).
Attention none of these sees (a fused kernel, a softmax written as exp / sum) is judged from the gradient at the
target features instead (see `reached`), which can only find a leak.

Positions: the module call inside a trained module's forward that returns a (cos, sin) pair (cos^2 + sin^2 = 1)
is the drafter's rotary, whatever it is called; the integer tensor handed to it is the positions as applied.
Reading the positions handed to the call (rather than recovering angles from rotated q/k) holds for any rope
variant (scaling, partial rotary, mRoPE sections), where the angle per position is no longer a fixed formula.

Each pattern is summarised per (row, query): the first, last and count of visible keys in the context part
(the first Lk - Lq keys) and in the block part (the last Lq); identical patterns across layers are sent once.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))

MAX_CALLS = 64  # attention calls kept per step (the latest)
MAX_ROWS = 8  # batch rows summarised per pattern
MAX_QUERIES = 8192  # queries summarised per row
MAX_IDS = 65_536  # token ids kept per embedding call
BLOCKED_ADDITIVE = -1e3  # an additive mask value at or below this weighs a key by exp(-1000): blocked
BLOCKED_GAP = 1e3  # a score this far below its row's best weighs nothing after softmax
ROTARY_TOLERANCE = 3e-2


FLEX_MODULE = "torch.nn.attention.flex_attention"


class _ModuleWatch:
    """A meta path finder that lets one module import as usual, then hands it to `then`."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original, then = loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            original(module)
            try:
                then(module)
            except Exception:  # noqa: BLE001 - the observer never breaks the user's import
                pass

        loader.exec_module = exec_module
        return spec


def _site() -> str:
    """file:line of the user's code that made the current call (the first frame outside torch, installed packages
    and sleuth)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<") or "site-packages" in name or "dist-packages" in name or "/lib/python" in name
                or os.path.dirname(os.path.abspath(name)) == _HERE):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class AttentionWatch:
    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.stack: list[tuple[Any, bool]] = []  # (module ref, trains) of the forwards now running
        self.vocab: set[int] = set()
        self.tick = 0  # orders embedding, rotary and attention calls
        self.inside = False
        self.reset()

    def reset(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.patterns: dict[tuple, int] = {}
        self.summaries: list[dict[str, Any]] = []
        self.embedded: list[dict[str, Any]] = []
        self.layer_types: list[str] | None = None
        self.rotary: list[dict[str, Any]] = []
        self.trains: dict[int, bool] = {}
        self.special: dict[str, list[int]] = {}

    # --- instrumentation --------------------------------------------------------------------------------

    def patch(self) -> None:
        torch = self.torch
        from torch.nn import functional
        from torch.nn.modules import module as module_mod

        module_mod.register_module_forward_pre_hook(self.on_pre_forward)
        module_mod.register_module_forward_hook(self.on_forward, with_kwargs=True, always_call=True)
        watch = self
        original_embedding = getattr(functional, "embedding", None)
        if original_embedding is not None:
            # The token ids as embedded, whether through nn.Embedding (whose forward calls this) or a borrowed
            # weight applied functionally: the block's tokens, the mask token among them.
            def embedding(input, weight, *args, **kwargs):  # noqa: A002, ANN001, ANN202
                try:
                    watch.on_embedding(input, weight)
                except Exception:  # noqa: BLE001 - the observer never breaks the user's run
                    pass
                return original_embedding(input, weight, *args, **kwargs)

            embedding.__wrapped__ = original_embedding
            functional.embedding = embedding
        original_sdpa = getattr(functional, "scaled_dot_product_attention", None)
        if original_sdpa is not None:

            def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,  # noqa: ANN001, ANN202
                     *args, **kwargs):  # noqa: ANN002, ANN003
                try:
                    watch.on_sdpa(query, key, attn_mask, is_causal)
                except Exception:  # noqa: BLE001 - the observer never breaks the user's run
                    pass
                return original_sdpa(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)

            sdpa.__wrapped__ = original_sdpa
            functional.scaled_dot_product_attention = sdpa
        for owner, name in ((torch, "softmax"), (functional, "softmax"), (torch.Tensor, "softmax")):
            original = getattr(owner, name, None)
            if original is not None:
                setattr(owner, name, self.softmax(original))
        # flex attention lives in a module torch does not import by itself: wrapped when (if) the command imports it,
        # before its `from ... import flex_attention` binds the name.
        flex = sys.modules.get(FLEX_MODULE)
        if flex is not None:
            self.patch_flex(flex)
        else:
            sys.meta_path.insert(0, _ModuleWatch(FLEX_MODULE, self.patch_flex))

    def patch_flex(self, module: Any) -> None:
        original = getattr(module, "flex_attention", None)
        if original is None or getattr(original, "__sleuth__", False):
            return
        watch = self

        def flex_attention(query, key, value, *args, **kwargs):  # noqa: ANN001, ANN202
            try:
                block_mask = kwargs.get("block_mask", args[1] if len(args) > 1 else None)
                watch.on_flex(query, key, block_mask)
            except Exception:  # noqa: BLE001
                pass
            return original(query, key, value, *args, **kwargs)

        flex_attention.__wrapped__ = original
        flex_attention.__sleuth__ = True
        module.flex_attention = flex_attention

    def softmax(self, original: Any) -> Any:
        watch = self

        def softmax(input, *args, **kwargs):  # noqa: A002, ANN001, ANN202
            if watch.inside:  # one softmax reached through another entry (F.softmax calls Tensor.softmax)
                return original(input, *args, **kwargs)
            watch.inside = True
            try:
                out = original(input, *args, **kwargs)
            finally:
                watch.inside = False
            try:
                dim = kwargs.get("dim", args[0] if args else None)
                if isinstance(input, watch.torch.Tensor) and dim in (-1, input.dim() - 1):
                    watch.on_scores(input)
            except Exception:  # noqa: BLE001
                pass
            return out

        softmax.__wrapped__ = original
        return softmax

    def in_drafter(self) -> bool:
        return self.torch.is_grad_enabled() and any(trains for _ref, trains in self.stack)

    def on_pre_forward(self, module: Any, args: Any) -> None:
        self.stack.append((weakref.ref(module), self.trains_module(module)))

    def trains_module(self, module: Any) -> bool:
        key = id(module)
        found = self.trains.get(key)
        if found is None:
            found = self.trains[key] = any(p.requires_grad for p in module.parameters())
        return found

    def on_forward(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        while self.stack:  # a forward that raised left its entry: pop down to this module
            ref, _trains = self.stack.pop()
            if ref() is module:
                break
        try:
            self.after_forward(module, args, kwargs or {}, output)
        except Exception:  # noqa: BLE001
            pass

    def on_embedding(self, ids: Any, weight: Any) -> None:
        torch = self.torch
        if not (isinstance(ids, torch.Tensor) and isinstance(weight, torch.Tensor) and weight.dim() == 2):
            return
        self.vocab.add(int(weight.shape[0]))
        if not ids.is_floating_point() and 1 <= ids.dim() <= 2 and ids.numel() <= MAX_IDS:
            rows = ids.detach().reshape(-1, ids.shape[-1]).tolist()
            self.embedded = [*self.embedded[-7:], {"ids": rows, "order": self.next()}]

    def after_forward(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        torch = self.torch
        config = getattr(module, "config", None)
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(config, name, None) if config is not None else None
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, int) and item not in self.special.setdefault(name, []):
                    self.special[name].append(item)
        types = getattr(config, "layer_types", None) if config is not None else None
        if (isinstance(types, (list, tuple)) and types and all(isinstance(t, str) for t in types)
                and self.trains_module(module)):
            # The drafter's declared layer kinds: a sliding layer may be causal within the block (speculators'
            # default), and its window can be wider than the observed sequence, so its mask looks like a full one.
            self.layer_types = [str(t)[:40] for t in types[:256]]
        if isinstance(module, torch.nn.Embedding):
            self.vocab.add(int(module.num_embeddings))  # its ids were recorded by on_embedding
            return
        if not (self.in_drafter() and isinstance(output, (tuple, list)) and len(output) == 2):
            return
        cos, sin = output
        if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.shape == sin.shape
                and cos.is_floating_point() and cos.dim() >= 2 and cos.numel() > 0):
            return
        # cos^2 + sin^2 = 1 to the precision of the dtype the tables come in (bf16 keeps about 3 digits)
        if not bool(((cos.detach().float() ** 2 + sin.detach().float() ** 2) - 1).abs().max() < ROTARY_TOLERANCE):
            return
        given = [a for a in (*args, *kwargs.values())
                 if isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dim() >= 1]
        positions = given[-1] if given else None
        record: dict[str, Any] = {"module": weakref.ref(module), "shape": list(cos.shape), "order": self.next()}
        if positions is not None and positions.numel() <= MAX_IDS:
            record["positions"] = positions.detach().reshape(-1, positions.shape[-1]).tolist()
        self.rotary = [*self.rotary[-3:], record]

    # --- attention calls --------------------------------------------------------------------------------

    def compiling(self) -> bool:
        """Under torch.compile's tracing the record (host copies, Python loops) would break the graph: not observed."""
        return bool(getattr(getattr(self.torch, "compiler", None), "is_compiling", lambda: False)())

    def on_sdpa(self, query: Any, key: Any, mask: Any, is_causal: bool) -> None:
        torch = self.torch
        if self.compiling() or not (isinstance(query, torch.Tensor) and query.requires_grad
                                    and torch.is_grad_enabled()):
            return
        lq, lk = int(query.shape[-2]), int(key.shape[-2])
        lead = tuple(int(d) for d in query.shape[:-2])
        causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril() if is_causal else None
        if mask is None:
            how = "is_causal" if is_causal else "no mask (full attention)"
            plain = causal if causal is not None else torch.ones(lq, lk, dtype=torch.bool, device=query.device)
            self.record("scaled_dot_product_attention: " + how, 1, lambda _r: plain, lq, lk, True)
            return
        held = mask.detach()
        if held.dim() > len(lead) + 2:
            return
        while held.dim() < len(lead) + 2:
            held = held[None]
        # A view over the queries' leading dimensions: one (row, head) slice at a time is ever materialised.
        full = held.expand(*lead, lq, lk)
        additive = held.dtype != torch.bool
        rows, heads = self.rows_heads(lead)

        def visible(flat: int) -> Any:
            part = full[self.unravel(flat, lead)] if lead else full
            seen = part > BLOCKED_ADDITIVE if additive else part
            return seen & causal if causal is not None else seen

        # heads agree when the mask does not vary over them (broadcast), or, where it does, on the first row
        agree = all(d == 1 for d in held.shape[1:len(lead)]) or all(
            bool((visible(h) == visible(0)).all()) for h in range(1, heads))
        how = ("additive mask" if additive else "boolean mask") + (" and is_causal" if is_causal else "")
        self.record("scaled_dot_product_attention: " + how, rows, lambda r: visible(r * heads), lq, lk, agree)

    def on_flex(self, query: Any, key: Any, block_mask: Any) -> None:
        """The mask a BlockMask stands for, element by element: its mask_mod evaluated over (row, query, key) for
        the first head, one row at a time (a score_mod that adds -inf is not seen)."""
        torch = self.torch
        if self.compiling() or not (isinstance(query, torch.Tensor) and query.requires_grad and torch.is_grad_enabled()):
            return
        lq, lk = int(query.shape[-2]), int(key.shape[-2])
        rows = int(query.shape[0]) if query.dim() == 4 else 1
        mask_mod = getattr(block_mask, "mask_mod", None)
        if mask_mod is None:
            plain = torch.ones(lq, lk, dtype=torch.bool)
            self.record("flex_attention: no block mask (full attention)", 1, lambda _r: plain, lq, lk, True)
            return
        from torch.nn.attention.flex_attention import create_mask

        def visible(row: int) -> Any:
            with torch.no_grad():
                return create_mask(lambda b, h, q, k: mask_mod(b + row, h, q, k), 1, 1, lq, lk,
                                   device=query.device)[0, 0]

        self.record("flex_attention: the block mask's mask_mod", rows, visible, lq, lk, True)

    def on_scores(self, scores: Any) -> None:
        if self.compiling() or not (scores.is_floating_point() and scores.dim() >= 2 and scores.requires_grad
                                    and self.torch.is_grad_enabled()):
            return
        if scores.shape[-1] in self.vocab:  # a softmax over the vocabulary (a loss), not over keys
            return
        lq, lk = int(scores.shape[-2]), int(scores.shape[-1])
        lead = tuple(int(d) for d in scores.shape[:-2])
        rows, heads = self.rows_heads(lead)

        def visible(flat: int) -> Any:
            part = (scores[self.unravel(flat, lead)] if lead else scores).detach()
            return (part > part.amax(-1, keepdim=True) - BLOCKED_GAP) & (part != float("-inf"))

        agree = all(bool((visible(h) == visible(0)).all()) for h in range(1, min(heads, 8)))
        self.record("softmax over scores", rows, lambda r: visible(r * heads), lq, lk, agree)

    def rows_heads(self, lead: tuple[int, ...]) -> tuple[int, int]:
        """Batch rows and heads among the leading dimensions, which are (batch, heads) in that order: with two or
        more, the first is the batch; with one (batch and heads merged), the rows of the last embedding call."""
        total = 1
        for d in lead:
            total *= d
        rows = lead[0] if len(lead) >= 2 else self.batch_rows(total)
        return max(rows, 1), max(1, total // max(rows, 1))

    @staticmethod
    def unravel(flat: int, lead: tuple[int, ...]) -> tuple[int, ...]:
        index = []
        for d in reversed(lead):
            index.append(flat % d)
            flat //= d
        return tuple(reversed(index))

    def record(self, how: str, rows: int, visible: Any, lq: int, lk: int, heads_agree: bool) -> None:
        """One attention call: `visible(r)` is row r's (queries x keys) visibility for its first head."""
        split = max(0, lk - lq)
        summary = {"rows": [self.summarise(visible(r)[:MAX_QUERIES].cpu(), split) for r in range(min(rows, MAX_ROWS))]}
        key = tuple(tuple(tuple(v) for v in row) for row in summary["rows"])
        if key not in self.patterns:
            self.patterns[key] = len(self.summaries)
            self.summaries.append(summary)
        stack = [ref() for ref, _trains in self.stack[-6:]]
        self.calls = [*self.calls[-(MAX_CALLS - 1):], {
            "how": how, "site": _site(), "pattern": self.patterns[key], "lq": lq, "lk": lk, "split": split,
            "batch_rows": rows, "heads_agree": heads_agree,
            "stack": [weakref.ref(m) for m in stack if m is not None], "order": self.next()}]

    def next(self) -> int:
        self.tick += 1
        return self.tick

    def batch_rows(self, leading: int) -> int:
        """How many batch rows the leading dimensions hold: the rows of the last embedding call, when they
        divide it (a mask broadcast over the batch is one row)."""
        if self.embedded:
            rows = len(self.embedded[-1]["ids"])
            if rows and leading % rows == 0:
                return rows
        return 1 if leading else 0

    def summarise(self, visible: Any, split: int) -> list[list[int]]:
        """Per query: [context first, context end (last + 1), context count, block first, block end, block count],
        block indices counted from the start of the block part; -1 and 0 where nothing is visible."""
        torch = self.torch
        out = []
        for part in (visible[:, :split], visible[:, split:]):
            count = part.sum(-1)
            width = part.shape[-1]
            if width == 0:
                out += [torch.full_like(count, -1), torch.zeros_like(count), count]
                continue
            first = part.int().argmax(-1)
            last = width - 1 - part.flip(-1).int().argmax(-1)
            out += [torch.where(count > 0, first, -1), torch.where(count > 0, last + 1, 0), count]
        return torch.stack(out, -1).tolist()

    # --- the observation --------------------------------------------------------------------------------

    def reached(self, gathered: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Which positions of the target features reached the loss (their gradient, per batch row and position, is
        not zero): a key that no query weighs passes exactly zero gradient back, whatever computed the attention."""
        for record in reversed(gathered):
            grad = getattr(record.get("leaf"), "grad", None)
            if grad is None or grad.dim() < 2:
                continue
            per = grad.detach().abs().reshape(*grad.shape[:2], -1).sum(-1) if grad.dim() >= 3 else \
                grad.detach().abs().sum(-1)[None]
            if per.numel() > MAX_IDS:
                return None
            return {"site": record.get("site"), "length": int(per.shape[-1]), "rows": (per > 0).int().tolist()}
        return None

    def describe(self, names: dict[str, dict[int, Any]], gathered: list[dict[str, Any]] = ()) -> dict[str, Any]:
        # Copies: the observation may be described twice (at the observed step, and again at exit).
        calls = []
        for call in map(dict, self.calls):
            modules = [ref() for ref in call.pop("stack")]
            modules = [m for m in modules if m is not None]
            place = next((names["in_list"].get(id(m)) for m in reversed(modules) if id(m) in names["in_list"]), None)
            inner = modules[-1] if modules else None
            call["module"] = (names["modules"].get(id(inner), type(inner).__name__) if inner is not None
                              else call["site"])
            if place is not None:
                call.update(layer=place[0], layers=place[1], stack=place[2])
            calls.append(call)
        rotary = []
        for record in map(dict, self.rotary):
            module = record.pop("module")()
            record["module"] = names["modules"].get(id(module), type(module).__name__) if module is not None else "?"
            rotary.append(record)
        return {"calls": calls, "patterns": self.summaries, "embedded": self.embedded, "rotary": rotary,
                "layer_types": self.layer_types,
                "special_ids": self.special, "features_reached": self.reached(list(gathered))}
