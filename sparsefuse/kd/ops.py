"""Registered ops and the public functions for top-K knowledge distillation.

Shapes: N tokens (leading dimensions [B, S, ...] are flattened), V vocab, H hidden, K teacher slots.
``target_token_ids [..., K]`` int32/int64, ``target_logprobs [..., K]`` float, ``target_mask [..., K]``
bool or 0/1 (None: every slot counts). Floating inputs may be float16, bfloat16, float32 or float64;
arithmetic is float32 (float64 if an input is float64). Losses come back in that accumulation dtype;
gradients in their parameter's dtype.

Objective (see ``reference.py`` for the gradient formulas): with p_k = exp(t_k) over unmasked slots,
the per-token loss is the forward KL  T^2 * sum_k p_k (t_k - log q_k), where ``normalize`` picks q:
``"topk"`` the student renormalised over the teacher's K tokens, ``"full"`` the student's
log-softmax over the vocabulary, ``"tail"`` full plus the (K+1)-th bucket
(1 - P) log((1 - P) / (1 - Q)) (a KL over K + 1 outcomes, never negative). Masked slots are left out
of every sum and normaliser; a token with no unmasked slot contributes 0 and gets a zero gradient.

Teacher slots. Padding slots must be masked (``target_mask``) for ``"topk"`` and ``"tail"`` (and so
for the gathered form): an unmasked slot enters the student's normaliser (lse_K, Q) whatever its
log-prob, so a padding log-prob of -1e9 or -inf does not remove it there (it does under ``"full"``,
where p = 0 makes the slot contribute nothing). The unmasked ids of a token should be distinct, as a
teacher's top-K ids are: ``"tail"`` requires it (its K slots and the tail must be K + 1 distinct
outcomes): with index checks on (see ``set_index_checks``) a repeated id raises ``ValueError``;
unchecked, it poisons the token as an id outside ``[0, V)`` does (below). Under ``"full"`` repeated
slots act as one slot with the summed probability (same gradient, the loss differs by a constant);
under ``"topk"`` each slot is one outcome of the renormalised distribution, so a repeated id is
counted twice in it. The teacher is fixed: ``target_logprobs`` that requires grad (with grad mode on)
raises ``ValueError``; pass ``target_logprobs.detach()``. With index checks off, an unmasked id
outside ``[0, V)`` makes its token's loss (so the loss) NaN and its whole gradient row (logits, or
``grad_hidden``) NaN in every mode; from hidden states the weight and bias gradients then are NaN too
(the row enters every column), except for ``"topk"`` without cross-entropy, where the bad slot adds
nothing to them (the token's other slots add what they would if it were masked).

Reductions: ``"sum"``; ``"mean"`` over tokens that have an unmasked slot (counted on the device);
``num_items_in_batch`` (a positive finite number, or a one-element tensor on the inputs' device)
divides the sum instead, for gradient accumulation.

Layering: forward and backward are each one registered op (``torch.ops.sparsefuse.kd_*``, with
fake implementations, so ``torch.compile(fullgraph=True)`` sees them), and a small
``torch.autograd.Function`` strings them together. Unlike the SAE ops this family does not use
``register_autograd``: on the H200 host the gathered loss ([8192, 64]) spent ~430 us per
forward+backward in the custom-op autograd wrapper against ~80 us in the kernels' launchers, and
that loss is launch-bound. In plain eager mode the registered ops themselves skip the dispatcher
and call their launchers directly (``sparsefuse/_registry.py``).
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch
from torch import Tensor

from .._registry import INTERPRET, first_order, refuse_transforms, register_op
from .._validate import (FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_not_empty, check_number, check_tensor,
                         index_checks_enabled)
from . import kernels, reference
from .reference import NORMALIZE

_REDUCTIONS = ("mean", "sum")

#: Most teacher slots per token that the logits and hidden-state forms take where their kernels run
#: (CUDA, or the Triton interpreter): their backward compares every pair of a token's slots (a
#: [K, K] tile) to sum repeated ids. On one H200 their first call compiled in 3-12 s at K = 256 and
#: 11-26 s at K = 512; at K = 1024 it ran past 100 s, and K = 8192 failed to compile
#: (``scripts/probe_many_latents.py kd``). The gathered form has no such tile and takes any K.
MAX_SLOTS = 512


def _check_reduction(reduction) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _reduction_args(reduction, num_items_in_batch, dev):
    """(reduction code, num_items tensor or None, num_items float) for the ops."""
    _check_reduction(reduction)
    if num_items_in_batch is None:
        return reference.REDUCTION[reduction], None, 1.0
    if isinstance(num_items_in_batch, Tensor):  # its value is not checked: that would be a host sync
        check_tensor("num_items_in_batch", num_items_in_batch, device=dev)
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one element, got shape {tuple(num_items_in_batch.shape)}")
        return 2, num_items_in_batch.reshape(()), 1.0
    return 2, None, check_number("num_items_in_batch", num_items_in_batch, positive=True)


def _normalize_code(normalize):
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {tuple(NORMALIZE)}, got {normalize!r}")
    return NORMALIZE[normalize]


def _check_temperature(temperature):
    return check_number("temperature", temperature, positive=True)


def _check_chunk_size(chunk_size):
    """The hidden form's tokens per chunk: a positive integer, or None (from the vocabulary size)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer or None (automatic), got {chunk_size!r}")


_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16) + INDEX_DTYPES + FLOAT_DTYPES


def _check_targets(ids, logprobs, mask, dev, *, with_ids=True):
    """Flatten the teacher tensors to [N, K] (ids for the forms that take them) and check them."""
    if with_ids:
        check_tensor("target_token_ids", ids, dtypes=INDEX_DTYPES, device=dev)
    check_tensor("target_logprobs", logprobs, dtypes=FLOAT_DTYPES, device=dev)
    if logprobs.requires_grad and torch.is_grad_enabled():
        raise ValueError("target_logprobs requires grad, but the teacher is treated as fixed (no gradient would "
                         "reach it); pass target_logprobs.detach()")
    name, shape = ("target_token_ids", tuple(ids.shape)) if with_ids else ("target_logprobs", tuple(logprobs.shape))
    if len(shape) < 1 or shape[-1] < 1:
        raise ValueError(f"{name} must end in a K >= 1 dimension, got shape {shape}")
    if tuple(logprobs.shape) != shape:
        raise ValueError(f"target_logprobs has shape {tuple(logprobs.shape)}; expected {shape}")
    if mask is not None:
        check_tensor("target_mask", mask, dtypes=_MASK_DTYPES, device=dev)
        if tuple(mask.shape) != shape:
            raise ValueError(f"target_mask has shape {tuple(mask.shape)}; expected {shape}")
    K = shape[-1]
    if with_ids and K > MAX_SLOTS and (dev.type == "cuda" or INTERPRET):
        raise ValueError(f"target_token_ids has {K} slots per token; the logits and hidden-state forms take at most "
                         f"{MAX_SLOTS} on the GPU (their kernels compare every pair of slots). Keep the teacher's top "
                         f"{MAX_SLOTS}, or gather the student's logits at the ids and use topk_kd_loss")
    t = logprobs.reshape(-1, K)
    m = torch.ones(t.shape, dtype=torch.bool, device=dev) if mask is None else mask.reshape(-1, K)
    if m.dtype != torch.bool:
        m = m != 0
    return (ids.reshape(-1, K) if with_ids else None), t, m, shape[:-1]


def _check_ids(ids, mask, V, labels=None, distinct=False):
    """Range-check the unmasked ids (and the labels that are not -100) when index checks are on,
    and with ``distinct`` (``"tail"``) reject an id repeated among a token's unmasked slots.

    Both implementations of an op (the Triton launcher and, on CPU without the interpreter, the
    PyTorch reference) run this first, so a bad id raises the same error on either. It reads the
    data, so it lives inside the ops, where ``torch.compile`` does not trace it."""
    if index_checks_enabled(ids):
        on = mask != 0
        check_index_range("target_token_ids", torch.where(on, ids, torch.zeros_like(ids)), V)
        if distinct and ids.shape[1] > 1 and ids.shape[0]:
            keys, rep = reference.repeated_ids(ids, on)
            if bool(rep.any()):
                n, k = rep.nonzero()[0].tolist()
                raise ValueError(f"target_token_ids repeats id {keys[n, k].item()} among the unmasked slots of token "
                                 f"{n} (flattened); normalize='tail' needs distinct ids (the K slots and the tail are "
                                 f"K + 1 distinct outcomes)")
    if labels is not None and index_checks_enabled(labels):
        check_index_range("labels", torch.where(labels != reference.IGNORE_INDEX, labels, torch.zeros_like(labels)), V)


# --- gathered logits ----------------------------------------------------------------------------


def _topk_fake(z, t, mask, temperature, reduction, num_items, num_items_value):
    acc = reference.acc_dtype(z, t)
    return z.new_empty((), dtype=acc), z.new_empty(z.shape[0], dtype=acc), z.new_empty(2, dtype=acc)


def _topk_bwd_fake(grad_loss, grad_tok, z, t, mask, scale, temperature):
    return z.new_empty(z.shape)  # contiguous like the kernel's (torch.empty_like would keep z's strides)


@register_op("kd_topk_bwd", fake=_topk_bwd_fake, reference=reference.kd_topk_bwd)
def _topk_bwd_op(grad_loss: Tensor, grad_tok: Optional[Tensor], z: Tensor, t: Tensor, mask: Tensor, scale: Tensor,
                 temperature: float) -> Tensor:
    return kernels.topk_bwd(grad_loss, grad_tok, z, t, mask, scale, temperature)


@register_op("kd_topk", fake=_topk_fake, reference=reference.kd_topk_fwd)
def _topk_op(z: Tensor, t: Tensor, mask: Tensor, temperature: float, reduction: int, num_items: Optional[Tensor],
             num_items_value: float) -> tuple[Tensor, Tensor, Tensor]:
    return kernels.topk_fwd(z, t, mask, temperature, reduction, num_items, num_items_value)


class _TopKFunction(torch.autograd.Function):
    """Autograd around the two registered ops (cheaper per call than register_autograd, see module doc)."""

    @staticmethod
    def forward(ctx, z, t, mask, temperature, reduction, num_items, num_items_value):
        loss, tok, scale = _topk_op(z, t, mask, temperature, reduction, num_items, num_items_value)
        ctx.save_for_backward(z, t, mask, scale)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return loss, tok

    @staticmethod
    @first_order
    def backward(ctx, grad_loss, grad_tok):
        z, t, mask, scale = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = scale.new_zeros(())
        return _topk_bwd_op(grad_loss, grad_tok, z, t, mask, scale, ctx.temperature), None, None, None, None, None, None


def topk_kd_loss(
    student_logits_topk: Tensor, target_logprobs: Tensor, target_mask: Optional[Tensor] = None, *,
    temperature: float = 1.0, reduction: str = "mean", num_items_in_batch: Union[int, float, Tensor, None] = None,
    return_per_token: bool = False,
):
    """Top-K distillation loss from the student logits already gathered at the teacher's K tokens.

    ``loss_token = T^2 * sum_k p_k (t_k - log softmax_K(z / T)_k)`` over unmasked slots (the
    ``"topk"`` normalisation: the student renormalised over the K tokens).

    Args:
        student_logits_topk: ``[..., K]`` student logits at the teacher's top-K token ids.
        target_logprobs: ``[..., K]`` teacher log-probabilities (fixed: one that requires grad raises
            ``ValueError``; pass it detached).
        target_mask: ``[..., K]`` bool or 0/1; None means every slot counts. Padding slots must be
            masked: an unmasked slot enters the renormalisation whatever its log-prob (-1e9, -inf).
        temperature: T > 0, a Python number; divides the student logits; the loss is multiplied by T^2.
        reduction: ``"mean"`` (over tokens with an unmasked slot) or ``"sum"``.
        num_items_in_batch: if given (a positive finite number, or a one-element tensor whose value is
            not checked), the loss is the sum divided by it (in place of ``reduction``'s divisor).
        return_per_token: also return the per-token loss ``[...]`` (differentiable).

    Returns:
        A scalar in float32 (float64 for float64 inputs), or ``(loss, per_token)``.
    """
    check_tensor("student_logits_topk", student_logits_topk, dtypes=FLOAT_DTYPES)
    dev = student_logits_topk.device
    _, t, m, lead = _check_targets(None, target_logprobs, target_mask, dev, with_ids=False)
    if tuple(student_logits_topk.shape) != tuple(target_logprobs.shape):
        raise ValueError(f"student_logits_topk has shape {tuple(student_logits_topk.shape)}; "
                         f"expected {tuple(target_logprobs.shape)} (the shape of target_logprobs)")
    T = _check_temperature(temperature)
    red, items, items_v = _reduction_args(reduction, num_items_in_batch, dev)
    refuse_transforms((student_logits_topk, t, m, items), functorch_ok=False)
    loss, tok = _TopKFunction.apply(student_logits_topk.reshape(t.shape), t, m, T, red, items, items_v)
    return (loss, tok.reshape(lead)) if return_per_token else loss


# --- full logits ---------------------------------------------------------------------------------


def _logits_fake(z, ids, t, mask, normalize, temperature, reduction, num_items, num_items_value):
    acc = reference.acc_dtype(z, t)
    N, K = ids.shape
    e = lambda *s: z.new_empty(*s, dtype=acc)  # noqa: E731
    return e(()), e(N), e(2), e(N), e(N), e(N, K)


def _logits_bwd_fake(grad_loss, grad_tok, z, ids, mask, lse, A, corr, scale, normalize, temperature):
    return z.new_empty(z.shape)  # contiguous like the kernel's


@register_op("kd_logits_bwd", fake=_logits_bwd_fake, reference=reference.kd_logits_bwd)
def _logits_bwd_op(grad_loss: Tensor, grad_tok: Optional[Tensor], z: Tensor, ids: Tensor, mask: Tensor, lse: Tensor,
                   A: Tensor, corr: Tensor, scale: Tensor, normalize: int, temperature: float) -> Tensor:
    return kernels.logits_bwd(grad_loss, grad_tok, z, ids, mask, lse, A, corr, scale, normalize, temperature)


def _logits_reference(z, ids, t, mask, normalize, *args):
    _check_ids(ids, mask, z.shape[1], distinct=normalize == 2)
    return reference.kd_logits_fwd(z, ids, t, mask, normalize, *args)


@register_op("kd_logits", fake=_logits_fake, reference=_logits_reference)
def _logits_op(z: Tensor, ids: Tensor, t: Tensor, mask: Tensor, normalize: int, temperature: float, reduction: int,
               num_items: Optional[Tensor], num_items_value: float
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_ids(ids, mask, z.shape[1], distinct=normalize == 2)
    return kernels.logits_fwd(z, ids, t, mask, normalize, temperature, reduction, num_items, num_items_value)


class _LogitsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, ids, t, mask, normalize, temperature, reduction, num_items, num_items_value):
        loss, tok, scale, lse, A, corr = _logits_op(z, ids, t, mask, normalize, temperature, reduction, num_items,
                                                    num_items_value)
        ctx.save_for_backward(z, ids, mask, lse, A, corr, scale)
        ctx.args = (normalize, temperature)
        ctx.set_materialize_grads(False)
        return loss, tok

    @staticmethod
    @first_order
    def backward(ctx, grad_loss, grad_tok):
        z, ids, mask, lse, A, corr, scale = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = scale.new_zeros(())
        g = _logits_bwd_op(grad_loss, grad_tok, z, ids, mask, lse, A, corr, scale, *ctx.args)
        return (g,) + (None,) * 8


def topk_kd_loss_from_logits(
    logits: Tensor, target_token_ids: Tensor, target_logprobs: Tensor, target_mask: Optional[Tensor] = None, *,
    normalize: str = "full", temperature: float = 1.0, reduction: str = "mean",
    num_items_in_batch: Union[int, float, Tensor, None] = None, return_per_token: bool = False,
):
    """Top-K distillation loss from the student's full logits ``[..., V]``.

    Args:
        logits: ``[..., V]`` student logits (leading dimensions match the targets').
        target_token_ids: ``[..., K]`` teacher top-K token ids in ``[0, V)`` (masked slots may hold
            anything; unmasked ids outside the range raise ``IndexError``, see ``set_index_checks``).
            A token's unmasked ids should be distinct; ``"tail"`` requires it (``ValueError`` when
            index checks are on; see the module docstring). At most :data:`MAX_SLOTS` (512) slots
            where the kernels run (CUDA, or the Triton interpreter), here and from hidden states.
        target_logprobs, target_mask, temperature, reduction, num_items_in_batch, return_per_token:
            as in :func:`topk_kd_loss` (padding slots must be masked for ``"topk"`` and ``"tail"``).
        normalize: ``"topk"``, ``"full"`` (default) or ``"tail"`` (see the module docstring).

    Returns:
        A scalar (float32, or float64 for float64 inputs), or ``(loss, per_token)``. The forward
        reads the logits once (online logsumexp) and keeps O(N*K) state; the backward writes the
        logits gradient in one pass, with no [N, V] float32 temporaries.
    """
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES)
    dev = logits.device
    ids, t, m, lead = _check_targets(target_token_ids, target_logprobs, target_mask, dev)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != lead:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected {list(lead) + ['V']}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension V >= 1")
    mode = _normalize_code(normalize)
    T = _check_temperature(temperature)
    red, items, items_v = _reduction_args(reduction, num_items_in_batch, dev)
    z = logits.reshape(-1, logits.shape[-1])
    refuse_transforms((z, ids, t, m, items), functorch_ok=False)
    loss, tok = _LogitsFunction.apply(z, ids, t, m, mode, T, red, items, items_v)
    return (loss, tok.reshape(lead)) if return_per_token else loss


# --- hidden states -------------------------------------------------------------------------------


def _hidden_fake(hidden, weight, bias, ids, t, mask, labels, normalize, temperature, reduction, num_items,
                 num_items_value, ce_weight, need_gh, need_gw, need_gb, chunk_size):
    acc = reference.acc_dtype(hidden, weight, t)
    N = ids.shape[0]
    # contiguous like the kernels' gradients, whatever the inputs' strides
    gh = hidden.new_empty(hidden.shape) if need_gh else hidden.new_empty(0)
    gw = weight.new_empty(weight.shape) if need_gw else weight.new_empty(0)
    gb = bias.new_empty(bias.shape) if need_gb else hidden.new_empty(0)
    return hidden.new_empty((), dtype=acc), hidden.new_empty(N, dtype=acc), gh, gw, gb, hidden.new_empty(2, dtype=acc)


def _hidden_bwd_fake(grad_loss, grad_hidden, grad_weight, grad_bias, applied):
    return None


@register_op("kd_hidden_bwd", fake=_hidden_bwd_fake, reference=reference.kd_hidden_bwd,
             mutates_args=("grad_hidden", "grad_weight", "grad_bias", "applied"))
def _hidden_bwd_op(grad_loss: Tensor, grad_hidden: Tensor, grad_weight: Tensor, grad_bias: Tensor,
                   applied: Tensor) -> None:
    """Rescale the forward's gradients in place to the incoming gradient (no-op when it is 1);
    ``applied`` [2] holds the factors (grad_hidden's, then grad_weight's and grad_bias's) they carry."""
    kernels.hidden_bwd(grad_loss, grad_hidden, grad_weight, grad_bias, applied)


def _hidden_reference(hidden, weight, bias, ids, t, mask, labels, normalize, *args):
    _check_ids(ids, mask, weight.shape[0], labels, distinct=normalize == 2)
    return reference.kd_hidden_fwd(hidden, weight, bias, ids, t, mask, labels, normalize, *args)


@register_op("kd_hidden", fake=_hidden_fake, reference=_hidden_reference)
def _hidden_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, t: Tensor, mask: Tensor,
               labels: Optional[Tensor], normalize: int, temperature: float, reduction: int,
               num_items: Optional[Tensor], num_items_value: float, ce_weight: float, need_gh: bool, need_gw: bool,
               need_gb: bool, chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_ids(ids, mask, weight.shape[0], labels, distinct=normalize == 2)
    return kernels.hidden_fwd(hidden, weight, bias, ids, t, mask, labels, normalize, temperature, reduction,
                              num_items, num_items_value, ce_weight, need_gh, need_gw, need_gb, chunk_size)


class _HiddenFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, *args):
        loss, tok, gh, gw, gb, applied = _hidden_op(hidden, weight, bias, *args)
        # tok stays differentiable so that a gradient reaching it is seen (and refused) in backward,
        # rather than dropped; set_materialize_grads(False) makes its gradient None when unused
        ctx.save_for_backward(gh, gw, gb, applied)
        ctx.set_materialize_grads(False)
        ctx.handed_out = False  # whether a backward has returned the saved gradients
        return loss, tok

    @staticmethod
    @first_order
    def backward(ctx, grad_loss, grad_tok):
        if grad_tok is not None:
            if not torch.compiler.is_compiling():
                raise RuntimeError("topk_kd_loss_from_hidden: a gradient reached the per-token loss (return_per_"
                                   "token=True), which is not differentiable: the gradients are computed in the "
                                   "forward pass for the returned loss only. Use the per-token loss detached, or "
                                   "topk_kd_loss_from_logits, whose per-token loss is differentiable")
            # Traced, the gradient of an unused output is a tensor of zeros, not None: a non-zero one
            # makes every returned gradient NaN instead (no host sync).
            used = (grad_tok != 0).any()
            grad_loss = torch.where(used, float("nan"), grad_tok.new_zeros(()) if grad_loss is None else grad_loss)
        # after a later backward, private copies (see below); else the saved gradients, whose version
        # check refuses a backward after the caller changed the returned ones in place
        try:
            gh, gw, gb, applied = getattr(ctx, "private", None) or ctx.saved_tensors
        except RuntimeError as e:
            if "inplace" not in str(e):
                raise
            raise RuntimeError("topk_kd_loss_from_hidden: a later backward through a retained graph rescales the "
                               "gradients the first backward returned, which were changed in place since (zeroed, "
                               "clipped, or an optimizer step on .grad). Compute the loss again") from e
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (need_h and gh.dim() == 1) or (need_w and gw.dim() == 1) or (need_b and gb.numel() == 0):
            raise RuntimeError("topk_kd_loss_from_hidden: a gradient was not computed in the forward pass "
                               "(the input did not require grad, or grad mode was off, when the loss was computed)")
        rest = (None,) * (len(ctx.needs_input_grad) - 3)  # the forward's other inputs get no gradient
        if grad_loss is None:
            return (None, None, None) + rest
        if ctx.handed_out:
            # A later backward (retain_graph): the caller holds the tensors returned before (a
            # leaf's .grad may even be one of them), so scale new ones by grad_loss / applied.
            # The first backward scaled the saved gradients to its incoming gradient; if that was 0
            # (or not finite) they are lost. Checking costs a host sync, in this rare path only.
            if not torch.compiler.is_compiling() and bool(((applied == 0) | ~applied.isfinite()).any()):
                raise RuntimeError("topk_kd_loss_from_hidden: a later backward through a retained graph cannot be "
                                   "computed: the first backward's incoming gradient was 0 (or not finite), and "
                                   "the gradients, computed in the forward pass and scaled in place by it, are "
                                   "lost. Compute the loss again")
            if getattr(ctx, "private", None) is None and not torch.compiler.is_compiling():
                # The caller holds the first backward's tensors, and autograd accumulates this
                # backward's result into them when they became a leaf's .grad: keep copies of what
                # they hold now, so that a third backward neither reads changed values nor trips
                # the saved tensors' version check (copies only on this retain_graph path).
                ctx.private = gh, gw, gb, applied = tuple(x.clone() for x in (gh, gw, gb, applied))
            f = grad_loss.to(applied.dtype) / applied
            gh, gw, gb = ((x.to(f.dtype) * fx).to(x.dtype) for x, fx in ((gh, f[0]), (gw, f[1]), (gb, f[1])))
        else:
            # .data: the rescale mutates the saved gradients without bumping the saved tensors' version,
            # so a later backward can still unpack them (`applied` records the factors they now carry).
            _hidden_bwd_op(grad_loss, gh.data, gw.data, gb.data, applied.data)
            ctx.handed_out = True
        return (gh if need_h else None, gw if need_w else None, gb if need_b else None) + rest


def _needs_grad(t: Optional[Tensor]) -> bool:
    return t is not None and torch.is_grad_enabled() and t.requires_grad


def topk_kd_loss_from_hidden(
    hidden: Tensor, lm_head_weight: Tensor, target_token_ids: Tensor, target_logprobs: Tensor,
    target_mask: Optional[Tensor] = None, *, normalize: str = "full", temperature: float = 1.0,
    reduction: str = "mean", num_items_in_batch: Union[int, float, Tensor, None] = None,
    lm_head_bias: Optional[Tensor] = None, labels: Optional[Tensor] = None, ce_weight: Optional[float] = None,
    return_per_token: bool = False, chunk_size: Optional[int] = None,
):
    """Top-K distillation loss from the student's last hidden states, fused with the LM head.

    ``logits = hidden @ lm_head_weight.T (+ lm_head_bias)`` is never materialised for all tokens:
    tokens go in chunks (``chunk_size`` rows; by default a power of two, 128-256 MiB of logits); each
    chunk's logits come from a cuBLAS matmul, a Triton kernel computes the loss and overwrites them
    with their gradient in place, and two more matmuls accumulate grad_hidden and the weight
    gradient (in the weight's dtype). ``normalize="topk"`` without cross-entropy only reads the K
    weight rows of each token and never touches V. Gradients are computed in the forward pass (for an incoming
    gradient of 1) and rescaled in place on the device in the backward; a further backward through
    a retained graph (``retain_graph=True``) scales copies instead (the first such backward takes
    them), so it is exact too and leaves the gradients already returned unchanged, unless the first
    backward's incoming gradient was 0 (the in-place rescale then zeroed them) or the returned
    gradients were changed in place before it: that later backward raises ``RuntimeError``. With float16
    inputs the forward computes the gradients at a per-token weight of 1 (the reduction's 1/count
    would make them subnormal) and, where they sum over tokens (weight and bias), scaled by a power
    of two at most the reduction's weight, so they stay within float16's range; the backward
    divides these factors out.

    Args:
        hidden: ``[..., H]`` student hidden states.
        lm_head_weight: ``[V, H]`` (same dtype as ``hidden``).
        target_token_ids, target_logprobs, target_mask: ``[..., K]`` teacher top-K (see
            :func:`topk_kd_loss_from_logits`).
        normalize, temperature, reduction, num_items_in_batch: as in :func:`topk_kd_loss_from_logits`.
        lm_head_bias: ``[V]`` (same dtype as ``lm_head_weight``) or None.
        labels: ``[...]`` hard labels for an added cross-entropy (ignore index -100), or None.
        ce_weight: weight (a finite number >= 0) of the cross-entropy term, computed on the untempered
            logits with the same reduction (``"mean"``: over labels that are not -100). Required with
            ``labels`` (``ValueError`` otherwise: labels alone would add nothing); 0 turns the term
            off, as for a schedule that starts it later. None (default) without labels: no term.
        return_per_token: also return the per-token KD loss ``[...]``. It is not differentiable (the
            gradients are computed in the forward pass for ``loss``): a backward that sends a gradient
            into it raises ``RuntimeError``, or, under ``torch.compile`` (where checking would cost a
            host sync), makes every returned gradient NaN when that gradient is non-zero. Use it
            detached, or the logits form.
        chunk_size: tokens per chunk, a positive integer, or None (default: from the vocabulary size).

    Returns:
        ``loss`` (float32, or float64 for float64 inputs), or ``(loss, per_token)``.
    """
    check_tensor("lm_head_weight", lm_head_weight, shape=(None, None), dtypes=FLOAT_DTYPES)
    V, H = lm_head_weight.shape
    dev = lm_head_weight.device
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, device=dev)
    if hidden.dtype != lm_head_weight.dtype:  # under autocast a bf16 hidden meets an fp32 weight
        raise TypeError(f"hidden has dtype {str(hidden.dtype)[6:]} and lm_head_weight {str(lm_head_weight.dtype)[6:]}; "
                        f"they must match (the kernels do not follow autocast: cast one to the other's dtype)")
    if hidden.dim() < 1 or hidden.shape[-1] != H:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected [..., {H}] (lm_head_weight is [{V}, {H}])")
    ids, t, m, lead = _check_targets(target_token_ids, target_logprobs, target_mask, dev)
    if tuple(hidden.shape[:-1]) != lead:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}; expected {list(lead) + [H]}")
    check_tensor("lm_head_bias", lm_head_bias, shape=(V,), dtypes=(lm_head_weight.dtype,), device=dev, optional=True)
    check_not_empty("lm_head_weight", lm_head_weight, 0, "row (V >= 1)")
    if ce_weight is None:
        if labels is not None:
            raise ValueError("labels are given but ce_weight is not: pass ce_weight > 0 to add their "
                             "cross-entropy (ce_weight=0 leaves it out)")
        ce_weight = 0.0
    ce_weight = check_number("ce_weight", ce_weight, positive=False)
    if ce_weight and labels is None:
        raise ValueError("ce_weight is set but labels is None")
    _check_chunk_size(chunk_size)
    if labels is not None:
        check_tensor("labels", labels, dtypes=INDEX_DTYPES, device=dev)
        if tuple(labels.shape) != lead:
            raise ValueError(f"labels has shape {tuple(labels.shape)}; expected {list(lead)}")
        labels = labels.reshape(-1)
    mode = _normalize_code(normalize)
    T = _check_temperature(temperature)
    red, items, items_v = _reduction_args(reduction, num_items_in_batch, dev)
    h = hidden.reshape(ids.shape[0], H)  # not -1: with H = 0 there is nothing to infer it from
    w = lm_head_weight if lm_head_weight.stride(-1) == 1 else lm_head_weight.contiguous()
    refuse_transforms((h, w, lm_head_bias, ids, t, m, labels, items), functorch_ok=False)
    loss, tok = _HiddenFunction.apply(
        h, w, lm_head_bias, ids, t, m, labels if ce_weight else None, mode, T, red, items, items_v,
        ce_weight, _needs_grad(hidden), _needs_grad(lm_head_weight), _needs_grad(lm_head_bias),
        0 if chunk_size is None else int(chunk_size),
    )
    return (loss, tok.reshape(lead)) if return_per_token else loss
