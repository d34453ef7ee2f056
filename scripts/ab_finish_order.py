"""In-process A/B: the backward's finishing launch queued before (old) or after (new) the weight
gradient's long kernel, on the host-bound K = 32 steps (GPU only). Old and new alternate round by
round in one process, so both meet the same host. Also the peak memory of one step each way.
Writes JSON to argv[1]."""
import json
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

new_topk, new_hier = kn.topk_loss_bwd, kn.hierarchical_grads_finish


def old_topk(grad_loss, indices, vals, weight, resid, gv, need_weight_grad, bias_dtype):
    B, D = resid.shape
    gc = grad_loss.to(resid.dtype) * (2.0 / max(B * D, 1))
    grad_vals, grad_bias, _ = kn._finish_grads(gv, resid.sum(0), gc, vals, bias_dtype)
    grad_weight = (kn.weight_grad(indices, resid, vals, weight.shape[0], weight.dtype, scale=gc)
                   if need_weight_grad else weight.new_empty(0))
    return grad_vals, grad_weight, grad_bias


def old_hier(grad_loss, indices, vals, etot, gv, stage, num_features, weight_dtype, bias_dtype, mode):
    B, D = etot.shape
    K = gv.shape[-1]
    gc = grad_loss.to(etot.dtype) * (2.0 / max(B * K * D, 1))
    grad_vals, grad_bias, _ = kn._finish_grads(gv, etot.sum(0), gc, vals, bias_dtype)
    if mode == 0:
        grad_weight = torch.empty(0, device=etot.device, dtype=weight_dtype)
    elif mode == 1:
        grad_weight = torch.empty(stage.shape, device=etot.device, dtype=weight_dtype)
        n, block = stage.numel(), 4096
        if n:
            kn._launch(kn._scale_cast_kernel, (kn.cdiv(n, block),), stage, grad_weight, gc, n,
                       ACC=kn.tl_dtype(etot.dtype), BLOCK=block, num_warps=8)
    else:
        grad_weight = kn.weight_grad(indices, stage, None, num_features, weight_dtype, scale=gc, row_per_entry=True)
    return grad_vals, grad_weight, grad_bias


VERSIONS = {"old": (old_topk, old_hier), "new": (new_topk, new_hier)}
OPS = {"topk": sf.topk_sae_loss, "hierarchical": sf.hierarchical_sae_loss}
CASES = [("topk", torch.float32), ("topk", torch.bfloat16), ("hierarchical", torch.bfloat16)]
B, F, D, K, ROUNDS = 4096, 65536, 2304, 32, 8
out = []
for op, dt in CASES:
    idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    fn = lambda: torch.autograd.grad(OPS[op](idx, w, v, b, t), ps)  # noqa: E731
    row = dict(op=op, dtype=str(dt).replace("torch.", ""), K=K)
    for rnd in range(ROUNDS):
        for name, (tk, hr) in VERSIONS.items():
            kn.topk_loss_bwd, kn.hierarchical_grads_finish = tk, hr
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            row.setdefault(f"{name}_ms", []).append(do_bench(fn, warmup=25, rep=200))
            if rnd == 0:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                row[f"{name}_peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for name in VERSIONS:
        xs = sorted(row[f"{name}_ms"])
        row[f"{name}_median"] = (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    print(json.dumps(row), flush=True)
    out.append(row)
    del idx, w, v, b, t, ps, fn
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
