"""A/B of the KD row backward with and without the A = 0 guard on its dense term (session 39: a
fully masked token whose logits are all -inf got a NaN gradient row). The kernels before the change
must be in ``sparsefuse/kd/_kernels_before.py`` (``git show fb990ed:sparsefuse/kd/kernels.py >
sparsefuse/kd/_kernels_before.py``); ``ops.kernels`` is swapped between the two, alternating, three
rounds of do_bench and device time per normalize on full forward + backward steps of
``topk_kd_loss_from_logits`` at the KD benchmark's shape (N = 8192, V = 128256, K = 64, bf16), and
of the from-hidden loss ("full"). JSON to argv[1]."""
import json
import statistics
import sys

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse.bench.harness import device_time
from sparsefuse.bench.kd import ISSUE_SHAPE, make_targets
from sparsefuse.kd import _kernels_before, kernels, ops

N, H, V, K = (ISSUE_SHAPE[k] for k in "NHVK")
dtype = torch.bfloat16
ids, t, m = make_targets(N, K, V, "cuda")
rows = []
for form in ("logits-full", "logits-tail", "hidden-full"):
    if form.startswith("logits"):
        z = (torch.randn(N, V, device="cuda") * 3).to(dtype).requires_grad_()
        norm = form.split("-")[1]
        fn = lambda: torch.autograd.grad(  # noqa: E731
            sparsefuse.topk_kd_loss_from_logits(z, ids, t, m, normalize=norm), [z])
        ps = [z]
    else:
        h = torch.randn(N, H, device="cuda").to(dtype).requires_grad_()
        w = (torch.randn(V, H, device="cuda") / H**0.5).to(dtype).requires_grad_()
        fn = lambda: torch.autograd.grad(  # noqa: E731
            sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, m, normalize="full"), [h, w])
        ps = [h, w]
    times = {"before": [], "after": []}
    dev = {"before": [], "after": []}
    for _ in range(3):
        for name, mod in (("before", _kernels_before), ("after", kernels)):
            ops.kernels = mod
            fn()
            ms = do_bench(fn, warmup=10, rep=50)
            times[name].append(ms)
            dev[name].append(device_time(fn, ms))
    ops.kernels = kernels
    row = dict(form=form, **{f"ms_{n}": statistics.median(x) for n, x in times.items()},
               **{f"device_ms_{n}": statistics.median(x) for n, x in dev.items()}, rounds=times, device_rounds=dev)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del fn, ps
    torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
