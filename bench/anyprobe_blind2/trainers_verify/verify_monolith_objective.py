"""monolith_objective: two planted defects.
  D1 dflash.context_excludes_anchor: _ctx_ok(include_anchor=True) default -> k_pos <= anchor.
  D2 dflash.target_shift: _target_index returns anchor + j (should be anchor + j - 1).
"""
import torch
from _load import load, tiny_target

M = load("monolith_objective")
torch.set_printoptions(linewidth=160)
print("== monolith_objective ==")

# ---- D1: the mask, on tiny tensors
target = tiny_target()
obj = M.DFlashObjective(target, block_size=4, gamma=4.0)
anchors = torch.tensor([[5, 9]])
T = 12
mask = obj._mask(anchors, T)[0]                                  # [N*B, T + N*B]
ctx = mask[:, :T]
a_q = anchors.repeat_interleave(4, 1)[0]
ref_ctx = torch.arange(T)[None, :] < a_q[:, None]                # intended: strictly before the anchor
print("D1 context rows of query 0 (anchor 5), code    :", ctx[0].int().tolist())
print("D1 context rows of query 0 (anchor 5), intended:", ref_ctx[0].int().tolist())
leak = (ctx & ~ref_ctx)
print("D1 entries that differ:", int((ctx != ref_ctx).sum()), "; all are the anchor's own position:",
      bool(((leak.nonzero()[:, 1]) == a_q[leak.nonzero()[:, 0]]).all()))

# effect on the loss: same seed, fixed helper patched in
ids = torch.randint(0, 110, (2, 32), generator=torch.Generator().manual_seed(3))
lm = torch.zeros(2, 32, dtype=torch.long); lm[:, 6:] = 1


def run(o):
    o.gen.manual_seed(0)
    torch.manual_seed(0)
    with torch.no_grad():
        return o(ids, lm)[0].item()


torch.manual_seed(0); o1 = M.DFlashObjective(tiny_target(), block_size=4, gamma=4.0)
loss_bug = run(o1)
orig = M.DFlashObjective._ctx_ok
o1._ctx_ok = lambda k, a: orig(k, a, include_anchor=False)
loss_fix_d1 = run(o1)
print(f"D1 loss as written {loss_bug:.6f}  with strict '<' mask {loss_fix_d1:.6f}  diff {loss_bug - loss_fix_d1:+.2e}")

# ---- D2: the label index
anc = torch.tensor([[5, 9]])
idx_code = obj._target_index(anc)[0]
idx_ref = anc[0][:, None] + torch.arange(4) - 1
print("D2 target index, code    :", idx_code.tolist())
print("D2 target index, intended:", idx_ref.tolist())
# what those indices mean: pred[t] is the target's choice for token t+1
with torch.no_grad():
    pred = target(input_ids=ids[:1]).logits.argmax(-1)[0]
lab_code = pred[idx_code]
lab_ref = pred[idx_ref]
print("D2 slot-1 label, code: token predicted for position", (idx_code[:, 1] + 1).tolist(),
      "(should be", (anc[0] + 1).tolist(), ")")
print("D2 labels code    :", lab_code.tolist())
print("D2 labels intended:", lab_ref.tolist())
o1._ctx_ok = lambda k, a: orig(k, a, include_anchor=False)
o1._target_index = lambda a: a[..., None] + torch.arange(4) - 1
loss_fix_both = run(o1)
print(f"D2 loss with strict mask, as-written shift {loss_fix_d1:.6f}  fixed shift {loss_fix_both:.6f}  "
      f"diff {loss_fix_d1 - loss_fix_both:+.2e}")
print("RESULT monolith_objective D1 context_excludes_anchor:", "CONFIRMED" if (ctx != ref_ctx).any() else "NOT REPRODUCED")
print("RESULT monolith_objective D2 target_shift:", "CONFIRMED" if (idx_code != idx_ref).any() else "NOT REPRODUCED")
