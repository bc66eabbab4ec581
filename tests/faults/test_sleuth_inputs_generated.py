"""Every sleuth command over generated bad inputs: no traceback, ever.

From one good run directory, every file is damaged every way a disk, a kill or a hand can damage it
(truncated, emptied, the wrong JSON type, non-UTF-8, a symlink out of the run, a directory in its place,
numbers too large for a float); each variant is diagnosed. sleuth's own config file gets the same
treatment under `fetch-reference` and `diagnose`. The test fails on any traceback, any "internal error"
(a bug that the command's last-resort handler hid), an exit code outside 0/1/2, an exit 2 that is not
exactly one line, or a byte of the run directory changed (diagnosis writes only to --out).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from sleuth_helpers import invoke, isolate, write_run

RUN_FILES = ["run.json", "config.json", "metrics.jsonl", "checkpoints/latest",
             "checkpoints/step-300/drafter.safetensors", "code/drafter.py"]


def truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def emptied(path: Path) -> None:
    path.write_bytes(b"")


def wrong_type(path: Path) -> None:
    path.write_bytes(b'[1, "two", {"three": null}]\n')


def non_utf8(path: Path) -> None:
    path.write_bytes(b"\xff\xfe\x00garbage \xe9\xe8\n" + path.read_bytes()[:40])


def symlinked_out(path: Path) -> None:
    """The file becomes a link to a file outside the runs directory (a user's, say)."""
    run = next(p for p in path.parents if (p / "run.json").exists() or p.name == "v5")
    outside = run.parent.parent / f"outside-{path.name}"
    outside.write_bytes(b'{"not": "this run\'s"}\n')
    path.unlink()
    path.symlink_to(outside)


def a_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def huge_numbers(path: Path) -> None:
    path.write_text('{"step": 1' + "0" * 400 + ', "block_size": 1e999, "acc": -1e309, "loss": NaN}\n')


DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated": truncated, "emptied": emptied, "wrong type": wrong_type, "non-UTF-8": non_utf8,
    "symlinked out": symlinked_out, "a directory": a_directory, "huge numbers": huge_numbers,
}


def tree_digest(root: Path) -> dict[str, str]:
    digest: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            digest[key] = "link:" + os.readlink(path)
        elif path.is_file():
            digest[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest[key] = "dir"
    return digest


def assert_calm(code: int, out: str, err: str, exc: BaseException | None, what: str) -> None:
    assert exc is None, f"{what}: {type(exc).__name__}: {exc}"
    assert "Traceback" not in out + err, f"{what}: {err}"
    assert "internal error" not in err, f"{what}: {err}"
    assert code in (0, 1, 2), f"{what}: exit {code}"
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: {err}"


@pytest.fixture(autouse=True)
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    isolate(tmp_path, monkeypatch, url=(tmp_path / "no-upstream.git").as_uri(), allowed_hosts=[])


@pytest.mark.slow
@pytest.mark.parametrize("file", RUN_FILES)
def test_diagnose_survives_every_damage_to_every_run_file(tmp_path: Path, file: str) -> None:
    for damage, apply in DAMAGES.items():
        root = tmp_path / damage.replace(" ", "-")
        write_run(root / "runs", "base", created="2026-10-01T10:00:00+00:00")
        run = write_run(root / "runs", "v5")
        apply(run / file)
        before = tree_digest(root / "runs")
        # One --out for all: the chart (most of a diagnosis's time) is redrawn only when the metrics differ.
        code, out, err, exc = invoke(["diagnose", "--run", str(run), "--offline", "--out", str(tmp_path / "out")])
        assert_calm(code, out, err, exc, f"diagnose with {file} {damage}")
        assert tree_digest(root / "runs") == before, f"diagnose changed the runs when {file} was {damage}"


CONFIG_DAMAGES: dict[str, bytes] = {
    "truncated": b"references:\n  speculators: {pa",
    "emptied": b"",
    "wrong type": b"- 1\n- two\n",
    "references wrong type": b"references: 3\n",
    "entry wrong type": b"references: {speculators: [1, 2]}\n",
    "path wrong type": b"references: {speculators: {path: [1]}}\n",
    "non-UTF-8": b"\xff\xfe references",
    "huge numbers": b"references: {speculators: {path: 1" + b"0" * 5000 + b"}}\n",
    "tab indentation": b"references:\n\tspeculators: {}\n",
    "nul bytes": b"references: \x00\n",
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGES) + ["a directory", "symlink to nowhere"])
def test_every_command_survives_a_damaged_sleuth_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             damage: str) -> None:
    config = tmp_path / "config.yaml"
    if damage == "a directory":
        config.mkdir()
    elif damage == "symlink to nowhere":
        config.symlink_to(tmp_path / "missing.yaml")
    else:
        config.write_bytes(CONFIG_DAMAGES[damage])
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(config))
    code_file = tmp_path / "drafter.py"
    code_file.write_text("BLOCK_SIZE = 8\n")
    for args in (["fetch-reference", "speculators", "--offline"],
                 ["fetch-reference", "speculators", "--offline", "--json"],
                 ["diagnose", "--code", str(code_file), "--offline", "--out", str(tmp_path / "out")]):
        code, out, err, exc = invoke(args)
        assert_calm(code, out, err, exc, f"{args[0]} with a config file {damage}")


def _cached_reference(tmp_path: Path) -> Path:
    """A cache holding a verified snapshot of the reference, as a successful online run leaves it."""
    from sleuth_helpers import NEEDED, git_blob_sha, stand_in

    from sleuth.reference.cache import ReferenceCache
    from sleuth.reference.model import ResolvedFile

    commit = "b" * 40
    cache = ReferenceCache(tmp_path / "cache", "speculators")
    files = [(ResolvedFile(path=p, tier="raw", source=f"https://raw.githubusercontent.com/x/{commit}/{p}",
                           commit=commit, sha256=hashlib.sha256(stand_in(p)).hexdigest(),
                           git_blob_sha=git_blob_sha(stand_in(p)), fetched_at="2026-11-01T00:00:00+00:00"),
              stand_in(p)) for p in NEEDED]
    cache.write_snapshot(commit, files)
    cache.write_ref("main", commit)
    return cache.dir


CACHE_DAMAGES: dict[str, Callable[[Path], None]] = {
    "ref non-UTF-8": lambda d: (d / "refs" / "main").write_bytes(b"\xff\xfe"),
    "ref a path": lambda d: (d / "refs" / "main").write_text("../../../../etc\n"),
    "ref a directory": lambda d: ((d / "refs" / "main").unlink(), (d / "refs" / "main").mkdir()),
    "provenance a list": lambda d: next((d / "provenance").glob("*.json")).write_text("[1, 2]"),
    "provenance entry a string": lambda d: next((d / "provenance").glob("*.json")).write_text(
        json.dumps({p: "x" for p in ["src/speculators/models/dflash/__init__.py"]})),
    "provenance non-UTF-8": lambda d: next((d / "provenance").glob("*.json")).write_bytes(b"\xff{"),
    "snapshot file a directory": lambda d: next(p for p in (d / "snapshots").rglob("*.py")).unlink()
    or next(iter((d / "snapshots").iterdir())).joinpath("src/speculators/losses/utils.py").mkdir(),
    "snapshots a file": lambda d: (shutil.rmtree(d / "snapshots"), (d / "snapshots").write_text("x")),
}


@pytest.mark.parametrize("damage", list(CACHE_DAMAGES))
def test_offline_fetch_survives_a_damaged_cache(tmp_path: Path, damage: str) -> None:
    CACHE_DAMAGES[damage](_cached_reference(tmp_path))
    for args in (["fetch-reference", "speculators", "--offline"], ["fetch-reference", "speculators", "--offline",
                                                                    "--json"]):
        code, out, err, exc = invoke(args)
        assert_calm(code, out, err, exc, f"{' '.join(args)} with the cache's {damage}")
