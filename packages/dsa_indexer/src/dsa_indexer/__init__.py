"""DeepSeek Sparse Attention lightning indexer: logits, differentiable top-k scores, ranges."""

from dsa_indexer._kl_loss import indexer_kl_loss
from dsa_indexer._ops import indexer_logits, indexer_topk_scores, lightning_indexer
from dsa_indexer.config import IndexerConfig, resolve_config
from dsa_indexer.ranges import causal_ranges

__all__ = [
    "IndexerConfig",
    "causal_ranges",
    "indexer_kl_loss",
    "indexer_logits",
    "indexer_topk_scores",
    "lightning_indexer",
    "resolve_config",
]
__version__ = "0.1.0"
