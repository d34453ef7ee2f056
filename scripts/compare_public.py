"""Head-to-head with the public Triton kernels the SAE targets are set against: flex-sae
(github.com/corl-team/flexsae at d147d2f, torch-ext/flex_sae/topk_kernels.py and
hierarchical_kernels.py). They are not part of this repository (the TopK file is CC-BY-NC-4.0);
put the two files in a folder and pass it:

    python scripts/compare_public.py FOLDER      # GPU; writes $OUT/sae_public.json and sae_public.md

One run times sparsefuse, flex-sae and torch.compile of our reference on the shapes of
``sparsefuse bench sae`` with its cases and rounds (``sparsefuse.bench.sae._case``), after checking
flex-sae's loss and gradients against the float64 reference on a small problem.
"""
import importlib.util
import os
import sys

import torch

from sparsefuse.bench import harness
from sparsefuse.bench.sae import OPS, _case, make_inputs


def _load(folder, name):
    spec = importlib.util.spec_from_file_location(f"flexsae_{name}", os.path.join(folder, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _max_rel_err(fn, ref):
    idx, w, v, b, t = make_inputs(64, 32, 1024, 512, torch.float32, "cuda")
    params = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    got = [fn(idx, *params, t)]
    got += torch.autograd.grad(got[0], params)
    p64 = [p.detach().double().requires_grad_() for p in params]
    want = [ref(idx, *p64, t.double())]
    want += torch.autograd.grad(want[0], p64)
    return max(float((a.detach().double() - c.detach()).norm() / c.detach().norm()) for a, c in zip(got, want))


def main(folder):
    public = {"topk": _load(folder, "topk_kernels").triton_topk_sae_loss,
              "hierarchical": _load(folder, "hierarchical_kernels").triton_hierarchical_sae_loss}
    for op, fn in public.items():
        print(f"flex-sae {op}: max relative error vs float64 reference {_max_rel_err(fn, OPS[op][1]):.2e}")
    B, F, D = 4096, 65536, 2304
    cases = []
    for K in (32, 64, 128):
        for op, (ours, ref) in OPS.items():
            compiled = torch.compile(ref, dynamic=False)
            for provider, fn in (("sparsefuse", ours), ("flex-sae", public[op]), ("torch.compile", compiled)):
                for dtype in ("fp32", "bf16"):
                    cases.append(_case(op, provider, fn, B, K, F, D, dtype))
    results = harness.run_cases(cases)
    out = os.environ.get("OUT", ".")
    harness.save(results, "sae_public", out)
    table = harness.speedup_table(results, baselines=("flex-sae", "torch.compile"), shape_keys=["K"],
                                  device_baselines=("flex-sae", "torch.compile"))
    with open(os.path.join(out, "sae_public.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main(sys.argv[1])
