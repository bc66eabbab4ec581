"""Probes without an adapter: the located pieces of a trainer called one by one (the probe child's side).

sleuth's process located the pieces statically (sleuth/probes/locate.py) and handed them over as data
(`spec["plan"]`). Here each is imported from the diagnosed tree, bound (sleuth/probes/binding.py) and called
on a synthetic scene whose answer is known (sleuth/probes/piece_experiments.py). The answer has one verdict
per probed invariant: decided by a piece where one was called and judged, `unknown` naming what was missing
otherwise, and `answer["subject"]["pieces"]` says for every piece where it was found, how it was called and
what could not be bound.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from sleuth.probes import piece_experiments as px
from sleuth.probes.binding import NO_VALUE, BindError, Call, RoleNamespace, factory, import_module, names, plan_slots, resolve
from sleuth.probes.binding import _config_like as _config_like_name
from sleuth.probes.binding import call_piece as _call_piece
from sleuth.probes.pieces import PIECE_KINDS
from sleuth.probes.verdict import PROBED_INVARIANTS, Expectations, Verdict

KIND_ORDER = ("layer_ids", "features", "mask", "positions", "teacher", "final_logits", "weights", "loss", "optimizer")
NOT_PROBED_HERE = {"dflash.kv_injection": "needs the drafter's own forward with its layers hooked: write an entry "
                   "(`sleuth probe init --code PATH` scaffolds one)"}
BLOCK_SETTINGS = ("block_size", "BLOCK_SIZE", "block", "BLOCK", "B", "block_len", "blk", "BLOCK_LEN")
GAMMA_SETTINGS = ("gamma", "loss_decay_gamma", "decay_gamma", "GAMMA", "DECAY", "decay")


@dataclass
class PieceReport:
    kind: str
    where: str
    qualname: str
    found_by: str
    used_by: str
    outcome: str = ""  # "measured" | "not bound" | "failed" | "not needed"
    called: str = ""
    detail: str = ""
    decided: list[str] = field(default_factory=list)
    binding: dict[str, Any] = field(default_factory=dict)  # param -> how it was bound (binding.Call.binding)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class GenericSubject:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.plan = spec["plan"]
        self.config = dict((spec.get("context") or {}).get("config") or {})
        self.settings = _settings(self.plan.get("settings") or {}, self.config)
        found = _first_int(self.settings, BLOCK_SETTINGS)
        self.block, self.block_from_settings = found or 6, found is not None
        self.gamma = _first_number(self.settings, GAMMA_SETTINGS)
        self.reports: list[PieceReport] = []
        self.notes: list[str] = []

    # --- the run ----------------------------------------------------------------------------------------------

    def run(self, answer: dict[str, Any], expectations: Expectations, seed: int, started: float) -> dict[str, Any]:
        torch.manual_seed(seed)
        self.expectations = expectations
        verdicts: dict[str, list[Verdict]] = {}
        pieces = self.plan.get("pieces") or []
        self.layer_rule: tuple[px.LayerRule, PieceReport] | None = None
        self.layer_reads: tuple[list[int], list[int], PieceReport] | None = None  # (ids given, hidden_states read)
        for kind in KIND_ORDER:
            start = time.perf_counter()
            chains: dict[int, list[dict[str, Any]]] = {}
            for piece in pieces:
                if piece["kind"] == kind:
                    chains.setdefault(piece["chain"], []).append(piece)
            for members in chains.values():
                for produced in self._run_chain(kind, members):
                    verdicts.setdefault(produced.invariant, []).append(produced)
            answer["seconds"][f"located-{kind}"] = round(time.perf_counter() - start, 3)
        for produced in self._layer_verdicts():
            verdicts.setdefault(produced.invariant, []).append(produced)
        answer["verdicts"] = [combine(invariant, verdicts.get(invariant, []), self._missing_reason(invariant)).to_json()
                              for invariant in PROBED_INVARIANTS]
        measured = sorted({v["invariant"] for v in answer["verdicts"] if v["status"] in ("match", "mismatch")})
        answer["subject"] = {
            "name": "located pieces (no adapter)", "protocol": 1, "block_size": self.block,
            "num_target_layers": px.NUM_TARGET_LAYERS, "kind": "generic",
            "notes": [f"measured on located pieces: {', '.join(i.split('.', 1)[1] for i in measured) or 'none'}",
                      *self.notes],
            "pieces": [r.to_json() for r in self.reports],
            "missing": self.plan.get("missing") or {},
        }
        if not any(r.outcome == "measured" for r in self.reports):
            # nothing was called: that is no experiment, not a clean bill (the report must not read as one)
            tried = [f"{r.qualname}: {r.detail}" for r in self.reports if r.detail][:2]
            answer["error"] = ("no located piece could be called" + (f" ({'; '.join(tried)})" if tried else
                               ": sleuth found no function of the trainer that computes a DFlash piece on its own"))
        answer["seconds"]["total"] = round(time.perf_counter() - started, 3)
        return answer

    def _missing_reason(self, invariant: str) -> str:
        if invariant in NOT_PROBED_HERE:
            return NOT_PROBED_HERE[invariant]
        kinds = [k for k, ids in PIECE_KINDS.items() if invariant in ids]
        missing = self.plan.get("missing") or {}
        tried = [r for r in self.reports if r.kind in kinds]
        parts = [f"{r.qualname} ({r.where}): {r.detail}" for r in tried if r.outcome in ("not bound", "failed")]
        parts += [f"{k}: {missing[k]}" for k in kinds if k in missing]
        return "no located piece decides it" + (f" ({'; '.join(parts[:3])})" if parts else "")

    def _run_chain(self, kind: str, members: list[dict[str, Any]]) -> list[Verdict]:
        """Try a chain's pieces in order (the builder nearest the training step first); the first that binds
        and gives a result of the right shape is judged."""
        for index, piece in enumerate(members):
            report = PieceReport(kind, f"{piece['path']}:{piece['line']}", piece["qualname"], piece["found_by"],
                                 piece.get("used_by", ""))
            self.reports.append(report)
            self.last_call = None
            try:
                produced = getattr(self, f"_probe_{kind}")(piece, report)
            except BindError as exc:
                report.outcome, report.detail = "not bound", str(exc)
                continue
            except Exception as exc:  # the code under diagnosis failed in a way no binding explains
                report.outcome, report.detail = "failed", _one_line(exc)
                report.detail += " | " + traceback.format_exc(limit=3).strip().splitlines()[-1][:200]
                continue
            report.outcome = "measured"
            if self.last_call is not None:
                report.binding = self.last_call.binding
            report.decided = sorted({v.invariant for v in produced if v.status in ("match", "mismatch")})
            for later in members[index + 1:]:
                self.reports.append(PieceReport(kind, f"{later['path']}:{later['line']}", later["qualname"],
                                                later["found_by"], later.get("used_by", ""), "not needed",
                                                detail=f"measured through {piece['qualname']}, which calls it"))
            return produced
        return []

    # --- binding ------------------------------------------------------------------------------------------

    def _callable(self, piece: dict[str, Any], scene: px.Scene) -> tuple[Any, Any, str]:
        """(the function to call, its module, how `self` was bound), importing from the diagnosed tree."""
        modules = self.plan.get("modules") or {}
        module, note = import_module(piece["module"], modules.get(piece["module"], {}))
        if note and note not in self.notes:
            self.notes.append(f"{piece['module']}: {note}")
        if not piece.get("owner"):
            return resolve(module, piece["qualname"]), module, ""
        errors = []
        for cls_name in piece.get("concrete") or [piece["owner"]]:
            cls_module_name = (piece.get("class_modules") or {}).get(cls_name, piece["module"])
            cls_module, _ = import_module(cls_module_name, modules.get(cls_module_name, {}))
            cls = getattr(cls_module, cls_name)
            if piece["name"] == "__init__":
                return cls, module, ""
            try:
                instance, how = self._instance(cls, scene)
            except BindError as exc:
                errors.append(str(exc))
                continue
            return getattr(instance, piece["name"]), module, how
        raise BindError("; ".join(errors) or f"no concrete class to call {piece['qualname']} on")

    def _instance(self, cls: type, scene: px.Scene, answer: Any = None) -> tuple[Any, str]:
        """An object to call a method on: a module built from its constructor with tiny sizes, else the class's
        instance without __init__, whose missing attributes are answered from the roles and settings (a config
        attribute, `self.cfg`, by a stand-in answering its options)."""
        if isinstance(cls, type) and issubclass(cls, nn.Module) and answer is None:
            instance, how = self.construct(cls, scene)
            return instance, f"self = {cls.__name__}({how})"
        answer = answer or self._answer(scene)
        roles = px.scene_roles(scene, self.gamma)

        def fallback(obj: Any, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            if _config_like_name(name):
                value = RoleNamespace(answer, f"self.{name}")
            else:
                role = px.book(roles).role_for(name)
                if role is not None:
                    value = role.variants[0][1]
                    value = value() if getattr(value, "_sleuth_factory", False) else value
                else:
                    value = answer(name)
                    if value is NO_VALUE:
                        raise AttributeError(f"self.{name}: set by {cls.__name__}.__init__, which the probe does not run")
            obj.__dict__[name] = value  # the same object every time (self.target is one model, as in the run)
            return value

        stand_in = type(f"Probed{cls.__name__}", (cls,), {"__getattr__": fallback})
        try:
            return object.__new__(stand_in), f"self = a {cls.__name__} whose __init__ did not run (attributes from class defaults and roles)"
        except TypeError as exc:
            raise BindError(f"cannot make a {cls.__name__} without running its __init__: {exc}") from None

    def construct(self, cls: Any, scene: px.Scene, extra: dict[str, Any] | None = None) -> tuple[Any, str]:
        """`cls(...)` (a class or a builder function) with tiny sizes from its signature."""
        import inspect

        target = cls.__init__ if isinstance(cls, type) else cls
        params = []
        for name, p in list(inspect.signature(target).parameters.items())[(1 if isinstance(cls, type) else 0):]:
            kind = {p.VAR_POSITIONAL: "var_positional", p.VAR_KEYWORD: "var_keyword", p.KEYWORD_ONLY: "keyword"}.get(p.kind, "positional")
            params.append({"name": name, "kind": kind, "has_default": p.default is not p.empty,
                           "annotation": "" if p.annotation is p.empty else str(getattr(p.annotation, "__name__", p.annotation))})
        book = self._constructor_book(scene, extra)
        slots = plan_slots(target, params, {}, {}, book, self._answer(scene), set(), sys.modules.get(cls.__module__))
        call = _call_piece(cls, slots, lambda result, _args: None)
        return call.result, call.described()

    def _constructor_book(self, scene: px.Scene, extra: dict[str, Any] | None) -> Any:
        roles = px.scene_roles(scene, self.gamma)
        t = scene.target
        roles["draft_layers"] = px.Role("draft layers", [("2", 2)])
        roles["num_features"] = px.Role("selected target layers", [("3", 3)])
        roles["hf_config"] = px.Role("a Qwen3Config of the target's sizes",
                                     [("Qwen3Config(hidden 32, 2 layers)", factory(lambda: _hf_config(t, 2)))])
        roles["stand_in_target"] = px.Role("a stand-in causal LM", [("the probe's target", factory(lambda: px.StandInTarget(scene)))])
        for name, value in (extra or {}).items():
            roles[name] = px.Role(name, [(f"the {name} built above", value)])
        extra_vocabulary = {
            **({name: [names(*words)] for name, words in (("drafter", ("drafter", "model", "draft", "net", "module",
                                                                        "draft_model", "student", "m")),)
                if "drafter" in (extra or {})}),
            "stand_in_target": [names("target", "verifier", "target_model", "teacher_model", "base_model", "teacher")],
            "draft_layers": [names("num_layers", "n_layers", "layers", "num_draft_layers", "n_draft_layers",
                                   "num_hidden_layers", "depth", "n_layer")],
            "num_features": [names("num_taps", "taps", "n_feat", "num_features", "k", "n_taps", "num_target_layers",
                                   "num_context_layers", "n_context_layers", "num_selected_layers", "num_aux_layers",
                                   "n_features", "num_aux", "num_selected")],
            "hf_config": [names("config", "cfg", "target_config", "model_config", "hf_config", "tc", "dcfg", "qwen_config")],
            "layer_ids": [names("layer_ids", "target_layer_ids", "taps_ids", "selected_layers", "aux_layer_ids")],
        }
        # a constructor is given sizes, configs and modules, never the scene's tensors
        tensors = ("hidden_states", "target_logits", "input_ids", "position_ids", "doc_ids", "loss_mask", "anchors",
                   "anchors_per_query", "anchor_valid", "doc_of_query", "cu_seqlens", "seq_len", "q_len", "kv_len")
        return px.book(roles, extra_vocabulary, drop=tensors)

    def _answer(self, scene: px.Scene):
        return px.config_answer(scene, self.settings, self.gamma)

    def _bind_and_call(self, piece: dict[str, Any], scene: px.Scene, book: Any, accept: Any,
                       prefer_run: set[str] = frozenset()) -> tuple[Call, str]:
        function, module, self_how = self._callable(piece, scene)
        slots = plan_slots(function, piece["params"], piece.get("passed") or {}, piece.get("unresolved") or {}, book,
                           self._answer(scene), set(prefer_run), module)
        call = _call_piece(function, slots, accept)
        self.last_function, self.last_call = function, call
        return call, (f"{self_how}; " if self_how else "") + call.described()

    def _block_for(self, piece: dict[str, Any]) -> int:
        book = px.book(px.scene_roles(px.make_scene(self.block)))
        for param in piece["params"]:
            role = book.role_for(param["name"])
            passed = (piece.get("passed") or {}).get(param["name"])
            if role is not None and role.name == "the block size" and isinstance(passed, int) and 1 < passed <= px.MAX_BLOCK:
                return passed
        return self.block

    # --- the kinds ------------------------------------------------------------------------------------------

    def _probe_layer_ids(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self.block)
        function, _module, _how = self._callable(piece, scene)
        ints = [p for p in piece["params"] if p["kind"] != "var_keyword" and p["kind"] != "var_positional"]
        required = [p for p in ints if not p.get("has_default")]
        book = px.book({}, {"depth": [names("num_layers", "n_layers", "num_hidden_layers", "total_layers", "target_depth",
                                            "depth", "n_target_layers", "num_target_layers", "l", "target_layers",
                                            "num_target_hidden_layers", "n_layer", "layers_total")],
                            "count": [names("k", "n", "count", "num_taps", "n_taps", "num_draft_layers", "num_features",
                                            "taps", "n_select", "num_aux", "num_select", "n_draft_layers", "num_layers_to_select",
                                            "num_selected", "n_feat")]}, drop=tuple(px.COMMON_VOCABULARY))
        if len(required) == 1 and _config_like_name(required[0]["name"]):
            return self._layer_rule_from_config(function, required[0]["name"], book, report)
        if not required and piece.get("owner"):  # `self.layer_ids()`: the rule reads the depth and count off self.cfg
            return self._layer_rule_from_self(piece, scene, book, report)
        if len(required) > 2 or not ints:
            raise BindError(f"{piece['qualname']} takes {len(required)} required parameters; a layer rule takes the "
                            "target's depth and a count")
        named = {p["name"]: book.vocabulary["depth"][0](p["name"].lower(), set()) for p in ints}
        depth_param = next((n for n, is_depth in named.items() if is_depth), None)
        orders = [(depth_param, next(p["name"] for p in ints if p["name"] != depth_param))] if depth_param and len(ints) > 1 \
            else [(ints[0]["name"], ints[1]["name"]), (ints[1]["name"], ints[0]["name"])] if len(ints) > 1 else [(ints[0]["name"], None)]
        k_run = next((v for n, v in (piece.get("passed") or {}).items() if isinstance(v, int) and n != depth_param), None)
        errors = []
        for depth_name, count_name in orders:
            def call(depth: int, k: int) -> list[int]:
                kwargs = {depth_name: depth}
                if count_name is not None:
                    kwargs[count_name] = k
                out = function(**kwargs)
                return out.tolist() if isinstance(out, Tensor) else list(out)
            try:
                sizes_ok = all(len(call(d, k)) == k for d, k in px.LAYER_TESTS)
            except Exception as exc:
                errors.append(_one_line(exc))
                continue
            if not sizes_ok:
                errors.append(f"{depth_name}=L, {count_name}=k does not give k ids")
                continue
            rule = px.measure_layer_rule(call, k_run)
            report.called = f"{depth_name}=L, {count_name}=k for " + ", ".join(rule.observed)
            report.binding = {depth_name: {"role": "target_depth"}, **({count_name: {"role": "layer_count", "k": k_run}}
                                                                       if count_name else {})}
            self.layer_rule = (rule, report)
            return []
        raise BindError("no binding of the depth and the count gives k ids (" + "; ".join(errors[:2]) + ")")

    def _layer_rule_from_self(self, piece: dict[str, Any], scene: px.Scene, book: Any, report: PieceReport) -> list[Verdict]:
        asked: set[str] = set()
        current: dict[str, int] = {}

        def answer(option: str) -> Any:
            asked.add(option)
            if book.vocabulary["depth"][0](option.lower(), set()):
                return current["depth"]
            if book.vocabulary["count"][0](option.lower(), set()):
                return current["k"]
            return self.settings.get(option, NO_VALUE)

        modules = self.plan.get("modules") or {}
        cls_name = (piece.get("concrete") or [piece["owner"]])[0]
        cls_module, _ = import_module((piece.get("class_modules") or {}).get(cls_name, piece["module"]),
                                      modules.get((piece.get("class_modules") or {}).get(cls_name, piece["module"]), {}))
        instance, _how = self._instance(getattr(cls_module, cls_name), scene, answer)

        def call(depth: int, k: int) -> list[int]:
            current.update(depth=depth, k=k)
            out = getattr(instance, piece["name"])()
            return out.tolist() if isinstance(out, Tensor) else list(out)

        try:
            ok = all(len(call(d, k)) == k for d, k in px.LAYER_TESTS)
        except Exception as exc:
            raise BindError(f"calling it on a stand-in self failed: {_one_line(exc)}") from None
        if not ok:
            raise BindError("self's depth and count options do not give k ids")
        k_run = next((v for key, v in self.settings.items() if book.vocabulary["count"][0](key.lower(), set())
                      and isinstance(v, int) and not isinstance(v, bool)), None)
        rule = px.measure_layer_rule(call, k_run)
        report.called = f"self = a {cls_name} whose options answer {', '.join(sorted(asked))}, for " + ", ".join(rule.observed)
        report.binding = {"self": {"namespace": sorted(asked)}}
        self.layer_rule = (rule, report)
        return []

    def _layer_rule_from_config(self, function: Any, name: str, book: Any, report: PieceReport) -> list[Verdict]:
        """`select_layers(config)`: the rule reads the depth and the count off a config; the stand-in answers
        the depth- and count-named options, the others from the code's settings."""
        settings = self.settings
        k_run = next((v for key, v in settings.items() if book.vocabulary["count"][0](key.lower(), set())
                      and isinstance(v, int) and not isinstance(v, bool)), None)
        asked: set[str] = set()

        def call(depth: int, k: int) -> list[int]:
            def answer(option: str) -> Any:
                asked.add(option)
                if book.vocabulary["depth"][0](option.lower(), set()):
                    return depth
                if book.vocabulary["count"][0](option.lower(), set()):
                    return k
                return settings.get(option, NO_VALUE)

            out = function(RoleNamespace(answer, name))
            return out.tolist() if isinstance(out, Tensor) else list(out)

        try:
            if not all(len(call(d, k)) == k for d, k in px.LAYER_TESTS):
                raise BindError(f"`{name}` answering the depth and the count does not give k ids")
        except BindError:
            raise
        except Exception as exc:
            raise BindError(f"calling it with a stand-in `{name}` failed: {_one_line(exc)}") from None
        rule = px.measure_layer_rule(call, k_run)
        report.called = f"{name} = a stand-in answering {', '.join(sorted(asked))} for " + ", ".join(rule.observed)
        report.binding = {name: {"namespace": sorted(asked)}}
        self.layer_rule = (rule, report)
        return []

    def _probe_features(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        """Perturb each hidden state in turn (in the tuple handed over, or behind a stand-in target): which layers
        the gather reads, and, when its output is the concatenation itself ([..., k*H]), where each one lands."""
        scene = px.make_scene(self.block)
        ids = px.reference_layer_ids(px.NUM_TARGET_LAYERS, 3)
        roles = px.scene_roles(scene, self.gamma)

        def features(result: Any) -> Tensor | None:
            if isinstance(result, (tuple, list)):
                result = next((r for r in result if isinstance(r, Tensor) and r.is_floating_point()), None)
            return result if isinstance(result, Tensor) and result.is_floating_point() else None

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            return None if features(result) is not None else "not a feature tensor"

        call, called = self._bind_and_call(piece, scene, px.book(roles), accept)
        report.called = called
        function = self.last_function
        if not any((meta or {}).get("role") == "layer_ids" for meta in call.binding.values()):
            raise BindError(f"{piece['qualname']} selects its own layers (no layer ids are passed in): which layers "
                            "it should read is not known here")
        base = features(call.result).detach()
        read, columns = [], {}
        for layer in range(len(scene.hidden_states)):
            noise = 3.0 * torch.randn(scene.hidden_states[layer].shape, generator=torch.Generator().manual_seed(layer))
            args = dict(call.arguments)
            for name, value in args.items():
                if isinstance(value, tuple) and len(value) == len(scene.hidden_states):
                    noisy = list(value)
                    noisy[layer] = noisy[layer] + noise.reshape(noisy[layer].shape)
                    args[name] = tuple(noisy)
                elif isinstance(value, px.StandInTarget):
                    noisy = list(scene.hidden_states)
                    noisy[layer] = noisy[layer] + noise
                    value.hidden_states = tuple(noisy)
            out = features(function(**args)).detach()
            for value in args.values():
                if isinstance(value, px.StandInTarget):
                    value.hidden_states = scene.hidden_states
            moved = (out - base).abs().reshape(-1, out.shape[-1]).amax(0)
            if moved.max().item() > 1e-6 * max(base.abs().max().item(), 1e-12):
                read.append(layer)
                columns[layer] = (moved > 0).nonzero().flatten().tolist()
        self.layer_reads = (ids, read, report)
        v = px.verdict("dflash.fc_input_layers", "features", report.where, called,
                       hypothesis=f"the gather reads all {len(ids)} selected layers, concatenated layer after layer",
                       threshold="a layer is read when perturbing it changes the output",
                       measurement=f"hidden_states read: {read} (ids given {ids})", expected=f"{len(ids)} of {len(ids)} read",
                       measured={"read": read, "ids": ids},
                       exercised=f"each of the {len(scene.hidden_states)} hidden states perturbed in turn")
        h = scene.hidden
        if len(read) != len(ids):
            v.status, v.observed = "mismatch", f"{len(read)} of {len(ids)} selected layers read (hidden_states {read})"
            v.fix = "Concatenate every selected layer into fc: Linear(k*H, H) over all k target_layer_ids."
        elif base.shape[-1] == len(ids) * h and any(columns[layer] != list(range(j * h, (j + 1) * h))
                                                     for j, layer in enumerate(read)):
            v.status = "mismatch"
            v.observed = ("all selected layers read, but not concatenated layer after layer: each layer's features land "
                          f"in columns {columns[read[0]][:4]}... (interleaved), not in a block of {h}")
            v.fix = "Concatenate the selected layers on the last dim (cat, not stack + flatten)."
        else:
            v.status, v.observed = "match", f"all {len(ids)} selected layers read" + (
                ", each in its own block of columns" if base.shape[-1] == len(ids) * h else "")
        return [v]

    def _probe_mask(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self._block_for(piece))
        roles = px.scene_roles(scene, self.gamma)
        captured: list[Any] = []
        has_documents = any(px.book(roles).role_for(p["name"]) in (roles["doc_ids"], roles["cu_seqlens"], roles["doc_of_query"])
                            for p in piece["params"])

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            result = captured[-1] if captured else result
            candidates = px.dense_mask(result, scene)
            if not candidates:
                return f"not a mask of {scene.queries} query rows ({type(result).__name__})"
            reading = px.read_mask(candidates, scene, has_documents)
            if reading is None:
                return "no reading (polarity, key layout) is close to the DFlash rule"
            self._mask_reading = reading
            return None

        with _capture_block_masks(captured):
            call, called = self._bind_and_call(piece, scene, px.book(roles), accept)
        report.called = called
        return px.judge_mask(self._mask_reading, scene, has_documents, self.plan.get("packs_documents"), report.where, called)

    def _probe_positions(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self._block_for(piece))
        roles = px.scene_roles(scene, self.gamma)
        book = px.book(roles)
        given = any(book.role_for(p["name"]) in (roles["position_ids"], roles["cu_seqlens"], roles["doc_ids"])
                    for p in piece["params"])
        found: list[Verdict] = []

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            judged = px.judge_positions(result, scene, given, report.where, "")
            if isinstance(judged, str):
                return judged
            found.append(judged)
            return None

        call, called = self._bind_and_call(piece, scene, book, accept)
        report.called = called
        found[-1].perturbed = found[-1].perturbed.replace("called " + report.where + " with ", f"called {report.where} with {called}", 1)
        return [found[-1]]

    def _probe_teacher(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self._block_for(piece))
        roles = px.scene_roles(scene, self.gamma)

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            sources = px.slot_sources(result, scene)
            if isinstance(sources, str):
                return sources
            self._sources = sources
            return None

        call, called = self._bind_and_call(piece, scene, px.book(roles), accept)
        report.called = called
        return [px.judge_teacher(self._sources, scene, report.where, called)]

    def _probe_final_logits(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self.block)
        roles = px.scene_roles(scene, self.gamma)
        judged: list[Verdict] = []

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            out = px.judge_final_logits(result, scene, report.where, "")
            if isinstance(out, str):
                return out
            judged.append(out)
            return None

        call, called = self._bind_and_call(piece, scene, px.book(roles), accept)
        report.called = called
        judged[-1].perturbed = f"called {report.where} with {called}; " + judged[-1].perturbed.split("; ", 1)[-1]
        return judged[-1:]

    def _probe_weights(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        block = self._block_for(piece)
        scene = px.make_scene(block)
        gamma = self._gamma_for(piece)
        roles = px.scene_roles(scene, gamma)
        book = px.book(roles)
        takes_gamma = any(book.role_for(p["name"]) is roles.get("gamma") for p in piece["params"]) and gamma is not None
        got: list[Tensor] = []

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            length = result.shape[-1] if isinstance(result, Tensor) and result.dim() else 0
            weights = px.slot_weights(result, length if length and length <= px.MAX_BLOCK * 4 else block)
            if isinstance(weights, str):
                return weights
            got.append(weights)
            return None

        call, called = self._bind_and_call(piece, scene, book, accept)
        report.called = called
        weights = got[-1]
        exercised = f"B={weights.numel()}" + (f", gamma {gamma:g} ({self._gamma_source(piece)})" if takes_gamma else "")
        known = self._block_known(piece, weights.numel())
        exercised += "" if known else " (the run's block size is not known)"
        return px.judge_weights(weights, weights.numel(), gamma if takes_gamma else None, self.expectations, "weights",
                                report.where, called, exercised, block_known=known,
                                gamma_from_config=takes_gamma and self._gamma_source(piece) == "--config")

    def _block_known(self, piece: dict[str, Any], block: int) -> bool:
        """Whether B is the run's: passed by the run, its --config / the code's one default, or the code's own."""
        if block != self.block or self.block_from_settings:
            return True
        return self._block_for(piece) != self.block or any(isinstance(v, int) and v == block
                                                           for v in (piece.get("passed") or {}).values())

    def _gamma_for(self, piece: dict[str, Any]) -> float | None:
        passed = piece.get("passed") or {}
        for name in GAMMA_SETTINGS:
            if isinstance(passed.get(name), (int, float)) and not isinstance(passed.get(name), bool):
                return float(passed[name])
        return self.gamma

    def _gamma_source(self, piece: dict[str, Any]) -> str:
        passed = piece.get("passed") or {}
        if any(name in passed for name in GAMMA_SETTINGS):
            return "as the run passes it"
        return "--config" if any(k in self.config for k in GAMMA_SETTINGS) else "the code's default"

    def _probe_loss(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self._block_for(piece))
        a, b, v = len(scene.anchors), scene.block, scene.vocab
        g = torch.Generator().manual_seed(31)
        inputs = px.LossInputs(torch.zeros(a, b, v, requires_grad=True), torch.randn(a, b, v, generator=g) * 2.0)
        roles = {**px.scene_roles(scene, self._gamma_for(piece)), **px.loss_roles(scene, inputs)}
        probe_book = px.book(roles)
        # A loss given the anchors gathers its targets from the target's whole row itself: hand it the row
        # (the shift is then measured too); otherwise it is handed each slot's teacher.
        full_row = any(probe_book.role_for(p["name"]) is roles["anchors"] for p in piece["params"])
        vocabulary = dict(px.LOSS_VOCABULARY)
        if full_row:
            vocabulary = {k: w for k, w in vocabulary.items() if k not in ("teacher_slots", "teacher_probs")}
        book = px.book(roles, vocabulary, drop=() if full_row else ("target_logits",))
        grads: list[Tensor] = []

        def accept(result: Any, args: dict[str, Any]) -> str | None:
            grad = px.gradient(SimpleNamespace(result=result), inputs.logits)
            if isinstance(grad, str):
                return grad
            grads.append(grad)
            return None

        call, called = self._bind_and_call(piece, scene, book, accept)
        report.called = called
        # weights passed in, or per-slot losses the caller weighs: slot 0 and gamma are decided where they are applied
        per_slot = isinstance(call.result, Tensor) and call.result.numel() == inputs.logits.shape[0] * inputs.logits.shape[1]
        takes_weights = per_slot or any(book.role_for(p["name"]) is roles["weights"] for p in piece["params"])
        known = self._block_known(piece, scene.block)
        if not full_row:
            return px.judge_loss(grads[-1], inputs, scene, takes_weights, self.expectations, report.where, called, known)
        shift, teacher = px.loss_shift(grads[-1], scene, report.where, called)
        if teacher is None:
            return [shift]
        judged = px.judge_loss(grads[-1], px.LossInputs(inputs.logits, teacher), scene, takes_weights,
                               self.expectations, report.where, called, known)
        return [shift, *judged]

    def _probe_optimizer(self, piece: dict[str, Any], report: PieceReport) -> list[Verdict]:
        scene = px.make_scene(self.block)
        self.trainer_objects: dict[str, Any] = {}  # class name -> the one stand-in object its methods run on
        drafter, built = self._drafter(scene)
        vocab_params = _vocab_parameters(drafter, scene)
        executed: set[tuple[str, int]] = set()
        freezes = []
        with _record_calls(executed):
            for freeze in [p for p in self.plan.get("pieces") or [] if p["kind"] == "freeze" and not p.get("owner")]:
                try:
                    function, _m, _h = self._callable(freeze, scene)
                    self._call_with_drafter(function, freeze, scene, drafter)
                    freezes.append(freeze["qualname"])
                except Exception as exc:
                    report.detail += f"{freeze['qualname']} not run ({_one_line(exc)}); "
            optimizer, called = self._optimizer(piece, scene, drafter)
        if not vocab_params:
            report.called = called
            return [px.verdict("dflash.frozen_embed_head", "optimizer", report.where, called,
                               hypothesis="one optimizer step leaves the drafter's embeddings and lm_head unchanged",
                               expected="embeddings and lm_head unchanged",
                               reason=f"the drafter built by {built} holds no embeddings or lm_head of its own (it uses "
                                      "the target's: whether the target is frozen is read statically)")]
        grad_sites = self.plan.get("grad_sites") or []
        unrun = [site for site in grad_sites if (site.split(":")[0], int(site.split(":")[1])) not in executed]
        if unrun:  # the path's other freezing steps, run on the same objects (a hook on the trainer, a function of it)
            owner = getattr(getattr(self, "last_function", None), "__self__", None)
            with _record_calls(executed):
                for site in unrun:
                    self._run_grad_site(site, owner, scene, drafter, report)
            unrun = [site for site in grad_sites if (site.split(":")[0], int(site.split(":")[1])) not in executed]
        report.called = called + (f"; after {', '.join(freezes)}" if freezes else "")
        before = {name: p.detach().clone() for name, p in vocab_params.items()}
        for p in drafter.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
        optimizer.step()
        changed = sorted(name for name, p in vocab_params.items() if not torch.equal(before[name], p.detach()))
        others = [p for p in drafter.parameters() if p.requires_grad]
        v = px.verdict("dflash.frozen_embed_head", "optimizer", report.where, report.called,
                       hypothesis="one optimizer step leaves the drafter's embeddings and lm_head unchanged",
                       threshold="any changed element counts", expected="embeddings and lm_head unchanged",
                       measurement=f"{len(changed)} of {len(vocab_params)} embedding / lm_head tensors changed "
                                   f"({', '.join(vocab_params)})", measured={"changed": changed},
                       exercised=f"the drafter built by {built}; every trainable parameter given a gradient; one step")
        if unrun:
            v.reason = ("not exercised: code on the run's path that sets requires_grad did not run in the probe ("
                        + ", ".join(s.split(":", 2)[2] + " at " + ":".join(s.split(":")[:2]) for s in unrun[:3]) + ")")
        elif changed:
            v.status, v.observed = "mismatch", f"{' and '.join(changed)} trained"
            v.fix = "Freeze the embeddings and lm_head (requires_grad False, and keep them out of the optimizer)."
        elif not others:
            v.reason = "the optimizer step trains nothing at all"
        else:
            v.status, v.observed = "match", "embeddings and lm_head unchanged; the drafter's other weights train"
        return [v]

    def _run_grad_site(self, site: str, owner: Any, scene: px.Scene, drafter: nn.Module, report: PieceReport) -> None:
        """Run a function on the path that sets requires_grad: a method of the trainer object the optimizer came
        from (on that object), or a function taking the drafter."""
        file, _line, qualname = site.split(":", 2)
        parts = qualname.split(".")
        try:
            if len(parts) == 2 and owner is not None and parts[0] in {c.__name__ for c in type(owner).__mro__}:
                method = getattr(owner, parts[1])
                import inspect

                if not [p for p in inspect.signature(method).parameters.values() if p.default is p.empty]:
                    method()
            elif len(parts) == 1:
                module = next((sys.modules[name] for name, info in (self.plan.get("modules") or {}).items()
                               if info.get("file") == file and name in sys.modules), None)
                function = getattr(module, parts[0], None) if module is not None else None
                params = [{"name": n, "kind": "positional", "has_default": False, "annotation": ""}
                          for n in (function.__code__.co_varnames[: function.__code__.co_argcount] if function else [])]
                if function is not None:
                    self._call_with_drafter(function, {"params": params}, scene, drafter)
        except Exception as exc:
            report.detail += f"{qualname} not run ({_one_line(exc)}); "

    def _drafter(self, scene: px.Scene) -> tuple[nn.Module, str]:
        """The drafter as the run builds it: its builder (a trainer's method on the shared stand-in object, or a
        function) before its bare constructor, whose embedding / head arguments would be sleuth's."""
        errors = []
        pieces = [p for p in self.plan.get("pieces") or [] if p["kind"] == "drafter"]
        pieces.sort(key=lambda p: p["name"] == "__init__")
        for piece in pieces:
            try:
                if piece.get("owner") and piece["name"] != "__init__":
                    built, how = self._shared_method(piece, scene)(), "its own method"
                else:  # a drafter class (its constructor) or a builder function, called with tiny sizes
                    function, _module, _how = self._callable(piece, scene)
                    built, how = self.construct(function, scene)
            except Exception as exc:
                errors.append(f"{piece['qualname']}: {_one_line(exc)}")
                continue
            if isinstance(built, nn.Module):
                return built, f"{piece['qualname']}({how})"
        raise BindError("no drafter module could be built (" + ("; ".join(errors[:2]) or "none located") + ")")

    def _shared_method(self, piece: dict[str, Any], scene: px.Scene) -> Any:
        """The method bound to the one stand-in object of its concrete class (shared by the optimizer experiment's
        steps, as the run's steps share `self`)."""
        modules = self.plan.get("modules") or {}
        cls_name = (piece.get("concrete") or [piece["owner"]])[0]
        if cls_name not in self.trainer_objects:
            module_name = (piece.get("class_modules") or {}).get(cls_name, piece["module"])
            cls_module, _ = import_module(module_name, modules.get(module_name, {}))
            self.trainer_objects[cls_name], _how = self._instance(getattr(cls_module, cls_name), scene)
        return getattr(self.trainer_objects[cls_name], piece["name"])

    def _call_with_drafter(self, function: Any, piece: dict[str, Any], scene: px.Scene, drafter: nn.Module) -> Any:
        book = self._constructor_book(scene, {"drafter": drafter})
        slots = plan_slots(function, piece["params"], piece.get("passed") or {}, piece.get("unresolved") or {}, book,
                           self._answer(scene), set(), None)
        return _call_piece(function, slots, lambda result, _a: None)

    def _optimizer(self, piece: dict[str, Any], scene: px.Scene, drafter: nn.Module) -> tuple[Any, str]:
        if piece.get("owner") and piece["name"] != "__init__" and not piece.get("owner_is_module"):
            function, module, self_how = self._shared_method(piece, scene), None, "self = the stand-in trainer object"
        else:
            function, module, self_how = self._callable(piece, scene)
        if self_how and piece.get("owner"):
            instance = function.__self__
            for attr in ("drafter", "model", "draft", "net", "module", "draft_model", "student"):
                try:
                    object.__setattr__(instance, attr, drafter)
                except Exception:
                    pass
        book = self._constructor_book(scene, {"drafter": drafter})
        slots = plan_slots(function, piece["params"] if piece["name"] != "__init__" else _init_params(function),
                           piece.get("passed") or {}, piece.get("unresolved") or {}, book, self._answer(scene), set(), module)

        def accept(result: Any, _args: dict[str, Any]) -> str | None:
            return None if _find_optimizer(result) is not None else "no optimizer in the result"

        call = _call_piece(function, slots, accept)
        self.last_call, self.last_function = call, function
        return _find_optimizer(call.result), (f"{self_how}; " if self_how else "") + call.described()

    # --- layer ids: the rule and how its ids index the hidden states ------------------------------------------

    def _layer_verdicts(self) -> list[Verdict]:
        if self.layer_rule is None:
            return []
        rule, report = self.layer_rule
        sample = rule.observed.get("L=36,k=5") or next(iter(rule.observed.values()))
        v = px.verdict("dflash.target_layer_ids", "layer_ids", report.where, report.called,
                       hypothesis="the ids follow round(1 + i*(L-4)/(k-1)) and index hidden_states[id + 1]",
                       threshold="exact, for every depth tried", measurement="ids " + "; ".join(
                           f"{k}: {ids}" for k, ids in rule.observed.items()),
                       expected=f"L=36,k=5: {px.reference_layer_ids(36, 5)}", measured=rule.observed,
                       exercised="the rule called with the target depths " + ", ".join(rule.observed))
        report.decided = []
        if rule.convention is None:
            v.status = "mismatch"
            v.observed = f"the rule gives {sample} for L=36, k=5"
            v.fix = "Select round(1 + i*(L-4)/(k-1)) for i < k (one layer: [L//2])."
        elif self.layer_reads is None:
            v.reason = (f"the rule gives the {'z-lab' if rule.convention == 'zlab' else 'vLLM-numbered'} ids; how the "
                        "ids index hidden_states was not measured (no located gather of the selected layers)")
        else:
            given, read, _r = self.layer_reads
            offset = {tuple(i + 1 for i in given): 1, tuple(given): 0}.get(tuple(read))
            wanted = 1 if rule.convention == "zlab" else 0
            v.measurement += f"; the gather reads hidden_states {read} for ids {given}"
            if offset is None:
                v.reason = "the gather reads layers that are not the ids it was given shifted by 0 or 1"
            elif offset == wanted:
                v.status, v.observed = "match", f"the rule's ids, read at hidden_states[id + {offset}]"
            else:
                v.status = "mismatch"
                v.observed = f"off by one: the rule's ids are read at hidden_states[id + {offset}]"
                v.fix = "Read hidden_states[id + 1] for z-lab layer id `id` (hidden_states[0] is the embeddings)."
        if v.status in ("match", "mismatch"):
            report.decided = ["dflash.target_layer_ids"]
        return [v]


# --- pieces of the machinery ----------------------------------------------------------------------------------------


def combine(invariant: str, verdicts: list[Verdict], missing: str) -> Verdict:
    """One verdict per invariant: a mismatch from any piece the run uses stands; a match needs every decided
    piece to agree; otherwise unknown with the reasons."""
    decided = [v for v in verdicts if v.status in ("match", "mismatch")]
    mismatches = [v for v in decided if v.status == "mismatch"]
    if mismatches:
        return mismatches[0]
    if decided:
        return decided[0]
    if verdicts:
        first = verdicts[0]
        first.reason = "; ".join(dict.fromkeys(v.reason for v in verdicts if v.reason)) or missing
        return first
    return Verdict(invariant=invariant, status="unknown", experiment="located-pieces", hypothesis="", perturbed="",
                   measurement="", threshold="", reason=missing)


def _settings(located: dict[str, list], config: dict[str, Any]) -> dict[str, Any]:
    """Setting name -> value: the run's --config first, then a default the code gives it in one way only."""
    import json

    values: dict[str, Any] = {}
    for name, found in located.items():
        distinct = {json.dumps(v, default=repr) for v, _where in found}
        if len(distinct) == 1:
            values[name] = found[0][0]
    values.update({k: v for k, v in config.items() if not isinstance(v, dict)})
    return values


def _first_int(settings: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = settings.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 1 < value <= px.MAX_BLOCK:
            return value
    return None


def _first_number(settings: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = settings.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _hf_config(target: Any, layers: int) -> Any:
    return px.hf_config(target, layers)


def _vocab_parameters(module: nn.Module, scene: px.Scene) -> dict[str, nn.Parameter]:
    """The drafter's embedding and output-projection weights (shape [V, H]: recognised by the vocabulary size)."""
    found = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding) and sub.num_embeddings == scene.vocab:
            found[f"{name}.weight"] = sub.weight
        elif isinstance(sub, nn.Linear) and sub.out_features == scene.vocab and sub.in_features == scene.hidden:
            found[f"{name}.weight"] = sub.weight
    return found


def _find_optimizer(result: Any) -> Any:
    if isinstance(result, torch.optim.Optimizer):
        return result
    if isinstance(result, (list, tuple)):
        for item in result:
            found = _find_optimizer(item)
            if found is not None:
                return found
    if hasattr(result, "__dict__") and not isinstance(result, (nn.Module, Tensor, type)):
        for value in vars(result).values():
            if isinstance(value, torch.optim.Optimizer):
                return value
    return None


def _init_params(cls: Any) -> list[dict[str, Any]]:
    import inspect

    params = []
    for name, p in list(inspect.signature(cls.__init__).parameters.items())[1:]:
        kind = {p.VAR_POSITIONAL: "var_positional", p.VAR_KEYWORD: "var_keyword", p.KEYWORD_ONLY: "keyword"}.get(p.kind, "positional")
        params.append({"name": name, "kind": kind, "has_default": p.default is not p.empty, "annotation": ""})
    return params


class _capture_block_masks:
    """While a mask builder runs, `create_block_mask(mask_mod, ...)` records the mask_mod (the rule itself) instead
    of compiling a BlockMask, so the rule is evaluated on every (query, key) pair."""

    def __init__(self, sink: list[Any]) -> None:
        self.sink, self.patched = sink, []

    def __enter__(self) -> _capture_block_masks:
        try:
            import torch.nn.attention.flex_attention as flex
        except ImportError:
            return self
        sink = self.sink

        def record(mask_mod: Any, *args: Any, **kwargs: Any) -> Any:
            sink.append(mask_mod)
            return SimpleNamespace(mask_mod=mask_mod, recorded_by_sleuth=True)

        for module in [flex, *[m for m in list(sys.modules.values()) if getattr(m, "create_block_mask", None) is flex.create_block_mask]]:
            self.patched.append((module, module.create_block_mask))
            module.create_block_mask = record
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, original in self.patched:
            module.create_block_mask = original


class _record_calls:
    """Which functions of the diagnosed code ran (their file and first line), while the block runs."""

    def __init__(self, sink: set[tuple[str, int]]) -> None:
        self.sink = sink

    def __enter__(self) -> _record_calls:
        def profile(frame: Any, event: str, _arg: Any) -> None:
            if event == "call":
                code = frame.f_code
                self.sink.add((code.co_filename, code.co_firstlineno))

        self.previous = sys.getprofile()
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(self.previous)
