"""Two probes (GPU): what bounds the hierarchical backward's atomics, and what each host-side op of
an eager SAE step costs on this machine."""
import os, json
import torch, triton, triton.language as tl
from triton.testing import do_bench
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.sae import make_inputs
from sparsefuse._launch import launch
from sparsefuse.bench.harness import host_us

B, F, D = 4096, 65536, 2304


@triton.jit
def _probe_kernel(idx_ptr, w_ptr, gw_ptr, B, K, D, MODE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (row, D tile): gather K decoder rows; MODE 0 sums them, 1 atomically adds each into gw,
    2 stores each into gw (same addresses, wrong result: timing only), 3 atomics with 'cta' scope."""
    i_t = tl.program_id(1)
    i_b = tl.program_id(0).to(tl.int64)
    o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i_k in range(0, K):
        i_f = tl.load(idx_ptr + i_b * K + i_k).to(tl.int64)
        w = tl.load(w_ptr + i_f * D + o_d, mask=m_d, other=0)
        acc += w
        if MODE == 1:
            tl.atomic_add(gw_ptr + i_f * D + o_d, acc, mask=m_d, sem="relaxed")
        elif MODE == 2:
            tl.store(gw_ptr + i_f * D + o_d, acc, mask=m_d)
        elif MODE == 3:
            tl.atomic_add(gw_ptr + i_f * D + o_d, acc, mask=m_d, sem="relaxed", scope="gpu")
    tl.store(gw_ptr + i_b * D + o_d, acc, mask=m_d)


out = {}
idx, w, v, b, tg = make_inputs(B, 128, F, D, torch.float32, "cuda")
gw = torch.zeros(F, D, device="cuda")
for BD in (32, 64, 128):
    for mode in (0, 1, 2):
        for nw in (1, 2):
            if BD < 32 * nw: continue
            grid = (B, triton.cdiv(D, BD))
            f = lambda: _probe_kernel[grid](idx, w, gw, B, 128, D, MODE=mode, BLOCK_D=BD, num_warps=nw)
            f(); torch.cuda.synchronize()
            out[f"probe K128 BD={BD} nw={nw} mode={mode}"] = do_bench(f, warmup=10, rep=40)
    # row-major order (D tile fastest): no L2 locality
    gridT = (triton.cdiv(D, BD),)
for k, ms in out.items():
    print(f"{k:40} {ms:.3f} ms")

# Host cost per op (no sync in the loop; tiny tensors so the GPU never limits).
x = torch.randn(64, 256, device="cuda"); s = torch.ones((), device="cuda"); ik = torch.randint(0, 1024, (64 * 32,), device="cuda")
ar = torch.arange(1025, device="cuda")
host = {
    "torch.empty": lambda: torch.empty(64, 256, device="cuda"),
    "torch.zeros": lambda: torch.zeros(64, 256, device="cuda"),
    "x.sum()": lambda: x.sum(),
    "x.sum(0)": lambda: x.sum(0),
    "x * s": lambda: x * s,
    "x.mul_(1.0)": lambda: x.mul_(1.0),
    "x.to(bf16)": lambda: x.to(torch.bfloat16),
    "x.to(fp32) noop": lambda: x.to(torch.float32),
    "x.contiguous() noop": lambda: x.contiguous(),
    "sort stable": lambda: torch.sort(ik, stable=True),
    "searchsorted": lambda: torch.searchsorted(ik, ar),
    "ones_like scalar": lambda: torch.ones_like(s),
}
resid = torch.empty(64, 256, device="cuda"); sk, order = torch.sort(ik, stable=True)
seg = torch.searchsorted(sk, ar); gwt = torch.empty(1024, 256, device="cuda"); vv = torch.rand(64, 32, device="cuda")
# no chunk partial sums (a chunk longer than any segment): the per-feature walk alone, as before session 15
args = (seg, order, vv, resid, resid[:1], None, s, gwt, None, 32, 256, 256)
meta = dict(WEIGHTED=True, ROW_PER_ENTRY=False, HAS_SCALE=True, HAS_WSUM=False, ACC=tl.float32, BLOCK_D=512,
            CHUNK=1 << 40, E=4)
host["sparsefuse launch (12 args)"] = lambda: launch(kn._sae_weight_grad_kernel, (1024, 1), args, meta, 2)
host["triton kernel[grid] (12 args)"] = lambda: kn._sae_weight_grad_kernel[(1024, 1)](*args, **meta, num_warps=2)
for name, fn in host.items():
    out[f"host {name}"] = host_us(fn, 2000)
    print(f"host {name:32} {out[f'host {name}']:.1f} us")
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe.json"), "w"), indent=1)
