"""sparsefuse: fused Triton kernels for training models whose hot path is a sparse top-K gather or scatter.

Set ``TRITON_INTERPRET=1`` before importing to run the Triton kernels on CPU tensors (tests do);
without it, CPU tensors take the exact PyTorch reference path.
"""

from ._validate import index_checks_enabled, set_index_checks
from .sae import hierarchical_sae_loss, sae_decode, topk_sae_loss

__version__ = "0.1.0"

__all__ = [
    "sae_decode",
    "topk_sae_loss",
    "hierarchical_sae_loss",
    "set_index_checks",
    "index_checks_enabled",
]
