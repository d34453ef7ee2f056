"""A/B of the TopK loss forward with and without the mask on the columns past D (session 38: an
infinite vals entry made those columns NaN, which reached the loss). The kernels before the change
must be in ``sparsefuse/sae/_kernels_before.py`` (``git show e41f629:sparsefuse/sae/kernels.py >
sparsefuse/sae/_kernels_before.py``); ``ops.kernels`` is swapped between the two, alternating, three
rounds of do_bench and device time per (dtype, K) on full forward + backward steps at the benchmark
shape. JSON to argv[1]."""
import json
import statistics
import sys

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse.bench.harness import device_time
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import _kernels_before, kernels, ops

B, F, D = 4096, 65536, 2304
rows = []
for dtype in (torch.float32, torch.bfloat16):
    for K in (32, 64, 128):
        idx, w, v, b, t = make_inputs(B, K, F, D, dtype, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(sparsefuse.topk_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
        times = {"before": [], "after": []}
        dev = {"before": [], "after": []}
        for _ in range(3):
            for name, mod in (("before", _kernels_before), ("after", kernels)):
                ops.kernels = mod
                fn()
                ms = do_bench(fn, warmup=25, rep=100)
                times[name].append(ms)
                dev[name].append(device_time(fn, ms))
        ops.kernels = kernels
        row = dict(dtype=str(dtype)[6:], K=K, **{f"ms_{n}": statistics.median(x) for n, x in times.items()},
                   **{f"device_ms_{n}": statistics.median(x) for n, x in dev.items()}, rounds=times, device_rounds=dev)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del idx, w, v, b, t, ps
        torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
