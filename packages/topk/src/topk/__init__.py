"""Exact ranged top-k selection: the selector between the DSA indexer and sparse attention."""

from topk._op import ranged_topk

__all__ = ["ranged_topk"]
__version__ = "0.1.0"
