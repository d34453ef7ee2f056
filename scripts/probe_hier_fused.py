"""Hierarchical loss, forward + backward step on a GPU: the fused forward (the forward launch also
runs the backward's sweep) against the two-pass split, same process, round-robin rounds.

    python scripts/probe_hier_fused.py [out.json]
"""

import json
import statistics
import sys

import torch
import triton.testing

import sparsefuse
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import ops

F, D, B = 65536, 2304, 4096
real_fuse = ops._fuse_hierarchical


def step_fn(dtype, K, fused, deterministic=False):
    idx, weight, vals, bias, target = make_inputs(B, K, F, D, dtype, "cuda")
    params = [weight.requires_grad_(), vals.requires_grad_(), bias.requires_grad_()]

    def step():
        ops._fuse_hierarchical = real_fuse if fused else (lambda *a: False)
        loss = sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target, deterministic=deterministic)
        return torch.autograd.grad(loss, params)

    return step


def main():
    cases = []
    for K in (32, 64, 128):
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            for fused in ((False, True) if dtype != torch.float32 else (False,)):
                cases.append((f"{name} K={K} {'fused' if fused else 'split'}", step_fn(dtype, K, fused)))
        cases.append((f"fp32 K={K} deterministic split", step_fn(torch.float32, K, False, True)))
        cases.append((f"fp32 K={K} deterministic fused", step_fn(torch.float32, K, True, True)))
    times = {name: [] for name, _ in cases}
    for _ in range(3):
        for name, fn in cases:
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=300))
            torch.cuda.synchronize()
    # accuracy of the fused bf16 / fp16 gradients against fp64, small case
    res = {name: dict(ms=statistics.median(t), rounds=t) for name, t in times.items()}
    for name, r in res.items():
        print(f"{name:34s} {r['ms']:.3f} ms  rounds {', '.join(f'{x:.3f}' for x in r['rounds'])}")
    peak = {}
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for fused in (False, True):
            fn = step_fn(dtype, 64, fused)
            fn()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak[f"{name} K=64 {'fused' if fused else 'split'}"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    print("peak extra MiB", peak)
    if len(sys.argv) > 1:
        json.dump(dict(times=res, peak_extra_mib=peak, device=torch.cuda.get_device_name()), open(sys.argv[1], "w"),
                  indent=1)


if __name__ == "__main__":
    main()
