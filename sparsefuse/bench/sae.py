"""``sparsefuse bench sae``: TopK and HierarchicalTopK decoder losses, forward + backward.

Providers: ``sparsefuse`` (the fused ops), ``torch`` (the reference in eager mode) and
``torch.compile`` (the same reference compiled, static shapes). Default shape: F = 65536,
D = 2304, B = 4096, K in {32, 64, 128}, float32 and bfloat16.

GB/s counts the traffic no implementation can avoid: the B*K active decoder rows read once, the
target read once, and the dense weight gradient written once.

Every case is timed in five round-robin rounds and keeps its median round (all providers alike):
the small-K steps are close to host-bound, and one round's median moved by up to 0.4 ms between
runs on the same H200 (three rounds until session 11, when rounds of one K = 32 case still spanned
0.77-1.18 ms in one run). Our fp32 and bf16 cases of one (op, K) run back to back in each round, so
that the two dtypes, which the targets compare in ms, meet the same host and clock conditions.
"""

from __future__ import annotations

import torch

from .. import hierarchical_sae_loss, topk_sae_loss
from ..sae import reference
from . import harness

FAMILY = "sae"
OPS = {
    "topk": (topk_sae_loss, reference.topk_sae_loss),
    "hierarchical": (hierarchical_sae_loss, reference.hierarchical_sae_loss),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROUNDS = 5


def make_inputs(B, K, F, D, dtype, device, *, seed=0):
    """Random SAE decoder inputs: distinct latents per row, sorted by activation (largest first)."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.rand(B, F, device=device, generator=g).topk(K, dim=1).indices.int()
    vals = torch.rand(B, K, device=device, generator=g).sort(dim=1, descending=True).values
    weight = torch.randn(F, D, device=device, generator=g) / D**0.5
    bias = torch.randn(D, device=device, generator=g) * 0.1
    target = torch.randn(B, D, device=device, generator=g)
    return idx, weight.to(dtype), vals.to(dtype), bias.to(dtype), target.to(dtype)


def _case(op_name, provider, fn, B, K, F, D, dtype_name):
    dtype = DTYPES[dtype_name]

    def make():
        idx, weight, vals, bias, target = make_inputs(B, K, F, D, dtype, "cuda")
        params = [weight.requires_grad_(), vals.requires_grad_(), bias.requires_grad_()]
        return lambda: torch.autograd.grad(fn(idx, weight, vals, bias, target), params)

    isz = dtype.itemsize
    return harness.Case(
        op=op_name, provider=provider, shape=dict(B=B, K=K, F=F, D=D), dtype=dtype_name, mode="full", make=make,
        bytes_moved=(B * K * D + F * D + B * D) * isz, rounds=ROUNDS,
    )


def cases(*, quick=False):
    F, D, B = (8192, 512, 1024) if quick else (65536, 2304, 4096)
    out = []
    for K in (32, 64, 128):
        for op_name, (ours, ref) in OPS.items():
            # our fp32 and bf16 cases back to back (the targets compare them in ms), then the baselines
            for provider in ("sparsefuse", "torch", "torch.compile"):
                for dtype_name in DTYPES:
                    fn = {"sparsefuse": ours, "torch": ref}.get(provider) or torch.compile(ref, dynamic=False)
                    out.append(_case(op_name, provider, fn, B, K, F, D, dtype_name))
    return out


def render(out_dir=harness.RESULTS_DIR, readme="README.md"):
    results = [r for r in harness.load(FAMILY, out_dir) if r.mode == "full"]
    if not results:
        return None
    # K alone labels a row only while every result has the same (B, F, D): a --quick run saved into
    # the same folder would otherwise add rows that read exactly like the full-size ones
    same_bfd = len({(r.shape["B"], r.shape["F"], r.shape["D"]) for r in results}) == 1
    table = harness.speedup_table(results, shape_keys=["K"] if same_bfd else ["B", "K", "F", "D"],
                                  device_baselines=("torch.compile",))
    ratio_lines = _ratio_lines(results)
    text = table + ("\n\n" + ratio_lines if ratio_lines else "")
    return harness.publish(FAMILY, text, results, out_dir=out_dir, readme=readme,
                           title="SAE decoder loss, forward + backward", x_key="K")


def _ratio_lines(results):
    """Two comparisons among our own results, each in do_bench time and, where measured, device time:
    Hierarchical over TopK at each shape and dtype (the issue asks for <= 1.5x) and bf16 over fp32
    at each op and shape (bf16 must not be slower)."""
    ours = {(r.op, r.dtype, tuple(r.shape[k] for k in "KBFD")): r for r in results if r.provider == "sparsefuse"}
    labels = "K" if len({shape[1:] for _, _, shape in ours}) <= 1 else "KBFD"

    def where(shape):
        return " ".join(f"{k}={v}" for k, v in zip("KBFD", shape) if k in labels)

    def ratio(a, b):
        dev = f" (device {a.device_ms / b.device_ms:.2f}×)" if a.device_ms and b.device_ms else ""
        return f"{a.ms / b.ms:.2f}×{dev}"

    hier = [f"{dtype} {where(shape)}: {ratio(r, ours[('topk', dtype, shape)])}"
            for (op, dtype, shape), r in sorted(ours.items())
            if op == "hierarchical" and ("topk", dtype, shape) in ours]
    half = [f"{op} {where(shape)}: {ratio(r, ours[(op, 'fp32', shape)])}"
            for (op, dtype, shape), r in sorted(ours.items())
            if dtype == "bf16" and (op, "fp32", shape) in ours]
    lines = []
    if hier:
        lines.append("Hierarchical over TopK (sparsefuse): " + ", ".join(hier))
    if half:
        lines.append("bf16 over fp32 (sparsefuse; below 1 is faster): " + ", ".join(half))
    return "\n\n".join(lines)


def check(log=print) -> bool:
    """No GPU: compare the ops with the float64 reference on a small problem instead of timing."""
    ok = True
    for op_name, (ours, ref) in OPS.items():
        idx, weight, vals, bias, target = make_inputs(37, 5, 50, 24, torch.float32, "cpu")
        params = [weight.requires_grad_(), vals.requires_grad_(), bias.requires_grad_()]
        got = [ours(idx, weight, vals, bias, target)]
        got += torch.autograd.grad(got[0], params)
        p64 = [p.detach().double().requires_grad_() for p in params]
        want = [ref(idx, p64[0], p64[1], p64[2], target.double())]
        want += torch.autograd.grad(want[0], p64)
        err = harness.rel_err(got, want)
        good = err < 1e-5
        ok &= good
        log(f"  {op_name:<13} loss and gradients vs float64 reference: max relative error {err:.2e}  "
            f"{'ok' if good else 'FAILED'}")
    return ok
