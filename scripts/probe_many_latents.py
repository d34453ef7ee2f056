"""Rows of many latents (session 36): do the ops run, and what do blocks of latents cost?

``python scripts/probe_many_latents.py sae <cap>``: TopK loss, decode and ``sparse_linear`` forward +
backward at K = 512 .. 8192 (B = 512, F = 65536, D = 2304, fp32, as session 13's
``probe_topk_large_k.py``) with ``kernels._MAX_BLOCK_K`` set to ``cap``: 512 is the package's; a
cap above K gives the single tile of every latent that the kernels used before (its compile takes
38 s at K = 8192, so that cap stops at 4096). The first call's seconds (compiles included) and
do_bench ms; one JSON line per case on stdout, as it finishes.

``python scripts/probe_many_latents.py kd <K>``: the three KD forms forward + backward at one K (N = 64,
V = 32000, H = 256, fp32), each reported as ok or with its error.

Run each under ``timeout``: a single tile of thousands of latents may compile for minutes.
"""

import json
import sys
import time

import torch
from triton.testing import do_bench

import sparsefuse
from sparsefuse.sae import kernels


def _time(fn, row, name):
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    row[name + "_first_s"] = round(time.perf_counter() - t0, 2)
    row[name + "_ms"] = do_bench(fn, warmup=25, rep=100)


def sae(cap: int) -> None:
    kernels._MAX_BLOCK_K = cap
    B, F, D = 512, 65536, 2304
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(F, D, device="cuda", generator=g) / D**0.5).requires_grad_()
    w_enc = torch.randn(F, D, device="cuda", generator=g).requires_grad_()
    b = torch.randn(D, device="cuda", generator=g).requires_grad_()
    x = torch.randn(B, D, device="cuda", generator=g)
    gd = torch.randn(B, D, device="cuda", generator=g)
    for K in (512, 1024, 2048, 4096, 8192):
        if K > 4096 and cap > K:
            break
        idx = torch.rand(B, F, device="cuda", generator=g).topk(K, dim=1).indices
        vals = torch.rand(B, K, device="cuda", generator=g).sort(dim=1, descending=True).values.requires_grad_()
        gl = torch.randn(B, K, device="cuda", generator=g)
        row = dict(K=K, cap=cap)
        try:
            _time(lambda: torch.autograd.grad(sparsefuse.topk_sae_loss(idx, w, vals, b, x), [w, vals, b]), row, "topk")
            _time(lambda: torch.autograd.grad(sparsefuse.sae_decode(idx, vals, w, b), [w, vals, b], gd), row, "decode")
            _time(lambda: torch.autograd.grad(sparsefuse.sparse_linear(x, w_enc, idx, None, b), [w_enc, b], gl), row,
                  "linear")
        except Exception as e:  # noqa: BLE001 - reported, not raised
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)


def kd(K: int) -> None:
    N, V, H = 64, 32000, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=g).requires_grad_()
    head = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).requires_grad_()
    logits = (hidden.detach() @ head.detach().t()).requires_grad_()
    ids = torch.rand(N, V, device="cuda", generator=g).topk(K, dim=1).indices
    t = torch.log_softmax(torch.randn(N, K, device="cuda", generator=g), -1)
    forms = {
        "gathered": lambda: torch.autograd.grad(sparsefuse.topk_kd_loss(logits.gather(1, ids), t), [logits]),
        "logits": lambda: torch.autograd.grad(sparsefuse.topk_kd_loss_from_logits(logits, ids, t), [logits]),
        "hidden": lambda: torch.autograd.grad(sparsefuse.topk_kd_loss_from_hidden(hidden, head, ids, t), [hidden, head]),
        "hidden_topk": lambda: torch.autograd.grad(
            sparsefuse.topk_kd_loss_from_hidden(hidden, head, ids, t, normalize="topk"), [hidden, head]),
    }
    for name, fn in forms.items():
        row = dict(K=K, form=name)
        try:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            row["ok"] = True
            row["first_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    {"sae": sae, "kd": kd}[sys.argv[1]](int(sys.argv[2]))
