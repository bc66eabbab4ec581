"""What the observed step says about how the run optimises (inside the user's process; torch, names never read).

observer.py calls in here at five places: an optimizer built, a scheduler built, each optimizer step (before and
after), and the observation written. Watched, on the real objects:
  * each optimizer's parameter groups as built (lr, weight decay, betas, eps, momentum), and the kinds of tensors
    each group holds: matrices (ndim >= 2), vectors (norms, biases: ndim < 2), embedding tables (the weight of an
    nn.Embedding or of the module that produced the draft logits), frozen tensors (requires_grad False);
  * each top-level LR scheduler, deep-copied the moment it is built (its optimizer replaced by a stand-in that
    holds the groups' values, no parameters), then stepped from its first step over the run's horizon: the
    schedule as the run would follow it from step 0, whatever the observed step's position in it;
  * the scheduler's position (last_epoch) at every optimizer step and when the observation ends: how many
    scheduler steps one optimizer step takes;
  * backward calls per optimizer step, and torch.nn.utils.clip_grad_norm_ calls (max_norm, norm type);
  * a resume: Optimizer.load_state_dict / LRScheduler.load_state_dict before the first step, with the step the
    loaded optimizer state had reached.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
import warnings
import weakref
from typing import Any

HORIZON_ENV = "SLEUTH_OBSERVE_SCHEDULE"  # "total,warmup" optimizer steps as the run configures them ("" unknown)
DEFAULT_STEPS = 4096  # scheduler steps read when the run names no horizon
MAX_STEPS = 300_000  # a copy is never stepped further (about a second per 50k steps)
MAX_POINTS = 4096  # trajectory points sent back; beyond, a stride and each key step's neighbourhood
HYPER = ("lr", "weight_decay", "betas", "eps", "momentum")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _site() -> str:
    """file:line of the user's code that made the current call (the first frame outside torch, installed packages
    and sleuth's observer)."""
    frame = sys._getframe(1)
    root = os.environ.get("SLEUTH_OBSERVE_WORKDIR", "")
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<") or os.path.dirname(os.path.abspath(name)) == _HERE or "site-packages" in name
                or "dist-packages" in name or "/lib/python" in name):
            shown = os.path.relpath(name, root) if root and name.startswith(root) else os.path.basename(name)
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _number(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:  # a tensor lr (capturable optimizers)
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else str(value)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key in HYPER:
        if key not in group:
            continue
        value = group[key]
        if isinstance(value, (tuple, list)):
            numbers = [_number(v) for v in value]
            found[key] = numbers if all(n is not None for n in numbers) else None
        else:
            found[key] = _number(value)
    return found


class _Stand:
    """The optimizer as a scheduler's copy sees it: the groups' values, no parameters, a step that does nothing."""

    def __init__(self, opt: Any) -> None:
        self.param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in opt.param_groups]
        self.defaults = dict(getattr(opt, "defaults", {}))
        self.state: dict[Any, Any] = {}
        self._opt_called = True

        def step() -> None:
            return None

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.step = step


def _copy(sched: Any) -> tuple[Any, _Stand]:
    stand = _Stand(sched.optimizer)
    return copy.deepcopy(sched, {id(sched.optimizer): stand}), stand


def _attributes(sched: Any) -> dict[str, Any]:
    """The scheduler's own statement of its horizon: its integer attributes (T_max, total_steps, total_iters,
    milestones), and the integers a LambdaLR's functions were built with (a partial's keywords, a closure's cells)."""
    found: dict[str, Any] = {"class": type(sched).__name__}
    for key, value in vars(sched).items():
        if key in ("last_epoch", "_step_count", "verbose", "_get_lr_called_within_step") or key.startswith("__"):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            found[key.lstrip("_")] = value
        elif isinstance(value, float) and math.isfinite(value):
            found[key.lstrip("_")] = value
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            found[key.lstrip("_")] = list(value[:16])
    functions = getattr(sched, "lr_lambdas", None) or []
    for index, function in enumerate(functions[:1]):
        inner: dict[str, Any] = {}
        while isinstance(function, functools.partial):
            inner.update({k: v for k, v in (function.keywords or {}).items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
            function = function.func
        code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
        if code is not None:
            for name, cell in zip(code.co_freevars, cells):
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    inner.setdefault(name, value)
        if inner:
            found[f"lr_lambda{index}"] = inner
    children = getattr(sched, "_schedulers", None)
    if isinstance(children, (list, tuple)):
        found["schedulers"] = [_attributes(child) for child in children[:8]]
    return found


class OptimWatch:
    def __init__(self, observer: Any) -> None:
        self.observer = observer
        self.torch = observer.torch
        self.optimizers: dict[int, dict[str, Any]] = {}
        self.schedulers: list[dict[str, Any]] = []
        self.marks: dict[int, list[dict[str, Any]]] = {}  # id(optimizer) -> one entry per pre/post step
        self.clips: list[dict[str, Any]] = []
        self.loads: list[dict[str, Any]] = []
        self.horizon = self._horizon()

    @staticmethod
    def _horizon() -> tuple[int | None, int | None]:
        parts = (os.environ.get(HORIZON_ENV) or "").split(",")
        values = [int(p) if p.strip().isdigit() else None for p in parts[:2]] + [None, None]
        return values[0], values[1]

    # --- instrumentation -----------------------------------------------------------------------------

    def patch(self) -> None:
        torch = self.torch
        from torch.nn.utils import clip_grad
        from torch.optim import lr_scheduler, optimizer

        watch = self
        original_clip = clip_grad.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):  # noqa: ANN001, ANN202
            watch.clips.append({"max_norm": _number(max_norm), "norm_type": _number(norm_type),
                                "after_steps": watch.steps_done(), "backward_calls": watch.observer.backward_calls})
            del watch.clips[:-16]
            return original_clip(parameters, max_norm, norm_type, *args, **kwargs)

        clip_grad_norm_.__wrapped__ = original_clip  # type: ignore[attr-defined]
        for holder in (clip_grad, torch.nn.utils):
            if getattr(holder, "clip_grad_norm_", None) is original_clip:
                holder.clip_grad_norm_ = clip_grad_norm_
        original_opt_load = optimizer.Optimizer.load_state_dict

        def opt_load(opt, state_dict, *args, **kwargs):  # noqa: ANN001, ANN202
            result = original_opt_load(opt, state_dict, *args, **kwargs)
            watch.loads.append({"kind": "optimizer", "optimizer": id(opt), "after_steps": watch.steps_done(),
                                "state_step": watch.state_step(opt)})
            return result

        optimizer.Optimizer.load_state_dict = opt_load
        # A scheduler's load sets its position (torch's own schedulers that load their own way, SequentialLR among
        # them, each wrapped; a nested call is recorded once, by the outermost).
        loading: set[int] = set()

        def wrap_load(original):  # noqa: ANN001, ANN202
            def sched_load(sched, *args, **kwargs):  # noqa: ANN001, ANN202
                if id(sched) in loading:
                    return original(sched, *args, **kwargs)
                loading.add(id(sched))
                try:
                    result = original(sched, *args, **kwargs)
                finally:
                    loading.discard(id(sched))
                watch.loads.append({"kind": "scheduler", "scheduler": id(sched), "after_steps": watch.steps_done(),
                                    "last_epoch": _number(getattr(sched, "last_epoch", None))})
                return result

            return sched_load

        for cls in list(vars(lr_scheduler).values()):
            if (isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler)
                    and "load_state_dict" in vars(cls)):
                cls.load_state_dict = wrap_load(vars(cls)["load_state_dict"])
        # SequentialLR and ChainedScheduler set themselves up without LRScheduler.__init__: watched here.
        for name in ("SequentialLR", "ChainedScheduler"):
            cls = getattr(lr_scheduler, name, None)
            if cls is None or "__init__" not in vars(cls):
                continue
            original = cls.__init__

            def init(sched, *args, _original=original, **kwargs):  # noqa: ANN001, ANN202
                _original(sched, *args, **kwargs)
                watch.on_scheduler(sched, _site())

            cls.__init__ = init

    def steps_done(self) -> int:
        return max(self.observer.step_counts.values(), default=0)

    def state_step(self, opt: Any) -> float | None:
        steps = []
        for state in getattr(opt, "state", {}).values():
            value = state.get("step") if isinstance(state, dict) else None
            number = _number(value) if value is not None else None
            if isinstance(number, float):
                steps.append(number)
        return max(steps) if steps else None

    def on_optimizer(self, opt: Any) -> None:
        """The groups as built: what the run's code handed the optimizer, before any schedule touched them."""
        try:
            import inspect

            default = inspect.signature(type(opt).__init__).parameters.get("lr")
            class_default = _number(default.default) if default is not None else None
        except (TypeError, ValueError):
            class_default = None
        self.optimizers[id(opt)] = {"ref": weakref.ref(opt), "class_lr_default": class_default,
                                    "built": [_hyper(g) for g in opt.param_groups]}

    def on_scheduler(self, sched: Any, site: str | None = None) -> None:
        if any(s["ref"]() is sched for s in self.schedulers):
            return
        record: dict[str, Any] = {"ref": weakref.ref(sched), "class": type(sched).__name__,
                                  "birth_epoch": _number(getattr(sched, "last_epoch", None))}
        if site is not None:
            record["site"] = site
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                record["birth"] = _copy(sched)
        except Exception as exc:  # noqa: BLE001 - reported; the run goes on
            record["error"] = f"{type(exc).__name__}: {exc}"[:300]
        self.schedulers.append(record)

    def mark(self, when: str, opt: Any) -> None:
        marks = self.marks.setdefault(id(opt), [])
        if len(marks) >= 64:
            return
        marks.append({"when": when, "step": self.observer.step_counts.get(id(opt), 0),
                      "backward_calls": self.observer.backward_calls, "clips": len(self.clips),
                      "epochs": {id(s["ref"]()): _number(getattr(s["ref"](), "last_epoch", None))
                                 for s in self.schedulers if s["ref"]() is not None}})

    # --- the observation --------------------------------------------------------------------------------

    def describe(self, names: dict[str, dict[int, Any]]) -> dict[str, Any]:
        try:
            return self.describe_all(names)
        except Exception as exc:  # noqa: BLE001 - the rest of the observation stands
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}

    def describe_all(self, names: dict[str, dict[int, Any]]) -> dict[str, Any]:
        try:
            tables = self.tables()
        except Exception:  # noqa: BLE001 - the kinds then say matrices for the tables
            tables = set()
        return {"optimizers": [self.describe_optimizer(record, names, tables) for record in self.optimizers.values()
                               if record["ref"]() is not None],
                "schedulers": [self.describe_scheduler(record) for record in self.top_level()],
                "clips": self.clips, "loads": self.loads, "horizon": list(self.horizon),
                "backward_calls": self.observer.backward_calls}

    def tables(self) -> set[int]:
        """The parameters of the vocabulary tables: every nn.Embedding that ran, and the smallest module that
        produced the draft logits (observer.describe_frozen's head)."""
        torch = self.torch
        found: set[int] = set()
        for ref in self.observer.embeddings.values():
            module = ref()
            if module is not None and isinstance(module, torch.nn.Embedding):
                found.update(id(p) for p in module.parameters())
        last = self.observer.draft_logits()
        if last is not None:
            module = last["module"]()
            producers = [h["module"]() for h in self.observer.logits if "grad" in h]
            sized = [(sum(p.numel() for p in m.parameters()), m) for m in producers + [module] if m is not None]
            sized = [item for item in sized if item[0] > 0]
            if sized:  # only the head's tensors of the vocabulary's width (observer.describe_frozen says why)
                vocab = last["shape"][-1]
                found.update(id(p) for p in min(sized, key=lambda item: item[0])[1].parameters()
                             if vocab in tuple(p.shape))
        return found

    def describe_optimizer(self, record: dict[str, Any], names: dict[str, dict[int, Any]],
                           tables: set[int]) -> dict[str, Any]:
        opt = record["ref"]()
        groups = []
        for index, group in enumerate(opt.param_groups):
            kinds: dict[str, dict[str, Any]] = {}
            for param in group["params"]:
                if not param.requires_grad:
                    kind = "frozen"
                elif id(param) in tables:
                    kind = "embeddings"
                elif param.dim() >= 2:
                    kind = "matrices"
                else:
                    kind = "vectors"
                entry = kinds.setdefault(kind, {"tensors": 0, "numel": 0, "examples": []})
                entry["tensors"] += 1
                entry["numel"] += int(param.numel())
                if len(entry["examples"]) < 4:
                    entry["examples"].append(names["params"].get(id(param), f"a parameter {tuple(param.shape)}"))
            built = record["built"][index] if index < len(record["built"]) else {}
            groups.append({"built": built, "now": _hyper(group), "initial_lr": _number(group.get("initial_lr")),
                           "kinds": kinds})
        marks = self.marks.get(id(opt), [])
        pre = [m for m in marks if m["when"] == "pre"]
        backward = [b - a for a, b in zip([0] + [m["backward_calls"] for m in pre], [m["backward_calls"] for m in pre])]
        return {"class": type(opt).__name__, "class_lr_default": record["class_lr_default"], "groups": groups,
                "steps": self.observer.step_counts.get(id(opt), 0), "backward_per_step": backward,
                "state_step": self.state_step(opt)}

    def top_level(self) -> list[dict[str, Any]]:
        alive = [s for s in self.schedulers if s["ref"]() is not None]
        inner = {id(child) for s in alive for child in getattr(s["ref"](), "_schedulers", None) or []}
        return [s for s in alive if id(s["ref"]()) not in inner]

    def describe_scheduler(self, record: dict[str, Any]) -> dict[str, Any]:
        sched = record["ref"]()
        key = id(sched)
        out: dict[str, Any] = {"class": record["class"], "site": record.get("site", "?"),
                               "birth_epoch": record["birth_epoch"],
                               "last_epoch": _number(getattr(sched, "last_epoch", None))}
        try:
            out["attributes"] = _attributes(sched)
        except Exception as exc:  # noqa: BLE001
            out["attributes"] = {"error": f"{type(exc).__name__}"}
        opt = getattr(sched, "optimizer", None)
        marks = self.marks.get(id(opt), []) if opt is not None else []
        loaded = [entry["last_epoch"] for entry in self.loads if entry.get("scheduler") == key
                  and entry["after_steps"] == 0]
        baseline = loaded[-1] if loaded else record["birth_epoch"]
        out["loaded_epoch"] = loaded[-1] if loaded else None
        out["positions"] = [{"when": m["when"], "step": m["step"], "epoch": m["epochs"].get(key),
                             "backward_calls": m["backward_calls"]} for m in marks]
        out["baseline_epoch"] = baseline
        out["finish_epoch"] = out["last_epoch"]
        if "error" in record:
            out["error"] = record["error"]
            return out
        clone, stand = record["birth"]
        total, warmup = self.horizon
        per_step = max(1, self.scheduler_steps_per_step(out) or 1, self.around_first_step(out))
        length = DEFAULT_STEPS
        if total:
            length = max(length, per_step * (total + max(2, total // 2)))
        length = min(length, MAX_STEPS)
        try:
            lrs = [float(g["lr"]) for g in stand.param_groups]
            path = [lrs[:1]]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(length):
                    clone.step()
                    path.append([float(g["lr"]) for g in stand.param_groups[:1]])
            out["trajectory"] = self.summarise([p[0] for p in path], per_step, total, warmup)
            out["groups_at_birth"] = [_number(v) for v in lrs[:8]]
        except Exception as exc:  # noqa: BLE001 - a schedule the copy cannot step: reported, not judged
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return out

    @staticmethod
    def scheduler_steps_per_step(out: dict[str, Any]) -> int | None:
        pre = [p["epoch"] for p in out["positions"] if p["when"] == "pre" and isinstance(p["epoch"], (int, float))]
        if len(pre) >= 2:
            return int(pre[-1] - pre[-2])
        return None

    @staticmethod
    def around_first_step(out: dict[str, Any]) -> int:
        """Scheduler steps before the first optimizer step plus those after the last one observed: the most one
        optimizer step can have taken (the copy is stepped that much further)."""
        pre = [p["epoch"] for p in out["positions"] if p["when"] == "pre"]
        post = [p["epoch"] for p in out["positions"] if p["when"] == "post"]
        numbers = [out["baseline_epoch"], out["finish_epoch"], *pre[:1], *post[-1:]]
        if not pre or not post or not all(isinstance(n, (int, float)) for n in numbers):
            return 1
        return int(pre[0] - out["baseline_epoch"]) + int(out["finish_epoch"] - post[-1])

    @staticmethod
    def summarise(path: list[float], per_step: int, total: int | None, warmup: int | None) -> dict[str, Any]:
        """The schedule in scheduler steps from its first: every step while short, else a stride and each key step's
        neighbourhood; and, over the whole copy, where it first reaches its peak and, after that, its floor."""
        peak = max(path)
        tol = 1e-9 * max(abs(peak), 1e-30)
        peak_first = next(i for i, v in enumerate(path) if v >= peak - tol)
        after = path[peak_first:]
        floor = min(after)
        floor_first = peak_first + next(i for i, v in enumerate(after) if v <= floor + tol)
        keys = {0, peak_first, floor_first, len(path) - 1}
        for value in (total, warmup):
            if value is not None:
                keys.update({per_step * value + d for d in range(-2 * per_step, 2 * per_step + 1)})
        if len(path) <= MAX_POINTS:
            points = list(enumerate(path))
        else:
            stride = max(1, len(path) // (MAX_POINTS // 2))
            chosen = set(range(0, len(path), stride)) | {k for k in keys if 0 <= k < len(path)}
            points = [(i, path[i]) for i in sorted(chosen)]
        return {"points": [[i, v] for i, v in points], "length": len(path), "peak": peak, "peak_first": peak_first,
                "floor": floor, "floor_first": floor_first, "per_step_used": per_step}
