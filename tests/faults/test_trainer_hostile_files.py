"""Files someone else shaped, around the trainer (campaign 4). One test per class of fault, each over several
cases; the campaign adds cases, the classes stay:

- a value from a file (a shipped config.json) reaches the error line with its ESC, OSC and bidi characters
  escaped;
- no write goes through a link or into a special file the trainer did not create (planted temporary names,
  a link at the final name, a FIFO);
- a key given twice in --config is one line naming the key and the file;
- metrics.jsonl of any size is streamed (bounded memory, blank lines skipped), for `trainer runs` and --resume;
- an interrupted hidden-state generation says the command that continues it;
- unreadable run files are `permission denied: PATH` (as an unprivileged user when the suite runs as root);
- bad numbers, deep JSON, shards of another width, a failed process group: each one line that says what;
- per-shard progress on a pipe is one line per 30 s, as `trainer run`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from trainer_faults import (
    CHECKPOINT,
    REPO,
    assert_one_line_error,
    copy_base_run,
    invoke,
    no_traceback,
    small_target,
    tiny_config,
)

RAW = ("\x1b", "\x07", "\u202e", "\x9b")
HOSTILE_VALUES = {
    "CSI clear screen": "\x1b[2J\x1b[31mred",
    "OSC window title": "\x1b]0;owned by config.json\x07",
    "RTL override": "abc\u202egnp.exe",
}


def no_raw_control(text: str) -> None:
    assert not any(ch in text for ch in RAW), repr(text)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A z-lab export of the base run: a drafter directory as one is shipped to other people."""
    root = tmp_path_factory.mktemp("exported")
    runs = root / "runs"
    copy_base_run(runs)
    result = invoke("export", "r", "--runs-dir", str(runs), "--out", str(root / "drafter"))
    assert result.exit_code == 0, result.output
    return root / "drafter"


# --- a value from a file reaches the terminal escaped -----------------------------------------------------------

@pytest.mark.parametrize("sink", ["foreign drafter config.json", "run config.json"])
@pytest.mark.parametrize("value", list(HOSTILE_VALUES.values()), ids=list(HOSTILE_VALUES))
def test_a_value_from_a_file_reaches_the_error_line_escaped(tmp_path: Path, exported: Path, sink: str,
                                                            value: str) -> None:
    if sink == "run config.json":
        runs = tmp_path / "runs"
        run_dir = copy_base_run(runs)
        config = json.loads((run_dir / "config.json").read_text())
        config["loss"] = value  # not a loss the validator knows: its message quotes the value
        (run_dir / "config.json").write_text(json.dumps(config, ensure_ascii=False))
        result = invoke("eval", "r", "--runs-dir", str(runs), "--prompts", "1", "--max-new-tokens", "2",
                        "--device", "cpu")
    else:
        drafter = tmp_path / "drafter"
        shutil.copytree(exported, drafter)
        config = json.loads((drafter / "config.json").read_text())
        config["dtype"] = value  # transformers looks the name up in torch, and its error quotes it
        (drafter / "config.json").write_text(json.dumps(config, ensure_ascii=False))
        result = invoke("eval", str(drafter), "--target", str(small_target()), "--prompts", "1",
                        "--max-new-tokens", "2", "--device", "cpu")
    line = assert_one_line_error(result.stderr, result.exit_code)
    no_raw_control(result.output)
    assert "\\x1b" in line or "\\u202e" in line, line  # shown, as an escape


# --- no write through a link or into a special file ------------------------------------------------------------

def _victim(tmp_path: Path) -> tuple[Path, bytes, int]:
    victim = tmp_path / "victim" / "notes.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"the user's own file\n")
    victim.chmod(0o600)
    return victim, victim.read_bytes(), stat.S_IMODE(victim.stat().st_mode)


def test_export_force_never_writes_through_a_planted_link(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    copy_base_run(runs)
    out = tmp_path / "export"
    first = invoke("export", "r", "--runs-dir", str(runs), "--out", str(out))
    assert first.exit_code == 0, first.output
    victim, content, mode = _victim(tmp_path)
    for name in (".config.json.partial", ".model.safetensors.partial"):  # the staging names of earlier versions
        (out / name).symlink_to(victim)
    again = invoke("export", "r", "--runs-dir", str(runs), "--out", str(out), "--force")
    assert again.exit_code == 0, again.output
    assert victim.read_bytes() == content and stat.S_IMODE(victim.stat().st_mode) == mode
    assert not (out / "config.json").is_symlink() and json.loads((out / "config.json").read_text())

    # the final name itself a link: refused, the linked file untouched
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(victim)
    refused = invoke("export", "r", "--runs-dir", str(runs), "--out", str(out), "--force")
    assert "symbolic link" in assert_one_line_error(refused.stderr, refused.exit_code, naming="config.json")
    assert victim.read_bytes() == content and stat.S_IMODE(victim.stat().st_mode) == mode


def test_resuming_generation_never_writes_its_manifest_through_a_planted_link(tmp_path: Path) -> None:
    out = tmp_path / "hs"
    made = _generate(tmp_path, out, rows_per_shard=32)
    assert made.exit_code == 0, made.output
    (out / "shard-00001.safetensors").unlink()  # so the same command resumes and rewrites the manifest
    victim, content, mode = _victim(tmp_path)
    # the name an earlier version wrote the manifest through: `.manifest.json.<pid>.tmp` (invoke runs in this pid)
    (out / f".manifest.json.{os.getpid()}.tmp").symlink_to(victim)
    resumed = _generate(tmp_path, out, rows_per_shard=32)
    assert resumed.exit_code == 0, resumed.output
    assert victim.read_bytes() == content and stat.S_IMODE(victim.stat().st_mode) == mode
    assert json.loads((out / "manifest.json").read_text())["complete"]


def test_the_write_helper_refuses_links_and_special_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one helper every trainer write goes through: a link or FIFO at the final name is refused (without
    blocking), and a link planted at the very temporary name it picks is never opened (O_EXCL | O_NOFOLLOW)."""
    from trainer import safe_io

    victim, content, _ = _victim(tmp_path)
    link = tmp_path / "run.json"
    link.symlink_to(victim)
    with pytest.raises(safe_io.UnsafeFileError, match="symbolic link"):
        safe_io.write_json(link, {"status": "running"})
    fifo = tmp_path / "eval.json"
    os.mkfifo(fifo)
    with pytest.raises(safe_io.UnsafeFileError, match="FIFO"):
        safe_io.write_text(fifo, "{}")
    target = tmp_path / "config.json"
    monkeypatch.setattr(safe_io.secrets, "token_hex", lambda n: "0" * 2 * n)
    (tmp_path / f".config.json.{'0' * 16}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        safe_io.write_text(target, "{}")
    assert victim.read_bytes() == content and not target.exists()
    with pytest.raises(safe_io.UnsafeFileError, match="FIFO"):
        safe_io.read_limited(fifo, 1024)  # a reader of a user's path: refused, never a blocked read


# --- a key given twice -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("c.yaml", "lr: 0.001\nseed: 3\nlr: 1000\n", "lr"),
        ("c.json", '{"lr": 0.001, "seed": 3, "lr": 1000}', "lr"),
        ("c.yaml", "draft_config:\n  head_dim: 16\n  head_dim: 32\n", "head_dim"),
        ("c.json", '{"draft_config": {"sliding_window": 8, "sliding_window": 64}}', "sliding_window"),
    ],
)
def test_a_key_given_twice_is_one_line_naming_it_and_the_file(tmp_path: Path, name: str, text: str, key: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    result = invoke("run", "x", "--config", str(path), "--runs-dir", str(tmp_path / "runs"))
    line = assert_one_line_error(result.stderr, result.exit_code, naming=name)
    assert f"'{key}' is given twice" in line, line
    assert not (tmp_path / "runs" / "x").exists()


def test_a_merge_key_may_still_be_overridden(tmp_path: Path) -> None:
    """YAML's `<<: *base` then the key again is an override the user wrote on purpose, not a duplicate."""
    from trainer.config import load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("base: &base {head_dim: 16}\ndraft_config:\n  <<: *base\n  head_dim: 32\n")
    assert load_config_file(path)["draft_config"] == {"head_dim": 32}


# --- metrics.jsonl of any size -----------------------------------------------------------------------------------

BLANK_BYTES = 48 * 2**20


def test_metrics_of_any_size_are_streamed_and_blank_lines_skipped(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    rows = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    with (run_dir / "metrics.jsonl").open("wb") as handle:  # 48 MiB of blank lines between rows 2 and 3
        handle.writelines(rows[:2])
        block = b"\n" * 2**20
        for _ in range(BLANK_BYTES // len(block)):
            handle.write(block)
        handle.write(b"   \n\t\n")
        handle.writelines(rows[2:])
    tracemalloc.start()
    try:
        listed = invoke("runs", "--runs-dir", str(runs), "--json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert listed.exit_code == 0 and listed.stderr == "", listed.output
    (row,) = json.loads(listed.stdout)
    assert row["status"] == "completed" and row["step"] == 4, row
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB: the file was read whole"

    # resume reads the same file through the same reader: the rows are all found, the run goes on
    resumed = invoke("run", "r", "--resume", "--steps", "5", "--runs-dir", str(runs), "--quiet")
    assert resumed.exit_code == 0, resumed.output
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [1, 2, 3, 4, 5], steps


def test_a_metrics_line_longer_than_any_row_is_named(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    with (run_dir / "metrics.jsonl").open("ab") as handle:
        handle.write(b"x" * (3 * 2**20) + b"\n")
    listed = invoke("runs", "--runs-dir", str(runs), "--json")
    line = assert_one_line_error(listed.stderr, 0, naming="metrics.jsonl", code=0)
    assert "longer than" in line and "out of memory" not in line, line


# --- an interrupted generation says how to continue it -----------------------------------------------------------

def test_an_interrupted_generation_says_the_command_that_continues_it(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT to this process as the second shard is written (Ctrl-C in a terminal)."""
    import trainer.hidden_states.generate as generate

    real_write, calls = generate.write_safetensors, {"n": 0}

    def write_then_interrupt(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - write_safetensors' signature
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(generate, "write_safetensors", write_then_interrupt)
    out = tmp_path / "hs"
    stopped = _generate(tmp_path, out, rows_per_shard=32)
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("error: ")]
    assert stopped.exit_code == 130 and len(lines) == 1, stopped.stderr
    assert "`trainer hidden-states generate`" in lines[0] and "trainer run NAME" not in lines[0], lines[0]
    monkeypatch.undo()
    again = _generate(tmp_path, out, rows_per_shard=32)
    assert again.exit_code == 0, again.output
    assert json.loads((out / "manifest.json").read_text())["complete"]


# --- unreadable run files ----------------------------------------------------------------------------------------

UNREADABLE = {
    "run directory": ("", "export"),
    "checkpoint directory": (CHECKPOINT, "export"),
    "checkpoint file": (f"{CHECKPOINT}/drafter.safetensors", "export"),
    "run listed": ("", "runs"),
}


@pytest.mark.parametrize("what", list(UNREADABLE))
def test_an_unreadable_run_file_is_permission_denied(tmp_path: Path, what: str) -> None:
    """chmod 000 on the entry, then the command as a real process. Root reads through any mode, so as root
    the process runs without the two capabilities that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): a
    real EACCES, as any other user meets it."""
    relative, command = UNREADABLE[what]
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    entry = run_dir / relative if relative else run_dir
    entry.chmod(0)
    try:
        args = (["export", "r", "--runs-dir", str(runs), "--out", str(tmp_path / "out")] if command == "export"
                else ["runs", "--runs-dir", str(runs), "--json"])
        result = _without_permission_override(*args)
    finally:
        entry.chmod(0o755 if entry.is_dir() else 0o644)
    no_traceback(result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: permission denied: "), result.stderr
    assert errors[0].removeprefix("error: permission denied: ") in (str(entry), str(entry.parent)), errors[0]
    assert result.returncode == (0 if command == "runs" else 2), result.stderr
    if command == "runs":
        assert json.loads(result.stdout)[0]["status"] == "damaged"


def _without_permission_override(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "400", "TRAINER_DEBUG": ""}
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root every file is readable, and setpriv (to drop CAP_DAC_OVERRIDE) is not installed")
        drop = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"]
    return subprocess.run([*prefix, sys.executable, "-m", "trainer.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)


# --- bad values: one line that says what ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("c.yaml", "draft_vocab_size: 1000000000000000000000000000000\n", "draft_vocab_size"),
        ("c.yaml", "lr: " + "9" * 400 + "\n", "lr: a number of about 400 digits overflows a float"),
        ("c.json", '{"lr": 1.0e+400}', "lr: Input should be a finite number"),
        ("c.yaml", "draft_config:\n  rope_parameters: {rope_type: default, rope_theta: " + "7" * 320 + "}\n",
         "draft_config.rope_parameters.rope_theta"),
        ("c.yaml", "draft_config:\n  rope_parameters: {rope_type: default, rope_theta: .inf}\n", "rope_theta"),
        ("c.json", '{"seed": ' + "1" * 5000 + "}", "does not parse"),
    ],
)
def test_a_value_out_of_range_is_the_validators_one_line(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    result = invoke("run", "x", "--config", str(path), "--set", f"target={tiny_config()['target']}",
                    "--set", "seq_len=64", "--set", "steps=1", "--runs-dir", str(tmp_path / "runs"), "--quiet")
    assert message in assert_one_line_error(result.stderr, result.exit_code), result.stderr


DEEP = 100_000


@pytest.mark.parametrize("depth", [DEEP, 200], ids=["past the parser", "past the bound"])
@pytest.mark.parametrize("where", ["foreign drafter config.json", "run config.json", "--config", "manifest.json"])
def test_deeply_nested_json_is_one_line_naming_the_file(tmp_path: Path, exported: Path, where: str,
                                                       depth: int) -> None:
    deep = "[" * depth + "]" * depth
    if where == "foreign drafter config.json":
        drafter = tmp_path / "drafter"
        shutil.copytree(exported, drafter)
        text = (drafter / "config.json").read_text()
        (drafter / "config.json").write_text(text.replace("{", '{"nested": ' + deep + ", ", 1))
        result = invoke("eval", str(drafter), "--target", str(small_target()), "--device", "cpu")
        named = "config.json"
    elif where == "run config.json":
        runs = tmp_path / "runs"
        run_dir = copy_base_run(runs)
        text = (run_dir / "config.json").read_text()
        (run_dir / "config.json").write_text(text.replace("{", '{"nested": ' + deep + ", ", 1))
        result = invoke("export", "r", "--runs-dir", str(runs), "--out", str(tmp_path / "out"))
        named = "config.json"
    elif where == "--config":
        (tmp_path / "c.json").write_text('{"target_layer_ids": ' + deep + "}")
        result = invoke("run", "x", "--config", str(tmp_path / "c.json"), "--runs-dir", str(tmp_path / "runs"))
        named = "c.json"
    else:
        out = tmp_path / "hs"
        out.mkdir()
        (out / "manifest.json").write_text('{"format_version": 1, "nested": ' + deep + "}")
        (tmp_path / "c.json").write_text(json.dumps(tiny_config(hidden_states=str(out))))
        result = invoke("run", "x", "--config", str(tmp_path / "c.json"), "--runs-dir", str(tmp_path / "runs"),
                        "--quiet")
        named = "manifest.json"
    line = assert_one_line_error(result.stderr, result.exit_code, naming=named)
    assert "deep" in line, line


def test_a_shard_of_another_width_is_named_with_its_width(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path / "hs"
    made = _generate(tmp_path, out, rows_per_shard=32)
    assert made.exit_code == 0, made.output
    shard = out / "shard-00001.safetensors"
    with safe_open(str(shard), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        metadata = handle.metadata()
    width = next(t.shape[-1] for name, t in tensors.items() if name.startswith("layer."))
    wider = {name: (torch.zeros(*t.shape[:-1], width + 16, dtype=t.dtype) if name.startswith("layer.") else t)
             for name, t in tensors.items()}
    save_file(wider, str(shard), metadata=metadata)  # a shard of another target's cache, copied in
    config = tmp_path / "run.json"
    config.write_text(json.dumps(tiny_config(data=str(tmp_path / "docs.txt"), hidden_states=str(out))))
    training = invoke("run", "h", "--config", str(config), "--runs-dir", str(tmp_path / "runs"), "--quiet")
    line = assert_one_line_error(training.stderr, training.exit_code, naming="shard-00001.safetensors")
    assert f"width {width + 16}" in line and f"hidden size {width}" in line, line


@pytest.mark.slow
def test_a_failed_process_group_is_one_line(tmp_path: Path) -> None:
    """A real two-process gloo job whose other process joins and then dies: rank 0's first collective fails."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "400", "TRAINER_DEBUG": "",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    peer = subprocess.Popen(
        [sys.executable, "-c", "import os, datetime, torch.distributed as d\n"
         "d.init_process_group('gloo', timeout=datetime.timedelta(seconds=120))\nos._exit(1)"],
        env={**env, "RANK": "1", "LOCAL_RANK": "1"})
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config()))
    try:
        rank0 = subprocess.run([sys.executable, "-m", "trainer.cli", "run", "g", "--config", str(config),
                                "--runs-dir", str(tmp_path / "runs"), "--quiet", "--device", "cpu"],
                               cwd=REPO, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True,
                               text=True, timeout=300)
    finally:
        peer.kill()
        peer.wait()
    line = assert_one_line_error(rank0.stderr, rank0.returncode)
    assert "the distributed job failed at rank 0" in line and "pair.cc" not in line, line


# --- progress on a pipe ------------------------------------------------------------------------------------------

def test_generation_progress_on_a_pipe_is_one_line_per_30_seconds(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """CliRunner's stderr is no terminal: shards written within the interval show one line (the last), as
    `trainer run` shows its steps on a pipe (the interval is `trainer run`'s setting, raised here so that a
    slow machine cannot make two lines legitimately)."""
    monkeypatch.setenv("TRAINER_PROGRESS_EVERY_S", "3600")
    out = tmp_path / "hs"
    made = _generate(tmp_path, out, rows_per_shard=32)
    assert made.exit_code == 0, made.output
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    progress = [line for line in made.stderr.splitlines() if line.startswith("shard ")]
    assert shards >= 4 and len(progress) == 1 and progress[0].startswith(f"shard {shards}/{shards} "), made.stderr


# --- helpers -----------------------------------------------------------------------------------------------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _generate(tmp_path: Path, out: Path, rows_per_shard: int):  # noqa: ANN202 - typer's Result
    data = tmp_path / "docs.txt"
    if not data.exists():
        data.write_text("\n\n".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(60)) for i in range(40)) + "\n")
    config = tmp_path / "hs.json"
    config.write_text(json.dumps(tiny_config(data=str(data))))
    return invoke("hidden-states", "generate", "--out", str(out), "--config", str(config), "--rows-per-shard",
                  str(rows_per_shard), "--device", "cpu")

