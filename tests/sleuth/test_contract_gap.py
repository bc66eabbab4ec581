"""dflash.train_serve_gap: teacher-forced acceptance vs real tau on the same eval sequences."""

from __future__ import annotations

from contract_fixtures import save_target, write_run

from sleuth.checks import ContractContext
from sleuth.checks.train_serve_gap import SIGN_TEST_P, check_train_serve_gap, paired_standard_error, sign_test_p
from sleuth.findings import Evidence, Finding
from sleuth.runs import read_run


def eval_report(tau: list[float], teacher_forced: list[float], step: int = 40) -> dict:
    return {"step": step, "tau": sum(tau) / len(tau), "tau_per_prompt": tau,
            "teacher_forced": {"acceptance": sum(teacher_forced) / len(teacher_forced),
                               "acceptance_per_prompt": teacher_forced}}


def finding(invariant: str, status: str) -> Finding:
    return Finding(id=invariant, title=invariant, status=status, severity="critical", confidence=0.9,
                   evidence=[Evidence(kind="config", location="config.json: target_logits_source", value="5")])


def gap(run_dir, findings=()) -> Finding:
    return check_train_serve_gap(ContractContext(run=read_run(run_dir), findings=list(findings)))


V5_TAU = [1.2, 1.3, 1.25, 1.1, 1.4, 1.2, 1.3, 1.25]
V5_TF = [1.85, 1.8, 1.9, 1.75, 1.85, 1.8, 1.9, 1.8]


def test_a_gap_beyond_noise_is_a_mismatch_explained_by_a_broken_finding(tmp_path):
    run = write_run(tmp_path / "v5", eval_report=eval_report(V5_TAU, V5_TF))
    result = gap(run, [finding("dflash.target_logits_source", "mismatch"), finding("dflash.fc_input_layers", "mismatch"),
                       finding("dflash.context_excludes_anchor", "match")])
    assert result.status == "mismatch"
    assert "explained by the broken invariant(s) this diagnosis found: dflash.target_logits_source" in result.reason
    assert "fc_input_layers" not in result.reason  # fewer fc inputs hurt training and serving alike
    assert result.notes[0] == "explanation found: dflash.target_logits_source"


def test_an_unexplained_gap_says_so_and_points_at_the_probes(tmp_path):
    run = write_run(tmp_path / "v5", eval_report=eval_report(V5_TAU, V5_TF))
    result = gap(run, [finding("dflash.target_logits_source", "match")])
    assert result.status == "mismatch"
    assert "no finding of this diagnosis explains it" in result.reason and "sleuth diagnose --probe" in result.reason
    assert result.notes[0] == "explanation found: none"


def test_real_tau_within_noise_matches(tmp_path):
    tau = [1.7, 1.9, 1.75, 1.8, 1.65, 1.85, 1.8, 1.75]
    teacher_forced = [1.8, 1.8, 1.8, 1.75, 1.8, 1.85, 1.8, 1.8]
    assert gap(write_run(tmp_path / "v3", eval_report=eval_report(tau, teacher_forced))).status == "match"


def test_the_latest_of_metrics_rows_and_eval_json_is_used(tmp_path):
    rows = [{"step": 25, "tau": 1.2, "tf_acceptance": 1.9, "tau_per_prompt": V5_TAU, "tf_acceptance_per_prompt": V5_TF},
            {"step": 30, "loss": 1.0}]
    run = write_run(tmp_path / "v5", metrics=rows)
    result = gap(run)
    assert result.status == "mismatch" and "at step 25" in result.observed
    # a later eval.json that closed the gap wins
    run = write_run(tmp_path / "v6", metrics=rows, eval_report=eval_report(V5_TF, V5_TF, step=40))
    assert gap(run).status == "match"


def test_without_teacher_forced_numbers_the_gap_is_unknown(tmp_path):
    run = write_run(tmp_path / "old", metrics=[{"step": 25, "tau": 1.3, "eal": 0.8}], eval_report={"step": 40, "tau": 1.3})
    result = gap(run)
    assert result.status == "unknown"
    assert "no teacher-forced acceptance" in result.reason and "eal + 1 at step 25 is 1.80" in result.reason


def test_paired_standard_error_skips_prompts_without_a_value():
    se, n = paired_standard_error([2.0, 2.0, None, 3.0], [1.0, 1.5, 1.0, None])
    assert n == 2 and abs(se - 0.25) < 1e-12


def test_the_block_by_block_comparison_wins_and_has_no_systematic_slack(tmp_path):
    # Expected acceptance from per-slot accuracy overshoots on one repetitive prompt, but at the anchors
    # serving used the training objective's prefix equals the real acceptance: a match.
    report = eval_report([3.9, 1.3, 1.3, 1.1], [5.1, 1.3, 1.3, 1.1])
    report["teacher_forced"].update(at_verify=1.9, tau_at_verify=1.9, at_verify_per_prompt=[3.9, 1.3, 1.3, 1.1],
                                    tau_at_verify_per_prompt=[3.9, 1.3, 1.3, 1.1])
    result = gap(write_run(tmp_path / "v3", eval_report=report))
    assert result.status == "match" and "block by block" in result.observed
    # the same prompts with a consistent small shortfall at every prompt: beyond the 0.02 floor and 3 se
    report["teacher_forced"].update(at_verify=1.98, at_verify_per_prompt=[3.98, 1.38, 1.39, 1.17])
    result = gap(write_run(tmp_path / "v5", eval_report=report), [finding("dflash.target_logits_source", "mismatch")])
    assert result.status == "mismatch" and result.notes[0] == "explanation found: dflash.target_logits_source"


def block_by_block(at: list[float], real: list[float], above: int, below: int, labels: float | None = 1.0,
                   label_slots: int = 400, temperature: float = 0.0) -> dict:
    """eval.json as `trainer eval` writes it: the block-by-block comparison with its step counts and labels."""
    report = eval_report(real, at)
    report["temperature"] = temperature
    report["teacher_forced"].update(
        at_verify=sum(at) / len(at), tau_at_verify=sum(real) / len(real), at_verify_per_prompt=at,
        tau_at_verify_per_prompt=real, verify_steps_above=above, verify_steps_below=below,
        label_agreement=labels, label_slots=label_slots)
    return report


# v5 at 40 steps on the embedded target, as measured (eval.json, 8 prompts): one repetitive prompt carries
# most of the gap, so the spread over prompts is wide, but every differing verify step lies on one side.
V5_AT = [1.2083, 1.425, 1.4074, 1.1176, 1.4048, 8.0, 1.5526, 1.3571]
V5_REAL = [1.1875, 1.425, 1.2593, 1.1176, 1.381, 1.0, 1.5, 1.3571]


def test_one_sided_differing_steps_are_a_gap_even_when_the_prompt_spread_is_wide(tmp_path):
    report = block_by_block(V5_AT, V5_REAL, above=63, below=0)
    result = gap(write_run(tmp_path / "v5", eval_report=report), [finding("dflash.target_logits_source", "mismatch")])
    assert result.status == "mismatch"
    assert "longer at 63 and shorter at 0 of the verify steps" in result.observed
    assert "one-sided at the verify steps: sign test p" in result.reason
    # the same per-prompt numbers with steps differing both ways, as argmax ties do: no evidence of a gap
    report = block_by_block(V5_AT, V5_REAL, above=33, below=30)
    assert gap(write_run(tmp_path / "ties", eval_report=report)).status == "match"


def test_sign_test_p():
    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(3, 0) == 1 / 8
    assert abs(sign_test_p(1, 1) - 0.75) < 1e-12
    assert sign_test_p(12, 0) < SIGN_TEST_P < sign_test_p(9, 0)


def test_labels_other_than_the_served_tokens_are_a_gap_in_the_making(tmp_path):
    # A drafter that has learned little yet: the acceptance gap is within noise, but 17% of the slots are
    # scored against other tokens than serving verifies. The labels side explains it, not the input side.
    at, real = [1.625, 1.3889, 1.0, 1.1364], [1.5625, 1.3889, 1.0, 1.1364]
    report = block_by_block(at, real, above=1, below=0, labels=0.825, label_slots=784)
    result = gap(write_run(tmp_path / "v5", eval_report=report),
                 [finding("dflash.target_logits_source", "mismatch"), finding("dflash.context_excludes_anchor", "mismatch")])
    assert result.status == "mismatch"
    assert "equal the served tokens at 82.5% of 784 labelled slots" in result.reason
    assert result.notes[0] == "explanation found: dflash.target_logits_source"
    assert "also broken, on the other side of the measurement: dflash.context_excludes_anchor" in result.reason
    # the same labels at temperature 1 (sampled tokens are not the target's argmax): not a label measurement
    report = block_by_block(at, real, above=1, below=0, labels=0.825, label_slots=784, temperature=1.0)
    assert gap(write_run(tmp_path / "sampled", eval_report=report)).status == "match"
    # too few slots to speak of a 1% rate
    report = block_by_block(at, real, above=1, below=0, labels=0.9, label_slots=20)
    assert gap(write_run(tmp_path / "few", eval_report=report)).status == "match"


def test_serving_labels_and_no_gap_match_and_point_at_the_input_side(tmp_path):
    report = block_by_block([2.1667, 1.5625, 1.3158, 1.087], [2.1667, 1.5625, 1.3158, 1.087], above=0, below=0)
    result = gap(write_run(tmp_path / "v3", eval_report=report))
    assert result.status == "match"
    assert any("labels equal the served tokens at 100.0%" in n and "dflash.context_excludes_anchor" in n
               for n in result.notes)


# --- the serving side first ------------------------------------------------------------------------------


def save_target_config(path, family: str):
    """A tiny target's config.json as save_pretrained writes it (sleuth reads the config, never the weights)."""
    from types import SimpleNamespace

    from tests.trainer.tiny_targets import FAMILIES

    FAMILIES[family](64, SimpleNamespace(eos_token_id=0, pad_token_id=1, bos_token_id=2)).save_pretrained(path)
    return path


# A tiny kimi_linear run at 40 steps as the trainer of main 22f97b5 wrote it (measured: eval.json, 4 prompts of
# 32 tokens, block 8): the eval cropped the cache after rejected blocks, so its decoding drifted from greedy on
# every prompt and the teacher-forced labels (the target's argmax on those tokens) agree with them at 45.5%.
KIMI_ON_MAIN = dict(at=[1.0] * 4, real=[1.0] * 4, above=0, below=0, labels=0.4547, label_slots=651)


def test_a_decoder_off_on_a_recurrent_target_is_the_explanation_not_the_labels(tmp_path):
    target = save_target_config(tmp_path / "kimi", "kimi_linear")
    report = block_by_block(**KIMI_ON_MAIN)
    report.update(lossless=False, lossless_mismatch_prompts=[0, 1, 2, 3])
    result = gap(write_run(tmp_path / "main", target=target, eval_report=report),
                 [finding("dflash.target_logits_source", "match")])
    assert result.status == "mismatch"
    assert result.notes[0] == "explanation found: the serving side (the eval's decoding is not the target's)"
    assert "4 of 4 prompts differ" in result.reason
    assert "kimi_linear (linear_attention layers) keeps a recurrent state" in result.reason
    assert "no target_rollback" in result.reason and "does not implicate the labels" in result.reason
    assert "gap lies in what a slot is scored against" not in " ".join(result.notes)  # the labels are not blamed
    assert result.fix is not None and "state_replay" in result.fix.code_hint
    assert any(e.location.endswith("eval.json: lossless") for e in result.evidence)
    # the same run evaluated with the state rollback, as the trainer now writes it (measured: lossless, the
    # labels the served tokens at 784 of 784 slots): nothing on either side
    report = block_by_block([1.0204] * 4, [1.0204] * 4, above=0, below=0, labels=1.0, label_slots=784)
    report.update(lossless=True, lossless_mismatch_prompts=[], target_rollback="state_replay", state_replays=122)
    assert gap(write_run(tmp_path / "fixed", target=target, eval_report=report)).status == "match"
    # and with the cache's own recorded states (transformers >= 5.25): exact too, no replay
    report.update(target_rollback="state_history", state_replays=0)
    assert gap(write_run(tmp_path / "recorded", target=target, eval_report=report)).status == "match"


def test_a_recurrent_target_without_a_recorded_rollback_is_named_first_when_losslessness_is_unchecked(tmp_path):
    target = save_target_config(tmp_path / "qwen3_5", "qwen3_5")
    report = block_by_block(**KIMI_ON_MAIN)  # no lossless, no target_rollback: another decoder's eval
    result = gap(write_run(tmp_path / "other", target=target, eval_report=report))
    assert result.status == "mismatch"  # the labels' measurement stands, but the served side comes first
    assert result.reason.endswith("served side is unverified")
    assert "check the serving side first: the target qwen3_5_text (linear_attention layers)" in result.reason
    # an attention-only target decoded the same way: a crop is exact there, nothing to check first
    result = gap(write_run(tmp_path / "attention", target=save_target(tmp_path / "qwen3"), eval_report=report))
    assert result.status == "mismatch" and "serving side" not in result.reason


def test_argmax_ties_are_not_a_decoder_that_is_off(tmp_path):
    # bf16: a tie flips a token in one prompt, greedy decoding resumes right after; the labels still are the
    # served tokens at >= 99% of the slots, so the tie-only comparison stands.
    report = block_by_block([2.1667, 1.5625, 1.3158, 1.087], [2.1667, 1.5625, 1.3158, 1.087], above=0, below=0,
                            labels=0.996, label_slots=800)
    report.update(lossless=False, lossless_mismatch_prompts=[2])
    result = gap(write_run(tmp_path / "bf16", target=save_target(tmp_path / "qwen3"), eval_report=report))
    assert result.status == "match"
    assert any("argmax ties, not a decoder that is off" in note for note in result.notes)


def test_a_lossless_false_eval_without_a_gap_cannot_be_judged(tmp_path):
    tau = [1.7, 1.9, 1.75, 1.8, 1.65, 1.85, 1.8, 1.75]
    report = eval_report(tau, tau)  # no label agreement recorded
    report.update(lossless=False, lossless_mismatch_prompts=[0, 3])
    result = gap(write_run(tmp_path / "v3", eval_report=report))
    assert result.status == "unknown"
    assert result.reason.startswith("the served side is off before training can be judged") and "2 of 8" in result.reason
    assert "state_replay" not in result.reason and "leaves greedy decoding" in result.fix.code_hint  # no recurrence
