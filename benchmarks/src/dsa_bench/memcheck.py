"""Small calls of every GPU op for ``compute-sanitizer --tool memcheck``.

Covers the padding cases the kernels must survive without touching memory out of bounds: -1
tails, shuffled -1, whole rows of -1, indices >= S_kv and < -1, duplicates, a sink and a tail
that is not a block multiple. Each case runs the public ``sparse_attention`` (forward and
backward, the table's row for its shape, then its deterministic row) and
``sparse_attention_probs`` on the same indices (the TileLang kernel on Hopper), the Triton
probs kernel and the Triton forward; ``sparse_attention_probs`` on those indices at 40, 64 and
70 heads (the TileLang kernel's head blocks of 64: a partial one, one full, a full and a
partial); the backward's synced kernels (run once dkv outgrows L2) forced at a short length;
then ``lightning_indexer`` in several blocks (forward, backward; the two passes and the fused
logits -> top-k kernel; a CP shard whose logits launches split the keys into chunks) and
``indexer_kl_loss``
(forward, backward) on its scores. Run on the GPU host:

    compute-sanitizer --tool memcheck python -m dsa_bench.memcheck
"""

import contextlib
import dataclasses
from unittest import mock

import torch
from dsa_indexer import causal_ranges, indexer_kl_loss, lightning_indexer, resolve_config
from dsa_indexer._triton.logits_topk import list_slots
from dsa_sparse_attention import sparse_attention, sparse_attention_probs
from dsa_sparse_attention._tilelang import backward as tilelang_backward
from dsa_sparse_attention._triton import sparse_attention_probs_triton
from dsa_sparse_attention._triton.forward import sparse_attention_forward_triton

from dsa_bench import common

B, S, S_KV = 2, 33, 70


def attention_case(heads: int, dim: int, topk: int, sink: bool, gen) -> torch.Tensor:
    """``sparse_attention`` forward and backward in both modes, then the probs and Triton
    kernels, on [B, S] queries with every padding kind; returns the indices."""
    b, s, s_kv = B, S, S_KV
    q = torch.randn(b, s, heads, dim, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(b, s_kv, 1, dim, device="cuda", generator=gen).bfloat16()
    idx = torch.randint(0, s_kv, (b, s, 1, topk), device="cuda", generator=gen).int()
    idx[:, :, :, topk // 2 :] = -1  # tails
    idx[:, 3] = -1  # whole rows
    idx[:, 4, :, :7] = s_kv + 5  # past the end
    idx[:, 5, :, :7] = -9  # below -1
    idx[:, 6, :, :7] = torch.iinfo(torch.int32).max
    idx[:, 7, :, :9] = 2  # duplicates
    attn_sink = torch.randn(heads, device="cuda", generator=gen) if sink else None
    leaves = [q.requires_grad_(), kv.requires_grad_()]
    if attn_sink is not None:
        leaves.append(attn_sink.requires_grad_())
    for deterministic in (False, True):
        out, lse = sparse_attention(
            q, kv, idx, attn_sink=attn_sink, return_lse=True, deterministic=deterministic
        )
        loss = (out.float().square().sum(), torch.where(torch.isfinite(lse), lse, 0).sum())
        grads = torch.autograd.grad(loss, leaves)
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(g.float()).all()) for g in grads)
        print(
            f"heads={heads} dim={dim} topk={topk} sink={sink} "
            f"deterministic={deterministic}: grads finite={finite}"
        )
    args = (q.detach(), kv.detach(), idx, lse.detach())
    target = sparse_attention_probs(*args)
    triton = sparse_attention_probs_triton(*args, dim**-0.5)
    sink = attn_sink.detach() if sink else None
    forward, _ = sparse_attention_forward_triton(*args[:3], sink, dim**-0.5, 512)
    torch.cuda.synchronize()
    print(f"  target finite={bool(torch.isfinite(target).all())}, "
          f"triton finite={bool(torch.isfinite(triton).all())}, "
          f"triton forward finite={bool(torch.isfinite(forward).all())}")  # fmt: skip
    return idx


@contextlib.contextmanager
def rotated_walk():
    """The default mode's synced kernels at every size (deterministic mode keeps its fixed
    walk), starting past block 0: a resident count of one SM's programs (1 or 2) and the
    counter preset to 7, so the first wave starts at block 7 or 3 modulo the row's blocks (4 in
    the cases here: block 3) and the programs after it wherever the others are; prints how
    many synced launches there were."""
    counter = tilelang_backward._walk_counter
    launches = []

    def preset(device):
        launches.append(device)
        return counter(device) + 7

    with (
        mock.patch.object(
            tilelang_backward, "_sync_threshold", lambda block_h, det: None if det else 0
        ),
        mock.patch.object(tilelang_backward, "sm_count", lambda device: 1),
        mock.patch.object(tilelang_backward, "_walk_counter", preset),
    ):
        yield
    print(f"synced backward launches: {len(launches)}")


def main() -> None:
    common.require_cuda("dsa_bench.memcheck")
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, s_kv = B, S, S_KV
    # The table's tilings, all atomics on row segments: 16 heads 32-key blocks and 32 / 64 heads
    # 64-key blocks in 4 slices (128-byte segments; D 512 and 576); the fixed walk (dkv this
    # small is under the synchronised walk's threshold).
    for heads, dim, topk, sink in (
        (16, 576, 100, False),
        (32, 576, 120, False),
        (64, 512, 130, True),
        (64, 576, 150, True),
    ):
        idx = attention_case(heads, dim, topk, sink, gen)
    for heads in (40, 64, 70):
        q = torch.randn(b, s, heads, 576, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(b, s_kv, 1, 576, device="cuda", generator=gen).bfloat16()
        lse = torch.randn(b, s, heads, device="cuda", generator=gen) + 8
        # The last case's padded indices (150 slots: a partial third 64-key block).
        target = sparse_attention_probs(q, kv, idx, lse)
        torch.cuda.synchronize()
        print(f"probs heads={heads}: finite={bool(torch.isfinite(target).all())}")
    # The synced kernels (see `rotated_walk`): 16 heads, 100 slots in 4 blocks of 32 keys; 64
    # heads, 250 slots in 4 blocks of 64 keys.
    with rotated_walk():
        print("synced backward kernels:")
        attention_case(16, 576, 100, False, gen)
        attention_case(64, 576, 250, True, gen)
    # The indexer: a 64-row budget over packed causal ranges (32-row blocks on two streams),
    # then the KL loss; with the two passes and with the fused logits -> top-k kernel (lists of
    # 128 entries, compacted once a range passes 64 keys).
    t, heads, d, topk = 300, 32, 128, 64
    cu = torch.tensor([0, 1, 130, 300], device="cuda", dtype=torch.int32)
    starts, ends = causal_ranges(cu, t)
    iq = torch.randn(t, heads, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    ik = torch.randn(t, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    iw = torch.randn(t, heads, device="cuda", generator=gen).requires_grad_()
    table = resolve_config(iq).config
    for fused in (False, True):
        cfg = dataclasses.replace(table, lightning_fused=fused)
        slots = list_slots(topk, cfg.logits_block_n, cfg.logits_num_warps)
        budget = 64 * (8 * slots + 4 if fused else 4 * t)
        scores, indices = lightning_indexer(
            iq, ik, iw, starts, ends, topk, logits_budget_bytes=budget, config=cfg
        )
        loss = indexer_kl_loss(scores, torch.rand(t, topk, device="cuda", generator=gen))
        loss.backward()
        torch.cuda.synchronize()
        print(f"indexer fused={fused}: {int((indices >= 0).sum())} selected, kl {float(loss):.4f},"
              f" dq finite={bool(torch.isfinite(iq.grad.float()).all())}")  # fmt: skip
        iq.grad = ik.grad = iw.grad = None
    # A context-parallel shard: 200 queries (the last of a 9000-token sequence, a 1-token
    # segment among them) against all its keys, a 64-row budget (32-row blocks on two
    # streams): each logits launch has too few query blocks to fill the GPU and splits the keys
    # into chunks.
    t, t_kv = 200, 9000
    cu = torch.tensor([0, 8899, 8900, t_kv], device="cuda", dtype=torch.int32)
    starts, ends = causal_ranges(cu, t, query_offset=t_kv - t)
    iq = torch.randn(t, heads, d, device="cuda", generator=gen).bfloat16()
    ik = torch.randn(t_kv, d, device="cuda", generator=gen).bfloat16()
    iw = torch.randn(t, heads, device="cuda", generator=gen)
    _, indices = lightning_indexer(
        iq, ik, iw, starts, ends, topk, logits_budget_bytes=64 * 4 * t_kv
    )
    torch.cuda.synchronize()
    print(f"indexer cp shard, key chunks: {int((indices >= 0).sum())} selected")


if __name__ == "__main__":
    main()
