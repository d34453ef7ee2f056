"""``VectorQuantizer`` and ``ResidualVQ``: nearest-code search, straight-through estimator,
commitment loss and the fused EMA update in training mode."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._dtypes import acc_dtype
from .._validate import check_number, check_positive_int
from .ops import (batch_statistics, check_ema_options, check_generator, check_precision, nearest_code, quantize,
                  vq_ema_update)


def _kmeans(x: Tensor, num_codes: int, iters: int, *, cosine: bool, precision: str, generator, process_group,
            deterministic: Optional[bool] = None):
    """Lloyd's k-means on the device: (centroids [K, D] fp32, counts [K] of the last assignment).

    Starts from random rows of x (of rank 0 under DDP, broadcast; other ranks may hold no rows, and
    a rank 0 without rows makes every rank raise), distinct while B >= K (with B < K, code k starts
    from the same row as code k - B); each iteration assigns with
    :func:`nearest_code` and re-centres with :func:`batch_statistics` (all-reduced over
    ``process_group``; summed in a fixed order with ``deterministic``); an empty cluster keeps its
    centroid.
    """
    B, D = x.shape
    if B == 0 and process_group is None:
        raise ValueError(f"x must have at least one row to initialise the codebook with k-means, got shape "
                         f"{tuple(x.shape)}")
    seed = torch.empty(num_codes * D + 1, device=x.device, dtype=torch.float32)  # starting centroids, then B
    c = seed[:-1].view(num_codes, D)
    if B:
        perm = torch.randperm(B, device=x.device, generator=generator)
        c.copy_(x[perm[torch.arange(num_codes, device=x.device) % B]])
    seed[-1] = B
    if process_group is not None:
        import torch.distributed as dist

        # rank 0's rows seed every rank, and its B travels with them: a rank 0 without rows makes every
        # rank raise here (one host read, at initialisation) rather than one rank raising while the
        # others wait in the next collective. Other ranks may hold no rows.
        dist.broadcast(seed, src=dist.get_global_rank(process_group, 0), group=process_group)
        if seed[-1].item() == 0:
            raise ValueError("rank 0 of process_group has no rows to initialise the codebook with k-means "
                             "(its rows seed every rank); every rank raises")
    n = torch.zeros(num_codes, device=x.device)
    for _ in range(iters):
        codes, _ = nearest_code(x, c, cosine=cosine, precision=precision, deterministic=deterministic)
        n, s = batch_statistics(x, codes, num_codes, process_group, deterministic=deterministic)
        c = torch.where(n[:, None] > 0, s / n.clamp_min(1)[:, None], c)
    return c, n


def _refuse_recompute(module) -> None:
    """A training-mode forward updates the codebook in place, so activation checkpointing, which runs
    the forward again inside the backward, would search and quantize with the updated codebook
    (silently wrong gradients for x) and, with ``use_reentrant=True``, update it a second time."""
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(f"{type(module).__name__} in training mode cannot run inside a backward pass, as "
                           f"activation checkpointing (torch.utils.checkpoint) reruns it: its forward updates the "
                           f"codebook in place, so the rerun would quantize with the updated codebook. Keep the "
                           f"quantizer outside the checkpointed function (or checkpoint it in eval mode)")


def _sync_initted(module, incompatible_keys):
    module._initted = bool(module.initted)


def _flatten(module, x: Tensor) -> Tensor:
    """x [..., D] as [B, D], refused by name before any state changes if its last dimension is not D."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != module.dim:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., {module.dim}] (dim={module.dim})")
    return x.reshape(-1, module.dim)


class VectorQuantizer(nn.Module):
    """Vector quantiser with an EMA codebook, trained by the fused sparsefuse kernels.

    ``forward(x [..., D]) -> (quantized [..., D], codes [...] int64, loss [])``: ``quantized`` equals
    the nearest codebook rows in value and passes gradients straight through to x; ``loss`` is
    ``commitment_weight * mean((x - sg(quantized))^2)``. In training mode the codebook is then
    updated in place by :func:`sparsefuse.vq_ema_update` (no gradient reaches it), so a
    training-mode forward cannot be rerun by activation checkpointing: that raises ``RuntimeError``
    (keep the quantizer outside the checkpointed function).

    Args:
        dim, codebook_size: D and K.
        decay, semantics, eps, threshold, reset_cluster_size, restart_after_steps: passed to
            :func:`sparsefuse.vq_ema_update` (``threshold`` is the dead-code threshold of the
            ``"laplace"`` semantics, ``restart_after_steps`` the dead-code age of ``"active"``; 0
            turns restarts off; an option of the other semantics is refused).
        commitment_weight: beta of the commitment loss (a finite number >= 0).
        cosine, precision: passed to :func:`sparsefuse.nearest_code`. ``cosine`` makes the search
            use cosine distance and starts the codebook with unit rows; the EMA averages x as given,
            so ``quantized`` (a codebook row) is not normalised: for spherical VQ, normalise x before
            the call.
        kmeans_init, kmeans_iters: initialise the codebook with Lloyd's k-means on the first
            training batch (on the device, all-reduced over ``process_group``); ``kmeans_iters`` >= 0
            Lloyd iterations after the seeding rows.
        process_group: ``torch.distributed`` group the EMA statistics are reduced over.
        generator: optional ``torch.Generator`` for restarts and k-means seeding (not under
            ``torch.compile(fullgraph=True)``; see :func:`sparsefuse.vq_ema_update`). Its state is
            not part of ``state_dict``: to restart from the same rows after resuming, save
            ``generator.get_state()`` with the checkpoint and ``set_state`` it back.
        deterministic: passed to :func:`sparsefuse.vq_ema_update`, :func:`sparsefuse.nearest_code` and
            the k-means statistics.

    Buffers (all in ``state_dict``): ``codebook [K, D]``, ``cluster_size [K]``, ``embed_sum [K, D]``,
    ``steps_since_active [K]`` int64, ``initted`` bool. The float buffers stay float32 under
    ``.half()``, ``.to(dtype)`` and the like, which move them to another device only (the update
    keeps its state in float32 whatever the dtype of x).
    """

    def __init__(self, dim: int, codebook_size: int, *, decay: float = 0.99, semantics: str = "laplace",
                 commitment_weight: float = 0.25, eps: float = 1e-5, threshold: float = 0.0,
                 reset_cluster_size: Optional[float] = None, restart_after_steps: int = 0, cosine: bool = False,
                 precision: str = "exact", kmeans_init: bool = False, kmeans_iters: int = 10, process_group=None,
                 generator: Optional[torch.Generator] = None, deterministic: Optional[bool] = None,
                 _levels: Optional[int] = None):
        check_positive_int("dim", dim)
        check_positive_int("codebook_size", codebook_size)
        # refused here rather than at the first training step
        check_ema_options(semantics, decay, eps, threshold, reset_cluster_size, restart_after_steps)
        check_precision(precision)
        check_number("commitment_weight", commitment_weight, positive=False)  # NaN or < 0 reached the loss
        if isinstance(kmeans_iters, bool) or not isinstance(kmeans_iters, int) or kmeans_iters < 0:
            raise ValueError(f"kmeans_iters must be a non-negative int (0: the seeding rows only), "
                             f"got {kmeans_iters!r}")
        check_generator(generator)  # k-means and restarts use it
        super().__init__()
        self.dim, self.codebook_size = dim, codebook_size
        self.decay, self.semantics, self.eps = decay, semantics, eps
        self.commitment_weight = commitment_weight
        self.threshold, self.reset_cluster_size = threshold, reset_cluster_size
        self.restart_after_steps = restart_after_steps
        self.cosine, self.precision = cosine, precision
        self.kmeans_iters = kmeans_iters
        self.process_group, self.generator, self.deterministic = process_group, generator, deterministic
        lead = () if _levels is None else (_levels,)
        codebook = torch.randn(*lead, codebook_size, dim)
        if cosine:
            codebook = F.normalize(codebook, dim=-1)
        self.register_buffer("codebook", codebook)
        self.register_buffer("cluster_size", torch.ones(*lead, codebook_size))
        self.register_buffer("embed_sum", codebook.clone())
        self.register_buffer("steps_since_active", torch.zeros(*lead, codebook_size, dtype=torch.int64))
        self.register_buffer("initted", torch.tensor(not kmeans_init))
        # a host copy of ``initted``, so that forward never reads the device flag (a sync)
        self._initted = not kmeans_init
        self.register_load_state_dict_post_hook(_sync_initted)

    def extra_repr(self) -> str:
        restart = (f"restart_after_steps={self.restart_after_steps}" if self.semantics == "active"
                   else f"threshold={self.threshold}")
        return (f"dim={self.dim}, codebook_size={self.codebook_size}, semantics={self.semantics!r}, "
                f"decay={self.decay}, {restart}, cosine={self.cosine}, precision={self.precision!r}")

    def _apply(self, fn, recurse=True):
        def keep_float32(t):  # .half() / .to(dtype) convert a copy; only its device is taken
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(keep_float32, recurse)

    def _update_kwargs(self):
        return dict(decay=self.decay, semantics=self.semantics, eps=self.eps, threshold=self.threshold,
                    reset_cluster_size=self.reset_cluster_size, restart_after_steps=self.restart_after_steps,
                    generator=self.generator, process_group=self.process_group, deterministic=self.deterministic)

    @torch.no_grad()
    def kmeans_init_(self, x: Tensor) -> None:
        """Initialise the state from k-means on ``x [..., D]`` (rows of width ``dim``; another width is
        refused, not regrouped): codebook = centroids, N = max(count, 1), S = N * centroid (so the
        first refresh keeps the centroids)."""
        c, n = _kmeans(_flatten(self, x).detach(), self.codebook_size, self.kmeans_iters, cosine=self.cosine,
                       precision=self.precision, generator=self.generator, process_group=self.process_group,
                       deterministic=self.deterministic)
        self._set_state(c, n)
        self.initted.fill_(True)
        self._initted = True

    def _set_state(self, c, n, level=None):
        sel = (lambda t: t) if level is None else (lambda t: t[level])
        n = n.clamp_min(1)
        sel(self.codebook).copy_(c)
        sel(self.cluster_size).copy_(n)
        sel(self.embed_sum).copy_(c * n[:, None])
        sel(self.steps_since_active).zero_()

    def _start_training_step(self, flat: Tensor) -> None:
        """Refuse a rerun by activation checkpointing, then initialise from k-means once."""
        _refuse_recompute(self)
        if not self._initted:
            self.kmeans_init_(flat)

    def forward(self, x: Tensor):
        flat = _flatten(self, x)
        if self.training:
            self._start_training_step(flat)
        codes, _ = nearest_code(flat.detach(), self.codebook, cosine=self.cosine, precision=self.precision,
                                deterministic=self.deterministic)
        out, loss = quantize(flat, codes, self.codebook, self.commitment_weight)
        if self.training:
            vq_ema_update(flat.detach(), codes, self.codebook, self.cluster_size, self.embed_sum,
                          self.steps_since_active, _check_codes=False, **self._update_kwargs())
        return out.view_as(x), codes.view(x.shape[:-1]), loss


class ResidualVQ(VectorQuantizer):
    """Residual VQ with ``num_levels`` codebooks: level l quantises what levels < l left over.

    ``forward(x [..., D]) -> (quantized [..., D], codes [..., L] int64, loss [])``: ``quantized`` equals
    the sum of the L chosen codebook rows (summed in float32, float64 for float64 x, then rounded
    once to x's dtype) and passes gradients straight through to x; ``loss`` is the
    commitment weight times the mean over levels of ``mean((r_l - sg(q_l))^2)``. In training mode all
    L codebooks (stacked ``[L, K, D]`` state) are updated by one multi-level EMA call. Other
    arguments as for :class:`VectorQuantizer`; k-means initialisation runs level by level.
    """

    def __init__(self, num_levels: int, dim: int, codebook_size: int, **kwargs):
        check_positive_int("num_levels", num_levels)
        super().__init__(dim, codebook_size, _levels=num_levels, **kwargs)
        self.num_levels = num_levels

    def extra_repr(self) -> str:
        return f"num_levels={self.num_levels}, {super().extra_repr()}"

    @torch.no_grad()
    def kmeans_init_(self, x: Tensor) -> None:
        r = _flatten(self, x).detach().to(acc_dtype(x))  # a wrong width raises, as in forward
        for level in range(self.num_levels):
            c, n = _kmeans(r, self.codebook_size, self.kmeans_iters, cosine=self.cosine, precision=self.precision,
                           generator=self.generator, process_group=self.process_group,
                           deterministic=self.deterministic)
            self._set_state(c, n, level)
            codes, _ = nearest_code(r, c, cosine=self.cosine, precision=self.precision,
                                    deterministic=self.deterministic)
            r = r - c[codes]
        self.initted.fill_(True)
        self._initted = True

    def forward(self, x: Tensor):
        flat = _flatten(self, x)
        if self.training:
            self._start_training_step(flat)
        wide = acc_dtype(flat)  # the residuals in float32, float64 for float64 input (as VectorQuantizer)
        resid = flat.detach().to(wide)
        inputs, all_codes, total = [], [], torch.zeros_like(resid)
        loss = flat.new_zeros((), dtype=wide)
        for level in range(self.num_levels):
            codes, _ = nearest_code(resid, self.codebook[level], cosine=self.cosine, precision=self.precision,
                                    deterministic=self.deterministic)
            # r_l = x - sg(q_0 + ... + q_{l-1}): the loss mean((r_l - q_l)^2) pulls x towards each partial
            # reconstruction. Through quantize, whose op saves what its backward needs: built from
            # the codebook buffer, torch.compile's partitioner recomputed r_l - q_l in the backward
            # from the codebook as updated in place below (a wrong gradient for x)
            q, level_loss = quantize(flat.to(wide) - total, codes, self.codebook[level])
            q = q.detach()
            inputs.append(resid)
            all_codes.append(codes)
            loss = loss + level_loss
            total = total + q
            resid = resid - q
        loss = loss * (self.commitment_weight / self.num_levels)
        # the value is exactly the sum of the chosen rows (what decoding the codes gives), the gradient
        # x's: flat - flat.detach() is 0 in any dtype, where flat + (q - flat).detach() rounded twice
        # (one ulp off in 16-bit x for most rows, and compiled graphs, which round once, disagreed)
        out = total.to(flat.dtype) + (flat - flat.detach())
        codes = torch.stack(all_codes)  # [L, B]
        if self.training:
            vq_ema_update(torch.stack(inputs), codes, self.codebook, self.cluster_size, self.embed_sum,
                          self.steps_since_active, _check_codes=False, **self._update_kwargs())
        return out.view_as(x), codes.T.reshape(*x.shape[:-1], self.num_levels), loss
