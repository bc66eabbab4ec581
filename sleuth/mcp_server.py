"""`sleuth mcp`: sleuth's commands as Model Context Protocol tools, for coding agents (stdio transport).

Each tool calls the same functions as the CLI (the reference chain, `diagnose`, the run reader and the
regression) and returns typed, structured results (pydantic models: the tool's output schema). A user's
mistake is a tool error carrying the CLI's one-line message; a bug in sleuth is one line too, its
traceback in the server's log on stderr. stdout carries only the protocol (the SDK points fd 1 at stderr
while it serves, so nothing printed by a step can corrupt it).

Safety is the CLI's: the reference tiers contact only the definition's allowed hosts and never GitHub's
HTML pages; `offline` (per call, or for the whole server with `sleuth mcp --offline`) opens no socket;
foreign code runs only when a `diagnose` call asks for it (`probe: true`), isolated, and the answer says
what ran and how. This module imports the `mcp` SDK at import time: only `sleuth mcp` imports it.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

from sleuth.findings import Finding
from sleuth.regression import Regression
from sleuth.report.model import ProbeSummary, ReferenceSummary

DEBUG_ENV = "SLEUTH_DEBUG"
log = logging.getLogger("sleuth.mcp")
T = TypeVar("T")

INSTRUCTIONS = """\
sleuth diagnoses DFlash drafter training runs against the reference implementations.
Read the reference with fetch_reference / list_reference_files / read_reference_file / search_reference
(never GitHub's HTML tree pages: these tools walk local checkout -> git fetch -> raw files -> docs -> pinned
facts and cite path:line@commit). Diagnose a run with diagnose(run=...); list_runs and compare_runs show the
runs and the regression at matched steps; explain_invariant(id) explains a finding's rule and fix.
Code under diagnosis runs only when diagnose is called with probe=true (isolated; the answer says how)."""


# --- results ---------------------------------------------------------------------------------------------


class FileEntry(BaseModel):
    path: str
    tier: str
    commit: str | None
    sha256: str
    source: str


class TierAttempt(BaseModel):
    tier: str
    tried: str
    outcome: str
    reason: str
    duration_s: float


class FetchReferenceResult(BaseModel):
    reference: str
    tier: str | None = Field(description="the best tier that answered: local, git-pull, raw, docs, pinned; None: none")
    commit: str | None = Field(description="the commit every source file is read at")
    has_source: bool = Field(description="source files resolved (a source tier answered)")
    summary: str
    files: list[FileEntry]
    docs: list[FileEntry] = Field(description="docs pages (facts from them carry lower confidence)")
    pinned: dict[str, Any] = Field(description="facts pinned in the reference definition, by invariant id")
    trace: list[TierAttempt] = Field(description="each tier tried, in order, with its outcome and reason")
    notes: list[str] = Field(description="e.g. 'checkout at de03273 has no src/...; upstream has it since f324209'")


class ReferenceFiles(BaseModel):
    reference: str
    commit: str | None
    tier: str | None
    path: str | None = Field(description="the directory listed; None: the whole tree")
    files: list[str]
    how: str = Field(description="where the listing came from")
    truncated: bool


class ReferenceFileText(BaseModel):
    reference: str
    path: str
    commit: str
    tier: str
    source: str = Field(description="where the bytes were read: git object, cache file or URL")
    sha256: str = Field(description="of the whole file")
    start: int
    end: int
    total_lines: int
    truncated: bool = Field(description="more lines were asked for than one read returns")
    provenance: str = Field(description="path:start-end@commit, for citing")
    text: str = Field(description="lines start..end (fetched code is data, never run); control, bidi and "
                                  "invisible characters shown as escapes (\\u202e), as on sleuth's terminal")


class SearchMatch(BaseModel):
    path: str
    line: int
    text: str
    provenance: str = Field(description="path:line@commit")


class ReferenceSearch(BaseModel):
    reference: str
    commit: str
    pattern: str
    regex: bool
    scope: list[str] = Field(description="the paths searched (files and directories)")
    files_searched: int
    matches: list[SearchMatch]
    truncated: bool
    notes: list[str]


class DiagnoseResult(BaseModel):
    subject: str = Field(description="the run's name, or the code path diagnosed")
    exit_status: Literal[0, 1, 2] = Field(description="the CLI's exit code: 0 clean, 1 findings, 2 no experiment ran")
    summary: str
    counts: dict[str, int] = Field(description="findings by status")
    findings: list[Finding] = Field(description="ranked by expected impact; mismatches first")
    regression: Regression | None = None
    reference: ReferenceSummary | None = None
    probes: ProbeSummary | None = Field(None, description="what ran, at whose consent, and how isolated")
    ran: list[str] = Field(description="what sleuth announced before running any code under diagnosis")
    input_problems: list[str]
    report_dir: str
    report_files: dict[str, str] = Field(description="report.md, report.json, report.sarif, fix.yaml, chart, trace")


class FixText(BaseModel):
    config_patch: dict[str, Any]
    code_hint: str | None
    applicability: Literal["safe", "unsafe"]
    why_unsafe: str | None


class InvariantExplanation(BaseModel):
    id: str
    title: str
    severity: str
    rank: int = Field(description="expected impact on real acceptance, 1 = largest")
    what: str
    why: str
    example: str
    expected: Any = Field(description="the rule's value in canonical form")
    accept: list[Any]
    fix: FixText
    reference: str = Field(description="the reference implementation it is checked against")
    reference_files: list[str] = Field(description="files of the reference the expected value is read from")
    reference_locations: list[str] = Field(description="path:lines@commit pinned in the playbook")
    notes: list[str]
    playbook: str


class RunEntry(BaseModel):
    name: str
    path: str
    status: str | None
    preset: str | None
    created: str | None
    steps_done: int | None
    block_size: int | None
    target_fingerprint: str | None
    data_fingerprint: str | None
    metrics_rows: int
    last_step: int | None
    last: dict[str, float] = Field(description="the last logged value of each headline metric")
    checkpoint_step: int | None
    problems: list[str]


class UnreadableRun(BaseModel):
    path: str
    reason: str


class RunList(BaseModel):
    runs_dir: str
    runs: list[RunEntry] = Field(description="oldest first (by run.json created)")
    unreadable: list[UnreadableRun]


# --- the server ------------------------------------------------------------------------------------------


# Argument types shared by the tools (module level: the SDK resolves the annotations by name).
Name = Annotated[str, Field(description="reference name, e.g. speculators (playbooks/references/NAME.yaml)")]
Ref = Annotated[str | None, Field(description="branch, tag or commit SHA (default: the default branch)")]
Checkout = Annotated[str | None, Field(description="a local git checkout of the reference (the CLI's --path)")]
Offline = Annotated[bool, Field(description="read only local checkouts and the cache; open no socket")]


class _State:
    """What the server keeps between calls: its own defaults and the reference views resolved so far."""

    def __init__(self, offline: bool, runs_dir: Path | None, cache_dir: Path | None) -> None:
        self.offline = offline
        self.runs_dir = runs_dir
        self.cache_dir = cache_dir
        self.views: dict[tuple, Any] = {}
        self.lock = threading.Lock()


def _user_errors() -> tuple[type[BaseException], ...]:
    from sleuth.diagnose import DiagnoseError
    from sleuth.invariants.playbook import PlaybookError
    from sleuth.reference import ReferenceError
    from sleuth.regression import RegressionRefused
    from sleuth.runs import RunError

    return (ReferenceError, DiagnoseError, PlaybookError, RunError, RegressionRefused)


def _one_line(text: str) -> str:
    from sleuth.escape import terminal
    from sleuth.redact import redact

    return terminal(redact(text))


def _visible(text: str) -> str:
    """Fetched text as an agent should see it: line by line (tabs kept), every control, bidi override and
    invisible character shown as an escape and secrets masked, as sleuth shows any text on a terminal; the
    sha256 in the answer is still of the file's bytes."""
    from sleuth.escape import terminal

    return "\n".join("\t".join(terminal(part) for part in line.split("\t")) for line in text.split("\n"))


def _call(work: Callable[[], T]) -> T:
    """Run a tool body: a user's mistake is a ToolError with the CLI's message, anything else one line too."""
    try:
        return work()
    except ToolError:
        raise
    except _user_errors() as exc:
        raise ToolError(_one_line(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)) from None
    except KeyboardInterrupt:
        raise ToolError("interrupted") from None
    except Exception as exc:  # a bug in sleuth: the traceback goes to the log (stderr), the caller gets one line
        log.exception("tool failed")
        if os.environ.get(DEBUG_ENV):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ToolError(_one_line(f"internal error ({type(exc).__name__}{': ' + first if first else ''}); "
                                  f"rerun with {DEBUG_ENV}=1 for the traceback")) from None


async def _in_thread(ctx: Context | None, work: Callable[[Callable[[str], None]], T], *, label: str) -> T:
    """Run blocking sleuth work in a worker thread; `progress(message)` from it becomes a progress notification."""
    count = 0

    def progress(message: str) -> None:
        nonlocal count
        count += 1
        if ctx is None:
            return
        try:
            anyio.from_thread.run(ctx.report_progress, count, None, _one_line(message)[:300])
        except Exception:  # noqa: BLE001 - a client gone away must not fail the work
            log.debug("progress notification not sent", exc_info=True)

    if ctx is not None:
        await ctx.report_progress(0, None, label)
    # One call at a time: an agent may send calls in parallel, and two of them fetching into one checkout, or
    # diagnosing one run into one diagnosis/ folder, would trip over each other as two CLI runs would.
    async with _serial():
        return await anyio.to_thread.run_sync(lambda: _call(lambda: work(progress)))


_LOCK: anyio.Lock | None = None


def _serial() -> anyio.Lock:
    global _LOCK
    if _LOCK is None:  # created inside the server's event loop
        _LOCK = anyio.Lock()
    return _LOCK


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def build_server(*, offline: bool = False, runs_dir: Path | None = None, cache_dir: Path | None = None) -> MCPServer:
    """The MCP server with sleuth's tools; `offline` forces every call offline, `runs_dir` is the default runs dir."""
    from sleuth import __version__

    state = _State(offline, runs_dir, cache_dir)
    server = MCPServer(name="sleuth", title="sleuth: DFlash drafter diagnosis", instructions=INSTRUCTIONS,
                       version=__version__)
    read_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=True)
    local_only = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)

    def view(name: str, ref: str | None, checkout: str | None, offline_call: bool, progress: Callable[[str], None],
             *, refresh: bool = False) -> Any:
        from sleuth.reference.browse import open_view

        effective = state.offline or offline_call
        key = (name, ref, str(_path(checkout)) if checkout else None, effective)
        with state.lock:
            cached = state.views.get(key)
        if cached is not None and not refresh:
            return cached
        progress(f"resolving {name} (local -> git-pull -> raw -> docs -> pinned{', offline' if effective else ''})")
        resolved = open_view(name, ref=ref, path=_path(checkout), offline=effective, cache_dir=state.cache_dir)
        with state.lock:
            state.views[key] = resolved
        progress(f"{name}: {resolved.resolution.tier or 'no tier'} answered"
                 + (f" at {resolved.resolution.commit[:7]}" if resolved.resolution.commit else ""))
        return resolved

    @server.tool(annotations=read_only)
    async def fetch_reference(name: Name, ref: Ref = None, checkout: Checkout = None, offline: Offline = False,
                              ctx: Context | None = None) -> FetchReferenceResult:
        """Resolve a reference implementation (local checkout -> git-pull -> raw -> docs -> pinned) and say
        which tier answered, at which commit, with each file's provenance and notes such as a stale checkout.
        Use this instead of fetching GitHub tree pages."""

        def work(progress: Callable[[str], None]) -> FetchReferenceResult:
            resolved = view(name, ref, checkout, offline, progress, refresh=True)
            return _fetch_result(resolved.resolution)

        return await _in_thread(ctx, work, label=f"fetch-reference {name}")

    @server.tool(annotations=read_only)
    async def list_reference_files(name: Name, path: Annotated[str | None, Field(
            description="a directory inside the repository, e.g. src/speculators/models/dflash")] = None,
            ref: Ref = None, checkout: Checkout = None, offline: Offline = False,
            ctx: Context | None = None) -> ReferenceFiles:
        """List the reference's files at the resolved commit (under `path` when given)."""

        def work(progress: Callable[[str], None]) -> ReferenceFiles:
            from sleuth.reference.browse import check_repo_path, list_files

            if path:
                check_repo_path(path)  # before anything is resolved or fetched
            resolved = view(name, ref, checkout, offline, progress)
            listed = list_files(resolved, path)
            return ReferenceFiles(reference=name, commit=resolved.commit, tier=resolved.resolution.tier,
                                  path=path, files=listed.paths, how=listed.how, truncated=listed.truncated)

        return await _in_thread(ctx, work, label=f"list {name}")

    @server.tool(annotations=read_only)
    async def read_reference_file(name: Name, path: Annotated[str, Field(
            description="file path inside the repository")],
            start: Annotated[int | None, Field(description="first line, 1-based")] = None,
            end: Annotated[int | None, Field(description="last line, inclusive")] = None,
            ref: Ref = None, checkout: Checkout = None, offline: Offline = False,
            ctx: Context | None = None) -> ReferenceFileText:
        """Read lines of a reference file at the resolved commit, with path:line@commit provenance."""

        def work(progress: Callable[[str], None]) -> ReferenceFileText:
            from sleuth.reference.browse import check_repo_path, read_file

            check_repo_path(path)  # before anything is resolved or fetched
            resolved = view(name, ref, checkout, offline, progress)
            piece = read_file(resolved, path, start, end)
            return ReferenceFileText(reference=name, path=piece.path, commit=piece.commit, tier=piece.tier,
                                     source=piece.source, sha256=piece.sha256, start=piece.start, end=piece.end,
                                     total_lines=piece.total_lines, truncated=piece.truncated,
                                     provenance=piece.provenance, text=_visible(piece.text))

        return await _in_thread(ctx, work, label=f"read {name}:{path}")

    @server.tool(annotations=read_only)
    async def search_reference(name: Name, pattern: Annotated[str, Field(
            description="text to find (a Python regular expression when regex is true)")],
            path: Annotated[str | None, Field(description="directory or file to search (default: the files and "
                                                          "module directories the playbook reads)")] = None,
            regex: bool = False, ref: Ref = None, checkout: Checkout = None, offline: Offline = False,
            ctx: Context | None = None) -> ReferenceSearch:
        """Find lines in the reference at the resolved commit; each match cites path:line@commit."""

        def work(progress: Callable[[str], None]) -> ReferenceSearch:
            from sleuth.reference.browse import check_pattern, check_repo_path, search

            check_pattern(pattern, regex=regex)  # before anything is resolved or fetched
            if path:
                check_repo_path(path)
            resolved = view(name, ref, checkout, offline, progress)
            found = search(resolved, pattern, under=path, regex=regex)
            commit = resolved.commit or ""
            return ReferenceSearch(
                reference=name, commit=commit, pattern=pattern, regex=regex, scope=found.scope,
                files_searched=found.files_searched, truncated=found.truncated, notes=found.notes,
                matches=[SearchMatch(path=m.path, line=m.line, text=_visible(m.text), provenance=m.provenance(commit))
                         for m in found.matches])

        return await _in_thread(ctx, work, label=f"search {name} for {pattern!r}")

    @server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=True))
    async def diagnose(
        run: Annotated[str | None, Field(description="run name (in runs_dir) or path of a run directory")] = None,
        runs_dir: Annotated[str | None, Field(description="where runs live (default: the server's --runs-dir, "
                                                          "./runs, or the run path's parent)")] = None,
        code: Annotated[str | None, Field(description="a DFlash implementation to diagnose (file or tree)")] = None,
        config: Annotated[str | None, Field(description="the run configuration (JSON/YAML) for `code`")] = None,
        baseline: Annotated[str | None, Field(description="compare with this run instead of the best earlier one")] = None,
        reference: Annotated[str | None, Field(description="reference implementation (default: the playbook's)")] = None,
        reference_path: Annotated[str | None, Field(description="a local git checkout of the reference")] = None,
        offline: Offline = False,
        out: Annotated[str | None, Field(description="report directory (default: <run>/diagnosis/)")] = None,
        probe: Annotated[bool | None, Field(description=(
            "consent to run code under diagnosis, isolated. Default (null): only a run's code/ that your own "
            "trainer recorded for that run directory runs; true: also --code or anyone else's run; false: "
            "nothing runs"))] = None,
        probe_entry: Annotated[str | None, Field(description="your trainer's probe entry, MODULE:FUNCTION "
                                                             "(runs code: asks for it)")] = None,
        probe_python: Annotated[str | None, Field(description="interpreter the probes run in")] = None,
        target: Annotated[str | None, Field(description="the target model directory, when the run names none")] = None,
        hidden_states: Annotated[str | None, Field(description="an offline hidden-state cache to check")] = None,
        served_by: Annotated[str | None, Field(description="the engine the drafter is served with (vllm, speculators, "
                                                           "zlab, sglang, specforge, ik_llama.cpp, vllm-v1): a "
                                                           "sliding-window drafter it does not build as trained, or a "
                                                           "DFlash2 / DSpark export it reads otherwise, is a "
                                                           "mismatch")] = None,
        ctx: Context | None = None,
    ) -> DiagnoseResult:
        """Diagnose a drafter run (or any DFlash code): findings with evidence and fixes, the regression
        against earlier runs, and the paths of report.md/json/sarif and fix.yaml. Same rules as
        `sleuth diagnose`."""

        def work(progress: Callable[[str], None]) -> DiagnoseResult:
            from sleuth.diagnose import DiagnoseRequest
            from sleuth.diagnose import diagnose as run_diagnosis

            announced: list[str] = []

            def announce(line: str) -> None:
                announced.append(_one_line(line))
                log.info("%s", _one_line(line))
                progress(line)

            request = DiagnoseRequest(
                run=run, runs_dir=_path(runs_dir) or (state.runs_dir if run and not _looks_like_path(run) else None),
                baseline=baseline, reference=reference, reference_path=_path(reference_path), code=_path(code),
                config=_path(config), offline=state.offline or offline, out=_path(out), probe=probe,
                probe_python=probe_python, probe_entry=probe_entry, target=_path(target),
                hidden_states=_path(hidden_states), served_by=served_by)
            result = run_diagnosis(request, listener=lambda step: progress(f"{step.step}: {step.outcome}"),
                                   announce=announce)
            report = result.report
            subject = report.run.name if report.run is not None else str(code or "")
            return DiagnoseResult(
                subject=subject, exit_status=report.exit_status, summary=report.summary, counts=report.counts,
                findings=report.findings, regression=report.regression, reference=report.reference,
                probes=report.probes, ran=announced, input_problems=report.input_problems,
                report_dir=str(result.out_dir), report_files={k: str(v) for k, v in result.files.items()})

        return await _in_thread(ctx, work, label="diagnose " + (run or code or ""))

    @server.tool(annotations=local_only)
    async def explain_invariant(
        id: Annotated[str, Field(description="invariant id, e.g. dflash.context_excludes_anchor")],  # noqa: A002
        playbook: Annotated[str, Field(description="playbook name (playbooks/NAME.yaml)")] = "dflash",
    ) -> InvariantExplanation:
        """The playbook's entry for an invariant: what it requires, why it matters, an example violation,
        the fix, and where the reference implementation shows the rule."""

        def work(_: Callable[[str], None]) -> InvariantExplanation:
            return _explain(id, playbook)

        return await _in_thread(None, work, label=f"explain {id}")

    @server.tool(annotations=local_only)
    async def list_runs(runs_dir: Annotated[str | None, Field(
            description="directory holding run directories (default: the server's --runs-dir, else ./runs)")] = None,
    ) -> RunList:
        """The runs in a runs directory with their status, last metrics and any damage sleuth saw."""

        def work(_: Callable[[str], None]) -> RunList:
            return _list_runs(_path(runs_dir) or state.runs_dir or Path("runs"))

        return await _in_thread(None, work, label="list runs")

    @server.tool(annotations=local_only)
    async def compare_runs(
        run: Annotated[str, Field(description="the run (name in runs_dir, or path)")],
        baseline: Annotated[str, Field(description="the run to compare with (name in runs_dir, or path)")],
        runs_dir: Annotated[str | None, Field(description="where the runs live (default: the server's "
                                                          "--runs-dir, else ./runs)")] = None,
    ) -> Regression:
        """Compare two runs at matched steps (smoothed, interpolated onto common steps): per metric the gap,
        the noise threshold, the verdict and how much slower the run reached its final value."""

        def work(_: Callable[[str], None]) -> Regression:
            from sleuth.regression import find_regression
            from sleuth.runs import read_run, resolve_run_dir

            where = _path(runs_dir) or state.runs_dir
            first = read_run(resolve_run_dir(run, where))
            second = read_run(resolve_run_dir(baseline, where))
            if first.path.resolve() == second.path.resolve():
                raise ToolError(f"--baseline {baseline} is the diagnosed run itself")
            return find_regression(first, [], second)

        return await _in_thread(None, work, label=f"compare {run} with {baseline}")

    return server


# --- the tools' bodies -----------------------------------------------------------------------------------


def _looks_like_path(run: str) -> bool:
    return "/" in run or os.sep in run or run.startswith("~") or Path(run).is_absolute()


def _fetch_result(resolution: Any) -> FetchReferenceResult:
    def entry(f: Any) -> FileEntry:
        return FileEntry(path=f.path, tier=f.tier, commit=f.commit, sha256=f.sha256, source=f.source)

    if resolution.has_source:
        summary = (f"{len(resolution.files)} source files from the {resolution.tier} tier at "
                   f"{(resolution.commit or 'an unpinned branch')[:12]}")
    elif resolution.tier in ("docs", "pinned"):
        summary = (f"no source files: only {resolution.tier} answered (facts from docs carry lower confidence; "
                   "pinned facts are as of the definition's commit)")
    else:
        summary = f"no tier resolved {resolution.reference!r}; see the trace"
    from sleuth.redact import redact_data

    return FetchReferenceResult(
        reference=resolution.reference, tier=resolution.tier, commit=resolution.commit,
        has_source=resolution.has_source, summary=summary, files=[entry(f) for f in resolution.files],
        docs=[entry(f) for f in resolution.docs], pinned=redact_data(resolution.pinned),  # type: ignore[arg-type]
        trace=[TierAttempt(**a.model_dump()) for a in resolution.trace], notes=list(resolution.notes))


_PLAYBOOK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _explain(invariant_id: str, playbook_name: str) -> InvariantExplanation:
    from sleuth.invariants.playbook import PlaybookError, load_playbook

    # A name only: the tool reads sleuth's own playbooks, not any YAML file a caller points at.
    if not _PLAYBOOK_NAME.fullmatch(playbook_name) or ".." in playbook_name or playbook_name.endswith((".yaml", ".yml")):
        raise PlaybookError(f"{playbook_name!r} is not a playbook name (letters, digits, '.', '_', '-')")
    book = load_playbook(playbook_name)
    by_id = {inv.id: inv for inv in book.invariants}
    invariant = by_id.get(invariant_id) or by_id.get(f"{book.name}.{invariant_id}")
    if invariant is None:
        raise PlaybookError(f"unknown invariant {invariant_id!r} in playbook {book.name}; known: "
                            + ", ".join(sorted(by_id)))
    expected = invariant.expected
    locations = []
    if expected.pinned is not None:
        locations.append(expected.pinned.location + (f"@{expected.pinned.commit[:7]}" if expected.pinned.commit else ""))
    return InvariantExplanation(
        id=invariant.id, title=invariant.title, severity=invariant.severity, rank=invariant.rank,
        what=invariant.why.what, why=invariant.why.why, example=invariant.why.example, expected=expected.value,
        accept=list(expected.accept),
        fix=FixText(config_patch=dict(invariant.fix.config_patch), code_hint=invariant.fix.code_hint,
                    applicability=invariant.fix.applicability, why_unsafe=invariant.fix.why_unsafe),
        reference=book.reference, reference_files=list(expected.reference_files), reference_locations=locations,
        notes=list(invariant.notes), playbook=book.name)


_HEADLINE = ("acc", "loss", "streak", "eal", "tau", "val_acc", "val_loss")


def _list_runs(runs_dir: Path) -> RunList:
    from sleuth.artifacts import shown
    from sleuth.artifacts import is_dir
    from sleuth.runs import RunError, list_run_dirs, read_run

    if not is_dir(runs_dir):
        raise RunError(f"runs directory {shown(runs_dir)} does not exist")
    entries: list[tuple[str, RunEntry]] = []
    unreadable: list[UnreadableRun] = []
    for path in list_run_dirs(runs_dir):
        try:
            info = read_run(path)
        except Exception as exc:  # noqa: BLE001 - one damaged run never hides the others
            if os.environ.get(DEBUG_ENV) and not isinstance(exc, RunError):
                raise
            unreadable.append(UnreadableRun(path=str(path), reason=_one_line(str(exc) or type(exc).__name__)))
            continue
        last: dict[str, float] = {}
        last_step = None
        for metric in _HEADLINE:
            steps, values = info.series(metric)
            if steps:
                last[metric] = float(values[-1])
                last_step = max(last_step or 0, int(steps[-1]))
        run_json = info.run_json or {}
        created = info.created
        steps_done = run_json.get("steps_done")
        preset = run_json.get("preset")
        entries.append((created.isoformat() if created else "", RunEntry(
            name=info.name, path=str(info.path), status=info.status,
            preset=preset if isinstance(preset, str) else None, created=created.isoformat() if created else None,
            steps_done=steps_done if isinstance(steps_done, int) and not isinstance(steps_done, bool) else None,
            block_size=info.block_size, target_fingerprint=info.target_fingerprint,
            data_fingerprint=info.data_fingerprint, metrics_rows=len(info.metrics), last_step=last_step, last=last,
            checkpoint_step=info.checkpoint_step, problems=[_one_line(p) for p in info.problems])))
    entries.sort(key=lambda item: (item[0], item[1].name))
    return RunList(runs_dir=str(runs_dir), runs=[e for _, e in entries], unreadable=unreadable)


def serve(*, offline: bool = False, runs_dir: Path | None = None) -> None:
    """Serve over stdio until the client closes stdin; logs go to stderr."""
    logging.basicConfig(level=logging.INFO if os.environ.get(DEBUG_ENV) else logging.WARNING,
                        format="sleuth mcp: %(levelname)s %(name)s: %(message)s")
    build_server(offline=offline, runs_dir=runs_dir).run("stdio")
