"""TileLang kernels of sparse attention (Hopper)."""

from dsa_sparse_attention._tilelang.backward import sparse_attention_backward_tilelang
from dsa_sparse_attention._tilelang.forward import sparse_attention_forward_tilelang

__all__ = ["sparse_attention_backward_tilelang", "sparse_attention_forward_tilelang"]
