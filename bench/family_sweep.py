"""Every causal-LM family transformers maps, through the trainer's target path: trains exactly or says why.

A survey, not a test. For each model type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES its default
config is shrunk (the SMALL fields it has: 4 layers of width 32, 2 heads ...) and a random model of it saved
with save_pretrained; then, as a run and `trainer eval` would: FrozenTarget.load, the fidelity check
(choose_packing), the drafter from the target's config, and a lossless speculative eval (one 12-token
prompt, 8 new tokens, block 4, an untrained 1-layer drafter). Each family ends in one of

    OK       the fidelity check passed and the decoding equals greedy decoding
    REFUSED  a one-line TargetError / EvalError at that stage (what a user sees, exit 2)
    INTERNAL anything else: a bug to fix (the trainer's own `internal error`)
    SKIP     the shrunken config or model could not be built (the survey's limit, not the trainer's: some
             families validate sizes this generic shrinking breaks), or building took over 60 s

    PYTHONPATH=. python bench/family_sweep.py [MODEL_TYPE ...]
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

SMALL = dict(
    hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
    head_dim=16, max_position_embeddings=512, n_embd=32, n_layer=4, n_head=2, d_model=32,
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    tie_word_embeddings=False, sliding_window=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_head_dim=8, linear_num_heads=2, shared_expert_intermediate_size=32,
    mamba_n_heads=4, mamba_d_state=8, mamba_d_head=16, n_group=1, topk_group=1, first_k_dense_replace=1,
)
BUILD_SECONDS = 60


class _Timeout(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Timeout()


def build(model_type: str, tokenizer, directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type)
    text = config.get_text_config()
    present = text.to_dict()
    for key, value in {**SMALL, "vocab_size": len(tokenizer) + 8}.items():
        if key in present:
            try:
                setattr(text, key, value)
            except Exception:  # a strict field refusing this value: keep the family's own
                pass
    if getattr(text, "layer_types", None) is not None and len(text.layer_types) != text.num_hidden_layers:
        text.layer_types = (list(text.layer_types) * text.num_hidden_layers)[:text.num_hidden_layers]
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if hasattr(text, key):
            setattr(text, key, getattr(tokenizer, key))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def through_the_trainer(directory: Path) -> str:
    from trainer.eval.speculative import evaluate
    from trainer.model.drafter import DFlashDrafter
    from trainer.target.fidelity import check_lengths, choose_packing, token_stream
    from trainer.target.frozen import FrozenTarget

    target = FrozenTarget.load(str(directory), torch.device("cpu"))
    lead, document = check_lengths(target, 48)
    record = choose_packing(target, token_stream([list(range(10, 200))], lead + document), lead)
    drafter = DFlashDrafter.from_target_config(target.model.config, num_layers=1, num_features=1, block_size=4,
                                               mask_token_id=target.mask_token_id)
    report = evaluate(drafter, target, [list(range(20, 32))], feature_layer_ids=[min(1, target.num_layers - 1)],
                      block_size=4, max_new_tokens=8, measure_speedup=False, stop_token_ids=[])
    verdict = "OK" if record.passed and report.lossless else "WRONG"
    return (f"{verdict} packing {record.packing}, max diff "
            f"{max(record.max_abs_hidden_diff, record.max_abs_logit_diff):.1e}, lossless {report.lossless}, "
            f"rollback {getattr(report, 'target_rollback', 'crop (before issue 23)')}")


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from trainer.eval.speculative import EvalError
    from trainer.target.embedded import build_embedded_tokenizer
    from trainer.target.frozen import TargetError

    torch.set_num_threads(1)
    tokenizer = build_embedded_tokenizer(small=True)
    signal.signal(signal.SIGALRM, _alarm)
    wanted = set(sys.argv[1:])
    outcomes: Counter[str] = Counter()
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if wanted and model_type not in wanted:
            continue
        # One directory per family, removed after it: the sweep saves ~300 families of up to 4 GB each, and
        # keeping them filled the disk of the machine CI ran on next.
        with tempfile.TemporaryDirectory(prefix="family-sweep-") as scratch:
            directory = Path(scratch) / model_type
            signal.alarm(BUILD_SECONDS)
            try:
                build(model_type, tokenizer, directory)
            except BaseException as exc:  # the survey's own shrinking, or a family that needs more (timm ...)
                line = f"SKIP ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
            else:
                signal.alarm(0)
                started = time.perf_counter()
                try:
                    line = through_the_trainer(directory) + f" ({time.perf_counter() - started:.1f} s)"
                except (TargetError, EvalError) as exc:
                    line = f"REFUSED {exc}"
                except Exception as exc:
                    line = f"INTERNAL {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            finally:
                signal.alarm(0)
        outcomes[line.split()[0]] += 1
        print(f"{model_type}: {line}", flush=True)
    print(dict(outcomes))


if __name__ == "__main__":
    main()
