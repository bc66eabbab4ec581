"""Reading a resolved reference past its needed files when no git repository holds the commit (the raw tier
answered): the file comes through the same chain pinned to the commit, from the allowed hosts only."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import respx

from sleuth.reference import ReferenceError
from sleuth.reference.browse import list_files, open_view, read_file, search

REPO = "vllm-project/speculators"
SHA = "e" * 40
NEEDED = ["src/speculators/models/dflash/core.py", "src/speculators/losses/utils.py"]
EXTRA = "src/speculators/models/utils.py"
FILES = {
    NEEDED[0]: b'"""stand-in core"""\nimport torch\n\nfc = torch.nn.Linear(5 * 8, 8, bias=False)\n',
    NEEDED[1]: b"WEIGHT = 1.0\n",
    EXTRA: b"def layer_ids(num_layers):\n    return [2, num_layers // 2, num_layers - 3]\n",
}
API = f"https://api.github.com/repos/{REPO}/commits/main"
TREE = f"https://api.github.com/repos/{REPO}/git/trees/{SHA}?recursive=1"
RAW = f"https://raw.githubusercontent.com/{REPO}/{SHA}/"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    playbooks = tmp_path / "playbooks"
    (playbooks / "references").mkdir(parents=True)
    (playbooks / "references" / "speculators.yaml").write_text(f"""\
repository: {REPO}
url: {(tmp_path / 'no-such-upstream.git').as_uri()}
files: {json.dumps(NEEDED)}
module_dirs: [src/speculators/models/dflash/]
allowed_hosts: [api.github.com, raw.githubusercontent.com]
""")
    monkeypatch.setenv("SLEUTH_PLAYBOOKS_DIR", str(playbooks))


def blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def serve(mock: respx.MockRouter) -> None:
    mock.get(API).respond(200, text=SHA)
    mock.get(TREE).respond(200, json={"sha": SHA, "truncated": False, "tree": [
        {"path": p, "type": "blob", "mode": "100644", "sha": blob(b), "size": len(b)} for p, b in FILES.items()]})
    for path, body in FILES.items():
        mock.get(RAW + path).respond(200, content=body)
    mock.get(RAW + "src/missing.py").respond(404)


def test_a_file_outside_the_definition_is_fetched_at_the_resolved_commit_from_the_allowed_hosts() -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        view = open_view("speculators")
        assert view.resolution.tier == "raw" and view.commit == SHA and view.checkout is None

        listed = list_files(view)
        assert listed.paths == NEEDED and "no git repository holds eeeeeee" in listed.how

        piece = read_file(view, EXTRA, 2, 2)
        assert piece.text == "    return [2, num_layers // 2, num_layers - 3]"
        assert piece.commit == SHA and piece.tier == "raw" and piece.source == RAW + EXTRA
        assert piece.provenance == f"{EXTRA}:2@eeeeeee" and piece.total_lines == 2
        assert piece.sha256 == hashlib.sha256(FILES[EXTRA]).hexdigest()

        with pytest.raises(ReferenceError, match=r"^src/missing.py could not be read from speculators at eeeeeee"):
            read_file(view, "src/missing.py")

        found = search(view, "torch.nn.Linear")
        assert [(m.path, m.line) for m in found.matches] == [(NEEDED[0], 4)]
        hosts = {call.request.url.host for call in mock.calls}
        assert hosts == {"api.github.com", "raw.githubusercontent.com"}  # never github.com's HTML pages
        assert all(str(call.request.url).startswith((RAW, "https://api.github.com/")) for call in mock.calls)
        assert any(str(call.request.url) == RAW + EXTRA for call in mock.calls)


def test_offline_with_nothing_cached_has_no_commit_to_read() -> None:
    with respx.mock(assert_all_called=False) as mock:
        view = open_view("speculators", offline=True)
        assert view.commit is None
        with pytest.raises(ReferenceError, match="no source tier answered"):
            read_file(view, NEEDED[0])
        assert list_files(view).paths == []
        assert not mock.calls  # offline: no request at all
