"""``dsa_bench.small_head_forward``: the copy-engine few-head forward (TileLang).

CPU: the kernel compiles for sm_90a at every block size (64 keys needed a workaround in
TileLang's storage rewrite) and with kv groups and a sink, and its builder refuses what it
cannot run. GPU (Hopper): every launch against the fp32 reference, every padding kind
(``small_head_forward.check``).
"""

import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.skip("tilelang is a Linux-only dependency", allow_module_level=True)

from dsa_bench import small_head_forward
from dsa_bench import small_head_forward_tl as tl


@pytest.mark.parametrize(
    ("heads", "groups", "dim", "sink", "launch"),
    [(8, 1, 576, False, (16, 4)), (8, 1, 576, False, (64, 2)), (32, 2, 512, True, (32, 3))],
)
def test_tilelang_kernel_compiles_for_sm90a(heads, groups, dim, sink, launch):
    kernel = tl.compile_few_head_forward(heads, groups, dim, 512, sink, *launch, "sm_90a")
    source = kernel.get_kernel_source()
    assert f"dsa_issue_rows<{launch[0]}>" in source  # the bulk-copy gather
    # mma.sync on ldmatrix fragments: S = Q K^T, and O += P V through ldmatrix.trans
    assert "dsa_mma_pair<false>(" in source and "dsa_mma_pair<true>(" in source
    assert ("Sink[" in source) == sink


@pytest.mark.parametrize(
    ("heads", "groups", "dim", "d_v", "launch", "match"),
    [
        (17, 1, 576, 512, (32, 2), "1 to 16 heads per group"),
        (16, 3, 576, 512, (32, 2), "1 to 16 heads per group"),
        (8, 1, 600, 512, (32, 2), "multiples of 64"),
        (8, 1, 576, 480, (32, 2), "multiples of 64"),
        (8, 1, 576, 512, (64, 3), "not in"),
    ],
)
def test_builder_refuses(heads, groups, dim, d_v, launch, match):
    with pytest.raises(ValueError, match=match):
        tl.build(heads, groups, dim, d_v, False, *launch)


@pytest.mark.gpu
def test_gpu_against_reference():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernel is built for sm_90a (Hopper)")
    small_head_forward.check(torch.device("cuda"))
