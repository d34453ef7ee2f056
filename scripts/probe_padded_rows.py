"""Rows padded with zero vals (the README's recipe for BatchTopK / JumpReLU rows of varying length),
GPU only: what the padding index costs. Writes JSON to argv[1].

B = 4096, F = 65536, D = 2304, K = 64, fp32 and bf16; forward + backward (weight, vals, bias) of
both losses, median of three do_bench rounds:

* ``full``: every slot a real latent (the benchmark's inputs);
* ``pad0``: the last half of every row's slots padded with vals 0 at index 0, so B·K/2 entries
  share one feature;
* ``spread``: the same slots padded at index (b·K + j) mod F, spread over the features as real
  latents are.

The Hierarchical default backward adds every slot's row to the weight gradient with atomics, padded
or not, so ``pad0`` puts B·K/2 adds on one row's addresses; the segmented sums (TopK, and the
deterministic Hierarchical) take a crowded feature through their chunk partials.

Optional: argv[2] K (default 64); argv[3] the steps to time, from "topk,hier,det" (default all).
"""
import json
import statistics
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
K = int(sys.argv[2]) if len(sys.argv) > 2 else 64
STEPS = sys.argv[3].split(",") if len(sys.argv) > 3 else ["topk", "hier", "det"]
out = {"sparsefuse": sf.__file__, "shape": dict(B=B, K=K, F=F, D=D), "ms": {}}


def bench(name, fn, rounds=3):
    fn()
    ts = [do_bench(fn, warmup=10, rep=100) for _ in range(rounds)]
    out["ms"][name] = statistics.median(ts)
    print(f"{name}: {out['ms'][name]:.3f} ms", flush=True)


def run(dt):
    idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
    half = slice(K // 2, K)
    spread = ((torch.arange(B, device="cuda")[:, None] * K + torch.arange(K, device="cuda")) % F).to(idx.dtype)
    cases = {"full": (idx, v)}
    for label, pad_idx in (("pad0", torch.zeros_like(idx)), ("spread", spread)):
        i2, v2 = idx.clone(), v.clone()
        i2[:, half], v2[:, half] = pad_idx[:, half], 0
        cases[label] = (i2, v2)
    name = str(dt).split(".")[-1]
    w.requires_grad_(), b.requires_grad_()
    for label, (ids, vals) in cases.items():
        vals = vals.clone().requires_grad_()
        ps = [w, vals, b]
        if "topk" in STEPS:
            bench(f"topk {name} {label}", lambda: torch.autograd.grad(sf.topk_sae_loss(ids, w, vals, b, t), ps))
        for det in [d for d, step in ((False, "hier"), (True, "det")) if step in STEPS]:
            bench(f"hier {'det' if det else 'default'} {name} {label}", lambda: torch.autograd.grad(
                sf.hierarchical_sae_loss(ids, w, vals, b, t, deterministic=det), ps))


for dt in (torch.float32, torch.bfloat16):
    run(dt)
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
