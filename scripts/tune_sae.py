"""Sweep of the TopK loss's gather (``kernels._decode_config``) on full forward + backward steps of
``topk_sae_loss``. GPU only. Three round-robin rounds, median kept; writes $OUT/tune_sae.json.

Variants: (layout, BLOCK_D bytes, num_warps; 0 = the heuristic's). ``row``: one program per row
sweeping all of D with ``_gather_config``'s tile (before session 10), so the B*K gathered rows come
from DRAM. ``group``: GROUP = cdiv(BLOCK_K, BLOCK_D) tiles per program on the (row, column group)
grid, BLOCK_D = bytes // itemsize (since session 10: 32 columns in every dtype). The hierarchical
sweeps have their own script: scripts/tune_hier.py."""
import json
import os
import statistics

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse._launch import cdiv, next_pow2
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

B, F, D = 4096, 65536, 2304
VARIANTS = [("row", 0, 0), ("group", 128, 0), ("group", 128, 2), ("group", 64, 0), ("group", 64, 2),
            ("group", 256, 0)]  # num_warps 0: the heuristic's
default = kn._decode_config


def config(variant):
    mode, nbytes, warps = variant

    def cfg(K, D, itemsize, loss):
        if mode == "row":
            c = kn._gather_config(K, D, itemsize)
            return dict(c, GROUP=cdiv(D, c["BLOCK_D"]))
        block_k = next_pow2(K)
        block_d = max(16, min(next_pow2(max(D, 1)), nbytes // itemsize, kn._GATHER_TILE // block_k))
        nw = warps or max(1, min(8, block_k * block_d // 4096))
        return dict(BLOCK_K=block_k, BLOCK_D=block_d, GROUP=cdiv(block_k, block_d) if loss else 1, num_warps=nw)
    return cfg


times = {}
for dtype in (torch.float32, torch.bfloat16):
    for K in (32, 64, 128):
        idx, w, v, b, tg = make_inputs(B, K, F, D, dtype, "cuda")
        params = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(sparsefuse.topk_sae_loss(idx, w, v, b, tg), params)
        tag = f"{str(dtype)[6:]} K={K}"
        for _ in range(3):
            for var in VARIANTS:
                kn._decode_config = config(var)
                fn()
                torch.cuda.synchronize()
                times.setdefault(f"{tag} {var}", []).append(do_bench(fn, warmup=25, rep=100))
        kn._decode_config = default
        row = {var: statistics.median(times[f"{tag} {var}"]) for var in VARIANTS}
        best = min(row, key=row.get)
        print(f"{tag:15} " + "  ".join(f"{m}/{nb}/{nw}:{ms:.3f}" for (m, nb, nw), ms in row.items()) + f"   best {best}",
              flush=True)
        del idx, w, v, b, tg, params, fn
        torch.cuda.empty_cache()

json.dump(dict(device=torch.cuda.get_device_name(),
               ms={k: dict(median=statistics.median(t), rounds=t) for k, t in times.items()}),
          open(os.path.join(os.environ.get("OUT", "."), "tune_sae.json"), "w"), indent=1)
