"""A/B of eager vq_ema_update across checkouts, on one GPU machine (host time moves a lot from one
machine start to the next, so only an interleaved comparison on one machine means much).

    mkdir -p .ab/old && git archive <commit> sparsefuse | tar -x -C .ab/old   # untracked packages
    python scripts/ab_vq_ema_host.py $PWD .ab/old [.ab/older ...]              # GPU

Each version runs in its own process, four interleaved rounds; per case the eager update and the
same update replayed from a CUDA graph (device time only). Session 12's output:
benchmarks/logs/vq_ema_ab_session12.log; session 44's: vq_ema_ab_session44_h200.log.
"""
import os
import subprocess
import sys

code = r'''
import sys; sys.path.insert(0, sys.argv[1])
import torch, sparsefuse
from triton.testing import do_bench
from sparsefuse.bench.vq import make_state, _ema_kwargs
from sparsefuse import vq_ema_update
assert sparsefuse.__file__.startswith(sys.argv[1]), sparsefuse.__file__
res = {}
for sem in ("active", "laplace"):
    for B, K, D in ((640, 256, 64), (65536, 1024, 128)):
        st = make_state(B, K, D, "cuda"); kw = _ema_kwargs(sem)
        res[f"{sem} B={B}"] = round(do_bench(lambda: vq_ema_update(*st, **kw), warmup=50, rep=300, return_mode="median"), 4)
        side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            vq_ema_update(*st, **kw)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            vq_ema_update(*st, **kw)
        res[f"{sem} B={B} graph"] = round(do_bench(g.replay, warmup=50, rep=300, return_mode="median"), 4)
print(res)
'''
for r in range(4):
    for path in map(os.path.abspath, sys.argv[1:]):  # the child checks its import against it
        out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True)
        print(r, path, out.stdout.strip()[-400:], out.stderr.strip()[-300:] if out.returncode else "", flush=True)
