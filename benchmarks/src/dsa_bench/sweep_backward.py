"""Sweep of the TileLang sparse-attention backward tilings on one GPU (rows for CONFIG_TABLE).

    python benchmarks/sweep_sparse_backward.py [--tokens 16384] [--out DIR] [--quick]

For each model shape and TP-local head count, every candidate tiling that fits the shared
memory of sm_90 (``block_i`` x ``num_stages`` x ``split_store`` x ``dkv_reduce`` x threads) is
compiled up front (nvcc runs in parallel) and its backward alone is timed on the benchmark's
causal indices (``dsa_sparse_attention.bench.benchmark_indices``), from the TileLang forward's
``out`` and lse. dq / dkv of every candidate are compared with the default tiling's (rel_diff;
the reference check itself is in the gpu tests, at small sizes). Prints one table and the best
candidate per shape; writes ``sparse_backward_sweep.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import itertools
import os
from pathlib import Path

import torch
from dsa_sparse_attention._tilelang import backward as bw
from dsa_sparse_attention._tilelang.forward import sparse_attention_forward_tilelang
from dsa_sparse_attention.bench import benchmark_indices
from dsa_sparse_attention.models import MODELS
from dsa_sparse_attention.reference import default_sm_scale
from kernel_common.testing import rel_diff
from kernel_common.timing import cuda_time_ms

# (model, TP) pairs: every TP-local head count of the table's Hopper rows, both widths.
SHAPES = [("glm5", 1), ("glm5", 2), ("glm5", 4), ("glm5", 8), ("dsv4.1-flash-r1", 1)]


def candidates(hg: int, dim: int, d_v: int, quick: bool) -> list[dict]:
    """Tilings that compile for `hg` heads per group: the default first."""
    block_i, stages, split = bw.default_tiling(hg)
    default = dict(block_i=block_i, num_stages=stages, split_store=split, dkv_reduce="tma")
    default["threads"] = bw.default_threads(hg)
    grid = itertools.product(
        (16, 32, 64),
        (1, 2) if quick else (1, 2, 3),
        (2, 4),
        ("tma", "atomic"),
        (128, 256, 512),
    )
    out = [default]
    for block_i, stages, split, reduce, threads in grid:
        spec = dict(
            block_i=block_i,
            num_stages=stages,
            split_store=split,
            dkv_reduce=reduce,
            threads=threads,
        )
        max_warps = bw.head_block(hg) // 16 * (block_i // 8)
        smem = bw.shared_memory_bytes(
            hg, dim, d_v, block_i=block_i, num_stages=stages, split_store=split, dkv_reduce=reduce
        )
        if spec == default or threads // 32 > max_warps or smem > bw.SHARED_MEMORY_LIMIT:
            continue
        # Threads beyond what a head block can use, or below a warpgroup per 32 head rows,
        # are known losers; keep the grid to what one GPU call can time.
        if threads < bw.default_threads(hg) or (threads == 512 and bw.head_block(hg) < 64):
            continue
        out.append(spec)
    return out


def time_shape(model, tp: int, args, failed: dict, device) -> list[dict]:
    """Backward ms of every candidate for one shape, and its rel_diff to the default's."""
    heads, s = model.local_heads(tp), args.tokens
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, heads, model.d_qk, device=device, generator=gen).bfloat16()
    kv = torch.randn(1, s * model.kv_ratio, 1, model.d_qk, device=device, generator=gen)
    kv = kv.bfloat16()
    do = torch.randn(1, s, heads, model.d_v, device=device, generator=gen).bfloat16()
    sink = torch.randn(heads, device=device, generator=gen) if model.sink else None
    idx = benchmark_indices(s, model.kv_ratio, model.topk, device, gen)
    scale = default_sm_scale(model.d_qk)
    out, lse2 = sparse_attention_forward_tilelang(q, kv, idx, sink, scale, model.d_v)
    rows, base = [], None
    for spec in candidates(heads, model.d_qk, model.d_v, args.quick):
        row = dict(model=model.name, tp=tp, heads=heads, tokens=s, **spec)
        key = (model.name, tp, repr(spec))
        if key in failed:
            rows.append(row | dict(bwd_ms=None, note=failed[key]))
            print(rows[-1], flush=True)
            continue

        def run(spec=spec):
            return bw.sparse_attention_backward_tilelang(
                do, None, q, kv, idx, out, lse2, sink, scale, model.d_v, **spec
            )

        grads = run()
        base = grads if base is None else base
        ms = cuda_time_ms(run, warmup=2, rep=args.rep)
        row |= dict(
            bwd_ms=round(ms, 3),
            rd_dq=f"{rel_diff(grads[0], base[0]):.1e}",
            rd_dkv=f"{rel_diff(grads[1], base[1]):.1e}",
            note="default" if grads is base else "",
        )
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--shapes", default=None, help="e.g. glm5:1,glm5:8 (default: all)")
    parser.add_argument("--rep", type=int, default=5)
    args = parser.parse_args()
    shapes = (
        [(m, int(tp)) for m, tp in (s.split(":") for s in args.shapes.split(","))]
        if args.shapes
        else SHAPES
    )
    device = torch.device("cuda")
    jobs = []
    for name, tp in shapes:
        model = MODELS[name]
        hg = model.local_heads(tp)
        for spec in candidates(hg, model.d_qk, model.d_v, args.quick):
            jobs.append((name, tp, spec))
    # Compile everything first: nvcc runs as a subprocess, so threads overlap the compiles.
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        futures = {}
        for name, tp, spec in jobs:
            model = MODELS[name]
            kwargs = dict(
                heads=model.local_heads(tp),
                groups=1,
                dim=model.d_qk,
                d_v=model.d_v,
                topk=model.topk,
                **spec,
            )
            futures[(name, tp, repr(spec))] = pool.submit(bw.compile_backward, **kwargs)
        failed = {}
        for key, fut in futures.items():
            try:
                fut.result()
            except Exception as exc:  # a candidate that does not build is reported, not fatal
                failed[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
    print(f"compiled {len(jobs) - len(failed)} of {len(jobs)} candidates", flush=True)

    rows = []
    for name, tp in shapes:
        rows += time_shape(MODELS[name], tp, args, failed, device)
        torch.cuda.empty_cache()

    args.out.mkdir(parents=True, exist_ok=True)
    fields = [*dict.fromkeys(k for r in rows for k in r)]
    with open(args.out / "sparse_backward_sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)
    print("\nbest per shape (backward ms):")
    for name, tp in shapes:
        timed = [r for r in rows if r["model"] == name and r["tp"] == tp and r["bwd_ms"]]
        default = next(r for r in timed if r["note"] == "default")
        best = min(timed, key=lambda r: r["bwd_ms"])
        spec = {k: best[k] for k in ("block_i", "num_stages", "split_store", "dkv_reduce")}
        print(
            f"{name} TP{tp} ({best['heads']} heads): default {default['bwd_ms']} ms, "
            f"best {best['bwd_ms']} ms with {spec} threads={best['threads']}"
        )


if __name__ == "__main__":
    main()
