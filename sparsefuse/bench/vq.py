"""``sparsefuse bench vq``: EMA codebook update, nearest-code search, one VectorQuantizer step.

* ``ema_active`` / ``ema_laplace``: :func:`sparsefuse.vq_ema_update` against the five-step one-hot
  PyTorch update (``reference.ema_update`` with a plain ``torch.randperm`` row picker) in eager mode,
  and for ``ema_active`` also under ``torch.compile``, at (B, K, D) = (640, 256, 64),
  (16384, 1024, 128), (65536, 1024, 128), (32768, 4096, 256); x float32.
  Each EMA case is timed in three round-robin rounds and keeps its median round (every provider
  alike): the eager update is host-bound and one-off medians moved 3x between runs on the H200 host.
  The ``vq_step`` cases (below) get the same three rounds.
  ``sparsefuse-graph`` replays the same op from a CUDA graph (it has no host sync, so it can be
  captured): its time is the kernels' device time, without Python's launch overhead.
* ``search``: :func:`sparsefuse.nearest_code` against ``(||x||^2 - 2 x C^T + ||c||^2).argmin`` in
  the same precision (float32 with TF32 off for ``exact``; TF32 on for ``fast``; bfloat16), eager
  and compiled, at (65536, 1024, 128) and (65536, 4096, 256).
* ``vq_step``: one training step of :class:`sparsefuse.VectorQuantizer` (search, straight-through,
  commitment loss, backward to x, EMA update) against vector-quantize-pytorch's ``VectorQuantize``
  with EMA at the same settings (decay 0.99, dead-code threshold 2, commitment 0.25, straight-through
  gradient: ``rotation_trick=False``, where recent versions default to True), when installed.

GB/s counts the traffic no implementation avoids: x and the codes read once and the two [K, D]
state tensors (codebook, EMA sums) read and written once (update); x and the codebook read once
(search).
"""

from __future__ import annotations

import torch

from .. import VectorQuantizer, nearest_code, vq_ema_update
from ..vq import reference
from . import harness

FAMILY = "vq"
EMA_SHAPES = [(640, 256, 64), (16384, 1024, 128), (65536, 1024, 128), (32768, 4096, 256)]
SEARCH_SHAPES = [(65536, 1024, 128), (65536, 4096, 256)]
STEP_SHAPE = (65536, 1024, 128)
EMA_ROUNDS = 3  # host-bound cases (EMA, step): median of three round-robin rounds for every provider
RESTART_AFTER = 10
THRESHOLD = 2.0


def make_state(B, K, D, device, *, dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, D, device=device, generator=g).to(dtype)
    codes = torch.randint(0, K, (B,), device=device, generator=g)
    codebook = torch.randn(K, D, device=device, generator=g)
    cluster_size = torch.rand(K, device=device, generator=g) * 4
    embed_sum = codebook * cluster_size[:, None]
    counters = torch.randint(0, RESTART_AFTER, (K,), device=device, generator=g)
    return x, codes, codebook, cluster_size, embed_sum, counters


def _ema_kwargs(semantics):
    restart = dict(restart_after_steps=RESTART_AFTER) if semantics == "active" else dict(threshold=THRESHOLD)
    return dict(decay=0.99, semantics=semantics, **restart)


def _reference_update(x, codes, codebook, cluster_size, embed_sum, counters, semantics):
    reference.ema_update(x, codes, codebook, cluster_size, embed_sum, counters, decay=0.99,
                         active=semantics == "active", threshold=THRESHOLD, restart_after=RESTART_AFTER,
                         row_picker="randperm")


def _ema_case(semantics, provider, B, K, D):
    def make():
        state = make_state(B, K, D, "cuda")
        if provider == "sparsefuse":
            kw = _ema_kwargs(semantics)
            return lambda: vq_ema_update(*state, **kw)
        if provider == "sparsefuse-graph":  # the same op replayed from a CUDA graph: device time only
            kw = _ema_kwargs(semantics)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                vq_ema_update(*state, **kw)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                vq_ema_update(*state, **kw)
            return graph.replay
        fn = _reference_update if provider == "torch" else torch.compile(_reference_update, dynamic=False)
        return lambda: fn(*state, semantics)

    return harness.Case(op=f"ema_{semantics}", provider=provider, shape=dict(B=B, K=K, D=D), dtype="fp32",
                        mode="fwd", make=make, bytes_moved=(B * D + 2 * K * D * 2) * 4 + B * 8, rounds=EMA_ROUNDS)


def _search_torch(x, c):
    return ((x * x).sum(1, keepdim=True) - 2 * (x @ c.T) + (c * c).sum(1)).argmin(1)


def _with_tf32(fn, on):
    def run(*args):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = on
        try:
            return fn(*args)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    return run


def _search_case(provider, B, K, D, dtype_name):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]

    def make():
        x, _, c, *_ = make_state(B, K, D, "cuda", dtype=dtype)
        c = c.to(dtype)
        if provider.startswith("sparsefuse"):
            prec = {"sparsefuse": "exact", "sparsefuse-ieee": "ieee", "sparsefuse-fast": "fast"}[provider]
            return lambda: nearest_code(x, c, precision=prec)
        fn = _search_torch if provider == "torch" else torch.compile(_search_torch, dynamic=False)
        return lambda: _with_tf32(fn, provider.endswith("tf32"))(x, c)

    isz = dtype.itemsize
    return harness.Case(op="search", provider=provider, shape=dict(B=B, K=K, D=D), dtype=dtype_name, mode="fwd",
                        make=make, bytes_moved=(B * D + K * D) * isz, flops=2 * B * K * D)


def _step_case(provider, B, K, D):
    def make():
        x = torch.randn(B, D, device="cuda").requires_grad_()
        if provider == "sparsefuse":
            vq = VectorQuantizer(D, K, decay=0.99, threshold=THRESHOLD, commitment_weight=0.25).cuda().train()
            inp = x
        else:
            from vector_quantize_pytorch import VectorQuantize

            vq = VectorQuantize(dim=D, codebook_size=K, decay=0.99, commitment_weight=0.25,
                                threshold_ema_dead_code=THRESHOLD, **_vqtorch_straight_through()).cuda().train()
            inp = x[None]

        def step():
            out, _, loss = vq(inp)
            loss = loss.sum() + out.float().square().mean()
            return torch.autograd.grad(loss, x)
        return step

    return harness.Case(op="vq_step", provider=provider, shape=dict(B=B, K=K, D=D), dtype="fp32", mode="full",
                        make=make, rounds=EMA_ROUNDS)


def _vqtorch_straight_through() -> dict:
    """The keyword that gives vector-quantize-pytorch's ``VectorQuantize`` the plain straight-through
    gradient of ours: recent versions (1.32.0 among them) default to the rotation trick (arXiv
    2410.06424), a per-row rotation in the forward and the backward that a straight-through step
    does not do."""
    import inspect

    from vector_quantize_pytorch import VectorQuantize

    return {"rotation_trick": False} if "rotation_trick" in inspect.signature(VectorQuantize).parameters else {}


def _have_vqtorch() -> bool:
    try:
        import vector_quantize_pytorch  # noqa: F401
    except Exception:
        return False
    return True


def cases(*, quick=False):
    ema_shapes = EMA_SHAPES[:2] if quick else EMA_SHAPES
    search_shapes = [(4096, 512, 64)] if quick else SEARCH_SHAPES
    out = []
    for B, K, D in ema_shapes:
        for provider in ("sparsefuse", "sparsefuse-graph", "torch", "torch.compile"):
            out.append(_ema_case("active", provider, B, K, D))
        for provider in ("sparsefuse", "torch"):
            out.append(_ema_case("laplace", provider, B, K, D))
    for B, K, D in search_shapes:
        for provider in ("sparsefuse", "sparsefuse-ieee", "sparsefuse-fast", "torch", "torch.compile",
                         "torch.compile-tf32"):
            out.append(_search_case(provider, B, K, D, "fp32"))
        for provider in ("sparsefuse", "torch", "torch.compile"):
            out.append(_search_case(provider, B, K, D, "bf16"))
    B, K, D = (8192, 512, 64) if quick else STEP_SHAPE
    out.append(_step_case("sparsefuse", B, K, D))
    if _have_vqtorch():
        out.append(_step_case("vector-quantize-pytorch", B, K, D))
    else:
        print("vector-quantize-pytorch is not installed: the vq_step baseline is skipped")
    return out


def _table(results, op, baselines, mode="fwd", ours="sparsefuse"):
    sub = [r for r in results if r.op == op]
    return harness.speedup_table(sub, ours=ours, baselines=baselines, mode=mode) if sub else ""


def render(out_dir=harness.RESULTS_DIR, readme="README.md"):
    results = harness.load(FAMILY, out_dir)
    if not results:
        return None
    parts = [
        "**EMA update, `active` semantics** (RecTokens; baseline: five-step one-hot PyTorch update; every "
        "EMA time is the median of three round-robin rounds)\n\n"
        + _table(results, "ema_active", ("torch", "torch.compile")),
        "**The same update replayed from a CUDA graph** (`sparsefuse-graph`: the kernels' device time, "
        "without Python's launch cost; the baselines as above, eager)\n\n"
        + _table(results, "ema_active", ("torch", "torch.compile"), ours="sparsefuse-graph"),
        "**EMA update, `laplace` semantics** (vector-quantize-pytorch / EnCodec)\n\n"
        + _table(results, "ema_laplace", ("torch",)),
        "**Nearest-code search, fp32** (`precision=\"exact\"`, fp32-accurate 3xTF32; baseline: "
        "`(‖x‖² − 2x·Cᵀ + ‖c‖²).argmin` with TF32 off; `sparsefuse-ieee` is the strict-IEEE FMA mode)\n\n"
        + _table([r for r in results if r.dtype == "fp32"], "search", ("torch", "torch.compile", "sparsefuse-ieee")),
        "**Nearest-code search, fast fp32** (`precision=\"fast\"`, TF32; baseline with TF32 on)\n\n"
        + _table([r for r in results if r.dtype == "fp32"], "search", ("torch.compile-tf32",), ours="sparsefuse-fast"),
        "**Nearest-code search, bf16**\n\n"
        + _table([r for r in results if r.dtype == "bf16"], "search", ("torch", "torch.compile")),
        "**One VectorQuantizer training step** (search, straight-through, commitment loss, backward, EMA update)\n\n"
        + _table(results, "vq_step", ("vector-quantize-pytorch",), mode="full"),
    ]
    text = "\n\n".join(p for p in parts if not p.endswith("\n\n"))
    return harness.publish(FAMILY, text, [r for r in results if r.op.startswith("ema")], out_dir=out_dir,
                           readme=readme, title="VQ EMA update", x_key="B", mode="fwd")


def check(log=print) -> bool:
    """No GPU: compare the ops with the float64 reference on a small problem instead of timing."""
    ok = True
    for semantics in ("active", "laplace"):
        x, codes, *state = make_state(37, 11, 20, "cpu")
        ref = [t.double() if t.is_floating_point() else t.clone() for t in state]
        g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        vq_ema_update(x, codes, *state, generator=g1, **_ema_kwargs(semantics))
        reference.ema_update(x.double(), codes, *ref, decay=0.99, active=semantics == "active", threshold=THRESHOLD,
                             restart_after=RESTART_AFTER, generator=g2)
        err = harness.rel_err(state, ref)
        good = err < 1e-5
        ok &= good
        log(f"  ema_{semantics:<8} state vs float64 reference: max relative error {err:.2e}  {'ok' if good else 'FAILED'}")
    x, _, c, *_ = make_state(37, 50, 20, "cpu")
    codes, dist = nearest_code(x, c)
    want_codes, want_dist = reference.nearest_code_exact(x, c)
    good = bool((codes == want_codes).all()) and float((dist.double() - want_dist).abs().max()) < 1e-4
    ok &= good
    log(f"  search       codes and distances vs float64 brute force  {'ok' if good else 'FAILED'}")
    return ok

