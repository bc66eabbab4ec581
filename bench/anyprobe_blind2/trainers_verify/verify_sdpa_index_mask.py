"""sdpa_index_mask: one planted defect.
  D5 dflash.blocks_isolated: slot_tables builds blk with .repeat(B) (tiles 0..n-1) instead of
     .repeat_interleave(B); the in-block part of the SDPA mask then links queries of different blocks.
"""
import torch
import torch.nn.functional as F
from _load import load

M = load("sdpa_index_mask")
print("== sdpa_index_mask ==")
B, T = 4, 16
anc = torch.tensor([[3, 6, 8, 11]])
n = anc.shape[1]
allow, q_ix, kv_ix, slot = M.build_allow(anc, T, B)
allow = allow[0, 0]

# element-wise reference (python loop): query (a, j) sees ctx k < a, and block keys of its own block
Q = n * B
ref = torch.zeros(Q, T + Q, dtype=torch.bool)
for qb in range(n):
    for qj in range(B):
        q = qb * B + qj
        for k in range(T):
            ref[q, k] = k < anc[0, qb]
        for kb in range(n):
            for kj in range(B):
                ref[q, T + kb * B + kj] = kb == qb
blk_code, _ = M.slot_tables(n, B)
print("D5 blk as built :", blk_code.tolist())
print("D5 blk intended :", torch.arange(n).repeat_interleave(B).tolist())
print("D5 context part equal to reference:", torch.equal(allow[:, :T], ref[:, :T]))
blkpart, refblk = allow[:, T:], ref[:, T:]
print("D5 block part equal to reference  :", torch.equal(blkpart, refblk))
cross = blkpart & ~refblk
missing = refblk & ~blkpart
print(f"D5 cross-block entries allowed: {int(cross.sum())}, own-block entries hidden: {int(missing.sum())} (of {int(refblk.sum())})")
print("D5 block-part of query 0 (block 0, slot 0), code:", blkpart[0].int().tolist())
print("D5 block-part of query 0 (block 0, slot 0), ref :", refblk[0].int().tolist())
print("D5 position ids q_ix (unaffected):", q_ix[0].tolist())

# effect on attention output with random q/k/v
g = torch.Generator().manual_seed(0)
q = torch.randn(1, 2, Q, 8, generator=g); k = torch.randn(1, 2, T + Q, 8, generator=g); v = torch.randn(1, 2, T + Q, 8, generator=g)
o_code = F.scaled_dot_product_attention(q, k, v, attn_mask=allow[None, None])
o_ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref[None, None])
print(f"D5 max |attn(code mask) - attn(reference mask)| = {(o_code - o_ref).abs().max():.4f}")
# and the fixed helper reproduces the reference exactly
orig = M.slot_tables
M.slot_tables = lambda n_blk, B: (torch.arange(n_blk).repeat_interleave(B), torch.arange(B).repeat(n_blk))
allow_fix = M.build_allow(anc, T, B)[0][0, 0]
M.slot_tables = orig
print("D5 with repeat_interleave the mask equals the reference:", torch.equal(allow_fix, ref))
print("RESULT sdpa_index_mask D5 blocks_isolated:", "CONFIRMED" if int(cross.sum()) > 0 else "NOT REPRODUCED")
