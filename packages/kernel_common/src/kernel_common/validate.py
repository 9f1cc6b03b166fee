"""Argument checks for every public entry: each failure names the argument and what was expected."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype],
    shape: Sequence[int | None] | None = None,
    layout: str = "",
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t`` is a tensor of one of ``dtypes`` with ``shape`` (``None`` matches any size).

    ``layout`` names the dimensions for the message (``"[B, S, H, D]"``). Raises ``TypeError`` for a
    non-tensor or wrong dtype and ``ValueError`` for a wrong rank, size or device.
    """
    want = f"{layout} " if layout else ""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a {want}torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(
            f"{op}: {name} must have dtype {names}, got {str(t.dtype).removeprefix('torch.')}"
        )
    if shape is not None:
        bad = t.dim() != len(shape) or any(
            s is not None and t.shape[i] != s for i, s in enumerate(shape)
        )
        if bad:
            expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(
                f"{op}: {name} must have shape {layout or expected} = {expected}, "
                f"got {list(t.shape)}"
            )
    if device is not None and t.device != device:
        raise ValueError(
            f"{op}: {name} is on {t.device}, expected {device} (the device of the inputs)"
        )
    return t


def check_int(op: str, name: str, value: object, *, minimum: int) -> int:
    """Check ``value`` is an int (not a bool) that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
    return value


def check_indices(op: str, name: str, indices: torch.Tensor, bound: int, bound_name: str) -> None:
    """Raise ``ValueError`` if an entry of ``indices`` lies outside ``[-1, bound)``.

    Reads the tensor back to the host, so only the torch references call it: the GPU kernels
    treat such entries as padding instead, with no synchronisation.
    """
    bad = (indices < -1) | (indices >= bound)
    if bool(bad.any()):
        raise ValueError(
            f"{op}: {name} must lie in [-1, {bound_name}={bound}); "
            f"found {int(bad.sum())} entries outside it"
        )
