"""SAE ops: the sparse embedding bag and the TopK / HierarchicalTopK reconstruction losses (the
decoder), and sparse_linear / topk (the encoder)."""

from .ops import hierarchical_sae_loss, sae_decode, sparse_linear, topk, topk_sae_loss

__all__ = ["sae_decode", "topk_sae_loss", "hierarchical_sae_loss", "sparse_linear", "topk"]
