"""Host time of the pieces of one eager TopK SAE step (GPU machine; tiny shapes, so the GPU never limits)."""
import torch
import sparsefuse as sf
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.harness import host_us
from sparsefuse.bench.sae import make_inputs

idx, w, v, b, t = make_inputs(64, 32, 1024, 256, torch.float32, "cuda")
ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
x = torch.randn(8, device="cuda", requires_grad=True)
loss0 = sf.topk_sae_loss(idx, w, v, b, t)
_, resid, gv = kn.topk_loss_fwd(idx, w.detach(), v.detach(), b.detach(), t)
g = torch.ones((), device="cuda")
rows = {
    "autograd.grad of (x*2).sum()": lambda: torch.autograd.grad((x * 2).sum(), [x]),
    "topk fwd, no grad": lambda: sf.topk_sae_loss(idx, w.detach(), v.detach(), b.detach(), t),
    "topk fwd with grad": lambda: sf.topk_sae_loss(idx, w, v, b, t),
    "topk fwd+bwd": lambda: torch.autograd.grad(sf.topk_sae_loss(idx, w, v, b, t), ps),
    "kernels.topk_loss_fwd": lambda: kn.topk_loss_fwd(idx, w, v, b, t),
    "kernels.topk_loss_bwd": lambda: kn.topk_loss_bwd(g, idx, v, w, resid, gv, True, b.dtype),
    "kernels.weight_grad": lambda: kn.weight_grad(idx, resid, v, 1024, torch.float32, scale=g),
    "_check_loss_inputs": lambda: sf.sae.ops._check_loss_inputs(idx, w, v, b, t),
    "hier fwd+bwd": lambda: torch.autograd.grad(sf.hierarchical_sae_loss(idx, w, v, b, t), ps),
}
for name, fn in rows.items():
    print(f"{name:32} {host_us(fn, 500):7.1f} us")

# Where the host time of one eager TopK step goes, op by op (CPU self time, 50 steps).
from torch.profiler import ProfilerActivity, profile

step = rows["topk fwd+bwd"]
for _ in range(20):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(50):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
