"""SparseAttentionConfig and the measured table keyed by (arch, RoPE tail, TP-local heads)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kernel_common import ConfigTable, KeyField, heads_bucket

FORWARD_BACKENDS = ("tilelang", "flash_mla", "torch")
BACKWARD_BACKENDS = ("tilelang", "torch")
DKV_REDUCE_MODES = ("tma", "atomic")
_INT_FIELDS = (
    "forward_block_i",
    "forward_stages",
    "backward_block_i",
    "backward_stages",
    "split_store",
)


@dataclass(frozen=True)
class SparseAttentionConfig:
    """How sparse attention runs: backends and the kernels' tiling, every field explicit.

    The defaults are the library's own TileLang kernels with a tiling that every head count and
    width fits on Hopper, so ``SparseAttentionConfig(backward_block_i=64)`` changes one field and
    nothing else; to change one field of the measured row instead, use
    ``dataclasses.replace(resolve_config(q, kv).config, ...)``. CPU tensors always run the torch
    reference, whatever the config says. A config the kernels cannot run for the given shapes is
    refused with a ``ValueError`` naming the field, before anything is compiled or launched.

    Attributes:
        forward_backend: ``"tilelang"`` (Hopper), ``"flash_mla"`` (FlashMLA's sparse prefill,
            optional: where it is not importable or does not support the shape, the TileLang
            forward runs on Hopper and the torch reference elsewhere) or ``"torch"``.
        backward_backend: ``"tilelang"`` or ``"torch"``; either takes the lse of any forward.
        forward_block_i: keys per forward index block, one of 16, 32, 64 (topk is padded to it).
        forward_stages: K/V shared-memory stages of the forward's gather pipeline (>= 2).
        backward_block_i: keys per backward block (a multiple of 16).
        backward_stages: slots of the backward's K/V ring (>= 1).
        split_store: slices of d_v in which the backward forms and writes the key gradient.
        dkv_reduce: how the backward adds dKV rows: ``"tma"`` bulk reduce-adds staged in shared
            memory, or ``"atomic"`` fp32 atomics straight from registers.
    """

    forward_backend: str = "tilelang"
    backward_backend: str = "tilelang"
    forward_block_i: int = 64
    forward_stages: int = 2
    backward_block_i: int = 32
    backward_stages: int = 1
    split_store: int = 2
    dkv_reduce: str = "tma"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("forward_backend", FORWARD_BACKENDS),
            ("backward_backend", BACKWARD_BACKENDS),
            ("dkv_reduce", DKV_REDUCE_MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"SparseAttentionConfig.{name} must be one of {allowed}, "
                    f"got {getattr(self, name)!r}"
                )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SparseAttentionConfig.{name} must be a positive int, got {value!r}"
                )


TORCH_CONFIG = SparseAttentionConfig(forward_backend="torch", backward_backend="torch")

# Hopper: the TileLang kernels. Backward tiling from dsa_bench.sweep_backward on the H200 (16k
# tokens, the benchmark's causal indices; benchmarks/results/sparse_backward_sweep.csv): from 32
# heads up the program is alone on its SM, and fp32 atomics straight from registers beat the
# staged bulk reduce-adds (60.6 vs 67.1 ms at 64 heads, 48.1 vs 58.8 at 32); at 8 and 16 heads
# two programs share an SM and the bulk reduce-adds win (32 vs 36 ms). At 64 heads and D = 576,
# 64-key blocks (M = 64 key-gradient MMAs, half the block iterations; shared memory fits only
# without the bulk-reduce staging buffer) take the backward from 60.4 to 47.5 ms
# (results/tuning_topk_and_attn64.log). The 512-wide 64-head row keeps 32-key blocks: 64-key
# blocks were checked there against the reference but not timed. The forward keeps its default
# tiling at every head count.
_HOPPER_SMALL = SparseAttentionConfig()
_HOPPER_64 = dataclasses.replace(_HOPPER_SMALL, dkv_reduce="atomic")
_HOPPER_32 = dataclasses.replace(_HOPPER_64, split_store=4)
_HOPPER_64_TAIL = dataclasses.replace(_HOPPER_64, backward_block_i=64)
_MEASURED = "measured H200 (backward sweep and dsa-bench, 16k tokens)"


def _hopper(tail: bool, heads: int) -> tuple[SparseAttentionConfig, str]:
    """The Hopper row for (RoPE tail present, heads bucket) and where its tiling comes from."""
    if heads == 64:
        return (_HOPPER_64_TAIL if tail else _HOPPER_64), _MEASURED
    config = _HOPPER_32 if heads == 32 else _HOPPER_SMALL
    return config, _MEASURED if tail else "measured H200 at D=576; the 512-wide tiling follows it"


# Blackwell: FlashMLA's sparse prefill where it is installed (else the torch reference), the
# torch backward; no TileLang kernel here is built or measured for sm_100 yet.
_BLACKWELL = SparseAttentionConfig(forward_backend="flash_mla", backward_backend="torch")

CONFIG_TABLE: ConfigTable[SparseAttentionConfig] = ConfigTable(
    "sparse_attention",
    SparseAttentionConfig,
    [KeyField("arch_major"), KeyField("rope_tail"), KeyField("heads", heads_bucket)],
    rows=[
        *(
            ({"arch_major": 9, "rope_tail": tail, "heads": h}, *_hopper(tail, h))
            for tail in (True, False)
            for h in (8, 16, 32, 64)
        ),
        *(
            ({"arch_major": 10, "rope_tail": tail, "heads": h}, _BLACKWELL, "unmeasured default")
            for tail in (True, False)
            for h in (8, 16, 32, 64)
        ),
    ],
    default=TORCH_CONFIG,
)
