"""The code detectors, one module per area of the rules; importing this package registers them all.

Each detector is `@detector("<invariant id>")` over the analysis kit (sleuth/evidence/ast_index.py and
sleuth/evidence/origins.py) and returns the readings it found: every site it saw, agreeing or not.
"""

from sleuth.evidence.detectors import attention, fusion, layers, loss, targets  # noqa: F401 - registers them
