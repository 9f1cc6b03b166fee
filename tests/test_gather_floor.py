"""``dsa_bench.gather_floor``'s kernel reads exactly the selected rows (Triton interpreter on the
CPU, fp32: the interpreter has no bf16), so the floor it times is the gather the attention
kernels do."""

import shutil

import pytest
import torch
from dsa_bench.common import cuda_library
from dsa_bench.gather_floor import gather_sum, split_width
from support import interp_only, not_interpreted, run_interpreted, seeded_gen


def test_split_width():
    assert split_width(576) == (512, 64) and split_width(512) == (512, 0)
    with pytest.raises(ValueError, match="dim = 600"):
        split_width(600)


@not_interpreted
def test_interpreter_run():
    run_interpreted(__file__)


@interp_only
@pytest.mark.parametrize("dim", [48, 32])
def test_cpu_interp_gather_sum(dim):
    gen = seeded_gen("gather floor", dim)
    s, s_kv, topk = 9, 23, 20
    kv = torch.randn(s_kv, dim, generator=gen)
    idx = torch.randint(-1, s_kv + 3, (s, topk), generator=gen, dtype=torch.int32)
    valid = (idx >= 0) & (idx < s_kv)
    want = (kv[idx.clamp(0, s_kv - 1).long()] * valid[..., None]).sum(dim=(1, 2))
    got = gather_sum(kv, idx, block_k=16, warps=4, stages=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.parametrize(
    ("source", "entry"), [("gather_copy.cu", "gather_copy"), ("reduce_add.cu", "reduce_add")]
)
def test_cuda_sources_build(source, entry):
    """The floors' CUDA sources compile for sm_90a and export their launchers (no GPU needed)."""
    lib = cuda_library(source)
    assert not isinstance(lib, str), lib
    assert hasattr(lib, entry)
