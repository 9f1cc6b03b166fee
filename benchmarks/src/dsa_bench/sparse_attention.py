"""``dsa-bench``: sparse attention at the model configurations, forward and forward+backward.

For each model x TP size x length it builds the benchmark inputs (per query, random scores over
its causal window selected by :func:`topk.ranged_topk`, -1 where the window is shorter than
topk) and, for each forward backend compared (default ``tilelang`` and ``flash_mla``), times
the forward and the forward+backward of :func:`dsa_sparse_attention.sparse_attention`. Each
backend runs the config that :func:`dsa_sparse_attention.resolve_config` reports for these
inputs with its ``forward_backend`` swapped in (the ``config`` column: the lookup's
``describe()``, and the swap). A backend that would not run as asked (FlashMLA not installed,
or not for this shape: ``resolve_config`` then reports another forward) is skipped with a note,
never replaced by another one. On a Hopper GPU the TileLang kernels are built first, in
parallel (:func:`dsa_sparse_attention.precompile`), and the bf16 matmul ceiling is measured.

Precision, up to ``--check-max-tokens`` (columns ``rd_out``, ``rd_dq``, ``rd_dkv``,
``rd_dsink``: ``kernel_common.testing.rel_diff`` of out and of each gradient):

* on a GPU, against the torch reference in fp32 (``dsa_sparse_attention.reference`` with
  ``dtype=torch.float32``) on the same inputs; the backward reference starts from the
  reference forward's lse;
* on the CPU, where the op itself runs that torch reference, against an independent dense
  float64 formulation (:mod:`dsa_bench.dense`: every query against every key, weighted by the
  key's multiplicity in the index row; gradients by float64 autograd).

``rd_vs_other_fwd`` is the rel_diff between the forward outputs of two backends on the same
inputs, where more than one runs (each row against the first other backend of ``--backends``;
also up to ``--check-max-tokens``, and with ``--forward-only``).

``--deterministic`` adds, beside each run, the table's deterministic row for the shape (the
``mode`` column; ``resolve_config(..., deterministic=True)``), and for every row the
``bitwise`` column: whether two more forward+backward calls gave bit-identical dq, dkv and
dsink.

Without a GPU (or with ``--cpu``) it runs a small default on the torch backend, 256 tokens at
the TP 8 head count, and says so; ``--full`` (every length up to 128k) is refused there unless
``--tokens`` names the lengths.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from dsa_sparse_attention import (
    AttentionShape,
    SparseAttentionConfig,
    precompile,
    reference,
    resolve_config,
    sparse_attention,
)
from dsa_sparse_attention.config import FORWARD_BACKENDS
from kernel_common import Lookup, device_arch
from kernel_common.testing import rel_diff
from topk import ranged_topk

from dsa_bench import common
from dsa_bench.dense import dense_forward_backward
from dsa_bench.models import MODELS, ModelShape

QUICK_TOKENS = (4096, 16384)
ALL_TOKENS = (4096, 8192, 16384, 32768, 65536, 131072)
CPU_TOKENS = (256,)
CPU_TP = (8,)
DEFAULT_BACKENDS = ("tilelang", "flash_mla")
COLUMNS = [
    "model",
    "tp",
    "heads",
    "tokens",
    "backend",
    "mode",
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
    "bitwise",
]
PROGRESS = ["model", "tp", "heads", "tokens", "backend", "mode", "fwd_ms", "fwd_bwd_ms"]


@dataclasses.dataclass
class Plan:
    """One (model, TP size): the (forward backend, table lookup, config) triples that run: the
    lookup's config with each backend swapped in, and with ``--deterministic`` the same from the
    table's deterministic row."""

    model: ModelShape
    tp: int
    runs: list[tuple[str, Lookup[SparseAttentionConfig], SparseAttentionConfig]]

    @property
    def heads(self) -> int:
        return self.model.local_heads(self.tp)

    @staticmethod
    def describe(lookup: Lookup[SparseAttentionConfig], config: SparseAttentionConfig) -> str:
        """The ``config`` column: the lookup's description, and the forward swapped in."""
        text = lookup.describe()
        if config.forward_backend != lookup.config.forward_backend:
            text += f"; forward_backend={config.forward_backend}"
        return text


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
    """Forward and backward FLOPs over valid (index != -1) pairs, as docs/design.md counts them."""
    pairs = float((indices >= 0).sum()) * heads
    return pairs * 2 * (d_qk + d_v), pairs * 2 * (3 * d_qk + 2 * d_v)


def bf16_peak_tflops(device: torch.device) -> float | None:
    """The bf16 matmul ceiling of this GPU, measured now (8192^3 on random data)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = common.time_ms(lambda: a @ b, warmup=3, rep=10, device=device)
    return 2 * 8192**3 / ms / 1e9


def plan_case(
    model: ModelShape, tp: int, backends: list[str], device, deterministic: bool = False
) -> Plan:
    """The forward backends of ``backends`` that really run for this shape (no silent
    fallbacks: a backend is skipped, with a note, when ``resolve_config`` with it swapped into
    the table's config reports another forward backend); each also in deterministic mode with
    ``deterministic``."""
    heads = model.local_heads(tp)
    # resolve_config reads only the device, the head count, the kv groups, the width and the
    # index count, so one-row tensors stand for the benchmark inputs of any length.
    q = torch.empty(1, 1, heads, model.d_qk, device=device, dtype=torch.bfloat16)
    kv = torch.empty(1, 1, 1, model.d_qk, device=device, dtype=torch.bfloat16)
    idx = torch.empty(1, 1, 1, model.topk, device=device, dtype=torch.int32)
    modes = (False, True) if deterministic else (False,)
    lookups = [resolve_config(q, kv, idx, d_v=model.d_v, deterministic=mode) for mode in modes]
    if len(lookups) == 2 and lookups[1].config == lookups[0].config:
        lookups.pop()  # one config for both modes (the CPU's torch reference): run it once
    runs = []
    for backend in backends:
        for lookup in lookups:
            config = dataclasses.replace(lookup.config, forward_backend=backend)
            really = resolve_config(q, kv, idx, d_v=model.d_v, config=config)
            if really.config.forward_backend != backend:
                print(
                    f"skip: model={model.name} tp={tp} heads={heads} backend={backend}: "
                    f"{really.config.forward_backend} would run instead ({really.source})",
                    flush=True,
                )
                break
            runs.append((backend, lookup, config))
    return Plan(model, tp, runs)


def build_kernels(plans: list[Plan], arch, forward_only: bool, workers: int = 16) -> int:
    """Build the TileLang kernels that the run will time, in parallel (``precompile``: nvcc,
    no GPU); with ``forward_only`` no backward. Returns the number of kernels."""
    jobs = {}
    for plan in plans:
        m = plan.model
        shape = AttentionShape(plan.heads, m.d_qk, m.d_v, m.topk, 1, m.sink)
        # The runs of one lookup (mode) differ in their forward backend only: one build covers
        # the TileLang forward (if any of them uses it) and the backward they share.
        for lookup in {id(lookup): lookup for _, lookup, _ in plan.runs}.values():
            backends = [b for b, other, _ in plan.runs if other is lookup]
            forward = "tilelang" if "tilelang" in backends else backends[0]
            config = dataclasses.replace(lookup.config, forward_backend=forward)
            if forward_only:  # a backward that is never timed need not be built
                config = dataclasses.replace(config, backward_backend="torch")
            jobs[(shape, config)] = None
    per_job = max(1, workers // max(1, len(jobs)))

    def build(job) -> int:
        shape, config = job
        try:
            return precompile([shape], arch=arch, config=config, max_workers=per_job)
        except ValueError as e:  # a config the kernels refuse: the run skips it with the reason
            print(f"dsa-bench: not built for {shape}: {e}", flush=True)
            return 0

    with concurrent.futures.ThreadPoolExecutor(min(workers, max(1, len(jobs)))) as pool:
        return sum(pool.map(build, jobs))


def run_case(plan: Plan, tokens: int, args, device, peak) -> list[dict]:
    """The rows of one (model, TP size, length): one per forward backend that runs."""
    model, heads = plan.model, plan.heads
    gen = torch.Generator(device=device).manual_seed(args.seed)
    s_kv = tokens * model.kv_ratio
    q = torch.randn(1, tokens, heads, model.d_qk, device=device, generator=gen).bfloat16()
    kv = torch.randn(1, s_kv, 1, model.d_qk, device=device, generator=gen).bfloat16()
    sink = torch.randn(heads, device=device, generator=gen) if model.sink else None
    idx = benchmark_indices(tokens, model.kv_ratio, model.topk, device, gen)
    do = torch.randn(1, tokens, heads, model.d_v, device=device, generator=gen).bfloat16()
    scale = 1.0 / math.sqrt(model.d_qk)
    leaves = [x.detach().requires_grad_() for x in (q, kv, sink) if x is not None]
    f_fwd, f_bwd = flops(idx, heads, model.d_qk, model.d_v)
    compare = tokens <= args.check_max_tokens  # rd_vs_other_fwd (forwards only)
    check = compare and not args.forward_only  # rd_out, rd_dq, rd_dkv, rd_dsink
    expected = None  # the precision reference, computed once for every backend
    rows, outputs = [], {}  # outputs: the first forward output of each backend
    for backend, lookup, config in plan.runs:

        def forward(config=config):
            with torch.no_grad():
                return sparse_attention(
                    q, kv, idx, sm_scale=scale, d_v=model.d_v, attn_sink=sink, config=config
                )

        def forward_backward(config=config):
            qg, kvg, *sg = leaves
            sink_g = sg[0] if sg else None
            out = sparse_attention(
                qg, kvg, idx, sm_scale=scale, d_v=model.d_v, attn_sink=sink_g, config=config
            )
            return out, torch.autograd.grad(out, leaves, do)

        try:
            out = forward()  # the first call: a config the kernels refuse raises here
        except ValueError as e:
            print(f"skip: model={model.name} tp={plan.tp} backend={backend}: {e}", flush=True)
            continue
        fwd_ms = common.time_ms(forward, warmup=args.warmup, rep=args.rep, device=device)
        fb_ms = None
        if not args.forward_only:
            fb_ms = common.time_ms(
                forward_backward, warmup=args.warmup, rep=args.rep, device=device
            )
        row = {
            "model": model.name,
            "tp": plan.tp,
            "heads": heads,
            "tokens": tokens,
            "backend": backend,
            "mode": "deterministic" if config.deterministic else "default",
            "config": plan.describe(lookup, config),
            "fwd_ms": fwd_ms,
            "fwd_bwd_ms": fb_ms,
            "fwd_tflops": f_fwd / fwd_ms / 1e9,
            "fwd_bwd_tflops": (f_fwd + f_bwd) / fb_ms / 1e9 if fb_ms else None,
            "fwd_peak_pct": 100 * f_fwd / fwd_ms / 1e9 / peak if peak else None,
        }
        if check:
            if expected is None:
                expected = reference_results(q, kv, idx, sink, do, scale, model.d_v, device)
            row.update(precision(forward_backward(), expected))
        if args.deterministic and not args.forward_only:
            first, second = forward_backward()[1], forward_backward()[1]
            row["bitwise"] = all(
                torch.equal(a, b) for a, b in zip(first, second, strict=True) if a is not None
            )
        rows.append(row)
        if compare:
            outputs.setdefault(backend, out)
        print("done:", common.named(row, PROGRESS), flush=True)
    if len(outputs) > 1:
        for row in rows:
            other = next(o for b, o in outputs.items() if b != row["backend"])
            row["rd_vs_other_fwd"] = rel_diff(outputs[row["backend"]], other)
    return rows


def reference_results(q, kv, idx, sink, do, scale, d_v, device) -> tuple:
    """``(out, (dq, dkv, dsink))`` to compare with: the fp32 torch reference on a GPU, the dense
    float64 formulation on the CPU (where the op itself runs the torch reference)."""
    if device.type == "cpu":
        out, _, dq, dkv, dsink = dense_forward_backward(q, kv, idx, scale, d_v, sink, do)
        return out, (dq, dkv, dsink)
    f32 = torch.float32
    out, lse = reference.sparse_attention_forward_reference(q, kv, idx, scale, d_v, sink, dtype=f32)
    grads = reference.sparse_attention_backward_reference(
        do, None, q, kv, idx, lse, scale, d_v, sink, dtype=f32
    )
    return out, grads


def precision(got, expected) -> dict:
    """rel_diff of out / dq / dkv / dsink (dsink only with a sink)."""
    (out, grads), (ref_out, ref_grads) = got, expected
    result = {"rd_out": rel_diff(out, ref_out)}
    for name, a, b in zip(("rd_dq", "rd_dkv", "rd_dsink"), grads, ref_grads, strict=False):
        if b is not None:
            result[name] = rel_diff(a, b)
    return result


def plot(rows: list[dict], path: Path) -> Path:
    return common.bar_plot(
        path,
        [
            f"{r['model']}\nTP{r['tp']} {r['tokens']}\n{r['backend']}"
            + ("\ndeterministic" if r["mode"] == "deterministic" else "")
            for r in rows
        ],
        [
            ("forward", [r["fwd_ms"] for r in rows]),
            ("forward+backward", [r.get("fwd_bwd_ms") for r in rows]),
        ],
        ylabel="ms (median)",
        title="sparse_attention",
        figsize=(max(6, len(rows) * 0.6), 4),
        label_fontsize=6,
    )


def csv_ints(values) -> str:
    return ",".join(map(str, values))


def build_parser() -> argparse.ArgumentParser:
    p = common.ArgumentParser(
        prog="dsa-bench",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Precision columns: on a GPU against the fp32 torch reference, on the CPU against "
        "a dense float64 formulation (dsa_bench.dense).",
    )
    model_names = list(MODELS)
    p.add_argument(
        "--models",
        type=common.comma_list(common.one_of(model_names, "model")),
        default=model_names,
        metavar="LIST",
        help=f"comma list of {', '.join(model_names)} (default: all)",
    )
    p.add_argument(
        "--tp",
        type=common.comma_list(common.positive_int),
        default=None,
        metavar="LIST",
        help="comma list of TP sizes, each dividing the models' heads (default: each model's "
        f"own on a GPU, {CPU_TP[0]} on the CPU)",
    )
    p.add_argument(
        "--tokens",
        type=common.comma_list(common.positive_int),
        default=None,
        metavar="LIST",
        help=f"comma list of lengths (default: {csv_ints(QUICK_TOKENS)} on a GPU, "
        f"{csv_ints(CPU_TOKENS)} on the CPU)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"every length: {csv_ints(ALL_TOKENS)} (unless --tokens)",
    )
    p.add_argument(
        "--backends",
        type=common.comma_list(common.one_of(FORWARD_BACKENDS, "forward backend")),
        default=None,
        metavar="LIST",
        help=f"comma list of forward backends from {', '.join(FORWARD_BACKENDS)} (default: "
        f"{', '.join(DEFAULT_BACKENDS)} on a GPU, torch on the CPU); one that would fall back "
        "to another backend is skipped",
    )
    p.add_argument(
        "--check-max-tokens",
        type=common.nonnegative_int,
        default=8192,
        metavar="N",
        help="precision checks up to this length (default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=common.nonnegative_int,
        default=2,
        metavar="N",
        help="untimed calls before timing (default: %(default)s)",
    )
    p.add_argument(
        "--rep",
        type=common.positive_int,
        default=5,
        metavar="N",
        help="timed calls, the median is reported (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random inputs")
    p.add_argument(
        "--csv", type=Path, default=None, metavar="PATH", help="write the table as CSV here"
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="write a PNG bar plot here (needs matplotlib)",
    )
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    p.add_argument("--forward-only", action="store_true", help="time the forward alone")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="also run each config in deterministic mode, and check bitwise repeatability",
    )
    return p


def parse_args(argv=None) -> tuple[argparse.Namespace, bool]:
    """The arguments, checked against each other (usage errors exit 2), and whether the run
    is on a GPU. ``args.models`` holds :class:`ModelShape` entries."""
    parser = build_parser()
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    args.models = [MODELS[name] for name in args.models]
    for tp in args.tp or ():
        bad = [m for m in args.models if m.heads % tp]
        if bad:
            parser.error(
                f"argument --tp: {tp} does not divide the {bad[0].heads} heads of "
                f"{', '.join(m.name for m in bad)}"
            )
    if not on_gpu:
        if args.full and not args.tokens:
            parser.error(
                f"--full on the CPU runs the torch reference at up to {max(ALL_TOKENS)} tokens "
                "(hours, and the dense float64 check alone would need terabytes); name the "
                "lengths with --tokens, or run on a GPU"
            )
        if args.backends and args.backends != ["torch"]:
            parser.error(
                "argument --backends: only the torch backend runs on the CPU (the op runs its "
                f"reference for CPU tensors), got {','.join(args.backends)}"
            )
    if args.plot:
        common.require_matplotlib(parser, "--plot")
    return args, on_gpu


def main(argv=None) -> int:
    args, on_gpu = parse_args(argv)
    start = time.perf_counter()
    device = torch.device("cuda" if on_gpu else "cpu")
    if args.tokens:
        tokens = args.tokens
    else:
        tokens = list(ALL_TOKENS if args.full else QUICK_TOKENS if on_gpu else CPU_TOKENS)
    backends = args.backends or (list(DEFAULT_BACKENDS) if on_gpu else ["torch"])
    if not on_gpu:
        print(
            f"dsa-bench: {'--cpu' if args.cpu else 'no GPU'}: the torch backend on the CPU "
            f"at {', '.join(map(str, tokens))} tokens, TP {args.tp or list(CPU_TP)}; precision "
            "against the dense float64 formulation",
            flush=True,
        )
    plans = [
        plan_case(model, tp, backends, device, args.deterministic)
        for model in args.models
        for tp in args.tp or (model.tp_sizes if on_gpu else CPU_TP)
    ]
    arch = device_arch(device) if on_gpu else None
    if arch is not None and arch.is_hopper:
        t0 = time.perf_counter()
        built = build_kernels(plans, arch, args.forward_only)
        print(
            f"dsa-bench: {built} TileLang kernels built in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    peak = bf16_peak_tflops(device)
    if peak:
        print(f"dsa-bench: {torch.cuda.get_device_name()} bf16 matmul ceiling {peak:.0f} TFLOP/s")
    rows = []
    for plan in plans:
        for n in tokens:
            rows += run_case(plan, n, args, device, peak)
            if on_gpu:
                torch.cuda.empty_cache()
    if not rows:
        print("dsa-bench: no backend ran (see the skip lines above)", file=sys.stderr)
        return 1
    print()
    common.print_table(rows, COLUMNS, drop_empty=True)
    if args.csv:
        print(f"wrote {common.write_csv(rows, args.csv, COLUMNS)}")
    if args.plot:
        print(f"wrote {plot(rows, args.plot)}")
    print(f"dsa-bench: {len(rows)} rows in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
