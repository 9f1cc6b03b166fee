"""GPU timing: median of CUDA-event timings after warm-up, optionally flushing L2 first, of
eager calls or of CUDA-graph replays."""

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


def cuda_graph_time_ms(fn: Callable[[], object], *, warmup: int = 3, rep: int = 10) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph.

    Events around an eager call also time the host's launch work (Python, allocator, kernel
    launches: tens of microseconds) whenever the GPU waits for it; a replay launches the
    captured kernels back to back, as a graph-captured training step does, so this is the
    device time of ``fn``. ``fn`` must be capturable (no host synchronisation); it runs twice
    on a side stream first so that lazy initialisation stays out of the capture.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_graph_time_ms needs a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_time_ms(graph.replay, warmup=warmup, rep=rep)
