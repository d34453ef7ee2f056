"""A/B of the fp32 atomic hierarchical backward's tile width (kernels._narrow_atomic_bwd forced
off / on) on whole forward + backward steps, alternating, three rounds, medians; JSON to argv[1]."""
import json
import statistics
import sys

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

SHAPES = [(4096, 32, 65536, 2304), (4096, 64, 65536, 2304), (4096, 128, 65536, 2304), (1024, 64, 65536, 2304),
          (2048, 128, 65536, 2304), (4096, 64, 131072, 4096), (4096, 32, 24576, 768)]  # (B, K, F, D)
real = kn._narrow_atomic_bwd
rows = []
for B, K, F, D in SHAPES:
    idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    fn = lambda: torch.autograd.grad(sparsefuse.hierarchical_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
    times = {64: [], 32: []}
    for _ in range(3):
        for width in (64, 32):
            kn._narrow_atomic_bwd = lambda device, n=width == 32: n
            fn()
            times[width].append(do_bench(fn, warmup=10, rep=100))
    kn._narrow_atomic_bwd = real
    row = dict(B=B, K=K, F=F, D=D, ms_64=statistics.median(times[64]), ms_32=statistics.median(times[32]),
               rounds_64=times[64], rounds_32=times[32], device_default_narrow=real(w.device))
    print(json.dumps(row), flush=True)
    rows.append(row)
    del idx, w, v, b, t, ps
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
