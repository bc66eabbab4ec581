#!/usr/bin/env bash
# The whole story on the embedded target, in one command (`make demo`):
#   build the target, train the seed's history (v3, v5, v6, fixed), then let sleuth diagnose v5.
# Completed runs are kept and skipped; a run that was killed resumes from its last checkpoint.
set -euo pipefail
RUNS="${RUNS:-runs}"
BIN="${BIN:-.venv/bin}"
STEPS="${DEMO_STEPS:-}"
mkdir -p "$RUNS"

echo "== building the embedded target (once; about a minute)"
"$BIN/trainer" target build >/dev/null

# Trains one preset into $RUNS/<preset>, or resumes it, or skips it when it is complete.
train() {
  local preset="$1" state
  # "none": never started; anything else but "completed" (a run killed at any point) resumes.
  state=$("$BIN/python" -c '
import json, os, sys
run = sys.argv[1]
try:
    print(json.load(open(os.path.join(run, "run.json"))).get("status", "running"))
except (OSError, ValueError):
    print("running" if os.path.exists(os.path.join(run, "config.json")) else "none")' "$RUNS/$preset")
  local steps=()
  [ -n "$STEPS" ] && steps=(--steps "$STEPS")
  case "$state" in
    completed) echo "== $preset: already trained ($RUNS/$preset)" ;;
    none)      "$BIN/trainer" run --preset "$preset" --runs-dir "$RUNS" --quiet "${steps[@]}" ;;
    *)         echo "== resuming $preset"; "$BIN/trainer" run "$preset" --resume --runs-dir "$RUNS" --quiet "${steps[@]}" ;;
  esac
}

# Two runs at a time with one thread each: on small CPU models that beats one run on every core.
# v3 is trained first so that it is the earlier run v5 is compared with.
echo "== training v3 and v5, then v6 and fixed (progress: trainer runs --runs-dir $RUNS)"
for pair in "v3 v5" "v6 fixed"; do
  pids=()
  for preset in $pair; do
    OMP_NUM_THREADS=1 train "$preset" &
    pids+=($!)
    sleep 1  # created timestamps in order: the first of a pair is the earlier run
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
done

echo
"$BIN/trainer" runs --runs-dir "$RUNS"
echo
echo "== sleuth diagnose --run v5"
# Exit 1 means "mismatches found": the expected outcome here, not a failure of the demo.
"$BIN/sleuth" diagnose --run v5 --runs-dir "$RUNS" --offline || [ $? -eq 1 ]
echo
echo "next: $BIN/trainer run --fixed --from v5 --runs-dir $RUNS   (trains sleuth's fix into the next vN)"
