"""Can the hierarchical fp32 backward's F x D zero-fill hide behind the forward sweep? (GPU only)

Times, at the benchmark's shape (fp32, K in 32/64/128): the forward kernel alone, the zero-fill
alone, both on one stream, and the zero-fill on a side stream (normal or high priority, forked
before or after the forward's launch) joined before the end. Also whole fwd + bwd kernel chains
with the buffer zeroed in line or on the side stream. Writes JSON to argv[1].
"""
import json
import sys

import torch
from triton.testing import do_bench

from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

B, F, D = 4096, 65536, 2304
main = torch.cuda.current_stream()
sides = {"normal": torch.cuda.Stream(priority=0), "high": torch.cuda.Stream(priority=-1)}
out = []
for K in (32, 64, 128):
    idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
    g = torch.ones((), device="cuda")
    buf = torch.empty(F, D, device="cuda")
    _, etot = kn.hierarchical_loss_fwd(idx, w, v, b, t)

    def fwd():
        return kn.hierarchical_loss_fwd(idx, w, v, b, t)

    def zero():
        buf.zero_()

    def seq():
        fwd(); zero()

    def side(name, first):
        s = sides[name]

        def f():
            if not first:
                fwd()
            s.wait_stream(main)
            with torch.cuda.stream(s):
                zero()
            if first:
                fwd()
            main.wait_stream(s)
        return f

    orig_zeros = torch.zeros

    def bwd_with(prezeroed):
        def zeros(*a, **k):
            if tuple(a) == (F, D) or (len(a) == 1 and tuple(a[0]) == (F, D)):
                return buf if prezeroed else buf.zero_()
            return orig_zeros(*a, **k)
        torch.zeros = zeros
        try:
            kn.hierarchical_loss_bwd(g, idx, w, v, b, t, etot, True, False)
        finally:
            torch.zeros = orig_zeros

    def step_seq():
        fwd(); bwd_with(False)

    def step_side(name):
        s = sides[name]

        def f():
            s.wait_stream(main)
            with torch.cuda.stream(s):
                zero()
            fwd()
            main.wait_stream(s)
            bwd_with(True)
        return f

    cases = {"fwd": fwd, "zero": zero, "fwd+zero seq": seq}
    for name in sides:
        for first in (True, False):
            cases[f"zero on {name} side stream, forked {'before' if first else 'after'} fwd"] = side(name, first)
    cases["step seq"] = step_seq
    for name in sides:
        cases[f"step, zero on {name} side stream"] = step_side(name)
    row = dict(K=K)
    for rnd in range(3):
        for name, fn in cases.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            row.setdefault(name, []).append(do_bench(fn, warmup=25, rep=200))
    row = {k: (v if k == "K" else sorted(v)[1]) for k, v in row.items()}
    print(json.dumps(row), flush=True)
    out.append(row)
    del idx, w, v, b, t, buf, etot
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
