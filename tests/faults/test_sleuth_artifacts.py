"""Foreign artifacts, damaged or hostile: one reader discipline, one line, the documented exit code.

A run directory can come from anywhere. From the speculators and SpecForge fixtures (made by those trainers'
own code) and a run of ours, cases are generated: every file sleuth reads there (a checkpoint's config.json,
val_metrics.json, training_state.json / .pt, run.yaml, train_command.txt, best_meta.json, the draft config,
the verifier's config, tensorboard event files, our run files) is replaced by JSON nested 100,000 deep, a
400- or 5000-digit number, a list or a string where an object belongs, a FIFO (no writer: a read blocks
forever), a link to a file outside the run; plus names that are not UTF-8, a report directory whose files
are links to a victim file, a code/ that is a link to a large tree, a tensorboard log dir at `/`, a damaged
sibling run, an expanded-view SpecForge weight, a reference checkout whose extractor reading is a guess.

Every case runs through the real CLI in one child process (tests/faults/sleuth_batch.py) under a deadline,
so a case that hangs fails instead of hanging the suite. Each must end calmly (no traceback, no "internal
error", exit 0/1/2 with exit 2 exactly one line), name what it could not read, never call a damaged run
clean when the damage hides what it trained with (exit 1), and change nothing outside the report directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sleuth_helpers import Upstream, write_run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPECULATORS = ROOT / "tests" / "fixtures" / "speculators"
SPECFORGE = ROOT / "tests" / "fixtures" / "specforge"
BATCH_DEADLINE_S = 240  # all cases together; each takes about half a second
CASE_DEADLINE_S = 30

NESTED = "[" * 100_000 + "]" * 100_000
DIGITS_400 = "1" + "0" * 400
DIGITS_5000 = "1" + "0" * 5000


def env(tmp_path: Path) -> dict[str, str]:
    environment = dict(os.environ)
    environment.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "SLEUTH_CACHE_DIR": str(tmp_path / "cache"),
        "SLEUTH_CONFIG_FILE": str(tmp_path / "no-config.yaml"), "HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1", "COLUMNS": "300", "PYTHONDONTWRITEBYTECODE": "1",
    })
    for name in ("SLEUTH_DEBUG", "SLEUTH_SPECULATORS_PATH", "GITHUB_TOKEN"):
        environment.pop(name, None)
    return environment


# --- damage ------------------------------------------------------------------------------------------------

def replace_with(text: str) -> Callable[[Path, Path], None]:
    def damage(path: Path, outside: Path) -> None:
        path.unlink()
        path.write_text(text)
    return damage


def fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def link_outside(path: Path, outside: Path) -> None:
    """The file becomes a link to a file of the user's outside the run (a key, a token file)."""
    secret = outside / "id_rsa"
    secret.write_text('{"secret": "BEGIN PRIVATE KEY"}\n')
    path.unlink()
    path.symlink_to(secret)


def edit_json(**changes: Any) -> Callable[[Path, Path], None]:
    def damage(path: Path, outside: Path) -> None:
        data = json.loads(path.read_text())
        for dotted, value in changes.items():
            node = data
            *parents, last = dotted.split(".")
            for part in parents:
                node = node[part]
            node[last] = value
        path.write_text(json.dumps(data))
    return damage


JSON_DAMAGES: dict[str, Callable[[Path, Path], None]] = {
    "nested 100000 deep": replace_with(NESTED),
    "a 400-digit number": replace_with('{"block_size": ' + DIGITS_400 + "}"),
    "a 5000-digit number": replace_with('{"block_size": ' + DIGITS_5000 + "}"),
    "a list": replace_with("[1, 2, 3]"),
    "a FIFO": fifo,
    "a link outside": link_outside,
}


# --- the cases ---------------------------------------------------------------------------------------------

class Case:
    """One damaged copy and what its diagnosis must show (beyond calm: see `check`)."""

    def __init__(self, name: str, run: Path, *, out: Path | None, exit_codes: tuple[int, ...] = (0, 1, 2),
                 names: str | None = None, args: tuple[str, ...] = (), **expect: Any) -> None:
        self.name, self.run, self.out, self.exit_codes, self.names, self.expect = name, run, out, exit_codes, names, expect
        self.args = ["diagnose", "--run", str(run).rstrip("/"), "--offline", "--no-probe", "--format", "json", *args]
        if out is not None:
            self.args += ["--out", str(out)]
        self.report = (out or run / "diagnosis") / "report.json"
        self.plant: list[str] | None = None


def speculators_copy(root: Path) -> Path:
    shutil.copytree(SPECULATORS, root, symlinks=True, ignore=shutil.ignore_patterns("data"))
    return root / "specout"


def specforge_copy(root: Path) -> Path:
    shutil.copytree(SPECFORGE, root, symlinks=True, ignore=shutil.ignore_patterns("export-hf", "sf-tiny-gamma7*"))
    return root / "outputs" / "sf-tiny"


def reference_checkout(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout of the speculators reference (gitpython) whose core.py applies the head to a parameter named
    like the last hidden state, with no call site: the extractor reads `final?`, a guess, not the rule."""
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "test@example.test")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    upstream = Upstream(root)
    files = {path: f'"""Stand-in for {path}."""\n'.encode() for path in (
        "src/speculators/models/dflash/__init__.py", "src/speculators/models/dflash/attention.py",
        "src/speculators/models/dflash/config.py", "src/speculators/models/dflash/metrics.py",
        "src/speculators/models/dflash/model_definitions.py", "src/speculators/models/dflash/utils.py",
        "src/speculators/losses/__init__.py", "src/speculators/losses/utils.py", "docs/user_guide/algorithms/dflash.md")}
    files["src/speculators/models/dflash/core.py"] = (
        b"import torch\nfrom torch import nn\n\n\nclass DFlashDraftModel(nn.Module):\n"
        b"    def compute_targets(self, verifier_last_hidden_states, loss_mask):\n"
        b"        target_logits = self.verifier_lm_head(verifier_last_hidden_states)\n"
        b"        return torch.argmax(target_logits, dim=-1)\n")
    upstream.commit(files)
    return Path(upstream.clone(root / "checkout").working_tree_dir)


def build_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Case]:
    cases: list[Case] = []
    shared_out = tmp_path / "out"  # one --out: the chart is redrawn only when the metrics differ
    outside = tmp_path / "outside"
    outside.mkdir()

    def speculators_case(name: str, relative: str, damage: Callable[[Path, Path], None], **kw: Any) -> None:
        save = speculators_copy(tmp_path / "c" / str(len(cases)))
        damage(save.parent / relative, outside)
        cases.append(Case(f"speculators {relative}: {name}", save, out=shared_out, **kw))

    # The checked checkpoint's config.json: unreadable means the settings it trained with are unknown.
    for damage, apply in JSON_DAMAGES.items():
        named = "is a link leading outside" if damage == "a link outside" else "config.json"
        speculators_case(damage, "specout/3/config.json", apply, exit_codes=(1,), names=named)
    for where, value in (("speculators_config", ["x"]), ("speculators_config", "dflash"),
                         ("speculators_config.verifier", "verifier"), ("speculators_config.proposal_methods", [1, "x"])):
        speculators_case(f"{where} = {json.dumps(value)}", "specout/3/config.json", edit_json(**{where: value}),
                         exit_codes=(1,), names=where.split(".")[-1])
    for damage in ("nested 100000 deep", "a 5000-digit number", "a FIFO"):
        speculators_case(damage, "specout/3/val_metrics.json", JSON_DAMAGES[damage], names="val_metrics.json")
        speculators_case(damage, "specout/2/training_state.json", JSON_DAMAGES[damage], names="training_state.json")
        speculators_case(damage, "verifier/config.json", JSON_DAMAGES[damage], names="config.json")
    speculators_case("a string", "specout/2/training_state.json", replace_with('"x"'), names="training_state.json")
    # The settings record: an alias bomb as the only one, or none at all, is not a clean bill.
    bomb = "\n".join(['a: &a ["l","l","l","l","l","l","l","l","l"]']
                     + [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi")]) + "\n"

    def only_bomb(path: Path, _: Path) -> None:
        (path.parent / "train_command.txt").unlink()
        path.write_text(bomb)

    def no_settings(path: Path, _: Path) -> None:
        (path.parent / "train_command.txt").unlink()
        path.unlink()

    speculators_case("an alias bomb, the only settings record", "specout/run.yaml", only_bomb, exit_codes=(1,),
                     names="run.yaml")
    speculators_case("no settings record at all", "specout/run.yaml", no_settings, exit_codes=(1,),
                     names="training settings are unknown")
    speculators_case("a FIFO", "specout/train_command.txt", fifo, names="train_command.txt")
    speculators_case("a FIFO as an event file", "logs/specout/events.out.tfevents.1796046911.vm.17002.1", fifo)

    def bad_name(path: Path, _: Path) -> None:
        os.mkdir(os.path.join(os.fsencode(path), b"\xff\xfe-not-utf8"))
        (Path(os.fsdecode(os.path.join(os.fsencode(path.parent / "logs" / "specout"),
                                       b"events.out.tfevents.\xff")))).write_bytes(b"torn")

    speculators_case("names that are not UTF-8", "specout", bad_name)

    # A tensorboard log dir at `/`, in a run with three mismatched settings: the curves of every run on the
    # machine must not stand in for this run's, and the mismatches still count.
    def logdir_root(path: Path, _: Path) -> None:
        for record, old, new in (("run.yaml", "log_dir: logs", "log_dir: /"), ("run.yaml", "run_name: specout", "run_name: ."),
                                 ("train_command.txt", "--log-dir logs", "--log-dir /"),
                                 ("train_command.txt", "--run-name specout", "--run-name .")):
            file = path / record
            file.write_text(file.read_text().replace(old, new))
        edit_json(aux_hidden_state_layer_ids=[1, 4, 9], sample_from_anchor=True, mask_token_id=None)(path / "3" / "config.json", _)

    speculators_case("log dir at /", "specout", logdir_root, exit_codes=(1,), names="log dir / contains",
                     mismatches={"dflash.target_layer_ids", "dflash.anchor_slot_untrained", "speculators.mask_token_id"})
    # A damaged sibling run beside the one diagnosed: skipped with a note, never fatal.
    sibling_root = tmp_path / "c" / "sibling"
    save = speculators_copy(sibling_root)
    shutil.copytree(save, save.parent / "specout-damaged", symlinks=True)
    (save.parent / "specout-damaged" / "3" / "config.json").write_text(NESTED)
    cases.append(Case("a damaged sibling run", save, out=shared_out, exit_codes=(0, 1), sibling="specout-damaged"))

    # SpecForge: best_meta.json, the draft config the checkpoint names, the checkpoint itself, event files.
    def specforge_case(name: str, relative: str, damage: Callable[[Path, Path], None], *, diagnose: str = "",
                       **kw: Any) -> None:
        out_dir = specforge_copy(tmp_path / "f" / str(len(cases)))
        damage(out_dir.parent.parent / relative, outside)
        cases.append(Case(f"specforge {relative}: {name}", out_dir / diagnose, out=shared_out, **kw))

    for damage in ("nested 100000 deep", "a 5000-digit number", "a list", "a FIFO"):
        specforge_case(damage, "outputs/sf-tiny/sf-tiny.best_meta.json", JSON_DAMAGES[damage], names="best_meta.json")
        specforge_case(damage, "draft-dflash.json", JSON_DAMAGES[damage], exit_codes=(1,), names="draft-dflash.json")
    specforge_case("dflash_config a string", "draft-dflash.json", edit_json(dflash_config="x"), exit_codes=(1,),
                   names="dflash_config")
    specforge_case("a FIFO", "outputs/sf-tiny/runs/" + next(p.name for p in (SPECFORGE / "outputs/sf-tiny/runs").iterdir()),
                   fifo)

    def expanded_fc(path: Path, _: Path) -> None:
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
        state["draft_state_dict"]["fc.weight"] = torch.zeros(1).expand(10**6, 10**6)  # one element, stride 0
        path.unlink()
        torch.save(state, path)

    # In the output directory the other checkpoints of the run still count; diagnosed alone, the checkpoint's
    # settings are unknown. Either way its [1e6, 1e6] shape is not evidence of a layer-id mismatch.
    not_evidence = {"dflash.target_layer_ids", "dflash.fc_input_layers"}
    specforge_case("an fc weight that is an expanded view of one element", "outputs/sf-tiny/sf-tiny-step12/training_state.pt",
                   expanded_fc, names="expanded", not_mismatch=not_evidence)
    specforge_case("an fc weight that is an expanded view, diagnosed alone", "outputs/sf-tiny/sf-tiny-step12/training_state.pt",
                   expanded_fc, diagnose="sf-tiny-step12", exit_codes=(1,), names="expanded", not_mismatch=not_evidence)

    # Our own run format.
    runs = tmp_path / "runs"
    write_run(runs, "base", created="2026-10-01T10:00:00+00:00")

    def own(name: str, prepare: Callable[[Path], None], *, out: Path | None = shared_out, **kw: Any) -> Case:
        run = write_run(tmp_path / "own" / str(len(cases)), "v5")
        prepare(run)
        case = Case(f"our run: {name}", run, out=out, **kw)
        cases.append(case)
        return case

    victim = outside / ".bashrc"
    victim.write_text("# the user's shell setup\n")

    def trace_link(run: Path) -> None:
        (run / "diagnosis").mkdir()
        (run / "diagnosis" / "trace.jsonl").symlink_to(victim)
        (run / "diagnosis" / "report.md").symlink_to(victim)

    own("report files that are links to a victim", trace_link, out=None, victim=str(victim))
    staged = own("staging names that are links to a victim", lambda run: None, out=None, victim=str(victim))
    staged.plant = [str(staged.run / "diagnosis"), str(victim)]

    def fifo_reports(run: Path) -> None:
        (run / "diagnosis").mkdir()
        for name in ("chart.png", "report.json", "trace.jsonl"):
            os.mkfifo(run / "diagnosis" / name)

    own("report files that are FIFOs", fifo_reports, out=None)
    own("a code file that is a FIFO", lambda run: os.mkfifo(run / "code" / "zz_fifo.py"))
    for file in ("config.json", "run.json", "metrics.jsonl", "checkpoints/latest"):
        own(f"{file} a FIFO", lambda run, file=file: fifo(run / file, outside), names=file.split("/")[-1])

    def code_link(run: Path) -> None:
        shutil.rmtree(run / "code")
        (run / "code").symlink_to(sysconfig.get_paths()["stdlib"])

    own("code/ a link to the Python library", code_link, names="code/ is a link")

    def diagnosis_link(run: Path) -> None:
        elsewhere = outside / "elsewhere"
        elsewhere.mkdir()
        (run / "diagnosis").symlink_to(elsewhere)

    own("diagnosis/ a link out of the run", diagnosis_link, out=None, exit_codes=(2,), names="is a link",
        empty=str(outside / "elsewhere"))

    def wrong_types(run: Path) -> None:
        config = json.loads((run / "config.json").read_text())
        for key in ("target_layer_ids", "fc_layers", "target_logits_source", "loss", "context_includes_anchor"):
            config[key] = {"x": [1]}
        config["loss_decay_gamma"] = "seven"
        (run / "config.json").write_text(json.dumps(config))

    own("every DFlash key of the wrong type", wrong_types, exit_codes=(1,), names="not a valid value")
    # A correct run read against a reference checkout whose extractor reading is a guess (`final?`): the
    # rule stands, so `target_logits_source: final` is no mismatch (it was a false critical one).
    checkout = reference_checkout(tmp_path / "reference", monkeypatch)

    def final_logits(run: Path) -> None:
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**config, "target_logits_source": "final"}))

    own("a correct run against a reference checkout", final_logits, args=("--reference-path", str(checkout)),
        names="local tier answered", not_mismatch={"dflash.target_logits_source"})
    own("config.json with a 400-digit number",
        lambda run: (run / "config.json").write_text('{"block_size": 8, "loss_decay_gamma": ' + DIGITS_400 + "}"),
        exit_codes=(1,), names="config.json")
    return cases


def check(case: Case, result: dict[str, Any], tmp_path: Path) -> list[str]:
    """What is wrong with one case's outcome (empty: nothing)."""
    problems = []
    code, stderr = result["code"], result["stderr"]
    if result["exception"]:
        return [f"raised: {result['exception']}"]
    if "Traceback" in stderr or "internal error" in stderr:
        return [f"stderr: {stderr}"]
    lines = [line for line in stderr.splitlines() if line.strip()]
    if code == 2 and (len(lines) != 1 or not lines[0].startswith("error: ")):
        problems.append(f"exit 2 without exactly one error line: {stderr!r}")
    if code not in case.exit_codes:
        problems.append(f"exit {code}, expected {case.exit_codes}: {stderr.strip()[:300]}")
    if result["seconds"] > CASE_DEADLINE_S:
        problems.append(f"took {result['seconds']} s")
    report = result["report"]
    if code in (0, 1) and report is None:
        problems.append("no report.json written")
    text = json.dumps(report or {}) + stderr
    if "BEGIN PRIVATE KEY" in text:
        problems.append("a file a link points to outside the run was read into the report")
    if case.names and case.names not in text.replace("\\\\", "\\"):
        problems.append(f"{case.names!r} is not named in the report or on stderr")
    findings = {f["id"]: f for f in (report or {}).get("findings", [])}
    for inv_id in case.expect.get("mismatches", ()):
        if findings.get(inv_id, {}).get("status") != "mismatch":
            problems.append(f"{inv_id} is not a mismatch: {findings.get(inv_id, {}).get('reason')}")
    for inv_id in case.expect.get("not_mismatch", ()):
        if findings.get(inv_id, {}).get("status") == "mismatch":
            problems.append(f"{inv_id} is a mismatch, which it must not be: {findings[inv_id].get('reason')}")
    if "victim" in case.expect and Path(case.expect["victim"]).read_text() != "# the user's shell setup\n":
        problems.append("the victim file behind a link in diagnosis/ was overwritten")
    if "empty" in case.expect and any(Path(case.expect["empty"]).iterdir()):
        problems.append(f"wrote into {case.expect['empty']} through a link")
    if "sibling" in case.expect:
        candidates = {c["name"]: c for c in (report or {}).get("regression", {}).get("candidates", [])}
        if case.expect["sibling"] not in candidates:
            problems.append(f"the damaged sibling is not listed among the candidates: {sorted(candidates)}")
    return problems


def test_every_damaged_or_hostile_artifact_ends_in_one_line_and_the_documented_exit_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = build_cases(tmp_path, monkeypatch)
    outside_before = {p: p.read_bytes() for p in (tmp_path / "outside").rglob("*") if p.is_file() and not p.is_symlink()}
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"cases": [{"name": c.name, "args": c.args, "report": str(c.report),
                                           "plant_pid_links": c.plant} for c in cases]}))
    process = subprocess.Popen([sys.executable, str(HERE / "sleuth_batch.py"), str(spec)], cwd=tmp_path,
                               env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    try:
        stdout, stderr = process.communicate(timeout=BATCH_DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    results = {line["name"]: line for line in lines if "code" in line}
    started = [line["name"] for line in lines if line.get("started")]
    if process.returncode != 0 or len(results) < len(cases):
        hung = started[-1] if started and started[-1] not in results else None
        pytest.fail(f"the batch stopped after {time.monotonic() - start:.0f} s (exit {process.returncode}); "
                    f"{'hung in: ' + hung if hung else 'crashed'}; {stderr[-1500:]}")
    failures = {case.name: check(case, results[case.name], tmp_path) for case in cases}
    failures = {name: problems for name, problems in failures.items() if problems}
    assert not failures, json.dumps(failures, indent=1)
    outside_after = {p: p.read_bytes() for p in outside_before}
    assert outside_after == outside_before, "a file outside the runs changed"


def _peak_rss_kib(save: Path, tmp_path: Path, out: str) -> tuple[int, dict[str, Any]]:
    """`sleuth diagnose` of `save` in a fresh process: its peak RSS and its report."""
    script = ("import resource, sys\nfrom sleuth.cli import main\nsys.argv = ['sleuth'] + sys.argv[1:]\n"
              "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
              "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
              "sys.exit(code or 0)\n")
    done = subprocess.run([sys.executable, "-c", script, "diagnose", "--run", str(save), "--offline", "--no-probe",
                           "--format", "json", "--out", str(tmp_path / out)], env=env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return int(done.stderr.rsplit("PEAK", 1)[1].split()[0]), json.loads((tmp_path / out / "report.json").read_text())


def test_a_300_mb_train_command_is_not_read_into_memory(tmp_path: Path) -> None:
    """A save dir whose train_command.txt is 300 MB (sparse here) costs no more memory than the intact one: it is
    refused by its size, never read. Measured on 2 CPU cores: 96 MiB either way; 637 MiB when it was read."""
    intact_peak, _ = _peak_rss_kib(speculators_copy(tmp_path / "intact"), tmp_path, "out-intact")
    save = speculators_copy(tmp_path / "big")
    with (save / "train_command.txt").open("r+b") as handle:
        handle.seek(300 * 1024 * 1024)
        handle.write(b"\n")
    big_peak, report = _peak_rss_kib(save, tmp_path, "out-big")
    assert big_peak < intact_peak + 100 * 1024, f"peak RSS {big_peak >> 10} MiB, intact {intact_peak >> 10} MiB"
    assert any("train_command.txt" in p and "bytes" in p for p in report["run"]["problems"]), report["run"]["problems"]


def test_a_run_named_by_bytes_that_are_not_utf8_prints_its_report(tmp_path: Path) -> None:
    """A real process with stdout a pipe, as a user's shell or CI sees it: the text report names the run with
    \\xNN escapes instead of dying on UnicodeEncodeError."""
    save = speculators_copy(tmp_path / "named")
    renamed = Path(os.fsdecode(os.path.join(os.fsencode(save.parent), b"spec\xffout")))
    save.rename(renamed)
    done = subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", "--run", str(renamed), "--offline",
                           "--no-probe", "--out", str(tmp_path / "out")], env=env(tmp_path), cwd=tmp_path,
                          capture_output=True, timeout=180)
    stderr = done.stderr.decode("utf-8")  # what sleuth printed is UTF-8 throughout
    assert done.returncode == 0, stderr[-2000:]
    assert "spec\\xffout" in done.stdout.decode("utf-8")
    assert "spec\\xffout" in (tmp_path / "out" / "report.md").read_text()


def test_a_candidate_run_that_cannot_be_read_is_skipped_with_a_note(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever reading a sibling run raises, the run under diagnosis is diagnosed; the sibling is listed."""
    from sleuth_helpers import invoke, isolate

    import sleuth.diagnose as agent

    isolate(tmp_path, monkeypatch, url=(tmp_path / "no-upstream.git").as_uri(), allowed_hosts=[])
    runs = tmp_path / "runs"
    write_run(runs, "broken", created="2026-10-01T10:00:00+00:00")
    run = write_run(runs, "v5")
    real_read = agent.read_run

    def read(path: Path):  # noqa: ANN202 - RunInfo
        if path.name == "broken":
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return real_read(path)

    monkeypatch.setattr(agent, "read_run", read)
    code, out, err, exc = invoke(["diagnose", "--run", str(run), "--offline", "--no-probe", "--format", "json",
                                  "--out", str(tmp_path / "out")])
    assert exc is None and code in (0, 1), err
    candidates = {c["name"]: c for c in json.loads(out)["regression"]["candidates"]}
    assert "cannot be read, skipped (RecursionError" in candidates["broken"]["reason"], candidates
