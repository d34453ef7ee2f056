"""Skewed sparsity against uniform, GPU only: how the segmented sums (one program per feature,
vocab tile or code) behave when a few segments hold most of the entries. Writes JSON to argv[1].

* SAE TopK and Hierarchical (deterministic and default), B=4096 F=65536 D=2304 K=64: uniform latents
  against "dense latents", the first ``hot`` latents of every row drawn from ``hot`` features that
  every row uses (dense latents are common in trained TopK SAEs); and (session 31) latents drawn
  without replacement from a Zipf(alpha) law over the features (alpha = 0.8 and 1.0; frequent
  features at random ids, each row's latents in random order), a smoother skew than 8 latents in
  every row: with alpha = 1 about ten features are in half the rows.
* KD from hidden states, N=8192 H=4096 V=128256 K=64 bf16: uniform teacher ids against ids drawn
  without replacement from a Zipf(1) law over the vocabulary in id order (frequent tokens have small
  ids in BPE vocabularies, so they share the first vocab tiles).
* VQ EMA, deterministic statistics, B=65536 K=1024 D=128: uniform codes against half of the rows on
  code 0, and against every row on code 0 (collapse).

For a before / after comparison on one machine, run it alternately with the old and the new tree
first on PYTHONPATH (the JSON records which ``sparsefuse`` it imported). argv[2], optional, picks
the families (default "sae,kd,vq"); "prof" adds the device time per kernel of the uniform TopK steps.
argv[3], optional, is the SAE K (default 64); argv[4], optional, the SAE labels to time (default all:
"uniform,dense8,zipf0.8,zipf1.0").
"""
import json
import statistics
import sys
from collections import defaultdict

import torch
from triton.testing import do_bench

import sparsefuse as sf
from sparsefuse.bench.kd import make_targets
from sparsefuse.bench.sae import make_inputs
from sparsefuse.bench.vq import make_state

out = {"sparsefuse": sf.__file__}
families = sys.argv[2].split(",") if len(sys.argv) > 2 else ["sae", "kd", "vq"]


def bench(name, fn, rounds=3):
    fn()
    ts = [do_bench(fn, warmup=10, rep=100) for _ in range(rounds)]
    out[name] = statistics.median(ts)
    print(f"{name}: {out[name]:.3f} ms", flush=True)


def zipf_latents(B, K, F, alpha, dtype):
    """[B, K] distinct ids a row, drawn from p(rank r) ~ r^-alpha; ranks mapped to random ids."""
    p = torch.arange(1, F + 1, device="cuda", dtype=torch.float32).pow(-alpha)
    ranks = torch.cat([torch.multinomial(p.expand(512, F), K, replacement=False) for _ in range(B // 512)])
    ids = torch.randperm(F, device="cuda")[ranks]
    ids = ids.gather(1, torch.argsort(torch.rand(B, K, device="cuda"), dim=1))
    rows_with = torch.bincount(ids.flatten(), minlength=F).float() / B
    out[f"zipf{alpha} share of rows: top feature, features in > 10% / > 50%"] = s = [
        rows_with.max().item(), int((rows_with > 0.1).sum()), int((rows_with > 0.5).sum())]
    print(f"zipf{alpha} share of rows: top feature, features in > 10% / > 50%:", s, flush=True)
    return ids.to(dtype)


def sae():
    B, F, D = 4096, 65536, 2304
    K = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    labels = sys.argv[4].split(",") if len(sys.argv) > 4 else ["uniform", "dense8", "zipf0.8", "zipf1.0"]
    zipf = {a: zipf_latents(B, K, F, a, torch.int64) for a in (0.8, 1.0) if f"zipf{a}" in labels}
    for dt in (torch.float32, torch.bfloat16):
        idx, w, v, b, t = make_inputs(B, K, F, D, dt, "cuda")
        hot = 8
        dense = idx.clone()
        dense[:, :hot] = torch.arange(F - hot, F, device="cuda", dtype=idx.dtype)
        # a uniform id equal to a hot one moves to another id (a repeat within a row is allowed anyway)
        dense[:, hot:] = torch.where(dense[:, hot:] >= F - hot, dense[:, hot:] % (F - hot), dense[:, hot:])
        ps = [w.requires_grad_(), v.requires_grad_(), b.requires_grad_()]
        name = str(dt).split(".")[-1]
        cases = dict(uniform=idx, dense8=dense, **{f"zipf{a}": z.to(idx.dtype) for a, z in zipf.items()})
        for label, ids in ((lab, cases[lab]) for lab in labels):
            topk = lambda ids=ids: torch.autograd.grad(sf.topk_sae_loss(ids, w, v, b, t), ps)  # noqa: E731
            if "prof" in families and label == "uniform":
                kernel_times(f"sae topk {name} {label}", topk)
            if "sae" not in families:
                continue
            bench(f"sae topk {name} {label}", topk)
            for det in (True, False):
                bench(f"sae hier {'det' if det else 'default'} {name} {label}", lambda ids=ids, det=det:
                      torch.autograd.grad(sf.hierarchical_sae_loss(ids, w, v, b, t, deterministic=det), ps))


def kernel_times(name, fn, steps=20):
    """Device microseconds per step of each kernel of fn, from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] += e.device_time / steps
    out[f"kernels {name}"] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    print(f"kernels {name} (us per step):", json.dumps(out[f"kernels {name}"], indent=1), flush=True)


def kd():
    N, H, V, K = 8192, 4096, 128256, 64
    ids, lp, m = make_targets(N, K, V, "cuda")
    p = 1.0 / torch.arange(1, V + 1, device="cuda", dtype=torch.float32)
    zipf = torch.cat([torch.multinomial(p.expand(512, V), K, replacement=False) for _ in range(N // 512)])
    zipf = torch.where(m, zipf, torch.zeros_like(zipf))
    tile_hits = torch.bincount((zipf[m] // 64).flatten(), minlength=V // 64 + 1)
    out["kd zipf hits in the busiest 64 consecutive ids, mean"] = [int(tile_hits.max()), float(tile_hits.float().mean())]
    print("kd zipf hits in the busiest 64 consecutive ids, mean:", out["kd zipf hits in the busiest 64 consecutive ids, mean"],
          flush=True)
    h = torch.randn(N, H, device="cuda").to(torch.bfloat16).requires_grad_()
    wl = (torch.randn(V, H, device="cuda") / H**0.5).to(torch.bfloat16).requires_grad_()
    for label, tid in (("uniform", ids), ("zipf", zipf)):
        for nz in ("topk", "full"):
            bench(f"kd hidden-{nz} {label}", lambda tid=tid, nz=nz: torch.autograd.grad(
                sf.topk_kd_loss_from_hidden(h, wl, tid, lp, m, normalize=nz), [h, wl]))


def vq():
    B, K, D = 65536, 1024, 128
    x, codes, cb, cs, es, cnt = make_state(B, K, D, "cuda")
    half = torch.where(torch.arange(B, device="cuda") % 2 == 0, torch.zeros_like(codes), codes)
    if "prof" in families:
        kernel_times("vq ema det=True uniform", lambda: sf.vq_ema_update(
            x, codes, cb, cs, es, cnt, decay=0.99, semantics="active", deterministic=True))
    if "vq" not in families:
        return
    for label, c in (("uniform", codes), ("half on one code", half), ("all on one code", torch.zeros_like(codes))):
        for det in (False, True):
            bench(f"vq ema det={det} {label}", lambda c=c, det=det: sf.vq_ema_update(
                x, c, cb, cs, es, cnt, decay=0.99, semantics="active", deterministic=det))


if "sae" in families or "prof" in families:
    sae()
    torch.cuda.empty_cache()
if "kd" in families:
    kd()
    torch.cuda.empty_cache()
if "vq" in families or "prof" in families:
    vq()
json.dump(out, open(sys.argv[1], "w"), indent=1)
