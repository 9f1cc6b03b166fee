"""Torch reference for :func:`topk.ranged_topk` (pure PyTorch, any device, bounded memory)."""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = (
    1 << 25
)  # rows are processed in chunks of ~32M scores (a few hundred MB of temporaries)


def ranged_topk_reference(
    scores: torch.Tensor, k: int, starts: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Exact ranged top-k of ``scores`` [R, N] over half-open row ranges ``starts``/``ends`` [R].

    Out-of-range columns are masked before anything looks at them, -inf and NaN are never chosen,
    ties keep the smaller column (a stable descending sort), and the chosen columns come back in
    ascending order with a -1 tail. Returns int32 [R, k].
    """
    rows, n = scores.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    if rows == 0 or n == 0:
        return out
    cols = torch.arange(n, device=scores.device)
    chunk = max(1, _CHUNK_ELEMENTS // n)
    take = min(k, n)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        s = scores[r0:r1].to(torch.float32)
        lo = starts[r0:r1, None].to(torch.int64)
        hi = ends[r0:r1, None].to(torch.int64)
        selectable = (cols >= lo) & (cols < hi) & ~torch.isnan(s) & (s != float("-inf"))
        masked = torch.where(selectable, s, float("-inf"))
        values, idx = torch.sort(masked, dim=-1, descending=True, stable=True)
        values, idx = values[:, :take], idx[:, :take]
        # Everything ranked after the last selectable column is -inf; it becomes the -1 tail.
        chosen = torch.where(values != float("-inf"), idx, n)
        chosen = torch.sort(chosen, dim=-1).values
        out[r0:r1, :take] = torch.where(chosen == n, -1, chosen).to(torch.int32)
    return out
