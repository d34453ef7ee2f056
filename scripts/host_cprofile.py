"""Python-level host profile of eager SAE loss steps (GPU machine, tiny shapes: the GPU never limits)."""
import cProfile
import pstats
import sys

import torch

import sparsefuse as sf
from sparsefuse.bench.harness import host_us
from sparsefuse.bench.sae import make_inputs

OPS = {"topk": sf.topk_sae_loss, "hierarchical": sf.hierarchical_sae_loss}
for name, op in OPS.items():
    for dt in (torch.float32, torch.bfloat16):
        idx, w, v, b, t = make_inputs(64, 32, 1024, 256, dt, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(op(idx, w, v, b, t), ps)  # noqa: E731
        print(f"== {name} {dt}: step {host_us(fn, 500):.1f} us", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(300):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)
