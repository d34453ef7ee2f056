"""The EMA-update cases of ``sparsefuse bench vq`` (eager sparsefuse and the eager reference), run
``--repeats`` times in one process: how much the host-bound eager ratios move from run to run."""
import argparse

from sparsefuse.bench import harness
from sparsefuse.bench.vq import EMA_SHAPES, _ema_case

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--repeats", type=int, default=3)
a = p.parse_args()
for rep in range(a.repeats):
    for B, K, D in EMA_SHAPES:
        ours, ref = harness.run_cases([_ema_case("active", prov, B, K, D) for prov in ("sparsefuse", "torch")])
        print(f"repeat {rep} active B={B} K={K} D={D}: sparsefuse {ours.ms * 1e3:.1f} us, "
              f"torch {ref.ms * 1e3:.1f} us, {ref.ms / ours.ms:.1f}x", flush=True)
