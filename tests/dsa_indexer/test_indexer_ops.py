"""Indexer entries: validation, config resolution, custom-op registration, torch.compile."""

import dataclasses

import pytest
import torch
from dsa_indexer import (
    IndexerConfig,
    causal_ranges,
    indexer_logits,
    indexer_topk_scores,
    lightning_indexer,
    resolve_config,
)
from dsa_indexer._ops import _block_rows, _config_fields
from dsa_indexer.config import INDEXER_CONFIGS, TORCH_CONFIG
from kernel_common import ARCH_ENV
from support import cu_seqlens, dense_logits, fake_cuda, indexer_inputs, naive_topk, seeded_gen


def make(t=12, h=4, d=16, t_kv=None, seed=0):
    gen = seeded_gen("ops", t, h, d, seed)
    q, k, w = indexer_inputs(t, t if t_kv is None else t_kv, h, d, gen)
    starts, ends = causal_ranges(cu_seqlens([5, t - 5]), t)
    return q, k, w, starts, ends


def test_validation_messages():
    q, k, w, s, e = make()
    with pytest.raises(TypeError, match="q must have dtype bfloat16, got float32"):
        indexer_logits(q.float(), k, w, s, e)
    with pytest.raises(ValueError, match=r"q must have shape \[T, H, D\]"):
        indexer_logits(q[0], k, w, s, e)
    with pytest.raises(ValueError, match=r"k must have shape \[T_kv, D=16\]"):
        indexer_logits(q, k[:, :8], w, s, e)
    with pytest.raises(TypeError, match="weights must have dtype float32"):
        indexer_logits(q, k, w.bfloat16(), s, e)
    with pytest.raises(ValueError, match=r"weights must have shape \[T=12, H=4\]"):
        indexer_logits(q, k, w[:, :2], s, e)
    with pytest.raises(ValueError, match=r"ends must have shape \[T=12\]"):
        indexer_logits(q, k, w, s, e[:3])
    with pytest.raises(TypeError, match="starts must have dtype int32"):
        indexer_logits(q, k, w, s.long(), e)
    with pytest.raises(ValueError, match=r"indices must have shape \[T=12, topk\]"):
        indexer_topk_scores(q, k, w, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk >= 1"):
        indexer_topk_scores(q, k, w, torch.zeros(12, 0, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, T_kv=12\)"):
        indexer_topk_scores(q, k, w, torch.full((12, 2), 12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"indices must lie in"):
        indexer_topk_scores(q, k, w, torch.full((12, 2), -2, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk must be >= 1"):
        lightning_indexer(q, k, w, s, e, 0)
    with pytest.raises(TypeError, match="config must be an IndexerConfig"):
        indexer_logits(q, k, w, s, e, config="fast")


@pytest.mark.gpu
def test_device_mismatch():
    q, k, w, s, e = make()
    with pytest.raises(ValueError, match="k is on cpu, expected cuda"):
        indexer_logits(q.cuda(), k, w.cuda(), s.cuda(), e.cuda())


# --------------------------------------------------------------------------- config


def test_config_validation():
    cases = [
        (dict(backend="cuda"), "IndexerConfig.backend"),
        (dict(logits_block_n=96), "IndexerConfig.logits_block_n"),
        (dict(backward_block_k=8), "IndexerConfig.backward_block_k"),
        (dict(scores_num_warps=3), "IndexerConfig.scores_num_warps"),
        (dict(logits_num_stages=0), "IndexerConfig.logits_num_stages"),
        (dict(backward_rotate=1), "IndexerConfig.backward_rotate"),
        (dict(backward_dk_split=4), "IndexerConfig.backward_dk_split"),
        (dict(backward_dk_split=True), "IndexerConfig.backward_dk_split"),
        (dict(backward_key_window=-1), "IndexerConfig.backward_key_window"),
        (dict(backward_key_window=True), "IndexerConfig.backward_key_window"),
        (dict(lightning_fused=1), "IndexerConfig.lightning_fused"),
        (dict(fused_max_registers=16), "IndexerConfig.fused_max_registers"),
        (dict(fused_max_registers=256), "IndexerConfig.fused_max_registers"),
        (dict(fused_max_registers=True), "IndexerConfig.fused_max_registers"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            IndexerConfig(**kwargs)


def test_config_table_rows():
    assert [f.name for f in INDEXER_CONFIGS.fields] == ["arch_major", "heads"]
    rows = {
        dict(r.key)["heads"]: r for r in INDEXER_CONFIGS.rows() if dict(r.key)["arch_major"] == 9
    }
    assert sorted(rows) == [8, 16, 32, 64]
    for row in rows.values():
        assert row.config.backend == "triton"
        assert row.note.startswith("measured H200")
    # Heads are bucketed: 24 TP-local heads use the 32 row, 128 the 64 row.
    assert INDEXER_CONFIGS.lookup(arch_major=9, heads=24).config == rows[32].config
    assert INDEXER_CONFIGS.lookup(arch_major=9, heads=128).config == rows[64].config
    assert INDEXER_CONFIGS.lookup(arch_major=8, heads=32).source == "default"


def test_resolve_config_on_cpu_is_the_torch_reference(monkeypatch):
    """CPU tensors run the torch reference whatever the caller passes or the arch claims."""
    q = torch.zeros(4, 32, 16, dtype=torch.bfloat16)
    for arch in (None, "sm_90"):
        if arch is None:
            monkeypatch.delenv(ARCH_ENV, raising=False)
        else:
            monkeypatch.setenv(ARCH_ENV, arch)
        for config in (None, IndexerConfig(logits_block_n=256)):
            found = resolve_config(q, config)
            assert found.config == TORCH_CONFIG and found.config.backend == "torch"
            assert found.source.startswith("cpu tensors")
    with pytest.raises(TypeError, match="config must be an IndexerConfig"):
        resolve_config(q, "fast")


def test_resolve_config_on_cuda(monkeypatch):
    """CUDA tensors: the caller's config, else the (arch, heads bucket) row, else the default;
    ROCm runs the torch reference."""
    q = fake_cuda(4, 32, 16)
    mine = IndexerConfig(logits_block_n=256)
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    found = resolve_config(q)
    assert found.config == INDEXER_CONFIGS.lookup(arch_major=9, heads=32).config
    assert found.source.startswith("row (measured H200")
    assert found.key == (("arch_major", 9), ("heads", 32))
    assert resolve_config(q, mine).config == mine and resolve_config(q, mine).source == "caller"
    monkeypatch.setenv(ARCH_ENV, "sm_100")
    assert resolve_config(fake_cuda(4, 16, 16)).config == INDEXER_CONFIGS.default
    monkeypatch.setenv(ARCH_ENV, "gfx942")
    assert resolve_config(q, mine).config == TORCH_CONFIG


# --------------------------------------------------------------------------- custom ops


OPS = {
    "indexer_logits": ["q", "k", "weights", "starts", "ends", "clean"],
    "indexer_topk_scores": ["q", "k", "weights", "indices"],
    "indexer_topk_scores_backward": ["grad", "q", "k", "weights", "indices"],
    "lightning_indices": ["q", "k", "weights", "starts", "ends", "topk", "block_rows"],
}


@pytest.mark.parametrize("name", OPS)
def test_ops_take_the_config_fields_in_declaration_order(name):
    """Each op rebuilds the IndexerConfig from its trailing arguments by position."""
    schema = getattr(torch.ops.dsa_indexer, name).default._schema
    names = [a.name for a in schema.arguments]
    assert names == OPS[name] + [f.name for f in dataclasses.fields(IndexerConfig)]


def test_opcheck():
    q, k, w, s, e = make()
    fields = _config_fields(q, None)
    ops = torch.ops.dsa_indexer
    torch.library.opcheck(ops.indexer_logits.default, (q, k, w, s, e, True, *fields))
    idx = torch.randint(-1, 12, (12, 5), dtype=torch.int32, generator=seeded_gen("idx"))
    qq, kk, ww = (x.clone().requires_grad_() for x in (q, k, w))
    torch.library.opcheck(ops.indexer_topk_scores.default, (qq, kk, ww, idx, *fields))
    g = torch.randn(12, 5, generator=seeded_gen("grad"))
    torch.library.opcheck(ops.indexer_topk_scores_backward.default, (g, q, k, w, idx, *fields))
    block = _block_rows("test", q.shape[0], k.shape[0], 0, 4 * k.shape[0] * 5)
    torch.library.opcheck(ops.lightning_indices.default, (q, k, w, s, e, 4, block, *fields))


def test_logits_with_inputs_that_require_grad():
    """The logits are not differentiable: the op passes opcheck and compiles (fullgraph) with
    inputs that require grad, and its output claims no gradient."""
    q, k, w, s, e = make()
    leaves = [x.clone().requires_grad_() for x in (q, k, w)]
    torch.library.opcheck(
        torch.ops.dsa_indexer.indexer_logits.default,
        (*leaves, s, e, True, *_config_fields(q, None)),
    )
    out = indexer_logits(*leaves, s, e)
    assert out.requires_grad is False and out.grad_fn is None
    torch.testing.assert_close(out, dense_logits(q, k, w, s, e).float())
    compiled = torch.compile(indexer_logits, fullgraph=True, dynamic=True)
    got = compiled(*leaves, s, e)
    assert got.requires_grad is False
    assert torch.equal(got, out)


def test_compile_forward_and_backward():
    def step(q, k, w, s, e):
        scores, idx = lightning_indexer(q, k, w, s, e, 4)
        return torch.where(idx >= 0, scores, 0.0).sum(), idx

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for t in (12, 19):
        q, k, w, s, e = make(t=t, seed=t)
        q1, k1, w1 = (x.clone().requires_grad_() for x in (q, k, w))
        q2, k2, w2 = (x.clone().requires_grad_() for x in (q, k, w))
        loss1, idx1 = step(q1, k1, w1, s, e)
        loss2, idx2 = compiled(q2, k2, w2, s, e)
        loss1.backward()
        loss2.backward()
        assert torch.equal(idx1, idx2)
        assert torch.equal(idx1, naive_topk(dense_logits(q, k, w, s, e), 4, s, e))
        torch.testing.assert_close(loss1, loss2)
        for a, b in ((q1, q2), (k1, k2), (w1, w2)):
            torch.testing.assert_close(a.grad, b.grad)
    logits_fn = torch.compile(indexer_logits, fullgraph=True, dynamic=True)
    q, k, w, s, e = make()
    assert torch.equal(logits_fn(q, k, w, s, e), indexer_logits(q, k, w, s, e))
