"""The dKV reduce floor of the sparse-attention backward: the reduce-adds alone, nothing else.

    python -m dsa_bench.reduce_floor [--tokens 16384,65536] [--topk 2048] [--dim 576] [--out DIR]

Per query and kv group the backward adds one row of D values to dkv for every selected key (the
key gradient summed over the program's heads): fp32, or 64-bit fixed point in deterministic
mode. With the benchmark's causal indices at glm5 that is 31.5 M rows of 576 x 4 B = 77 GB at 16k
tokens (154 GB as int64), whatever the head count, against 11 TFLOP of MMAs at 64 heads (14 ms at
800 TFLOP/s). The rows land in L2 while dkv fits there (16k x 2304 B = 38 MB as fp32; the int64
dkv of 16k and the fp32 one of 64k do not).

This times kernels that issue only those adds (``reduce_add.cu``, built with nvcc for sm_90a),
each adding 1 to every selected element, in the ways a backward can:

* ``red``: atomics from registers, ``vec`` values per instruction (fp32 x1 / x2 / x4, u64 x1),
  ``lanes_per_row`` lanes of a warp on one row per instruction. fp32 x2 with 4 lanes per row is
  the layout of a wgmma accumulator, what the TileLang backward's ``dkv_reduce="atomic"`` path
  issues (``AtomicAddx2``);
* ``bulk``: one ``cp.reduce.async.bulk`` per row and column slice of ``slice`` elements from
  shared memory, the ``dkv_reduce="tma"`` path without its staging (slices 256 and 128 are its
  ``split_store`` 2 and 4 at D = 576).

Every run's dkv is checked (each column holds the number of times its row was selected). Prints
the time and the bytes added per second of each variant and pattern (``causal``: the benchmark's
indices; ``contiguous``: query t adds rows ``t % (S - topk) ...`` in order); writes
``reduce_floor.csv`` and ``reduce_floor.png`` under ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

from dsa_bench import common
from dsa_bench.gather_floor import indices

COLUMNS = [
    "pattern", "tokens", "topk", "dim", "variant", "ms", "tb_per_s", "g_ops_per_s"
]  # fmt: skip


class Variant(NamedTuple):
    """One way of issuing the adds, as ``reduce_add.cu``'s ``reduce_add`` takes it."""

    method: str  # "red" or "bulk"
    u64: bool
    vec: int = 1  # red: values per instruction
    lanes_per_row: int = 32  # red
    slice: int = 0  # bulk: elements per reduce-add

    @property
    def name(self) -> str:
        kind = "u64" if self.u64 else "f32"
        if self.method == "bulk":
            return f"bulk {kind} slice {self.slice}"
        return f"red {kind} x{self.vec} {self.lanes_per_row} lanes/row"

    def ops(self, rows: int, dim: int) -> int:
        """Instructions (red) or bulk operations over ``rows`` added rows."""
        per_row = -(-dim // self.slice) if self.method == "bulk" else dim // self.vec
        return rows * per_row


VARIANTS = (
    Variant("red", False, 1, 32),
    Variant("red", False, 2, 4),  # the TileLang backward's atomic path
    Variant("red", False, 2, 16),
    Variant("red", False, 4, 4),
    Variant("red", False, 4, 8),
    Variant("bulk", False, slice=576),
    Variant("bulk", False, slice=256),
    Variant("bulk", False, slice=128),
    Variant("red", True, 1, 32),
    Variant("red", True, 1, 4),
    Variant("bulk", True, slice=576),
    Variant("bulk", True, slice=128),
)


def reduce_add(lib: ctypes.CDLL, dkv: torch.Tensor, idx: torch.Tensor, variant: Variant) -> None:
    """Add 1 to every element of the ``dkv`` ``[S_kv, D]`` rows (fp32, or int64 for a u64
    variant) that each query row of ``idx`` ``[S, topk]`` (int32) selects, as ``variant``
    issues it (entries outside ``[0, S_kv)`` add nothing)."""
    s, topk = idx.shape
    ptr = ctypes.c_void_p
    stream = ptr(torch.cuda.current_stream(dkv.device).cuda_stream)
    args = (0 if variant.method == "red" else 1, int(variant.u64), variant.vec)
    args += (variant.lanes_per_row, variant.slice, ptr(dkv.data_ptr()), ptr(idx.data_ptr()))
    args += (s, dkv.shape[0], topk, dkv.shape[1], stream)
    code = lib.reduce_add(*args)
    if code:
        raise RuntimeError(f"reduce_add({variant}) returned {code}")


def plot(rows: list[dict], path: Path) -> Path:
    cases = sorted({(r["pattern"], r["tokens"]) for r in rows}, key=lambda c: (c[1], c[0]))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["pattern"], r["tokens"], r["variant"]): r["tb_per_s"] for r in rows}
    return common.bar_plot(
        path,
        names,
        [(f"{p} {t}", [by.get((p, t, n)) for n in names]) for p, t in cases],
        ylabel="TB/s added (higher is better)",
        title="dKV reduce-adds alone (reduce_floor)",
        figsize=(max(7, len(names) * 0.9), 4.5),
        log=False,
        label_fontsize=6,
    )


def main(argv=None) -> None:
    parser = common.ArgumentParser(
        prog="python -m dsa_bench.reduce_floor", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--tokens", type=common.comma_list(common.positive_int), default=[16384, 65536]
    )
    parser.add_argument("--topk", type=common.positive_int, default=2048)
    parser.add_argument("--dim", type=common.positive_int, default=576)
    parser.add_argument("--rep", type=common.positive_int, default=10)
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    if min(args.tokens) <= args.topk:
        parser.error(f"--tokens must exceed --topk {args.topk}")
    if args.dim % 4:
        parser.error(f"--dim {args.dim} must be a multiple of 4 (16-byte rows of fp32)")
    common.require_cuda("dsa_bench.reduce_floor")
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise SystemExit("dsa_bench.reduce_floor: the kernels are built for sm_90a (Hopper)")
    lib = common.cuda_library("reduce_add.cu")
    if isinstance(lib, str):
        raise SystemExit(f"dsa_bench.reduce_floor: {lib}")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for tokens in args.tokens:
        for pattern in ("causal", "contiguous"):
            idx = indices(pattern, tokens, args.topk, device, gen)
            valid = idx[(idx >= 0) & (idx < tokens)].long()
            counts = torch.bincount(valid, minlength=tokens)
            for variant in VARIANTS:
                dtype = torch.int64 if variant.u64 else torch.float32
                dkv = torch.zeros(tokens, args.dim, device=device, dtype=dtype)
                run = functools.partial(reduce_add, lib, dkv, idx, variant)
                run()
                got = dkv.double()
                if not torch.equal(got, counts.double()[:, None].expand_as(got)):
                    raise SystemExit(f"dsa_bench.reduce_floor: {variant.name} added wrong counts")
                ms = common.time_ms(run, warmup=2, rep=args.rep, device=device)
                row = dict(pattern=pattern, tokens=tokens, topk=args.topk, dim=args.dim)
                row |= dict(variant=variant.name, ms=round(ms, 3))
                row["tb_per_s"] = round(valid.numel() * args.dim * dkv.element_size() / ms / 1e9, 2)
                row["g_ops_per_s"] = round(variant.ops(valid.numel(), args.dim) / ms / 1e6, 1)
                print(row, flush=True)
                rows.append(row)
                del dkv, got
    common.print_table(rows, COLUMNS)
    print(f"wrote {common.write_csv(rows, args.out / 'reduce_floor.csv', COLUMNS)}")
    try:
        print(f"wrote {plot(rows, args.out / 'reduce_floor.png')}")
    except ImportError:
        print("matplotlib missing: no PNG")


if __name__ == "__main__":
    main()
