"""Build the TileLang kernels of many shapes up front, in parallel (nvcc, no GPU needed)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import NamedTuple

from kernel_common import Arch, device_arch, parse_arch, tilelang_target
from kernel_common.constants import round_up

from dsa_sparse_attention._ops import _table_lookup
from dsa_sparse_attention.config import SparseAttentionConfig


class AttentionShape(NamedTuple):
    """The static shape of a sparse-attention call: what its kernels are compiled for (batch
    and lengths are run-time values and need no build of their own)."""

    heads: int
    d_qk: int
    d_v: int
    topk: int
    groups: int = 1
    sink: bool = False


def precompile(
    shapes: Iterable[AttentionShape],
    *,
    arch: Arch | str | None = None,
    config: SparseAttentionConfig | None = None,
    deterministic: bool | None = None,
    probs: bool = False,
    max_workers: int = 16,
) -> int:
    """Compile the TileLang kernels that calls of these shapes will use, on a thread pool.

    TileLang compiles each kernel on its first use (10-40 s of nvcc); a training job or a
    benchmark that builds its shapes here first runs the nvcc processes side by side. The
    kernels land in TileLang's on-disk cache and this process's cache.

    Args:
        shapes: the static shapes, e.g. ``AttentionShape(heads=8, d_qk=576, d_v=512, topk=2048)``.
        arch: the arch to build for (``"sm_90"``, an :class:`Arch`); default the current device's
            (a ``ValueError`` without a GPU). Compiling needs nvcc, not a GPU.
        config: the config the calls will pass, default each shape's table row.
        deterministic: the mode the calls will run in, as ``sparse_attention``'s argument
            (``None``: as ``torch.use_deterministic_algorithms``).
        probs: also build the kernel of ``sparse_attention_probs`` (the indexer's training
            target) for each shape that runs it (more than 32 heads per kv group).
        max_workers: parallel builds.

    Returns:
        The number of build jobs (each built or found in the cache): one per forward, per
        probs kernel and per backward, whose job builds the preprocess kernel and the main
        kernel, in default mode both the fixed-walk and the synced one. Shapes whose config
        runs no TileLang kernel on ``arch`` build nothing, and so does any arch other than
        Hopper.
    """
    from dsa_sparse_attention._probs import tilelang_runs
    from dsa_sparse_attention._tilelang import (
        check_backward_config,
        check_forward_config,
        compile_backward,
        compile_forward,
    )
    from dsa_sparse_attention._tilelang.probs import BLOCK, compile_probs

    arch = device_arch() if arch is None else parse_arch(arch) if isinstance(arch, str) else arch
    if arch.vendor == "cpu":
        raise ValueError("precompile: no GPU here to build for; pass arch, e.g. arch='sm_90'")
    if not arch.is_hopper:
        return 0  # the TileLang kernels target Hopper only
    target = tilelang_target(arch)["arch"]
    jobs: set[tuple] = set()
    for shape in shapes:
        shape = AttentionShape(*shape)
        hw = (shape.heads, shape.groups, shape.d_qk, shape.d_v)
        cfg = _table_lookup(arch, *hw, shape.topk, config, deterministic).config
        if cfg.forward_backend == "tilelang":
            check_forward_config(*hw, cfg.forward_block_i, cfg.forward_stages)
            topk = round_up(shape.topk, cfg.forward_block_i)
            jobs.add(
                (compile_forward, (*hw, topk, shape.sink, cfg.forward_block_i,
                                   cfg.forward_stages, target), ())
            )  # fmt: skip
        if cfg.backward_backend == "tilelang":
            tiling = (
                ("block_i", cfg.backward_block_i),
                ("num_stages", cfg.backward_stages),
                ("split_store", cfg.split_store),
                ("dkv_reduce", cfg.dkv_reduce),
                ("deterministic", cfg.deterministic),
            )
            check_backward_config(*hw, *(value for _, value in tiling))
            jobs.add((compile_backward, (*hw, shape.topk), (*tiling, ("target", target))))
        if probs and tilelang_runs(arch, shape.d_qk, shape.heads // shape.groups):
            topk = round_up(shape.topk, BLOCK)
            jobs.add((compile_probs, (shape.heads, shape.groups, shape.d_qk, topk, target), ()))
    with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
        futures = [pool.submit(fn, *args, **dict(kwargs)) for fn, args, kwargs in jobs]
        for future in futures:
            future.result()
    return len(jobs)
