"""A/B of the nearest-code search kernel in one run: this tree's kernels against another commit's.

    git show REV:sparsefuse/vq/kernels.py > sparsefuse/vq/_ab_kernels.py   # (not committed)
    python scripts/ab_search.py OUT.json

Times ``kernels.nearest_code`` of both modules, interleaved in three rounds, on the bench's search
shapes (B = 65536; D, K = 128, 1024 and 256, 4096) for fp32 exact / fast and bf16, random data.
"""
import json
import sys

import torch
from triton.testing import do_bench

from sparsefuse.vq import _ab_kernels as old
from sparsefuse.vq import kernels as new


def main(path):
    rows = []
    for D, K in ((128, 1024), (256, 4096)):
        for dt, prec in ((torch.float32, "exact"), (torch.float32, "fast"), (torch.bfloat16, "exact")):
            x = torch.randn(65536, D, device="cuda").to(dt)
            c = torch.randn(K, D, device="cuda").to(dt)
            assert torch.equal(old.nearest_code(x, c, False, prec)[0], new.nearest_code(x, c, False, prec)[0])
            times = {"old": [], "new": []}
            for _ in range(3):
                for name, mod in (("old", old), ("new", new)):
                    times[name].append(do_bench(lambda: mod.nearest_code(x, c, False, prec), warmup=25, rep=200))
            row = dict(D=D, K=K, dtype=str(dt), precision=prec, **{k: sorted(v) for k, v in times.items()})
            row["new_over_old"] = sorted(times["new"])[1] / sorted(times["old"])[1]
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
