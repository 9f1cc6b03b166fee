"""Host side of the Triton top-k: the launch geometry for a row length and k, and the launch.

:class:`TopkLaunch` is everything the kernel is compiled and launched with; :func:`launch_plan`
derives it from a :class:`topk.TopkConfig` (the measured knobs) and the shape, so that the
sizes that follow from N and k are computed in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from kernel_common import next_pow2, sm_count
from kernel_common.constants import MAX_REGISTERS_PER_THREAD, SM_REGISTERS

from topk._triton.ranged_topk import _ranged_topk_kernel
from topk.config import TopkConfig

# Sampling: rows up to _SHORT_ROW columns sample 1 / _SAMPLE_FRACTION of the row in single
# columns (at least _MIN_SAMPLE); longer rows at most _MAX_SAMPLE columns in runs of _LONG_RUN
# adjacent columns (whole 32-byte sectors: the sample then adds ~1/32 of the row's traffic,
# not a sector per sampled element).
_SAMPLE_FRACTION = 32
_MIN_SAMPLE = 64
_MAX_SAMPLE = 4096
_SHORT_ROW = 16384
_LONG_RUN = 8


@dataclass(frozen=True)
class TopkLaunch:
    """The geometry of one launch of the top-k kernel (all sizes powers of two).

    num_warps: warps per program; each streams its own segment of a row.
    reps: rows of 128 columns per warp and step of the streaming pass (4 * reps per thread,
        at most 4).
    sample: sampled columns per row; run: adjacent columns per sampled run.
    list_size: entries of each warp's candidate list (k plus the bracket, with margin); also
        the register tile of the resolve (``list_size / (32 * num_warps)`` keys per thread).
    chunk: columns per step of the slow exact path.
    programs_per_sm: programs launched per SM (rows are shared out dynamically); the launch
        caps registers so that they fit (65536 per SM).
    prefetch: streaming steps between a tile's L2 prefetch and its load (0: none). Used on
        CUDA only: the interpreter runs no inline PTX.
    """

    num_warps: int
    reps: int
    sample: int
    run: int
    list_size: int
    chunk: int
    programs_per_sm: int
    prefetch: int


def _max_registers(launch: TopkLaunch) -> int:
    """Registers per thread that let ``programs_per_sm`` programs share an SM, at most the
    hardware limit."""
    return min(
        MAX_REGISTERS_PER_THREAD, SM_REGISTERS // (32 * launch.num_warps * launch.programs_per_sm)
    )


def _list_size(n: int, k: int, sample: int) -> int:
    """A list capacity that the bracket of a length-n row overflows with probability ~1e-3.

    The list receives every element >= t_lo, the sample element of rank j_lo (plus the early
    stop's slack); that element's rank in the row is j_lo / f (f = sample / n) with standard
    deviation sqrt(j_lo (1 - j_lo / sample)) / f, and the capacity covers 3 of those. Shorter
    rows sample a larger fraction and stay further below. Rows never hold more than n.
    """
    f = sample / n
    jc = k * f
    sd = math.sqrt(max(jc * (1.0 - min(jc / sample, 1.0)), 0.0))
    j_lo = math.ceil(jc + 3.0 * sd + 2.0) + max(int(0.5 * sd), 1)
    spread = math.sqrt(j_lo * max(1.0 - j_lo / sample, 0.0))
    need = max(k, math.ceil((j_lo + 3.0 * spread) / f))
    return next_pow2(min(n, need))


def launch_plan(config: TopkConfig, n: int, k: int) -> TopkLaunch:
    """The launch geometry for rows of ``n`` columns and ``k`` selected under ``config``.

    The sample is 1/32 of the row (see the module constants), which keeps the candidate list
    near k + k/2 whatever the length; the list is sized by :func:`_list_size`. A list longer
    than ``1024 * config.num_warps`` entries doubles the warps (the resolve then holds at most
    32 keys per thread at the defaults), and the programs per SM follow from
    ``config.warps_per_sm``.
    """
    n_pow2 = next_pow2(max(n, 1))
    sample = min(max(n_pow2 // _SAMPLE_FRACTION, _MIN_SAMPLE), _MAX_SAMPLE)
    list_size = _list_size(max(n, 1), k, sample)
    num_warps = config.num_warps * (2 if list_size > 1024 * config.num_warps else 1)
    return TopkLaunch(
        num_warps=num_warps,
        reps=config.reps,
        sample=sample,
        run=_LONG_RUN if n_pow2 > _SHORT_ROW else 1,
        list_size=max(list_size, 128 * num_warps),
        chunk=512 * num_warps,
        programs_per_sm=max(1, config.warps_per_sm // num_warps),
        prefetch=config.prefetch,
    )


def topk_programs(rows: int, device: torch.device, launch: TopkLaunch) -> int:
    """Programs one launch over ``rows`` rows runs (rows are shared out dynamically): enough to
    fill the GPU at ``launch.programs_per_sm``, never more than the rows."""
    if device.type == "cuda":
        return min(rows, sm_count(device) * launch.programs_per_sm)
    return min(rows, 2)  # the interpreter runs programs one after another


def topk_scratch(rows: int, device: torch.device, launch: TopkLaunch) -> torch.Tensor:
    """The candidate-list scratch of a launch over at most ``rows`` rows (int64
    ``[programs, num_warps, list_size]``); reusable by launches that do not overlap in time."""
    programs = topk_programs(rows, device, launch)
    return torch.empty(
        (programs, launch.num_warps, launch.list_size), dtype=torch.int64, device=device
    )


def ranged_topk_triton(
    scores: torch.Tensor,
    k: int,
    lo: torch.Tensor,
    hi: torch.Tensor,
    launch: TopkLaunch,
) -> torch.Tensor:
    """Exact top-k columns of each row of ``scores`` over ``[lo, hi)``.

    Args:
        scores: ``[R, N]`` float32 / bfloat16 / float16 with ``stride(1) == 1`` (any row stride),
            on CUDA (or on CPU under ``TRITON_INTERPRET=1``). Only columns in a row's range are
            read; bf16 / fp16 are compared after an exact upcast to fp32.
        k: columns per row, ``k >= 1`` (may exceed N).
        lo, hi: int32 ``[R]``, already clipped to ``[0, N]``; a row with ``hi <= lo`` is empty.
        launch: the geometry (:func:`launch_plan`).

    Returns:
        int32 ``[R, k]``: the columns of the k largest in-range values in ascending order, -1
        after them when fewer than k are selectable. NaN and -inf are never selected; ties at
        the k-th value keep the smaller column. No host synchronisation (CUDA-graph safe).
    """
    if scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError("ranged_topk_triton: scores must be [R, N] with unit column stride")
    rows, n = scores.shape
    if rows == 0 or n == 0:
        return torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    out = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    counter = torch.zeros(1, dtype=torch.int32, device=scores.device)
    lists = topk_scratch(rows, scores.device, launch)
    ranged_topk_into(out, scores, lo.contiguous(), hi.contiguous(), launch, lists, counter)
    return out


def ranged_topk_into(
    out: torch.Tensor,
    scores: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    launch: TopkLaunch,
    lists: torch.Tensor,
    counter: torch.Tensor,
) -> None:
    """:func:`ranged_topk_triton` into a contiguous int32 ``[R, k]`` ``out``, with the caller's
    scratch: ``lists`` from :func:`topk_scratch` for at least ``R`` rows and ``counter`` one
    int32 that is 0 (the launch leaves it at R + programs). For callers that launch many times
    (one query block after another) and so keep allocations and small launches off the host's
    path. The caller guarantees what the op would check: ``scores`` ``[R, N]`` with unit column
    stride and R, N >= 1; ``lo``, ``hi`` contiguous int32 ``[R]`` already clipped to
    ``[0, N]``."""
    rows = scores.shape[0]
    programs = topk_programs(rows, scores.device, launch)
    _ranged_topk_kernel[(programs,)](
        scores,
        scores.stride(0),
        lo,
        hi,
        out,
        lists,
        counter,
        rows,
        out.shape[1],
        CHUNK=launch.chunk,
        SAMPLE=launch.sample,
        RUN=launch.run,
        LIST=launch.list_size,
        REPS=launch.reps,
        TAIL=min(next_pow2(out.shape[1]), 1024),
        WARPS=launch.num_warps,
        PREFETCH=launch.prefetch if scores.device.type == "cuda" else 0,
        num_warps=launch.num_warps,
        maxnreg=_max_registers(launch),
    )
