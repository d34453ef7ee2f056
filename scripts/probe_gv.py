"""Hierarchical backward: gv through atomics vs per-D-tile partials (GPU)."""
import torch, triton, triton.language as tl
from triton.testing import do_bench
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
for dtype in (torch.float32, torch.bfloat16):
    for K in (32, 64, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, dtype, "cuda")
        etot = torch.randn(B, D, device="cuda"); g1 = torch.full((), 1e-9, device="cuda")
        gw = torch.zeros(F, D, device="cuda")
        cfg = kn._hier_config(D, w.element_size(), backward=True)
        grid = kn._hier_grid(B, D, cfg)
        res = []
        for staged in (False, True):
            gv = torch.zeros(grid[1], B, K, device="cuda") if staged else torch.zeros(B, K, device="cuda")
            f = lambda: kn._hierarchical_sae_bwd_kernel[grid](idx, v, w, b, tg, etot, g1, gw, gv, None, 1, B, K, D, F,
                D, 1, 0, D, HAS_BIAS=True, WEIGHT_GRAD=1, STAGED_GV=staged, FUSED=False, ACC=tl.float32, **cfg)
            f(); torch.cuda.synchronize()
            res.append(do_bench(f, warmup=20, rep=100))
        z = do_bench(lambda: torch.zeros(F, D, device="cuda"), warmup=20, rep=100)
        print(f"{str(dtype)[6:]:9} K={K:3}: atomic gv {res[0]:.3f} ms, staged gv {res[1]:.3f} ms, zeros(F,D) {z:.3f} ms")
