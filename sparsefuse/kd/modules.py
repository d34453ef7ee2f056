"""``nn.Module`` wrappers for the top-K distillation losses (same options as the functions)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from .._validate import check_number
from .ops import (_check_reduction, _check_temperature, _normalize_code, _check_chunk_size, topk_kd_loss,
                  topk_kd_loss_from_hidden, topk_kd_loss_from_logits)


class TopKKDLoss(nn.Module):
    """Top-K forward-KL distillation loss.

    ``TopKKDLoss(normalize, temperature, reduction, ce_weight, chunk_size, return_per_token)``; call it with

    * ``(student_logits_topk, target_logprobs, target_mask)``: gathered logits (``"topk"`` only);
      chosen when the second argument holds log-probs (floating point) rather than token ids, or
      when no token ids are given;
    * ``(logits, target_token_ids, target_logprobs, target_mask)``: full logits ``[..., V]``;
    * ``(hidden, target_token_ids, target_logprobs, target_mask, lm_head_weight=W, lm_head_bias=b,
      labels=y)``: hidden states through the fused LM head. ``lm_head_bias``, ``labels`` and a
      non-zero ``ce_weight`` belong to this form only: without ``lm_head_weight`` they raise
      ``ValueError``. ``labels`` need a ``ce_weight`` (0 keeps the term off).

    ``num_items_in_batch`` may be passed per call. With ``return_per_token`` it returns
    ``(loss, per_token)``. See :func:`sparsefuse.topk_kd_loss_from_logits` for the math and
    :func:`sparsefuse.topk_kd_loss_from_hidden` for the fused path.
    """

    def __init__(self, normalize: str = "full", temperature: float = 1.0, reduction: str = "mean",
                 ce_weight: Optional[float] = None, chunk_size: Optional[int] = None,
                 return_per_token: bool = False):
        super().__init__()
        _normalize_code(normalize)  # refused here rather than at the first call
        _check_temperature(temperature)
        _check_reduction(reduction)
        _check_chunk_size(chunk_size)
        self.normalize, self.temperature, self.reduction = normalize, temperature, reduction
        self.ce_weight = None if ce_weight is None else check_number("ce_weight", ce_weight, positive=False)
        self.chunk_size, self.return_per_token = chunk_size, return_per_token

    def extra_repr(self) -> str:
        return (f"normalize={self.normalize!r}, temperature={self.temperature}, reduction={self.reduction!r}, "
                f"ce_weight={self.ce_weight}, chunk_size={self.chunk_size}, return_per_token={self.return_per_token}")

    def forward(self, inputs: Tensor, target_token_ids: Optional[Tensor] = None,
                target_logprobs: Optional[Tensor] = None, target_mask: Optional[Tensor] = None, *,
                lm_head_weight: Optional[Tensor] = None, lm_head_bias: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, num_items_in_batch=None):
        common = dict(temperature=self.temperature, reduction=self.reduction, num_items_in_batch=num_items_in_batch,
                      return_per_token=self.return_per_token)
        if lm_head_weight is not None:
            return topk_kd_loss_from_hidden(
                inputs, lm_head_weight, target_token_ids, target_logprobs, target_mask, normalize=self.normalize,
                lm_head_bias=lm_head_bias, labels=labels, ce_weight=self.ce_weight, chunk_size=self.chunk_size,
                **common)
        for name, given in (("lm_head_bias", lm_head_bias is not None), ("labels", labels is not None),
                            (f"ce_weight={self.ce_weight}", bool(self.ce_weight))):
            if given:
                raise ValueError(f"TopKKDLoss: {name} is used by the hidden-state form only; pass lm_head_weight "
                                 f"(and hidden states as the input), or leave it out")
        logprobs_second = isinstance(target_token_ids, Tensor) and target_token_ids.is_floating_point()
        if target_token_ids is None or (logprobs_second and (target_logprobs is None or target_mask is None)):
            # gathered form; positionally, (z, t, m) arrives as (inputs, target_token_ids, target_logprobs)
            if logprobs_second:
                mask = target_mask if target_logprobs is None else target_logprobs
                target_logprobs, target_mask = target_token_ids, mask
            if self.normalize != "topk":
                raise ValueError(f"gathered logits support normalize='topk' only, not {self.normalize!r}")
            return topk_kd_loss(inputs, target_logprobs, target_mask, **common)
        return topk_kd_loss_from_logits(inputs, target_token_ids, target_logprobs, target_mask,
                                        normalize=self.normalize, **common)
