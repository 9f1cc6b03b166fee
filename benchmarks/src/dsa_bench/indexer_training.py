"""Benchmark of the indexer's training ops: ``sparse_attention_probs`` and ``indexer_kl_loss``.

    python -m dsa_bench.indexer_training [--tokens 4096,16384,65536] [--out DIR]

At the model shapes (glm5 at 64 and 8 heads, dsv4.1-flash-r1 with its sink at 64 and 8 heads)
and the benchmark's causal indices (as ``dsa-bench`` builds them), it times the sparse-attention
forward (the table's config), ``sparse_attention_probs`` from that forward's lse (its ratio to
the forward: the bar is <= 0.5 at glm5 64 heads 16k; its gather rate; the kernel the entry
ran, TileLang on Hopper from 33 heads, and the Triton kernel's time beside it) and
``indexer_kl_loss`` forward+backward on ``[T, topk]`` (bar <= 0.3 ms at 16k x 2048), CUDA-graph
replays for the loss. Up to 16k tokens the target (of both kernels) is checked against the fp32
torch reference (rel_diff, bar 1e-5). Writes ``indexer_training.csv`` / ``.png`` under
``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import gc
from functools import partial
from pathlib import Path

import torch
from dsa_indexer import indexer_kl_loss
from dsa_sparse_attention import sparse_attention, sparse_attention_probs
from dsa_sparse_attention._probs import _gpu_kernel
from dsa_sparse_attention._triton import sparse_attention_probs_triton
from dsa_sparse_attention.reference import default_sm_scale, sparse_attention_probs_reference
from kernel_common.testing import rel_diff

from dsa_bench import common
from dsa_bench.models import MODELS
from dsa_bench.sparse_attention import benchmark_indices

CASES = (("glm5", 1), ("glm5", 8), ("dsv4.1-flash-r1", 1), ("dsv4.1-flash-r1", 8))
TOKENS = (4096, 16384, 65536)
CHECK_MAX_TOKENS = 16384
COLUMNS = [
    common.Column("model"),
    common.Column("tp"),
    common.Column("heads"),
    common.Column("tokens"),
    common.Column("fwd_ms", fmt="{:.3f}"),
    common.Column("probs_ms", fmt="{:.3f}"),
    common.Column("probs_over_fwd", fmt="{:.2f}"),
    common.Column("probs_tflops", fmt="{:.0f}"),
    common.Column("probs_gbps", fmt="{:.0f}"),
    common.Column("probs_kernel"),
    common.Column("triton_probs_ms", fmt="{:.3f}"),
    common.Column("kl_fwd_bwd_ms", fmt="{:.3f}"),
    common.Column("kl_gbps", fmt="{:.0f}"),
    common.Column("rd_probs"),
    common.Column("rd_triton"),
]


def run_case(name: str, tp: int, tokens: int) -> dict:
    model = MODELS[name]
    heads = model.local_heads(tp)
    gen = torch.Generator(device="cuda").manual_seed(0)
    s_kv = tokens * model.kv_ratio
    q = torch.randn(1, tokens, heads, model.d_qk, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(1, s_kv, 1, model.d_qk, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(heads, device="cuda", generator=gen) if model.sink else None
    idx = benchmark_indices(tokens, model.kv_ratio, model.topk, "cuda", gen)

    def forward():
        return sparse_attention(q, kv, idx, d_v=model.d_v, attn_sink=sink, return_lse=True)

    with torch.no_grad():
        _, lse = forward()
        fwd_ms = common.time_ms(forward)
        probs_ms = common.time_ms(lambda: sparse_attention_probs(q, kv, idx, lse))
        target = sparse_attention_probs(q, kv, idx, lse)
        scale = default_sm_scale(model.d_qk)
        triton = partial(sparse_attention_probs_triton, q, kv, idx, lse, scale)
        triton_target = triton()
        triton_ms = common.time_ms(triton)
    keys = float((idx >= 0).sum())
    pairs = keys * heads
    row = {
        "model": name,
        "tp": tp,
        "heads": heads,
        "tokens": tokens,
        "fwd_ms": fwd_ms,
        "probs_kernel": _gpu_kernel(q.device, model.d_qk, heads),
        "probs_ms": probs_ms,
        "probs_over_fwd": probs_ms / fwd_ms,
        "probs_tflops": pairs * 2 * model.d_qk / probs_ms / 1e9,
        # The K rows gathered (bf16, whole width), the bound of the kernel: GB/s.
        "probs_gbps": keys * model.d_qk * 2 / probs_ms / 1e6,
        "triton_probs_ms": triton_ms,
    }
    if tokens <= CHECK_MAX_TOKENS:
        want = sparse_attention_probs_reference(q, kv, idx, lse, scale)
        row["rd_probs"] = rel_diff(target, want)
        row["rd_triton"] = rel_diff(triton_target, want)
        del want

    scores = torch.randn(tokens, model.topk, device="cuda", generator=gen)
    scores = scores.where(idx[0, :, 0] >= 0, float("-inf")).requires_grad_()
    t2 = target[0, :, 0].contiguous()

    def kl_step():
        loss = indexer_kl_loss(scores, t2)
        loss.backward()
        scores.grad = None

    row["kl_fwd_bwd_ms"] = common.time_ms(kl_step, graph=True)
    # Bytes: forward reads scores and target, backward reads both again and writes the grad.
    row["kl_gbps"] = 5 * scores.numel() * 4 / row["kl_fwd_bwd_ms"] / 1e6
    return row


def probs_sweep(tokens: int = 16384) -> None:
    """Time the Triton probs kernel's launch parameters (keys per step, warps, stages) at glm5
    64 and 8 heads, and print the fastest per head count (the module constants of
    ``dsa_sparse_attention._triton.probs`` are swapped for each candidate)."""
    from dsa_sparse_attention._triton import probs as kernel

    model = MODELS["glm5"]
    for tp in (1, 8):
        heads = model.local_heads(tp)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, tokens, heads, model.d_qk, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(1, tokens, 1, model.d_qk, device="cuda", generator=gen).bfloat16()
        idx = benchmark_indices(tokens, 1, model.topk, "cuda", gen)
        with torch.no_grad():
            _, lse = sparse_attention(q, kv, idx, d_v=model.d_v, return_lse=True)
        call = partial(kernel.sparse_attention_probs_triton, q, kv, idx, lse, model.d_qk**-0.5)
        want = call()
        results = []
        saved = kernel._BLOCK_K, kernel._WARPS, kernel._STAGES
        try:
            # 16-key steps: the bare gather (dsa_bench.gather_floor) ran fastest in 16-row
            # steps with 8 warps; 128-key steps and 1 stage lost everywhere in the first sweep.
            for block_k in (16, 32, 64):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        kernel._BLOCK_K, kernel._WARPS, kernel._STAGES = block_k, warps, stages
                        try:
                            got = call()
                            ms = common.time_ms(call)
                        except Exception as e:  # e.g. out of shared memory for this candidate
                            print(f"heads={heads} {block_k}/{warps}/{stages}: {type(e).__name__}")
                            continue
                        results.append((ms, block_k, warps, stages, rel_diff(got, want)))
                        print(f"heads={heads} block_k={block_k} warps={warps} stages={stages}: "
                              f"{ms:.3f} ms", flush=True)  # fmt: skip
        finally:
            kernel._BLOCK_K, kernel._WARPS, kernel._STAGES = saved
        if not results:
            print(f"heads={heads}: no candidate ran")
            continue
        best = min(results)
        print(f"best at {heads} heads: {best[0]:.3f} ms block_k={best[1]} warps={best[2]} "
              f"stages={best[3]} (rel_diff vs the default {best[4]:.1e})", flush=True)  # fmt: skip


def plot(rows: list[dict], path: Path) -> Path:
    labels = [f"{r['model']}\nTP{r['tp']} {r['tokens'] // 1024}k" for r in rows]
    return common.bar_plot(
        path,
        labels,
        [
            ("sparse_attention forward", [r["fwd_ms"] for r in rows]),
            ("sparse_attention_probs", [r["probs_ms"] for r in rows]),
            ("sparse_attention_probs, Triton kernel", [r["triton_probs_ms"] for r in rows]),
            ("indexer_kl_loss fwd+bwd", [r["kl_fwd_bwd_ms"] for r in rows]),
        ],
        ylabel="ms (median)",
        title="indexer training ops (H200)",
        figsize=(max(8, len(rows) * 0.7), 4.5),
    )


def main(argv=None) -> None:
    parser = common.ArgumentParser(
        prog="python -m dsa_bench.indexer_training", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--tokens",
        type=common.comma_list(common.positive_int),
        default=list(TOKENS),
        help="comma list of lengths (default 4096,16384,65536)",
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results folder")
    parser.add_argument(
        "--probs-sweep",
        action="store_true",
        help="time the Triton probs kernel's launch candidates",
    )
    args = parser.parse_args(argv)
    common.require_cuda("dsa_bench.indexer_training")
    if args.probs_sweep:
        probs_sweep()
        return
    rows = []
    for name, tp in CASES:
        for tokens in args.tokens:
            rows.append(run_case(name, tp, tokens))
            print(common.named(rows[-1], [c.key for c in COLUMNS]), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\nwrote {common.write_csv(rows, args.out / 'indexer_training.csv')}")
    try:
        print(f"wrote {plot(rows, args.out / 'indexer_training.png')}")
    except ImportError:
        print("matplotlib missing: no PNG")
    print("bars: probs <= 0.5x forward at glm5 64 heads 16k; kl fwd+bwd <= 0.3 ms at 16k x 2048")
    common.print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
