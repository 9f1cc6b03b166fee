"""MLA-style sparse attention of DeepSeek Sparse Attention, forward and backward."""

from dsa_sparse_attention._ops import resolve_config, sparse_attention
from dsa_sparse_attention._probs import sparse_attention_probs
from dsa_sparse_attention.config import SparseAttentionConfig
from dsa_sparse_attention.precompile import AttentionShape, precompile

__all__ = [
    "AttentionShape",
    "SparseAttentionConfig",
    "precompile",
    "resolve_config",
    "sparse_attention",
    "sparse_attention_probs",
]
__version__ = "0.1.0"
