"""Per-kernel GPU time of one forward+backward of each SAE loss (torch.profiler), for tuning."""
import sys
import torch
from torch.profiler import ProfilerActivity, profile
from sparsefuse.bench.sae import OPS, make_inputs

Ks = [int(k) for k in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["32", "128"])]
for dtype in (torch.float32, torch.bfloat16):
    for K in Ks:
        idx, w, v, b, t = make_inputs(4096, K, 65536, 2304, dtype, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        for name, (ours, _) in OPS.items():
            step = lambda: torch.autograd.grad(ours(idx, w, v, b, t), ps)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            print(f"==== {name} {dtype} K={K} (5 steps)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
