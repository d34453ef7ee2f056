"""Sweep of the hierarchical backward sweep's (BLOCK_D, CHUNK, VEC) on full forward + backward steps of
``hierarchical_sae_loss`` (fp32: atomics; bf16: the fused forward).
GPU only. Three round-robin rounds, median kept; writes every timing to $OUT/tune_hier.json.

The forward's own configuration (kernels._HIER_FWD) was swept in session 7
(benchmarks/logs/tune_hier_fp32_session7.json) and is left as it is."""
import json
import os
import statistics

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

B, F, D = 4096, 65536, 2304
CONFIGS = [(64, 1, 4), (64, 8, 4), (64, 4, 2), (64, 8, 2), (64, 16, 2), (32, 8, 1)]  # (BLOCK_D, CHUNK, VEC)
if os.environ.get("TUNE_CONFIGS"):  # e.g. "64,8,2;32,8,1"
    CONFIGS = [tuple(int(x) for x in c.split(",")) for c in os.environ["TUNE_CONFIGS"].split(";")]
CASES = [(torch.float32, K, False) for K in (32, 64, 128)] + [(torch.bfloat16, K, False) for K in (32, 64, 128)]
default = {k: dict(v) for k, v in kn._HIER_BWD.items()}


def step(dtype, K, deterministic):
    idx, w, v, b, tg = make_inputs(B, K, F, D, dtype, "cuda")
    params = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    return lambda: torch.autograd.grad(
        sparsefuse.hierarchical_sae_loss(idx, w, v, b, tg, deterministic=deterministic), params)


times = {}
for dtype, K, det in CASES:
    fn = step(dtype, K, det)
    tag = f"{str(dtype)[6:]} K={K}{' det' if det else ''}"
    for _ in range(3):
        for bd, ch, vec in CONFIGS:
            kn._HIER_BWD[dtype.itemsize] = dict(BLOCK_D=bd, CHUNK=ch, VEC=vec)
            fn()
            torch.cuda.synchronize()
            times.setdefault(f"{tag} BD={bd} CH={ch} VEC={vec}", []).append(do_bench(fn, warmup=25, rep=100))
    kn._HIER_BWD.update({k: dict(v) for k, v in default.items()})
    torch.cuda.empty_cache()
    row = {c: statistics.median(times[f"{tag} BD={c[0]} CH={c[1]} VEC={c[2]}"]) for c in CONFIGS}
    best = min(row, key=row.get)
    print(f"{tag:18} " + "  ".join(f"{c[0]},{c[1]},{c[2]}:{ms:.3f}" for c, ms in row.items()) + f"   best {best}", flush=True)

json.dump(dict(device=torch.cuda.get_device_name(), default=default,
               ms={k: dict(median=statistics.median(t), rounds=t) for k, t in times.items()}),
          open(os.path.join(os.environ.get("OUT", "."), "tune_hier.json"), "w"), indent=1)
