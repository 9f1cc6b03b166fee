"""IndexerConfig and the table that picks it per (arch major, TP-local heads bucket)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_common import ConfigTable, KeyField, Lookup, device_arch, heads_bucket

BACKENDS = ("triton", "torch")
_NUM_WARPS = (1, 2, 4, 8, 16)
_DK_SPLITS = (1, 2)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class IndexerConfig:
    """How the indexer runs: backend and the Triton kernels' tiling.

    Attributes:
        backend: ``"triton"`` or ``"torch"`` (the reference; always used for CPU tensors).
        logits_block_rows: (query, head) rows per logits program, ``BLOCK_M * next_pow2(H)``:
            the N side of the per-tile tensor-core product, so ``BLOCK_M = rows // next_pow2(H)``
            queries share each key tile (at least one). Power of two >= 16.
        logits_block_n: keys per logits tile (the M side of the product). Power of two >= 16.
        logits_num_warps, logits_num_stages: launch parameters of the logits kernel
            (``num_stages`` is the software-pipelining depth of the key-tile loads).
        scores_block_k: selected keys gathered per step by the top-k scores forward.
        scores_num_warps, scores_num_stages: its launch parameters.
        backward_block_k: selected keys gathered per step by the fused backward.
        backward_num_warps, backward_num_stages: its launch parameters.
        backward_rotate: each backward program starts its walk over the selected keys at its
            own step (query index mod steps) and wraps around, so that the programs running
            together (adjacent queries, which select nearly the same keys in the same
            ascending order) add into different dk rows at any moment instead of contending
            for the same ones.
        backward_dk_split: the backward computes the dk product ``ds @ q`` and its atomic adds
            in this many column blocks of ``D / split`` (1 or 2; no split where a block would
            be narrower than 16), which lowers its peak register count.
        backward_key_window: 0, or the keys per pass of the backward: with more keys than
            this, it runs one pass per window of keys, so that each pass's fp32 dk scratch
            and key rows stay in L2 (see ``topk_scores_backward_into``).
        lightning_fused: :func:`lightning_indexer` selects the top-k inside the logits kernel
            (a candidate list per query, the logits never stored; same indices bit for bit)
            instead of writing each block's logits and running ``ranged_topk`` on them. Used
            where a list fits (``topk + logits_block_n <= 4096``), else the two passes run. A
            list row takes ``8 * slots + 4`` bytes of the budget whatever T_kv (32 KB at topk
            2048), more than a logits row below T_kv = ``2 * slots``.
        fused_max_registers: 0, or a register cap per thread for the fused kernel (``maxnreg``):
            its list handling needs more registers than the logits loop, and a cap keeps as
            many CTAs per SM as the logits kernel has, spilling only in the rare list code.
    """

    backend: str = "triton"
    logits_block_rows: int = 128
    logits_block_n: int = 64
    logits_num_warps: int = 4
    logits_num_stages: int = 3
    scores_block_k: int = 64
    scores_num_warps: int = 4
    scores_num_stages: int = 3
    backward_block_k: int = 64
    backward_num_warps: int = 4
    backward_num_stages: int = 2
    backward_rotate: bool = False
    backward_dk_split: int = 1
    backward_key_window: int = 0
    lightning_fused: bool = False
    fused_max_registers: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"IndexerConfig.backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        for name in ("logits_block_rows", "logits_block_n", "scores_block_k", "backward_block_k"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < 16
                or not _is_pow2(value)
            ):
                raise ValueError(
                    f"IndexerConfig.{name} must be a power of two >= 16, got {value!r}"
                )
        for name in ("logits_num_warps", "scores_num_warps", "backward_num_warps"):
            value = getattr(self, name)
            if value not in _NUM_WARPS or isinstance(value, bool):
                raise ValueError(f"IndexerConfig.{name} must be one of {_NUM_WARPS}, got {value!r}")
        for name in ("logits_num_stages", "scores_num_stages", "backward_num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IndexerConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.backward_rotate, bool):
            raise ValueError(
                f"IndexerConfig.backward_rotate must be a bool, got {self.backward_rotate!r}"
            )
        if self.backward_dk_split not in _DK_SPLITS or isinstance(self.backward_dk_split, bool):
            raise ValueError(
                f"IndexerConfig.backward_dk_split must be one of {_DK_SPLITS},"
                f" got {self.backward_dk_split!r}"
            )
        if not isinstance(self.lightning_fused, bool):
            raise ValueError(
                f"IndexerConfig.lightning_fused must be a bool, got {self.lightning_fused!r}"
            )
        cap = self.fused_max_registers
        if isinstance(cap, bool) or not isinstance(cap, int) or not (cap == 0 or 24 <= cap <= 255):
            raise ValueError(
                f"IndexerConfig.fused_max_registers must be 0 or an int in [24, 255], got {cap!r}"
            )
        window = self.backward_key_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(
                f"IndexerConfig.backward_key_window must be an int >= 0, got {window!r}"
            )


TORCH_CONFIG = IndexerConfig(backend="torch")

# Tiles that fit every CUDA arch Triton targets (about 80 KB of shared memory for D = 128).
DEFAULT_CONFIG = IndexerConfig()

_MEASURED = (
    "measured H200 (dsa_bench.indexer --sweep and --backward-sweep, 16k causal / packed8, 4k;"
    " --window-sweep, 64k / 128k)"
)

# Fastest candidates of the sweeps per head count: (logits rows, block_n, warps, stages) and
# (backward block_k, warps, stages, rotate, dk_split); the scores forward was fastest at
# (64, 4, 3) for all. Two or three one-warpgroup CTAs per SM overlap one's epilogue with
# another's wgmma; 256 (query, head) rows pay off at 8 heads (more queries share a key tile),
# at 64 heads with a third stage, and at 32 heads with 8 warps (two warpgroups per CTA; not in
# the first sweep; re-swept on 16k / 128k causal: 2.02 -> 1.90 ms and 141.8 -> 130.2 ms whole,
# 157.2 -> 144.2 ms in 1024-row blocks; benchmarks/results/indexer_logits_tiles_32h.log).
# The backward is register-bound: splitting its dk product
# in two column halves takes 32 heads from 220 registers (two CTAs per SM) to 164 (three), 7.4
# -> 6.0 ms at 16k causal; rotating the key walk spreads the dk atomics of neighbouring queries
# (which pick nearly the same keys) and wins a little at 8, 16 and 64 heads. At 32 heads a third
# stage won on the re-measure at every length (16k causal 6.12 -> 5.82 ms, 128k 56.6 -> 51.7).
_SWEEP = {
    8: ((256, 64, 4, 2), (64, 4, 3, True, 2)),
    16: ((128, 64, 4, 2), (64, 4, 2, True, 1)),
    32: ((256, 64, 8, 2), (64, 4, 3, False, 2)),
    64: ((256, 64, 4, 3), (64, 4, 2, True, 2)),
}


# Keys per backward pass on Hopper: the pass's fp32 dk scratch (512 B a key at D = 128) and bf16
# key rows (256 B) take 48 MB of the 60 MB L2; 64k-key causal inputs, whose whole scratch is that
# size, ran at 2.7-2.9x the backward floor, 128k keys in one pass at 3.0-3.4x. Measured at 8, 32
# and 64 heads on 128k causal keys (dsa_bench.indexer --window-sweep: 51.9 -> 45.9, 51.3 -> 48.3,
# 77.8 -> 68.1 ms; 32768-key windows gained less); 16 heads takes the same window untimed.
_HOPPER_KEY_WINDOW = 65536


def _hopper(heads: int) -> IndexerConfig:
    (rows, block_n, warps, stages), (bk, bwarps, bstages, rotate, split) = _SWEEP[heads]
    return IndexerConfig(
        backend="triton",
        logits_block_rows=rows,
        logits_block_n=block_n,
        logits_num_warps=warps,
        logits_num_stages=stages,
        scores_block_k=64,
        scores_num_warps=4,
        scores_num_stages=3,
        backward_block_k=bk,
        backward_num_warps=bwarps,
        backward_num_stages=bstages,
        backward_rotate=rotate,
        backward_dk_split=split,
        backward_key_window=_HOPPER_KEY_WINDOW,
    )


INDEXER_CONFIGS: ConfigTable[IndexerConfig] = ConfigTable(
    "indexer",
    IndexerConfig,
    [KeyField("arch_major"), KeyField("heads", heads_bucket)],
    rows=[({"arch_major": 9, "heads": h}, _hopper(h), _MEASURED) for h in _SWEEP],
    default=DEFAULT_CONFIG,
)


def resolve_config(q: torch.Tensor, config: IndexerConfig | None = None) -> Lookup[IndexerConfig]:
    """The config the indexer ops run for queries ``q`` ``[T, H, D]``, and where it came from.

    CPU (any non-CUDA) tensors always run the torch reference, whatever ``config`` says, and so
    do ROCm devices (the Triton kernels are neither tested nor sized for them: the sm_90 tiles
    exceed a CDNA workgroup's 64 KB of LDS). On a CUDA device: the caller's ``config`` if given,
    else the table row for (arch major, heads bucket), else the default. ``.source`` says which
    applied. Arch detection is lazy and cached (``KERNEL_COMMON_ARCH`` overrides it); nothing
    here synchronises with the device.
    """
    if config is not None and not isinstance(config, IndexerConfig):
        raise TypeError(
            f"dsa_indexer: config must be an IndexerConfig, got {type(config).__name__}"
        )
    heads = q.shape[1]
    if q.device.type != "cuda":
        key = INDEXER_CONFIGS.key(arch_major=0, heads=heads)
        return Lookup(TORCH_CONFIG, "cpu tensors: the torch reference", key)
    arch = device_arch(q.device)
    if arch.vendor != "cuda":
        key = INDEXER_CONFIGS.key(arch_major=arch.major, heads=heads)
        return Lookup(TORCH_CONFIG, f"{arch.sm}: the torch reference", key)
    return INDEXER_CONFIGS.lookup(config, arch_major=arch.major, heads=heads)
