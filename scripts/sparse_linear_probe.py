"""Where ``sparse_linear``'s forward + backward time goes at the SAE encoder's shape (GPU): B = 4096,
K = 64, F = 65536, D = 2304, bf16; each piece timed alone (do_bench medians), and the segmented
weight-gradient kernel at a few tile widths / warp counts."""
import torch
from triton.testing import do_bench

from sparsefuse.sae import kernels
from sparsefuse.sae.ops import sparse_linear

B, K, N, D = 4096, 64, 65536, 2304
x = torch.randn(B, D, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(N, D, device="cuda") / D**0.5).to(torch.bfloat16).requires_grad_()
bias = torch.zeros(N, device="cuda", dtype=torch.bfloat16).requires_grad_()
idx = torch.randn(B, N, device="cuda").topk(K, dim=-1).indices
g = torch.randn(B, K, device="cuda", dtype=torch.bfloat16)
xg = x.clone().requires_grad_()
keys = idx.reshape(-1)
sorted_keys = keys.sort().values


def seg(block_d, warps):
    out = torch.empty(N, D, device="cuda", dtype=w.dtype)
    wsum = torch.empty(N, device="cuda", dtype=torch.float32)
    sk, order = torch.sort(keys, stable=True)
    s = torch.searchsorted(sk, kernels._feature_range(N + 1, keys.device, keys.dtype))
    part, wpart = x[:1].float(), wsum[:1]  # never read: CHUNK is longer than any segment (no partial sums)
    return lambda: kernels._launch(
        kernels._sae_weight_grad_kernel, (N, -(-D // block_d)), s, order, g, x, part, wpart, None, out, wsum, K, D,
        D, WEIGHTED=True, ROW_PER_ENTRY=False, HAS_SCALE=False, HAS_WSUM=True, ACC=kernels.tl.float32,
        BLOCK_D=block_d, CHUNK=1 << 40, E=4, num_warps=warps)


parts = {
    "fwd + bwd (x needs grad)": lambda: torch.autograd.grad(sparse_linear(xg, w, idx, bias), (xg, w, bias), g),
    "fwd + bwd (x frozen)": lambda: torch.autograd.grad(sparse_linear(x, w, idx, bias), (w, bias), g),
    "fwd (row_dot)": lambda: kernels.sparse_linear_fwd(x, w, idx, bias, None, None),
    "grad_x (embedding bag)": lambda: kernels.decode_fwd(idx, g, w, None),
    "sort int64 keys": lambda: torch.sort(keys, stable=True),
    "sort int32 keys": lambda: torch.sort(keys.int(), stable=True),
    "searchsorted": lambda: torch.searchsorted(sorted_keys, kernels._feature_range(N + 1, keys.device, keys.dtype)),
    "weight_grad (sort + kernel)": lambda: kernels.weight_grad(idx, x, g, N, w.dtype),
}
for bd, nw in ((512, 2), (256, 1), (256, 2), (1024, 4), (128, 1), (2048, 8)):
    parts[f"segment kernel BLOCK_D={bd} warps={nw}"] = seg(bd, nw)
for name, fn in parts.items():
    fn()
    print(f"{name:40} {do_bench(fn, warmup=25, rep=200):7.3f} ms")
