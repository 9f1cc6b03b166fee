"""GPU arch detection: lazy, cached per device, overridable for tests and compile-only runs."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

import torch

ARCH_ENV = "KERNEL_COMMON_ARCH"
"""Environment override (``sm_90``, ``sm_100``, ``gfx942``, ``cpu``): pretend to be that arch."""

_VENDORS = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class Arch:
    """A device architecture: vendor (``cuda``, ``rocm`` or ``cpu``) and compute capability."""

    vendor: str
    major: int = 0
    minor: int = 0
    # Derived fields, set from the three above, not properties: torch.compile traces the public
    # entries' reads of them on the constant that `device_arch` returns, and Dynamo (torch 2.11)
    # reads a field of such a constant but fails on a property ("GetAttrVariable").
    sm: str = field(init=False, repr=False, compare=False)
    """``sm_90`` for CUDA 9.0, ``gfx942`` style for ROCm, ``cpu`` for the CPU."""
    is_hopper: bool = field(init=False, repr=False, compare=False)
    is_blackwell: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.vendor not in _VENDORS:
            raise ValueError(f"Arch.vendor must be one of {_VENDORS}, got {self.vendor!r}")
        if self.vendor == "cuda":
            sm = f"sm_{self.major}{self.minor}"
        elif self.vendor == "rocm":
            sm = f"gfx{self.major}{self.minor:x}"
        else:
            sm = "cpu"
        object.__setattr__(self, "sm", sm)
        object.__setattr__(self, "is_hopper", self.vendor == "cuda" and self.major == 9)
        object.__setattr__(self, "is_blackwell", self.vendor == "cuda" and self.major == 10)


CPU = Arch("cpu")


def parse_arch(text: str) -> Arch:
    """Parse ``sm_90`` / ``sm_90a`` / ``sm_100`` / ``gfx942`` / ``cpu`` into an :class:`Arch`."""
    name = text.strip().lower()
    if name == "cpu":
        return CPU
    m = re.fullmatch(r"sm_?(\d+)(\d)a?", name)
    if m:
        return Arch("cuda", int(m.group(1)), int(m.group(2)))
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])", name)
    if m:
        return Arch("rocm", int(m.group(1)), int(m.group(2), 16))
    raise ValueError(
        f"{ARCH_ENV}={text!r} is not an arch name; expected e.g. 'sm_90', 'sm_100', 'gfx942', 'cpu'"
    )


# torch.compile treats the answer as a constant of the traced graph: the public entries pick their
# config from it while being traced, and tracing the regex and device queries inside would break
# the graph. (A compiled graph keeps the arch it was traced with, as the device cannot change.)
@torch.compiler.assume_constant_result
def device_arch(device: torch.device | str | int | None = None) -> Arch:
    """The arch of ``device`` (default: the current CUDA device, else the CPU).

    Queried on first use and cached per device, never at import. ``KERNEL_COMMON_ARCH`` overrides
    the answer for every device (tests and compile-only runs use it to pretend to be an arch).
    """
    override = os.environ.get(ARCH_ENV)
    if override:
        return parse_arch(override)
    if device is None:
        if not torch.cuda.is_available():
            return CPU
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _query_cuda(index)


@functools.cache
def _query_cuda(index: int) -> Arch:
    major, minor = torch.cuda.get_device_capability(index)
    vendor = "rocm" if torch.version.hip else "cuda"
    return Arch(vendor, major, minor)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (cached per device: launchers that size
    their grids by it ask on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _query_sm_count(index)


@functools.cache
def _query_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# A constant of a traced graph, as device_arch: entries check a launch against it while traced.
@torch.compiler.assume_constant_result
def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one thread block of the CUDA ``device`` may opt into (227 KiB on
    Hopper and Blackwell B200, 99 KiB on sm_89 / sm_120; cached per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _query_shared_memory(index)


@functools.cache
def _query_shared_memory(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def tilelang_target(arch: Arch) -> dict[str, str]:
    """The TileLang compile target for ``arch``.

    Hopper and Blackwell get their arch-specific targets (``sm_90a``, ``sm_100a``, ...), which
    unlock wgmma / tcgen05 and the tensor-memory-accelerator paths; other CUDA archs the plain one.
    """
    if arch.vendor != "cuda":
        raise ValueError(f"TileLang kernels here target CUDA; got arch {arch.sm!r}")
    suffix = "a" if arch.major in (9, 10) else ""
    return {"kind": "cuda", "arch": f"{arch.sm}{suffix}"}
