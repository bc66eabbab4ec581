"""--offline opens no socket; the shipped speculators definition; config file, env var; CLI exit codes."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import git
import pytest
import typer
from typer.testing import CliRunner

from sleuth.commands.fetch_reference import fetch_reference
from sleuth.reference import ReferenceError, load_reference_spec, resolve_reference
from sleuth.reference.config import checkout_env_var, configured_checkout

DFLASH_IDS = ["dflash.target_layer_ids", "dflash.fc_input_layers", "dflash.loss_decay_gamma",
              "dflash.context_excludes_anchor", "dflash.anchor_slot_untrained", "dflash.target_shift"]


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "config.yaml"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)
    monkeypatch.delenv("SLEUTH_PLAYBOOKS_DIR", raising=False)
    for var in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(var, "Test")
    for var in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(var, "test@example.test")


@pytest.fixture()
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail(f"a socket was opened under --offline: {args[1:] if len(args) > 1 else args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def cli(*args: str):
    app = typer.Typer()
    app.command()(fetch_reference)
    return CliRunner().invoke(app, list(args))


def test_the_socket_guard_really_trips(no_sockets: None) -> None:
    # Without this, the offline tests below could pass with a guard that catches nothing.
    with pytest.raises(pytest.fail.Exception, match="socket was opened"):
        socket.create_connection(("example.test", 443))
    import httpx

    with pytest.raises(pytest.fail.Exception):
        httpx.get("https://raw.githubusercontent.com/")


def test_offline_with_nothing_cached_gives_pinned_facts_without_a_socket(no_sockets: None) -> None:
    res = resolve_reference("speculators", offline=True)

    assert res.tier == "pinned" and res.files == [] and res.commit is None
    outcomes = [(a.tier, a.outcome) for a in res.trace]
    assert outcomes == [("local", "skipped"), ("local", "miss"), ("git-pull", "skipped"), ("raw", "skipped"),
                        ("docs", "miss"), ("pinned", "ok")]
    for fact_id in DFLASH_IDS:
        assert res.pinned[fact_id]["commit"].startswith("c05b95b")
        assert ":" in res.pinned[fact_id]["location"]


def test_offline_cli_json_exits_1_on_pinned_facts(no_sockets: None) -> None:
    result = cli("speculators", "--offline", "--json")

    assert result.exit_code == 1
    payload = json.loads(result.stdout)
    assert payload["tier"] == "pinned" and payload["files"] == [] and payload["commit"] is None
    assert payload["pinned"]["dflash.loss_decay_gamma"]["expected"]["default_gamma"] == 4.0


def test_offline_reads_a_checkout_from_the_config_file(tmp_path: Path, no_sockets: None) -> None:
    spec = load_reference_spec("speculators")
    repo = git.Repo.init(tmp_path / "specs", initial_branch="main")
    for path in spec.files:
        target = tmp_path / "specs" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("# stand-in\n" if path.endswith(".md") else "X = 1\n")
    repo.index.add(spec.files)
    head = repo.index.commit("stand-in").hexsha
    (tmp_path / "config.yaml").write_text(f"references:\n  speculators:\n    path: {tmp_path / 'specs'}\n")

    res = resolve_reference("speculators", offline=True)

    assert res.tier == "local" and res.commit == head and len(res.files) == len(spec.files)
    assert res.trace[0].tried.startswith(f"checkout {tmp_path / 'specs'} at {head[:7]}")
    assert [a.outcome for a in res.trace[1:]] == ["skipped"] * 4


def test_checkout_precedence_path_then_env_then_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.yaml").write_text("references: {speculators: {path: /from/config}}\n")
    assert configured_checkout("speculators", None).origin.startswith("config ")
    monkeypatch.setenv("SLEUTH_SPECULATORS_PATH", "/from/env")
    assert configured_checkout("speculators", None) .path == Path("/from/env")
    assert configured_checkout("speculators", Path("/from/flag")).origin == "--path"
    assert checkout_env_var("z-lab-dflash") == "SLEUTH_Z_LAB_DFLASH_PATH"


def test_unknown_reference_lists_the_known_ones() -> None:
    with pytest.raises(ReferenceError, match="known references: .*speculators"):
        resolve_reference("nope", offline=True)
    result = cli("nope", "--offline")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "speculators" in result.stderr


def test_shipped_definition_lists_the_dflash_module_losses_and_docs() -> None:
    spec = load_reference_spec("speculators")

    assert spec.repository == "vllm-project/speculators" and spec.default_branch == "main"
    assert "src/speculators/models/dflash/core.py" in spec.files
    assert "src/speculators/models/dflash/attention.py" in spec.files
    assert "src/speculators/losses/utils.py" in spec.files
    assert "docs/user_guide/algorithms/dflash.md" in spec.files
    assert {"raw.githubusercontent.com", "api.github.com"} <= set(spec.allowed_hosts)
    assert all(url.url.startswith("https://") for url in spec.docs)
    assert set(DFLASH_IDS) <= set(spec.pinned)


def test_human_output_is_a_table_of_tiers(no_sockets: None) -> None:
    result = cli("speculators", "--offline")

    assert result.exit_code == 1
    for tier in ("local", "git-pull", "raw", "docs", "pinned"):
        assert tier in result.stdout
    assert "pinned:" in result.stdout
