"""sparse_attention_probs: the torch reference, the Triton kernel and the Hopper TileLang
kernel (the public entry's on Hopper) against a dense fp64 target or the fp32 reference.

CPU: the reference against the dense target, the Triton kernel under the interpreter, the
TileLang kernel's sm_90a builds and refusals, the entry's kernel choice. GPU: the entry
(checking which kernel it runs) and the Triton kernel forced against the fp32 reference over
head counts (one and two head blocks, a partial one), widths, groups, padding patterns and the
TileLang kernel's block counts 1, 2, 3, 5 against its 3 stages; CUDA-graph replays, no
recompilation across lengths, the entry under torch.compile."""

import sys

import pytest
import torch
from dsa_bench.dense import dense_attention
from dsa_sparse_attention import sparse_attention, sparse_attention_probs
from dsa_sparse_attention._triton import launch_config, split_width
from kernel_common import ARCH_ENV, device_arch
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK
from kernel_common.testing import assert_close, poisoned
from support import (
    as_padding,
    attention_indices,
    attention_inputs,
    check_graph_replays,
    compile_for_sm90,
    interp_only,
    not_interpreted,
    run_interpreted,
    seeded_gen,
)

SM90A = "sm_90a"


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


def test_triton_launch_config():
    """The fastest launch (64 slots, 2 stages) at the model widths; wider rows and smaller
    shared memories give up slots, then stages; None where nothing fits or D has no split."""
    hopper, small = HOPPER_SMEM_PER_BLOCK, 99 * 1024
    assert launch_config(576, 64, hopper) == launch_config(512, 8, hopper) == (64, 2)
    assert launch_config(768, 40, hopper) == (32, 2)  # (64, 2) needs 289 KiB
    assert launch_config(1024, 64, hopper) == (32, 1) and launch_config(1024, 8, hopper) == (32, 2)
    assert launch_config(576, 64, small) == (16, 1) and launch_config(576, 8, small) == (32, 2)
    assert launch_config(2048, 64, hopper) is None and launch_config(1536, 33, hopper) is None
    assert launch_config(2048, 8, hopper) == (32, 1) and launch_config(100, 8, hopper) is None


# (D, heads per group, shared memory limit): the model widths, the widest Hopper rows at one
# head block of 64 and of 16, and a 99 KiB device (sm_89, sm_120).
_LAUNCH_CASES = [
    (576, 64, HOPPER_SMEM_PER_BLOCK),
    (768, 40, HOPPER_SMEM_PER_BLOCK),
    (1024, 64, HOPPER_SMEM_PER_BLOCK),
    (2048, 8, HOPPER_SMEM_PER_BLOCK),
    (576, 64, 99 * 1024),
]


@pytest.mark.parametrize("d,hg,limit", _LAUNCH_CASES, ids=str)
def test_triton_launch_fits(d, hg, limit):
    """Triton's own shared-memory allocation of the chosen launch, compiled for sm_90 with the
    launch's 16-byte-aligned pointers (as it specialises them at run time: what turns the
    key loads into staged cp.async copies), is within the limit (no GPU: the 768-wide case
    once failed on the H100 with 295936 bytes)."""
    from dsa_sparse_attention._triton import probs
    from kernel_common.constants import LOG2E

    block_k, stages = launch_config(d, hg, limit)
    pointers = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "lse_ptr": "*fp32"}
    signature = {**pointers, "out_ptr": "*fp32", "S": "i32", "S_kv": "i32", "TOPK": "i32"}
    signature["scale2"] = "fp32"
    d_main, d_tail = split_width(d)
    constexprs = dict(G=1, HG=hg, D=d, D_MAIN=d_main, D_TAIL=d_tail, HB=probs.head_block(hg))
    constexprs.update(BLOCK_K=block_k, DOT_FP32=False, LOG2E_=LOG2E)
    compiled = compile_for_sm90(
        probs._probs_kernel, signature, constexprs, num_warps=probs._WARPS, num_stages=stages
    )
    assert 0 < compiled.metadata.shared <= limit


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


@pytest.mark.skipif(sys.platform != "linux", reason="tilelang is a Linux-only dependency")
def test_kernel_choice(monkeypatch):
    """The entry's kernel per device, arch, width and heads per group: TileLang on Hopper for
    multiples of 64 from 128 to 768 with more than 32 heads per group, Triton on other CUDA
    GPUs, widths and head counts, the reference on CPU and ROCm."""
    from dsa_sparse_attention._probs import _gpu_kernel

    cuda = torch.device("cuda")
    monkeypatch.setenv(ARCH_ENV, "sm_90")
    assert [_gpu_kernel(cuda, d, 64) for d in (576, 512, 128, 768, 832, 80, 64)] == (
        ["tilelang"] * 4 + ["triton"] * 3
    )
    assert [_gpu_kernel(cuda, 576, h) for h in (1, 8, 16, 32, 33, 48, 128)] == (
        ["triton"] * 4 + ["tilelang"] * 3
    )
    assert _gpu_kernel(torch.device("cpu"), 576, 64) is None
    monkeypatch.setenv(ARCH_ENV, "sm_100")
    assert _gpu_kernel(cuda, 576, 64) == "triton"
    monkeypatch.setenv(ARCH_ENV, "sm_80")
    assert _gpu_kernel(cuda, 576, 64) == "triton"
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert _gpu_kernel(cuda, 576, 64) is None


@pytest.mark.skipif(sys.platform != "linux", reason="tilelang is a Linux-only dependency")
def test_kernel_choice_traces(monkeypatch):
    """torch.compile traces the entry's kernel choice on Hopper (fullgraph: no graph break)."""
    from dsa_sparse_attention._probs import _gpu_kernel

    monkeypatch.setenv(ARCH_ENV, "sm_90")

    def pick(x):
        hopper = _gpu_kernel(torch.device("cuda"), x.shape[-1], x.shape[0]) == "tilelang"
        return x + (1 if hopper else 2)

    compiled = torch.compile(pick, fullgraph=True, backend="eager", dynamic=False)
    assert compiled(torch.zeros(64, 576))[0, :2].tolist() == [1, 1]
    assert compiled(torch.zeros(64, 832))[0, :2].tolist() == [2, 2]
    assert compiled(torch.zeros(8, 576))[0, :2].tolist() == [2, 2]


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


# (heads, groups, D, topk_padded) of the TileLang kernel: glm5 TP 1 and 8 (2112 = 33 blocks),
# two head blocks of 64, a partial second head block (70 = 64 + 6), dsv4.1's width with
# groups, a small width (64 + 64 + 64 columns, four stages), one head, the widest width (two
# stages); the first two build by default.
_TL_VARIANTS = [
    (64, 1, 576, 2048),
    (70, 1, 512, 64),
    pytest.param((8, 1, 576, 2112), marks=pytest.mark.slow),
    pytest.param((128, 1, 576, 128), marks=pytest.mark.slow),
    pytest.param((16, 2, 512, 640), marks=pytest.mark.slow),
    pytest.param((8, 1, 192, 192), marks=pytest.mark.slow),
    pytest.param((1, 1, 576, 320), marks=pytest.mark.slow),
    pytest.param((8, 1, 768, 128), marks=pytest.mark.slow),
]


@pytest.mark.skipif(sys.platform != "linux", reason="tilelang is a Linux-only dependency")
@pytest.mark.parametrize("variant", _TL_VARIANTS, ids=str)
def test_tilelang_compiles_for_sm90a(variant, tmp_path):
    """The kernel lowers to register-A wgmma fed by the cp.async gather and builds for sm_90a
    (no GPU)."""
    from dsa_sparse_attention._tilelang import probs

    heads, groups, dim, topk_padded = variant
    kernel = probs.compile_probs(heads, groups, dim, topk_padded, SM90A)
    src = kernel.get_kernel_source()
    assert "tl::wgmma_rs<" in src, "S = Q K^T must take Q from registers"
    assert "cp_async_gs" in src and "mbarrier_cp_async_arrive_noinc" in src, "gather path"
    assert "run_batch" in src, "one batched head reduction per block"
    assert "__launch_bounds__(256, 1)" in src
    n_hblk = probs.head_blocks(heads, groups)
    out = kernel.prim_func.buffer_map[kernel.prim_func.params[4]]
    assert [str(x) for x in out.shape] == [str(n_hblk), "batch", "seq_len", str(groups), "topk"]
    kernel.export_library(str(tmp_path / "probs.so"))


@pytest.mark.skipif(sys.platform != "linux", reason="tilelang is a Linux-only dependency")
def test_tilelang_refuses_before_compiling():
    from dsa_sparse_attention._tilelang import probs

    assert [probs.head_blocks(h, g) for h, g in ((64, 1), (8, 1), (70, 1), (128, 2))] == [
        1,
        1,
        2,
        1,
    ]
    assert probs.column_split(576) == (256, 64) and probs.column_split(512) == (256, 0)
    # Three 64-key stages at the model widths (what the kernel is designed for), two up to the
    # widest width it runs.
    assert (probs.stages(576), probs.stages(512), probs.stages(probs.MAX_DIM)) == (3, 3, 2)
    supported = [d for d in range(1, 1025) if probs.probs_kernel_supports(d)]
    assert supported == list(range(128, 769, 64))
    for args, match in [
        ((6, 4, 576, 64), "positive multiple of groups"),
        ((8, 1, 80, 64), "D = 80"),
        ((64, 1, 832, 64), "D = 832"),
        ((8, 1, 600, 64), "D = 600"),
        ((8, 1, 576, 100), "topk_padded = 100"),
    ]:
        with pytest.raises(ValueError, match=match):
            probs.compile_probs(*args, SM90A)


@pytest.mark.skipif(sys.platform != "linux", reason="tilelang is a Linux-only dependency")
def test_precompile_builds_the_probs_kernel():
    """precompile(probs=True) builds the probs kernel a call of the shape runs (here the first
    sm_90a variant, so nothing new is compiled when that test ran first); shapes the entry runs
    with the Triton kernel (a width, 32 heads per group) build nothing; a torch config leaves
    only the probs kernel to build."""
    from dsa_sparse_attention._tilelang.probs import compile_probs
    from dsa_sparse_attention.config import TORCH_CONFIG
    from dsa_sparse_attention.precompile import AttentionShape, precompile

    shape = AttentionShape(heads=64, d_qk=576, d_v=512, topk=2000)
    assert precompile([shape, shape], arch="sm_90", config=TORCH_CONFIG, probs=True) == 1
    assert precompile([shape], arch="sm_90", config=TORCH_CONFIG) == 0
    narrow = AttentionShape(heads=64, d_qk=80, d_v=64, topk=64)
    few_heads = AttentionShape(heads=64, d_qk=576, d_v=512, topk=64, groups=2)
    for other in (narrow, few_heads):  # the Triton kernel runs these
        assert precompile([other], arch="sm_90", config=TORCH_CONFIG, probs=True) == 0
    before = compile_probs.cache_info()
    compile_probs(64, 1, 576, 2048, SM90A)
    after = compile_probs.cache_info()
    assert (after.hits, after.misses) == (before.hits + 1, before.misses)


@pytest.mark.skipif(sys.platform != "linux", reason="tilelang is a Linux-only dependency")
@pytest.mark.parametrize(
    "b,s,s_kv,topk", [(2, 3, 0, 64), (0, 3, 10, 64), (2, 0, 10, 64), (2, 3, 10, 0)]
)
def test_tilelang_empty_inputs_give_zeros(b, s, s_kv, topk):
    """No keys, queries or slots: zeros of the output's shape, with no kernel built or launched
    (so this runs on CPU tensors)."""
    from dsa_sparse_attention._tilelang import probs

    before = probs.compile_probs.cache_info().currsize
    q, kv = torch.randn(b, s, 8, 576), torch.randn(b, s_kv, 1, 576)
    idx = torch.full((b, s, 1, topk), -1, dtype=torch.int32)
    got = probs.sparse_attention_probs_tilelang(q, kv, idx, torch.zeros(b, s, 8), 0.1)
    assert got.shape == (b, s, 1, topk) and got.dtype == torch.float32
    assert not got.any()
    assert probs.compile_probs.cache_info().currsize == before


# (heads, groups, D, topk, pattern): model widths and head counts, one and two head blocks (a
# partial one at 70 and 96 heads), groups, a width only the Triton kernel runs (80), and the
# TileLang kernel's block counts 1 (topk 1 and 64), 2 (100, a partial last block), 3 (192: each
# of its 3 stages used once), 5 (320: the stages wrap around).
_GPU_CASES = [
    (64, 1, 576, 2048, "causal"),
    (8, 1, 576, 2112, "out_of_range"),
    (16, 1, 512, 640, "mixed"),
    (128, 1, 576, 64, "empty_rows"),
    (32, 2, 512, 100, "shuffled"),
    (1, 1, 576, 1, "all"),
    (70, 1, 576, 192, "duplicates"),
    (96, 2, 512, 320, "out_of_range"),
    (8, 1, 192, 320, "tail"),
    (4, 1, 80, 50, "mixed"),
    (40, 1, 768, 130, "tail"),  # the TileLang kernel's widest width; Triton: 32 slots
    (16, 1, 1024, 100, "shuffled"),  # a width only the Triton kernel runs (32 slots)
]


KERNELS = ["entry", "triton"]


def _probs_call(kernel, d):
    """``(q, kv, indices, lse) -> target`` through the public entry (on Hopper the TileLang
    kernel for more than 32 heads per group and the widths it supports, else the Triton
    kernel) or the Triton kernel forced."""
    if kernel == "entry":
        return sparse_attention_probs
    from dsa_sparse_attention._triton import sparse_attention_probs_triton

    if split_width(d) is None:
        pytest.skip(f"D = {d} is a width only the TileLang kernel runs")
    return lambda q, kv, idx, lse: sparse_attention_probs_triton(q, kv, idx, lse, d**-0.5)


def _expected_kernel(d, heads_per_group):
    from dsa_sparse_attention._tilelang.probs import probs_kernel_supports

    # Written out here rather than read from the entry's rule: 33 heads is where the measured
    # crossover put the gate (benchmarks/NOTES.md).
    hopper = device_arch().is_hopper and heads_per_group > 32
    return "tilelang" if hopper and probs_kernel_supports(d) else "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads,groups,d,topk,pattern", _GPU_CASES)
def test_gpu_against_reference(heads, groups, d, topk, pattern, kernel):
    """Each kernel on the GPU against the fp32 reference; every output element written."""
    from dsa_sparse_attention._probs import _gpu_kernel
    from dsa_sparse_attention.reference import sparse_attention_probs_reference

    run = _probs_call(kernel, d)
    if kernel == "entry":
        want = _expected_kernel(d, heads // groups)
        assert _gpu_kernel(torch.device("cuda"), d, heads // groups) == want
    gen = seeded_gen("probs gpu", heads, groups, d, topk, pattern)
    s, s_kv = 300, 2500
    q, kv, sink = attention_inputs(1, s, s_kv, heads, groups, d, gen, sink=True, device="cuda")
    idx = attention_indices(1, s, groups, topk, s_kv, pattern, gen, device="cuda")
    # The reference forward rejects out-of-range entries: it gets them as -1.
    padded = as_padding(idx, s_kv)
    _, lse = sparse_attention(
        q, kv, padded, d_v=64, attn_sink=sink, return_lse=True, config=_torch_forward()
    )
    # Fill the allocator's next block with NaN, so that an unwritten output element shows.
    poisoned((1, s, groups, topk * 2), torch.float32, "cuda")
    got = run(q, kv, idx, lse)
    assert not torch.isnan(got).any()
    want = sparse_attention_probs_reference(q, kv, padded, lse, d**-0.5)
    assert_close(got, want, name="target")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_gpu_graph_replays_and_lengths(kernel):
    """Each kernel under CUDA-graph capture and replay with new inputs, and at new lengths;
    the TileLang kernel (the entry's on Hopper) without a new compile (batch, S, S_kv and the
    topk within one 64-key bucket are dynamic)."""
    from dsa_sparse_attention.reference import sparse_attention_probs_reference

    heads, d = 64, 576
    run = _probs_call(kernel, d)
    gen = seeded_gen("probs graphs")

    def inputs(b, s, s_kv, topk):
        q, kv, _ = attention_inputs(b, s, s_kv, heads, 1, d, gen, device="cuda")
        idx = attention_indices(b, s, 1, topk, s_kv, "shuffled", gen, device="cuda")
        lse = torch.randn(b, s, heads, generator=gen).cuda() + 8
        return q, kv, idx, lse

    def reference(q, kv, idx, lse):
        return sparse_attention_probs_reference(q, kv, idx, lse, d**-0.5)

    cases = [inputs(2, 40, 500, 200), inputs(2, 40, 500, 200)]
    for case in cases:
        assert_close(run(*case), reference(*case), name="eager")
    # Replays give the eager run's bits (the eager runs are checked above).
    check_graph_replays(run, cases, run)
    tilelang = kernel == "entry" and _expected_kernel(d, heads) == "tilelang"
    if tilelang:
        from dsa_sparse_attention._tilelang.probs import compile_probs

        before = compile_probs.cache_info()
    for shape in ((1, 33, 900, 250), (3, 7, 64, 193)):
        case = inputs(*shape)
        assert_close(run(*case), reference(*case), name=f"{shape}")
    if tilelang:
        after = compile_probs.cache_info()
        assert (after.misses, after.currsize) == (before.misses, before.currsize)


@pytest.mark.gpu
def test_gpu_rejects_widths_without_a_kernel():
    """Widths no kernel runs raise before any launch, naming the argument."""
    gen = seeded_gen("probs widths")
    for heads, d in ((64, 2048), (8, 100), (40, 1536)):
        q, kv, _ = attention_inputs(1, 4, 8, heads, 1, d, gen, device="cuda")
        idx = attention_indices(1, 4, 1, 16, 8, "shuffled", gen, device="cuda")
        lse = torch.zeros(1, 4, heads, device="cuda")
        with pytest.raises(ValueError, match=rf"q.shape\[-1\] = {d} must be"):
            sparse_attention_probs(q, kv, idx, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 8])
def test_gpu_compiled_entry(heads):
    """The entry under torch.compile (fullgraph, dynamic lengths) gives the eager bits: the
    kernel choice and the width check trace, and the custom op runs the same kernel (on Hopper
    TileLang at 64 heads, Triton at 8)."""
    d = 576
    gen = seeded_gen("probs compiled", heads)
    compiled = torch.compile(sparse_attention_probs, fullgraph=True, dynamic=True)
    for s, s_kv, topk in ((40, 500, 200), (57, 700, 256)):
        q, kv, _ = attention_inputs(1, s, s_kv, heads, 1, d, gen, device="cuda")
        idx = attention_indices(1, s, 1, topk, s_kv, "shuffled", gen, device="cuda")
        lse = torch.randn(1, s, heads, generator=gen).cuda() + 8
        eager = sparse_attention_probs(q, kv, idx, lse)
        assert torch.equal(compiled(q, kv, idx, lse), eager)


def _torch_forward():
    from dsa_sparse_attention import SparseAttentionConfig

    # The lse is an input here: the reference forward keeps this test about the probs kernel.
    return SparseAttentionConfig(forward_backend="torch", backward_backend="torch")
