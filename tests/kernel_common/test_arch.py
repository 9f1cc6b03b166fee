import pytest
import torch
from kernel_common import (
    ARCH_ENV,
    Arch,
    device_arch,
    parse_arch,
    shared_memory_per_block,
    tilelang_target,
)
from kernel_common.constants import HOPPER_SMEM_PER_BLOCK


def test_parse_arch_names():
    assert parse_arch("sm_90") == Arch("cuda", 9, 0)
    assert parse_arch("sm_90a") == Arch("cuda", 9, 0)
    assert parse_arch("sm_100") == Arch("cuda", 10, 0)
    assert parse_arch("SM_103A") == Arch("cuda", 10, 3)
    assert parse_arch("gfx942") == Arch("rocm", 94, 2)
    assert parse_arch("cpu") == Arch("cpu")
    with pytest.raises(ValueError, match=ARCH_ENV):
        parse_arch("hopper")


def test_sm_names_and_flags():
    assert Arch("cuda", 9, 0).sm == "sm_90"
    assert Arch("cuda", 10, 0).sm == "sm_100"
    assert Arch("cuda", 9, 0).is_hopper and not Arch("cuda", 9, 0).is_blackwell
    assert Arch("cuda", 10, 0).is_blackwell
    assert Arch("cpu").sm == "cpu"
    with pytest.raises(ValueError, match="vendor"):
        Arch("tpu", 1, 0)


def test_arch_reads_trace(monkeypatch):
    """torch.compile traces the entries' reads of the arch (fullgraph: no graph break): the
    derived names and flags as well as the fields, on the constant that device_arch returns."""
    monkeypatch.setenv(ARCH_ENV, "sm_90")

    def f(x):
        arch = device_arch(torch.device("cuda"))
        hopper = arch.is_hopper and not arch.is_blackwell and arch.sm == "sm_90"
        return x + (1 if hopper and arch.major == 9 else 2)

    assert torch.compile(f, fullgraph=True, backend="eager")(torch.zeros(2)).tolist() == [1, 1]


def test_tilelang_targets():
    assert tilelang_target(Arch("cuda", 9, 0)) == {"kind": "cuda", "arch": "sm_90a"}
    assert tilelang_target(Arch("cuda", 10, 0)) == {"kind": "cuda", "arch": "sm_100a"}
    assert tilelang_target(Arch("cuda", 10, 3)) == {"kind": "cuda", "arch": "sm_103a"}
    assert tilelang_target(Arch("cuda", 8, 0)) == {"kind": "cuda", "arch": "sm_80"}
    with pytest.raises(ValueError, match="CUDA"):
        tilelang_target(Arch("cpu"))


def test_env_override(monkeypatch):
    monkeypatch.setenv(ARCH_ENV, "sm_100")
    assert device_arch() == Arch("cuda", 10, 0)
    assert device_arch("cpu") == Arch("cuda", 10, 0)
    monkeypatch.setenv(ARCH_ENV, "bogus")
    with pytest.raises(ValueError, match=ARCH_ENV):
        device_arch()


def test_cpu_device_without_override(monkeypatch):
    monkeypatch.delenv(ARCH_ENV, raising=False)
    assert device_arch(torch.device("cpu")) == Arch("cpu")
    if not torch.cuda.is_available():
        assert device_arch() == Arch("cpu")


def test_import_does_not_query_the_gpu():
    # A fresh interpreter imports every package without initialising CUDA.
    import subprocess
    import sys

    code = (
        "import torch, kernel_common, topk, dsa_indexer, dsa_sparse_attention; "
        "print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.gpu
def test_cuda_device_arch_is_cached(monkeypatch):
    monkeypatch.delenv(ARCH_ENV, raising=False)
    a = device_arch(torch.device("cuda", 0))
    assert a.vendor in ("cuda", "rocm")
    assert (a.major, a.minor) == torch.cuda.get_device_capability(0)
    assert device_arch(0) is a


@pytest.mark.gpu
def test_cuda_shared_memory_per_block():
    """The device's opt-in limit: more than the 48 KiB default, and Hopper's 227 KiB there."""
    smem = shared_memory_per_block(torch.device("cuda"))
    assert smem > 48 * 1024
    if torch.cuda.get_device_capability() == (9, 0):
        assert smem == HOPPER_SMEM_PER_BLOCK
