"""GPU timing: median of CUDA-event timings after warm-up, optionally flushing L2 first."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    rep: int = 10,
    flush_l2: bool = False,
    l2_bytes: int = 256 << 20,
) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream, after ``warmup`` calls.

    Each repetition is timed with its own pair of CUDA events. With ``flush_l2`` a buffer larger
    than L2 (60 MB on an H200) is zeroed before each timed call, outside the events, so inputs
    smaller than the cache are read from HBM as they would be in a training step.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_time_ms needs a CUDA device")
    for _ in range(warmup):
        fn()
    flush = torch.empty(l2_bytes, dtype=torch.uint8, device="cuda") if flush_l2 else None
    times = []
    for _ in range(rep):
        if flush is not None:
            flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
