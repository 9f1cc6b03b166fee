"""Sparse attention (torch backend) against the dense fp64 formulation of ``dsa_bench.dense``
(every key weighted by its multiplicity in the index row, differentiated by autograd)."""

import math

import pytest
import torch
from dsa_bench.dense import dense_attention
from dsa_sparse_attention import reference as ref
from dsa_sparse_attention import sparse_attention
from kernel_common.testing import assert_close
from support import as_padding, attention_indices, attention_inputs, seeded_gen


def make(b, s, h, g, d, topk, s_kv=None, sink=False, seed=0, pattern="duplicates"):
    """Inputs and ``support.attention_indices`` of one pattern, out-of-range entries made -1
    (the torch backend rejects them)."""
    gen = seeded_gen("reference", b, s, h, g, d, topk, s_kv, sink, seed, pattern)
    s_kv = s if s_kv is None else s_kv
    q, kv, attn_sink = attention_inputs(b, s, s_kv, h, g, d, gen, sink=sink)
    idx = as_padding(attention_indices(b, s, g, topk, s_kv, pattern, gen), s_kv)
    return q, kv, idx, attn_sink


def run_both(q, kv, idx, sink, d_v, sm_scale=None):
    d = q.shape[-1]
    scale = sm_scale if sm_scale is not None else 1 / math.sqrt(d)
    leaves = [q.clone().requires_grad_(), kv.clone().requires_grad_()]
    if sink is not None:
        leaves.append(sink.clone().requires_grad_())
    out, lse = sparse_attention(
        leaves[0],
        leaves[1],
        idx,
        d_v=d_v,
        attn_sink=leaves[2] if sink is not None else None,
        sm_scale=sm_scale,
        return_lse=True,
    )
    gen = torch.Generator().manual_seed(99)
    # out is bf16, so autograd hands the backward a bf16 dout: use bf16-exact values throughout.
    do = torch.randn(out.shape, generator=gen).bfloat16().float()
    dl = torch.randn(lse.shape, generator=gen)
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    ((out.float() * do).sum() + (finite_lse * dl).sum()).backward()

    dense_leaves = [x.double().requires_grad_() for x in (q, kv)]
    if sink is not None:
        dense_leaves.append(sink.double().requires_grad_())
    o64, l64 = dense_attention(
        dense_leaves[0],
        dense_leaves[1],
        idx,
        scale,
        d_v,
        dense_leaves[2] if sink is not None else None,
    )
    l64_finite = torch.where(torch.isfinite(l64), l64, 0.0)
    ((o64 * do.double()).sum() + (l64_finite * dl.double()).sum()).backward()
    return (out, lse, [x.grad for x in leaves]), (o64, l64, [x.grad for x in dense_leaves])


# Outputs are bf16 (out, dq, dkv): compared at bf16 resolution; lse and dsink are fp32.
BF16_BAR = 2e-5


@pytest.mark.parametrize(
    ("b", "s", "h", "g", "d", "d_v", "topk", "s_kv", "sink", "pattern"),
    [
        (1, 9, 4, 1, 40, 32, 5, None, False, "duplicates"),
        (2, 7, 8, 2, 48, 32, 6, None, True, "tail"),
        (1, 6, 4, 4, 24, 24, 9, 12, True, "shuffled"),  # S_kv = 2 S, no tail, G = H
        (2, 5, 6, 3, 40, 32, 3, None, False, "empty_rows"),  # all -1 rows, no sink
        (1, 5, 4, 1, 40, 32, 4, None, True, "empty_rows"),  # all -1 rows with a sink
        (1, 3, 2, 1, 16, 16, 20, None, True, "duplicates"),  # topk > S_kv: duplicates forced
        (2, 6, 4, 2, 40, 32, 7, 9, True, "mixed"),
        (1, 8, 4, 1, 40, 32, 5, 11, False, "causal"),
    ],
)
def test_forward_backward_against_dense(b, s, h, g, d, d_v, topk, s_kv, sink, pattern):
    q, kv, idx, attn_sink = make(b, s, h, g, d, topk, s_kv, sink, pattern=pattern)
    (out, lse, grads), (o64, l64, grads64) = run_both(q, kv, idx, attn_sink, d_v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_close(out, o64, max_rel_diff=BF16_BAR, name="out")
    assert_close(lse, l64, max_rel_diff=1e-6, name="lse")
    names = ["dq", "dkv", "dsink"]
    for name, a, e in zip(names, grads, grads64, strict=False):
        assert torch.isfinite(a.float()).all(), name
        assert_close(a, e, max_rel_diff=BF16_BAR if name != "dsink" else 1e-6, name=name)


@pytest.mark.parametrize("with_sink", [False, True])
def test_all_minus_one_rows_are_exactly_zero_with_finite_grads(with_sink):
    q, kv, idx, sink = make(1, 6, 4, 1, 32, 8, sink=with_sink, pattern="empty_rows", seed=3)
    (out, lse, grads), _ = run_both(q, kv, idx, sink, 32)
    empty = (idx == -1).all(-1)[..., 0]  # [B, S]
    assert bool(empty.any()) and not bool(empty.all())
    assert (out[empty] == 0).all()
    assert (grads[0][empty] == 0).all()
    assert all(torch.isfinite(x.float()).all() for x in grads)
    assert torch.isfinite(lse[~empty]).all()
    if with_sink:  # only the sink is in the softmax: lse = sink
        assert torch.allclose(lse[empty], sink.expand_as(lse)[empty])
    else:
        assert torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("sink", [False, True])
def test_every_row_empty(sink):
    q, kv, idx, attn_sink = make(2, 5, 4, 1, 32, 6, sink=sink, seed=7)
    idx = torch.full_like(idx, -1)
    (out, lse, grads), (_, l64, grads64) = run_both(q, kv, idx, attn_sink, 32)
    assert (out == 0).all() and (grads[0] == 0).all() and (grads[1] == 0).all()
    assert_close(lse, l64, name="lse")
    if sink:
        assert_close(grads[2], grads64[2], max_rel_diff=1e-6, name="dsink")


def test_custom_scale_and_default_d_v():
    q, kv, idx, _ = make(1, 4, 2, 1, 600, 3, seed=4)
    out = sparse_attention(q, kv, idx)
    assert out.shape[-1] == 512  # d_v defaults to min(D, 512)
    (out, _, _), (o64, _, _) = run_both(q, kv, idx, None, 512, sm_scale=0.02)
    assert_close(out, o64, max_rel_diff=BF16_BAR)


def test_reference_chunking_is_invisible(monkeypatch):
    q, kv, idx, sink = make(2, 11, 4, 2, 24, 5, sink=True, pattern="shuffled", seed=5)
    scale = 0.3
    fwd = ref.sparse_attention_forward_reference(q, kv, idx, scale, 16, sink)
    do = torch.randn(2, 11, 4, 16, generator=seeded_gen("chunking dout")).bfloat16()
    bwd = ref.sparse_attention_backward_reference(do, None, q, kv, idx, fwd[1], scale, 16, sink)
    monkeypatch.setattr(ref, "_CHUNK_ELEMENTS", 1)
    fwd1 = ref.sparse_attention_forward_reference(q, kv, idx, scale, 16, sink)
    bwd1 = ref.sparse_attention_backward_reference(do, None, q, kv, idx, fwd1[1], scale, 16, sink)
    for a, b in zip((*fwd, *bwd), (*fwd1, *bwd1), strict=True):
        assert_close(a, b, max_rel_diff=1e-6)


def test_gradcheck_fp64_explicit_backward():
    gen = torch.Generator().manual_seed(6)
    b, s, h, g, d, d_v = 1, 3, 4, 2, 6, 4
    q = torch.randn(b, s, h, d, dtype=torch.float64, generator=gen, requires_grad=True)
    kv = torch.randn(b, 5, g, d, dtype=torch.float64, generator=gen, requires_grad=True)
    sink = torch.randn(h, dtype=torch.float64, generator=gen, requires_grad=True)
    idx = torch.tensor(
        [
            [
                [[0, 2, -1, 2], [1, 4, 3, -1]],
                [[-1, -1, -1, -1], [0, 0, 1, 2]],
                [[4, 3, 2, 1], [-1, 3, -1, 0]],
            ]
        ],
        dtype=torch.int32,
    )
    scale = 0.4

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, kv, sink):
            out, lse = ref.sparse_attention_forward_reference(
                q, kv, idx, scale, d_v, sink, dtype=torch.float64
            )
            ctx.save_for_backward(q, kv, sink, lse)
            return out, lse.double()

        @staticmethod
        def backward(ctx, do, dlse):
            q, kv, sink, lse = ctx.saved_tensors
            return ref.sparse_attention_backward_reference(
                do, dlse, q, kv, idx, lse, scale, d_v, sink, dtype=torch.float64
            )

    assert torch.autograd.gradcheck(Attn.apply, (q, kv, sink))
