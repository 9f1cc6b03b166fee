"""ranged_topk semantics against the independent per-row formulation ``support.naive_topk``;
its config, its resolution and its custom-op registration."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_common import ARCH_ENV
from support import fake_cuda, naive_topk, random_ranges
from topk import TopkConfig, ranged_topk, resolve_config
from topk.config import TOPK_CONFIGS, TORCH_CONFIG


@pytest.mark.parametrize("k", [1, 5, 17, 64])
def test_random_rows_with_ranges(k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(40, 50, generator=gen)
    lo, hi = random_ranges(40, 50, gen)
    assert torch.equal(ranged_topk(scores, k, lo, hi), naive_topk(scores, k, lo, hi))


def test_ties_keep_the_smaller_column():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0], [3.0] * 6])
    out = ranged_topk(scores, 3)
    assert out.tolist() == [[1, 2, 3], [0, 1, 2]]
    lo = torch.tensor([2, 1], dtype=torch.int32)
    hi = torch.tensor([6, 6], dtype=torch.int32)
    assert ranged_topk(scores, 2, lo, hi).tolist() == [[2, 3], [1, 2]]


def test_many_values_equal_to_the_kth():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (16, 200), generator=gen).float()
    lo, hi = random_ranges(16, 200, gen)
    assert torch.equal(ranged_topk(scores, 37, lo, hi), naive_topk(scores, 37, lo, hi))


def test_neg_inf_and_nan_never_selected_pos_inf_is():
    inf, nan = math.inf, math.nan
    scores = torch.tensor([[-inf, nan, 1.0, inf, -inf, nan]])
    assert ranged_topk(scores, 4).tolist() == [[2, 3, -1, -1]]
    mostly = torch.full((8, 100), -inf)
    mostly[:, ::10] = torch.randn(8, 10)
    assert torch.equal(ranged_topk(mostly, 20), naive_topk(mostly, 20, [0] * 8, [100] * 8))


def test_garbage_outside_ranges_is_never_selected():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(6, 30, generator=gen)
    lo = torch.tensor([0, 5, 10, 3, 29, 12], dtype=torch.int32)
    hi = torch.tensor([4, 20, 10, 30, 30, 13], dtype=torch.int32)
    clean = ranged_topk(scores, 8, lo, hi)
    dirty = scores.clone()
    cols = torch.arange(30)
    outside = (cols < lo[:, None]) | (cols >= hi[:, None])
    dirty[outside] = torch.tensor([math.nan, math.inf, 1e30])[torch.arange(int(outside.sum())) % 3]
    assert torch.equal(ranged_topk(dirty, 8, lo, hi), clean)
    assert clean[2].tolist() == [-1] * 8  # empty range


def test_exactly_k_fewer_than_k_and_k_larger_than_row():
    scores = torch.randn(3, 10)
    lo = torch.tensor([0, 0, 0], dtype=torch.int32)
    hi = torch.tensor([4, 3, 10], dtype=torch.int32)
    out = ranged_topk(scores, 4, lo, hi)
    assert out[0].tolist() == [0, 1, 2, 3]
    assert out[1].tolist() == [0, 1, 2, -1]
    wide = ranged_topk(scores, 25)
    assert wide[:, :10].tolist() == [list(range(10))] * 3 and (wide[:, 10:] == -1).all()


def test_ranges_are_clipped_to_the_row():
    scores = torch.randn(2, 6)
    lo = torch.tensor([-5, 4], dtype=torch.int32)
    hi = torch.tensor([2, 100], dtype=torch.int32)
    assert torch.equal(ranged_topk(scores, 3, lo, hi), naive_topk(scores, 3, lo, hi))


def test_leading_dims_strides_and_half_inputs():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 3, 64, generator=gen)
    wide = torch.randn(2, 3, 100, generator=gen)
    wide[..., :64] = base
    view = wide[..., :64]
    assert not view.is_contiguous()
    full = ([0] * 6, [64] * 6)
    expected = naive_topk(base.reshape(6, 64), 9, *full).reshape(2, 3, 9)
    assert torch.equal(ranged_topk(base, 9), expected)
    assert torch.equal(ranged_topk(view, 9), expected)
    for dt in (torch.float16, torch.bfloat16):
        half = base.to(dt)  # ranked by the exact fp32 upcast (ties after the cast by column)
        want = naive_topk(half.float().reshape(6, 64), 9, *full).reshape(2, 3, 9)
        assert torch.equal(ranged_topk(half, 9), want)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    n=st.integers(1, 40),
    k=st.integers(1, 50),
    levels=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_against_naive(rows, n, k, levels, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (rows, n), generator=gen).float()
    scores[torch.rand(rows, n, generator=gen) < 0.2] = -math.inf
    scores[torch.rand(rows, n, generator=gen) < 0.1] = math.nan
    lo, hi = random_ranges(rows, n, gen)
    assert torch.equal(ranged_topk(scores, k, lo, hi), naive_topk(scores, k, lo, hi))


def test_validation_messages():
    s = torch.randn(4, 8)
    i32 = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match="scores must have dtype float32"):
        ranged_topk(s.double(), 2)
    with pytest.raises(TypeError, match="scores must be a"):
        ranged_topk([1.0], 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        ranged_topk(s, 0)
    with pytest.raises(TypeError, match="k must be an int"):
        ranged_topk(s, 2.0)
    with pytest.raises(TypeError, match="starts must have dtype int32"):
        ranged_topk(s, 2, i32.long(), i32)
    with pytest.raises(ValueError, match=r"ends must have shape .*got \[5\]"):
        ranged_topk(s, 2, i32, torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one dimension"):
        ranged_topk(torch.tensor(1.0), 1)


def _fields(config: TopkConfig) -> tuple:
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config))


def test_opcheck():
    s = torch.randn(5, 33)
    lo, hi = random_ranges(5, 33, torch.Generator().manual_seed(4))
    fields = _fields(resolve_config(s).config)
    torch.library.opcheck(torch.ops.topk.ranged_topk.default, (s, 7, lo, hi, *fields))
    torch.library.opcheck(torch.ops.topk.ranged_topk.default, (s, 7, None, None, *fields))


def test_compile_fullgraph_dynamic():
    s = torch.randn(5, 33)
    lo, hi = random_ranges(5, 33, torch.Generator().manual_seed(4))
    compiled = torch.compile(ranged_topk, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(s, 7, lo, hi), naive_topk(s, 7, lo, hi))
    s2 = torch.randn(9, 41)
    lo2, hi2 = random_ranges(9, 41, torch.Generator().manual_seed(5))
    assert torch.equal(compiled(s2, 7, lo2, hi2), naive_topk(s2, 7, lo2, hi2))


def test_op_takes_the_config_fields_in_declaration_order():
    """The op rebuilds the TopkConfig from its trailing arguments by position."""
    schema = torch.ops.topk.ranged_topk.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:4] == ["scores", "k", "starts", "ends"]
    assert names[4:] == [f.name for f in dataclasses.fields(TopkConfig)]


# --------------------------------------------------------------------------- config


def test_config_validation():
    cases = [
        (dict(backend="cuda"), "TopkConfig.backend"),
        (dict(num_warps=3), "TopkConfig.num_warps"),
        (dict(num_warps=True), "TopkConfig.num_warps"),
        (dict(reps=3), "TopkConfig.reps"),
        (dict(warps_per_sm=2), "TopkConfig.warps_per_sm"),  # below num_warps = 4
        (dict(warps_per_sm=65), "TopkConfig.warps_per_sm"),
        (dict(prefetch=-1), "TopkConfig.prefetch"),
        (dict(prefetch=1.0), "TopkConfig.prefetch"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            TopkConfig(**kwargs)


def test_resolve_config_on_cpu_is_the_torch_reference(monkeypatch):
    """CPU tensors run the torch reference whatever the caller passes or the arch claims."""
    scores = torch.zeros(2, 8)
    for arch in (None, "sm_90"):
        if arch is None:
            monkeypatch.delenv(ARCH_ENV, raising=False)
        else:
            monkeypatch.setenv(ARCH_ENV, arch)
        for config in (None, TopkConfig(num_warps=8)):
            found = resolve_config(scores, config)
            assert found.config == TORCH_CONFIG and found.config.backend == "torch"
            assert found.source.startswith("cpu tensors")
    with pytest.raises(TypeError, match="config must be a TopkConfig"):
        resolve_config(scores, {"num_warps": 4})


def test_resolve_config_on_cuda(monkeypatch):
    """CUDA tensors: the caller's config, else the arch's table row, else the default."""
    scores = fake_cuda(2, 8, dtype=torch.float32)
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    found = resolve_config(scores)
    assert found.config.backend == "triton" and found.source.startswith("row (measured H200")
    assert found.key == (("arch_major", 9),)
    mine = TopkConfig(num_warps=8, warps_per_sm=32)
    assert resolve_config(scores, mine).config == mine
    assert resolve_config(scores, mine).source == "caller"
    monkeypatch.setenv(ARCH_ENV, "sm_100")
    assert resolve_config(scores).source == "default"
    assert resolve_config(scores).config == TOPK_CONFIGS.default
    # ROCm: the kernel's L2 prefetch is inline PTX, so the reference runs.
    monkeypatch.setenv(ARCH_ENV, "gfx942")
    assert resolve_config(scores).config.backend == "torch"
