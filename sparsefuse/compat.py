"""Drop-in names matching the APIs that users migrate from.

* ``triton_topk_sae_loss`` / ``triton_hierarchical_sae_loss``: flex-sae's argument order
  ``(indices, weight, vals, bias, target)``.
* ``kd_loss_triton``: axolotl's early Triton KD kernel ``(student_logits, teacher_logprobs, mask,
  num_items_in_batch=None)`` on gathered top-K logits.
* ``ema_update``: the RecTokens ``VQQuantizer`` EMA update's argument order, ``"active"`` semantics.
"""

from .kd import topk_kd_loss
from .sae import hierarchical_sae_loss, topk_sae_loss
from .vq import vq_ema_update


def triton_topk_sae_loss(indices, weight, vals, bias, target):
    """flex-sae name for :func:`sparsefuse.topk_sae_loss`."""
    return topk_sae_loss(indices, weight, vals, bias, target)


def triton_hierarchical_sae_loss(indices, weight, vals, bias, target):
    """flex-sae name for :func:`sparsefuse.hierarchical_sae_loss`."""
    return hierarchical_sae_loss(indices, weight, vals, bias, target)


def ema_update(x, codes, ema_cluster_size, ema_embed_sum, codebook, steps_since_active, decay, restart_after_steps):
    """RecTokens name and argument order for :func:`sparsefuse.vq_ema_update` with ``semantics="active"``
    (in place; returns None)."""
    vq_ema_update(x, codes, codebook, ema_cluster_size, ema_embed_sum, steps_since_active, decay=decay,
                  semantics="active", restart_after_steps=restart_after_steps)


def kd_loss_triton(student_logits, teacher_logprobs, mask, num_items_in_batch=None):
    """axolotl's early Triton KD loss, argument order kept: the top-K forward KL on gathered student
    logits ``[..., K]``, renormalised over the K tokens, returned as the unnormalised sum (divided by
    ``num_items_in_batch`` when given). Unlike the original it never reads past the last block and
    leaves masked slots out of the normaliser. See :func:`sparsefuse.topk_kd_loss`."""
    return topk_kd_loss(student_logits, teacher_logprobs, mask, reduction="sum", num_items_in_batch=num_items_in_batch)


__all__ = ["triton_topk_sae_loss", "triton_hierarchical_sae_loss", "kd_loss_triton", "ema_update"]
