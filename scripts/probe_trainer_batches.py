"""Time a step of `train_sae` takes at a real SAE size, and what each of session 28's trainer changes
gives: the training rows held on the GPU or streamed through pinned buffers on a side stream (both
`sparsefuse.sae.train._Batches`) against the loader before (`train[rows].to(device,
non_blocking=True)` from pageable memory); AuxK skipped while no latent can be dead against computed
at every step; Adam with fused=True against without. Random activations, on which every latent keeps
firing: only the time means anything. Then latents held dead (`--dead-fracs`): AuxK over every
latent against the trainer's superset of the dead ones, as k_aux gathers a row against the module's
rule (dense products over few candidate columns, `modules.AUXK_DENSE_RATIO`). Each case is timed
after a 3-step run of the same configuration, so no kernel compiles inside the timed steps.

    python scripts/probe_trainer_batches.py [--rows 200000] [--steps 60] [--dtype bfloat16] [--out probe.json]
"""

import argparse
import json
import time

import torch

from sparsefuse.sae import modules, train as train_mod
from sparsefuse.sae.modules import TopKSAE


def timed(name, a, **kw):
    """ms a step of the training loop, after a short run of the same configuration (so that no
    kernel compiles inside the timed steps), and the dead fraction at the end."""
    runs = []
    for steps in (3, a.steps):
        cfg = train_mod.TrainConfig(data="random", losses=("hierarchical",), k=a.k, n_latents=a.latents,
                                    batch_size=a.batch, steps=steps, device="cuda", dtype=a.dtype,
                                    dead_tokens=a.dead_tokens, out=None, progress=False, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runs.append(train_mod.train_sae(cfg, log=lambda *_: None)["hierarchical"])
        torch.cuda.synchronize()
    run = runs[-1]
    out = {"ms_per_step": 1e3 * run.seconds / a.steps, "whole_call_s": time.perf_counter() - t0,
           "dead_frac": run.history["dead_frac"][-1]}
    print(f"{name:>70}: {out['ms_per_step']:.3f} ms a step, dead at the end {out['dead_frac']:.4f}", flush=True)
    return out


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
    p.add_argument("--dead-fracs", type=float, nargs="*", default=[0.01, 0.05, 0.2],
                   help="fractions of latents kept dead, each timed with AuxK over every latent and over the "
                        "trainer's superset of the dead ones, as gathers and by the module's rule")
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
    real_ratio = modules.AUXK_DENSE_RATIO

    def unfused_adam(params, **kw):  # the trainer before session 28
        kw.pop("fused", None)
        return real_adam(params, **kw)

    def auxk_every_step(self, x, variance=None, *, auxk_latents=None):  # the trainer before session 28
        return real_forward(self, x, variance)

    results = {}
    cases = (  # name, data on the GPU, loader, AuxK at every step, Adam without fused=True
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
        results[name] = timed(name, a, data_on_device=on_device)
    # Latents that stay dead: their clocks start past dead_tokens and they never count as fired.
    # AuxK then runs at every step: over every latent (as before session 28's follow-up), or over the
    # trainer's superset of the dead ones, as k_aux gathers a row or by the module's rule (dense
    # products over few candidates).
    real_init, real_counts = TopKSAE.__init__, TopKSAE.fired_counts
    train_mod._Batches.take, torch.optim.Adam = real_take, real_adam
    for frac in a.dead_fracs:
        dead = torch.randperm(a.latents, generator=torch.Generator().manual_seed(1))[:int(frac * a.latents)]

        def init(self, *args, **kw):
            real_init(self, *args, **kw)
            self.tokens_since_fired[dead] = self.config["dead_tokens"] + 1

        def counts(self, indices, vals):
            return real_counts(self, indices, vals).index_fill_(0, dead.to(vals.device), 0)

        TopKSAE.__init__, TopKSAE.fired_counts = init, counts
        for name, force_auxk, ratio in (("AuxK over every latent, gathers", True, 0),
                                        ("AuxK over the trainer's superset, gathers", False, 0),
                                        ("AuxK over the trainer's superset, module's rule", False, real_ratio)):
            TopKSAE.forward = auxk_every_step if force_auxk else real_forward
            modules.AUXK_DENSE_RATIO = ratio
            results[f"{len(dead)} dead latents ({frac:.0%}), {name}"] = timed(
                f"{len(dead)} dead ({frac:.0%}), {name}", a, data_on_device=True)
        TopKSAE.__init__, TopKSAE.fired_counts = real_init, real_counts
        modules.AUXK_DENSE_RATIO = real_ratio
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **vars(a)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
