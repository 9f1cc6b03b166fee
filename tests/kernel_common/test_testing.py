import pytest
import torch
from kernel_common.testing import assert_close, poison_, poisoned, rel_diff


def test_rel_diff_metric():
    a = torch.randn(100, dtype=torch.float64)
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
    a = torch.randn(4, 5)
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
    assert torch.isnan(poisoned((3,), torch.float32, "cpu")).all()
    t = poison_(torch.zeros(2, dtype=torch.int32))
    assert (t == torch.iinfo(torch.int32).min).all()
