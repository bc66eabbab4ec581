#!/usr/bin/env bash
# Install the right torch build into a virtual environment: the default (CUDA) build where an NVIDIA GPU
# answers, else the CPU build. A plain `pip install torch` on Linux pulls a multi-GB CUDA build even on a
# machine without a GPU, so the CPU case pins the `+cpu` local version: it resolves from a configured
# wheelhouse or mirror when there is one (fast, works offline) and from PyTorch's CPU index otherwise.
#
#   tools/install_torch.sh .venv/bin/python
set -euo pipefail
PY="${1:?usage: install_torch.sh PYTHON}"
# The version the suite passed on: requirements/lock.txt's, for both builds (the CPU one and the CUDA one).
LOCK="$(dirname "$0")/../requirements/lock.txt"
LOCKED="$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$LOCK" 2>/dev/null | head -n 1)"
VERSION="${TORCH_CPU_VERSION:-$LOCKED}"
[ -n "$VERSION" ] || { echo "error: no torch==VERSION line in $LOCK (set TORCH_CPU_VERSION)" >&2; exit 1; }
INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "NVIDIA GPU found: installing the default (CUDA) build of torch $VERSION"
    exec "$PY" -m pip install -q "torch==$VERSION"
fi
if [ "$(uname -s)" = "Darwin" ]; then  # PyPI's macOS wheels are CPU builds already
    exec "$PY" -m pip install -q "torch==$VERSION"
fi
echo "no NVIDIA GPU: installing the CPU build of torch $VERSION"
"$PY" -m pip install -q "torch==$VERSION+cpu" 2>/dev/null \
    || "$PY" -m pip install -q --retries 2 --timeout 30 "torch==$VERSION+cpu" --extra-index-url "$INDEX"
