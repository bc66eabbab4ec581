"""Probes: experiments run on the implementation under diagnosis, in a separate process.

Static reading is fooled by names; a probe is not. Each experiment builds tiny inputs whose answer is known
(a synthetic target, chosen anchors), perturbs one thing, measures how the implementation's own code
responds and compares the number with a stated threshold. Verdicts become `probe` evidence, ranked above
static code readings (where the two disagree, the probe decides and the report says so), never above the
run's config or checkpoint (merge.py).

Layout:
  protocol.py     the documented protocol a subject implements (torch-free)
  verdict.py      what an experiment reports, and the expected values it is judged by (torch-free)
  target.py       the synthetic target and batches (worker side)
  experiments/    the experiments (worker side): lab.py, one module per family, the registry in __init__
  adapters/       subjects for code that does not implement the protocol itself (speculators, SpecForge)
  worker.py       the subprocess: loads the subject, runs every experiment, writes JSON
  runner.py       sleuth's side: which subject, which interpreter, the subprocess and its limits
  merge.py        verdicts -> `probe` evidence on the engine's findings, and trace steps
  agent.py        the policy: when `sleuth diagnose` probes

Nothing here is imported at package import: the worker runs in the user's interpreter, which may lack
sleuth's own dependencies.
"""
