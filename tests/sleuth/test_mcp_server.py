"""`sleuth mcp` as an agent meets it: the real server in a subprocess, the SDK's own stdio client.

One server process for the module (start-up is the slow part); every tool is called over the protocol on
runs built per the run-directory contract and on a local git repository standing in for speculators (its
definition points at a file:// remote, so the git tiers run for real and no socket is opened).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import git
import pytest
import yaml
from test_runs import metrics_rows, write_run

pytest.importorskip("mcp")
from anyio.from_thread import BlockingPortal, start_blocking_portal  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LOCAL_REF = "speculators-local"  # a definition of our own, so the real `speculators` stays untouched for diagnose
DFLASH = "src/speculators/models/dflash/"
NEEDED = [DFLASH + "__init__.py", DFLASH + "attention.py", DFLASH + "core.py", "src/speculators/losses/utils.py"]
CORE = '''"""DFlash draft model (stand-in)."""


class DFlashDraftModel:
    def __init__(self, config):
        self.fc = Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
'''
# Trojan Source: a bidi override makes the line read differently from what it does.
TROJAN = 'access_level = "user\u202e \u2066# admin\u2069 \u2066"\n'
STEPS = list(range(10, 301, 10))
V3 = {"block_size": 8, "draft_layers": 5, "target_layer_ids": [1, 3, 5, 7, 9], "fc_layers": None,
      "target_logits_source": "final", "loss": "ce", "loss_decay_gamma": 7.0, "context_includes_anchor": False,
      "max_anchors": 32}
V5 = {**V3, "fc_layers": [0, 1, 2, 3], "target_logits_source": 9}


class Upstream:
    """A bare upstream and an author repository that pushes to it."""

    def __init__(self, root: Path) -> None:
        self.bare_dir = root / "upstream.git"
        git.Repo.init(self.bare_dir, bare=True, initial_branch="main")
        self.work = git.Repo.init(root / "author", initial_branch="main")
        self.work.create_remote("origin", self.bare_dir.as_uri())
        self.url = self.bare_dir.as_uri()

    def commit(self, files: dict[str, str], message: str) -> str:
        for path, text in files.items():
            target = Path(self.work.working_tree_dir) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            self.work.index.add([path])
        sha = self.work.index.commit(message).hexsha
        self.work.git.push("origin", "main")
        return sha


class Client:
    """Blocking calls into one MCP client session running in a portal's event loop."""

    def __init__(self, portal: BlockingPortal, session: ClientSession, stderr: Path) -> None:
        self.portal, self.session, self.stderr = portal, session, stderr

    def call(self, tool: str, arguments: dict[str, Any], progress: list | None = None) -> Any:
        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            if progress is not None:
                progress.append((value, message))

        return self.portal.call(lambda: self.session.call_tool(
            tool, arguments, progress_callback=on_progress if progress is not None else None))

    def ok(self, tool: str, arguments: dict[str, Any], progress: list | None = None) -> dict[str, Any]:
        result = self.call(tool, arguments, progress)
        assert not result.is_error, result.content
        assert result.structured_content is not None
        return result.structured_content

    def error(self, tool: str, arguments: dict[str, Any]) -> str:
        """The tool error's message: the SDK prefixes the tool's own one line with where it came from."""
        result = self.call(tool, arguments)
        assert result.is_error, result.structured_content
        text = result.content[0].text
        prefix = f"Error executing tool {tool}: "
        assert text.startswith(prefix) and "\n" not in text, text
        return text[len(prefix):]


@asynccontextmanager
async def _session(params: StdioServerParameters, errlog) -> AsyncIterator[tuple[ClientSession, Any]]:  # noqa: ANN001
    async with stdio_client(params, errlog=errlog) as (read, write):
        async with ClientSession(read, write) as session:
            initialized = await session.initialize()
            yield session, initialized


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mcp")
    env = {"GIT_AUTHOR_NAME": "Test", "GIT_COMMITTER_NAME": "Test", "GIT_AUTHOR_EMAIL": "t@example.test",
           "GIT_COMMITTER_EMAIL": "t@example.test", "GIT_CONFIG_NOSYSTEM": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the author repository commits in this process
    try:
        up = Upstream(root)
        stale = up.commit({"README.md": "speculators stand-in\n", "src/speculators/__init__.py": ""}, "before DFlash")
        stale_clone = root / "stale-template"
        git.Repo.clone_from(up.url, stale_clone)
        files = {p: f'"""Stand-in for {p}."""\n' for p in NEEDED}
        files[DFLASH + "core.py"] = CORE
        files["src/speculators/models/utils.py"] = "def default_layer_ids(num_layers):\n    return [2]\n"
        files["docs/trojan.py"] = TROJAN
        added = up.commit(files, "Add DFlash training support (#354)")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    playbooks = root / "playbooks"
    shutil.copytree(REPO / "playbooks", playbooks, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    definition = yaml.safe_load((REPO / "playbooks" / "references" / "speculators.yaml").read_text())
    definition.update(url=up.url, files=NEEDED, docs=[], module_dirs=[DFLASH, "src/speculators/losses/"])
    (playbooks / "references" / f"{LOCAL_REF}.yaml").write_text(yaml.safe_dump(definition))

    runs = root / "runs"
    write_run(runs, "v3", created="2026-11-01T09:00:00+00:00", config=V3, code={},
              rows=metrics_rows(STEPS, acc=[0.002 * s for s in STEPS], loss=[5 - 0.01 * s for s in STEPS]))
    write_run(runs, "v5", created="2026-11-01T10:00:00+00:00", config=V5, fc_inputs=4, code={},
              rows=metrics_rows(STEPS, acc=[0.001 * s for s in STEPS], loss=[5 - 0.005 * s for s in STEPS]))
    return {"root": root, "up": up, "stale": stale, "added": added, "stale_clone": stale_clone, "runs": runs,
            "playbooks": playbooks, "env": env}


@pytest.fixture(scope="module")
def client(world: dict[str, Any]) -> Iterator[Client]:
    root = world["root"]
    env = {**world["env"], "PYTHONPATH": str(REPO), "HOME": str(root / "home"),
           "SLEUTH_CACHE_DIR": str(root / "cache"), "SLEUTH_CONFIG_FILE": str(root / "no-config.yaml"),
           "SLEUTH_PLAYBOOKS_DIR": str(world["playbooks"]), "SLEUTH_TRUST_DIR": str(root / "trust")}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sleuth.cli", "mcp", "--runs-dir",
                                                                   str(world["runs"])], env=env, cwd=str(root))
    stderr = root / "server-stderr.txt"
    with stderr.open("w") as errlog, start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(_session(params, errlog)) as (session, initialized):
            world["initialized"] = initialized
            yield Client(portal, session, stderr)


def fresh_stale_checkout(world: dict[str, Any], name: str) -> Path:
    target = world["root"] / name
    shutil.copytree(world["stale_clone"], target)
    return target


# --- the session --------------------------------------------------------------------------------------------


def test_initialize_names_the_server_and_lists_every_tool_with_an_output_schema(client: Client,
                                                                                   world: dict[str, Any]) -> None:
    info = world["initialized"].server_info
    assert info.name == "sleuth"
    tools = {t.name: t for t in client.portal.call(client.session.list_tools).tools}
    assert set(tools) == {"fetch_reference", "list_reference_files", "read_reference_file", "search_reference",
                          "diagnose", "explain_invariant", "list_runs", "compare_runs"}
    for tool in tools.values():
        assert tool.output_schema and tool.output_schema.get("type") == "object", tool.name
        assert tool.description
    assert "probe" in tools["diagnose"].input_schema["properties"]
    assert "ctx" not in tools["diagnose"].input_schema["properties"]


def test_fetch_reference_names_the_stale_checkout_and_the_commit_upstream_has(client: Client,
                                                                               world: dict[str, Any]) -> None:
    checkout = fresh_stale_checkout(world, "user-fetch")
    progress: list = []
    result = client.ok("fetch_reference", {"name": LOCAL_REF, "checkout": str(checkout)}, progress)
    stale, added = world["stale"][:7], world["added"][:7]
    assert result["tier"] == "git-pull" and result["commit"] == world["added"] and result["has_source"]
    assert f"checkout at {stale} has no {DFLASH}; upstream has it since {added}" in result["notes"]
    assert [f["path"] for f in result["files"]] == NEEDED
    assert all(f["commit"] == world["added"] for f in result["files"])
    assert [a["tier"] for a in result["trace"]][:3] == ["local", "local", "git-pull"]
    assert progress and any("git-pull answered" in (m or "") for _, m in progress)


def test_offline_fetch_reads_the_cache_not_the_network_and_names_the_stale_checkout(client: Client,
                                                                                     world: dict[str, Any]) -> None:
    client.ok("fetch_reference", {"name": LOCAL_REF, "checkout": str(fresh_stale_checkout(world, "user-warm"))})
    checkout = fresh_stale_checkout(world, "user-offline")
    result = client.ok("fetch_reference", {"name": LOCAL_REF, "checkout": str(checkout), "offline": True})
    # The snapshot the online fetch cached answers; the stale checkout is left as it was.
    assert result["tier"] == "local" and result["commit"] == world["added"]
    assert all("snapshots" in f["source"] for f in result["files"])
    assert git.Repo(checkout).head.commit.hexsha == world["stale"]
    git_pull = [a for a in result["trace"] if a["tier"] == "git-pull"][0]
    assert git_pull["outcome"] == "skipped" and "--offline" in git_pull["reason"]
    raw = [a for a in result["trace"] if a["tier"] == "raw"][0]
    assert raw["outcome"] == "skipped"
    assert any(f"checkout at {world['stale'][:7]} has no {DFLASH}" in n for n in result["notes"])


def test_list_read_and_search_the_reference_at_the_resolved_commit(client: Client, world: dict[str, Any]) -> None:
    checkout = fresh_stale_checkout(world, "user-read")
    args = {"name": LOCAL_REF, "checkout": str(checkout)}
    listed = client.ok("list_reference_files", {**args, "path": "src/speculators/models"})
    assert listed["commit"] == world["added"]
    # The whole tree of the commit, not only the files the definition lists.
    assert set(listed["files"]) == {DFLASH + "__init__.py", DFLASH + "attention.py", DFLASH + "core.py",
                                    "src/speculators/models/utils.py"}
    assert "git tree" in listed["how"]

    read = client.ok("read_reference_file", {**args, "path": DFLASH + "core.py", "start": 4, "end": 6})
    commit = world["added"]
    assert read["commit"] == commit and read["total_lines"] == len(CORE.splitlines())
    assert read["text"].splitlines() == CORE.splitlines()[3:6]
    assert read["provenance"] == f"{DFLASH}core.py:4-6@{commit[:7]}"
    # A file outside the definition's list is read from git objects at the same commit.
    other = client.ok("read_reference_file", {**args, "path": "src/speculators/models/utils.py"})
    assert other["text"].startswith("def default_layer_ids") and other["commit"] == commit

    trojan = client.ok("read_reference_file", {**args, "path": "docs/trojan.py"})
    assert trojan["text"] == 'access_level = "user\\u202e \\u2066# admin\\u2069 \\u2066"'
    assert trojan["sha256"] == hashlib.sha256(TROJAN.encode()).hexdigest()  # of the bytes, not the shown text

    found = client.ok("search_reference", {**args, "pattern": "len(config.target_layer_ids)"})
    assert [(m["path"], m["line"]) for m in found["matches"]] == [(DFLASH + "core.py", 6)]
    assert found["matches"][0]["provenance"] == f"{DFLASH}core.py:6@{commit[:7]}"
    regex = client.ok("search_reference", {**args, "pattern": r"def \w+\(", "regex": True, "path": "src"})
    assert {m["path"] for m in regex["matches"]} == {DFLASH + "core.py", "src/speculators/models/utils.py"}


def test_bad_input_is_a_tool_error_with_the_clis_one_line_message(client: Client, world: dict[str, Any]) -> None:
    checkout = fresh_stale_checkout(world, "user-bad")
    escape = client.error("read_reference_file", {"name": LOCAL_REF, "checkout": str(checkout),
                                                  "path": "../../etc/passwd"})
    assert escape == "path '../../etc/passwd' is not a path inside the repository (relative, no '..')"
    unknown = client.error("fetch_reference", {"name": "no-such-reference"})
    assert unknown.startswith("unknown reference 'no-such-reference'; known references:") and "\n" not in unknown
    missing = client.error("read_reference_file", {"name": LOCAL_REF, "checkout": str(checkout),
                                                   "path": "src/nothing.py"})
    assert missing == f"src/nothing.py is not a file of {LOCAL_REF} at {world['added'][:7]}"
    bad_regex = client.error("search_reference", {"name": LOCAL_REF, "pattern": "(", "regex": True})
    assert bad_regex.startswith("pattern '(' is not a valid regular expression: ")
    not_git = client.error("fetch_reference", {"name": LOCAL_REF, "checkout": str(world["runs"])})
    assert not_git == f"--path: {world['runs']} is not a git checkout"
    engine = client.error("diagnose", {"run": "v5", "served_by": "tgi"})  # the CLI's --served-by line
    assert engine.startswith("--served-by: ") and "tgi" in engine and "\n" not in engine
    no_run = client.error("diagnose", {"run": "v9"})
    assert no_run.startswith("no run 'v9': not a directory, and no run of that name in ") and "v3, v5" in no_run
    assert client.error("compare_runs", {"run": "v5", "baseline": "v5"}) == "--baseline v5 is the diagnosed run itself"
    nowhere = world["root"] / "no-runs-here"
    assert client.error("list_runs", {"runs_dir": str(nowhere)}) == f"runs directory {nowhere} does not exist"
    wrong_type = client.call("read_reference_file", {"name": LOCAL_REF, "path": "x.py", "start": "first"})
    assert wrong_type.is_error


def test_diagnose_returns_ranked_findings_the_regression_and_the_report_paths(client: Client,
                                                                               world: dict[str, Any]) -> None:
    progress: list = []
    result = client.ok("diagnose", {"run": "v5", "offline": True}, progress)
    assert result["subject"] == "v5" and result["exit_status"] == 1
    mismatches = [f["id"] for f in result["findings"] if f["status"] == "mismatch"]
    assert {"dflash.fc_input_layers", "dflash.target_logits_source"} <= set(mismatches)
    assert result["regression"]["baseline"] == "v3" and result["regression"]["verdict"] == "regression"
    assert result["reference"]["tier"] == "pinned"
    report_json = Path(result["report_files"]["report.json"])
    assert report_json.parent == world["runs"] / "v5" / "diagnosis"
    assert json.loads(report_json.read_text())["findings"][0]["id"] == result["findings"][0]["id"]
    # Progress notifications, one per step of the investigation.
    messages = [m for _, m in progress if m]
    assert any(m.startswith("regression:") for m in messages) and any(m.startswith("write-report") for m in messages)
    # The consent rule: this run's code/ was not recorded by our trainer here, so nothing ran unasked.
    probes = result["probes"]
    assert probes is None or (not probes["ran"] and probes["consent"] != "asked")
    assert result["ran"] == []


def test_code_runs_only_when_the_call_asks_and_the_answer_says_how_it_was_isolated(client: Client,
                                                                                   tmp_path: Path) -> None:
    code = tmp_path / "trainer"
    shutil.copytree(REPO / "examples" / "anyprobe", code)
    out = tmp_path / "out"
    unasked = client.ok("diagnose", {"code": str(code), "probe_entry": "probe_entry_handwritten:subject",
                                     "offline": True, "out": str(out / "unasked"), "probe": False})
    assert unasked["probes"]["ran"] is False and unasked["ran"] == []
    default = client.ok("diagnose", {"code": str(code), "offline": True, "out": str(out / "default")})
    assert default["probes"]["ran"] is False and default["ran"] == []
    assert default["probes"]["reason"] == "--code is probed only with --probe (running the code is the user's decision)"

    asked = client.ok("diagnose", {"code": str(code), "probe_entry": "probe_entry_handwritten:subject",
                                   "offline": True, "out": str(out / "asked"), "probe": True})
    probes = asked["probes"]
    assert probes["ran"] is True and probes["consent"] == "asked"
    assert probes["isolation"]["level"] in ("bwrap", "namespaces", "process")
    assert len(asked["ran"]) == 1 and asked["ran"][0].startswith(
        "probes: running entry probe_entry_handwritten:subject (at your request): ")
    assert f"isolation {probes['isolation']['level']}" in asked["ran"][0]


def test_explain_invariant_gives_the_playbook_entry(client: Client) -> None:
    entry = client.ok("explain_invariant", {"id": "dflash.context_excludes_anchor"})
    assert entry["severity"] == "critical" and entry["rank"] == 1
    assert "kv < anchor" in entry["what"] and entry["why"] and entry["example"]
    assert entry["fix"]["config_patch"] == {"context_includes_anchor": False}
    assert entry["reference"] == "speculators"
    assert entry["reference_locations"] == ["src/speculators/models/dflash/attention.py:61-83@c05b95b"]
    unknown = client.error("explain_invariant", {"id": "dflash.nope"})
    assert unknown.startswith("unknown invariant 'dflash.nope' in playbook dflash; known: ")
    assert client.error("explain_invariant", {"id": "x", "playbook": "../etc/passwd"}).startswith(
        "'../etc/passwd' is not a playbook name")


def test_list_runs_and_compare_runs_at_matched_steps(client: Client, world: dict[str, Any]) -> None:
    listed = client.ok("list_runs", {})
    assert listed["runs_dir"] == str(world["runs"])
    assert [r["name"] for r in listed["runs"]] == ["v3", "v5"]
    v5 = listed["runs"][1]
    assert v5["last_step"] == 300 and v5["last"]["acc"] == pytest.approx(0.3) and v5["checkpoint_step"] == 300
    compared = client.ok("compare_runs", {"run": "v5", "baseline": "v3"})
    assert compared["run"] == "v5" and compared["baseline"] == "v3" and compared["verdict"] == "regression"
    acc = next(m for m in compared["metrics"] if m["metric"] == "acc")
    assert acc["verdict"] == "regression" and acc["gaps"] and all(g["gap"] > 0 for g in acc["gaps"])


def test_the_server_wrote_nothing_but_the_protocol_on_stdout(client: Client) -> None:
    # Every line the client read parsed as JSON-RPC (or the calls above would have failed); the log is on stderr.
    assert client.portal.call(client.session.send_ping) is not None


def test_importing_sleuths_cli_does_not_import_the_mcp_sdk() -> None:
    code = "import sys, sleuth.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "[]", done.stderr


def test_a_server_started_offline_keeps_every_call_offline(world: dict[str, Any]) -> None:
    """`sleuth mcp --offline`: a call asking for the network (offline: false) still opens no socket."""
    root = world["root"]
    checkout = fresh_stale_checkout(world, "user-server-offline")
    env = {**world["env"], "PYTHONPATH": str(REPO), "HOME": str(root / "home"),
           "SLEUTH_CACHE_DIR": str(root / "cache-offline"), "SLEUTH_CONFIG_FILE": str(root / "no-config.yaml"),
           "SLEUTH_PLAYBOOKS_DIR": str(world["playbooks"])}
    params = StdioServerParameters(command=sys.executable, args=["-m", "sleuth.cli", "mcp", "--offline"], env=env,
                                   cwd=str(root))
    with (root / "offline-stderr.txt").open("w") as errlog, start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(_session(params, errlog)) as (session, _):
            result = Client(portal, session, root).ok(
                "fetch_reference", {"name": LOCAL_REF, "checkout": str(checkout), "offline": False})
    assert not result["has_source"] and result["tier"] == "pinned"  # the definition's facts: the last resort
    reasons = {a["tier"]: a["reason"] for a in result["trace"] if a["outcome"] == "skipped"}
    assert reasons["git-pull"] == "--offline: no fetch" and reasons["raw"] == "--offline: no HTTP"
    assert git.Repo(checkout).head.commit.hexsha == world["stale"]


def test_the_agent_transcript_script_records_a_real_session(tmp_path: Path) -> None:
    out = tmp_path / "transcript.md"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLEUTH_CACHE_DIR": str(tmp_path / "cache"),
           "SLEUTH_CONFIG_FILE": str(tmp_path / "no-config.yaml")}
    done = subprocess.run([sys.executable, str(REPO / "tools" / "agent_transcript.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("# An agent's session with `sleuth mcp` on run v5")
    assert '## 2. `diagnose(run="v5", offline=true)`' in text
    assert '"id": "dflash.fc_input_layers"' in text and '"verdict": "regression"' in text
    assert "## 3. `explain_invariant(id=" in text
    assert ("**tool error**" in text and "path '../../.ssh/id_rsa' is not a path inside the repository" in text)
