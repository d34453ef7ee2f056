"""The SAE trainer: CLI end to end, activation files, bad input, and DDP (gloo, 2 CPU processes)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sparsefuse.cli import main as cli
from sparsefuse.sae.data import load_activations, synthetic_activations
from sparsefuse.sae.modules import TopKSAE
from sparsefuse.sae.train import TrainConfig, feature_recovery, train_sae

from helpers import end_spawned_worker, free_port

TINY = ["--steps", "12", "--n-samples", "256", "--eval-rows", "64", "--batch-size", "32", "--latents", "16",
        "--k", "4", "--d-model", "8", "--features", "12", "--mean-active", "3", "--quiet"]


def _plain_env():
    """The environment of a user's CPU run: no Triton interpreter, so the ops take their exact
    PyTorch CPU path (the interpreter, ~1 s per step here, is exercised by test_sae_modules.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "sparsefuse", "train-sae", "--loss", "both", "--out", str(out), *TINY],
                          env=_plain_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "FVU" in proc.stdout and "ground-truth feature recovery" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    for loss in ("topk", "hierarchical"):
        run = metrics["runs"][loss]
        assert list(run["fvu"]) == ["1", "2", "4"]
        assert all(0 <= v < 10 for v in run["fvu"].values())
        assert 0 < run["recovery"]["mean_max_cos"] <= 1
        assert len(run["history"]["dead_frac"]) == len(run["history"]["step"]) > 0
        model = TopKSAE.load(str(out / run["checkpoint"]))
        assert model.hierarchical == (loss == "hierarchical") and model.k == 4
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "sae.png").stat().st_size > 1000


@pytest.mark.parametrize("ext", [".npy", ".pt", ".safetensors"])
def test_activation_files(tmp_path, ext):
    x = torch.randn(300, 6)
    path = str(tmp_path / f"acts{ext}")
    if ext == ".npy":
        np.save(path, x.numpy())
    elif ext == ".pt":
        torch.save({"activations": x}, path)
    else:
        from safetensors.torch import save_file

        save_file({"acts": x}, path)
    assert torch.equal(load_activations(path), x)
    runs = train_sae(TrainConfig(data=path, k=2, n_latents=8, batch_size=20, steps=3, out=None, progress=False),
                     log=lambda *_: None)
    assert runs["hierarchical"].recovery is None and set(runs["hierarchical"].fvu) == {1, 2}


def test_log_every_must_be_positive():
    """log_every=0 passed the set-up and died in a ZeroDivisionError at the first step."""
    with pytest.raises(ValueError, match="log_every must be a positive int, got 0"):
        train_sae(TrainConfig(k=2, n_latents=8, batch_size=20, steps=3, out=None, progress=False, log_every=0),
                  log=lambda *_: None)


def test_losses_given_as_a_string_is_refused_by_name():
    """losses="topk" iterated as characters and failed with "unknown loss 't'"."""
    with pytest.raises(ValueError, match=r"losses must be a tuple of loss names, got the string 'topk'; "
                                         r"write losses=\('topk',\)"):
        train_sae(TrainConfig(losses="topk", k=2, n_latents=8, batch_size=20, steps=3, out=None, progress=False),
                  log=lambda *_: None)


@pytest.mark.parametrize("kw, msg", [
    # trained both and returned the second, silently dropping the first
    (dict(losses=("topk", "topk")), r"losses names a loss more than once: \('topk', 'topk'\)"),
    (dict(k=2.0), "k must be a positive int, got 2.0"),  # failed in torch.topk
    (dict(batch_size=20.0), "batch_size must be a positive int, got 20.0"),
    # the upper bounds, on a set small enough that a run past a missing check ends soon
    (dict(seed=2**63, n_samples=200, eval_rows=20), r"seed must lie in \[0, 2\^63\), got 9223372036854775808"),
    (dict(lr=1e300, n_samples=200, eval_rows=20), r"lr must be finite and > 0 \(below 1e30\), got 1e\+300"),
])
def test_config_refused_by_name(kw, msg):
    cfg = dict(k=2, n_latents=8, batch_size=20, steps=3, out=None, progress=False) | kw
    with pytest.raises(ValueError, match=msg):
        train_sae(TrainConfig(**cfg), log=lambda *_: None)


def test_every_message_goes_through_log(tmp_path, capsys):
    """The closing "wrote ..." line was printed past a caller's ``log``."""
    lines = []
    train_sae(TrainConfig(k=2, n_latents=8, batch_size=20, steps=2, n_samples=200, eval_rows=20, plot=False,
                          progress=False, out=str(tmp_path / "o")), log=lines.append)
    assert capsys.readouterr().out == ""
    assert lines[-1] == f"wrote {tmp_path / 'o'}/metrics.json and checkpoint(s)"


def test_rerun_into_a_folder_removes_the_earlier_runs_outputs(tmp_path):
    """A run of both losses, then one of "topk" into the same folder: the first run's two
    checkpoints stayed beside the second's sae.safetensors and metrics.json, which no longer named
    them. The trainer's own outputs that a run does not rewrite are removed, and it says so; other
    files are left alone."""
    out = tmp_path / "o"
    kw = dict(k=2, n_latents=8, batch_size=20, steps=2, n_samples=200, eval_rows=20, plot=False, progress=False,
              out=str(out))
    train_sae(TrainConfig(losses=("topk", "hierarchical"), **kw), log=lambda *_: None)
    (out / "notes.txt").write_text("mine")
    assert {"sae_topk.safetensors", "sae_hierarchical.safetensors"} <= {p.name for p in out.iterdir()}
    lines = []
    train_sae(TrainConfig(losses=("topk",), **kw), log=lines.append)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "notes.txt", "sae.safetensors"]
    assert f"removed sae_topk.safetensors, sae_hierarchical.safetensors of an earlier run from {out}" in lines


def test_a_runs_own_plot_is_kept_and_a_stale_one_removed(tmp_path):
    """The plot a run has just written is one of its outputs, not a leftover: it stays beside
    metrics.json; a later run without a plot removes it as stale and says so."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "o"
    kw = dict(losses=("topk",), k=2, n_latents=8, batch_size=20, steps=2, n_samples=200, eval_rows=20,
              progress=False, out=str(out))
    lines = []
    train_sae(TrainConfig(plot=True, **kw), log=lines.append)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "sae.png", "sae.safetensors"]
    assert not any(line.startswith("removed") for line in lines), lines
    lines.clear()
    train_sae(TrainConfig(plot=False, **kw), log=lines.append)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "sae.safetensors"]
    assert f"removed sae.png of an earlier run from {out}" in lines


def _write(tmp_path, name, x):
    path = str(tmp_path / name)
    np.save(path, x)
    return path


@pytest.mark.parametrize("case, msg", [
    ("missing", "activations file not found"),
    ("shape", r"must have shape \[N, D\], got shape \(10,\)"),
    ("nan", "contain 2 non-finite values"),
    ("ext", "unknown activations format '.txt'"),
    ("k", "k=40 is larger than n_latents=16"),
    ("batch", r"batch_size=32 is larger than the 18 training rows"),
    ("few-rows", r"a\.npy holds 19 rows; at least 20 are needed to hold out 10% \(at least 2 rows\)"),
    ("eval-rows", r"eval_rows must be >= 2 \(FVU needs the held-out rows' variance\), got 1"),
    ("mean-active", r"mean_active must be a positive finite number, got nan"),
    ("n-samples", r"n_samples \(synthetic training rows\) must be >= 1, got -100"),
    ("dead-tokens", r"dead_tokens must be an int >= 0 and below 2\^62, got -1"),
    ("dead-tokens-huge", r"dead_tokens must be an int >= 0 and below 2\^62, got 100000000000000000000000"),
    ("seed", r"seed must lie in \[0, 2\^63\), got -1"),
    ("out-file", r"out='.*afile' cannot be made a folder"),
    ("out-under-file", r"out='.*afile/sub' cannot be made a folder"),
    ("float8", r"activations must be float16/bfloat16/float32/float64 or signed integers, got dtype "
               r"torch.float8_e4m3fn"),
    ("sparse", r"activations must be a dense tensor holding data, got layout torch.sparse_coo"),
    ("auxk-inf", r"auxk_alpha must be finite and >= 0 \(0 turns AuxK off\), got inf"),
    ("auxk-negative", r"auxk_alpha must be finite and >= 0 \(0 turns AuxK off\), got -0.5"),
    ("lr-inf", r"lr must be finite and > 0 \(below 1e30\), got inf"),
    ("lr-zero", r"lr must be finite and > 0 \(below 1e30\), got 0.0"),
    ("lr-huge", r"lr must be finite and > 0 \(below 1e30\), got 1e\+300"),  # Adam failed at the first step
    ("float64-overflow", r"contain 1 finite values beyond float32's range, which float32 makes infinite in 1 rows"),
    ("constant", "the training data has no variance: every row is the same"),  # trained, printed FVU nan
])
def test_bad_input_messages(tmp_path, capsys, case, msg):
    args = ["train-sae", "--quiet", "--out", str(tmp_path / "o"), "--steps", "2", "--latents", "16"]
    if case == "missing":
        args += ["--data", str(tmp_path / "nope.npy")]
    elif case == "shape":
        args += ["--data", _write(tmp_path, "a.npy", np.zeros(10, np.float32))]
    elif case == "nan":
        x = np.ones((20, 4), np.float32)
        x[3, 1], x[5, 0] = np.nan, np.inf
        args += ["--data", _write(tmp_path, "a.npy", x)]
    elif case == "ext":
        (tmp_path / "a.txt").write_text("1 2 3")
        args += ["--data", str(tmp_path / "a.txt")]
    elif case == "batch":  # 20 rows, 2 held out: a batch of 32 would be the 18 rows, split unevenly under DDP
        args += ["--data", _write(tmp_path, "a.npy", np.ones((20, 4), np.float32)), "--batch-size", "32"]
    elif case == "few-rows":  # 10% of 19 is one row, whose FVU would divide by zero variance
        args += ["--data", _write(tmp_path, "a.npy", np.ones((19, 4), np.float32)), "--batch-size", "4"]
    elif case == "eval-rows":
        args += ["--eval-rows", "1"]
    elif case == "mean-active":  # NaN passed "mean_active <= 0": all-zero data, FVU NaN, exit status 0
        args += ["--mean-active", "nan"]
    elif case == "n-samples":  # a negative slice bound: training on the wrong rows without a word
        args += ["--n-samples", "-100"]
    elif case == "dead-tokens":
        args += ["--dead-tokens", "-1"]
    elif case == "dead-tokens-huge":  # overflowed a tensor with a traceback
        args += ["--dead-tokens", "100000000000000000000000"]
    elif case == "seed":  # -1 seeded the generator 2^63 - 1 does
        args += ["--seed", "-1"]
    elif case.startswith("out-"):  # found after training, with a traceback
        (tmp_path / "afile").write_text("x")
        args += ["--out", str(tmp_path / ("afile" if case == "out-file" else "afile/sub"))]
    elif case in ("float8", "sparse"):  # passed the dtype check and failed inside PyTorch
        x = torch.ones(20, 4)
        x = x.to(torch.float8_e4m3fn) if case == "float8" else x.to_sparse()
        torch.save(x, str(tmp_path / "a.pt"))
        args += ["--data", str(tmp_path / "a.pt")]
    elif case.startswith("auxk-"):  # inf trained a NaN model and exited 0
        args += ["--auxk-alpha", "inf" if case == "auxk-inf" else "-0.5"]
    elif case.startswith("lr-"):  # Adam itself accepts an infinite learning rate
        args += ["--lr", {"lr-inf": "inf", "lr-zero": "0", "lr-huge": "1e300"}[case]]
    elif case == "constant":
        args += ["--data", _write(tmp_path, "a.npy", np.full((40, 4), 3.0, np.float32)), "--batch-size", "4"]
    elif case == "float64-overflow":  # finite in the file, infinite in float32: not "non-finite in the file"
        x = np.ones((20, 4), np.float64)
        x[7, 2] = 1e39
        args += ["--data", _write(tmp_path, "a.npy", x)]
    else:
        args += ["--k", "40"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert "sparsefuse train-sae: error:" in err
    assert __import__("re").search(msg, err), err


def test_synthetic_firing_rate_reports_the_cap():
    """Each firing probability is capped at 1, so a large mean_active is not what fires: the log
    reports what does (expected_active), not the number asked for."""
    from sparsefuse.sae.data import expected_active

    assert expected_active(256, 5.0) == pytest.approx(5.0)
    assert expected_active(256, 64.0) == pytest.approx(60.19, abs=0.01)
    assert expected_active(40, 50.0) < 40
    lines = []
    train_sae(TrainConfig(k=2, n_latents=8, batch_size=16, steps=1, n_samples=64, eval_rows=8, d_model=6, n_features=40,
                          mean_active=50.0, out=None, progress=False, device="cpu"), log=lines.append)
    assert f"~{expected_active(40, 50.0):.3g} active per row" in lines[0] and "~50 active" not in lines[0]


def test_synthetic_set_is_seeded_and_recovery_metric():
    x1, G = synthetic_activations(200, 8, 12, 3.0, seed=5)
    x2, _ = synthetic_activations(200, 8, 12, 3.0, seed=5)
    assert torch.equal(x1, x2) and x1.shape == (200, 8)
    assert torch.allclose(G.norm(dim=1), torch.ones(12))
    assert feature_recovery(G, G)["mean_max_cos"] == pytest.approx(1.0)
    assert feature_recovery(torch.cat([G[:6], -G[6:]]), G)["frac_above_0.9"] == pytest.approx(0.5)


DDP_CFG = dict(losses=("topk", "hierarchical"), k=2, n_latents=64, batch_size=16, steps=6, n_samples=256,
               eval_rows=32, d_model=8, n_features=12, mean_active=3.0, dead_tokens=16, auxk_alpha=0.5,
               device="cpu", out=None, progress=False, plot=False)


def _ddp_worker(rank, world, port, path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        runs = train_sae(TrainConfig(**DDP_CFG), log=lambda *_: None)
        if rank == 0:
            torch.save({loss: dict(r.model.state_dict(), logged_loss=torch.tensor(r.history["loss"]))
                        for loss, r in runs.items()}, path)
    finally:
        dist.destroy_process_group()
    end_spawned_worker()


def _spawn(world, path, monkeypatch):
    import torch.multiprocessing as mp

    port = free_port()
    for k, v in _plain_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mp.spawn(_ddp_worker, args=(world, port, path), nprocs=world, join=True)
    return torch.load(path)


def test_ddp_gloo_matches_single_process(tmp_path, monkeypatch):
    """Two gloo processes, each on half of every global batch, end with the weights of one process
    on the whole batch (AuxK on: latents die after 16 tokens without firing), and log the loss of the
    whole batch (``logged_loss``; rank 0 logged its own shard's before)."""
    ddp = _spawn(2, str(tmp_path / "ddp.pt"), monkeypatch)
    single = _spawn(1, str(tmp_path / "single.pt"), monkeypatch)
    for loss, state in single.items():
        assert (state["tokens_since_fired"] > DDP_CFG["dead_tokens"]).any(), "the test should exercise AuxK"
        for name, want in state.items():
            got = ddp[loss][name]
            if want.dtype.is_floating_point:
                err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                assert err < 1e-5, f"{loss} {name}: DDP differs from one process by {err:.2e}"
            else:
                assert torch.equal(got, want), f"{loss} {name}"


# --- mutation audit: what the trainer hands the module (the DDP test compares two runs of the same code)


@pytest.mark.parametrize("lr", [None, 1e-3])
def test_trainer_setup_follows_the_config(monkeypatch, lr):
    """Adam's learning rate (default 2e-4 / sqrt(n_latents / 2**14)), b_dec started at the data mean,
    the loss divided by the variance of the whole training set (not the batch's, not the mean square),
    the dead-latent default min(10M, steps * batch_size // 5), and the decoder projection /
    renormalisation around every optimiser step."""
    from sparsefuse.sae import modules, train as train_mod

    seen = {}
    real_adam, real_forward = torch.optim.Adam, modules.TopKSAE.forward

    def adam(params, lr, **kw):
        seen.setdefault("lr", lr)
        opt = real_adam(params, lr=lr, **kw)
        step = opt.step
        opt.step = lambda: (events.append("step"), step())[1]
        return opt

    def forward(self, x, variance=None, **kw):
        seen.setdefault("b_dec", self.b_dec.detach().clone())
        seen.setdefault("variance", variance)
        return real_forward(self, x, variance, **kw)

    events = []
    for name in ("remove_parallel_grad_", "normalize_decoder_"):
        real = getattr(modules.TopKSAE, name)
        monkeypatch.setattr(modules.TopKSAE, name, lambda self, _f=real, _n=name: (events.append(_n), _f(self))[1])
    monkeypatch.setattr(torch.optim, "Adam", adam)
    monkeypatch.setattr(modules.TopKSAE, "forward", forward)
    cfg = TrainConfig(k=2, n_latents=32, batch_size=16, steps=2, n_samples=96, eval_rows=8, d_model=6, n_features=10,
                      mean_active=2.0, lr=lr, out=None, progress=False, device="cpu")
    run = train_sae(cfg, log=lambda *_: None)["hierarchical"]
    train, _, _ = train_mod._load_data(cfg)
    data = train.double()
    assert seen["lr"] == pytest.approx(lr if lr is not None else 2e-4 / (32 / 2**14) ** 0.5, rel=1e-12)
    torch.testing.assert_close(seen["b_dec"], data.mean(0).float())
    assert float(seen["variance"]) == pytest.approx(float((data - data.mean(0)).square().mean()), rel=1e-6)
    assert run.model.config["dead_tokens"] == 2 * 16 // 5
    # every step: the gradient's radial part removed before the optimiser step, rows renormalised after
    assert events == ["remove_parallel_grad_", "step", "normalize_decoder_"] * 2


def test_activation_files_pick_the_named_tensor_and_convert_to_float32(tmp_path):
    """A dict holding several tensors gives the one named "activations"; integer activations come
    back as float32 (load_activations' contract)."""
    x = torch.arange(12).reshape(4, 3)
    path = str(tmp_path / "acts.pt")
    torch.save({"labels": torch.zeros(4), "activations": x}, path)
    got = load_activations(path)
    assert got.dtype == torch.float32 and torch.equal(got, x.float())
    npy = str(tmp_path / "acts.npy")
    np.save(npy, x.numpy().astype(np.int32))
    got = load_activations(npy)
    assert got.dtype == torch.float32 and torch.equal(got, x.float())


# --- mutation audit 2: the training loop replayed by hand, the held-out split, the data loader's checks ---

REPLAY_CFG = dict(losses=("hierarchical",), k=2, n_latents=32, batch_size=16, steps=5, n_samples=48, eval_rows=8,
                  d_model=6, n_features=10, mean_active=2.0, dead_tokens=16, auxk_alpha=0.5, lr=1e-2, log_every=2,
                  out=None, progress=False, device="cpu")


def _record_calls(monkeypatch):
    """Record what the trainer passes to TopKSAE.forward and TopKSAE.fvu_curve (while ``rec["on"]``)."""
    from sparsefuse.sae import modules

    rec = {"on": True, "forward": [], "fvu_x": [], "auxk": []}
    real_forward, real_fvu = modules.TopKSAE.forward, modules.TopKSAE.fvu_curve

    def forward(self, x, variance=None, *, auxk_latents=None):
        out = real_forward(self, x, variance, auxk_latents=auxk_latents)
        if rec["on"]:
            rec["forward"].append((x.detach().clone(), variance, float(out.recon_loss.detach())))
            cols = torch.arange(self.n_latents) if auxk_latents is None else auxk_latents.cpu()
            rec["auxk"].append((cols, self.dead_mask().nonzero().squeeze(1).cpu()))
        return out

    def fvu_curve(self, x, *a, **kw):
        if rec["on"]:
            rec["fvu_x"].append(x.detach().clone())
        return real_fvu(self, x, *a, **kw)

    monkeypatch.setattr(modules.TopKSAE, "forward", forward)
    monkeypatch.setattr(modules.TopKSAE, "fvu_curve", fvu_curve)
    return rec


def test_trainer_steps_equal_a_hand_written_loop(monkeypatch):
    """The trainer's weights, dead-latent clock and logged history equal a plain loop over the same
    batches: loss (reconstruction + auxk_alpha * AuxK) backward, radial gradient removed, Adam step,
    gradients cleared, rows renormalised, the clock advanced by the batch. AuxK is on (latents die
    after 16 tokens) with a weight other than the default, and the run is logged every 2 steps."""
    from sparsefuse.sae import train as train_mod

    cfg = TrainConfig(**REPLAY_CFG)
    rec = _record_calls(monkeypatch)
    run = train_sae(cfg, log=lambda *_: None)["hierarchical"]
    rec["on"] = False
    assert len(rec["forward"]) == cfg.steps and all(x.shape == (16, 6) for x, _, _ in rec["forward"])
    assert run.model.config["auxk_alpha"] == 0.5 and run.model.config["dead_tokens"] == 16
    train, _, _ = train_mod._load_data(cfg)
    model = TopKSAE(6, 32, 2, hierarchical=True, auxk_alpha=0.5, dead_tokens=16, seed=cfg.seed)
    with torch.no_grad():
        model.b_dec.copy_(train.double().mean(0).float())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    history, auxk_seen = {"step": [], "loss": [], "dead_frac": []}, False
    for step, (xb, variance, _) in enumerate(rec["forward"], 1):
        out = model(xb, variance)
        auxk_seen |= bool(out.auxk_loss > 0)
        out.loss.backward()
        model.remove_parallel_grad_()
        opt.step()
        opt.zero_grad()
        model.normalize_decoder_()
        model.record_firing(model.fired_counts(out.indices, out.vals), xb.shape[0])
        if step % 2 == 0 or step == cfg.steps:
            history["step"].append(step)
            history["loss"].append(float(out.recon_loss))
            history["dead_frac"].append(float(model.dead_mask().float().mean()))
    assert auxk_seen, "the test should exercise AuxK"
    # AuxK searched every dead latent at every step, and was skipped at the first (no clock can
    # have passed dead_tokens = 16 after one batch of 16)
    assert all(torch.isin(dead, cols).all() for cols, dead in rec["auxk"]) and rec["auxk"][0][0].numel() == 0
    assert run.history["step"] == [2, 4, 5]
    assert run.history["loss"] == pytest.approx(history["loss"], rel=1e-5)
    assert run.history["loss"] == pytest.approx([rec["forward"][s - 1][2] for s in (2, 4, 5)], rel=1e-6)
    assert run.history["dead_frac"] == history["dead_frac"] and 0 < history["dead_frac"][-1] < 1
    for name, want in model.state_dict().items():
        got = run.model.state_dict()[name]
        if want.dtype.is_floating_point:
            err = float((got - want).norm() / want.norm().clamp_min(1e-30))
            assert err < 1e-5, f"{name}: the trainer differs from the hand-written loop by {err:.2e}"
        else:
            assert torch.equal(got, want), name


def _row_ids(batch, rows):
    """The index in ``rows`` of every row of ``batch`` (each must match exactly one)."""
    hit = (batch[:, None, :] == rows[None, :, :]).all(-1)
    assert (hit.sum(1) == 1).all(), "a batch row is not exactly one row of the data"
    return hit.int().argmax(1)


def test_synthetic_split_and_epochs(monkeypatch):
    """Synthetic data: the FVU curve is measured on the eval_rows rows after the n_samples training
    rows, which training never sees; each epoch visits every training row exactly once."""
    cfg = TrainConfig(**REPLAY_CFG)
    rec = _record_calls(monkeypatch)
    train_sae(cfg, log=lambda *_: None)
    full, _ = synthetic_activations(48 + 8, 6, 10, 2.0, cfg.noise, cfg.seed)
    assert len(rec["fvu_x"]) == 1 and torch.equal(rec["fvu_x"][0], full[48:])
    ids = [_row_ids(x, full) for x, _, _ in rec["forward"]]
    assert all((i < 48).all() for i in ids), "a held-out row was trained on"
    # 3 batches of 16 per epoch of 48 rows: the first epoch, then 2 batches of the second
    assert torch.equal(torch.cat(ids[:3]).sort().values, torch.arange(48))
    assert torch.cat(ids[3:]).unique().numel() == 32


@pytest.mark.parametrize("eval_rows, n_eval", [(8192, 20), (14, 14)])
def test_file_split_holds_out_the_last_rows(tmp_path, monkeypatch, eval_rows, n_eval):
    """A data file: the last min(eval_rows, N // 10) rows are held out for the FVU curve and never
    trained on; an epoch covers the other rows once."""
    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    path = str(tmp_path / "acts.npy")
    np.save(path, x.numpy())
    n_train = 200 - n_eval
    batch = n_train // 3
    rec = _record_calls(monkeypatch)
    train_sae(TrainConfig(data=path, k=2, n_latents=8, batch_size=batch, steps=3, eval_rows=eval_rows, out=None,
                          progress=False, device="cpu"), log=lambda *_: None)
    assert torch.equal(rec["fvu_x"][0], x[-n_eval:])
    ids = torch.cat([_row_ids(xb, x) for xb, _, _ in rec["forward"]])
    assert torch.equal(ids.sort().values, torch.arange(n_train))


def test_load_activations_refuses_an_ambiguous_dict(tmp_path):
    """Several tensors and none named "activations": an error, not whichever tensor comes first."""
    path = str(tmp_path / "acts.pt")
    torch.save({"labels": torch.zeros(20, 4), "acts": torch.ones(20, 4)}, path)
    with pytest.raises(ValueError, match="holds 2 tensors; name the activations 'activations'"):
        load_activations(path)


def test_check_activations_rejects_empty_width_and_wrong_d_model():
    from sparsefuse.sae.data import check_activations

    with pytest.raises(ValueError, match=r"activations are empty \(shape \(5, 0\)\)"):
        check_activations(torch.zeros(5, 0))
    with pytest.raises(ValueError, match="activations have D=3, the SAE expects d_model=4"):
        check_activations(torch.zeros(5, 3), d_model=4)
    assert check_activations(torch.zeros(5, 4, dtype=torch.float64), d_model=4).dtype == torch.float32


def test_synthetic_noise_is_relative_to_the_signal():
    """noise is the noise std as a fraction of the signal's mean per-element std (module docstring)."""
    clean, _ = synthetic_activations(2000, 8, 64, 20.0, noise=0.0, seed=1)
    noisy, _ = synthetic_activations(2000, 8, 64, 20.0, noise=0.1, seed=1)
    signal_std = float(clean.std(0).mean())
    assert signal_std > 2  # far from 1, so an absolute noise std would show
    assert float((noisy - clean).std()) == pytest.approx(0.1 * signal_std, rel=0.05)


# --- review of session 28: unreadable files, devices, the data statistics, the batches ---


def _unreadable(tmp_path, case):
    """A file of each kind that its reader fails on, and the reader's own words in the message."""
    if case == "truncated-pt":
        path = tmp_path / "a.pt"
        torch.save(torch.ones(20, 4), path)
        path.write_bytes(path.read_bytes()[:100])
    elif case == "text-as-pt":
        path = tmp_path / "a.pt"
        path.write_text("not a checkpoint")
    elif case == "garbage-safetensors":
        path = tmp_path / "a.safetensors"
        path.write_bytes(b"\x00" * 40)
    elif case == "empty-npy":
        path = tmp_path / "a.npy"
        path.write_bytes(b"")
    elif case == "string-npy":
        path = tmp_path / "a.npy"
        np.save(path, np.array([["a", "b"], ["c", "d"]]))
    else:  # a folder with the right extension
        path = tmp_path / "a.npy"
        path.mkdir()
    return str(path)


@pytest.mark.parametrize("case", ["truncated-pt", "text-as-pt", "garbage-safetensors", "empty-npy", "string-npy",
                                  "directory"])
def test_unreadable_files_get_one_line_naming_the_file(tmp_path, capsys, case):
    """Each reader raised its own exception type (UnpicklingError, SafetensorError, EOFError,
    TypeError, IsADirectoryError, ...), which the CLI printed as a traceback without the path."""
    path = _unreadable(tmp_path, case)
    with pytest.raises(ValueError, match=f"^{__import__('re').escape(path)}: cannot be read as a "):
        load_activations(path)
    assert cli(["train-sae", "--quiet", "--out", str(tmp_path / "o"), "--steps", "2", "--data", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sparsefuse train-sae: error: {path}: cannot be read as a ") and err.count("\n") == 1


def test_big_endian_and_unsigned_files(tmp_path):
    """A big-endian .npy was refused by torch.from_numpy; it is read as its values. uint8 is named
    as what it is not (floating point or signed integers)."""
    x = np.arange(40, dtype=np.float64).reshape(10, 4)
    path = str(tmp_path / "be.npy")
    np.save(path, x.astype(">f8"))
    assert torch.equal(load_activations(path), torch.from_numpy(x).float())
    np.save(path, x.astype(np.uint8))
    with pytest.raises(ValueError, match="must be float16/bfloat16/float32/float64 or signed integers, got dtype "
                                         "torch.uint8"):
        load_activations(path)


def test_check_activations_takes_every_signed_integer_width_and_refuses_meta():
    """int8, int16, int32 and int64 activations are read as float32 values; a meta tensor (no data)
    is refused by name instead of failing inside PyTorch; a big-endian unsigned file is named as
    unsigned, as a native one is (its reader does not fail on the byte order)."""
    from sparsefuse.sae.data import check_activations

    x = torch.arange(-6, 6).reshape(4, 3)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        got = check_activations(x.to(dtype))
        assert got.dtype == torch.float32 and torch.equal(got, x.float()), dtype
    with pytest.raises(ValueError, match="activations must be a dense tensor holding data, got layout torch.strided "
                                         "on meta"):
        check_activations(torch.zeros(4, 3, device="meta"))


def test_big_endian_unsigned_file_is_named_as_unsigned(tmp_path):
    path = str(tmp_path / "be.npy")
    np.save(path, np.arange(40).reshape(10, 4).astype(">u2"))
    with pytest.raises(ValueError, match="or signed integers, got dtype torch.uint16"):
        load_activations(path)


def test_weights_only_refusal_gives_its_reason_not_the_advice(tmp_path):
    """torch.load(weights_only=True) puts its reason for refusing a pickled object after a paragraph
    of advice on loading untrusted checkpoints; the one-line message keeps the reason."""
    import datetime

    path = str(tmp_path / "a.pt")
    torch.save({"activations": torch.ones(20, 4), "when": datetime.date(2024, 1, 1)}, path)
    with pytest.raises(ValueError, match=r"a\.pt: cannot be read as a \.pt file \(UnpicklingError: Unsupported "
                                         r"global: GLOBAL datetime\.date") as info:
        load_activations(path)
    assert "Weights only load failed" not in str(info.value) and "Check the documentation" not in str(info.value)


@pytest.mark.parametrize("device, msg", [
    ("gpu", r"unknown device 'gpu'; use auto, cpu, cuda or cuda:N"),
    ("meta", r"unknown device 'meta'; use auto, cpu, cuda or cuda:N"),
    ("cuda:99", "CUDA is not available on this machine" if not torch.cuda.is_available()
     else r"device 'cuda:99': this machine has \d+ CUDA device\(s\)"),
])
def test_bad_device_is_named_before_the_data_is_read(tmp_path, capsys, device, msg):
    """A device this machine lacks gave a RuntimeError or AssertionError traceback, after the
    whole activations file had been read; the file here does not exist, so the device must be
    refused first."""
    args = ["train-sae", "--quiet", "--out", str(tmp_path / "o"), "--device", device,
            "--data", str(tmp_path / "missing.npy")]
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(msg, err) and "missing.npy" not in err, err


def test_cuda_index_one_past_the_last_device_is_refused(monkeypatch):
    """cuda:N names one of N CUDA devices only for N below the count: cuda:2 on a two-GPU machine is
    refused before the data is read, cuda:1 is taken (the count is faked: no GPU is needed)."""
    from sparsefuse.sae import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device 'cuda:2': this machine has 2 CUDA device\(s\)"):
        train._check_device("cuda:2")
    train._check_device("cuda:1")


def test_torchrun_refuses_one_explicit_gpu_for_every_process(monkeypatch):
    """Under torchrun, --device cuda:1 put every process on that one GPU over gloo, silently."""
    import torch.distributed as dist

    from sparsefuse.sae import train as train_mod

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("started a process group"))
    with pytest.raises(ValueError, match=r"device='cuda:1' under torchrun \(4 processes\): use auto, cuda or cpu"):
        train_mod._init_distributed("cuda:1")


def test_data_statistics_in_chunks_equal_float64():
    """b_dec's start and the loss's variance come from chunks of rows summed in float64 (a float64
    copy of the whole set took 4x its memory at peak); they equal the whole-set float64 values,
    with rows that do not fill the last chunk."""
    from sparsefuse.sae import train as train_mod

    g = torch.Generator().manual_seed(3)
    for n, d in ((7, 1 << 21), (300, 5)):  # 2 rows a chunk (3.5 chunks); then one chunk
        x = (torch.randn(n, d, generator=g) * 3 + torch.arange(d) / d).float()
        mean, var = train_mod._data_stats(x)
        x64 = x.double()
        torch.testing.assert_close(mean, x64.mean(0).float(), rtol=1.2e-7, atol=0)
        assert var == pytest.approx(float((x64 - x64.mean(0)).square().mean()), rel=1e-12)


def _batches_agree(train, order, device, on_device, local, stall=False):
    """Every batch of two epochs equals the rows asked for. ``stall``: the copy stream first sleeps
    (~50 ms), so the host queues all its gathers before any copy runs: a pinned buffer refilled
    before its copy has read it would show."""
    from sparsefuse.sae.train import _Batches

    batches = _Batches(train, local, torch.device(device), on_device)
    if stall:
        with torch.cuda.stream(batches.stream):
            torch.cuda._sleep(100_000_000)
    got = []
    for epoch in range(2):
        batches.new_epoch(order.roll(epoch))
        for start in range(0, order.numel() - local + 1, local):
            got.append((batches.take(start, start + local), train[order.roll(epoch)[start:start + local]]))
    for xb, want in got:
        assert xb.device.type == torch.device(device).type and torch.equal(xb.cpu(), want)
    return batches


def test_batches_on_cpu_are_rows_of_the_set():
    train = torch.randn(40, 3)
    _batches_agree(train, torch.randperm(40, generator=torch.Generator().manual_seed(0)), "cpu", None, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [None, True, False])
def test_batches_on_cuda_resident_or_streamed_from_pinned_buffers(on_device):
    """On the GPU the set is held there (auto picks that for a small set) or streamed through two
    pinned buffers on a side stream: every batch must be the rows asked for, also after the
    buffers have been reused many times with the host ahead of the GPU."""
    train = torch.randn(4096, 257)
    order = torch.randperm(4096, generator=torch.Generator().manual_seed(1))
    b = _batches_agree(train, order, "cuda", on_device, 512, stall=on_device is False)
    assert (b.stream is None) == (on_device is not False) and b.src.is_cuda == (on_device is not False)


@pytest.mark.gpu
def test_trainer_streamed_batches_match_resident_ones(tmp_path):
    """A whole CUDA run with the data streamed from pinned host memory trains the same SAE as one
    with the data on the GPU (fp32 atomics: to rounding)."""
    from sparsefuse.sae.train import config_from_args, add_arguments
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    states = {}
    for flag in ("yes", "no"):
        cfg = config_from_args(p.parse_args(TINY + ["--device", "cuda", "--data-on-device", flag]))
        assert cfg.data_on_device is (flag == "yes")
        cfg.out = None
        states[flag] = train_sae(cfg, log=lambda *_: None)["hierarchical"].model.state_dict()
    for name, want in states["yes"].items():
        got = states["no"][name]
        if want.dtype.is_floating_point:
            assert float((got - want).norm() / want.norm().clamp_min(1e-30)) < 1e-5, name
        else:
            assert torch.equal(got, want), name


def test_trainer_gives_auxk_a_superset_of_the_dead_latents(monkeypatch):
    """The host-side knowledge of the dead-latent clock: with dead_tokens far beyond the run, AuxK is
    never computed; with latents dying before the first logging step it searches every dead latent
    (the clock's bound grows by each batch); after a logging step it searches only the latents that
    can die before the next one, all dead ones among them; where every latent keeps firing, AuxK is
    skipped again after a logging step. (The run equals a plain loop that always searches every
    latent: test_trainer_steps_equal_a_hand_written_loop.)"""
    rec = _record_calls(monkeypatch)

    def run(**kw):
        rec["auxk"].clear()
        train_sae(TrainConfig(**dict(REPLAY_CFG, **kw)), log=lambda *_: None)
        assert all(torch.isin(dead, cols).all() for cols, dead in rec["auxk"]), "a dead latent was left out"
        return [(cols.numel(), dead.numel()) for cols, dead in rec["auxk"]]

    assert run(dead_tokens=10**9) == [(0, 0)] * 5
    sizes = run(steps=4, log_every=100)
    assert sum(d for _, d in sizes) >= 3 and sizes[:2] == [(0, 0)] * 2, "the test should see dead latents"
    # dead_tokens = 100 and 3 batches of 16 between logging steps: after one, only latents whose clock
    # is past 100 - 48 are searched, fewer than all 32
    sizes = run(steps=12, log_every=3, dead_tokens=100)
    assert any(0 < c < 32 for c, _ in sizes[3:]) and any(d for _, d in sizes)
    # 8 latents, 4 active of 16 rows: all keep firing; without the logging steps' bound, step 4 on needs AuxK
    assert run(n_latents=8, k=4, steps=9, dead_tokens=40, log_every=3) == [(0, 0)] * 9