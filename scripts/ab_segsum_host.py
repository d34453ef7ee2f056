"""Same-process A/B of the chunked segmented sum's cost in a uniform TopK step (GPU only): the
shipped weight gradient against the same kernels with the chunk kernel not launched (a chunk longer
than every segment, so no partial sum is ever read). Five alternating rounds of: host time of one
step enqueued on an idle GPU (median of 200), and do_bench of the step. Writes JSON to argv[1]."""
import json
import sys

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench import harness
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels

shipped_partials, shipped_size = kernels.chunk_partials, kernels.chunk_size


def no_chunks(sorted_keys, order, weights, rows, row_div, chunk, acc, block_d, want_wsum):
    return rows.new_empty(1, 1, rows.shape[-1], dtype=acc), None


variants = {
    "shipped": (shipped_partials, shipped_size),
    "no chunk kernel": (no_chunks, lambda entries, rows: 1 << 40),
}
out = {}
for K in (32, 64):
    for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        idx, w, v, b, t = make_inputs(4096, K, 65536, 2304, dt, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        step = lambda: torch.autograd.grad(sf.topk_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
        res = {n: dict(host=[], bench=[]) for n in variants}
        for _ in range(5):
            for name, (part, size) in variants.items():
                kernels.chunk_partials, kernels.chunk_size = part, size
                step()
                res[name]["host"].append(harness.idle_host_ms(step))
                res[name]["bench"].append(do_bench(step, warmup=25, rep=200))
        kernels.chunk_partials, kernels.chunk_size = shipped_partials, shipped_size
        out[f"K={K} {dn}"] = res
        print(f"K={K} {dn}", json.dumps({n: {k: [round(x, 3) for x in xs] for k, xs in r.items()}
                                           for n, r in res.items()}), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
