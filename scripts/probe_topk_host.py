"""Where the TopK step's time goes at small K (GPU only): host against GPU time of one eager step
for a few forward tilings, then the per-kernel GPU time of one step from the profiler.

Part 1 (``split`` from probe_host_gpu_split.py: the host enqueues N steps behind a long GPU sleep,
so host ms = wall / N and GPU ms = events / N) for the current ``_decode_config`` and for wider
column groups. Part 2: torch.profiler over 20 steps, CUDA time per step by kernel name.
Writes JSON to argv[1] (default probe_topk_host.json)."""
import json
import sys
from collections import defaultdict

import torch
from triton.testing import do_bench

import sparsefuse as sf
from probe_host_gpu_split import split
from sparsefuse._launch import cdiv
from sparsefuse.bench.sae import make_inputs
from sparsefuse.sae import kernels as kn

B, F, D = 4096, 65536, 2304
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
default = kn._decode_config


def widened(min_cols):
    def cfg(K, D, itemsize, loss):
        c = default(K, D, itemsize, loss)
        if loss:
            c["GROUP"] = max(c["GROUP"], cdiv(min_cols, c["BLOCK_D"]))
        return c
    return cfg


VARIANTS = {"current": default, "cols>=128": widened(128), "cols>=256": widened(256)}


def step_fn(K, dt):
    idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
    ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
    return lambda: torch.autograd.grad(sf.topk_sae_loss(idx, w, v, b, t), ps)


def part1():
    out = []
    for K in (32, 64):
        for dn, dt in DTYPES.items():
            fn = step_fn(K, dt)
            for vn, cfg in VARIANTS.items():
                kn._decode_config = cfg
                rounds = [dict(split(fn), do_bench_ms=do_bench(fn, warmup=25, rep=200)) for _ in range(3)]
                row = dict(K=K, dtype=dn, variant=vn, rounds=rounds)
                print(json.dumps(row), flush=True)
                out.append(row)
            kn._decode_config = default
            del fn
            torch.cuda.empty_cache()
    return out


def part2(n=20):
    out = {}
    for K in (32, 128):
        for dn, dt in DTYPES.items():
            fn = step_fn(K, dt)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    fn()
                torch.cuda.synchronize()
            per = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name[:70]] += e.device_time / n / 1e3  # ms per step
            rows = sorted(per.items(), key=lambda kv: -kv[1])
            out[f"K={K} {dn}"] = dict(total_ms=sum(per.values()), kernels=rows)
            print(f"K={K} {dn}: {sum(per.values()):.3f} ms of kernels per step", flush=True)
            for name, ms in rows:
                print(f"   {ms:.4f}  {name}", flush=True)
            del fn
            torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "probe_topk_host.json"
    res = dict(gpu=torch.cuda.get_device_name(), profile=part2(), split=part1())
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
