"""Host time of one gathered KD step (forward + backward) against the eager reference, measured
with the host far ahead of the GPU (the steps are enqueued behind a long GPU sleep, so wall time
per step is host time), then a cProfile of our step. Writes $OUT/kd_gathered_host.txt."""
import cProfile
import io
import os
import pstats
import time

import torch

import sparsefuse
from sparsefuse.bench.kd import _ref_gathered, make_targets

N, K = 8192, 64
ids, t, m = make_targets(N, K, 4096, "cuda")
z = (torch.randn(N, K, device="cuda") * 3).to(torch.bfloat16).reshape(4, N // 4, K).requires_grad_()
t, m = t.reshape(4, N // 4, K), m.reshape(4, N // 4, K)
steps = {"sparsefuse": lambda: torch.autograd.grad(sparsefuse.topk_kd_loss(z, t, m), [z]),
         "torch": lambda: torch.autograd.grad(_ref_gathered(z, t, m), [z])}
out = io.StringIO()
for name, fn in steps.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(5):
        torch.cuda._sleep(2_000_000_000 // 1000 * 50)  # ~50 ms of GPU sleep: the host runs ahead
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        per.append((time.perf_counter() - t0) / 20 * 1e3)
        torch.cuda.synchronize()
    print(f"{name}: host ms per step {[round(x, 3) for x in per]}", file=out)
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    steps["sparsefuse"]()
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
text = out.getvalue()
print(text[:6000])
open(os.path.join(os.environ.get("OUT", "."), "kd_gathered_host.txt"), "w").write(text)
