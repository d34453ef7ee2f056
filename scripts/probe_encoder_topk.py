"""torch.topk over an SAE encoder's [B, F] pre-activations against a two-stage topk (per chunk of C
columns, then over the candidates) and a row max (about the read floor). GPU only; prints ms."""
import torch
from triton.testing import do_bench
B, F, K = 4096, 65536, 64
for dt in (torch.bfloat16, torch.float32):
    x = torch.randn(B, F, device="cuda").to(dt)
    base = do_bench(lambda: x.topk(K, dim=-1, sorted=True), warmup=10, rep=100)
    print(f"{dt} torch.topk {base:.3f} ms", flush=True)
    for C in (256, 512, 1024, 2048, 4096, 8192):
        def two():
            v, i = x.view(B, F // C, C).topk(K, dim=-1, sorted=False)
            v2, j = v.reshape(B, -1).topk(K, dim=-1, sorted=True)
            base_idx = (torch.arange(F // C, device="cuda") * C).view(1, -1, 1)
            return v2, (i + base_idx).reshape(B, -1).gather(1, j)
        t = do_bench(two, warmup=10, rep=100)
        v1, i1 = x.topk(K, dim=-1, sorted=True); v2, i2 = two()
        print(f"  two-stage C={C}: {t:.3f} ms, values equal {bool((v1 == v2).all())}, idx equal {bool((i1 == i2).all())}", flush=True)
    for m in ("max", ):
        t = do_bench(lambda: x.max(dim=-1), warmup=10, rep=100)
        print(f"  x.max(dim=-1) (read floor-ish): {t:.3f} ms", flush=True)
    s = do_bench(lambda: torch.sort(x, dim=-1, descending=True), warmup=5, rep=50)
    print(f"  full sort: {s:.3f} ms", flush=True)
