import pytest
import torch
from kernel_common.testing import assert_close, poison_, poisoned, rel_diff


def test_rel_diff_metric():
    a = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert rel_diff(a, a) == pytest.approx(0.0, abs=1e-15)
    assert rel_diff(a, -a) == pytest.approx(2.0)
    assert rel_diff(a, torch.zeros_like(a)) == pytest.approx(1.0)
    b = a * 1.01
    expected = 1 - 2 * (a * b).sum() / ((a * a).sum() + (b * b).sum())
    assert rel_diff(a, b) == pytest.approx(float(expected))
    assert rel_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="shapes"):
        rel_diff(torch.zeros(3), torch.zeros(4))


def test_assert_close_reports_location_and_nonfinite():
    a = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    assert_close(a, a.clone())
    b = a.clone()
    b[2, 3] += 100
    with pytest.raises(AssertionError, match=r"at \(2, 3\)"):
        assert_close(b, a, name="out")
    c = a.clone()
    c[1, 1] = float("nan")
    with pytest.raises(AssertionError, match="DIFFERS: actual nan=1"):
        assert_close(c, a)
    d, e = a.clone(), a.clone()
    d[0, 0] = e[0, 0] = float("-inf")
    assert_close(d, e)
    e[0, 0] = float("inf")
    with pytest.raises(AssertionError, match="DIFFERS"):
        assert_close(d, e)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(a, a[:2])


def test_poison():
    for dtype in (torch.float32, torch.bfloat16):
        t = poisoned((3, 2), dtype, "cpu")
        assert t.shape == (3, 2) and t.dtype == dtype and torch.isnan(t).all()
    t = torch.zeros(2, dtype=torch.int32)
    assert poison_(t) is t and (t == torch.iinfo(torch.int32).min).all()


@pytest.mark.gpu
def test_cuda_graph_time_ms_replays_the_captured_work():
    from kernel_common.timing import cuda_graph_time_ms, cuda_time_ms

    counter = torch.zeros(1, device="cuda")
    x = torch.randn(4096, 4096, device="cuda")

    def step():
        counter.add_(1)
        torch.mm(x, x)

    ms = cuda_graph_time_ms(step, warmup=2, rep=5)
    # Two eager warm-up calls, then 2 + 5 replays; the capture itself runs nothing.
    assert counter.item() == 2 + 2 + 5
    # A 4096^3 fp32 product is well above launch overhead: replays take about the eager time.
    eager = cuda_time_ms(step, warmup=1, rep=5)
    assert 0.5 * eager < ms < 1.5 * eager


def test_cuda_graph_time_ms_needs_cuda(monkeypatch):
    from kernel_common.timing import cuda_graph_time_ms

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_graph_time_ms(lambda: None)
