"""`python -m bench.upstream_defects.behaviour`: does each planted defect change what the code computes?

    PYTHONPATH=. .venv-speculators/bin/python -m bench.upstream_defects.behaviour [--catalog defects_heldout.yaml]
        [--sources speculators,specforge,zlab] [--only ID,...] [--speculators PATH] [--specforge PATH] [--zlab PATH]

A defect that changes nothing is a bug of the benchmark, not a miss of sleuth. Each source is probed
unmodified and then with each defect planted (a fresh copy, imported afresh), on tiny random tensors on CPU
(probe_*.py). A defect is `changed` (with the probed numbers that moved), `not exercised` (nothing moved: the
probe does not reach the edited code, so read it), or `error` (the probe raised). Needs torch, transformers and
the sources' own imports: run it in the parity venv. Exit 0 when every probe ran, 1 when one raised, 2 on bad
input.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..catalog import SOURCE_NAMES, CatalogError, Defect, copy_with_defect, load_catalog, resolve_catalog_path, \
    resolve_source


def _fresh_import_probe(source: str, package_name: str) -> Callable[[Path], dict[str, Any]]:
    """probe(copy) for one source; speculators and SpecForge are imported by name, so the copy's parent goes
    first on sys.path and the package's modules are imported afresh from it. The process's own modules of the
    package are put back afterwards: a caller that imported speculators before (the parity tests, in one pytest
    worker) keeps its classes, where a copy's SpeculatorsConfig left in sys.modules fails pydantic's
    isinstance checks on every model the caller builds later."""
    def run(copy: Path) -> dict[str, Any]:
        if source == "zlab":
            from .probe_zlab import probe as zlab_probe
            return zlab_probe(copy)

        def package_modules() -> list[str]:
            return [m for m in sys.modules if m == package_name or m.startswith(package_name + ".")]

        own = {name: sys.modules.pop(name) for name in package_modules()}
        sys.path.insert(0, str(copy.parent))
        try:
            if source == "speculators":
                from .probe_speculators import probe
            else:
                from .probe_specforge import probe
            return probe()
        finally:
            sys.path.remove(str(copy.parent))
            for name in package_modules():
                del sys.modules[name]
            sys.modules.update(own)
    return run


def _probe_copy(root: Path, package: str, defect: Defect | None, run: Callable[[Path], dict[str, Any]]):
    with tempfile.TemporaryDirectory(prefix="behaviour-") as tmp:
        copy = copy_with_defect(root, Path(tmp) / package, defect)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run(copy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream_defects.behaviour",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--catalog", default="defects.yaml", help="a path, or a file name next to defects.yaml")
    parser.add_argument("--sources", default=",".join(SOURCE_NAMES))
    parser.add_argument("--only", help="comma-separated defect ids")
    for name in SOURCE_NAMES:
        parser.add_argument(f"--{name}", metavar="PATH")
    args = parser.parse_args(argv)
    try:
        catalog = load_catalog(resolve_catalog_path(args.catalog))
        sources = [s.strip() for s in args.sources.split(",") if s.strip()]
        unknown_sources = set(sources) - set(SOURCE_NAMES)
        if unknown_sources:
            raise CatalogError(f"unknown source(s) {sorted(unknown_sources)} (known: {', '.join(SOURCE_NAMES)})")
    except (CatalogError, OSError, ValueError) as exc:
        print(f"error: {'; '.join(line.strip() for line in str(exc).splitlines() if line.strip())[:600]}",
              file=sys.stderr)
        return 2
    only = {i.strip() for i in args.only.split(",")} if args.only else None
    counts = {"changed": 0, "not exercised": 0, "error": 0}
    for source in sources:
        spec = catalog.sources[source]
        root, how = resolve_source(source, spec, getattr(args, source))
        if root is None:
            print(f"{source}: skipped ({how})")
            continue
        run = _fresh_import_probe(source, spec.package)
        defects = [d for d in catalog.for_sources([source]) if only is None or d.id in only]
        if not defects:
            continue
        try:
            base = _probe_copy(root, spec.package, None, run)
        except Exception as exc:  # the probe no longer fits this version of the source
            counts["error"] += len(defects)
            print(f"{source} (unmodified): error {type(exc).__name__}: {str(exc)[:160]}")
            continue
        for defect in defects:
            try:
                probed = _probe_copy(root, spec.package, defect, run)
            except Exception as exc:  # a defect may make the code raise: report it, keep going
                counts["error"] += 1
                print(f"{defect.id}: error {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                continue
            moved = [key for key in base if probed.get(key) != base[key]]
            counts["changed" if moved else "not exercised"] += 1
            print(f"{defect.id}: " + (f"changed ({', '.join(moved)})" if moved else "not exercised"), flush=True)
    print(", ".join(f"{k} {v}" for k, v in counts.items()))
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
