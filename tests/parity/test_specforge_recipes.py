"""sleuth's probes on unmodified SpecForge 0.2.0 under a recipe in the shape of its shipped Qwen3.6 one.

The fixture (tests/fixtures/specforge/checkout-qwen36) lays the recipe out as SpecForge's checkout does:
examples/configs/<recipe>.yaml naming configs/<draft>.json from the checkout's root, with the target's
embedding under `model.language_model.`. Before, that recipe stopped every experiment ("draft config not
found next to the recipe", then "Required target weight tensors were not loaded"), so a user of the
published recipe got no probe at all. Unmodified code under the user's real recipe must come out with no
mismatch, and the experiments must have run on the recipe's own values (gamma 7, sliding-window layers).

Runs in the speculators environment (`make parity`), where SpecForge is installed beside speculators.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from speculators_guard import require_speculators

require_speculators()

from sleuth.probes.runner import plan_for_code, run_plan  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[1] / "fixtures" / "specforge" / "checkout-qwen36"
RECIPE = CHECKOUT / "examples" / "configs" / "qwen36-dflash-online.yaml"


def _specforge() -> Path:
    spec = importlib.util.find_spec("specforge")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("specforge is not installed here (the reference venv: bench/setup_speculators_env.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def test_the_shipped_qwen36_recipe_shape_is_probed_without_a_false_alarm(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # sleuth run from anywhere but the checkout
    plan = plan_for_code(_specforge(), yaml.safe_load(RECIPE.read_text()), RECIPE)
    assert plan.spec["context"]["draft_config_from"] == str(CHECKOUT / "configs" / "qwen36-dflash.json")
    outcome = run_plan(plan, python=sys.executable, timeout_s=600)
    assert outcome.error is None, outcome.error
    found = {v.invariant: v for v in outcome.verdicts}
    mismatches = {k: v.observed for k, v in found.items() if v.status == "mismatch"}
    assert mismatches == {}
    gamma = found["dflash.loss_decay_gamma"]
    assert gamma.measured["gamma"] == pytest.approx(7.0, rel=1e-3), gamma.observed
    # the recipe's sliding-window drafter was the one probed: its layers are causal within the block
    assert found["dflash.block_bidirectional"].status != "mismatch"
    assert "causal" in (found["dflash.block_bidirectional"].observed or ""), found["dflash.block_bidirectional"].observed
