"""causal_ranges against a per-token loop and against fla-core's packed-sequence helpers."""

import pytest
import torch
from dsa_indexer import causal_ranges
from hypothesis import given, settings
from hypothesis import strategies as st
from support import cu_seqlens


def naive(lens, ratio, offset, total):
    starts, ends, kv_base, pos = [], [], 0, 0
    for n in lens:
        for r in range(n):
            if offset <= pos < offset + total:
                starts.append(kv_base)
                ends.append(kv_base + (r + 1) // ratio)
            pos += 1
        kv_base += n // ratio
    return starts, ends


def test_packed_causal():
    starts, ends = causal_ranges(cu_seqlens([3, 1, 4]), 8)
    assert starts.tolist() == [0, 0, 0, 3, 4, 4, 4, 4]
    assert ends.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert starts.dtype == ends.dtype == torch.int32


def test_ratio_and_offset():
    lens = [5, 8, 1]
    for ratio in (1, 2, 4):
        for offset in (0, 3, 6):
            total = sum(lens) - offset
            s, e = causal_ranges(
                cu_seqlens(lens, torch.int64), total, ratio=ratio, query_offset=offset
            )
            assert (s.tolist(), e.tolist()) == naive(lens, ratio, offset, total)


@settings(max_examples=50, deadline=None)
@given(
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    ratio=st.integers(1, 5),
    data=st.data(),
)
def test_hypothesis(lens, ratio, data):
    n = sum(lens)
    offset = data.draw(st.integers(0, n))
    total = data.draw(st.integers(0, n - offset))
    s, e = causal_ranges(cu_seqlens(lens), total, ratio=ratio, query_offset=offset)
    assert (s.tolist(), e.tolist()) == naive(lens, ratio, offset, total)


def test_agrees_with_fla_position_and_sequence_ids():
    from fla.ops.utils.index import prepare_position_ids, prepare_sequence_ids

    cu = cu_seqlens([1, 7, 1, 1, 12], torch.int64)
    starts, ends = causal_ranges(cu, int(cu[-1]))
    pos = prepare_position_ids(cu)
    seq = prepare_sequence_ids(cu)
    assert torch.equal(starts.long(), cu[seq])
    assert torch.equal(ends.long(), cu[seq] + pos + 1)


def test_validation():
    cu = cu_seqlens([2, 2])
    with pytest.raises(TypeError, match="cu_seqlens must have dtype int32 or int64"):
        causal_ranges(cu.float(), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[N \+ 1\]"):
        causal_ranges(cu[None], 4)
    with pytest.raises(ValueError, match="N >= 1"):
        causal_ranges(cu[:1], 0)
    with pytest.raises(ValueError, match="ratio must be >= 1"):
        causal_ranges(cu, 4, ratio=0)
    with pytest.raises(ValueError, match="query_offset must be >= 0"):
        causal_ranges(cu, 4, query_offset=-1)
    with pytest.raises(TypeError, match="total must be an int"):
        causal_ranges(cu, torch.tensor(4))


def test_compiles_without_graph_breaks():
    fn = torch.compile(causal_ranges, fullgraph=True, dynamic=True)
    for lens in ([3, 4], [1, 1, 9]):
        cu = cu_seqlens(lens)
        total = sum(lens)
        got = fn(cu, total, ratio=2)
        want = causal_ranges(cu, total, ratio=2)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
