import importlib.util
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainers")


def load(name):
    path = os.path.join(ROOT, name, "train.py")
    spec = importlib.util.spec_from_file_location(f"trainer_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_target(layers=8, hidden=48, vocab=112, heads=4, kv=2, hd=12, seed=0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      head_dim=hd, max_position_embeddings=256, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def layer_outputs(model, ids):
    """Output of every decoder layer, captured with forward hooks (ground truth for layer ids)."""
    import torch
    outs = []
    hooks = [l.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for l in model.model.layers]
    with torch.no_grad():
        res = model(input_ids=ids, output_hidden_states=True)
    for h in hooks:
        h.remove()
    return outs, res
