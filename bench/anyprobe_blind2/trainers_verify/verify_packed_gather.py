"""packed_gather (CLEAN): its unusual rewrites compute the same as the plain versions.
  S1 layer ids via torch.linspace(1, L-3, k).round()   == round(1 + i*(L-4)/(k-1))
  S2 context mask  same_doc & ~(k >= a)                == element-wise loop: same doc and k < a
  S3 doc id by bucketize(cu[1:], right=True), pos_in_doc by gather   == python loop
  S4 slot 0 removed by subtracting its term            == weights with w[0] = 0
  S5 labels pr.gather(g_ix - 1) on per-document logits == argmax of each document's logits at anchor+j-1
"""
import torch
import torch.nn.functional as F
from _load import load, tiny_target

M = load("packed_gather")
print("== packed_gather (clean) ==")
ok = {}

# S1
mism = []
for L in range(5, 97):
    for k in range(2, 9):
        plain = [round(1 + i * (L - 4) / (k - 1)) for i in range(k)]
        if M.select_layers(L, k) != plain:
            mism.append((L, k, M.select_layers(L, k), plain))
print("S1 (8,3):", M.select_layers(8, 3), "(64,5):", M.select_layers(64, 5), "(36,5):", M.select_layers(36, 5))
print(f"S1 mismatches over L=5..96, k=2..8: {len(mism)}", mism[:3])
ok["S1 layer ids"] = not mism and M.select_layers(8, 3) == [1, 3, 5] and M.select_layers(64, 5) == [1, 16, 31, 46, 61]
if mism:
    print("S1 note: equal for the trainer's config (8,3) but not for every (L,k): see mismatches above")

# S2 + S3
cu = torch.tensor([0, 7, 12, 20])
T, B, mask_id = 20, 3, 99
ids = torch.arange(T) + 10
sup = torch.ones(T, dtype=torch.long)
row = M.Packed(ids, sup, cu)
anchors = torch.tensor([2, 8, 14])
tok, q_pos, k_pos, allow, g_ix = M.row_inputs(row, anchors, B, mask_id)
doc_ref = torch.tensor([next(d for d in range(3) if cu[d] <= t < cu[d + 1]) for t in range(T)])
pid_ref = torch.tensor([t - cu[doc_ref[t]] for t in range(T)])
print("S3 doc ids   :", M.doc_index(cu, T).tolist())
print("S3 pos_in_doc:", M.pos_in_doc(cu, T).tolist())
ok["S3 doc/pos"] = torch.equal(M.doc_index(cu, T), doc_ref) and torch.equal(M.pos_in_doc(cu, T), pid_ref)
Q = anchors.numel() * B
ref = torch.zeros(Q, T + Q, dtype=torch.bool)
for qb, a in enumerate(anchors.tolist()):
    for j in range(B):
        q = qb * B + j
        for kk in range(T):
            ref[q, kk] = doc_ref[kk] == doc_ref[a] and kk < a
        for kb in range(anchors.numel()):
            for jj in range(B):
                ref[q, T + kb * B + jj] = kb == qb
print("S2 mask == loop reference:", torch.equal(allow, ref), "| plain (k < a) form equal:",
      torch.equal(allow[:, :T], (doc_ref[None] == doc_ref[anchors.repeat_interleave(B)][:, None]) &
                  (torch.arange(T)[None] < anchors.repeat_interleave(B)[:, None])))
print("S2 row of anchor 8 (doc 1 spans 7..11):", allow[B, :T].int().tolist())
ok["S2 mask"] = torch.equal(allow, ref)
qpos_ref = torch.tensor([pid_ref[a] + j for a in anchors.tolist() for j in range(B)])
print("S2 block positions:", q_pos.tolist(), "== anchor_in_doc + j:", torch.equal(q_pos, qpos_ref))
ok["S2 positions"] = torch.equal(q_pos, qpos_ref) and torch.equal(k_pos[:T], pid_ref)

# S4
g = torch.Generator().manual_seed(0)
N, V, gamma = 3, 11, 4.0
logits = torch.randn(N * B, V, generator=g)
labels = torch.randint(0, V, (N * B,), generator=g)
valid = torch.tensor([1., 1, 1, 1, 0, 1, 1, 1, 1])
code = M.weighted_block_ce(logits, labels, valid, B, gamma)
w = torch.tensor([0.0] + [torch.exp(torch.tensor(-(k - 1) / gamma)).item() for k in range(1, B)]).repeat(N) * valid
plain = (w * F.cross_entropy(logits, labels, reduction="none")).sum() / w.sum()
print(f"S4 subtract-slot-0 loss {code:.7f}  masked-weights loss {plain:.7f}  |diff| {abs(code - plain):.1e}")
ok["S4 slot0"] = torch.allclose(code, plain, atol=1e-6)

# S5
model = tiny_target(layers=8, hidden=32, vocab=120, heads=4, kv=2, hd=8)
ids = torch.randint(0, 119, (T,), generator=g)
with torch.no_grad():
    pr = torch.cat([model(input_ids=ids[None, s:e]).logits[0].argmax(-1) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    per_doc = [model(input_ids=ids[None, s:e]).logits[0] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
lab_code = pr.gather(0, (g_ix - 1).clamp_min(0)).view(N, B)[:, 1:]
lab_ref = torch.tensor([[per_doc[doc_ref[a]][pid_ref[a] + j - 1].argmax().item() for j in range(1, B)] for a in anchors.tolist()])
print("S5 labels code:", lab_code.tolist(), " reference:", lab_ref.tolist())
ok["S5 labels"] = torch.equal(lab_code, lab_ref)
for k_, v_ in ok.items():
    print(f"RESULT packed_gather {k_}: {'EQUIVALENT' if v_ else 'DIFFERENT'}")
