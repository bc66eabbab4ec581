"""Block targets and positions: target shift, block position ids, where target logits come from."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from sleuth.evidence.origins import (
    Origin,
    block_legs,
    call_bindings,
    head_input,
    keyed_values,
    reaching_definitions,
    trace,
    value_uses,
)
from sleuth.evidence.ast_index import (
    Analyzer,
    CodeReading,
    LOGITS_TOKENS,
    Mode,
    POSITION_TOKENS,
    PRESERVING_METHODS,
    TOKEN_ID_TOKENS,
    is_module_name,
    reading_at,
    scope_mentions_anchor,
    nodes_of,
    call_name,
    const_number,
    is_blocksize_name,
    kwarg,
    leaf_name,
    tokens,
)
from sleuth.evidence.registry import detector


# --- positions, targets ------------------------------------------------------------------------------


def _index_uses(an: Analyzer) -> Iterator[tuple[ast.AST, ast.expr, ast.expr]]:
    """(node, source tensor, index expression) for subscripts, gather / take_along_dim / index_select."""
    for node in nodes_of(an, (ast.Subscript, ast.Call)):
            if isinstance(node, ast.Subscript):
                index = node.slice
                parts = index.elts if isinstance(index, ast.Tuple) else [index]
                for part in parts:
                    if not isinstance(part, ast.Slice):
                        yield node, node.value, part
            elif isinstance(node, ast.Call):
                name = call_name(node)
                if name in {"gather", "take_along_dim", "index_select"}:
                    if isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value):
                        src, idx = node.func.value, node.args[-1] if node.args else kwarg(node, "index")
                    else:
                        src = node.args[0] if node.args else None
                        idx = node.args[-1] if len(node.args) >= 2 else kwarg(node, "index")
                    if src is not None and idx is not None:
                        yield node, src, idx


def _tensor_kind(an: Analyzer, node: ast.AST, depth: int = 0) -> tuple[str | None, int]:
    """('logits' | 'tokens' | None, roll shift) of the tensor an index is applied to."""
    if depth > 5:
        return None, 0
    if isinstance(node, ast.Call):
        name = call_name(node)
        if name == "roll":
            shift_node = node.args[1] if len(node.args) >= 2 else kwarg(node, "shifts")
            shift = const_number(shift_node)
            src = node.args[0] if node.args and not (isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value)) else getattr(node.func, "value", None)
            kind, inner = _tensor_kind(an, src, depth + 1) if src is not None else (None, 0)
            return kind, inner + (int(shift) if shift is not None else 0)
        if isinstance(node.func, ast.Attribute) and name in PRESERVING_METHODS and not is_module_name(node.func.value):
            return _tensor_kind(an, node.func.value, depth + 1)
        lname = set(tokens(name))
        if lname & {"lm", "head", "logits", "unembed"}:
            return "logits", 0
        if name in {"argmax", "softmax", "log_softmax", "sigmoid"}:
            # the target's prediction at t (argmax or distribution) keeps the logits' alignment: it is token t+1
            src = node.func.value if isinstance(node.func, ast.Attribute) and not is_module_name(node.func.value) else (
                node.args[0] if node.args else None)
            if src is not None:
                return _tensor_kind(an, src, depth + 1)
    if isinstance(node, ast.Attribute) and node.attr == "logits":
        return "logits", 0
    if isinstance(node, ast.Subscript):
        if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            # `batch["key"]`: what the code stored under the key decides (a cache of the target's argmax is
            # its predictions, whatever the key says); the key's name fills in only when the stores say nothing
            stored = _origin_kind(an, keyed_values(an, node.slice.value)[:3], depth)
            if stored is not None:
                return stored
        return _tensor_kind(an, node.value, depth + 1)
    name = leaf_name(node)
    toks = set(tokens(name))
    kind = None
    if toks & LOGITS_TOKENS or (toks & {"target", "targets"} and not toks & TOKEN_ID_TOKENS):
        kind = "logits"
    elif toks & TOKEN_ID_TOKENS:
        kind = "tokens"
    if toks & POSITION_TOKENS or toks & {"mask", "doc", "docs", "weight", "weights", "valid"}:
        return None, 0
    roll = 0
    if isinstance(node, (ast.Name, ast.Attribute)):
        found = an.defs_of(node)
        if found and not found[0] and isinstance(node, ast.Name) and node.id in found[1].params:
            # a parameter: what its callers pass decides
            passed = [arg for _call, arg in call_bindings(an, found[1].node, node.id) if isinstance(arg, ast.expr)]
            origin = _origin_kind(an, passed[:3], depth)
            if origin is not None:
                return origin
        if found and found[0]:
            own = ast.unparse(node)
            for definition in found[0]:
                # x = roll(x, 1): a shift of the same tensor, counted once; its kind comes from the other defs
                if isinstance(definition, ast.Call) and call_name(definition) == "roll" and definition.args and ast.unparse(definition.args[0]) == own:
                    shift = const_number(definition.args[1] if len(definition.args) >= 2 else kwarg(definition, "shifts"))
                    roll += int(shift) if shift is not None else 0
                    continue
                inner_kind, inner_roll = _tensor_kind(an, definition, depth + 1)
                # where the value comes from decides; the name only fills in when the origin says nothing
                kind = inner_kind or kind
                roll += inner_roll
    return kind, roll


def _origin_kind(an: Analyzer, values: list[ast.expr], depth: int) -> tuple[str, int] | None:
    """The kind the values agree on (logits or tokens, with their roll), or None where they say nothing or
    disagree."""
    kinds = {_tensor_kind(an, value, depth + 1) for value in values}
    kinds = {k for k in kinds if k[0] is not None}
    return kinds.pop() if len(kinds) == 1 else None


def _label_context(an: Analyzer, node: ast.AST) -> bool:
    """Token ids read at block positions are labels only where they feed a loss or a label/target name;
    elsewhere (an inference loop copying the block's own tokens) they are inputs."""
    current = an.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.Call) and re.search(r"cross_entropy|nll|loss|kl_div", call_name(current)):
            return True
        current = an.parents.get(current)
    if isinstance(current, (ast.Assign, ast.AnnAssign)):
        targets = current.targets if isinstance(current, ast.Assign) else [current.target]
        if any(set(tokens(leaf_name(t))) & {"label", "labels", "target", "targets", "tgt", "y", "gold"} for t in targets):
            return True
    func = an.enclosing_function(node)
    return func is not None and bool(re.search(r"loss|label|target|objective", func.name, re.I))


def _index_only(an: Analyzer, node: ast.AST) -> bool:
    """An assignment (or keyword) whose value is only ever used to index other tensors or in comparisons:
    `label_pos = anchors[:, None] + 1 + arange(B); labels = ids[label_pos]` is a gather index, whatever it is
    called; position ids reach a rotary embedding or a model's `position_ids`."""
    if isinstance(node, ast.Assign):
        uses = value_uses(an, node.value)
    elif isinstance(node, ast.Expr):
        return False
    else:
        return False
    return bool(uses) and uses <= {"index", "compare"}


def _only_compared(an: Analyzer, node: ast.AST) -> bool:
    """Targets gathered only to be compared (accuracy against the draft's argmax): not what the loss trains
    toward, so not a reading of the shift the loss uses."""
    uses = value_uses(an, node)
    return bool(uses) and "compare" in uses and uses <= {"compare", "index"}


@detector("dflash.target_shift")
def detect_target_shift(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node, src, idx in _index_uses(an):
        offsets = an.block_index_offsets(idx)
        if not offsets:
            continue
        kind, roll = _tensor_kind(an, src)
        if kind is None or (kind == "tokens" and not _label_context(an, node)) or _only_compared(an, node):
            continue
        for offset, switch in offsets:
            effective = offset - roll
            want = -1 if kind == "logits" else 0
            # a label token at p+j is the distribution at p+j-1: both say "slot j learns token p+j"
            label_offset = effective + 1 if kind == "logits" else effective
            value = "p+j-1" if effective == want else f"p+j{label_offset - 1:+d}"
            src_text = ast.unparse(src)[:60]
            detail = (f"slot j reads {kind} of `{src_text}` at p+j{effective:+d}"
                      + (f" after roll by {roll}" if roll else "")
                      + ("" if effective == want else f" (slot j learns token p+j{label_offset:+d}, not p+j)"))
            if_switch = switch or an.switch_of(node)
            mode = "switch" if if_switch else "hardcoded"
            readings.append(reading_at(an, "dflash.target_shift", value, node, 0.8, mode=mode, switch=if_switch, detail=detail))
    # slices: teacher_logits[:, p - 1 : p + B - 1] / input_ids[p + 1 : p + B + 1]; the upper bound fixes which
    # element the last slot gets, so slot j reads p + j + c for an upper bound p + B + c
    for node in nodes_of(an, ast.Subscript):
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for part in parts:
            if not isinstance(part, ast.Slice) or part.upper is None or part.lower is None:
                continue
            if "anchor" not in an.tags(part.upper) or not any(an.is_blocksize(n) for n in ast.walk(part.upper) if isinstance(n, (ast.Name, ast.Attribute))):
                continue
            kind, roll = _tensor_kind(an, node.value)
            if kind is None or (kind == "tokens" and not _label_context(an, node)) or _only_compared(an, node):
                continue
            effective = an.const_offset(part.upper) - roll
            want = -1 if kind == "logits" else 0
            label_offset = effective + 1 if kind == "logits" else effective
            value = "p+j-1" if effective == want else f"p+j{label_offset - 1:+d}"
            switch = an.switch_of(node)
            readings.append(reading_at(an, "dflash.target_shift", value, node, 0.7, mode="switch" if switch else "hardcoded", switch=switch,
                                     detail=f"slot j reads {kind} of `{ast.unparse(node.value)[:50]}` at p+j{effective:+d} (slice {ast.unparse(part)})"))
    return readings


def _block_position_readings(an: Analyzer, node: ast.AST, candidate: ast.expr, siblings: list[ast.expr],
                             target_name: str) -> list[CodeReading] | None:
    """Block positions read along the anchor's whole path (i11-attn): an offset on a helper's argument or in a
    reassignment counts, and a block whose positions are joined to the context's position tensor must take the
    anchor's position from that tensor: the anchor's packed index is its position only where positions are a
    plain arange (packed documents restart theirs). None when no anchor + arange(B) is found here."""
    legs = block_legs(an, candidate)
    if not legs:
        return None
    context_positions = [s for s in siblings if s is not candidate]
    out = []
    seen: set[tuple] = set()
    for leg, start in legs:
        offset = leg.offset + start
        key = (offset, leg.lookup, leg.complete, leg.switch)
        if key in seen:
            continue
        seen.add(key)
        value = "anchor+j" if offset == 0 else f"anchor+j{offset:+d}"
        detail = f"block token j at position anchor + j{offset:+d} (`{target_name}`)"
        confidence = 0.8
        if leg.lookup is None and context_positions and _packs_documents(an) and not all(_is_plain_arange(an, c) for c in context_positions):
            value = "anchor index+j" if offset == 0 else f"anchor index+j{offset:+d}"
            detail = (f"block positions start at the anchor's packed index, but the context's positions are "
                      f"`{ast.unparse(context_positions[0])[:40]}` (document positions in a packed row): the anchor's "
                      f"position is that tensor at the anchor")
            confidence = 0.85  # it sees both parts of the positions: it outranks a reading of the block part alone
        elif leg.lookup is not None and context_positions and not any(
                ast.unparse(c).startswith(leg.lookup.split("[")[0]) for c in context_positions):
            detail += f"; the anchor's position is read from `{leg.lookup}`"
        if leg.entered is not None and offset:
            detail += f"; the offset enters at `{ast.unparse(leg.entered)[:50]}` ({an.unit(leg.entered).path}:{getattr(leg.entered, 'lineno', 0)})"
        mode = "switch" if leg.switch else "hardcoded"
        if not leg.complete:
            value += "?"
            detail += f"; the anchor's path is not traced: {leg.missing}"
        out.append(reading_at(an, "dflash.block_position_ids", value, node, confidence, mode=mode, switch=leg.switch, detail=detail))
    return out


def _sliced_block_positions(an: Analyzer, node: ast.AST, value: ast.expr, target_name: str) -> CodeReading | None:
    """Serving style: the block's positions cut from a plain arange of positions, `pos[:, start : start + B]`
    (or a context-and-block window ending at `start + B`): block token j sits at start + j + c."""
    if not isinstance(value, ast.Subscript) or not _is_plain_arange(an, value.value):
        return None
    parts = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
    cut = parts[-1]
    if not isinstance(cut, ast.Slice) or cut.upper is None:
        return None
    upper = cut.upper
    size_terms = [n for n in ast.walk(upper) if isinstance(n, (ast.Name, ast.Attribute)) and an.is_blocksize(n)]
    if not size_terms or "anchor" not in an.tags(upper):
        return None
    offset = an.const_offset(upper)
    if cut.lower is not None and "anchor" in an.tags(cut.lower) and an.const_offset(cut.lower) != offset:
        return reading_at(an, "dflash.block_position_ids", "anchor+j?", node, 0.6,
                          detail=f"`{ast.unparse(value)[:60]}`: the start and the end of the cut disagree")
    text = "anchor+j" if offset == 0 else f"anchor+j{offset:+d}"
    # serving is a site of its own: correct training positions elsewhere do not vouch for it
    return reading_at(an, "dflash.block_position_ids", text, node, 0.7 if offset == 0 else 0.85,
                      detail=f"`{target_name}` cut from a plain arange as `{ast.unparse(cut)}`: block token j at anchor + j{offset:+d}")


def _packs_documents(an: Analyzer) -> bool:
    """Whether the code packs several documents in a row: it compares one tensor read at two places for
    equality (`doc_ids[q] == doc_ids[kv]`, through names), the same-document rule of a packed mask."""
    def base(node: ast.AST, depth: int = 0) -> str | None:
        if isinstance(node, ast.Subscript):
            return ast.unparse(node.value)
        if isinstance(node, ast.Name) and depth < 3:
            reached = reaching_definitions(an, node)
            if reached and len(reached[0]) == 1:
                return base(reached[0][0], depth + 1)
        return None

    def compute() -> bool:
        for node in nodes_of(an, ast.Compare):
            if len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
                left, right = base(node.left), base(node.comparators[0])
                if left is not None and left == right:
                    return True
        return False
    return an.memo("packs-documents", compute)


def _is_plain_arange(an: Analyzer, node: ast.AST, depth: int = 0) -> bool:
    """Positions that are certainly 0..n-1 (an arange built here, through names and layout methods)."""
    if depth > 6:
        return False
    if isinstance(node, ast.Call):
        if call_name(node) == "arange" and an.arange_start(node) == 0:
            return True
        if isinstance(node.func, ast.Attribute) and call_name(node) in PRESERVING_METHODS and not is_module_name(node.func.value):
            return _is_plain_arange(an, node.func.value, depth + 1)
        return False
    if isinstance(node, ast.Subscript):
        return _is_plain_arange(an, node.value, depth + 1)
    if isinstance(node, ast.Name):
        reached = reaching_definitions(an, node)
        if reached is None:
            return False
        definitions, is_param = reached
        return bool(definitions) and not is_param and all(_is_plain_arange(an, d, depth + 1) for d in definitions)
    return False


@detector("dflash.block_position_ids")
def detect_block_position_ids(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node in nodes_of(an, (ast.Assign, ast.keyword, ast.Expr)):
            target_name, value_node = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target_name, value_node = leaf_name(node.targets[0]), node.value
            elif isinstance(node, ast.keyword) and node.arg:
                target_name, value_node = node.arg, node.value
            elif (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                  and node.value.func.attr == "append" and len(node.value.args) == 1):
                # positions built in a loop: pos.append(a + j)
                target_name, value_node = leaf_name(node.value.func.value), node.value.args[0]
            if not target_name or value_node is None or not set(tokens(target_name)) & POSITION_TOKENS:
                continue
            if _index_only(an, node):
                continue  # a position-named index used only to gather (labels, targets): not position ids
            if isinstance(value_node, ast.Call) and call_name(value_node) in {"cat", "concat", "concatenate"} and value_node.args:
                # the joined parts are the first argument's elements; the rest (`dim`) is not a part
                joined = value_node.args[0]
                candidates = list(joined.elts) if isinstance(joined, (ast.List, ast.Tuple)) else [joined]
            else:
                candidates = [value_node]
            sliced = _sliced_block_positions(an, node, value_node, target_name)
            if sliced is not None:
                readings.append(sliced)
                continue
            for candidate in candidates:
                traced = _block_position_readings(an, node, candidate, candidates, target_name)
                if traced is not None:
                    readings += traced
                else:
                    for offset, switch in an.block_index_offsets(candidate):
                        value = "anchor+j" if offset == 0 else f"anchor+j{offset:+d}"
                        mode = "switch" if switch else "hardcoded"
                        readings.append(reading_at(an, "dflash.block_position_ids", value, node, 0.8, mode=mode, switch=switch,
                                                 detail=f"block token j at position anchor + j{offset:+d} (`{target_name}`)"))
                while (isinstance(candidate, ast.Call) and isinstance(candidate.func, ast.Attribute)
                       and call_name(candidate) in PRESERVING_METHODS and not is_module_name(candidate.func.value)):
                    candidate = candidate.func.value
                if (isinstance(candidate, ast.Call) and call_name(candidate) == "arange" and not an.block_index_offsets(candidate)
                        and not set(tokens(target_name)) & {"offset", "offsets", "off", "delta", "rel", "relative", "local"}
                        and scope_mentions_anchor(an, node) and "anchor" not in an.tags(candidate)
                        and any(is_blocksize_name(leaf_name(a)) for a in candidate.args)):
                    readings.append(reading_at(an, "dflash.block_position_ids", "0..B-1 (block-local)", node, 0.6,
                                             detail=f"`{target_name}` restarts at 0 in every block instead of anchor + j"))
    return readings


@detector("dflash.target_logits_source")
def detect_target_logits_source(an: Analyzer) -> list[CodeReading]:
    readings = []
    for node in nodes_of(an, ast.Subscript):
        base = node.value
        base_tokens = set(tokens(leaf_name(base)))
        if not base_tokens & {"hidden", "hiddens", "hs", "states", "activations", "layers"} or base_tokens & {"last"}:
            continue
        parent = an.parents.get(node)
        # the subscript must feed a head (lm_head / logits / norm -> lm_head) to be a target source
        feeds_head, current = False, parent
        for _ in range(5):
            if current is None:
                break
            if isinstance(current, ast.Call):
                name = set(tokens(call_name(current)))
                if name & {"lm", "head", "logits", "unembed", "output"}:
                    feeds_head = True
                    break
            current = an.parents.get(current)
        if not feeds_head:
            continue
        index = node.slice
        parts = index.elts if isinstance(index, ast.Tuple) else [index]
        part = parts[0] if len(parts) == 1 else next((p for p in parts if not isinstance(p, ast.Slice)), parts[-1])
        number = const_number(part)
        if number is None and not isinstance(part, ast.Slice):
            resolved = an.literal(part)
            number = resolved if isinstance(resolved, (int, float)) and not isinstance(resolved, bool) else None
        if number is None and isinstance(part, (ast.Name, ast.Attribute)):
            # cfg.teacher_layer / self.hparams.layer: the default of the config field or parameter it names
            number = _named_default(an, leaf_name(part))
        switch = an.switch_of(node)
        mode: Mode = "switch" if switch else "hardcoded"
        if number == -1:
            value, detail = "final", "the last hidden state"
        elif number is not None:
            # a constant index is a layer only on the per-layer tuple (out.hidden_states, or a name bound to it)
            # and only where it feeds the targets; on a plain tensor it may be a batch index
            if not (_is_layer_tuple(an, base) and (_feeds_target(an, node) or _target_side(an, node))):
                continue
            value, detail = "intermediate", f"hidden_states[{int(number)}], not the last layer"
        elif isinstance(part, ast.Slice):
            continue
        else:
            names = {leaf_name(n) for n in ast.walk(part) if isinstance(n, (ast.Name, ast.Attribute))}
            list_pick = any(isinstance(n, ast.Subscript) and re.search(r"layer|ids", leaf_name(n.value), re.I)
                            for n in ast.walk(part))
            scope = an.scope(node)
            runtime = [n.id for n in ast.walk(part) if isinstance(n, ast.Name) and scope.param_default(n.id) is not None]
            if any("num" in n.lower() for n in names):
                continue
            if list_pick:
                value, detail = "intermediate", f"hidden_states[{ast.unparse(part)}]: a selected (intermediate) layer"
            elif runtime:
                value, detail, mode = "intermediate", f"hidden_states[{ast.unparse(part)}]: a layer chosen at run time", "switch"
                switch = switch or f"parameter {runtime[0]}"
            elif any(re.search(r"layer|ids", n, re.I) for n in names):
                value, detail = "intermediate", f"hidden_states[{ast.unparse(part)}]: a selected (intermediate) layer"
            else:
                continue
        readings.append(reading_at(an, "dflash.target_logits_source", value, node, 0.75, mode=mode, switch=switch, detail=detail))
    readings += _head_origins(an)
    # the target model's own `.logits`, read where the targets are built (gathered, argmax'd or softmax'd)
    for node in nodes_of(an, ast.Attribute):
        if node.attr != "logits" or not _model_output(an, node.value):
            continue
        parent = an.parents.get(node)
        if isinstance(parent, ast.Assign):
            continue  # handled below
        used = False
        current = parent
        while current is not None and not isinstance(current, ast.stmt):
            if (isinstance(current, ast.Subscript) and current.value is node) or (
                    isinstance(current, ast.Call) and call_name(current) in {"argmax", "softmax", "log_softmax", "gather", "take_along_dim"}):
                used = True
            current = an.parents.get(current)
        if used:
            switch = an.switch_of(node)
            readings.append(reading_at(an, "dflash.target_logits_source", "final", node, 0.7,
                                     mode="switch" if switch else "hardcoded", switch=switch,
                                     detail=f"targets read from `{ast.unparse(node)}`, the target model's own output logits"))
    for node in nodes_of(an, ast.Assign):
        if len(node.targets) != 1 or not isinstance(node.value, ast.Attribute) or node.value.attr != "logits":
            continue
        target = leaf_name(node.targets[0])
        toks = set(tokens(target))
        producer = node.value.value
        producer_name = set(tokens(leaf_name(producer))) if isinstance(producer, (ast.Name, ast.Attribute, ast.Call)) else set()
        if toks & {"target", "teacher", "verifier", "ref", "base"} or producer_name & {"target", "teacher", "verifier", "base"}:
            switch = an.switch_of(node)
            readings.append(reading_at(an, "dflash.target_logits_source", "final", node, 0.75,
                                     mode="switch" if switch else "hardcoded", switch=switch,
                                     detail="targets are the target model's own output logits"))
    return readings


def _head_origins(an: Analyzer) -> list[CodeReading]:
    """Every head application whose input comes from the target's per-layer tuple, read by value origin:
    `lm_head(norm(x))` with `x = out.hidden_states[ids[-1] + 1]` is an intermediate layer, whatever `x` is
    called. An input whose origin is not established gives no reading; a name that says "last" only
    explains the unknown (`final?`)."""
    readings = []
    for node in nodes_of(an, ast.Call):
        arg = head_input(node)
        if arg is None:
            continue
        origins = trace(an, arg)
        layered = [o for o in origins if o.kind in ("layer", "last_hidden")]
        for origin in layered:
            value, detail, mode, switch = _layer_origin_value(an, origin)
            if value is None:
                continue
            via = f" (traced from `{ast.unparse(arg)[:50]}`)" if origin.steps else ""
            readings.append(reading_at(an, "dflash.target_logits_source", value, node, 0.8, mode=mode,
                                     switch=switch or an.switch_of(node), detail=detail + via))
        fused = _fusion_input_slice(an, arg) if not layered else None
        if fused is not None:
            readings.append(reading_at(an, "dflash.target_logits_source", "intermediate", node, 0.75,
                                       mode="switch" if an.switch_of(node) else "hardcoded", switch=an.switch_of(node),
                                       detail=f"the head's input `{ast.unparse(arg)[:50]}` is `{ast.unparse(fused)[:50]}`, a "
                                              "slice of what the drafter's fc fuses (the selected target layers), not the "
                                              "model's output"))
            continue
        if not layered and _feeds_target(an, node):
            names = {leaf_name(n).lower() for n in ast.walk(arg) if isinstance(n, (ast.Name, ast.Attribute))}
            if any("last" in n or "final" in n for n in names):
                missing = next((o.missing for o in origins if o.missing), "its origin is not in the code")
                readings.append(reading_at(an, "dflash.target_logits_source", "final?", node, 0.4,
                                         detail=f"the head's input `{ast.unparse(arg)[:50]}` is named as the last layer, "
                                                f"but {missing}"))
    return readings


def _fusion_input_slice(an: Analyzer, arg: ast.expr) -> ast.expr | None:
    """The head's input, followed through its definitions in the same function, is a slice of the tensor that
    function hands to the drafter's fusion projection (`fc(features)`): one of the selected target layers,
    not the target's output. Returns that slice."""
    from sleuth.evidence.detectors.fusion import detect_fc  # the fusion projection's attribute names

    fc_names = set(an.memo("fc", lambda: detect_fc(an))[1])
    func = an.enclosing_function(arg)
    if not fc_names or func is None:
        return None
    fused = set()
    for call in nodes_of(an, ast.Call):
        if leaf_name(call.func) in fc_names and call.args and isinstance(call.args[0], ast.Name) \
                and an.enclosing_function(call) is func:
            fused.add(call.args[0].id)
    if not fused:
        return None
    pending, seen = [arg], 0
    while pending and seen < 12:
        expr = pending.pop()
        seen += 1
        while True:  # norms, tensor methods and row picks keep what a value is
            if isinstance(expr, ast.Call) and expr.args and set(tokens(call_name(expr))) & {"norm", "rmsnorm", "layernorm"}:
                expr = expr.args[0]
            elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and call_name(expr) in PRESERVING_METHODS:
                expr = expr.func.value
            else:
                break
        if isinstance(expr, ast.Subscript):
            parts = expr.slice.elts if isinstance(expr.slice, ast.Tuple) else [expr.slice]
            if isinstance(expr.value, ast.Name) and expr.value.id in fused and isinstance(parts[-1], ast.Slice):
                return expr  # features[..., -H:]: a slice along the concatenated layers
            pending.append(expr.value)
        elif isinstance(expr, ast.Name):
            found = an.defs_of(expr)
            if found and found[0]:
                pending += [d for d in found[0][-3:] if an.enclosing_function(d) is func]
    return None


def _layer_origin_value(an: Analyzer, origin: Origin) -> tuple[str | None, str, Mode, str | None]:
    if origin.kind == "last_hidden":
        return "final", "the target's last_hidden_state", "hardcoded", None
    index = origin.index
    assert index is not None
    if isinstance(index, ast.Name) and index.id in origin.bindings:
        index = origin.bindings[index.id]
    text = ast.unparse(index)
    number = const_number(index)
    if number is None:
        resolved = an.literal(index)
        number = resolved if isinstance(resolved, (int, float)) and not isinstance(resolved, bool) else None
    if number == -1:
        return "final", "hidden_states[-1], the last layer", "hardcoded", None
    relative = _depth_relative(index)
    if relative is not None:
        # HF's per-layer tuple has L + 1 entries: index L (= len - 1) is the last layer's output, L - 1 the one before
        if relative == 0:
            return "final", f"hidden_states[{text}], the last layer", "hardcoded", None
        return "intermediate", (f"hidden_states[{text}]: {-relative} before the last of the L + 1 entries, the output of "
                                f"layer L{relative - 1:+d}, not the target's output"), "hardcoded", None
    if number is not None:
        return "intermediate", f"hidden_states[{int(number)}], not the last layer", "hardcoded", None
    if any(isinstance(n, ast.Subscript) for n in ast.walk(index)):
        return "intermediate", f"hidden_states[{text}]: an element of a layer list (a selected, intermediate layer)", "hardcoded", None
    scope = an.scope(origin.node)
    runtime = [n.id for n in ast.walk(index) if isinstance(n, ast.Name) and scope.param_default(n.id) is not None]
    if runtime:
        return "intermediate", f"hidden_states[{text}]: a layer chosen at run time", "switch", f"parameter {runtime[0]}"
    return None, "", "hardcoded", None


_DEPTH = re.compile(r"[\w.]*(num_(hidden_)?layers|n_layers|num_target_layers|n_layer|depth)")


def _depth_relative(index: ast.AST) -> int | None:
    """For an index written against the model's depth: its distance from the last entry of the per-layer tuple
    (`num_hidden_layers` and `len(hs) - 1` are 0, `num_hidden_layers - 1` is -1), else None."""
    offset = 0
    while isinstance(index, ast.BinOp) and isinstance(index.op, (ast.Add, ast.Sub)) and const_number(index.right) is not None:
        offset += int(const_number(index.right)) * (1 if isinstance(index.op, ast.Add) else -1)
        index = index.left
    if isinstance(index, ast.Call) and call_name(index) == "len":
        return offset + 1  # len(hidden_states) - 1 is the last entry
    if isinstance(index, (ast.Name, ast.Attribute)) and _DEPTH.fullmatch(ast.unparse(index)):
        return offset
    return None


def _named_default(an: Analyzer, name: str) -> int | None:
    """The one integer default that a config field / function parameter called `name` has, if unambiguous."""
    values = set()
    for value_node, _unit, _stmt in an.field_defaults.get(name, []):
        values.add(an.literal(value_node))
    for func_list in an.functions.values():
        for _func, scope in func_list:
            default = scope.params.get(name)
            if default is not None:
                values.add(an.literal(default))
    if len(values) == 1:
        value = values.pop()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
            return int(value)
    return None


def _model_output(an: Analyzer, node: ast.AST, depth: int = 0) -> bool:
    """`node` is the output of the target / teacher / verifier model: target(...), or a name bound to it."""
    if depth > 3:
        return False
    if isinstance(node, ast.Call):
        callee = node.func.value if isinstance(node.func, ast.Attribute) and node.func.attr in {"forward", "__call__"} else node.func
        return bool(set(tokens(leaf_name(callee))) & {"target", "teacher", "verifier", "base", "oracle"})
    if isinstance(node, (ast.Name, ast.Attribute)):
        found = an.defs_of(node)
        return bool(found and found[0] and all(_model_output(an, d, depth + 1) for d in found[0]))
    return False


def _is_layer_tuple(an: Analyzer, base: ast.AST) -> bool:
    """out.hidden_states / all_hidden_states / a name assigned from `.hidden_states`."""
    if isinstance(base, ast.Attribute) and base.attr in {"hidden_states", "all_hidden_states"}:
        return True
    if isinstance(base, ast.Name):
        if base.id in {"all_hidden_states", "layer_outputs", "all_hiddens"}:
            return True
        found = an.defs_of(base)
        return bool(found and any(isinstance(d, ast.Attribute) and d.attr in {"hidden_states", "all_hidden_states"} for d in found[0]))
    return False


def _target_side(an: Analyzer, node: ast.AST) -> bool:
    """Inside a function about the target / teacher / verifier, or through the target's own head."""
    func = an.enclosing_function(node)
    if func is not None and re.search(r"target|teacher|verifier|label|distill", func.name, re.I):
        return True
    current = an.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        if isinstance(current, ast.Call) and isinstance(current.func, ast.Attribute):
            owner = set(tokens(leaf_name(current.func.value)))
            if owner & {"target", "teacher", "verifier", "base", "model"} and set(tokens(current.func.attr)) & {"lm", "head", "logits"}:
                return True
        current = an.parents.get(current)
    return False


def _feeds_target(an: Analyzer, node: ast.AST) -> bool:
    current = an.parents.get(node)
    while current is not None and not isinstance(current, ast.stmt):
        current = an.parents.get(current)
    if isinstance(current, ast.Assign):
        names = {leaf_name(t) for t in current.targets}
        return any(set(tokens(n)) & {"target", "targets", "teacher", "verifier", "labels"} for n in names)
    return False
