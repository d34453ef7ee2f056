"""Run-to-run bit identity of the kernels racecheck flags (Triton's reductions write replicated
values to shared memory from several threads): nearest_code's distances and codes, and the SAE
decode's loss and gradients, repeated on the same inputs. Prints one JSON line per case."""
import json

import torch

import sparsefuse
from sparsefuse.bench.sae import make_inputs

REPS = 200


def count_mismatch(fn):
    first = [t.clone() for t in fn()]
    bad = 0
    for _ in range(REPS):
        bad += any(not torch.equal(a, b) for a, b in zip(first, fn()))
    return bad


g = torch.Generator(device="cuda").manual_seed(0)
for B, K, D in ((37, 300, 77), (4096, 1024, 256)):
    x = torch.randn(B, D, device="cuda", generator=g)
    c = torch.randn(K, D, device="cuda", generator=g)
    for cosine in (False, True):
        for prec in ("exact", "ieee", "fast"):
            bad = count_mismatch(lambda: sparsefuse.nearest_code(x, c, cosine=cosine, precision=prec))
            print(json.dumps(dict(op="nearest_code", B=B, K=K, D=D, cosine=cosine, precision=prec, reps=REPS,
                                  runs_differing=bad)), flush=True)
for B, K, F, D in ((13, 7, 300, 77), (4096, 64, 65536, 2304)):
    i, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    for name, f in (("topk", sparsefuse.topk_sae_loss), ("hierarchical", sparsefuse.hierarchical_sae_loss)):
        def run():
            loss = f(i, w, v, b, t, deterministic=True)
            return [loss.detach(), *torch.autograd.grad(loss, ps)]
        print(json.dumps(dict(op=name, B=B, K=K, F=F, D=D, deterministic=True, reps=REPS,
                              runs_differing=count_mismatch(run))), flush=True)
