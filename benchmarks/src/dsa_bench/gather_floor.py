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

Prints the best time per pattern and the bytes per second it implies; writes
``gather_floor.csv`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl

from dsa_bench import common

COLUMNS = ["pattern", "tokens", "topk", "dim", "block_k", "warps", "stages", "ms", "tb_per_s"]


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
            row = dict(pattern=pattern, tokens=args.tokens, topk=args.topk, dim=args.dim)
            row |= dict(block_k=block_k, warps=warps, stages=stages, ms=round(ms, 3))
            row["tb_per_s"] = round(valid * args.dim * kv.element_size() / ms / 1e9, 2)
            rows.append(row)
            print(row, flush=True)
    common.print_table(rows, COLUMNS)
    for pattern in ("causal", "contiguous"):
        best = min((r for r in rows if r["pattern"] == pattern), key=lambda r: r["ms"])
        print(f"best {pattern}: {best['ms']} ms, {best['tb_per_s']} TB/s ({best})")
    print(f"wrote {common.write_csv(rows, args.out / 'gather_floor.csv', COLUMNS)}")


if __name__ == "__main__":
    main()
