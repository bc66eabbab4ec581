"""Locating a trainer's pieces statically (sleuth's process, nothing imported), on the development corpus
tests/fixtures/anyprobe (trainers in styles the static corpus does not have, written for these tests)."""

from __future__ import annotations

from pathlib import Path

from sleuth.probes.locate import locate

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "anyprobe"


def _pieces(case: str, config=None) -> dict[str, list]:
    found: dict[str, list] = {}
    for piece in locate(CORPUS / case, config).pieces:
        found.setdefault(piece.kind, []).append(piece)
    return found


def test_the_override_a_concrete_subclass_runs_is_located_not_the_base_hook():
    pieces = _pieces("a06_hierarchy_hooks")
    weights = pieces["weights"]
    assert [p.qualname for p in weights] == ["DFlashTrainer.position_weights"]
    assert weights[0].concrete == ["DFlashTrainer"] and weights[0].class_modules == {"DFlashTrainer": "dflash_trainer"}
    # a method nothing calls is not on the run's path
    located = locate(CORPUS / "a06_hierarchy_hooks")
    assert "positions" not in pieces
    assert "DFlashTrainer.block_positions" in located.missing["positions"]


def test_a_registry_gives_the_loss_under_the_configured_key():
    assert [p.qualname for p in _pieces("a05_registry_clean")["loss"]] == ["hard_ce"]  # DFlashConfig.loss = "ce"
    assert [p.qualname for p in _pieces("a05_registry_clean", {"loss": "kl"})["loss"]] == ["soft_kl"]


def test_a_label_gather_for_a_metric_is_not_a_position_or_a_target():
    located = locate(CORPUS / "a05_registry_clean")
    assert "positions" not in {p.kind for p in located.pieces}
    assert [p.qualname for p in located.pieces if p.kind == "teacher"] == ["teacher_for_blocks"]


def test_a_mask_mod_factory_is_probed_through_the_builder_that_calls_it():
    mask = _pieces("a09_flex_with_adapter")["mask"]
    assert [p.qualname for p in mask] == ["make_block_mask", "dflash_mask_mod"]
    assert mask[0].chain == mask[1].chain  # one chain: the child calls the builder first


def test_the_probe_entry_beside_the_code_is_not_the_implementation():
    located = locate(CORPUS / "a09_flex_with_adapter")
    assert list(located.excluded) == ["a09_flex_with_adapter/probe_entry.py"]
    assert not any(p.path.endswith("probe_entry.py") for p in located.pieces)


def test_what_the_run_passes_is_read_at_the_call_sites():
    pieces = _pieces("a01_paramdict_pure")
    weights = pieces["weights"][0]
    assert weights.qualname == "slot_weights" and weights.passed == {"block": 16, "gamma": 7.0}  # cfg = {...} in main
    rule = pieces["layer_ids"][0]
    assert rule.passed == {"n_taps": 5} and "n_target_layers" in rule.unresolved


def test_work_on_import_is_left_out_of_the_module(tmp_path: Path):
    (tmp_path / "script.py").write_text(
        "import torch\nBLOCK = 8\nargs = parse()\n\ndef visible(anchors, block):\n"
        "    return anchors[:, None] < torch.arange(block)\n\nmain()\n")
    located = locate(tmp_path)
    assert located.modules["script"].strip == [3, 8]


def test_inline_computations_say_where_they_are():
    missing = locate(CORPUS / "a02_argparse_script").missing
    assert missing["loss"].startswith("computed inline in main (a02_argparse_script/train_dflash.py:")


def test_an_objective_module_called_as_an_instance_reaches_its_forward(tmp_path: Path):
    # a blind trainer's style: `loss = objective(ids, mask)` on an nn.Module whose forward builds the mask
    # through helpers. Calling the instance runs forward; before, nothing linked
    # `objective(...)` to forward, so every piece inside it was "not on the run's path".
    (tmp_path / "train.py").write_text('''
import torch
from torch import nn


class Objective(nn.Module):
    def __init__(self, block_size=4):
        super().__init__()
        self.block_size = block_size
        self.proj = nn.Linear(8, 8)

    @staticmethod
    def _visible(key_pos, anchor_pos):
        return key_pos < anchor_pos

    def _mask(self, anchors, seq_len):
        per_query = anchors.repeat_interleave(self.block_size, dim=1)
        return self._visible(torch.arange(seq_len)[None, None, :], per_query[:, :, None])

    def forward(self, input_ids, loss_mask):
        mask = self._mask(loss_mask.nonzero()[:, 1][None, :2], input_ids.shape[1])
        return self.proj(torch.randn(1, 8)).sum() * mask.float().mean()


class Scaled:
    def __call__(self, loss):
        return loss * 0.5


def main():
    objective, scale = Objective(), Scaled()
    optimizer = torch.optim.AdamW(objective.parameters())
    loss = scale(objective(torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8)))
    loss.backward()
    optimizer.step()
''')
    located = locate(tmp_path)
    masks = {p.qualname: p.used_by for p in located.pieces if p.kind == "mask"}
    assert "Objective._visible <- Objective._mask <- Objective.forward <- main (" in masks.get("Objective._visible", ""), masks
