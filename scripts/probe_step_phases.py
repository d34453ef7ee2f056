"""Where the host time of one eager TopK step goes, by phase (GPU machine; tiny shapes, so the GPU
never limits): the forward call; from autograd.grad's call to our backward launcher's start (the
engine, its hand-off to the device thread, our backward's Python); the launcher; from its return to
autograd.grad's return. A trivial autograd.grad and the same phases with torch.sort alone are
the yardsticks. Medians of 500 steps, microseconds; steps back to back (tiny shapes), or each after a
synchronize (the GPU held by a sleep at the full shape), and our backward launcher called directly
on the main thread beside them. Writes JSON to argv[1]."""
import json
import statistics
import sys
import time

import torch

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

pc = time.perf_counter
marks = {}
inner = kn.topk_loss_bwd


def timed_bwd(*a):
    marks["b0"] = pc()
    out = inner(*a)
    marks["b1"] = pc()
    return out


kn.topk_loss_bwd = timed_bwd
res = {}
SHAPES = ((64, 32, 1024, 256), (4096, 32, 65536, 2304))
for SYNC, (B, K, F, D) in [(False, SHAPES[0]), (True, SHAPES[0]), (True, SHAPES[1])]:
    idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    x = torch.randn(8, device="cuda", requires_grad=True)
    rows = {k: [] for k in ("fwd", "to_bwd", "bwd", "after_bwd", "step", "trivial_grad")}
    g = torch.ones((), device="cuda")
    _, resid, gv = kn.topk_loss_fwd(idx, w.detach(), v.detach(), b.detach(), t)
    rows["direct_bwd_launcher"] = []
    for i in range(600):
        if SYNC:
            torch.cuda.synchronize()
            if B > 64:
                torch.cuda._sleep(2_000_000)  # keep the GPU busy so the host never waits on it
        elif i % 50 == 0:
            torch.cuda.synchronize()  # tiny shapes: the GPU keeps up; just bound the queue
        t0 = pc()
        loss = sf.topk_sae_loss(idx, w, v, b, t)
        t1 = pc()
        torch.autograd.grad(loss, ps)
        t2 = pc()
        y = (x * 2).sum()
        t3 = pc()
        torch.autograd.grad(y, [x])
        t4 = pc()
        inner(g, idx, v.detach(), w.detach(), resid, gv, True, b.dtype)
        t5 = pc()
        if i >= 100:
            rows["direct_bwd_launcher"].append(t5 - t4)
            rows["fwd"].append(t1 - t0)
            rows["to_bwd"].append(marks["b0"] - t1)
            rows["bwd"].append(marks["b1"] - marks["b0"])
            rows["after_bwd"].append(t2 - marks["b1"])
            rows["step"].append(t2 - t0)
            rows["trivial_grad"].append(t4 - t3)
    key = f"B={B} K={K} F={F} D={D} {'synced, GPU held by a sleep' if SYNC else 'back to back'}"
    res[key] = {k: 1e6 * statistics.median(v) for k, v in rows.items()}
    print(key, json.dumps({k: round(v, 1) for k, v in res[key].items()}), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)

# The same Python work (a few allocations and small launches) timed inside a backward, which the
# engine runs on its CUDA device thread, and called directly on the main thread.
def work(z):
    outs = [torch.empty(64, device="cuda") for _ in range(10)]
    for o in outs[:5]:
        o.fill_(1.0)
    return z.sum() + outs[0][0]


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        return z * 1.0

    @staticmethod
    def backward(ctx, gz):
        marks["w0"] = pc()
        work(gz)
        marks["w1"] = pc()
        return gz


z = torch.randn(8, device="cuda", requires_grad=True)
inside, direct = [], []
for i in range(600):
    if i % 50 == 0:
        torch.cuda.synchronize()
    torch.autograd.grad(_Probe.apply(z).sum(), [z])
    t0 = pc()
    work(z.detach())
    t1 = pc()
    if i >= 100:
        inside.append(marks["w1"] - marks["w0"])
        direct.append(t1 - t0)
res["same Python work"] = {"in backward (device thread)": 1e6 * statistics.median(inside),
                           "direct (main thread)": 1e6 * statistics.median(direct)}
print(json.dumps(res["same Python work"]), flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
