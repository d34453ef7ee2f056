"""Peak memory of a [4096, 2304] fp32 column sum, several ways (the hierarchical finish sums E_0 over rows)."""
import torch
MiB = 2**20
B, D = 4096, 2304
etot = torch.randn(B, D, device="cuda")
for name, fn in [("sum(0)", lambda: etot.sum(0)), ("view(64,64,D).sum(1).sum(0)", lambda: etot.view(64, 64, D).sum(1).sum(0)),
                 ("sum(0, dtype=f32)", lambda: torch.sum(etot, 0)), ("t().sum(1)", lambda: etot.t().sum(1)),
                 ("sum(0) [512 rows]", lambda: etot[:512].sum(0))]:
    fn(); torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    out = fn(); torch.cuda.synchronize()
    print(f"{name:32s} transient {(torch.cuda.max_memory_allocated() - base) / MiB:8.2f} MiB")
