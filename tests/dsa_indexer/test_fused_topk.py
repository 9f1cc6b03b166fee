"""The fused indexer logits -> top-k kernel against the two passes it replaces.

The contract is bit for bit: the fused kernel's indices equal ``ranged_topk`` on the logits
kernel's output with the same config (the same logits code), which the topk tests hold to the
torch reference. Interpreter tests (``test_cpu_interp_*``, run in a fresh process by
``test_interpreter_run``) compare with ``ranged_topk_reference`` on tiny shapes whose lists
compact many times (topk 4-8 in lists of 32 entries): every range layout, heavy ties (q, k and
weights in {-1, 0, 1}, so that -0.0 and +0.0 occur), keys rising along the range (every logit
a candidate), k larger than every range, no keys, and ``lightning_indexer``'s blocks of rows.
GPU tests: every table config, head dims, range layouts, k = 1 / 640 / 2048 / 2112, rising keys,
through the public op in blocks and inside a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("triton is a Linux-only dependency of dsa_indexer", allow_module_level=True)

from dsa_indexer import _ops, causal_ranges, lightning_indexer
from dsa_indexer._triton import logits_topk
from dsa_indexer._triton.logits import indexer_logits_into
from dsa_indexer._triton.logits_topk import MAX_LIST, indexer_logits_topk_into, list_slots
from dsa_indexer.config import INDEXER_CONFIGS, IndexerConfig
from support import (
    RANGE_LAYOUTS,
    check_graph_replays,
    cu_seqlens,
    indexer_inputs,
    interp_only,
    not_interpreted,
    range_layout,
    run_interpreted,
    seeded_gen,
)
from topk import ranged_topk
from topk.reference import ranged_topk_reference

# One warp, so that lists of 32 entries (one per thread, see list_slots) compact often on the
# tiny interpreter shapes.
INTERP_CONFIG = IndexerConfig(
    logits_block_rows=32, logits_block_n=16, logits_num_warps=1, lightning_fused=True
)


def _tied(q, k, w):
    """Inputs in {-1, 0, 1}: many equal logits, and zeros of both signs (negative weights)."""
    return (q.float() * 2).round().clamp(-1, 1).bfloat16(), k.round().clamp(-1, 1), w.sign()


def _rising(t_q, t_kv, heads, d, device="cpu"):
    """Keys whose logits grow with the column for every query: each logit is a candidate."""
    q = torch.ones(t_q, heads, d, device=device, dtype=torch.bfloat16)
    scale = torch.arange(1, t_kv + 1, device=device, dtype=torch.float32) / t_kv
    k = (scale[:, None] * torch.ones(t_kv, d, device=device)).bfloat16()
    w = torch.ones(t_q, heads, device=device)
    return q, k, w


def _fused(q, k, w, starts, ends, topk, config):
    t_q = q.shape[0]
    slots = list_slots(topk, config.logits_block_n, config.logits_num_warps)
    # Scratch and output start as junk: the kernel must write every index and read no stale
    # list entry or count.
    lists = torch.full((t_q, slots), 7, dtype=torch.int64, device=q.device)
    counts = torch.full((t_q,), 3, dtype=torch.int32, device=q.device)
    idx = torch.full((t_q, topk), -5, dtype=torch.int32, device=q.device)
    indexer_logits_topk_into(idx, lists, counts, q, k, w, starts, ends, config=config)
    return idx


def _two_pass(q, k, w, starts, ends, topk, config, select):
    logits = torch.empty(q.shape[0], k.shape[0], device=q.device)
    indexer_logits_into(logits, q, k, w, starts, ends, False, config=config)
    return select(logits, topk, starts, ends)


def _check(q, k, w, starts, ends, topk, config, select=ranged_topk_reference):
    got = _fused(q, k, w, starts, ends, topk, config)
    want = _two_pass(q, k, w, starts, ends, topk, config, select)
    if not torch.equal(got, want):
        row = int((got != want).any(1).nonzero()[0, 0])
        raise AssertionError(
            f"fused top-k differs in {int((got != want).any(1).sum())} rows; row {row}: "
            f"{got[row, :12].tolist()} vs {want[row, :12].tolist()}"
        )


# --------------------------------------------------------------------------- plain CPU


def test_list_slots():
    assert list_slots(2048, 64, 4) == 4096
    assert list_slots(2112, 64, 4) == 4096  # at least one tile past k, not 2k above 4096
    assert list_slots(640, 64, 4) == 2048
    assert list_slots(4, 16, 1) == 32
    assert list_slots(1, 16, 1) == 32
    assert list_slots(1, 16, 4) == 128  # at least one entry per thread
    assert list_slots(4, 16, 16) == 512
    assert list_slots(MAX_LIST - 64, 64, 4) == MAX_LIST
    assert list_slots(MAX_LIST - 63, 64, 4) == 0  # does not fit: the two passes run


def test_budget_names_the_candidate_row():
    """On the fused path the budget is counted in candidate rows: 8 * slots + 4 bytes."""
    cfg = dataclasses.replace(INDEXER_CONFIGS.default, lightning_fused=True)
    slots = list_slots(16, cfg.logits_block_n, cfg.logits_num_warps)
    row = 8 * slots + 4
    with pytest.raises(ValueError, match=rf"below one row of top-k candidates.*at least {row}"):
        _ops._block_rows("lightning_indexer", 100, 100, slots, row - 1)
    assert _ops._block_rows("lightning_indexer", 100, 100, slots, row) == 1
    # The fused rows do not depend on T_kv; the logits rows do.
    assert (
        _ops._block_rows("op", 10**6, 10**6, 4096, 1 << 30)
        == (1 << 30) // (8 * 4096 + 4) // 64 * 64
    )
    assert _ops._block_rows("op", 10**6, 131072, 0, 1 << 30) == 2048


def test_interp_config_is_fused():
    """The CPU ops run the torch reference; the fused flag only matters on the Triton path."""
    assert _ops._fused_slots(INTERP_CONFIG, 8, 100) == 32
    assert _ops._fused_slots(INTERP_CONFIG, 8, 0) == 0  # no keys: no lists to allocate
    assert _ops._fused_slots(dataclasses.replace(INTERP_CONFIG, lightning_fused=False), 8, 100) == 0
    assert _ops._fused_slots(dataclasses.replace(INTERP_CONFIG, backend="torch"), 8, 100) == 0


# --------------------------------------------------------------------------- interpreter


@not_interpreted
def test_interpreter_run():
    run_interpreted(__file__)


@interp_only
@pytest.mark.parametrize("layout", RANGE_LAYOUTS)
def test_cpu_interp_fused_layouts(layout):
    gen = seeded_gen("fused", layout)
    starts, ends, t_kv = range_layout(layout, 70, gen)
    q, k, w = indexer_inputs(70, t_kv, 4, 16, gen)
    _check(q, k, w, starts, ends, 6, INTERP_CONFIG)


@interp_only
@pytest.mark.parametrize("topk", [1, 8])
def test_cpu_interp_fused_ties(topk):
    gen = seeded_gen("fused ties", topk)
    starts, ends, t_kv = range_layout("causal", 60, gen)
    q, k, w = _tied(*indexer_inputs(60, t_kv, 4, 16, gen))
    _check(q, k, w, starts, ends, topk, INTERP_CONFIG)


@interp_only
def test_cpu_interp_fused_emit_blocks(monkeypatch):
    """Compactions that move entries across emit blocks (8 entries per block, 4 per list)."""
    monkeypatch.setattr(logits_topk, "_EMIT", 8)
    gen = seeded_gen("fused emit")
    starts, ends, t_kv = range_layout("causal", 50, gen)
    q, k, w = _tied(*indexer_inputs(50, t_kv, 4, 16, gen))
    _check(q, k, w, starts, ends, 8, INTERP_CONFIG)


@interp_only
def test_cpu_interp_fused_rising_keys():
    q, k, w = _rising(8, 70, 2, 16)
    starts = torch.zeros(8, dtype=torch.int32)
    ends = torch.arange(63, 71, dtype=torch.int32)
    _check(q, k, w, starts, ends, 8, INTERP_CONFIG)


@interp_only
def test_cpu_interp_fused_short_ranges_and_no_keys():
    """k above every range (all taken, -1 tails) and no keys at all (all -1)."""
    gen = seeded_gen("fused short")
    starts, ends = causal_ranges(cu_seqlens([5, 1, 9, 3]), 18)
    q, k, w = indexer_inputs(18, 18, 3, 16, gen)
    _check(q, k, w, starts, ends, 12, INTERP_CONFIG)
    none = torch.zeros(18, dtype=torch.int32)
    got = _fused(q, k[:0], w, none, none, 5, INTERP_CONFIG)
    assert torch.equal(got, torch.full((18, 5), -1, dtype=torch.int32))


@interp_only
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rows", [3, 64])
def test_cpu_interp_blocks(rows, fused):
    """lightning_indexer's blocked Triton path, with the fused kernel or with logits blocks and
    the Triton top-k (one counter per block, one scratch reused): blocks of 3 and 64 rows give
    the indices of one pass."""
    lens = [70, 1, 29]
    gen = seeded_gen("fused blocks", rows)
    q, k, w = indexer_inputs(100, 100, 4, 16, gen)
    starts, ends = causal_ranges(cu_seqlens(lens), 100)
    want = _two_pass(q, k, w, starts, ends, 10, INTERP_CONFIG, ranged_topk_reference)
    fields = dataclasses.astuple(dataclasses.replace(INTERP_CONFIG, lightning_fused=fused))
    got = _ops._lightning_indices_impl(q, k, w, starts, ends, 10, rows, *fields)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- GPU

GPU_T = 4096


def _fused_table_configs():
    """Every config the table can pick (each row, the default), with lightning_fused set."""
    cases = [(row.config, dict(row.key)["heads"]) for row in INDEXER_CONFIGS.rows()]
    cases += [(INDEXER_CONFIGS.default, h) for h in (8, 64)]
    return [(dataclasses.replace(c, lightning_fused=True), h) for c, h in cases]


@pytest.mark.gpu
@pytest.mark.parametrize("config,heads", _fused_table_configs())
@pytest.mark.parametrize("topk", [1, 640, 2048, 2112])
def test_gpu_fused_every_config(config, heads, topk):
    gen = seeded_gen("fused gpu", config, heads, topk)
    for layout in ("causal", "packed_1tok", "cp_offset", "random"):
        starts, ends, t_kv = range_layout(layout, GPU_T, gen, "cuda")
        q, k, w = indexer_inputs(GPU_T, t_kv, heads, 128, gen, "cuda")
        _check(q, k, w, starts, ends, topk, config, select=ranged_topk)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,d", [(32, 64), (8, 128), (64, 128)])
def test_gpu_fused_ties_and_rising_keys(heads, d):
    """Against the torch reference top-k (no helper shared with the kernel), with lists of 2048
    entries (topk 640) over ranges of up to 4096 (causal) and about 5500 (cp_offset) keys, so that
    they compact: heavy ties, and keys whose logits never fall along the range."""
    config = dataclasses.replace(
        INDEXER_CONFIGS.lookup(arch_major=9, heads=heads).config, lightning_fused=True
    )
    gen = seeded_gen("fused gpu ties", heads, d)
    starts, ends, t_kv = range_layout("cp_offset", GPU_T, gen, "cuda")
    q, k, w = _tied(*indexer_inputs(GPU_T, t_kv, heads, d, gen, "cuda"))
    _check(q, k, w, starts, ends, 640, config)
    starts, ends, t_kv = range_layout("causal", GPU_T, gen, "cuda")
    q, k, w = _rising(GPU_T, t_kv, heads, d, "cuda")
    _check(q, k, w, starts, ends, 640, config)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [64, 192, 100_000])
def test_gpu_lightning_fused_equals_two_pass(rows):
    """Through the public op, in blocks of rows on two streams: the fused and the two-pass
    configs give the same indices and scores."""
    gen = seeded_gen("fused public", rows)
    lens = [1500, 1, 333, 2262]
    q, k, w = indexer_inputs(sum(lens), sum(lens), 32, 128, gen, "cuda")
    starts, ends = causal_ranges(cu_seqlens(lens).cuda(), sum(lens))
    base = INDEXER_CONFIGS.lookup(arch_major=9, heads=32).config
    fused = dataclasses.replace(base, lightning_fused=True)
    two = dataclasses.replace(base, lightning_fused=False)
    budget = rows * (8 * list_slots(2048, base.logits_block_n, base.logits_num_warps) + 4)
    s1, i1 = lightning_indexer(
        q, k, w, starts, ends, 2048, logits_budget_bytes=budget, config=fused
    )
    _, i2 = lightning_indexer(q, k, w, starts, ends, 2048, config=two)
    assert torch.equal(i1, i2)
    assert bool(torch.isfinite(s1).sum() == (i1 >= 0).sum())


@pytest.mark.gpu
def test_gpu_fused_in_a_cuda_graph():
    gen = seeded_gen("fused graph")
    cu = cu_seqlens([700, 1, 323]).cuda()
    inputs = [indexer_inputs(1024, 1024, 32, 128, gen, device="cuda") for _ in range(2)]
    starts, ends = causal_ranges(cu, 1024)
    cfg = dataclasses.replace(
        INDEXER_CONFIGS.lookup(arch_major=9, heads=32).config, lightning_fused=True
    )
    budget = 256 * (8 * list_slots(64, cfg.logits_block_n, cfg.logits_num_warps) + 4)
    two_pass = dataclasses.replace(cfg, lightning_fused=False)

    def run(q, k, w, config=cfg):  # the fused path in blocks of 256 rows
        return lightning_indexer(
            q, k, w, starts, ends, 64, logits_budget_bytes=budget, config=config
        )[1]

    check_graph_replays(run, inputs, lambda q, k, w: run(q, k, w, config=two_pass))
