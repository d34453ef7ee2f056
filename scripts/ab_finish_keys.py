"""A/B of the weight gradient's sort keys written by the backward's finishing launch (new) against
a key pass of their own (old, session 47), GPU only. Run once per code version in alternating
processes (PYTHONPATH picks the package; the old one from ``git archive``), on one machine start.

For each step (forward + backward of weight, vals and bias at B = 4096, F = 65536, D = 2304): the
device time (``harness.device_time``: host far ahead), the host time of a step on an idle GPU, the
do_bench median, and the kernels one step launches. Steps: TopK fp32 and bf16 at K = 32, fp32 at
K = 64 (each takes the finishing launch before its segmented sum now), Hierarchical bf16 at K = 32
(staged in one chunk, the fused forward) and deterministic fp32 at K = 64. Writes JSON to argv[1]."""
import json
import statistics
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench import harness
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEPS = [("topk", "fp32", 32, None), ("topk", "bf16", 32, None), ("topk", "fp32", 64, None),
         ("hier", "bf16", 32, None), ("hier", "fp32", 64, True)]
out = {"sparsefuse": sf.__file__, "device": torch.cuda.get_device_name(), "steps": []}


def measure(op, dn, K, det):
    idx, w, v, b, t = make_inputs(B, K, F, D, DT[dn], "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    loss = sf.topk_sae_loss if op == "topk" else lambda *a: sf.hierarchical_sae_loss(*a, deterministic=det)
    fn = lambda: torch.autograd.grad(loss(idx, w, v, b, t), ps)  # noqa: E731
    for _ in range(10):
        fn()
    bench = [do_bench(fn, warmup=25, rep=200) for _ in range(3)]
    dev = [harness.device_time(fn, max(bench)) for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    launches = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    return dict(op=op, dtype=dn, K=K, deterministic=det, device_ms=statistics.median(d for d in dev if d is not None),
                device_rounds=dev, bench_ms=statistics.median(bench), bench_rounds=bench,
                idle_host_ms=harness.idle_host_ms(fn), launches=launches)


for step in STEPS:
    out["steps"].append(measure(*step))
    print(json.dumps(out["steps"][-1]), flush=True)
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
