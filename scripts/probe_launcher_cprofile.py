"""cProfile of our TopK launchers called directly on the main thread (GPU machine, tiny shapes,
so the GPU never limits): where their Python time goes, by function, and the wall time per call
of the forward and backward launchers. Prints the top entries by own time."""
import cProfile
import pstats
import time

import torch

from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

idx, w, v, b, t = make_inputs(64, 32, 1024, 256, torch.float32, "cuda")
g = torch.ones((), device="cuda")
_, resid, gv = kn.topk_loss_fwd(idx, w, v, b, t)
calls = {
    "fwd": lambda: kn.topk_loss_fwd(idx, w, v, b, t),
    "bwd": lambda: kn.topk_loss_bwd(g, idx, v, w, resid, gv, True, b.dtype),
    "mul": lambda: g.to(torch.float32) * (2.0 / (64 * 256)),
    "sum": lambda: resid.sum(0),
    "sort": lambda: torch.sort(idx.reshape(-1), stable=True),
    "empty": lambda: torch.empty(1024, 256, device="cuda"),
}
for name, fn in calls.items():
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(400):
        if i % 50 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"{name:6s} median {1e6 * ts[len(ts) // 2]:7.1f} us", flush=True)
for name in ("fwd", "bwd"):
    pr = cProfile.Profile()
    pr.enable()
    for i in range(300):
        calls[name]()
    pr.disable()
    torch.cuda.synchronize()
    print(f"== {name}: 300 calls")
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
