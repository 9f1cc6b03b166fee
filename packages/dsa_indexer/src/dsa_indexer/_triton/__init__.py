"""Triton backend of the indexer: logits over key ranges, top-k scores and their fused backward."""

from dsa_indexer._triton.logits import indexer_logits_triton
from dsa_indexer._triton.topk_scores import (
    indexer_topk_scores_backward_triton,
    indexer_topk_scores_triton,
)

__all__ = [
    "indexer_logits_triton",
    "indexer_topk_scores_backward_triton",
    "indexer_topk_scores_triton",
]
