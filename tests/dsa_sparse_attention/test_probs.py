"""sparse_attention_probs: the torch reference and the Triton kernel against a dense fp64 target."""

import pytest
import torch
from dsa_bench.dense import dense_attention
from dsa_sparse_attention import sparse_attention, sparse_attention_probs
from dsa_sparse_attention._triton import split_width
from kernel_common.testing import assert_close
from support import (
    as_padding,
    attention_indices,
    attention_inputs,
    interp_only,
    not_interpreted,
    run_interpreted,
    seeded_gen,
)


def dense_target(q, kv, indices, sm_scale, d_v, sink):
    """fp64 ``[B, S, G, topk]``: every head's probability of every key (dense softmax with the
    sink in the denominator), summed over the group's heads and read at each slot."""
    _, lse = dense_attention(q.double(), kv.double(), indices, sm_scale, d_v, sink)
    b, s, h, _ = q.shape
    g = kv.shape[2]
    group = torch.arange(h) // (h // g)
    logits = torch.einsum("bshd,bkhd->bshk", q.double(), kv.double()[:, :, group]) * sm_scale
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(logits - lse[..., None]))
    per_group = torch.zeros(b, s, g, kv.shape[1], dtype=torch.float64).index_add_(2, group, p)
    picked = per_group.gather(3, indices.clamp(min=0).long())
    return torch.where(indices >= 0, picked, 0.0), lse


# (b, s, s_kv, heads, groups, d, d_v, topk, sink, pattern)
CASES = [
    (2, 5, 9, 4, 1, 80, 64, 7, True, "mixed"),
    (1, 6, 6, 8, 2, 96, 64, 20, False, "duplicates"),
    (1, 4, 5, 70, 1, 48, 32, 5, True, "empty_rows"),  # two head blocks of the kernel
    (1, 7, 7, 1, 1, 64, 64, 3, False, "causal"),
    (1, 3, 4, 16, 1, 80, 64, 6, False, "all"),
]


def _case(case, seed):
    b, s, s_kv, heads, groups, d, d_v, topk, sink, pattern = case
    gen = seeded_gen("probs", case, seed)
    q, kv, attn_sink = attention_inputs(b, s, s_kv, heads, groups, d, gen, sink=sink)
    idx = attention_indices(b, s, groups, topk, s_kv, pattern, gen)
    want, lse = dense_target(q, kv, as_padding(idx, s_kv), d**-0.5, d_v, attn_sink)
    return q, kv, idx, lse.float(), want


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_against_dense(case):
    q, kv, idx, lse, want = _case(case, 0)
    got = sparse_attention_probs(q, kv, as_padding(idx, kv.shape[1]), lse)
    assert_close(got, want, name="target")


def test_target_from_the_forward_lse():
    """With the lse that sparse_attention returns (sink folded in), as a user calls it."""
    gen = seeded_gen("probs forward lse")
    q, kv, sink = attention_inputs(1, 9, 9, 4, 1, 80, gen, sink=True)
    idx = attention_indices(1, 9, 1, 6, 9, "causal", gen)
    _, lse = sparse_attention(q, kv, idx, d_v=64, attn_sink=sink, return_lse=True)
    want, _ = dense_target(q, kv, idx, 80**-0.5, 64, sink)
    assert_close(sparse_attention_probs(q, kv, idx, lse), want, name="target")


def test_validation_messages():
    gen = seeded_gen("probs validation")
    q, kv, _ = attention_inputs(1, 6, 6, 4, 2, 40, gen)
    idx = torch.zeros(1, 6, 2, 5, dtype=torch.int32)
    lse = torch.zeros(1, 6, 4)
    cases = [
        (dict(q=q.float()), TypeError, "q must have dtype bfloat16"),
        (dict(kv=kv[..., :32]), ValueError, r"kv must have shape \[B=1, S_kv, G, D=40\]"),
        (dict(kv=kv[:, :, :1].expand(1, 6, 3, 40)), ValueError, "divisible by the kv groups G=3"),
        (dict(indices=idx.long()), TypeError, "indices must have dtype int32"),
        (dict(indices=idx[..., :0]), ValueError, "topk >= 1"),
        (dict(indices=idx + 6), ValueError, r"indices must lie in \[-1, S_kv=6\)"),
        (dict(lse=lse[..., :3]), ValueError, r"lse must have shape \[B=1, S=6, H=4\]"),
        (dict(lse=lse.double()), TypeError, "lse must have dtype float32"),
    ]
    for overrides, exc, msg in cases:
        args = dict(q=q, kv=kv, indices=idx, lse=lse)
        args.update(overrides)
        with pytest.raises(exc, match=msg):
            sparse_attention_probs(args.pop("q"), args.pop("kv"), args.pop("indices"), **args)


def test_split_width():
    assert split_width(576) == (512, 64) and split_width(512) == (512, 0)
    assert split_width(80) == (64, 16) and split_width(16) == (16, 0)
    assert split_width(100) is None and split_width(8) is None and split_width(72) is None


def test_opcheck_and_compile():
    q, kv, idx, lse, _ = _case(CASES[0], 1)
    idx = as_padding(idx, kv.shape[1])
    args = (q.requires_grad_(), kv, idx, lse.requires_grad_(), 0.1)
    torch.library.opcheck(torch.ops.dsa_sparse_attention.probs.default, args)
    out = sparse_attention_probs(q, kv, idx, lse)
    assert not out.requires_grad
    compiled = torch.compile(sparse_attention_probs, fullgraph=True, dynamic=True)
    for seed in (2, 3):
        q, kv, idx, lse, want = _case(CASES[1], seed)
        assert_close(compiled(q, kv, idx, lse), want, name="compiled target")


@not_interpreted
def test_interpreter_run():
    run_interpreted(__file__)


@interp_only
@pytest.mark.parametrize("case", CASES, ids=str)
def test_cpu_interp_kernel(case):
    """The Triton kernel itself (out-of-range entries are padding for it)."""
    from dsa_sparse_attention._triton import sparse_attention_probs_triton

    q, kv, idx, lse, want = _case(case, 4)
    got = sparse_attention_probs_triton(q, kv, idx, lse, q.shape[-1] ** -0.5)
    assert not torch.isnan(got).any()
    assert_close(got, want, name="target")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads,groups,d,topk,pattern",
    [
        (64, 1, 576, 2048, "causal"),
        (8, 1, 576, 2112, "out_of_range"),
        (16, 1, 512, 640, "mixed"),
        (128, 1, 576, 64, "empty_rows"),
        (32, 2, 512, 100, "shuffled"),
        (1, 1, 576, 1, "all"),
    ],
)
def test_gpu_against_reference(heads, groups, d, topk, pattern):
    """The kernel on the GPU against the fp32 reference (every output element written)."""
    from dsa_sparse_attention.reference import sparse_attention_probs_reference

    gen = seeded_gen("probs gpu", heads, groups, d, topk, pattern)
    s, s_kv = 300, 2500
    q, kv, sink = attention_inputs(1, s, s_kv, heads, groups, d, gen, sink=True, device="cuda")
    idx = attention_indices(1, s, groups, topk, s_kv, pattern, gen, device="cuda")
    # The reference forward rejects out-of-range entries: it gets them as -1.
    padded = as_padding(idx, s_kv)
    _, lse = sparse_attention(
        q, kv, padded, d_v=512, attn_sink=sink, return_lse=True, config=_torch_forward()
    )
    # Fill the allocator's next block with NaN, so that an unwritten output element shows.
    torch.full((1, s, groups, topk), float("nan"), device="cuda")
    got = sparse_attention_probs(q, kv, idx, lse)
    assert not torch.isnan(got).any()
    want = sparse_attention_probs_reference(q, kv, padded, lse, d**-0.5)
    assert_close(got, want, name="target")


def _torch_forward():
    from dsa_sparse_attention import SparseAttentionConfig

    # The lse is an input here: the reference forward keeps this test about the probs kernel.
    return SparseAttentionConfig(forward_backend="torch", backward_backend="torch")
