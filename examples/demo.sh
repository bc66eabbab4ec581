#!/usr/bin/env bash
# The whole story on the embedded target, in one command (`make demo`):
#   build the target, train the seed's history (v3, v5, v6, fixed), then let sleuth diagnose v5.
# Completed runs are kept and skipped; a run that was killed resumes from its last checkpoint.
set -euo pipefail
RUNS="${RUNS:-runs}"
BIN="${BIN:-.venv/bin}"
STEPS="${DEMO_STEPS:-}"

"$BIN/trainer" target build >/dev/null

train() {
  local preset="$1"
  local state
  state=$("$BIN/python" - "$RUNS/$preset/run.json" <<'PY'
import json, sys
try:
    print(json.load(open(sys.argv[1])).get("status", "none"))
except (OSError, ValueError):
    print("none")
PY
)
  local steps=()
  [ -n "$STEPS" ] && steps=(--steps "$STEPS")
  case "$state" in
    completed) echo "== $preset: already trained ($RUNS/$preset)" ;;
    none)      echo "== training $preset"; "$BIN/trainer" run --preset "$preset" --runs-dir "$RUNS" "${steps[@]}" ;;
    *)         echo "== resuming $preset"; "$BIN/trainer" run "$preset" --resume --runs-dir "$RUNS" "${steps[@]}" ;;
  esac
}

for preset in v3 v5 v6 fixed; do train "$preset"; done

echo
"$BIN/trainer" runs --runs-dir "$RUNS"
echo
echo "== sleuth diagnose --run v5"
# Exit 1 means "mismatches found": that is the expected outcome here, not a failure of the demo.
"$BIN/sleuth" diagnose --run v5 --runs-dir "$RUNS" --offline || [ $? -eq 1 ]
