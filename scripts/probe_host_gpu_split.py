"""Host time against GPU time of one eager SAE loss step, and the hierarchical fp32 kernel floors.

Part 1, per (op, dtype, K) at the benchmark's shape: the do_bench median of the step (what
``sparsefuse bench sae`` reports), the host time to enqueue one step and the GPU time of one step.
The last two come from one window: the GPU is first given a long ``torch.cuda._sleep`` so that the
host enqueues all N steps before the GPU reaches the first, then host time = wall time / N and GPU
time = event time / N (valid only when the host finished inside the sleep: ``ahead`` says so).

Part 2, fp32 Hierarchical at K = 32 / 64 / 128: the pieces a single-gather (fused forward) design
would still pay for, each timed alone: the forward sweep, the backward with and without its weight
gradient (the zero-fill included in the latter), the zero-fill alone, and a scale pass over F x D.

Writes JSON to argv[1] (default probe_host_gpu_split.json).
"""
import json
import sys
import time

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

B, F, D = 4096, 65536, 2304
OPS = {"topk": sf.topk_sae_loss, "hierarchical": sf.hierarchical_sae_loss}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def split(fn, n=40, sleep_cycles=int(6e8)):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    torch.cuda._sleep(sleep_cycles)
    s1.record()
    e0.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    e1.record()
    torch.cuda.synchronize()
    host_ms = (t1 - t0) * 1e3
    return dict(host_ms=host_ms / n, gpu_ms=e0.elapsed_time(e1) / n, ahead=host_ms < s0.elapsed_time(s1))


def part1():
    out = []
    for K in (32, 64):
        for name, op in OPS.items():
            for dn, dt in DTYPES.items():
                idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
                ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
                fn = lambda: torch.autograd.grad(op(idx, w, v, b, t), ps)  # noqa: E731
                rounds = []
                for _ in range(3):
                    r = split(fn)
                    r["do_bench_ms"] = do_bench(fn, warmup=50, rep=300, return_mode="median")
                    rounds.append(r)
                row = dict(op=name, dtype=dn, K=K, rounds=rounds)
                print(json.dumps(row), flush=True)
                out.append(row)
                del idx, w, v, b, t, ps, fn
                torch.cuda.empty_cache()
    return out


def part2():
    out = []
    for K in (32, 64, 128):
        idx, w, v, b, t = make_inputs(B, K, F, D, torch.float32, "cuda")
        g = torch.ones((), device="cuda")
        _, etot = kn.hierarchical_loss_fwd(idx, w, v, b, t)
        buf = torch.randn(F, D, device="cuda")
        dst = torch.empty_like(buf)
        gs = torch.full((), 0.5, device="cuda")
        n = buf.numel()
        times = {
            "forward sweep": lambda: kn.hierarchical_loss_fwd(idx, w, v, b, t),
            "backward, no weight grad (gather + gv)": lambda: kn.hierarchical_loss_bwd(
                g, idx, w, v, b, t, etot, False, False),
            "backward with atomics (zero-fill included)": lambda: kn.hierarchical_loss_bwd(
                g, idx, w, v, b, t, etot, True, False),
            "two-sweep fused forward, mode 1 (zero-fill included)": lambda: kn.hierarchical_loss_fwd_grads(
                idx, w, v, b, t, True, False),
            "zero-fill F x D": lambda: torch.zeros(F, D, device="cuda"),
            "scale pass F x D (read + write)": lambda: kn._launch(
                kn._scale_cast_kernel, (n // 4096,), buf, dst, gs, n, ACC=kn.tl.float32, BLOCK=4096,
                num_warps=8),
        }
        row = dict(K=K)
        for name, fn in times.items():
            row[name] = do_bench(fn, warmup=50, rep=300, return_mode="median")
        print(json.dumps(row), flush=True)
        out.append(row)
        del idx, w, v, b, t, etot, buf, dst
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "probe_host_gpu_split.json"
    res = dict(gpu=torch.cuda.get_device_name(), steps=part1(), floors=part2())
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
