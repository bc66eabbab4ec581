"""The documentation site's reference pages are generated (tools/gen_docs.py) and must be current.

A config key, CLI option, invariant or report field changed without `python tools/gen_docs.py` fails here,
naming the page. Only the generator runs: mkdocs is not needed (`make docs` builds the site).
"""

from __future__ import annotations

import difflib
import re
import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _load_generator()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    gen_docs.generate(out)
    return out


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_reference_page_is_current(page: str, regenerated: Path) -> None:
    committed = (ROOT / "docs" / "reference" / page).read_text(encoding="utf-8")
    fresh = (regenerated / page).read_text(encoding="utf-8")
    if committed != fresh:
        diff = "".join(difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True),
                                            f"docs/reference/{page} (committed)", "regenerated", n=1))
        pytest.fail(f"docs/reference/{page} is not current: run `python tools/gen_docs.py`\n{diff[:4000]}")


def test_check_mode_names_an_edited_page(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs" / "reference", tmp_path, dirs_exist_ok=True)
    assert gen_docs.stale_pages(tmp_path) == []
    edited = tmp_path / "config.md"
    edited.write_text(edited.read_text(encoding="utf-8").replace("| `block_size` |", "| `block_sise` |"),
                      encoding="utf-8")
    assert gen_docs.stale_pages(tmp_path) == ["config.md"]
    assert gen_docs.main(["--check", "--out", str(tmp_path)]) == 1


def test_invariants_page_follows_the_playbook_and_its_fixtures(tmp_path: Path) -> None:
    """An invariant's text and fixtures come from the playbook and the fixture folder, not from prose."""
    (tmp_path / "playbooks").mkdir()
    playbook = (ROOT / "playbooks" / "dflash.yaml").read_text(encoding="utf-8")
    changed = playbook.replace("title: Block queries see context strictly before the anchor",
                               "title: Queries see only the context before their anchor", 1)
    assert changed != playbook
    (tmp_path / "playbooks" / "dflash.yaml").write_text(changed, encoding="utf-8")
    fixtures = tmp_path / "tests" / "fixtures" / "invariants" / "dflash.context_excludes_anchor"
    fixtures.mkdir(parents=True)
    (fixtures / "invalid_le.py").write_text("mask = kv <= anchor\n", encoding="utf-8")
    page = gen_docs.invariants_page(tmp_path)
    assert "**Queries see only the context before their anchor**" in page
    assert "`invalid_le.py`" in page
    assert page != gen_docs.invariants_page()


def test_config_page_lists_every_key_with_its_default() -> None:
    from trainer.config import DraftConfig, TrainConfig

    page = gen_docs.config_page()
    for name in TrainConfig.model_fields:
        assert f"| `{name}` |" in page
    for name in DraftConfig.model_fields:
        assert f"| `draft_config.{name}` |" in page
    assert "| `block_size` | int | `8` | `>= 1, <= 64` |" in page


def test_cli_page_lists_every_command() -> None:
    page = gen_docs.cli_page()
    for command in ("trainer run", "trainer eval", "trainer export", "trainer target build",
                    "trainer hidden-states generate", "sleuth fetch-reference", "sleuth diagnose",
                    "sleuth probe init", "sleuth probe check"):
        assert f"`{command}`" in page


def test_help_text_is_shown_literally_outside_code_spans() -> None:
    """`<runs-dir>` in a help text must not vanish as an HTML tag, nor `k*H ... i*L` turn italic; code spans
    stay as written."""
    assert gen_docs.prose("into <runs-dir>/<name>/, `a <= b` k*H i*L") == \
        "into &lt;runs-dir>/&lt;name>/, `a <= b` k\\*H i\\*L"


def test_run_directory_page_documents_every_entry_the_trainer_writes() -> None:
    """The run-directory page is written by hand (the contract is prose, not a schema), so it is checked
    against the one list in code of what a run directory holds: a new entry without documentation fails."""
    from trainer.run.rundir import RUN_ENTRIES

    page = (ROOT / "docs" / "reference" / "run-directory.md").read_text(encoding="utf-8")
    table_paths = re.findall(r"^\| `([^`]+)` \|", page, re.M)
    documented = {path.split("/")[0] for path in table_paths}
    assert sorted(RUN_ENTRIES - documented) == []
