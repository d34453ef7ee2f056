"""Where the time of the fused from-hidden loss goes (GPU): ``python -m sparsefuse.kd.profile``.

Times each stage of one chunked forward+gradient pass separately with ``do_bench`` (the issue's
shape by default), next to the bare LM-head matmuls, and the gathered and row kernels alone.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from .._launch import cdiv
from . import kernels
from .reference import acc_dtype


def main(N=8192, H=4096, V=128256, K=64, dtype=torch.bfloat16, dev="cuda", iters=300):
    from ..bench.kd import make_targets

    ids, t, m = make_targets(N, K, V, dev)
    h = torch.randn(N, H, device=dev).to(dtype)
    w = (torch.randn(V, H, device=dev) / H**0.5).to(dtype)
    C = kernels.chunk_rows(N, V, h.element_size())
    acc = acc_dtype(h)
    z = torch.empty(C, V, device=dev, dtype=dtype)
    torch.mm(h[:C], w.t(), out=z)
    gw = torch.empty_like(w)
    gh = torch.empty_like(h)
    m8 = kernels._u8(m)
    e = lambda *s: torch.empty(*s, device=dev, dtype=acc)  # noqa: E731
    tok, flags, lse, A, lse1, ce = (e(C) for _ in range(6))
    corr = e(C, K)
    scale = torch.tensor([1.0 / N, 0.0], device=dev, dtype=acc)
    nchunks = cdiv(N, C)  # the last chunk may be partial: timed as a full one
    rows = dict(
        mm_fwd=lambda: torch.mm(h[:C], w.t(), out=z),
        row_fwd=lambda: kernels._row_fwd(z, ids[:C], t[:C], m8[:C], None, 1, 1.0, acc,
                                         (tok, flags, lse, A, corr, None, None, None)),
        row_bwd=lambda: kernels._row_bwd(z, z, ids[:C], m8[:C], None, lse, A, corr, None, None, None, scale, 1, 1.0),
        mm_gh=lambda: torch.mm(z, w, out=gh[:C]),
        mm_gw=lambda: gw.addmm_(z.t(), h[:C]),
    )
    total = 0.0
    for name, fn in rows.items():
        ms = do_bench(fn, warmup=25, rep=100)
        if name == "row_bwd":  # keep z finite for the next stages: refill with logits
            torch.mm(h[:C], w.t(), out=z)
        total += ms * nchunks
        print(f"{name:<8} {ms:8.3f} ms per chunk of {C} rows  x{nchunks} = {ms * nchunks:8.2f} ms")
    g = torch.randn(N, V, device=dev).to(dtype)
    bare = do_bench(lambda: (h @ w.t(), g @ w, g.t() @ h), warmup=25, rep=200)
    print(f"sum of stages {total:.2f} ms; bare matmuls {bare:.2f} ms; ratio {total / bare:.3f}")
    del g, z
    torch.cuda.empty_cache()
    topk_stages(h, w, ids, t, m)
    gathered_overhead(N, K, iters, dev)


def topk_stages(h, w, ids, t, m):
    """"topk" from hidden: the gather kernel under a few launch configurations, and the weight gradient."""
    import triton

    from ..sae import kernels as sae_kernels

    N, H = h.shape
    V, K = w.shape[0], ids.shape[1]
    dev = h.device
    acc = torch.float32
    tok, flags = torch.empty(N, device=dev), torch.empty(N, device=dev)
    g = torch.randn(N, K, device=dev) * 1e-3
    gh = torch.empty_like(h)
    scale = torch.tensor([1.0 / N, 0.0], device=dev)
    m8 = kernels._u8(m)
    tl_acc = kernels.tl_dtype(acc)
    for grad in (False, True):
        for bh in (64, 128):
            for nw in (2,):
                fn = lambda: kernels._kd_hidden_topk_kernel[(N,)](  # noqa: E731
                    h, w, None, ids, t, m8, tok, flags, g, gh, scale, H, V, K, w.stride(0), 1.0, 1.0,
                    HAS_BIAS=False, NEED_GRAD=grad, NEED_GH=grad, ACC=tl_acc, BLOCK_K=triton.next_power_of_2(K),
                    BLOCK_H=bh, num_warps=nw)
                try:
                    ms = do_bench(fn, warmup=10, rep=50)
                except Exception as e:  # noqa: BLE001
                    ms = float("nan")
                    print("  failed", bh, nw, type(e).__name__)
                print(f"hidden_topk kernel grad={grad!s:<5} BLOCK_H={bh:<4} warps={nw}: {ms:7.3f} ms")
    ms = do_bench(lambda: sae_kernels.row_dot(ids, w, h, None, torch.float32, acc), warmup=10, rep=50)
    print(f"sae dots (row_dot kernel, the decode's vals gradient): {ms:.3f} ms")
    ms = do_bench(lambda: sae_kernels.decode_fwd(ids, g, w, None), warmup=10, rep=50)
    print(f"sae decode fwd (embedding bag, fp32 out): {ms:.3f} ms")
    clean = torch.where(m, ids, torch.zeros_like(ids))
    ms = do_bench(lambda: torch.sort(clean.reshape(-1), stable=True), warmup=10, rep=50)
    print(f"sort of N*K ids: {ms:.3f} ms")
    ms = do_bench(lambda: sae_kernels.weight_grad(clean, h, g, V, w.dtype), warmup=10, rep=50)
    print(f"sae weight_grad (sort + segmented sum): {ms:.3f} ms")
    ms = do_bench(lambda: kernels.lm_weight_grad(ids, m, g, h, V, w.dtype), warmup=10, rep=50)
    print(f"kd lm_weight_grad (sort + one-hot tiles on the matrix unit): {ms:.3f} ms, "
          f"config {kernels._kd_weight_grad_kernel.best_config}")


def gathered_overhead(N, K, iters=300, dev="cuda"):
    """Host time per call of the gathered loss (it is launch-bound at [8192, 64])."""
    import time

    from .. import topk_kd_loss
    from ..bench.kd import _ref_gathered
    from . import ops

    ids, t, m = make_targets_small(N, K, dev)
    z = torch.randn(N, K, device=dev).to(torch.bfloat16).requires_grad_()
    zd = z.detach()
    one = torch.ones((), device=dev)
    m8 = kernels._u8(m)
    acc = torch.float32
    tok, flags = torch.empty(N, device=dev), torch.empty(N, device=dev)

    def sync():
        if torch.device(dev).type == "cuda":
            torch.cuda.synchronize()

    def host_us(fn):
        for _ in range(10):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters * 1e6

    rows = {
        "public fwd+bwd": lambda: torch.autograd.grad(topk_kd_loss(z, t, m), [z]),
        "public fwd": lambda: topk_kd_loss(zd, t, m),
        "reference fwd+bwd (eager)": lambda: torch.autograd.grad(_ref_gathered(z, t, m), [z]),
        "op fwd (no autograd)": lambda: ops._topk_op(zd, t, m, 1.0, 1, None, 1.0),
        "launchers fwd+bwd": lambda: kernels.topk_bwd(one, None, zd, t, m, kernels.topk_fwd(zd, t, m, 1.0, 1, None,
                                                                                             1.0)[2], 1.0),
        "one reduce launch": lambda: kernels.reduce(tok, None, flags, None, 1, None, 1.0, 0.0, acc),
        "one topk launch": lambda: kernels._kd_topk_kernel[(cdiv(N, 64),)](
            zd, t, m8, tok, flags, None, None, None, None, N, K, 1.0, 1.0, IS_BWD=False, HAS_GT=False,
            ACC=kernels.tl_dtype(acc), BLOCK_N=64, BLOCK_K=64),
        "torch.empty x2": lambda: (torch.empty(N, device=dev), torch.empty(N, device=dev)),
    }
    for name, fn in rows.items():
        print(f"host {name:<28} {host_us(fn):8.1f} us/call")
    print(f"device public fwd+bwd (do_bench) {do_bench(rows['public fwd+bwd'], warmup=25, rep=200) * 1e3:.1f} us")


def make_targets_small(N, K, dev):
    from ..bench.kd import make_targets

    return make_targets(N, K, 4096, dev)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
