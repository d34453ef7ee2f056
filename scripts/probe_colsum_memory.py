"""Transient memory of summing a [4096, 2304] fp32 tensor over its rows, several ways. PyTorch's
one-stage sum over rows allocates about 72 MiB there; summed in 64-row blocks first, 0.57 MiB
(session 19: it mattered where the sum ran beside an F x D gradient buffer).

    python scripts/probe_colsum_memory.py
"""

import torch

MiB = 2**20
B, D = 4096, 2304
x = torch.randn(B, D, device="cuda")
WAYS = {
    "sum(0)": lambda: x.sum(0),
    "view(64, 64, D).sum(1).sum(0)": lambda: x.view(64, 64, D).sum(1).sum(0),
    "sum(0, dtype=f32)": lambda: torch.sum(x, 0),
    "t().sum(1)": lambda: x.t().sum(1),
    "sum(0) [512 rows]": lambda: x[:512].sum(0),
}
for name, fn in WAYS.items():
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    print(f"{name:32s} transient {(torch.cuda.max_memory_allocated() - base) / MiB:8.2f} MiB")
