"""Probe (GPU, session 32): is a TMA bulk reduce-add (``cp.reduce.async.bulk.tensor ... .add``,
Triton's ``tensor_descriptor.atomic_add``) a cheaper way to scatter the hierarchical weight gradient
than per-thread ``red.global.add.v4.f32``?

The hierarchical backward's floor is its gather plus the scatter of B * K distinct gradient rows into
an F x D fp32 buffer (sessions 6, 9, 29, 30: about 0.92 ms at K = 64 and 1.84 at K = 128 on an
H200, of which the gather alone is about 0.3 / 0.58). Every earlier design moved those rows with
per-thread atomics; a TMA reduce moves a whole [1, BLOCK_D] row slice as one bulk operation that the
L2 applies. These kernels keep the package backward's grid (rows fast, D tiles slow, one warp) and
its gather, and differ only in how each gathered row goes back:

* ``gather``: no scatter (one float stored a program so the loads stay live);
* ``atomic``: a [CHUNK, BLOCK_D] tile of ``tl.atomic_add``, as the package backward does;
* ``tma``: one latent a step, its row slice scaled and reduce-added through a [1, BLOCK_D] descriptor.

No scans: the row added is v * w, so the result is checkable (gw = scatter of v * w).

``--hier`` then times ``_hier_tma_kernel``, the package's fp32 atomic backward rebuilt around the bulk
reduce (one latent a step, no scans), against the package's kernel, zero-fill included in both, after
checking that the two agree at the benchmark shape.

Outcome (one H200, benchmarks/logs/probe_tma_{scatter,hier}_session32_h200.json): the bare scatter
is 4-8% cheaper through TMA (K = 64: 1.098 against 1.148 ms; K = 128: 2.018 against 2.181), but
the backward built on it is slower than the package's at K = 64 and 128 with gv summed either way
(second run, K = 64: 1.267-1.328 against 1.245 ms; K = 128: 2.343-2.394 against 2.213). With gv dropped (a wrong
result, timing only) it gains 2.6% / 6%, which bounds any TMA version of this sweep. Not built.

    python scripts/probe_tma_scatter.py            (GPU; writes $OUT/probe_tma_scatter.json, then --hier's)
    python scripts/probe_tma_scatter.py --hier     (GPU; only the backward comparison: $OUT/probe_tma_hier.json)
    python scripts/probe_tma_scatter.py --ptx      (any machine, no TRITON_INTERPRET: the sm_90 PTX's bulk ops)
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kernel(idx_ptr, vals_ptr, w_ptr, out_ptr, B, K, D, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i_k in range(0, K, CHUNK):
        o_k = i_k + tl.arange(0, CHUNK)
        m_k = o_k < K
        i_f = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)
        v = tl.load(vals_ptr + i_b * K + o_k, mask=m_k, other=0)
        b_w = tl.load(w_ptr + i_f[:, None] * D + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0)
        acc += tl.sum(v[:, None] * b_w, axis=0)
    tl.store(out_ptr + i_b * D + o_d, acc, mask=m_d)


@triton.jit
def _atomic_kernel(idx_ptr, vals_ptr, w_ptr, gw_ptr, B, K, D, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_d = tl.max_contiguous(i_t * BLOCK_D + tl.arange(0, BLOCK_D), 4)
    m_d = o_d < D
    for i_k in range(0, K, CHUNK):
        o_k = i_k + tl.arange(0, CHUNK)
        m_k = o_k < K
        i_f = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)
        v = tl.load(vals_ptr + i_b * K + o_k, mask=m_k, other=0)
        m_kd = m_k[:, None] & m_d[None, :]
        b_w = tl.load(w_ptr + i_f[:, None] * D + o_d[None, :], mask=m_kd, other=0)
        tl.atomic_add(gw_ptr + i_f[:, None] * D + o_d[None, :], v[:, None] * b_w, mask=m_kd, sem="relaxed")


@triton.jit
def _tma_kernel(idx_ptr, vals_ptr, w_ptr, gw_desc, B, K, D, BLOCK_D: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    for i_k in range(0, K):
        i_f = tl.load(idx_ptr + i_b * K + i_k).to(tl.int64)
        v = tl.load(vals_ptr + i_b * K + i_k)
        b_w = tl.load(w_ptr + i_f * D + o_d, mask=m_d, other=0)
        gw_desc.atomic_add([i_f.to(tl.int32), i_t * BLOCK_D], (v * b_w)[None, :])


@triton.jit
def _tma_chunk_kernel(idx_ptr, vals_ptr, w_ptr, gw_desc, B, K, D, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """CHUNK rows' loads issued together (a [CHUNK, BLOCK_D] tile), then CHUNK bulk reduces, each of one
    row picked out of the tile with a masked sum (the row ids are scalars reloaded from memory)."""
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    for i_k in range(0, K, CHUNK):
        o_k = i_k + tl.arange(0, CHUNK)
        m_k = o_k < K
        i_f = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)
        v = tl.load(vals_ptr + i_b * K + o_k, mask=m_k, other=0)
        b_g = v[:, None] * tl.load(w_ptr + i_f[:, None] * D + o_d[None, :], mask=m_k[:, None] & m_d[None, :], other=0)
        for j in tl.static_range(CHUNK):
            row = tl.sum(tl.where((tl.arange(0, CHUNK) == j)[:, None], b_g, 0.0), axis=0)
            f = tl.load(idx_ptr + i_b * K + i_k + j, mask=i_k + j < K, other=0)
            if i_k + j < K:
                gw_desc.atomic_add([f.to(tl.int32), i_t * BLOCK_D], row[None, :])


@triton.jit
def _hier_tma_kernel(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, etot_ptr, g_ptr, gw_desc, gv_ptr, B, K, D, F,
                     stride_wf, stride_wd, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
                     GV: tl.constexpr = 0, BLOCK_K: tl.constexpr = 16):
    """The package's fp32 atomic hierarchical backward (WEIGHT_GRAD 1, atomic gv), one latent a step
    with no scans: e_k = e_{k-1} + v_k w_k, the gradient rows use S_k = sum_{j>=k} e_j, then
    S_{k+1} = S_k - e_k. Each gradient row slice goes back as one TMA bulk reduce-add. PREFETCH loads
    latent k + 1's row before latent k's arithmetic (two gathers in flight a program). GV 0: a scalar
    atomic a latent; 1: gv kept in a [BLOCK_K] register vector, one vector atomic at the end; 2: none
    (timing only)."""
    o_kk = tl.arange(0, BLOCK_K)
    b_gv = tl.zeros([BLOCK_K], dtype=tl.float32)
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    gc = tl.load(g_ptr)
    b_off = -tl.load(tgt_ptr + i_b * D + o_d, mask=m_d, other=0)
    if HAS_BIAS:
        b_off += tl.load(bias_ptr + o_d, mask=m_d, other=0)
    b_e = b_off * gc
    b_s = tl.load(etot_ptr + i_b * D + o_d, mask=m_d, other=0) * gc
    f = tl.load(idx_ptr + i_b * K).to(tl.int64)
    ok = (f >= 0) & (f < F)
    b_w = tl.load(w_ptr + f * stride_wf + o_d * stride_wd, mask=m_d & ok, other=0)
    for i_k in range(0, K):
        v = tl.load(vals_ptr + i_b * K + i_k)
        v = tl.where(ok, v, float("nan"))
        if PREFETCH:
            m_n = i_k + 1 < K
            f_n = tl.load(idx_ptr + i_b * K + i_k + 1, mask=m_n, other=0).to(tl.int64)
            ok_n = (f_n >= 0) & (f_n < F)
            b_w_n = tl.load(w_ptr + f_n * stride_wf + o_d * stride_wd, mask=m_d & ok_n & m_n, other=0)
        b_e += (v * gc) * b_w
        if GV == 0:
            tl.atomic_add(gv_ptr + i_b * K + i_k, tl.where(ok, tl.sum(b_s * b_w, axis=0), float("nan")), sem="relaxed")
        elif GV == 1:
            b_gv = tl.where(o_kk == i_k, tl.where(ok, tl.sum(b_s * b_w, axis=0), float("nan")), b_gv)
        if ok:
            gw_desc.atomic_add([f.to(tl.int32), i_t * BLOCK_D], (v * b_s)[None, :])
        b_s -= b_e
        if PREFETCH:
            f, ok, b_w = f_n, ok_n, b_w_n
        else:
            f = tl.load(idx_ptr + i_b * K + i_k + 1, mask=i_k + 1 < K, other=0).to(tl.int64)
            ok = (f >= 0) & (f < F)
            b_w = tl.load(w_ptr + f * stride_wf + o_d * stride_wd, mask=m_d & ok & (i_k + 1 < K), other=0)
    if GV == 1:
        tl.atomic_add(gv_ptr + i_b * K + o_kk, b_gv, mask=o_kk < K, sem="relaxed")


def _ptx():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = _tma_kernel
    sig = dict(idx_ptr="*i64", vals_ptr="*fp32", w_ptr="*fp32", gw_desc="tensordesc<fp32[1, 64]>", B="i32", K="i32",
               D="i32", BLOCK_D="constexpr")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index("BLOCK_D"),): 64})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    lines = [ln.strip() for ln in k.asm["ptx"].splitlines() if "bulk" in ln or "fence" in ln]
    print("\n".join(lines))


def _hier(do_bench, TensorDescriptor):
    """The TMA hierarchical backward against the package's (zero-fill included in both)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from probe_zero_ahead import bwd_base
    from sparsefuse.bench.sae import make_inputs
    from sparsefuse.sae import kernels as kn
    B, F, D = 4096, 65536, 2304
    out = {}
    for K in (32, 64, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, torch.float32, "cuda")
        gw = torch.zeros(F, D, device="cuda")
        gv = torch.zeros(B, K, device="cuda")
        gc = torch.tensor(2.0 / (B * K * D), device="cuda")
        _, etot = kn.hierarchical_loss_fwd(idx, w, v, b, tg)

        def tma(bd, pre, gvm=0):
            gw.zero_()
            gv.zero_()
            desc = TensorDescriptor.from_tensor(gw, [1, bd])
            _hier_tma_kernel[(B, triton.cdiv(D, bd))](idx, v, w, b, tg, etot, gc, desc, gv, B, K, D, F, D, 1,
                                                       HAS_BIAS=True, BLOCK_D=bd, PREFETCH=pre, GV=gvm,
                                                       BLOCK_K=triton.next_power_of_2(K), num_warps=1)

        bwd_base(idx, v, w, b, tg, etot, gc, gw, gv, 64)
        gw0, gv0 = gw.clone(), gv.clone()
        for bd, pre, gvm in ((64, True, 1),):
            gw.fill_(float("nan"))
            tma(bd, pre, gvm)
            torch.cuda.synchronize()
            out[f"K={K} check bd={bd} pre={int(pre)}"] = e = dict(
                gw=((gw - gw0).norm() / gw0.norm()).item(), gv=((gv - gv0).norm() / gv0.norm()).item())
            print("agree", K, bd, pre, e, flush=True)
        del gw0, gv0
        for bd in (64,):
            out[f"K={K} zero+bwd base bd={bd}"] = ms = do_bench(
                lambda: bwd_base(idx, v, w, b, tg, etot, gc, gw, gv, bd), warmup=25, rep=200)
            print(K, "base", bd, ms, flush=True)
        for bd, pre, gvm in ((64, True, 0), (64, True, 1), (64, True, 2)):
            out[f"K={K} zero+bwd tma bd={bd} pre={int(pre)} gv={gvm}"] = ms = do_bench(lambda: tma(bd, pre, gvm),
                                                                                      warmup=25, rep=200)
            print(K, "tma", bd, pre, gvm, ms, flush=True)
        del gw
        torch.cuda.empty_cache()
    return out


def main():
    if "--hier" in sys.argv:
        from triton.testing import do_bench
        from triton.tools.tensor_descriptor import TensorDescriptor
        out = _hier(do_bench, TensorDescriptor)
        with open(os.path.join(os.environ.get("OUT", "."), "probe_tma_hier.json"), "w") as fh:
            json.dump(out, fh, indent=1)
        return
    if "--ptx" in sys.argv:
        return _ptx()
    from triton.testing import do_bench
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = "cuda"
    F, D, B = 65536, 2304, 4096
    BD, CHUNK = 64, 8
    torch.manual_seed(0)
    w = torch.randn(F, D, device=dev)
    gw = torch.zeros(F, D, device=dev)
    out = torch.empty(B, D, device=dev)
    res = dict(device=torch.cuda.get_device_name(), F=F, D=D, B=B, BLOCK_D=BD, CHUNK=CHUNK, rows={})
    T = triton.cdiv(D, BD)
    for K in (64, 128):
        idx = torch.rand(B, F, device=dev).topk(K, dim=1).indices
        vals = torch.rand(B, K, device=dev)
        desc = TensorDescriptor.from_tensor(gw, [1, BD])
        want = torch.zeros(F, D, device=dev).index_add_(0, idx.flatten(), (vals.flatten()[:, None] * w[idx.flatten()]))
        runs = {
            "zero_fill": lambda: gw.zero_(),
            "gather": lambda: _gather_kernel[(B, T)](idx, vals, w, out, B, K, D, BLOCK_D=BD, CHUNK=CHUNK, num_warps=1),
            "atomic": lambda: _atomic_kernel[(B, T)](idx, vals, w, gw, B, K, D, BLOCK_D=BD, CHUNK=CHUNK, num_warps=1),
            "tma": lambda: _tma_kernel[(B, T)](idx, vals, w, desc, B, K, D, BLOCK_D=BD, num_warps=1),
            "tma_chunk": lambda: _tma_chunk_kernel[(B, T)](idx, vals, w, desc, B, K, D, BLOCK_D=BD, CHUNK=CHUNK,
                                                           num_warps=1),
        }
        row = {}
        for name, fn in runs.items():
            if name in ("atomic", "tma", "tma_chunk"):
                gw.zero_()
                fn()
                torch.cuda.synchronize()
                err = ((gw - want).abs().max() / want.abs().max()).item()
                row[name + "_relerr"] = err
            row[name + "_ms"] = do_bench(fn, warmup=50, rep=300)
            print(K, name, row[name + "_ms"], row.get(name + "_relerr"), flush=True)
        res["rows"][K] = row
    res["hier"] = _hier(do_bench, TensorDescriptor)
    path = os.path.join(os.environ.get("OUT", "."), "probe_tma_scatter.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
