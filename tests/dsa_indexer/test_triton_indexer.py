"""Triton indexer kernels against the torch reference.

Three groups:

* config logic (plain CPU);
* ``test_cpu_interp_*``: the kernels under the Triton interpreter on tiny shapes. Triton reads
  ``TRITON_INTERPRET`` when a kernel is *defined* (at import of ``dsa_indexer._triton``), so
  :func:`test_interpreter_run` runs them in a fresh ``python -m pytest`` with the variable set;
  in any other process they skip. The interpreter has no bf16 matmul, so the kernels upcast
  their dot operands there and the math is exact up to fp32 summation order;
* ``gpu`` (skipped without CUDA by tests/conftest.py): the compiled kernels at T = 4096 over
  heads, head dims, range layouts, index patterns and every config the table can pick.

Precision. Logits and scores are fp32 sums of exact bf16 products: rel_diff <= 1e-5 and the same
-inf pattern. The backward returns dq and dk in bf16; comparing those against the reference's
bf16 is the contract (both are fp32 sums rounded once, so they differ by at most one rounding
flip per entry), but bf16 rounding alone sits near rel_diff 1e-6 and would hide a small logic
error. So the tests also compare the fp32 accumulations themselves (dq written as fp32, the fp32
dk scratch) with the reference run on the exactly upcast inputs: on the interpreter to 1e-10, on
the GPU to 1e-5 (there ds enters the gradient products as bf16, by design).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton backend needs triton (Linux)")
from dsa_indexer import causal_ranges, reference
from dsa_indexer._triton import (
    indexer_logits_triton,
    indexer_topk_scores_backward_triton,
    indexer_topk_scores_triton,
)
from dsa_indexer._triton.logits import indexer_logits_into
from dsa_indexer._triton.topk_scores import indexer_topk_scores_into, topk_scores_backward_into
from dsa_indexer.config import (
    INDEXER_CONFIGS,
    TORCH_CONFIG,
    IndexerConfig,
    resolve_indexer_config,
)
from kernel_common import KeyField
from kernel_common.testing import assert_close, rel_diff

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(
    not INTERPRETED, reason="runs under TRITON_INTERPRET=1, started by test_interpreter_run"
)

# Small tiles so that the tiny interpreter shapes still take several tiles per program.
INTERP_CONFIG = IndexerConfig(
    logits_block_rows=32, logits_block_n=16, scores_block_k=16, backward_block_k=16
)


# --------------------------------------------------------------------------- input builders


def _gen(*key):
    """A generator seeded by the case (stable across processes, unlike ``hash``)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _qkw(t_q, t_kv, heads, d, device, gen):
    q = torch.randn(t_q, heads, d, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(t_kv, d, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(t_q, heads, generator=gen) / heads**0.5).to(device)
    return q, k, w


def _segments(lengths, device):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu.to(device)


def _layout(name, t_q, device, gen):
    """``(starts, ends, t_kv)`` for a named range layout with ``t_q`` queries."""
    if name == "causal":
        starts, ends = causal_ranges(_segments([t_q], device), t_q)
        return starts, ends, t_q
    if name == "packed_1tok":
        # 1-token segments between longer ones, odd lengths, ending exactly at t_q.
        lengths, left, i = [], t_q, 0
        while left:
            n = min(left, (1, 1, 7, 1, max(2, t_q // 5), 3)[i % 6])
            lengths.append(n)
            left -= n
            i += 1
        starts, ends = causal_ranges(_segments(lengths, device), t_q)
        return starts, ends, t_q
    if name == "ratio4":
        lengths = [t_q // 2 + 3, t_q - t_q // 2 - 3]
        starts, ends = causal_ranges(_segments(lengths, device), t_q, ratio=4)
        return starts, ends, sum(n // 4 for n in lengths)
    if name == "cp_offset":
        # The query shard is the second third of a 3 * t_q packed sequence of two segments.
        total = 3 * t_q
        cu = _segments([t_q + t_q // 3, total - t_q - t_q // 3], device)
        starts, ends = causal_ranges(cu, t_q, query_offset=t_q)
        return starts, ends, total
    if name == "random":
        # Empty ranges, starts below 0 and ends past T_kv: the kernel clamps, the reference masks.
        t_kv = t_q + 13
        starts = torch.randint(-3, t_kv + 2, (t_q,), generator=gen)
        ends = starts + torch.randint(-4, t_kv // 2, (t_q,), generator=gen)
        ends[: max(1, t_q // 8)] = starts[: max(1, t_q // 8)]  # a few empty rows
        return starts.to(device, torch.int32), ends.to(device, torch.int32), t_kv
    raise ValueError(name)


def _indices(starts, ends, t_kv, topk, pattern, gen):
    """int32 ``[T, topk]`` columns inside each range (-1 tail when the range is short).

    ``pattern="ranged"``: the top-k of random scores over each range, ascending, as the
    ranged top-k delivers them. ``"messy"``: the same, then ~5% of slots made out of range
    (-7, T_kv, T_kv + 9), ~5% duplicated from another slot of the row, a few all -1 rows, and
    the columns shuffled.
    """
    device = starts.device
    t_q = starts.shape[0]
    cols = torch.arange(t_kv, device=device)
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    scores = torch.rand(t_q, t_kv, generator=gen).to(device)
    scores = torch.where(inside, scores, float("-inf"))
    width = min(topk, t_kv)
    vals, idx = scores.topk(width, dim=1)
    idx = torch.where(torch.isfinite(vals), idx, t_kv).sort(dim=1).values  # padding sorts last
    idx = torch.where(idx < t_kv, idx, -1)
    idx = torch.nn.functional.pad(idx, (0, topk - width), value=-1)
    if pattern == "messy":
        u = torch.rand(t_q, topk, generator=gen).to(device)
        stray = torch.tensor([-7, t_kv, t_kv + 9], device=device)[
            torch.randint(0, 3, (t_q, topk), generator=gen).to(device)
        ]
        dup = idx.gather(1, torch.randint(0, topk, (t_q, topk), generator=gen).to(device))
        idx = torch.where(u < 0.05, stray, torch.where(u < 0.10, dup, idx))
        idx[torch.randperm(t_q, generator=gen)[: max(1, t_q // 16)].to(device)] = -1
        perm = torch.rand(t_q, topk, generator=gen).to(device).argsort(dim=1)
        idx = idx.gather(1, perm)
    return idx.to(torch.int32).contiguous()


def _as_padding(indices, t_kv):
    """What the reference sees: out-of-range entries replaced by the -1 they stand for."""
    return torch.where((indices >= 0) & (indices < t_kv), indices, -1)


# --------------------------------------------------------------------------- shared checks


def _close(actual, expected, name, bar=1e-5):
    """``assert_close`` semantics, evaluated on the tensors' device (the GPU logits are large);
    the detailed host-side report runs only on failure."""
    a, e = actual.double(), expected.double()
    same_pattern = torch.equal(torch.isnan(a), torch.isnan(e)) and torch.equal(
        torch.where(torch.isinf(a), a, 0), torch.where(torch.isinf(e), e, 0)
    )
    finite = torch.isfinite(a) & torch.isfinite(e)
    if not (same_pattern and rel_diff(a[finite], e[finite]) <= bar):
        assert_close(actual, expected, max_rel_diff=bar, name=name)


def _check_logits(q, k, w, starts, ends, config):
    t_q, t_kv = q.shape[0], k.shape[0]
    ref = reference.indexer_logits_reference(q, k, w, starts, ends)
    clean = torch.full((t_q, t_kv), float("nan"), device=q.device)
    indexer_logits_into(clean, q, k, w, starts, ends, True, config=config)
    _close(clean, ref, "logits (clean)")  # -inf pattern exact, no NaN left
    unclean = torch.full((t_q, t_kv), float("nan"), device=q.device)
    indexer_logits_into(unclean, q, k, w, starts, ends, False, config=config)
    cols = torch.arange(t_kv, device=q.device)
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    assert torch.equal(unclean[inside], clean[inside]), "unclean logits differ inside the ranges"
    public = indexer_logits_triton(q, k, w, starts, ends, True, config=config)
    assert torch.equal(public, clean)


def _check_scores_and_backward(q, k, w, indices, config, accum_bar):
    t_kv = k.shape[0]
    ref_idx = _as_padding(indices, t_kv)
    valid = ref_idx >= 0
    ref_scores = reference.indexer_topk_scores_reference(q, k, w, ref_idx)
    out = torch.full(indices.shape, float("nan"), device=q.device)
    indexer_topk_scores_into(out, q, k, w, indices, config=config)
    _close(out, ref_scores, "scores")
    assert torch.equal(indexer_topk_scores_triton(q, k, w, indices, config=config), out)

    # Padding slots carry garbage gradients that must be ignored.
    grad = torch.randn(indices.shape, device=q.device)
    grad = torch.where(valid, grad, float("nan"))
    rq, rk, rw = reference.indexer_topk_scores_backward_reference(grad, q, k, w, ref_idx)
    dq, dk, dw = indexer_topk_scores_backward_triton(grad, q, k, w, indices, config=config)
    assert dq.dtype == torch.bfloat16 and dk.dtype == torch.bfloat16 and dw.dtype == torch.float32
    _close(dq, rq, "dq")
    _close(dk, rk, "dk")
    _close(dw, rw, "dweights")

    fq, fk, fw = reference.indexer_topk_scores_backward_reference(
        grad, q.float(), k.float(), w, ref_idx
    )
    aq = torch.full(q.shape, float("nan"), device=q.device)
    ak = torch.zeros(k.shape, device=q.device)
    aw = torch.full(w.shape, float("nan"), device=q.device)
    topk_scores_backward_into(aq, ak, aw, grad, q, k, w, indices, config=config)
    _close(aq, fq, "dq (fp32 accumulation)", accum_bar)
    _close(ak, fk, "dk (fp32 accumulation)", accum_bar)
    _close(aw, fw, "dweights (fp32 accumulation)", accum_bar)


# --------------------------------------------------------------------------- config logic


def test_config_validation():
    with pytest.raises(ValueError, match="backend"):
        IndexerConfig(backend="cuda")
    with pytest.raises(ValueError, match="logits_block_n"):
        IndexerConfig(logits_block_n=96)
    with pytest.raises(ValueError, match="backward_block_k"):
        IndexerConfig(backward_block_k=8)
    with pytest.raises(ValueError, match="scores_num_warps"):
        IndexerConfig(scores_num_warps=3)
    with pytest.raises(ValueError, match="logits_num_stages"):
        IndexerConfig(logits_num_stages=0)
    with pytest.raises(ValueError, match="backward_rotate"):
        IndexerConfig(backward_rotate=1)
    with pytest.raises(ValueError, match="backward_dk_split"):
        IndexerConfig(backward_dk_split=4)
    with pytest.raises(ValueError, match="backward_dk_split"):
        IndexerConfig(backward_dk_split=True)
    with pytest.raises(ValueError, match="backward_key_window"):
        IndexerConfig(backward_key_window=-1)
    with pytest.raises(ValueError, match="backward_key_window"):
        IndexerConfig(backward_key_window=True)
    cfg = IndexerConfig(
        logits_block_rows=64, backward_num_stages=3, backward_rotate=True, backward_dk_split=2
    )
    assert IndexerConfig.from_json(cfg.to_json()) == cfg


def test_config_table_rows():
    assert [f.name for f in INDEXER_CONFIGS.fields] == ["arch_major", "heads"]
    assert all(isinstance(f, KeyField) for f in INDEXER_CONFIGS.fields)
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
    assert INDEXER_CONFIGS.default in INDEXER_CONFIGS.configs()


def test_resolve_indexer_config(monkeypatch):
    mine = IndexerConfig(logits_block_n=256)
    for config in (None, mine):
        lookup = resolve_indexer_config("cpu", 32, config)
        assert lookup.config == TORCH_CONFIG
        assert lookup.source.startswith("cpu")
    monkeypatch.setenv("KERNEL_COMMON_ARCH", "sm_90")
    lookup = resolve_indexer_config(torch.device("cuda", 0), 32)
    assert lookup.config == INDEXER_CONFIGS.lookup(arch_major=9, heads=32).config
    assert lookup.source.startswith("row")
    assert resolve_indexer_config("cuda", 32, mine).config == mine
    monkeypatch.setenv("KERNEL_COMMON_ARCH", "sm_100")
    assert resolve_indexer_config("cuda", 16).config == INDEXER_CONFIGS.default
    monkeypatch.setenv("KERNEL_COMMON_ARCH", "gfx942")
    assert resolve_indexer_config("cuda", 16, mine).config == TORCH_CONFIG


def test_unsupported_head_dim():
    q = torch.zeros(4, 8, 48, dtype=torch.bfloat16)
    k = torch.zeros(4, 48, dtype=torch.bfloat16)
    w = torch.zeros(4, 8)
    r = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        indexer_logits_triton(q, k, w, r, r, True, config=INTERP_CONFIG)
    with pytest.raises(ValueError, match="power of two"):
        indexer_topk_scores_triton(q, k, w, r[:, None], config=INTERP_CONFIG)


# --------------------------------------------------------------------------- interpreter


@pytest.mark.skipif(INTERPRETED, reason="this process already interprets the kernels")
def test_interpreter_run():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KERNEL_COMMON_ARCH", None)
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x"]
    cmd += ["-k", "cpu_interp", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter tests failed:\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail


@interp_only
@pytest.mark.parametrize("layout", ["causal", "packed_1tok", "ratio4", "cp_offset", "random"])
@pytest.mark.parametrize("heads,d", [(8, 32), (6, 16)])
def test_cpu_interp_logits(layout, heads, d):
    gen = _gen(layout, heads, d)
    t_q = 37
    starts, ends, t_kv = _layout(layout, t_q, "cpu", gen)
    q, k, w = _qkw(t_q, t_kv, heads, d, "cpu", gen)
    _check_logits(q, k, w, starts, ends, INTERP_CONFIG)


@interp_only
def test_cpu_interp_logits_all_empty():
    gen = _gen("all-empty")
    q, k, w = _qkw(9, 20, 8, 16, "cpu", gen)
    starts = torch.full((9,), 5, dtype=torch.int32)
    out = torch.full((9, 20), float("nan"))
    indexer_logits_into(out, q, k, w, starts, starts, True, config=INTERP_CONFIG)
    assert torch.isneginf(out).all()


@interp_only
@pytest.mark.parametrize("pattern,topk", [("ranged", 37), ("messy", 37), ("messy", 1)])
@pytest.mark.parametrize("heads,d", [(8, 32), (20, 16)])
def test_cpu_interp_topk_scores_and_backward(pattern, topk, heads, d):
    gen = _gen(pattern, topk, heads, d)
    t_q = 29
    starts, ends, t_kv = _layout("cp_offset", t_q, "cpu", gen)
    q, k, w = _qkw(t_q, t_kv, heads, d, "cpu", gen)
    indices = _indices(starts, ends, t_kv, topk, pattern, gen)
    _check_scores_and_backward(q, k, w, indices, INTERP_CONFIG, accum_bar=1e-10)


# The backward variants the config can select beyond the default (rotate=False, split=1).
BACKWARD_VARIANTS = [(True, 1), (False, 2), (True, 2)]


@interp_only
@pytest.mark.parametrize("rotate,split", BACKWARD_VARIANTS)
@pytest.mark.parametrize("heads,d", [(20, 32), (8, 16)])
def test_cpu_interp_backward_variants(rotate, split, heads, d):
    """Rotated walks (37 slots: the partial block sits mid-walk for most queries) and the split
    dk product (d = 16 falls back to one block: halves would be below the tensor-core width)."""
    gen = _gen("variants", rotate, split, heads, d)
    t_q = 29
    starts, ends, t_kv = _layout("cp_offset", t_q, "cpu", gen)
    q, k, w = _qkw(t_q, t_kv, heads, d, "cpu", gen)
    indices = _indices(starts, ends, t_kv, 37, "messy", gen)
    config = dataclasses.replace(INTERP_CONFIG, backward_rotate=rotate, backward_dk_split=split)
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-10)


@interp_only
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("pattern", ["ranged", "messy"])
def test_cpu_interp_backward_key_windows(pattern, rotate):
    """One pass per window of 16 keys (87 keys: 6 passes, the last partial); ascending rows
    walk only their window's blocks, messy ones (shuffled, duplicates, strays) walk more."""
    gen = _gen("windows", pattern, rotate)
    t_q = 29
    starts, ends, t_kv = _layout("cp_offset", t_q, "cpu", gen)
    q, k, w = _qkw(t_q, t_kv, 8, 16, "cpu", gen)
    indices = _indices(starts, ends, t_kv, 37, pattern, gen)
    config = dataclasses.replace(INTERP_CONFIG, backward_rotate=rotate, backward_key_window=16)
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-10)


@interp_only
def test_cpu_interp_backward_without_keys():
    """No keys at all: every slot is padding, and dq / dweights are still written (zeros)."""
    gen = _gen("no-keys")
    q, k, w = _qkw(5, 0, 4, 16, "cpu", gen)
    indices = torch.full((5, 3), -1, dtype=torch.int32)
    grad = torch.randn(5, 3, generator=gen)
    config = dataclasses.replace(INTERP_CONFIG, backward_key_window=16)
    aq = torch.full(q.shape, float("nan"))
    ak = torch.zeros(k.shape)
    aw = torch.full(w.shape, float("nan"))
    topk_scores_backward_into(aq, ak, aw, grad, q, k, w, indices, config=config)
    assert torch.equal(aq, torch.zeros_like(aq)) and torch.equal(aw, torch.zeros_like(aw))


# --------------------------------------------------------------------------- GPU

LAYOUTS = ["causal", "packed_1tok", "ratio4", "cp_offset", "random"]
GPU_T = 4096


def _device_config(heads):
    return resolve_indexer_config(torch.device("cuda"), heads).config


def _every_table_config():
    """(config, heads) pairs: each row at its own heads bucket, the default at 8 and 64."""
    cases = [(row.config, dict(row.key)["heads"]) for row in INDEXER_CONFIGS.rows()]
    cases += [(INDEXER_CONFIGS.default, h) for h in (8, 64)]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_gpu_logits(heads, d, layout):
    gen = _gen("logits", heads, d, layout)
    starts, ends, t_kv = _layout(layout, GPU_T, "cuda", gen)
    q, k, w = _qkw(GPU_T, t_kv, heads, d, "cuda", gen)
    _check_logits(q, k, w, starts, ends, _device_config(heads))


@pytest.mark.gpu
@pytest.mark.parametrize("config,heads", _every_table_config())
def test_gpu_logits_every_config(config, heads):
    gen = _gen("cfg", config, heads)
    for layout in ("packed_1tok", "cp_offset"):
        starts, ends, t_kv = _layout(layout, 2048, "cuda", gen)
        q, k, w = _qkw(2048, t_kv, heads, 128, "cuda", gen)
        _check_logits(q, k, w, starts, ends, config)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,topk", [("ranged", 2048), ("messy", 2048), ("messy", 100)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_gpu_topk_scores_and_backward(heads, d, pattern, topk):
    gen = _gen("scores", heads, d, pattern, topk)
    starts, ends, t_kv = _layout(
        "causal" if pattern == "ranged" else "cp_offset", GPU_T, "cuda", gen
    )
    q, k, w = _qkw(GPU_T, t_kv, heads, d, "cuda", gen)
    indices = _indices(starts, ends, t_kv, topk, pattern, gen)
    _check_scores_and_backward(q, k, w, indices, _device_config(heads), accum_bar=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("config,heads", _every_table_config())
def test_gpu_topk_scores_every_config(config, heads):
    gen = _gen("scores-cfg", config, heads)
    starts, ends, t_kv = _layout("packed_1tok", 2048, "cuda", gen)
    q, k, w = _qkw(2048, t_kv, heads, 128, "cuda", gen)
    indices = _indices(starts, ends, t_kv, 640, "messy", gen)
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rotate,split", BACKWARD_VARIANTS)
@pytest.mark.parametrize("pattern,topk", [("ranged", 2048), ("messy", 100)])
@pytest.mark.parametrize("heads,d", [(8, 128), (32, 64), (32, 128), (64, 128)])
def test_gpu_backward_variants(heads, d, pattern, topk, rotate, split):
    """Each backward knob value on the table's tiling for these heads."""
    gen = _gen("bwd-variants", heads, d, pattern, topk, rotate, split)
    starts, ends, t_kv = _layout(
        "causal" if pattern == "ranged" else "cp_offset", GPU_T, "cuda", gen
    )
    q, k, w = _qkw(GPU_T, t_kv, heads, d, "cuda", gen)
    indices = _indices(starts, ends, t_kv, topk, pattern, gen)
    config = dataclasses.replace(
        _device_config(heads), backward_rotate=rotate, backward_dk_split=split
    )
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("pattern,topk", [("ranged", 2048), ("messy", 100)])
@pytest.mark.parametrize("heads", [8, 32, 64])
def test_gpu_backward_key_windows(heads, pattern, topk, rotate):
    """The windowed backward (4 passes of 1024 keys at T = 4096, as 65536-key windows run at
    128k) on the table's tiling: bf16 dq is rounded once per pass and still within the bar."""
    gen = _gen("bwd-windows", heads, pattern, topk, rotate)
    starts, ends, t_kv = _layout(
        "causal" if pattern == "ranged" else "cp_offset", GPU_T, "cuda", gen
    )
    q, k, w = _qkw(GPU_T, t_kv, heads, 128, "cuda", gen)
    indices = _indices(starts, ends, t_kv, topk, pattern, gen)
    config = dataclasses.replace(
        _device_config(heads), backward_rotate=rotate, backward_key_window=1024
    )
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-5)


@pytest.mark.gpu
def test_gpu_large_offsets():
    """T * T_kv > 2^31: the last rows' logits and -inf fill sit past int32 offsets."""
    t_q, heads, d = 256, 8, 64
    t_kv = (1 << 31) // t_q + 4096
    gen = _gen("large")
    q, k, w = _qkw(t_q, t_kv, heads, d, "cuda", gen)
    first = t_kv - 300
    starts = torch.full((t_q,), first, dtype=torch.int32, device="cuda")
    ends = starts + torch.arange(1, t_q + 1, dtype=torch.int32, device="cuda")
    out = indexer_logits_triton(q, k, w, starts, ends, True, config=_device_config(heads))
    ref = reference.indexer_logits_reference(q, k[first:], w, starts - first, ends - first)
    _close(out[:, first:], ref, "logits window")
    assert bool(torch.isneginf(out[:, :first]).all())
