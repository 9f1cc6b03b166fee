"""Triton backend of :func:`topk.ranged_topk` (private: import the public entry instead)."""

from topk._triton.ranged_topk import TopkConfig, default_config, ranged_topk_triton

__all__ = ["TopkConfig", "default_config", "ranged_topk_triton"]
