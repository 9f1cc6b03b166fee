"""Benchmark of the Triton indexer kernels on one GPU (H200 figures in docs/gpu-results.md).

    python -m dsa_bench.indexer [--out DIR] [--sweep | --backward-sweep | --window-sweep]

(``uv run python -m dsa_bench.indexer ...`` in the workspace; ``--plot indexer.csv`` redraws the
PNG anywhere, with matplotlib.) The kernels are the private Triton entries of ``dsa_indexer``
called with the config that :func:`dsa_indexer.resolve_config` picks for the GPU and head count
(the arch's ``INDEXER_CONFIGS`` row), or with the sweeps' candidates.

Cases: T in {4k, 16k, 64k, 128k} tokens, H = 32, D = 128; one causal sequence, and 8 packed
causal sequences of equal length. For each case:

* forward: ``indexer_logits`` with ``clean=False`` (what ``lightning_indexer`` runs) and with
  ``clean=True``; TFLOP/s over the in-range (query, key) pairs, 2 * H * D flops each, and the
  fraction of the measured bf16 peak (812 TFLOP/s). Bar: >= 400 TFLOP/s from 16k on.
* backward of the top-k scores, topk = 2048: indices are stratified random columns of each causal
  window (one random key in each 1/topk-th of the window: distinct, ascending, spread over the
  whole window like a real top-k), with a -1 tail where the window holds fewer than topk keys.
  Time of the whole wrapper (scratch zeroing, kernel, dk cast) against its memory floor: the
  gathered key rows (topk * D * 2 bytes per query) + q + dq + dk + dweights at 4.26 TB/s.
  Bar: within 3x of the floor.
* the torch reference at 4k only (it is slow), after checking the kernels against it there.

Writes ``indexer.csv`` and ``indexer.png`` under ``--out`` (default ``benchmarks/results``).
``--sweep`` instead times candidate tilings per head count at 16k tokens and prints the best,
as rows for ``dsa_indexer.config.INDEXER_CONFIGS``. ``--backward-sweep`` times the backward's
variants (pipeline stages, ``backward_rotate``, ``backward_dk_split``) per head count on 16k
causal, 16k packed8 and 4k causal, and prints the best per head count. ``--window-sweep`` times
the backward in one pass and in passes of ``backward_key_window`` keys on long inputs.
``--lightning`` times ``lightning_indexer`` end to end (forward, forward+backward, peak memory)
on the two passes and the fused logits -> top-k kernel at the default budget and with the whole
logits, causal and packed8 at every length and a context-parallel shard (16k queries, 128k
keys): ``indexer_lightning.csv`` / ``.png``. ``--fused-sweep`` times the fused kernel against
the two passes per head count (16k and 64k causal).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from functools import partial
from pathlib import Path

import torch
from dsa_indexer import IndexerConfig, causal_ranges, reference, resolve_config
from dsa_indexer._triton.logits import indexer_logits_into
from dsa_indexer._triton.topk_scores import (
    indexer_topk_scores_backward_triton,
    indexer_topk_scores_triton,
)
from kernel_common import Lookup
from kernel_common.testing import rel_diff

from dsa_bench import common

PEAK_TFLOPS = 812.0
HBM_TBPS = 4.26
FWD_BAR_TFLOPS = 400.0
BWD_BAR_X_FLOOR = 3.0
HEADS, DIM, TOPK = 32, 128, 2048
TOKENS = (4096, 16384, 65536, 131072)
LAYOUTS = {"causal": 1, "packed8": 8}


def table_config(heads: int) -> Lookup[IndexerConfig]:
    """The config the indexer ops pick on this GPU for ``heads`` query heads (the table row)."""
    return resolve_config(torch.empty(1, heads, DIM, device="cuda", dtype=torch.bfloat16))


def make_inputs(t, heads, d, n_seq, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(t, heads, d, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(t, d, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(t, heads, device=device, generator=g) / heads**0.5
    cu = torch.arange(0, t + 1, t // n_seq, device=device, dtype=torch.int32)
    starts, ends = causal_ranges(cu, t)
    return q, k, w, starts, ends, g


def stratified_indices(starts, ends, topk, g):
    """int32 [T, topk]: one random key per 1/topk-th of each window, -1 where it is too short.

    Stratum j of a window of length L >= topk is ``[start + j*L//topk, start + (j+1)*L//topk)``,
    at least one key wide, so the picks are distinct and ascending.
    """
    length = (ends - starts).long()[:, None]
    first = starts.long()[:, None]
    j = torch.arange(topk, device=starts.device)
    lo = first + j * length // topk
    width = first + (j + 1) * length // topk - lo
    u = torch.rand(starts.shape[0], topk, device=starts.device, generator=g)
    pick = lo + (u * width).long().clamp(max=width - 1)
    # A window shorter than topk: all of its keys, then -1.
    idx = torch.where(length >= topk, pick, torch.where(j < length, first + j, -1))
    return idx.to(torch.int32)


def check(name, actual, expected, bar=1e-5):
    a, e = actual.double(), expected.double()
    if not torch.equal(torch.isinf(a), torch.isinf(e)) or bool(torch.isnan(a).any()):
        raise AssertionError(f"{name}: non-finite pattern differs from the reference")
    finite = torch.isfinite(e)
    rd = rel_diff(a[finite], e[finite])
    if rd > bar:
        raise AssertionError(f"{name}: rel_diff {rd:.3e} > {bar:.0e}")
    return rd


def bwd_floor_ms(t, t_kv, heads, d, topk):
    gathered = t * topk * d * 2
    q_bytes = t * heads * d * 2
    outputs = t * heads * d * 2 + t_kv * d * 2 + t * heads * 4
    return (gathered + q_bytes + outputs) / (HBM_TBPS * 1e12) * 1e3


def reps(t):
    return {"warmup": 2, "rep": 5} if t >= 65536 else {"warmup": 3, "rep": 10}


def run_case(layout, t, config, rows):
    n_seq = LAYOUTS[layout]
    q, k, w, starts, ends, g = make_inputs(t, HEADS, DIM, n_seq)
    pairs = int((ends - starts).clamp(min=0).sum())
    flops = 2.0 * HEADS * DIM * pairs
    logits = torch.empty(t, t, dtype=torch.float32, device=q.device)
    row = {"layout": layout, "T": t, "pairs": pairs}

    if t == TOKENS[0]:
        indexer_logits_into(logits, q, k, w, starts, ends, True, config=config)
        ref = reference.indexer_logits_reference(q, k, w, starts, ends)
        row["fwd_rel_diff"] = check("logits", logits, ref)
        del ref

    fwd = common.time_ms(
        partial(indexer_logits_into, logits, q, k, w, starts, ends, False, config=config), **reps(t)
    )
    fwd_clean = common.time_ms(
        partial(indexer_logits_into, logits, q, k, w, starts, ends, True, config=config), **reps(t)
    )
    del logits
    gc.collect()
    torch.cuda.empty_cache()

    indices = stratified_indices(starts, ends, TOPK, g)
    grad = torch.randn(indices.shape, device=q.device, generator=g)
    if t == TOKENS[0]:
        scores = indexer_topk_scores_triton(q, k, w, indices, config=config)
        row["scores_rel_diff"] = check(
            "scores", scores, reference.indexer_topk_scores_reference(q, k, w, indices)
        )
        got = indexer_topk_scores_backward_triton(grad, q, k, w, indices, config=config)
        want = reference.indexer_topk_scores_backward_reference(grad, q, k, w, indices)
        row["bwd_rel_diff"] = max(
            check(n, a, b) for n, a, b in zip(("dq", "dk", "dweights"), got, want, strict=True)
        )
    bwd = common.time_ms(
        partial(indexer_topk_scores_backward_triton, grad, q, k, w, indices, config=config),
        **reps(t),
    )
    floor = bwd_floor_ms(t, t, HEADS, DIM, TOPK)
    row.update(
        fwd_ms=fwd,
        fwd_tflops=flops / fwd / 1e9,
        fwd_frac_peak=flops / fwd / 1e9 / PEAK_TFLOPS,
        fwd_clean_ms=fwd_clean,
        fwd_clean_tflops=flops / fwd_clean / 1e9,
        bwd_ms=bwd,
        bwd_floor_ms=floor,
        bwd_x_floor=bwd / floor,
    )
    if t == TOKENS[0]:
        row["ref_fwd_ms"] = common.time_ms(
            partial(reference.indexer_logits_reference, q, k, w, starts, ends), warmup=1, rep=3
        )
        row["ref_bwd_ms"] = common.time_ms(
            partial(reference.indexer_topk_scores_backward_reference, grad, q, k, w, indices),
            warmup=1,
            rep=3,
        )
    rows.append(row)
    del q, k, w, starts, ends, indices, grad
    gc.collect()
    torch.cuda.empty_cache()


COLUMNS = [
    common.Column("layout"),
    common.Column("T"),
    common.Column("fwd_ms", fmt="{:.3f}"),
    common.Column("fwd_tflops", fmt="{:.0f}"),
    common.Column("fwd_frac_peak", fmt="{:.2f}"),
    common.Column("fwd_clean_ms", fmt="{:.3f}"),
    common.Column("bwd_ms", fmt="{:.3f}"),
    common.Column("bwd_floor_ms", fmt="{:.3f}"),
    common.Column("bwd_x_floor", fmt="{:.2f}"),
    common.Column("ref_fwd_ms", fmt="{:.1f}"),
    common.Column("ref_bwd_ms", fmt="{:.1f}"),
]


def plot(rows, path: Path) -> Path:
    plt = common.pyplot()
    fig, (ax_f, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for layout in LAYOUTS:
        rs = [r for r in rows if r["layout"] == layout]
        ts = [r["T"] for r in rs]
        ax_f.plot(ts, [r["fwd_tflops"] for r in rs], "o-", label=f"{layout}, clean=False")
        ax_f.plot(ts, [r["fwd_clean_tflops"] for r in rs], "x--", label=f"{layout}, clean=True")
        ax_b.plot(ts, [r["bwd_x_floor"] for r in rs], "o-", label=layout)
    ax_f.axhline(FWD_BAR_TFLOPS, color="gray", ls=":", label="bar 400")
    ax_f.axhline(PEAK_TFLOPS, color="black", ls=":", label="bf16 peak 812")
    ax_f.set(xscale="log", xlabel="tokens", ylabel="TFLOP/s (in-range pairs)", ylim=(0, 900))
    ax_f.set_title(f"indexer logits, H={HEADS} D={DIM}")
    ax_b.axhline(BWD_BAR_X_FLOOR, color="gray", ls=":", label="bar 3x")
    ax_b.set(xscale="log", xlabel="tokens", ylabel="time / memory floor", ylim=(0, None))
    ax_b.set_title(f"top-k scores backward, topk={TOPK}")
    for ax in (ax_f, ax_b):
        ax.set_xticks(TOKENS, [f"{t // 1024}k" for t in TOKENS])
        ax.minorticks_off()
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return common.save_figure(fig, path, dpi=120)


# Candidate tilings for --sweep (configs that do not fit a GPU fail to launch and are skipped).
LOGITS_CANDIDATES = [
    (128, 64, 4, 2),
    (128, 128, 8, 2),
    (128, 128, 4, 3),
    (256, 64, 4, 2),
    (256, 64, 4, 3),
    (256, 128, 8, 2),
    (256, 128, 8, 3),
]
BACKWARD_CANDIDATES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2)]
SCORES_CANDIDATES = [(32, 4, 3), (64, 4, 3), (64, 8, 2), (128, 8, 3)]


def _best(label, candidates, fields, base, fn):
    """Time ``fn(config)`` for each candidate (values of ``fields`` over ``base``): the fastest."""
    best = None
    for cand in candidates:
        cfg = dataclasses.replace(base, **dict(zip(fields, cand, strict=True)))
        try:
            ms = common.time_ms(partial(fn, config=cfg), warmup=2, rep=5)
        except Exception as e:  # resource limits of this GPU: report and move on
            print(f"  {label} {cand}: skipped ({type(e).__name__}: {str(e)[:80]})")
            continue
        print(f"  {label} {cand}: {ms:.3f} ms")
        if best is None or ms < best[1]:
            best = (cand, ms)
    return best


LOGITS_FIELDS = ("logits_block_rows", "logits_block_n", "logits_num_warps", "logits_num_stages")
SCORES_FIELDS = ("scores_block_k", "scores_num_warps", "scores_num_stages")
BACKWARD_FIELDS = ("backward_block_k", "backward_num_warps", "backward_num_stages")


def sweep(t=16384):
    for heads in (8, 16, 32, 64):
        base = table_config(heads).config
        q, k, w, starts, ends, g = make_inputs(t, heads, DIM, 1)
        logits = torch.empty(t, t, dtype=torch.float32, device="cuda")
        indices = stratified_indices(starts, ends, TOPK, g)
        grad = torch.randn(indices.shape, device="cuda", generator=g)
        print(f"heads={heads}, T={t}, causal:")
        best = [
            _best(
                "logits (rows, block_n, warps, stages)",
                LOGITS_CANDIDATES,
                LOGITS_FIELDS,
                base,
                partial(indexer_logits_into, logits, q, k, w, starts, ends, False),
            ),
            _best(
                "scores (block_k, warps, stages)",
                SCORES_CANDIDATES,
                SCORES_FIELDS,
                base,
                partial(indexer_topk_scores_triton, q, k, w, indices),
            ),
            _best(
                "backward (block_k, warps, stages)",
                BACKWARD_CANDIDATES,
                BACKWARD_FIELDS,
                base,
                partial(indexer_topk_scores_backward_triton, grad, q, k, w, indices),
            ),
        ]
        if all(best):
            values = {}
            for fields, (cand, _) in zip(
                (LOGITS_FIELDS, SCORES_FIELDS, BACKWARD_FIELDS), best, strict=True
            ):
                values.update(zip(fields, cand, strict=True))
            print(f"  best for heads={heads}: {dataclasses.replace(base, **values)}")
        del q, k, w, starts, ends, logits, indices, grad
        gc.collect()
        torch.cuda.empty_cache()


# --backward-sweep: the backward's knobs over the table row's tiling, on these cases.
BACKWARD_SWEEP_CASES = (("causal", 16384), ("packed8", 16384), ("causal", 4096))
BACKWARD_SWEEP_KNOBS = ("backward_num_stages", "backward_rotate", "backward_dk_split")
BACKWARD_SWEEP_VALUES = [
    (stages, rotate, split) for stages in (2, 3) for rotate in (False, True) for split in (1, 2)
]


def _backward_case(layout, t, heads):
    """``(fn, floor_ms)``: the backward on one benchmark case, ``fn(config=...)``."""
    q, k, w, starts, ends, g = make_inputs(t, heads, DIM, LAYOUTS[layout])
    indices = stratified_indices(starts, ends, TOPK, g)
    grad = torch.randn(indices.shape, device="cuda", generator=g)
    fn = partial(indexer_topk_scores_backward_triton, grad, q, k, w, indices)
    return fn, bwd_floor_ms(t, t, heads, DIM, TOPK)


def backward_sweep():
    """Time the top-k scores backward (whole wrapper) per head count over the knob values of
    ``BACKWARD_SWEEP_VALUES`` on the table row's block_k and warps, on each case of
    ``BACKWARD_SWEEP_CASES``; print a table (ms and x floor) and the best candidate per head
    count by the geometric mean of its times over the cases. Each candidate compiles once (the
    cases share its specialisation); a few reps each keep the sweep to ~1-2 minutes."""
    start = time.time()
    case_names = [f"{layout} {t // 1024}k" for layout, t in BACKWARD_SWEEP_CASES]
    for heads in (8, 16, 32, 64):
        base = table_config(heads).config
        cases = [_backward_case(layout, t, heads) for layout, t in BACKWARD_SWEEP_CASES]
        print(
            f"\nheads={heads}: block_k {base.backward_block_k}, warps {base.backward_num_warps}"
            f" (table row: stages {base.backward_num_stages}, rotate {base.backward_rotate},"
            f" dk_split {base.backward_dk_split}); ms (x floor)"
        )
        print(f"  {'stages rotate split':>19s}  " + "  ".join(f"{n:>15s}" for n in case_names))
        best = None
        for values in BACKWARD_SWEEP_VALUES:
            cfg = dataclasses.replace(base, **dict(zip(BACKWARD_SWEEP_KNOBS, values, strict=True)))
            label = f"{values[0]:6d} {values[1]!s:>6s} {values[2]:5d}"
            try:
                ms = [common.time_ms(partial(fn, config=cfg), warmup=2, rep=5) for fn, _ in cases]
            except Exception as e:  # resource limits of this GPU: report and move on
                print(f"  {label}  skipped ({type(e).__name__}: {str(e)[:80]})")
                continue
            cells = [f"{m:7.3f} ({m / f:4.2f}x)" for m, (_, f) in zip(ms, cases, strict=True)]
            geo = math.prod(ms) ** (1 / len(ms))
            print(f"  {label}  " + "  ".join(cells), flush=True)
            if best is None or geo < best[1]:
                best = (values, geo)
        if best is not None:
            knobs = ", ".join(
                f"{n}={v}" for n, v in zip(BACKWARD_SWEEP_KNOBS, best[0], strict=True)
            )
            print(f"  best for heads={heads}: {knobs} (geomean {best[1]:.3f} ms)")
        del cases
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\nbackward sweep took {time.time() - start:.0f} s")


# --window-sweep: (heads, layout, T) cases and the backward_key_window values timed on each.
WINDOW_SWEEP_CASES = (
    (32, "causal", 131072),
    (32, "packed8", 131072),
    (32, "causal", 65536),
    (8, "causal", 131072),
    (64, "causal", 131072),
)
WINDOW_SWEEP_VALUES = (0, 65536, 32768)


def window_sweep():
    """Time the backward (whole wrapper, the table row otherwise) with each window of
    ``WINDOW_SWEEP_VALUES`` (0: one pass) shorter than T, on each case of
    ``WINDOW_SWEEP_CASES``, and check the passes' gradients against the one-pass ones."""
    for heads, layout, t in WINDOW_SWEEP_CASES:
        base = table_config(heads).config
        fn, floor = _backward_case(layout, t, heads)
        one_pass = None
        for window in (w for w in WINDOW_SWEEP_VALUES if w < t):
            cfg = dataclasses.replace(base, backward_key_window=window)
            grads = fn(config=cfg)
            one_pass = one_pass or grads
            rd = max(rel_diff(a.double(), b.double()) for a, b in zip(grads, one_pass, strict=True))
            ms = common.time_ms(partial(fn, config=cfg), warmup=2, rep=5)
            print(
                f"heads={heads:2d} {layout:7s} T={t:6d} stages={cfg.backward_num_stages}"
                f" window={window:6d}: {ms:7.2f} ms ({ms / floor:.2f}x floor),"
                f" rel_diff vs one pass {rd:.1e}",
                flush=True,
            )
        del fn, one_pass
        gc.collect()
        torch.cuda.empty_cache()


LIGHTNING_COLUMNS = [
    common.Column("layout"),
    common.Column("T"),
    common.Column("T_kv"),
    common.Column("path"),
    common.Column("block_rows"),
    common.Column("fwd_ms", fmt="{:.2f}"),
    common.Column("fwd_bwd_ms", fmt="{:.2f}"),
    common.Column("logits_tflops", fmt="{:.0f}"),
    common.Column("block_gib", fmt="{:.2f}"),
    common.Column("fwd_peak_gib", fmt="{:.2f}"),
    common.Column("work_gib", fmt="{:.2f}"),
    common.Column("peak_extra_gib", fmt="{:.2f}"),
    common.Column("same_indices"),
]

# (name, lightning_fused, fused_max_registers, budget: None = the default, 0 = the whole
# logits) of --lightning; "whole" only where the default budget splits the input.
LIGHTNING_PATHS = (
    ("two-pass", False, 0, None),
    ("fused", True, 0, None),
    ("fused-r168", True, 168, None),
    ("whole", False, 0, 0),
)


def _lightning_cases():
    """(layout, T, T_kv, cu_seqlens length, query_offset): causal and packed8 at every length,
    and a context-parallel shard: the last 16k queries of one 128k sequence against its keys."""
    cases = [(layout, t, t, t, 0) for t in TOKENS for layout in LAYOUTS]
    cases.append(("cp_shard", 16384, 131072, 131072, 131072 - 16384))
    return cases


def _memory(forward, grad, leaves) -> tuple[int, int]:
    """Peak bytes above the inputs during the forward, and over the forward+backward (which
    also holds the outputs, the upstream gradient and the input gradients)."""
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    scores, _indices = forward()
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    torch.autograd.backward(scores, torch.where(torch.isfinite(scores), grad, 0.0))
    torch.cuda.synchronize()
    for x in leaves:
        x.grad = None
    return fwd_peak, torch.cuda.max_memory_allocated() - base


def _selection_work(inputs, block_rows, cfg) -> int:
    """Peak bytes above the inputs while the indices are selected (the op before the scores),
    less the indices themselves: the working memory (logits blocks or candidate lists, and the
    top-k scratch)."""
    from dsa_indexer._ops import _lightning_indices_op
    from kernel_common import config_fields

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        indices = _lightning_indices_op(*inputs, TOPK, block_rows, *config_fields(cfg))
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - indices.untyped_storage().nbytes()


def _lightning_inputs(layout, t, t_kv, seq_len, offset, heads=HEADS):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, heads, DIM, device="cuda", generator=g).bfloat16().requires_grad_()
    k = torch.randn(t_kv, DIM, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(t, heads, device="cuda", generator=g) / heads**0.5).requires_grad_()
    n_seq = LAYOUTS.get(layout, 1)
    cu = torch.arange(0, seq_len + 1, seq_len // n_seq, device="cuda", dtype=torch.int32)
    starts, ends = causal_ranges(cu, t, query_offset=offset)
    return q, k, w, starts, ends, g


def _lightning_case(layout, t, t_kv, seq_len, offset, rows):
    from dsa_indexer import lightning_indexer
    from dsa_indexer._ops import DEFAULT_LOGITS_BUDGET, _block_rows, _fused_slots, _row_bytes

    q, k, w, starts, ends, g = _lightning_inputs(layout, t, t_kv, seq_len, offset)
    pairs = int((ends - starts).clamp(min=0).sum())
    grad = torch.randn(t, TOPK, device="cuda", generator=g)
    table = table_config(HEADS).config
    picked = None
    for name, fused, regs, budget in LIGHTNING_PATHS:
        cfg = dataclasses.replace(table, lightning_fused=fused, fused_max_registers=regs)
        slots = _fused_slots(cfg, TOPK, t_kv)
        budget = DEFAULT_LOGITS_BUDGET if budget is None else budget or 4 * t * t_kv
        block_rows = min(t, _block_rows("bench", t, t_kv, slots, budget))
        if name == "whole" and t <= _block_rows("bench", t, t_kv, 0, DEFAULT_LOGITS_BUDGET):
            continue  # the default budget already holds the whole logits

        def forward(budget=budget, cfg=cfg):
            return lightning_indexer(
                q, k, w, starts, ends, TOPK, logits_budget_bytes=budget, config=cfg
            )

        def forward_backward(forward=forward):
            scores, _ = forward()
            torch.autograd.backward(scores, torch.where(torch.isfinite(scores), grad, 0.0))
            q.grad = k.grad = w.grad = None

        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        fwd_peak, peak = _memory(forward, grad, (q, k, w))
        work = _selection_work((q, k, w, starts, ends), block_rows, cfg)
        with torch.no_grad():
            indices = forward()[1]
        fwd = common.time_ms(forward, **reps(t))
        fb = common.time_ms(forward_backward, **reps(t))
        row = {
            "layout": layout,
            "T": t,
            "T_kv": t_kv,
            "path": name,
            "block_rows": block_rows,
            "fwd_ms": fwd,
            "fwd_bwd_ms": fb,
            "logits_tflops": 2.0 * HEADS * DIM * pairs / fwd / 1e9,
            "block_gib": block_rows * _row_bytes(t_kv, slots)[0] / 2**30,
            "fwd_peak_gib": fwd_peak / 2**30,
            "work_gib": work / 2**30,
            "peak_extra_gib": peak / 2**30,
        }
        if picked is None:
            picked = indices
        else:
            row["same_indices"] = bool(torch.equal(picked, indices))
        del indices
        rows.append(row)
        print(common.named(row, [c.key for c in LIGHTNING_COLUMNS]), flush=True)


def lightning(out: Path):
    """``lightning_indexer`` forward and forward+backward (topk 2048, the 32-head table row) on
    each path (``LIGHTNING_PATHS``): the two passes (logits blocks, then ``ranged_topk``) and the
    fused logits -> top-k kernel (with and without a register cap) at the default 1 GiB budget,
    and the two passes over the whole logits (as before the budget existed). Time, logits
    TFLOP/s over in-range pairs, and memory: the block's rows and bytes (``block_rows`` /
    ``block_gib``; past one block they run as two half blocks on two streams), the working
    memory of the selection (``work_gib``, :func:`_selection_work`), the forward's peak above
    the inputs (it includes the outputs: scores and indices are 2 GiB at 128k) and the peak over
    forward+backward (:func:`_memory`; it also holds the upstream gradient and dq, 1 GiB each
    at 128k). Every path's indices are checked equal to
    the first's."""
    rows = []
    for case in _lightning_cases():
        _lightning_case(*case, rows)
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\nwrote {common.write_csv(rows, out / 'indexer_lightning.csv')}")
    try:
        labels = [f"{r['layout']}\n{r['T'] // 1024}k {r['path']}" for r in rows]
        path = common.bar_plot(
            out / "indexer_lightning.png",
            labels,
            [
                ("fwd ms", [r["fwd_ms"] for r in rows]),
                ("fwd+bwd ms", [r["fwd_bwd_ms"] for r in rows]),
                ("working memory GiB", [r["work_gib"] for r in rows]),
            ],
            ylabel="ms / GiB",
            title="lightning_indexer (32 heads x 128, topk 2048): two passes vs fused",
            figsize=(max(8, len(rows) * 0.55), 4.5),
            label_fontsize=6,
        )
        print(f"wrote {path}")
    except ImportError:
        print("matplotlib missing: no PNG")
    print("bars: extra <= 2 GiB at 128k, <= 1.5 GiB at 64k; fwd+bwd no slower than before;")
    print("      fused forward <= 0.7x the two passes at 64k / 128k, >= 400 logits TFLOP/s")
    common.print_table(rows, LIGHTNING_COLUMNS)


FUSED_SWEEP_COLUMNS = [
    common.Column("heads"),
    common.Column("T"),
    common.Column("path"),
    common.Column("indices_ms", fmt="{:.2f}"),
    common.Column("x_two_pass", fmt="{:.3f}"),
    common.Column("same_indices"),
]


def _fused_sweep_case(heads, t, rows):
    from dsa_indexer import lightning_indexer

    table = table_config(heads).config
    q, k, w, starts, ends, _g = _lightning_inputs("causal", t, t, t, 0, heads)
    base = None
    for name, fused, regs, _budget in LIGHTNING_PATHS[:3]:
        cfg = dataclasses.replace(table, lightning_fused=fused, fused_max_registers=regs)

        def forward(cfg=cfg):
            with torch.no_grad():
                return lightning_indexer(q, k, w, starts, ends, TOPK, config=cfg)[1]

        indices = forward()
        ms = common.time_ms(forward, **reps(t))
        if base is None:
            base = (ms, indices)
        row = {
            "heads": heads,
            "T": t,
            "path": name,
            "indices_ms": ms,
            "x_two_pass": ms / base[0],
            "same_indices": bool(torch.equal(indices, base[1])),
        }
        rows.append(row)
        print(common.named(row, [c.key for c in FUSED_SWEEP_COLUMNS]), flush=True)


def fused_sweep(out: Path):
    """Per head count's table row, causal 16k and 64k, topk 2048: the forward's indices
    (``lightning_indexer`` under no_grad, scores included) on the two passes and on the fused
    kernel with and without a register cap, each against the two passes. Writes
    ``indexer_fused_sweep.csv`` and ``.png``."""
    rows = []
    for heads in (8, 16, 32, 64):
        for t in (16384, 65536):
            _fused_sweep_case(heads, t, rows)
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\nwrote {common.write_csv(rows, out / 'indexer_fused_sweep.csv')}")
    try:
        print(f"wrote {plot_fused_sweep(rows, out / 'indexer_fused_sweep.png')}")
    except ImportError:
        print("matplotlib missing: no PNG")
    common.print_table(rows, FUSED_SWEEP_COLUMNS)


def plot_fused_sweep(rows, path: Path) -> Path:
    """Each path's time relative to the two passes, per head count and length."""
    labels = [f"{r['heads']}h {int(r['T']) // 1024}k {r['path']}" for r in rows]
    return common.bar_plot(
        path,
        labels,
        [("x two passes", [float(r["x_two_pass"]) for r in rows])],
        ylabel="time / two passes",
        title="lightning_indexer forward (topk 2048): fused logits -> top-k vs two passes",
        figsize=(max(8, len(rows) * 0.45), 4.5),
        label_fontsize=6,
    )


def main(argv=None):
    parser = common.ArgumentParser(
        prog="python -m dsa_bench.indexer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=common.RESULTS_DIR,
        help="folder of indexer.csv and indexer.png (default: benchmarks/results)",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--sweep", action="store_true", help="time candidate tilings instead")
    modes.add_argument(
        "--backward-sweep",
        action="store_true",
        help="time the backward's knob values per head count instead",
    )
    modes.add_argument(
        "--window-sweep",
        action="store_true",
        help="time the backward in one pass and in key windows on long inputs instead",
    )
    modes.add_argument(
        "--lightning",
        action="store_true",
        help="time lightning_indexer (bounded logits budget vs whole logits) and its memory",
    )
    modes.add_argument(
        "--fused-sweep",
        action="store_true",
        help="time the fused logits -> top-k kernel against the two passes per head count",
    )
    modes.add_argument(
        "--plot", type=Path, metavar="CSV", help="only redraw indexer.png from a results CSV"
    )
    args = parser.parse_args(argv)
    if args.plot:
        common.require_matplotlib(parser, "--plot")
        print(f"wrote {plot(common.read_csv(args.plot), args.out / 'indexer.png')}")
        return
    common.require_cuda("dsa_bench.indexer", " (or --plot CSV)")
    if args.sweep:
        sweep()
        return
    if args.backward_sweep:
        backward_sweep()
        return
    if args.window_sweep:
        window_sweep()
        return
    if args.lightning:
        lightning(args.out)
        return
    if args.fused_sweep:
        fused_sweep(args.out)
        return
    lookup = table_config(HEADS)
    print(f"{torch.cuda.get_device_name()}: config {lookup.describe()}: {lookup.config}")
    rows = []
    start = time.time()
    for t in TOKENS:
        for layout in LAYOUTS:
            run_case(layout, t, lookup.config, rows)
            r = rows[-1]
            print(
                f"{layout:8s} T={t:6d}: fwd {r['fwd_ms']:.3f} ms ({r['fwd_tflops']:.0f} TFLOP/s),"
                f" bwd {r['bwd_ms']:.3f} ms ({r['bwd_x_floor']:.2f}x floor)"
                f"  [{time.time() - start:.0f} s]",
                flush=True,
            )
    print(f"\nwrote {common.write_csv(rows, args.out / 'indexer.csv')}")
    try:
        print(f"wrote {plot(rows, args.out / 'indexer.png')}")
    except ImportError:  # a GPU host without matplotlib: draw it later with --plot
        print("matplotlib missing: redraw the PNG elsewhere with --plot indexer.csv")
    print(f"bars: forward >= {FWD_BAR_TFLOPS:.0f} TFLOP/s from 16k on; backward <= 3x floor\n")
    common.print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
