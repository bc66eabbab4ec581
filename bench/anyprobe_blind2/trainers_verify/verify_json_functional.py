"""json_functional: two planted defects.
  D3 dflash.loss_decay_gamma: slot_weights reads loss.decay_gamma (default 1.0); dflash.json sets loss.gamma = 7.
  D4 dflash.target_layer_ids: tap_features takes hidden_states[i] (output of layer i-1), not hidden_states[i+1].
"""
import json
import math
import os

import torch
from _load import ROOT, layer_outputs, load, tiny_target

M = load("json_functional")
print("== json_functional ==")
cfg = json.load(open(os.path.join(ROOT, "json_functional", "dflash.json")))
B = cfg["draft"]["block_size"]

# ---- D3
w_code = M.slot_weights(cfg["loss"], B)
g = cfg["loss"]["gamma"]
w_ref = torch.tensor([0.0] + [math.exp(-(k - 1) / g) for k in range(1, B)])
print(f"D3 config loss section: {cfg['loss']}")
print("D3 weights as computed :", [round(x, 4) for x in w_code.tolist()], "(= gamma 1.0)")
print(f"D3 weights for gamma {g}:", [round(x, 4) for x in w_ref.tolist()])
# normalised share of the last slot in the loss
print(f"D3 share of slot {B-1} in the normalised loss: code {w_code[-1]/w_code.sum():.3f} vs intended {w_ref[-1]/w_ref.sum():.3f}")
valid = torch.ones(1, B)
logits = torch.randn(1, B, 7, generator=torch.Generator().manual_seed(0))
labels = torch.tensor([[1, 2, 3, 4, 5]])
l_code = M.dflash_loss(logits, labels, valid, w_code)
l_ref = M.dflash_loss(logits, labels, valid, w_ref)
print(f"D3 dflash_loss on a fixed tiny block: code {l_code:.5f} vs intended {l_ref:.5f}")

# ---- D4
t = cfg["target"]
ids_l = M.resolve_layer_ids(t["num_hidden_layers"], t["num_taps"])
model = tiny_target(layers=t["num_hidden_layers"], hidden=t["hidden_size"], vocab=t["vocab_size"],
                    heads=t["num_attention_heads"], kv=t["num_key_value_heads"], hd=t["head_dim"])
ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(1))
outs, res = layer_outputs(model, ids)
code = M.tap_features(res.hidden_states, ids_l)
ref = torch.cat([outs[i] for i in ids_l], -1)                     # output of decoder layer i
shifted = torch.cat([outs[i - 1] if i > 0 else res.hidden_states[0] for i in ids_l], -1)
print("D4 layer ids:", ids_l)
print(f"D4 max|code - output of layers {ids_l}|       = {(code - ref).abs().max():.4f}")
print(f"D4 max|code - output of layers {[i-1 for i in ids_l]}| = {(code - shifted).abs().max():.2e}  (code taps one layer early)")
print(f"D4 max|hidden_states[i+1] - output of layer i| = {(torch.cat([res.hidden_states[i+1] for i in ids_l], -1) - ref).abs().max():.2e}")
print("RESULT json_functional D3 loss_decay_gamma:", "CONFIRMED" if not torch.allclose(w_code, w_ref) else "NOT REPRODUCED")
print("RESULT json_functional D4 target_layer_ids:", "CONFIRMED" if (code - ref).abs().max() > 1e-3 else "NOT REPRODUCED")

# not a defect: dflash_loss tiles the slot weights with w.repeat(N); the flattened block layout is
# block-major (index n*B + j), so slot = index % B and tiling is the right broadcast here.
w = M.slot_weights({"decay_gamma": 7.0}, B)
N = 3
tiled = w.repeat(N)
per_index = torch.stack([w[t % B] for t in range(N * B)])
print("note: w.repeat(N) == w[index % B] for the block-major layout:", torch.equal(tiled, per_index))
