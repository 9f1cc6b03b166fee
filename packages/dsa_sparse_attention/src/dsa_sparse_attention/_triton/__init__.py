"""Triton kernels of sparse attention (private: import the public entries instead)."""

from dsa_sparse_attention._triton.probs import (
    launch_config,
    sparse_attention_probs_triton,
    split_width,
)

__all__ = ["launch_config", "sparse_attention_probs_triton", "split_width"]
