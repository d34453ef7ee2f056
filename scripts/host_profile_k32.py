import torch
from torch.profiler import ProfilerActivity, profile
import sparsefuse as sf
from sparsefuse.bench.harness import host_us
from sparsefuse.bench.sae import make_inputs
for name, op in (("topk", sf.topk_sae_loss), ("hier", sf.hierarchical_sae_loss)):
    for dt in (torch.float32, torch.bfloat16):
        idx, w, v, b, t = make_inputs(64, 32, 1024, 256, dt, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(op(idx, w, v, b, t), ps)
        fwd = lambda: op(idx, w, v, b, t)
        print(f"{name} {dt}: step {host_us(fn, 500):.1f} us, forward only {host_us(fwd, 500):.1f} us", flush=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22), flush=True)
x = torch.randn(8, device="cuda", requires_grad=True)
print("autograd.grad trivial", host_us(lambda: torch.autograd.grad((x * 2).sum(), [x]), 500))
print("empty", host_us(lambda: torch.empty(10, device="cuda"), 500))
y = torch.randn(4096, 2304, device="cuda")
print("sum(0)", host_us(lambda: y.sum(0), 500))
k = torch.randint(0, 65536, (131072,), device="cuda", dtype=torch.int32)
print("sort", host_us(lambda: torch.sort(k, stable=True), 500))
