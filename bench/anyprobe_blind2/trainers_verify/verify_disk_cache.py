"""disk_cache (CLEAN): its unusual rewrites compute the same as the plain versions.
  S1 taps via hidden_states[i - L] (negative index)   == hidden_states[i + 1] == output of decoder layer i
  S2 labels via torch.roll(argmax, 1) gathered at p+j == argmax(logits[p + j - 1])
  S3 DecayedBlockCE: torch.pow(e^{-1/gamma}, k-1), slot 0 -> 0  == exp(-(k-1)/gamma), w0 = 0; loss == plain mean
  S4 context mask (a - k) > 0                         == k < a
  S5 cross_entropy on transposed [b, V, B, N] logits   == flat cross_entropy
"""
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from _load import layer_outputs, load, tiny_target

M = load("disk_cache")
print("== disk_cache (clean) ==")
ok = {}
L, k_taps = 8, 5
lids = M.taps_for(L, k_taps)
model = tiny_target(layers=L, hidden=32, vocab=128, heads=4, kv=1, hd=8)
ids = torch.randint(0, 127, (2, 34), generator=torch.Generator().manual_seed(0))
outs, res = layer_outputs(model, ids)

# run the real cache writer on this model and read the .pt back
cfg = dict(M.DEFAULTS, mask_token_id=127, target_layer_ids=lids, n_batches=1)
tmp = tempfile.mkdtemp(dir=os.environ.get("TMPDIR"))
model.save_pretrained(os.path.join(tmp, "t"))
M.write_cache(cfg, os.path.join(tmp, "t"), os.path.join(tmp, "cache"))
cached = torch.load(os.path.join(tmp, "cache", "batch_0000.pt"))
outs, res = layer_outputs(model, cached["ids"])
ref_taps = torch.cat([outs[i] for i in lids], -1)
print("S1 layer ids:", lids, f"| max|cached taps - outputs of layers {lids}| = {(cached['taps'] - ref_taps).abs().max():.1e}")
print("S1 negative indices used:", [i - L for i in lids], "-> hidden_states index", [(i - L) % (L + 1) for i in lids])
ok["S1 taps"] = torch.allclose(cached["taps"], ref_taps, atol=1e-6)

# S2 via block_batch (the trainer's own function)
gen = torch.Generator().manual_seed(5)
tok, blk_pos, allow, labels, valid, (b, N) = M.block_batch(cached, 4, 5, 127, gen)
anc = blk_pos.view(b, N, 4)[..., 0]
pred = res.logits.argmax(-1)
lab_ref = torch.stack([torch.stack([pred[r, anc[r] + j - 1] for j in range(4)], -1) for r in range(b)])
print("S2 anchors row0:", anc[0].tolist(), "| labels slots1..3 row0 code:", labels[0, :, 1:].tolist())
print("S2                                 reference:", lab_ref[0, :, 1:].tolist())
ok["S2 shift"] = torch.equal(labels[..., 1:], lab_ref[..., 1:])

# S4
T = cached["ids"].shape[1]
a_q = anc.repeat_interleave(4, 1)
plain_ctx = torch.arange(T)[None, None] < a_q[..., None]
print("S4 context mask equal to k < a:", torch.equal(allow[..., :T], plain_ctx),
      "| row of anchor", anc[0, 0].item(), ":", allow[0, 0, :T].int().tolist())
bid = torch.arange(N).repeat_interleave(4)
ok["S4 mask"] = torch.equal(allow[..., :T], plain_ctx) and torch.equal(allow[0, :, T:], bid[:, None] == bid[None])

# S3 + S5
gamma = 5.0
crit = M.DecayedBlockCE(4, gamma)
w_ref = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, 4)])
print("S3 weights pow:", [round(x, 6) for x in crit.w.tolist()], " exp:", [round(x, 6) for x in w_ref.tolist()])
g = torch.Generator().manual_seed(1)
logits = torch.randn(2, 3, 4, 9, generator=g)
lab = torch.randint(0, 9, (2, 3, 4), generator=g)
val = (torch.rand(2, 3, 4, generator=g) > 0.2).float()
code = crit(logits, lab, val)
ce = F.cross_entropy(logits.reshape(-1, 9), lab.reshape(-1), reduction="none").view(2, 3, 4)
w = w_ref * val
plain = (ce * w).sum() / w.sum()
print(f"S3/S5 loss code {code:.7f} plain {plain:.7f} |diff| {abs(code - plain):.1e}")
ok["S3 weights"] = torch.allclose(crit.w, w_ref, atol=1e-6)
ok["S5 loss"] = torch.allclose(code, plain, atol=1e-6)
for k_, v_ in ok.items():
    print(f"RESULT disk_cache {k_}: {'EQUIVALENT' if v_ else 'DIFFERENT'}")
