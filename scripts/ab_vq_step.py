"""Time one VectorQuantizer training step (the bench's vq_step case) with whichever sparsefuse is
on PYTHONPATH: device-inclusive ms (do_bench median) and host us per step (harness.host_us). Run it
in alternating processes against an older tree to A/B a change on a host that drifts:

    mkdir _abold && git archive REV sparsefuse | tar -x -C _abold      # (not committed)
    for i in 1 2 3; do for P in $PWD/_abold $PWD; do (cd /tmp && PYTHONPATH=$P python3 \
        $OLDPWD/scripts/ab_vq_step.py $P); done; done
"""
import json, sys, torch
import sparsefuse
from sparsefuse import VectorQuantizer
from sparsefuse.bench import harness
from triton.testing import do_bench
torch.manual_seed(0)
B, K, D = 65536, 1024, 128
x = torch.randn(B, D, device="cuda").requires_grad_()
vq = VectorQuantizer(D, K, decay=0.99, threshold=1.0, commitment_weight=0.25).cuda().train()
def step():
    out, _, loss = vq(x)
    loss = loss.sum() + out.float().square().mean()
    return torch.autograd.grad(loss, x)
for _ in range(20): step()
torch.cuda.synchronize()
ms = do_bench(step, warmup=50, rep=300)
us = harness.host_us(step, n=200)
print(json.dumps(dict(tree=sys.argv[1], file=sparsefuse.__file__, ms=round(ms, 4), host_us=round(us, 1))))
