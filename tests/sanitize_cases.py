"""Small calls that launch every Triton kernel of a family, for the GPU tier's compute-sanitizer tests.

``python tests/sanitize_cases.py FAMILY [DEVICE [DTYPES]]`` (FAMILY: sae, kd or vq; DEVICE: cuda,
the default, or cpu under ``TRITON_INTERPRET=1``; DTYPES: all, the default, or float32) runs the
family's ops forward and backward on odd shapes in float32 and the 16-bit dtypes, then again with
out-of-range indices and the host check off, where each op must poison the affected rows with NaN
and touch nothing out of bounds. ``float32`` leaves the 16-bit cases out: initcheck does not see
some cuBLAS bf16 matmuls write their outputs (a plain bf16 ``torch.addmm`` into a NaN-filled buffer
overwrites every element, yet initcheck flags a later read of each one), so the KD family runs under
initcheck in float32.

On CUDA it records every kernel launched (a Triton launch hook) and fails if a ``*_kernel`` of the
family's modules never ran, so a kernel added later cannot escape the sanitizer unnoticed. It
prints ``ok`` last.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

import sparsefuse
from sparsefuse import _segsum
from sparsefuse.kd import kernels as kd_kernels
from sparsefuse.sae import kernels as sae_kernels
from sparsefuse.vq import kernels as vq_kernels

#: The modules whose kernels each family's cases must launch.
MODULES = {"sae": (sae_kernels, _segsum), "kd": (kd_kernels,), "vq": (vq_kernels, _segsum)}

#: Index values no op may dereference: negative, one past the end, and past 2^32 both ways.
BAD = lambda n: (-1, n, 2**40, -(2**40))  # noqa: E731


def kernels_of(mod) -> set[str]:
    """Names of the Triton kernels (``*_kernel``) a module defines, compiled or interpreted."""
    names = set()
    for name, obj in vars(mod).items():
        if isinstance(obj, triton.runtime.Autotuner):  # an autotuned kernel wraps its JITFunction
            obj = obj.fn
        if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)) and name.endswith("_kernel"):
            names.add(obj.fn.__name__)
    return names


def family_kernels(family: str) -> set[str]:
    return set().union(*map(kernels_of, MODULES[family]))


def grads(out, params):
    return torch.autograd.grad(out, [p for p in params if p.requires_grad], allow_unused=True)


def leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def sae(dev: str, dtypes) -> None:
    from sparsefuse.bench.sae import make_inputs

    cases = [(1, torch.float32)] + [(7, dt) for dt in dtypes]
    if len(dtypes) > 1:  # float16 too: its hierarchical weight gradient is the one with the scale-and-cast pass
        cases.append((7, torch.float16))
    for K, dt in cases:
        i, w, v, b, t = make_inputs(13, K, 300, 77, dt, dev)
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        for f in (sparsefuse.topk_sae_loss, sparsefuse.hierarchical_sae_loss):
            for det in (False, True):
                grads(f(i, w, v, b, t, deterministic=det), ps)
        grads(sparsefuse.sae_decode(i, v, w, b).sum(), ps)
    # the encoder-side ops of TopKSAE: sparse_linear and the unit-norm decoder rows
    for hierarchical in (False, True):
        model = sparsefuse.TopKSAE(77, 300, 7, hierarchical=hierarchical).to(dev)
        model.zero_grad()
        model(torch.randn(13, 77, device=dev)).loss.backward()
        model.remove_parallel_grad_()
        model.normalize_decoder_()
    # bad indices with the host check off (the CUDA default): NaN, and never an access out of bounds
    sparsefuse.set_index_checks(False)
    for dt in dtypes:
        i, w, v, b, t = make_inputs(13, 7, 300, 77, dt, dev)
        i = i.long()
        for r, (c, bad) in enumerate(zip((0, 2, 3, 6), BAD(300))):
            i[r, c] = bad
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        for f in (sparsefuse.topk_sae_loss, sparsefuse.hierarchical_sae_loss):
            for det in (False, True):
                g = grads(f(i, w, v, b, t, deterministic=det), ps)
                assert g[1][:4].isnan().any(dim=1).all(), (f, det)
        g = grads(sparsefuse.sae_decode(i, v, w, b).sum(), ps)
        assert g[1][:4].isnan().any(dim=1).all()
        out = sparsefuse.sparse_linear(t, w, i, torch.zeros(300, device=dev, dtype=dt))
        assert out[:4].isnan().any(dim=1).all() and out[4:].isfinite().all()


def _kd_inputs(N, K, V, H, dt, dev):
    """test_kd's inputs (distinct ids: "tail" refuses repeats), as a tuple."""
    from test_kd import make

    d = make(N, K, V, H, dtype=dt, device=dev, dup=False)
    return tuple(d[k] for k in ("ids", "t", "m", "z", "h", "w", "b", "labels"))


def kd(dev: str, dtypes) -> None:
    # V = 1000 and 4099: partial vocabulary tiles, and a "tail" bit map whose last word is partial
    N, K, H = 11, 5, 40
    for V in (1000, 4099):
        for dt in dtypes:
            ids, t, m, z, h, w, b, labels = _kd_inputs(N, K, V, H, dt, dev)
            (zk,) = leaves(z.gather(1, ids))
            grads(sparsefuse.topk_kd_loss(zk, t, m, temperature=2.0), [zk])
            for norm in ("topk", "full", "tail"):
                (zl,) = leaves(z)
                grads(sparsefuse.topk_kd_loss_from_logits(zl, ids, t, m, normalize=norm, temperature=2.0), [zl])
                for ce, chunk in ((0.0, None), (0.5, 4)):
                    ps = leaves(h, w, b)
                    loss = sparsefuse.topk_kd_loss_from_hidden(ps[0], ps[1], ids, t, m, normalize=norm,
                                                               lm_head_bias=ps[2], labels=labels, ce_weight=ce,
                                                               chunk_size=chunk, reduction="sum")
                    grads(loss * 0.5, ps)  # an incoming gradient other than 1: the rescale does work
    # out-of-range ids with the host check off: NaN for the token, nothing read or written out of bounds
    sparsefuse.set_index_checks(False)
    V = 1000
    ids, t, m, z, h, w, b, labels = _kd_inputs(N, K, V, H, torch.float32, dev)
    rows = (0, 2, 3, 4)
    for r, bad in zip(rows, BAD(V)):
        ids[r, 0] = bad  # slot 0 is never masked
    for norm in ("topk", "full", "tail"):
        (zl,) = leaves(z)
        loss, tok = sparsefuse.topk_kd_loss_from_logits(zl, ids, t, m, normalize=norm, return_per_token=True)
        (gz,) = grads(loss, [zl])
        assert tok[list(rows)].isnan().all() and gz[list(rows)].isnan().all(dim=1).all(), norm
        ps = leaves(h, w, b)
        loss, tok = sparsefuse.topk_kd_loss_from_hidden(ps[0], ps[1], ids, t, m, normalize=norm, lm_head_bias=ps[2],
                                                        chunk_size=4, return_per_token=True)
        gh = grads(loss, ps)[0]
        assert tok[list(rows)].isnan().all() and gh[list(rows)].isnan().all(dim=1).all(), norm


def vq(dev: str, dtypes) -> None:
    from sparsefuse.vq import quantize

    B, K, D = 37, 300, 77
    g = torch.Generator().manual_seed(0)
    for dt in dtypes:
        x = torch.randn(B, D, generator=g).to(dev, dt)
        cb = torch.randn(K, D, generator=g).to(dev)
        for cosine in (False, True):
            for precision in ("exact", "ieee", "fast") if dt == torch.float32 else ("exact",):
                xs, cbs = leaves(x, cb)
                codes, dist = sparsefuse.nearest_code(xs, cbs, cosine=cosine, precision=precision)
                grads(dist.sum(), [xs, cbs])
        (xq,) = leaves(x)
        out, loss = quantize(xq, codes, cb.to(dt), 0.5)
        grads(out.sum() + loss, [xq])
    from test_vq import make, restart_options

    for L in (None, 2):
        for semantics in ("laplace", "active"):
            for det in (False, True):  # most codes unused: restarts
                x, codes, *state = make(B, K, D, L=L, device=dev, used=K // 3)
                sparsefuse.vq_ema_update(x, codes, *state, **restart_options(semantics, 1.5, 2), deterministic=det,
                                         generator=torch.Generator(device=dev).manual_seed(1))
    # the restart of the multi-rank path (rows summed over ranks), called as one rank would
    cb, es = torch.randn(2, K, D, device=dev), torch.randn(2, K, D, device=dev)
    dead = (torch.rand(2, K, generator=g) < 0.3).to(dev, torch.int8)
    torch.ops.sparsefuse.vq_ema_restart(cb, es, torch.randn(2, K, D, device=dev), dead, 0.5)
    for model in (sparsefuse.VectorQuantizer(D, K, threshold=1.0, kmeans_init=True),
                  sparsefuse.ResidualVQ(2, D, K, deterministic=True)):
        model.to(dev).train()
        (xm,) = leaves(torch.randn(B, D, generator=g).to(dev))
        out, _, loss = model(xm)
        grads(out.sum() + loss, [xm])
    # out-of-range codes with the host check off: NaN rows, nothing read or written out of bounds
    sparsefuse.set_index_checks(False)
    x = torch.randn(B, D, generator=g).to(dev)
    codes = torch.randint(0, K, (B,), generator=g).to(dev)
    rows = [0, 2, 3, 4]
    codes[rows] = torch.tensor(BAD(K), device=dev)
    cb = torch.randn(K, D, generator=g).to(dev)
    (xq,) = leaves(x)
    out, loss = quantize(xq, codes, cb, 0.5)
    (gx,) = grads(out.sum() + loss, [xq])
    assert out[rows].isnan().all() and gx[rows].isnan().all() and loss.isnan()
    for det in (False, True):
        cs, es = torch.rand(K, device=dev), torch.randn(K, D, device=dev)
        sparsefuse.vq_ema_update(x, codes, cb.clone(), cs, es, deterministic=det)
        assert cs[[0, K - 1]].isnan().all() and es[[0, K - 1]].isnan().all(), det


def main(family: str, dev: str = "cuda", dtypes: str = "all") -> None:
    launched = set()

    def record(meta):
        launched.add(meta.data["name"])

    on_gpu = dev == "cuda"
    if on_gpu:
        triton.knobs.runtime.launch_enter_hook.add(record)
    floats = (torch.float32,) if dtypes == "float32" else (torch.float32, torch.bfloat16)
    {"sae": sae, "kd": kd, "vq": vq}[family](dev, floats)
    if on_gpu:
        torch.cuda.synchronize()
        missing = family_kernels(family) - launched
        assert not missing, f"kernels of {family} that no case launched: {sorted(missing)}"
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
