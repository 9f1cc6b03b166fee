"""Argument checks shared by the entries, and the shared constants."""

import math

import pytest
import torch
from kernel_common import check_indices, check_int, check_tensor
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK, LN2, LOG2E, round_up


def test_check_tensor_messages():
    t = torch.zeros(2, 3, dtype=torch.int32)
    assert check_tensor("op", "x", t, dtypes=(torch.int32,), shape=[2, None]) is t
    with pytest.raises(TypeError, match=r"op: x must be a \[A, B\] torch.Tensor, got list"):
        check_tensor("op", "x", [1], dtypes=(torch.int32,), layout="[A, B]")
    with pytest.raises(TypeError, match="op: x must have dtype float32 or bfloat16, got int32"):
        check_tensor("op", "x", t, dtypes=(torch.float32, torch.bfloat16))
    with pytest.raises(
        ValueError, match=r"op: x must have shape \[A, B\] = \[2, 4\], got \[2, 3\]"
    ):
        check_tensor("op", "x", t, dtypes=(torch.int32,), shape=[2, 4], layout="[A, B]")
    with pytest.raises(ValueError, match=r"got \[2, 3\]"):
        check_tensor("op", "x", t, dtypes=(torch.int32,), shape=[2])
    with pytest.raises(ValueError, match="op: x is on cpu, expected meta"):
        check_tensor("op", "x", t, dtypes=(torch.int32,), device=torch.device("meta"))


def test_check_int():
    assert check_int("op", "k", 3, minimum=1) == 3
    with pytest.raises(TypeError, match="op: k must be an int, got bool"):
        check_int("op", "k", True, minimum=0)
    with pytest.raises(TypeError, match="op: k must be an int, got float"):
        check_int("op", "k", 2.0, minimum=0)
    with pytest.raises(ValueError, match="op: k must be >= 1, got 0"):
        check_int("op", "k", 0, minimum=1)


def test_check_indices():
    check_indices("op", "idx", torch.tensor([[-1, 0, 4], [3, -1, -1]]), 5, "S_kv")
    check_indices("op", "idx", torch.empty(0, 3, dtype=torch.int32), 0, "S_kv")
    with pytest.raises(ValueError, match=r"op: idx must lie in \[-1, S_kv=5\); found 2 entries"):
        check_indices("op", "idx", torch.tensor([[-1, 5, 0], [-2, 1, 2]]), 5, "S_kv")
    with pytest.raises(ValueError, match=r"\[-1, T_kv=0\); found 1 entries"):
        check_indices("op", "idx", torch.tensor([-1, 0]), 0, "T_kv")


def test_constants():
    # exp2 of logits scaled by LOG2E is exp; a log2 lse times LN2 is the natural-log lse.
    for x in (-3.5, 0.25, 7.0):
        assert math.isclose(2 ** (x * LOG2E), math.exp(x), rel_tol=1e-14)
        assert math.isclose(math.log2(math.exp(x)) * LN2, x, rel_tol=1e-14)
    assert HOPPER_SMEM_PER_BLOCK == 232448
    assert [round_up(n, 64) for n in (0, 1, 64, 65, 2048, 2112)] == [64, 64, 64, 128, 2048, 2112]
    assert round_up(33, 32) == 64 and round_up(-3, 16) == 16
