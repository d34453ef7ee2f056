"""Gaps found by the session-51 mutation pass over the module-level code (``sparsefuse/vq/modules.py``,
``sparsefuse/sae/modules.py``, ``sparsefuse/sae/train.py``); each test fails on its mutant
(benchmarks/logs/mutation_session51_modules.md) and passes on the clean code."""

import pytest
import torch

from helpers import DEVICE
from sparsefuse.vq import ResidualVQ, VectorQuantizer


# --- VQ modules --------------------------------------------------------------------------------------


def test_kmeans_seeding_rows_are_drawn_with_the_generator():
    """Mutant Q01: k-means starts from random rows of the batch, drawn with the module's generator, not
    from its first K rows (a batch sorted by class would seed every code in one class). The same seed
    gives the same codebook; another seed other rows."""
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def seeded(seed):
        vq = VectorQuantizer(4, 4, kmeans_init=True, kmeans_iters=0,
                             generator=torch.Generator(device=DEVICE).manual_seed(seed)).to(DEVICE)
        vq.kmeans_init_(x)
        return vq.codebook.clone()

    books = [seeded(s) for s in range(4)]
    assert torch.equal(books[0], seeded(0))
    assert any(not torch.equal(b, x[:4]) for b in books), "the codebook is the batch's first rows"
    assert len({tuple(b.flatten().tolist()) for b in books}) > 1, "the generator does not choose the rows"


@pytest.mark.parametrize("levels", [None, 2], ids=["vq", "rvq"])
def test_loaded_initialised_state_is_not_reinitialised_by_k_means(levels, monkeypatch):
    """Mutant Q06: a ``kmeans_init=True`` module that loads an initialised state (resuming) must not run
    k-means again at its first training step: that would throw the loaded codebook away. The host copy
    of ``initted`` follows ``load_state_dict``."""
    def build():
        m = VectorQuantizer(4, 5, kmeans_init=True) if levels is None else ResidualVQ(levels, 4, 5, kmeans_init=True)
        return m.to(DEVICE)

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    trained = build()
    trained(x)
    resumed = build()
    resumed.load_state_dict(trained.state_dict())

    def refuse(self, x):
        raise AssertionError("k-means ran again on a loaded, initialised state")

    monkeypatch.setattr(type(resumed), "kmeans_init_", refuse)
    resumed(x)  # training mode: a step on the loaded codebook
    # and the other way: an uninitialised state loaded into an initialised module makes it initialise
    fresh = build()
    monkeypatch.undo()
    trained.load_state_dict(fresh.state_dict())
    calls = []
    monkeypatch.setattr(type(trained), "kmeans_init_", lambda self, x: calls.append(1))
    trained(x)
    assert calls == [1]


def test_kmeans_init_after_training_steps_restarts_the_dead_code_clock():
    """Mutant Q10: ``kmeans_init_`` sets the whole state, the ``"active"`` semantics' dead-code counters
    included; counters left from earlier steps would restart fresh centroids after fewer steps."""
    vq = VectorQuantizer(4, 6, semantics="active", restart_after_steps=50).to(DEVICE)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)  # 3 rows: 3+ codes unused
    for _ in range(3):
        vq(x)
    assert int(vq.steps_since_active.max()) > 0
    vq.kmeans_init_(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)).to(DEVICE))
    assert torch.equal(vq.steps_since_active, torch.zeros_like(vq.steps_since_active))


# --- SAE module ------------------------------------------------------------------------------------


def test_unnormalised_decoder_does_not_share_the_encoders_storage():
    """Mutant S19: with ``normalize_decoder=False`` the decoder starts as a copy of the encoder's rows.
    Built in float32 on the CPU, ``w.to(float32)`` returns ``w`` itself, so without the copy W_enc and
    W_dec were one tensor: every optimiser step moved both by the sum of their gradients."""
    from sparsefuse.sae.modules import TopKSAE

    m = TopKSAE(8, 16, 2, normalize_decoder=False, seed=1)
    assert m.W_enc.data_ptr() != m.W_dec.data_ptr()
    before = m.W_dec.detach().clone()
    with torch.no_grad():
        m.W_enc.add_(1.0)
    assert torch.equal(m.W_dec.detach(), before)


@pytest.mark.parametrize("decoder", ["fused", "reference"])
def test_normalize_decoder_false_leaves_the_decoder_rows_alone(decoder):
    """Mutant S20: ``normalize_decoder=False`` turns both decoder-row helpers off (the trainer calls them
    every step whatever the option): the rows keep their norms and the gradient its parallel part."""
    from sparsefuse.sae.modules import TopKSAE

    m = TopKSAE(8, 16, 2, normalize_decoder=False, decoder=decoder, seed=1).to(DEVICE)
    with torch.no_grad():
        m.W_dec.mul_(3.0)
    before = m.W_dec.detach().clone()
    m.W_dec.grad = before.clone()  # wholly parallel to each row
    m.remove_parallel_grad_()
    m.normalize_decoder_()
    assert torch.equal(m.W_dec.detach(), before)
    assert torch.equal(m.W_dec.grad, before)


@pytest.mark.parametrize("levels", [None, 3], ids=["vq", "rvq"])
def test_cosine_codebook_starts_with_unit_rows(levels):
    """Mutant Q21: ``cosine=True`` starts the codebook (and embed_sum, with N = 1) with unit rows, as the
    docstring says. The cosine search does not see row norms, but ``quantized`` is the codebook row, so
    rows of norm ~sqrt(D) scaled every output before the first EMA refresh."""
    m = VectorQuantizer(16, 8, cosine=True) if levels is None else ResidualVQ(levels, 16, 8, cosine=True)
    norms = m.codebook.norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert torch.equal(m.embed_sum, m.codebook)
    out, codes, _ = m.to(DEVICE).eval()(torch.randn(5, 16, device=DEVICE))
    if levels is None:
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(5, device=DEVICE))


# --- trainer ---------------------------------------------------------------------------------------


def test_trainer_bfloat16_runs_the_forward_under_autocast(monkeypatch):
    """Mutant T08: ``dtype="bfloat16"`` trains with bf16 autocast around the forward (float32 weights);
    no trainer test ran that option, so a trainer that never enabled autocast passed."""
    from sparsefuse.sae import modules
    from sparsefuse.sae.train import TrainConfig, train_sae

    seen, real_forward = [], modules.TopKSAE.forward

    def forward(self, x, variance=None, **kw):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real_forward(self, x, variance, **kw)

    monkeypatch.setattr(modules.TopKSAE, "forward", forward)
    cfg = dict(losses=("topk",), k=2, n_latents=16, batch_size=8, steps=2, n_samples=32, eval_rows=8, d_model=4,
               n_features=8, mean_active=2.0, out=None, progress=False, plot=False, device="cpu")
    run = train_sae(TrainConfig(dtype="bfloat16", **cfg), log=lambda *_: None)["topk"]
    assert seen == [(True, torch.bfloat16)] * 2
    assert all(p.dtype == torch.float32 for p in run.model.parameters())
    seen.clear()
    train_sae(TrainConfig(**cfg), log=lambda *_: None)
    assert [enabled for enabled, _ in seen] == [False] * 2


@pytest.mark.parametrize("decoder, encoder", [("reference", "dense"), ("fused", "sparse")])
def test_reconstruction_targets_x_as_given_not_rounded_to_the_parameters(decoder, encoder):
    """Mutant S08: the encoder runs in the parameters' dtype, but the loss targets x as given (forward's
    docstring). A bf16 module fed float32 activations whose values bf16 cannot hold: the loss is that of
    the float32 rows; rounding the target to bf16 moved it by ~1e-3 relative. (The earlier dtype tests
    fed values that the parameters' dtype holds exactly.)"""
    from sparsefuse.sae.modules import TopKSAE

    m = TopKSAE(10, 24, 5, decoder=decoder, encoder=encoder, seed=3, auxk_alpha=0.0).to(DEVICE, torch.bfloat16)
    x = (torch.randn(13, 10, generator=torch.Generator().manual_seed(0)) + 0.3).to(DEVICE)
    assert not torch.equal(x.bfloat16().float(), x)
    out = m(x, 1.0)
    W, b = m.W_dec.detach().double(), m.b_dec.detach().double()
    x_hat = b + (out.vals.detach().double()[..., None] * W[out.indices]).sum(1)
    want = float((x_hat - x.double()).square().mean())
    assert abs(float(out.recon_loss.detach()) - want) <= 1e-5 * want


def test_auxk_residual_is_float32_for_a_bf16_module():
    """Mutant S09: AuxK's e = x - x_hat is formed from x and x_hat each cast to float32. With float32
    parameters x_hat is float32 already and the order does not matter; a bf16 module (the benchmark's)
    fed bf16 rows rounded x - x_hat to bf16 first. Same losses as the same rows in float32."""
    from sparsefuse.sae.modules import TopKSAE

    m = TopKSAE(10, 24, 5, decoder="reference", encoder="dense", seed=3, auxk_alpha=0.25,
                dead_tokens=100).to(DEVICE, torch.bfloat16)
    m.tokens_since_fired[::3] = 1000
    x = ((torch.randn(13, 10, generator=torch.Generator().manual_seed(0)) + 0.3) * 40).to(DEVICE, torch.bfloat16)
    low, high = m(x), m(x.float())
    assert high.auxk_loss > 0
    for name in ("recon_loss", "auxk_loss"):
        torch.testing.assert_close(getattr(low, name), getattr(high, name), rtol=1e-5, atol=0, msg=name)
