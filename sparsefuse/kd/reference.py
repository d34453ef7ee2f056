"""Exact PyTorch references for the top-K knowledge-distillation losses.

Two kinds of function live here:

* ``topk_kd_loss``, ``topk_kd_loss_from_logits``, ``topk_kd_loss_from_hidden``: the plain math,
  differentiable by autograd, returning ``(loss, per_token)``. Tests compare the kernels against
  them in float64; benchmarks time them in eager mode and under ``torch.compile``.
* ``slot_terms`` and the ``*_fwd`` / ``*_bwd`` functions: the same math split the way the
  registered ops split it, with explicit gradient formulas. They are the ops' CPU implementation
  when the Triton interpreter is off, and they document what each kernel computes.

Notation (per token): student logits z [V] (or the K gathered ones), s = z / T, teacher slots
k = 1..K with ids i_k, log-probabilities t_k and a mask; p_k = exp(t_k) on unmasked slots, else 0;
P = sum_k p_k; lse_K = logsumexp of s over unmasked slots; lse_V = logsumexp of s over the vocab;
lse_tail = logsumexp of s over the other columns; q_j = exp(s_j - lse_V); Q = exp(lse_K - lse_V)
(the student mass on the teacher's slots) and 1 - Q = exp(lse_tail - lse_V).

    topk:  L = sum_k p_k (t_k - s_{i_k}) + P * lse_K
    full:  L = sum_k p_k (t_k - s_{i_k}) + P * lse_V
    tail:  full + (1 - P) * log((1 - P) / (1 - Q))

each multiplied by T**2. Gradient with respect to s (then dL/dz = T * dL/ds, T**2 included):
dense part ``A * q_j`` over the whole vocab plus a correction ``corr_k`` at each unmasked slot:

    topk:  A = 0,          corr_k = P * exp(s_k - lse_K) - p_k
    full:  A = P,          corr_k = -p_k

and for tail, ``A * exp(s_j - lse_tail)`` off the slots and ``corr_k`` as the slot column's whole value:

    tail:  A = P * (1 - Q) - (1 - P) * Q,  corr_k = q_{i_k} - p_k

(a KL over K + 1 outcomes, the last one spread over the off-slot columns as the student's softmax
there). log(1 - Q) = lse_tail - lse_V keeps its precision however confident the student is
(1 - exp(lse_K - lse_V) resolves nothing below an ulp of lse_V, ~1e-6 in float32, and exp underflows
below ~1e-38), and the gradient never forms r = (1 - P) / (1 - Q), which grows without bound. With no
column off the slots (K = V, or -inf logits there) 1 - Q = 0 is taken as the dtype's smallest normal
number: the tail term saturates and passes no gradient (1 - P drops out of A and corr).

Slots sharing an id add up. A token with no unmasked slot has L = 0 and a zero gradient.
"""

from __future__ import annotations

import math

import torch

from .._dtypes import acc_dtype

NORMALIZE = {"topk": 0, "full": 1, "tail": 2}
REDUCTION = {"sum": 0, "mean": 1}  # the ops' code 2 divides by num_items_in_batch
IGNORE_INDEX = -100


def slot_columns(ids, valid, V):
    """[N, V] bool: the columns that hold a valid slot (masked or out-of-range slots mark nothing)."""
    cols = torch.zeros(ids.shape[0], V + 1, dtype=torch.bool, device=ids.device)
    return cols.scatter_(-1, torch.where(valid, ids, V).long(), True)[:, :V]


def lse_off_slots(s, ids, valid):
    """lse_tail: logsumexp of s [N, V] over the columns that hold no valid slot (-inf if none)."""
    return torch.logsumexp(s.masked_fill(slot_columns(ids, valid, s.shape[-1]), float("-inf")), -1)


def _log_one_minus_q(lse_tail, lse_v):
    """log(1 - Q) = lse_tail - lse_V; log of the dtype's smallest normal number when no column is off
    the slots (a constant: no gradient)."""
    return torch.where(lse_tail == float("-inf"), math.log(torch.finfo(lse_v.dtype).tiny), lse_tail - lse_v)


def _per_token(s_k, t, valid, lse_v, normalize: int, lse_tail=None):
    """Per-token loss (without T**2) from the gathered s_k [N, K] and, unless topk, lse_v [N]
    (and lse_tail [N] for tail)."""
    p = torch.where(valid, t.exp(), torch.zeros_like(t))
    P = p.sum(-1)
    cross = torch.where(p > 0, p * (t - s_k), torch.zeros_like(t)).sum(-1)
    has = valid.any(-1)
    s_safe = torch.where(has[:, None], torch.where(valid, s_k, torch.full_like(s_k, float("-inf"))),
                         torch.zeros_like(s_k))
    lse_k = torch.logsumexp(s_safe, -1)
    if normalize == 0:
        loss = cross + P * lse_k
    else:
        loss = cross + P * lse_v
        if normalize == 2:
            log_om_q = _log_one_minus_q(lse_tail, lse_v)
            om_p = (1 - P).clamp_min(0)
            loss = loss + torch.where(om_p > 0, om_p * (om_p.clamp_min(torch.finfo(P.dtype).tiny).log() - log_om_q),
                                      torch.zeros_like(om_p))
    return torch.where(has, loss, torch.zeros_like(loss))


def _reduce(per_token, valid, reduction: str, num_items_in_batch):
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    if reduction == "mean":
        return total / valid.any(-1).sum().clamp_min(1)
    return total


def _flatten(x):
    return x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, *x.shape)


def _mask(target_mask, like):
    return torch.ones_like(like, dtype=torch.bool) if target_mask is None else target_mask.reshape(like.shape) != 0


def topk_kd_loss(student_logits_topk, target_logprobs, target_mask=None, *, temperature=1.0, reduction="mean",
                 num_items_in_batch=None):
    """Reference for :func:`sparsefuse.topk_kd_loss`: ``(loss, per_token [...])``."""
    lead = student_logits_topk.shape[:-1]
    z = _flatten(student_logits_topk)
    dt = acc_dtype(z, target_logprobs)
    t = target_logprobs.reshape(z.shape).to(dt)
    valid = _mask(target_mask, z)
    tok = _per_token(z.to(dt) / temperature, t, valid, None, 0) * temperature**2
    return _reduce(tok, valid, reduction, num_items_in_batch), tok.reshape(lead)


def topk_kd_loss_from_logits(logits, target_token_ids, target_logprobs, target_mask=None, *, normalize="full",
                             temperature=1.0, reduction="mean", num_items_in_batch=None):
    """Reference for :func:`sparsefuse.topk_kd_loss_from_logits`: ``(loss, per_token [...])``."""
    lead = target_token_ids.shape[:-1]
    ids = _flatten(target_token_ids)
    z = logits.reshape(ids.shape[0], logits.shape[-1])
    dt = acc_dtype(z, target_logprobs)
    t = target_logprobs.reshape(ids.shape).to(dt)
    valid = _mask(target_mask, ids)
    s = z.to(dt) / temperature
    s_k = s.gather(-1, torch.where(valid, ids, torch.zeros_like(ids)).long())
    mode = NORMALIZE[normalize]
    lse_v = torch.logsumexp(s, -1) if mode else None
    lse_tail = lse_off_slots(s, ids, valid) if mode == 2 else None
    tok = _per_token(s_k, t, valid, lse_v, mode, lse_tail) * temperature**2
    return _reduce(tok, valid, reduction, num_items_in_batch), tok.reshape(lead)


def _label_columns(labels, V):
    """(has [N]: label is not -100, bad [N]: a label outside [0, V) that is not -100 (index checks
    off), column [N, 1] int64 to gather or scatter at: the label, or 0 where there is none)."""
    has = labels != IGNORE_INDEX
    bad = has & ((labels < 0) | (labels >= V))
    return has, bad, torch.where(has & ~bad, labels, torch.zeros_like(labels)).long()[:, None]


def cross_entropy_terms(logits, labels):
    """(sum of per-token CE over labels != -100, count of such labels), in the logits' dtype. A label
    outside [0, V) (index checks off) makes its token's term NaN, and its gradient under autograd."""
    labels = labels.reshape(-1)
    has, bad, col = _label_columns(labels, logits.shape[-1])
    lse = torch.logsumexp(logits, -1)
    z_l = logits.gather(-1, col)[:, 0]
    ce = torch.where(has, lse - z_l, torch.zeros_like(lse))
    return (ce * torch.where(bad, float("nan"), 1.0).to(ce.dtype)).sum(), has.sum()


def topk_kd_loss_from_hidden(hidden, lm_head_weight, target_token_ids, target_logprobs, target_mask=None, *,
                             normalize="full", temperature=1.0, reduction="mean", num_items_in_batch=None,
                             lm_head_bias=None, labels=None, ce_weight=0.0):
    """Reference for :func:`sparsefuse.topk_kd_loss_from_hidden`: materialises the logits (in the
    accumulation dtype) and adds ``ce_weight`` times the hard-label cross-entropy."""
    dt = acc_dtype(hidden, lm_head_weight, target_logprobs)
    h = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1]).to(dt)  # not -1: H may be 0
    logits = h @ lm_head_weight.to(dt).t()
    if lm_head_bias is not None:
        logits = logits + lm_head_bias.to(dt)
    loss, tok = topk_kd_loss_from_logits(logits, target_token_ids, target_logprobs, target_mask, normalize=normalize,
                                         temperature=temperature, reduction=reduction,
                                         num_items_in_batch=num_items_in_batch)
    if ce_weight and labels is not None:
        ce_sum, n = cross_entropy_terms(logits, labels)
        if num_items_in_batch is not None:
            ce = ce_sum / num_items_in_batch
        elif reduction == "mean":
            ce = ce_sum / n.clamp_min(1)
        else:
            ce = ce_sum
        loss = loss + ce_weight * ce
    return loss, tok


# --- the ops' CPU implementations --------------------------------------------------------------


def slot_terms(s_k, t, valid, lse, normalize: int):
    """Explicit per-token terms: (loss [N] without T**2, A [N], corr [N, K], lse_V [N]); see the module
    doc. ``lse`` is lse_V for full, lse_tail for tail, unused for topk (as in the kernels' math core)."""
    p = torch.where(valid, t.exp(), torch.zeros_like(t))
    P = p.sum(-1)
    cross = torch.where(p > 0, p * (t - s_k), torch.zeros_like(t)).sum(-1)
    has = valid.any(-1)
    s_m = torch.where(valid, s_k, torch.full_like(s_k, float("-inf")))
    mx = torch.where(has, s_m.amax(-1), torch.zeros_like(P))
    e = (s_m - mx[:, None]).exp()
    se = e.sum(-1)
    lse_k = mx + torch.where(has, se, torch.ones_like(se)).log()
    zero = torch.zeros_like(P)
    lse_v = lse
    if normalize == 2:
        lse_v = torch.logaddexp(torch.where(has, lse_k, torch.full_like(lse_k, float("-inf"))), lse)
    if normalize == 0:
        loss = cross + P * lse_k
        A = zero
        corr = P[:, None] * e / torch.where(has, se, torch.ones_like(se))[:, None] - p
    else:
        loss = cross + P * lse_v
        q = (s_k - lse_v[:, None]).exp()
        if normalize == 1:
            A, corr = P, -p
        else:
            om_p = (1 - P).clamp_min(0)
            tiny = torch.finfo(P.dtype).tiny
            loss = loss + torch.where(om_p > 0, om_p * (om_p.clamp_min(tiny).log() - _log_one_minus_q(lse, lse_v)),
                                      zero)
            om_p_g = torch.where(lse == float("-inf"), zero, om_p)  # no column off the slots: no gradient
            A = P * (lse - lse_v).exp() - om_p_g * (lse_k - lse_v).exp()
            corr = (P + om_p_g)[:, None] * q - p
    corr = torch.where(valid, corr, torch.zeros_like(corr))
    return torch.where(has, loss, zero), torch.where(has, A, zero), corr, lse_v


def _row_scale(grad_loss, grad_tok, scale, n):
    f = (grad_loss * scale).expand(n)
    return f if grad_tok is None else f + grad_tok.to(f.dtype)


def _scales(flags, reduction: int, num_items, num_items_value: float, dt, labels=None, ce_weight: float = 0.0):
    """(kd weight per token, ce weight per token) as a [2] tensor of dtype dt, like the reduce kernel."""
    dev = flags.device  # the tests also run this reference on CUDA tensors

    def denom(count):
        if reduction == 1:
            return count.to(dt).clamp_min(1)
        if reduction == 2:
            if num_items is not None:
                return num_items.to(dt).reshape(())
            return torch.tensor(num_items_value, dtype=dt, device=dev)
        return torch.ones((), dtype=dt, device=dev)
    kd = 1 / denom(flags.sum())
    ce = (ce_weight / denom((labels != IGNORE_INDEX).sum())) if labels is not None else torch.zeros((), dtype=dt,
                                                                                                  device=dev)
    return torch.stack([kd, ce.to(dt)])


def kd_topk_fwd(z, t, mask, temperature, reduction, num_items, num_items_value):
    dt = acc_dtype(z, t)
    valid = mask != 0
    loss, _, _, _ = slot_terms(z.to(dt) / temperature, t.to(dt), valid, None, 0)
    tok = loss * temperature**2
    scale = _scales(valid.any(-1), reduction, num_items, num_items_value, dt)
    return (tok * scale[0]).sum(), tok, scale


def kd_topk_bwd(grad_loss, grad_tok, z, t, mask, scale, temperature):
    dt = scale.dtype
    _, _, corr, _ = slot_terms(z.to(dt) / temperature, t.to(dt), mask != 0, None, 0)
    f = _row_scale(grad_loss.to(dt), grad_tok, scale[0], z.shape[0]) * temperature
    # contiguous like the kernel's and the op's fake: corr takes the mask's layout (a column-major
    # mask failed the compiled backward's stride check)
    return (corr * f[:, None]).to(z.dtype).contiguous()


def _gather(z, ids, valid):
    return z.gather(-1, torch.where(valid, ids, torch.zeros_like(ids)).long())


def repeated_ids(ids, on):
    """(keys, rep): each token's ids sorted, the slots off ``on`` given distinct negative keys, and
    rep [N, K - 1] True where a key equals the next one: an id repeated among the slots on."""
    keys = torch.where(on, ids.long(), -1 - torch.arange(ids.shape[1], device=ids.device)).sort(-1).values
    return keys, keys[:, 1:] == keys[:, :-1]


def _slots(ids, mask, V, normalize=1):
    """(valid, bad): unmasked slots with an id in [0, V), and unmasked slots outside it (which only
    reach the ops with index checks off). For "tail" (``normalize`` 2) a token whose valid ids
    repeat has all its valid slots bad too, as in the kernels (its K + 1 outcomes are not distinct)."""
    on = mask != 0
    inside = (ids >= 0) & (ids < V)
    valid, bad = on & inside, on & ~inside
    if normalize == 2 and ids.shape[1] > 1:
        bad = bad | (valid & repeated_ids(ids, valid)[1].any(-1, keepdim=True))
    return valid, bad


def _poison(bad, loss, A, corr):
    """As the kernels do for a token with an out-of-range id: its loss and A (so its whole gradient
    row) NaN, and the bad slots' corrections NaN."""
    row = bad.any(-1)
    return loss.masked_fill(row, float("nan")), A.masked_fill(row, float("nan")), corr.masked_fill(bad, float("nan"))


def row_terms(s, ids, t, valid, normalize):
    """slot_terms from the rows' logits s [N, V]: (loss, A, corr, lse), lse what the dense term
    divides by (lse_V; lse_tail for tail unless no column is off the slots; 0 for topk, A = 0)."""
    if normalize == 0:
        return slot_terms(_gather(s, ids, valid), t, valid, None, 0)[:3] + (torch.zeros_like(s[:, 0]),)
    lse = lse_off_slots(s, ids, valid) if normalize == 2 else torch.logsumexp(s, -1)
    loss, A, corr, lse_v = slot_terms(_gather(s, ids, valid), t, valid, lse, normalize)
    return loss, A, corr, torch.where(lse == float("-inf"), lse_v, lse)


def kd_logits_fwd(z, ids, t, mask, normalize, temperature, reduction, num_items, num_items_value):
    dt = acc_dtype(z, t)
    valid, bad = _slots(ids, mask, z.shape[1], normalize)
    loss, A, corr, lse = row_terms(z.to(dt) / temperature, ids, t.to(dt), valid, normalize)
    loss, A, corr = _poison(bad, loss, A, corr)
    tok = loss * temperature**2
    scale = _scales(valid.any(-1), reduction, num_items, num_items_value, dt)
    return (tok * scale[0]).sum(), tok, scale, lse, A, corr


def dense_grad(z, ids, valid, lse, A, corr, c_kd, temperature, labels=None, lse1=None, c_ce=None, normalize=1):
    """dL/dz [N, V] in the accumulation dtype: c_kd * T * (A exp(s - lse) + corrections at the valid
    slots; for tail the slot values replace the dense term there) (+ c_ce * (softmax - onehot)). Rows
    with A = 0 get no dense term ("topk" passes lse = 0, where exp(s) could overflow); a NaN A makes
    the row NaN."""
    x = z.to(A.dtype) / temperature - lse[:, None]
    slot = slot_columns(ids, valid, z.shape[1]) if normalize == 2 else None
    if normalize == 2:  # off the slots x <= 0 (lse is lse_tail); on them it could overflow exp
        x = x.masked_fill(slot, 0.0)
    g = torch.where(A[:, None] == 0, 0.0, (c_kd * temperature * A)[:, None] * x.exp())
    if normalize == 2:
        g = torch.where(slot, g * 0, g)  # times 0: a NaN row stays NaN
    g = g.scatter_add(-1, torch.where(valid, ids, torch.zeros_like(ids)).long(),
                      corr * (c_kd * temperature)[:, None])
    if labels is not None:
        has, bad, lab = _label_columns(labels, z.shape[1])
        c_ce = torch.where(has, c_ce, torch.zeros_like(c_ce))
        g = g + c_ce[:, None] * (z.to(A.dtype) - lse1[:, None]).exp()
        g = g.scatter_add(-1, lab, torch.where(has, -c_ce, torch.zeros_like(c_ce))[:, None])
        g = g.masked_fill(bad[:, None], float("nan"))  # as for an out-of-range id: the whole row
    return g


def kd_logits_bwd(grad_loss, grad_tok, z, ids, mask, lse, A, corr, scale, normalize, temperature):
    f = _row_scale(grad_loss.to(A.dtype), grad_tok, scale[0], z.shape[0])
    return dense_grad(z, ids, _slots(ids, mask, z.shape[1])[0], lse, A, corr, f, temperature,
                      normalize=normalize).to(z.dtype)


def kd_hidden_fwd(hidden, weight, bias, ids, t, mask, labels, normalize, temperature, reduction, num_items,
                  num_items_value, ce_weight, need_grad_hidden, need_grad_weight, need_grad_bias, chunk_size):
    """(loss, per-token KD loss, grad_hidden, grad_weight, grad_bias, applied); gradients of the loss
    for an incoming gradient of 1 (empty when not needed), ``applied`` [2] the factors that grad_hidden
    and (grad_weight, grad_bias) carry (1, 1 here; see kernels.hidden_fwd for float16)."""
    del chunk_size
    dt = acc_dtype(hidden, weight, t)
    z = hidden.to(dt) @ weight.to(dt).t()
    if bias is not None:
        z = z + bias.to(dt)
    valid, bad = _slots(ids, mask, weight.shape[0], normalize)
    loss, A, corr, lse = row_terms(z / temperature, ids, t.to(dt), valid, normalize)
    tok = loss.masked_fill(bad.any(-1), float("nan")) * temperature**2
    has_ce = labels is not None and ce_weight != 0.0
    flags = (mask != 0).any(-1)  # the hidden kernels count tokens from the mask
    scale = _scales(flags, reduction, num_items, num_items_value, dt, labels if has_ce else None, ce_weight)
    total = (tok * scale[0]).sum()
    N = z.shape[0]
    lse1 = c_ce = None
    if has_ce:
        ce_sum, _ = cross_entropy_terms(z, labels)
        total = total + ce_sum * scale[1]
        lse1 = torch.logsumexp(z, -1)
        c_ce = scale[1].expand(N)
    # A token with an out-of-range id (index checks off) gets a NaN gradient row, which reaches every
    # column of grad_weight and grad_bias, except on the gather kernel's path ("topk" without
    # cross-entropy), where only its grad_hidden row is NaN and the bad slot adds nothing.
    gather_path = normalize == 0 and not has_ce
    if not gather_path:
        _, A, corr = _poison(bad, loss, A, corr)
    g = dense_grad(z, ids, valid, lse, A, corr, scale[0].expand(N), temperature, labels if has_ce else None, lse1,
                   c_ce, normalize)
    gh = hidden.new_empty(0)
    if need_grad_hidden:
        gh = (g @ weight.to(dt)).masked_fill(bad.any(-1)[:, None], float("nan")).to(hidden.dtype)
    gw = (g.t() @ hidden.to(dt)).to(weight.dtype) if need_grad_weight else weight.new_empty(0)
    gb = g.sum(0).to(bias.dtype) if need_grad_bias else hidden.new_empty(0)
    return total, tok, gh, gw, gb, torch.ones(2, dtype=dt, device=hidden.device)


def kd_hidden_bwd(grad_loss, grad_hidden, grad_weight, grad_bias, applied):
    """Rescale the forward's gradients in place from the factors they carry to grad_loss."""
    f = grad_loss.to(applied.dtype) / applied
    for x, fx in ((grad_hidden, f[0]), (grad_weight, f[1]), (grad_bias, f[1])):
        if x.numel():
            x.mul_(fx.to(x.dtype))
    applied.copy_(grad_loss.reshape(1).to(applied.dtype).expand(2))
