"""sleuth's observer, installed before the user's code runs (Python imports `sitecustomize` at start-up).

Only where sleuth asked for it (SLEUTH_OBSERVE_ANSWER names the answer file): the launcher and anything else
that starts Python without it is left alone. An environment's own sitecustomize, which this file shadows by
coming first on PYTHONPATH, is run after it, as it would have run without sleuth.
"""

import os
import sys


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("SLEUTH_OBSERVE_ANSWER"):
    from sleuth.observe.observer import install

    install()
_chain()
