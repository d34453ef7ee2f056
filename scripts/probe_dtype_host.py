"""Why a bf16 TopK step costs the host more than an fp32 one (GPU only; session 16 and 49 saw
1.34 / 1.09 and 1.12 / 0.99 ms of idle host time at the benchmark's shape, K = 32).

For fp32 and bf16 in alternation: host time of the forward alone and of the backward alone (each
after a synchronisation, median of 200), the whole step pipelined (``harness.host_us``), the
launcher's cache size before and after (a growing cache would mean launches that miss it), and the
top CPU ops of 20 steps by self CPU time (torch.profiler). Writes JSON to argv[1].
"""
import json
import statistics
import sys
import time

import torch

import sparsefuse as sf
from sparsefuse import _launch
from sparsefuse.bench import harness
from sparsefuse.bench.sae import make_inputs

B, K, F, D = 4096, 32, 65536, 2304
out = []
inputs = {dn: make_inputs(B, K, F, D, dt, "cuda") for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
for rnd in range(3):
    for dn, (idx, w, v, b, t) in inputs.items():
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        step = lambda: torch.autograd.grad(sf.topk_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
        for _ in range(20):
            step()
        n_cache = len(_launch._CACHE)
        fwd, bwd = [], []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = sf.topk_sae_loss(idx, w, v, b, t)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            torch.autograd.grad(loss, ps)
            t3 = time.perf_counter()
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t3 - t2) * 1e3)
        row = dict(round=rnd, dtype=dn, fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd),
                   idle_step_ms=harness.idle_host_ms(step), pipelined_us=harness.host_us(step, 200),
                   cache_growth=len(_launch._CACHE) - n_cache)
        if rnd == 2:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
            row["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        out.append(row)
for row in out:
    if "profile" in row:
        print("==", row["dtype"])
        print(row["profile"])
with open(sys.argv[1] if len(sys.argv) > 1 else "probe_dtype_host.json", "w") as f:
    json.dump(out, f, indent=1)
