"""Host-side cost of one eager training step of each SAE loss and of one eager VQ EMA update
(tiny shapes, so the kernels are ~free); with any argument, a cProfile of each as well."""
import cProfile, pstats, sys
import torch
from sparsefuse import vq_ema_update
from sparsefuse.bench.harness import host_us
from sparsefuse.bench.sae import OPS, make_inputs
from sparsefuse.bench.vq import _ema_kwargs, make_state

idx, w, v, b, t = make_inputs(64, 32, 1024, 256, torch.float32, "cuda")
ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
calls = {name: (lambda fn=fn: torch.autograd.grad(fn(idx, w, v, b, t), ps)) for name, (fn, _) in OPS.items()}
for semantics in ("active", "laplace"):
    state, kw = make_state(640, 256, 64, "cuda"), _ema_kwargs(semantics)
    calls[f"vq_ema_update {semantics}"] = lambda state=state, kw=kw: vq_ema_update(*state, **kw)
for name, call in calls.items():
    print(f"{name}: {host_us(call):.0f} us per call (host-bound)")
    if len(sys.argv) > 1:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            call()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
