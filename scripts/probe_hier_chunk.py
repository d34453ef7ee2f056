"""Probe (GPU, session 8): are the hierarchical sweeps latency-bound, and does the F x D zero-fill's
HBM traffic matter? Times, in one process:

* the package's forward and atomic backward kernels (the baseline, gradient buffer zeroed by torch;
  when benchmarks/logs/probe_hier_chunk.json was recorded the package's backward still took one
  latent a step: it has since taken the chunked form below, so "base" now times that);
* chunked sweeps: each loop step gathers CHUNK latents of the row at once ([CHUNK, BLOCK_D] tile,
  CHUNK loads in flight instead of one) and resolves the recurrence inside the chunk with an
  in-thread tl.cumsum;
* the chunked backward that zeroes the gradient itself, one D-tile slice ahead of its use
  (ZERO_AHEAD): work items are taken from an atomic counter in (tile, row) order, each item zeroes
  its share of the next tile's slice and counts itself done; a tile's items wait until the previous
  tile's items have all counted. The slice is written just before the atomics reach it, so it should
  stay in L2: no DRAM zero-fill, and no DRAM read of zeros by the first atomic of each line.

    python scripts/probe_hier_chunk.py        (writes $OUT/probe_hier_chunk.json)
    TRITON_INTERPRET=1 python scripts/probe_hier_chunk.py --check   (CPU: correctness only)
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
def _fwd_chunk_kernel(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, etot_ptr, loss_ptr, B, K, D, F, stride_wf,
                      stride_wd, HAS_BIAS: tl.constexpr, ACC: tl.constexpr, BLOCK_D: tl.constexpr,
                      CHUNK: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_u = tl.arange(0, CHUNK)
    b_e = -tl.load(tgt_ptr + i_b * D + o_d, mask=m_d, other=0).to(ACC)
    if HAS_BIAS:
        b_e += tl.load(bias_ptr + o_d, mask=m_d, other=0).to(ACC)
    b_tot = tl.zeros([BLOCK_D], dtype=ACC)
    b_loss = tl.zeros([BLOCK_D], dtype=ACC)
    for i_k in range(0, K, CHUNK):
        o_k = i_k + o_u
        m_k = o_k < K
        i_f, ok, v, b_w = kn._load_latent_chunk(idx_ptr, vals_ptr, w_ptr, i_b, o_k, m_k, o_d, m_d, K, F, stride_wf,
                                                stride_wd, ACC)
        b_u = v[:, None] * b_w
        b_ec = tl.where(m_k[:, None], b_e[None, :] + tl.cumsum(b_u, axis=0), 0.0)  # e_k, k in the chunk
        b_loss += tl.sum(b_ec * b_ec, axis=0)
        b_tot += tl.sum(b_ec, axis=0)
        b_e += tl.sum(b_u, axis=0)
    tl.store(etot_ptr + i_b * D + o_d, b_tot, mask=m_d)
    tl.store(loss_ptr + i_t * B + i_b, tl.sum(tl.where(m_d, b_loss, 0.0), axis=0))


@triton.jit
def _bwd_chunk_kernel(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, etot_ptr, g_ptr, gw_ptr, gv_ptr, cnt_ptr, B, K, D,
                      F, stride_wf, stride_wd, HAS_BIAS: tl.constexpr, ZERO_AHEAD: tl.constexpr, ACC: tl.constexpr,
                      BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, ZROWS: tl.constexpr):
    if ZERO_AHEAD:
        # cnt_ptr: [T + 1] int32 zeroed; cnt[T] hands out work items in order, cnt[t] counts tile t-1's
        # items that have zeroed their share of tile t's slice
        n_tiles = tl.cdiv(D, BLOCK_D)
        i_item = tl.atomic_add(cnt_ptr + n_tiles, 1, sem="relaxed")
        i_t = i_item // B
        i_b = (i_item % B).to(tl.int64)
        if i_t + 1 < n_tiles:
            o_z = (i_t + 1) * BLOCK_D + tl.arange(0, BLOCK_D)
            for i_r in range(i_b * ZROWS, tl.minimum(i_b * ZROWS + ZROWS, F)):
                tl.store(gw_ptr + i_r * D + o_z, tl.zeros([BLOCK_D], dtype=ACC), mask=o_z < D)
            tl.debug_barrier()  # every thread's zeros before the count (the release orders one thread's)
            tl.atomic_add(cnt_ptr + i_t + 1, 1, sem="release")
        if i_t > 0:
            n_done = tl.atomic_add(cnt_ptr + i_t, 0, sem="acquire")
            while n_done < B:
                n_done = tl.atomic_add(cnt_ptr + i_t, 0, sem="acquire")
            tl.debug_barrier()
    else:
        i_b = tl.program_id(0).to(tl.int64)
        i_t = tl.program_id(1)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_u = tl.arange(0, CHUNK)
    gc = tl.load(g_ptr).to(ACC)
    b_s = tl.load(etot_ptr + i_b * D + o_d, mask=m_d, other=0) * gc  # S_j, j = i_k
    b_e = -tl.load(tgt_ptr + i_b * D + o_d, mask=m_d, other=0).to(ACC)
    if HAS_BIAS:
        b_e += tl.load(bias_ptr + o_d, mask=m_d, other=0).to(ACC)
    b_e *= gc  # e_{i_k - 1}
    for i_k in range(0, K, CHUNK):
        o_k = i_k + o_u
        m_k = o_k < K
        i_f, ok, v, b_w = kn._load_latent_chunk(idx_ptr, vals_ptr, w_ptr, i_b, o_k, m_k, o_d, m_d, K, F, stride_wf,
                                                stride_wd, ACC)
        b_u = (v * gc)[:, None] * b_w
        b_ec = tl.where(m_k[:, None], b_e[None, :] + tl.cumsum(b_u, axis=0), 0.0)  # e_j
        b_sc = b_s[None, :] - (tl.cumsum(b_ec, axis=0) - b_ec)  # S_j = S_{i_k} - sum_{i_k <= k < j} e_k
        b_dot = tl.where(ok, tl.sum(b_sc * b_w, axis=1), float("nan"))
        tl.atomic_add(gv_ptr + i_b * K + o_k, b_dot, mask=m_k, sem="relaxed")
        tl.atomic_add(gw_ptr + i_f[:, None] * D + o_d[None, :], v[:, None] * b_sc,
                      mask=(m_k & ok)[:, None] & m_d[None, :], sem="relaxed")
        b_e += tl.sum(b_u, axis=0)
        b_s -= tl.sum(b_ec, axis=0)


def run_fwd(idx, v, w, b, tg, BLOCK_D, CHUNK, num_warps=1):
    B, K = idx.shape
    F, D = w.shape
    etot = torch.empty(B, D, device=w.device)
    grid = (B, triton.cdiv(D, BLOCK_D))
    rl = torch.empty(grid[1], B, device=w.device)
    _fwd_chunk_kernel[grid](idx, v, w, b, tg, etot, rl, B, K, D, F, D, 1, HAS_BIAS=True, ACC=tl.float32,
                            BLOCK_D=BLOCK_D, CHUNK=CHUNK, num_warps=num_warps)
    return rl.sum() / (B * K * D), etot


def bwd_chunk(idx, v, w, b, tg, etot, gc, gw, gv, cnt, BLOCK_D, CHUNK, zero_ahead, num_warps=1):
    B, K = idx.shape
    F, D = w.shape
    n_t = triton.cdiv(D, BLOCK_D)
    if zero_ahead:
        cnt.zero_()
        gw[:, :BLOCK_D].zero_()
        grid = (B * n_t,)
    else:
        gw.zero_()
        grid = (B, n_t)
    gv.zero_()
    _bwd_chunk_kernel[grid](idx, v, w, b, tg, etot, gc, gw, gv, cnt, B, K, D, F, D, 1, HAS_BIAS=True,
                            ZERO_AHEAD=zero_ahead, ACC=tl.float32, BLOCK_D=BLOCK_D, CHUNK=CHUNK,
                            ZROWS=triton.cdiv(F, B), num_warps=num_warps)


def bwd_base(idx, v, w, b, tg, etot, gc, gw, gv):
    B, K = idx.shape
    F, D = w.shape
    gw.zero_()
    gv.zero_()
    cfg = kn._hier_config(D, 4, backward=True)
    kn._hierarchical_sae_bwd_kernel[kn._hier_grid(B, D, cfg)](
        idx, v, w, b, tg, etot, gc, gw, gv, None, 1, B, K, D, F, D, 1, 0, D, HAS_BIAS=True, WEIGHT_GRAD=1,
        STAGED_GV=False, FUSED=False, ACC=tl.float32, **cfg)


def fwd_base(idx, v, w, b, tg):
    B, K = idx.shape
    F, D = w.shape
    cfg = kn._hier_config(D, 4, backward=False)
    grid = kn._hier_grid(B, D, cfg)
    etot = torch.empty(B, D, device=w.device)
    rl = torch.empty(grid[1], B, device=w.device)
    kn._hierarchical_sae_fwd_kernel[grid](idx, v, w, b, tg, etot, rl, B * K * D, B, K, D, F, D, 1, HAS_BIAS=True,
                                          ACC=tl.float32, **cfg)
    return rl.sum(), etot


def check(device, B, K, F, D, BLOCK_D, CHUNK):
    """Chunked forward and both chunked backwards against the float64 reference."""
    from sparsefuse.bench.sae import make_inputs
    idx, w, v, b, tg = make_inputs(B, K, F, D, torch.float32, device, seed=1)
    loss, etot = run_fwd(idx, v, w, b, tg, BLOCK_D, CHUNK)
    w64, v64, b64, t64 = (x.double().requires_grad_() for x in (w, v, b, tg))
    want = ref.hierarchical_sae_loss(idx, w64, v64, b64, t64)
    gw_ref, gv_ref = torch.autograd.grad(want * 1.5, (w64, v64))
    errs = dict(loss=abs(loss.item() - want.item()) / abs(want.item()))
    _, etot_ref = ref.hierarchical_sae_loss_fwd(idx, w64, v64, b64, t64)
    errs["etot"] = ((etot.double() - etot_ref).norm() / etot_ref.norm()).item()
    gc = torch.tensor(1.5 * 2.0 / (B * K * D), device=device)
    n_t = triton.cdiv(D, BLOCK_D)
    for za in (False, True):
        gw = torch.full((F, D), float("nan"), device=device)
        gv = torch.empty(B, K, device=device)
        cnt = torch.empty(n_t + 1, dtype=torch.int32, device=device)
        bwd_chunk(idx, v, w, b, tg, etot, gc, gw, gv, cnt, BLOCK_D, CHUNK, za)
        errs[f"gw za={za}"] = ((gw.double() - gw_ref).norm() / gw_ref.norm()).item()
        errs[f"gv za={za}"] = ((gv.double() - gv_ref).norm() / gv_ref.norm()).item()
    return errs


def main():
    if "--check" in sys.argv:
        for shape in ((5, 7, 11, 40, 16, 4), (3, 3, 5, 33, 16, 2), (6, 5, 8, 20, 16, 8)):
            errs = check("cpu", *shape)
            print(shape, {k: f"{e:.1e}" for k, e in errs.items()})
            assert max(errs.values()) < 1e-5, errs
        return
    from triton.testing import do_bench
    from sparsefuse.bench.sae import make_inputs
    B, F, D = 4096, 65536, 2304
    props = torch.cuda.get_device_properties(0)
    out = dict(device=torch.cuda.get_device_name(), l2_mb=props.L2_cache_size / 2**20, sms=props.multi_processor_count,
               check={}, ms={})
    print(out, flush=True)
    for shape in ((37, 50, 64, 100, 64, 8), (512, 128, 4096, 2304, 64, 8), (512, 64, 4096, 300, 32, 4)):
        out["check"][str(shape)] = errs = check("cuda", *shape)
        print("check", shape, {k: f"{e:.1e}" for k, e in errs.items()}, flush=True)

    def t(name, fn):
        fn()
        torch.cuda.synchronize()
        out["ms"][name] = ms = do_bench(fn, warmup=25, rep=100)
        print(f"{name:44s} {ms:.3f} ms", flush=True)

    for K in (32, 64, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, torch.float32, "cuda")
        gw = torch.zeros(F, D, device="cuda")
        gv = torch.zeros(B, K, device="cuda")
        gc = torch.tensor(2.0 / (B * K * D), device="cuda")
        _, etot = fwd_base(idx, v, w, b, tg)
        t(f"K={K} fwd base", lambda: fwd_base(idx, v, w, b, tg))
        for BD, CH, nw in ((64, 4, 1), (64, 8, 1), (64, 16, 1), (128, 4, 1), (128, 8, 1), (32, 8, 1), (32, 16, 1),
                           (128, 4, 2), (64, 8, 2)):
            t(f"K={K} fwd chunk BD={BD} CH={CH} nw={nw}", lambda: run_fwd(idx, v, w, b, tg, BD, CH, nw))
        t(f"K={K} zero+bwd base", lambda: bwd_base(idx, v, w, b, tg, etot, gc, gw, gv))
        for BD, CH, nw in ((64, 2, 1), (64, 4, 1), (64, 8, 1), (64, 16, 1), (32, 8, 1), (128, 4, 1), (128, 8, 1), (64, 8, 2)):
            for za in (False, True):
                cnt = torch.zeros(triton.cdiv(D, BD) + 1, dtype=torch.int32, device="cuda")
                t(f"K={K} zero+bwd chunk BD={BD} CH={CH} nw={nw} za={int(za)}",
                  lambda: bwd_chunk(idx, v, w, b, tg, etot, gc, gw, gv, cnt, BD, CH, za, nw))
        t(f"K={K} zero only", lambda: gw.zero_())
        del gw
        torch.cuda.empty_cache()
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_hier_chunk.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
