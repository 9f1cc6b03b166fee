"""A few-head forward gathered through the copy engine, against the library's forward.

``small_head_forward_tl`` is a TileLang forward for <= 16 heads per kv group whose K/V rows
arrive by one ``cp.async.bulk`` each and feed ``mma.sync`` through ``ldmatrix``, with the
library forward's whole contract, not yet a library kernel (``benchmarks/NOTES.md``, "A
few-head forward on the copy engine"). This module checks it against the fp32 torch reference
(padding, out-of-range indices, a ragged last block, groups, batch, a sink), then times every
launch beside the library's default forward on the benchmark's indices, in one process.
"""

import concurrent.futures
import functools
import itertools
import math
from pathlib import Path

import torch
from dsa_sparse_attention import sparse_attention
from dsa_sparse_attention.reference import sparse_attention_forward_reference
from kernel_common.testing import rel_diff

from dsa_bench import common
from dsa_bench import small_head_forward_tl as tl
from dsa_bench.models import MODELS
from dsa_bench.sparse_attention import benchmark_indices

LAUNCHES = tl.LAUNCHES  # (keys per block, stages)
CASES = (  # (model, heads)
    ("glm5", 8),
    ("glm5", 16),
    ("glm5.3-flash-notail", 8),
    ("dsv4.1-flash-r1", 8),
)
CHECK_CASES = (  # (batch, queries, keys, heads, groups, D, topk, sink)
    (1, 96, 300, 16, 1, 576, 136, False),
    (1, 96, 300, 8, 1, 576, 136, False),
    (1, 96, 300, 5, 1, 512, 136, False),
    (1, 96, 300, 1, 1, 512, 136, False),
    (2, 96, 300, 16, 2, 576, 136, True),
    (1, 96, 300, 12, 1, 512, 136, True),
    (1, 64, 300, 8, 1, 576, 1, False),
    (1, 64, 300, 8, 1, 576, 20, True),
    (1, 2048, 4096, 16, 1, 576, 2048, False),
)
COLUMNS = ("model", "heads", "tokens", "method", "block", "stages", "ms", "rd_out", "rd_lse")


def _case(device, gen, b, s, s_kv, h, g, d, topk, sink):
    """Inputs with every kind of padding at any topk: -1 tails and holes, indices exactly S_kv,
    past it, < -1 and at the int32 limits, a row with nothing valid. The sink is large enough
    (log topk above a logit's scale) that leaving it out fails the comparison."""
    q = torch.randn(b, s, h, d, device=device, generator=gen).bfloat16()
    kv = torch.randn(b, s_kv, g, d, device=device, generator=gen).bfloat16()
    idx = torch.randint(0, s_kv, (b, s, g, topk), device=device, generator=gen, dtype=torch.int32)
    idx[..., topk - topk // 8 :] = -1
    idx[:, 1::7, :, topk // 4 : topk // 2] = -1
    idx[:, 2::9, :, topk // 3] = s_kv
    idx[:, 3::9, :, (2 * topk) // 3] = s_kv + 5
    idx[:, 4::9, :, topk // 5] = -7
    idx[:, 6::9, :, topk // 6] = torch.iinfo(torch.int32).max
    idx[:, 7::9, :, topk // 7] = torch.iinfo(torch.int32).min
    idx[:, 5] = -1
    snk = torch.randn(h, device=device, generator=gen) + math.log(topk) if sink else None
    return q, kv, idx, snk


def _compare(what, out, lse, want_out, want_lse) -> None:
    """rel_diff <= 1e-5 for out and lse (natural log), lse within 1e-3 everywhere it is finite,
    and finite exactly where the reference's is."""
    finite = torch.isfinite(want_lse)
    rd_out = rel_diff(out.float(), want_out.float())
    rd_lse = rel_diff(lse[finite], want_lse[finite])
    err_lse = (lse[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
    print(f"check {what}: {rd_out=:.2e} {rd_lse=:.2e} {err_lse=:.1e}", flush=True)
    same_finite = torch.equal(finite, torch.isfinite(lse))
    if not (rd_out < 1e-5 and rd_lse < 1e-5 and err_lse < 1e-3 and same_finite):
        raise AssertionError(f"small_head_forward wrong: {what}")


def check(device, *, small: bool = False) -> None:
    """Every launch against the fp32 reference (``_case``'s padding): batch 1 and 2, one and
    two kv groups, with and without a sink; 1 to 16 heads, D 512 and 576; topk 1 and 20 (fewer
    blocks than stages), 136 (a ragged last block) and 2048 over 2048 queries (more programs
    than SMs, many stage reuses; left out when ``small``, for compute-sanitizer)."""
    cases = CHECK_CASES[:-1] if small else CHECK_CASES
    _build([(h, g, d, sink) for _, _, _, h, g, d, _, sink in cases])
    gen = torch.Generator(device=device).manual_seed(1)
    for b, s_len, s_kv, h, g, d, topk, sink in cases:
        q, kv, idx, snk = _case(device, gen, b, s_len, s_kv, h, g, d, topk, sink)
        legal = torch.where((idx >= 0) & (idx < s_kv), idx, -1)
        scale = 1 / math.sqrt(d)
        want_out, want_lse = sparse_attention_forward_reference(q, kv, legal, scale, 512, snk)
        for block, stages in LAUNCHES:
            what = f"{b=} {s_len=} {h=} {g=} {d=} {topk=} {sink=} {block=} {stages=}"
            out, lse2 = tl.few_head_forward(q, kv, idx, snk, scale, 512, block=block, stages=stages)
            _compare(what, out, lse2 * math.log(2), want_out, want_lse)


def _build(jobs) -> None:
    """Compile every launch of each ``(heads, groups, D, sink)`` in ``jobs``, in threads (minutes
    one by one)."""
    specs = {
        (h, g, d, 512, sink, *launch, "sm_90a") for h, g, d, sink in jobs for launch in LAUNCHES
    }
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda spec: tl.compile_few_head_forward(*spec), sorted(specs)))


def plot(rows: list[dict], path: Path) -> Path:
    """ms per (model, heads, tokens): the library's forward and each launch of the kernel."""
    cases = list(dict.fromkeys((r["model"], r["heads"], r["tokens"]) for r in rows))

    def name(r):
        return (
            r["method"] if r["method"] == "library" else f"{r['method']} {r['block']}x{r['stages']}"
        )

    names = list(dict.fromkeys(name(r) for r in rows))

    by = {(r["model"], r["heads"], r["tokens"], name(r)): r["ms"] for r in rows}
    return common.bar_plot(
        path,
        [f"{m} {h}h {t // 1024}k" for m, h, t in cases],
        [(n, [by.get((*c, n)) for c in cases]) for n in names],
        ylabel="forward ms (lower is better)",
        title="few-head forward on the copy engine (small_head_forward)",
        figsize=(max(8, len(cases) * 1.6), 4.8),
        log=True,
        legend_fontsize=5,
    )


def main(argv=None) -> None:
    parser = common.ArgumentParser(
        prog="python -m dsa_bench.small_head_forward", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--tokens", type=common.comma_list(common.positive_int), default=[4096, 16384]
    )
    parser.add_argument("--rep", type=common.positive_int, default=10)
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="only the check against the reference, without its 2048-query case (for "
        "compute-sanitizer --tool memcheck)",
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    common.require_cuda("dsa_bench.small_head_forward")
    device = torch.device("cuda")
    check(device, small=args.check_only)
    if args.check_only:
        return
    _build([(heads, 1, MODELS[name].d_qk, False) for name, heads in CASES])
    rows = []
    for (name, heads), tokens in itertools.product(CASES, args.tokens):
        model = MODELS[name]
        gen = torch.Generator(device=device).manual_seed(0)
        s_kv = tokens * model.kv_ratio
        q = torch.randn(1, tokens, heads, model.d_qk, device=device, generator=gen).bfloat16()
        kv = torch.randn(1, s_kv, 1, model.d_qk, device=device, generator=gen).bfloat16()
        idx = benchmark_indices(tokens, model.kv_ratio, model.topk, device, gen)
        scale = 1 / math.sqrt(model.d_qk)

        def library(q=q, kv=kv, idx=idx, scale=scale):
            with torch.no_grad():
                return sparse_attention(q, kv, idx, sm_scale=scale, d_v=512, return_lse=True)

        want_out, want_lse = library()
        base = dict(model=name, heads=heads, tokens=tokens)
        ms = common.time_ms(library, warmup=2, rep=args.rep, device=device)
        rows.append(base | dict(method="library", ms=round(ms, 3)))
        print(rows[-1], flush=True)
        for block, stages in LAUNCHES:
            fn = functools.partial(
                tl.few_head_forward, q, kv, idx, None, scale, 512, block=block, stages=stages
            )
            out, lse = fn()
            lse = lse * math.log(2)  # log2 units, as the library's kernels
            ms = common.time_ms(fn, warmup=2, rep=args.rep, device=device)
            rd_out = rel_diff(out.float(), want_out.float())
            rd_lse = rel_diff(lse, want_lse)
            row = dict(method="tilelang", block=block, stages=stages, ms=round(ms, 3))
            rows.append(base | row | dict(rd_out=f"{rd_out:.1e}", rd_lse=f"{rd_lse:.1e}"))
            print(rows[-1], flush=True)
            if not (rd_out < 1e-5 and rd_lse < 1e-5):  # at scale, against the library's forward
                raise AssertionError(f"small_head_forward differs from the library: {rows[-1]}")
    common.print_table(rows, COLUMNS)
    print(f"wrote {common.write_csv(rows, args.out / 'small_head_forward.csv', COLUMNS)}")
    try:
        print(f"wrote {plot(rows, args.out / 'small_head_forward.png')}")
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
