"""Probe (GPU, session 31): can the fp32 hierarchical backward zero its own gradient, slice by slice,
cheaply enough to drop the F x D zero-fill?

Session 8 tried this (``scripts/probe_hier_chunk.py``, ZERO_AHEAD) and was 0.4-1.0 ms slower: every
(row, D tile) item took its place from one atomic counter and counted its zeroing on another, so
about 2 x 147k same-address atomics sat on the critical path, and tile t's items waited for the last
of tile t - 1's. Here:

* a claim covers ROWS rows of one D tile, so the counter sees B * T / ROWS atomics;
* only NZ claims of tile t (starting at its Z0-th) zero slice t + 1 of the gradient, and count
  once each; every claim of tile t + 1 checks that count with one acquire load and spins only if
  the zeroing is not done;
* claims are taken in (tile, row) order from the counter, so a claim waits only on claims taken
  before it, which are running: no deadlock whatever the residency.

The zeros are written into L2 shortly before that slice's atomics arrive, so the first atomic of a
line finds it there instead of fetching a zero from DRAM, and the 0.13 ms fill goes away. Slice 0 is
zeroed by a strided fill before the launch.

Outcome (one H100, benchmarks/logs/probe_zero_ahead_*_session31_h100.*): slower than zero-fill plus
backward in every configuration. ROWS > 1 puts ROWS tiles' worth of rows in flight and breaks the
shared-slice L2 plan (5.2 against 2.9 ms at K = 128); with ROWS = 1 the claim counter costs what
session 8 saw. STATIC (block index as the claim, relying on in-order dispatch) with ASM acquire
loads came closest and still lost 0.22-0.23 ms. The first run timed ROWS in {1, 8, 16, 32} through the
counter; this file's loop is the second run's (STATIC, ASM, NZ, Z0).

    python scripts/probe_zero_ahead.py                              (GPU; writes $OUT/probe_zero_ahead.json)
    TRITON_INTERPRET=1 python scripts/probe_zero_ahead.py --check   (CPU: correctness only)
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

from sparsefuse.sae import kernels as kn
from sparsefuse.sae import reference as ref


@triton.jit
def _row_sweep(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, etot_ptr, gc, gw_ptr, gv_ptr, i_b, i_t, B, K, D, F,
               stride_wf, stride_wd, HAS_BIAS: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr,
               CHUNK: tl.constexpr, VEC: tl.constexpr):
    """The package backward's sweep (WEIGHT_GRAD 1, atomic gv) for row i_b, D tile i_t."""
    o_b = i_b + tl.arange(0, 1)
    o_d = tl.max_contiguous(i_t * BLOCK_D + tl.arange(0, BLOCK_D), VEC)
    m_b, m_d = o_b < B, o_d < D
    m_bd = m_b[:, None] & m_d[None, :]
    b_off = kn._hierarchical_offset(tgt_ptr, bias_ptr, o_b, o_d, m_bd, m_d, D, HAS_BIAS, ACC)
    b_s = tl.load(etot_ptr + o_b[:, None] * D + o_d[None, :], mask=m_bd, other=0) * gc
    b_s = tl.sum(b_s, axis=0)
    b_e = tl.sum(b_off, axis=0) * gc
    for i_k in range(0, K, CHUNK):
        o_k = i_k + tl.arange(0, CHUNK)
        m_k = o_k < K
        i_f, ok, v, b_w = kn._load_latent_chunk(idx_ptr, vals_ptr, w_ptr, i_b, o_k, m_k, o_d, m_d, K, F, stride_wf,
                                                stride_wd, ACC)
        b_u = (v * gc)[:, None] * b_w
        b_ec = tl.where(m_k[:, None], b_e[None, :] + tl.cumsum(b_u, axis=0), 0.0)
        b_sc = b_s[None, :] - (tl.cumsum(b_ec, axis=0) - b_ec)
        b_dot = tl.where(ok, tl.sum(b_sc * b_w, axis=1), float("nan"))
        tl.atomic_add(gv_ptr + i_b * K + o_k, b_dot, mask=m_k, sem="relaxed")
        m_kd = m_k[:, None] & m_d[None, :]
        tl.atomic_add(gw_ptr + i_f[:, None] * D + o_d[None, :], v[:, None] * b_sc, mask=m_kd & ok[:, None],
                      sem="relaxed")
        b_e += tl.sum(b_u, axis=0)
        b_s -= tl.sum(b_ec, axis=0)


@triton.jit
def _load_acquire(ptr, ASM: tl.constexpr):
    """An acquire load: ld.acquire.gpu with ASM (no read-modify-write, so loads of one counter by many
    programs do not serialise in L2), else an atomic add of 0 (the interpreter has no inline asm)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _bwd_zero_ahead_kernel(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, etot_ptr, g_ptr, gw_ptr, gv_ptr, cnt_ptr,
                           B, K, D, F, stride_wf, stride_wd, NB, N_TILES, HAS_BIAS: tl.constexpr,
                           ACC: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr,
                           ROWS: tl.constexpr, NZ: tl.constexpr, Z0, ZB: tl.constexpr, STATIC: tl.constexpr = False,
                           ASM: tl.constexpr = False):
    # cnt_ptr: [N_TILES + 1] int32, zeroed. cnt[N_TILES] hands out claims in (tile, row block) order;
    # cnt[t] counts the claims of tile t - 1 that have zeroed their share of slice t.
    if STATIC:  # block order as the claim: relies on blocks being dispatched in index order
        claim = tl.program_id(0)
    else:
        claim = tl.atomic_add(cnt_ptr + N_TILES, 1, sem="relaxed")
    i_t = claim // NB
    i_blk = claim % NB
    i_z = i_blk - Z0
    if (i_t + 1 < N_TILES) & (i_z >= 0) & (i_z < NZ):
        per = tl.cdiv(tl.cdiv(F, NZ), ZB) * ZB
        o_z = (i_t + 1) * BLOCK_D + tl.arange(0, BLOCK_D)
        r_end = tl.minimum(i_z * per + per, F)
        for r0 in range(i_z * per, r_end, ZB):
            o_r = (r0 + tl.arange(0, ZB)).to(tl.int64)
            tl.store(gw_ptr + o_r[:, None] * D + o_z[None, :], tl.zeros([ZB, BLOCK_D], dtype=ACC),
                     mask=(o_r < r_end)[:, None] & (o_z < D)[None, :])
        tl.debug_barrier()  # every thread's zeros before the count
        tl.atomic_add(cnt_ptr + i_t + 1, 1, sem="release")
    if i_t > 0:
        n_done = _load_acquire(cnt_ptr + i_t, ASM)
        while n_done < NZ:
            n_done = _load_acquire(cnt_ptr + i_t, ASM)
        tl.debug_barrier()
    gc = tl.load(g_ptr).to(ACC)
    b0 = (i_blk * ROWS).to(tl.int64)
    for i_b in range(b0, tl.minimum(b0 + ROWS, B)):
        _row_sweep(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, etot_ptr, gc, gw_ptr, gv_ptr, i_b, i_t,
                   B, K, D, F, stride_wf, stride_wd, HAS_BIAS, ACC, BLOCK_D, CHUNK, VEC)


def bwd_base(idx, v, w, b, tg, etot, gc, gw, gv, block_d):
    """What the package does: zero-fill, then the atomic backward."""
    B, K = idx.shape
    F, D = w.shape
    gw.zero_()
    gv.zero_()
    cfg = dict(kn._hier_config(D, 4, backward=True), BLOCK_D=block_d)
    kn._hierarchical_sae_bwd_kernel[kn._hier_grid(B, D, cfg)](
        idx, v, w, b, tg, etot, gc, gw, gv, None, 1, B, K, D, F, D, 1, 0, D, HAS_BIAS=True, WEIGHT_GRAD=1,
        STAGED_GV=False, FUSED=False, ACC=tl.float32, **cfg)


def bwd_zero_ahead(idx, v, w, b, tg, etot, gc, gw, gv, cnt, block_d, rows, nz, z0_frac, zb=16, static=False,
                   asm=False):
    B, K = idx.shape
    F, D = w.shape
    cfg = dict(kn._hier_config(D, 4, backward=True), BLOCK_D=block_d)
    n_t = triton.cdiv(D, block_d)
    nb = triton.cdiv(B, rows)
    nz = min(nz, nb)
    z0 = min(int(z0_frac * nb), nb - nz)
    cnt.zero_()
    gw[:, :block_d].zero_()
    gv.zero_()
    _bwd_zero_ahead_kernel[(nb * n_t,)](
        idx, v, w, b, tg, etot, gc, gw, gv, cnt, B, K, D, F, D, 1, nb, n_t, HAS_BIAS=True, ACC=tl.float32,
        BLOCK_D=block_d, CHUNK=cfg["CHUNK"], VEC=cfg["VEC"], ROWS=rows, NZ=nz, Z0=z0, ZB=zb, STATIC=static, ASM=asm,
        num_warps=1)


def check(device, B, K, F, D, block_d, rows, nz, z0_frac, static=False, asm=False):
    from sparsefuse.bench.sae import make_inputs
    idx, w, v, b, tg = make_inputs(B, K, F, D, torch.float32, device, seed=1)
    w64, v64, b64, t64 = (x.double().requires_grad_() for x in (w, v, b, tg))
    want = ref.hierarchical_sae_loss(idx, w64, v64, b64, t64)
    gw_ref, gv_ref = torch.autograd.grad(want * 1.5, (w64, v64))
    _, etot = kn.hierarchical_loss_fwd(idx, w, v, b, tg)
    gc = torch.tensor(1.5 * 2.0 / (B * K * D), device=device)
    gw = torch.full((F, D), float("nan"), device=device)
    gv = torch.empty(B, K, device=device)
    cnt = torch.empty(triton.cdiv(D, block_d) + 1, dtype=torch.int32, device=device)
    bwd_zero_ahead(idx, v, w, b, tg, etot, gc, gw, gv, cnt, block_d, rows, nz, z0_frac, zb=4, static=static, asm=asm)
    return dict(gw=((gw.double() - gw_ref).norm() / gw_ref.norm()).item(),
                gv=((gv.double() - gv_ref).norm() / gv_ref.norm()).item())


def main():
    if "--check" in sys.argv:
        for shape in ((5, 7, 11, 40, 16, 2, 2, 0.0), (3, 3, 5, 33, 16, 1, 3, 0.5), (6, 5, 8, 20, 16, 4, 1, 1.0),
                      (9, 4, 37, 50, 16, 2, 4, 0.3)):
            errs = check("cpu", *shape)
            print(shape, {k: f"{e:.1e}" for k, e in errs.items()})
            assert max(errs.values()) < 1e-5, errs
        return
    from triton.testing import do_bench
    from sparsefuse.bench.sae import make_inputs
    B, F, D = 4096, 65536, 2304
    props = torch.cuda.get_device_properties(0)
    out = dict(device=torch.cuda.get_device_name(), l2_mb=props.L2_cache_size / 2**20,
               sms=props.multi_processor_count, check={}, ms={})
    print(out, flush=True)
    for shape in ((37, 50, 64, 100, 32, 4, 2, 0.5), (512, 128, 4096, 2304, 64, 8, 16, 0.2),
                  (512, 64, 4096, 300, 32, 1, 8, 0.0)):
        out["check"][str(shape)] = errs = check("cuda", *shape, static=True, asm=True)
        print("check", shape, {k: f"{e:.1e}" for k, e in errs.items()}, flush=True)
        assert max(errs.values()) < 1e-5, errs

    def t(name, fn):
        fn()
        torch.cuda.synchronize()
        out["ms"][name] = ms = do_bench(fn, warmup=25, rep=100)
        print(f"{name:52s} {ms:.3f} ms", flush=True)

    for K in (32, 64, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, torch.float32, "cuda")
        gw = torch.zeros(F, D, device="cuda")
        gv = torch.zeros(B, K, device="cuda")
        gc = torch.tensor(2.0 / (B * K * D), device="cuda")
        _, etot = kn.hierarchical_loss_fwd(idx, w, v, b, tg)
        cnt = torch.zeros(D + 1, dtype=torch.int32, device="cuda")
        t(f"K={K} zero only", lambda: gw.zero_())
        for bd in (64, 32):
            t(f"K={K} BD={bd} zero+bwd base", lambda: bwd_base(idx, v, w, b, tg, etot, gc, gw, gv, bd))
            for static, asm in ((False, False), (False, True), (True, True)):
                for nz, z0 in ((64, 0.0), (64, 0.5), (256, 0.0)):
                    t(f"K={K} BD={bd} zero-ahead static={int(static)} asm={int(asm)} nz={nz} z0={z0}",
                      lambda: bwd_zero_ahead(idx, v, w, b, tg, etot, gc, gw, gv, cnt, bd, 1, nz, z0, static=static,
                                             asm=asm))
        # the two paths agree at the benchmark shape
        bwd_base(idx, v, w, b, tg, etot, gc, gw, gv, 64)
        gw0, gv0 = gw.clone(), gv.clone()
        gw.fill_(float("nan"))
        bwd_zero_ahead(idx, v, w, b, tg, etot, gc, gw, gv, cnt, 64, 1, 64, 0.5, static=True, asm=True)
        out["check"][f"K={K} bench"] = e = dict(gw=((gw - gw0).norm() / gw0.norm()).item(),
                                               gv=((gv - gv0).norm() / gv0.norm()).item())
        print("agree", K, e, flush=True)
        del gw, gw0
        torch.cuda.empty_cache()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_zero_ahead.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
