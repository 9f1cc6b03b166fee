"""TileLang sparse-attention forward: sm_90a compiles without a GPU, exactness on a GPU.

CPU: every kernel variant the model table reaches is compiled for sm_90a (a representative set of
eight by default, the rest under ``slow``), plus the wrapper's validation and empty-key path.
GPU: forward against the fp32 torch reference over heads, topk, widths, sinks, layouts, padding
patterns and the block counts 1, num_stages, num_stages + 1, 2 * num_stages + 1 of every tiling
the config table can pick; no recompilation across lengths; CUDA-graph capture.
"""

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("tilelang")  # a Linux-only dependency of the package

from dsa_sparse_attention import reference
from dsa_sparse_attention._tilelang import forward as fwd
from dsa_sparse_attention.config import CONFIG_TABLE
from kernel_common.testing import assert_close, poisoned

LN2 = math.log(2.0)
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (Hopper) to run kernels")


def _tilings() -> list[tuple[int, int]]:
    """(block_i, num_stages) of the wrapper's default and of every TileLang row of the table."""
    found = {(64, 2)}
    for config in CONFIG_TABLE.configs():
        if config.forward_backend == "tilelang":
            found.add((config.forward_block_i, config.forward_stages))
    return sorted(found)


TILINGS = _tilings()

# Static variants (heads, groups, D, d_v, topk_padded, has_sink) of the model table
# (glm5: 576 wide, topk 2048; glm5.3-flash: 576 or 512 wide, topk 2112; dsv4.1-flash: 512 wide,
# topk 640, sink) at TP-local heads 64 / TP, plus 128 heads (two head blocks) and block counts.
FAST_VARIANTS = [
    (64, 1, 576, 512, 2048, False),  # glm5, TP 1
    (8, 1, 576, 512, 2112, False),  # glm5.3-flash, TP 8: 33 blocks, a static remainder
    (128, 1, 576, 512, 2048, False),  # 128 heads: two head blocks per query
    (16, 1, 576, 512, 64, False),  # one block: no block loop at all
    (64, 1, 512, 512, 2112, False),  # glm5.3-flash without the tail
    (8, 1, 512, 512, 640, True),  # dsv4.1-flash, TP 8
    (32, 1, 512, 512, 192, True),  # num_stages + 1 blocks, sink, TP 2
    (64, 1, 512, 512, 640, True),  # dsv4.1-flash, TP 1
]
SLOW_VARIANTS = [
    (heads, 1, dim, 512, topk, sink)
    for dim in (512, 576)
    for heads in (8, 16, 32, 64, 128)
    for sink in (False, True)
    for topk in ((2048 if dim == 576 else (640 if sink else 2112)),)
    if (heads, 1, dim, 512, topk, sink) not in FAST_VARIANTS
] + [
    (16, 2, 576, 512, 128, True),  # kv groups
    (96, 1, 576, 512, 640, False),  # a partial second head block
    (8, 1, 192, 128, 128, True),  # a small width: d_v 128 plus a 64-wide tail
]


def _variant_id(v) -> str:
    heads, groups, dim, d_v, topk_padded, sink = v
    return f"H{heads}-G{groups}-D{dim}-dv{d_v}-tk{topk_padded}-{'sink' if sink else 'nosink'}"


def _check_compiled(kernel, variant, tmp_path) -> None:
    heads, groups, dim = variant[:3]
    src = kernel.get_kernel_source()
    assert "tl::wgmma_ss<" in src, "S = Q K^T and the shared-P P V must lower to wgmma"
    assert "tl::wgmma_rs<" in src, "warpgroup 0's P V must take P from registers"
    assert "cp_async_gs" in src and "mbarrier_cp_async_arrive_noinc" in src, "gather path"
    assert "__launch_bounds__(384, 1)" in src
    assert "initialize_wgmma_descriptor_at_use" in src  # the prelude's per-use descriptors
    q_shape = [str(x) for x in kernel.prim_func.buffer_map[kernel.prim_func.params[0]].shape]
    assert q_shape == ["batch", "seq_len", str(heads), str(dim)]
    idx_shape = [str(x) for x in kernel.prim_func.buffer_map[kernel.prim_func.params[2]].shape]
    assert idx_shape == ["batch", "seq_len", str(groups), "topk"]
    lib = tmp_path / "forward.so"
    kernel.export_library(str(lib))
    assert lib.stat().st_size > 0


@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
@pytest.mark.parametrize(
    "variant",
    [*FAST_VARIANTS, *(pytest.param(v, marks=pytest.mark.slow) for v in SLOW_VARIANTS)],
    ids=_variant_id,
)
def test_compiles_for_sm90a(variant, tiling, tmp_path):
    """Each variant lowers to wgmma + cp.async and builds a library for sm_90a (no GPU needed)."""
    block_i, num_stages = tiling
    if fwd.shared_memory_bytes(variant[2], block_i, num_stages) > fwd.SMEM_LIMIT:
        pytest.skip("tiling does not fit this width's shared memory")
    kernel = fwd.compile_forward(*variant, block_i, num_stages, "sm_90a")
    _check_compiled(kernel, variant, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
@pytest.mark.parametrize("dim", [512, 576])
def test_compiles_block_counts(dim, tiling, tmp_path):
    """Block counts 1, ns, ns + 1 and 2 ns + 1 (static loop/remainder shapes) compile."""
    block_i, num_stages = tiling
    if fwd.shared_memory_bytes(dim, block_i, num_stages) > fwd.SMEM_LIMIT:
        pytest.skip("tiling does not fit this width's shared memory")
    for n in (1, num_stages, num_stages + 1, 2 * num_stages + 1):
        variant = (64, 1, dim, 512, n * block_i, dim == 512)
        _check_compiled(
            fwd.compile_forward(*variant, block_i, num_stages, "sm_90a"), variant, tmp_path
        )


@pytest.mark.parametrize(
    "args, match",
    [
        ((6, 4, 576, 512, 64, 64, 2), "multiple of groups"),
        ((8, 1, 576, 448, 64, 64, 2), "d_v"),
        ((8, 1, 600, 512, 64, 64, 2), "D - d_v"),
        ((8, 1, 576, 512, 64, 48, 2), "block_i"),
        ((8, 1, 576, 512, 64, 64, 1), "num_stages"),
        ((8, 1, 576, 512, 100, 64, 2), "topk_padded"),
        ((8, 1, 576, 512, 192, 64, 3), "shared memory"),
    ],
)
def test_rejects_unsupported_configs(args, match):
    with pytest.raises(ValueError, match=match):
        fwd.check_config(*args)


def test_wrapper_rejects_other_thread_counts():
    q = torch.zeros(1, 2, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="384"):
        fwd.sparse_attention_forward_tilelang(q, kv, idx, None, 0.1, 512, threads=256)


@pytest.mark.parametrize("with_sink", [False, True])
def test_empty_key_set(with_sink):
    """S_kv = 0: no kernel launch; zeros and the sink-only (or -inf) log2 lse."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 8, 576, generator=gen).to(torch.bfloat16)
    kv = torch.empty(2, 0, 1, 576, dtype=torch.bfloat16)
    idx = torch.full((2, 3, 1, 16), -1, dtype=torch.int32)
    sink = torch.randn(8, generator=gen) if with_sink else None
    out, lse2 = fwd.sparse_attention_forward_tilelang(q, kv, idx, sink, 0.05, 512)
    assert torch.equal(out, torch.zeros_like(out))
    expected = sink.expand(2, 3, 8) if with_sink else torch.full((2, 3, 8), float("-inf"))
    assert_close(lse2 * LN2, expected, name="lse")


def test_padded_topk():
    assert [fwd.padded_topk(t) for t in (1, 64, 65, 100, 2048, 2112)] == [
        64,
        64,
        128,
        128,
        2048,
        2112,
    ]
    assert fwd.padded_topk(33, 32) == 64


# ----------------------------------------------------------------------------------------------
# GPU: exactness against the fp32 reference.


def _indices(gen, b, s, g, topk, s_kv, pattern):
    """int32 [b, s, g, topk] index rows for one padding pattern (all on the generator's device).

    ``tail``: distinct keys, a random count of them, then -1; ``shuffled``: the same with the -1
    scattered; ``empty_rows``: like ``shuffled`` with every third query all -1; ``out_of_range``:
    like ``shuffled`` with entries >= S_kv and < -1 mixed in; ``duplicates``: keys drawn with
    replacement; ``causal``: query t (of a suffix of the keys) picks distinct keys <= its position.
    """
    dev = gen.device
    if pattern == "duplicates":
        return torch.randint(0, s_kv, (b, s, g, topk), generator=gen, device=dev, dtype=torch.int32)
    scores = torch.rand(b, s, g, s_kv, generator=gen, device=dev)
    if pattern == "causal":
        pos = torch.arange(s, device=dev) + (s_kv - s)
        scores = scores.masked_fill(torch.arange(s_kv, device=dev) > pos[:, None, None], -1.0)
    k = min(topk, s_kv)
    top, cols = scores.topk(k, dim=-1)
    cols = torch.where(top < 0, -1, cols)
    idx = torch.full((b, s, g, topk), -1, dtype=torch.int64, device=dev)
    idx[..., :k] = cols
    if pattern != "causal":
        count = torch.randint(0, topk + 1, (b, s, g, 1), generator=gen, device=dev)
        idx = torch.where(torch.arange(topk, device=dev) < count, idx, -1)
        idx[0, 0, 0, :k] = cols[0, 0, 0]  # one full row
    if pattern in ("shuffled", "empty_rows", "out_of_range"):
        perm = torch.rand(b, s, g, topk, generator=gen, device=dev).argsort(dim=-1)
        idx = idx.gather(-1, perm)
    if pattern == "empty_rows":
        idx[:, ::3] = -1
    if pattern == "out_of_range":
        junk = torch.tensor([s_kv, s_kv + 7, 2**31 - 1, -2, -1000, -(2**31)], device=dev)
        pick = torch.randint(0, len(junk), idx.shape, generator=gen, device=dev)
        where = torch.rand(idx.shape, generator=gen, device=dev) < 0.15
        idx = torch.where(where, junk[pick], idx)
    return idx.to(torch.int32)


def _run_kernel(q, kv, idx, sink, sm_scale, d_v, block_i, num_stages):
    """The compiled kernel on poisoned outputs (the wrapper minus its allocation)."""
    b, s, h, d = q.shape
    kernel = fwd.compile_forward(
        h,
        kv.shape[2],
        d,
        d_v,
        fwd.padded_topk(idx.shape[-1], block_i),
        sink is not None,
        block_i,
        num_stages,
        "sm_90a",
    )
    out = poisoned((b, s, h, d_v), torch.bfloat16, q.device)
    lse2 = poisoned((b, s, h), torch.float32, q.device)
    sink_arg = sink if sink is not None else torch.empty(h, device=q.device)
    kernel(q, kv, idx, sink_arg, out, lse2, float(sm_scale))
    return out, lse2


def _check_case(case, block_i, num_stages, seed, sm_scale=None):
    heads, groups, dim, topk, sink, b, s, s_kv, pattern = case
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b, s, heads, dim, generator=gen, device=dev).to(torch.bfloat16)
    kv = torch.randn(b, s_kv, groups, dim, generator=gen, device=dev).to(torch.bfloat16)
    idx = _indices(gen, b, s, groups, topk, s_kv, pattern)
    attn_sink = torch.randn(heads, generator=gen, device=dev) * 2 if sink else None
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    out, lse2 = _run_kernel(q, kv, idx, attn_sink, sm_scale, 512, block_i, num_stages)
    # The kernel treats every index outside [0, S_kv) as padding; the reference wants -1 there.
    ref_idx = torch.where((idx >= 0) & (idx < s_kv), idx, -1)
    ref_out, ref_lse = reference.sparse_attention_forward_reference(
        q, kv, ref_idx, sm_scale, 512, attn_sink
    )
    torch.cuda.synchronize()
    assert_close(out.float(), ref_out.float(), name=f"out {case}")
    assert_close(lse2 * LN2, ref_lse, name=f"lse {case}")
    empty = (ref_idx < 0).all(dim=-1)  # [b, s, g]
    if bool(empty.any()):
        rows = empty.repeat_interleave(heads // groups, dim=2)
        assert bool((out[rows] == 0).all()), "a row without a valid index must give exactly 0"


# (heads, groups, D, topk, sink, B, S, S_kv, pattern) per block count n of a tiling: n = 1 takes
# topk 1 and block_i, the others n * block_i - 7 * block_i / 16 (a partly padded last block;
# topk 100 at n = 2, block_i = 64).
_BLOCK_COUNT_SHAPES = {
    0: [(128, 1, 576, False, 2, 40, 200, "shuffled"), (128, 1, 576, False, 1, 50, 90, "tail")],
    1: [(16, 1, 512, True, 1, 64, 300, "empty_rows")],
    2: [(32, 1, 512, True, 1, 48, 96, "out_of_range")],
    3: [(64, 1, 512, True, 2, 33, 500, "duplicates")],
}


def _block_count_cases(block_i, num_stages):
    cases = []
    for slot, n in enumerate((1, num_stages, num_stages + 1, 2 * num_stages + 1)):
        for i, (h, g, d, sink, b, s, s_kv, pattern) in enumerate(_BLOCK_COUNT_SHAPES[slot]):
            topk = (1 if i == 0 else block_i) if n == 1 else n * block_i - 7 * block_i // 16
            cases.append((h, g, d, topk, sink, b, s, s_kv, pattern))
    return cases


# Model shapes and layouts: glm5 (576, topk 2048), glm5.3-flash (2112, both widths),
# dsv4.1-flash (512, 640, sink, S_kv = 2 S), kv groups, a partial second head block.
_MODEL_CASES = [
    (64, 1, 576, 2048, False, 1, 512, 2560, "causal"),
    (64, 1, 576, 2048, False, 2, 64, 128, "tail"),
    (64, 1, 576, 2048, False, 1, 96, 3000, "out_of_range"),
    (64, 1, 576, 2048, False, 1, 64, 2500, "empty_rows"),
    (64, 1, 576, 2048, False, 1, 64, 1000, "duplicates"),
    (8, 1, 576, 2112, False, 1, 80, 2200, "shuffled"),
    (8, 1, 512, 2112, False, 2, 40, 2112, "causal"),
    (64, 1, 512, 640, True, 1, 128, 256, "causal"),
    (64, 1, 512, 640, True, 2, 48, 96, "empty_rows"),
    _GROUPS_CASE := (16, 2, 576, 128, True, 2, 40, 80, "shuffled"),
    (96, 1, 576, 640, False, 1, 40, 900, "out_of_range"),
]


def _gpu_keys():
    keys = set()
    for bi, ns in TILINGS:
        for h, g, d, topk, sink, *_ in [*_block_count_cases(bi, ns), *_MODEL_CASES]:
            if fwd.shared_memory_bytes(d, bi, ns) <= fwd.SMEM_LIMIT:
                keys.add((h, g, d, 512, fwd.padded_topk(topk, bi), sink, bi, ns, "sm_90a"))
    return sorted(keys)


@pytest.fixture(scope="module")
def warm_kernels():
    """Compile the GPU cases' kernels in parallel processes first (each takes 10-40 s).

    The processes fill TileLang's disk cache, from which this process then loads each kernel.
    """
    keys = _gpu_keys()
    code = "from dsa_sparse_attention._tilelang.forward import compile_forward as c; "
    workers = max(1, min(len(keys), (os.cpu_count() or 2) // 2))

    def build(key):
        args = ", ".join(repr(k) for k in key)
        subprocess.run([sys.executable, "-c", code + f"c({args})"], check=True, timeout=900)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(build, keys))


def _fits(case, tiling):
    return fwd.shared_memory_bytes(case[2], *tiling) <= fwd.SMEM_LIMIT


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
def test_block_counts_match_reference(tiling, warm_kernels):
    """1, ns, ns + 1 and 2 ns + 1 blocks (the stage + 1 case once read a stale stage)."""
    for i, case in enumerate(_block_count_cases(*tiling)):
        if _fits(case, tiling):
            _check_case(case, *tiling, seed=100 + i)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
@pytest.mark.parametrize(
    "i", range(len(_MODEL_CASES)), ids=["-".join(map(str, c)) for c in _MODEL_CASES]
)
def test_model_shapes_match_reference(i, tiling, warm_kernels):
    case = _MODEL_CASES[i]
    if not _fits(case, tiling):
        pytest.skip("tiling does not fit this width's shared memory")
    _check_case(case, *tiling, seed=1000 + i)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sm_scale", [0.0, -0.04, 0.2])
def test_any_scale(sm_scale, warm_kernels):
    """The running maximum is taken over scaled logits: zero and negative scales work too."""
    _check_case(_GROUPS_CASE, 64, 2, seed=7, sm_scale=sm_scale)


@pytest.mark.gpu
@needs_cuda
def test_new_lengths_do_not_recompile(warm_kernels):
    """Batch, S and S_kv are dynamic: three shapes, one compiled kernel."""
    case = (64, 1, 576, 2048, False)
    _check_case((*case, 1, 33, 100, "tail"), 64, 2, seed=1)
    before = fwd.compile_forward.cache_info()
    _check_case((*case, 2, 64, 4096, "shuffled"), 64, 2, seed=2)
    _check_case((*case, 3, 17, 2500, "duplicates"), 64, 2, seed=3)
    after = fwd.compile_forward.cache_info()
    assert after.misses == before.misses and after.currsize == before.currsize


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("with_sink", [False, True])
def test_wrapper_matches_reference_and_captures(with_sink, warm_kernels):
    """The public wrapper (its own allocation) under CUDA-graph capture and replay."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11 + with_sink)
    heads, dim, topk = (64, 512, 640) if with_sink else (64, 576, 2048)
    q = torch.randn(1, 48, heads, dim, generator=gen, device=dev).to(torch.bfloat16)
    kv = torch.randn(1, 700, 1, dim, generator=gen, device=dev).to(torch.bfloat16)
    idx = _indices(gen, 1, 48, 1, topk, 700, "shuffled")
    sink = torch.randn(heads, generator=gen, device=dev) if with_sink else None
    scale = 1.0 / math.sqrt(dim)
    out, lse2 = fwd.sparse_attention_forward_tilelang(q, kv, idx, sink, scale, 512)
    ref_out, ref_lse = reference.sparse_attention_forward_reference(q, kv, idx, scale, 512, sink)
    assert_close(out.float(), ref_out.float(), name="out")
    assert_close(lse2 * LN2, ref_lse, name="lse")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse2 = fwd.sparse_attention_forward_tilelang(q, kv, idx, sink, scale, 512)
    q.copy_(torch.randn(q.shape, generator=gen, device=dev).to(torch.bfloat16))
    graph.replay()
    ref_out, ref_lse = reference.sparse_attention_forward_reference(q, kv, idx, scale, 512, sink)
    torch.cuda.synchronize()
    assert_close(g_out.float(), ref_out.float(), name="graph out")
    assert_close(g_lse2 * LN2, ref_lse, name="graph lse")
