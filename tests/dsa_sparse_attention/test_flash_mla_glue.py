"""The FlashMLA glue against a torch emulation of FlashMLA's documented sparse-prefill contract.

A FlashMLA package cannot be installed here, so a stand-in module is injected as ``flash_mla``:
it checks the input contract (no batch, h_q in {64, 128}, topk a multiple of 128, one kv head)
and computes what FlashMLA documents: out with the sink applied, a natural-log lse over the
scaled logits without the sink, +inf where a row has no valid index.
"""

import math
import sys
import types

import pytest
import torch
from dsa_sparse_attention import _flash_mla
from dsa_sparse_attention import reference as ref
from kernel_common.testing import assert_close


def emulated_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None):
    h_q = q.shape[1]
    s_kv = kv.shape[0]
    assert h_q in (64, 128), h_q
    assert kv.shape[1] == 1 and indices.shape[1] == 1
    assert indices.shape[-1] % 128 == 0 and indices.dtype == torch.int32
    idx = indices[:, 0].long()
    invalid = (idx < 0) | (idx >= s_kv)
    keys = kv[:, 0].float()[idx.clamp(0, s_kv - 1)]  # [s_q, topk, d_qk]
    p = torch.einsum("shd,skd->shk", q.float(), keys) * sm_scale
    p = p.masked_fill(invalid[:, None], float("-inf"))
    lse = torch.logsumexp(p, -1)
    total = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float()[None])
    weights = torch.exp(p - total.masked_fill(torch.isneginf(total), float("inf"))[..., None])
    out = torch.einsum("shk,skd->shd", weights, keys[..., :d_v]).bfloat16()
    return out, p.amax(-1), lse.masked_fill(torch.isneginf(lse), float("inf"))


@pytest.fixture
def fake_flash_mla(monkeypatch):
    module = types.ModuleType("flash_mla")
    module.flash_mla_sparse_fwd = emulated_sparse_fwd
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return module


@pytest.mark.parametrize(
    ("b", "h", "d", "topk", "sink", "arch"),
    [
        (2, 8, 576, 100, False, 9),
        (1, 64, 512, 128, True, 9),
        (2, 80, 576, 7, True, 9),
        (1, 16, 512, 130, True, 10),
    ],
)
def test_glue_matches_reference(fake_flash_mla, b, h, d, topk, sink, arch):
    gen = torch.Generator().manual_seed(h + topk)
    s, s_kv = 5, 9
    q = torch.randn(b, s, h, d, generator=gen).bfloat16()
    kv = torch.randn(b, s_kv, 1, d, generator=gen).bfloat16()
    idx = torch.randint(-1, s_kv, (b, s, 1, topk), generator=gen, dtype=torch.int32)
    idx[:, 1] = -1  # empty rows
    attn_sink = torch.randn(h, generator=gen) if sink else None
    scale = 1 / math.sqrt(d)
    out, lse2 = _flash_mla.sparse_attention_forward_flash_mla(
        q, kv, idx, attn_sink, scale, 512, arch
    )
    want_out, want_lse = ref.sparse_attention_forward_reference(q, kv, idx, scale, 512, attn_sink)
    assert out.shape == (b, s, h, 512) and lse2.shape == (b, s, h)
    assert_close(out, want_out, max_rel_diff=1e-5, name="out")
    assert_close(lse2 * math.log(2), want_lse, max_rel_diff=1e-6, name="lse")
    assert (out[:, 1] == 0).all()


def test_out_of_range_indices_are_padding(fake_flash_mla):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 8, 576, generator=gen).bfloat16()
    kv = torch.randn(2, 4, 1, 576, generator=gen).bfloat16()
    idx = torch.tensor([0, 3, 4, -5, 7, 1], dtype=torch.int32).expand(2, 3, 1, 6).contiguous()
    out, lse2 = _flash_mla.sparse_attention_forward_flash_mla(q, kv, idx, None, 0.05, 512, 9)
    clean = torch.where((idx >= 0) & (idx < 4), idx, -1)
    want_out, want_lse = ref.sparse_attention_forward_reference(q, kv, clean, 0.05, 512, None)
    assert_close(out, want_out, name="out")
    assert_close(lse2 * math.log(2), want_lse, name="lse")


def test_support_rules_and_head_padding():
    assert _flash_mla.flash_mla_supports(9, 64, 1, 576, 512)
    assert _flash_mla.flash_mla_supports(10, 128, 1, 512, 512)
    assert not _flash_mla.flash_mla_supports(8, 64, 1, 576, 512)
    assert not _flash_mla.flash_mla_supports(9, 64, 2, 576, 512)
    assert not _flash_mla.flash_mla_supports(9, 64, 1, 576, 256)
    assert not _flash_mla.flash_mla_supports(9, 256, 1, 576, 512)
    assert [_flash_mla.padded_heads(h, 9) for h in (1, 64, 65, 128)] == [64, 64, 128, 128]
    assert _flash_mla.padded_heads(8, 10) == 128


@pytest.mark.gpu
def test_real_flash_mla_against_reference():
    if not _flash_mla.flash_mla_importable():
        pytest.skip("flash_mla is not importable on this machine (optional backend)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 64, 16, 576, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(2, 128, 1, 576, device="cuda", generator=gen).bfloat16()
    idx = torch.randint(-1, 128, (2, 64, 1, 200), device="cuda", generator=gen, dtype=torch.int32)
    sink = torch.randn(16, device="cuda", generator=gen)
    major = torch.cuda.get_device_capability()[0]
    out, lse2 = _flash_mla.sparse_attention_forward_flash_mla(q, kv, idx, sink, 0.04, 512, major)
    want_out, want_lse = ref.sparse_attention_forward_reference(q, kv, idx, 0.04, 512, sink)
    assert_close(out, want_out, name="out")
    assert_close(lse2 * math.log(2), want_lse, name="lse")
