"""Time a step of `train_sae` takes at a real SAE size, and what each of session 28's trainer changes
gives: the training rows held on the GPU or streamed through pinned buffers on a side stream (both
`sparsefuse.sae.train._Batches`) against the loader before (`train[rows].to(device,
non_blocking=True)` from pageable memory); AuxK skipped while no latent can be dead against computed
at every step; Adam with fused=True against without. Random activations, on which every latent keeps
firing: only the time means anything.

    python scripts/probe_trainer_batches.py [--rows 200000] [--steps 60] [--dtype bfloat16] [--out probe.json]
"""

import argparse
import json
import time

import torch

from sparsefuse.sae import train as train_mod
from sparsefuse.sae.modules import TopKSAE


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--d", type=int, default=2304)
    p.add_argument("--latents", type=int, default=32768)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--dead-tokens", type=int, default=10_000_000, help="the trainer's default for long runs")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    x = torch.randn(a.rows, a.d, generator=torch.Generator().manual_seed(0))
    train_mod._load_data = lambda cfg: (x[:-2048], x[-2048:], None)
    real_take = train_mod._Batches.take

    def pageable_take(self, start, stop):  # the loader before session 28
        rows = self.order[start:stop].cpu()
        return self.src.cpu()[rows].to(self.device, non_blocking=True)

    real_forward = TopKSAE.forward
    real_adam = torch.optim.Adam

    def unfused_adam(params, **kw):  # the trainer before session 28
        kw.pop("fused", None)
        return real_adam(params, **kw)

    def auxk_every_step(self, x, variance=None, *, auxk=True):  # the trainer before session 28
        return real_forward(self, x, variance, auxk=True)

    results = {}
    cases = (  # name, data on the GPU, loader, AuxK at every step, Adam without fused=True
        ("warm-up", True, real_take, False, False),
        ("resident", True, real_take, False, False),
        ("pinned stream", False, real_take, False, False),
        ("resident, AuxK every step", True, real_take, True, False),
        ("resident, Adam not fused", True, real_take, False, True),
        ("before: pageable, AuxK every step, Adam not fused", False, pageable_take, True, True),
        ("resident again", True, real_take, False, False),
    )
    for name, on_device, take, force_auxk, unfused in cases:
        train_mod._Batches.take = take
        TopKSAE.forward = auxk_every_step if force_auxk else real_forward
        torch.optim.Adam = unfused_adam if unfused else real_adam
        cfg = train_mod.TrainConfig(data="random", losses=("hierarchical",), k=a.k, n_latents=a.latents,
                                    batch_size=a.batch, steps=a.steps if name != "warm-up" else 5, device="cuda",
                                    dtype=a.dtype, data_on_device=on_device, dead_tokens=a.dead_tokens, out=None,
                                    progress=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run = train_mod.train_sae(cfg, log=lambda *_: None)["hierarchical"]
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        if name != "warm-up":
            results[name] = {"ms_per_step": 1e3 * run.seconds / a.steps, "whole_call_s": total,
                             "dead_frac": run.history["dead_frac"][-1]}
            print(f"{name:>50}: {results[name]['ms_per_step']:.3f} ms a step (training loop), call {total:.1f} s",
                  flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **vars(a)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
