"""``nn.Module`` wrappers for the top-K distillation losses (same options as the functions)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .ops import topk_kd_loss, topk_kd_loss_from_hidden, topk_kd_loss_from_logits


class TopKKDLoss(nn.Module):
    """Top-K forward-KL distillation loss.

    ``TopKKDLoss(normalize, temperature, reduction, ce_weight)``; call it with

    * ``(student_logits_topk, target_logprobs, target_mask)``: gathered logits (``"topk"`` only);
    * ``(logits, target_token_ids, target_logprobs, target_mask)``: full logits ``[..., V]``;
    * ``(hidden, target_token_ids, target_logprobs, target_mask, lm_head_weight=W, lm_head_bias=b,
      labels=y)``: hidden states through the fused LM head.

    ``num_items_in_batch`` may be passed per call. See :func:`sparsefuse.topk_kd_loss_from_logits`
    for the math and :func:`sparsefuse.topk_kd_loss_from_hidden` for the fused path.
    """

    def __init__(self, normalize: str = "full", temperature: float = 1.0, reduction: str = "mean",
                 ce_weight: float = 0.0, chunk_size: Optional[int] = None):
        super().__init__()
        self.normalize, self.temperature, self.reduction = normalize, temperature, reduction
        self.ce_weight, self.chunk_size = ce_weight, chunk_size

    def extra_repr(self) -> str:
        return (f"normalize={self.normalize!r}, temperature={self.temperature}, reduction={self.reduction!r}, "
                f"ce_weight={self.ce_weight}")

    def forward(self, inputs: Tensor, target_token_ids: Optional[Tensor] = None,
                target_logprobs: Optional[Tensor] = None, target_mask: Optional[Tensor] = None, *,
                lm_head_weight: Optional[Tensor] = None, lm_head_bias: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, num_items_in_batch=None):
        common = dict(temperature=self.temperature, reduction=self.reduction, num_items_in_batch=num_items_in_batch)
        if lm_head_weight is not None:
            return topk_kd_loss_from_hidden(
                inputs, lm_head_weight, target_token_ids, target_logprobs, target_mask, normalize=self.normalize,
                lm_head_bias=lm_head_bias, labels=labels, ce_weight=self.ce_weight, chunk_size=self.chunk_size,
                **common)
        if target_logprobs is None:  # gathered form: (student_logits_topk, target_logprobs, target_mask)
            if self.normalize != "topk":
                raise ValueError(f"gathered logits support normalize='topk' only, not {self.normalize!r}")
            return topk_kd_loss(inputs, target_token_ids, target_mask, **common)
        return topk_kd_loss_from_logits(inputs, target_token_ids, target_logprobs, target_mask,
                                        normalize=self.normalize, **common)
