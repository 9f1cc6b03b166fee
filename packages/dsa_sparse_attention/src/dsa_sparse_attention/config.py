"""SparseAttentionConfig and the measured table keyed by (arch, RoPE tail, TP-local heads,
top-k bucket, deterministic)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kernel_common import ConfigTable, KeyField, heads_bucket

FORWARD_BACKENDS = ("tilelang", "triton", "flash_mla", "torch")
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
    ``dataclasses.replace(resolve_config(q, kv, indices).config, ...)``. CPU tensors always run
    the torch reference, whatever the config says. A config the kernels cannot run for the given
    shapes is refused with a ``ValueError`` naming the field, before anything is compiled or
    launched.

    Attributes:
        forward_backend: ``"tilelang"`` (Hopper), ``"triton"`` (keys on the tensor-core M
            side, for few heads per kv group; D must split as d_v plus 0 or a smaller power of
            two, d_v a power of two; any CUDA GPU; slower than the TileLang forward on Hopper,
            measured on an H100, so no table row selects it),
            ``"flash_mla"`` (FlashMLA's sparse prefill, optional:
            where it is not importable or does not support the shape, the TileLang forward runs
            on Hopper and the torch reference elsewhere) or ``"torch"``.
        backward_backend: ``"tilelang"`` or ``"torch"``; either takes the lse of any forward.
        forward_block_i: keys per forward index block, one of 16, 32, 64 (topk is padded to it).
            This and ``forward_stages`` tile the TileLang forward; the Triton forward picks its
            own launch for the width and head count.
        forward_stages: K/V shared-memory stages of the forward's gather pipeline (>= 2).
        backward_block_i: keys per backward block (a multiple of 16).
        backward_stages: slots of the backward's K/V ring (>= 1).
        split_store: slices of d_v in which the backward forms and writes the key gradient.
        dkv_reduce: how the backward adds dKV rows: ``"tma"`` bulk reduce-adds staged in shared
            memory, or ``"atomic"`` atomics straight from registers.
        deterministic: make the backward bitwise reproducible: dq, dkv and dsink are the same
            bits on every run for the same inputs, and on every CUDA-graph replay of the
            TileLang backward (which then adds dkv in 64-bit fixed point instead of fp32; see
            ``docs/dispatch.md``). The torch backward runs under
            ``torch.use_deterministic_algorithms(True)`` for the call, a process-wide switch,
            with that mode's requirements (older torch releases also want
            ``CUBLAS_WORKSPACE_CONFIG`` set). The forward is deterministic either way. The
            table has deterministic rows, which ``sparse_attention(..., deterministic=True)``
            and ``torch.use_deterministic_algorithms(True)`` select (:func:`resolve_config`).
    """

    forward_backend: str = "tilelang"
    backward_backend: str = "tilelang"
    forward_block_i: int = 64
    forward_stages: int = 2
    backward_block_i: int = 32
    backward_stages: int = 1
    split_store: int = 2
    dkv_reduce: str = "tma"
    deterministic: bool = False

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
        if not isinstance(self.deterministic, bool):
            raise ValueError(
                f"SparseAttentionConfig.deterministic must be a bool, got {self.deterministic!r}"
            )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"SparseAttentionConfig.{name} must be a positive int, got {value!r}"
                )


TORCH_CONFIG = SparseAttentionConfig(forward_backend="torch", backward_backend="torch")

# Hopper backward: the TileLang kernel. Tiling first from dsa_bench.sweep_backward on the H200
# (16k tokens, the benchmark's causal indices; benchmarks/results/sparse_backward_sweep.csv):
# from 32 heads up the program is alone on its SM and fp32 atomics straight from registers beat
# the staged bulk reduce-adds (60.6 vs 67.1 ms at 64 heads, 48.1 vs 58.8 at 32), while at 8 and
# 16 heads (two programs per SM) the bulk reduce-adds won (32 vs 36 ms) over atomics of 8 bytes
# each. At 64 heads and D = 576, 64-key blocks (M = 64 key-gradient MMAs, half the block
# iterations; shared memory fits only without the bulk-reduce staging buffer) took the backward
# from 60.4 to 47.5 ms (results/tuning_topk_and_attn64.log). Since the atomics are 16 bytes each
# on 64- / 128-byte row segments (2026-12-06, H100, no H200 lent;
# results/backward_warp_tile_h100.log), atomics win at every head count: 8 heads 34.1 ms (bulk)
# -> 28.8, 16 heads 34.6 -> 29.2, dsv4.1 8 heads 9.9 -> 8.4; 64-key blocks win at 32 heads
# (43.9 ms with 32-key blocks -> 36.4, both in 4 slices) and at 64 heads with D = 512 too
# (dsv4.1: 18.2 -> 13.2). The 512-wide 16- and 32-head rows follow the 576-wide ones (dsv4.1 32
# heads was timed with 64-key blocks in 2 slices only: 11.4 ms, against 15.2 before). At 64 heads
# 4 slices, whose accumulator is small enough for 128-byte segments, beat 2 slices of 64-byte
# ones (2026-12-07, H100, results/backward_pipelined_slices_h100.log: glm5 46.2 -> 44.9 ms;
# dsv4.1 15.9 -> 14.9, timed with the key-gradient MMAs of the next slice issued before the
# atomics, a variant not kept). The TileLang forward keeps its default tiling at every head count.
_HOPPER_SMALL = SparseAttentionConfig(dkv_reduce="atomic")
# 32 and 64 heads: 64-key blocks in 4 slices.
_HOPPER_LARGE = dataclasses.replace(_HOPPER_SMALL, backward_block_i=64, split_store=4)
_MEASURED = "backward measured H100 (16k tokens)"
# The rows whose tiling was compared only at D = 576.
_FOLLOWS_576 = "backward measured H100 at D=576, the 512-wide row follows"
# Deterministic mode: the int64 staging doubles the bytes of each reduce-add, and the sweep in
# that mode (results/sparse_backward_sweep_deterministic.csv, 16k tokens) picks bulk
# reduce-adds in 4 slices of 32-key blocks at 8 and 64 heads: 58.8 ms (8 heads; 67.5 with the
# default row's tiling) and 93.1 ms (64 heads; 119.2 with the default row's atomics). 16 and 32
# heads follow them.
_HOPPER_DETERMINISTIC = SparseAttentionConfig(split_store=4, deterministic=True)
_MEASURED_DETERMINISTIC = "deterministic backward measured H200 at 8 and 64 heads, D=576"

# Hopper forward: the measured winner of `dsa-bench --forward-only` with FlashMLA built, both
# backends in one run. First on the H200 (results/sparse_attention_forward_backends.csv: every
# model and TP size at 4k and 16k, 64k at 8 and 64 heads): FlashMLA won every long index list
# (glm5 2048, glm5.3 2112; TileLang 1.42-1.69x its time at 4k, 1.10-1.16x at 16k) and TileLang
# the short ones (dsv4.1, 640) at 8 and 32 heads. Then, after the TileLang forward's producer
# began zero-filling padding rows (0.9x at 16k), on an H100 (no H200 was lent;
# results/sparse_attention_forward_backends_h100.csv): FlashMLA still wins the 576-wide rows
# (glm5, glm5.3-flash: 1.00-1.09x at 16k), TileLang now wins the 512-wide long rows at 16k
# (glm5.3-flash-notail: FlashMLA 1.05x at 8 heads, 1.06x at 16 and 64; at 4k 0.95x / 1.10x /
# 1.00x) and dsv4.1 at 64 heads at every length (FlashMLA 1.03x at 4k, 1.06x at 16k, 1.02x at
# 64k). Where the lengths disagree the longer ones decide. Two more H100 runs (2026-12-06,
# results/forward_rows_repeat_h100_*.csv) put the 64-head dsv4.1 and 512-wide rows within the
# run-to-run spread of either backend (FlashMLA 3-7% ahead twice, 6% behind once): ties, which
# keep the TileLang forward every install has. Where FlashMLA is not importable the forward is
# TileLang (resolve_config says so).
_FORWARD = {
    # (tail, topk bucket, heads bucket): (forward backend, how it was chosen)
    (True, 2048, 8): ("flash_mla", "FlashMLA forward measured fastest at 4k / 16k / 64k"),
    (True, 2048, 16): ("flash_mla", "FlashMLA forward measured fastest at 4k / 16k"),
    (True, 2048, 32): ("flash_mla", "FlashMLA forward: no 32-head model, as the 16 / 64 rows"),
    (True, 2048, 64): ("flash_mla", "FlashMLA forward measured fastest at 4k / 16k / 64k"),
    (False, 2048, 8): ("tilelang", "TileLang forward measured fastest at 16k (H100), 64k"),
    (False, 2048, 16): ("tilelang", "TileLang forward measured fastest at 4k / 16k (H100)"),
    (False, 2048, 32): ("tilelang", "TileLang forward: no 32-head model, as the 16 / 64 rows"),
    (False, 2048, 64): ("tilelang", "TileLang / FlashMLA forward tie (3 H100 runs, within 6%)"),
    (False, 1024, 8): ("tilelang", "TileLang forward measured fastest at 4k / 16k / 64k"),
    (False, 1024, 16): ("tilelang", "TileLang forward: no 16-head model, as the 8 / 32 rows"),
    (False, 1024, 32): ("tilelang", "TileLang forward measured fastest at 4k / 16k"),
    (False, 1024, 64): ("tilelang", "TileLang / FlashMLA forward tie (3 H100 runs, within 7%)"),
    **{
        (True, 1024, h): ("tilelang", "forward unmeasured: no model has a tail and topk <= 1024")
        for h in (8, 16, 32, 64)
    },
}


def topk_bucket(topk: int) -> int:
    """The table's top-k key: 1024 for up to 1024 indices per row (dsv4.1's 640), 2048 above
    (glm5's 2048 / 2112). The forward's winner differs between the two: a long index list
    amortises FlashMLA's per-query setup, a short one favours the TileLang forward."""
    return 1024 if topk <= 1024 else 2048


def _hopper(
    tail: bool, heads: int, topk: int, deterministic: bool
) -> tuple[SparseAttentionConfig, str]:
    """The Hopper row for (RoPE tail present, heads bucket, top-k bucket, deterministic) and
    where its choices come from."""
    if deterministic:
        config, note = _HOPPER_DETERMINISTIC, _MEASURED_DETERMINISTIC
    else:
        config = _HOPPER_LARGE if heads in (32, 64) else _HOPPER_SMALL
        note = _MEASURED if tail or heads in (8, 64) else _FOLLOWS_576
    forward, forward_note = _FORWARD[tail, topk, heads]
    return dataclasses.replace(config, forward_backend=forward), f"{forward_note}; {note}"


# Blackwell: FlashMLA's sparse prefill where it is installed (else the torch reference), the
# torch backward; no TileLang kernel here is built or measured for sm_100 yet.
_BLACKWELL = SparseAttentionConfig(forward_backend="flash_mla", backward_backend="torch")
# (RoPE tail, heads bucket, top-k bucket, deterministic): the key of every row of an arch.
_KEYS = [
    (tail, h, k, det)
    for tail in (True, False)
    for h in (8, 16, 32, 64)
    for k in (1024, 2048)
    for det in (False, True)
]

CONFIG_TABLE: ConfigTable[SparseAttentionConfig] = ConfigTable(
    "sparse_attention",
    SparseAttentionConfig,
    [
        KeyField("arch_major"),
        KeyField("rope_tail"),
        KeyField("heads", heads_bucket),
        KeyField("topk", topk_bucket),
        KeyField("deterministic"),
    ],
    rows=[
        *(
            (
                {"arch_major": 9, "rope_tail": tail, "heads": h, "topk": k, "deterministic": det},
                *_hopper(tail, h, k, det),
            )
            for tail, h, k, det in _KEYS
        ),
        *(
            (
                {"arch_major": 10, "rope_tail": tail, "heads": h, "topk": k, "deterministic": det},
                dataclasses.replace(_BLACKWELL, deterministic=det),
                "unmeasured default",
            )
            for tail, h, k, det in _KEYS
        ),
    ],
    default=TORCH_CONFIG,
)
