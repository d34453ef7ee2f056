"""Does every SAE op work at large K (K = 2048, 4096, 8192) on a GPU? Each op's forward and
gradients against float64 (relative errors), the first call's time (compiles included) and a second
call's, or the exception."""
import json
import os
import sys
import time

import torch

sys.path.insert(0, "tests")
from test_sae import OPS, make, value_and_grads  # noqa: E402
from helpers import rel_err  # noqa: E402

out = []
for K in (2048, 4096, 8192):
    for op in OPS:
        for dtype in (torch.float32, torch.bfloat16):
            rec = dict(op=op, K=K, dtype=str(dtype))
            try:
                args = make(32, K, 20000, 300, dtype, device="cuda")
                torch.cuda.synchronize()
                t = time.perf_counter()
                got = value_and_grads(OPS[op][0], *args)
                torch.cuda.synchronize()
                rec["first_call_s"] = time.perf_counter() - t
                t = time.perf_counter()
                value_and_grads(OPS[op][0], *args)
                torch.cuda.synchronize()
                rec["second_call_s"] = time.perf_counter() - t
                want = value_and_grads(OPS[op][1], args[0], *(a.double() for a in args[1:]))
                rec["rel_err"] = [rel_err(a, b) for a, b in zip(got, want)]
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(rec, flush=True)
            out.append(rec)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_large_k.json"), "w"), indent=1)
