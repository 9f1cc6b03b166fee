"""Optional forward backend: FlashMLA's sparse prefill kernel (``flash_mla.flash_mla_sparse_fwd``).

FlashMLA is never a dependency; this glue adapts our contract to its documented one:
q ``[s_q, h_q, d_qk]``, kv ``[s_kv, 1, d_qk]``, indices ``[s_q, 1, topk]`` (invalid = -1 or
>= s_kv), h_q padded to 64 or 128, topk a multiple of 128, no batch dimension, an optional
per-head ``attn_sink`` applied to the output, and an lse that is natural-log, excludes the sink
and is +inf on rows without a valid index. We return our convention: the log2-space lse with the
sink folded in, -inf on empty rows without a sink.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from kernel_common.constants import LOG2E, round_up

TOPK_MULTIPLE = 128


# A constant for torch.compile: the entry resolves its config while being traced.
@torch.compiler.assume_constant_result
def flash_mla_importable() -> bool:
    return importlib.util.find_spec("flash_mla") is not None


def flash_mla_supports(arch_major: int, heads: int, groups: int, dim: int, d_v: int) -> bool:
    """Whether FlashMLA's sparse prefill handles this shape on this arch."""
    return (
        arch_major in (9, 10) and groups == 1 and d_v == 512 and dim in (512, 576) and heads <= 128
    )


def padded_heads(heads: int, arch_major: int) -> int:
    # Hopper kernels come in 64- and 128-head variants; Blackwell's prefill needs 128.
    return 64 if heads <= 64 and arch_major == 9 else 128


def sparse_attention_forward_flash_mla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    attn_sink: torch.Tensor | None,
    sm_scale: float,
    d_v: int,
    arch_major: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward through FlashMLA: ``(out [B, S, H, d_v] bf16, lse2 [B, S, H] fp32)``.

    Shapes as in :func:`dsa_sparse_attention.sparse_attention` with G = 1. Batches are flattened
    into global rows (index + b * S_kv, padding stays -1); heads are padded with zero queries and
    a zero sink, topk with -1, and everything is sliced back.
    """
    flash_mla = importlib.import_module("flash_mla")
    b, s, h, d = q.shape
    s_kv, topk = kv.shape[1], indices.shape[-1]
    hp = padded_heads(h, arch_major)
    q_rows = q.reshape(b * s, h, d)
    if hp != h:
        q_rows = torch.nn.functional.pad(q_rows, (0, 0, 0, hp - h))
    kv_rows = kv.reshape(b * s_kv, 1, d)
    idx = indices.reshape(b, s, topk)
    valid = (idx >= 0) & (idx < s_kv)
    offset = torch.arange(b, device=idx.device, dtype=idx.dtype).view(b, 1, 1) * s_kv
    idx = torch.where(valid, idx + offset, -1).reshape(b * s, 1, topk)
    pad_k = round_up(topk, TOPK_MULTIPLE) - topk
    if pad_k:
        idx = torch.nn.functional.pad(idx, (0, pad_k), value=-1)
    kwargs = {}
    if attn_sink is not None:
        kwargs["attn_sink"] = torch.nn.functional.pad(attn_sink, (0, hp - h))
    out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(
        q_rows, kv_rows, idx.contiguous(), sm_scale, d_v, **kwargs
    )
    out = out[:, :h].reshape(b, s, h, d_v)
    lse = lse[:, :h].reshape(b, s, h).float()
    lse = torch.where(torch.isposinf(lse), float("-inf"), lse)
    if attn_sink is not None:
        lse = torch.logaddexp(lse, attn_sink.view(1, 1, h))
    return out, lse * LOG2E
