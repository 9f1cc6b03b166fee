"""``sparse_attention``: validation, config resolution, ``dsa_sparse_attention::*`` custom ops.

A call is followed from here: :func:`sparse_attention` checks its arguments and resolves one
complete :class:`SparseAttentionConfig` (:func:`resolve_config`); the custom op
``dsa_sparse_attention::forward`` receives that config's fields as typed static arguments
(custom ops take no dataclasses: ``kernel_common.define_config_op`` writes the fields into the
schema), rebuilds the config, refuses a tiling the kernels cannot run for these shapes, and
dispatches to ``_tilelang`` / ``_triton`` / ``_flash_mla`` / ``reference``; its registered
autograd calls ``dsa_sparse_attention::backward`` with the same config.

Inside, the lse is in log2 units (``lse2``: the kernels' softmax runs on exp2); only the public
entry converts it to the natural log the API returns.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from kernel_common import (
    Arch,
    Lookup,
    check_indices,
    check_int,
    check_tensor,
    config_fields,
    define_config_op,
    device_arch,
    shared_memory_per_block,
)
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LN2, LOG2E

from dsa_sparse_attention import _flash_mla, reference
from dsa_sparse_attention._triton.forward import check_forward_config as check_triton_forward
from dsa_sparse_attention._triton.forward import (
    forward_supports,
    sparse_attention_forward_triton,
)
from dsa_sparse_attention.config import CONFIG_TABLE, TORCH_CONFIG, SparseAttentionConfig

_OP = "sparse_attention"


def _table_lookup(
    arch: Arch,
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    topk: int,
    config: SparseAttentionConfig | None,
    deterministic: bool | None,
) -> Lookup[SparseAttentionConfig]:
    """The config for these static shapes on a GPU ``arch``: the caller's or the table row, in
    deterministic mode if asked (``None``: as ``torch.are_deterministic_algorithms_enabled()``),
    with a FlashMLA forward replaced by the one that runs where FlashMLA cannot. ROCm devices
    get the torch reference unless the caller asks for more (no kernel here is built for
    them)."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if arch.vendor != "cuda" and config is None:
        return Lookup(
            dataclasses.replace(TORCH_CONFIG, deterministic=deterministic),
            f"{arch.sm}: the torch reference",
            (),
        )
    found = CONFIG_TABLE.lookup(
        config,
        arch_major=arch.major,
        rope_tail=dim > d_v,
        heads=heads,
        topk=topk,
        deterministic=deterministic,
    )
    if deterministic and not found.config.deterministic:  # the caller's config, in that mode
        found = Lookup(
            dataclasses.replace(found.config, deterministic=True),
            f"{found.source}; deterministic",
            found.key,
        )
    cfg = found.config
    if cfg.forward_backend == "triton" and not forward_supports(dim, d_v):
        return Lookup(
            dataclasses.replace(cfg, forward_backend="tilelang"),
            f"{found.source}; the triton forward does not run this width: tilelang forward",
            found.key,
        )
    if cfg.forward_backend == "flash_mla" and not (
        _flash_mla.flash_mla_importable()
        and _flash_mla.flash_mla_supports(arch.major, heads, groups, dim, d_v)
    ):
        fallback = "tilelang" if arch.is_hopper else "torch"
        return Lookup(
            dataclasses.replace(cfg, forward_backend=fallback),
            f"{found.source}; flash_mla not importable or not for this shape: {fallback} forward",
            found.key,
        )
    return found


def resolve_config(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    d_v: int | None = None,
    config: SparseAttentionConfig | None = None,
    deterministic: bool | None = None,
) -> Lookup[SparseAttentionConfig]:
    """The config that :func:`sparse_attention` runs for these inputs, and where it came from.

    ``.config`` is what really runs: CPU tensors run the torch reference whatever ``config``
    says; on a CUDA device it is ``config`` if given, else the measured table row for (arch
    major, RoPE tail present, TP-local heads bucket, top-k bucket of ``indices.shape[-1]``,
    deterministic), else the torch reference for an arch without rows; a FlashMLA forward that
    cannot run here is replaced by the one that does. ``deterministic`` (default ``None``: as
    ``torch.are_deterministic_algorithms_enabled()``) picks the deterministic row, or sets the
    field of the caller's config; a config that says ``deterministic=True`` keeps it either way.
    ``.source`` says which of these applied and ``.describe()`` prints it with the table key.
    """
    if config is not None and not isinstance(config, SparseAttentionConfig):
        raise TypeError(
            f"{_OP}: config must be a SparseAttentionConfig, got {type(config).__name__}"
        )
    dim = q.shape[-1]
    d_v = min(dim, 512) if d_v is None else d_v
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"{_OP}: deterministic must be a bool or None, got {deterministic!r}")
    if q.device.type != "cuda":
        source = "cpu tensors: the torch reference"
        if config is not None:
            source += " (the caller's config applies to CUDA tensors only)"
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        return Lookup(dataclasses.replace(TORCH_CONFIG, deterministic=deterministic), source, ())
    return _table_lookup(
        device_arch(q.device),
        q.shape[2],
        kv.shape[2],
        dim,
        d_v,
        indices.shape[-1],
        config,
        deterministic,
    )


def _check_runnable(
    cfg: SparseAttentionConfig,
    arch: Arch,
    heads: int,
    groups: int,
    dim: int,
    d_v: int,
    smem_limit: int = HOPPER_SMEM_PER_BLOCK,
) -> None:
    """Raise ValueError, naming the field, if the config's kernels cannot run these shapes on
    ``arch`` with ``smem_limit`` bytes of shared memory per block (before anything is compiled
    or launched)."""
    if cfg.forward_backend == "triton":
        check_triton_forward(dim, d_v, heads // groups, smem_limit)
    if cfg.forward_backend == "tilelang" or cfg.backward_backend == "tilelang":
        if not arch.is_hopper:
            raise ValueError(
                f"{_OP}: the TileLang kernels target Hopper (sm_90a), not {arch.sm}; set "
                "SparseAttentionConfig.forward_backend / backward_backend to 'torch' (or the "
                "forward to 'flash_mla')"
            )
        from dsa_sparse_attention import _tilelang

        if cfg.forward_backend == "tilelang":
            _tilelang.check_forward_config(
                heads, groups, dim, d_v, cfg.forward_block_i, cfg.forward_stages
            )
        if cfg.backward_backend == "tilelang":
            _tilelang.check_backward_config(
                heads,
                groups,
                dim,
                d_v,
                cfg.backward_block_i,
                cfg.backward_stages,
                cfg.split_store,
                cfg.dkv_reduce,
                cfg.deterministic,
            )


def _forward_impl(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    *config,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = SparseAttentionConfig(*config)
    arch = device_arch(q.device) if q.device.type == "cuda" else None
    if arch is not None:
        # Both halves of the config, before anything runs: the backward's too.
        smem = shared_memory_per_block(q.device)
        _check_runnable(cfg, arch, q.shape[2], kv.shape[2], q.shape[3], d_v, smem)
    if arch is None or cfg.forward_backend == "torch":
        check_indices(_OP, "indices", indices, kv.shape[1], "S_kv")
        out, lse = reference.sparse_attention_forward_reference(
            q, kv, indices, sm_scale, d_v, attn_sink
        )
        return out, lse * LOG2E
    if cfg.forward_backend == "flash_mla":
        return _flash_mla.sparse_attention_forward_flash_mla(
            q, kv, indices, attn_sink, sm_scale, d_v, arch.major
        )
    if cfg.forward_backend == "triton":
        return sparse_attention_forward_triton(
            q,
            kv,
            indices,
            attn_sink,
            sm_scale,
            d_v,
        )
    from dsa_sparse_attention._tilelang import sparse_attention_forward_tilelang

    return sparse_attention_forward_tilelang(
        q,
        kv,
        indices,
        attn_sink,
        sm_scale,
        d_v,
        block_i=cfg.forward_block_i,
        num_stages=cfg.forward_stages,
    )


_forward_op = define_config_op(
    "dsa_sparse_attention::forward",
    "Tensor q, Tensor kv, Tensor indices, Tensor? attn_sink, float sm_scale, int d_v",
    "(Tensor, Tensor)",
    SparseAttentionConfig,
    _forward_impl,
)


@torch.library.register_fake("dsa_sparse_attention::forward")
def _(q, kv, indices, attn_sink, sm_scale, d_v, *config):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, d_v)), q.new_empty((b, s, h), dtype=torch.float32)


@contextlib.contextmanager
def _deterministic_algorithms(on: bool):
    """``torch.use_deterministic_algorithms(True)`` for the block when ``on`` (restored after)."""
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if on and not was:
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        if on and not was:
            torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _backward_impl(
    dout: torch.Tensor,
    dlse2: torch.Tensor | None,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse2: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    *config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = SparseAttentionConfig(*config)
    # dsink comes back as an empty tensor without a sink: custom ops cannot return None.
    if q.device.type == "cuda" and cfg.backward_backend == "tilelang":
        from dsa_sparse_attention._tilelang import sparse_attention_backward_tilelang

        dq, dkv, dsink = sparse_attention_backward_tilelang(
            dout,
            dlse2,
            q,
            kv,
            indices,
            out,
            lse2,
            attn_sink,
            sm_scale,
            d_v,
            block_i=cfg.backward_block_i,
            num_stages=cfg.backward_stages,
            split_store=cfg.split_store,
            dkv_reduce=cfg.dkv_reduce,
            deterministic=cfg.deterministic,
        )
    else:
        # The reference works in natural-log units: d lse2 / d lse = log2(e). Its dkv is a
        # scatter_add_, which torch makes reproducible on CUDA only in deterministic mode.
        with _deterministic_algorithms(cfg.deterministic):
            dq, dkv, dsink = reference.sparse_attention_backward_reference(
                dout,
                dlse2 * LOG2E if dlse2 is not None else None,
                q,
                kv,
                indices,
                lse2 * LN2,
                sm_scale,
                d_v,
                attn_sink,
            )
    return dq, dkv, dsink if dsink is not None else q.new_empty(0, dtype=torch.float32)


_backward_op = define_config_op(
    "dsa_sparse_attention::backward",
    "Tensor dout, Tensor? dlse2, Tensor q, Tensor kv, Tensor indices, Tensor out, Tensor lse2, "
    "Tensor? attn_sink, float sm_scale, int d_v",
    "(Tensor, Tensor, Tensor)",
    SparseAttentionConfig,
    _backward_impl,
)


@torch.library.register_fake("dsa_sparse_attention::backward")
def _(dout, dlse2, q, kv, indices, out, lse2, attn_sink, *static):
    h = attn_sink.shape[0] if attn_sink is not None else 0
    return torch.empty_like(q), torch.empty_like(kv), q.new_empty(h, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, kv, indices, attn_sink, *static = inputs
    out, lse2 = output
    ctx.save_for_backward(q, kv, indices, attn_sink, out, lse2)
    ctx.static = static  # sm_scale, d_v and the config's fields


def _backward(ctx, dout, dlse2):
    q, kv, indices, attn_sink, out, lse2 = ctx.saved_tensors
    dq, dkv, dsink = _backward_op(
        dout.contiguous(), dlse2, q, kv, indices, out, lse2, attn_sink, *ctx.static
    )
    return dq, dkv, None, dsink if attn_sink is not None else None, *(None,) * len(ctx.static)


torch.library.register_autograd(
    "dsa_sparse_attention::forward", _backward, setup_context=_setup_context
)


def check_attention_inputs(
    op: str, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor
) -> None:
    """The shared checks of q [B, S, H, D] bf16, kv [B, S_kv, G, D] bf16 with H % G == 0, and
    indices [B, S, G, topk >= 1] int32 on q's device (``sparse_attention`` and
    ``sparse_attention_probs``)."""
    check_tensor(op, "q", q, dtypes=(torch.bfloat16,), shape=[None] * 4, layout="[B, S, H, D]")
    b, s, h, d = q.shape
    check_tensor(
        op,
        "kv",
        kv,
        dtypes=(torch.bfloat16,),
        shape=[b, None, None, d],
        layout=f"[B={b}, S_kv, G, D={d}]",
        device=q.device,
    )
    g = kv.shape[2]
    if g < 1 or h % g != 0:
        raise ValueError(
            f"{op}: q heads H={h} must be divisible by the kv groups G={g} (kv.shape[2])"
        )
    check_tensor(
        op,
        "indices",
        indices,
        dtypes=(torch.int32,),
        shape=[b, s, g, None],
        layout=f"[B={b}, S={s}, G={g}, topk]",
        device=q.device,
    )
    if indices.shape[-1] < 1:
        raise ValueError(
            f"{op}: indices must have topk >= 1 entries per row, got shape {list(indices.shape)}"
        )


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    d_v: int | None = None,
    attn_sink: torch.Tensor | None = None,
    config: SparseAttentionConfig | None = None,
    deterministic: bool | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA-style sparse attention of each query over its selected keys.

    Args:
        q: bfloat16 ``[B, S, H, D]``, ``D = d_v + d_tail`` (the RoPE tail last).
        kv: bfloat16 ``[B, S_kv, G, D]``: K is the whole row, V its first ``d_v`` columns (MLA in
            absorbed form). Query head ``h`` reads group ``h // (H // G)``; ``H % G == 0``.
        indices: int32 ``[B, S, G, topk]``, ``topk >= 1``: key rows in ``[-1, S_kv)``, -1 is
            padding (anywhere in the row). Duplicates count once per occurrence. The GPU
            kernels treat any other out-of-range entry as padding; the torch reference rejects it.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        d_v: value width, default ``min(D, 512)``; ``1 <= d_v <= D``.
        attn_sink: float32 ``[H]`` or None: a learnable per-head logit added to the softmax
            denominator only (it has no value).
        config: a :class:`SparseAttentionConfig`; default the measured table row
            (:func:`resolve_config` tells which).
        deterministic: make the gradients bitwise reproducible (dq, dkv and dsink the same bits
            on every run and CUDA-graph replay; the backward then adds dkv in 64-bit fixed
            point, 1.5-2x its default time). ``None`` (default) follows
            ``torch.use_deterministic_algorithms``; a config with ``deterministic=True`` is
            deterministic either way.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` bfloat16 ``[B, S, H, d_v]`` and, with ``return_lse``, ``lse`` float32
        ``[B, S, H]`` (natural log, sink included; -inf for a row with no valid index and no
        sink). A row whose indices are all -1 gives exactly 0 and finite gradients.
        Differentiable w.r.t. q, kv and attn_sink (and through lse).
    """
    check_attention_inputs(_OP, q, kv, indices)
    d = q.shape[-1]
    h = q.shape[2]
    if d_v is None:
        d_v = min(d, 512)
    check_int(_OP, "d_v", d_v, minimum=1)
    if d_v > d:
        raise ValueError(f"{_OP}: d_v={d_v} must not exceed the q/kv width D={d}")
    if attn_sink is not None:
        check_tensor(
            _OP,
            "attn_sink",
            attn_sink,
            dtypes=(torch.float32,),
            shape=[h],
            layout=f"[H={h}]",
            device=q.device,
        )
    found = resolve_config(q, kv, indices, d_v=d_v, config=config, deterministic=deterministic)
    if sm_scale is None:
        sm_scale = reference.default_sm_scale(d)
    fields = config_fields(found.config)
    out, lse2 = _forward_op(q, kv, indices, attn_sink, float(sm_scale), d_v, *fields)
    return (out, lse2 * LN2) if return_lse else out
