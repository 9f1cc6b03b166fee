"""sparse_attention entry: validation, dispatch and config table, custom ops, torch.compile."""

import dataclasses

import pytest
import torch
from dsa_sparse_attention import SparseAttentionConfig, sparse_attention
from dsa_sparse_attention._ops import resolve_config
from dsa_sparse_attention.config import CONFIG_TABLE
from kernel_common import ARCH_ENV


def make(b=1, s=6, h=4, g=1, d=40, topk=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=gen).bfloat16()
    kv = torch.randn(b, s, g, d, generator=gen).bfloat16()
    idx = torch.randint(-1, s, (b, s, g, topk), generator=gen, dtype=torch.int32)
    return q, kv, idx


def test_validation_messages():
    q, kv, idx = make(h=4, g=2, d=40)
    kv = torch.randn(1, 6, 2, 40).bfloat16()
    idx = torch.randint(0, 6, (1, 6, 2, 5), dtype=torch.int32)
    cases = [
        (dict(q=q.float()), TypeError, "q must have dtype bfloat16, got float32"),
        (dict(q=q[0]), ValueError, r"q must have shape \[B, S, H, D\]"),
        (dict(kv=kv.half()), TypeError, "kv must have dtype bfloat16"),
        (dict(kv=kv[..., :32]), ValueError, r"kv must have shape \[B=1, S_kv, G, D=40\]"),
        (
            dict(kv=torch.randn(1, 6, 3, 40).bfloat16()),
            ValueError,
            "H=4 must be divisible by the kv groups G=3",
        ),
        (dict(indices=idx.long()), TypeError, "indices must have dtype int32"),
        (
            dict(indices=idx[:, :, :1]),
            ValueError,
            r"indices must have shape \[B=1, S=6, G=2, topk\]",
        ),
        (dict(indices=idx[..., :0]), ValueError, "topk >= 1"),
        (dict(indices=idx + 6), ValueError, r"indices must lie in \[-1, S_kv=6\)"),
        (dict(indices=idx - 8), ValueError, r"indices must lie in \[-1, S_kv=6\)"),
        (dict(d_v=41), ValueError, "d_v=41 must not exceed the q/kv width D=40"),
        (dict(d_v=0), ValueError, "d_v must be >= 1"),
        (dict(attn_sink=torch.zeros(3)), ValueError, r"attn_sink must have shape \[H=4\]"),
        (dict(attn_sink=torch.zeros(4).bfloat16()), TypeError, "attn_sink must have dtype float32"),
        (dict(config="fast"), TypeError, "config must be a SparseAttentionConfig"),
    ]
    for overrides, exc, msg in cases:
        args = dict(q=q, kv=kv, indices=idx, d_v=32)
        args.update(overrides)
        with pytest.raises(exc, match=msg):
            sparse_attention(args.pop("q"), args.pop("kv"), args.pop("indices"), **args)


@pytest.mark.gpu
def test_device_mismatch():
    q, kv, idx = make()
    with pytest.raises(ValueError, match="kv is on cpu, expected cuda"):
        sparse_attention(q.cuda(), kv, idx.cuda())


def test_config_validation():
    with pytest.raises(ValueError, match="forward_backend must be one of"):
        SparseAttentionConfig(forward_backend="cudnn")
    with pytest.raises(ValueError, match="forward_block_i must be a positive int"):
        SparseAttentionConfig(forward_block_i=0)
    cfg = SparseAttentionConfig(forward_block_i=32, split_store=4)
    assert SparseAttentionConfig.from_json(cfg.to_json()) == cfg


def test_cpu_dispatch_uses_torch_and_caller_config_wins(monkeypatch):
    monkeypatch.delenv(ARCH_ENV, raising=False)
    q, _, _ = make()
    picked = resolve_config(q, 32, None)
    assert picked.config.forward_backend == "torch" and picked.source == "cpu"
    mine = SparseAttentionConfig(split_store=4)
    assert resolve_config(q, 32, mine).config is mine


def test_table_keys_and_every_config_runs(monkeypatch):
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    # With an arch override even CPU tensors go through the table lookup.
    picked = resolve_config(q, 512, None)
    assert picked.key == (("arch_major", 9), ("rope_tail", True), ("heads", 16))
    monkeypatch.delenv(ARCH_ENV)
    q, kv, idx = make()
    outs = [sparse_attention(q, kv, idx, d_v=32, config=c) for c in CONFIG_TABLE.configs()]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert all(dataclasses.is_dataclass(c) for c in CONFIG_TABLE.configs())


def test_opcheck():
    q, kv, idx = make(h=4, g=2)
    kv = torch.randn(1, 6, 2, 40).bfloat16()
    idx = torch.randint(-1, 6, (1, 6, 2, 5), dtype=torch.int32)
    cfg = SparseAttentionConfig().to_json()
    sink = torch.randn(4)
    for s in (sink, None):
        leaves = (q.clone().requires_grad_(), kv.clone().requires_grad_())
        sk = s.clone().requires_grad_() if s is not None else None
        torch.library.opcheck(
            torch.ops.dsa_sparse_attention.forward.default, (*leaves, idx, sk, 0.2, 32, cfg)
        )


def test_compile_forward_backward_dynamic():
    def loss_fn(q, kv, idx, sink):
        out, lse = sparse_attention(q, kv, idx, d_v=32, attn_sink=sink, return_lse=True)
        return out.float().square().sum() + lse.sum()

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=True)
    for s in (6, 9):
        q, kv, idx = make(s=s, seed=s)
        sink = torch.randn(4)
        eager = [x.clone().requires_grad_() for x in (q, kv, sink)]
        comp = [x.clone().requires_grad_() for x in (q, kv, sink)]
        l1 = loss_fn(eager[0], eager[1], idx, eager[2])
        l2 = compiled(comp[0], comp[1], idx, comp[2])
        l1.backward()
        l2.backward()
        torch.testing.assert_close(l1, l2)
        for a, b in zip(eager, comp, strict=True):
            torch.testing.assert_close(a.grad, b.grad)
