"""Host time against GPU time of one eager SAE loss step at the benchmark's shape (GPU only).

For each (op, dtype, K): the host time of a step enqueued on an idle GPU (``harness.idle_host_ms``);
the GPU time of a step with the host far ahead (``harness.device_time``); do_bench of the step (what
``bench sae`` reports); the kernels one step launches (torch.profiler) and the Python calls it
makes (cProfile, top entries by own time). Run it once per code version in alternating processes to
compare two versions on one machine start. Writes JSON to argv[1].
"""
import cProfile
import io
import json
import os
import pstats
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench import harness
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
OPS = {"topk": sf.topk_sae_loss, "hierarchical": sf.hierarchical_sae_loss}
CASES = [c.split(":") for c in os.environ.get("CASES", "topk:fp32:32,topk:bf16:32,hierarchical:fp32:32,"
                                                      "hierarchical:bf16:32").split(",")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

out = []
for op, dn, k in CASES:
    K = int(k)
    idx, w, v, b, t = make_inputs(B, K, F, D, DTYPES[dn], "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    fn = lambda: torch.autograd.grad(OPS[op](idx, w, v, b, t), ps)  # noqa: E731
    for _ in range(20):
        fn()
    bench = do_bench(fn, warmup=25, rep=200)
    row = dict(op=op, dtype=dn, K=K, idle_host_ms=harness.idle_host_ms(fn), gpu_ms=harness.device_time(fn, bench),
               bench_ms=bench)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    row["launches"] = len(kernels)
    row["kernels"] = kernels
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    row["python_calls_per_step"] = st.total_calls / 100
    st.sort_stats("tottime").print_stats(18)
    row["profile"] = s.getvalue()
    print(json.dumps({k: v for k, v in row.items() if k not in ("profile", "kernels")}), flush=True)
    out.append(row)
    del idx, w, v, b, t, ps, fn
    torch.cuda.empty_cache()
with open(sys.argv[1] if len(sys.argv) > 1 else "probe_step_host.json", "w") as f:
    json.dump(out, f, indent=1)
