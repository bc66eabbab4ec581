#!/usr/bin/env bash
# Creates the reference environment for the parity tests and the benchmarks against speculators:
# vllm-project/speculators 0.9.0 on CPU, in its own virtual environment (it pins transformers <= 5.19,
# which our main .venv does not), and sgl-project/SpecForge 0.2.0 beside it (the probes' second upstream:
# installed --no-deps, since it pins CUDA builds and sglang; what its DFlash code imports on CPU is added by
# hand). Idempotent: a finished environment is reused.
#
#   bash bench/setup_speculators_env.sh                 # -> .venv-speculators
#   SPECULATORS_VENV=/tmp/specvenv bash bench/setup_speculators_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${SPECULATORS_VENV:-.venv-speculators}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
SPECULATORS_VERSION="${SPECULATORS_VERSION:-0.9.0}"
SPECFORGE_VERSION="${SPECFORGE_VERSION:-0.2.0}"
SPECFORGE_EXTRAS="accelerate==1.15.0 psutil==7.2.2 yunchang==0.6.4"
# z-lab's own inference package (DFlashDraftModel, dflash_generate): the parity suite runs our exports through it.
# --no-deps: it pins tqdm / datasets / requests / huggingface_hub versions its model code never imports.
DFLASH_VERSION="${DFLASH_VERSION:-0.1.0}"
# `make parity` runs on both cores (-n 2), like `make test`; the main lock's version.
XDIST_VERSION="${XDIST_VERSION:-3.8.0}"
PIP="$VENV/bin/python -m pip"
# The marker holds what was installed: an environment built with other pins (or before SpecForge was
# added) is brought up to date in place instead of being taken as ready.
STAMP="torch $TORCH_VERSION speculators $SPECULATORS_VERSION specforge $SPECFORGE_VERSION $SPECFORGE_EXTRAS dflash $DFLASH_VERSION pytest-xdist $XDIST_VERSION"

if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$STAMP" ]; then
    echo "speculators environment ready: $VENV"
    exit 0
fi

"$PYTHON" -m venv "$VENV"
$PIP install -q --upgrade pip
# torch first, and the CPU build where there is no NVIDIA GPU (the same rule as the main environment).
tools/install_torch.sh "$VENV/bin/python"
"$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" \
    || echo "warning: $VENV got a CUDA build of torch; the parity tests still run on CPU" >&2
$PIP install -q "torch==$TORCH_VERSION" "speculators==$SPECULATORS_VERSION"
# speculators pulls torchvision/torchaudio from PyPI as CUDA builds; their import breaks speculators'
# import on a CPU machine, and nothing we run needs them.
$PIP uninstall -y -q torchvision torchaudio
# What our trainer package and the parity tests import besides torch and transformers (speculators
# brings transformers, safetensors, pydantic, pyyaml, rich, typer, tokenizers, httpx already).
$PIP install -q pytest "pytest-xdist==$XDIST_VERSION" platformdirs tensorboard  # tensorboard: `speculators train --logger tensorboard` (tools/make_speculators_fixture.py)
# SpecForge without its dependency pins (CUDA torch, sglang); its DFlash training code needs only these on CPU
# (pinned to what the reference environment was measured with: BENCHMARKS.md, the probes catalog).
$PIP install -q --no-deps "specforge==$SPECFORGE_VERSION" $SPECFORGE_EXTRAS
$PIP install -q --no-deps "dflash==$DFLASH_VERSION"

# Fail here, not in CI, if the environment cannot import what the parity tests need.
PYTHONPATH=. "$VENV/bin/python" - <<'PY'
import speculators, torch, transformers
from speculators.models.dflash.core import DFlashDraftModel  # noqa: F401
from speculators.losses import resolve_loss_config
resolve_loss_config("ce", "eager")
import trainer.run.step  # noqa: F401  (our side of the comparison)
import specforge.algorithms.common.dflash_family_model  # noqa: F401  (the probes' SpecForge adapter)
from dflash.model import DFlashDraftModel, dflash_generate  # noqa: F401  (z-lab's package: tests/parity/test_served_engines.py)
from importlib.metadata import version
print(f"speculators {version('speculators')}, specforge {version('specforge')}, dflash {version('dflash')}, "
      f"torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PY
echo "$STAMP" > "$VENV/.installed"
echo "speculators environment ready: $VENV"
