"""One rule for every parity module: speculators is required under `make parity`, optional elsewhere."""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("SPECULATORS_PARITY_REQUIRED") == "1"


def require_speculators() -> None:
    """Skip the calling test module where speculators' DFlash model does not import; under
    SPECULATORS_PARITY_REQUIRED=1 (set by `make parity`) that is a failure instead."""
    try:
        import speculators.models.dflash.core  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (a CUDA torchvision fails at import)
        if REQUIRED:
            pytest.fail(f"SPECULATORS_PARITY_REQUIRED=1 but speculators does not import: {exc!r}", pytrace=False)
        pytest.skip(f"speculators is not importable here ({type(exc).__name__}); the parity tests run in the "
                    "speculators venv: bench/setup_speculators_env.sh, then `make parity`", allow_module_level=True)
