"""The dense half of an SAE step at D = 2304, F = 65536, K = 64, B = 4096, bf16 (GPU): ways to run the
encoder product and the top-k over [B, F], each timed alone (do_bench medians)."""
import torch
import torch.nn.functional as F
from triton.testing import do_bench

B, D, N, K = 4096, 2304, 65536, 64
x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(N, D, device="cuda") / D**0.5).to(torch.bfloat16)
b = torch.randn(N, device="cuda", dtype=torch.bfloat16) * 0.01
pre = F.linear(x, w, b)
out = torch.empty_like(pre)


def two_stage(t, chunks):
    part = t.view(B, chunks, N // chunks).topk(K, dim=-1)
    cand = part.values.view(B, -1)
    top = cand.topk(K, dim=-1, sorted=True)
    base = (torch.arange(chunks, device="cuda") * (N // chunks)).repeat_interleave(K)
    return top.values, (part.indices.view(B, -1) + base).gather(1, top.indices)


parts = {
    "F.linear(x, w, b)": lambda: F.linear(x, w, b),
    "F.linear(x, w)": lambda: F.linear(x, w),
    "torch.mm(x, w.t(), out=)": lambda: torch.mm(x, w.t(), out=out),
    "addmm(b, x, w.t())": lambda: torch.addmm(b, x, w.t()),
    "relu(F.linear)": lambda: F.relu(F.linear(x, w, b)),
    "topk sorted": lambda: pre.topk(K, dim=-1, sorted=True),
    "topk unsorted": lambda: pre.topk(K, dim=-1, sorted=False),
    "topk fp32 input": lambda: pre.float().topk(K, dim=-1, sorted=True),
}
for chunks in (4, 16, 64):
    parts[f"two-stage topk, {chunks} chunks"] = lambda c=chunks: two_stage(pre, c)
want = pre.topk(K, dim=-1, sorted=True).values
for chunks in (4, 16, 64):
    assert torch.equal(two_stage(pre, chunks)[0], want)
for name, fn in parts.items():
    fn()
    ms = do_bench(fn, warmup=25, rep=200)
    print(f"{name:34} {ms:7.3f} ms")
