"""``dsa-bench``: sparse attention at the model configurations, forward and forward+backward.

For each model x TP size x length it builds the benchmark inputs (per query, random scores over
its causal window selected by :func:`topk.ranged_topk`, -1 where the window is shorter than
topk), times the forward and forward+backward of :func:`sparse_attention`, and checks precision
against the fp32 torch reference up to ``--check-max-tokens``. Without a GPU it runs a small
default on the torch backend (and says so), checking it against the float64 reference.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from kernel_common import device_arch, tilelang_target
from kernel_common.testing import rel_diff
from topk import ranged_topk

from dsa_sparse_attention import reference
from dsa_sparse_attention._ops import forward_backend, resolve_config, sparse_attention
from dsa_sparse_attention.config import CONFIG_TABLE, FORWARD_BACKENDS
from dsa_sparse_attention.models import MODELS, ModelShape

QUICK_TOKENS = (4096, 16384)
ALL_TOKENS = (4096, 8192, 16384, 32768, 65536, 131072)
CPU_TOKENS = (256,)
COLUMNS = [
    "model",
    "tp",
    "heads",
    "tokens",
    "backend",
    "config",
    "fwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "fwd_bwd_tflops",
    "fwd_peak_pct",
    "rd_out",
    "rd_dq",
    "rd_dkv",
    "rd_dsink",
    "rd_vs_other_fwd",
]


def benchmark_indices(s: int, kv_ratio: int, topk: int, device, gen) -> torch.Tensor:
    """[1, S, 1, topk] int32: top-k of random scores over each query's causal window."""
    s_kv = s * kv_ratio
    out = torch.empty(s, topk, dtype=torch.int32, device=device)
    rows = max(1, (1 << 28) // s_kv)
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        scores = torch.rand(r1 - r0, s_kv, device=device, generator=gen)
        ends = (torch.arange(r0, r1, device=device, dtype=torch.int32) + 1) * kv_ratio
        out[r0:r1] = ranged_topk(scores, topk, None, ends)
    return out[None, :, None]


def flops(indices: torch.Tensor, heads: int, d_qk: int, d_v: int) -> tuple[float, float]:
    """Forward and backward FLOPs over valid (index != -1) pairs, as DESIGN.md counts them."""
    pairs = float((indices >= 0).sum()) * heads
    return pairs * 2 * (d_qk + d_v), pairs * 2 * (3 * d_qk + 2 * d_v)


def time_ms(fn, device: torch.device, warmup: int, rep: int) -> float:
    if device.type == "cuda":
        from kernel_common.timing import cuda_time_ms

        return cuda_time_ms(fn, warmup=warmup, rep=rep)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bf16_peak_tflops(device: torch.device) -> float | None:
    """The bf16 matmul ceiling of this GPU, measured now (8192^3 on random data)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device, 3, 10)
    return 2 * 8192**3 / ms / 1e9


def usable(backends: list[str], model: ModelShape, tp: int, device) -> list[str]:
    """The requested forward backends that really run for this shape (no silent fallbacks)."""
    if device.type != "cuda":
        return ["torch"]
    q = torch.empty(1, 1, model.local_heads(tp), model.d_qk, device=device, dtype=torch.bfloat16)
    kv = torch.empty(1, 1, 1, model.d_qk, device=device, dtype=torch.bfloat16)
    base = resolve_config(q, model.d_v, None).config
    return [
        b
        for b in backends
        if forward_backend(q, kv, model.d_v, dataclasses.replace(base, forward_backend=b)) == b
    ]


def precompile(cases: list[tuple[ModelShape, int]], arch_major: int, target: str) -> int:
    """Build the TileLang kernels of the table's rows for ``cases`` ((model, TP) pairs) on a
    thread pool, so that nvcc runs in parallel rather than once per case inside the timing loop.
    Needs nvcc, not a GPU (``target`` such as ``"sm_90a"``). Returns the number of kernels."""
    from dsa_sparse_attention._tilelang.backward import compile_backward
    from dsa_sparse_attention._tilelang.forward import compile_forward, padded_topk

    jobs = set()
    for model, tp in cases:
        heads, d, d_v = model.local_heads(tp), model.d_qk, model.d_v
        cfg = CONFIG_TABLE.lookup(arch_major=arch_major, rope_tail=d > d_v, heads=heads).config
        if cfg.forward_backend == "tilelang":
            topk = padded_topk(model.topk, cfg.forward_block_i)
            jobs.add(
                (compile_forward, (heads, 1, d, d_v, topk, model.sink, cfg.forward_block_i,
                                   cfg.forward_stages, target), ())
            )  # fmt: skip
        if cfg.backward_backend == "tilelang":
            tiling = (
                ("block_i", cfg.backward_block_i),
                ("num_stages", cfg.backward_stages),
                ("split_store", cfg.split_store),
                ("dkv_reduce", cfg.dkv_reduce),
                ("target", target),
            )
            jobs.add((compile_backward, (heads, 1, d, d_v, model.topk), tiling))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(fn, *a, **dict(kw)) for fn, a, kw in jobs]
        for f in futures:
            f.result()
    return len(jobs)


def run_case(model: ModelShape, tp: int, tokens: int, backend: str, args, device, peak) -> dict:
    heads = model.local_heads(tp)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    s_kv = tokens * model.kv_ratio
    q = torch.randn(1, tokens, heads, model.d_qk, device=device, generator=gen).bfloat16()
    kv = torch.randn(1, s_kv, 1, model.d_qk, device=device, generator=gen).bfloat16()
    sink = torch.randn(heads, device=device, generator=gen) if model.sink else None
    idx = benchmark_indices(tokens, model.kv_ratio, model.topk, device, gen)
    do = torch.randn(1, tokens, heads, model.d_v, device=device, generator=gen).bfloat16()
    # The table's row for these inputs, with the forward backend under test swapped in.
    lookup = resolve_config(q, model.d_v, None)
    config = dataclasses.replace(lookup.config, forward_backend=backend)
    described = lookup.describe()
    if config != lookup.config:
        described += f" forward_backend={backend}"
    qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
    sg = sink.detach().requires_grad_() if sink is not None else None

    def forward():
        with torch.no_grad():
            return sparse_attention(q, kv, idx, d_v=model.d_v, attn_sink=sink, config=config)

    def forward_backward():
        out = sparse_attention(qg, kvg, idx, d_v=model.d_v, attn_sink=sg, config=config)
        grads = torch.autograd.grad(out, [x for x in (qg, kvg, sg) if x is not None], do)
        return out, grads

    fwd_ms = time_ms(forward, device, args.warmup, args.rep)
    fb_ms = None if args.forward_only else time_ms(forward_backward, device, args.warmup, args.rep)
    f_fwd, f_bwd = flops(idx, heads, model.d_qk, model.d_v)
    row = {
        "model": model.name,
        "tp": tp,
        "heads": heads,
        "tokens": tokens,
        "backend": backend,
        "config": described,
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fb_ms,
        "fwd_tflops": f_fwd / fwd_ms / 1e9,
        "fwd_bwd_tflops": (f_fwd + f_bwd) / fb_ms / 1e9 if fb_ms else None,
        "fwd_peak_pct": 100 * f_fwd / fwd_ms / 1e9 / peak if peak else None,
    }
    if tokens <= args.check_max_tokens and not args.forward_only:
        row.update(check_precision(model, q, kv, idx, sink, do, forward_backward, device))
    return row


def check_precision(model, q, kv, idx, sink, do, forward_backward, device) -> dict:
    """rel_diff of out / dq / dkv / dsink against the reference (float64 on CPU, fp32 on GPU)."""
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    scale = reference.default_sm_scale(model.d_qk)
    out, grads = forward_backward()
    ref_out, lse = reference.sparse_attention_forward_reference(
        q.detach(), kv.detach(), idx, scale, model.d_v, sink, dtype=dtype
    )
    ref_grads = reference.sparse_attention_backward_reference(
        do, None, q.detach(), kv.detach(), idx, lse, scale, model.d_v, sink, dtype=dtype
    )
    names = ("rd_dq", "rd_dkv", "rd_dsink")
    result = {"rd_out": rel_diff(out, ref_out)}
    for name, got, want in zip(names, grads, ref_grads, strict=False):
        result[name] = rel_diff(got, want)
    return result


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2e}" if abs(v) < 1e-2 and v != 0 else f"{v:.2f}"
    return str(v)


def print_table(rows: list[dict]) -> None:
    shown = [c for c in COLUMNS if any(r.get(c) is not None for r in rows)]
    cells = [[fmt(r.get(c)) for c in shown] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(shown)]
    print("  ".join(c.ljust(w) for c, w in zip(shown, widths, strict=True)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths, strict=True)))


def write_outputs(rows: list[dict], csv_path: Path | None, plot_path: Path | None) -> None:
    if csv_path:
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        with csv_path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    if plot_path:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot written", file=sys.stderr)
            return
        fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.6), 4))
        labels = [f"{r['model']}\nTP{r['tp']} {r['tokens']}\n{r['backend']}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["fwd_ms"] for r in rows], 0.4, label="forward")
        ax.bar(
            [x + 0.2 for x in xs], [r["fwd_bwd_ms"] for r in rows], 0.4, label="forward+backward"
        )
        ax.set_xticks(list(xs), labels, fontsize=6)
        ax.set_ylabel("ms (median)")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("sparse_attention")
        fig.tight_layout()
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot_path, dpi=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsa-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    p.add_argument("--tp", default=None, help="comma list of TP sizes (default: each model's)")
    p.add_argument("--tokens", default=None, help="comma list of lengths (default: quick subset)")
    p.add_argument("--full", action="store_true", help=f"every length {ALL_TOKENS}")
    p.add_argument(
        "--backends",
        default=None,
        help=f"comma list of forward backends from {FORWARD_BACKENDS} (default: every GPU "
        "backend usable here; a backend that would fall back to another one is skipped)",
    )
    p.add_argument("--check-max-tokens", type=int, default=8192, help="precision checks up to here")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    p.add_argument("--rep", type=int, default=5, help="timed calls (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--csv", type=Path, default=None, help="write the table as CSV here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar plot here")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    p.add_argument("--forward-only", action="store_true", help="time the forward alone")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if on_gpu else "cpu")
    models = [MODELS[m] for m in args.models.split(",")]
    backends = args.backends.split(",") if args.backends else ["tilelang", "flash_mla"]
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = list(ALL_TOKENS if args.full else QUICK_TOKENS if on_gpu else CPU_TOKENS)
    if not on_gpu:
        print(
            "dsa-bench: no GPU: running the torch backend on the CPU "
            f"({tokens} tokens, TP=8 head counts unless --tp), precision vs the float64 reference"
        )
        backends = ["torch"]
    tp_arg = [int(t) for t in args.tp.split(",")] if args.tp else None
    cases = [
        (model, tp) for model in models for tp in tp_arg or (model.tp_sizes if on_gpu else (8,))
    ]
    arch = device_arch(device) if on_gpu else None
    if arch is not None and arch.is_hopper:
        built = precompile(cases, arch.major, tilelang_target(arch)["arch"])
        print(f"dsa-bench: {built} TileLang kernels built", flush=True)
    peak = bf16_peak_tflops(device)
    if peak:
        print(f"dsa-bench: {torch.cuda.get_device_name()} bf16 matmul ceiling {peak:.0f} TFLOP/s")
    rows = []
    for model, tp in cases:
        for n in tokens:
            for backend in usable(backends, model, tp, device):
                rows.append(run_case(model, tp, n, backend, args, device, peak))
                print("done:", *(fmt(rows[-1][c]) for c in COLUMNS[:8]), flush=True)
    print_table(rows)
    write_outputs(rows, args.csv, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
