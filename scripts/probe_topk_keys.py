"""sparsefuse.topk as in this tree against the committed kernel (HEAD), on one GPU.

Needs sparsefuse/sae/_kernels_head.py, the committed kernels module (``git show
HEAD:sparsefuse/sae/kernels.py > sparsefuse/sae/_kernels_head.py``), beside the current one.
(Session 42 ran it first with int64 keys at HEAD and int32 keys in the tree.) Round-robin rounds
in one process; each result checked against the other (identical indices) and against
torch.topk's values. JSON lines to $OUT/probe_topk_keys.jsonl, flushed per shape.

    python scripts/probe_topk_keys.py
"""

import json
import os
import statistics

import torch
from triton.testing import do_bench

from sparsefuse.sae import _kernels_head as old
from sparsefuse.sae import kernels as new

SHAPES = [(4096, 65536, torch.bfloat16, k) for k in (32, 64, 128, 256)] + [
    (4096, 65536, torch.float32, k) for k in (32, 64, 128)] + [
    (4096, 16384, torch.bfloat16, 64), (2048, 131072, torch.bfloat16, 64), (4096, 24576, torch.float16, 32)]


def main():
    out = os.path.join(os.environ.get("OUT", "."), "probe_topk_keys.jsonl")
    g = torch.Generator(device="cuda").manual_seed(0)
    with open(out, "w") as f:
        for B, F, dtype, k in SHAPES:
            x = torch.randn(B, F, device="cuda", generator=g).to(dtype)
            x[0, 3] = float("nan")
            x[1, :100] = float("-inf")
            x[2, :300] = 1.5  # ties
            a, b = old.row_topk(x, k), new.row_topk(x, k)
            assert torch.equal(a, b), "indices differ"
            want = x.float().cpu().topk(k, dim=-1).values
            assert torch.equal(x.gather(-1, b).float().cpu().nan_to_num(7.0), want.nan_to_num(7.0)), "values"
            times = {"torch": [], "HEAD": [], "tree": []}
            for _ in range(3):
                times["torch"].append(do_bench(lambda: x.topk(k, dim=-1, sorted=True), warmup=5, rep=30))
                times["HEAD"].append(do_bench(lambda: old.row_topk(x, k), warmup=5, rep=30))
                times["tree"].append(do_bench(lambda: new.row_topk(x, k), warmup=5, rep=30))
            row = dict(B=B, F=F, k=k, dtype=str(dtype)[6:], C=new.row_topk_block(F, k),
                       ms={n: statistics.median(t) for n, t in times.items()}, rounds=times)
            print(json.dumps(row["ms"] | dict(B=B, F=F, k=k, dtype=row["dtype"])), flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
