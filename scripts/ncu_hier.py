"""One hierarchical forward + backward at the benchmark shape, for ncu (GPU)."""
import sys
import torch
import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs

K = int(sys.argv[1]) if len(sys.argv) > 1 else 128
idx, w, v, b, t = make_inputs(4096, K, 65536, 2304, torch.float32, "cuda")
ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
for _ in range(2):
    torch.autograd.grad(sf.hierarchical_sae_loss(idx, w, v, b, t), ps)
torch.cuda.synchronize()
