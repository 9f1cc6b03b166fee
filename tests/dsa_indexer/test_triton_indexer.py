"""Triton indexer kernels against the torch reference.

Three groups (the config and its table are tested in test_indexer_ops.py):

* the wrappers' own checks (plain CPU);
* ``test_cpu_interp_*``: the kernels under the Triton interpreter on tiny shapes. Triton reads
  ``TRITON_INTERPRET`` when a kernel is *defined* (at import of ``dsa_indexer._triton``), so
  :func:`test_interpreter_run` runs them in a fresh ``python -m pytest`` with the variable set
  (``support.run_interpreted``); in any other process they skip. The interpreter has no bf16
  matmul, so the kernels upcast their dot operands there and the math is exact up to fp32
  summation order;
* ``gpu`` (skipped without CUDA by tests/conftest.py): the compiled kernels at T = 4096 over
  heads, head dims, range layouts, index patterns and every config the table can pick.

Outputs start poisoned (``kernel_common.testing.poisoned``: NaN) and each check asserts that no
poison survives where the kernel's contract says it writes, besides the numeric comparison.

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
import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("triton is a Linux-only dependency of dsa_indexer", allow_module_level=True)

from dsa_indexer import reference
from dsa_indexer._triton import (
    indexer_logits_triton,
    indexer_topk_scores_backward_triton,
    indexer_topk_scores_triton,
)
from dsa_indexer._triton import logits as logits_kernel
from dsa_indexer._triton.logits import indexer_logits_into
from dsa_indexer._triton.topk_scores import indexer_topk_scores_into, topk_scores_backward_into
from dsa_indexer.config import INDEXER_CONFIGS, IndexerConfig
from kernel_common.testing import assert_close, poisoned, rel_diff
from support import (
    RANGE_LAYOUTS,
    as_padding,
    indexer_indices,
    indexer_inputs,
    interp_only,
    not_interpreted,
    range_layout,
    run_interpreted,
    seeded_gen,
)

# Small tiles so that the tiny interpreter shapes still take several tiles per program.
INTERP_CONFIG = IndexerConfig(
    logits_block_rows=32, logits_block_n=16, scores_block_k=16, backward_block_k=16
)


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
    # Outputs start poisoned (NaN): clean logits write every entry (-inf outside the ranges),
    # unclean ones at least every entry inside the ranges.
    clean = poisoned((t_q, t_kv), torch.float32, q.device)
    indexer_logits_into(clean, q, k, w, starts, ends, True, config=config)
    assert not bool(torch.isnan(clean).any()), "poison left in the clean logits"
    _close(clean, ref, "logits (clean)")  # -inf pattern exact
    unclean = poisoned((t_q, t_kv), torch.float32, q.device)
    indexer_logits_into(unclean, q, k, w, starts, ends, False, config=config)
    cols = torch.arange(t_kv, device=q.device)
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    assert not bool(torch.isnan(unclean[inside]).any()), "poison left inside the ranges"
    assert torch.equal(unclean[inside], clean[inside]), "unclean logits differ inside the ranges"
    public = indexer_logits_triton(q, k, w, starts, ends, True, config=config)
    assert torch.equal(public, clean)


def _check_scores_and_backward(q, k, w, indices, config, accum_bar):
    t_kv = k.shape[0]
    ref_idx = as_padding(indices, t_kv)
    valid = ref_idx >= 0
    ref_scores = reference.indexer_topk_scores_reference(q, k, w, ref_idx)
    out = poisoned(indices.shape, torch.float32, q.device)
    indexer_topk_scores_into(out, q, k, w, indices, config=config)
    assert not bool(torch.isnan(out).any()), "poison left in the scores (-inf at padding)"
    _close(out, ref_scores, "scores")
    assert torch.equal(indexer_topk_scores_triton(q, k, w, indices, config=config), out)

    # Padding slots carry garbage gradients that must be ignored.
    grad = torch.randn(indices.shape, generator=seeded_gen("grad", *indices.shape)).to(q.device)
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
    # dq and dweights start poisoned (written whole); dk is an accumulator and starts at 0.
    aq = poisoned(q.shape, torch.float32, q.device)
    ak = torch.zeros(k.shape, device=q.device)
    aw = poisoned(w.shape, torch.float32, q.device)
    topk_scores_backward_into(aq, ak, aw, grad, q, k, w, indices, config=config)
    assert not bool(torch.isnan(aq).any()), "poison left in dq"
    assert not bool(torch.isnan(aw).any()), "poison left in dweights"
    _close(aq, fq, "dq (fp32 accumulation)", accum_bar)
    _close(ak, fk, "dk (fp32 accumulation)", accum_bar)
    _close(aw, fw, "dweights (fp32 accumulation)", accum_bar)


# --------------------------------------------------------------------------- wrapper checks


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


@not_interpreted
def test_interpreter_run():
    run_interpreted(__file__)


@interp_only
@pytest.mark.parametrize("layout", RANGE_LAYOUTS)
@pytest.mark.parametrize("heads,d", [(8, 32), (6, 16)])
def test_cpu_interp_logits(layout, heads, d):
    gen = seeded_gen(layout, heads, d)
    t_q = 37
    starts, ends, t_kv = range_layout(layout, t_q, gen)
    q, k, w = indexer_inputs(t_q, t_kv, heads, d, gen)
    _check_logits(q, k, w, starts, ends, INTERP_CONFIG)


def _long_ranges(t_q, t_kv, gen, device):
    """Ranges over ``t_kv`` keys that start below 0, end past T_kv, are empty in some rows and
    cross the key chunks of a split launch anywhere."""
    starts = torch.randint(-3, t_kv, (t_q,), generator=gen)
    ends = starts + torch.randint(-4, t_kv // 2, (t_q,), generator=gen)
    ends[::7] = starts[::7]
    return starts.to(device, torch.int32), ends.to(device, torch.int32)


def _check_split_logits(t_q, t_kv, heads, d, config, device):
    """Logits of a launch whose few query blocks split the keys into chunks (asserted)."""
    gen = seeded_gen("split", t_q, t_kv, heads)
    q, k, w = indexer_inputs(t_q, t_kv, heads, d, gen, device)
    starts, ends = _long_ranges(t_q, t_kv, gen, device)
    hp = 1 << (heads - 1).bit_length()  # the kernel pads heads to a power of two
    blocks = -(-t_q // max(1, config.logits_block_rows // hp))
    assert logits_kernel._split_n(blocks, t_kv, config.logits_block_n, q.device) < t_kv
    _check_logits(q, k, w, starts, ends, config)


@interp_only
def test_cpu_interp_logits_key_chunks(monkeypatch):
    # The interpreter counts one SM: 16 programs, chunks of 16+ keys.
    monkeypatch.setattr(logits_kernel, "_PROGRAMS_PER_SM", 16)
    monkeypatch.setattr(logits_kernel, "_MIN_SPLIT_N", 16)
    _check_split_logits(9, 150, 8, 16, INTERP_CONFIG, "cpu")


@interp_only
def test_cpu_interp_logits_all_empty():
    gen = seeded_gen("all-empty")
    q, k, w = indexer_inputs(9, 20, 8, 16, gen)
    starts = torch.full((9,), 5, dtype=torch.int32)
    out = poisoned((9, 20), torch.float32, "cpu")
    indexer_logits_into(out, q, k, w, starts, starts, True, config=INTERP_CONFIG)
    assert torch.isneginf(out).all()


@interp_only
@pytest.mark.parametrize("pattern,topk", [("ranged", 37), ("messy", 37), ("messy", 1)])
@pytest.mark.parametrize("heads,d", [(8, 32), (20, 16)])
def test_cpu_interp_topk_scores_and_backward(pattern, topk, heads, d):
    gen = seeded_gen(pattern, topk, heads, d)
    t_q = 29
    starts, ends, t_kv = range_layout("cp_offset", t_q, gen)
    q, k, w = indexer_inputs(t_q, t_kv, heads, d, gen)
    indices = indexer_indices(starts, ends, t_kv, topk, pattern, gen)
    _check_scores_and_backward(q, k, w, indices, INTERP_CONFIG, accum_bar=1e-10)


# The backward variants the config can select beyond the default (rotate=False, split=1).
BACKWARD_VARIANTS = [(True, 1), (False, 2), (True, 2)]


@interp_only
@pytest.mark.parametrize("rotate,split", BACKWARD_VARIANTS)
@pytest.mark.parametrize("heads,d", [(20, 32), (8, 16)])
def test_cpu_interp_backward_variants(rotate, split, heads, d):
    """Rotated walks (37 slots: the partial block sits mid-walk for most queries) and the split
    dk product (d = 16 falls back to one block: halves would be below the tensor-core width)."""
    gen = seeded_gen("variants", rotate, split, heads, d)
    t_q = 29
    starts, ends, t_kv = range_layout("cp_offset", t_q, gen)
    q, k, w = indexer_inputs(t_q, t_kv, heads, d, gen)
    indices = indexer_indices(starts, ends, t_kv, 37, "messy", gen)
    config = dataclasses.replace(INTERP_CONFIG, backward_rotate=rotate, backward_dk_split=split)
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-10)


@interp_only
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("pattern", ["ranged", "messy"])
def test_cpu_interp_backward_key_windows(pattern, rotate):
    """One pass per window of 16 keys (87 keys: 6 passes, the last partial); ascending rows
    walk only their window's blocks, messy ones (shuffled, duplicates, strays) walk more."""
    gen = seeded_gen("windows", pattern, rotate)
    t_q = 29
    starts, ends, t_kv = range_layout("cp_offset", t_q, gen)
    q, k, w = indexer_inputs(t_q, t_kv, 8, 16, gen)
    indices = indexer_indices(starts, ends, t_kv, 37, pattern, gen)
    config = dataclasses.replace(INTERP_CONFIG, backward_rotate=rotate, backward_key_window=16)
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-10)


@interp_only
def test_cpu_interp_backward_without_keys():
    """No keys at all: every slot is padding, and dq / dweights are still written (zeros)."""
    gen = seeded_gen("no-keys")
    q, k, w = indexer_inputs(5, 0, 4, 16, gen)
    indices = torch.full((5, 3), -1, dtype=torch.int32)
    grad = torch.randn(5, 3, generator=gen)
    config = dataclasses.replace(INTERP_CONFIG, backward_key_window=16)
    aq = poisoned(q.shape, torch.float32, "cpu")
    ak = torch.zeros(k.shape)
    aw = poisoned(w.shape, torch.float32, "cpu")
    topk_scores_backward_into(aq, ak, aw, grad, q, k, w, indices, config=config)
    assert torch.equal(aq, torch.zeros_like(aq)) and torch.equal(aw, torch.zeros_like(aw))


# --------------------------------------------------------------------------- GPU

GPU_T = 4096


def _device_config(heads):
    """The config the entries pick on the H200 for this head count (its table row)."""
    return INDEXER_CONFIGS.lookup(arch_major=9, heads=heads).config


def _every_table_config():
    """(config, heads) pairs: each row at its own heads bucket, the default at 8 and 64."""
    cases = [(row.config, dict(row.key)["heads"]) for row in INDEXER_CONFIGS.rows()]
    cases += [(INDEXER_CONFIGS.default, h) for h in (8, 64)]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("layout", RANGE_LAYOUTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_gpu_logits(heads, d, layout):
    gen = seeded_gen("logits", heads, d, layout)
    starts, ends, t_kv = range_layout(layout, GPU_T, gen, "cuda")
    q, k, w = indexer_inputs(GPU_T, t_kv, heads, d, gen, "cuda")
    _check_logits(q, k, w, starts, ends, _device_config(heads))


@pytest.mark.gpu
@pytest.mark.parametrize("config,heads", _every_table_config())
def test_gpu_logits_every_config(config, heads):
    gen = seeded_gen("cfg", config, heads)
    for layout in ("packed_1tok", "cp_offset"):
        starts, ends, t_kv = range_layout(layout, 2048, gen, "cuda")
        q, k, w = indexer_inputs(2048, t_kv, heads, 128, gen, "cuda")
        _check_logits(q, k, w, starts, ends, config)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern,topk", [("ranged", 2048), ("messy", 2048), ("messy", 100)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_gpu_topk_scores_and_backward(heads, d, pattern, topk):
    gen = seeded_gen("scores", heads, d, pattern, topk)
    starts, ends, t_kv = range_layout(
        "causal" if pattern == "ranged" else "cp_offset", GPU_T, gen, "cuda"
    )
    q, k, w = indexer_inputs(GPU_T, t_kv, heads, d, gen, "cuda")
    indices = indexer_indices(starts, ends, t_kv, topk, pattern, gen)
    _check_scores_and_backward(q, k, w, indices, _device_config(heads), accum_bar=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("config,heads", _every_table_config())
def test_gpu_topk_scores_every_config(config, heads):
    gen = seeded_gen("scores-cfg", config, heads)
    starts, ends, t_kv = range_layout("packed_1tok", 2048, gen, "cuda")
    q, k, w = indexer_inputs(2048, t_kv, heads, 128, gen, "cuda")
    indices = indexer_indices(starts, ends, t_kv, 640, "messy", gen)
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rotate,split", BACKWARD_VARIANTS)
@pytest.mark.parametrize("pattern,topk", [("ranged", 2048), ("messy", 100)])
@pytest.mark.parametrize("heads,d", [(8, 128), (32, 64), (32, 128), (64, 128)])
def test_gpu_backward_variants(heads, d, pattern, topk, rotate, split):
    """Each backward knob value on the table's tiling for these heads."""
    gen = seeded_gen("bwd-variants", heads, d, pattern, topk, rotate, split)
    starts, ends, t_kv = range_layout(
        "causal" if pattern == "ranged" else "cp_offset", GPU_T, gen, "cuda"
    )
    q, k, w = indexer_inputs(GPU_T, t_kv, heads, d, gen, "cuda")
    indices = indexer_indices(starts, ends, t_kv, topk, pattern, gen)
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
    gen = seeded_gen("bwd-windows", heads, pattern, topk, rotate)
    starts, ends, t_kv = range_layout(
        "causal" if pattern == "ranged" else "cp_offset", GPU_T, gen, "cuda"
    )
    q, k, w = indexer_inputs(GPU_T, t_kv, heads, 128, gen, "cuda")
    indices = indexer_indices(starts, ends, t_kv, topk, pattern, gen)
    config = dataclasses.replace(
        _device_config(heads), backward_rotate=rotate, backward_key_window=1024
    )
    _check_scores_and_backward(q, k, w, indices, config, accum_bar=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 32, 64])
def test_gpu_logits_key_chunks(heads):
    """A few query blocks (as in a lightning block) against many keys: chunked programs."""
    _check_split_logits(300, 40000, heads, 128, _device_config(heads), "cuda")


@pytest.mark.gpu
def test_gpu_large_offsets():
    """T * T_kv > 2^31: the last rows' logits and -inf fill sit past int32 offsets."""
    t_q, heads, d = 256, 8, 64
    t_kv = (1 << 31) // t_q + 4096
    gen = seeded_gen("large")
    q, k, w = indexer_inputs(t_q, t_kv, heads, d, gen, "cuda")
    first = t_kv - 300
    starts = torch.full((t_q,), first, dtype=torch.int32, device="cuda")
    ends = starts + torch.arange(1, t_q + 1, dtype=torch.int32, device="cuda")
    out = indexer_logits_triton(q, k, w, starts, ends, True, config=_device_config(heads))
    ref = reference.indexer_logits_reference(q, k[first:], w, starts - first, ends - first)
    _close(out[:, first:], ref, "logits window")
    assert bool(torch.isneginf(out[:, :first]).all())
