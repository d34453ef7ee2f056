"""Host-side cost of one eager training step of each SAE loss (tiny shapes, so kernels are ~free)."""
import cProfile, pstats, sys, time
import torch
from sparsefuse.bench.sae import OPS, make_inputs

idx, w, v, b, t = make_inputs(64, 32, 1024, 256, torch.float32, "cuda")
ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
for name, (fn, _) in OPS.items():
    step = lambda: torch.autograd.grad(fn(idx, w, v, b, t), ps)
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        step()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us per step (host-bound)")
    if len(sys.argv) > 1:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)

# The VQ EMA update (eager, CUDA): host cost per call at a tiny shape.
from sparsefuse import vq_ema_update
from sparsefuse.bench.vq import make_state, _ema_kwargs
for semantics in ("active", "laplace"):
    state = make_state(640, 256, 64, "cuda")
    kw = _ema_kwargs(semantics)
    call = lambda: vq_ema_update(*state, **kw)
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        call()
    torch.cuda.synchronize()
    print(f"vq_ema_update {semantics}: {(time.perf_counter() - t0) / 200 * 1e6:.0f} us per call (host-bound)")
    if len(sys.argv) > 1:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            call()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
