"""MLA-style sparse attention of DeepSeek Sparse Attention, forward and backward."""

from dsa_sparse_attention._ops import sparse_attention
from dsa_sparse_attention.config import SparseAttentionConfig

__all__ = ["SparseAttentionConfig", "sparse_attention"]
__version__ = "0.1.0"
