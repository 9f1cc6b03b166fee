"""TileLang sparse-attention backward: sm_90a compile checks (CPU, needs nvcc) and the reference
matrix on the GPU.

CPU: every variant the config table can pick (D in {512, 576} x TP-local heads {8, 16, 64, 128};
the sink does not change the kernels) compiles for sm_90a and the generated CUDA uses the
instructions the design relies on; further tilings are in the ``slow`` set.

GPU: dq, dkv and dsink against ``reference.sparse_attention_backward_reference`` (fp32 math on
the same bf16 inputs) with ``out`` / ``lse`` from the reference forward, so these tests do not
depend on the forward kernel. The kernels are compiled up front in a thread pool (nvcc runs as a
subprocess) and reused by every case that shares their static configuration.
"""

import concurrent.futures
import math
import os
import re

import pytest
import torch

tilelang = pytest.importorskip("tilelang", reason="TileLang is not installed (Linux only)")
bw = pytest.importorskip("dsa_sparse_attention._tilelang.backward")

from dsa_sparse_attention import reference  # noqa: E402
from dsa_sparse_attention.config import CONFIG_TABLE  # noqa: E402
from kernel_common.testing import assert_close  # noqa: E402

SM90A = "sm_90a"
D_V = 512
LN2 = math.log(2.0)


def _have_nvcc() -> bool:
    try:
        from tilelang.contrib.nvcc import get_nvcc_compiler

        return os.path.exists(get_nvcc_compiler())
    except Exception:
        return False


needs_nvcc = pytest.mark.skipif(not _have_nvcc(), reason="nvcc not found: cannot compile")
gpu = pytest.mark.gpu  # tests/conftest.py skips these, with the reason, without a CUDA device


def _default_tiling(heads_per_group):
    block_i, num_stages, split_store = bw.default_tiling(heads_per_group)
    return dict(block_i=block_i, num_stages=num_stages, split_store=split_store)


def _compile_all(specs, **common):
    """compile_backward for every spec (dicts of arguments), a few at a time."""
    workers = max(1, min(len(specs), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(bw.compile_backward, **common, **spec) for spec in specs]
        return [f.result() for f in futures]


# --------------------------------------------------------------------------------------------
# CPU: compile for sm_90a
# --------------------------------------------------------------------------------------------


def _table_rows():
    """(heads, dim, tiling) for every TileLang backward row of the config table, the row's
    None fields resolved to the kernel defaults."""
    out = []
    for row in CONFIG_TABLE.rows():
        cfg, key = row.config, dict(row.key)
        if getattr(cfg, "backward_backend", None) != "tilelang":
            continue
        tiling = _default_tiling(key["heads"]) | dict(dkv_reduce=cfg.dkv_reduce)
        for name, field in (
            ("block_i", "backward_block_i"),
            ("num_stages", "backward_stages"),
            ("split_store", "split_store"),
        ):
            if getattr(cfg, field) is not None:
                tiling[name] = getattr(cfg, field)
        out.append((key["heads"], 576 if key["rope_tail"] else 512, tiling))
    return out


# The variants the table can pick: every row, and 128 heads (two head blocks) on the 64 row.
TABLE_VARIANTS = [dict(heads=h, dim=d, **t) for h, d, t in _table_rows()] + [
    dict(heads=128, dim=d, **t) for h, d, t in _table_rows() if h == 64
]
SLOW_VARIANTS = [
    dict(heads=8, dim=576, dkv_reduce="atomic"),
    dict(heads=64, dim=576, dkv_reduce="atomic"),
    dict(heads=32, dim=576),
    dict(heads=8, dim=576, num_stages=3, split_store=4),
    dict(heads=64, dim=576, num_stages=2, split_store=8),
    dict(heads=64, dim=512, num_stages=2, split_store=4),
    dict(heads=16, dim=576, block_i=64, split_store=4, threads=256),
    dict(heads=128, dim=576, groups=2),
    dict(heads=96, dim=576),
    dict(heads=4, dim=576, groups=2),
]


def _check_source(kernels, spec):
    src = kernels.main.get_kernel_source()
    hg = spec["heads"] // spec.get("groups", 1)
    # Lengths are runtime arguments: nothing length-specific is baked into the kernel.
    assert re.search(r"int batch, int seq_len, int seq_len_kv", src), "lengths must be dynamic"
    # The gather is cp.async (16-byte chunks) through the index list.
    assert "tl::cp_async_gs<16>" in src
    # Score MMAs: wgmma for 64-row head blocks, mma.sync below (M = 16 / 32).
    if bw.head_block(hg) == 64:
        assert "wgmma" in src
    else:
        assert "tl::mma_sync" in src
    if spec.get("dkv_reduce", "tma") == "tma":
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in src
        assert src.count("dsa_bulk_reduce_add_f32(") >= 2  # the definition and a use per slice
        assert "dsa_fence_proxy_async_shared();" in src  # staging stores -> TMA reads
        assert "tl::tma_store_wait<0, false>" in src  # the final drain before exit
        assert "AtomicAdd" not in src
    else:
        assert "AtomicAddx2" in src or "AtomicAddx4" in src
    pre = kernels.preprocess.get_kernel_source()
    assert re.search(r"int batch, int seq_len\)", pre)


@needs_nvcc
def test_compile_table_variants_sm90a():
    specs = TABLE_VARIANTS
    kernels = _compile_all(specs, groups=1, d_v=D_V, topk=2048, target=SM90A)
    for spec, k in zip(specs, kernels, strict=True):
        _check_source(k, spec)
        assert k.topk_padded == 2048
    # The in-process cache returns the same compiled objects.
    again = bw.compile_backward(8, 1, 576, D_V, 2048, target=SM90A)
    assert again.main is kernels[0].main and again.preprocess is kernels[0].preprocess


@needs_nvcc
@pytest.mark.slow
def test_compile_more_tilings_sm90a():
    specs = [{"groups": 1, **s} for s in SLOW_VARIANTS]
    kernels = _compile_all(specs, d_v=D_V, topk=2112, target=SM90A)
    for spec, k in zip(specs, kernels, strict=True):
        _check_source(k, spec)
        assert k.topk_padded % (spec.get("block_i") or 32) == 0 and k.topk_padded >= 2112


@pytest.mark.parametrize("dim", [512, 576])
def test_default_tiling_fits_shared_memory(dim):
    for hg in range(1, 129):
        smem = bw.shared_memory_bytes(hg, dim, D_V, **_default_tiling(hg))
        assert smem <= bw.SHARED_MEMORY_LIMIT, (hg, dim, smem)
    # Two programs per SM for small head counts (each hides the other's gather).
    assert bw.shared_memory_bytes(8, dim, D_V, **_default_tiling(8)) <= 113 * 1024


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(heads=6, groups=4), "multiple of groups"),
        (dict(heads=256), "heads per group"),
        (dict(block_i=24), "block_i"),
        (dict(dim=560), "RoPE tail"),
        (dict(split_store=3), "split_store"),
        (dict(dkv_reduce="bf16"), "dkv_reduce"),
        (dict(threads=96), "threads"),
        (dict(heads=8, threads=512), "threads"),
        (dict(heads=64, num_stages=3), "shared memory"),
    ],
)
def test_compile_backward_rejects_bad_configs(kwargs, match):
    args = dict(heads=64, groups=1, dim=576, d_v=D_V, topk=2048, target=SM90A) | kwargs
    with pytest.raises(ValueError, match=match):
        bw.compile_backward(**args)


def test_degenerate_shapes_launch_nothing():
    """No query or no key: nothing is launched (so this runs on the CPU), dq = 0, dkv = 0 and
    dsink still sees dlse through delta = rowsum(out * dout) - dlse."""
    gen = torch.Generator().manual_seed(0)
    b, s, h, g, d, topk = 2, 5, 8, 1, 576, 64
    q = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, 0, g, d, generator=gen).to(torch.bfloat16)
    out = torch.zeros(b, s, h, D_V, dtype=torch.bfloat16)
    dout = torch.randn(b, s, h, D_V, generator=gen).to(torch.bfloat16)
    idx = torch.full((b, s, g, topk), -1, dtype=torch.int32)
    sink = torch.randn(h, generator=gen)
    dlse = torch.randn(b, s, h, generator=gen)
    lse2 = (sink * bw.LOG2E).expand(b, s, h).contiguous()  # only the sink is in the softmax
    dq, dkv, dsink = bw.sparse_attention_backward_tilelang(
        dout, dlse, q, kv, idx, out, lse2, sink, 0.05, D_V
    )
    assert dq.shape == q.shape and bool((dq == 0).all()) and dkv.shape == kv.shape
    torch.testing.assert_close(dsink, dlse.sum(dim=(0, 1)))  # p_sink = 1 on every row
    empty = q[:, :0]
    dq, dkv, dsink = bw.sparse_attention_backward_tilelang(
        dout[:, :0], None, empty, kv, idx[:, :0], out[:, :0], lse2[:, :0], None, 0.05, D_V
    )
    assert dq.shape == empty.shape and dsink is None


# --------------------------------------------------------------------------------------------
# GPU: against the torch reference
# --------------------------------------------------------------------------------------------


def _table_tilings():
    """(heads, dim, tiling) for every TileLang backward row of the config table, plus the
    kernel defaults and a few more ring depths."""
    out = _table_rows()
    out += [(heads, 576, _default_tiling(heads)) for heads in (8, 32, 64)]
    out.append((8, 576, dict(block_i=32, num_stages=3, split_store=4)))
    out.append((64, 576, dict(block_i=32, num_stages=2, split_store=8)))
    unique = {repr((h, d, sorted(t.items()))): (h, d, t) for h, d, t in out}
    return list(unique.values())


def _block_count_cases():
    """topk giving 1, stages, stages + 1 and 2 * stages + 1 index blocks for every tiling."""
    cases = []
    for heads, dim, tiling in _table_tilings():
        s = tiling["num_stages"]
        for n in sorted({1, s, s + 1, 2 * s + 1}):
            cases.append((heads, dim, n * tiling["block_i"], tiling))
    return cases


# (heads, groups, dim, topk, tiling): the matrix of DESIGN.md, cut so that each static config
# is compiled once. Every case also has a sink / dlse / padding setting below.
MATRIX = (
    [(h, 1, d, 100, {}) for h in (8, 16, 32, 64, 128) for d in (512, 576)]
    + [(h, 1, 576, k, {}) for h in (8, 64) for k in (1, 64, 640, 2048, 2112)]
    + [(16, 2, 576, 640, {}), (64, 2, 512, 100, {}), (12, 1, 576, 64, {})]
    + [
        (8, 1, 576, 640, dict(dkv_reduce="atomic")),
        (64, 1, 576, 640, dict(dkv_reduce="atomic")),
        (8, 1, 576, 640, dict(num_stages=3, split_store=4)),
        (16, 1, 576, 640, dict(block_i=64, split_store=4, threads=256)),
        (64, 1, 512, 640, dict(num_stages=2, split_store=4)),
    ]
)
PADDINGS = ("mixed", "tail", "shuffled", "all", "out_of_range", "none")


def _all_specs():
    specs = [dict(heads=h, groups=g, dim=d, d_v=D_V, topk=k, **t) for h, g, d, k, t in MATRIX] + [
        dict(heads=h, groups=1, dim=d, d_v=D_V, topk=k, **t) for h, d, k, t in _block_count_cases()
    ]
    return specs


@pytest.fixture(scope="module")
def compiled():
    """Compile every static configuration of this module once, in parallel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    unique = {}
    for spec in _all_specs():
        # Fill in the default tiling so that equal configurations are compiled once.
        full = _default_tiling(spec["heads"] // spec["groups"]) | spec
        unique[repr(sorted(full.items()))] = full
    _compile_all(list(unique.values()))
    return True


def _indices(b, s, s_kv, g, topk, padding, gen, device):
    """Random key rows (duplicates allowed) with the requested padding pattern."""
    idx = torch.randint(0, s_kv, (b, s, g, topk), generator=gen, device=device, dtype=torch.int32)
    if padding in ("tail", "mixed"):
        keep = torch.randint(0, topk + 1, (b, s, g, 1), generator=gen, device=device)
        idx = torch.where(torch.arange(topk, device=device) < keep, idx, -1)
    if padding in ("shuffled", "mixed"):
        drop = torch.rand(idx.shape, generator=gen, device=device) < 0.3
        idx = torch.where(drop, -1, idx)
    if padding in ("all", "mixed"):
        rows = torch.rand((b, s, g, 1), generator=gen, device=device) < 0.15
        idx = torch.where(rows, -1, idx)
    if padding in ("out_of_range", "mixed"):
        bad = torch.rand(idx.shape, generator=gen, device=device) < 0.1
        junk = torch.randint(0, 3, idx.shape, generator=gen, device=device, dtype=torch.int32)
        junk = torch.where(junk == 0, -7, torch.where(junk == 1, s_kv, s_kv + 1000))
        idx = torch.where(bad, junk.to(torch.int32), idx)
    if padding in ("mixed", "none") and topk > 1:
        # Explicit duplicates: copy the first slot over the last one.
        idx[..., -1] = idx[..., 0]
    return idx.contiguous()


def _case(b, s, s_kv, heads, groups, dim, topk, *, sink, dlse, padding, seed):
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device)

    q = randn(b, s, heads, dim).to(torch.bfloat16)
    kv = randn(b, s_kv, groups, dim).to(torch.bfloat16)
    dout = randn(b, s, heads, D_V).to(torch.bfloat16)
    idx = _indices(b, s, s_kv, groups, topk, padding, gen, device)
    attn_sink = randn(heads) if sink else None
    dlse_t = randn(b, s, heads) if dlse else None
    return q, kv, dout, idx, attn_sink, dlse_t


def _poison_allocator(*tensors_like):
    """Leave NaN-filled blocks in the caching allocator: outputs the kernel forgets to write then
    show up as NaN (torch.empty reuses freed blocks of the same size)."""
    junk = [torch.full_like(t, float("nan")) for t in tensors_like]
    del junk


def _run_and_compare(q, kv, dout, idx, attn_sink, dlse, *, tiling=None, sm_scale=None):
    dim = q.shape[-1]
    sm_scale = sm_scale if sm_scale is not None else reference.default_sm_scale(dim)
    s_kv = kv.shape[1]
    # The reference takes only [-1, S_kv): every other value is padding for the kernel.
    idx_ref = torch.where((idx >= 0) & (idx < s_kv), idx, -1)
    out, lse = reference.sparse_attention_forward_reference(
        q, kv, idx_ref, sm_scale, D_V, attn_sink
    )
    dq_ref, dkv_ref, dsink_ref = reference.sparse_attention_backward_reference(
        dout, dlse, q, kv, idx_ref, lse, sm_scale, D_V, attn_sink
    )
    _poison_allocator(q, dq_ref)
    dq, dkv, dsink = bw.sparse_attention_backward_tilelang(
        dout, dlse, q, kv, idx, out, lse / LN2, attn_sink, sm_scale, D_V, **(tiling or {})
    )
    torch.cuda.synchronize()
    assert dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16
    for name, t in (("dq", dq), ("dkv", dkv)):
        assert bool(torch.isfinite(t).all()), f"{name} has non-finite entries"
    assert_close(dq, dq_ref, name="dq")
    assert_close(dkv, dkv_ref, name="dkv")
    if attn_sink is None:
        assert dsink is None
    else:
        assert dsink.dtype == torch.float32 and bool(torch.isfinite(dsink).all())
        assert_close(dsink, dsink_ref, name="dsink")
    # A row with no valid index has exactly zero dq.
    empty = ~((idx >= 0) & (idx < s_kv)).any(dim=-1)  # [B, S, G]
    heads_per_group = q.shape[2] // kv.shape[2]
    empty_heads = empty.repeat_interleave(heads_per_group, dim=2)
    assert bool((dq[empty_heads] == 0).all())


@gpu
@pytest.mark.parametrize("case", range(len(MATRIX)))
def test_backward_matches_reference(compiled, case):
    heads, groups, dim, topk, tiling = MATRIX[case]
    s = 64 + 16 * (case % 5)
    q, kv, dout, idx, sink, dlse = _case(
        2, s, 2 * s, heads, groups, dim, topk, sink=case % 2 == 0, dlse=case % 3 == 0,
        padding=PADDINGS[case % len(PADDINGS)], seed=case,
    )  # fmt: skip
    _run_and_compare(q, kv, dout, idx, sink, dlse, tiling=tiling)


@gpu
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("sink", [False, True])
def test_backward_padding_patterns(compiled, padding, sink):
    q, kv, dout, idx, attn_sink, dlse = _case(
        2, 96, 192, 64, 1, 576, 100, sink=sink, dlse=True, padding=padding, seed=7
    )
    _run_and_compare(q, kv, dout, idx, attn_sink, dlse)


@gpu
def test_backward_all_rows_empty(compiled):
    q, kv, dout, idx, sink, _ = _case(
        2, 64, 128, 8, 1, 576, 100, sink=False, dlse=False, padding="none", seed=3
    )
    idx = torch.full_like(idx, -1)
    _run_and_compare(q, kv, dout, idx, sink, None)


@gpu
@pytest.mark.parametrize("case", range(len(_block_count_cases())))
def test_backward_block_counts(compiled, case):
    """1, stages, stages + 1 and 2 * stages + 1 index blocks for every tiling the table uses
    (a software-pipelined gather once read the wrong stage at stages + 1 blocks)."""
    heads, dim, topk, tiling = _block_count_cases()[case]
    q, kv, dout, idx, sink, dlse = _case(
        2, 80, 160, heads, 1, dim, topk, sink=True, dlse=case % 2 == 0, padding="mixed",
        seed=100 + case,
    )  # fmt: skip
    _run_and_compare(q, kv, dout, idx, sink, dlse, tiling=tiling)


@gpu
def test_no_recompile_for_new_lengths(compiled, monkeypatch):
    heads, dim, topk = 16, 576, 640
    bw.compile_backward(heads, 1, dim, D_V, topk)  # the one compile of this configuration

    def no_compile(*args, **kwargs):
        raise AssertionError("a new length must not compile a new kernel")

    monkeypatch.setattr(bw.tilelang, "compile", no_compile)
    for seed, (b, s, s_kv) in enumerate([(1, 37, 80), (2, 64, 128), (3, 129, 301)]):
        q, kv, dout, idx, sink, dlse = _case(
            b, s, s_kv, heads, 1, dim, topk, sink=True, dlse=True, padding="mixed", seed=seed
        )
        _run_and_compare(q, kv, dout, idx, sink, dlse)


@gpu
def test_backward_cuda_graph_capture(compiled):
    """No host synchronisation: the whole backward can be captured and replayed."""
    q, kv, dout, idx, sink, dlse = _case(
        2, 64, 128, 16, 1, 576, 640, sink=True, dlse=True, padding="mixed", seed=11
    )
    sm_scale = reference.default_sm_scale(576)
    idx_ref = torch.where((idx >= 0) & (idx < 128), idx, -1)
    out, lse = reference.sparse_attention_forward_reference(q, kv, idx_ref, sm_scale, D_V, sink)
    lse2 = lse / LN2
    args = (dout, dlse, q, kv, idx, out, lse2, sink, sm_scale, D_V)
    expected = bw.sparse_attention_backward_tilelang(*args)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = bw.sparse_attention_backward_tilelang(*args)
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(("dq", "dkv", "dsink"), captured, expected, strict=True):
        assert_close(got, want, name=name)
