"""Test helpers: the precision metric of DESIGN.md, a reporting assert, output poisoning."""

from __future__ import annotations

import torch


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``1 - 2*sum(a*b) / (sum(a*a) + sum(b*b))`` in float64; 0 for identical tensors.

    Non-finite entries must be compared separately (see :func:`assert_close`); two all-zero
    tensors are identical (0).
    """
    a64 = a.detach().to(torch.float64)
    b64 = b.detach().to(torch.float64)
    if a64.shape != b64.shape:
        raise ValueError(f"rel_diff: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    denom = (a64 * a64).sum() + (b64 * b64).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (a64 * b64).sum() / denom)


def _nonfinite(t: torch.Tensor) -> str:
    if not t.is_floating_point():
        return "integer"
    nan, pinf, ninf = (int(f(t).sum()) for f in (torch.isnan, torch.isposinf, torch.isneginf))
    return f"nan={nan} +inf={pinf} -inf={ninf}"


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    max_rel_diff: float = 1e-5,
    name: str = "tensor",
) -> None:
    """Assert ``rel_diff(actual, expected) <= max_rel_diff`` and identical non-finite patterns.

    On failure the message gives the metric, the largest absolute error and where it is, and the
    NaN / inf counts of both sides, so a kernel bug shows its shape in the first failing run.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    same_pattern = torch.equal(torch.isnan(a), torch.isnan(e)) and torch.equal(
        torch.where(torch.isinf(a), a, 0), torch.where(torch.isinf(e), e, 0)
    )
    finite = torch.isfinite(a) & torch.isfinite(e)
    af, ef = torch.where(finite, a, 0), torch.where(finite, e, 0)
    rd = rel_diff(af, ef)
    if same_pattern and rd <= max_rel_diff:
        return
    err = (af - ef).abs()
    flat = int(err.argmax()) if err.numel() else 0
    where = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        if err.numel()
        else ()
    )
    raise AssertionError(
        f"{name}: rel_diff {rd:.3e} (bar {max_rel_diff:.1e}); max abs error "
        f"{float(err.max()) if err.numel() else 0.0:.4e} at {where} "
        f"(actual {float(af[where]) if err.numel() else 0.0:.6g}, expected "
        f"{float(ef[where]) if err.numel() else 0.0:.6g}); non-finite pattern "
        f"{'matches' if same_pattern else 'DIFFERS'}: "
        f"actual {_nonfinite(a)}, expected {_nonfinite(e)}"
    )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel writes (NaN for floats, the minimum for ints)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


def poisoned(shape, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A new tensor filled by :func:`poison_`; unwritten entries show up in any comparison."""
    return poison_(torch.empty(shape, dtype=dtype, device=device))
