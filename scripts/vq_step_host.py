"""Where the eager VectorQuantizer step's time goes on the GPU host: the step timed five times in a
row, its host enqueue time, and the host time of each public call it makes (GPU)."""
import torch
from triton.testing import do_bench

from sparsefuse import nearest_code, vq_ema_update
from sparsefuse.vq import quantize
from sparsefuse.bench import harness, vq as bvq

B, K, D = bvq.STEP_SHAPE
for provider in ("sparsefuse", "vector-quantize-pytorch"):
    step = bvq._step_case(provider, B, K, D).make()
    step()
    torch.cuda.synchronize()
    ms = [do_bench(step, warmup=50, rep=300) for _ in range(5)]
    print(f"{provider}: step " + " / ".join(f"{m:.3f}" for m in ms) + f" ms; host {harness.host_us(step, 100):.0f} us")
vq = bvq.VectorQuantizer(D, K, decay=0.99, threshold=bvq.THRESHOLD, commitment_weight=0.25).cuda().train()
x = torch.randn(B, D, device="cuda", requires_grad=True)
codes, _ = nearest_code(x.detach(), vq.codebook)
parts = {
    "nearest_code": lambda: nearest_code(x.detach(), vq.codebook),
    "quantize fwd": lambda: quantize(x, codes, vq.codebook, 0.25),
    "ema update": lambda: vq_ema_update(x.detach(), codes, vq.codebook, vq.cluster_size, vq.embed_sum,
                                        vq.steps_since_active, _check_codes=False, **vq._update_kwargs()),
    "module fwd": lambda: vq(x),
    "grad of a trivial graph": lambda: torch.autograd.grad((x * 2).sum(), x),
}
for name, fn in parts.items():
    print(f"  host {name:<24} {harness.host_us(fn, 200):7.1f} us   device+host {do_bench(fn, warmup=50, rep=200) * 1e3:7.1f} us")
