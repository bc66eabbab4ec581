"""sleuth's observer, installed before the user's code runs (Python imports `sitecustomize` at start-up).

Only where sleuth asked for it (SLEUTH_OBSERVE_ANSWER names the answer file): the launcher and anything else
that starts Python without it is left alone.
"""

import os

if os.environ.get("SLEUTH_OBSERVE_ANSWER"):
    from sleuth.observe.observer import install

    install()
