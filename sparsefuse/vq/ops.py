"""Registered ops and the public functions for VQ codebooks.

* :func:`vq_ema_update`: the EMA codebook update with dead-code restart, in place, for one codebook
  or L stacked residual levels at once. Ops: ``vq_ema_accumulate`` (batch statistics), then
  ``vq_ema_apply`` (blend, refresh, counters, restart) with, under DDP, an all-gather of every
  rank's B and rank 0's restart keys first, an all-reduce between them and ``vq_ema_restart`` after
  a second one. Outside plain eager mode the keys come from ``vq_draw_key``, drawn when it runs.
* :func:`nearest_code`: fused distance + argmin search, ``nearest_code`` op.
* :func:`quantize`: straight-through estimator fused with the commitment loss, ``vq_quantize`` op
  (eager: an ``autograd.Function`` over the same launchers).

In plain eager mode (``_registry.plain_eager``: no tracing, no dispatch mode, plain tensors) the
public functions call the launchers directly instead of going through the dispatcher, and bump the
version counters of what they write in place: the update is not differentiable and a registered
op costs tens of microseconds of host time per call, more than the whole update takes on the GPU at
small shapes. Under ``torch.compile`` (or fake tensors) they go through the registered ops, so
tracing sees an op with a fake implementation and declared mutations. On CPU tensors without the
Triton interpreter, the references in ``reference.py`` run.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from .._dtypes import acc_dtype
from .._registry import INTERPRET, bump_versions, first_order, plain_eager, refuse_transforms, register_op
from .._validate import (FLOAT_DTYPES, INDEX_DTYPES, check_disjoint, check_in_place, check_index_range,
                         check_not_empty, check_not_inference, check_number, check_tensor,
                         use_deterministic)
from . import kernels, reference

SEMANTICS = ("laplace", "active")
PRECISIONS = ("exact", "ieee", "fast")
_COUNTER_EXACT = 1 << 24
_GENERATOR_COMPILE = ("vq_ema_update: generator= cannot be traced by torch.compile (a torch.Generator cannot enter a "
                      "graph); under torch.compile pass generator=None (restart keys from the default generator, as "
                      "in eager mode), or leave fullgraph off so that the update runs in eager mode")


# --- EMA update: accumulate -------------------------------------------------------------------------


def _acc_fake(x, codes, cluster_size, counters, deterministic, check_codes):
    L, K = cluster_size.shape
    return x.new_empty(kernels.stats_layout(L, K, x.shape[-1])[3], dtype=torch.float32)


def _acc_reference(x, codes, cluster_size, counters, deterministic, check_codes):
    L, K = cluster_size.shape
    if check_codes:
        check_index_range("codes", codes, K)
    n, s = reference.ema_accumulate(x, codes, K)
    cnt = (torch.zeros_like(cluster_size) if counters is None
           else counters.clamp_max(_COUNTER_EXACT).to(torch.float32))
    return torch.cat([s.float().flatten(), n.float().flatten(), cluster_size.float().flatten(), cnt.flatten()])


@register_op("vq_ema_accumulate", fake=_acc_fake, reference=_acc_reference)
def _acc_op(x: Tensor, codes: Tensor, cluster_size: Tensor, counters: Optional[Tensor], deterministic: bool,
            check_codes: bool) -> Tensor:
    return kernels.ema_accumulate(x, codes, cluster_size, counters, deterministic, check_codes)


# --- EMA update: apply and restart --------------------------------------------------------------------


def _apply_fake(x, codebook, cluster_size, embed_sum, counters, stats, key, decay, eps, threshold, reset,
                restart_after, active, sizes, rank):
    L, K, D = codebook.shape
    dist = sizes is not None
    return (codebook.new_empty((L, K, D) if dist else (0,), dtype=torch.float32),
            codebook.new_empty((L, K) if dist else (0,), dtype=torch.int8))


def _apply_reference(x, codebook, cluster_size, embed_sum, counters, stats, key, decay, eps, threshold, reset,
                     restart_after, active, sizes, rank):
    L, K, D = codebook.shape
    s, n, _, _ = kernels.split_stats(stats, L, K, D)
    return reference.ema_apply(x, codebook, cluster_size, embed_sum, counters, n, s, key, decay=decay,
                               active=active, eps=eps, threshold=threshold, reset=reset,
                               restart_after=restart_after, sizes=sizes, rank=rank)


@register_op("vq_ema_apply", fake=_apply_fake, reference=_apply_reference,
             mutates_args=("codebook", "cluster_size", "embed_sum", "counters"))
def _apply_op(
    x: Tensor, codebook: Tensor, cluster_size: Tensor, embed_sum: Tensor, counters: Optional[Tensor], stats: Tensor,
    key: Tensor, decay: float, eps: float, threshold: float, reset: float, restart_after: int, active: bool,
    sizes: Optional[Tensor], rank: int,
) -> tuple[Tensor, Tensor]:
    """``sizes``: None for one process; under DDP every rank's B ([world] int64, on the device)."""
    cand, dead = kernels.ema_apply(x, codebook, cluster_size, embed_sum, counters, stats, key, decay, eps, threshold,
                                   reset, restart_after, active, sizes, rank)
    if cand is None:
        cand, dead = codebook.new_empty(0, dtype=torch.float32), codebook.new_empty(0, dtype=torch.int8)
    return cand, dead


def _restart_fake(codebook, embed_sum, cand, dead, reset):
    return None


def _key_fake(out):
    return None


@register_op("vq_draw_key", fake=_key_fake, mutates_args=("out",))
def _key_op(out: Tensor) -> None:
    """Fill ``out [L, 4]`` int64 with restart keys from the default generator of its device, drawn
    when the op runs: a compiled graph then draws the keys eager mode would (Inductor would
    otherwise lower a ``torch.randint`` to its own random numbers). It writes in place so that
    two draws are never merged as equal calls."""
    out.copy_(reference.draw_key(out.shape[0], out.device))


@register_op("vq_ema_restart", fake=_restart_fake, reference=reference.ema_restart,
             mutates_args=("codebook", "embed_sum"))
def _restart_op(codebook: Tensor, embed_sum: Tensor, cand: Tensor, dead: Tensor, reset: float) -> None:
    kernels.ema_restart(codebook, embed_sum, cand, dead, reset)


@torch.compiler.disable
def _draw_key_eagerly(levels, device, generator):
    """Keys from an explicit generator, always drawn outside a graph. Without fullgraph, Dynamo
    compiles what follows a graph break on its own: traced, ``key_words`` cannot read the
    generator's Philox state and ``draw_key`` fell back to ``torch.randint``, so a compiled update
    restarted from other rows than eager mode with the same generator state (seen on CUDA)."""
    return reference.draw_key(levels, device, generator)


def check_precision(precision) -> None:
    """``nearest_code``'s precision (also checked when a ``VectorQuantizer`` is built)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def check_generator(generator) -> None:
    """``generator``: a ``torch.Generator`` or None (also checked when a ``VectorQuantizer`` is built;
    a seed passed as ``generator=1234`` failed in ``.device`` or inside ``torch.randperm``)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def check_ema_options(semantics, decay, eps, threshold=0.0, reset_cluster_size=None, restart_after_steps=0):
    """The EMA update's scalar options (also checked when a ``VectorQuantizer`` is built)."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if isinstance(decay, Tensor):  # TypeError, as for the other options: reading it would be a sync
        check_number("decay", decay, positive=False)
    number = type(decay) is float or type(decay) is int or (isinstance(decay, numbers.Real)
                                                              and not isinstance(decay, bool))
    if not (number and 0.0 <= decay <= 1.0):
        raise ValueError(f"decay must lie in [0, 1], got {decay!r}")
    check_number("eps", eps, positive=True)
    # a NaN or negative value would pass silently into the state: a NaN reset size poisons every
    # restarted code (and, with "laplace", every codebook row), a NaN threshold turns restarts off
    check_number("threshold", threshold, positive=False)
    if reset_cluster_size is not None:
        check_number("reset_cluster_size", reset_cluster_size, positive=False)
    check_number("restart_after_steps", restart_after_steps, positive=False)
    if restart_after_steps != int(restart_after_steps):
        raise ValueError(f"restart_after_steps must be a whole number of steps, got {restart_after_steps!r}")
    # each semantics has its own restart rule; an option of the other one would be ignored silently
    if semantics == "laplace" and restart_after_steps:
        raise ValueError("restart_after_steps applies to semantics='active'; 'laplace' restarts a code whose "
                         f"cluster_size falls below threshold (got restart_after_steps={restart_after_steps!r})")
    if semantics == "active" and (threshold or reset_cluster_size is not None):
        raise ValueError("threshold and reset_cluster_size apply to semantics='laplace'; 'active' restarts a code "
                         f"unused for restart_after_steps steps (got threshold={threshold!r}, "
                         f"reset_cluster_size={reset_cluster_size!r})")


def _check_ema_inputs(x, codes, codebook, cluster_size, embed_sum, counters, semantics, decay, eps, threshold=0.0,
                      reset_cluster_size=None, restart_after_steps=0, generator=None):
    check_ema_options(semantics, decay, eps, threshold, reset_cluster_size, restart_after_steps)
    grad, compiling = torch.is_grad_enabled(), torch.compiler.is_compiling()
    state = dict(codebook=codebook, cluster_size=cluster_size, embed_sum=embed_sum, steps_since_active=counters)
    for name, t in state.items():
        if isinstance(t, Tensor):
            if grad and t.requires_grad:  # the state must not require grad (overlaps fail the contiguity checks)
                check_in_place(name, t)  # raises, naming it
            if not compiling and t.is_inference():
                check_not_inference(name, t)  # raises outside inference mode, naming it
    if generator is not None:
        if compiling:
            raise ValueError(_GENERATOR_COMPILE)
        check_generator(generator)
        if isinstance(codebook, Tensor) and generator.device.type != codebook.device.type:
            raise ValueError(f"generator is on {generator.device} but the codebook is on {codebook.device}")
    # Valid inputs pass these few comparisons (a few us of host time instead of ~15 through the
    # per-argument checks below, which run only to name what is wrong).
    if (isinstance(codebook, Tensor) and isinstance(cluster_size, Tensor) and isinstance(embed_sum, Tensor)
            and isinstance(x, Tensor) and isinstance(codes, Tensor)):
        f32, cb_shape, x_shape, dev = torch.float32, codebook.shape, x.shape, codebook.device
        lead = cb_shape[:-1]  # [L,] K
        if (codebook.dtype is f32 and cluster_size.dtype is f32 and embed_sum.dtype is f32
                and x.dtype in FLOAT_DTYPES and codes.dtype in INDEX_DTYPES
                and 2 <= len(cb_shape) <= 3 and cb_shape[-2] >= 1 and embed_sum.shape == cb_shape
                and cluster_size.shape == lead and len(x_shape) == len(cb_shape) and x_shape[-1] == cb_shape[-1]
                and x_shape[:-2] == cb_shape[:-2] and codes.shape == x_shape[:-1]
                and cluster_size.device == dev and embed_sum.device == dev and x.device == dev
                and codes.device == dev and codebook.is_contiguous() and cluster_size.is_contiguous()
                and embed_sum.is_contiguous()
                and (counters is None or (isinstance(counters, Tensor) and counters.dtype in INDEX_DTYPES
                                          and counters.shape == lead and counters.device == dev
                                          and counters.is_contiguous()))):
            check_disjoint(dict(x=x, codes=codes, **state))
            return
    check_tensor("codebook", codebook, dtypes=(torch.float32,))
    if codebook.dim() not in (2, 3):
        raise ValueError(f"codebook must be [K, D] or [L, K, D], got shape {tuple(codebook.shape)}")
    lead = tuple(codebook.shape[:-2])
    K, D = codebook.shape[-2:]
    check_not_empty("codebook", codebook, -2, "code")
    dev = codebook.device
    check_tensor("cluster_size", cluster_size, shape=lead + (K,), dtypes=(torch.float32,), device=dev)
    check_tensor("embed_sum", embed_sum, shape=lead + (K, D), dtypes=(torch.float32,), device=dev)
    check_tensor("steps_since_active", counters, shape=lead + (K,), dtypes=INDEX_DTYPES, device=dev, optional=True)
    check_tensor("x", x, shape=lead + (None, D), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("codes", codes, shape=tuple(x.shape[:-1]), dtypes=INDEX_DTYPES, device=dev)
    for name, t in state.items():
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: it is updated in place")
    check_disjoint(dict(x=x, codes=codes, **state))


def vq_ema_update(
    x: Tensor, codes: Tensor, codebook: Tensor, cluster_size: Tensor, embed_sum: Tensor,
    steps_since_active: Optional[Tensor] = None, *, decay: float = 0.99, semantics: str = "laplace",
    eps: float = 1e-5, threshold: float = 0.0, reset_cluster_size: Optional[float] = None,
    restart_after_steps: int = 0, generator: Optional[torch.Generator] = None, process_group=None,
    deterministic: Optional[bool] = None, _check_codes: bool = True,
) -> None:
    """EMA codebook update with dead-code restart, in place: two kernel launches by default (the
    deterministic mode adds a sort and a chunk-sum launch; under DDP, an all-reduce and a restart
    kernel).

    Args:
        x: ``[B, D]`` rows that were quantised (float32, bfloat16, float16 or float64; summed in
            float32 by the kernels, in float64 for float64 x by the CPU reference path), or
            ``[L, B, D]`` for L residual levels updated together.
        codes: ``[B]`` / ``[L, B]`` int32/int64 code of each row, in ``[0, K)`` (see below for one
            outside it).
        codebook: ``[K, D]`` / ``[L, K, D]`` float32, contiguous; rewritten in place.
        cluster_size: ``[K]`` / ``[L, K]`` float32 EMA of the code counts (N), in place.
        embed_sum: ``[K, D]`` / ``[L, K, D]`` float32 EMA of the code sums (S), in place.
        steps_since_active: ``[K]`` / ``[L, K]`` int32/int64 counters, in place, or None (required
            for ``semantics="active"`` with ``restart_after_steps > 0``).
        decay: EMA factor gamma in [0, 1].
        semantics: ``"laplace"`` (every code decays; codebook = S / Laplace-smoothed N; a code with
            N < ``threshold`` after the blend restarts with N = ``reset_cluster_size``, default
            ``threshold``, and S = N * v) or ``"active"`` (only codes used in the batch blend and
            refresh, codebook = S / max(N, eps); a code unused for ``restart_after_steps`` steps
            restarts with N = S = 0). See ``sparsefuse.vq.reference`` for the exact math.
            ``threshold`` and ``reset_cluster_size`` belong to ``"laplace"``, ``restart_after_steps``
            to ``"active"``; the other semantics refuses them (``ValueError``) rather than ignore them.
        eps: Laplace smoothing epsilon, or the floor on N for ``"active"``; must be positive.
        generator: ``torch.Generator`` on the codebook's device type for the restart rows (same
            state, same rows); None: the device's default generator. Not under ``torch.compile``:
            a generator cannot enter a graph, so with ``fullgraph=True`` the call fails with
            Dynamo's ``Unsupported`` error (a ``RuntimeError``) carrying this function's message
            (without, Dynamo runs the update in eager mode). With ``generator=None`` a compiled
            update draws its keys when the graph runs, from the default generator, as eager mode
            does: the same restart rows as eager from the same generator state, as long as the
            graph draws no other random numbers before it (Inductor seeds its own random ops from
            the default generator).
        process_group: a ``torch.distributed`` group: the batch statistics (and the restart rows)
            are all-reduced over it, so every rank ends with the same state, equal to one process
            updating on the concatenated batch (rank 0's rows first). Ranks may pass different B
            (B = 0 too): one all-gather, which also shares rank 0's restart keys, gives every rank
            all B's on the device.
        deterministic: sum the statistics in a fixed order (rows sorted by code) instead of with
            atomics; default ``torch.are_deterministic_algorithms_enabled()``.

    ``decay``, ``eps``, ``threshold``, ``reset_cluster_size`` and ``restart_after_steps`` must be finite
    Python numbers (a tensor would cost a host sync), non-negative, ``restart_after_steps`` whole;
    otherwise ``ValueError`` / ``TypeError`` names them. The state tensors must not require grad while
    grad mode is on (``ValueError``), as for any in-place op on a leaf.

    Dead codes restart from distinct random rows of x while there are at most B (under DDP the sum
    of every rank's B) of them. No B x K one-hot, no host sync, fp32 state whatever the dtype of x.

    A code outside ``[0, K)`` raises ``IndexError`` where index checks are on (see
    ``sparsefuse.set_index_checks``). Unchecked, it is never dereferenced: it poisons the nearest
    valid code (0 or K - 1), whose batch count and sums become NaN in both the atomic and the
    deterministic path. That code counts as used (its counter resets) and its ``cluster_size``,
    ``embed_sum`` and codebook row become NaN; with ``"laplace"`` the NaN also enters the total N
    that smooths every code, so every codebook row of the level that is refreshed becomes NaN
    (codes restarting in this step still take their rows of x).

    In eager mode (not deterministic, no process group) the batch statistics go into a zeroed
    buffer that the update's second kernel leaves zeroed again, cached per thread, device, stream
    and (L, K, D) and reused by the next update: ``L * K * (D + 4)`` float32 each (0.5 MiB at
    K = 1024, D = 128) stay allocated until ``sparsefuse.vq.kernels.clear_ema_workspaces()``.
    Under ``torch.compile`` and while a CUDA graph is captured every update allocates its own.
    """
    active = semantics == "active"
    # an in-place update of shared state has no per-sample meaning: under vmap it failed deep in
    # the dispatcher ("Batching rule not implemented for sparsefuse::vq_ema_apply")
    refuse_transforms((x, codes, codebook, cluster_size, embed_sum, steps_since_active), functorch_ok=False)
    _check_ema_inputs(x, codes, codebook, cluster_size, embed_sum, steps_since_active, semantics, decay, eps,
                      threshold, reset_cluster_size, restart_after_steps, generator)
    if active and restart_after_steps > 0 and steps_since_active is None:
        raise ValueError("semantics='active' with restart_after_steps > 0 needs steps_since_active")
    if restart_after_steps >= _COUNTER_EXACT:
        raise ValueError(f"restart_after_steps must be below 2^24, got {restart_after_steps}")
    dev = codebook.device
    reset = 0.0 if active else float(threshold if reset_cluster_size is None else reset_cluster_size)
    det = use_deterministic(deterministic)
    eager = plain_eager((x, codes, codebook, cluster_size, embed_sum, steps_since_active))
    if process_group is None and eager and (codebook.is_cuda or INTERPRET):
        # Eager: the launchers directly, the keys as four kernel integers on CUDA (no key tensor) and
        # the statistics in a reused zeroed workspace (no allocation, no memset launch).
        L, K, D = kernels._levels(codebook)
        key = reference.key_words(dev, generator)
        if key is None:  # CPU tensors (interpreter) or graph capture: keys drawn on the device
            key = reference.draw_key(L, dev, generator)
        ws = None if det else kernels.ema_workspace(codebook, L, K, D)
        stats = kernels.ema_accumulate(x, codes, cluster_size, steps_since_active, det, bool(_check_codes), ws)
        kernels.ema_apply(x, codebook, cluster_size, embed_sum, steps_since_active, stats, key, decay, eps,
                          threshold, reset, restart_after_steps, active, None, 0, ws)
        bump_versions(codebook, cluster_size, embed_sum, steps_since_active)
        return
    if codebook.dim() == 2 and not (eager and (codebook.is_cuda or INTERPRET)):
        # the registered ops and the references take stacked levels; the launchers take either
        x, codes, codebook, cluster_size, embed_sum = (t.unsqueeze(0) for t in (x, codes, codebook, cluster_size,
                                                                              embed_sum))
        steps_since_active = None if steps_since_active is None else steps_since_active.unsqueeze(0)
    L, K, D = kernels._levels(codebook)
    if generator is None:
        key = torch.zeros((L, 4), device=dev, dtype=torch.int64)
        _key_op(key)
    else:
        key = _draw_key_eagerly(L, dev, generator)
    world, rank, sizes = 1, 0, None
    if process_group is not None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        if world > 1:
            # one collective: every rank's B beside its keys; all ranks use rank 0's keys, and the
            # apply kernel reads the B's on the device (ranks may differ in B; no host sync)
            mine = torch.cat([torch.full((1,), x.shape[-2], device=dev, dtype=torch.int64), key.flatten()])
            everyone = mine.new_zeros(world, mine.numel())
            dist.all_gather(list(everyone.unbind(0)), mine, group=process_group)
            sizes, key = everyone[:, 0], everyone[0, 1:].view(L, 4)
    stats = _acc_op(x, codes, cluster_size, steps_since_active, det, bool(_check_codes))
    if world > 1:
        dist.all_reduce(stats[: L * K * (D + 1)], group=process_group)
    cand, dead = _apply_op(x, codebook, cluster_size, embed_sum, steps_since_active, stats, key, float(decay),
                           float(eps), float(threshold), reset, int(restart_after_steps), active, sizes, rank)
    if world > 1:
        dist.all_reduce(cand, group=process_group)
        _restart_op(codebook, embed_sum, cand, dead, reset)


def batch_statistics(x: Tensor, codes: Tensor, num_codes: int, process_group=None,
                     deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """Per-code counts and sums ``(n [K], s [K, D])`` (``[L, ...]`` for stacked x), float32, no one-hot;
    all-reduced over ``process_group`` when given. Used by the k-means initialisation.

    x: ``[B, D]`` or ``[L, B, D]`` float; codes: ``[B]`` / ``[L, B]`` int32/int64 in ``[0, num_codes)``
    (range-checked and, unchecked, poisoned with NaN as in :func:`vq_ema_update`)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [B, D] or [L, B, D], got shape {tuple(x.shape)}")
    check_tensor("codes", codes, shape=tuple(x.shape[:-1]), dtypes=INDEX_DTYPES, device=x.device)
    if not torch.compiler.is_compiling() and (isinstance(num_codes, bool)
                                                  or not isinstance(num_codes, numbers.Integral)):
        raise ValueError(f"num_codes must be an int, got {num_codes!r}")  # 4.5 failed inside torch.zeros
    if num_codes < 1:
        raise ValueError(f"num_codes must be at least 1, got {num_codes}")
    single = x.dim() == 2
    if single:
        x, codes = x.unsqueeze(0), codes.unsqueeze(0)
    L, B, D = x.shape
    cs = torch.zeros(L, num_codes, device=x.device, dtype=torch.float32)
    det = use_deterministic(deterministic)
    stats = _acc_op(x, codes, cs, None, det, True)
    if process_group is not None:
        import torch.distributed as dist

        dist.all_reduce(stats[: L * num_codes * (D + 1)], group=process_group)
    s, n, _, _ = kernels.split_stats(stats, L, num_codes, D)
    return (n[0], s[0]) if single else (n, s)


# --- nearest-code search --------------------------------------------------------------------------------


def _search_fake(x, codebook, cosine, precision, deterministic):
    acc = acc_dtype(x, codebook)
    return x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0], dtype=acc)


def _search_reference(x, codebook, cosine, precision, deterministic):
    return reference.nearest_code(x, codebook, cosine)


def _search_kernel(x, codebook, cosine, precision, deterministic):
    if torch.float64 in (x.dtype, codebook.dtype):
        return reference.nearest_code(x, codebook, cosine)
    return kernels.nearest_code(x, codebook, cosine, precision, deterministic)


def _search_setup(ctx, inputs, output):
    x, codebook, cosine, _precision, _deterministic = inputs
    codes, _dist = output
    ctx.mark_non_differentiable(codes)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, codebook, codes)
    ctx.cosine = cosine


def _search_backward(ctx, _grad_codes, grad_dist):
    """Gradient of ``dist`` (the chosen code's distance) for x and the codebook; ``codes`` have none.

    Euclidean: ``d dist / dx = 2 (x - c)`` and ``-2 (x - c)`` for the chosen row ``c``. Cosine,
    ``dist = 2 - 2 cos`` with ``cos = x.c / (|x| |c|)``: ``d dist / dx = -2 (c^ - cos x^) / |x|`` and
    ``d dist / dc = -2 (x^ - cos c^) / |c|`` (``^`` unit vectors); a row of x or a code of norm
    at most 1e-12 (the search's clamp: its dist is 2) gets 0 there rather than a 1e12-sized step."""
    x, codebook, codes = ctx.saved_tensors
    need_x, need_c = ctx.needs_input_grad[:2]
    if grad_dist is None:
        return None, None, None, None, None
    dt = grad_dist.dtype
    xf, c = x.to(dt), codebook[codes].to(dt)
    g = grad_dist[:, None]
    if ctx.cosine:
        nx, nc = xf.norm(dim=1, keepdim=True), c.norm(dim=1, keepdim=True)
        ok = (nx > 1e-12) & (nc > 1e-12)
        nx, nc = torch.where(ok, nx, 1), torch.where(ok, nc, 1)
        xu, cu = xf / nx, c / nc
        cos = (xu * cu).sum(1, keepdim=True)
        gx = torch.where(ok, -2 * g * (cu - cos * xu) / nx, 0)
        gc = torch.where(ok, -2 * g * (xu - cos * cu) / nc, 0)
    else:
        gx = 2 * g * (xf - c)
        gc = -gx
    grad_x = gx.to(x.dtype) if need_x else None
    grad_c = None
    if need_c:
        grad_c = torch.zeros(codebook.shape, device=gc.device, dtype=dt).index_add_(0, codes, gc).to(codebook.dtype)
    return grad_x, grad_c, None, None, None


@register_op("nearest_code", fake=_search_fake, reference=_search_reference, backward=_search_backward,
             setup_context=_search_setup)
def _search_op(x: Tensor, codebook: Tensor, cosine: bool, precision: str, deterministic: bool) -> tuple[Tensor, Tensor]:
    return _search_kernel(x, codebook, cosine, precision, deterministic)


def nearest_code(x: Tensor, codebook: Tensor, *, cosine: bool = False, precision: str = "exact",
                 deterministic: Optional[bool] = None) -> tuple[Tensor, Tensor]:
    """Nearest code of every row, fused distance + argmin: the B x K distance matrix never exists.

    Args:
        x: ``[B, D]`` rows (float16, bfloat16, float32, float64).
        codebook: ``[K, D]``.
        cosine: pick the code of largest cosine similarity instead of smallest Euclidean distance.
        precision: for float32 inputs, ``"exact"`` (default: fp32-accurate dot products on tensor
            cores, each fp32 operand split into two TF32 parts and three TF32 products summed in fp32;
            the error is at the level of fp32 rounding, like any fp32 summation order), ``"ieee"``
            (strict IEEE fp32 fused multiply-adds on the CUDA cores; slower) or ``"fast"`` (one TF32
            product: about 3 significant digits). 16-bit inputs always use their native tensor-core
            dot, whose products are exact in fp32 and sums fp32; mixed dtypes compute in the promoted
            dtype; float64 runs the reference.
        deterministic: search with one fixed kernel configuration instead of the autotuner's pick, so
            that results repeat bit for bit across processes too (within a process they always do).
            The autotuner times its configurations in each process, and they sum the dot products
            in different orders, which can flip a near-tie between two codes. Default
            ``torch.are_deterministic_algorithms_enabled()``.

    Returns:
        ``codes [B]`` int64, ties to the lowest index; ``dist [B]`` float32 (float64 for float64
        inputs): the squared distance ``||x - c||^2`` (clamped at 0), or with ``cosine`` the squared
        distance between the unit vectors, ``2 - 2 cos``. The search scores ``||c||^2 - 2 x.c`` and
        ``dist`` adds ``||x||^2``, as FAISS and the usual PyTorch VQ code do: its error is that of
        fp32 rounding of those terms, about 1e-7 * (||x||^2 + ||c||^2), so for data far from the
        origin (``||x||^2`` much larger than the distance) ``dist`` loses relative accuracy, and
        codes closer than that may tie either way. Centre such data, or take
        ``(x - codebook[codes]).square().sum(-1)`` where the value matters.

    NaN propagates (kernel and reference alike): a NaN score ranks before every number, as in
    ``torch.argmin``, and gives a NaN ``dist``. So a row of x holding a NaN gets code 0 and dist
    NaN, and a codebook row holding a NaN is the code of every row of x (the lowest-numbered such
    row), all with dist NaN. Infinite entries are outside this rule: their scores follow IEEE
    arithmetic, in which the kernel's split products and the reference may differ.

    Extra memory O(B + K) for 16- and 32-bit inputs; float64 (x or the codebook) runs the
    brute-force reference, which builds the B x K distance matrix.

    ``dist`` is differentiable in x and the codebook (a commitment term built on it gets its
    gradient): the backward computes the derivative of the chosen code's distance from the saved
    x, codebook and codes, O(B * D) (see ``_search_backward``); the forward is the same search
    either way. ``codes`` are not differentiable. Because the codebook is saved, updating it in
    place (``vq_ema_update``) before a backward that differentiates ``dist`` raises PyTorch's
    in-place error; a backward that does not reach ``dist`` (``codes, _ = nearest_code(...)``) is
    unaffected, and ``nearest_code(x, codebook.clone())`` keeps a ``dist`` loss valid across the update.
    """
    check_tensor("codebook", codebook, shape=(None, None), dtypes=FLOAT_DTYPES)
    K, D = codebook.shape
    check_tensor("x", x, shape=(None, D), dtypes=FLOAT_DTYPES, device=codebook.device)
    check_not_empty("codebook", codebook, -2, "code")
    check_precision(precision)
    det = use_deterministic(deterministic)
    return _search_op(x, codebook, bool(cosine), precision, det)


# --- straight-through quantisation + commitment loss ---------------------------------------------------------


def _quantize_fake(x, codes, codebook, beta):
    acc = acc_dtype(x, codebook)
    return x.new_empty(x.shape), x.new_empty((), dtype=acc)  # contiguous like the kernel's


def _quantize_reference(x, codes, codebook, beta):
    check_index_range("codes", codes, codebook.shape[0])
    return reference.quantize_fwd(x, codes, codebook, beta)


def _quantize_bwd_fake(grad_out, grad_loss, x, q, beta):
    return x.new_empty(x.shape)


@register_op("vq_quantize_bwd", fake=_quantize_bwd_fake, reference=reference.quantize_bwd)
def _quantize_bwd_op(grad_out: Tensor, grad_loss: Tensor, x: Tensor, q: Tensor, beta: float) -> Tensor:
    return kernels.quantize_bwd(grad_out, grad_loss, x, q, beta)


def _quantize_setup(ctx, inputs, output):
    x, codes, codebook, beta = inputs
    out, _ = output
    ctx.save_for_backward(x, out)  # not the codebook: the EMA update rewrites it in place before backward
    ctx.beta = beta


def _quantize_backward(ctx, grad_out, grad_loss):
    # both gradients are tensors: autograd materialises an unused output's gradient as zeros
    x, out = ctx.saved_tensors
    return _quantize_bwd_op(grad_out, grad_loss, x, out, ctx.beta), None, None, None


@register_op("vq_quantize", fake=_quantize_fake, reference=_quantize_reference,
             backward=_quantize_backward, setup_context=_quantize_setup)
def _quantize_op(x: Tensor, codes: Tensor, codebook: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    return kernels.quantize_fwd(x, codes, codebook, beta)


def quantize(x: Tensor, codes: Tensor, codebook: Tensor, beta: float = 1.0) -> tuple[Tensor, Tensor]:
    """Straight-through quantisation fused with the commitment loss.

    Returns ``out = codebook[codes]`` (``[B, D]`` in x's dtype) whose gradient flows to ``x``
    unchanged, and ``loss = beta * mean((x - sg(out))^2)`` (float32; float64 for float64 inputs),
    computed from ``out`` as returned (the codebook rows rounded to x's dtype), so the backward is
    its exact derivative. One kernel forward (gather + squared error), one backward
    (``grad_x = grad_out + grad_loss * 2 beta / (B D) * (x - out)``); the codebook gets no gradient
    (straight-through: out's gradient goes to x; a codebook learned by gradient needs its own loss,
    such as ``F.mse_loss(codebook[codes], x.detach())``). ``beta`` is a finite Python number >= 0.
    ``codes [B]`` int64 in ``[0, K)`` (from :func:`nearest_code`): one outside raises ``IndexError``
    where index checks are on (see ``sparsefuse.set_index_checks``); unchecked, its row of ``out``
    and of ``grad_x``, and the loss, are NaN.
    """
    check_tensor("codebook", codebook, shape=(None, None), dtypes=FLOAT_DTYPES)
    check_tensor("x", x, shape=(None, codebook.shape[1]), dtypes=FLOAT_DTYPES, device=codebook.device)
    check_tensor("codes", codes, shape=(x.shape[0],), dtypes=(torch.int64,), device=codebook.device)
    beta = check_number("beta", beta, positive=False)  # NaN or < 0 reached the loss, a tensor was a sync
    if not plain_eager((x, codes, codebook)):
        return _quantize_op(x, codes, codebook.detach(), beta)
    return _Quantize.apply(x, codes, codebook.detach(), beta)


class _Quantize(torch.autograd.Function):
    """Eager path of ``vq_quantize``: the same launchers without the custom-op autograd wrapper,
    whose host cost exceeded the two kernels' device time. Not the registry's eager path
    (``RegisteredOp.__call__``) either: that repeats ``plain_eager`` and picks the implementation
    in the forward and again for the backward op: about 10 us more host time per forward + backward,
    measured on CPU (before the registry tested ``is_cpu`` in place of ``device.type``)."""

    @staticmethod
    def forward(ctx, x, codes, codebook, beta):
        impl = kernels.quantize_fwd if (x.is_cuda or INTERPRET) else _quantize_reference
        out, loss = impl(x, codes, codebook, beta)
        ctx.save_for_backward(x, out)
        ctx.beta = beta
        return out, loss

    @staticmethod
    @first_order
    def backward(ctx, grad_out, grad_loss):
        x, out = ctx.saved_tensors
        impl = kernels.quantize_bwd if (x.is_cuda or INTERPRET) else reference.quantize_bwd
        return impl(grad_out, grad_loss, x, out, ctx.beta), None, None, None
