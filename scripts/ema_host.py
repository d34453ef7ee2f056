"""Host cost of one eager EMA update ("active") at two benchmark shapes (GPU): host enqueue time per
call, do_bench median (target at (16384, 1024, 128): <= 35 us), and a cProfile of 200 calls."""
import torch
from triton.testing import do_bench

from sparsefuse import vq_ema_update
from sparsefuse.bench.harness import host_profile, host_us
from sparsefuse.bench.vq import _ema_kwargs, make_state

for B, K, D in ((16384, 1024, 128), (640, 256, 64)):
    state, kw = make_state(B, K, D, "cuda"), _ema_kwargs("active")
    fn = lambda: vq_ema_update(*state, **kw)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    host = host_us(fn)
    med = do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
    print(f"active B={B} K={K} D={D}: host {host:.1f} us per call, do_bench median {med:.1f} us", flush=True)
    host_profile(fn, 200, 15)
