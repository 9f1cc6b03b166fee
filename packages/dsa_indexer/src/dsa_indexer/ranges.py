"""Packed causal key ranges for the indexer and the top-k selector (device-side, no host sync)."""

from __future__ import annotations

import torch
from kernel_common import check_int, check_tensor


def causal_ranges(
    cu_seqlens: torch.Tensor,
    total: int,
    *,
    ratio: int = 1,
    query_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-open causal key ranges ``[starts[t], ends[t])`` for ``total`` packed queries.

    Args:
        cu_seqlens: int32 or int64 ``[N + 1]``: cumulative segment lengths of the packed token
            sequence (``cu_seqlens[0] == 0``, non-decreasing, last entry the packed length).
        total: number of queries in this shard (an argument so that nothing is read back to the
            host; ``query_offset + total <= cu_seqlens[-1]``).
        ratio: key compression ratio. Each segment's ``len // ratio`` compressed keys are packed
            back to back; compressed key ``j`` of a segment summarises its tokens
            ``[j*ratio, (j+1)*ratio)`` and is visible from the segment's position
            ``(j+1)*ratio - 1`` on. With ``ratio == 1`` a query sees its segment start up to
            itself.
        query_offset: global packed position of the first query (context parallelism: the query
            shard starts there while keys cover the whole packed sequence).

    Returns:
        ``(starts, ends)``, int32 ``[total]``: the key range of each query, in the (compressed)
        packed key index space. A query that sees no compressed key yet gets an empty range.
    """
    op = "causal_ranges"
    check_tensor(
        op,
        "cu_seqlens",
        cu_seqlens,
        dtypes=(torch.int32, torch.int64),
        shape=[None],
        layout="[N + 1]",
    )
    if cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"causal_ranges: cu_seqlens must have shape [N + 1] with N >= 1, "
            f"got {list(cu_seqlens.shape)}"
        )
    check_int(op, "total", total, minimum=0)
    check_int(op, "ratio", ratio, minimum=1)
    check_int(op, "query_offset", query_offset, minimum=0)
    cu = cu_seqlens.to(torch.int64)
    pos = torch.arange(query_offset, query_offset + total, device=cu.device, dtype=torch.int64)
    seg = (torch.searchsorted(cu, pos, right=True) - 1).clamp(0, cu.shape[0] - 2)
    seg_start = cu[seg]
    kv_cu = torch.nn.functional.pad(torch.cumsum(torch.diff(cu) // ratio, 0), (1, 0))
    starts = kv_cu[seg]
    ends = starts + (pos - seg_start + 1) // ratio
    return starts.to(torch.int32), ends.to(torch.int32)
