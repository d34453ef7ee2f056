"""Kernel-level profile of the fused TopK and Hierarchical SAE training steps (bench sae_train's
shape, bf16): torch.profiler's CUDA time per kernel over 20 steps, as text tables in
$OUT/profile_sae_step.log.

    python scripts/profile_sae_step.py
"""

import os

import torch
from torch.profiler import ProfilerActivity, profile

from sparsefuse.bench.sae_train import make_step


def main():
    path = os.path.join(os.environ.get("OUT", "."), "profile_sae_step.log")
    with open(path, "w") as f:
        for loss in ("topk", "hierarchical"):
            step = make_step(loss, "fused", "sparse", False, 4096, 64, 65536, 2304)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
            f.write(f"## {loss}, bf16, B=4096 K=64 F=65536 D=2304, 20 steps\n{table}\n")
            f.flush()
            print(loss, flush=True)


if __name__ == "__main__":
    main()
