"""Host time of one eager TopK step at the benchmark's shape, inside a do_bench-like loop (GPU only).

Per K and dtype: (a) host time of a step enqueued on an idle GPU; (b) a do_bench-like loop (the
256 MB cache clear, start event, step, end event), recording the host's wall time for the step and
the events' interval, each a median of 100; (c) the events' interval with the host well ahead
(10 iterations behind a GPU sleep); then a cProfile of (b)'s loop. Writes JSON to argv[1]."""
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import triton

import sparsefuse as sf
from sparsefuse.bench import harness
from sparsefuse.bench.sae import make_inputs

B, F, D = 4096, 65536, 2304
cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
clear = lambda: triton.runtime.driver.active.clear_cache(cache)  # noqa: E731


def loop(fn, n, sleep=False):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    host = []
    torch.cuda.synchronize()
    if sleep:
        torch.cuda._sleep(int(3e8))
    for s, e in ev:
        clear()
        s.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(host), statistics.median(s.elapsed_time(e) for s, e in ev)


out = []
for K in (32, 64):
    for dn, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        fn = lambda: torch.autograd.grad(sf.topk_sae_loss(idx, w, v, b, t), ps)  # noqa: E731
        for _ in range(20):
            fn()
        host_loop, gpu_loop = loop(fn, 100)
        _, gpu_ahead = loop(fn, 10, sleep=True)
        row = dict(K=K, dtype=dn, idle_host_ms=harness.idle_host_ms(fn, 50), loop_host_ms=host_loop,
                   loop_event_ms=gpu_loop, ahead_event_ms=gpu_ahead)
        pr = cProfile.Profile()
        pr.enable()
        loop(fn, 100)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        row["profile"] = s.getvalue()
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if K == 32:
            print(row["profile"], flush=True)
        out.append(row)
        del idx, w, v, b, t, ps, fn
        torch.cuda.empty_cache()
with open(sys.argv[1] if len(sys.argv) > 1 else "probe_topk_host2.json", "w") as f:
    json.dump(out, f, indent=1)
