"""sleuth's probes on the SpecForge paths its experiments bypass: the chunked objective and the capture layers.

The experiments run SpecForge's objective in one piece (objective_chunk_blocks=0: recomputation would call
lm_head again behind the probe's hook) and select the target layers with extract_context_feature over the
drafter's own ids. The run takes other code: its objective in checkpointed chunks of 128 blocks by default,
and for offline / server training the layers resolve_dflash_capture_layers says to capture. A defect there
(round 3's r3-sf-chunk-grad-first-slice-only, r3-sf-capture-layers-plus-one) was reported `match`. The
adapter's path_checks now compare the chunked objective with the one piece (loss and every trainable
parameter's gradient) and the capture layers with the layers the drafter reads: unmodified SpecForge, under
its defaults and under the recipes, must give no mismatch, and each planted class must give one.

Runs in the speculators environment (`make parity`), where SpecForge is installed beside speculators.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from speculators_guard import require_speculators

require_speculators()

from sleuth.probes.runner import plan_for_code, run_plan  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "specforge"
RECIPES = {
    "tiny-gamma7": FIXTURES / "recipe-sf-tiny-gamma7.yaml",
    "qwen36": FIXTURES / "checkout-qwen36" / "examples" / "configs" / "qwen36-dflash-online.yaml",
}

# Planted with exact find / replace (the round-3 catalog's edits, and variants of the same classes).
CHUNK_DETACHED = ("core/chunking.py",
                  "        totals = tuple(left + right for left, right in zip(totals, chunk_terms))\n",
                  "        totals = tuple(left + right.detach() for left, right in zip(totals, chunk_terms))\n")
CHUNK_LAST_DROPPED = ("core/chunking.py",  # the loss changes too: the last slice never reaches the totals
                      "        width = min(effective_chunk_size, length - start)\n",
                      "        width = min(effective_chunk_size, length - start)\n"
                      "        if start and start + width >= length:\n"
                      "            break\n")
CAPTURE_PLUS_ONE = ("algorithms/model_providers.py",
                    '    layers = list(method_config.get("target_layer_ids", []))\n',
                    '    layers = [int(i) + 1 for i in method_config.get("target_layer_ids", [])]\n')
CAPTURE_REVERSED = ("algorithms/model_providers.py",
                    '    layers = list(method_config.get("target_layer_ids", []))\n',
                    '    layers = sorted(method_config.get("target_layer_ids", []), reverse=True)\n')


def _specforge() -> Path:
    spec = importlib.util.find_spec("specforge")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("specforge is not installed here (the reference venv: bench/setup_speculators_env.sh)")
    return Path(next(iter(spec.submodule_search_locations)))


def _planted(tmp_path: Path, edit: tuple[str, str, str]) -> Path:
    copy = tmp_path / "specforge"
    shutil.copytree(_specforge(), copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    file, find, replace = edit
    text = (copy / file).read_text()
    assert text.count(find) == 1, f"{find!r} is not in {file} exactly once"
    (copy / file).write_text(text.replace(find, replace))
    return copy


def _verdicts(code: Path, recipe: Path | None = None) -> dict:
    config = yaml.safe_load(recipe.read_text()) if recipe else None
    outcome = run_plan(plan_for_code(code, config, recipe), python=sys.executable, timeout_s=600)
    assert outcome.error is None, outcome.error
    return {v.invariant: v for v in outcome.verdicts}


@pytest.mark.parametrize("recipe", [None, *RECIPES], ids=["defaults", *RECIPES])
def test_unmodified_specforge_paths_agree(recipe, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = _verdicts(_specforge(), RECIPES.get(recipe))
    assert {k: v.observed for k, v in found.items() if v.status == "mismatch"} == {}
    # the checks ran and agreed, and say so in the coverage of the verdicts they join
    chunking = found["dflash.loss_kind"].coverage["path_checks"]["objective-chunking"]
    assert chunking.startswith("match"), chunking
    capture = found["dflash.target_layer_ids"].coverage["path_checks"]["capture-layers"]
    assert capture.startswith("match"), capture
    row_end = found["dflash.target_shift"].coverage["path_checks"]["row-end-block"]
    assert row_end.startswith("match"), row_end
    positions = found["dflash.block_position_ids"].coverage["path_checks"]["row-end-positions"]
    assert positions.startswith("match"), positions
    accumulation = found["dflash.loss_kind"].coverage["path_checks"]["gradient-accumulation"]
    assert accumulation.startswith("match"), accumulation
    assert found["dflash.fc_norm"].status == "match", found["dflash.fc_norm"]
    saved = found["dflash.mask_token_distinct"].coverage["path_checks"]["saved-mask-token"]
    assert saved.startswith("match"), saved


@pytest.mark.parametrize("edit", [CHUNK_DETACHED, CHUNK_LAST_DROPPED], ids=["detached", "last-dropped"])
def test_a_defect_in_the_chunked_objective_is_a_loss_kind_mismatch(edit, tmp_path: Path):
    found = _verdicts(_planted(tmp_path, edit))
    verdict = found["dflash.loss_kind"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "chunked objective the run uses (objective_chunk_blocks=" in verdict.observed, verdict.observed
    assert "than the same objective in one piece" in verdict.observed, verdict.observed


@pytest.mark.parametrize("edit", [CAPTURE_PLUS_ONE, CAPTURE_REVERSED], ids=["plus-one", "reversed"])
def test_capture_layers_other_than_the_drafter_reads_are_a_layer_ids_mismatch(edit, tmp_path: Path):
    # the 3-layer recipe drafter, so a reordering is visible as well as an offset
    found = _verdicts(_planted(tmp_path, edit), RECIPES["qwen36"])
    verdict = found["dflash.target_layer_ids"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "captures target layers" in verdict.observed and "the drafter is built to read" in verdict.observed, \
        verdict.observed


# the flex mask_mod's window bound one wider than the SDPA builder's (round 3: a silent match, since the
# experiments' contexts never reach a recipe's 2048-token window)
FLEX_WINDOW_WIDER = ("algorithms/common/dflash_family_model.py",
                     "            context_lower_bound = anchor_pos + q_block_offset - (sliding_window - 1)\n",
                     "            context_lower_bound = anchor_pos + q_block_offset - sliding_window\n")


@pytest.mark.parametrize("recipe", [None, "qwen36"], ids=["defaults", "qwen36"])
def test_a_flex_mask_that_differs_from_the_sdpa_builder_is_a_mismatch(recipe, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = _verdicts(_planted(tmp_path, FLEX_WINDOW_WIDER), RECIPES.get(recipe))
    verdict = found["dflash.context_excludes_anchor"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "the flex mask the run uses differs from SpecForge's SDPA mask at window 3" in verdict.observed


def test_a_recipes_sliding_windows_are_compared_between_the_builders(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = _verdicts(_specforge(), RECIPES["qwen36"])
    said = found["dflash.context_excludes_anchor"].coverage["path_checks"]["mask-builders"]
    assert said.startswith("match") and "windows [" in said, said  # the recipe's windows were compared


# the label bound made inclusive (round 3: a silent match, since no probe block ran past its row's end)
LABEL_BOUND_INCLUSIVE = ("algorithms/common/dflash_family_model.py",
                         "        label_indices = anchor_positions.unsqueeze(-1) + label_offsets\n"
                         "        valid_label_mask = label_indices < seq_len\n        safe_label_indices",
                         "        label_indices = anchor_positions.unsqueeze(-1) + label_offsets\n"
                         "        valid_label_mask = label_indices <= seq_len\n        safe_label_indices")


def test_a_block_past_the_rows_end_that_trains_there_is_a_shift_mismatch(tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, LABEL_BOUND_INCLUSIVE))["dflash.target_shift"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "a block at the row's end trains slots [2]" in verdict.observed, verdict.observed


# Round 3's last silent match: the optimizer boundary normalised by the last micro-batch's denominator (only with
# accumulation_steps > 1; no experiment runs SpecForge's trainer loop), and a variant: the per-micro-batch
# division by accumulation_steps dropped (every accumulated gradient twice the objective's).
ACCUM_LAST_DENOMINATOR = ("training/controller.py",
                          '            self._normalize_gradients(self._ratio_totals["loss"][1])\n',
                          "            self._normalize_gradients(denominator)\n")
ACCUM_NOT_DIVIDED = ("training/controller.py",
                     "        loss = loss / self.accumulation_steps\n",
                     "        loss = loss\n")


@pytest.mark.parametrize("edit", [ACCUM_LAST_DENOMINATOR, ACCUM_NOT_DIVIDED], ids=["last-denominator", "not-divided"])
def test_gradient_accumulation_other_than_the_pooled_objective_is_a_loss_kind_mismatch(edit, tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, edit))["dflash.loss_kind"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "with gradient accumulation the trainer steps with other gradients" in verdict.observed, verdict.observed


# draft positions clamped at the row's end like the label indices (round 3: unknown; the layout keeps blocks
# inside their rows, so only the row-end block shows it)
POSITIONS_CLAMPED = ("algorithms/common/dflash_family_model.py",
                     "        draft_position_ids = self._create_position_ids(anchor_positions)\n",
                     "        draft_position_ids = self._create_position_ids(anchor_positions).clamp(max=seq_len - 1)\n")


def test_positions_clamped_at_the_rows_end_are_a_position_mismatch(tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, POSITIONS_CLAMPED))["dflash.block_position_ids"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "not anchor + j" in verdict.observed, verdict.observed


# the decayed loss divided by the token count instead of the sum of its weights (round 3: unknown; the fitted
# weight ratios do not move under a uniform scale): SpecForge promises a weighted mean (describe's
# loss_reduction), so the weights' sum is checked
DENOMINATOR_COUNT = ("algorithms/common/dflash_family_model.py",
                     "            loss_den = loss_weights.sum()\n",
                     "            loss_den = weight_mask.sum()\n")


@pytest.mark.parametrize("recipe", [None, "tiny-gamma7"], ids=["defaults", "tiny-gamma7"])
def test_a_weighted_loss_over_a_count_is_a_gamma_mismatch(recipe, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    verdict = _verdicts(_planted(tmp_path, DENOMINATOR_COUNT), RECIPES.get(recipe))["dflash.loss_decay_gamma"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert "the code promises (weighted_mean:" in verdict.observed and "(token_mean)" in verdict.observed, \
        verdict.observed


# Round 4's classes (defects_round4.yaml), our own variants: the D-PACE loss over the supervised tokens instead of
# the rows SpecForge divides it by, and a saved draft config that keeps a pinned mask id training does not use.
DPACE_OVER_TOKENS = ("algorithms/common/dflash_family_model.py",
                     '            loss_den if self.loss_type == "dflash" else loss_num.new_tensor(float(bsz))\n',
                     '            loss_den if self.loss_type == "dflash" else accuracy_denom.detach().clamp_min(1)\n')
MASK_ID_KEPT = ("algorithms/model_providers.py",
                '    method_config["mask_token_id"] = mask_token_id\n',
                '    method_config["mask_token_id"] = method_config.get("mask_token_id", mask_token_id)\n')


def test_a_dpace_loss_divided_otherwise_than_by_the_rows_is_a_mismatch(tmp_path: Path):
    # SpecForge's D-PACE path is its variant without a recipe: the variant's mismatch is the finding's
    verdict = _verdicts(_planted(tmp_path, DPACE_OVER_TOKENS))["dflash.loss_decay_gamma"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert "the code promises (batch_mean:" in verdict.observed, verdict.observed


def test_a_saved_mask_id_other_than_the_trained_one_is_a_mask_token_and_an_export_mismatch(tmp_path: Path):
    # training fills the blocks with the right id and the checkpoint carries another: serving's mask token is not
    # the trained one, and the export does not carry what trained
    found = _verdicts(_planted(tmp_path, MASK_ID_KEPT))
    for invariant in ("dflash.mask_token_distinct", "dflash.export_contract"):
        verdict = found[invariant]
        assert verdict.status == "mismatch", (invariant, verdict.status, verdict.reason)
        assert "the saved draft config's mask_token_id is" in verdict.observed, verdict.observed


# Round 7's classes (defects_round7.yaml), our own variants: a warm start whose draft config's mask id is ignored
# (the tokenizer's own mask token wins), assistant spans cut before their end-of-turn, and every norm built with a
# fixed eps instead of the config's.
WARM_START_ID_IGNORED = ("training/model_utils.py",
                         '        ("draft config mask token", method_config.get("mask_token_id")),\n', "")
SPAN_ENDS_BEFORE_EOT = ("data/parse.py", "            content_end_char = match.end(1)\n",
                        "            content_end_char = match.end(1) - len(self.chat_template.end_of_turn_token)\n")
NORM_EPS_FIXED = ("modeling/draft/dflash_kernels.py", "    return Qwen3RMSNorm(hidden_size, eps=eps)\n",
                  "    return Qwen3RMSNorm(hidden_size, eps=1e-5)\n")


def test_a_warm_start_that_loses_the_recorded_mask_id_is_a_mask_token_mismatch(tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, WARM_START_ID_IGNORED))["dflash.mask_token_distinct"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason, verdict.coverage.get("path_checks"))
    assert "on a warm start the blocks are filled with" in verdict.observed, verdict.observed


@pytest.mark.parametrize("recipe", [None, "qwen36"], ids=["defaults-llama3", "qwen36-thinking"])
def test_assistant_spans_that_stop_before_the_end_of_turn_are_a_chat_template_mismatch(recipe, tmp_path: Path,
                                                                                      monkeypatch):
    # the defaults' llama3 template (general parser) and the Qwen3.6 recipe's qwen3.5 template (thinking parser)
    monkeypatch.chdir(tmp_path)
    found = _verdicts(_planted(tmp_path, SPAN_ENDS_BEFORE_EOT), RECIPES.get(recipe))
    verdict = found["dflash.chat_template_consistency"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert "end-of-turn token after 2 of 2 assistant turns is unsupervised" in verdict.observed, verdict.observed


def test_norms_built_with_another_eps_than_the_config_records_are_an_fc_norm_mismatch(tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, NORM_EPS_FIXED))["dflash.fc_norm"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert "use eps 1e-05 where its config records 3e-06" in verdict.observed, verdict.observed


# Round 5's optimizer classes (defects_round5.yaml), our own variants: the clip norm summed as absolute values
# (an L1 norm), and the float32 masters copied back into only the matrices (the norms' weights never updated).
CLIP_NORM_L1 = ("optimizer.py",
                "        grads = [p.grad.detach() for p in self.model_params if p.grad is not None]\n"
                "        if grads:\n            total_norm_sq = torch.stack(\n"
                "                [grad.float().square().sum() for grad in grads]\n",
                "        grads = [p.grad.detach() for p in self.model_params if p.grad is not None]\n"
                "        if grads:\n            total_norm_sq = torch.stack(\n"
                "                [grad.float().abs().sum() for grad in grads]\n")
MASTERS_MATRICES_ONLY = ("optimizer.py",
                         "                p.data.copy_(mp.data.to(device=p.device, dtype=p.dtype))\n",
                         "                if mp.dim() > 1:\n"
                         "                    p.data.copy_(mp.data.to(device=p.device, dtype=p.dtype))\n")


@pytest.mark.parametrize(("edit", "observed"), [(CLIP_NORM_L1, "is scaled by"),
                                                (MASTERS_MATRICES_ONLY, "are not its updated float32 masters")],
                         ids=["clip-l1", "masters-matrices-only"])
def test_an_optimizer_that_steps_otherwise_than_configured_is_an_optimizer_mismatch(edit, observed, tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, edit))["dflash.optimizer_schedule"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert observed in verdict.observed, verdict.observed


def test_the_optimizer_is_checked_in_the_runs_dtype(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = _verdicts(_specforge(), RECIPES["qwen36"])["dflash.optimizer_schedule"]
    assert found.status == "match", (found.status, found.reason, found.observed)
    assert "parameters in bfloat16" in found.measurement and "one step:" in found.measurement, found.measurement


# the saved optimizer state's masters re-read from the model's half-precision parameters (our variant of round
# 5's: rounded to float16 where the run trains in bfloat16)
MASTERS_SAVED_ROUNDED = ("optimizer.py",
                         '            "fp32_params": [t.detach().cpu() for t in self.fp32_params],\n',
                         '            "fp32_params": [t.detach().cpu().half().float() for t in self.fp32_params],\n')


def test_an_optimizer_state_that_does_not_resume_is_an_optimizer_mismatch(tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, MASTERS_SAVED_ROUNDED))["dflash.optimizer_schedule"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert "an optimizer resumed from its saved state is not the saved one" in verdict.observed, verdict.observed


# Round 7's accept-length class (r7-sf-accept-len-block-axis took the cumulative product over the block axis), our
# own variants: every correct slot counted (no leading-run product at all), the verifier's bonus token left out,
# and blocks without an evaluated slot kept in the denominator. Only the Domino objective reports accept_len.
FAMILY = "algorithms/common/dflash_family_model.py"
ACCEPT_EVERY_CORRECT_SLOT = (FAMILY, "    accept_prefix = correct.long().cumprod(dim=2) * valid_mask_4d.long()\n",
                             "    accept_prefix = correct.long() * valid_mask_4d.long()\n")
ACCEPT_NO_BONUS = (FAMILY, "            accept_num = ((accepted + 1.0) * valid_blocks).sum()\n",
                   "            accept_num = (accepted * valid_blocks).sum()\n")
ACCEPT_EVERY_BLOCK = (FAMILY, "            accept_den = valid_blocks.sum()\n",
                      "            accept_den = torch.ones_like(valid_blocks).sum()\n")


@pytest.mark.parametrize("edit", [ACCEPT_EVERY_CORRECT_SLOT, ACCEPT_NO_BONUS, ACCEPT_EVERY_BLOCK],
                         ids=["every-correct-slot", "no-bonus", "every-block"])
def test_an_accept_len_other_than_servings_is_a_train_serve_mismatch(edit, tmp_path: Path):
    verdict = _verdicts(_planted(tmp_path, edit))["dflash.train_serve_gap"]
    assert verdict.status == "mismatch", (verdict.status, verdict.reason)
    assert "where serving would accept" in verdict.observed, verdict.observed


def _reported_acceptance(recipe: Path | None) -> object:
    """The reported-acceptance check on unmodified SpecForge, in this process (its `match` never reaches a probe
    answer: train_serve_gap is mismatch-only), on the lab the worker builds."""
    import torch

    from sleuth.probes.adapters.specforge import SpecForgeSubject
    from sleuth.probes.experiments import Lab, randomize_drafter
    from sleuth.probes.protocol import PartialSubject, check_description
    from sleuth.probes.target import make_target
    from sleuth.probes.verdict import Expectations

    context = {"config": yaml.safe_load(recipe.read_text()), "config_path": str(recipe)} if recipe else {}
    subject = SpecForgeSubject(str(_specforge()), context)
    info = check_description(PartialSubject(subject).describe())
    target = make_target(int(info["num_target_layers"]), 0)
    torch.manual_seed(0)
    subject.build(target)
    randomize_drafter(PartialSubject(subject), target, 7)
    return subject._reported_acceptance(Lab(PartialSubject(subject), info, target, Expectations.from_json(None), 0))


def test_unmodified_domino_accept_len_is_servings_on_several_chunks_and_cut_blocks():
    verdict = _reported_acceptance(None)
    assert verdict.status == "match", (verdict.status, verdict.observed, verdict.measurement)
    assert verdict.coverage["chunks"] >= 2 and verdict.coverage["blocks_cut_short"] >= 1, verdict.coverage
    assert "probe choice: no recipe chose a strategy" in verdict.coverage["objective"], verdict.coverage


def test_a_dflash_recipe_leaves_the_domino_accept_len_unexercised():
    verdict = _reported_acceptance(RECIPES["tiny-gamma7"])
    assert verdict.status == "unknown" and "training.strategy dflash" in verdict.reason, verdict
