"""Kernel-level sweep for the TopK SAE kernels (block sizes, warps). GPU only.

The hierarchical sweeps have their own: scripts/tune_hier.py."""
import json, os, sys
import torch, triton, triton.language as tl
from triton.testing import do_bench
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
out = {}

def t(fn):
    fn(); torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100)

for dtype in (torch.float32, torch.bfloat16):
    for K in (32, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, dtype, "cuda")
        tag = f"{str(dtype)[6:]}-K{K}"
        resid = torch.empty(B, D, device="cuda"); gv = torch.empty(B, K, device="cuda"); rl = torch.empty(B, device="cuda")
        BK = triton.next_power_of_2(K)
        cfg = kn._gather_config(K, D, w.element_size())
        out[f"fwd {tag} heuristic {cfg}"] = t(lambda: kn._sae_decode_fwd_kernel[(B,)](idx, v, w, b, tg, resid, gv, rl, K, D, F, D, 1,
                               HAS_BIAS=True, IS_LOSS=True, ACC=tl.float32, **cfg))
        keys = idx.reshape(-1)
        sk, order = torch.sort(keys, stable=True)
        seg = torch.searchsorted(sk, torch.arange(F + 1, device="cuda", dtype=keys.dtype))
        gw = torch.empty(F, D, device="cuda", dtype=dtype)
        for BD, nw in ((512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8), (256, 2)):
            ms = t(lambda: kn._sae_weight_grad_kernel[(F, triton.cdiv(D, BD))](seg, order, v, resid, None, gw, K, D, 1.0,
                   WEIGHTED=True, ROW_PER_ENTRY=False, HAS_SCALE=False, ACC=tl.float32, BLOCK_D=BD, num_warps=nw))
            out[f"wg {tag} BD={BD} nw={nw}"] = ms
        print(tag, "done", flush=True)
# CPU-side cost of one training step (launch and dispatch overhead), no sync inside the loop
import time
from sparsefuse.bench.sae import OPS
idx, w, v, b, tg = make_inputs(B, 32, F, D, torch.float32, "cuda")
ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
for name, (fn, _) in OPS.items():
    step = lambda: torch.autograd.grad(fn(idx, w, v, b, tg), ps)
    for _ in range(5): step()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(20): step()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    out[f"cpu-enqueue {name} K32"] = (t1 - t0) / 20 * 1e3
    out[f"wall {name} K32"] = (t2 - t0) / 20 * 1e3

json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "tune.json"), "w"), indent=1)
groups = {}
for k, ms in out.items():
    g = " ".join(k.split()[:2])
    groups.setdefault(g, []).append((ms, k))
for g, items in groups.items():
    items.sort()
    print(f"{g:32} best {items[0][0]:.3f} ms  {items[0][1]}   | worst {items[-1][0]:.3f}")
