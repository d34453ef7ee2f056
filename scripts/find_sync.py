"""Which eager SAE loss steps make the host wait for the GPU, and why (GPU machine).

For each (op, dtype, K): the host time to enqueue 10 steps behind a long GPU sleep (a step that
waits for the GPU shows up as the whole sleep), the allocator's device mallocs / frees during that
window, a run under ``torch.cuda.set_sync_debug_mode("error")``, and the CUDA runtime calls of one
step from the profiler.
"""
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
OPS = {"topk": sf.topk_sae_loss, "hierarchical": sf.hierarchical_sae_loss}

for K in (32, 64):
    for name, op in OPS.items():
        for dt in (torch.float32, torch.bfloat16):
            idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
            ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
            fn = lambda: torch.autograd.grad(op(idx, w, v, b, t), ps)  # noqa: E731
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            s0 = torch.cuda.memory_stats()
            torch.cuda._sleep(int(4e8))
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            host = (time.perf_counter() - t0) * 1e3 / 10
            torch.cuda.synchronize()
            s1 = torch.cuda.memory_stats()
            keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
            delta = {k: s1.get(k, 0) - s0.get(k, 0) for k in keys}
            print(f"{name} {dt} K={K}: host {host:.3f} ms/step behind a ~200 ms sleep; allocator {delta}", flush=True)
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                print("  sync debug mode: no synchronizing call")
            except Exception:
                print("  sync debug mode:", "".join(traceback.format_exc().splitlines(True)[-12:]))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            calls = {}
            for e in prof.events():
                if e.name.startswith("cuda") and "Launch" not in e.name:
                    calls[e.name] = calls.get(e.name, 0) + 1
            print("  runtime calls:", calls, flush=True)
            del idx, w, v, b, t, ps, fn
            torch.cuda.empty_cache()
