"""TileLang sparse-attention backward: sm_90a compile checks (CPU, nvcc from the venv) and the
reference matrix on the GPU.

CPU: a representative set of the variants the config table can pick (every backward tiling of
the Hopper rows, both widths, one to two head blocks) compiles for sm_90a and the generated CUDA
uses the instructions the design relies on; the other rows and further tilings are in the
``slow`` set. Compiling needs nvcc, not a GPU: the dev group installs it from PyPI
(``nvidia-cuda-nvcc``) and TileLang finds it in the venv, so these tests fail, not skip, where it
is missing. The tiling checks (``check_backward_config``) name the config field to change.

GPU: dq, dkv and dsink against ``reference.sparse_attention_backward_reference`` (fp32 math on
the same bf16 inputs) with ``out`` / ``lse`` from the reference forward, so these tests do not
depend on the forward kernel. The kernels are compiled up front and reused by every case that
shares their static configuration.
"""

import concurrent.futures
import os
import re
import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("tilelang is a Linux-only dependency", allow_module_level=True)

from dsa_sparse_attention import reference
from dsa_sparse_attention._tilelang import backward as bw
from dsa_sparse_attention.config import CONFIG_TABLE
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LN2, LOG2E
from kernel_common.testing import assert_close, poisoned
from support import as_padding, attention_indices, attention_inputs, seeded_gen

SM90A = "sm_90a"
D_V = 512


def _row_tiling(heads: int, dim: int, deterministic: bool = False) -> dict:
    """The backward tiling of the Hopper table row for (heads bucket, RoPE tail present, mode),
    as ``sparse_attention`` picks it (keyed by all of ``q``'s heads, whatever the kv groups; the
    backward rows do not depend on the top-k bucket)."""
    cfg = CONFIG_TABLE.lookup(
        arch_major=9, rope_tail=dim > D_V, heads=heads, topk=2048, deterministic=deterministic
    ).config
    return dict(
        block_i=cfg.backward_block_i,
        num_stages=cfg.backward_stages,
        split_store=cfg.split_store,
        dkv_reduce=cfg.dkv_reduce,
        deterministic=cfg.deterministic,
    )


def _compile(spec: dict, topk: int) -> "bw.BackwardKernels":
    """compile_backward for a spec (heads, dim, optional groups and tiling overrides of the
    row's tiling) at ``topk``, for sm_90a."""
    spec = dict(spec)
    heads, dim, groups = spec.pop("heads"), spec.pop("dim"), spec.pop("groups", 1)
    tiling = _row_tiling(heads, dim) | spec
    return bw.compile_backward(heads, groups, dim, D_V, topk, **tiling, target=SM90A)


def _spec_id(spec: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in spec.items())


# --------------------------------------------------------------------------------------------
# CPU: compile for sm_90a
# --------------------------------------------------------------------------------------------

# Every (heads bucket, width) row of the table and 128 heads (two head blocks) on the 64 rows.
# The fast set covers each backward tiling the rows use (atomics on 128-byte row segments at
# 16-row head blocks with and without the tail, and at 32 and 64 rows with 64-key blocks in 4
# slices, two head blocks) and the bulk reduce-adds of a caller's config; the rest is ``slow``
# (among it the 64-byte segments of 64 rows in 2 slices).
FAST_VARIANTS = [
    dict(heads=8, dim=576),
    dict(heads=16, dim=512),
    dict(heads=32, dim=576),
    dict(heads=64, dim=576),
    dict(heads=128, dim=512),
    dict(heads=8, dim=576, dkv_reduce="tma"),
    # Deterministic: a default row's tiling in that mode (a caller's config), and the table's
    # deterministic rows (bulk u64 reduce-adds in 4 slices).
    dict(heads=64, dim=576, deterministic=True),
    dict(heads=8, dim=576, **_row_tiling(8, 576, deterministic=True)),
    dict(heads=64, dim=576, **_row_tiling(64, 576, deterministic=True)),
]
TABLE_VARIANTS = [
    dict(heads=h, dim=d) for h in (8, 16, 32, 64, 128) for d in (512, 576)
]  # fmt: skip
SLOW_VARIANTS = [v for v in TABLE_VARIANTS if v not in FAST_VARIANTS] + [
    dict(heads=64, dim=576, block_i=32),
    dict(heads=64, dim=576, block_i=16),
    dict(heads=64, dim=576, split_store=2),
    dict(heads=32, dim=576, dkv_reduce="tma", split_store=2),
    dict(heads=8, dim=576, num_stages=3, split_store=4),
    dict(heads=64, dim=576, num_stages=2, split_store=8, block_i=32),
    dict(heads=64, dim=512, num_stages=2, split_store=4, block_i=32),
    dict(heads=16, dim=576, block_i=64, split_store=4),
    dict(heads=128, dim=576, groups=2),
    dict(heads=96, dim=576),
    dict(heads=4, dim=576, groups=2),
    *(
        dict(heads=h, dim=d, **_row_tiling(h, d, deterministic=True))
        for h in (8, 16, 32, 64, 128)
        for d in (512, 576)
        if (h, d) not in ((8, 576), (64, 576))
    ),
    *(dict(heads=h, dim=d, deterministic=True) for h in (8, 16, 32, 128) for d in (512, 576)),
    dict(heads=64, dim=512, deterministic=True),
    dict(heads=8, dim=576, dkv_reduce="atomic", deterministic=True),
]


# The synchronised walk's counter: one atomic read when a program starts, one add per block.
_PROGRESS_ATOMICS = ("AtomicAddRet((&(Progress[0])), 0)", "AtomicAdd((&(Progress[0])), 1)")


def _check_source(kernels, spec):
    hg = spec["heads"] // spec.get("groups", 1)
    tiling = _row_tiling(spec["heads"], spec["dim"]) | {
        k: v for k, v in spec.items() if k not in ("heads", "dim", "groups")
    }
    # Default mode has a synced kernel beside the fixed walk's (the counter's atomics, nothing
    # else); deterministic mode only the fixed walk.
    assert not kernels.main.synced
    assert (kernels.synced is None) == tiling["deterministic"]
    for main in (kernels.main, kernels.synced):
        if main is not None:
            _check_main_source(main.kernel.get_kernel_source(), main.synced, hg, spec, tiling)
    pre = kernels.preprocess.get_kernel_source()
    assert re.search(r"int batch, int seq_len\)", pre)


def _check_main_source(src, synced, hg, spec, tiling):
    assert all((src.count(a) == 1) == synced for a in _PROGRESS_ATOMICS)
    for atomic in _PROGRESS_ATOMICS:
        src = src.replace(atomic, "")
    # Lengths are runtime arguments: nothing length-specific is baked into the kernel. (The
    # device code drops arguments it does not read: the counter's unless synced.)
    resident = "int resident, " if synced else ""
    assert re.search(rf"int batch, {resident}int seq_len, int seq_len_kv", src), "dynamic lengths"
    # The gather is cp.async (16-byte chunks) through the index list.
    assert "tl::cp_async_gs<16>" in src
    # Score MMAs: wgmma for 64-row head blocks, mma.sync below (M = 16 / 32).
    if bw.head_block(hg) == 64:
        assert "wgmma" in src
    else:
        assert "tl::mma_sync" in src
    # Deterministic mode adds 64-bit fixed point (integer adds commute bitwise), never fp32.
    # The prelude defines every helper once: uses are the count past that definition.
    uses = lambda name: src.count(name + "(") - 1
    det = tiling["deterministic"]
    u64, f32 = "dsa_bulk_reduce_add_u64", "dsa_bulk_reduce_add_f32"
    bulk, other = (u64, f32) if det else (f32, u64)
    if tiling["dkv_reduce"] == "tma":
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add" in src
        assert uses(bulk) >= 1 and uses(other) == 0
        assert "dsa_fence_proxy_async_shared();" in src  # staging stores -> TMA reads
        assert "tl::tma_store_wait<0, false>" in src  # the final drain before exit
        assert "AtomicAdd" not in src and uses("dsa_red_add_fixed") == 0
        assert (uses("__float2ll_rn") >= 1) == det  # the staging converts in det mode
    elif det:
        assert uses("dsa_red_add_fixed") >= 1 and "AtomicAdd" not in src
    else:
        # 32- and 64-key blocks: every slice through dsa_red_add_warp_tile (16-byte atomics on
        # 128- or 64-byte row segments, in slice order); else per-pair atomics.
        calls = re.findall(r"dsa_red_add_warp_tile<(\d+), (true|false)>\(", src)
        if tiling["block_i"] in (32, 64):
            slices = bw._column_slices(spec["dim"], D_V, tiling["split_store"])
            assert len(calls) == len(slices) and "AtomicAdd" not in src
            # 128-byte segments wherever a warp's tile is 32 columns or more (4 chunks), except
            # for slices of more than 32 accumulator registers a thread at 64-row head blocks.
            for (_, w), (nj, flag) in zip(slices, calls, strict=True):
                regs = tiling["block_i"] * w // bw.program_threads(hg)
                wide = bw.head_block(hg) < 64 or regs <= 32
                assert (flag == "true") == (wide and int(nj) >= 4), (w, nj, flag)
        else:
            assert not calls and "AtomicAddx2" in src
    assert f"__launch_bounds__({bw.program_threads(hg)}" in src


@pytest.mark.parametrize(
    "spec",
    [*FAST_VARIANTS, *(pytest.param(v, marks=pytest.mark.slow) for v in SLOW_VARIANTS)],
    ids=_spec_id,
)
def test_compiles_for_sm90a(spec):
    """Each variant builds for sm_90a (no GPU needed) with the instructions of the design."""
    kernels = _compile(spec, 2112)
    _check_source(kernels, spec)
    block_i = (_row_tiling(spec["heads"], spec["dim"]) | spec)["block_i"]
    assert kernels.topk_padded == -(-2112 // block_i) * block_i
    # The in-process cache returns the same compiled objects for the same static config.
    again = _compile(spec, kernels.topk_padded)
    assert again.main.kernel is kernels.main.kernel and again.preprocess is kernels.preprocess
    assert (again.synced is None) == (kernels.synced is None)
    assert again.synced is None or again.synced.kernel is kernels.synced.kernel


def test_synced_kernel_for_sm90a():
    """compile_backward builds the synced kernel together with the fixed walk's (so no length
    compiles anything later) and runs it once the fp32 dkv passes the threshold."""
    kernels = _compile(dict(heads=64, dim=576), 2048)
    plain, synced = kernels.main, kernels.synced
    assert (plain.synced, synced.synced) == (False, True)
    assert plain.programs_per_sm == synced.programs_per_sm == 1
    assert kernels.sync_above == 48 << 20
    assert kernels.main_for(48 << 20) is plain and kernels.main_for((48 << 20) + 1) is synced


@pytest.mark.parametrize(
    "block_h, deterministic, threshold",
    [
        (64, False, 48 << 20),  # cost 1-3% at 36 MiB, gained 8% at 64 MiB (H100, 50 MB L2)
        (32, False, 32 << 20),  # below 64-row head blocks: gained past 32 MiB, cost below
        (16, False, 32 << 20),
        (64, True, None),  # deterministic mode: the fixed walk only
        (16, True, None),
    ],
)
def test_sync_threshold_rule(block_h, deterministic, threshold):
    assert bw._sync_threshold(block_h, deterministic) == threshold


@pytest.mark.parametrize(
    "threads, smem, programs",
    [(256, 220 * 1024, 1), (256, 100 * 1024, 1), (128, 72 * 1024, 2), (128, 150 * 1024, 1)],
)
def test_programs_per_sm(threads, smem, programs):
    assert bw._programs_per_sm(threads, smem) == programs


@pytest.mark.parametrize("dim", [512, 576])
def test_table_tilings_fit_every_head_count_of_their_bucket(dim):
    """Each Hopper row's tiling passes the checks (shared memory included) for every head count
    that buckets to it, 1 to 128."""
    for hg in range(1, 129):
        for deterministic in (False, True):
            tiling = _row_tiling(hg, dim, deterministic)
            bw.check_backward_config(hg, 1, dim, D_V, *tiling.values())
            assert bw.shared_memory_bytes(hg, dim, D_V, **tiling) <= HOPPER_SMEM_PER_BLOCK
    # Two programs per SM for small head counts (each hides the other's gather), in both modes.
    for deterministic in (False, True):
        tiling = _row_tiling(8, dim, deterministic)
        assert bw.shared_memory_bytes(8, dim, D_V, **tiling) <= 113 * 1024


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(heads=6, groups=4), "positive multiple of kv.shape"),
        (dict(heads=256), "at most 128"),
        (dict(d_v=448), "d_v = 448"),
        (dict(dim=560), "RoPE tail"),
        (dict(block_i=24), r"SparseAttentionConfig\.backward_block_i = 24"),
        (dict(heads=8, block_i=16), r"backward_block_i = 16 is too small for 8 heads"),
        (dict(heads=8, block_i=256), r"backward_block_i = 256 must be at most 128"),
        (dict(num_stages=0), r"SparseAttentionConfig\.backward_stages"),
        (dict(split_store=3), r"SparseAttentionConfig\.split_store"),
        (dict(dkv_reduce="bf16"), r"SparseAttentionConfig\.dkv_reduce"),
        (dict(num_stages=3), "shared memory"),
        # The int64 staging of deterministic mode is twice the fp32 one.
        (dict(deterministic=True), r"deterministic = True need \d+ bytes of shared memory"),
    ],
)
def test_rejects_unsupported_configs(kwargs, match):
    shape = dict(heads=64, groups=1, dim=576, d_v=D_V)
    tiling = dict(block_i=32, num_stages=1, split_store=2, dkv_reduce="tma", deterministic=False)
    shape, tiling = (
        shape | {k: v for k, v in kwargs.items() if k in shape},
        tiling | {k: v for k, v in kwargs.items() if k in tiling},
    )
    with pytest.raises(ValueError, match=match):
        bw.check_backward_config(*shape.values(), *tiling.values())
    # compile_backward refuses it the same way, before compiling anything.
    with pytest.raises(ValueError, match=match):
        bw.compile_backward(*shape.values(), 2048, **tiling, target=SM90A)


@pytest.mark.parametrize("deterministic", [False, True])
def test_degenerate_shapes_launch_nothing(deterministic):
    """No query or no key: nothing is launched (so this runs on the CPU), dq = 0, dkv = 0 and
    dsink still sees the lse gradient through delta = rowsum(out * dout) - dlse; in both
    modes (the deterministic scale is not computed without a launch)."""
    gen = seeded_gen("degenerate")
    b, s, h, g, d, topk = 2, 5, 8, 1, 576, 64
    q, kv, sink = attention_inputs(b, s, 0, h, g, d, gen, sink=True)
    out = torch.zeros(b, s, h, D_V, dtype=torch.bfloat16)
    dout = torch.randn(b, s, h, D_V, generator=gen).to(torch.bfloat16)
    idx = torch.full((b, s, g, topk), -1, dtype=torch.int32)
    dlse2 = torch.randn(b, s, h, generator=gen)  # gradient of the log2-space lse
    lse2 = (sink * LOG2E).expand(b, s, h).contiguous()  # only the sink is in the softmax
    tiling = _row_tiling(h, d, deterministic)
    dq, dkv, dsink = bw.sparse_attention_backward_tilelang(
        dout, dlse2, q, kv, idx, out, lse2, sink, 0.05, D_V, **tiling
    )
    assert dq.shape == q.shape and bool((dq == 0).all()) and dkv.shape == kv.shape
    assert dkv.dtype == torch.bfloat16
    # p_sink = 1 on every row, and d lse2 / d lse = log2(e).
    torch.testing.assert_close(dsink, dlse2.sum(dim=(0, 1)) * LOG2E)
    empty = q[:, :0]
    dq, dkv, dsink = bw.sparse_attention_backward_tilelang(
        dout[:, :0], None, empty, kv, idx[:, :0], out[:, :0], lse2[:, :0], None, 0.05, D_V,
        **tiling,
    )  # fmt: skip
    assert dq.shape == empty.shape and dsink is None


def test_fixed_point_scale_bounds_every_column():
    """The deterministic mode's per-column scale (CPU, float64 check): every partial sum of the
    head-summed key-gradient values a program adds, scaled, stays below 2**61 in every column,
    also with outlier channels, peaked attention, a sink, the lse gradient and duplicated
    indices; an outlier channel of q gets its own coarser scale, and fixed point summed in any order
    matches the float64 sum to 1e-9 of each column's largest value."""
    gen = seeded_gen("fixed point scale")
    b, s, s_kv, h, d, topk, scale = 2, 24, 40, 8, 576, 32, 0.07
    q, kv, sink = attention_inputs(b, s, s_kv, h, 1, d, gen, sink=True)
    q[..., 7] *= 100  # outlier channels of q and of the keys / values
    kv[..., 300] *= 100
    q[0, 3] *= 40  # a peaked row
    idx = attention_indices(b, s, 1, topk, s_kv, "duplicates", gen)
    dout = torch.randn(b, s, h, D_V, generator=gen).to(torch.bfloat16)
    dlse = torch.randn(b, s, h, generator=gen) * 3
    f64 = torch.float64
    out, lse = reference.sparse_attention_forward_reference(q, kv, idx, scale, D_V, sink, dtype=f64)
    dot = (out.to(torch.bfloat16).float() * dout.float()).sum(-1)
    fix = bw._fixed_point_scale(q, kv, dout, dot, dlse * LN2, scale, D_V).to(f64)
    assert fix.shape == (d,) and bool(torch.isfinite(fix).all())
    # The values one program adds: for query (b, s) and slot j, summed over the heads.
    keys = kv[:, :, 0].to(f64)[torch.arange(b)[:, None, None], idx[:, :, 0].long()]  # b s j d
    qf, dof = q.to(f64), dout.to(f64)
    p = torch.exp(torch.einsum("bshd,bsjd->bshj", qf, keys) * scale - lse[..., None])
    dp = torch.einsum("bshd,bsjd->bshj", dof, keys[..., :D_V])
    delta = (dot.to(f64) - dlse.to(f64))[..., None]
    ds = p * (dp - delta) * scale
    add = torch.einsum("bshj,bshd->bsjd", ds, qf)
    add[..., :D_V] += torch.einsum("bshj,bshd->bsjd", p, dof)
    flat = idx[:, :, 0].long() + torch.arange(b)[:, None, None] * s_kv  # global key rows
    worst = torch.zeros(b * s_kv, d, dtype=f64).index_add_(0, flat.reshape(-1),
                                                          add.abs().reshape(-1, d))  # fmt: skip
    assert bool((worst.amax(0) * fix <= 2.0**61).all())
    assert fix[7] < fix[6]  # q's outlier channel coarsens its own column only
    # Fixed point, summed in two different orders, against the float64 sum.
    ints = torch.round(add.reshape(-1, d) * fix).to(torch.int64)
    order = torch.randperm(ints.shape[0], generator=gen)
    fwd = torch.zeros(b * s_kv, d, dtype=torch.int64).index_add_(0, flat.reshape(-1), ints)
    rev = torch.zeros(b * s_kv, d, dtype=torch.int64).index_add_(
        0, flat.reshape(-1)[order], ints[order]
    )
    assert torch.equal(fwd, rev)
    exact = torch.zeros(b * s_kv, d, dtype=f64).index_add_(0, flat.reshape(-1), add.reshape(-1, d))
    err = (fwd.to(f64) / fix - exact).abs().amax(0)
    assert bool((err <= 1e-9 * exact.abs().amax(0)).all())


# --------------------------------------------------------------------------------------------
# GPU: against the torch reference
# --------------------------------------------------------------------------------------------


def _table_tilings():
    """(heads, dim, tiling) for every TileLang backward row of the config table, plus a few more
    ring depths and slice counts."""
    out = [(h, d, _row_tiling(h, d)) for h in (8, 16, 32, 64) for d in (512, 576)]
    out.append((8, 576, dict(block_i=32, num_stages=3, split_store=4, dkv_reduce="tma")))
    out.append((64, 576, dict(block_i=32, num_stages=2, split_store=8, dkv_reduce="atomic")))
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


# (heads, groups, dim, topk, tiling overrides of the row): the matrix of DESIGN.md, cut so that
# each static config is compiled once. Every case also has a sink / dlse / padding setting below.
MATRIX = (
    [(h, 1, d, 100, {}) for h in (8, 16, 32, 64, 128) for d in (512, 576)]
    + [(h, 1, 576, k, {}) for h in (8, 64) for k in (1, 64, 640, 2048, 2112)]
    + [(16, 2, 576, 640, {}), (64, 2, 512, 100, {}), (12, 1, 576, 64, {})]
    + [
        (8, 1, 576, 640, dict(dkv_reduce="tma")),
        (64, 1, 576, 640, dict(block_i=32)),
        (64, 1, 576, 640, dict(block_i=16)),
        (64, 1, 576, 640, dict(split_store=2)),  # 64-byte segments
        (8, 1, 576, 640, dict(num_stages=3, split_store=4)),
        (16, 1, 576, 640, dict(block_i=64, split_store=4)),
        (64, 1, 512, 640, dict(num_stages=2, split_store=4, block_i=32)),
    ]
)
# Deterministic mode at every deterministic table row's tiling (and two head blocks), and at
# the default rows' tilings turned deterministic (what a caller's config with
# deterministic=True runs), with many queries per key so that concurrent adds to one key row
# are the rule: 2 x 256 queries over 96 keys.
DETERMINISTIC = [
    (h, 1, d, 160, _row_tiling(h, d, deterministic=True))
    for h in (8, 16, 32, 64, 128)
    for d in (512, 576)
] + [(h, 1, 576, 160, dict(deterministic=True)) for h in (8, 32, 64)]
DETERMINISTIC.append((16, 2, 576, 160, _row_tiling(16, 576, deterministic=True)))  # 2 kv groups
# support.attention_indices patterns: padding of every kind, with and without duplicates.
PADDINGS = ("mixed", "tail", "shuffled", "empty_rows", "out_of_range", "duplicates")


def _all_specs():
    specs = [(h, g, d, k, t) for h, g, d, k, t in MATRIX + DETERMINISTIC]
    specs += [(h, 1, d, k, t) for h, d, k, t in _block_count_cases()]
    return specs


@pytest.fixture(scope="module")
def compiled():
    """Compile every static configuration of this module once, a few at a time."""
    unique = {}
    for heads, groups, dim, topk, tiling in _all_specs():
        full = _row_tiling(heads, dim) | tiling
        key = (heads, groups, dim, -(-topk // full["block_i"]) * full["block_i"])
        unique[repr((key, sorted(full.items())))] = (key, full)
    workers = max(1, min(len(unique), os.cpu_count() or 1, 8))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [
            pool.submit(bw.compile_backward, h, g, d, D_V, k, **t, target=SM90A)
            for (h, g, d, k), t in unique.values()
        ]
        for f in futures:
            f.result()


def _case(b, s, s_kv, heads, groups, dim, topk, *, sink, dlse, padding, seed):
    gen = seeded_gen("backward", b, s, s_kv, heads, groups, dim, topk, sink, dlse, padding, seed)
    q, kv, attn_sink = attention_inputs(b, s, s_kv, heads, groups, dim, gen, sink=sink)
    dout = torch.randn(b, s, heads, D_V, generator=gen).to(torch.bfloat16)
    idx = attention_indices(b, s, groups, topk, s_kv, padding, gen)
    dlse_t = torch.randn(b, s, heads, generator=gen) if dlse else None
    cuda = lambda t: t.cuda() if t is not None else None
    return tuple(cuda(t) for t in (q, kv, dout, idx, attn_sink, dlse_t))


def _run_and_compare(q, kv, dout, idx, attn_sink, dlse, *, tiling=None, sm_scale=None):
    heads, dim = q.shape[2], q.shape[-1]
    tiling = _row_tiling(heads, dim) | (tiling or {})
    sm_scale = sm_scale if sm_scale is not None else reference.default_sm_scale(dim)
    s_kv = kv.shape[1]
    # The reference takes only [-1, S_kv): every other value is padding for the kernel.
    idx_ref = as_padding(idx, s_kv)
    out, lse = reference.sparse_attention_forward_reference(
        q, kv, idx_ref, sm_scale, D_V, attn_sink
    )
    dq_ref, dkv_ref, dsink_ref = reference.sparse_attention_backward_reference(
        dout, dlse, q, kv, idx_ref, lse, sm_scale, D_V, attn_sink
    )
    # Poison the allocator: the kernel's dq comes from torch.empty, which reuses a freed block
    # of the same size, so an entry the kernel forgets to write keeps the NaN.
    junk = poisoned(q.shape, q.dtype, q.device)
    del junk
    # The kernel takes the log2-space lse and its gradient (d lse2 = d lse * ln 2).
    dlse2 = dlse * LN2 if dlse is not None else None
    dq, dkv, dsink = bw.sparse_attention_backward_tilelang(
        dout, dlse2, q, kv, idx, out, lse / LN2, attn_sink, sm_scale, D_V, **tiling
    )
    torch.cuda.synchronize()
    assert dq.dtype == torch.bfloat16 and dkv.dtype == torch.bfloat16
    for name, t in (("dq", dq), ("dkv", dkv)):
        assert not bool(torch.isnan(t).any()), f"{name}: poison (NaN) survived"
        assert bool(torch.isfinite(t).all()), f"{name} has non-finite entries"
    assert_close(dq, dq_ref, name="dq")
    assert_close(dkv, dkv_ref, name="dkv")
    if attn_sink is None:
        assert dsink is None
    else:
        assert dsink.dtype == torch.float32 and bool(torch.isfinite(dsink).all())
        assert_close(dsink, dsink_ref, name="dsink")
    # A row with no valid index has exactly zero dq.
    empty = (idx_ref < 0).all(dim=-1)  # [B, S, G]
    heads_per_group = q.shape[2] // kv.shape[2]
    empty_heads = empty.repeat_interleave(heads_per_group, dim=2)
    assert bool((dq[empty_heads] == 0).all())


# The default mode's two kernels: the test inputs are far under the synced kernel's dkv size
# threshold, so "synced" lowers it to 0.
WALKS = ("fixed", "synced")


def _force_walk(monkeypatch, walk: str) -> list:
    """Run the default mode's `walk` kernel: "synced" lowers the threshold to 0, "fixed" leaves
    it (the test inputs are far under it). Returns the list each launch of a synced kernel
    appends to (it alone takes a walk counter), so a test can check which kernel ran."""
    launches = []
    counter = bw._walk_counter

    def spy(device):
        launches.append(device)
        return counter(device)

    monkeypatch.setattr(bw, "_walk_counter", spy)
    if walk == "synced":
        monkeypatch.setattr(bw, "_sync_threshold", lambda block_h, det: None if det else 0)
    return launches


@pytest.mark.gpu
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("case", range(len(MATRIX)))
def test_backward_matches_reference(compiled, monkeypatch, case, walk):
    heads, groups, dim, topk, tiling = MATRIX[case]
    launches = _force_walk(monkeypatch, walk)
    s = 64 + 16 * (case % 5)
    q, kv, dout, idx, sink, dlse = _case(
        2, s, 2 * s, heads, groups, dim, topk, sink=case % 2 == 0, dlse=case % 3 == 0,
        padding=PADDINGS[case % len(PADDINGS)], seed=case,
    )  # fmt: skip
    _run_and_compare(q, kv, dout, idx, sink, dlse, tiling=tiling)
    assert len(launches) == (walk == "synced")


@pytest.mark.gpu
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("sink", [False, True])
def test_backward_padding_patterns(compiled, padding, sink):
    q, kv, dout, idx, attn_sink, dlse = _case(
        2, 96, 192, 64, 1, 576, 100, sink=sink, dlse=True, padding=padding, seed=7
    )
    _run_and_compare(q, kv, dout, idx, attn_sink, dlse)


@pytest.mark.gpu
def test_backward_all_rows_empty(compiled):
    q, kv, dout, idx, sink, _ = _case(
        2, 64, 128, 8, 1, 576, 100, sink=False, dlse=False, padding="all", seed=3
    )
    assert bool((idx == -1).all())
    _run_and_compare(q, kv, dout, idx, sink, None)


@pytest.mark.gpu
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("case", range(len(_block_count_cases())))
def test_backward_block_counts(compiled, monkeypatch, case, walk):
    """1, stages, stages + 1 and 2 * stages + 1 index blocks for every tiling the table uses
    (a software-pipelined gather once read the wrong stage at stages + 1 blocks)."""
    heads, dim, topk, tiling = _block_count_cases()[case]
    launches = _force_walk(monkeypatch, walk)
    q, kv, dout, idx, sink, dlse = _case(
        2, 80, 160, heads, 1, dim, topk, sink=True, dlse=case % 2 == 0, padding="mixed",
        seed=100 + case,
    )  # fmt: skip
    _run_and_compare(q, kv, dout, idx, sink, dlse, tiling=tiling)
    assert len(launches) == (walk == "synced")  # the table's default-mode rows


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64])
def test_no_recompile_for_new_lengths(compiled, monkeypatch, heads):
    dim, topk = 576, 640
    tiling = _row_tiling(heads, dim)
    # The only compile. The lengths below cross the synced kernel's threshold (lowered to 500
    # kB of fp32 dkv: 80 key rows are under it, 2 x 128 and 3 x 301 over), so it must exist by
    # now.
    kernels = bw.compile_backward(heads, 1, dim, D_V, topk, **tiling, target=SM90A)
    assert kernels.synced is not None

    def no_compile(*args, **kwargs):
        raise AssertionError("a new length must not compile a new kernel")

    monkeypatch.setattr(bw.tilelang, "compile", no_compile)
    launches = _force_walk(monkeypatch, "fixed")
    monkeypatch.setattr(bw, "_sync_threshold", lambda block_h, deterministic: 500_000)
    synced = []
    for seed, (b, s, s_kv) in enumerate([(1, 37, 80), (2, 64, 128), (3, 129, 301)]):
        q, kv, dout, idx, sink, dlse = _case(
            b, s, s_kv, heads, 1, dim, topk, sink=True, dlse=True, padding="mixed", seed=seed
        )
        before = len(launches)
        _run_and_compare(q, kv, dout, idx, sink, dlse)
        synced.append(len(launches) > before)
    assert synced == [False, True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64])
def test_synced_walk_from_any_block(compiled, monkeypatch, heads):
    """The synchronised walk (forced here at short lengths) matches the reference from whatever
    block a program starts at: with the counter preset to k times the resident count every
    program, the first wave's too, starts at block k (then later ones further on), for every
    k; and from a zero counter with a resident count of one SM's programs, the programs past
    the first wave start wherever the others are."""
    dim, topk = 576, 100  # 2 blocks of 64 keys at 64 heads, 4 of 32 at 16
    tiling = _row_tiling(heads, dim)
    monkeypatch.setattr(bw, "sm_count", lambda device: 1)
    counter = bw._walk_counter
    launches = _force_walk(monkeypatch, "synced")
    kernels = bw.compile_backward(heads, 1, dim, D_V, topk, **tiling, target=SM90A)
    main = kernels.main_for(1)
    assert main.synced
    case = _case(2, 96, 192, heads, 1, dim, topk, sink=True, dlse=True, padding="mixed", seed=0)
    for k in range(kernels.topk_padded // tiling["block_i"]):

        def preset(device, k=k):
            launches.append(device)
            return counter(device) + k * main.programs_per_sm

        monkeypatch.setattr(bw, "_walk_counter", preset)
        _run_and_compare(*case)
        assert len(launches) == k + 1
    for seed, (b, s, s_kv) in enumerate([(2, 96, 192), (1, 301, 350)]):
        q, kv, dout, idx, sink, dlse = _case(
            b, s, s_kv, heads, 1, dim, topk, sink=True, dlse=True, padding="mixed", seed=seed
        )
        monkeypatch.setattr(bw, "_walk_counter", counter)  # from zero again
        launches = _force_walk(monkeypatch, "synced")
        _run_and_compare(q, kv, dout, idx, sink, dlse)
        assert len(launches) == 1


def _kernel_args(q, kv, dout, idx, sink, dlse):
    """The backward wrapper's positional arguments, with out / lse of the reference forward."""
    sm_scale = reference.default_sm_scale(q.shape[-1])
    out, lse = reference.sparse_attention_forward_reference(
        q, kv, as_padding(idx, kv.shape[1]), sm_scale, D_V, sink
    )
    dlse2 = dlse * LN2 if dlse is not None else None
    return (dout, dlse2, q, kv, idx, out, lse / LN2, sink, sm_scale, D_V)


def _assert_bitwise(runs):
    for i, run in enumerate(runs[1:], 1):
        for name, a, b in zip(("dq", "dkv", "dsink"), runs[0], run, strict=True):
            assert torch.equal(a, b), f"{name} of run {i} differs bitwise from run 0"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "deterministic, walk", [(False, "fixed"), (False, "synced"), (True, "fixed")]
)
def test_backward_cuda_graph_capture(compiled, monkeypatch, deterministic, walk):
    """No host synchronisation: the whole backward can be captured and replayed (in
    deterministic mode, bit for bit the eager result, at every replay). The synced kernel's
    counter is allocated and zeroed inside the graph."""
    launches = _force_walk(monkeypatch, walk)
    q, kv, dout, idx, sink, dlse = _case(
        2, 64, 128, 16, 1, 576, 640, sink=True, dlse=True, padding="mixed", seed=11
    )
    args = _kernel_args(q, kv, dout, idx, sink, dlse)
    tiling = _row_tiling(16, 576) | dict(deterministic=deterministic)
    expected = bw.sparse_attention_backward_tilelang(*args, **tiling)  # warm-up, uncaptured
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = bw.sparse_attention_backward_tilelang(*args, **tiling)
    replays = []
    for _ in range(3):
        graph.replay()
        replays.append([t.clone() for t in captured])
    torch.cuda.synchronize()
    for name, got, want in zip(("dq", "dkv", "dsink"), captured, expected, strict=True):
        assert_close(got, want, name=name)
    if deterministic:
        _assert_bitwise([expected, *replays])
    assert len(launches) == 2 * (walk == "synced")  # the eager call and the captured one


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(DETERMINISTIC)))
def test_deterministic_backward_is_bitwise_repeatable(compiled, case):
    """Every table row's tiling in deterministic mode: matches the reference like the default
    mode, and three runs give the same bits for dq, dkv and dsink."""
    heads, groups, dim, topk, tiling = DETERMINISTIC[case]
    q, kv, dout, idx, sink, dlse = _case(
        2, 256, 96, heads, groups, dim, topk, sink=True, dlse=True, padding="duplicates",
        seed=200 + case,
    )  # fmt: skip
    _run_and_compare(q, kv, dout, idx, sink, dlse, tiling=tiling)
    args = _kernel_args(q, kv, dout, idx, sink, dlse)
    full = _row_tiling(heads, dim) | tiling
    _assert_bitwise([bw.sparse_attention_backward_tilelang(*args, **full) for _ in range(3)])


@pytest.mark.gpu
def test_deterministic_backward_poisons_dkv_for_non_finite_gradients(compiled):
    """A non-finite upstream gradient leaves no finite scale for the fixed point: dkv is NaN
    everywhere instead of silently wrapped integers."""
    heads, dim, topk, tiling = DETERMINISTIC[0][0], DETERMINISTIC[0][2], *DETERMINISTIC[0][3:]
    q, kv, dout, idx, sink, dlse = _case(
        1, 64, 96, heads, 1, dim, topk, sink=False, dlse=False, padding="duplicates", seed=9
    )
    dout[0, 3, 0, 5] = float("inf")
    args = _kernel_args(q, kv, dout, idx, sink, dlse)
    _, dkv, _ = bw.sparse_attention_backward_tilelang(*args, **_row_tiling(heads, dim) | tiling)
    assert bool(torch.isnan(dkv).all())
