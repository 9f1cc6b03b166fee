"""Helpers shared by the test files: ``from support import ...``.

pyproject.toml puts ``tests/`` on ``sys.path`` (``[tool.pytest.ini_options] pythonpath``), so
this module is importable from every test file and from the interpreter subprocesses.

* seeded generators (stable across processes, unlike ``hash``);
* the Triton-interpreter subprocess runner and its markers;
* input and index builders: random and causal ranges, packed ``cu_seqlens``, indexer inputs and
  index patterns, sparse-attention inputs and index patterns;
* the independent formulations the packages are checked against: a per-row naive top-k and the
  dense fp64 indexer logits / top-k scores (the dense attention is ``dsa_bench.dense``);
* fake CUDA tensors, so that config resolution for CUDA inputs runs on a CPU-only machine.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- generators


def seeded_gen(*key) -> torch.Generator:
    """A CPU generator seeded by the case ``key`` (crc32 of its repr: stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# --------------------------------------------------------------------------- Triton interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether this process interprets Triton kernels (decided when triton is imported)."""

interp_only = pytest.mark.skipif(
    not INTERPRETED, reason="runs under TRITON_INTERPRET=1, started by test_interpreter_run"
)
not_interpreted = pytest.mark.skipif(
    INTERPRETED, reason="this process already interprets the kernels"
)


def run_interpreted(test_file: str, *, selector: str = "cpu_interp", timeout: int = 900) -> None:
    """Run the ``selector`` tests of ``test_file`` in a fresh pytest with ``TRITON_INTERPRET=1``.

    Triton decides when a kernel is *defined* whether it is interpreted, its own standard library
    included, so the interpreter tests need a process that set the variable before importing
    triton. Fails unless they all ran and passed (a skip there counts as a failure).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KERNEL_COMMON_ARCH", None)
    cmd = [sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-x"]
    cmd += ["-k", selector, "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter tests failed:\n{tail}"
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    assert " passed" in summary and "skipped" not in summary, tail


def compile_for_sm90(kernel, signature: dict, constexprs: dict, *, num_warps, num_stages):
    """Compile a Triton kernel for sm_90 without a GPU, its pointer arguments (the ``*``-typed
    entries of ``signature``, which lead it) marked 16-byte aligned as Triton specialises them
    at run time: what makes pointer loads staged cp.async copies."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = sum(kind.startswith("*") for kind in signature.values())
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(pointers)}
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


# --------------------------------------------------------------------------- ranges


def random_ranges(rows: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 half-open ranges ``[lo, hi)`` within ``[0, n]`` (empty ones included)."""
    a = torch.randint(0, n + 1, (rows,), generator=gen)
    b = torch.randint(0, n + 1, (rows,), generator=gen)
    return torch.minimum(a, b).int(), torch.maximum(a, b).int()


def causal_tail(rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``rows`` rows of an n-key causal window: row i sees ``[0, n - rows + i + 1)``."""
    hi = torch.arange(n - rows + 1, n + 1, dtype=torch.int32)
    return torch.zeros(rows, dtype=torch.int32), hi


def cu_seqlens(lengths, dtype: torch.dtype = torch.int32, device="cpu") -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]``: the cumulative lengths of packed segments."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=device)


def as_padding(indices: torch.Tensor, bound: int) -> torch.Tensor:
    """What a reference sees: entries outside ``[0, bound)`` replaced by the -1 the GPU kernels
    take them for (the references reject them)."""
    return torch.where((indices >= 0) & (indices < bound), indices, -1)


# --------------------------------------------------------------------------- indexer inputs


def indexer_inputs(t_q, t_kv, heads, d, gen, device="cpu"):
    """bf16 q ``[T, H, D]`` and k ``[T_kv, D]``, fp32 weights ``[T, H]`` (scaled by 1/sqrt(H))."""
    q = torch.randn(t_q, heads, d, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(t_kv, d, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(t_q, heads, generator=gen) / heads**0.5).to(device)
    return q, k, w


RANGE_LAYOUTS = ("causal", "packed_1tok", "ratio4", "cp_offset", "random")


def range_layout(name: str, t_q: int, gen: torch.Generator, device="cpu"):
    """``(starts, ends, t_kv)`` for a named key-range layout of ``t_q`` queries.

    ``causal``: one segment; ``packed_1tok``: 1-token segments between longer ones, odd lengths;
    ``ratio4``: two segments with 4x compressed keys; ``cp_offset``: the query shard is the
    second third of a ``3 t_q`` packed sequence of two segments; ``random``: empty ranges,
    starts below 0 and ends past T_kv (kernels clamp, the reference masks).
    """
    from dsa_indexer import causal_ranges

    if name == "causal":
        starts, ends = causal_ranges(cu_seqlens([t_q], device=device), t_q)
        return starts, ends, t_q
    if name == "packed_1tok":
        lengths, left, i = [], t_q, 0
        while left:
            n = min(left, (1, 1, 7, 1, max(2, t_q // 5), 3)[i % 6])
            lengths.append(n)
            left -= n
            i += 1
        starts, ends = causal_ranges(cu_seqlens(lengths, device=device), t_q)
        return starts, ends, t_q
    if name == "ratio4":
        lengths = [t_q // 2 + 3, t_q - t_q // 2 - 3]
        starts, ends = causal_ranges(cu_seqlens(lengths, device=device), t_q, ratio=4)
        return starts, ends, sum(n // 4 for n in lengths)
    if name == "cp_offset":
        total = 3 * t_q
        cu = cu_seqlens([t_q + t_q // 3, total - t_q - t_q // 3], device=device)
        starts, ends = causal_ranges(cu, t_q, query_offset=t_q)
        return starts, ends, total
    if name == "random":
        t_kv = t_q + 13
        starts = torch.randint(-3, t_kv + 2, (t_q,), generator=gen)
        ends = starts + torch.randint(-4, t_kv // 2, (t_q,), generator=gen)
        ends[: max(1, t_q // 8)] = starts[: max(1, t_q // 8)]  # a few empty rows
        return starts.to(device, torch.int32), ends.to(device, torch.int32), t_kv
    raise ValueError(name)


def indexer_indices(starts, ends, t_kv, topk, pattern, gen):
    """int32 ``[T, topk]`` key columns inside each range (-1 tail when the range is short).

    ``"ranged"``: the top-k of random scores over each range, ascending, as the ranged top-k
    delivers them. ``"messy"``: the same, then ~5% of slots out of range (-7, T_kv, T_kv + 9),
    ~5% duplicated from another slot of the row, a few all -1 rows, the columns shuffled.
    """
    device = starts.device
    t_q = starts.shape[0]
    cols = torch.arange(t_kv, device=device)
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    scores = torch.rand(t_q, t_kv, generator=gen).to(device)
    scores = torch.where(inside, scores, float("-inf"))
    width = min(topk, t_kv)
    vals, idx = scores.topk(width, dim=1)
    idx = torch.where(torch.isfinite(vals), idx, t_kv).sort(dim=1).values  # padding sorts last
    idx = torch.where(idx < t_kv, idx, -1)
    idx = torch.nn.functional.pad(idx, (0, topk - width), value=-1)
    if pattern == "messy":
        u = torch.rand(t_q, topk, generator=gen).to(device)
        stray = torch.tensor([-7, t_kv, t_kv + 9], device=device)[
            torch.randint(0, 3, (t_q, topk), generator=gen).to(device)
        ]
        dup = idx.gather(1, torch.randint(0, topk, (t_q, topk), generator=gen).to(device))
        idx = torch.where(u < 0.05, stray, torch.where(u < 0.10, dup, idx))
        idx[torch.randperm(t_q, generator=gen)[: max(1, t_q // 16)].to(device)] = -1
        perm = torch.rand(t_q, topk, generator=gen).to(device).argsort(dim=1)
        idx = idx.gather(1, perm)
    elif pattern != "ranged":
        raise ValueError(pattern)
    return idx.to(torch.int32).contiguous()


# --------------------------------------------------------------------------- attention inputs


def attention_inputs(b, s, s_kv, heads, groups, d, gen, *, sink=False, device="cpu"):
    """bf16 q ``[B, S, H, D]`` and kv ``[B, S_kv, G, D]``, and a float32 sink ``[H]`` or None."""
    q = torch.randn(b, s, heads, d, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(b, s_kv, groups, d, generator=gen).to(device, torch.bfloat16)
    attn_sink = (torch.randn(heads, generator=gen) * 2).to(device) if sink else None
    return q, kv, attn_sink


ATTENTION_PATTERNS = (
    "duplicates",
    "distinct",
    "causal",
    "tail",
    "shuffled",
    "empty_rows",
    "out_of_range",
    "mixed",
    "all",
)


def attention_indices(b, s, g, topk, s_kv, pattern, gen, device="cpu"):
    """int32 ``[B, S, G, topk]`` key rows of one named pattern.

    Keys drawn with replacement (duplicates count once per occurrence):
      ``duplicates``: no padding, and the last slot repeats the first;
      ``mixed``: a random-length prefix, then -1 scattered (30%), ~15% of the rows all -1,
      ~10% out of range, and the last slot repeats the first.
    Distinct keys per row (the top-k of random scores):
      ``distinct``: ``min(topk, S_kv)`` keys, then -1;
      ``causal``: the queries are the last S of the S_kv positions and pick keys at or before
      their own (-1 where fewer are visible);
      ``tail``: a random count of keys, then -1 (the first row full);
      ``shuffled``: ``tail`` with the -1 scattered through the row;
      ``empty_rows``: ``shuffled`` with every third query all -1;
      ``out_of_range``: ``shuffled`` with ~15% of the entries >= S_kv or < -1 (padding for the
      kernels; :func:`as_padding` gives what the reference sees).
    ``all``: every entry -1.
    """
    shape = (b, s, g, topk)
    if pattern == "all":
        return torch.full(shape, -1, dtype=torch.int32, device=device)
    if pattern in ("duplicates", "mixed"):
        idx = torch.randint(0, s_kv, shape, generator=gen) if s_kv else torch.full(shape, -1)
        if pattern == "mixed":
            keep = torch.randint(0, topk + 1, (b, s, g, 1), generator=gen)
            idx = torch.where(torch.arange(topk) < keep, idx, -1)
            idx = torch.where(torch.rand(shape, generator=gen) < 0.3, -1, idx)
            idx = torch.where(torch.rand((b, s, g, 1), generator=gen) < 0.15, -1, idx)
            junk = torch.tensor([-7, s_kv, s_kv + 1000])[torch.randint(0, 3, shape, generator=gen)]
            idx = torch.where(torch.rand(shape, generator=gen) < 0.1, junk, idx)
        if topk > 1:
            idx[..., -1] = idx[..., 0]
        return idx.to(device, torch.int32).contiguous()
    if pattern not in ATTENTION_PATTERNS:
        raise ValueError(pattern)
    scores = torch.rand(b, s, g, s_kv, generator=gen)
    if pattern == "causal":
        pos = torch.arange(s) + (s_kv - s)
        scores = scores.masked_fill(torch.arange(s_kv) > pos[:, None, None], -1.0)
    k = min(topk, s_kv)
    top, cols = scores.topk(k, dim=-1)
    idx = torch.full(shape, -1, dtype=torch.int64)
    idx[..., :k] = torch.where(top < 0, -1, cols)
    if pattern in ("tail", "shuffled", "empty_rows", "out_of_range"):
        count = torch.randint(0, topk + 1, (b, s, g, 1), generator=gen)
        idx = torch.where(torch.arange(topk) < count, idx, -1)
        idx[0, 0, 0, :k] = cols[0, 0, 0]  # one full row
    if pattern in ("shuffled", "empty_rows", "out_of_range"):
        idx = idx.gather(-1, torch.rand(shape, generator=gen).argsort(dim=-1))
    if pattern == "empty_rows":
        idx[:, ::3] = -1
    if pattern == "out_of_range":
        junk = torch.tensor([s_kv, s_kv + 7, 2**31 - 1, -2, -1000, -(2**31)])
        pick = torch.randint(0, len(junk), shape, generator=gen)
        idx = torch.where(torch.rand(shape, generator=gen) < 0.15, junk[pick], idx)
    return idx.to(device, torch.int32).contiguous()


# --------------------------------------------------------------------------- independent math


def naive_topk(scores, k, starts, ends) -> torch.Tensor:
    """Per row: rank the in-range, non-NaN, non--inf columns by (-value, column), keep k, sort
    the columns; -1 tail. Any float dtype (compared in Python floats)."""
    out = []
    for r in range(scores.shape[0]):
        row = scores[r].tolist()
        cols = [
            c
            for c in range(max(0, int(starts[r])), min(len(row), int(ends[r])))
            if not math.isnan(row[c]) and row[c] != -math.inf
        ]
        best = sorted(sorted(cols, key=lambda c: (-row[c], c))[:k])
        out.append(best + [-1] * (k - len(best)))
    return torch.tensor(out, dtype=torch.int32).reshape(scores.shape[0], k)


def dense_logits(q, k, w, starts=None, ends=None) -> torch.Tensor:
    """fp64 ``[T, T_kv]`` indexer logits, one head at a time over every key, -inf outside
    ``[starts, ends)`` (no mask without ranges). Differentiable when q, k, w are fp64 leaves."""
    q64, k64, w64 = q.double(), k.double(), w.double()
    out = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float64)
    for h in range(q.shape[1]):
        out = out + w64[:, h : h + 1] * torch.clamp(q64[:, h] @ k64.T, min=0)
    if starts is None:
        return out
    cols = torch.arange(k.shape[0])
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    return out.masked_fill(~inside, float("-inf"))


def dense_topk_scores(q, k, w, indices) -> torch.Tensor:
    """fp64 ``[T, topk]``: the dense logits (every key) gathered at ``indices``, -inf at -1."""
    full = dense_logits(q, k, w)
    picked = full.gather(1, indices.clamp(min=0).long())
    return torch.where(indices >= 0, picked, float("-inf"))


# --------------------------------------------------------------------------- fake CUDA tensors


def check_graph_replays(run, inputs, expected) -> None:
    """Capture ``run`` on clones of ``inputs[0]`` in a CUDA graph (after a warm-up on a side
    stream, as capture requires); then for each tuple of ``inputs``, copy it into the captured
    tensors, replay, and assert that the captured output equals ``expected(*that tuple)``."""
    args = [x.clone() for x in inputs[0]]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run(*args)
        for new in inputs:
            for dst, src in zip(args, new, strict=True):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, expected(*new))


def fake_cuda(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A fake (shape and device only) CUDA tensor: config resolution reads nothing else, so the
    CUDA paths resolve on a machine without a GPU (with ``KERNEL_COMMON_ARCH`` set)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype, device="cuda")
