"""Run the probe experiments in-process on a subject (the worker does the same in its own process)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from sleuth.probes.experiments import EXPERIMENTS, Lab, randomize_drafter
from sleuth.probes.target import make_target
from sleuth.probes.verdict import Expectations, Verdict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_subject(**config: Any) -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import probe_protocol

    return probe_protocol.subject({"config": config})


def make_lab(subject: Any, expectations: Expectations | None = None, info_update: dict[str, Any] | None = None) -> Lab:
    info = subject.describe()
    target = make_target(int(info["num_target_layers"]), 0)
    torch.manual_seed(0)
    subject.build(target)
    randomize_drafter(subject, target, 7)
    if info_update:  # what a subject would say of itself, e.g. that its forward takes no document ids
        describe = subject.describe
        subject.describe = lambda: {**describe(), **info_update}
    return Lab(subject, info, target, expectations or Expectations(), 0)


def verdicts(subject: Any, *experiments: str, expectations: Expectations | None = None) -> dict[str, Verdict]:
    lab = make_lab(subject, expectations)
    found: dict[str, Verdict] = {}
    for name in experiments or tuple(EXPERIMENTS):
        found.update({v.invariant: v for v in EXPERIMENTS[name](lab)})
    return found
