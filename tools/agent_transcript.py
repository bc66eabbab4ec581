"""Write a Markdown transcript of a coding agent using `sleuth mcp` on a run: the calls and what came back.

    python tools/agent_transcript.py                              # fixture runs v3/v5 built here, offline
    python tools/agent_transcript.py --runs-dir runs --run v5     # the demo's runs
    python tools/agent_transcript.py --runs-dir runs --run v5 --online --reference-checkout ~/src/speculators

It starts the real server (`python -m sleuth.cli mcp`) and talks to it with the MCP SDK's stdio client,
making the calls an agent makes: list the runs, diagnose the regressed one, explain the top finding,
compare with the baseline at matched steps, resolve the reference and (when a source tier answered) search
and read it at the resolved commit. Results are shown as the structured content the agent receives, with
long lists and strings shortened (the transcript says where). The fixture runs follow the run-directory
contract (README: "The run directory") and are built without importing the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS = list(range(10, 301, 10))
REFERENCE_CONFIG = {
    "block_size": 8, "draft_layers": 5, "target_layer_ids": [1, 3, 5, 7, 9], "fc_layers": None,
    "target_logits_source": "final", "loss": "ce", "loss_decay_gamma": 7.0, "context_includes_anchor": False,
    "max_anchors": 32, "steps": 300,
}
# The story's regressed run: fc over 4 of the 5 selected layers, targets from layer 9 (L-3 of 12).
V5_CONFIG = {**REFERENCE_CONFIG, "fc_layers": [0, 1, 2, 3], "target_logits_source": 9}


def build_fixture_runs(root: Path) -> Path:
    """Runs v3 (the good one) and v5 (regressed), per the run-directory contract."""
    import numpy as np
    from safetensors.numpy import save_file

    runs = root / "runs"
    hidden = 8
    for name, created, config, fc_inputs, rate in (
        ("v3", "2026-11-01T09:00:00+00:00", REFERENCE_CONFIG, 5, 0.002),
        ("v5", "2026-11-01T10:00:00+00:00", V5_CONFIG, 4, 0.001),
    ):
        run = runs / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps(config))
        (run / "run.json").write_text(json.dumps({
            "format_version": 1, "name": name, "preset": "fixture", "created": created, "status": "completed",
            "steps_done": 300,
            "target": {"path": "embedded", "fingerprint": "target-fixture", "num_layers": 12, "hidden_size": hidden,
                       "vocab_size": 64},
            "data": {"source": "embedded", "fingerprint": "data-fixture"},
        }))
        rows = [{"step": s, "loss": 5.0 - rate * 5 * s, "acc": rate * s, "lr": 1e-3, "tokens_per_s": 100.0,
                 "elapsed_s": float(s)} for s in STEPS]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        step_dir = run / "checkpoints" / "step-00000300"
        step_dir.mkdir(parents=True)
        save_file({"fc.weight": np.zeros((hidden, fc_inputs * hidden), dtype=np.float32),
                   "hidden_norm.weight": np.ones(hidden, dtype=np.float32)}, str(step_dir / "drafter.safetensors"))
        (step_dir / "state.json").write_text(json.dumps({"step": 300}))
        (run / "checkpoints" / "latest").write_text("step-00000300\n")
    return runs


def shorten(value: Any, *, items: int = 4, chars: int = 240) -> Any:
    """Long lists and strings cut for reading, each cut marked."""
    if isinstance(value, str):
        return value if len(value) <= chars else value[:chars] + f"… [{len(value) - chars} more characters]"
    if isinstance(value, list):
        kept = [shorten(v, items=items, chars=chars) for v in value[:items]]
        return kept + ([f"… [{len(value) - items} more]"] if len(value) > items else [])
    if isinstance(value, dict):
        keys = list(value)
        kept = {k: shorten(value[k], items=items, chars=chars) for k in keys[:items * 3]}
        if len(keys) > items * 3:
            kept["…"] = f"{len(keys) - items * 3} more keys"
        return kept
    return value


class Transcript:
    def __init__(self, title: str) -> None:
        self.lines = [f"# {title}", ""]
        self.count = 0

    def say(self, text: str) -> None:
        self.lines += [text, ""]

    def call(self, tool: str, arguments: dict[str, Any], result: Any, seconds: float, progress: list[str],
             shown: Any = None, note: str = "") -> None:
        self.count += 1
        args = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())
        self.lines += [f"## {self.count}. `{tool}({args})`", ""]
        if progress:
            self.lines += [f"progress ({len(progress)} notifications): " + " · ".join(
                f"`{p}`" for p in progress[:6]) + (" · …" if len(progress) > 6 else ""), ""]
        if result.is_error:
            self.lines += [f"**tool error** ({seconds:.2f} s): `{result.content[0].text}`", ""]
            return
        body = json.dumps(shorten(shown if shown is not None else result.structured_content), indent=2)
        self.lines += [f"structured result ({seconds:.2f} s){note}:", "", "```json", body, "```", ""]

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"


async def converse(runs_dir: Path, run: str, *, online: bool, checkout: str | None, env: dict[str, str]) -> str:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable, args=["-m", "sleuth.cli", "mcp", "--runs-dir", str(runs_dir)],
                                   env=env, cwd=str(REPO))
    transcript = Transcript(f"An agent's session with `sleuth mcp` on run {run}")
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        init = await session.initialize()
        tools = (await session.list_tools()).tools
        transcript.say(f"Server `{init.server_info.name}` {init.server_info.version}, protocol "
                       f"{init.protocol_version}; {len(tools)} tools: " + ", ".join(f"`{t.name}`" for t in tools) + ".")

        async def call(tool: str, arguments: dict[str, Any], shown=None) -> Any:  # noqa: ANN001
            progress: list[str] = []

            async def on_progress(value: float, total: float | None, message: str | None) -> None:
                if message:
                    progress.append(message)

            start = time.perf_counter()
            result = await session.call_tool(tool, arguments, progress_callback=on_progress)
            seconds = time.perf_counter() - start
            transcript.call(tool, arguments, result, seconds, progress,
                            shown(result.structured_content) if shown and not result.is_error else None,
                            note=", the fields an agent reads first" if shown else "")
            return None if result.is_error else result.structured_content

        offline = {} if online else {"offline": True}
        await call("list_runs", {})
        diagnosis = await call("diagnose", {"run": run, **offline}, shown=_diagnosis_view)
        if diagnosis is None:
            return transcript.text()
        mismatches = [f for f in diagnosis["findings"] if f["status"] == "mismatch"]
        if mismatches:
            await call("explain_invariant", {"id": mismatches[0]["id"]})
        regression = diagnosis.get("regression") or {}
        if regression.get("baseline"):
            await call("compare_runs", {"run": run, "baseline": regression["baseline"]}, shown=_comparison_view)
        reference = (diagnosis.get("reference") or {}).get("name") or "speculators"
        ref_args = {"name": reference, **({"checkout": checkout} if checkout else {}), **offline}
        fetched = await call("fetch_reference", ref_args)
        if fetched and fetched["has_source"]:
            hits = await call("search_reference", {**ref_args, "pattern": "nn.Linear"})
            if hits and hits["matches"]:
                first = hits["matches"][0]
                await call("read_reference_file", {**ref_args, "path": first["path"],
                                                   "start": max(1, first["line"] - 3), "end": first["line"] + 3})
        else:
            transcript.say("No source tier answered (offline, and no checkout or cache for the reference), so the "
                           "agent cites the pinned facts and the playbook's locations instead of reading files.")
        await call("read_reference_file", {"name": reference, "path": "../../.ssh/id_rsa", **offline})
    return transcript.text()


def _diagnosis_view(result: dict[str, Any]) -> dict[str, Any]:
    """The diagnosis as an agent reads it first: the verdict, the mismatches, where the reports are."""
    keep = ("id", "status", "severity", "expected", "observed", "confidence")
    return {
        "subject": result["subject"], "exit_status": result["exit_status"], "summary": result["summary"],
        "counts": result["counts"],
        "findings (mismatches; every finding carries evidence and a fix)": [
            {k: f.get(k) for k in keep} | {"fix": (f.get("fix") or {}).get("config_patch")}
            for f in result["findings"] if f["status"] == "mismatch"],
        "regression": {k: (result.get("regression") or {}).get(k) for k in ("baseline", "verdict", "summary")},
        "reference": {k: (result.get("reference") or {}).get(k) for k in ("name", "tier", "commit", "notes")},
        "probes": {k: (result.get("probes") or {}).get(k) for k in ("ran", "consent", "reason")},
        "ran": result["ran"], "report_files": sorted(result["report_files"]),
    }


def _comparison_view(result: dict[str, Any]) -> dict[str, Any]:
    keep = ("metric", "verdict", "tail_gap", "threshold", "run_final", "baseline_reached_step", "run_reached_step",
            "speedup", "gaps", "sentence")
    return {"run": result["run"], "baseline": result["baseline"], "verdict": result["verdict"],
            "summary": result["summary"], "metrics": [{k: m.get(k) for k in keep} for m in result["metrics"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, help="runs directory (default: fixture runs built in a temp dir)")
    parser.add_argument("--run", default="v5", help="the run to diagnose (default v5)")
    parser.add_argument("--online", action="store_true", help="let the reference chain fetch (default: offline)")
    parser.add_argument("--reference-checkout", help="a local git checkout of the reference")
    parser.add_argument("--out", type=Path, help="write the transcript here (default: stdout)")
    args = parser.parse_args(argv)

    import anyio

    with tempfile.TemporaryDirectory(prefix="sleuth-transcript-") as scratch:
        runs_dir = args.runs_dir.resolve() if args.runs_dir else build_fixture_runs(Path(scratch))
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        for var in ("SLEUTH_CACHE_DIR", "SLEUTH_CONFIG_FILE", "SLEUTH_PLAYBOOKS_DIR", "SLEUTH_TRUST_DIR",
                    "SLEUTH_SPECULATORS_PATH", "GITHUB_TOKEN", "SLEUTH_DEBUG"):
            if var in os.environ:
                env[var] = os.environ[var]
        if not args.runs_dir:  # a fixture transcript must not depend on this machine's cache or config
            env.setdefault("SLEUTH_CACHE_DIR", str(Path(scratch) / "cache"))
            env.setdefault("SLEUTH_CONFIG_FILE", str(Path(scratch) / "no-config.yaml"))
        text = anyio.run(lambda: converse(runs_dir, args.run, online=args.online, checkout=args.reference_checkout,
                                          env=env))
    if args.runs_dir is None:
        text = text.replace(str(runs_dir.parent), "<tmp>")
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
