"""Would a single-gather hierarchical step reach the issue's targets (fp32, 1.07 / 2.10 ms at K = 64 / 128)?

Today's step gathers the B*K decoder rows twice (forward sweep, then the backward's sweep, which
also scatters B*K distinct gradient rows with fp32 atomics). A step that gathers once must hold a
row's whole [K, BLOCK_D] tile on chip: the gradient of latent j needs E_j = sum_{k >= j} e_k, known
only after the last latent. This probe times that kernel alone, with no library plumbing:

    one program per (row, D tile), row fast; load the [K, BLOCK_D] tile of the row's decoder rows;
    e = (bias - target) + cumsum(v w) (prefix errors); loss partial = sum e^2; E = sum(e) - cumsum(e) + e;
    gv_j += <E_j, w_j> (atomics across tiles); gw[idx_j] += v_j E_j (fp32 atomics, unscaled by g c).

A library step built on it would add the zero-fill of the F x D buffer (timed with the kernel
here), the loss and gv reductions and the bias gradient (~0.02 ms), and, only when the incoming
gradient is not 1, a scale pass over F x D (~0.3 ms). Compared in the same run with today's step
and today's two-sweep fused forward.

    python scripts/probe_hier_onegather.py OUT.json      # GPU
    TRITON_INTERPRET=1 python scripts/probe_hier_onegather.py --check   # CPU: the kernel against float64
    python scripts/probe_hier_onegather.py --sm90   # any machine: layout, shuffles, registers per tile shape
"""
import json
import sys

import torch
import triton
import triton.language as tl

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn
from sparsefuse.sae import reference


@triton.jit
def _onegather_kernel(idx_ptr, vals_ptr, w_ptr, bias_ptr, tgt_ptr, gw_ptr, gv_ptr, loss_ptr, etot_ptr,
                      B, K, D, stride_wf, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    i_f = tl.load(idx_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.int64)
    v = tl.load(vals_ptr + i_b * K + o_k, mask=m_k, other=0).to(tl.float32)
    m_kd = m_k[:, None] & m_d[None, :]
    b_w = tl.load(w_ptr + i_f[:, None] * stride_wf + o_d[None, :], mask=m_kd, other=0).to(tl.float32)
    off = tl.load(bias_ptr + o_d, mask=m_d, other=0).to(tl.float32) - tl.load(tgt_ptr + i_b * D + o_d, mask=m_d,
                                                                               other=0).to(tl.float32)
    b_e = tl.where(m_kd, off[None, :] + tl.cumsum(v[:, None] * b_w, axis=0), 0.0)  # prefix errors e_j
    tot = tl.sum(b_e, axis=0)  # E_0
    tl.store(etot_ptr + i_b * D + o_d, tot, mask=m_d)
    tl.store(loss_ptr + i_t * B + i_b, tl.sum(tl.sum(b_e * b_e, axis=1), axis=0))
    b_s = tot[None, :] - tl.cumsum(b_e, axis=0) + b_e  # E_j = sum_{k >= j} e_k
    tl.atomic_add(gv_ptr + i_b * K + o_k, tl.sum(b_s * b_w, axis=1), mask=m_k, sem="relaxed")
    tl.atomic_add(gw_ptr + i_f[:, None] * D + o_d[None, :], v[:, None] * b_s, mask=m_kd, sem="relaxed")


def onegather(idx, w, v, b, t, gw, gv, loss, etot, block_d, num_warps):
    B, K = idx.shape
    D = w.shape[1]
    gw.zero_()
    gv.zero_()
    grid = (B, triton.cdiv(D, block_d))
    _onegather_kernel[grid](idx, v, w, b, t, gw, gv, loss, etot, B, K, D, w.stride(0),
                            BLOCK_K=triton.next_power_of_2(K), BLOCK_D=block_d, num_warps=num_warps)
    return loss


def _buffers(B, K, F, D, device, block_d):
    return (torch.empty(F, D, device=device), torch.empty(B, K, device=device),
            torch.empty(triton.cdiv(D, block_d), B, device=device), torch.empty(B, D, device=device))


def check(device):
    """The kernel's loss and unscaled gradients against the float64 reference (odd K and D)."""
    B, K, F, D, block_d = 3, 5, 7, 40, 16
    idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, device)
    gw, gv, loss, etot = _buffers(B, K, F, D, device, block_d)
    onegather(idx, w, v, b, t, gw, gv, loss, etot, block_d, 1)
    p64 = [x.double().requires_grad_() for x in (w, v)]
    ref = reference.hierarchical_sae_loss(idx, p64[0], p64[1], b.double(), t.double())
    rw, rv = torch.autograd.grad(ref, p64)
    c = 2.0 / (B * K * D)
    errs = dict(loss=float((loss.sum() / (B * K * D) - ref).abs() / ref),
                gw=float((gw.double() * c - rw).norm() / rw.norm()),
                gv=float((gv.double() * c - rv).norm() / rv.norm()))
    print(json.dumps(errs))
    assert max(errs.values()) < 1e-5, errs
    return errs


def main(path):
    from triton.testing import do_bench
    B, F, D = 4096, 65536, 2304
    res = dict(gpu=torch.cuda.get_device_name(), check=check("cuda"), rows=[])
    for K in (32, 64, 128):
        idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        row = dict(K=K)
        row["step today"] = do_bench(lambda: torch.autograd.grad(sf.hierarchical_sae_loss(idx, w, v, b, t), ps),
                                     warmup=50, rep=300, return_mode="median")
        row["two-sweep fused forward today (zero-fill incl.)"] = do_bench(
            lambda: kn.hierarchical_loss_fwd_grads(idx, w.detach(), v.detach(), b.detach(), t, True, False),
            warmup=50, rep=300, return_mode="median")
        for block_d in (16, 32, 64):
            for nw in (1, 2, 4):
                if block_d * triton.next_power_of_2(K) > 4096 * nw:
                    continue  # more than 128 fp32 values of tile a thread
                bufs = _buffers(B, K, F, D, "cuda", block_d)
                fn = lambda: onegather(idx, w.detach(), v.detach(), b.detach(), t, *bufs, block_d, nw)  # noqa: E731
                row[f"onegather BLOCK_D={block_d} warps={nw} (zero-fill incl.)"] = do_bench(
                    fn, warmup=50, rep=300, return_mode="median")
                del bufs, fn
        row["zero-fill F x D"] = do_bench(lambda: torch.zeros(F, D, device="cuda"), warmup=50, rep=300,
                                          return_mode="median")
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        del idx, w, v, b, t, ps
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def sm90():
    """Compile the kernel for sm_90a as a real launch specialises it (16-divisible pointers, D and
    row stride; Triton ships ptxas) and print, per (K, BLOCK_D, warps): the register tile's layout,
    the shuffles in the PTX, and ptxas' registers and spill bytes. Session 26 asked whether putting K
    inside a thread (no shuffles in the scans) would leave only the gv reductions across lanes."""
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nvidia
    from compile_sm90 import compile_one  # scripts/ is on sys.path when this script runs

    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    types = dict(idx_ptr="*i64", vals_ptr="*fp32", w_ptr="*fp32", bias_ptr="*fp32", tgt_ptr="*fp32", gw_ptr="*fp32",
                 gv_ptr="*fp32", loss_ptr="*fp32", etot_ptr="*fp32", B="i32", K="i32", D="i32", stride_wf="i32")
    divisible = [n for n, t in types.items() if t.startswith("*") or n in ("D", "stride_wf")]
    for K, block_d, nw in ((64, 32, 1), (64, 64, 2), (32, 128, 1), (64, 128, 1), (128, 128, 1)):
        k = compile_one(_onegather_kernel, types, dict(BLOCK_K=K, BLOCK_D=block_d), nw, divisible)
        layout = re.search(r"#blocked = (.*)", k.asm["ttgir"]).group(1)
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "k.ptx"), "w") as f:
                f.write(k.asm["ptx"])
            info = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.path.join(d, "k.cubin")],
                                  capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", info).group(1)
        spill = re.search(r"(\d+) bytes spill stores", info).group(1)
        print(f"K={K} BLOCK_D={block_d} warps={nw}: {layout}; shfl.sync {k.asm['ptx'].count('shfl.sync')}; "
              f"{regs} registers, {spill} bytes spill stores")


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        check("cpu")
    elif sys.argv[1:] == ["--sm90"]:
        sm90()
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "probe_hier_onegather.json")
