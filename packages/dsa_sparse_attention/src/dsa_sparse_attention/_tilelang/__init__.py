"""TileLang kernels of sparse attention (Hopper): what the op layer calls and checks."""

from dsa_sparse_attention._tilelang.backward import (
    check_backward_config,
    compile_backward,
    sparse_attention_backward_tilelang,
)
from dsa_sparse_attention._tilelang.forward import (
    check_forward_config,
    compile_forward,
    sparse_attention_forward_tilelang,
)

__all__ = [
    "check_backward_config",
    "check_forward_config",
    "compile_backward",
    "compile_forward",
    "sparse_attention_backward_tilelang",
    "sparse_attention_forward_tilelang",
]
