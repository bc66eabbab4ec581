"""Invariants: playbooks as data, and the engine that checks a run against them.

    load_playbook(name_or_path="dflash") -> Playbook
    check_invariants(playbook, *, reference, config, config_source, checkpoint, code, trace) -> list[Finding]
"""

from sleuth.invariants.engine import check_invariants
from sleuth.invariants.playbook import Invariant, Playbook, PlaybookError, load_playbook, playbooks_dir

__all__ = ["Invariant", "Playbook", "PlaybookError", "check_invariants", "load_playbook", "playbooks_dir"]
