"""Quick GPU correctness probe used before timing: ops vs float64 reference at a mid size."""
import torch
from sparsefuse.bench.sae import make_inputs, OPS
for dt in (torch.float32, torch.bfloat16):
    for K in (1, 37, 128):
        idx, w, v, b, t = make_inputs(300, K, 5000, 777, dt, "cuda")
        for name, (ours, ref) in OPS.items():
            ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
            got = [ours(idx, w, v, b, t)]; got += torch.autograd.grad(got[0], ps)
            p64 = [p.detach().double().requires_grad_() for p in ps]
            want = [ref(idx, *p64, t.double())]; want += torch.autograd.grad(want[0], p64)
            errs = [float((a.detach().double() - c).norm() / c.norm()) for a, c in zip(got, want)]
            print(f"{str(dt):15} K={K:<4} {name:13} rel err loss/w/v/b: " + " ".join(f"{e:.1e}" for e in errs))
