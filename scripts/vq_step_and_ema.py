"""Re-measure the VectorQuantizer step against vector-quantize-pytorch (merged into $OUT/vq.json,
which the caller seeds with the committed results) and time the eager EMA update at each benchmark
shape twice, with its host enqueue time (GPU)."""
import os
import torch
from triton.testing import do_bench
from sparsefuse.bench import harness, vq as bvq
from sparsefuse import vq_ema_update

out = os.environ.get("OUT", ".")
B, K, D = 65536, 1024, 128
cases = [bvq._step_case("sparsefuse", B, K, D), bvq._step_case("vector-quantize-pytorch", B, K, D)]
harness.save(harness.run_cases(cases), bvq.FAMILY, out)
for (b, k, d) in bvq.EMA_SHAPES:
    for semantics in ("active", "laplace"):
        state = bvq.make_state(b, k, d, "cuda")
        kw = bvq._ema_kwargs(semantics)
        fn = lambda: vq_ema_update(*state, **kw)
        fn(); torch.cuda.synchronize()
        ms = [do_bench(fn, warmup=50, rep=300) for _ in range(2)]
        print(f"ema {semantics:8} B={b:6} K={k:5} D={d:4}: {ms[0]*1e3:6.1f} / {ms[1]*1e3:6.1f} us, "
              f"host {harness.host_us(fn, 50, 0):6.1f} us")
