"""`sleuth probe init`: a probe entry for someone's trainer, wired to the pieces sleuth located.

The entry (`probe_entry.py`) implements the protocol (sleuth/probes/protocol.py) by calling the trainer's own
functions: each call is written with the arguments the probe child bound when it called that piece (so the
shapes are ones the code accepts), or, when the pieces were only read statically (`--no-run`), with the
arguments the roles suggest. Every step sleuth could not wire is a `_todo("...")` that raises
NotImplementedError with what is missing and why: a protocol method that reaches one is reported "not
provided by the entry" by the probes that need it, and the others still run. `sleuth probe check` then says,
one line per method, what is still wrong.
"""

from __future__ import annotations

import json
import keyword
import textwrap
from pathlib import Path
from typing import Any

from sleuth.probes.binding import COMMON_VOCABULARY, LOSS_VOCABULARY, Role, RoleBook

# role key -> variant -> the expression the entry passes (inside draft_logits / loss: `batch`, `hooks`, `self`)
_ROW = {"[N, ...]": "{x}", "[...] (one row)": "{x}[0]"}
ROLE_EXPRESSIONS: dict[str, dict[str, str]] = {
    "anchors": {"[N, A]": "batch.anchors", "[A]": "batch.anchors[0]", "a list": "batch.anchors[0].tolist()"},
    "anchors_per_query": {"[N, A*B]": "batch.anchors.repeat_interleave(BLOCK_SIZE, dim=1)",
                          "[A*B]": "batch.anchors[0].repeat_interleave(BLOCK_SIZE)"},
    "anchor_valid": {"[N, A] all true": "batch.anchor_valid", "[A] all true": "batch.anchor_valid[0]"},
    "num_anchors": {"*": "batch.anchors.shape[1]"},
    "block_size": {"*": "BLOCK_SIZE"},
    "seq_len": {"*": "batch.input_ids.shape[1]"},
    "q_len": {"*": "batch.anchors.shape[1] * BLOCK_SIZE"},
    "kv_len": {"*": "batch.input_ids.shape[1] + batch.anchors.shape[1] * BLOCK_SIZE"},
    "doc_ids": {k: v.format(x="batch.doc_ids") for k, v in _ROW.items()},
    "doc_of_query": {"[N, A*B]": "batch.doc_ids.gather(1, batch.anchors).repeat_interleave(BLOCK_SIZE, dim=1)",
                     "[A*B]": "batch.doc_ids[0][batch.anchors[0]].repeat_interleave(BLOCK_SIZE)"},
    "cu_seqlens": {"*": "_cu_seqlens(batch.doc_ids[0])"},
    "position_ids": {k: v.format(x="batch.position_ids") for k, v in _ROW.items()},
    "input_ids": {k: v.format(x="batch.input_ids") for k, v in _ROW.items()},
    "loss_mask": {k: v.format(x="batch.loss_mask") for k, v in _ROW.items()},
    "target_logits": {"[N, S, V]": "batch.logits", "[S, V]": "batch.logits[0]"},
    "hidden_states": {"L+1 x [N, S, H]": "batch.hidden_states", "L+1 x [S, H]": "tuple(h[0] for h in batch.hidden_states)"},
    "layer_ids": {"*": "LAYER_IDS"},
    "lm_head": {"*": "self.lm_head"},
    "final_norm": {"*": "self.final_norm"},
    "embed": {"*": "self.embed"},
    "mask_token_id": {"*": "self.target.mask_token_id"},
    "vocab_size": {"*": "self.target.vocab_size"},
    "hidden_size": {"*": "self.target.hidden_size"},
    "num_heads": {"*": "self.target.num_heads"},
    "num_kv_heads": {"*": "self.target.num_kv_heads"},
    "head_dim": {"*": "self.target.head_dim"},
    "intermediate_size": {"*": "self.target.intermediate_size"},
    "device": {"*": '"cpu"'},
    "dtype": {"*": "torch.float32"},
    "generator": {"*": "torch.Generator().manual_seed(0)"},
    "gamma": {"*": "GAMMA"},
    # the loss's own inputs
    "draft_logits": {"[A, B, V]": "logits[0]", "[N, A, B, V]": "logits", "[A*B, V]": "logits[0].flatten(0, 1)",
                     "[N, A*B, V]": "logits.flatten(1, 2)"},
    # the targets the trainer's own teacher step returns, handed over as its training step hands them
    "teacher_slots": {"*": "teacher"},
    "teacher_probs": {"*": "teacher"},
    "labels": {"*": "teacher"},
    "weights": {"*": "weights"},
    "slot_valid": {"[N, A] all true": "batch.anchor_valid", "[A] all true": "batch.anchor_valid[0]",
                   "[A, B] ones": "batch.anchor_valid[0, :, None].float().expand(-1, BLOCK_SIZE)"},
    # constructors
    "draft_layers": {"*": "DRAFT_LAYERS"},
    "num_features": {"*": "len(LAYER_IDS)"},
    "hf_config": {"*": "target.qwen3_config(num_hidden_layers=DRAFT_LAYERS)"},
}
# A drafter forward's parameters, by name: which local value of draft_logits they take.
FORWARD_INPUTS = {
    "x": {"x", "h", "hidden", "hidden_states", "inputs_embeds", "block", "block_emb", "emb", "embeds", "tgt", "block_embeddings",
          "noise_embedding", "block_hidden", "draft_hidden"},
    "ids": {"block_ids", "input_ids", "ids", "tokens", "block_tokens", "draft_ids"},
    "features": {"feats", "features", "context", "ctx", "target_hidden", "memory", "aux", "aux_hidden", "target_feats",
                 "hidden_context", "cond", "context_features", "target_hidden_states"},
    "positions": {"pos", "positions", "position_ids", "pos_ids", "rope_pos"},
    "mask": {"mask", "attn_mask", "attention_mask", "bias", "attn_bias", "block_mask", "allowed", "blocked", "visible"},
}


def _alias(module: str, taken: set[str]) -> str:
    base = module.rsplit(".", 1)[-1]
    alias = base if base not in taken and not keyword.iskeyword(base) else module.replace(".", "_")
    taken.add(alias)
    return alias


def _literal(text: str) -> str:
    """A double-quoted Python string literal holding `text`, whatever it holds (quotes, backslashes, a
    message of the code under diagnosis): JSON's string escapes are Python's."""
    return json.dumps(text)


class Writer:
    """The entry's source, assembled from the located plan and (when the child ran) its measured pieces."""

    def __init__(self, located: dict[str, Any], measured: dict[str, Any] | None, code: Path, entry_name: str) -> None:
        self.located, self.code, self.entry_name = located, code, entry_name
        self.reports = {(r["kind"], r["where"]): r for r in (measured or {}).get("pieces", [])}
        self.measured = measured is not None
        self.aliases: dict[str, str] = {}
        self.taken: set[str] = {"torch", "nn", "SimpleNamespace", "Any"}
        self.status: dict[str, str] = {}  # method -> "wired" or what is missing
        self.settings = {name: found[0][0] for name, found in (located.get("settings") or {}).items()
                         if len({repr(v) for v, _w in found}) == 1}

    # --- which piece does each step ------------------------------------------------------------------------

    def piece(self, kind: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The piece of this kind to call, with its binding: the measured one first, else the first located."""
        pieces = [p for p in self.located.get("pieces") or [] if p["kind"] == kind]
        for piece in pieces:
            report = self.reports.get((kind, f"{piece['path']}:{piece['line']}"))
            if report and report.get("outcome") == "measured":
                return piece, report.get("binding") or {}
        if not self.measured and pieces:
            return pieces[0], {}
        return None

    def why_not(self, kind: str) -> str:
        missing = (self.located.get("missing") or {}).get(kind)
        tried = [r for (k, _w), r in self.reports.items() if k == kind and r.get("outcome") in ("not bound", "failed")]
        if tried:
            return f"{tried[0]['qualname']} ({tried[0]['where']}) could not be called: {tried[0]['detail'][:160]}"
        return missing or "sleuth found no function that does it alone"

    def ref(self, piece: dict[str, Any]) -> str:
        module = piece["module"]
        if module not in self.aliases:
            self.aliases[module] = _alias(module, self.taken)
        alias = self.aliases[module]
        if piece.get("owner"):
            cls = (piece.get("concrete") or [piece["owner"]])[0]
            cls_module = (piece.get("class_modules") or {}).get(cls, module)
            if cls_module not in self.aliases:
                self.aliases[cls_module] = _alias(cls_module, self.taken)
            owner = f"{self.aliases[cls_module]}.{cls}"
            return owner if piece["name"] == "__init__" else f"_instance({owner}).{piece['name']}"
        return f"{alias}.{piece['qualname']}"

    def call(self, piece: dict[str, Any], binding: dict[str, Any], extra: dict[str, str] | None = None) -> str:
        """`module.function(param=expr, ...)` from the binding; a parameter without an expression becomes a _todo."""
        args = []
        for param in piece["params"]:
            name = param["name"]
            if param["kind"] in ("var_positional", "var_keyword"):
                continue
            expr = (extra or {}).get(name) or self.expression(binding.get(name), name, piece)
            if expr is None:
                continue  # its default
            args.append(f"{name}={expr}")
        return f"{self.ref(piece)}({', '.join(args)})"

    def expression(self, meta: dict[str, Any] | None, name: str, piece: dict[str, Any]) -> str | None:
        if meta is None:
            passed = (piece.get("passed") or {}).get(name)
            if passed is not None:
                return repr(passed)
            guessed = self._guess(name, piece["kind"])
            if guessed is not None:
                return guessed
            param = next(p for p in piece["params"] if p["name"] == name)
            if param.get("has_default"):
                return None
            return f'_todo("pass `{name}` as {piece["qualname"]} gets it in training")'
        if meta.get("default"):
            return None
        if "passed" in meta:
            return repr(meta["passed"])
        if "config" in meta:
            owner = self.aliases.setdefault(piece["module"], _alias(piece["module"], self.taken))
            return f"{owner}.{meta['config']}()"
        if "namespace" in meta:
            fields = ", ".join(f"{a}={self.option(a)}" for a in meta["namespace"])
            return f"SimpleNamespace({fields})"
        role, variant = meta.get("role"), meta.get("variant", "*")
        table = ROLE_EXPRESSIONS.get(role or "", {})
        return table.get(variant) or table.get("*") or f'_todo("pass `{name}` ({role})")'

    def _guess(self, name: str, kind: str) -> str | None:
        """Without a measured call (`--no-run`): the role the parameter's name asks for, in its first shape,
        marked for the reader to check."""
        vocabulary = {**(LOSS_VOCABULARY if kind == "loss" else {}), **COMMON_VOCABULARY}
        book = RoleBook({key: Role(key, [("*", None)]) for key in vocabulary}, vocabulary)
        role = book.role_for(name)
        if role is None:
            return None
        table = ROLE_EXPRESSIONS.get(role.key, {})
        expr = table.get("*") or next(iter(table.values()), None)
        return f"{expr}  # check: the shape {name} takes" if expr and "\n" in expr else expr

    def option(self, attr: str) -> str:
        if attr in ("block_size", "block", "block_len", "blk"):
            return "BLOCK_SIZE"
        if attr in ("gamma", "loss_decay_gamma", "decay_gamma"):
            return "GAMMA"
        if attr in ("mask_token_id", "mask_id"):
            return "self.target.mask_token_id"
        if attr in self.settings:
            return repr(self.settings[attr])
        return f'_todo("the option `{attr}`")'

    # --- the file --------------------------------------------------------------------------------------------

    def source(self) -> str:
        block = self._first_setting(("block_size", "BLOCK_SIZE", "block", "BLOCK", "B", "block_len"))
        gamma = self._first_setting(("gamma", "loss_decay_gamma", "decay_gamma", "GAMMA"))
        packs = self.located.get("packs_documents")
        methods = {name: getattr(self, f"_{name}")() for name in
                   ("describe", "build", "parameters", "draft_logits", "loss", "train_step", "draft_layers", "rotary")}
        rule = self.piece("layer_ids")
        k_run = next((v for v in (rule[0].get("passed") or {}).values() if isinstance(v, int)), 3) if rule else 3
        fixed = self._fixed_layer_ids()
        depth = max(fixed[1]) + 3 if fixed and not rule else 8  # a fixed list was chosen for a target of L = max + 3
        namespace = next((meta.get("namespace") for meta in (rule[1] if rule else {}).values()
                          if isinstance(meta, dict) and "namespace" in meta), None)
        if rule and namespace and rule[0]["params"]:
            depth_words = ("num_hidden_layers", "num_layers", "n_layers", "num_target_layers", "target_depth", "depth")
            fields = ", ".join(f"{a}={'NUM_TARGET_LAYERS' if a in depth_words else k_run}" for a in namespace)
            layer_line = (f"LAYER_IDS = {self.ref(rule[0])}({rule[0]['params'][0]['name']}=SimpleNamespace({fields}))"
                          "  # the trainer's own rule, at the probe target's depth")
        elif rule and len(rule[0]["params"]) >= 2:
            layer_line = (f"LAYER_IDS = {self.ref(rule[0])}({rule[0]['params'][0]['name']}=NUM_TARGET_LAYERS, "
                          f"{rule[0]['params'][1]['name']}={k_run})  # the trainer's own rule, at the probe target's depth")
        elif fixed:
            layer_line = (f"LAYER_IDS = {fixed[1]!r}  # `{fixed[0]}`: a fixed list, so the probe's target is as deep as the "
                          "list is for")
        elif rule:
            # A rule with no parameter to hand the depth to (a method reading its object's fields, a closure):
            # only the user knows which object it runs on, so the line says where the rule is and stops there.
            layer_line = (f"LAYER_IDS = None  # TODO(sleuth): call your trainer's rule {self.ref(rule[0])} as the "
                          "trainer does, for an L = NUM_TARGET_LAYERS target (it takes no argument sleuth could "
                          "bind the depth to)")
        else:
            layer_line = ("LAYER_IDS = None  # TODO(sleuth): the ids your trainer selects for an L = NUM_TARGET_LAYERS "
                          f"target ({self.why_not('layer_ids')[:90]})")
        imports = "\n".join(f"import {m} as {a}" if a != m else f"import {m}" for m, a in sorted(self.aliases.items()))
        summary = "\n".join(f"    {m:<13} {s}" for m, s in self.status.items())
        header = (
            f'"""Probe entry for {self.code}, written by `sleuth probe init` from the pieces sleuth located'
            f'{" and called" if self.measured else ""}.\n\n'
            "What is wired (methods that reach a TODO raise NotImplementedError: the probes that need them report\n"
            '`unknown` "not provided by the entry", the others run):\n'
            f"{summary}\n\n"
            "Fill in every TODO(sleuth), then check and run it:\n"
            f"    sleuth probe check --probe-entry {self.entry_name}:subject --code {self.code}\n"
            f"    sleuth diagnose --code {self.code} --probe-entry {self.entry_name}:subject\n"
            "The protocol (call order, shapes, hooks) is documented in sleuth/probes/protocol.py.\n"
            '"""\n\n'
            "from __future__ import annotations\n\n"
            "from types import SimpleNamespace\n"
            "from typing import Any\n\n"
            "import torch\n"
            "from torch import nn\n\n"
        )
        body = f'''{imports}

BLOCK_SIZE = {block if block is not None else 'None  # TODO(sleuth): the block size your trainer uses'}
GAMMA = {gamma if gamma is not None else 'None  # the loss decay gamma, if your trainer has one'}
NUM_TARGET_LAYERS = {depth}  # the probe's synthetic target; the layer rule is called with it
DRAFT_LAYERS = 2  # a tiny drafter
{layer_line}


def _todo(what: str) -> Any:
    raise NotImplementedError(f"TODO(sleuth): {{what}}")


def _instance(cls: type) -> Any:
    """An object of the trainer's class without running its __init__ (the entry only calls methods that need
    the class's own attributes; set any others it reads here)."""
    return object.__new__(cls)


def _cu_seqlens(doc_ids: torch.Tensor) -> torch.Tensor:
    """Document offsets [0, end_0, end_1, ...] of one packed row."""
    starts = torch.nonzero(torch.diff(doc_ids, prepend=doc_ids[:1] - 1)).flatten()
    return torch.cat([starts, torch.tensor([doc_ids.numel()])]).to(torch.int32)


class _Hooked:
    """While active, the module's output is replaced by `fn(output)` (the protocol's hooks, on the drafter's
    own embedding / head modules)."""

    def __init__(self, module: nn.Module | None, fn: Any) -> None:
        self.module, self.fn, self.handle = module, fn, None

    def __enter__(self) -> _Hooked:
        if self.module is not None:
            self.handle = self.module.register_forward_hook(lambda _m, _a, out: self.fn(out))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.handle is not None:
            self.handle.remove()


class Subject:
{textwrap.indent(chr(10).join(methods.values()), "    ")}

def subject(context: dict[str, Any]) -> Subject:
    """The entry point: `--probe-entry {self.entry_name}:subject`."""
    return Subject()
'''
        del packs
        return header + body

    def _fixed_layer_ids(self) -> tuple[str, list[int]] | None:
        """A fixed list of layer ids the code sets (`TARGET_LAYER_IDS = [1, 9, 17]`, a config field's default)."""
        for name, value in self.settings.items():
            if set(name.lower().split("_")) & {"layer", "layers", "taps"} and isinstance(value, list) and value \
                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
                return name, value
        return None

    def _first_setting(self, names: tuple[str, ...]) -> Any:
        for name in names:
            value = self.settings.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
        return None

    def _describe(self) -> str:
        self.status["describe"] = "wired" if self._first_setting(("block_size", "BLOCK_SIZE", "block", "BLOCK", "B")) \
            else "TODO: BLOCK_SIZE"
        packs = self.located.get("packs_documents")
        rows = '"packed"' if packs else "1"
        note = "" if packs else "  # TODO(sleuth): \"packed\" if your rows hold several documents"
        return f'''def describe(self) -> dict[str, Any]:
    info = {{"name": "{self.code.name} (sleuth probe init)", "protocol": 1, "block_size": BLOCK_SIZE,
            "num_target_layers": NUM_TARGET_LAYERS, "layer_id_convention": "zlab",
            "documents_per_row": {rows},
            "max_rows": 1}}{note}  # the calls below were bound on one-row batches (some pass row 0 alone)
    if LAYER_IDS is not None:
        info["layer_ids"] = list(LAYER_IDS)
    return info
'''

    def _drafter_piece(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        return self.piece("drafter") or next(
            ((p, {}) for p in self.located.get("pieces") or [] if p["kind"] == "drafter"), None)

    def _build(self) -> str:
        drafter = self._drafter_piece()
        lines = ["def build(self, target: Any) -> None:", "    self.target = target",
                 "    # the target's embeddings, lm_head and final norm as frozen modules sharing its tensors (not copies)",
                 "    self.embed = nn.Embedding.from_pretrained(target.embed_weight, freeze=True)",
                 "    self.embed.weight = nn.Parameter(target.embed_weight, requires_grad=False)",
                 "    self.lm_head = nn.Linear(target.hidden_size, target.vocab_size, bias=False)",
                 "    self.lm_head.weight = nn.Parameter(target.lm_head_weight, requires_grad=False)",
                 "    self.final_norm = nn.RMSNorm(target.hidden_size, eps=target.rms_norm_eps)",
                 "    self.final_norm.weight = nn.Parameter(target.norm_weight, requires_grad=False)"]
        if drafter is None:
            lines.append('    self.drafter = _todo("build your drafter for `target` (sleuth found no module class for it)")')
            self.status["build"] = "TODO: the drafter"
        else:
            piece, binding = drafter
            info = piece.get("module_info") or {}
            lines.append(f"    # {info.get('class', piece['qualname'])} ({piece['path']}:{piece['line']}), with the target's sizes")
            lines.append(f"    self.drafter = {self._constructor(piece, binding)}")
            if info.get("embed") or info.get("head"):
                lines.append("    # it holds its own embedding / head: load the target's into them, as your trainer does")
                for attr, source in (("embed", "target.embed_weight"), ("head", "target.lm_head_weight")):
                    if info.get(attr):
                        lines.append(f"    self.drafter.{info[attr]}.weight.data.copy_({source})")
            self.status["build"] = "wired" if "_todo(" not in lines[-1] else "TODO: drafter arguments"
        return "\n".join(lines) + "\n"

    def _constructor(self, piece: dict[str, Any], binding: dict[str, Any]) -> str:
        if binding:
            return self.call({**piece, "params": [p for p in piece["params"]]}, binding)
        args = []
        for param in piece["params"]:
            if param["kind"] in ("var_positional", "var_keyword") or param.get("has_default"):
                continue
            args.append(f"{param['name']}={self._size_for(param['name'])}")
        return f"{self.ref(piece)}({', '.join(args)})"

    @staticmethod
    def _size_for(name: str) -> str:
        lower = name.lower()
        table = {("vocab", "vocab_size", "v", "n_vocab"): "target.vocab_size",
                 ("hidden", "hidden_size", "d", "d_model", "dim", "h"): "target.hidden_size",
                 ("heads", "num_heads", "n_heads", "num_attention_heads"): "target.num_heads",
                 ("num_kv_heads", "n_kv", "kv_heads"): "target.num_kv_heads",
                 ("head_dim", "hd"): "target.head_dim", ("ffn", "intermediate_size", "mlp", "d_ff"): "target.intermediate_size",
                 ("layers", "num_layers", "n_layers", "depth"): "DRAFT_LAYERS",
                 ("taps", "num_taps", "n_feat", "num_features", "k", "n_taps", "num_context_layers", "num_target_layers",
                  "n_context_layers", "num_selected_layers"): "len(LAYER_IDS or [1, 3, 5])",
                 ("config", "cfg", "target_config"): "target.qwen3_config(num_hidden_layers=DRAFT_LAYERS)"}
        for names, expr in table.items():
            if lower in names:
                return expr
        return f'_todo("the drafter\'s `{name}`")'

    def _parameters(self) -> str:
        self.status["parameters"] = "wired"
        return '''def parameters(self) -> dict[str, Any]:
    return dict(self.drafter.named_parameters())
'''

    def _step(self, kind: str, target: str, indent: str = "    ") -> str:
        found = self.piece(kind)
        if found is None:
            return f'{indent}{target} = _todo({_literal(f"{kind}: {self.why_not(kind)[:150]}")})'
        piece, binding = found
        line = f"{indent}{target} = {self.call(piece, binding)}  # {piece['path']}:{piece['line']}"
        for site in (piece.get("call_sites") or [])[:1]:
            # what the training step does with it (a negation, a reshape) is for the entry to repeat
            line += f"\n{indent}# your training step: {site}"
        return line

    def _draft_logits(self) -> str:
        drafter = self._drafter_piece()
        info = (drafter[0].get("module_info") or {}) if drafter else {}
        forward = info.get("forward") or []
        lines = ["def draft_logits(self, batch: Any, hooks: Any) -> torch.Tensor:",
                 "    n, a = batch.anchors.shape",
                 "    ids = torch.full((n, a, BLOCK_SIZE), self.target.mask_token_id)",
                 "    ids[..., 0] = batch.input_ids.gather(1, batch.anchors)  # slot 0: the anchor; the others: the mask token",
                 "    ids = ids.view(n, a * BLOCK_SIZE)  # block-major: token t is slot t % B of block t // B"]
        uses = {name: next((k for k, words in FORWARD_INPUTS.items() if name.lower() in words), None) for name in forward}
        if any(u == "x" for u in uses.values()) or not forward:
            lines.append("    x = hooks.block_embeddings(self.embed(ids))  # [N, A*B, H]")
        if any(u == "features" for u in uses.values()) or not forward:
            gather = self.piece("features")
            lines.append(self._step("features", "features") if gather else
                         '    features = torch.cat([batch.hidden_states[i + 1] for i in LAYER_IDS], dim=-1)  '
                         "# TODO(sleuth): check: select the layers as your trainer does")
        if any(u == "mask" for u in uses.values()) or not forward:
            lines.append(self._step("mask", "mask"))
        if any(u == "positions" for u in uses.values()) or not forward:
            lines.append(self._step("positions", "block_positions"))
            lines.append("    positions = torch.cat([batch.position_ids, block_positions.reshape(n, -1)], dim=1)  "
                         "# check: sleuth joins the context's and the block's positions")
        if not forward:
            lines.append('    hidden = _todo("call your drafter on x, features, positions and mask")')
            self.status["draft_logits"] = "TODO: the drafter's call"
        else:
            missing = [name for name, use in uses.items() if use is None]
            args = ", ".join(f"{name}={dict(x='x', ids='ids', features='features', positions='positions', mask='mask').get(use)}"
                             for name, use in uses.items() if use is not None)
            if missing:
                lines.append(f'    hidden = _todo("call {info.get("class")}.forward({", ".join(forward)}) '
                             f'({info.get("forward_where")}): sleuth could not tell what {", ".join(missing)} take")')
                self.status["draft_logits"] = f"TODO: the drafter's {', '.join(missing)}"
            else:
                call = f"self.drafter({args})  # {info.get('class')}.forward ({info.get('forward_where')})"
                if info.get("returns_logits"):
                    embed = f"self.drafter.{info['embed']}" if info.get("embed") and "ids" in uses.values() else "None"
                    lines.append(f"    with _Hooked({embed}, hooks.block_embeddings), "
                                 f"_Hooked(self.drafter.{info.get('head', 'lm_head')}, hooks.draft_logits):")
                    lines.append(f"        logits = {call}")
                    lines.append("    return logits.view(n, a, BLOCK_SIZE, -1)")
                    self.status["draft_logits"] = "wired" if not self._has_todo(lines) else "TODO: see the _todo calls"
                    return "\n".join(lines) + "\n"
                lines.append(f"    hidden = {call}")
                self.status["draft_logits"] = "wired" if not self._has_todo(lines) else "TODO: see the _todo calls"
        lines.append("    return hooks.draft_logits(self.lm_head(hidden)).view(n, a, BLOCK_SIZE, -1)")
        return "\n".join(lines) + "\n"

    @staticmethod
    def _has_todo(lines: list[str]) -> bool:
        return any("_todo(" in line for line in lines)

    def _loss(self) -> str:
        lines = ["def loss(self, batch: Any, hooks: Any) -> torch.Tensor:",
                 "    logits = self.draft_logits(batch, hooks)  # [N, A, B, V], through hooks.draft_logits"]
        found = self.piece("loss")
        if found is None:
            lines.append(f'    return _todo({_literal("the loss: " + self.why_not("loss")[:150])})')
            self.status["loss"] = "TODO: " + self.why_not("loss")[:80]
            return "\n".join(lines) + "\n"
        piece, binding = found
        roles = {meta.get("role") for meta in binding.values() if isinstance(meta, dict)}
        if not binding:  # read statically: the roles the parameters' names ask for
            vocabulary = {**LOSS_VOCABULARY, **COMMON_VOCABULARY}
            book = RoleBook({key: Role(key, [("*", None)]) for key in vocabulary}, vocabulary)
            roles = {getattr(book.role_for(p["name"]), "key", None) for p in piece["params"]}
        if roles & {"teacher_slots", "teacher_probs", "labels"}:
            lines.append(self._step("teacher", "teacher"))
        if "weights" in roles:
            lines.append(self._step("weights", "weights"))
        lines.append(f"    return {self.call(piece, binding)}  # {piece['path']}:{piece['line']}")
        self.status["loss"] = "wired" if not self._has_todo(lines) else "TODO: see the _todo calls"
        return "\n".join(lines) + "\n"

    def _train_step(self) -> str:
        found = self.piece("optimizer")
        lines = ["def train_step(self, batch: Any) -> None:"]
        if found is None or found[0]["name"] == "__init__" or found[0].get("owner"):
            located = found or next(((p, {}) for p in self.located.get("pieces") or [] if p["kind"] == "optimizer"), None)
            hint = self.why_not("optimizer") if located is None else \
                f"build the optimizer over self.drafter as {located[0]['qualname']} ({located[0]['path']}:{located[0]['line']}) does"
            lines.append(f'    optimizer = _todo({_literal(hint[:150])})')
            self.status["train_step"] = "TODO: the optimizer"
        else:
            piece, binding = found
            drafter_params = {p["name"]: "self.drafter" for p in piece["params"]
                              if (binding.get(p["name"]) or {}).get("role") == "drafter" or (not binding and p["name"] in
                                  ("drafter", "model", "draft", "net", "module", "draft_model", "student", "m"))}
            lines.append(f"    optimizer = {self.call(piece, binding, drafter_params)}"
                         f"  # {piece['path']}:{piece['line']}")
            self.status["train_step"] = "wired" if "_todo(" not in lines[-1] else "TODO: see the _todo calls"
        lines += ["    identity = SimpleNamespace(block_embeddings=lambda x: x, draft_logits=lambda x: x)",
                  "    optimizer.zero_grad()", "    self.loss(batch, identity).backward()", "    optimizer.step()"]
        return "\n".join(lines) + "\n"

    def _draft_layers(self) -> str:
        drafter = self._drafter_piece()
        attr = ((drafter[0].get("module_info") or {}).get("layers") if drafter else None)
        self.status["draft_layers"] = "wired" if attr else "TODO: the layers"
        body = f"    return list(self.drafter.{attr})" if attr else \
            '    return _todo("the drafter\'s decoder layers, in order")'
        return "def draft_layers(self) -> list[nn.Module]:\n" + body + "\n"

    def _rotary(self) -> str:
        drafter = self._drafter_piece()
        attr = ((drafter[0].get("module_info") or {}).get("rotary") if drafter else None)
        self.status["rotary"] = "wired" if attr else "TODO: the rotary module"
        body = f"    return self.drafter.{attr}" if attr else \
            '    return _todo("the module your drafter calls as rotary(x, position_ids)")'
        return "def rotary(self) -> nn.Module | None:\n" + body + "\n"


def write_entry(located: dict[str, Any], measured: dict[str, Any] | None, code: Path, out: Path) -> dict[str, str]:
    """Write the entry to `out`; returns method -> "wired" / what is still TODO."""
    writer = Writer(located, measured, code, out.stem)
    source = writer.source()
    compile(source, str(out), "exec")  # the scaffold is always valid Python
    from sleuth.artifacts import write_atomic

    # By rename, never through what is there: a link planted in the code tree (to the user's file, or
    # dangling out of the tree) or a FIFO is refused; --force replaces only a regular file.
    write_atomic(out, source, replace="regular")
    return writer.status
