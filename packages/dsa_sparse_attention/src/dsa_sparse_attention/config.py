"""SparseAttentionConfig and the measured table keyed by (arch, RoPE tail, TP-local heads)."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from kernel_common import ConfigTable, KeyField, heads_bucket

FORWARD_BACKENDS = ("tilelang", "flash_mla", "torch")
BACKWARD_BACKENDS = ("tilelang", "torch")
DKV_REDUCE_MODES = ("tma", "atomic")


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclass(frozen=True)
class SparseAttentionConfig:
    """How sparse attention runs: backends and the kernels' tiling.

    Attributes:
        forward_backend: ``"tilelang"`` (Hopper), ``"flash_mla"`` (optional FlashMLA sparse
            prefill; falls back to tilelang/torch when not importable or the shape is outside
            what it supports) or ``"torch"`` (the reference; always used for CPU tensors).
        backward_backend: ``"tilelang"`` or ``"torch"``. Either takes the lse of either forward.
        forward_block_i: keys per forward index block (16, 32 or 64; topk is padded to it).
        forward_threads: threads per forward program (the TileLang kernel runs 384).
        forward_stages: K/V shared-memory stages of the forward gather pipeline.
        backward_block_i, backward_stages, split_store: backward tiling (keys per block, K/V
            blocks in flight, d_v slices dKV is written in); None picks the kernel's default for
            the head count.
        dkv_reduce: how the backward adds dKV rows: ``"tma"`` bulk reduce-adds or ``"atomic"``
            fp32 atomics.
    """

    forward_backend: str = "torch"
    backward_backend: str = "torch"
    forward_block_i: int = 64
    forward_threads: int = 384
    forward_stages: int = 2
    backward_block_i: int | None = None
    backward_stages: int | None = None
    split_store: int | None = None
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
        for name in ("forward_block_i", "forward_threads", "forward_stages"):
            value = getattr(self, name)
            if not _positive(value):
                raise ValueError(
                    f"SparseAttentionConfig.{name} must be a positive int, got {value!r}"
                )
        for name in ("backward_block_i", "backward_stages", "split_store"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise ValueError(
                    f"SparseAttentionConfig.{name} must be a positive int or None, got {value!r}"
                )
        # Precomputed so that torch.compile reads an attribute instead of tracing json.dumps.
        object.__setattr__(self, "_json", json.dumps(dataclasses.asdict(self), sort_keys=True))

    def to_json(self) -> str:
        return self._json

    @staticmethod
    @functools.cache
    def from_json(text: str) -> SparseAttentionConfig:
        return SparseAttentionConfig(**json.loads(text))


TORCH_CONFIG = SparseAttentionConfig()

# Hopper: the TileLang kernels. Backward tiling from benchmarks/sweep_sparse_backward.py on the
# H200 (16k tokens, the benchmark's causal indices; results/sparse_backward_sweep.csv): from 32
# heads up the program is alone on its SM, and fp32 atomics straight from registers beat the
# staged bulk reduce-adds (60.6 vs 67.1 ms at 64 heads, 48.1 vs 58.8 at 32); at 8 and 16 heads
# two programs share an SM and the bulk reduce-adds win (32 vs 36 ms). At 64 heads and D = 576,
# 64-key blocks (M = 64 key-gradient MMAs, half the block iterations; shared memory fits only
# without the bulk-reduce staging buffer) take the backward from 60.4 to 47.5 ms
# (results/tuning_topk_and_attn64.log). The 512-wide 64-head row keeps 32-key blocks: 64-key
# blocks were checked there against the reference but not timed. The forward keeps its default
# tiling at every head count.
_HOPPER_SMALL = SparseAttentionConfig(forward_backend="tilelang", backward_backend="tilelang")
_HOPPER_ATOMIC = dataclasses.replace(_HOPPER_SMALL, dkv_reduce="atomic")
_HOPPER_32 = dataclasses.replace(
    _HOPPER_ATOMIC, backward_block_i=32, backward_stages=1, split_store=4
)
_HOPPER_64_TAIL = dataclasses.replace(
    _HOPPER_ATOMIC, backward_block_i=64, backward_stages=1, split_store=2
)


def _hopper(tail: bool, heads: int) -> tuple[SparseAttentionConfig, str]:
    """The Hopper row for (RoPE tail present, heads bucket) and where its tiling comes from."""
    if heads == 64:
        config = _HOPPER_64_TAIL if tail else _HOPPER_ATOMIC
        return config, "measured H200 (sweep_sparse_backward.py and dsa-bench, 16k tokens)"
    config = _HOPPER_32 if heads == 32 else _HOPPER_SMALL
    if tail:
        return config, "measured H200 (sweep_sparse_backward.py and dsa-bench, 16k tokens)"
    return config, "measured H200 at D=576; the 512-wide tiling follows it"


# Blackwell: FlashMLA's sparse prefill where it is installed (else the torch backend), the
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
