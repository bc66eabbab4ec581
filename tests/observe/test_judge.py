"""The observation -> verdict rules (torch-free): exercised parts decide, the rest stays unknown."""

from __future__ import annotations

import math

from sleuth.observe.judge import OBSERVED_INVARIANTS, block_pattern, judge
from sleuth.observe.optimization_judge import OPTIMIZATION_INVARIANTS
from sleuth.observe.reference import target_layer_ids
from sleuth.probes.verdict import Expectations


def features(layers: list[int], grads: list[float], depth: int = 12) -> dict:
    return {"kind": "cat", "site": "train.py:10", "dim": 2, "shape": [2, 8, 32 * len(layers)], "reached_backward": True,
            "chunks": [{"module": f"M.layers.{i}", "layer": i, "layers": depth, "stack": "M.layers",
                        "grad_abs_sum": g} for i, g in zip(layers, grads)]}


def weights(block: int, gamma: float, blocks: int = 3, slot0: float = 0.0, scale: float = 0.01) -> list[float]:
    one = [slot0] + [math.exp(-(k - 1) / gamma) for k in range(1, block)]
    return [w * scale * (1 + b) for b in range(blocks) for w in one]  # each block its own normalisation


def observation(**parts: object) -> dict:
    base = {"ended": "observed", "steps": 1, "steps_wanted": 1, "features": [], "logits": None, "frozen": []}
    return {**base, **parts}


def by_id(obs: dict, expectations: Expectations | None = None) -> dict:
    verdicts, _notes = judge(obs, expectations or Expectations())
    return {v.invariant: v for v in verdicts}


def test_reference_layer_rule() -> None:
    assert target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert target_layer_ids(12, 1) == [6]


def test_layers_all_reaching_the_loss_match_and_an_unread_layer_is_a_mismatch() -> None:
    clean = by_id(observation(features=[features([1, 3, 5, 7, 9], [1.0, 2.0, 1.0, 1.0, 0.5])]))
    assert clean["dflash.fc_input_layers"].status == "match"
    assert clean["dflash.target_layer_ids"].status == "match"
    unread = by_id(observation(features=[features([1, 3, 5, 7, 9], [1.0, 2.0, 1.0, 1.0, 0.0])]))
    assert unread["dflash.fc_input_layers"].status == "mismatch"
    assert "[9]" in unread["dflash.fc_input_layers"].observed
    shifted = by_id(observation(features=[features([0, 2, 4, 6, 8], [1.0] * 5)]))
    assert shifted["dflash.target_layer_ids"].status == "mismatch"


def test_features_that_never_reach_the_loss_are_not_exercised() -> None:
    found = by_id(observation(features=[{**features([1, 3], [0.0, 0.0]), "reached_backward": False}]))
    for invariant in ("dflash.fc_input_layers", "dflash.target_layer_ids"):
        assert found[invariant].status == "unknown"
        assert found[invariant].reason.startswith("not exercised by the observed step")


def test_gamma_and_slot_zero_recovered_from_the_weights() -> None:
    logits = {"module": "lm_head", "class": "Linear", "shape": [2, 3, 4, 64], "hard_labels": True}
    four = by_id(observation(logits={**logits, "weights": weights(4, 4.0)}))
    assert four["dflash.loss_decay_gamma"].status == "match"
    assert four["dflash.anchor_slot_untrained"].status == "match"
    seven = by_id(observation(logits={**logits, "weights": weights(4, 7.0, slot0=1.0)}))
    assert seven["dflash.loss_decay_gamma"].status == "mismatch" and "7.000" in seven["dflash.loss_decay_gamma"].observed
    assert seven["dflash.anchor_slot_untrained"].status == "mismatch"
    # block 16 accepts the paper's 7 (the playbook's conditional value)
    sixteen = {**logits, "shape": [2, 32, 64], "weights": weights(16, 7.0, blocks=2)}
    assert by_id(observation(logits=sixteen))["dflash.loss_decay_gamma"].status == "match"


def test_block_size_found_without_a_block_dimension() -> None:
    found = block_pattern(weights(6, 4.0, blocks=4), [2, 12, 64])
    assert found is not None and found[0] == 6


def test_soft_targets_and_missing_logits_claim_nothing() -> None:
    soft = {"module": "lm_head", "class": "Linear", "shape": [2, 8, 64], "hard_labels": False, "weights": None}
    for obs in (observation(logits=soft), observation()):
        found = by_id(obs)
        assert found["dflash.loss_decay_gamma"].status == "unknown"
        assert found["dflash.anchor_slot_untrained"].status == "unknown"


def test_frozen_rows() -> None:
    row = {"role": "embeddings", "param": "T.embed.weight", "requires_grad": False, "in_optimizer": True, "lr": 1e-3,
           "changed_by_step": False}
    head = {**row, "role": "draft head", "param": "T.lm_head.weight", "in_optimizer": False}
    assert by_id(observation(frozen=[row, head]))["dflash.frozen_embed_head"].status == "match"
    trained = by_id(observation(frozen=[{**row, "requires_grad": True, "changed_by_step": True}, head]))
    assert trained["dflash.frozen_embed_head"].status == "mismatch"
    # trainable and in the optimizer but unchanged (warm-up from lr 0): the step cannot vouch for it
    idle = by_id(observation(frozen=[{**row, "requires_grad": True, "lr": 0.0}, head]))["dflash.frozen_embed_head"]
    assert idle.status == "unknown" and "trainable and in the optimizer" in idle.reason
    # the head was not watched: what was not exercised is no match
    alone = by_id(observation(frozen=[row]))["dflash.frozen_embed_head"]
    assert alone.status == "unknown" and "draft logits" in alone.reason


def test_a_malformed_observation_is_unknown_never_a_crash() -> None:
    for broken in (observation(features=[{"reached_backward": True, "chunks": "x"}]),
                   observation(logits={"hard_labels": True, "weights": ["a"], "shape": [1]}),
                   observation(frozen=[{"role": "embeddings", "changed_by_step": "yes"}]),
                   {"features": 3, "frozen": 4, "logits": 5}):
        verdicts, _notes = judge(broken, Expectations())
        assert {v.invariant for v in verdicts} == set(OBSERVED_INVARIANTS + OPTIMIZATION_INVARIANTS)
        assert all(v.status in ("unknown", "match", "mismatch") for v in verdicts)
        assert not any(v.status == "match" for v in verdicts)


def test_the_shortest_period_wins_over_a_row_dimension() -> None:
    # t02's layout: logits (rows, anchors * block, vocab), slot 0 trained: the row (36) is no block
    found = block_pattern(weights(6, 7.0, blocks=18, slot0=1.0), [3, 36, 96])
    assert found is not None and found[0] == 6
    flat = [1.0] * 24
    assert block_pattern(flat, [2, 3, 4, 64])[0] == 4
    assert block_pattern(flat, [24, 64]) is None


def test_the_final_norms_output_counts_as_the_last_layer_read_after_the_norm() -> None:
    chunks = features([1, 3, 5, 7], [1.0] * 4, depth=12)
    chunks["chunks"].append({"module": "M.norm", "after_last_layer": True, "layers": 12, "stack": "M.layers",
                             "grad_abs_sum": 1.0})
    found = by_id(observation(features=[chunks]))["dflash.target_layer_ids"]
    assert found.status == "mismatch" and "[1, 3, 5, 7, 11]" in found.observed and "final norm" in found.observed


def test_the_observation_is_read_like_hostile_input(tmp_path) -> None:  # noqa: ANN001
    from sleuth.observe.runner import _read_observation

    answer = tmp_path / "answer.json"
    answer.write_text('{"ended": "observed", "when": "\\u001b[31mred\\nline", "features": [{"site": "\\u202etxt"}]}')
    data = _read_observation(answer, 4096)
    assert isinstance(data, dict) and "\x1b" not in data["when"] and "\n" not in data["when"]
    assert "\u202e" not in data["features"][0]["site"]
    answer.write_text("[" * 100_000 + "]" * 100_000)
    assert isinstance(_read_observation(answer, 2**20), str)
    answer.write_text("x" * 5000)
    assert "under" in _read_observation(answer, 4096)


def test_the_shift_is_read_from_labels_against_the_targets_top1_at_each_anchor() -> None:
    top1 = [[(7 * p + 3) % 50 for p in range(20)]]
    ids = [[(11 * p + 5) % 47 for p in range(20)]]
    anchors, block = [3, 9, 14], 4

    def logits(shift: int, source: dict | None = None) -> dict:
        source = source or {"through": "T.model.norm", "before": "T.model.layers.11", "before_layer": 11,
                            "before_layers": 12}
        labels, block_ids = [], []
        for a in anchors:
            block_ids += [ids[0][a]] + [49] * (block - 1)
            labels += [-1] + [top1[0][a + j - shift] for j in range(1, block)]
        return {"module": "lm_head", "class": "Linear", "shape": [1, 3, 4, 64], "hard_labels": True,
                "weights": weights(block, 4.0, blocks=3), "labels": labels, "block_ids": block_ids,
                "teachers": [{"module": "T.lm_head", "top1": top1, "ids": ids, "source": source}]}

    assert by_id(observation(logits=logits(1)))["dflash.target_shift"].status == "match"
    wrong = by_id(observation(logits=logits(0)))["dflash.target_shift"]
    assert wrong.status == "mismatch" and "anchor + j" in wrong.observed
    no_teacher = {**logits(1), "teachers": []}
    assert by_id(observation(logits=no_teacher))["dflash.target_shift"].status == "unknown"
    found = by_id(observation(logits=logits(1)))
    assert found["dflash.target_logits_source"].status == "match"
    middle = {"through": "T.model.norm", "before": "T.model.layers.9", "before_layer": 9, "before_layers": 12}
    assert by_id(observation(logits=logits(1, middle)))["dflash.target_logits_source"].status == "mismatch"
    bare = {"through": "T.model.layers.11", "through_layer": 11, "through_layers": 12}
    assert by_id(observation(logits=logits(1, bare)))["dflash.target_logits_source"].status == "mismatch"
    assert by_id(observation(logits=logits(1, {"through": "?"})))["dflash.target_logits_source"].status == "unknown"


def test_a_selection_sliced_before_the_gathering_is_not_a_match() -> None:
    """fc over `ids[:-1]`: every gathered layer reaches the loss, but the run selected one more; the step alone
    cannot tell, so no match unless the selection is seen (configured, or the reference's whole selection)."""
    sliced = observation(features=[features([1, 3], [1.0, 1.0], depth=8)])
    assert by_id(sliced)["dflash.fc_input_layers"].status == "unknown"
    named = {"layer_ids": {"value": [1, 3, 5], "key": "target_layer_ids", "source": "small.yaml (named by the command)"}}
    found = by_id({**sliced, "configured": named})["dflash.fc_input_layers"]
    assert found.status == "mismatch" and "the run selects 3" in found.observed and "small.yaml" in found.observed
    two = {"layer_ids": {"value": [1, 3], "key": "target_layer_ids", "source": "the command's arguments"}}
    assert by_id({**sliced, "configured": two})["dflash.fc_input_layers"].status == "match"


def test_the_run_configuration_reads_a_layer_selection_not_the_drafters_own_layers(tmp_path) -> None:
    from sleuth.observe.optimization_judge import run_configuration

    (tmp_path / "c.json").write_text('{"model": {"layer_types": [1, 2], "target_layer_ids": [1, 4, 7]}, "lr": 3e-4}')
    configured = run_configuration(["python", "train.py", "--config", "c.json"], tmp_path)
    assert configured["layer_ids"]["value"] == [1, 4, 7] and configured["layer_ids"]["key"] == "target_layer_ids"
    assert configured["lr"][0]["value"] == 3e-4
