"""Where the fp32 hierarchical step's peak memory goes, fused forward against the split one: memory
allocated after each stage and the peak within it (F = 65536, D = 2304, B = 4096, K = 64).

    python scripts/probe_hier_memory.py
"""

import torch

import sparsefuse
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels, ops

F, D, B, K = 65536, 2304, 4096, 64
MiB = 2**20
real_fuse = ops._fuse_hierarchical


def traced(name, fn):
    def wrapper(*args, **kwargs):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **kwargs)
        print(f"    {name:28s} allocated {before / MiB:9.1f} -> {torch.cuda.memory_allocated() / MiB:9.1f} MiB, "
              f"peak {torch.cuda.max_memory_allocated() / MiB:9.1f}")
        return out
    return wrapper


for name in ("hierarchical_loss_fwd", "hierarchical_loss_bwd", "hierarchical_loss_fwd_grads",
             "hierarchical_grads_finish"):
    setattr(kernels, name, traced(name, getattr(kernels, name)))

idx, weight, vals, bias, target = make_inputs(B, K, F, D, torch.float32, "cuda")
params = [weight.requires_grad_(), vals.requires_grad_(), bias.requires_grad_()]
for fused in (False, True, False, True):
    ops._fuse_hierarchical = real_fuse if fused else (lambda *a: False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    print("fused" if fused else "split", f"base {base / MiB:.1f} MiB")
    loss = sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target)
    print(f"    after forward: allocated {torch.cuda.memory_allocated() / MiB:.1f}")
    grads = torch.autograd.grad(loss, params)
    torch.cuda.synchronize()
    print(f"    after backward: allocated {torch.cuda.memory_allocated() / MiB:.1f}, grads held "
          f"{sum(g.numel() * g.element_size() for g in grads) / MiB:.1f}")
    del loss, grads
    torch.cuda.synchronize()
    print(f"    after del: allocated {torch.cuda.memory_allocated() / MiB:.1f}")
