"""Interleaved A/B of the launcher before and after session 13's review fixes (device guard, wider
cache keys) on host-bound steps: the KD gathered loss and the SAE TopK loss at K = 32 (one H200).
Needs the old launcher as sparsefuse/_launch_old_ab.py (``git show 8896d03:sparsefuse/_launch.py``)."""
import json
import os

import torch
import triton

import sparsefuse
from sparsefuse import _launch, _launch_old_ab
from sparsefuse.bench.kd import make_targets
from sparsefuse.bench.sae import make_inputs
from sparsefuse.kd import kernels as kdk
from sparsefuse.sae import kernels as saek


def use(mod):
    kdk.launch = saek.launch = mod.launch


def kd_step():
    N, K = 8192, 64
    z = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
    ids, t, m = make_targets(N, K, 4096, "cuda")
    return lambda: torch.autograd.grad(sparsefuse.topk_kd_loss(z, t, m), z)


def sae_step(dtype):
    idx, w, v, b, t = make_inputs(4096, 32, 65536, 2304, dtype, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    return lambda: torch.autograd.grad(sparsefuse.topk_sae_loss(idx, w, v, b, t), ps)


steps = {"kd gathered": kd_step(), "topk fp32 K=32": sae_step(torch.float32), "topk bf16 K=32": sae_step(torch.bfloat16)}
out = {name: {"old": [], "new": []} for name in steps}
for mod in (_launch_old_ab, _launch):
    use(mod)
    for fn in steps.values():
        fn()
for r in range(6):
    for tag, mod in (("old", _launch_old_ab), ("new", _launch)) if r % 2 == 0 else (("new", _launch), ("old", _launch_old_ab)):
        use(mod)
        for name, fn in steps.items():
            out[name][tag].append(triton.testing.do_bench(fn, warmup=25, rep=200))
for name, d in out.items():
    print(name, {k: [round(x, 3) for x in v] for k, v in d.items()})
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_launch_host.json"), "w"), indent=1)
