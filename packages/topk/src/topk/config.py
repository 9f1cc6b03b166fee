"""TopkConfig and the table that picks it per arch; the launch sizes derive from it per call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_common import ConfigTable, KeyField, Lookup, device_arch

BACKENDS = ("triton", "torch")
_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class TopkConfig:
    """How ``ranged_topk`` runs: backend and the measured knobs of the Triton kernel.

    The sizes that depend on the row length N and on k (sample, candidate list, slow-path chunk)
    are derived from these per call (``topk._triton.launch.launch_plan``), so one row serves
    every shape.

    Attributes:
        backend: ``"triton"`` or ``"torch"`` (the reference; always used for CPU tensors).
        num_warps: warps per program; each streams its own segment of a row. A candidate list
            longer than ``1024 * num_warps`` entries (k > 2112) gets more warps, so that the
            resolve holds at most 32 keys per thread.
        warps_per_sm: resident warps per SM that the launch aims for (programs per SM =
            ``warps_per_sm / warps``; registers are capped to fit them).
        reps: rows of 128 columns per warp and step of the streaming pass (1, 2 or 4).
        prefetch: streaming steps between a tile's L2 prefetch and its load (0: none).
    """

    backend: str = "triton"
    num_warps: int = 4
    warps_per_sm: int = 16
    reps: int = 2
    prefetch: int = 3

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"TopkConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_warps not in _WARPS or isinstance(self.num_warps, bool):
            raise ValueError(
                f"TopkConfig.num_warps must be one of {_WARPS}, got {self.num_warps!r}"
            )
        if self.reps not in (1, 2, 4) or isinstance(self.reps, bool):
            raise ValueError(f"TopkConfig.reps must be 1, 2 or 4, got {self.reps!r}")
        w = self.warps_per_sm
        if isinstance(w, bool) or not isinstance(w, int) or w < self.num_warps or w > 64:
            raise ValueError(
                f"TopkConfig.warps_per_sm must be an int in [num_warps={self.num_warps}, 64], "
                f"got {w!r}"
            )
        p = self.prefetch
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"TopkConfig.prefetch must be an int >= 0, got {p!r}")


TORCH_CONFIG = TopkConfig(backend="torch")

# H200 (dsa_bench.topk cases, CUDA-graph timed; benchmarks/NOTES.md, top-k):
# * 4 warps x 4 programs per SM beat 8 warps x 2 on the 4096-row long cases at k = 2048 (0.69 vs
#   0.85 ms at 65536 columns, 1.12 vs 1.24 ms at 131072): more rows are in flight, and the
#   per-row resolve, which does not scale with the row length, overlaps other programs' streams.
# * Prefetching 3 steps ahead (two tiles per loop iteration) was the fastest of 2, 3, 4 and 6 on
#   the long rows at k 2048, by 0.1-4%; 4 ahead had taken 4096 x 65536 from 0.653 to 0.596 ms.
# * 16 warps per SM caps registers at 128 per thread: the tilings compile within that with at
#   most 24 bytes spilled, outside the loops; 512 columns per warp and step (reps=4) spill more.
_HOPPER = TopkConfig()

TOPK_CONFIGS: ConfigTable[TopkConfig] = ConfigTable(
    "topk",
    TopkConfig,
    [KeyField("arch_major")],
    rows=[({"arch_major": 9}, _HOPPER, "measured H200 (dsa_bench.topk, CUDA-graph timed)")],
    default=TopkConfig(),
)


def resolve_config(scores: torch.Tensor, config: TopkConfig | None = None) -> Lookup[TopkConfig]:
    """The config :func:`topk.ranged_topk` runs for ``scores``, and where it came from.

    CPU (any non-CUDA) tensors run the torch reference whatever ``config`` says; on a CUDA
    device it is ``config`` if given, else the table row for the arch major, else the default
    (the H200 values, unmeasured there); ROCm devices run the torch reference.
    """
    if config is not None and not isinstance(config, TopkConfig):
        raise TypeError(f"ranged_topk: config must be a TopkConfig, got {type(config).__name__}")
    if scores.device.type != "cuda":
        return Lookup(TORCH_CONFIG, "cpu tensors: the torch reference", ())
    arch = device_arch(scores.device)
    if arch.vendor != "cuda":
        # The kernel's L2 prefetch is inline PTX: ROCm runs the reference.
        return Lookup(TORCH_CONFIG, f"{arch.sm}: the torch reference", ())
    return TOPK_CONFIGS.lookup(config, arch_major=arch.major)
