"""Exact ranged top-k selection: the selector between the DSA indexer and sparse attention."""

from topk._op import ranged_topk
from topk.config import TopkConfig, resolve_config

__all__ = ["TopkConfig", "ranged_topk", "resolve_config"]
__version__ = "0.1.0"
