"""Registered ops and the public functions for SAE decoders.

Shapes: ``indices [B, K]`` (int32 or int64, values in [0, F)), ``vals [B, K]``, ``weight [F, D]``,
``bias [D]`` or None, ``target [B, D]``. Floating inputs may be float16, bfloat16, float32 or
float64 and may differ from one another; arithmetic is float32 (float64 if any input is float64).
Each gradient comes back in its parameter's dtype; ``indices`` get none. A ``target`` that requires
grad gets the loss's gradient (``-c * g * r`` with the loss's residual ``r``, see
:func:`_target_grad`), as ``F.mse_loss`` would give it.
Any B >= 0, K >= 1, D >= 0 and F >= 1; inputs need not be contiguous.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor

from .._registry import INTERPRET, register_op
from .._validate import (FLOAT_DTYPES, INDEX_DTYPES, check_in_place, check_no_partial_overlap, check_not_empty,
                         check_number, check_tensor, use_deterministic)
from . import kernels, reference


def _check_inputs(indices, weight, vals, bias):
    check_tensor("weight", weight, shape=(None, None), dtypes=FLOAT_DTYPES)
    F, D = weight.shape
    dev = weight.device
    check_tensor("indices", indices, shape=(None, None), dtypes=INDEX_DTYPES, device=dev)
    B, K = indices.shape
    check_not_empty("indices", indices, 1, "column (K >= 1)")
    check_not_empty("weight", weight, 0, "row (F >= 1)")
    check_tensor("vals", vals, shape=(B, K), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("bias", bias, shape=(D,), dtypes=FLOAT_DTYPES, device=dev, optional=True)


def _check_loss_inputs(indices, weight, vals, bias, target):
    _check_inputs(indices, weight, vals, bias)
    check_tensor("target", target, shape=(indices.shape[0], weight.shape[1]), dtypes=FLOAT_DTYPES,
                 device=weight.device)


# --- sae_decode ------------------------------------------------------------------------------


def _decode_fake(indices, vals, weight, bias):
    return vals.new_empty(indices.shape[0], weight.shape[1], dtype=torch.promote_types(vals.dtype, weight.dtype))


def _decode_bwd_fake(grad, indices, vals, weight, need_weight_grad):
    # contiguous, as the kernels return it
    grad_weight = weight.new_empty(weight.shape) if need_weight_grad else weight.new_empty(0)
    return vals.new_empty(vals.shape), grad_weight, grad.new_empty(weight.shape[1], dtype=reference.acc_dtype(vals, weight, grad))


@register_op("sae_decode_bwd", fake=_decode_bwd_fake, reference=reference.sae_decode_bwd)
def _decode_bwd_op(
    grad: Tensor, indices: Tensor, vals: Tensor, weight: Tensor, need_weight_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.decode_bwd(grad, indices, vals, weight, need_weight_grad)


def _decode_setup(ctx, inputs, output):
    indices, vals, weight, bias = inputs
    ctx.save_for_backward(indices, vals, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _decode_backward(ctx, grad):
    indices, vals, weight = ctx.saved_tensors
    _, need_vals, need_weight, need_bias = ctx.needs_input_grad
    gv, gw, gb = _decode_bwd_op(grad, indices, vals, weight, need_weight)
    if need_bias and ctx.bias_dtype == torch.float64 and gb.dtype != torch.float64:
        gb = grad.sum(0, dtype=torch.float64)  # a float64 bias: its sum in float64, as the forward added it
    return (None, gv if need_vals else None, gw if need_weight else None,
            gb.to(ctx.bias_dtype) if need_bias else None)


@register_op("sae_decode", fake=_decode_fake, reference=reference.sae_decode_fwd,
             backward=_decode_backward, setup_context=_decode_setup)
def _decode_op(indices: Tensor, vals: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return kernels.decode_fwd(indices, vals, weight, bias)


def sae_decode(indices: Tensor, vals: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Sparse embedding bag: ``recon[b] = bias + sum_k vals[b, k] * weight[indices[b, k]]``.

    Args:
        indices: ``[B, K]`` int32/int64 latent ids in ``[0, F)``.
        vals: ``[B, K]`` latent activations.
        weight: ``[F, D]`` decoder dictionary.
        bias: ``[D]`` decoder bias, or None.

    Returns:
        ``[B, D]`` in ``promote_types(vals.dtype, weight.dtype)``, accumulated in float32 (float64
        if any input is float64).
        Differentiable in ``vals``, ``weight`` and ``bias``; the weight gradient is a deterministic
        segmented sum (no atomics).
    """
    _check_inputs(indices, weight, vals, bias)
    return _decode_op(indices, vals, weight, bias)


# --- sparse_linear (the encoder side) -------------------------------------------------------


def _check_linear_inputs(x, weight, indices, bias, x_shift, values):
    check_tensor("weight", weight, shape=(None, None), dtypes=FLOAT_DTYPES)
    F, D = weight.shape
    check_not_empty("weight", weight, 0, "row (F >= 1)")
    dev = weight.device
    check_tensor("x", x, shape=(None, D), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("indices", indices, shape=(x.shape[0], None), dtypes=INDEX_DTYPES, device=dev)
    check_not_empty("indices", indices, 1, "column (K >= 1)")
    check_tensor("bias", bias, shape=(F,), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("x_shift", x_shift, shape=(D,), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("values", values, shape=tuple(indices.shape), dtypes=FLOAT_DTYPES, device=dev, optional=True)


def _linear_fake(x, weight, indices, bias, x_shift, values):
    dt = torch.promote_types(x.dtype, weight.dtype)
    for t in (bias, x_shift):
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return x.new_empty(indices.shape, dtype=dt)


def _linear_bwd_fake(grad, x, indices, weight, x_shift, need_x, need_weight, need_bias, need_shift):
    acc = reference.acc_dtype(grad, x, weight, x_shift)
    return (x.new_empty(x.shape if need_x else (0,)), weight.new_empty(weight.shape if need_weight else (0,)),
            x.new_empty(weight.shape[0] if need_bias else 0, dtype=acc),
            x.new_empty(weight.shape[1] if need_shift else 0, dtype=acc))


@register_op("sparse_linear_bwd", fake=_linear_bwd_fake, reference=reference.sparse_linear_bwd)
def _linear_bwd_op(
    grad: Tensor, x: Tensor, indices: Tensor, weight: Tensor, x_shift: Optional[Tensor], need_x: bool,
    need_weight: bool, need_bias: bool, need_shift: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return kernels.sparse_linear_bwd(grad, x, indices, weight, x_shift, need_x, need_weight, need_bias, need_shift)


def _linear_setup(ctx, inputs, output):
    x, weight, indices, bias, x_shift, _values = inputs
    ctx.save_for_backward(x, indices, weight, x_shift)
    ctx.dtypes = [None if t is None else t.dtype for t in (bias, x_shift)]


def _linear_backward(ctx, grad):
    x, indices, weight, x_shift = ctx.saved_tensors
    need_x, need_weight, _, need_bias, need_shift, _ = ctx.needs_input_grad
    gx, gw, gb, gs = _linear_bwd_op(grad, x, indices, weight, x_shift, need_x, need_weight, need_bias, need_shift)
    return (gx if need_x else None, gw if need_weight else None, None,
            gb.to(ctx.dtypes[0]) if need_bias else None, gs.to(ctx.dtypes[1]) if need_shift else None, None)


@register_op("sparse_linear", fake=_linear_fake, reference=reference.sparse_linear_fwd,
             backward=_linear_backward, setup_context=_linear_setup)
def _linear_op(x: Tensor, weight: Tensor, indices: Tensor, bias: Optional[Tensor],
               x_shift: Optional[Tensor], values: Optional[Tensor]) -> Tensor:
    return kernels.sparse_linear_fwd(x, weight, indices, bias, x_shift, values)


def sparse_linear(x: Tensor, weight: Tensor, indices: Tensor, bias: Optional[Tensor] = None,
                  x_shift: Optional[Tensor] = None, *, values: Optional[Tensor] = None) -> Tensor:
    """The K selected outputs per row of ``F.linear(x - x_shift, weight, bias)``, with a K-sparse backward.

    ``out[b, k] = sum_d (x[b, d] - x_shift[d]) * weight[indices[b, k], d] + bias[indices[b, k]]``

    A TopK SAE encoder computes ``(x - b_dec) @ W_enc.T`` densely to choose its latents, but only the
    K chosen ones get a gradient. Recomputing them through this op (the dense product under
    ``no_grad``) replaces the two dense ``[B, F]`` backward matmuls by work proportional to B*K*D:

    * ``grad_weight[f] = sum_{(b, k): indices[b, k] = f} g[b, k] * (x[b] - x_shift)`` and
      ``grad_bias[f] = sum_{(b, k): indices[b, k] = f} g[b, k]``, one segmented pass over the entries
      sorted by feature: deterministic, no atomics, each gradient row written once;
    * ``grad_x[b] = sum_k g[b, k] * weight[indices[b, k]]`` (the embedding bag of :func:`sae_decode`),
      only when x requires grad;
    * ``grad_x_shift = -sum_b grad_x[b] = -(grad_bias @ weight)``: a matrix-vector product when x is
      frozen (the SAE's pre-encoder bias ``b_dec`` goes here; with 16-bit weights the product runs
      in their dtype, and in float64, over a float64 copy of the weight, when another input is
      float64). On the kernel path that product reads every row of the weight, so an inf or NaN in
      a row no entry selects makes the matching entries of ``grad_x_shift`` NaN (its sum is 0, and
      0 * inf is NaN); with x requiring grad, and on the PyTorch reference path, only the selected
      rows are read.

    ``x - x_shift`` is formed in ``promote_types(x.dtype, x_shift.dtype)``, as the dense
    ``F.linear(x - x_shift, ...)`` that chose the latents forms it, or in float64 when any input is
    float64.

    Args:
        x: ``[B, D]`` inputs.
        weight: ``[F, D]`` (an ``nn.Linear(D, F)`` weight).
        indices: ``[B, K]`` int32/int64 in ``[0, F)``.
        bias: ``[F]`` or None.
        x_shift: ``[D]`` subtracted from every row of x first, or None.
        values: ``[B, K]``, the forward result when the caller already has it (an SAE has it from
            the dense product that chose ``indices``: ``pre.topk(K)`` returns it). It is returned
            (as a copy, in the output dtype) instead of being recomputed; its shape, dtype and
            device are checked, its values are not. The backward is the same. Not differentiable.

    Returns:
        ``[B, K]`` in the promoted dtype of the float inputs, accumulated in float32 (float64 for
        float64 inputs). Gradients come back in their inputs' dtypes.
    """
    _check_linear_inputs(x, weight, indices, bias, x_shift, values)
    return _linear_op(x, weight, indices, bias, x_shift, None if values is None else values.detach())


# --- topk_sae_loss ---------------------------------------------------------------------------


def _gv_parts(K, D, weight) -> int:
    """Column-group parts of the TopK forward's gv: the kernels' (CUDA, or the interpreter), else 1."""
    return kernels.topk_gv_parts(K, D, weight.element_size()) if weight.is_cuda or INTERPRET else 1


def _topk_fake(indices, weight, vals, bias, target):
    acc = reference.acc_dtype(weight, vals, bias, target)
    (B, K), D = indices.shape, weight.shape[1]
    return (vals.new_empty((), dtype=acc), vals.new_empty(B, D, dtype=acc),
            vals.new_empty(_gv_parts(K, D, weight), B, K, dtype=acc))


def _topk_reference(indices, weight, vals, bias, target):
    loss, resid, gv = reference.topk_sae_loss_fwd(indices, weight, vals, bias, target)
    return loss, resid, gv[None]


def _topk_bwd_fake(grad_loss, indices, vals, weight, resid, gv, need_weight_grad, bias_dtype):
    # contiguous, as the kernels return it
    grad_weight = weight.new_empty(weight.shape) if need_weight_grad else weight.new_empty(0)
    return vals.new_empty(vals.shape), grad_weight, resid.new_empty(resid.shape[1], dtype=bias_dtype)


def _topk_bwd_reference(grad_loss, indices, vals, weight, resid, gv, need_weight_grad, bias_dtype):
    gvals, gw, gb = reference.topk_sae_loss_bwd(grad_loss, indices, vals, weight, resid, gv.sum(0), need_weight_grad)
    return gvals, gw, gb.to(bias_dtype)


@register_op("topk_sae_loss_bwd", fake=_topk_bwd_fake, reference=_topk_bwd_reference)
def _topk_bwd_op(
    grad_loss: Tensor, indices: Tensor, vals: Tensor, weight: Tensor, resid: Tensor, gv: Tensor,
    need_weight_grad: bool, bias_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.topk_loss_bwd(grad_loss, indices, vals, weight, resid, gv, need_weight_grad, bias_dtype)


def _topk_setup(ctx, inputs, output):
    indices, weight, vals, bias, target = inputs
    _, resid, gv = output
    ctx.mark_non_differentiable(resid, gv)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the auxiliary outputs
    ctx.save_for_backward(indices, vals, weight, resid, gv)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.target_dtype = target.dtype


def _target_grad(grad_loss: Tensor, resid: Tensor, terms: int, dtype: torch.dtype) -> Tensor:
    """The gradient of ``sum(resid^2) / terms`` for ``target``, which enters ``resid`` with a minus
    sign: ``-2 / terms * grad_loss * resid``, in ``dtype``. ``resid`` is TopK's residual, or for
    the hierarchical loss the sum of its K prefix errors (``etot``) with ``terms = B * K * D``."""
    return (grad_loss.to(resid.dtype) * (-2.0 / max(terms, 1)) * resid).to(dtype)


def _topk_backward(ctx, grad_loss, _grad_resid, _grad_gv):
    if grad_loss is None:  # gradients are not materialised: nothing flows into the loss
        return None, None, None, None, None
    indices, vals, weight, resid, gv = ctx.saved_tensors
    _, need_weight, need_vals, need_bias, need_target = ctx.needs_input_grad
    gvals = gw = gb = gt = None
    if need_weight or need_vals or need_bias:
        gvals, gw, gb = _topk_bwd_op(grad_loss, indices, vals, weight, resid, gv, need_weight,
                                     ctx.bias_dtype or resid.dtype)
    if need_target:
        gt = _target_grad(grad_loss, resid, resid.numel(), ctx.target_dtype)
    return (None, gw if need_weight else None, gvals if need_vals else None, gb if need_bias else None, gt)


@register_op("topk_sae_loss", fake=_topk_fake, reference=_topk_reference,
             backward=_topk_backward, setup_context=_topk_setup)
def _topk_op(
    indices: Tensor, weight: Tensor, vals: Tensor, bias: Optional[Tensor], target: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.topk_loss_fwd(indices, weight, vals, bias, target)


def topk_sae_loss(
    indices: Tensor, weight: Tensor, vals: Tensor, bias: Optional[Tensor], target: Tensor,
    *, deterministic: Optional[bool] = None,
) -> Tensor:
    """TopK SAE reconstruction loss, fused with the decoder.

    ``loss = 1/(B*D) * sum_{b,d} (bias_d + sum_k vals[b,k] * weight[indices[b,k], d] - target[b,d])^2``

    Args:
        indices: ``[B, K]`` int32/int64 in ``[0, F)``.
        weight: ``[F, D]`` decoder dictionary.
        vals: ``[B, K]`` activations of the selected latents.
        bias: ``[D]`` decoder bias, or None.
        target: ``[B, D]`` the input being reconstructed (it gets a gradient if it requires one).
        deterministic: accepted for symmetry; this loss is always bit-reproducible (the weight
            gradient is a segmented sum, not atomics).

    Returns:
        A float32 scalar (float64 for float64 inputs). B = 0 gives 0 with zero gradients.
        The decoder is read once in the forward pass; the backward reuses the saved residual.
    """
    del deterministic
    _check_loss_inputs(indices, weight, vals, bias, target)
    return _topk_op(indices, weight, vals, bias, target)[0]


# --- hierarchical_sae_loss -------------------------------------------------------------------


def _hier_fake(indices, weight, vals, bias, target, deterministic):
    acc = reference.acc_dtype(weight, vals, bias, target)
    return vals.new_empty((), dtype=acc), vals.new_empty(indices.shape[0], weight.shape[1], dtype=acc)


def _hier_bwd_fake(grad_loss, indices, weight, vals, bias, target, etot, need_weight_grad, deterministic):
    # contiguous, as the kernels return it
    grad_weight = weight.new_empty(weight.shape) if need_weight_grad else weight.new_empty(0)
    return vals.new_empty(vals.shape), grad_weight, etot.new_empty(etot.shape[1])


@register_op("hierarchical_sae_loss_bwd", fake=_hier_bwd_fake, reference=reference.hierarchical_sae_loss_bwd)
def _hier_bwd_op(
    grad_loss: Tensor, indices: Tensor, weight: Tensor, vals: Tensor, bias: Optional[Tensor], target: Tensor,
    etot: Tensor, need_weight_grad: bool, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.hierarchical_loss_bwd(grad_loss, indices, weight, vals, bias, target, etot, need_weight_grad,
                                         deterministic)


def _hier_setup(ctx, inputs, output):
    indices, weight, vals, bias, target, deterministic = inputs
    _, etot = output
    ctx.mark_non_differentiable(etot)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(indices, weight, vals, bias, target, etot)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.deterministic = deterministic


def _hier_backward(ctx, grad_loss, _grad_etot):
    if grad_loss is None:  # gradients are not materialised: nothing flows into the loss
        return None, None, None, None, None, None
    indices, weight, vals, bias, target, etot = ctx.saved_tensors
    _, need_weight, need_vals, need_bias, need_target, _ = ctx.needs_input_grad
    gvals = gw = gb = gt = None
    if need_weight or need_vals or need_bias:
        gvals, gw, gb = _hier_bwd_op(grad_loss, indices, weight, vals, bias, target, etot, need_weight,
                                     ctx.deterministic)
    if need_target:
        gt = _target_grad(grad_loss, etot, etot.numel() * indices.shape[1], target.dtype)
    return (None, gw if need_weight else None, gvals if need_vals else None,
            gb.to(ctx.bias_dtype) if need_bias else None, gt, None)


def _hier_reference(indices, weight, vals, bias, target, deterministic):
    return reference.hierarchical_sae_loss_fwd(indices, weight, vals, bias, target)


@register_op("hierarchical_sae_loss", fake=_hier_fake, reference=_hier_reference,
             backward=_hier_backward, setup_context=_hier_setup)
def _hier_op(indices: Tensor, weight: Tensor, vals: Tensor, bias: Optional[Tensor], target: Tensor,
             deterministic: bool) -> tuple[Tensor, Tensor]:
    """``deterministic`` only matters to the backward (it picks how the weight gradient is summed)."""
    return kernels.hierarchical_loss_fwd(indices, weight, vals, bias, target)


# When the loss is computed for a backward that its forward can run ahead of (16-bit weights,
# deterministic mode, a frozen decoder: see kernels.hierarchical_fusable), one launch sweeps the
# latents twice and leaves the gradients unscaled for the backward to finish. These two ops have no
# CPU reference: hierarchical_sae_loss only takes them where the kernels run (CUDA, or CPU under
# the Triton interpreter); elsewhere it uses the two ops above, whose reference is exact.


def _hier_grads_fake(indices, weight, vals, bias, target, need_weight_grad, deterministic):
    acc = reference.acc_dtype(weight, vals, bias, target)
    (B, K), (F, D) = indices.shape, weight.shape
    mode = kernels.hierarchical_plan(B, K, F, D, weight.dtype, need_weight_grad, deterministic)[0]
    shape, stage_dtype = kernels.hierarchical_stage_shape(B, K, F, D, weight.dtype, acc, mode)
    gv_tiles = kernels.hierarchical_gv_tiles(D, weight.dtype, deterministic)
    return (vals.new_empty((), dtype=acc), vals.new_empty(B, D, dtype=acc), vals.new_empty(gv_tiles, B, K, dtype=acc),
            vals.new_empty(shape, dtype=stage_dtype))


def _hier_finish_fake(grad_loss, indices, vals, etot, gv, stage, num_features, weight_dtype, bias_dtype, mode):
    B, D = etot.shape
    grad_weight = etot.new_empty((num_features, D) if mode else (0,), dtype=weight_dtype)
    return vals.new_empty(B, gv.shape[-1]), grad_weight, etot.new_empty(D, dtype=bias_dtype)


@register_op("hierarchical_sae_loss_finish", fake=_hier_finish_fake)
def _hier_finish_op(
    grad_loss: Tensor, indices: Tensor, vals: Tensor, etot: Tensor, gv: Tensor, stage: Tensor, num_features: int,
    weight_dtype: torch.dtype, bias_dtype: torch.dtype, mode: int,
) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.hierarchical_grads_finish(grad_loss, indices, vals, etot, gv, stage, num_features, weight_dtype,
                                             bias_dtype, mode)


def _hier_grads_setup(ctx, inputs, output):
    indices, weight, vals, bias, target, need_weight_grad, deterministic = inputs
    _, etot, gv, stage = output
    ctx.mark_non_differentiable(etot, gv, stage)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(indices, vals, etot, gv, stage)  # not weight: its values are not needed again
    B, K = indices.shape
    F, D = weight.shape
    ctx.mode = kernels.hierarchical_plan(B, K, F, D, weight.dtype, need_weight_grad, deterministic)[0]
    ctx.dtypes = (F, weight.dtype, None if bias is None else bias.dtype, target.dtype)


def _hier_grads_backward(ctx, grad_loss, _grad_etot, _grad_gv, _grad_stage):
    if grad_loss is None:
        return (None,) * 7
    indices, vals, etot, gv, stage = ctx.saved_tensors
    _, need_weight, need_vals, need_bias, need_target, _, _ = ctx.needs_input_grad
    F, weight_dtype, bias_dtype, target_dtype = ctx.dtypes
    gvals = gw = gb = gt = None
    if need_weight or need_vals or need_bias:
        gvals, gw, gb = _hier_finish_op(grad_loss, indices, vals, etot, gv, stage, F, weight_dtype,
                                        bias_dtype or etot.dtype, ctx.mode if need_weight else 0)
    if need_target:
        gt = _target_grad(grad_loss, etot, etot.numel() * indices.shape[1], target_dtype)
    return (None, gw if need_weight else None, gvals if need_vals else None, gb if need_bias else None, gt, None,
            None)


@register_op("hierarchical_sae_loss_grads", fake=_hier_grads_fake, backward=_hier_grads_backward,
             setup_context=_hier_grads_setup)
def _hier_grads_op(indices: Tensor, weight: Tensor, vals: Tensor, bias: Optional[Tensor], target: Tensor,
                   need_weight_grad: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, etot, gv, stage): the loss with its gradients, unscaled (kernels.hierarchical_loss_fwd_grads)."""
    return kernels.hierarchical_loss_fwd_grads(indices, weight, vals, bias, target, need_weight_grad, deterministic)


def _fuse_hierarchical(indices, weight, vals, bias, target, deterministic) -> bool:
    """Whether this call takes the fused forward: a gradient will be wanted, the kernels run (CUDA, or
    the Triton interpreter), and the backward has a pass that can apply g * c."""
    if not (torch.is_grad_enabled() and (weight.requires_grad or vals.requires_grad)):
        return False
    if not (weight.is_cuda or INTERPRET):
        return False
    (B, K), (F, D) = indices.shape, weight.shape
    return kernels.hierarchical_fusable(B, K, F, D, weight.dtype, reference.acc_dtype(weight, vals, bias, target),
                                        weight.requires_grad, deterministic)


def hierarchical_sae_loss(
    indices: Tensor, weight: Tensor, vals: Tensor, bias: Optional[Tensor], target: Tensor,
    *, deterministic: Optional[bool] = None,
) -> Tensor:
    """HierarchicalTopK loss (arXiv 2505.24473): the mean of the K prefix TopK losses.

    ``loss = 1/(B*K*D) * sum_{b,k,d} (bias_d + sum_{j<=k} vals[b,j] * weight[indices[b,j], d] - target[b,d])^2``

    The order along K defines the prefixes: pass the latents sorted by activation, largest first,
    so that prefix k is the k-sparse reconstruction. Same arguments, dtypes and B = 0 rule as
    :func:`topk_sae_loss`.

    By default (fp32 weights) the forward reads the active decoder rows once and saves only E_0 =
    sum_k e_k ([B, D] fp32); the backward reads them once more. The weight gradient is scattered
    with fp32 atomics (the summation order, and so the last bits, vary run to run) unless
    ``deterministic=True``, or ``deterministic=None`` (the default) under
    ``torch.use_deterministic_algorithms(True)`` (read when the loss is computed; an explicit
    ``deterministic=False`` keeps the atomics even then), which stages the B*K gradient rows and
    reduces them in a fixed order instead (B*K*D extra floats; for bf16 weights the rows are kept in
    bf16, a column chunk at a time, within the bytes of an F x D fp32 buffer). A 16-bit weight's
    gradient is otherwise accumulated in an F x D fp32 buffer and converted, or, for bf16 with B*K
    <= 2F, staged in one chunk as above.

    When a gradient will be wanted (grad mode on, weight or vals requiring grad) and the backward
    has a pass that can apply the incoming gradient (16-bit weights, deterministic mode with fp32,
    fp16 or fp64 weights, or with bf16 weights when the staged rows fit in one column chunk, or a
    frozen decoder), the forward runs the backward's sweep as well, in the same launch, and hands
    the backward unscaled gradients: the decoder rows come from DRAM once per step instead of twice
    (the second sweep finds them in L1 / L2). The weight-gradient buffer (or the staged rows: B*K*D
    floats in deterministic fp32) is then held from the forward to the backward, so several such
    losses summed before one backward hold one each. Weights in the accumulation dtype (fp32, or
    fp64) on the default atomic path keep the two-pass split: their atomics land in the output
    itself. Compute a loss you will not differentiate under ``torch.no_grad()``, or it pays for the
    backward's sweep.
    """
    _check_loss_inputs(indices, weight, vals, bias, target)
    deterministic = use_deterministic(deterministic)
    if _fuse_hierarchical(indices, weight, vals, bias, target, deterministic):
        return _hier_grads_op(indices, weight, vals, bias, target, weight.requires_grad, deterministic)[0]
    return _hier_op(indices, weight, vals, bias, target, deterministic)[0]


# --- topk (the encoder's selection) ----------------------------------------------------------


def _row_topk_fake(x, k):
    return x.new_empty(x.shape[0], k, dtype=torch.int64)


@register_op("row_topk", fake=_row_topk_fake, reference=reference.row_topk)
def _row_topk_op(x: Tensor, k: int) -> Tensor:
    return kernels.row_topk(x, k)


def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(values, indices)``: the k largest entries along the last dimension, largest first, as
    ``torch.topk(x, k, dim=-1, largest=True, sorted=True)`` returns them, in a sixth to a ninth of
    the time on wide rows at k <= 128 (the selection of a TopK SAE encoder: ``[B, F]``
    pre-activations, F in the tens of thousands; on an H200 at [4096, 65536], k = 64: 0.27 against
    2.01 ms in bf16, 0.42 against 3.09 in float32).

    One program per row takes the maximum of each block of C columns, then the k blocks with the
    largest maxima, then the k largest entries of those k * C (every one of the row's k largest lies
    in a chosen block), both selections by radix over 32-bit integer keys of the floats.

    Args:
        x: ``[..., F]`` float16, bfloat16, float32 or float64, any strides.
        k: ``1 <= k <= F``.

    Returns:
        ``values [..., k]`` in x's dtype, differentiable in x (a gather of the chosen entries, with
        torch.topk's gradient), and ``indices [..., k]`` int64. The values equal torch.topk's (as
        floats compare: of +0.0 and -0.0 the kernel takes +0.0 first); every NaN, whatever its sign
        bit, ranks above every number, as torch.topk ranks it on the CPU (CUDA's torch.topk did not
        always: a NaN with its sign bit set, in a row of 500 at k = 40, came below the numbers).
        Among equal values the kernel takes the lower column first (torch.topk, which CPU tensors
        take without the Triton interpreter, leaves that order open, so indices can differ there).
        float64 rows, k > 512, and rows whose k is too large a share of F for the kernel's buffers
        (``kernels.row_topk_block``) take torch.topk itself, with its own NaN order.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-dim tensor")
    check_not_empty("x", x, -1, "entry in its last dimension")
    F = x.shape[-1]
    try:
        k_int = None if isinstance(k, bool) else operator.index(k)  # an int, or a NumPy / 0-dim integer
    except TypeError:
        k_int = None
    if k_int is None or not 1 <= k_int <= F:
        raise ValueError(f"k must be an integer in [1, {F}] (the size of x's last dimension), got {k!r}")
    k = k_int
    rows = x.reshape(-1, F)
    indices = _row_topk_op(rows.detach(), k)
    return rows.gather(1, indices).reshape(*x.shape[:-1], k), indices.reshape(*x.shape[:-1], k)


# --- unit-norm decoder rows (in place; the training loop calls them around the optimiser step) ---


def _no_output(*args):
    return None


@register_op("normalize_rows_", fake=_no_output, reference=lambda weight, eps: reference.unit_rows_(weight, None, eps),
             mutates_args=("weight",))
def _normalize_op(weight: Tensor, eps: float) -> None:
    kernels.unit_rows_(weight, None, eps)


@register_op("project_rows_", fake=_no_output, reference=lambda grad, weight, eps: reference.unit_rows_(weight, grad, eps),
             mutates_args=("grad",))
def _project_op(grad: Tensor, weight: Tensor, eps: float) -> None:
    kernels.unit_rows_(weight, grad, eps)


def normalize_rows_(weight: Tensor, eps: float = 1e-12) -> Tensor:
    """In place ``weight[f] /= max(||weight[f]||, eps)`` for every row of ``[F, D]`` ``weight``: two
    reads of each row (the second mostly from L2) and one write (norm in float32, float64 for
    float64). ``eps`` is a positive finite number (a NaN one made every row NaN, an infinite one
    every row 0). Returns ``weight``."""
    check_tensor("weight", weight, shape=(None, None), dtypes=FLOAT_DTYPES)
    check_in_place("weight", weight)
    _normalize_op(weight, check_number("eps", eps, positive=True))
    return weight


def remove_parallel_component_(grad: Tensor, weight: Tensor, eps: float = 1e-12) -> Tensor:
    """In place ``grad[f] -= (grad[f] . u_f) u_f`` with ``u_f = weight[f] / max(||weight[f]||, eps)``:
    the gradient of a row kept at unit norm loses its radial part. ``grad`` and ``weight`` are
    ``[F, D]``; two reads of each row of both (the second mostly from L2) and one write of ``grad``.
    ``eps`` as for :func:`normalize_rows_`. Returns ``grad``."""
    check_tensor("weight", weight, shape=(None, None), dtypes=FLOAT_DTYPES)
    check_tensor("grad", grad, shape=tuple(weight.shape), dtypes=FLOAT_DTYPES, device=weight.device)
    check_in_place("grad", grad)
    check_no_partial_overlap("grad", grad, "weight", weight)
    _project_op(grad, weight, check_number("eps", eps, positive=True))
    return grad
