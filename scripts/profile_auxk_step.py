"""Where the GPU time of one TopKSAE training step goes with AuxK on (torch.profiler, device time
per step): F = 32768, D = 2304, K = 64, B = 4096, Hierarchical, 327 latents dead (1%), AuxK over the
dead latents as the trainer passes them ("superset"), over every latent ("all"), and skipped ("skip"),
in fp32 and under bf16 autocast. Run before session 29's dense AuxK products
(benchmarks/logs/prof_auxk_step_session29_h200.txt), it showed the superset's cost in the gathers
and the segmented sums of their backward.

    python scripts/profile_auxk_step.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from sparsefuse.sae.modules import TopKSAE

torch.manual_seed(0)
F, D, K, B = 32768, 2304, 64, 4096
for dtype in ("float32", "bfloat16"):
    m = TopKSAE(D, F, K, hierarchical=True, auxk_alpha=1/32, dead_tokens=1000).cuda()
    dead = torch.randperm(F, device="cuda")[:327]
    m.tokens_since_fired[dead] = 10**6
    x = torch.randn(B, D, device="cuda")
    var = torch.tensor(1.0, device="cuda")
    for lat_name, lat in (("superset", dead), ("all", None), ("skip", dead[:0])):
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                out = m(x, var, auxk_latents=lat)
            out.loss.backward()
            m.zero_grad(set_to_none=True)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        tot = sum(e.device_time_total for e in p.key_averages()) / 3 / 1e3
        print(f"==== {dtype} {lat_name}: {tot:.2f} ms device per step")
        for e in sorted(p.key_averages(), key=lambda e: -e.device_time_total)[:12]:
            print(f"  {e.device_time_total/3/1e3:8.3f} ms  x{e.count//3:3d}  {e.key[:110]}")
