"""`trainer eval DIR --target TARGET` on drafters this trainer did not train, with the same loop.

The reference is the run's own evaluation: an export of a run, evaluated as a foreign directory on the
same target, must decode exactly what the run decodes (tau, acceptance, outputs at temperature 0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_targets import char_tokenizer, save_tiny_qwen3

TARGET_LAYERS = 8
EVAL_ARGS = ("--prompts", "3", "--max-new-tokens", "24", "--device", "cpu", "--json")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen3 target, two short runs on it, and the first run exported in both layouts."""
    from trainer.config import build_config
    from trainer.export import export_run
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    root = tmp_path_factory.mktemp("foreign")
    save_tiny_qwen3(root / "target", char_tokenizer(), layers=TARGET_LAYERS)
    common = dict(target=str(root / "target"), steps=4, batch_size=2, seq_len=48, draft_layers=2, block_size=4,
                  max_anchors=4, eval_every=None, warmup_steps=0, checkpoint_every=4, lr=3e-3)
    runs = root / "runs"
    train(RunDir(runs / "a"), build_config(extra=common), preset=None, device="cpu", progress=False)
    train(RunDir(runs / "b"), build_config(extra={**common, "seed": 1}), preset=None, device="cpu", progress=False)
    paths = {"target": root / "target", "runs": runs, "a": runs / "a", "b": runs / "b"}
    for layout in ("zlab", "speculators"):
        paths[layout] = export_run(runs / "a", root / f"a-{layout}", layout).path
    return paths


def invoke(*args: str):
    from typer.testing import CliRunner

    from trainer.cli import app

    return CliRunner().invoke(app, ["eval", *args])


def numbers(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_exported_then_evaluated_equals_the_runs_own_eval(setup):
    own = numbers(invoke(str(setup["a"]), *EVAL_ARGS))
    for layout in ("zlab", "speculators"):
        foreign = numbers(invoke(str(setup[layout]), "--target", str(setup["target"]), *EVAL_ARGS))
        assert foreign["layout"] == layout
        assert foreign["tau"] == own["tau"], layout
        assert foreign["acceptance_histogram"] == own["acceptance_histogram"], layout
        assert foreign["per_position_acceptance"] == own["per_position_acceptance"], layout
        assert foreign["lossless"] is True


def test_two_drafters_side_by_side_on_one_target(setup):
    both = numbers(invoke(str(setup["zlab"]), "--against", str(setup["b"]), "--target", str(setup["target"]), *EVAL_ARGS))
    first, second = both["drafters"]
    assert (first["layout"], second["layout"]) == ("zlab", "run")
    own_b = numbers(invoke(str(setup["b"]), *EVAL_ARGS))
    assert second["tau"] == own_b["tau"]
    table = invoke(str(setup["zlab"]), "--against", str(setup["b"]), "--target", str(setup["target"]),
                   "--prompts", "2", "--max-new-tokens", "8", "--device", "cpu")
    assert table.exit_code == 0, table.output
    assert "a-zlab (zlab)" in table.stdout and "slot 3 accepted" in table.stdout


def test_foreign_directory_without_target_is_one_line_and_exit_2(setup):
    result = invoke(str(setup["zlab"]), "--device", "cpu")
    assert result.exit_code == 2
    assert "give --target" in result.output and "Traceback" not in result.output


def test_drafter_that_does_not_fit_the_target_is_refused(setup, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((setup["speculators"] / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = [2, 40]
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "model.safetensors").write_bytes((setup["speculators"] / "model.safetensors").read_bytes())
    result = invoke(str(broken), "--target", str(setup["target"]), "--device", "cpu")
    assert result.exit_code == 2
    assert "outside the target's 8 layers" in result.output


SPECULATORS = Path(__file__).resolve().parents[1] / "fixtures" / "speculators"


def test_a_real_speculators_save_directory_is_measured_on_its_verifier():
    """tests/fixtures/speculators: `speculators train` output; its best checkpoint against its first epoch."""
    save = SPECULATORS / "specout"
    both = numbers(invoke(str(save), "--against", str(save / "0"), "--target", str(SPECULATORS / "verifier"),
                          "--prompts", "2", "--max-new-tokens", "12", "--device", "cpu", "--json"))
    best, first = both["drafters"]
    assert best["layout"] == first["layout"] == "speculators"
    assert best["drafter"] == f"specout/checkpoint_best -> {(save / 'checkpoint_best').resolve().name}"
    config = json.loads((save / "checkpoint_best" / "config.json").read_text())
    assert best["block_size"] == config["block_size"]
    assert best["lossless"] is True and first["lossless"] is True
    assert 1.0 <= best["tau"] <= config["block_size"]


# --- speculators' prepared data as training input ------------------------------------------------------


def test_speculators_prepared_data_trains(tmp_path):
    """tests/fixtures/speculators/data: `speculators prepare-data` output, on the verifier whose tokenizer made it."""
    from trainer.config import build_config
    from trainer.data.datasets import load_documents
    from trainer.data.prepared import load_prepared_rows
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir
    from transformers import AutoTokenizer

    data, verifier = SPECULATORS / "data", SPECULATORS / "verifier"
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    rows = load_prepared_rows(data, len(tokenizer))
    docs = load_documents(str(data), tokenizer, split="train") + load_documents(str(data), tokenizer, split="heldout")
    assert sorted((d.input_ids, d.loss_mask) for d in docs) == sorted(rows)  # used as they are, nothing added
    config = build_config(extra=dict(target=str(verifier), data=str(data), steps=2, batch_size=2, seq_len=64,
                                     draft_layers=1, block_size=4, max_anchors=4, eval_every=None, warmup_steps=0,
                                     eval_prompts=1, eval_max_new_tokens=4))
    train(RunDir(tmp_path / "prep"), config, preset=None, device="cpu", progress=False)
    metrics = [json.loads(line) for line in (tmp_path / "prep" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(row["loss"] > 0 for row in metrics)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("shorter_mask", "differ in length"),
        ("big_id", "outside the target's vocabulary"),
        ("strings", "expected a list of integers"),
    ],
)
def test_prepared_data_we_do_not_understand_is_one_line(tmp_path, change, words):
    """Shards rewritten with pyarrow (the format `datasets` writes), each with one thing wrong."""
    import pyarrow as pa

    from trainer.data.datasets import DataError
    from trainer.data.prepared import load_prepared_rows

    shutil.copytree(SPECULATORS / "data", tmp_path / "data")
    shard = tmp_path / "data" / "data-00000-of-00001.arrow"
    with pa.memory_map(str(shard)) as source:
        table = pa.ipc.open_stream(source).read_all()
    ids, mask = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    if change == "shorter_mask":
        mask[3] = mask[3][:-1]
    elif change == "big_id":
        ids[5][0] = 10**6
    columns = {"input_ids": ids, "loss_mask": mask}
    if change == "strings":
        columns["input_ids"] = [[str(i) for i in row] for row in ids]
    rewritten = pa.table(columns)
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_stream(sink, rewritten.schema) as writer:
        writer.write_table(rewritten)
    with pytest.raises(DataError, match=words) as caught:
        load_prepared_rows(tmp_path / "data", 310)
    assert "\n" not in str(caught.value)


def test_trainer_run_on_prepared_data_it_does_not_understand_is_one_line_and_exit_2(tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    shutil.copytree(SPECULATORS / "data", tmp_path / "data")
    (tmp_path / "data" / "state.json").write_text(json.dumps({"_data_files": "data.arrow"}))
    result = CliRunner().invoke(app, [
        "run", "bad", "--runs-dir", str(tmp_path / "runs"), "--set", f"target={SPECULATORS / 'verifier'}",
        "--set", f"data={tmp_path / 'data'}", "--steps", "1", "--device", "cpu", "--quiet",
    ])
    assert result.exit_code == 2, result.output
    assert "no _data_files list" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
