"""One rank of the tensor-parallel target check (run by test_tensor_parallel.py, two processes).

Each rank holds half of the query heads (and their sinks), runs sparse attention on them, and
sums ``sparse_attention_probs`` over the ranks with ``all_reduce``: that must be the target of
the full-head run, and the KL loss computed from it the full-head loss. Prints one JSON line.
"""

import json
import sys

import torch
import torch.distributed as dist
from dsa_indexer import indexer_kl_loss
from dsa_sparse_attention import sparse_attention, sparse_attention_probs
from kernel_common.testing import rel_diff


def main(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)  # every rank draws the same full inputs
    s, heads, d, d_v, topk = 24, 8, 80, 64, 6
    q = torch.randn(1, s, heads, d, generator=gen).bfloat16()
    kv = torch.randn(1, s, 1, d, generator=gen).bfloat16()
    sink = torch.randn(heads, generator=gen)
    ends = torch.arange(1, s + 1)
    idx = torch.stack([torch.randperm(s, generator=gen)[:topk] for _ in range(s)])
    idx = torch.where(idx < ends[:, None], idx, -1).int()[None, :, None]
    scores = torch.randn(s, topk, generator=gen).where(idx[0, :, 0] >= 0, float("-inf"))

    _, lse = sparse_attention(q, kv, idx, d_v=d_v, attn_sink=sink, return_lse=True)
    full = sparse_attention_probs(q, kv, idx, lse)

    local = slice(rank * heads // world, (rank + 1) * heads // world)
    q_r = q[:, :, local].contiguous()
    # The three lines of a tensor-parallel training step: the local heads' target, summed.
    _, lse_r = sparse_attention(q_r, kv, idx, d_v=d_v, attn_sink=sink[local], return_lse=True)
    target = sparse_attention_probs(q_r, kv, idx, lse_r)
    dist.all_reduce(target)

    loss_full = indexer_kl_loss(scores, full[0, :, 0])
    loss_tp = indexer_kl_loss(scores, target[0, :, 0])
    print(
        json.dumps(
            {
                "rank": rank,
                "rd_target": rel_diff(target, full),
                "rd_loss": rel_diff(loss_tp, loss_full),
                "target_sum": float(full.sum()),
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
