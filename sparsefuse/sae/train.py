"""Train TopK / HierarchicalTopK SAEs: ``sparsefuse train-sae`` and :func:`train_sae`.

One process, or several under ``torchrun`` with DistributedDataParallel (NCCL on GPUs, gloo on
CPU) and the same command line: every process reads the same data and the same seeded order of
global batches and trains on its slice of each; gradients are averaged, the dead-latent counts
summed. The loss is divided by the variance of the whole data set, not of the batch, so the
average of the slices' gradients is the gradient of the global batch (the weights match one
process on the same global batch).

Outputs in ``--out``: ``sae.safetensors`` (``sae_<loss>.safetensors`` per loss when training
several), ``metrics.json`` (config, FVU at each k', dead fraction and loss over training, and on
synthetic data the ground-truth feature recovery) and ``sae.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from .._validate import check_positive_int
from .data import expected_active, load_activations, synthetic_activations
from .modules import TopKSAE, check_auxk_alpha, check_dead_tokens, json_number

__all__ = ["TrainConfig", "RunResult", "train_sae", "feature_recovery", "plot_runs"]

LOSSES = ("topk", "hierarchical")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainConfig:
    """Everything a training run needs. Defaults: the small synthetic run of the README (well under
    a minute on a 2-core CPU). ``data=None`` means the embedded synthetic set."""

    data: Optional[str] = None  #: activations file (.npy, .pt, .safetensors), [N, D]; None: synthetic
    losses: tuple = ("hierarchical",)  #: which SAEs to train ("topk", "hierarchical"), same data and init
    k: int = 16
    n_latents: int = 256
    lr: Optional[float] = None  #: Adam learning rate; default 2e-4 / sqrt(n_latents / 2**14)
    batch_size: int = 512  #: global batch (split across processes)
    steps: int = 2000
    device: str = "auto"
    dtype: str = "float32"  #: "bfloat16": bf16 autocast around the forward pass, float32 weights
    seed: int = 0
    auxk_alpha: float = 1 / 32
    dead_tokens: Optional[int] = None  #: default min(10M, steps * batch_size // 5)
    eval_rows: int = 8192  #: held-out rows for the FVU curve (the last ones of a data file, at most a tenth)
    data_on_device: Optional[bool] = None  #: CUDA: hold the training rows on the GPU; None: if they take <= half the free memory
    n_samples: int = 32768  #: synthetic: training rows
    d_model: int = 32  #: synthetic: width
    n_features: int = 256  #: synthetic: ground-truth features
    mean_active: float = 5.0  #: synthetic: mean number of active features per row
    noise: float = 0.02  #: synthetic: noise std relative to the signal's
    out: Optional[str] = "sae_out"  #: output folder (None: write nothing)
    plot: bool = True
    progress: bool = True
    log_every: int = 25


@dataclass
class RunResult:
    loss: str
    model: TopKSAE
    fvu: dict
    history: dict = field(default_factory=dict)
    recovery: Optional[dict] = None
    seconds: float = 0.0


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world():
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def _check_device(device: str) -> None:
    """Refuse a device this machine cannot train on, before the data is read."""
    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _init_distributed(device: str) -> Optional[str]:
    """Start the process group when launched by torchrun; returns the device to use."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return device
    if device not in ("auto", "cuda", "cpu"):  # every process would train on that one GPU, over gloo
        raise ValueError(f"device={device!r} under torchrun ({world} processes): use auto, cuda or cpu; "
                         f"each process then takes cuda:LOCAL_RANK")
    cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return "cpu" if device == "auto" else device


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _load_data(cfg: TrainConfig):
    """(train [N, D], eval [M, D], ground-truth dictionary or None), on the CPU, float32."""
    if cfg.data is None:
        x, G = synthetic_activations(cfg.n_samples + cfg.eval_rows, cfg.d_model, cfg.n_features, cfg.mean_active,
                                     cfg.noise, cfg.seed)
        return x[:cfg.n_samples], x[cfg.n_samples:], G
    x = load_activations(cfg.data)
    n_eval = min(cfg.eval_rows, x.shape[0] // 10)
    if n_eval < 2:  # FVU divides by the held-out rows' variance, which one row does not have
        raise ValueError(f"{cfg.data} holds {x.shape[0]} rows; at least 20 are needed to hold out 10% "
                         f"(at least 2 rows) for the FVU curve")
    return x[:-n_eval], x[-n_eval:], None


def _data_stats(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(mean [D] float32, variance about it over every element) of the rows of ``x``, summed in
    float64 a few MiB of rows at a time: a float64 copy of the whole set would take twice its size."""
    n, d = x.shape
    step = max(1, (1 << 22) // d)
    total = torch.zeros(d, dtype=torch.float64)
    for s in range(0, n, step):
        total += x[s:s + step].sum(0, dtype=torch.float64)
    mean = total / n
    sq = 0.0
    for s in range(0, n, step):
        sq += float((x[s:s + step].double() - mean).square().sum())
    return mean.float(), sq / (n * d)


class _Batches:
    """The training rows of each step, on ``device``.

    CUDA: the training set is copied to the GPU once when ``on_device`` (None: when it takes at most
    half of the free memory), and a batch is a gather there. Otherwise each batch is gathered on the
    host into one of two pinned buffers and copied on a side stream. A copy from pageable memory
    can block the host until the GPU has reached it in its stream; a pinned one on its own stream
    overlaps the GPU's work on the step before. CPU: an index into the set."""

    def __init__(self, train: torch.Tensor, rows_per_step: int, device: torch.device, on_device: Optional[bool]):
        self.src, self.device, self.stream = train, device, None
        if device.type == "cuda":
            if on_device is None:
                on_device = train.numel() * train.element_size() <= torch.cuda.mem_get_info(device)[0] // 2
            if on_device:
                self.src = train.to(device)
            else:
                self.pinned = [torch.empty(rows_per_step, train.shape[1]).pin_memory() for _ in range(2)]
                self.copied = [None, None]
                self.stream, self.turn = torch.cuda.Stream(device), 0
        self.order = None

    def new_epoch(self, order: torch.Tensor) -> None:
        """Take rows in ``order`` (a CPU permutation) from now on."""
        self.order = order.to(self.src.device)

    def take(self, start: int, stop: int) -> torch.Tensor:
        rows = self.order[start:stop]
        if self.stream is None:
            return self.src[rows]
        t = self.turn
        if self.copied[t] is not None:
            self.copied[t].synchronize()  # the copy out of this buffer, two batches ago, has finished
        buf = torch.index_select(self.src, 0, rows, out=self.pinned[t])
        with torch.cuda.stream(self.stream):
            xb = buf.to(self.device, non_blocking=True)
            self.copied[t] = self.stream.record_event()
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        xb.record_stream(compute)  # allocated on the side stream, used on the compute stream
        self.turn = 1 - t
        return xb


def _latents_over(model: TopKSAE, tokens: int) -> torch.Tensor:
    """``[C]`` int64: the latents whose dead-latent clock is past ``tokens`` (a host sync)."""
    return (model.tokens_since_fired > tokens).nonzero().squeeze(1)


def feature_recovery(W_dec: torch.Tensor, G: torch.Tensor) -> dict:
    """Mean over true features of the best cosine similarity with any decoder row, and the share above 0.9."""
    W = W_dec.detach().double().cpu()
    W = W / W.norm(dim=1, keepdim=True).clamp_min(1e-12)
    best = (G.double() @ W.T).max(dim=1).values
    return {"mean_max_cos": float(best.mean()), "frac_above_0.9": float((best > 0.9).double().mean())}


class _Progress:
    """A one-line progress bar on a terminal; a line every 10 % otherwise (logs, CI)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.next_pct = 10

    def update(self, step: int, text: str):
        if not self.enabled:
            return
        pct = 100 * step / self.total
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        if self.tty:
            bar = "#" * int(pct / 5)
            sys.stderr.write(f"\r{self.label} [{bar:<20}] {step}/{self.total} {text} {rate:.0f} it/s ")
            sys.stderr.flush()
        elif pct >= self.next_pct or step == self.total:
            sys.stderr.write(f"{self.label} {step}/{self.total} ({pct:.0f}%) {text} {rate:.0f} it/s\n")
            self.next_pct = pct + 10

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _train_one(cfg: TrainConfig, loss: str, train: torch.Tensor, eval_x: torch.Tensor, G, device,
               stats: tuple, batches: _Batches) -> RunResult:
    rank, world = _rank_world()
    D = train.shape[1]
    dead_tokens = cfg.dead_tokens if cfg.dead_tokens is not None else min(10_000_000, cfg.steps * cfg.batch_size // 5)
    model = TopKSAE(D, cfg.n_latents, cfg.k, hierarchical=(loss == "hierarchical"), auxk_alpha=cfg.auxk_alpha,
                    dead_tokens=dead_tokens, seed=cfg.seed).to(device)
    mean, variance = stats
    with torch.no_grad():
        model.b_dec.copy_(mean)
    variance = torch.tensor(max(variance, 1e-30), device=device)
    lr = cfg.lr if cfg.lr is not None else 2e-4 / math.sqrt(cfg.n_latents / 2**14)
    opt = torch.optim.Adam(model.parameters(), lr=lr, fused=device.type == "cuda")  # one kernel a step on CUDA
    net = model
    if world > 1:
        with warnings.catch_warnings():  # newer torch renames the flag; the old name keeps working
            warnings.simplefilter("ignore", FutureWarning)
            net = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    local = cfg.batch_size // world
    g = torch.Generator().manual_seed(cfg.seed + 7)
    order, pos = torch.randperm(train.shape[0], generator=g), 0
    batches.new_epoch(order)
    autocast = cfg.dtype == "bfloat16"
    history = {"step": [], "loss": [], "dead_frac": []}
    bar = _Progress(cfg.steps, f"{loss:>12}", cfg.progress and rank == 0)
    # What AuxK needs to know of the dead latents, learnt on the host at each logging step (where it
    # waits anyway) and bounded in between: the dead-latent clock grows by at most batch_size a step.
    # clock_bound is at least its largest value: while that is at most dead_tokens no latent is dead,
    # AuxK's loss and gradients are 0, and it is skipped. Otherwise it searches only the latents
    # whose clock can pass dead_tokens before the next logging step (all dead ones among them).
    horizon = cfg.log_every * cfg.batch_size
    clock_bound, maybe_dead = int(model.tokens_since_fired.max()), _latents_over(model, dead_tokens - horizon)
    no_latents = maybe_dead[:0]
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        if pos + cfg.batch_size > order.numel():
            order, pos = torch.randperm(train.shape[0], generator=g), 0
            batches.new_epoch(order)
        xb = batches.take(pos + rank * local, pos + (rank + 1) * local)
        pos += cfg.batch_size
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = net(xb, variance, auxk_latents=maybe_dead if clock_bound > dead_tokens else no_latents)
        out.loss.backward()
        model.remove_parallel_grad_()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.normalize_decoder_()
        counts = model.fired_counts(out.indices, out.vals)
        if world > 1:
            _dist().all_reduce(counts)
        model.record_firing(counts, cfg.batch_size)
        clock_bound += cfg.batch_size
        if step % cfg.log_every == 0 or step == cfg.steps:
            recon_t = out.recon_loss.detach().float().reshape(1)
            if world > 1:  # the mean over the global batch (each rank's shard is the same size)
                _dist().all_reduce(recon_t)
                recon_t /= world
            recon = float(recon_t)
            dead = float(model.dead_mask().float().mean())
            clock_bound = int(model.tokens_since_fired.max())
            maybe_dead = _latents_over(model, dead_tokens - horizon)
            history["step"].append(step)
            history["loss"].append(recon)
            history["dead_frac"].append(dead)
            bar.update(step, f"loss {recon:.4f} dead {dead:.3f}")
    bar.close()
    seconds = time.perf_counter() - start
    model.eval()
    fvu = model.fvu_curve(eval_x.to(device))
    recovery = feature_recovery(model.W_dec, G) if G is not None else None
    return RunResult(loss, model, fvu, history, recovery, seconds)


def train_sae(cfg: Optional[TrainConfig] = None, log=print) -> dict:
    """Train one SAE per entry of ``cfg.losses`` on the same data; write outputs to ``cfg.out``.

    Returns ``{loss: RunResult}``. Under ``torchrun`` every process calls this; only rank 0 writes.
    """
    cfg = TrainConfig() if cfg is None else cfg
    if isinstance(cfg.losses, str):  # iterating "topk" would report an unknown loss 't'
        raise ValueError(f"losses must be a tuple of loss names, got the string {cfg.losses!r}; "
                         f"write losses=({cfg.losses!r},)")
    for loss in cfg.losses:
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)}")
    if len(set(cfg.losses)) < len(cfg.losses):  # the second run replaced the first in the results
        raise ValueError(f"losses names a loss more than once: {tuple(cfg.losses)!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {cfg.dtype!r}; choose from {', '.join(DTYPES)}")
    for name in ("k", "n_latents", "steps", "batch_size", "log_every", "eval_rows"):
        check_positive_int(name, getattr(cfg, name))  # whole numbers: a float k failed later, in torch.topk
    if cfg.k > cfg.n_latents:
        raise ValueError(f"k={cfg.k} is larger than n_latents={cfg.n_latents}")
    if cfg.eval_rows < 2:
        raise ValueError(f"eval_rows must be >= 2 (FVU needs the held-out rows' variance), got {cfg.eval_rows}")
    if cfg.lr is not None and not (0 < cfg.lr < 1e30):  # Adam accepts inf; 1e300 failed at the first step
        raise ValueError(f"lr must be finite and > 0 (below 1e30), got {cfg.lr}")
    if cfg.dead_tokens is not None:
        check_dead_tokens(cfg.dead_tokens)  # before the data is read (TopKSAE checks it when built)
    if not 0 <= cfg.seed < 2**63:  # -1 and 2^63 - 1 seed the same generator; 2^64 - 1 overflowed
        raise ValueError(f"seed must lie in [0, 2^63), got {cfg.seed}")
    check_auxk_alpha(cfg.auxk_alpha)  # before the data is read (TopKSAE checks it when built)
    if cfg.data is None and cfg.n_samples < 1:
        raise ValueError(f"n_samples (synthetic training rows) must be >= 1, got {cfg.n_samples}")
    if cfg.data is None:  # the synthetic set's sizes, by the names the caller used (not the generator's)
        check_positive_int("d_model", cfg.d_model)
        check_positive_int("n_features", cfg.n_features)
    _check_device(cfg.device)
    if cfg.out:  # made now: a path that cannot be a folder was found only after training
        try:
            os.makedirs(cfg.out, exist_ok=True)
        except OSError as e:
            raise ValueError(f"out={cfg.out!r} cannot be made a folder: {e.strerror or e}") from e
    train, eval_x, G = _load_data(cfg)
    if cfg.batch_size > train.shape[0]:  # a batch would be the whole set, uneven slices under DDP
        raise ValueError(f"batch_size={cfg.batch_size} is larger than the {train.shape[0]} training rows")
    device = _resolve_device(_init_distributed(cfg.device))
    rank, world = _rank_world()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the number of processes ({world})")
    if rank == 0:
        src = cfg.data or (f"synthetic: {train.shape[0]} rows, D={train.shape[1]}, {cfg.n_features} true features,"
                           f" ~{expected_active(cfg.n_features, cfg.mean_active):.3g} active per row")
        log(f"data: {src}; eval rows: {eval_x.shape[0]}; device: {device}"
            + (f" x {world} processes" if world > 1 else "") + f"; dtype: {cfg.dtype}")
    stats = _data_stats(train)
    if not stats[1] > 0:  # the loss is divided by it: every row the same trains nothing, FVU is NaN
        raise ValueError("the training data has no variance: every row is the same")
    batches = _Batches(train, cfg.batch_size // world, device, cfg.data_on_device)
    runs = {}
    for loss in cfg.losses:
        runs[loss] = _train_one(cfg, loss, train, eval_x, G, device, stats, batches)
        if rank == 0:
            log(_summary(runs[loss], cfg))
    if rank == 0 and cfg.out:
        _write_outputs(cfg, runs, train.shape, log)
    return runs


def _summary(run: RunResult, cfg: TrainConfig) -> str:
    lines = [f"{run.loss} SAE (K={cfg.k}, {cfg.n_latents} latents): {run.seconds:.1f} s, "
             f"dead latents {run.history['dead_frac'][-1]:.1%}"]
    lines.append("  k'   " + " ".join(f"{k:>7}" for k in run.fvu))
    lines.append("  FVU  " + " ".join(f"{v:7.4f}" for v in run.fvu.values()))
    if run.recovery:
        lines.append(f"  ground-truth feature recovery: mean best cosine {run.recovery['mean_max_cos']:.3f}, "
                     f"{run.recovery['frac_above_0.9']:.1%} of features above 0.9")
    return "\n".join(lines)


#: every file name the trainer writes into ``out``
OUTPUT_NAMES = ("metrics.json", "sae.png", "sae.safetensors") + tuple(f"sae_{loss}.safetensors" for loss in LOSSES)


def _write_outputs(cfg: TrainConfig, runs: dict, shape, log) -> None:
    os.makedirs(cfg.out, exist_ok=True)
    metrics = {"config": asdict(cfg), "data_shape": list(shape), "torch": torch.__version__, "runs": {}}
    metrics["config"]["losses"] = list(cfg.losses)
    written = {"metrics.json"}
    for loss, run in runs.items():
        name = "sae.safetensors" if len(runs) == 1 else f"sae_{loss}.safetensors"
        written.add(name)
        run.model.save(os.path.join(cfg.out, name))
        metrics["runs"][loss] = {
            "checkpoint": name, "fvu": {str(k): v for k, v in run.fvu.items()}, "recovery": run.recovery,
            "history": run.history, "seconds": run.seconds,
        }
    with open(os.path.join(cfg.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1, default=json_number)
    path = plot_runs(metrics, os.path.join(cfg.out, "sae.png")) if cfg.plot else None
    if path:
        written.add("sae.png")
    # outputs of an earlier run into this folder that this one did not rewrite (a checkpoint of
    # another loss set, a plot) would sit beside metrics.json without matching it
    stale = [n for n in OUTPUT_NAMES if n not in written and os.path.exists(os.path.join(cfg.out, n))]
    for name in stale:
        os.remove(os.path.join(cfg.out, name))
    if stale:
        log(f"removed {', '.join(stale)} of an earlier run from {cfg.out}")
    if cfg.plot:
        log(f"wrote {cfg.out}/metrics.json, checkpoint(s) and " + (path or "no plot (matplotlib not installed)"))
    else:
        log(f"wrote {cfg.out}/metrics.json and checkpoint(s)")


def plot_runs(metrics: dict, path: str, title: Optional[str] = None) -> Optional[str]:
    """FVU against k' (log-log), dead-latent fraction and loss over training, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cfg = metrics["config"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    colors = {"hierarchical": "tab:blue", "topk": "tab:orange"}
    for loss, run in metrics["runs"].items():
        ks = [int(k) for k in run["fvu"]]
        label = f"{loss} (K={cfg['k']})"
        if run.get("recovery"):
            label += f", recovery {run['recovery']['mean_max_cos']:.2f}"
        axes[0].plot(ks, list(run["fvu"].values()), "o-", color=colors.get(loss), label=label)
        axes[1].plot(run["history"]["step"], run["history"]["dead_frac"], color=colors.get(loss), label=loss)
        axes[2].plot(run["history"]["step"], run["history"]["loss"], color=colors.get(loss), label=loss)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("k' (first k' latents of the K-sparse code)")
    axes[0].set_ylabel("FVU (held-out, lower is better)")
    axes[0].set_title("FVU at every sparsity k' <= K")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("fraction of dead latents")
    axes[1].set_title("dead latents")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("loss / variance (hierarchical: mean over k)")
    axes[2].set_yscale("log")
    axes[2].set_title("reconstruction loss")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or f"{cfg.get('data') or 'synthetic data'}: {cfg['n_latents']} latents, K={cfg['k']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train-sae`` command line (shared by the CLI and ``python -m sparsefuse.sae.train``)."""
    d = TrainConfig()
    p.add_argument("--data", default=None, help="activations file [N, D] (.npy, .pt, .safetensors); "
                   "default: the embedded synthetic set")
    p.add_argument("--loss", default="hierarchical", choices=[*LOSSES, "both"],
                   help="hierarchical (default), topk, or both (same data and init, one plot)")
    p.add_argument("--k", type=int, default=d.k, help=f"active latents per row (default {d.k})")
    p.add_argument("--latents", type=int, default=d.n_latents, help=f"dictionary size (default {d.n_latents})")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate (default 2e-4 / sqrt(latents / 2**14))")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"global batch (default {d.batch_size})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimiser steps (default {d.steps})")
    p.add_argument("--device", default=d.device, help="auto (default), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPES), help="float32, or bfloat16 autocast")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--auxk-alpha", type=float, default=d.auxk_alpha, help="AuxK weight (0: off)")
    p.add_argument("--dead-tokens", type=int, default=None,
                   help="tokens without firing before a latent counts as dead (default min(10M, steps*batch/5))")
    p.add_argument("--n-samples", type=int, default=d.n_samples, help="synthetic: training rows")
    p.add_argument("--d-model", type=int, default=d.d_model, help="synthetic: width D")
    p.add_argument("--features", type=int, default=d.n_features, help="synthetic: ground-truth features")
    p.add_argument("--mean-active", type=float, default=d.mean_active, help="synthetic: active features per row")
    p.add_argument("--eval-rows", type=int, default=d.eval_rows,
                   help="held-out rows for the FVU curve (from a data file: its last rows, at most a tenth)")
    p.add_argument("--data-on-device", default="auto", choices=["auto", "yes", "no"],
                   help="CUDA: hold the training rows on the GPU (auto: if they take at most half the free memory)")
    p.add_argument("--out", default=d.out, help="output folder (checkpoint, metrics.json, sae.png)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        data=a.data, losses=LOSSES if a.loss == "both" else (a.loss,), k=a.k, n_latents=a.latents, lr=a.lr,
        batch_size=a.batch_size, steps=a.steps, device=a.device, dtype=a.dtype, seed=a.seed,
        auxk_alpha=a.auxk_alpha, dead_tokens=a.dead_tokens, n_samples=a.n_samples, d_model=a.d_model,
        n_features=a.features, mean_active=a.mean_active, eval_rows=a.eval_rows,
        data_on_device={"auto": None, "yes": True, "no": False}[a.data_on_device], out=a.out,
        plot=not a.no_plot, progress=not a.quiet,
    )


def run_cli(a: argparse.Namespace) -> int:
    """``sparsefuse train-sae``: returns the exit status; bad input prints one clear line."""
    try:
        train_sae(config_from_args(a))
    except (ValueError, FileNotFoundError) as e:
        print(f"sparsefuse train-sae: error: {e}", file=sys.stderr)
        return 2
    finally:
        d = _dist()
        if d:
            d.destroy_process_group()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsefuse.sae.train", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
