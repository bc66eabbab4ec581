"""Observe the user's own training command: verdicts measured on the run's own optimizer step.

    sleuth diagnose --code . --probe -- python train.py --config small.yaml

sleuth runs the command (with consent, `--probe`) in a copy of the code, inside the probe isolation
(sleuth/probes/sandbox.py), with an observer injected into the child interpreter before the user's code runs
(site/sitecustomize.py). The observer instruments torch, not names: global module forward hooks, the
concatenation of target layer outputs into features, `backward`, the optimizer's construction and steps,
LR schedulers. After N optimizer steps (default 1) it measures on that step's own tensors, writes the
observation to the box's answer file and ends the process. sleuth's side (judge.py, torch-free) turns the
observation into verdicts: `match` only for what the observed step exercised.

Modules: runner.py (sleuth's side: box, consent, isolation, reading the observation back), launch.py (the
child's first process: the copy becomes its working directory, then the user's command runs), observer.py
(inside the user's process; torch), judge.py (observation -> verdicts), reference.py (the DFlash formulas the
judge uses as its oracle).
"""
