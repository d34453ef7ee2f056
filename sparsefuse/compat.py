"""Drop-in names matching the APIs that users migrate from.

* ``triton_topk_sae_loss`` / ``triton_hierarchical_sae_loss``: flex-sae's argument order
  ``(indices, weight, vals, bias, target)``.
"""

from .sae import hierarchical_sae_loss, topk_sae_loss


def triton_topk_sae_loss(indices, weight, vals, bias, target):
    """flex-sae name for :func:`sparsefuse.topk_sae_loss`."""
    return topk_sae_loss(indices, weight, vals, bias, target)


def triton_hierarchical_sae_loss(indices, weight, vals, bias, target):
    """flex-sae name for :func:`sparsefuse.hierarchical_sae_loss`."""
    return hierarchical_sae_loss(indices, weight, vals, bias, target)


__all__ = ["triton_topk_sae_loss", "triton_hierarchical_sae_loss"]
