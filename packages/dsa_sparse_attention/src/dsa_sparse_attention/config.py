"""SparseAttentionConfig and the measured table keyed by (arch, RoPE tail, TP-local heads)."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from kernel_common import ConfigTable, KeyField, heads_bucket

FORWARD_BACKENDS = ("torch",)
BACKWARD_BACKENDS = ("torch",)


@dataclass(frozen=True)
class SparseAttentionConfig:
    """How sparse attention runs: backends and the kernels' tiling.

    Attributes:
        forward_backend: ``"torch"`` (the reference; the only backend for CPU tensors).
        backward_backend: ``"torch"``.
        block_i: index-block width: indices are padded with -1 to a multiple of it.
        forward_threads: threads per forward program.
        forward_stages: software-pipelining depth of the forward K/V gather.
        backward_stages: pipelining depth of the backward gather.
        split_store: number of slices the backward writes dKV in (fewer atomics in flight).
    """

    forward_backend: str = "torch"
    backward_backend: str = "torch"
    block_i: int = 64
    forward_threads: int = 256
    forward_stages: int = 2
    backward_stages: int = 2
    split_store: int = 2

    def __post_init__(self) -> None:
        if self.forward_backend not in FORWARD_BACKENDS:
            raise ValueError(
                f"SparseAttentionConfig.forward_backend must be one of {FORWARD_BACKENDS}, "
                f"got {self.forward_backend!r}"
            )
        if self.backward_backend not in BACKWARD_BACKENDS:
            raise ValueError(
                f"SparseAttentionConfig.backward_backend must be one of {BACKWARD_BACKENDS}, "
                f"got {self.backward_backend!r}"
            )
        for name in (
            "block_i",
            "forward_threads",
            "forward_stages",
            "backward_stages",
            "split_store",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SparseAttentionConfig.{name} must be a positive int, got {value!r}"
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

CONFIG_TABLE: ConfigTable[SparseAttentionConfig] = ConfigTable(
    "sparse_attention",
    SparseAttentionConfig,
    [KeyField("arch_major"), KeyField("rope_tail"), KeyField("heads", heads_bucket)],
    rows=[],
    default=TORCH_CONFIG,
)
