"""GPU time of the segmented sums on uniform and skewed keys, for an old/new A/B in alternating
processes (``PYTHONPATH`` picks the version). Per case: do_bench of the SAE weight gradient alone,
and the device time of a TopK / decode / deterministic Hierarchical / deterministic VQ step
(``harness.device_time``). Prints one JSON line per case; argv[1] is a label."""
import json
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench import harness
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels

label = sys.argv[1] if len(sys.argv) > 1 else "?"
B, F, D = 4096, 65536, 2304


def report(case, fn):
    wall = do_bench(fn, warmup=25, rep=200)
    print(json.dumps(dict(label=label, case=case, bench_ms=round(wall, 4),
                          device_ms=round(harness.device_time(fn, wall) or -1, 4))), flush=True)


for K in (32, 64, 128):
    for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
        resid = torch.randn(B, D, device="cuda")
        gc = torch.tensor(1e-3, device="cuda")
        report(f"weight_grad K={K} {dn}", lambda: kernels.weight_grad(idx, resid, v, F, dt, scale=gc))
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        report(f"topk step K={K} {dn}", lambda: torch.autograd.grad(sf.topk_sae_loss(idx, w, v, b, t), ps))
        if K == 64:
            report(f"hier det step K={K} {dn}",
                   lambda: torch.autograd.grad(sf.hierarchical_sae_loss(idx, w, v, b, t, deterministic=True), ps))
            dense = idx.clone()
            dense[:, :8] = torch.arange(8, device="cuda", dtype=idx.dtype)  # eight latents in every row
            report(f"topk step dense K={K} {dn}",
                   lambda: torch.autograd.grad(sf.topk_sae_loss(dense, w, v, b, t), ps))
        del idx, w, v, b, t, ps
x = torch.randn(65536, 256, device="cuda")
for name, codes in (("uniform", torch.randint(0, 1024, (65536,), device="cuda")),
                    ("half on one code", torch.where(torch.rand(65536, device="cuda") < 0.5, 0,
                                                     torch.randint(0, 1024, (65536,), device="cuda")))):
    report(f"vq det statistics {name}", lambda: sf.vq.batch_statistics(x, codes, 1024, deterministic=True))
