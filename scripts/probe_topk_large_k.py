"""TopK and Hierarchical full steps at large K against the compiled reference (one H200 run):
where does the TopK gather's one-tile-per-row design (all K latents of a row in registers, sized
for K <= 512) stop paying? B = 512 keeps the reference's [B, K, D] intermediate in memory at
K = 2048. Prints and writes $OUT/probe_topk_large_k.json: ms (do_bench median) per (op, K,
provider)."""
import json
import os
import time

import torch
import triton

from sparsefuse.bench.sae import OPS, make_inputs

B, F, D = 512, 65536, 2304
rows = []
for K in (128, 256, 512, 1024, 2048):
    for op, (ours, ref) in OPS.items():
        for name, fn in (("sparsefuse", ours), ("torch.compile", torch.compile(ref, dynamic=False))):
            idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
            params = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
            step = lambda: torch.autograd.grad(fn(idx, w, v, b, t), params)  # noqa: E731
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ms = triton.testing.do_bench(step, warmup=50, rep=300)
            rows.append(dict(op=op, K=K, provider=name, ms=ms, first_call_s=first))
            print(rows[-1], flush=True)
            torch._dynamo.reset()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "probe_topk_large_k.json"), "w"), indent=1)
