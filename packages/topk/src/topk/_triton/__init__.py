"""Triton backend of :func:`topk.ranged_topk` (private: import the public entry instead)."""

from topk._triton.launch import (
    TopkLaunch,
    launch_plan,
    ranged_topk_into,
    ranged_topk_triton,
    topk_scratch,
)

__all__ = ["TopkLaunch", "launch_plan", "ranged_topk_into", "ranged_topk_triton", "topk_scratch"]
