"""Sweep of the hierarchical sweeps' launch configuration on (row block, D tile) grids. GPU only.

Prints the best configuration per (dtype, K) for the forward and the atomic backward, and writes
every timing to $OUT/tune_hier.json."""
import json, os
import torch, triton, triton.language as tl
from triton.testing import do_bench
from sparsefuse.sae import kernels as kn
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
CONFIGS = [  # (BLOCK_B, BLOCK_D, num_warps, STAGES); one-warp programs cap an SM at 32 resident warps
    (1, 32, 1, 1), (1, 64, 1, 1), (1, 128, 1, 1), (1, 64, 1, 3), (1, 128, 2, 1),
    (2, 64, 1, 1), (4, 32, 1, 1), (4, 64, 2, 1), (4, 64, 2, 3), (8, 32, 2, 1), (8, 64, 4, 1), (16, 32, 4, 1),
    (16, 32, 8, 3), (2, 64, 2, 1), (4, 64, 4, 1), (2, 32, 2, 1), (4, 32, 4, 1), (2, 128, 2, 1),
]
if os.environ.get("TUNE_CONFIGS"):  # e.g. "1,64,1,1;2,64,2,1"
    CONFIGS = [tuple(int(x) for x in c.split(",")) for c in os.environ["TUNE_CONFIGS"].split(";")]
SWEEP = ((torch.float32, (32, 64, 128)), (torch.bfloat16, (32, 128)))
if os.environ.get("TUNE_FP32_ONLY"):
    SWEEP = SWEEP[:1]
out = {}


def t(fn):
    fn(); torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=40)


for dtype, Ks in SWEEP:
    for K in Ks:
        idx, w, v, b, tg = make_inputs(B, K, F, D, dtype, "cuda")
        tag = f"{str(dtype)[6:]}-K{K}"
        etot = torch.empty(B, D, device="cuda"); g1 = torch.ones((), device="cuda")
        gw = torch.zeros(F, D, device="cuda"); gv = torch.zeros(B, K, device="cuda")
        for BB, BD, nw, st in CONFIGS:
            cfg = dict(BLOCK_B=BB, BLOCK_D=BD, num_warps=nw, STAGES=st)
            grid = kn._hier_grid(B, D, cfg)
            rl = torch.empty(grid[1], B, device="cuda")
            try:
                out[f"fwd {tag} {BB},{BD},{nw},{st}"] = t(lambda: kn._hierarchical_sae_fwd_kernel[grid](
                    idx, v, w, b, tg, etot, rl, B, K, D, F, D, 1, HAS_BIAS=True, ACC=tl.float32, **cfg))
                out[f"bwd {tag} {BB},{BD},{nw},{st}"] = t(lambda: kn._hierarchical_sae_bwd_kernel[grid](
                    idx, v, w, b, tg, etot, g1, gw, gv, None, B, K, D, F, D, 1, 1e-9, 0, D, HAS_BIAS=True,
                    WEIGHT_GRAD=1, STAGED_GV=False, FUSED=False, ACC=tl.float32, **cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is just skipped
                print(tag, cfg, "failed:", str(e)[:200])
        print(tag, "done", flush=True)
        del gw

json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "tune_hier.json"), "w"), indent=1)
groups = {}
for k, ms in out.items():
    g = " ".join(k.split()[:2])
    groups.setdefault(g, []).append((ms, k.split()[2]))
for g, items in groups.items():
    items.sort()
    print(f"{g:14} " + "  ".join(f"{c}:{ms:.3f}" for ms, c in items[:5]) + f"   | worst {items[-1][1]}:{items[-1][0]:.3f}")
