"""sparsefuse.topk (the row top-k kernel) against torch.topk on one GPU, with a sweep of its launch.

For each shape and dtype: torch.topk, then the kernel at the default block width and warps, and at
other block widths and warp counts; each result checked against torch.topk (values equal, NaN
included; the indices select those values, each column once). JSON lines to
$OUT/probe_row_topk.jsonl. ``--warps-only``: the default block width alone, every warp count, on the SAE-sized rows (F = 65536
and 131072, k = 32 to 256).

    python scripts/probe_row_topk.py [--warps-only]
"""

import json
import os
import sys

import torch
from triton.testing import do_bench

from sparsefuse.sae import kernels


def check(x, k, idx):
    want = x.topk(k, dim=-1, sorted=True).values
    got = x.gather(-1, idx)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), "values"
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all(), "distinct columns"


def main():
    out = os.path.join(os.environ.get("OUT", "."), "probe_row_topk.jsonl")
    g = torch.Generator(device="cuda").manual_seed(0)
    with open(out, "w") as f:
        quick = "--warps-only" in sys.argv
        for B, F in ((4096, 65536), (2048, 131072)) if quick else ((4096, 65536), (4096, 16384), (2048, 131072),
                                                                  (4096, 24576)):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(B, F, device="cuda", generator=g).to(dtype)
                for k in (32, 64, 128, 256) if quick else (16, 32, 64, 128, 256, 512):
                    C0 = kernels.row_topk_block(F, k)
                    row = dict(B=B, F=F, k=k, dtype=str(dtype)[6:], C=C0)
                    row["torch"] = do_bench(lambda: x.topk(k, dim=-1, sorted=True), warmup=5, rep=30)
                    if C0 == 0:
                        print(json.dumps(row), flush=True)
                        f.write(json.dumps(row) + "\n")
                        continue
                    widths = [C0] if quick else sorted({C0 // 2, C0, C0 * 2} - {0})
                    for C in widths:
                        for w in (4, 8, 16):
                            try:
                                check(x, k, kernels.row_topk(x, k, block=C, num_warps=w))
                                row[f"C{C}_w{w}"] = do_bench(lambda: kernels.row_topk(x, k, block=C, num_warps=w),
                                                             warmup=5, rep=30)
                            except Exception as e:  # a block width past the caps: out of resources
                                row[f"C{C}_w{w}"] = repr(e)[:80]
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                x[0, 3] = float("nan")  # rows with NaN select as torch.topk does
                x[1, :100] = float("-inf")
                check(x, 64, kernels.row_topk(x, 64))


if __name__ == "__main__":
    main()
