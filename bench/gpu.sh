#!/usr/bin/env bash
# GPU benchmark and parity, for a lent CUDA machine, in one call of at most 8 minutes:
#   1. parity with speculators on the flex-attention paths, float32 (bench/gpu_parity.py);
#   2. training-step throughput, bf16, ours (flex BlockMask + compiled flex_attention) against speculators
#      (simple_flex_attention, its compiled forward) in the same process: tokens/s, peak memory, model FLOPs
#      utilisation against the bf16 dense peak (989 TFLOPS on H100/H200; --peak-tflops otherwise);
#   3. real vocabularies (32k / 152k / 248k): the step, and the loss path alone over V x A*B (bench/loss_memory.py),
#      against speculators' fused Triton loss: time and peak memory (CPU tables: BENCHMARKS.md, eager loss);
#      the same for the current recipe (D-PACE + Muon), and offline hidden states against the online target.
#   4. with two or more GPUs: the target sharded over them (target_parallelism: fsdp2) against the whole target
#      on every rank, and FSDP2 with Muon: a short torchrun training run each, metrics rows (loss, tokens/s)
#      and run.json's target_sharding record copied to the results.
# FSDP2 and target sharding need two GPUs (NCCL refuses two ranks on one device); with one they are covered
# by the CPU/gloo tests (tests/trainer/test_distributed.py) and step 4 writes why it was skipped.
# The machine reaches no network: PYTHON must already have torch (CUDA), transformers and, for the
# comparison, speculators 0.9.0 (pip install speculators==0.9.0 where a network exists). Without
# speculators, step 1 is skipped and step 2 times ours alone.
#   bash bench/gpu.sh                       # writes bench-gpu/*.json|txt (or $OUT if set)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
RESULTS="${OUT:-bench-gpu}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
deadline() { timeout --signal=INT "$@"; }

{
    date -u
    nvidia-smi -L || true
    "$PYTHON" - <<'PY'
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "speculators"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "NOT INSTALLED")
PY
} 2>&1 | tee "$RESULTS/env.txt"

HAVE_SPECULATORS=0
"$PYTHON" -c "import speculators.models.dflash.core" 2>/dev/null && HAVE_SPECULATORS=1

if [ "$HAVE_SPECULATORS" = 1 ]; then
    echo "== parity on CUDA (flex paths, float32)"
    deadline 150 "$PYTHON" bench/gpu_parity.py 2>&1 | grep -v Warning | tee "$RESULTS/gpu_parity.txt"
else
    echo "== speculators not importable: parity skipped, throughput times ours alone" | tee "$RESULTS/gpu_parity.txt"
fi

echo "== training step, bf16 (medium, then large)"
deadline 140 "$PYTHON" bench/train_step.py --device cuda --dtype bfloat16 --sizes medium --repeats 20 --warmup 3 \
    --json "$RESULTS/train_step_medium.json" 2>&1 | grep -v Warning | tee "$RESULTS/train_step_medium.txt"
deadline 170 "$PYTHON" bench/train_step.py --device cuda --dtype bfloat16 --sizes large --repeats 20 --warmup 3 \
    --json "$RESULTS/train_step_large.json" 2>&1 | grep -v Warning | tee "$RESULTS/train_step_large.txt"
if [ "$HAVE_SPECULATORS" = 1 ]; then
    echo "== real vocabularies: the step at V 32k / 152k / 248k, bf16, against speculators' fused loss (Triton)"
    deadline 150 "$PYTHON" bench/train_step.py --device cuda --dtype bfloat16 --sizes medium --vocab 32768,151936,248320 \
        --speculators-loss fused --repeats 10 --warmup 3 --json "$RESULTS/train_step_vocab.json" 2>&1 | grep -v Warning \
        | tee "$RESULTS/train_step_vocab.txt"
    echo "== the loss path alone, V x A*B, bf16, against speculators' fused loss"
    deadline 120 "$PYTHON" bench/loss_memory.py --device cuda --dtype bfloat16 --speculators-loss fused \
        --slots 2048,8192,32768 --max-gib 60 --json "$RESULTS/loss_memory.json" 2>&1 | grep -v Warning \
        | tee "$RESULTS/loss_memory.txt"
fi
echo "== the current recipe (D-PACE + Muon/AdamW on both sides), bf16, medium"
deadline 120 "$PYTHON" bench/train_step.py --device cuda --dtype bfloat16 --sizes medium --repeats 20 --warmup 3 \
    --recipe recipe-2026 --json "$RESULTS/train_step_recipe.json" 2>&1 | grep -v Warning | tee "$RESULTS/train_step_recipe.txt"
echo "== offline hidden states vs the target run online, bf16 (embedded target, or TARGET=DIR)"
deadline 90 "$PYTHON" bench/offline_step.py --device cuda --dtype bfloat16 --target "${TARGET:-embedded}" \
    --seq-len 1024 --batch-size 8 2>&1 | grep -v Warning | tee "$RESULTS/offline_step.txt"
echo "== sharded target and FSDP2 + Muon under torchrun (needs >= 2 GPUs)"
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -ge 2 ]; then
    SHARD_CFG="$RESULTS/shard_config.json"
    cat > "$SHARD_CFG" <<JSON
{"target": "${TARGET:-embedded}", "seq_len": 1024, "batch_size": $((GPUS * 4)), "steps": 20, "log_every": 5,
 "warmup_steps": 2, "eval_every": null, "eval_prompts": 2, "eval_max_new_tokens": 16, "checkpoint_every": 20,
 "dtype": "bfloat16"}
JSON
    for variant in "none ddp adamw" "fsdp2 ddp adamw" "fsdp2 fsdp2 muon"; do
        set -- $variant
        name="shard-$1-$2-$3"
        rm -rf "$RESULTS/runs/$name"
        deadline 100 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$GPUS" -m trainer.cli run "$name" \
            --config "$SHARD_CFG" --set target_parallelism="$1" --set parallelism="$2" --set optimizer="$3" \
            --runs-dir "$RESULTS/runs" --device cuda --quiet 2>&1 | grep -v Warning | tail -5
        cp "$RESULTS/runs/$name/metrics.jsonl" "$RESULTS/$name.metrics.jsonl" 2>/dev/null
        "$PYTHON" -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1])).get('target_sharding')))" \
            "$RESULTS/runs/$name/run.json" > "$RESULTS/$name.sharding.json" 2>/dev/null
        rm -rf "$RESULTS/runs/$name/checkpoints"
    done 2>&1 | tee "$RESULTS/sharded_target.txt"
else
    echo "only ${GPUS:-0} GPU(s): target sharding and FSDP2 need >= 2 (covered by the CPU/gloo tests)" \
        | tee "$RESULTS/sharded_target.txt"
fi
date -u | tee -a "$RESULTS/env.txt"
