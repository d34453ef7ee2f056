"""The hierarchical sweeps' tile width at shapes other than the benchmark's (session 25).

The backward runs one one-warp program per (row, D tile), the D tile the slow grid axis, so that the
programs resident together share an F x BLOCK_D slice of the decoder and of its gradient in L2. With
fewer rows than resident programs (small B), or a large F, the slices in flight outgrow L2. This
times whole forward + backward steps of ``hierarchical_sae_loss`` for several (forward BLOCK_D,
backward (BLOCK_D, CHUNK, VEC)) pairs, round-robin, three rounds, medians; JSON to argv[1].
bf16 takes the fused forward (the backward's configuration), so only fp32 varies the forward's."""
import json
import statistics
import sys

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

SHAPES = [(4096, 64, 65536, 2304), (1024, 64, 65536, 2304), (4096, 64, 131072, 4096), (4096, 32, 24576, 768),
          (2048, 128, 65536, 2304)]  # (B, K, F, D)
VARIANTS = {
    torch.float32: [(fd, bwd) for fd in (64, 32, 16) for bwd in ((64, 8, 4), (32, 8, 4), (16, 8, 4), (16, 8, 2))],
    torch.bfloat16: [(None, bwd) for bwd in ((64, 8, 2), (32, 8, 2), (16, 8, 2), (16, 8, 1))],
}
default_fwd = {k: dict(v) for k, v in kn._HIER_FWD.items()}
default_bwd = {k: dict(v) for k, v in kn._HIER_BWD.items()}
rows = []
for B, K, F, D in SHAPES:
    for dtype, variants in VARIANTS.items():
        idx, w, v, b, t = make_inputs(B, K, F, D, dtype, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(sparsefuse.hierarchical_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
        times = {}
        for _ in range(3):
            for fd, (bd, ch, vec) in variants:
                if fd is not None:
                    kn._HIER_FWD[4] = dict(default_fwd[4], BLOCK_D=fd)
                kn._HIER_BWD[dtype.itemsize] = dict(BLOCK_D=bd, CHUNK=ch, VEC=vec)
                fn()
                times.setdefault((fd, bd, ch, vec), []).append(do_bench(fn, warmup=10, rep=60))
        kn._HIER_FWD.update({k: dict(v) for k, v in default_fwd.items()})
        kn._HIER_BWD.update({k: dict(v) for k, v in default_bwd.items()})
        med = {k: statistics.median(x) for k, x in times.items()}
        best = min(med, key=med.get)
        dflt = med[next(iter(med))]
        print(f"B={B} K={K} F={F} D={D} {str(dtype)[6:]}: default {dflt:.3f}  best {best} {med[best]:.3f}  " +
              " ".join(f"{k}:{m:.3f}" for k, m in med.items()), flush=True)
        rows += [dict(B=B, K=K, F=F, D=D, dtype=str(dtype)[6:], fwd_block_d=k[0], bwd=list(k[1:]), median=m,
                      rounds=times[k]) for k, m in med.items()]
        del idx, w, v, b, t, ps
        torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
