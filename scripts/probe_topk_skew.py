"""The TopK decoder loss on a real SAE's latents (``sparsefuse bench sae_train``'s decoder-only
case: indices from a fresh TopKSAE's encoder, so some features fire far more often than others),
GPU only. Prints the hit counts per feature, then the step time (median of do_bench, three
round-robin rounds) and the kernel times of one step for: the shipped code; int32 indices (no
narrowing, no id check in the weight-gradient kernel); the gather's K-column groups (before
session 11). Writes JSON to argv[1]."""
import json
import statistics
import sys
from collections import defaultdict

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse._launch import cdiv, next_pow2
from sparsefuse.sae import kernels as kn
from sparsefuse.sae.modules import TopKSAE

B, K, F, D = 4096, 64, 65536, 2304
model = TopKSAE(D, F, K, auxk_alpha=0.0, device="cuda", dtype=torch.bfloat16)
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(B, D, device="cuda", generator=g).to(torch.bfloat16)
with torch.no_grad():
    idx, vals = model.encode(x)
vals.requires_grad_()
counts = torch.bincount(idx.flatten(), minlength=F)
stats = dict(max=int(counts.max()), p99=float(counts.float().quantile(0.99)), used=int((counts > 0).sum()))
print("hits per feature:", stats, flush=True)
params = [model.W_dec, vals, model.b_dec]
default = kn._decode_config


def old_config(K, D, itemsize, loss):
    c = default(K, D, itemsize, loss)
    c["GROUP"] = cdiv(next_pow2(K), c["BLOCK_D"]) if loss else 1
    return c


variants = {
    "shipped": (idx, default),
    "int32 ids": (idx.int(), default),
    "K-column groups": (idx, old_config),
}
fns = {n: (lambda i=i: torch.autograd.grad(sf.topk_sae_loss(i, model.W_dec, vals, model.b_dec, x), params))
       for n, (i, _) in variants.items()}
times = defaultdict(list)
for _ in range(3):
    for n, (_, cfg) in variants.items():
        kn._decode_config = cfg
        fns[n]()
        times[n].append(do_bench(fns[n], warmup=25, rep=200))
out = dict(stats=stats, ms={n: statistics.median(t) for n, t in times.items()}, kernels={})
for n, (_, cfg) in variants.items():
    kn._decode_config = cfg
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fns[n]()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time / 10 / 1e3
    out["kernels"][n] = sorted(per.items(), key=lambda kv: -kv[1])[:4]
    print(n, f"{out['ms'][n]:.3f} ms", [(k[:30], round(v, 3)) for k, v in out["kernels"][n]], flush=True)
kn._decode_config = default
with open(sys.argv[1] if len(sys.argv) > 1 else "probe_topk_skew.json", "w") as f:
    json.dump(out, f, indent=1)
