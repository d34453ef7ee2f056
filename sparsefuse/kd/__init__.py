"""Top-K knowledge distillation: from gathered logits, from full logits, from hidden states."""

from .modules import TopKKDLoss
from .ops import topk_kd_loss, topk_kd_loss_from_hidden, topk_kd_loss_from_logits

__all__ = ["topk_kd_loss", "topk_kd_loss_from_logits", "topk_kd_loss_from_hidden", "TopKKDLoss"]
