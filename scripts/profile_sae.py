"""Per-kernel GPU time of one forward+backward of each SAE loss (torch.profiler), for tuning.

    python scripts/profile_sae.py [K,K,...] [op,op,...]    e.g. 32,128 topk
SAE_GATHER=row times the TopK gather as it was before session 10 (one program per row)."""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sparsefuse._launch import cdiv
from sparsefuse.bench.sae import OPS, make_inputs
from sparsefuse.sae import kernels as kn

Ks = [int(k) for k in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["32", "128"])]
ops = sys.argv[2].split(",") if len(sys.argv) > 2 else list(OPS)
if os.environ.get("SAE_GATHER") == "row":
    kn._decode_config = lambda K, D, itemsize, loss: dict(kn._gather_config(K, D, itemsize),
                                                          GROUP=cdiv(D, kn._gather_config(K, D, itemsize)["BLOCK_D"]))
for dtype in (torch.float32, torch.bfloat16):
    for K in Ks:
        idx, w, v, b, t = make_inputs(4096, K, 65536, 2304, dtype, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        for name in ops:
            ours = OPS[name][0]
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
