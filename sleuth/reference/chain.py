"""The fetch-reference chain: local -> git-pull -> raw -> docs -> pinned, each attempt recorded.

The chain stops looking for source files at the first tier that gives every needed file at one commit (a
mix of commits would make line citations meaningless). Docs and pinned facts are consulted only when no
source tier succeeded. `offline` runs only the local tier (checkout and cache) and the cached docs and
pinned facts: no git fetch, no HTTP client, no socket.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sleuth.redact import redact
from sleuth.reference import http
from sleuth.reference.cache import ReferenceCache, git_blob_sha, sha256_hex
from sleuth.reference.config import cache_root, checkout_env_var, configured_checkout
from sleuth.reference.model import SOURCE_TIERS, Attempt, ReferenceError, Resolution, ResolvedFile
from sleuth.reference.playbook import ReferenceSpec, load_reference_spec

if TYPE_CHECKING:
    import httpx

    from sleuth.reference.local import GitCheckout, LocalState


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def resolve_reference(name: str, *, ref: str | None = None, path: Path | None = None, offline: bool = False,
                      cache_dir: Path | None = None, client: httpx.Client | None = None,
                      needed: list[str] | None = None, policy: http.HttpPolicy | None = None) -> Resolution:
    """Find the reference's needed files, trying each tier in order; see the module docstring."""
    if ref is not None:
        check_ref(ref)
    spec = load_reference_spec(name)
    chain = _Chain(spec, list(needed or spec.files), ReferenceCache(cache_root(cache_dir), name), ref=ref,
                   offline=offline, client=client, policy=policy or http.HttpPolicy())
    return chain.run(path)


# What git accepts as a branch, tag or SHA, minus everything that could walk a path or a URL: the ref lands
# in cache paths and in GitHub API URLs.
_SAFE_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")


def check_ref(ref: str) -> None:
    if not _SAFE_REF.fullmatch(ref) or ".." in ref or "//" in ref or ref.endswith((".", "/", ".lock")):
        raise ReferenceError(f"--ref {ref!r} is not a branch, tag or commit name")


class _Chain:
    def __init__(self, spec: ReferenceSpec, needed: list[str], cache: ReferenceCache, *, ref: str | None,
                 offline: bool, client: httpx.Client | None, policy: http.HttpPolicy) -> None:
        from sleuth.reference.local import looks_like_sha

        self.spec, self.needed, self.cache, self.ref = spec, needed, cache, ref
        self.offline, self.client, self.policy = offline, client, policy
        self.ref_is_sha = looks_like_sha(ref)
        self.branch = ref if ref and not self.ref_is_sha else spec.default_branch
        self.resolution = Resolution(reference=spec.name, tier=None, commit=None)
        self.files: list[tuple[ResolvedFile, bytes]] = []
        self.from_snapshot = False
        self.upstream_confirmed = False  # the commit is what the upstream branch points to
        self.unreachable: set[str] = set()  # hosts no connection could be made to: not tried again

    # bookkeeping --------------------------------------------------------------------------------------
    @contextmanager
    def attempt(self, tier: str, tried: str) -> Iterator[Attempt]:
        record = Attempt(tier=tier, tried=tried, outcome="miss", reason="")
        start = time.perf_counter()
        try:
            yield record
        except ReferenceError:
            raise
        except Exception as exc:  # a failing tier must not stop the chain; it is recorded and we go on
            record.outcome, record.reason = "error", _one_line(exc)
        finally:
            record.duration_s = round(time.perf_counter() - start, 4)
            self.resolution.trace.append(record)

    def skip(self, tier: str, reason: str) -> None:
        self.resolution.trace.append(Attempt(tier=tier, tried="-", outcome="skipped", reason=reason))

    @property
    def have_source(self) -> bool:
        return bool(self.files) and self.resolution.tier in SOURCE_TIERS

    def accept(self, tier: str, commit: str | None, files: list[tuple[ResolvedFile, bytes]]) -> None:
        self.resolution.tier, self.resolution.commit, self.files = tier, commit, files

    def read_git(self, checkout: GitCheckout, commit: str, tier: str, source: str) -> list[tuple[ResolvedFile, bytes]]:
        out = []
        for path in self.needed:
            data = checkout.read(commit, path)
            # git names objects by their hash, so these bytes are the file at `commit` by construction.
            out.append((ResolvedFile(path=path, tier=tier, source=source.format(commit=commit[:7], path=path),
                                     commit=commit, sha256=sha256_hex(data), git_blob_sha=git_blob_sha(data),
                                     fetched_at=_now(),
                                     text=data.decode("utf-8", errors="replace")), data))
        return out

    def http_client(self) -> tuple[httpx.Client, bool]:
        if self.client is not None:
            return self.client, False
        return http.new_client(self.policy), True

    # the chain ----------------------------------------------------------------------------------------
    def run(self, path: Path | None) -> Resolution:
        state = self.local(path)
        self.git_pull(state)
        if state is not None and state.missing and state.commit and not self.resolution.notes:
            # No upstream to compare with (offline, no remote, fetch failed): still name what is missing.
            from sleuth.reference.local import describe_missing

            for missing in describe_missing(state.missing, self.spec.module_dirs, self.needed):
                self.resolution.notes.append(f"checkout at {state.commit[:7]} has no {missing}")
        self.raw()
        self.docs()
        self.pinned()
        res = self.resolution
        res.files = [f for f, _ in self.files] if self.have_source else []
        if not res.files:
            res.tier = "docs" if res.docs else ("pinned" if res.pinned else None)
            res.commit = None
        self.write_cache()
        res.notes = [redact(note) for note in res.notes]
        return res

    def local(self, path: Path | None) -> LocalState | None:
        from sleuth.reference.local import GitCheckout, describe_missing, inspect_checkout, open_cache_clone

        choice = configured_checkout(self.spec.name, path)
        checkout = None
        if choice is not None:
            if not choice.path.exists():
                raise ReferenceError(f"{choice.origin}: {choice.path} does not exist")
            try:
                checkout = GitCheckout(choice.path, offline=self.offline, allowed_hosts=self.spec.allowed_hosts)
            except ReferenceError:
                raise ReferenceError(f"{choice.origin}: {choice.path} is not a git checkout") from None
        else:
            checkout = open_cache_clone(self.cache.clone_dir, self.spec.url, offline=self.offline, create=False,
                                        allowed_hosts=self.spec.allowed_hosts)

        state = None
        if checkout is None:
            self.skip("local", f"no checkout given (--path, {checkout_env_var(self.spec.name)}, config file) "
                               "and no cache clone yet")
        else:
            with self.attempt("local", str(checkout.path)) as record:
                state = inspect_checkout(checkout, self.needed, self.ref, self.spec.default_branch)
                record.tried = state.label
                if state.complete:
                    assert state.commit is not None
                    source = "git object {commit}:{path} in " + str(checkout.path)
                    self.accept("local", state.commit, self.read_git(checkout, state.commit, "local", source))
                    record.outcome, record.reason = "ok", f"all {len(self.needed)} needed files at {state.commit[:7]}"
                elif state.commit is None:
                    record.reason = state.label.split(": ", 1)[-1]
                else:
                    missing = ", ".join(describe_missing(state.missing, self.spec.module_dirs, self.needed))
                    record.outcome = "partial" if state.present else "miss"
                    record.reason = f"checkout at {state.commit[:7]} has no {missing}"
        if not self.have_source:
            self.local_snapshot()
        return state

    def local_snapshot(self) -> None:
        if self.ref_is_sha:
            commit = self.ref if len(self.ref or "") == 40 else self.cache.find_commit(self.ref or "")
            label = f"cache snapshot of {self.ref}"
        else:
            commit = self.cache.read_ref(self.branch)
            label = f"cache snapshot of {self.branch}"
        with self.attempt("local", f"{label} in {self.cache.dir}") as record:
            if commit is None:
                record.reason = "nothing cached yet"
                return
            found, missing = self.cache.read_snapshot(commit, self.needed)
            if missing:
                record.outcome = "partial" if found else "miss"
                record.reason = f"snapshot {commit[:7]} lacks {len(missing)} of {len(self.needed)} files"
                return
            files = []
            for path in self.needed:
                provenance, data = found[path]
                files.append((ResolvedFile(
                    path=path, tier=provenance.get("tier", "local"),
                    source=f"{self.cache.snapshot_dir(commit) / path} (cached from {provenance.get('source', '?')})",
                    commit=commit, sha256=sha256_hex(data), fetched_at=provenance.get("fetched_at", _now()),
                    text=data.decode("utf-8", errors="replace")), data))
            self.accept("local", commit, files)
            self.from_snapshot = True
            record.outcome, record.reason = "ok", f"all {len(self.needed)} needed files cached at {commit[:7]}"

    def git_pull(self, state: LocalState | None) -> None:
        from sleuth.reference.local import open_cache_clone, pull

        if self.offline:
            self.skip("git-pull", "--offline: no fetch")
            return
        if self.have_source and self.ref_is_sha:
            self.skip("git-pull", f"commit {self.ref} is immutable and already resolved")
            return
        if self.have_source and self.ref and state is not None and state.checkout.rev(f"refs/tags/{self.ref}"):
            self.skip("git-pull", f"tag {self.ref} is already in the checkout")
            return
        created = False
        with self.attempt("git-pull", "") as record:
            if state is None or state.checkout.is_cache:
                host = urlsplit(self.spec.url).hostname
                if host and host.lower() not in {h.lower() for h in self.spec.allowed_hosts}:
                    record.tried, record.outcome = f"clone {self.spec.url}", "error"
                    record.reason = f"host {host} is not in the reference's allowlist"
                    return
                created = not (self.cache.clone_dir / "HEAD").is_file()
                checkout = open_cache_clone(self.cache.clone_dir, self.spec.url, offline=False, create=True,
                                            allowed_hosts=self.spec.allowed_hosts)
                assert checkout is not None
                from sleuth.reference.local import inspect_checkout

                state = inspect_checkout(checkout, self.needed, self.ref, self.spec.default_branch)
                record.tried = (f"partial clone of {self.spec.url} into the cache" if created
                                else f"fetch {self.spec.url} into the cache clone")
            else:
                record.tried = f"fetch into checkout {state.checkout.path}"
            result = pull(state, self.needed, self.ref, self.spec.default_branch, self.spec.repository,
                          self.spec.module_dirs, allowed_hosts=self.spec.allowed_hosts, unreachable=self.unreachable)
            record.outcome, record.reason = result.outcome, result.reason  # type: ignore[assignment]
            self.resolution.notes.extend(result.notes)
            if result.commit is not None and self.from_snapshot and result.commit == self.resolution.commit:
                record.reason = f"the cache snapshot {result.commit[:7]} is what upstream has; nothing new"
                self.upstream_confirmed = not self.ref_is_sha and result.branch == self.branch
            elif result.commit is not None:
                self.accept("git-pull", result.commit,
                            self.read_git(state.checkout, result.commit, "git-pull", result.source))
                self.from_snapshot = False
                self.upstream_confirmed = not self.ref_is_sha and result.branch == self.branch
            elif result.up_to_date and self.have_source:
                self.upstream_confirmed = not self.ref_is_sha and result.branch == self.branch
        if created and not self.have_source:
            shutil.rmtree(self.cache.clone_dir, ignore_errors=True)  # an empty clone would only mislead

    def raw(self) -> None:
        from sleuth.reference.raw import RAW_HOST, fetch_raw_files

        if self.have_source:
            self.skip("raw", f"source files resolved by {self.resolution.tier}")
            return
        if self.offline:
            self.skip("raw", "--offline: no HTTP")
            return
        revision = self.ref or self.spec.default_branch
        tried = f"{RAW_HOST}/{self.spec.repository}/<commit>/<path> for {len(self.needed)} files"
        with self.attempt("raw", tried) as record:
            client, owned = self.http_client()
            try:
                result = fetch_raw_files(client, self.spec.repository, revision, self.needed,
                                         allowed_hosts=self.spec.allowed_hosts,
                                         deadline=http.monotonic() + self.policy.total_timeout_s,
                                         policy=self.policy, unreachable=self.unreachable)
            finally:
                if owned:
                    client.close()
            at = result.commit[:7] if result.commit else f"branch {revision} (unpinned: {result.resolved_how})"
            if not result.failures:
                fetched_at = _now()
                self.accept("raw", result.commit, [
                    (ResolvedFile(path=p, tier="raw", source=url, commit=result.commit, sha256=sha256_hex(data),
                                  git_blob_sha=result.verified.get(p), fetched_at=fetched_at,
                                  text=data.decode("utf-8", errors="replace")), data)
                    for p, (url, data) in result.found.items()])
                self.upstream_confirmed = result.commit is not None and not self.ref_is_sha
                record.outcome, record.reason = "ok", f"all {len(self.needed)} files at {at}"
                if len(result.verified) < len(self.needed):
                    record.reason += (f"; {len(self.needed) - len(result.verified)} not checked against the git "
                                      f"tree ({result.unverified_why}), so not cached")
                return
            record.outcome = "partial" if result.found else "miss"
            failures = "; ".join(f"{p.rsplit('/', 1)[-1]}: {why}" for p, why in list(result.failures.items())[:3])
            more = f" (+{len(result.failures) - 3} more)" if len(result.failures) > 3 else ""
            record.reason = f"{len(result.found)}/{len(self.needed)} files at {at}; {failures}{more}"

    def docs(self) -> None:
        from sleuth.reference.docs import fetch_docs

        if self.have_source:
            self.skip("docs", f"source files resolved by {self.resolution.tier}")
            return
        urls = [page.url for page in self.spec.docs]
        if not urls:
            self.skip("docs", "the reference lists no docs pages")
            return
        with self.attempt("docs", f"{len(urls)} docs page(s)" + (" from the cache" if self.offline else "")) as record:
            fetched: dict[str, bytes] = {}
            failures: dict[str, str] = {}
            if not self.offline:
                client, owned = self.http_client()
                try:
                    result = fetch_docs(client, urls, allowed_hosts=self.spec.allowed_hosts,
                                        deadline=http.monotonic() + self.policy.total_timeout_s, policy=self.policy,
                                        unreachable=self.unreachable)
                finally:
                    if owned:
                        client.close()
                fetched, failures = result.found, result.failures
            pages: list[ResolvedFile] = []
            for url in urls:
                if url in fetched:
                    data = fetched[url]
                    page = ResolvedFile(path=url, tier="docs", source=url, commit=None, sha256=sha256_hex(data),
                                        fetched_at=_now(), text=data.decode("utf-8", errors="replace"))
                    try:
                        self.cache.write_doc(url, page, data)
                    except OSError:
                        pass  # the cache is an optimisation; a read-only cache dir must not fail the tier
                    pages.append(page)
                    continue
                cached = self.cache.read_doc(url)
                if cached is not None:
                    provenance, data = cached
                    pages.append(ResolvedFile(path=url, tier="docs", source=f"cache (from {url})", commit=None,
                                              sha256=sha256_hex(data), fetched_at=provenance.get("fetched_at", ""),
                                              text=data.decode("utf-8", errors="replace")))
                    failures.pop(url, None)
                elif self.offline:
                    failures[url] = "not cached"
            self.resolution.docs = pages
            record.outcome = "ok" if pages and not failures else ("partial" if pages else "miss")
            detail = "; ".join(f"{u}: {why}" for u, why in list(failures.items())[:2])
            record.reason = f"{len(pages)}/{len(urls)} pages (facts from docs carry lower confidence)" + (
                f"; {detail}" if detail else "")

    def pinned(self) -> None:
        if self.have_source:
            self.skip("pinned", f"source files resolved by {self.resolution.tier}")
            return
        tried = f"facts pinned in playbooks/references/{self.spec.name}.yaml"
        with self.attempt("pinned", tried) as record:
            facts = self.spec.pinned_facts()
            if not facts:
                record.reason = "the reference pins no facts"
                return
            self.resolution.pinned = facts
            at = (self.spec.pinned_commit or "?")[:7]
            record.outcome, record.reason = "ok", f"{len(facts)} facts at {at} (offline last resort)"

    def write_cache(self) -> None:
        commit = self.resolution.commit
        if not self.have_source or self.from_snapshot or commit is None:
            return
        if any(resolved.git_blob_sha is None for resolved, _ in self.files):
            # Bytes nothing vouched for could be an empty or cut reply; cached, every later run (offline
            # too) would read them as the reference. They serve this run only.
            return
        try:
            self.cache.write_snapshot(commit, self.files)
            if self.upstream_confirmed:
                self.cache.write_ref(self.branch, commit)
        except (OSError, ValueError) as exc:
            self.resolution.notes.append(f"could not write the cache: {_one_line(exc)}")
