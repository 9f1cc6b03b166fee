"""TileLang sparse-attention forward: sm_90a compiles without a GPU, exactness on a GPU.

CPU: kernel variants the model table reaches are compiled for sm_90a (a representative set of
four by default, the rest under ``slow``), with the nvcc that the dev group installs from PyPI
(these tests fail, not skip, where TileLang cannot find it); ``precompile`` builds the same
kernels; the tiling checks name the config field to change; the wrapper's empty-key path.
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

if sys.platform != "linux":
    pytest.skip("tilelang is a Linux-only dependency", allow_module_level=True)

from dsa_sparse_attention import (
    AttentionShape,
    SparseAttentionConfig,
    _flash_mla,
    precompile,
    reference,
)
from dsa_sparse_attention._tilelang import backward as bw
from dsa_sparse_attention._tilelang import forward as fwd
from dsa_sparse_attention.config import CONFIG_TABLE
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LN2, LOG2E, round_up
from kernel_common.testing import assert_close, poisoned
from support import as_padding, attention_indices, attention_inputs, seeded_gen

SM90A = "sm_90a"


def _tilings() -> list[tuple[int, int]]:
    """(block_i, num_stages) of the config default and of every TileLang row of the table."""
    default = SparseAttentionConfig()
    found = {(default.forward_block_i, default.forward_stages)}
    for config in CONFIG_TABLE.configs():
        if config.forward_backend == "tilelang":
            found.add((config.forward_block_i, config.forward_stages))
    return sorted(found)


TILINGS = _tilings()


def _fits(dim, tiling) -> bool:
    return fwd.shared_memory_bytes(dim, *tiling) <= HOPPER_SMEM_PER_BLOCK


# Static variants (heads, groups, D, d_v, topk, has_sink) of the model table (glm5: 576 wide,
# topk 2048; glm5.3-flash: 576 or 512 wide, topk 2112; dsv4.1-flash: 512 wide, topk 640, sink)
# at TP-local heads 64 / TP, plus 128 heads (two head blocks) and block counts. The fast set
# covers both widths, with and without sink, one and two head blocks, a static remainder block
# and a single block; the rest is ``slow``.
FAST_VARIANTS = [
    (64, 1, 576, 512, 2048, False),  # glm5, TP 1
    (128, 1, 576, 512, 2112, False),  # two head blocks per query; 33 blocks: a remainder
    (16, 1, 576, 512, 64, False),  # one block: no block loop at all
    (8, 1, 512, 512, 640, True),  # dsv4.1-flash, TP 8
]
SLOW_VARIANTS = [
    (heads, 1, dim, 512, topk, sink)
    for dim in (512, 576)
    for heads in (8, 16, 32, 64, 128)
    for sink in (False, True)
    for topk in ((2048 if dim == 576 else (640 if sink else 2112)),)
    if (heads, 1, dim, 512, topk, sink) not in FAST_VARIANTS
] + [
    (8, 1, 576, 512, 2112, False),  # glm5.3-flash, TP 8: 33 blocks, a static remainder
    (64, 1, 512, 512, 2112, False),  # glm5.3-flash without the tail
    (32, 1, 512, 512, 192, True),  # num_stages + 1 blocks, sink, TP 2
    (16, 2, 576, 512, 128, True),  # kv groups
    (96, 1, 576, 512, 640, False),  # a partial second head block
    (8, 1, 192, 128, 128, True),  # a small width: d_v 128 plus a 64-wide tail
]


def _variant_id(v) -> str:
    heads, groups, dim, d_v, topk, sink = v
    return f"H{heads}-G{groups}-D{dim}-dv{d_v}-tk{topk}-{'sink' if sink else 'nosink'}"


def _compile(variant, block_i, num_stages):
    heads, groups, dim, d_v, topk, sink = variant
    padded = round_up(topk, block_i)
    return fwd.compile_forward(heads, groups, dim, d_v, padded, sink, block_i, num_stages, SM90A)


def _check_compiled(kernel, variant, tmp_path) -> None:
    heads, groups, dim = variant[:3]
    src = kernel.get_kernel_source()
    assert "tl::wgmma_ss<" in src, "S = Q K^T and the shared-P P V must lower to wgmma"
    assert "tl::wgmma_rs<" in src, "warpgroup 0's P V must take P from registers"
    assert "cp_async_gs" in src and "mbarrier_cp_async_arrive_noinc" in src, "gather path"
    assert f"__launch_bounds__({fwd.THREADS}, 1)" in src
    assert "initialize_wgmma_descriptor_at_use" in src  # the prelude's per-use descriptors
    q_shape = [str(x) for x in kernel.prim_func.buffer_map[kernel.prim_func.params[0]].shape]
    assert q_shape == ["batch", "seq_len", str(heads), str(dim)]
    idx_shape = [str(x) for x in kernel.prim_func.buffer_map[kernel.prim_func.params[2]].shape]
    assert idx_shape == ["batch", "seq_len", str(groups), "topk"]
    lib = tmp_path / "forward.so"
    kernel.export_library(str(lib))
    assert lib.stat().st_size > 0


def test_tilelang_finds_nvcc():
    """The dev group installs nvcc 13.0 from PyPI (nvidia-cuda-nvcc); TileLang must find it
    (CUDA_HOME, nvcc on PATH or that package), or no compile test below can run."""
    from tilelang.contrib.nvcc import get_nvcc_compiler

    nvcc = get_nvcc_compiler()
    assert os.path.isfile(nvcc) and os.access(nvcc, os.X_OK), f"no nvcc at {nvcc!r}"
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    assert "release 13." in version.stdout, version.stdout


@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
@pytest.mark.parametrize(
    "variant",
    [*FAST_VARIANTS, *(pytest.param(v, marks=pytest.mark.slow) for v in SLOW_VARIANTS)],
    ids=_variant_id,
)
def test_compiles_for_sm90a(variant, tiling, tmp_path):
    """Each variant lowers to wgmma + cp.async and builds a library for sm_90a (no GPU needed)."""
    assert _fits(variant[2], tiling), "a tiling of the table must fit shared memory"
    _check_compiled(_compile(variant, *tiling), variant, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
@pytest.mark.parametrize("dim", [512, 576])
def test_compiles_block_counts(dim, tiling, tmp_path):
    """Block counts 1, ns, ns + 1 and 2 ns + 1 (static loop/remainder shapes) compile."""
    block_i, num_stages = tiling
    for n in (1, num_stages, num_stages + 1, 2 * num_stages + 1):
        variant = (64, 1, dim, 512, n * block_i, dim == 512)
        _check_compiled(_compile(variant, *tiling), variant, tmp_path)


def test_precompile_builds_the_table_kernels(monkeypatch):
    """precompile builds what a call of the shape runs: the forward and the backward of the
    table row (here the kernels of the first fast variant and of the backward compile test of
    the same row, so nothing new is compiled when those ran first), identical shapes once.
    The row's forward is FlashMLA: where it is not importable the TileLang forward runs, and is
    built; where it is, only the backward."""
    shape = AttentionShape(heads=64, d_qk=576, d_v=512, topk=2048)
    monkeypatch.setattr(_flash_mla, "flash_mla_importable", lambda: True)
    assert precompile([shape, shape], arch="sm_90") == 1
    monkeypatch.setattr(_flash_mla, "flash_mla_importable", lambda: False)
    assert precompile([shape, shape], arch="sm_90") == 2
    row = CONFIG_TABLE.lookup(
        arch_major=9, rope_tail=True, heads=64, topk=2048, deterministic=False
    ).config
    built = (fwd.compile_forward.cache_info(), bw._compile_main.cache_info())
    fwd.compile_forward(
        64, 1, 576, 512, 2048, False, row.forward_block_i, row.forward_stages, SM90A
    )
    bw.compile_backward(
        64, 1, 576, 512, 2048, block_i=row.backward_block_i, num_stages=row.backward_stages,
        split_store=row.split_store, dkv_reduce=row.dkv_reduce, deterministic=False,
        target=SM90A,
    )  # fmt: skip
    # Both were already in the process's cache: precompile built exactly these.
    assert fwd.compile_forward.cache_info().misses == built[0].misses
    assert bw._compile_main.cache_info().misses == built[1].misses


@pytest.mark.parametrize(
    "args, match",
    [
        ((6, 4, 576, 512, 64, 2), "positive multiple of kv.shape"),
        ((8, 1, 576, 448, 64, 2), "d_v = 448"),
        ((8, 1, 600, 512, 64, 2), "RoPE tail"),
        ((64, 1, 576, 512, 48, 2), r"SparseAttentionConfig\.forward_block_i = 48"),
        ((8, 1, 576, 512, 64, 1), r"SparseAttentionConfig\.forward_stages = 1"),
        ((8, 1, 576, 512, 64, 3), r"SparseAttentionConfig\.forward_block_i = 64 with "),
    ],
)
def test_rejects_unsupported_configs(args, match):
    """check_forward_config names the shape argument or config field to change; compile_forward
    refuses the same configurations before compiling anything."""
    with pytest.raises(ValueError, match=match):
        fwd.check_forward_config(*args)
    heads, groups, dim, d_v, block_i, num_stages = args
    with pytest.raises(ValueError, match=match):
        fwd.compile_forward(heads, groups, dim, d_v, 2048, False, block_i, num_stages, SM90A)


def test_invalid_tiling_names_the_field():
    with pytest.raises(ValueError, match=r"SparseAttentionConfig\.forward_block_i"):
        fwd.check_forward_config(64, 1, 576, 512, block_i=48, num_stages=2)
    with pytest.raises(ValueError, match=r"shared memory"):
        fwd.check_forward_config(64, 1, 576, 512, block_i=64, num_stages=3)
    with pytest.raises(ValueError, match=r"topk_padded = 100 must be a positive multiple of 64"):
        fwd.compile_forward(8, 1, 576, 512, 100, False, 64, 2, SM90A)


@pytest.mark.parametrize("with_sink", [False, True])
def test_empty_key_set(with_sink):
    """S_kv = 0: no kernel launch; zeros and the sink-only (or -inf) log2 lse."""
    gen = seeded_gen("empty keys", with_sink)
    q, kv, sink = attention_inputs(2, 3, 0, 8, 1, 576, gen, sink=with_sink)
    idx = torch.full((2, 3, 1, 16), -1, dtype=torch.int32)
    out, lse2 = fwd.sparse_attention_forward_tilelang(
        q, kv, idx, sink, 0.05, 512, block_i=64, num_stages=2
    )
    assert torch.equal(out, torch.zeros_like(out))
    expected = sink.expand(2, 3, 8) if with_sink else torch.full((2, 3, 8), float("-inf"))
    assert_close(lse2 * LN2, expected, name="lse")


# ----------------------------------------------------------------------------------------------
# GPU: exactness against the fp32 reference.


def _run_kernel(q, kv, idx, sink, sm_scale, d_v, block_i, num_stages):
    """The compiled kernel on poisoned outputs (the wrapper minus its allocation)."""
    b, s, h, d = q.shape
    variant = (h, kv.shape[2], d, d_v, idx.shape[-1], sink is not None)
    kernel = _compile(variant, block_i, num_stages)
    out = poisoned((b, s, h, d_v), torch.bfloat16, q.device)
    lse2 = poisoned((b, s, h), torch.float32, q.device)
    sink_arg = sink if sink is not None else torch.empty(h, device=q.device)
    kernel(q, kv, idx, sink_arg, out, lse2, float(sm_scale))
    return out, lse2


def _check_case(case, block_i, num_stages, seed, sm_scale=None):
    heads, groups, dim, topk, sink, b, s, s_kv, pattern = case
    gen = seeded_gen("forward", case, block_i, num_stages, seed)
    q, kv, attn_sink = attention_inputs(b, s, s_kv, heads, groups, dim, gen, sink=sink)
    idx = attention_indices(b, s, groups, topk, s_kv, pattern, gen)
    q, kv, idx = q.cuda(), kv.cuda(), idx.cuda()
    attn_sink = attn_sink.cuda() if sink else None
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    out, lse2 = _run_kernel(q, kv, idx, attn_sink, sm_scale, 512, block_i, num_stages)
    # The kernel treats every index outside [0, S_kv) as padding; the reference wants -1 there.
    ref_idx = as_padding(idx, s_kv)
    ref_out, ref_lse = reference.sparse_attention_forward_reference(
        q, kv, ref_idx, sm_scale, 512, attn_sink
    )
    torch.cuda.synchronize()
    # Both outputs are written whole: no poison may survive.
    assert not bool(torch.isnan(out).any()), f"out: poison (NaN) survived {case}"
    assert not bool(torch.isnan(lse2).any()), f"lse2: poison (NaN) survived {case}"
    assert_close(out.float(), ref_out.float(), name=f"out {case}")
    assert_close(lse2 * LN2, ref_lse, name=f"lse {case}")
    empty = (ref_idx < 0).all(dim=-1)  # [b, s, g]
    if bool(empty.any()):
        rows = empty.repeat_interleave(heads // groups, dim=2)
        assert bool((out[rows] == 0).all()), "a row without a valid index must give exactly 0"


# (heads, groups, D, topk, sink, B, S, S_kv, pattern) per block count n of a tiling: n = 1 takes
# topk 1 and block_i, the others n * block_i - 7 * block_i / 16 (a partly padded last block;
# topk 100 at n = 2, block_i = 64). Patterns are those of support.attention_indices.
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
    (16, 1, 576, 640, True, 2, 48, 700, "mixed"),
]


def _gpu_keys():
    keys = set()
    for bi, ns in TILINGS:
        for h, g, d, topk, sink, *_ in [*_block_count_cases(bi, ns), *_MODEL_CASES]:
            if _fits(d, (bi, ns)):
                keys.add((h, g, d, 512, round_up(topk, bi), sink, bi, ns, SM90A))
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


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
def test_block_counts_match_reference(tiling, warm_kernels):
    """1, ns, ns + 1 and 2 ns + 1 blocks (the stage + 1 case once read a stale stage)."""
    for i, case in enumerate(_block_count_cases(*tiling)):
        if _fits(case[2], tiling):
            _check_case(case, *tiling, seed=100 + i)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"bi{t[0]}-st{t[1]}")
@pytest.mark.parametrize(
    "i", range(len(_MODEL_CASES)), ids=["-".join(map(str, c)) for c in _MODEL_CASES]
)
def test_model_shapes_match_reference(i, tiling, warm_kernels):
    case = _MODEL_CASES[i]
    assert _fits(case[2], tiling), "a tiling of the table must fit shared memory"
    _check_case(case, *tiling, seed=1000 + i)


@pytest.mark.gpu
@pytest.mark.parametrize("sm_scale", [0.0, -0.04, 0.2])
def test_any_scale(sm_scale, warm_kernels):
    """The running maximum is taken over scaled logits: zero and negative scales work too."""
    _check_case(_GROUPS_CASE, *TILINGS[0], seed=7, sm_scale=sm_scale)


@pytest.mark.gpu
def test_new_lengths_do_not_recompile(warm_kernels):
    """Batch, S and S_kv are dynamic: three shapes, one compiled kernel."""
    case = (64, 1, 576, 2048, False)
    tiling = TILINGS[0]
    _check_case((*case, 1, 33, 100, "tail"), *tiling, seed=1)
    before = fwd.compile_forward.cache_info()
    _check_case((*case, 2, 64, 4096, "shuffled"), *tiling, seed=2)
    _check_case((*case, 3, 17, 2500, "duplicates"), *tiling, seed=3)
    after = fwd.compile_forward.cache_info()
    assert after.misses == before.misses and after.currsize == before.currsize


@pytest.mark.gpu
@pytest.mark.parametrize("with_sink", [False, True])
def test_wrapper_matches_reference_and_captures(with_sink, warm_kernels):
    """The public wrapper (its own allocation, the table row's tiling) under CUDA-graph capture
    and replay."""
    gen = seeded_gen("wrapper", with_sink)
    heads, dim, topk = (64, 512, 640) if with_sink else (64, 576, 2048)
    row = CONFIG_TABLE.lookup(
        arch_major=9, rope_tail=dim > 512, heads=heads, topk=topk, deterministic=False
    ).config
    tiling = dict(block_i=row.forward_block_i, num_stages=row.forward_stages)
    q, kv, sink = attention_inputs(1, 48, 700, heads, 1, dim, gen, sink=with_sink, device="cuda")
    idx = attention_indices(1, 48, 1, topk, 700, "shuffled", gen, device="cuda")
    scale = 1.0 / math.sqrt(dim)
    out, lse2 = fwd.sparse_attention_forward_tilelang(q, kv, idx, sink, scale, 512, **tiling)
    ref_out, ref_lse = reference.sparse_attention_forward_reference(q, kv, idx, scale, 512, sink)
    assert_close(out.float(), ref_out.float(), name="out")
    assert_close(lse2 * LN2, ref_lse, name="lse")
    if with_sink:  # lse2 = log2 of the sum including exp(sink): never below the sink's
        assert bool((lse2 >= sink * LOG2E - 1e-4).all())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse2 = fwd.sparse_attention_forward_tilelang(
            q, kv, idx, sink, scale, 512, **tiling
        )
    q.copy_(torch.randn(q.shape, generator=gen).to(q.device, torch.bfloat16))
    graph.replay()
    ref_out, ref_lse = reference.sparse_attention_forward_reference(q, kv, idx, scale, 512, sink)
    torch.cuda.synchronize()
    assert_close(g_out.float(), ref_out.float(), name="graph out")
    assert_close(g_lse2 * LN2, ref_lse, name="graph lse")
