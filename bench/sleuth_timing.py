"""Wall time of `sleuth fetch-reference` and `sleuth diagnose`, per reference tier, cold and warm.

Every measurement is a fresh `python -m`-style process (interpreter start and imports included: what a
user waits for), timed from the parent. No socket is opened:
  * git tiers: the playbook's upstream URL is replaced by a local bare repository (file://), holding
    stand-ins for the reference's files; the local tier gets a clone of it via --path;
  * HTTP tiers (raw, docs): the child process serves GitHub's API, raw.githubusercontent.com and the docs
    host from respx before it runs the CLI, and answers 404 to anything else it was not told about.
cold: an empty SLEUTH_CACHE_DIR. warm: the same command again on the cache the cold run left.

    PYTHONPATH=. .venv/bin/python bench/sleuth_timing.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHA_HEX = "ab" * 20


def stand_in(path: str) -> str:
    if path.endswith(".md"):
        return "# DFlash (stand-in page)\n\n" + "Block diffusion drafter. " * 200 + "\n"
    # About the size of the real modules (a few hundred lines) so hashing and parsing are not free.
    body = "".join(f"def helper_{i}(x):\n    return x + {i}\n\n" for i in range(150))
    return f'"""Stand-in for {path}."""\n\n{body}'


def git(*args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.test",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.test", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def build_world(root: Path) -> dict:
    """A bare upstream with the reference's files, a checkout of it, playbooks pointing at it, runs."""
    import yaml

    spec = yaml.safe_load((REPO / "playbooks" / "references" / "speculators.yaml").read_text())
    author = root / "author"
    author.mkdir()
    git("init", "-q", "-b", "main", str(author))
    (author / "README.md").write_text("speculators stand-in\n")
    for i in range(30):  # some history, so fetches and log walks are not trivially empty
        (author / "HISTORY.md").write_text(f"change {i}\n")
        git("add", "-A", cwd=author)
        git("commit", "-q", "-m", f"change {i}", cwd=author)
    for path in spec["files"]:
        target = author / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(stand_in(path))
    git("add", "-A", cwd=author)
    git("commit", "-q", "-m", "[Feat]Add DFlash training support (#354)", cwd=author)
    bare = root / "upstream.git"
    git("clone", "-q", "--bare", str(author), str(bare))
    checkout = root / "checkout"
    git("clone", "-q", bare.as_uri(), str(checkout))

    def playbooks(name: str, url: str) -> Path:
        # SLEUTH_PLAYBOOKS_DIR is read by both the reference chain (<dir>/references/speculators.yaml)
        # and the invariant engine (<dir>/dflash.yaml), so the directory holds both.
        directory = root / f"playbooks-{name}"
        (directory / "references").mkdir(parents=True)
        shutil.copy(REPO / "playbooks" / "dflash.yaml", directory / "dflash.yaml")
        (directory / "references" / "speculators.yaml").write_text(yaml.safe_dump({**spec, "url": url}))
        return directory

    runs = root / "runs"
    sys.path.insert(0, str(REPO / "tests" / "sleuth"))
    from test_runs import metrics_rows, write_run  # the run-directory contract, as the sleuth tests write it

    steps = list(range(10, 301, 10))
    reference = {"block_size": 8, "draft_layers": 5, "target_layer_ids": [1, 3, 5, 7, 9], "fc_layers": None,
                 "target_logits_source": "final", "loss": "ce", "loss_decay_gamma": 4.0,
                 "context_includes_anchor": False, "max_anchors": 32}
    write_run(runs, "v3", created="2026-11-01T09:00:00+00:00", config={**reference, "loss_decay_gamma": 7.0},
              rows=metrics_rows(steps, acc=[0.002 * s for s in steps], loss=[5 - 0.01 * s for s in steps]), code={})
    write_run(runs, "v5", created="2026-11-01T10:00:00+00:00",
              config={**reference, "fc_layers": [0, 1, 2, 3], "target_logits_source": 9, "loss_decay_gamma": 7.0},
              fc_inputs=4, rows=metrics_rows(steps, acc=[0.001 * s for s in steps],
                                             loss=[5 - 0.005 * s for s in steps]), code={})
    return {
        "spec": spec,
        "checkout": checkout,
        "runs": runs,
        # The git tiers reach the upstream over file://; the HTTP tiers find no git upstream at all.
        "playbooks_git": playbooks("git", bare.as_uri()),
        "playbooks_http": playbooks("http", (root / "no-such-upstream.git").as_uri()),
    }


# (name, command, playbooks, http): http None = no HTTP served, "raw" = API + raw files, "docs" = docs only.
def scenarios(world: dict) -> list[tuple[str, str, list[str], str, str | None]]:
    checkout, runs = str(world["checkout"]), str(world["runs"])
    out = []
    for command, base in (("fetch-reference", ["fetch-reference", "speculators", "--json"]),
                          ("diagnose", ["diagnose", "--run", "v5", "--runs-dir", runs, "--format", "json", "--no-probe"])):
        path_flag = "--path" if command == "fetch-reference" else "--reference-path"
        out += [
            (command, "local (--path checkout, upstream over file://)", [*base, path_flag, checkout], "git", None),
            (command, "git (cache clone of the upstream over file://)", base, "git", None),
            (command, "raw (HTTP, mocked)", base, "http", "raw"),
            (command, "docs (HTTP, mocked; raw 404)", base, "http", "docs"),
            (command, "pinned (--offline, nothing cached)", [*base, "--offline"], "http", None),
        ]
    return out


def child(argv: list[str], serve: str | None, spec_file: Path) -> None:
    """Inside the timed process: serve the HTTP tiers from respx if asked, then run the sleuth CLI."""
    import respx
    import yaml

    spec = yaml.safe_load(spec_file.read_text())
    router = respx.mock(assert_all_called=False)
    router.start()
    repo, branch = spec["repository"], spec.get("default_branch", "main")
    if serve == "raw":
        router.get(f"https://api.github.com/repos/{repo}/commits/{branch}").respond(200, text=SHA_HEX)
        for path in spec["files"]:
            router.get(f"https://raw.githubusercontent.com/{repo}/{SHA_HEX}/{path}").respond(
                200, content=stand_in(path).encode())
    if serve in ("raw", "docs"):
        for page in spec.get("docs", []):
            router.get(page["url"]).respond(200, html="<html><body><h1>DFlash</h1>" + "<p>text</p>" * 300
                                                      + "</body></html>")
    router.route().respond(404)  # everything else, GitHub included when serving docs only
    from sleuth.cli import app

    try:
        app(argv, prog_name="sleuth")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
        if code not in (0, 1):
            raise
    finally:
        router.stop()


def resolved_tier(command: str, stdout: str) -> str | None:
    """Which tier actually answered, from the command's JSON output (checked, not assumed)."""
    data = json.loads(stdout)
    if command == "fetch-reference":
        return data.get("tier")
    return (data.get("reference") or {}).get("tier")


def timed(argv: list[str], env: dict, serve: str | None, spec_file: Path) -> tuple[float, str | None]:
    command = [sys.executable, __file__, "--child", json.dumps({"argv": argv, "serve": serve,
                                                               "spec": str(spec_file)})]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return elapsed, resolved_tier(argv[0], done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        child(spec["argv"], spec["serve"], Path(spec["spec"]))
        return

    results = []
    with tempfile.TemporaryDirectory(prefix="sleuth-bench-") as tmp:
        root = Path(tmp)
        world = build_world(root)
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLEUTH_", "GITHUB_TOKEN"))}
        base_env.update(PYTHONPATH=str(REPO), SLEUTH_CONFIG_FILE=str(root / "no-config.yaml"),
                        HOME=str(root / "home"), GIT_CONFIG_NOSYSTEM="1", NO_COLOR="1")
        (root / "home").mkdir()
        for index, (command, tier, argv, playbooks_kind, serve) in enumerate(scenarios(world)):
            playbooks = world[f"playbooks_{playbooks_kind}"]
            cold, warm, tiers = [], [], set()
            for rep in range(args.repeats):
                cache = root / f"cache-{index}-{rep}"
                out = root / f"diagnosis-{index}-{rep}"
                env = {**base_env, "SLEUTH_CACHE_DIR": str(cache), "SLEUTH_PLAYBOOKS_DIR": str(playbooks)}
                full = [*argv, "--out", str(out)] if command == "diagnose" else argv
                for times in (cold, warm):
                    elapsed, answered = timed(full, env, serve, playbooks / "references" / "speculators.yaml")
                    times.append(elapsed)
                    tiers.add(answered)
            row = {"command": command, "tier": tier, "answered_by": sorted(map(str, tiers)),
                   "cold_median_s": statistics.median(cold),
                   "warm_median_s": statistics.median(warm), "cold_s": cold, "warm_s": warm}
            results.append(row)
            print(f"{command:>15}  {tier:<52} cold {row['cold_median_s']:6.2f} s   warm {row['warm_median_s']:6.2f} s"
                  f"   answered by: {', '.join(row['answered_by'])}",
                  flush=True)
        # What a bare start costs, for scale: the same interpreter importing sleuth's CLI and printing help.
        start_times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import sleuth.cli"], env=base_env, check=True)
            start_times.append(time.perf_counter() - start)
        print(f"{'import sleuth.cli':>15}  {'(interpreter start + CLI imports)':<52} {statistics.median(start_times):6.2f} s")
        results.append({"command": "import sleuth.cli", "median_s": statistics.median(start_times)})
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))


if __name__ == "__main__":
    main()
