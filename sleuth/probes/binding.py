"""Calling a located piece of someone else's code with synthetic inputs (the probe child's side).

A piece is a function (or method, or constructor) sleuth found statically (sleuth/probes/locate.py). Its
parameters are bound, in this order of trust:
  1. what the run passes at its call sites, when that is a literal or a default sleuth read (`passed`);
  2. a *role* the probe can supply (anchors, block size, document ids, the target's logits, ...), matched by
     the parameter's name and annotation, each role with the shapes it is commonly given in;
  3. the parameter's own default (the run's default path);
  4. for a config-like parameter (`cfg`, `args`, a dataclass annotation): the code's own config class built
     with its defaults, or a namespace answering attributes from the roles and the code's settings.
Parameters that match several shapes are tried one combination at a time (trial calls); the first call
whose result the piece's validator accepts wins. Everything tried is recorded, so the report says how the
piece was called and, when nothing worked, what could not be bound.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_TRIALS = 48

NO_VALUE = object()


class BindError(Exception):
    """A parameter sleuth cannot supply; the message says which and why."""


@dataclass
class Trial:
    """One call: the arguments given (described) and what happened."""

    arguments: dict[str, str]
    outcome: str = ""  # "ok", or why the result was rejected, or the error


@dataclass
class Call:
    """The accepted call of a piece: the result and how every parameter was bound."""

    result: Any
    arguments: dict[str, Any]
    how: dict[str, str]  # param -> "role anchors [A]" / "passed by the run (16)" / "default" / ...
    trials: list[Trial] = field(default_factory=list)
    # param -> how it was bound, as data (what `sleuth probe init` writes code from):
    # {"role": key, "variant": shape} | {"passed": value} | {"default": True} | {"config": class} | {"namespace": [attrs]}
    binding: dict[str, dict[str, Any]] = field(default_factory=dict)

    def described(self) -> str:
        return ", ".join(f"{name}={how}" for name, how in self.how.items()) or "no arguments"


# --- importing the code under diagnosis ------------------------------------------------------------------------


def import_module(name: str, info: dict[str, Any]) -> tuple[types.ModuleType, str]:
    """The module, imported from the diagnosed tree. A module whose top level would do work on import (parse
    argv, load a model, train) is executed without those statements; the note says which were left out."""
    strip = set(info.get("strip") or [])
    if name in sys.modules:
        return sys.modules[name], ""
    if not strip:
        return importlib.import_module(name), ""
    import ast

    file = Path(info["file"])
    tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"))
    tree.body = [stmt for stmt in tree.body if stmt.lineno not in strip]
    module = types.ModuleType(name)
    module.__file__ = str(file)
    if "." in name:
        parent = importlib.import_module(name.rpartition(".")[0])
        module.__package__ = parent.__name__
    sys.modules[name] = module
    try:
        exec(compile(tree, str(file), "exec"), module.__dict__)  # noqa: S102 - the code under diagnosis, in the probe child
    except BaseException:
        del sys.modules[name]
        raise
    lines = ", ".join(str(n) for n in sorted(strip))
    return module, f"imported without its top-level statements at line {lines} (they run work on import)"


def resolve(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --- roles -----------------------------------------------------------------------------------------------------


@dataclass
class Role:
    """A value the probe can supply: a name and the shapes it is tried in (first = most common)."""

    name: str
    variants: list[tuple[str, Any]]  # (description, value or zero-argument factory)
    key: str = ""  # the role's id (set by the book it is in)


def _tokens(name: str) -> set[str]:
    import re

    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {t for t in re.split(r"[_\W\d]+", name.lower()) if t}


class RoleBook:
    """Which role a parameter name asks for (per kind of piece), and the values of each role."""

    def __init__(self, roles: dict[str, Role], vocabulary: dict[str, list[Callable[[str, set[str]], bool]]]) -> None:
        self.roles, self.vocabulary = roles, vocabulary
        for key, role in roles.items():
            role.key = role.key or key

    def role_for(self, name: str, annotation: str = "") -> Role | None:
        """Exact names first (over every role), then names by their words."""
        lower, toks = name.lower(), _tokens(name)
        for exact in (True, False):
            for role_name, tests in self.vocabulary.items():
                if role_name in self.roles and any(getattr(test, "exact", False) == exact and test(lower, toks)
                                                   for test in tests):
                    return self.roles[role_name]
        return None


def names(*words: str) -> Callable[[str, set[str]], bool]:
    """A test: the whole name is one of `words`."""
    wanted = set(words)

    def test(lower: str, _toks: set[str]) -> bool:
        return lower in wanted

    test.exact = True  # type: ignore[attr-defined]
    return test


def has(*words: str, without: tuple[str, ...] = ()) -> Callable[[str, set[str]], bool]:
    """A test: the name's tokens include one of `words` and none of `without`."""
    wanted, unwanted = set(words), set(without)
    return lambda _lower, toks: bool(toks & wanted) and not toks & unwanted


# --- configs and namespaces ------------------------------------------------------------------------------------


class RoleNamespace:
    """Stands in for `args` / `cfg` / `self`: attributes come from the roles, then the code's settings.
    What it could not answer is remembered, so a failed call says which option was missing."""

    def __init__(self, answer: Callable[[str], Any], label: str) -> None:
        object.__setattr__(self, "_answer", answer)
        object.__setattr__(self, "_label", label)
        object.__setattr__(self, "_asked", [])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._asked.append(name)
        value = self._answer(name)
        if value is NO_VALUE:
            raise AttributeError(f"{self._label}.{name}: sleuth has no value for this option")
        return value

    def __getitem__(self, key: str) -> Any:
        return self.__getattr__(str(key))

    def get(self, key: str, default: Any = None) -> Any:
        value = self._answer(str(key))
        return default if value is NO_VALUE else value

    def __contains__(self, key: str) -> bool:
        return self._answer(str(key)) is not NO_VALUE

    def __repr__(self) -> str:
        return f"<sleuth stand-in for {self._label}>"


def build_config(cls: type, answer: Callable[[str], Any]) -> Any:
    """An instance of the code's own config class: its defaults, with fields the roles / run config answer."""
    if dataclasses.is_dataclass(cls):
        values = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            value = answer(f.name)
            if value is not NO_VALUE:
                values[f.name] = value
        return cls(**values)
    signature = inspect.signature(cls)
    values = {}
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = answer(name)
        if value is not NO_VALUE:
            values[name] = value
        elif param.default is param.empty:
            raise BindError(f"{cls.__name__}({name}=...): no value for this field")
    return cls(**values)


# --- binding and trial calls -----------------------------------------------------------------------------------


@dataclass
class Slot:
    """How one parameter may be filled: candidate values, each with how it was chosen."""

    name: str
    options: list[tuple[str, Any, dict[str, Any]]]  # (how, value or factory, how as data)
    keyword: bool = False  # pass by keyword (a keyword-only parameter, or after a skipped one)


def _materialise(value: Any) -> Any:
    return value() if callable(value) and getattr(value, "_sleuth_factory", False) else value


def factory(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Mark a zero-argument callable as a value to build fresh for every trial (tensors a call may modify)."""
    fn._sleuth_factory = True  # type: ignore[attr-defined]
    return fn


def plan_slots(function: Any, params: list[dict[str, Any]], passed: dict[str, Any], unresolved: dict[str, str],
               book: RoleBook, config_answer: Callable[[str], Any], prefer_run: set[str], module: Any) -> list[Slot]:
    """The candidate values of every parameter (BindError when a required one has none)."""
    signature = _signature(function)
    slots: list[Slot] = []
    keyword = False
    for param in params:
        name, kind = param["name"], param["kind"]
        if kind in ("var_positional", "var_keyword"):
            continue
        sig_param = signature.parameters.get(name) if signature else None
        has_default = param.get("has_default") or (sig_param is not None and sig_param.default is not inspect.Parameter.empty)
        options: list[tuple[str, Any, dict[str, Any]]] = []
        role = None if _mapping_annotation(param.get("annotation", "")) else book.role_for(name, param.get("annotation", ""))
        if name in passed and (role is None or name in prefer_run or not isinstance(passed[name], (int, float))):
            options.append((f"{passed[name]!r}, as the run passes it", passed[name], {"passed": passed[name]}))
        if role is not None:
            options += [(f"{role.name} {how}", value, {"role": role.key, "variant": how}) for how, value in role.variants]
        config_class = _config_class(param.get("annotation", ""), module)
        if not options and config_class is not None:
            options.append((f"{config_class.__name__} with the code's defaults",
                            factory(lambda c=config_class: build_config(c, config_answer)), {"config": config_class.__name__}))
        if not options and (_config_like(name) or _mapping_annotation(param.get("annotation", ""))):
            options.append((f"a stand-in for `{name}` answering its options",
                            factory(lambda n=name: RoleNamespace(config_answer, n)), {"namespace": []}))
        if has_default:
            options.append(("its default", NO_VALUE, {"default": True}))
        if not options:
            why = unresolved.get(name) or unresolved.get("*") or "no call site on the run's path passes it"
            raise BindError(f"cannot bind `{name}`: no role sleuth can supply matches it and it has no default ({why})")
        keyword = keyword or kind == "keyword"
        slots.append(Slot(name, options, keyword))
    return slots


def _signature(function: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def _config_like(name: str) -> bool:
    return name.lower() in {"cfg", "config", "conf", "args", "opts", "options", "hparams", "settings", "params_cfg",
                            "opt", "hp", "flags", "training_args", "train_cfg", "model_cfg", "c", "hps", "run",
                            "dcfg", "tcfg", "s", "h"} or name.lower().endswith(("_cfg", "_config", "_args", "_hp"))


def _mapping_annotation(annotation: str) -> bool:
    """`h: dict`, `args: argparse.Namespace`, `cfg: Mapping[str, Any]`: options looked up by name."""
    return bool(annotation) and any(w in annotation for w in ("dict", "Dict", "Mapping", "Namespace"))


def _config_class(annotation: str, module: Any) -> type | None:
    """A config class named by a parameter's annotation and defined in the code (`cfg: DFlashConfig`)."""
    if not annotation or module is None:
        return None
    name = annotation.strip("'\"").split("[")[0].split(".")[-1].split("|")[0].strip()
    cls = getattr(module, name, None)
    if isinstance(cls, type) and (dataclasses.is_dataclass(cls) or "config" in name.lower() or "args" in name.lower()):
        return cls
    return None


def combinations(slots: list[Slot]) -> Iterator[list[tuple[Slot, str, Any]]]:
    """Argument sets, most likely first (each slot's options in order), at most MAX_TRIALS."""
    ranges = [range(len(s.options)) for s in slots]
    ordered = sorted(itertools.product(*ranges), key=lambda idx: (sum(idx), idx))
    for idx in ordered[:MAX_TRIALS]:
        yield [(slot, *slot.options[i]) for slot, i in zip(slots, idx)]


def call_piece(function: Any, slots: list[Slot], accept: Callable[[Any, dict[str, Any]], str | None]) -> Call:
    """Trial calls until `accept(result, arguments)` returns None (accepted); BindError with the trials when
    none is accepted."""
    trials: list[Trial] = []
    for combo in combinations(slots):
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        chosen: dict[str, Any] = {}
        how: dict[str, str] = {}
        binding: dict[str, dict[str, Any]] = {}
        keyword = False
        for slot, description, value, meta in combo:
            binding[slot.name] = dict(meta)
            if value is NO_VALUE:
                keyword = True
                continue
            value = _materialise(value)
            chosen[slot.name] = value
            how[slot.name] = description
            if keyword or slot.keyword:
                kwargs[slot.name] = value
            else:
                args.append(value)
        trial = Trial({k: v for k, v in how.items()})
        trials.append(trial)
        try:
            result = function(*args, **kwargs)
        except Exception as exc:  # the code under diagnosis may raise anything for a wrong shape
            trial.outcome = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ''}"
            continue
        rejected = accept(result, chosen)
        if rejected is None:
            trial.outcome = "ok"
            for name, value in chosen.items():
                if isinstance(value, RoleNamespace):
                    binding[name]["namespace"] = sorted(set(value._asked))
            return Call(result, chosen, how, trials, binding)
        trial.outcome = f"result rejected: {rejected}"
    last = trials[-1].outcome if trials else "no argument set to try"
    raise BindError(f"no call was accepted ({len(trials)} tried; last: {last})", )


# --- the vocabulary: which role a parameter name asks for ----------------------------------------------------
# (role key -> tests; exact names are tried first over every role, then names by their words)

_COUNT = ("num", "n", "max", "count", "total", "len", "size", "k")
COMMON_VOCABULARY = {
    "anchor_valid": [names("anchor_valid", "valid", "valid_anchors", "anchor_mask", "keep")],
    "anchors_per_query": [names("anchor_of_query", "q_anchor", "query_anchor", "anchor_per_query", "anchor_q",
                                "qa", "q_anchors")],
    "doc_of_query": [names("doc_of_query", "q_doc", "query_doc", "q_seg", "seg_of_query")],
    "num_anchors": [names("num_anchors", "n_anchors", "max_anchors", "k_anchors", "anchors_per_row", "n_blocks",
                          "num_blocks")],
    "anchors": [has("anchor", "anchors", "anc", "starts", without=_COUNT + ("valid", "mask", "of", "per", "q", "query")),
                names("start", "starts", "block_starts", "anchor_idx", "anchor_pos", "a_pos", "anchor_positions")],
    "block_size": [names("block", "blk", "b", "bs", "block_size", "block_len", "blocksize", "block_length", "draft_len",
                         "n_draft", "spec_len", "blk_size", "block_sz"), has("block", without=("mask", "ids", "id", "pos"))],
    "q_len": [names("q_len", "num_queries", "n_q", "query_len")],
    "kv_len": [names("kv_len", "k_len", "key_len", "num_keys")],
    "seq_len": [names("seq_len", "seqlen", "s", "ctx_len", "n_ctx", "context_len", "total_len", "seq_length", "length",
                      "t", "num_tokens", "ctx", "n_tokens", "row_len", "seq")],
    "cu_seqlens": [has("cu"), names("cu_seqlens", "offsets", "doc_offsets", "boundaries", "doc_starts", "doc_bounds")],
    "doc_ids": [names("doc", "docs", "doc_ids", "document_ids", "documents", "segment_ids", "seg", "seg_ids", "segs",
                      "sample_ids", "doc_of_key", "doc_id", "seq_ids"), has("doc", "document", "segment", "seg")],
    "position_ids": [names("position_ids", "pos_ids", "positions", "pos", "ctx_pos", "pos_id", "position", "row_pos",
                           "base_pos"), has("position", "positions", "pos")],
    "input_ids": [names("input_ids", "ids", "tokens", "toks", "token_ids", "stream", "tok", "x_ids", "seq_ids")],
    "loss_mask": [names("loss_mask", "label_mask", "labels_mask", "supervised")],
    "target_logits": [names("target_logits", "teacher_logits", "verifier_logits", "logits", "flat_logits", "t_logits",
                            "full_logits", "tgt_logits", "teacher", "all_logits", "top1", "predicted"),
                      has("logits", "teacher", "top1", without=("mask", "valid", "ids", "weights"))],
    "stand_in_target": [names("target", "model", "verifier", "target_model", "teacher_model", "base_model", "tgt_model")],
    "step_index": [names("step", "global_step", "batch_idx", "it", "iteration", "epoch", "batch_index")],
    "hidden_states": [names("hidden_states", "hs", "all_hidden", "all_hidden_states", "hidden", "states", "target_hidden",
                            "aux_hidden_states", "outputs", "feats_all", "layer_outputs")],
    "layer_ids": [names("layer_ids", "taps", "layers", "target_layer_ids", "layer_idx", "selected", "ids_to_select",
                        "aux_layer_ids", "layer_indices")],
    "lm_head": [names("lm_head", "head", "output_embeddings", "unembed", "out_proj", "output_layer")],
    "final_norm": [names("final_norm", "norm", "ln_f", "final_layernorm", "norm_f", "out_norm")],
    "embed": [names("embed", "embed_tokens", "embedding", "embeddings", "tok_emb", "wte")],
    "mask_token_id": [names("mask_token_id", "mask_id", "mask_token")],
    "vocab_size": [names("vocab_size", "vocab", "v", "n_vocab", "num_tokens_vocab")],
    "hidden_size": [names("hidden_size", "hidden", "d", "d_model", "dim", "h", "model_dim", "embed_dim")],
    "num_heads": [names("num_heads", "heads", "n_heads", "n_head", "num_attention_heads")],
    "num_kv_heads": [names("num_kv_heads", "n_kv", "kv_heads", "n_kv_heads", "num_key_value_heads")],
    "head_dim": [names("head_dim", "hd", "d_head")],
    "intermediate_size": [names("intermediate_size", "ffn", "mlp", "d_ff", "ff", "ffn_dim", "mlp_dim")],
    "device": [names("device")],
    "dtype": [names("dtype")],
    "generator": [names("g", "gen", "generator", "rng")],
    "gamma": [names("gamma", "decay_gamma", "loss_decay_gamma", "tau", "decay")],
}


LOSS_VOCABULARY = {
    "teacher_probs": [names("probs", "target_probs", "teacher_probs", "p_teacher", "soft_targets", "q")],
    "teacher_slots": [names("teacher", "teacher_logits", "target_logits", "verifier_logits", "tgt_logits", "t_logits",
                            "soft", "teacher_out", "target_out")],
    "labels": [names("labels", "targets", "target", "tgt", "target_ids", "y", "label_ids", "teacher_ids", "label", "gold")],
    "weights": [names("weights", "w", "loss_weights", "slot_weights", "decay", "wts", "position_weights", "weight")],
    "slot_valid": [names("valid", "anchor_valid", "mask", "loss_mask", "valid_mask", "slot_mask", "keep")],
    "draft_logits": [names("logits", "draft_logits", "draft", "pred", "preds", "student_logits", "scores", "output", "outputs",
                           "out", "student", "draft_out", "y_hat", "yhat", "prediction", "predictions"),
                     has("logits", without=("target", "teacher", "verifier", "tgt", "full", "all", "t"))],
}


