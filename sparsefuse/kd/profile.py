"""Where the time of the fused from-hidden loss goes (GPU): ``python -m sparsefuse.kd.profile``.

Times each stage of one chunked forward+gradient pass separately with ``do_bench`` (the issue's
shape by default), next to the bare LM-head matmuls, and the gathered and row kernels alone.
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from . import kernels
from .reference import acc_dtype


def main(N=8192, H=4096, V=128256, K=64, dtype=torch.bfloat16):
    from ..bench.kd import make_targets

    dev = "cuda"
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
    nchunks = N // C
    rows = dict(
        mm_fwd=lambda: torch.mm(h[:C], w.t(), out=z),
        row_fwd=lambda: kernels._row_fwd(z, ids[:C], t[:C], m8[:C], None, 1, 1.0, acc,
                                         (tok, flags, lse, A, corr, None, None)),
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


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
