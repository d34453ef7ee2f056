"""The SAE losses at shapes other than the benchmark's: forward + backward, ours against the
reference under torch.compile, fp32 and bf16, one process (do_bench medians; inputs random, never
zeros), each eager and replayed from a CUDA graph. Looks for a launch heuristic tuned at D = 2304
that falls off elsewhere, and for the shapes where the eager step waits on the host.

    python scripts/probe_sae_shapes.py OUT.jsonl
"""
import json
import sys

import torch
import triton.testing

from sparsefuse.bench.sae import DTYPES, OPS, make_inputs

SHAPES = [  # (B, K, F, D)
    (4096, 64, 65536, 2304),  # the benchmark's shape, for scale on the machine at hand
    (4096, 32, 24576, 768),  # GPT-2 small residual stream, 32x expansion
    (4096, 64, 131072, 4096),  # Llama-3-8B width, 32x expansion
    (1024, 64, 65536, 2304),  # the benchmark's dictionary, a quarter of its batch
]



def graphed(step):
    """``step`` captured once in a CUDA graph (warmed up on a side stream); returns its replay: the
    step's device time without Python's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


out = open(sys.argv[1], "w")
for B, K, F, D in SHAPES:
    for op, (ours, ref) in OPS.items():
        for dname, dtype in DTYPES.items():
            idx, weight, vals, bias, target = make_inputs(B, K, F, D, dtype, "cuda")
            params = [weight.requires_grad_(), vals.requires_grad_(), bias.requires_grad_()]
            compiled = torch.compile(ref, dynamic=False)
            row = dict(op=op, dtype=dname, B=B, K=K, F=F, D=D)
            for name, fn in (("sparsefuse", ours), ("torch.compile", compiled)):
                step = lambda fn=fn: torch.autograd.grad(fn(idx, weight, vals, bias, target), params)  # noqa: E731
                for _ in range(3):
                    step()
                row[name] = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
                try:
                    row[name + " graph"] = triton.testing.do_bench(graphed(step), warmup=25, rep=200,
                                                                   return_mode="median")
                except Exception as e:  # noqa: BLE001 - record why a capture failed and go on
                    row[name + " graph"] = None
                    row[name + " graph error"] = repr(e)[:300]
            row["speedup"] = row["torch.compile"] / row["sparsefuse"]
            if row["sparsefuse graph"] and row["torch.compile graph"]:
                row["speedup graph"] = row["torch.compile graph"] / row["sparsefuse graph"]
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
            del idx, weight, vals, bias, target, params, compiled
            torch._dynamo.reset()
            torch.cuda.empty_cache()
