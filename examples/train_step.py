"""One DSA training step of a layer: the indexer selects keys, sparse attention runs on them, and
the indexer learns from the attention's own probabilities (DeepSeek-V3.2's sparse stage).

    python examples/train_step.py            # CUDA if available, else the CPU (torch reference)

Packed sequences -> causal_ranges -> lightning_indexer -> sparse_attention ->
sparse_attention_probs (the target, detached) -> indexer_kl_loss + the model's loss -> backward.
The indexer's inputs are detached from the main model, so its parameters learn from the KL term
only; under tensor parallelism, all-reduce the target over the head shards before the loss.
"""

from __future__ import annotations

import torch
from dsa_indexer import causal_ranges, indexer_kl_loss, lightning_indexer
from dsa_sparse_attention import sparse_attention, sparse_attention_probs


def train_step(device: torch.device, *, seed: int = 0) -> dict[str, float]:
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [300, 1, 700, 24]  # packed sequences
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device).int()
    total, topk = sum(lens), 128
    heads, d_qk, d_v = (64, 576, 512) if device.type == "cuda" else (8, 96, 64)
    idx_heads, idx_dim = 32, 128

    def param(*shape, scale=1.0):
        x = torch.randn(*shape, device=device, generator=gen) * scale
        return x.bfloat16().requires_grad_()

    # The indexer's projections of the (detached) hidden states, and the attention's q / kv.
    iq, ik = param(total, idx_heads, idx_dim), param(total, idx_dim)
    iw = (torch.randn(total, idx_heads, device=device, generator=gen) / idx_heads).requires_grad_()
    q, kv = param(1, total, heads, d_qk), param(1, total, 1, d_qk)

    starts, ends = causal_ranges(cu_seqlens, total)
    scores, indices = lightning_indexer(iq, ik, iw, starts, ends, topk)
    out, lse = sparse_attention(q, kv, indices[None, :, None], d_v=d_v, return_lse=True)
    with torch.no_grad():
        target = sparse_attention_probs(q, kv, indices[None, :, None], lse)[0, :, 0]
        # Tensor parallelism: torch.distributed.all_reduce(target, group=tp_group) here.
    kl = indexer_kl_loss(scores, target, reduction="mean")
    main = out.float().square().mean()  # stands in for the model's loss
    (main + kl).backward()
    return {
        "kl": float(kl.detach()),
        "main": float(main.detach()),
        "indexer_q_grad_norm": float(iq.grad.float().norm()),
        "attention_q_grad_norm": float(q.grad.float().norm()),
    }


if __name__ == "__main__":
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(dev, train_step(dev))
