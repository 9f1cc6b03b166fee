"""The gather floor of sparse attention: reading each query's selected K/V rows once, nothing else.

    python -m dsa_bench.gather_floor [--tokens 16384] [--topk 2048] [--dim 576] [--out DIR]

Every sparse-attention kernel here (forward, backward, ``sparse_attention_probs``) and
FlashMLA's forward fetch, per query and kv group, ``topk`` rows of ``D`` bf16 values chosen by
the indices: 2048 x 1152 B = 2.4 MB per query at glm5, 38.6 GB at 16k tokens. The whole kv
(19 MB at 16k) fits in L2, so this is L2 -> SM traffic, and at 8 and 16 heads, where the
MMAs are 8x / 4x smaller than at 64, it bounds those kernels. This times a Triton kernel that
does only that gather (one program per query, ``block_k`` rows per step, pipelined loads, an
fp32 sum so that nothing is optimised away) over a small grid of launch settings, on two index
patterns of the same length:

* ``causal``: the benchmark's indices (:func:`dsa_bench.sparse_attention.benchmark_indices`,
  -1 where the causal window is shorter than topk; -1 rows are not read);
* ``contiguous``: query t reads rows ``t % (S - topk) ... + topk`` in order, the best case of
  the same byte count (each step reads contiguous memory).

On Hopper, where ``nvcc`` is found (``CUDA_HOME`` or ``PATH``), it also times the same gather
through the copy engine (``gather_copy.cu``, built here for sm_90a): one ``cp.async.bulk`` per
row (``bulk``), and 1-row x 64-column tensor copies with the 128-byte swizzle that a wgmma
operand needs (``tensor``), both into a ring of shared-memory stages, one warp per query.

Prints the best time per pattern and method and the bytes per second it implies; writes
``gather_floor.csv`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl

from dsa_bench import common

COLUMNS = [
    "pattern", "method", "tokens", "topk", "dim", "block_k", "warps", "stages", "ms", "tb_per_s"
]  # fmt: skip
# The copy-engine kernels: (rows per stage, stages), as gather_copy.cu instantiates them.
COPY_LAUNCHES = ((8, 2), (8, 4), (16, 2), (16, 4), (32, 2), (32, 3))


@triton.jit
def _gather_sum_kernel(
    kv_ptr,
    idx_ptr,
    out_ptr,
    s_kv,
    TOPK: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[q] = sum of every value of the kv rows that query q selects (-1 / out of range:
    skipped). The row width is D_MAIN + D_TAIL (both powers of two; the tail may be 0)."""
    q = tl.program_id(0).to(tl.int64)
    width = D_MAIN + D_TAIL
    main = tl.arange(0, D_MAIN)
    acc = tl.zeros([BLOCK_K, D_MAIN], dtype=tl.float32)
    if D_TAIL > 0:
        tail = tl.arange(0, D_TAIL)
        acc_tail = tl.zeros([BLOCK_K, D_TAIL], dtype=tl.float32)
    for k0 in range(0, TOPK, BLOCK_K):
        slot = k0 + tl.arange(0, BLOCK_K)
        row = tl.load(idx_ptr + q * TOPK + slot, mask=slot < TOPK, other=-1)
        valid = (row >= 0) & (row < s_kv)
        base = kv_ptr + row.to(tl.int64)[:, None] * width
        acc += tl.load(base + main[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        if D_TAIL > 0:
            acc_tail += tl.load(base + D_MAIN + tail[None, :], mask=valid[:, None], other=0.0).to(
                tl.float32
            )
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    if D_TAIL > 0:
        total += tl.sum(tl.sum(acc_tail, axis=1), axis=0)
    tl.store(out_ptr + q, total)


def split_width(dim: int) -> tuple[int, int]:
    """(main, tail) powers of two with main + tail = dim (tail 0 when dim is one)."""
    main = 1 << (dim.bit_length() - 1)
    tail = dim - main
    if tail & (tail - 1):
        raise ValueError(f"dim = {dim} must be a power of two or the sum of two")
    return main, tail


def gather_sum(
    kv: torch.Tensor, idx: torch.Tensor, *, block_k: int = 32, warps: int = 8, stages: int = 3
) -> torch.Tensor:
    """fp32 ``[S]``: for each query row of ``idx`` ``[S, topk]`` (int32), the sum of the
    ``kv`` ``[S_kv, D]`` rows it selects (entries outside ``[0, S_kv)`` select nothing)."""
    s, topk = idx.shape
    main, tail = split_width(kv.shape[1])
    out = torch.empty(s, dtype=torch.float32, device=kv.device)
    _gather_sum_kernel[(s,)](
        kv,
        idx,
        out,
        kv.shape[0],
        TOPK=topk,
        D_MAIN=main,
        D_TAIL=tail,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def gather_copy(
    lib: ctypes.CDLL, kv: torch.Tensor, idx: torch.Tensor, *, tensor: bool, rows: int, stages: int
) -> torch.Tensor:
    """fp32 ``[S]``: for each query row of ``idx`` ``[S, topk]`` (int32), the sum of column 0 of
    the ``kv`` ``[S_kv, D]`` (bf16, D a multiple of 64) rows it selects, gathered through the
    copy engine (``tensor``: swizzled 64-column tensor copies, else one bulk copy per row)."""
    s, topk = idx.shape
    out = torch.empty(s, dtype=torch.float32, device=kv.device)
    ptr = ctypes.c_void_p
    stream = ptr(torch.cuda.current_stream(kv.device).cuda_stream)
    args = (int(tensor), rows, stages, ptr(kv.data_ptr()), ptr(idx.data_ptr()))
    args += (ptr(out.data_ptr()), s, kv.shape[0], topk, kv.shape[1], stream)
    code = lib.gather_copy(*args)
    if code:
        raise RuntimeError(f"gather_copy({tensor=}, {rows=}, {stages=}) returned {code}")
    return out


def indices(pattern: str, s: int, topk: int, device, gen) -> torch.Tensor:
    if pattern == "causal":
        from dsa_bench.sparse_attention import benchmark_indices

        return benchmark_indices(s, 1, topk, device, gen)[0, :, 0].contiguous()
    start = torch.arange(s, device=device, dtype=torch.int32) % max(1, s - topk)
    return (start[:, None] + torch.arange(topk, device=device, dtype=torch.int32)).contiguous()


def main(argv=None) -> None:
    parser = common.ArgumentParser(
        prog="python -m dsa_bench.gather_floor", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tokens", type=common.positive_int, default=16384)
    parser.add_argument("--topk", type=common.positive_int, default=2048)
    parser.add_argument("--dim", type=common.positive_int, default=576)
    parser.add_argument("--rep", type=common.positive_int, default=10)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.tokens <= args.topk:
        parser.error(f"--tokens {args.tokens} must exceed --topk {args.topk}")
    common.require_cuda("dsa_bench.gather_floor")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(args.tokens, args.dim, device=device, generator=gen).bfloat16()

    def record(pattern, method, block_k, warps, stages, ms) -> dict:
        row = dict(pattern=pattern, method=method, tokens=args.tokens, topk=args.topk)
        row |= dict(dim=args.dim, block_k=block_k, warps=warps, stages=stages, ms=round(ms, 3))
        row["tb_per_s"] = round(valid * args.dim * kv.element_size() / ms / 1e9, 2)
        print(row, flush=True)
        return row

    hopper = torch.cuda.get_device_capability(device) == (9, 0)
    lib = "not Hopper or D % 64"
    if hopper and args.dim % 64 == 0:
        lib = common.cuda_library("gather_copy.cu")
    if isinstance(lib, str):
        print(f"skip: the copy-engine gathers ({lib})", flush=True)
    rows = []
    for pattern in ("causal", "contiguous"):
        idx = indices(pattern, args.tokens, args.topk, device, gen)
        valid = int(((idx >= 0) & (idx < args.tokens)).sum())
        few = idx[:64]  # the check: the first 64 queries against torch
        want = kv.float()[few.clamp(min=0).long()].mul_((few >= 0)[..., None]).sum(dim=(1, 2))
        for block_k, warps, stages in itertools.product((16, 32, 64), (4, 8), (2, 3, 4)):
            run = functools.partial(
                gather_sum, kv, idx, block_k=block_k, warps=warps, stages=stages
            )
            try:
                got = run()
            except triton.runtime.errors.OutOfResources:
                continue
            torch.testing.assert_close(got[:64], want, rtol=1e-4, atol=1e-2)
            ms = common.time_ms(run, warmup=2, rep=args.rep, device=device)
            rows.append(record(pattern, "triton", block_k, warps, stages, ms))
        if isinstance(lib, str):
            continue
        want0 = kv[:, 0].float()[few.clamp(min=0).long()].mul_(few >= 0).sum(dim=1)
        for tensor, (block, stages) in itertools.product((False, True), COPY_LAUNCHES):
            run = functools.partial(
                gather_copy, lib, kv, idx, tensor=tensor, rows=block, stages=stages
            )
            torch.testing.assert_close(run()[:64], want0, rtol=1e-4, atol=1e-2)
            ms = common.time_ms(run, warmup=2, rep=args.rep, device=device)
            rows.append(record(pattern, "tensor" if tensor else "bulk", block, 1, stages, ms))
    common.print_table(rows, COLUMNS)
    for pattern, method in itertools.product(
        ("causal", "contiguous"), ("triton", "bulk", "tensor")
    ):
        timed = [r for r in rows if r["pattern"] == pattern and r["method"] == method]
        if timed:
            best = min(timed, key=lambda r: r["ms"])
            print(f"best {pattern} {method}: {best['ms']} ms, {best['tb_per_s']} TB/s ({best})")
    print(f"wrote {common.write_csv(rows, args.out / 'gather_floor.csv', COLUMNS)}")


if __name__ == "__main__":
    main()
