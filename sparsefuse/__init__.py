"""sparsefuse: fused Triton kernels for training models whose hot path is a sparse top-K gather or scatter.

Set ``TRITON_INTERPRET=1`` before importing to run the Triton kernels on CPU tensors (tests do);
without it, CPU tensors take the exact PyTorch reference path.
"""

from ._validate import index_checks_enabled, set_index_checks
from .kd import TopKKDLoss, topk_kd_loss, topk_kd_loss_from_hidden, topk_kd_loss_from_logits
from .sae import hierarchical_sae_loss, sae_decode, sparse_linear, topk, topk_sae_loss
from .sae.modules import TopKSAE
from .vq import ResidualVQ, VectorQuantizer, nearest_code, vq_ema_update
from . import compat  # noqa: E402  (sparsefuse.compat.* after a plain `import sparsefuse`)

__version__ = "0.1.0"


def __getattr__(name):
    # the trainer is imported on first use: imported here, `python -m sparsefuse.sae.train` would
    # find it already in sys.modules and run its module twice (with a RuntimeWarning)
    if name in ("TrainConfig", "train_sae"):
        from .sae import train

        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "sae_decode",
    "topk_sae_loss",
    "hierarchical_sae_loss",
    "sparse_linear",
    "topk",
    "TopKSAE",
    "train_sae",
    "TrainConfig",
    "vq_ema_update",
    "nearest_code",
    "VectorQuantizer",
    "ResidualVQ",
    "topk_kd_loss",
    "topk_kd_loss_from_logits",
    "topk_kd_loss_from_hidden",
    "TopKKDLoss",
    "set_index_checks",
    "index_checks_enabled",
]
