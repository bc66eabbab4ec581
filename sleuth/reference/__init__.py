"""Reference implementations as data, resolved with provenance: `resolve_reference("speculators")`.

Tiers, in order: local checkout -> git-pull -> raw.githubusercontent.com -> docs pages -> pinned facts.
Importing this package is cheap: git, httpx and platformdirs are imported only when a tier runs.
"""

from sleuth.reference.chain import resolve_reference
from sleuth.reference.model import SOURCE_TIERS, TIERS, Attempt, ReferenceError, Resolution, ResolvedFile
from sleuth.reference.playbook import ReferenceSpec, known_references, load_reference_spec

__all__ = [
    "SOURCE_TIERS",
    "TIERS",
    "Attempt",
    "ReferenceError",
    "ReferenceSpec",
    "Resolution",
    "ResolvedFile",
    "known_references",
    "load_reference_spec",
    "resolve_reference",
]
