"""Is compute-sanitizer initcheck's report on the KD bf16 hidden path about cuBLAS's output? A plain
bf16 matmul into a fresh buffer, then a torch reduction reading it; the same into a NaN-filled
buffer, checked for NaN left behind (what a matmul that skipped elements would leave)."""
import torch

g = torch.Generator(device="cuda").manual_seed(0)
for dt in (torch.bfloat16, torch.float32):
    for V in (1000, 4099):
        h = torch.randn(11, 40, device="cuda", dtype=dt, generator=g)
        w = torch.randn(V, 40, device="cuda", dtype=dt, generator=g)
        b = torch.randn(V, device="cuda", dtype=dt, generator=g)
        out = torch.empty(11, V, device="cuda", dtype=dt)
        torch.addmm(b, h, w.t(), out=out)
        s = out.float().sum()  # initcheck: does this read "uninitialized" memory?
        poisoned = torch.full((11, V), float("nan"), device="cuda", dtype=dt)
        torch.addmm(b, h, w.t(), out=poisoned)
        ref = (h.double() @ w.double().t() + b.double())
        err = ((poisoned.double() - ref).norm() / ref.norm()).item()
        print(dt, V, "nan left:", bool(poisoned.isnan().any()), "rel err:", f"{err:.2e}", float(s))
torch.cuda.synchronize()
