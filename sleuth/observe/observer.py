"""The observer inside the user's training process: torch instrumented, names never read.

Installed by site/sitecustomize.py before the user's code runs, it watches what any trainer reduces to:
  * module calls (a global forward hook): which modules ran, in which order, the identity of each output, the
    vocabulary sizes of the embeddings called, and a gradient hook on every output that could be draft logits
    (it requires grad and its last dimension is an embedding's vocabulary);
  * the gathering of target features: a `torch.cat` / `torch.stack` whose inputs are all outputs of modules
    that did not train at that call (no grad through them) becomes a gradient leaf (same values), so after
    `backward` the gradient at each input block says which target layer reaches the loss;
  * `Tensor.backward` / `torch.autograd.backward`: the loss, and where it was called;
  * `Optimizer.__init__` and the global optimizer step hooks: the parameter groups (lr, weight decay, which
    parameters), and, around the observed step, which parameters of the embeddings and draft head changed;
  * LR schedulers: the real object, whose trajectory is read by stepping a deep copy.
After N optimizer steps (SLEUTH_OBSERVE_STEPS, default 1) it measures on that step's own tensors, writes the
observation (JSON) to the answer file and ends the process (os._exit: nothing of the run goes on). A process
that ends before writes what it saw (atexit), so sleuth can say which link was missing.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
import weakref
from typing import Any

from sleuth.observe.attention import AttentionWatch
from sleuth.observe.optimization import OptimWatch

ANSWER_ENV = "SLEUTH_OBSERVE_ANSWER"
STEPS_ENV = "SLEUTH_OBSERVE_STEPS"
WORKDIR_ENV = "SLEUTH_OBSERVE_WORKDIR"
MAX_WEIGHTS = 4096  # per-position weights sent back
MAX_GATHERED = 8  # gatherings of target features kept (the latest)
MAX_TEACHER = 65_536  # positions of a teacher candidate's top-1 sent back
FUSED_MAX_LOGITS = 1 << 26  # rows x vocabulary of a fused head+loss whose logits are recomputed to read its gradient
_THIS = os.path.abspath(__file__)

_OBSERVER: Observer | None = None


def install() -> None:
    """Start observing as soon as the command imports torch (at once if it already has): a process that never
    does (a data-preparation step, a launcher) is not slowed down, and says so if it is the one that ends."""
    answer = os.environ.get(ANSWER_ENV)
    if not answer or _OBSERVER is not None:
        return
    if "torch" in sys.modules:
        _start(answer)
        return
    sys.meta_path.insert(0, _TorchWatch(answer))
    atexit.register(_never_started, answer)


def _never_started(answer: str) -> None:
    if _OBSERVER is None:
        _write(answer, {"ended": "no_torch", "error": "the command ended without importing torch: no training step "
                        "to observe"}, only_if_empty=True)


class _TorchWatch:
    """A meta path finder that lets `import torch` run as usual, then starts the observer."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("torch")
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        answer = self.answer

        def exec_module(module: Any) -> None:
            original(module)
            _start(answer)

        loader.exec_module = exec_module
        return spec


def _start(answer: str) -> None:
    global _OBSERVER
    if _OBSERVER is not None:
        return
    try:
        _OBSERVER = Observer(answer, int(os.environ.get(STEPS_ENV, "1") or 1))
        _OBSERVER.patch()
    except Exception as exc:  # noqa: BLE001 - reported; the user's run goes on unobserved and says so
        _write(answer, {"ended": "observer_error", "error": f"sleuth's observer could not start: "
                        f"{type(exc).__name__}: {exc}"})


def _write(path: str, data: dict[str, Any], *, only_if_empty: bool = False) -> None:
    try:
        if only_if_empty and os.path.getsize(path) > 0:
            return
        text = json.dumps(data, default=str, allow_nan=False)
    except (OSError, ValueError):
        text = json.dumps({"ended": "error", "error": "the observation could not be serialised"})
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def _storage(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse, subclasses)
        return 0


def _site() -> str:
    """file:line of the user's code that made the current call (the first frame outside torch, installed
    packages and the observer)."""
    frame = sys._getframe(2)
    root = os.environ.get(WORKDIR_ENV, "")
    while frame is not None:
        name = frame.f_code.co_filename
        internal = (name == _THIS or name.startswith("<") or "site-packages" in name or "dist-packages" in name
                    or "/lib/python" in name)
        if not internal:
            shown = os.path.relpath(name, root) if root and name.startswith(root) else os.path.basename(name)
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class Observer:
    def __init__(self, answer: str, steps: int) -> None:
        import torch

        self.torch = torch
        self.answer, self.steps_wanted = answer, max(1, steps)
        self.started = time.perf_counter()
        self.seq = 0
        # id(tensor) -> (ref, module ref, seq, trained, ref of the module whose output was this call's first input)
        self.outputs: dict[int, tuple[Any, Any, int, bool, Any]] = {}
        self.by_storage: dict[int, tuple[Any, Any, int, bool, Any]] = {}  # the same, by the output's storage
        self.first_seen: dict[int, tuple[int, Any]] = {}  # id(module) -> (order, module ref)
        self.vocab: set[int] = set()
        self.gathered: list[dict[str, Any]] = []
        self.optimizers: list[dict[str, Any]] = []
        self.step_counts: dict[int, int] = {}
        self.backward_calls = 0
        self.last_backward: Any = None
        self.token_ids: list[dict[str, Any]] = []
        self.teachers: list[dict[str, Any]] = []
        self.due = False
        self.done = False
        self.attention = AttentionWatch(torch)
        self.new_window()
        self.observed: dict[str, Any] = {"frozen": {}}

    def new_window(self) -> None:
        """What belongs to one optimizer step: reset after each step but the last."""
        self.logits: list[dict[str, Any]] = []
        self.embeddings: dict[int, Any] = {}
        self.losses: list[dict[str, Any]] = []
        self.called: set[int] = set()
        self.snapshots: dict[int, Any] = {}
        self.attention.reset()
        self.fused: list[dict[str, Any]] = []

    # --- instrumentation --------------------------------------------------------------------------------

    def patch(self) -> None:
        torch = self.torch
        from torch.nn.modules import module as module_mod
        from torch.optim import lr_scheduler, optimizer

        module_mod.register_module_forward_pre_hook(self.on_pre_forward)
        module_mod.register_module_forward_hook(self.on_forward)
        self.attention.patch()
        for name in ("cat", "concat", "concatenate", "stack"):
            original = getattr(torch, name, None)
            if original is not None:
                setattr(torch, name, self.gathering(original, name))
        # A head applied functionally (F.linear or `@` on a borrowed weight) is no module call: its output is
        # taken as draft logits where it is made (the module hook, if a module made it, names the module).
        functional = torch.nn.functional
        for owner, name in ((functional, "linear"), (torch, "matmul"), (torch.Tensor, "__matmul__")):
            original = getattr(owner, name, None)
            if original is not None:
                setattr(owner, name, self.head_product(original, "F.linear" if name == "linear" else
                                                       "torch.matmul" if name == "matmul" else "@"))
        original_backward = torch.Tensor.backward
        original_autograd = torch.autograd.backward
        observer = self

        def backward(tensor, *args, **kwargs):  # noqa: ANN001, ANN202
            observer.on_backward([tensor])
            return original_backward(tensor, *args, **kwargs)

        def autograd_backward(tensors, *args, **kwargs):  # noqa: ANN001, ANN202
            observer.on_backward(list(tensors) if isinstance(tensors, (list, tuple)) else [tensors])
            return original_autograd(tensors, *args, **kwargs)

        torch.Tensor.backward = backward
        torch.autograd.backward = autograd_backward
        original_init = optimizer.Optimizer.__init__

        def optimizer_init(opt, *args, **kwargs):  # noqa: ANN001, ANN202
            observer.note_container(args[0] if args else kwargs.get("params"))
            original_init(opt, *args, **kwargs)
            # held, not weakly: a run that ends early has freed its optimizer by the time atexit reports it
            observer.optimizers.append({"ref": (lambda held=opt: held), "site": _site(), "class": type(opt).__name__})
            observer.optim.on_optimizer(opt)

        optimizer.Optimizer.__init__ = optimizer_init
        optimizer.register_optimizer_step_pre_hook(self.on_pre_step)
        optimizer.register_optimizer_step_post_hook(self.on_post_step)
        original_sched_init = lr_scheduler.LRScheduler.__init__

        def scheduler_init(sched, *args, **kwargs):  # noqa: ANN001, ANN202
            original_sched_init(sched, *args, **kwargs)
            observer.optim.on_scheduler(sched, _site())  # its groups' schedule, stepped from a copy made now

        lr_scheduler.LRScheduler.__init__ = scheduler_init
        self.optim = OptimWatch(self)  # optimizer groups, the schedule from its first step, clipping, a resume
        self.optim.patch()
        original_apply = getattr(torch.autograd.Function.__dict__.get("apply"), "__func__", None)
        if original_apply is not None:  # a torch whose Function defines apply elsewhere: fused heads are not followed

            def function_apply(cls, *args, **kwargs):  # noqa: ANN001, ANN202
                out = original_apply(cls, *args, **kwargs)
                try:
                    observer.on_function(cls, args, out)
                except Exception:  # noqa: BLE001 - the observer never breaks the user's run
                    pass
                return out

            torch.autograd.Function.apply = classmethod(function_apply)
        atexit.register(self.at_exit)

    def note_container(self, params: Any) -> None:
        """The module whose `.parameters()` generator the optimizer is given: a container (a ModuleDict, a
        drafter class) that may never be called itself, walked first so its parameters get their names."""
        frame = getattr(params, "gi_frame", None)
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, self.torch.nn.Module) and id(owner) not in self.first_seen:
            self.first_seen[id(owner)] = (-1 - len(self.first_seen), weakref.ref(owner))

    def on_pre_forward(self, module, args) -> None:  # noqa: ANN001
        if self.due:
            self.finish("the next forward after the observed step")
        if id(module) not in self.first_seen:
            self.first_seen[id(module)] = (len(self.first_seen), weakref.ref(module))

    def on_forward(self, module, args, output) -> None:  # noqa: ANN001
        torch = self.torch
        self.seq += 1
        self.called.add(id(module))
        tensor = output if isinstance(output, torch.Tensor) else (
            output[0] if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) else None)
        if isinstance(module, torch.nn.Embedding):
            self.vocab.add(int(module.num_embeddings))
            self.embeddings[id(module)] = weakref.ref(module)
            ids = args[0] if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point() else None
            if ids is not None:  # token ids, as the module was called: the target's input, or a draft block's
                self.token_ids = [*self.token_ids[-7:], {"ids": ids.detach(), "seq": self.seq}]
        if tensor is None:
            return
        trained = tensor.requires_grad and any(p.requires_grad for p in module.parameters(recurse=True))
        # Which module's output this call took as its first input (a view of it counts: HF heads take a slice):
        # two hops of it say where a head's input came from (the final norm over the last layer, or not).
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        source = self.producer(first) if first is not None else None
        fed_by = source[1] if source is not None else None
        entry = (weakref.ref(tensor), weakref.ref(module), self.seq, trained, fed_by)
        self.outputs[id(tensor)] = entry
        pointer = _storage(tensor)
        if pointer:
            self.by_storage[pointer] = entry
        if len(self.outputs) > 50_000:
            self.outputs = {k: v for k, v in self.outputs.items() if v[0]() is not None}
            self.by_storage = {k: v for k, v in self.by_storage.items() if v[0]() is not None}
        if (not tensor.requires_grad and tensor.dim() >= 2 and tensor.shape[-1] in self.vocab
                and tensor.is_floating_point() and self.token_ids
                and tuple(self.token_ids[-1]["ids"].shape) == tuple(tensor.shape[:-1])):
            # An output of the vocabulary's width that trains nothing, from the forward that embedded these ids:
            # a teacher candidate (the target's logits), kept as its top-1 per position.
            self.teachers = [*self.teachers[-2:], {"module": weakref.ref(module), "top1": tensor.detach().argmax(-1),
                                                   "ids": self.token_ids[-1]["ids"], "through": fed_by,
                                                   "before": source[4] if source is not None else None}]
        if (tensor.requires_grad and torch.is_grad_enabled() and tensor.dim() >= 2 and tensor.shape[-1] in self.vocab
                and tensor.is_floating_point()):
            self.note_logits(tensor, module)

    def head_product(self, original, label: str):  # noqa: ANN001, ANN201
        observer = self

        def product(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            out = original(*args, **kwargs)
            if (isinstance(out, observer.torch.Tensor) and out.requires_grad and out.dim() >= 2
                    and out.shape[-1] in observer.vocab and out.is_floating_point()
                    and observer.torch.is_grad_enabled()):
                observer.note_logits(out, None, f"{label} at {_site()}")
            return out

        return product

    def note_logits(self, tensor: Any, module: Any, made_by: str | None = None) -> None:
        """A candidate for the draft logits: an output of a vocabulary's width that trains; the innermost module
        that returned it (if any) is its head."""
        for held in self.logits:
            if held["tensor"]() is tensor:
                if held["module"]() is None and module is not None:
                    held["module"] = weakref.ref(module)
                return  # a module that returns its head's output (a drafter class): the head is the innermost
        holder: dict[str, Any] = {"module": weakref.ref(module) if module is not None else (lambda: None),
                                  "logits": tensor.detach(), "shape": list(tensor.shape), "tensor": weakref.ref(tensor),
                                  "made_by": made_by}
        tensor.register_hook(lambda grad, holder=holder: holder.__setitem__("grad", grad.detach()))
        self.logits = [*self.logits[-3:], holder]

    def on_function(self, cls: Any, args: tuple[Any, ...], out: Any) -> None:
        """A custom autograd Function that takes hidden rows [M, H] that train and a head weight [V, H] of an
        embedding's vocabulary, and returns a scalar: a head fused with its loss, whose logits never exist as a
        tensor with a graph. Its inputs and the gradient that reaches the hidden rows are kept; fused_logits()
        recovers the logits' gradient from them where a softmax loss on hard labels explains it exactly."""
        torch = self.torch
        if not (isinstance(out, torch.Tensor) and out.numel() == 1 and out.requires_grad and torch.is_grad_enabled()):
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        hidden = next((t for t in tensors if t.dim() == 2 and t.requires_grad), None)
        if hidden is None:
            return
        weight = next((t for t in tensors if t is not hidden and t.dim() == 2 and t.shape[1] == hidden.shape[1]
                       and t.shape[0] in self.vocab), None)
        if weight is None or hidden.shape[0] * weight.shape[0] > FUSED_MAX_LOGITS:
            return
        bias = next((t for t in tensors if t.dim() == 1 and t.shape[0] == weight.shape[0]), None)
        holder: dict[str, Any] = {"hidden": hidden.detach(), "weight": weight.detach(), "function": cls.__name__,
                                  "weight_id": id(weight),
                                  "bias": bias.detach() if bias is not None else None, "site": _site()}
        hidden.register_hook(lambda grad, holder=holder: holder.__setitem__("hidden_grad", grad.detach()))
        self.fused = [*self.fused[-1:], holder]

    def fused_logits(self, holder: dict[str, Any]) -> dict[str, Any] | None:
        """The draft logits of a fused head+loss Function and their gradient, where every row's gradient at the
        hidden input is w * (softmax(z) - onehot(y)) @ W for one label y and one weight w >= 0 (cross-entropy on
        hard labels, weighted): solved per row over every y, kept only when the best y explains the gradient to
        float precision. Anything else (soft targets, another loss, a gradient shared with other uses) is None."""
        torch = self.torch
        grad = holder.get("hidden_grad")
        if grad is None:
            return None
        h, w = holder["hidden"].double(), holder["weight"].double()
        g = grad.double()
        logits = h @ w.t() + (holder["bias"].double() if holder["bias"] is not None else 0.0)
        probs = torch.softmax(logits, -1)
        a = probs @ w  # [M, H]: the softmax part of d loss / d h (per unit weight)
        # c[i, y] = <g_i, a_i - W_y>, n[i, y] = |a_i - W_y|^2: the best scale for label y and what it leaves
        c = (g * a).sum(-1, keepdim=True) - g @ w.t()
        n = (a * a).sum(-1, keepdim=True) - 2 * a @ w.t() + (w * w).sum(-1)[None]
        residual = (g * g).sum(-1, keepdim=True) - c * c / n.clamp(min=1e-300)
        best = residual.argmin(-1)
        scale = c.gather(1, best[:, None]).squeeze(1) / n.gather(1, best[:, None]).squeeze(1)
        norm = (g * g).sum(-1)
        left = residual.gather(1, best[:, None]).squeeze(1).clamp(min=0)
        active = norm > 1e-24 * float(norm.max().clamp(min=1e-300))
        if not bool(((left <= 1e-6 * norm) | ~active).all()) or bool((scale[active] < -1e-9).any()):
            return None
        onehot = torch.zeros_like(probs).scatter_(1, best[:, None], 1.0)
        logits_grad = torch.where(active[:, None], scale[:, None] * (probs - onehot), torch.zeros_like(probs))
        return {"module": lambda: None, "logits": logits, "grad": logits_grad, "shape": list(logits.shape),
                "fused": f"{holder['function']} at {holder['site']}", "weight_id": holder["weight_id"]}

    def producer(self, tensor: Any) -> tuple[Any, ...] | None:
        """The output entry of the module call that produced `tensor`, or the tensor it is a view of."""
        found = self.outputs.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found
        pointer = _storage(tensor)
        found = self.by_storage.get(pointer) if pointer else None
        alive = found[0]() if found is not None else None
        return found if alive is not None and _storage(alive) == pointer else None

    def gathering(self, original, name: str):  # noqa: ANN001, ANN201
        observer = self

        def gather(tensors, *args, **kwargs):  # noqa: ANN001, ANN202
            if not isinstance(tensors, (list, tuple)):
                tensors = list(tensors)
            out = original(tensors, *args, **kwargs)
            try:
                return observer.on_gather(name, tensors, args, kwargs, out)
            except Exception:  # noqa: BLE001 - the observer never breaks the user's run
                return out

        gather.__wrapped__ = original
        return gather

    def on_gather(self, name: str, tensors, args, kwargs, out):  # noqa: ANN001, ANN201
        torch = self.torch
        if len(tensors) < 2 or kwargs.get("out") is not None or not isinstance(out, torch.Tensor):
            return out
        sources = []
        for tensor in tensors:
            found = self.outputs.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
            if found is None or found[0]() is not tensor or found[3] or tensor.requires_grad:
                return out  # not all of them are outputs of modules that did not train: not target features
            sources.append((found[1], found[2], int(tensor.shape[kwargs.get("dim", args[0] if args else 0)]
                                                     if name != "stack" else 1)))
        dim = kwargs.get("dim", args[0] if args else 0)
        dim = dim % out.dim() if isinstance(dim, int) else dim
        if not isinstance(dim, int):
            return out
        leaf = out.detach().requires_grad_(True) if not out.requires_grad else out
        record = {"kind": name, "dim": dim, "sources": sources, "site": _site(), "shape": list(out.shape),
                  "leaf": leaf, "grad_enabled": torch.is_grad_enabled()}
        self.gathered = [*self.gathered[-(MAX_GATHERED - 1):], record]
        return leaf

    def on_backward(self, tensors: list[Any]) -> None:
        torch = self.torch
        if tensors and self.last_backward is not None and self.last_backward() is tensors[0]:
            return  # Tensor.backward goes through torch.autograd.backward: one call, seen twice
        self.last_backward = weakref.ref(tensors[0]) if tensors and isinstance(tensors[0], torch.Tensor) else None
        self.backward_calls += 1
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                value = float(tensor.detach().float().sum()) if tensor.numel() == 1 else None
                self.losses.append({"site": _site(), "shape": list(tensor.shape), "value": value,
                                    "grad_fn": type(tensor.grad_fn).__name__ if tensor.grad_fn else None})
        self.losses = self.losses[-8:]

    def on_pre_step(self, opt, args, kwargs) -> None:  # noqa: ANN001
        self.optim.mark("pre", opt)
        if self.due and self.step_counts.get(id(opt), 0) >= self.steps_wanted:
            self.finish("the next optimizer step after the observed one")
        if self.step_counts.get(id(opt), 0) + 1 < self.steps_wanted:
            return
        # Before the observed step: the parameters whose change decides "frozen" (embeddings and draft heads).
        for module in self.watched_modules():
            for param in module.parameters():
                if id(param) not in self.snapshots:
                    self.snapshots[id(param)] = (weakref.ref(param), self.fingerprint(param),
                                                 param.grad is not None and bool(param.grad.abs().sum() > 0))

    def on_post_step(self, opt, args, kwargs) -> None:  # noqa: ANN001
        self.step_counts[id(opt)] = self.step_counts.get(id(opt), 0) + 1
        self.optim.mark("post", opt)
        if self.step_counts[id(opt)] < self.steps_wanted:
            self.new_window()
            return
        changed = self.observed["frozen"]
        for key, (ref, before, had_grad) in self.snapshots.items():
            param = ref()
            if param is not None and key not in changed:
                changed[key] = {"changed": self.fingerprint(param) != before, "had_grad": had_grad}
        self.due = True
        try:  # what a command that ends right after this step would leave: by atexit its modules are freed
            self.at_step = self.observation("the observed optimizer step, the command's last")
        except Exception:  # noqa: BLE001 - the observation at the next forward or at exit says what failed
            self.at_step = None

    def fingerprint(self, param: Any) -> tuple[float, float]:
        """Sum and sum of squares in float64, in chunks: any update an optimizer makes (a row of an embedding, a
        weight decay) moves them, and a vocabulary-sized table is never copied whole."""
        total = squares = 0.0
        with self.torch.no_grad():
            for chunk in param.detach().reshape(-1).split(1 << 22):
                wide = chunk.double()
                total += float(wide.sum())
                squares += float((wide * wide).sum())
        return total, squares

    def watched_modules(self) -> list[Any]:
        modules = [ref() for ref in self.embeddings.values()]
        modules += [holder["module"]() for holder in self.logits]
        return [m for m in dict.fromkeys(modules) if m is not None]

    def at_exit(self) -> None:
        if not self.done:
            self.finish("the command ended", exiting=True)

    # --- the observation --------------------------------------------------------------------------------

    def finish(self, when: str, *, exiting: bool = False) -> None:
        if self.done:
            return
        self.done = True
        try:
            data = (self.at_step if exiting and getattr(self, "at_step", None) is not None
                    else self.observation(when))
        except Exception as exc:  # noqa: BLE001 - reported, never a traceback in the user's run
            import traceback

            # where in the observer: a bug report needs the line, not just the exception
            where = traceback.extract_tb(exc.__traceback__)[-1]
            data = {"ended": "observer_error", "error": f"the observer failed: {type(exc).__name__}: {exc} "
                    f"({os.path.basename(where.filename)}:{where.lineno})"}
        steps = max(self.step_counts.values(), default=0)
        if exiting and steps < self.steps_wanted:
            data["ended"] = data.get("ended") or "command_ended"
            _write(self.answer, data, only_if_empty=True)
            return
        _write(self.answer, data)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def observation(self, when: str) -> dict[str, Any]:
        names = self.names()
        steps = max(self.step_counts.values(), default=0)
        return {
            "ended": "observed" if steps >= self.steps_wanted else "command_ended",
            "when": when,
            "steps_wanted": self.steps_wanted,
            "steps": steps,
            "backward_calls": self.backward_calls,
            "seconds": round(time.perf_counter() - self.started, 3),
            "torch": self.torch.__version__,
            "modules_called": len(self.first_seen),
            "features": [self.describe_gathering(g, names) for g in self.gathered],
            "logits": self.describe_logits(names),
            "loss": self.losses[-1] if self.losses else None,
            "optimizers": [self.describe_optimizer(o, names) for o in self.optimizers if o["ref"]() is not None],
            "frozen": self.describe_frozen(names),
            "optimization": self.optim.describe(names),
            "attention": self.attention.describe(names, self.gathered),
        }

    def names(self) -> dict[str, dict[int, Any]]:
        """Qualified names of modules and parameters, from the outermost modules that ran (first seen first);
        also where each module sits in a ModuleList (its index and the list's length and owner)."""
        torch = self.torch
        modules: dict[int, str] = {}
        params: dict[int, str] = {}
        in_list: dict[int, tuple[int, int, str]] = {}
        roots: dict[int, str] = {}
        for _order, ref in sorted(self.first_seen.values(), key=lambda item: item[0]):
            root = ref()
            if root is None or id(root) in modules:
                continue
            label = type(root).__name__
            stack = [(root, label)]
            while stack:
                module, name = stack.pop()
                if id(module) in modules:
                    continue
                modules[id(module)] = name
                roots[id(module)] = label
                for pname, param in module.named_parameters(recurse=False):
                    params.setdefault(id(param), f"{name}.{pname}")
                for cname, child in module.named_children():
                    if isinstance(module, torch.nn.ModuleList) and cname.isdigit():
                        in_list[id(child)] = (int(cname), len(module), name)
                    stack.append((child, f"{name}.{cname}"))
        return {"modules": modules, "params": params, "in_list": in_list, "roots": roots}

    def describe_gathering(self, record: dict[str, Any], names: dict[str, dict[int, Any]]) -> dict[str, Any]:
        leaf = record["leaf"]
        grad = leaf.grad
        chunks, offset = [], 0
        for ref, seq, size in record["sources"]:
            module = ref()
            entry: dict[str, Any] = {"module": names["modules"].get(id(module), type(module).__name__ if module
                                                                     is not None else "?"),
                                     "class": type(module).__name__ if module is not None else "?", "seq": seq}
            position = names["in_list"].get(id(module)) if module is not None else None
            if position is not None:
                entry.update(layer=position[0], layers=position[1], stack=position[2])
            if module is not None and isinstance(module, self.torch.nn.Embedding):
                entry["embeddings"] = True
            elif position is None and module is not None:
                # The module that ran right after the last layer of a stack (a final norm: HF's last hidden_states
                # entry is its output): the last layer's output, normalised.
                before = next((entry[1]() for entry in self.outputs.values() if entry[2] == seq - 1),
                              None)
                last = names["in_list"].get(id(before)) if before is not None else None
                if last is not None and last[0] == last[1] - 1:
                    entry.update(after_last_layer=True, layers=last[1], stack=last[2])
            if grad is not None:
                part = grad.narrow(record["dim"], offset, size)
                entry["grad_abs_sum"] = _finite(float(part.detach().abs().double().sum()))
            chunks.append(entry)
            offset += size
        return {"kind": record["kind"], "site": record["site"], "dim": record["dim"], "shape": record["shape"],
                "reached_backward": grad is not None, "made_under_no_grad": not record["grad_enabled"],
                "chunks": chunks}

    def draft_logits(self) -> dict[str, Any] | None:
        """The last output of the vocabulary's width whose gradient is a softmax loss's: each position's gradient
        sums to zero over the vocabulary (cross-entropy and KL alike); a layer that is merely as wide is not."""
        for holder in reversed(self.logits):
            grad = holder.get("grad")
            if grad is None:
                continue
            rows = grad.double().reshape(-1, grad.shape[-1])
            if bool((rows.sum(-1).abs() <= 1e-4 * rows.abs().sum(-1) + 1e-12).all()) and bool(rows.abs().sum() > 0):
                return holder
        for fused in reversed(self.fused):  # no module made them: a head fused with its loss, if one explains them
            found = fused.get("recovered") if "recovered" in fused else fused.setdefault("recovered",
                                                                                     self.fused_logits(fused))
            if found is not None:
                return found
        return None

    def describe_logits(self, names: dict[str, dict[int, Any]]) -> dict[str, Any] | None:
        torch = self.torch
        holder = self.draft_logits()
        if holder is None:
            return None
        grad = holder["grad"].double().reshape(-1, holder["shape"][-1])
        logits = holder["logits"].double().reshape(-1, holder["shape"][-1])
        negatives = (grad < 0).sum(-1)
        active = grad.abs().sum(-1) > 0
        hard = bool(((negatives == 1) | ~active).all())
        weights: list[float] | None = None
        if hard:
            label = grad.argmin(-1)
            prob = torch.softmax(logits, -1).gather(1, label[:, None]).squeeze(1)
            value = -grad.gather(1, label[:, None]).squeeze(1) / (1 - prob).clamp(min=1e-12)
            weights = [_finite(float(w)) for w in torch.where(active, value, torch.zeros_like(value))[:MAX_WEIGHTS]]
        module = holder["module"]() if holder["module"] is not None else None
        labels = None
        if hard and grad.shape[0] <= MAX_WEIGHTS:
            labels = [int(t) for t in torch.where(active, grad.argmin(-1), torch.full_like(grad.argmin(-1), -1))]
        block_ids = next((entry["ids"].reshape(-1).tolist() for entry in reversed(self.token_ids)
                          if entry["ids"].numel() == grad.shape[0]), None)
        teachers = [{"module": names["modules"].get(id(t["module"]()), "?"), "source": self.head_source(t, names),
                     "top1": t["top1"].reshape(
                        -1, t["top1"].shape[-1]).tolist(), "ids": t["ids"].reshape(-1, t["ids"].shape[-1]).tolist()}
                    for t in self.teachers if t["top1"].numel() <= MAX_TEACHER]
        return {"labels": labels, "block_ids": block_ids if labels is not None else None, "teachers": teachers,
                "module": names["modules"].get(id(module), type(module).__name__) if module is not None else
                (f"{names['params'].get(holder['weight_id'], 'a head weight')} fused into {holder['fused']}"
                 if holder.get("fused") else holder.get("made_by") or "?"),
                "class": type(module).__name__ if module is not None else "function", "shape": holder["shape"],
                "positions": int(grad.shape[0]), "active_positions": int(active.sum()),
                "hard_labels": hard, "weights": weights, "truncated": int(grad.shape[0]) > MAX_WEIGHTS}

    def head_source(self, teacher: dict[str, Any], names: dict[str, dict[int, Any]]) -> dict[str, Any]:
        """Where a teacher head's input came from: the module that produced it and the one before that, each with
        its place in a layer stack when it has one."""
        found: dict[str, Any] = {}
        for key in ("through", "before"):
            module = teacher[key]() if teacher.get(key) is not None else None
            if module is None:
                continue
            found[key] = names["modules"].get(id(module), type(module).__name__)
            place = names["in_list"].get(id(module))
            if place is not None:
                found[f"{key}_layer"], found[f"{key}_layers"] = place[0], place[1]
        return found

    def describe_optimizer(self, record: dict[str, Any], names: dict[str, dict[int, Any]]) -> dict[str, Any]:
        opt = record["ref"]()
        groups = []
        for group in opt.param_groups:
            owners: dict[str, int] = {}
            for param in group["params"]:
                name = names["params"].get(id(param), f"an unnamed parameter {tuple(param.shape)}")
                owner = name.rsplit(".", 1)[0] if "." in name else name
                owners[owner] = owners.get(owner, 0) + 1
            scalars = {k: (_finite(float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                       for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str))}
            groups.append({"hyper": scalars, "params": len(group["params"]),
                           "numel": int(sum(p.numel() for p in group["params"])),
                           "trainable": sum(1 for p in group["params"] if p.requires_grad),
                           "owners": sorted(owners)[:40], "owners_total": len(owners)})
        return {"class": record["class"], "site": record["site"], "groups": groups,
                "steps": self.step_counts.get(id(opt), 0)}

    def optimized(self) -> dict[int, float]:
        """id(param) -> the learning rate of the group that holds it, over every optimizer."""
        found: dict[int, float] = {}
        for record in self.optimizers:
            opt = record["ref"]()
            for group in opt.param_groups if opt is not None else []:
                for param in group["params"]:
                    lr = group.get("lr", 0.0)
                    found[id(param)] = float(lr) if isinstance(lr, (int, float)) else float("nan")
        return found

    def describe_frozen(self, names: dict[str, dict[int, Any]]) -> list[dict[str, Any]]:
        torch = self.torch
        optimized = self.optimized()
        # The head is the smallest module that produced the draft logits (a drafter class returning its head's
        # output, reshaped, produced them too: its parameters are not the head's).
        # Only modules whose output is the draft logits themselves (the last output of the vocabulary's width that
        # got a gradient, or a view of the same storage): a layer of the same width earlier is not the head.
        last = self.draft_logits()
        same = [h for h in self.logits if "grad" in h and last is not None
                and _storage(h["logits"]) == _storage(last["logits"])]
        producers = [m for m in (h["module"]() for h in same) if m is not None]
        sized = [(sum(p.numel() for p in m.parameters()), m) for m in producers]
        head_ids = {id(min((item for item in sized if item[0] > 0), key=lambda item: item[0])[1])} \
            if any(item[0] > 0 for item in sized) else set()
        # Of the head module's parameters only those of the vocabulary's width are the head's: a drafter that
        # applies a borrowed weight functionally (F.linear on a buffer) produced the logits itself, and its
        # trainable layers are not a head.
        vocab = last["shape"][-1] if last is not None else None
        rows = []
        for module in self.watched_modules():
            role = "embeddings" if isinstance(module, torch.nn.Embedding) else "draft head"
            if role == "draft head" and id(module) not in head_ids:
                continue
            for pname, param in module.named_parameters():
                if role == "draft head" and vocab not in tuple(param.shape):
                    continue
                step = self.observed["frozen"].get(id(param))
                rows.append({"role": role, "module": names["modules"].get(id(module), type(module).__name__),
                             "param": names["params"].get(id(param), pname), "shape": list(param.shape),
                             "root": names["roots"].get(id(module)), "requires_grad": bool(param.requires_grad),
                             "in_optimizer": id(param) in optimized,
                             "lr": _finite(optimized[id(param)]) if id(param) in optimized else None,
                             "changed_by_step": None if step is None else step["changed"],
                             "had_grad": None if step is None else step["had_grad"]})
        return rows
