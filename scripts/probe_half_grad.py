"""Hierarchical loss: forward+backward time by the column-chunk budget of the weight-gradient
accumulator (kernels._HIER_CHUNK_BYTES), fp32 and bf16, with accuracy against fp64. GPU."""
import json, os
import torch
from triton.testing import do_bench
from sparsefuse import hierarchical_sae_loss
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
BUDGETS = {"16MiB": 16 << 20, "32MiB": 32 << 20, "64MiB": 64 << 20, "whole": 1 << 40}
res = []
x = torch.randn(4096, 4096, device="cuda")
for _ in range(50):
    x @ x
for K in (32, 64, 128):
    base = make_inputs(B, K, F, D, torch.float64, "cuda")
    p64 = [base[1].clone().requires_grad_(), base[2].clone().requires_grad_(), base[3].clone().requires_grad_()]
    ref = torch.autograd.grad(hierarchical_sae_loss(base[0], p64[0], p64[1], p64[2], base[4]), p64)
    fns = {}
    for dtype in (torch.float32, torch.bfloat16):
        idx, w, v, b, t = (u.to(dtype) if u.is_floating_point() else u for u in base)
        params = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        for bname, budget in BUDGETS.items():
            def step(idx=idx, params=params, t=t, budget=budget):
                kn._HIER_CHUNK_BYTES = budget
                return torch.autograd.grad(hierarchical_sae_loss(idx, *params, t), params)
            got = step()
            err = [((g.double() - r).norm() / r.norm()).item() for g, r in zip(got, ref)]
            fns[f"{str(dtype)[6:]}/{bname}"] = (step, err)
    del base, p64, ref
    for rnd in range(3):
        for name, (step, err) in fns.items():
            ms = do_bench(step, warmup=25, rep=150)
            res.append(dict(K=K, variant=name, round=rnd, ms=ms, rel_err_w_v_b=err))
            print(f"K={K:3} {name:16} round {rnd}: {ms:.3f} ms  rel err (w, v, b) {[f'{e:.1e}' for e in err]}", flush=True)
    fns.clear()
    torch.cuda.empty_cache()
out = os.environ.get("OUT", ".")
json.dump(res, open(os.path.join(out, "probe_half_grad.json"), "w"), indent=1)
