"""The observed optimizer and schedule -> verdicts (torch-free; the observation is untrusted input).

What the run configures comes from its command: the values its arguments name (`--lr 3e-4`), and those of a
config file an argument names (JSON or YAML, nested keys flattened), or the config sleuth was given. A value the
command does not name (an argparse default, a constant in code) is not configured: what reached the optimizer is
then reported, not judged. Every `match` is a comparison of the real optimizer's groups, or of a copy of the real
scheduler stepped from its first step, with a configured value; what the observer would have had to guess (the
run's horizon where neither the command nor the scheduler states it) is `unknown`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sleuth.probes.answer import safe_text
from sleuth.probes.verdict import Verdict

EXPERIMENT = "observed-step"
NOT_EXERCISED = "not exercised by the observed step"
GROUPS, HORIZON, SCHEDULE = "dflash.optimizer_groups", "dflash.schedule_horizon", "dflash.optimizer_schedule"
OPTIMIZATION_INVARIANTS = (GROUPS, HORIZON, SCHEDULE)
REL = 1e-6  # configured and observed hyper-parameters agree within this (they are the same float, or a cast)
MAX_CONFIG_BYTES = 1 << 20

# Configuration keys, normalised (lower case, "-" -> "_"), by what they configure.
_TOTAL = ("max_steps", "total_steps", "num_steps", "train_steps", "num_train_steps", "num_training_steps",
          "max_train_steps", "training_steps", "total_training_steps", "scheduler_total_steps", "max_iters",
          "num_iterations", "total_iters", "iterations")
_EPOCHS = ("epochs", "num_epochs", "num_train_epochs", "max_epochs", "train_epochs")
_WARMUP = ("warmup_steps", "num_warmup_steps", "warmup", "warmup_iters", "lr_warmup_steps", "scheduler_warmup_steps",
           "warmup_step")
_RATIO = ("warmup_ratio", "scheduler_warmup_ratio", "lr_warmup_ratio")
_CLIP = ("max_grad_norm", "grad_clip", "clip_grad_norm", "gradient_clipping", "max_norm", "grad_norm_clip",
         "clip_grad", "clip_norm")
_ACCUM = ("gradient_accumulation_steps", "grad_accum", "accumulation_steps", "grad_accum_steps", "accum_steps",
          "gradient_accumulation")
_EPS = ("eps", "adam_eps", "adam_epsilon", "epsilon", "optimizer_eps")
_NOT_A_RATE = {"min", "end", "final", "warmup", "start", "init", "initial", "scheduler", "decay", "floor"}
# Speculators 0.9.0 gives every tensor outside Muon (norms and biases included) AdamW's weight_decay: recipes differ
# on excluding vectors from decay, so where they land is reported, never judged.
_DECAY_RECIPE = ("speculators 0.9.0 train/optimizers.py build_optimizers (AdamW with weight_decay over every tensor "
                 "outside Muon, norms and biases included; trainer.py weight_decay 0.01)")


def _text(value: Any, limit: int = 300) -> str:
    return safe_text(str(value), limit=limit)


def _num(value: Any) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return "none"


def _float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-30)


def _verdict(invariant: str, status: str, *, hypothesis: str, measurement: str = "", observed: str = "",
             expected: str = "", reason: str = "", fix: str = "", coverage: dict[str, Any] | None = None) -> Verdict:
    return Verdict(invariant=invariant, status=status, experiment=EXPERIMENT, hypothesis=hypothesis,
                   perturbed="nothing: the run's own optimizer and scheduler, observed", measurement=measurement,
                   threshold=f"relative {REL:g} on hyper-parameters; the schedule at the scheduler's own steps",
                   observed=observed, expected=expected, reason=reason, fix=fix, coverage=coverage or {})


def _unknown(invariant: str, reason: str, coverage: dict[str, Any] | None = None) -> Verdict:
    return _verdict(invariant, "unknown", hypothesis="", reason=reason, coverage=coverage)


# --- what the run configures ------------------------------------------------------------------------------------


def _key(name: str) -> str:
    return name.strip().lstrip("-").lower().replace("-", "_")


def _flatten(data: Any, out: dict[str, list[Any]], depth: int = 0) -> None:
    if depth > 8:
        return
    if isinstance(data, dict):
        for key, value in list(data.items())[:2000]:
            # A list of plain values (betas, a layer selection) is one value; a list of sections is walked.
            if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
                _flatten(value, out, depth + 1)
            else:
                out.setdefault(_key(str(key)), []).append(value)
    elif isinstance(data, list):
        for item in data[:200]:
            if isinstance(item, dict):
                _flatten(item, out, depth + 1)


def _read_file(path: Path) -> dict[str, Any] | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            from sleuth.safe_yaml import load_yaml

            data = load_yaml(text)
    except Exception:  # noqa: BLE001 - an unreadable file configures nothing
        return None
    return data if isinstance(data, dict) else None


def run_configuration(command: list[str], cwd: Path, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values the run's command configures, each with where it came from: its arguments first, then each
    config file an argument names (in order), then the config sleuth was given."""
    layers: list[tuple[str, dict[str, list[Any]]]] = []
    arguments: dict[str, list[Any]] = {}
    files: list[tuple[str, dict[str, list[Any]]]] = []
    index = 0
    while index < len(command):
        token = command[index]
        value: str | None = None
        if token.startswith("--") and len(token) > 2:
            name, eq, rest = token.partition("=")
            if eq:
                value = rest
            elif index + 1 < len(command) and not command[index + 1].startswith("--"):
                value = command[index + 1]
                index += 1
            arguments.setdefault(_key(name), []).append(value if value is not None else True)
        else:
            value = token
        if isinstance(value, str) and Path(value).suffix in (".json", ".yaml", ".yml"):
            found = _read_file((cwd / value) if not Path(value).is_absolute() else Path(value))
            if found is not None:
                flat: dict[str, list[Any]] = {}
                _flatten(found, flat)
                files.append((f"{value} (named by the command)", flat))
        index += 1
    layers.append(("the command's arguments", arguments))
    layers.extend(files)
    if isinstance(config, dict):
        flat = {}
        _flatten(config, flat)
        layers.append(("the run's config given to sleuth", flat))
    return _configured(layers)


def _pick(layers: list[tuple[str, dict[str, list[Any]]]], keys: tuple[str, ...]) -> dict[str, Any] | None:
    """The first layer naming one of `keys` with a single numeric value."""
    for source, flat in layers:
        for key in keys:
            values = [_float(v) for v in flat.get(key, [])]
            values = [v for v in values if v is not None]
            if values and all(v == values[0] for v in values):
                return {"value": values[0], "key": key, "source": source}
    return None


def _rates(flat: dict[str, list[Any]]) -> list[tuple[str, float]]:
    found = []
    for key, values in flat.items():
        tokens = set(key.split("_"))
        rate = key in ("lr", "learning_rate", "base_lr", "peak_lr", "max_lr") or key.endswith(("_lr", "_learning_rate"))
        if not rate or tokens & _NOT_A_RATE:
            continue
        for value in values:
            number = _float(value)
            if number is not None and number > 0:
                found.append((key, number))
    return found


def _configured(layers: list[tuple[str, dict[str, list[Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, keys in (("warmup", _WARMUP), ("warmup_ratio", _RATIO), ("max_grad_norm", _CLIP),
                       ("accumulation", _ACCUM), ("eps", _EPS)):
        found = _pick(layers, keys)
        if found is not None:
            out[name] = found
    epochs = _pick(layers, _EPOCHS)
    # A bare `steps` counts optimizer steps only where no epoch count could make it per-epoch.
    total_keys = _TOTAL if epochs is not None and epochs["value"] > 1 else _TOTAL + ("steps",)
    total = _pick(layers, total_keys)
    if total is not None and total["value"] >= 1:
        out["total"] = total
    for source, flat in layers:
        rates = _rates(flat)
        if rates:
            out["lr"] = [{"value": v, "key": k, "source": source} for k, v in rates]
            break
    for source, flat in layers:
        decays = [(k, _float(v)) for k, vs in flat.items() if k in ("weight_decay", "wd") or k.endswith("_weight_decay")
                  for v in vs]
        decays = [(k, v) for k, v in decays if v is not None and v >= 0]
        if decays:
            out["weight_decay"] = [{"value": v, "key": k, "source": source} for k, v in decays]
            break
    for source, flat in layers:
        selections = [(k, v) for k, vs in flat.items() if _names_layer_selection(k) for v in vs
                      if isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v)]
        if selections:
            key, ids = selections[0]
            out["layer_ids"] = {"value": ids, "key": key, "source": source}
            break
    for source, flat in layers:
        betas = next((v for v in flat.get("betas", []) + flat.get("adam_betas", []) if isinstance(v, list)), None)
        one = next((_float(v) for k in ("adam_beta1", "beta1") for v in flat.get(k, [])), None)
        two = next((_float(v) for k in ("adam_beta2", "beta2") for v in flat.get(k, [])), None)
        if betas is not None or one is not None or two is not None:
            pair = [_float(b) for b in betas] if betas is not None else [one, two]
            out["betas"] = {"value": pair, "source": source}
            break
    return out


def _names_layer_selection(key: str) -> bool:
    """A key that names which target layers feed the drafter (target_layer_ids, aux_hidden_state_layer_ids,
    feature_layers, tap_layers, ...), not the drafter's own layers (layer_types, num_hidden_layers)."""
    words = set(key.split("_"))
    return bool(words & {"layer", "layers"}) and bool(words & {"ids", "id", "target", "aux", "tap", "taps", "feature",
                                                                 "features", "hidden", "selected"})


def horizon_hint(configured: dict[str, Any]) -> str:
    """'total,warmup' optimizer steps for the observer's copy of the scheduler (empty fields where not named)."""
    total, warmup = _horizon(configured)
    return f"{'' if total is None else total},{'' if warmup is None else warmup}"


def _horizon(configured: dict[str, Any]) -> tuple[int | None, int | None]:
    total = configured.get("total", {}).get("value") if isinstance(configured.get("total"), dict) else None
    total = int(total) if isinstance(total, (int, float)) and total >= 1 else None
    warmup = configured.get("warmup", {}).get("value") if isinstance(configured.get("warmup"), dict) else None
    ratio = configured.get("warmup_ratio", {}).get("value") if isinstance(configured.get("warmup_ratio"), dict) else None
    if isinstance(warmup, (int, float)) and warmup >= 0:
        return total, int(warmup)
    if isinstance(ratio, (int, float)) and 0 <= ratio <= 1 and total is not None:
        return total, int(ratio * total)
    return total, None


def _said(entry: dict[str, Any]) -> str:
    return f"{entry.get('key')} {_num(entry.get('value'))} ({_text(entry.get('source'), 120)})"


# --- verdicts ----------------------------------------------------------------------------------------------------


def judge_optimization(observation: dict[str, Any]) -> list[Verdict]:
    """One verdict per OPTIMIZATION_INVARIANTS; a malformed observation is `unknown`, never a crash."""
    watched = observation.get("optimization")
    configured = observation.get("configured") if isinstance(observation.get("configured"), dict) else {}
    if not isinstance(watched, dict) or "error" in watched:
        why = (f"the observer could not read the optimizer ({_text(watched.get('error'))})" if isinstance(watched, dict)
               else f"{NOT_EXERCISED}: no optimizer was observed")
        return [_unknown(i, why) for i in OPTIMIZATION_INVARIANTS]
    verdicts = []
    for part, invariant in ((_groups, GROUPS), (_horizon_verdict, HORIZON), (_schedule, SCHEDULE)):
        try:
            verdicts.append(part(watched, configured))
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as exc:
            verdicts.append(_unknown(invariant, f"the observation is malformed ({type(exc).__name__})"))
    return verdicts


def _kinds(group: dict[str, Any]) -> str:
    kinds = group.get("kinds") if isinstance(group.get("kinds"), dict) else {}
    shown = []
    for kind, entry in kinds.items():
        if isinstance(entry, dict):
            examples = ", ".join(_text(e, 60) for e in (entry.get("examples") or [])[:2])
            shown.append(f"{kind} {entry.get('tensors')} ({examples})")
    return ", ".join(shown) or "no tensors"


def _trainable(group: dict[str, Any]) -> bool:
    kinds = group.get("kinds") if isinstance(group.get("kinds"), dict) else {}
    return any(kind != "frozen" and isinstance(entry, dict) and entry.get("tensors") for kind, entry in kinds.items())


def _groups(watched: dict[str, Any], configured: dict[str, Any]) -> Verdict:
    optimizers = [o for o in watched.get("optimizers") or [] if isinstance(o, dict)]
    if not optimizers:
        return _unknown(GROUPS, f"{NOT_EXERCISED}: no torch.optim optimizer was built")
    rates = [r for r in configured.get("lr") or [] if isinstance(r, dict) and _float(r.get("value")) is not None]
    decays = [d for d in configured.get("weight_decay") or [] if isinstance(d, dict) and _float(d.get("value")) is not None]
    betas = configured.get("betas") if isinstance(configured.get("betas"), dict) else None
    eps = configured.get("eps") if isinstance(configured.get("eps"), dict) else None
    problems: list[str] = []
    checked: list[str] = []
    shown: list[str] = []
    for o_index, opt in enumerate(optimizers):
        for g_index, group in enumerate(g for g in opt.get("groups") or [] if isinstance(g, dict)):
            built = group.get("built") if isinstance(group.get("built"), dict) and group.get("built") else (
                group.get("now") if isinstance(group.get("now"), dict) else {})
            lr = _float(built.get("lr"))
            if lr is None:
                lr = _float(group.get("initial_lr"))
            decay = _float(built.get("weight_decay"))
            name = f"{_text(opt.get('class'))} group {g_index}" + (f" (optimizer {o_index})" if len(optimizers) > 1 else "")
            shown.append(f"{name}: lr {_num(lr)}, weight decay {_num(decay)}, betas {built.get('betas')}, eps "
                         f"{_num(built.get('eps'))} over {_kinds(group)}")
            if not _trainable(group):
                continue
            kinds = group.get("kinds") or {}
            if rates and lr is not None:
                if any(_same(lr, float(r["value"])) for r in rates):
                    checked.append(f"{name} lr {_num(lr)}")
                else:
                    default = _float(opt.get("class_lr_default"))
                    origin = " (the optimizer class's own default)" if default is not None and _same(lr, default) else ""
                    problems.append(f"{name} ({_kinds(group)}) was built with lr {_num(lr)}{origin}; the run configures "
                                    + " / ".join(_said(r) for r in rates))
            if decays and decay is not None:
                matches = any(_same(decay, float(d["value"])) for d in decays)
                if matches:
                    checked.append(f"{name} weight decay {_num(decay)}")
                elif decay == 0 and "matrices" not in kinds:
                    checked.append(f"{name} weight decay 0 on {'/'.join(sorted(kinds))} (left out of decay)")
                elif decay == 0:
                    problems.append(f"{name} holds matrices ({_kinds(group)}) at weight decay 0; the run configures "
                                    + " / ".join(_said(d) for d in decays))
                else:
                    problems.append(f"{name} was built with weight decay {_num(decay)}; the run configures "
                                    + " / ".join(_said(d) for d in decays))
            observed_betas = built.get("betas")
            wanted = betas.get("value") if betas else None
            if (isinstance(observed_betas, list) and isinstance(wanted, list) and len(wanted) == len(observed_betas)):
                for position, (have, want) in enumerate(zip(observed_betas, wanted)):
                    if _float(want) is None or _float(have) is None:
                        continue
                    if _same(float(have), float(want)):
                        checked.append(f"{name} beta{position + 1} {_num(have)}")
                    else:
                        problems.append(f"{name} was built with beta{position + 1} {_num(have)}; the run configures "
                                        f"{_num(want)} ({_text(betas.get('source'), 120)})")
            if eps and _float(built.get("eps")) is not None:
                if _same(float(built["eps"]), float(eps["value"])):
                    checked.append(f"{name} eps {_num(built['eps'])}")
                else:
                    problems.append(f"{name} was built with eps {_num(built['eps'])}; the run configures {_said(eps)}")
    if not decays:
        problems += _inverted_decay(optimizers)
    coverage = {"groups": shown[:12], "configured": {k: configured[k] for k in ("lr", "weight_decay", "betas", "eps")
                                                      if k in configured}}
    measurement = "the parameter groups the run's optimizer was built with, by kind of tensor: " + "; ".join(shown[:8])
    if problems:
        return _verdict(GROUPS, "mismatch", hypothesis="each parameter group gets the hyper-parameters the run "
                        "configures", measurement=measurement, observed="; ".join(problems),
                        expected="every group's lr (and weight decay, betas, eps where configured) one of the run's "
                        "configured values", fix="build each group from the configured values (an lr or weight decay "
                        "passed in a group dict replaces the configured one)", coverage=coverage)
    if not rates:
        return _unknown(GROUPS, "the run's learning rate is not named by its command or a config file it names (an "
                        "argparse default or a constant in code): the groups are reported, not judged ("
                        + "; ".join(shown[:4]) + ")", coverage)
    verdict = _verdict(GROUPS, "match", hypothesis="each parameter group gets the hyper-parameters the run configures",
                       measurement=measurement, observed="; ".join(checked),
                       expected="the configured " + ", ".join(k for k in ("lr", "weight_decay", "betas", "eps")
                                                             if k in configured), coverage=coverage)
    return verdict


def _inverted_decay(optimizers: list[dict[str, Any]]) -> list[str]:
    """Weight decay on norms and biases while the 2-D weights of the same optimizer get none: no recipe decays
    that way round (speculators decays everything, the common split decays the weights and spares the vectors),
    so it is a mismatch whatever the run configures (the configured value itself may be a default in code)."""
    found = []
    for opt in optimizers:
        groups = [g for g in opt.get("groups") or [] if isinstance(g, dict) and _trainable(g)]

        def decay(group: dict[str, Any]) -> float | None:
            built = group.get("built") if isinstance(group.get("built"), dict) and group.get("built") else (
                group.get("now") if isinstance(group.get("now"), dict) else {})
            return _float(built.get("weight_decay"))

        def holds(group: dict[str, Any], kind: str) -> bool:
            entry = (group.get("kinds") or {}).get(kind)
            return isinstance(entry, dict) and bool(entry.get("tensors"))

        spared = [i for i, g in enumerate(groups) if holds(g, "matrices") and decay(g) == 0]
        decayed = [(i, decay(g)) for i, g in enumerate(groups) if not holds(g, "matrices") and (decay(g) or 0) > 0]
        if spared and decayed:
            found.append(f"{_text(opt.get('class'))} decays only norms and biases (group(s) "
                         + ", ".join(f"{i} at {_num(d)}" for i, d in decayed) + ") while its 2-D weights (group(s) "
                         + ", ".join(str(i) for i in spared) + ") get weight decay 0: the groups are swapped")
    return found


def _per_step(scheduler: dict[str, Any], backward_first: int | None) -> tuple[int | None, str]:
    """Scheduler steps one optimizer step takes, and how that was counted (None: not decided)."""
    positions = [p for p in scheduler.get("positions") or [] if isinstance(p, dict)]
    pre = [p.get("epoch") for p in positions if p.get("when") == "pre"]
    post = [p.get("epoch") for p in positions if p.get("when") == "post"]
    if len(pre) >= 2 and all(isinstance(e, (int, float)) for e in pre[-2:]):
        count = int(pre[-1] - pre[-2])
        return count, f"{count} scheduler step(s) between the last two optimizer steps"
    base, finish = scheduler.get("baseline_epoch"), scheduler.get("finish_epoch")
    if not pre or not post or not all(isinstance(n, (int, float)) for n in (base, finish, pre[0], post[-1])):
        return None, "the scheduler's position around the optimizer step was not read"
    before, after = int(pre[0] - base), int(finish - post[-1])
    told = f"{before} scheduler step(s) before the first optimizer step, {after} after it until the observation ended"
    micro = f" ({backward_first} backward calls before the first optimizer step)"
    if before == 0:
        return after, told
    if after == 0:
        return (before, told + micro) if (backward_first or 0) >= 2 else (1 if before == 1 else None, told)
    if (backward_first or 0) >= 2:  # micro-batches before the first step: the scheduler stepped with them
        return before + after, told + micro
    return None, told + ": before and after the step, one backward each; observe two steps (--observe-steps 2) to count"


def _from_zero(trajectory: dict[str, Any], birth: Any) -> dict[str, Any]:
    """The copy's steps counted from the schedule's step 0: a scheduler built resumed (last_epoch=N) starts at N."""
    offset = int(birth) if isinstance(birth, (int, float)) and birth > 0 else 0
    if not offset:
        return trajectory
    shifted = dict(trajectory, points=[[i + offset, v] for i, v in trajectory.get("points") or []],
                   length=int(trajectory.get("length") or 0) + offset, offset=offset)
    for key in ("peak_first", "floor_first"):
        if isinstance(trajectory.get(key), int):
            shifted[key] = trajectory[key] + offset
    return shifted


def _lr_at(trajectory: dict[str, Any], index: int) -> float | None:
    for i, value in trajectory.get("points") or []:
        if i == index:
            return _float(value)
    return None


def _scheduler_total(attributes: dict[str, Any]) -> tuple[int | None, int | None, str]:
    """The run's total (and warmup) as the scheduler itself states them, where it names a run total."""
    if not isinstance(attributes, dict):
        return None, None, ""
    total = attributes.get("total_steps")
    if isinstance(total, int) and total > 0:
        return total, None, f"its total_steps {total}"
    inner = attributes.get("lr_lambda0") if isinstance(attributes.get("lr_lambda0"), dict) else {}
    total, warmup = inner.get("num_training_steps"), inner.get("num_warmup_steps")
    if isinstance(total, int) and total > 0:
        return total, warmup if isinstance(warmup, int) else None, f"its function's num_training_steps {total}"
    return None, None, ""


def _horizon_verdict(watched: dict[str, Any], configured: dict[str, Any]) -> Verdict:
    schedulers = [s for s in watched.get("schedulers") or [] if isinstance(s, dict)]
    if not schedulers:
        return _unknown(HORIZON, f"{NOT_EXERCISED}: no torch LR scheduler was built (a rate set by hand each step is "
                        "not followed)")
    verdicts = [_one_horizon(scheduler, configured) for scheduler in schedulers[:8]]
    if len(verdicts) == 1:
        return verdicts[0]
    # One scheduler per optimizer (Muon beside AdamW): each must follow the run's horizon.
    wrong = [v for v in verdicts if v.status == "mismatch"]
    if wrong:
        wrong[0].observed = "; ".join(v.observed for v in wrong)
        return wrong[0]
    if all(v.status == "match" for v in verdicts):
        verdicts[0].observed = "; ".join(v.observed for v in verdicts)
        return verdicts[0]
    return next(v for v in verdicts if v.status != "match")


def _one_horizon(scheduler: dict[str, Any], configured: dict[str, Any]) -> Verdict:
    where = f"{_text(scheduler.get('class'))} at {_text(scheduler.get('site'))}"
    trajectory = scheduler.get("trajectory")
    if not isinstance(trajectory, dict):
        return _unknown(HORIZON, f"the copy of {where} could not be stepped ({_text(scheduler.get('error'))})")
    trajectory = _from_zero(trajectory, scheduler.get("birth_epoch"))
    first = next((p for p in scheduler.get("positions") or [] if isinstance(p, dict) and p.get("when") == "pre"), {})
    backward_first = first.get("backward_calls") if isinstance(first.get("backward_calls"), int) else None
    per_step, counted = _per_step(scheduler, backward_first)
    coverage: dict[str, Any] = {"scheduler": where, "scheduler_steps_per_optimizer_step": counted,
                                "attributes": scheduler.get("attributes")}
    total, warmup = _horizon(configured)
    source = ", ".join(_said(configured[k]) for k in ("total", "warmup", "warmup_ratio") if isinstance(configured.get(k), dict))
    not_exercised: list[str] = []
    if total is None:
        total, own_warmup, said = _scheduler_total(scheduler.get("attributes") or {})
        if total is not None:
            source = f"the scheduler's own statement ({said})"
            warmup = warmup if warmup is not None else own_warmup
            not_exercised.append(f"whether {total} steps is the run's: its total optimizer steps are not named by its "
                                 "command or config")
    problems: list[str] = []
    # Several scheduler steps per optimizer step are the cause of what the horizon shows wrong; a schedule whose
    # lengths were scaled to match (built over micro-batches) still follows the run's horizon.
    fast = f"the schedule advances {per_step} steps per optimizer step ({counted})" if per_step and per_step >= 2 else ""
    if per_step is None or per_step == 0:
        why = ("the scheduler was not stepped between the optimizer step and the end of the observation (stepped per "
               "epoch, or later)" if per_step == 0 else f"the scheduler steps per optimizer step are not decided ({counted})")
        return _unknown(HORIZON, f"{NOT_EXERCISED}: {why}", coverage)
    peak, floor = _float(trajectory.get("peak")), _float(trajectory.get("floor"))
    peak_first, floor_first = trajectory.get("peak_first"), trajectory.get("floor_first")
    length = int(trajectory.get("length") or 0)
    shape = (f"from its first step, the copy of {where} peaks at lr {_num(peak)} at scheduler step {peak_first} and "
             f"first reaches its floor {_num(floor)} at scheduler step {floor_first} (of {length - 1} stepped)")
    if total is None:
        return _unknown(HORIZON, "the run's total optimizer steps are not named by its command or a config file it "
                        "names, and the scheduler states no total: the horizon would be a guess; " + shape
                        + (f"; {fast}" if fast else ""), coverage)
    if per_step * total >= length:
        return _unknown(HORIZON, f"the copy of {where} was stepped {length - 1} times, short of the run's horizon "
                        f"({per_step} x {total})", coverage)
    tol = 1e-9 * max(abs(peak or 0.0), 1e-30)
    parts = [f"{counted}"]
    if warmup is not None and int(trajectory.get("offset") or 0) > per_step * max(warmup - 1, 0):
        not_exercised.append(f"the warmup: the scheduler was built resumed at its step {trajectory.get('offset')}")
    elif warmup is not None:
        lo, hi = per_step * max(warmup - 1, 0), per_step * warmup
        at_end = _lr_at(trajectory, per_step * warmup)
        if isinstance(peak_first, int) and lo <= peak_first <= hi:
            parts.append(f"the peak {_num(peak)} is reached at optimizer step {peak_first // per_step} (warmup {warmup})")
        else:
            problems.append(f"the schedule reaches its peak {_num(peak)} at optimizer step "
                            f"{_num(peak_first / per_step if isinstance(peak_first, int) else None)}, not at the end of "
                            f"the configured warmup (step {warmup}; lr there {_num(at_end)})")
    else:
        not_exercised.append(f"the warmup length (not named by the run's command or config; the peak comes at "
                             f"scheduler step {peak_first})")
    decays = peak is not None and floor is not None and floor < peak - tol
    last = per_step * total
    at_last = _lr_at(trajectory, last)
    if not decays:
        parts.append("no decay after the peak (a constant rate)")
    elif isinstance(floor_first, int) and floor_first >= length - 1 - per_step:
        not_exercised.append(f"the end of the decay: the rate still falls at the copy's last step ({length - 1}), a "
                             "schedule without a floor (exponential, inverse square root)")
    elif isinstance(floor_first, int) and last - per_step <= floor_first <= last:
        parts.append(f"the floor {_num(floor)} is reached at the last step ({total})")
    elif isinstance(floor_first, int) and floor_first < last - per_step:
        problems.append(f"the schedule reaches its floor {_num(floor)} at optimizer step {floor_first / per_step:g}, "
                        f"before the run's last step {total} (lr there {_num(at_last)})")
    else:
        share = f" ({at_last / peak:.1%} of the peak)" if at_last is not None and peak else ""
        reached = floor_first / per_step if isinstance(floor_first, int) else None
        problems.append(f"at the run's last step {total} the rate is {_num(at_last)}{share}; its floor "
                        f"{_num(floor)} comes only at optimizer step {_num(reached)} (a decay period longer than the "
                        "steps after warmup)")
    named = "not named" if warmup is None else warmup
    coverage["horizon"] = f"{total} optimizer steps, warmup {named} ({source})"
    if fast and problems:
        problems.insert(0, fast)
    elif fast:
        parts.append(f"{fast}, its lengths scaled to match")
    measurement = f"{shape}; horizon {total} optimizer steps, warmup {named}, from {source}"
    if problems:
        return _verdict(HORIZON, "mismatch", hypothesis="the schedule warms up to its peak at the configured warmup end "
                        "and decays to its floor at the run's last step, one scheduler step per optimizer step",
                        measurement=measurement, observed="; ".join(problems),
                        expected=f"peak at step {warmup}, floor at step {total}, 1 scheduler step per optimizer step",
                        fix="step the scheduler once per optimizer step, warm up over the configured warmup steps and "
                        "run the decay over total_steps - warmup_steps", coverage=coverage)
    verdict = _verdict(HORIZON, "match", hypothesis="the schedule warms up to its peak at the configured warmup end and "
                       "decays to its floor at the run's last step", measurement=measurement, observed="; ".join(parts),
                       expected=f"peak at step {warmup}, floor at step {total}", coverage=coverage)
    verdict.not_exercised = not_exercised
    return verdict.gated()


def _schedule(watched: dict[str, Any], configured: dict[str, Any]) -> Verdict:
    """Clipping and a resume, as far as the observed step exercised them; never a match (the float32 masters and
    the rest of the optimizer's contract are not observed)."""
    optimizers = [o for o in watched.get("optimizers") or [] if isinstance(o, dict)]
    schedulers = [s for s in watched.get("schedulers") or [] if isinstance(s, dict)]
    steps = max((int(o.get("steps") or 0) for o in optimizers), default=0)
    clips = [c for c in watched.get("clips") or [] if isinstance(c, dict) and c.get("after_steps") == steps - 1]
    seen: list[str] = []
    problems: list[str] = []
    wanted = configured.get("max_grad_norm") if isinstance(configured.get("max_grad_norm"), dict) else None
    norms = sorted({_num(c.get("max_norm")) for c in clips})
    if clips:
        seen.append(f"clip_grad_norm_ called {len(clips)} time(s) in the observed step with max_norm {', '.join(norms)}")
        if wanted and _float(wanted.get("value")) and not any(
                _float(c.get("max_norm")) is not None and _same(float(c["max_norm"]), float(wanted["value"])) for c in clips):
            problems.append(f"gradients clipped at max_norm {', '.join(norms)}; the run configures {_said(wanted)}")
    else:
        seen.append("no torch.nn.utils.clip_grad_norm_ call in the observed step" + (
            f" (the run configures {_said(wanted)}: clipped another way, or not at all)" if wanted else ""))
    backward = next((o.get("backward_per_step") for o in optimizers if o.get("backward_per_step")), None)
    if isinstance(backward, list) and backward:
        accum = configured.get("accumulation") if isinstance(configured.get("accumulation"), dict) else None
        seen.append(f"{backward[-1]} backward call(s) before the observed optimizer step"
                    + (f" (the run configures {_said(accum)})" if accum else ""))
    loads = [entry for entry in watched.get("loads") or [] if isinstance(entry, dict) and entry.get("after_steps") == 0]
    resumed = [entry for entry in loads if entry.get("kind") == "optimizer" and (_float(entry.get("state_step")) or 0) > 0]
    if resumed:
        step = _float(resumed[-1].get("state_step")) or 0.0
        for scheduler in schedulers:
            positions = [p for p in scheduler.get("positions") or [] if isinstance(p, dict) and p.get("when") == "pre"]
            first = positions[0].get("epoch") if positions else None
            if isinstance(first, (int, float)) and first <= 0:
                problems.append(f"the optimizer's state was restored at step {step:g}, but {_text(scheduler.get('class'))}"
                                f" starts the first step at its own step {first:g} (its position was not restored)")
            elif isinstance(first, (int, float)):
                seen.append(f"resumed: optimizer state at step {step:g}, {_text(scheduler.get('class'))} at step {first:g}")
    else:
        # A schedule loaded past its start beside an optimizer whose moments start fresh: half a resume.
        positioned = [entry for entry in loads if entry.get("kind") == "scheduler"
                      and (_float(entry.get("last_epoch")) or 0) > 0]
        if positioned:
            problems.append(f"the schedule was restored at its step {_num(positioned[-1].get('last_epoch'))}, but no "
                            "optimizer state with steps was loaded: its moments start fresh")
        else:
            seen.append("no resume (no optimizer state with steps loaded before the first step)")
    coverage = {"observed": seen}
    if problems:
        return _verdict(SCHEDULE, "mismatch", hypothesis="clipping and a resume as the run configures them",
                        measurement="calls to clip_grad_norm_, backward and load_state_dict around the observed step",
                        observed="; ".join(problems), expected="clip at the configured max_grad_norm; a resumed "
                        "optimizer resumes its schedule at the same step",
                        fix="clip with the configured max_grad_norm; load the scheduler's state with the optimizer's",
                        coverage=coverage)
    return _unknown(SCHEDULE, "the observed step decides parts of this rule only (" + "; ".join(seen) + "): the float32 "
                    "masters and the rest are not observed", coverage)


def describe_optimization(observation: dict[str, Any]) -> list[str]:
    """The report's lines: each group by kind of tensor, where weight decay lands, the schedule's shape."""
    lines: list[str] = []
    watched = observation.get("optimization")
    if not isinstance(watched, dict):
        return lines
    try:
        for opt in watched.get("optimizers") or []:
            for index, group in enumerate(opt.get("groups") or []):
                built = group.get("built") or group.get("now") or {}
                kinds = group.get("kinds") or {}
                lines.append(f"optimizer {_text(opt.get('class'))} group {index} as built: lr {_num(built.get('lr'))}, "
                             f"weight decay {_num(built.get('weight_decay'))}, betas {built.get('betas')}, eps "
                             f"{_num(built.get('eps'))}; {_kinds(group)}")
                if "vectors" in kinds and (_float(built.get("weight_decay")) or 0) > 0:
                    lines.append(f"weight decay {_num(built.get('weight_decay'))} reaches norms and biases in group "
                                 f"{index}: recipes differ (reference: {_DECAY_RECIPE}), so this is not judged")
                if "frozen" in kinds:
                    lines.append(f"group {index} holds {kinds['frozen'].get('tensors')} frozen tensor(s) (requires_grad "
                                 "False): no gradient, so the optimizer leaves them")
        for scheduler in watched.get("schedulers") or []:
            trajectory = scheduler.get("trajectory") or {}
            lines.append(f"schedule {_text(scheduler.get('class'))} at {_text(scheduler.get('site'))}, from its first "
                         f"step (a copy made when it was built): peak {_num(trajectory.get('peak'))} at step "
                         f"{trajectory.get('peak_first')}, floor {_num(trajectory.get('floor'))} first at step "
                         f"{trajectory.get('floor_first')}; its own horizon: "
                         f"{_text(json.dumps(scheduler.get('attributes'), default=str), 200)}")
        configured = observation.get("configured") or {}
        if configured:
            lines.append("configured by the run's command: " + ", ".join(
                f"{k} {_num(v.get('value')) if isinstance(v, dict) else '/'.join(_num(x.get('value')) for x in v)}"
                for k, v in configured.items() if isinstance(v, (dict, list))))
    except (TypeError, ValueError, AttributeError):
        lines.append("part of the optimizer's observation is malformed and was not shown")
    return lines
