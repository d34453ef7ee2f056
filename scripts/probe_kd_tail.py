r"""The "tail" term's cost: the logits form's forward and forward + backward for "full" and "tail",
with the kernels before a change and after, alternated in one process. Bench shape (N = 8192,
V = 128256, K = 64, bf16). Writes $OUT/probe_kd_tail.json.

The kernels before are not in the tree; make them, untracked, from the commit before the change
(session 23's exact tail: 040c9c2; session 24's bit map: d7f4ccb; session 27's repeated-id check in the
forward and the barrier before the backward's sweep: f165d28) before the device run:
    git show d7f4ccb:sparsefuse/kd/kernels.py | sed -e 's/^from \.\._/from sparsefuse._/' \
        -e 's/^from \.reference/from sparsefuse.kd.reference/' > scripts/_kd_kernels_before.py
"""

import importlib.util
import json
import os

import torch
from triton.testing import do_bench

from sparsefuse.bench.kd import make_targets
from sparsefuse.kd import kernels as after

BEFORE = os.path.join(os.path.dirname(__file__), "_kd_kernels_before.py")
spec = importlib.util.spec_from_file_location("kd_before", BEFORE)
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

N, V, K = (int(x) for x in os.environ.get("SHAPE", "8192,128256,64").split(","))
dev = "cuda"
torch.manual_seed(0)
z = (torch.randn(N, V, device=dev) * 2).bfloat16()
ids, t, m = make_targets(N, K, V, dev, distinct=True)  # "tail" poisons a token whose ids repeat (session 27)
one = torch.ones((), device=dev)


def fwd(mod, nz):
    return mod.logits_fwd(z, ids, t, m, nz, 1.0, 1, None, 1.0)


def step(mod, nz):
    loss, tok, scale, lse, A, corr = fwd(mod, nz)
    return mod.logits_bwd(one, None, z, ids, m, lse, A, corr, scale, nz, 1.0)


# the two agree where the old 1 - Q resolves (random logits: the off-slot mass is large)
for nz in (1, 2):
    a, b = fwd(before, nz), fwd(after, nz)
    print("normalize", nz, "loss before/after", float(a[0]), float(b[0]),
          "grad max diff", float((step(before, nz).float() - step(after, nz).float()).abs().max()))

res = {}
for rnd in range(3):
    for name, mod in (("before", before), ("after", after)):
        for nz, label in ((1, "full"), (2, "tail")):
            for what, fn in (("fwd", lambda: fwd(mod, nz)), ("fwd+bwd", lambda: step(mod, nz))):
                ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
                res.setdefault(f"{name} {label} {what}", []).append(ms)
out = {k: dict(rounds=v, median=sorted(v)[1]) for k, v in res.items()}
out["device"] = torch.cuda.get_device_name()
out["shape"] = dict(N=N, V=V, K=K, dtype="bf16")
for k, v in out.items():
    print(k, v)
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_kd_tail.json"), "w"), indent=1)
