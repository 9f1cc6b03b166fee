"""Triton sparse-attention forward (keys on the M side, for few heads per kv group).

CPU: the widths and launches it runs (each launch compiled for sm_90 within the shared-memory
limit), the kernel under the Triton interpreter against the fp32 reference (RoPE width,
groups, sinks, rows without a key, out-of-range indices, duplicates, a second and partial head
block, partly padded last blocks). GPU: the kernel against the fp32 reference at the model
shapes and every padding pattern, any scale, no recompilation across lengths, CUDA-graph
replays (the entry with this forward: test_sparse_attention_api)."""

import math

import pytest
import torch
from dsa_sparse_attention import reference
from dsa_sparse_attention._triton import forward
from dsa_sparse_attention._triton.forward import forward_supports, head_block
from dsa_sparse_attention._triton.probs import split_width
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LN2, LOG2E
from kernel_common.testing import assert_close
from support import (
    as_padding,
    attention_indices,
    attention_inputs,
    check_graph_replays,
    compile_for_sm90,
    interp_only,
    not_interpreted,
    run_interpreted,
    seeded_gen,
)


def test_widths_and_head_blocks():
    assert forward_supports(576, 512) and forward_supports(512, 512) and forward_supports(192, 128)
    assert forward_supports(640, 512) and not forward_supports(576, 448)
    assert not forward_supports(704, 512)  # 512 + 192: the tail is no power of two
    assert not forward_supports(100, 64)
    assert [head_block(h) for h in (1, 8, 16, 20, 32, 64, 128)] == [16, 16, 16, 32, 32, 64, 64]


# (D, heads per group, shared memory limit): the model widths at one head block of 16, 32 and
# 64, a wide row, and a 99 KiB device (sm_89, sm_120).
_LAUNCH_CASES = [
    (576, 8, HOPPER_SMEM_PER_BLOCK),
    (576, 32, HOPPER_SMEM_PER_BLOCK),
    (576, 64, HOPPER_SMEM_PER_BLOCK),
    (512, 16, HOPPER_SMEM_PER_BLOCK),
    (1024, 8, HOPPER_SMEM_PER_BLOCK),
    (576, 8, 99 * 1024),
]


@pytest.mark.parametrize("d,hg,limit", _LAUNCH_CASES, ids=str)
def test_launch_fits(d, hg, limit):
    """The chosen launch compiled for sm_90 with 16-byte-aligned pointers (as Triton specialises
    them at run time: what makes the key loads staged cp.async copies) takes no more shared
    memory than launch_config estimates, which is within the limit (no GPU)."""
    block_k, stages = forward.launch_config(d, hg, limit)
    pointers = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32"}
    signature = {**pointers, "out_ptr": "*bf16", "lse_ptr": "*fp32"}
    signature.update(S="i32", S_kv="i32", TOPK="i32", scale2="fp32")
    d_main, d_tail = split_width(d)
    constexprs = dict(G=1, HG=hg, D=d, D_MAIN=d_main, D_TAIL=d_tail, HB=forward.head_block(hg))
    constexprs.update(BLOCK_K=block_k, HAS_SINK=True, DOT_FP32=False, LOG2E_=LOG2E)
    compiled = compile_for_sm90(
        forward._forward_kernel,
        signature,
        constexprs,
        num_warps=forward.num_warps(hg),
        num_stages=stages,
    )
    estimate = forward.shared_memory_bytes(d, hg, block_k, stages)
    assert 0 < compiled.metadata.shared <= estimate <= limit
    assert "wgmma" in compiled.asm["ptx"], "O^T += V^T P^T must be a wgmma"


# (b, s, s_kv, heads, groups, d, d_v, topk, sink, pattern)
INTERP_CASES = [
    (1, 4, 150, 8, 1, 576, 512, 140, False, "shuffled"),  # glm5's width, a partial 3rd block
    (2, 3, 30, 16, 2, 192, 128, 20, True, "empty_rows"),  # groups, sink, rows without a key
    (1, 4, 20, 4, 1, 80, 64, 9, False, "empty_rows"),  # rows without a key or a sink
    (1, 4, 200, 20, 1, 80, 64, 150, True, "out_of_range"),
    (1, 3, 10, 8, 1, 512, 512, 16, False, "duplicates"),  # no tail, one block
    (1, 3, 40, 80, 1, 80, 64, 17, False, "tail"),  # a second, partial head block
]


@not_interpreted
def test_interpreter_run():
    run_interpreted(__file__)


@interp_only
@pytest.mark.parametrize("case", INTERP_CASES, ids=str)
def test_cpu_interp_kernel(case):
    from dsa_sparse_attention._triton.forward import sparse_attention_forward_triton

    b, s, s_kv, heads, groups, d, d_v, topk, sink, pattern = case
    gen = seeded_gen("triton forward", case)
    q, kv, attn_sink = attention_inputs(b, s, s_kv, heads, groups, d, gen, sink=sink)
    idx = attention_indices(b, s, groups, topk, s_kv, pattern, gen)
    scale = 1 / math.sqrt(d)
    out, lse2 = sparse_attention_forward_triton(q, kv, idx, attn_sink, scale, d_v)
    ref_out, ref_lse = reference.sparse_attention_forward_reference(
        q, kv, as_padding(idx, s_kv), scale, d_v, attn_sink
    )
    assert_close(out.float(), ref_out.float(), name="out")
    assert_close(lse2 * LN2, ref_lse, name="lse")
    empty = (as_padding(idx, s_kv) < 0).all(dim=-1).repeat_interleave(heads // groups, dim=2)
    assert bool((out[empty] == 0).all()), "a row without a key must give exactly 0"


# ----------------------------------------------------------------------------------------------
# GPU: the kernel against the fp32 reference.

# (heads, groups, D, topk, sink, B, S, S_kv, pattern): glm5 at TP 8 / 4 / 2 (576, 2048),
# glm5.3-flash (2112: a partial last block) with and without the tail, dsv4.1-flash (512, 640,
# sink, S_kv = 2 S), kv groups, a second and partial head block, every padding pattern.
GPU_CASES = [
    (8, 1, 576, 2048, False, 1, 300, 2400, "causal"),
    (16, 1, 576, 2048, False, 2, 64, 128, "tail"),
    (32, 1, 576, 2048, False, 1, 96, 3000, "out_of_range"),
    (8, 1, 576, 2112, False, 1, 64, 2500, "empty_rows"),
    (8, 1, 512, 2112, False, 1, 64, 1000, "duplicates"),
    (8, 1, 512, 640, True, 1, 128, 256, "causal"),
    (8, 1, 512, 640, True, 2, 48, 96, "empty_rows"),
    (16, 2, 576, 128, True, 2, 40, 80, "shuffled"),
    (64, 1, 576, 2048, False, 1, 64, 2200, "mixed"),
    (96, 1, 576, 640, True, 1, 40, 900, "out_of_range"),
    (4, 1, 576, 1, False, 1, 16, 30, "shuffled"),
]


def _gpu_inputs(case, seed):
    heads, groups, dim, topk, sink, b, s, s_kv, pattern = case
    gen = seeded_gen("triton forward gpu", case, seed)
    q, kv, attn_sink = attention_inputs(b, s, s_kv, heads, groups, dim, gen, sink=sink)
    idx = attention_indices(b, s, groups, topk, s_kv, pattern, gen)
    return q.cuda(), kv.cuda(), idx.cuda(), attn_sink.cuda() if sink else None


def _check_against_reference(q, kv, idx, attn_sink, name, sm_scale=None):
    from dsa_sparse_attention._triton.forward import sparse_attention_forward_triton

    dim = q.shape[-1]
    scale = 1 / math.sqrt(dim) if sm_scale is None else sm_scale
    out, lse2 = sparse_attention_forward_triton(q, kv, idx, attn_sink, scale, 512)
    ref_idx = as_padding(idx, kv.shape[1])
    ref_out, ref_lse = reference.sparse_attention_forward_reference(
        q, kv, ref_idx, scale, 512, attn_sink
    )
    torch.cuda.synchronize()
    assert_close(out.float(), ref_out.float(), name=f"out {name}")
    assert_close(lse2 * LN2, ref_lse, name=f"lse {name}")
    heads, groups = q.shape[2], kv.shape[2]
    empty = (ref_idx < 0).all(dim=-1).repeat_interleave(heads // groups, dim=2)
    assert bool((out[empty] == 0).all()), "a row without a key must give exactly 0"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "launch", sorted(set().union(*forward._LAUNCHES.values())), ids=lambda x: f"bk{x[0]}-st{x[1]}"
)
@pytest.mark.parametrize("i", range(len(GPU_CASES)), ids=["-".join(map(str, c)) for c in GPU_CASES])
def test_gpu_matches_reference(i, launch, monkeypatch):
    """Every case at every launch ``launch_config`` may choose (the first that fits the device:
    the others run where shared memory is smaller), where it fits a Hopper."""
    heads, groups, dim = GPU_CASES[i][:3]
    if forward.shared_memory_bytes(dim, heads // groups, *launch) <= HOPPER_SMEM_PER_BLOCK:
        monkeypatch.setattr(forward, "launch_config", lambda *_: launch)
    _check_against_reference(*_gpu_inputs(GPU_CASES[i], 0), name=f"{GPU_CASES[i]} {launch}")


@pytest.mark.gpu
@pytest.mark.parametrize("sm_scale", [0.0, -0.04, 0.2])
def test_gpu_any_scale(sm_scale):
    """The running maximum is taken over scaled logits: zero and negative scales work too."""
    case = GPU_CASES[7]
    _check_against_reference(*_gpu_inputs(case, 1), name=f"scale {sm_scale}", sm_scale=sm_scale)


@pytest.mark.gpu
def test_gpu_new_lengths_do_not_recompile():
    """Batch, S, S_kv and topk are not specialised on: three shapes, one compiled kernel."""
    from dsa_sparse_attention._triton.forward import _forward_kernel

    case = (8, 1, 576, 2048, False)
    _check_against_reference(*_gpu_inputs((*case, 1, 33, 100, "tail"), 1), name="first")
    compiled = _forward_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    _check_against_reference(*_gpu_inputs((*case, 2, 64, 4096, "shuffled"), 2), name="second")
    _check_against_reference(
        *_gpu_inputs((8, 1, 576, 1000, False, 3, 17, 2500, "mixed"), 3), name="third"
    )
    assert len(compiled) == before


@pytest.mark.gpu
def test_gpu_graph_replays():
    """Under CUDA-graph capture: each replay with new q and kv matches an eager call."""
    from dsa_sparse_attention._triton.forward import sparse_attention_forward_triton

    q, kv, idx, sink = _gpu_inputs(GPU_CASES[5], 4)

    def run(q, kv):
        return sparse_attention_forward_triton(q, kv, idx, sink, 0.05, 512)[0]

    gen = seeded_gen("triton forward graph")
    inputs = [
        (torch.randn(q.shape, generator=gen).to(q), torch.randn(kv.shape, generator=gen).to(kv))
        for _ in range(3)
    ]
    check_graph_replays(run, inputs, run)
