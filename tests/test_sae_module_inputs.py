"""Inputs the SAE module and trainer once mishandled (found in review, session 50): a k' listed twice
in the FVU curve, bad counts for the dead-latent clock, activation files whose tensor requires grad,
and NumPy numbers in a config."""

import pytest
import torch

from helpers import DEVICE
from sparsefuse.sae import train as train_mod
from sparsefuse.sae.data import check_activations, load_activations
from sparsefuse.sae.modules import TopKSAE
from sparsefuse.sae.train import TrainConfig, train_sae

D, F, K, B = 6, 12, 4, 9


def _model(**kw):
    return TopKSAE(D, F, K, hierarchical=True, seed=3, **kw).to(DEVICE, torch.float64)


def _x(rows=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, D, generator=g, dtype=torch.float64) + 0.3).to(DEVICE)


def test_fvu_curve_with_a_budget_listed_twice():
    """A k' named twice in ``ks`` gets its FVU once: its squared error was summed once per mention,
    so ks=[2, 2] read twice the FVU of ks=[2]."""
    m, x = _model(), _x()
    once = m.fvu_curve(x, ks=[2, 4])
    twice = m.fvu_curve(x, ks=[2, 4, 2])
    assert list(twice) == [2, 4]
    assert twice == pytest.approx(once, rel=1e-12)


@pytest.mark.parametrize("bad", ["shape", "longer"])
def test_record_firing_with_bad_counts_leaves_the_clock_alone(bad):
    """Counts that do not fit the clock are refused before the clock moves: it was advanced by
    n_tokens and then masked_fill_ raised, so the caller's retry counted the batch twice."""
    m = _model(dead_tokens=50)
    m.tokens_since_fired[::3] = 7
    before = m.tokens_since_fired.clone()
    counts = torch.ones(F + 1, device=DEVICE) if bad == "longer" else torch.ones(2, F, device=DEVICE)
    with pytest.raises((ValueError, RuntimeError)):
        m.record_firing(counts, 40)
    assert torch.equal(m.tokens_since_fired, before), "a refused call moved the dead-latent clock"
    counts = torch.zeros(F, device=DEVICE)
    counts[1] = 3
    m.record_firing(counts, 40)  # the good call still works: fired latents reset, the others advance
    want = before + 40
    want[1] = 0
    assert torch.equal(m.tokens_since_fired, want)


def test_activation_file_that_requires_grad_is_read_as_data(tmp_path):
    """``torch.save`` keeps ``requires_grad`` (hidden states saved without ``no_grad``, or a
    Parameter), and so did load_activations: every training step then backpropagated into the whole
    data set (an [N, D] gradient a step), and the GPU's streamed batches (index_select into a pinned
    buffer, ``out=``) failed outright."""
    x = torch.randn(60, 4) * 2
    path = str(tmp_path / "acts.pt")
    torch.save(x.requires_grad_(), path)
    got = load_activations(path)
    assert not got.requires_grad and torch.equal(got, x.detach())
    assert not check_activations(torch.nn.Parameter(torch.randn(3, 4))).requires_grad

    seen = []
    real_take = train_mod._Batches.take

    def take(self, start, stop):
        xb = real_take(self, start, stop)
        seen.append(xb.requires_grad)
        return xb

    train_mod._Batches.take, saved = take, real_take
    try:
        train_sae(TrainConfig(data=path, k=2, n_latents=8, batch_size=8, steps=2, device="cpu", out=None,
                              progress=False, plot=False), log=lambda *_: None)
    finally:
        train_mod._Batches.take = saved
    assert seen == [False, False], "the training batches carry an autograd graph into the data set"


def test_numpy_numbers_in_a_config_save_and_write_metrics(tmp_path):
    """NumPy numbers that the module and the trainer accept (``dead_tokens`` from ``np.arange``, a
    ``float32`` rate) are saved as JSON numbers: json.dumps refused them in ``save`` and in
    metrics.json, after the training had run, and left a truncated metrics.json behind."""
    import json

    import numpy as np

    m = _model(dead_tokens=np.arange(0, 2000, 500)[2], auxk_alpha=np.float32(0.125), k_aux=np.int64(3))
    path = str(tmp_path / "sae.safetensors")
    m.save(path)
    back = TopKSAE.load(path, device=DEVICE)
    assert (back.config["dead_tokens"], back.config["auxk_alpha"], back.config["k_aux"]) == (1000, 0.125, 3)

    out = tmp_path / "run"
    train_sae(TrainConfig(k=2, n_latents=8, batch_size=8, steps=1, n_samples=32, eval_rows=8, d_model=4,
                          n_features=6, device="cpu", out=str(out), progress=False, plot=False,
                          lr=np.float32(0.5), dead_tokens=np.int64(4)), log=lambda *_: None)
    config = json.loads((out / "metrics.json").read_text())["config"]
    assert (config["lr"], config["dead_tokens"]) == (0.5, 4)
    assert TopKSAE.load(str(out / "sae.safetensors")).config["dead_tokens"] == 4


@pytest.mark.parametrize("kw, match", [
    (dict(k_aux=2.5), "k_aux must be an int"), (dict(k_aux=True), "k_aux must be an int"),
    (dict(dead_tokens=None), "dead_tokens must be an int"), (dict(dead_tokens=1.5), "dead_tokens must be an int"),
    (dict(dead_tokens=-1), "dead_tokens must be an int >= 0"), (dict(dead_tokens=2**62), "below 2\\^62"),
])
def test_auxk_options_are_checked_when_the_module_is_built(kw, match):
    """``k_aux=2.5`` built and was saved in the config, then failed at the first AuxK step with an error
    naming ``k``; ``dead_tokens=None`` failed there comparing a tensor with None. Both are refused by
    name when the module is built (NumPy integers are still taken: the config test above)."""
    with pytest.raises(ValueError, match=match):
        TopKSAE(8, 24, 3, **kw)
