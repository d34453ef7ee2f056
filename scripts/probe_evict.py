"""Cache hints on the hierarchical sweeps' decoder gathers (GPU only). Never tried before session 22:
the backward's decoder slice and its gradient slice share L2, and ncu (session 8) counted gradient
lines evicted before their last atomic. Variants of ``sparsefuse/sae/kernels.py`` are written next to
it with one load changed, and the ops are pointed at each in turn; whole fp32 / bf16 steps alternate
variant by variant in one process. Writes JSON to argv[1]."""
import importlib
import json
import os
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as base, ops

SRC = open(base.__file__).read()
BWD_LOAD = "    b_w = tl.load(w_ptr + i_f[:, None] * stride_wf + o_d[None, :].to(tl.int64) * stride_wd,\n" \
           "                  mask=(m_k & ok)[:, None] & m_d[None, :], other=0).to(ACC)"
FWD_LOAD = "    b_w = tl.load(w_ptr + i_f[:, None] * stride_wf + o_d[None, :].to(tl.int64) * stride_wd, mask=m_w,\n" \
           "                  other=0).to(ACC)"
assert SRC.count(BWD_LOAD) == 1 and SRC.count(FWD_LOAD) == 1


def variant(name, bwd_hint="", fwd_hint=""):
    if not bwd_hint and not fwd_hint:
        return base
    src = SRC.replace(BWD_LOAD, BWD_LOAD.replace("other=0)", f"other=0{bwd_hint})"))
    src = src.replace(FWD_LOAD, FWD_LOAD.replace("other=0)", f"other=0{fwd_hint})"))
    path = os.path.join(os.path.dirname(base.__file__), f"_probe_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    return importlib.import_module(f"sparsefuse.sae._probe_{name}")


VARIANTS = {
    "base": variant("base"),
    "bwd_evict_first": variant("bwd_evict_first", bwd_hint=', eviction_policy="evict_first"'),
    "bwd_evict_last": variant("bwd_evict_last", bwd_hint=', eviction_policy="evict_last"'),
    "bwd_cg": variant("bwd_cg", bwd_hint=', cache_modifier=".cg"'),
    "fwd_evict_last": variant("fwd_evict_last", fwd_hint=', eviction_policy="evict_last"'),
}
B, F, D, ROUNDS = 4096, 65536, 2304, 4
CASES = [(64, torch.float32), (128, torch.float32), (128, torch.bfloat16)]
out = []
for K, dt in CASES:
    idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    fn = lambda: torch.autograd.grad(sf.hierarchical_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
    ops.kernels = base
    want = [g.double() for g in fn()]
    row = dict(op="hierarchical", dtype=str(dt).replace("torch.", ""), K=K)
    for rnd in range(ROUNDS):
        for name, mod in VARIANTS.items():
            ops.kernels = mod
            if rnd == 0:
                got = fn()
                row[f"{name}_max_rel_diff"] = max(float((g.double() - h).norm() / h.norm()) for g, h in zip(got, want))
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            row.setdefault(f"{name}_ms", []).append(do_bench(fn, warmup=25, rep=200))
    ops.kernels = base
    for name in VARIANTS:
        xs = sorted(row[f"{name}_ms"])
        row[f"{name}_median"] = (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    print(json.dumps({k: (round(x, 4) if isinstance(x, float) else x) for k, x in row.items()
                      if not k.endswith("_ms")}), flush=True)
    out.append(row)
    del idx, w, v, b, t, ps, fn
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=out), open(sys.argv[1], "w"), indent=1)
