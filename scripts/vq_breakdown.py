"""Where one VectorQuantizer training step's time goes at (B, K, D) = (65536, 1024, 128) (GPU):
device time of each piece (do_bench median) and host enqueue time of each piece."""
import torch
from triton.testing import do_bench
from sparsefuse.bench.harness import host_us
from sparsefuse import VectorQuantizer, nearest_code, vq_ema_update
from sparsefuse.vq.ops import quantize

B, K, D = 65536, 1024, 128
x = torch.randn(B, D, device="cuda").requires_grad_()
vq = VectorQuantizer(D, K, decay=0.99, threshold=2.0, commitment_weight=0.25).cuda().train()
codes, _ = nearest_code(x.detach(), vq.codebook)


def step():
    out, _, loss = vq(x)
    loss = loss.sum() + out.float().square().mean()
    return torch.autograd.grad(loss, x)


def qstep():
    out, loss = quantize(x, codes, vq.codebook, 0.25)
    return torch.autograd.grad(loss + out.square().mean(), x)


pieces = {
    "nearest_code exact": lambda: nearest_code(x.detach(), vq.codebook),
    "quantize fwd+bwd (+loss ops)": qstep,
    "vq_ema_update": lambda: vq_ema_update(x.detach(), codes, vq.codebook, vq.cluster_size, vq.embed_sum,
                                           vq.steps_since_active, _check_codes=False, **vq._update_kwargs()),
    "full step": step,
}
for name, fn in pieces.items():
    fn(); fn(); torch.cuda.synchronize()
    ms = do_bench(fn, warmup=50, rep=300)
    print(f"{name:30} device-bound median {ms * 1e3:7.1f} us   host enqueue {host_us(fn, 20, 0):7.1f} us")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as p:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
