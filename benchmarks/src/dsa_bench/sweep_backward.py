"""Sweep of the TileLang sparse-attention backward tilings on one GPU (rows for CONFIG_TABLE).

    python -m dsa_bench.sweep_backward [--tokens 16384] [--out DIR] [--quick] [--shapes glm5:8]
        [--deterministic]

For each model shape and TP-local head count, every candidate tiling (``block_i`` x
``num_stages`` x ``split_store`` x ``dkv_reduce``) that the backward kernels accept for the
shape (``check_backward_config``: shared memory of sm_90, warps per score tile) is compiled up
front (nvcc runs in parallel) and its backward alone is timed on the benchmark's causal indices
(:func:`dsa_bench.sparse_attention.benchmark_indices`), from the TileLang forward's ``out`` and
lse. The table row of ``dsa_sparse_attention.config.CONFIG_TABLE`` for the shape is the
default, timed first; dq / dkv of every candidate are compared with the default's (rel_diff;
the reference check itself is in the gpu tests, at small sizes). Threads per program follow
from the head count (``program_threads``; the ``threads`` column). Prints one table and the
best candidate per shape; writes ``sparse_backward_sweep.csv`` (``--deterministic``: every
candidate in deterministic mode, ``sparse_backward_sweep_deterministic.csv``) under ``--out``
(default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
from pathlib import Path

import torch
from dsa_sparse_attention._tilelang import backward as bw
from dsa_sparse_attention._tilelang import sparse_attention_forward_tilelang
from dsa_sparse_attention.config import CONFIG_TABLE, SparseAttentionConfig
from kernel_common import device_arch, tilelang_target
from kernel_common.testing import rel_diff

from dsa_bench import common
from dsa_bench.models import MODELS, ModelShape
from dsa_bench.sparse_attention import benchmark_indices

# (model, TP) pairs: every TP-local head count of the table's Hopper rows, both widths.
SHAPES = [("glm5", 1), ("glm5", 2), ("glm5", 4), ("glm5", 8), ("dsv4.1-flash-r1", 1)]
TILING = ("block_i", "num_stages", "split_store", "dkv_reduce", "deterministic")
COLUMNS = [
    "model",
    "tp",
    "heads",
    "tokens",
    *TILING,
    "threads",
    "bwd_ms",
    "rd_dq",
    "rd_dkv",
    "note",
]


def table_row(model: ModelShape, tp: int, deterministic: bool = False) -> SparseAttentionConfig:
    """The config table's row for this shape on the current GPU, in the given mode."""
    return CONFIG_TABLE.lookup(
        arch_major=device_arch().major,
        rope_tail=model.d_qk > model.d_v,
        heads=model.local_heads(tp),
        topk=model.topk,
        deterministic=deterministic,
    ).config


def candidates(model: ModelShape, tp: int, quick: bool, deterministic: bool) -> list[dict]:
    """Tilings the backward accepts for this shape in the given mode: the table row's first."""
    hg, dim, d_v = model.local_heads(tp), model.d_qk, model.d_v
    row = table_row(model, tp, deterministic)
    default = dict(
        block_i=row.backward_block_i,
        num_stages=row.backward_stages,
        split_store=row.split_store,
        dkv_reduce=row.dkv_reduce,
        deterministic=deterministic,
    )
    stages = (1, 2) if quick else (1, 2, 3)
    grid = itertools.product((16, 32, 64), stages, (2, 4), ("tma", "atomic"), (deterministic,))
    out = [default]
    for values in grid:
        spec = dict(zip(TILING, values, strict=True))
        if spec == default:
            continue
        try:
            bw.check_backward_config(hg, 1, dim, d_v, *values)
        except ValueError:  # too much shared memory, or too few keys per warp
            continue
        out.append(spec)
    return out


def time_shape(model: ModelShape, tp: int, args, failed: dict, device) -> list[dict]:
    """Backward ms of every candidate for one shape, and its rel_diff to the default's."""
    heads, s = model.local_heads(tp), args.tokens
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, s, heads, model.d_qk, device=device, generator=gen).bfloat16()
    kv = torch.randn(1, s * model.kv_ratio, 1, model.d_qk, device=device, generator=gen)
    kv = kv.bfloat16()
    do = torch.randn(1, s, heads, model.d_v, device=device, generator=gen).bfloat16()
    sink = torch.randn(heads, device=device, generator=gen) if model.sink else None
    idx = benchmark_indices(s, model.kv_ratio, model.topk, device, gen)
    scale = 1.0 / model.d_qk**0.5
    row_cfg = table_row(model, tp)
    out, lse2 = sparse_attention_forward_tilelang(
        q,
        kv,
        idx,
        sink,
        scale,
        model.d_v,
        block_i=row_cfg.forward_block_i,
        num_stages=row_cfg.forward_stages,
    )
    rows, base = [], None
    for i, spec in enumerate(candidates(model, tp, args.quick, args.deterministic)):
        row = dict(model=model.name, tp=tp, heads=heads, tokens=s, **spec)
        row["threads"] = bw.program_threads(heads)
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
        if base is None:
            base = grads  # the table row's (or, if it did not build, the first that did)
        ms = common.time_ms(run, warmup=2, rep=args.rep)
        row |= dict(
            bwd_ms=round(ms, 3),
            rd_dq=f"{rel_diff(grads[0], base[0]):.1e}",
            rd_dkv=f"{rel_diff(grads[1], base[1]):.1e}",
            note="default" if i == 0 else "",
        )
        rows.append(row)
        print(row, flush=True)
    return rows


def shape_arg(text: str) -> tuple[str, int]:
    """argparse type: ``model:tp`` with a known model and a TP size dividing its heads."""
    name, sep, tp_text = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected model:tp, got {text!r}")
    common.one_of(list(MODELS), "model")(name)
    tp = common.positive_int(tp_text)
    if MODELS[name].heads % tp:
        raise argparse.ArgumentTypeError(
            f"TP {tp} does not divide the {MODELS[name].heads} heads of {name}"
        )
    return name, tp


def main(argv=None) -> None:
    parser = common.ArgumentParser(
        prog="python -m dsa_bench.sweep_backward", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tokens", type=common.positive_int, default=16384)
    parser.add_argument(
        "--out",
        type=Path,
        default=common.RESULTS_DIR,
        help="folder of sparse_backward_sweep.csv (default: benchmarks/results)",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument(
        "--shapes",
        type=common.comma_list(shape_arg),
        default=None,
        help="model:tp pairs, e.g. glm5:1,glm5:8 (default: all)",
    )
    parser.add_argument("--rep", type=common.positive_int, default=5)
    parser.add_argument(
        "--deterministic", action="store_true", help="sweep the deterministic mode's tilings"
    )
    args = parser.parse_args(argv)
    common.require_cuda("dsa_bench.sweep_backward")
    shapes = args.shapes or SHAPES
    device = torch.device("cuda")
    target = tilelang_target(device_arch(device))["arch"]
    jobs = []
    for name, tp in shapes:
        for spec in candidates(MODELS[name], tp, args.quick, args.deterministic):
            jobs.append((name, tp, spec))
    # Compile everything first: nvcc runs as a subprocess, so threads overlap the compiles.
    with concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        futures = {}
        for name, tp, spec in jobs:
            model = MODELS[name]
            futures[(name, tp, repr(spec))] = pool.submit(
                bw.compile_backward,
                model.local_heads(tp),
                1,
                model.d_qk,
                model.d_v,
                model.topk,
                **spec,
                target=target,
            )
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

    stem = "sparse_backward_sweep" + ("_deterministic" if args.deterministic else "")
    path = common.write_csv(rows, args.out / f"{stem}.csv", COLUMNS)
    print(f"\nwrote {path}")
    common.print_table(rows, COLUMNS)
    print("\nbest per shape (backward ms):")
    for name, tp in shapes:
        timed = [r for r in rows if r["model"] == name and r["tp"] == tp and r["bwd_ms"]]
        if not timed:
            print(f"{name} TP{tp}: no candidate ran")
            continue
        default = next((r for r in timed if r["note"] == "default"), None)
        best = min(timed, key=lambda r: r["bwd_ms"])
        spec = {k: best[k] for k in TILING}
        print(
            f"{name} TP{tp} ({best['heads']} heads): "
            f"default {default['bwd_ms'] if default else 'did not build'} ms, "
            f"best {best['bwd_ms']} ms with {spec} threads={best['threads']}"
        )


if __name__ == "__main__":
    main()
