"""Exact PyTorch references for the SAE decoder ops.

Two kinds of function live here:

* ``sae_decode``, ``topk_sae_loss``, ``hierarchical_sae_loss``: the plain math, differentiable by
  autograd. Tests compare the kernels against them in float64; benchmarks time them in eager mode
  and under ``torch.compile``.
* ``*_fwd`` / ``*_bwd``: the same math split the way the registered ops split it (forward saves a
  small residual, backward applies the incoming gradient), with explicit gradient formulas. They are
  the ops' CPU implementation when the Triton interpreter is off.

Notation: B rows, K active latents per row, F dictionary size, D model width. Empty reductions
(B = 0 or D = 0) divide by 1, so the loss is 0 and every gradient is zero rather than NaN.
"""

from __future__ import annotations

import torch

from .._dtypes import acc_dtype
from .._validate import check_index_range




def sae_decode(indices, vals, weight, bias=None):
    """recon[b] = bias + sum_k vals[b, k] * weight[indices[b, k]]  ->  [B, D] in
    ``promote_types(vals.dtype, weight.dtype)``, the dtype it is computed in."""
    dt = torch.promote_types(vals.dtype, weight.dtype)
    out = torch.einsum("bk,bkd->bd", vals.to(dt), weight[indices.long()].to(dt))
    return out if bias is None else out + bias.to(dt)


def topk_sae_loss(indices, weight, vals, bias, target):
    """mean over B*D of (sae_decode(...) - target)^2, as a float32 (float64 for float64 inputs) scalar."""
    dt = acc_dtype(weight, vals, bias, target)
    recon = torch.einsum("bk,bkd->bd", vals.to(dt), weight[indices.long()].to(dt)) - target.to(dt)
    if bias is not None:
        recon = recon + bias.to(dt)
    return recon.square().sum() / max(target.numel(), 1)


def hierarchical_sae_loss(indices, weight, vals, bias, target):
    """Mean over k = 1..K of the TopK loss of the prefix reconstruction that uses latents 0..k-1."""
    dt = acc_dtype(weight, vals, bias, target)
    contrib = vals.to(dt).unsqueeze(-1) * weight[indices.long()].to(dt)  # [B, K, D]
    prefix = contrib.cumsum(1) - target.to(dt).unsqueeze(1)
    if bias is not None:
        prefix = prefix + bias.to(dt)
    return prefix.square().sum() / max(prefix.numel(), 1)


def sparse_linear(x, weight, indices, bias=None, x_shift=None):
    """out[b, k] = (x[b] - x_shift) . weight[indices[b, k]] + bias[indices[b, k]]: the K selected
    entries of ``F.linear(x - x_shift, weight, bias)`` per row, ``[B, K]`` in the promoted dtype."""
    if x_shift is not None:
        x = x - x_shift
    rows = weight[indices.long()]  # [B, K, D]
    dt = torch.promote_types(x.dtype, weight.dtype)
    out = torch.einsum("bd,bkd->bk", x.to(dt), rows.to(dt))
    return out if bias is None else out + bias[indices.long()]


def row_topk(x, k):
    """int64 [N, k]: the columns of the k largest entries of each row of x [N, F], largest first."""
    return x.topk(k, dim=-1, sorted=True).indices


def _rows(weight, indices):
    """weight[indices] ([B, K, D]) for the ops' CPU implementation, as the kernels read it: an index
    outside [0, F), which reaches here only with index checks off, gives a NaN row (PyTorch's indexing
    would wrap a negative index onto a real row, and raise past F - 1)."""
    idx = indices.long()
    bad = (idx < 0) | (idx >= weight.shape[0])
    return weight[idx.clamp(0, weight.shape[0] - 1)].masked_fill(bad.unsqueeze(-1), float("nan"))


def _scatter_rows(indices, rows, num_features):
    """grad[f] = sum of rows[e] over entries e with indices.flat[e] == f (rows: [B*K, D]); an entry
    outside [0, F) (index checks off) adds to no feature, as in the kernels."""
    idx = indices.reshape(-1).long()
    ok = (idx >= 0) & (idx < num_features)
    return rows.new_zeros(num_features, rows.shape[-1]).index_add_(0, idx[ok], rows[ok])


def sae_decode_fwd(indices, vals, weight, bias):
    check_index_range("indices", indices, weight.shape[0])
    dt = acc_dtype(weight, vals, bias)
    out = torch.einsum("bk,bkd->bd", vals.to(dt), _rows(weight, indices).to(dt))
    if bias is not None:
        out = out + bias.to(dt)
    return out.to(torch.promote_types(vals.dtype, weight.dtype))


def sae_decode_bwd(grad, indices, vals, weight, need_weight_grad):
    dt = acc_dtype(weight, vals, grad)
    g = grad.to(dt)
    rows = _rows(weight, indices).to(dt)  # [B, K, D]
    grad_vals = torch.einsum("bkd,bd->bk", rows, g).to(vals.dtype)
    grad_bias = g.sum(0)
    if need_weight_grad:
        per_entry = (vals.to(dt).unsqueeze(-1) * g.unsqueeze(1)).reshape(indices.numel(), g.shape[-1])
        grad_weight = _scatter_rows(indices, per_entry, weight.shape[0]).to(weight.dtype)
    else:
        grad_weight = weight.new_empty(0)
    return grad_vals, grad_weight, grad_bias


def topk_sae_loss_fwd(indices, weight, vals, bias, target):
    """Returns (loss, resid [B, D], gv [B, K]) with resid = recon - target, gv = <resid, w_idx>."""
    check_index_range("indices", indices, weight.shape[0])
    dt = acc_dtype(weight, vals, bias, target)
    rows = _rows(weight, indices).to(dt)
    resid = torch.einsum("bk,bkd->bd", vals.to(dt), rows) - target.to(dt)
    if bias is not None:
        resid = resid + bias.to(dt)
    loss = resid.square().sum() / max(resid.numel(), 1)
    gv = torch.einsum("bkd,bd->bk", rows, resid)
    return loss.to(dt), resid, gv


def topk_sae_loss_bwd(grad_loss, indices, vals, weight, resid, gv, need_weight_grad):
    scale = grad_loss.to(resid.dtype) * (2.0 / max(resid.numel(), 1))
    grad_vals = (gv * scale).to(vals.dtype)
    grad_bias = resid.sum(0) * scale
    if need_weight_grad:
        per_entry = (vals.to(resid.dtype).unsqueeze(-1) * resid.unsqueeze(1)).reshape(indices.numel(), resid.shape[-1])
        grad_weight = (_scatter_rows(indices, per_entry, weight.shape[0]) * scale).to(weight.dtype)
    else:
        grad_weight = weight.new_empty(0)
    return grad_vals, grad_weight, grad_bias


def hierarchical_sae_loss_fwd(indices, weight, vals, bias, target):
    """Returns (loss, etot [B, D]) with prefix errors e_k = bias + sum_{j<=k} v_j w_j - target and
    etot = E_0 = sum_k e_k."""
    check_index_range("indices", indices, weight.shape[0])
    dt = acc_dtype(weight, vals, bias, target)
    err = _prefix_errors(indices, weight, vals, bias, target, dt)
    return err.square().sum() / max(err.numel(), 1), err.sum(1)


def _prefix_errors(indices, weight, vals, bias, target, dt):
    err = (vals.to(dt).unsqueeze(-1) * _rows(weight, indices).to(dt)).cumsum(1) - target.to(dt).unsqueeze(1)
    return err if bias is None else err + bias.to(dt)


def hierarchical_sae_loss_bwd(grad_loss, indices, weight, vals, bias, target, etot, need_weight_grad, deterministic):
    """d loss / d (v_j w_j) = g * c * E_j with E_j = sum_{k>=j} e_k and c = 2 / (B*K*D)."""
    del deterministic  # the CPU path is deterministic anyway
    dt = etot.dtype
    err = _prefix_errors(indices, weight, vals, bias, target, dt)
    gc = grad_loss.to(dt) * (2.0 / max(err.numel(), 1))
    suffix = err.flip(1).cumsum(1).flip(1) * gc  # [B, K, D]
    grad_vals = torch.einsum("bkd,bkd->bk", suffix, _rows(weight, indices).to(dt)).to(vals.dtype)
    grad_bias = etot.sum(0) * gc
    if need_weight_grad:
        rows = (vals.to(dt).unsqueeze(-1) * suffix).reshape(indices.numel(), err.shape[-1])
        grad_weight = _scatter_rows(indices, rows, weight.shape[0]).to(weight.dtype)
    else:
        grad_weight = weight.new_empty(0)
    return grad_vals, grad_weight, grad_bias


def shifted(x, x_shift, acc):
    """x - x_shift, formed in promote(x, x_shift) as ``F.linear(x - x_shift, ...)`` would form it, or
    in ``acc`` when that is float64 and wider (a float64 bias, weight or gradient asks for float64)."""
    if x_shift is None:
        return x
    if acc == torch.float64 and torch.promote_types(x.dtype, x_shift.dtype) != acc:
        return x.to(acc) - x_shift.to(acc)
    return x - x_shift


def sparse_linear_fwd(x, weight, indices, bias, x_shift, values):
    check_index_range("indices", indices, weight.shape[0])
    out_dtype = x.dtype
    for t in (weight, bias, x_shift):
        if t is not None:
            out_dtype = torch.promote_types(out_dtype, t.dtype)
    if values is not None:
        return values.to(out_dtype, memory_format=torch.contiguous_format, copy=True)
    dt = acc_dtype(x, weight, bias, x_shift)
    xc = shifted(x, x_shift, dt).to(dt)
    out = torch.einsum("bd,bkd->bk", xc, _rows(weight, indices).to(dt))
    if bias is not None:
        out = out + _rows(bias[:, None], indices)[..., 0].to(dt)
    return out.to(out_dtype)


def sparse_linear_bwd(grad, x, indices, weight, x_shift, need_x, need_weight, need_bias, need_shift):
    dt = acc_dtype(grad, x, weight, x_shift)
    g = grad.to(dt)
    F = weight.shape[0]
    gx = torch.einsum("bk,bkd->bd", g, _rows(weight, indices).to(dt))
    grad_x = gx.to(x.dtype) if need_x else x.new_empty(0)
    grad_shift = -gx.sum(0) if need_shift else g.new_empty(0)
    grad_weight = weight.new_empty(0)
    if need_weight:
        xc = shifted(x, x_shift, dt).to(dt)
        per_entry = (g.unsqueeze(-1) * xc.unsqueeze(1)).reshape(indices.numel(), x.shape[-1])
        grad_weight = _scatter_rows(indices, per_entry, F).to(weight.dtype)
    grad_bias = _scatter_rows(indices, g.reshape(-1, 1), F)[:, 0] if need_bias else g.new_empty(0)
    return grad_x, grad_weight, grad_bias, grad_shift


def unit_rows_(weight, grad, eps):
    """In place: weight rows scaled to unit norm (grad None), or grad rows minus their component
    along the weight rows; arithmetic in acc_dtype."""
    dt = acc_dtype(weight, grad)
    w = weight.to(dt)
    w = w / w.norm(dim=1, keepdim=True).clamp_min(eps)
    if grad is None:
        weight.copy_(w)
    else:
        g = grad.to(dt)
        grad.copy_(g - (g * w).sum(1, keepdim=True) * w)
