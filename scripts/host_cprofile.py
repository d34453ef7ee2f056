"""Python-level host profile of eager SAE loss steps (GPU machine, tiny shapes: the GPU never limits)."""
import torch

import sparsefuse as sf
from sparsefuse.bench.harness import host_profile, host_us
from sparsefuse.bench.sae import make_inputs

OPS = {"topk": sf.topk_sae_loss, "hierarchical": sf.hierarchical_sae_loss}
for name, op in OPS.items():
    for dt in (torch.float32, torch.bfloat16):
        idx, w, v, b, t = make_inputs(64, 32, 1024, 256, dt, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(op(idx, w, v, b, t), ps)  # noqa: E731
        print(f"== {name} {dt}: step {host_us(fn, 500):.1f} us", flush=True)
        host_profile(fn, 300, 25)
