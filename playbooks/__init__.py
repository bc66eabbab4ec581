"""Playbooks are data, not code: `dflash.yaml` holds the invariants sleuth checks, and `references/` the
reference implementations it fetches. This file only makes them ship inside the wheel next to `sleuth`."""
