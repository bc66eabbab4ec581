"""The reference cache, laid out like the Hugging Face hub cache so content is keyed by commit SHA.

    <cache>/references/<name>/
        refs/<branch>                 text: the commit SHA the branch pointed to when last resolved
        snapshots/<sha>/<path>        the exact bytes of each resolved file at that commit
        provenance/<sha>.json         per file: tier, source, sha256, fetched_at
        docs/<url-sha256>.html|.json  docs pages and their provenance
        git/                          the tool's own partial clone (bare, blob:none)

A snapshot is immutable once written (a commit's files never change), so readers need no locks; writes
go through a temporary file and an atomic rename.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from sleuth.redact import redact
from sleuth.reference.model import ResolvedFile

_FULL_SHA = re.compile(r"[0-9a-f]{40}")


def git_blob_sha(data: bytes) -> str:
    """The object id git gives these bytes as a file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's id, not security


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """sleuth's one writer (sleuth.artifacts.write_atomic): a fresh O_EXCL | O_NOFOLLOW file, renamed over the
    name, in a folder opened without following a link; whatever was planted at the name is replaced, never
    written through."""
    from sleuth.artifacts import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)


class ReferenceCache:
    def __init__(self, root: Path, name: str) -> None:
        from sleuth.reference.playbook import check_reference_name

        # The name becomes a folder: checked here too, so no caller can make the cache write elsewhere.
        self.dir = Path(root) / "references" / check_reference_name(name)

    @property
    def clone_dir(self) -> Path:
        return self.dir / "git"

    def _inside(self, base: Path, relative: str) -> Path:
        target = (base / relative).resolve()
        if not target.is_relative_to(base.resolve()):
            raise ValueError(f"path escapes the cache: {relative!r}")
        return target

    # refs -------------------------------------------------------------------------------------------
    def read_ref(self, branch: str) -> str | None:
        """The SHA the branch pointed to, or None when absent or not a SHA (a damaged ref is no ref)."""
        path = self._inside(self.dir / "refs", branch)
        try:
            text = path.read_bytes()[:100].decode("ascii").strip() if path.is_file() else ""
        except (OSError, UnicodeDecodeError):
            return None
        return text.lower() if _FULL_SHA.fullmatch(text.lower()) else None

    def write_ref(self, branch: str, commit: str) -> None:
        _atomic_write(self._inside(self.dir / "refs", branch), commit.encode())

    # snapshots ----------------------------------------------------------------------------------------
    def snapshot_dir(self, commit: str) -> Path:
        return self.dir / "snapshots" / commit

    def find_commit(self, prefix: str) -> str | None:
        """A full SHA in the cache that starts with `prefix` (users type short SHAs)."""
        snapshots = self.dir / "snapshots"
        if not snapshots.is_dir() or len(prefix) < 4:
            return None
        matches = [p.name for p in snapshots.iterdir() if p.name.startswith(prefix.lower()) and _FULL_SHA.fullmatch(p.name)]
        return matches[0] if len(matches) == 1 else None

    def write_snapshot(self, commit: str, files: list[tuple[ResolvedFile, bytes]]) -> None:
        for resolved, data in files:
            if resolved.git_blob_sha is None or git_blob_sha(data) != resolved.git_blob_sha:
                raise ValueError(f"{resolved.path}: bytes not checked against git are never cached")
        base = self.snapshot_dir(commit)
        provenance = self._read_provenance(commit)
        for resolved, data in files:
            _atomic_write(self._inside(base, resolved.path), data)
            provenance[resolved.path] = resolved.model_dump(exclude={"text"})
        _atomic_write(self.dir / "provenance" / f"{commit}.json",
                      redact(json.dumps(provenance, indent=1)).encode())

    def _read_provenance(self, commit: str) -> dict:
        path = self.dir / "provenance" / f"{commit}.json"
        try:
            data = json.loads(path.read_bytes()) if path.is_file() else {}
        except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8, not JSON
            return {}
        # Damaged provenance is no provenance: its files count as not cached.
        return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}

    def read_snapshot(self, commit: str, paths: list[str]) -> tuple[dict[str, tuple[dict, bytes]], list[str]]:
        """(found: path -> (original provenance, bytes), missing paths). Bytes are re-hashed on read."""
        base = self.snapshot_dir(commit)
        provenance = self._read_provenance(commit)
        found: dict[str, tuple[dict, bytes]] = {}
        missing: list[str] = []
        for path in paths:
            file = self._inside(base, path)
            record = provenance.get(path)
            if not file.is_file() or record is None:
                missing.append(path)
                continue
            try:
                data = file.read_bytes()
            except OSError:
                missing.append(path)
                continue
            if sha256_hex(data) != record.get("sha256") or git_blob_sha(data) != record.get("git_blob_sha"):
                # A damaged entry, or one written before bytes were checked against git (an empty or cut
                # HTTP body could be among those), is treated as absent, never trusted.
                missing.append(path)
                continue
            found[path] = (record, data)
        return found, missing

    # docs -----------------------------------------------------------------------------------------------
    def _docs_key(self, url: str) -> Path:
        return self.dir / "docs" / hashlib.sha256(url.encode()).hexdigest()[:32]

    def write_doc(self, url: str, resolved: ResolvedFile, data: bytes) -> None:
        key = self._docs_key(url)
        _atomic_write(key.with_suffix(".html"), data)
        _atomic_write(key.with_suffix(".json"), redact(json.dumps(resolved.model_dump(exclude={"text"}))).encode())

    def read_doc(self, url: str) -> tuple[dict, bytes] | None:
        key = self._docs_key(url)
        try:
            record = json.loads(key.with_suffix(".json").read_bytes())
            data = key.with_suffix(".html").read_bytes()
        except (OSError, ValueError, RecursionError):
            return None
        return (record, data) if isinstance(record, dict) and sha256_hex(data) == record.get("sha256") else None
