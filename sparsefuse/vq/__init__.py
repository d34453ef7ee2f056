"""VQ codebooks: EMA update with dead-code restart, nearest-code search, VectorQuantizer / ResidualVQ."""

from .modules import ResidualVQ, VectorQuantizer
from .ops import batch_statistics, nearest_code, quantize, vq_ema_update

__all__ = ["vq_ema_update", "nearest_code", "quantize", "batch_statistics", "VectorQuantizer", "ResidualVQ"]
