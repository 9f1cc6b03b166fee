"""``sparse_attention``: validation, ``dsa_sparse_attention::*`` custom ops, autograd, dispatch."""

from __future__ import annotations

import torch
from kernel_common import Lookup, check_int, check_tensor, device_arch

from dsa_sparse_attention import _flash_mla, reference
from dsa_sparse_attention.config import CONFIG_TABLE, TORCH_CONFIG, SparseAttentionConfig

_LN2 = 0.6931471805599453  # the kernels keep lse in log2 space; the public lse is natural


def resolve_config(
    q: torch.Tensor, d_v: int, config: SparseAttentionConfig | None
) -> Lookup[SparseAttentionConfig]:
    """The config a call uses and where it came from (CPU tensors always use the torch backend)."""
    arch = device_arch(q.device)
    if arch.vendor == "cpu":
        return Lookup(
            config if config is not None else TORCH_CONFIG,
            "cpu" if config is None else "caller",
            (),
        )
    return CONFIG_TABLE.lookup(
        config, arch_major=arch.major, rope_tail=q.shape[-1] > d_v, heads=q.shape[2]
    )


def _config_from_op_arg(q: torch.Tensor, d_v: int, config: str) -> SparseAttentionConfig:
    """The ops take the caller's config as JSON, or "" for the table's choice for these inputs.

    Resolving inside the op keeps arch detection out of torch.compile's trace.
    """
    caller = SparseAttentionConfig.from_json(config) if config else None
    return resolve_config(q, d_v, caller).config


def _check_indices(kv: torch.Tensor, indices: torch.Tensor) -> None:
    """The torch backend rejects indices outside [-1, S_kv) (GPU kernels treat them as padding)."""
    bad = (indices < -1) | (indices >= kv.shape[1])
    if bool(bad.any()):
        raise ValueError(
            f"sparse_attention: indices must lie in [-1, S_kv={kv.shape[1]}); "
            f"found {int(bad.sum())} entries outside it"
        )


def forward_backend(q: torch.Tensor, kv: torch.Tensor, d_v: int, cfg: SparseAttentionConfig) -> str:
    """The forward backend that actually runs: FlashMLA only where it is importable and supports
    the shape (else TileLang on Hopper, else torch); torch for CPU tensors."""
    arch = device_arch(q.device)
    if q.device.type != "cuda":
        return "torch"
    backend = cfg.forward_backend
    if backend == "flash_mla" and not (
        _flash_mla.flash_mla_importable()
        and _flash_mla.flash_mla_supports(arch.major, q.shape[2], kv.shape[2], q.shape[3], d_v)
    ):
        backend = "tilelang" if arch.is_hopper else "torch"
    if backend == "tilelang" and not arch.is_hopper:
        raise ValueError(
            f"sparse_attention: the TileLang forward targets Hopper (sm_90a), not {arch.sm}; "
            "pass SparseAttentionConfig(forward_backend='torch') or 'flash_mla'"
        )
    return backend


@torch.library.custom_op("dsa_sparse_attention::forward", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = _config_from_op_arg(q, d_v, config)
    backend = forward_backend(q, kv, d_v, cfg)
    if backend == "flash_mla":
        out, lse2 = _flash_mla.sparse_attention_forward_flash_mla(
            q, kv, indices, attn_sink, sm_scale, d_v, device_arch(q.device).major
        )
        return out, lse2 * _LN2
    if backend == "tilelang":
        from dsa_sparse_attention._tilelang import sparse_attention_forward_tilelang

        out, lse2 = sparse_attention_forward_tilelang(
            q,
            kv,
            indices,
            attn_sink,
            sm_scale,
            d_v,
            block_i=cfg.forward_block_i,
            threads=cfg.forward_threads,
            num_stages=cfg.forward_stages,
        )
        return out, lse2 * _LN2
    _check_indices(kv, indices)
    return reference.sparse_attention_forward_reference(q, kv, indices, sm_scale, d_v, attn_sink)


@_forward_op.register_fake
def _(q, kv, indices, attn_sink, sm_scale, d_v, config):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, d_v)), q.new_empty((b, s, h), dtype=torch.float32)


@torch.library.custom_op("dsa_sparse_attention::backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # dsink comes back as an empty tensor without a sink: custom ops cannot return None.
    cfg = _config_from_op_arg(q, d_v, config)
    if q.device.type == "cuda" and cfg.backward_backend == "tilelang":
        from dsa_sparse_attention._tilelang import sparse_attention_backward_tilelang

        dq, dkv, dsink = sparse_attention_backward_tilelang(
            dout,
            dlse,
            q,
            kv,
            indices,
            out,
            lse / _LN2,
            attn_sink,
            sm_scale,
            d_v,
            block_i=cfg.backward_block_i,
            num_stages=cfg.backward_stages,
            split_store=cfg.split_store,
            dkv_reduce=cfg.dkv_reduce,
        )
    else:
        dq, dkv, dsink = reference.sparse_attention_backward_reference(
            dout, dlse, q, kv, indices, lse, sm_scale, d_v, attn_sink
        )
    return dq, dkv, dsink if dsink is not None else q.new_empty(0, dtype=torch.float32)


@_backward_op.register_fake
def _(dout, dlse, q, kv, indices, out, lse, attn_sink, sm_scale, d_v, config):
    h = attn_sink.shape[0] if attn_sink is not None else 0
    return torch.empty_like(q), torch.empty_like(kv), q.new_empty(h, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, kv, indices, attn_sink, sm_scale, d_v, config = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, attn_sink, out, lse)
    ctx.sm_scale, ctx.d_v, ctx.config = sm_scale, d_v, config


def _backward(ctx, dout, dlse):
    q, kv, indices, attn_sink, out, lse = ctx.saved_tensors
    dq, dkv, dsink = _backward_op(
        dout.contiguous(),
        dlse,
        q,
        kv,
        indices,
        out,
        lse,
        attn_sink,
        ctx.sm_scale,
        ctx.d_v,
        ctx.config,
    )
    return dq, dkv, None, dsink if attn_sink is not None else None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    sm_scale: float | None = None,
    d_v: int | None = None,
    attn_sink: torch.Tensor | None = None,
    config: SparseAttentionConfig | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA-style sparse attention of each query over its selected keys.

    Args:
        q: bfloat16 ``[B, S, H, D]``, ``D = d_v + d_tail`` (the RoPE tail last).
        kv: bfloat16 ``[B, S_kv, G, D]``: K is the whole row, V its first ``d_v`` columns (MLA in
            absorbed form). Query head ``h`` reads group ``h // (H // G)``; ``H % G == 0``.
        indices: int32 ``[B, S, G, topk]``, ``topk >= 1``: key rows in ``[-1, S_kv)``, -1 is
            padding (anywhere in the row). Duplicates count once per occurrence.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        d_v: value width, default ``min(D, 512)``; ``1 <= d_v <= D``.
        attn_sink: float32 ``[H]`` or None: a learnable per-head logit added to the softmax
            denominator only (it has no value).
        config: a :class:`SparseAttentionConfig`; default from the measured table.
        return_lse: also return the log-sum-exp.

    Returns:
        ``out`` bfloat16 ``[B, S, H, d_v]`` and, with ``return_lse``, ``lse`` float32
        ``[B, S, H]`` (natural log, sink included; -inf for a row with no valid index and no
        sink). A row whose indices are all -1 gives exactly 0 and finite gradients.
        Differentiable w.r.t. q, kv and attn_sink (and through lse).
    """
    op = "sparse_attention"
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
    if d_v is None:
        d_v = min(d, 512)
    check_int(op, "d_v", d_v, minimum=1)
    if d_v > d:
        raise ValueError(f"{op}: d_v={d_v} must not exceed the q/kv width D={d}")
    if attn_sink is not None:
        check_tensor(
            op,
            "attn_sink",
            attn_sink,
            dtypes=(torch.float32,),
            shape=[h],
            layout=f"[H={h}]",
            device=q.device,
        )
    if config is not None and not isinstance(config, SparseAttentionConfig):
        raise TypeError(
            f"{op}: config must be a SparseAttentionConfig, got {type(config).__name__}"
        )
    if sm_scale is None:
        sm_scale = reference.default_sm_scale(d)
    config_arg = config.to_json() if config is not None else ""
    out, lse = _forward_op(q, kv, indices, attn_sink, float(sm_scale), d_v, config_arg)
    return (out, lse) if return_lse else out
