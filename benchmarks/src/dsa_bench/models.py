"""The model configurations of docs/design.md: the shapes that the benchmarks and the tests use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """One DSA attention layer shape at TP=1; ``kv_ratio`` is S_kv / S."""

    name: str
    heads: int
    d_qk: int
    d_v: int
    topk: int
    sink: bool
    kv_ratio: int
    tp_sizes: tuple[int, ...]

    def local_heads(self, tp: int) -> int:
        return self.heads // tp


MODELS = {
    m.name: m
    for m in (
        ModelShape("glm5", 64, 576, 512, 2048, False, 1, (8, 4, 1)),
        ModelShape("glm5.3-flash", 64, 576, 512, 2112, False, 1, (8, 4, 1)),
        ModelShape("glm5.3-flash-notail", 64, 512, 512, 2112, False, 1, (8, 4, 1)),
        ModelShape("dsv4.1-flash-r1", 64, 512, 512, 640, True, 2, (8, 2, 1)),
        ModelShape("dsv4.1-flash-r0", 64, 512, 512, 640, True, 1, (8,)),
    )
}

INDEXER_HEADS = 32
INDEXER_DIM = 128
