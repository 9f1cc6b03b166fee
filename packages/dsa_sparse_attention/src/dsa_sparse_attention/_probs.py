"""``sparse_attention_probs``: the indexer's training target from the attention's saved lse."""

from __future__ import annotations

import torch
from kernel_common import Arch, check_indices, check_tensor, device_arch, shared_memory_per_block

from dsa_sparse_attention import reference
from dsa_sparse_attention._ops import check_attention_inputs

_OP = "sparse_attention_probs"


# The TileLang kernel gathers each query's keys once per 64-head block whatever the head count,
# so it takes about the same time from 8 to 64 heads per group; the Triton kernel is faster up
# to 32 heads and slower from 48 (H100, 16k tokens, benchmarks/NOTES.md).
_TILELANG_MIN_HEADS = 33


def tilelang_runs(arch: Arch, dim: int, heads_per_group: int) -> bool:
    """Whether the entry runs the TileLang kernel for this arch and shape: Hopper, more than 32
    heads per kv group, ``D`` a multiple of 64 from 128 to 768 (``precompile`` builds the same
    set)."""
    if not (arch.is_hopper and heads_per_group >= _TILELANG_MIN_HEADS):
        return False
    from dsa_sparse_attention._tilelang.probs import probs_kernel_supports

    return probs_kernel_supports(dim)


def _gpu_kernel(device: torch.device, dim: int, heads_per_group: int) -> str | None:
    """The kernel the entry runs: ``"tilelang"`` where :func:`tilelang_runs`, ``"triton"`` on
    other CUDA GPUs, head counts and widths, ``None`` (the torch reference) on the CPU and on
    ROCm, where neither kernel is built or tested."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return "tilelang" if tilelang_runs(device_arch(device), dim, heads_per_group) else "triton"


@torch.library.custom_op("dsa_sparse_attention::probs", mutates_args=())
def _probs_op(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    kernel = _gpu_kernel(q.device, q.shape[-1], q.shape[2] // kv.shape[2])
    if kernel == "tilelang":
        from dsa_sparse_attention._tilelang.probs import sparse_attention_probs_tilelang

        return sparse_attention_probs_tilelang(q, kv, indices, lse, sm_scale)
    if kernel == "triton":
        from dsa_sparse_attention._triton import sparse_attention_probs_triton

        return sparse_attention_probs_triton(q, kv, indices, lse, sm_scale)
    check_indices(_OP, "indices", indices, kv.shape[1], "S_kv")
    return reference.sparse_attention_probs_reference(q, kv, indices, lse, sm_scale)


@_probs_op.register_fake
def _(q, kv, indices, lse, sm_scale):
    return q.new_empty(indices.shape, dtype=torch.float32)


# A target, not a function to differentiate: the output is marked non-differentiable, so inputs
# that require grad (the lse of a training forward) pass through torch.compile and opcheck.
def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _backward(ctx, grad):
    raise RuntimeError(f"{_OP} is not differentiable")


_probs_op.register_autograd(_backward, setup_context=_setup_context)


def sparse_attention_probs(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lse: torch.Tensor,
    *,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The attention probability of each selected slot, summed over the heads of its kv group.

    The DSA indexer's training target (``dsa_indexer.indexer_kl_loss`` normalises it per row):
    ``out[b, s, g, j] = sum_{h in g} exp(sm_scale * q[b, s, h] . kv[b, indices[b, s, g, j], g]
    - lse[b, s, h])``, from the lse that ``sparse_attention(..., return_lse=True)`` returned
    for the same inputs, so no softmax statistics are recomputed. Per-head probabilities are
    never stored, and the result is the same bits on every run. Under tensor parallelism each
    rank holds some heads: all-reduce (sum) the result over the head shards to get the
    full-head target.

    Args:
        q, kv, indices, sm_scale: as in :func:`sparse_attention` (``sm_scale`` default
            ``1 / sqrt(D)``). On Hopper a TileLang kernel runs more than 32 heads per kv group
            with ``D`` a multiple of 64 from 128 to 768; other cases on CUDA run a Triton
            kernel, which needs ``D`` a power of two >= 16 or one plus a smaller power of two
            >= 16 (512, 576, ...) and ``(min(64, heads per group rounded up to a power of two
            >= 16) + 16) * D * 2`` bytes of shared memory per block (up to 1024 wide at 64
            heads per group on Hopper).
        lse: float32 ``[B, S, H]``, natural log, sink included (the forward's ``lse``).

    Returns:
        float32 ``[B, S, G, topk]``: 0 at padding (-1; on the GPU any index outside
        ``[0, S_kv)``, which the torch reference rejects), the same value at each occurrence of
        a duplicated index. Not differentiable.
    """
    check_attention_inputs(_OP, q, kv, indices)
    b, s, h, d = q.shape
    check_tensor(
        _OP,
        "lse",
        lse,
        dtypes=(torch.float32,),
        shape=[b, s, h],
        layout=f"[B={b}, S={s}, H={h}]",
        device=q.device,
    )
    hg = h // kv.shape[2]
    if _gpu_kernel(q.device, d, hg) == "triton":
        from dsa_sparse_attention._triton import launch_config

        smem = shared_memory_per_block(q.device)
        if launch_config(d, hg, smem) is None:
            raise ValueError(
                f"{_OP}: q.shape[-1] = {d} must be a power of two >= 16, or one plus a smaller "
                "power of two >= 16 (e.g. 512, 576), whose rows of a head block and 16 keys "
                f"fit the device's {smem} bytes of shared memory per block, for the Triton "
                "kernel (on Hopper with more than 32 heads per kv group: or a multiple of 64 "
                "from 128 to 768)"
            )
    if sm_scale is None:
        sm_scale = reference.default_sm_scale(d)
    return _probs_op(q, kv, indices, lse, float(sm_scale))
