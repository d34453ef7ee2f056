"""TopKSAE: gradients against the reference decoder, unit-norm decoder, AuxK, save/load, FVU curve."""

import pytest
import torch

import sparsefuse

from helpers import DEVICE, TOL, assert_close
from sparsefuse import sparse_linear
from sparsefuse.sae import modules
from sparsefuse.sae.modules import TopKSAE

D, F, K, B = 10, 24, 5, 13


def _model(hierarchical, decoder="fused", dtype=torch.float64, **kw):
    if decoder == "reference":  # the plain PyTorch module: dense encoder gradient too
        kw.setdefault("encoder", "dense")
    return TopKSAE(D, F, K, hierarchical=hierarchical, decoder=decoder, seed=3, **kw).to(DEVICE, dtype)


def _x(dtype=torch.float64, rows=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, D, generator=g, dtype=torch.float64) + 0.3).to(DEVICE, dtype)


def test_encode_sorted_and_relu():
    m = _model(False)
    idx, vals = m.encode(_x())
    assert idx.shape == vals.shape == (B, K)
    assert (vals[:, :-1] >= vals[:, 1:]).all(), "latents must be sorted by activation, largest first"
    assert (vals >= 0).all()
    pre = m.pre_acts(_x())
    assert torch.equal(pre.gather(1, idx), vals)


@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_selection_goes_through_sparsefuse_topk(encoder, monkeypatch):
    """The sparse encoder chooses its latents (encode, the forward's K, AuxK's candidates) through
    sparsefuse.topk, the dense one through torch.topk: both give the same values, so only the calls
    tell them apart, and a sparse encoder back on torch.topk would be 6-9x slower at real sizes."""
    calls = []
    real = modules.topk
    monkeypatch.setattr(modules, "topk", lambda a, k: calls.append(k) or real(a, k))
    m = _model(False, encoder=encoder)
    m.tokens_since_fired[::3] = 10**9  # dead latents, so AuxK selects too
    m.config["dead_tokens"] = 100
    m.encode(_x())
    assert m(_x()).auxk_loss > 0
    assert calls == ([K, K, m.config["k_aux"]] if encoder == "sparse" else [])


@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_module_gradients_match_reference(hierarchical, dtype, encoder):
    """Loss parts and every parameter gradient of the fused module (fused decoder, K-sparse encoder
    gradient) equal the reference module's (reference decoder, autograd through the dense encoder)."""
    x = _x(dtype)
    got, want = _model(hierarchical, "fused", dtype, encoder=encoder), _model(hierarchical, "reference")
    for m in (got, want):  # some latents dead, so AuxK contributes too
        m.tokens_since_fired[::3] = 10**9
        m.config["dead_tokens"] = 100
    out_g, out_w = got(x), want(x.double())
    assert out_w.auxk_loss > 0
    for name in ("loss", "recon_loss", "auxk_loss"):
        assert_close(getattr(out_g, name), getattr(out_w, name), dtype, name)
    out_g.loss.backward()
    out_w.loss.backward()
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        # summation order differs from the reference (GPU atomics): a looser bound in float64
        assert_close(p.grad, q.grad, dtype, f"grad {name}", scale=50 if dtype == torch.float64 else 5)


def test_reference_module_matches_dense_math():
    """The reference module is itself checked against the loss written out densely."""
    m, x = _model(True, "reference"), _x()
    out = m(x)
    pre = torch.relu((x - m.b_dec) @ m.W_enc.T + m.b_enc)
    vals, idx = pre.topk(K, dim=1)
    prefix = (vals.unsqueeze(-1) * m.W_dec[idx]).cumsum(1) + m.b_dec - x.unsqueeze(1)
    var = (x - x.mean(0)).square().mean()
    assert_close(out.recon_loss, prefix.square().mean() / var, torch.float64, "hierarchical loss")


@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
def test_unit_norm_invariant_after_steps(hierarchical):
    m = _model(hierarchical, dtype=torch.float32)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(4):
        m(_x(torch.float32, seed=step)).loss.backward()
        m.remove_parallel_grad_()
        w = m.W_dec.detach() / m.W_dec.detach().norm(dim=1, keepdim=True)
        parallel = (m.W_dec.grad * w).sum(1)
        assert parallel.abs().max() <= 1e-6 * m.W_dec.grad.norm(dim=1).max().clamp_min(1e-12)
        opt.step()
        opt.zero_grad()
        m.normalize_decoder_()
        norms = m.W_dec.detach().norm(dim=1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-6), f"step {step}: row norms {norms}"


def _loss_and_grads(m, x, **kw):
    out = m(x, **kw)
    return out.loss.detach(), out.auxk_loss.detach(), torch.autograd.grad(out.loss, list(m.parameters()))


def _same(m, got, want, exact):
    """Loss, AuxK loss and every gradient equal: bit for bit (``exact``, on the CPU), else to fp64's
    tolerance (other picks' zeros, or on CUDA atomics that sum in no fixed order)."""
    for name, a, b in (("loss", got[0], want[0]), ("auxk_loss", got[1], want[1]),
                       *((n, a, b) for (n, _), a, b in zip(m.named_parameters(), got[2], want[2]))):
        if exact and DEVICE == "cpu":
            assert torch.equal(a, b), name
        else:
            assert_close(a, b, torch.float64, name)


@pytest.mark.parametrize("encoder", ["sparse", "dense"])
@pytest.mark.parametrize("auxk_path", ["gathers", "dense"])
def test_auxk_latents_restrict_the_search_without_changing_the_loss(encoder, auxk_path, monkeypatch):
    """forward(auxk_latents=...), for a caller that knows a superset of the dead latents: an empty
    one skips AuxK, which is then 0 with the same gradients as computing it; a superset with fewer
    or more columns than k_aux gives AuxK's loss and gradients of the search over every latent
    (through k_aux gathers a row), whether AuxK runs as gathers or as dense products over the
    candidate columns."""
    m, x = _model(True, encoder=encoder, auxk_alpha=0.5, dead_tokens=100, k_aux=6), _x()
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)

    def reference(**kw):  # the search over every latent, through gathers
        with monkeypatch.context() as mp:
            mp.setattr(modules, "AUXK_DENSE_RATIO", 0)
            return _loss_and_grads(m, x, **kw)

    monkeypatch.setattr(modules, "AUXK_DENSE_RATIO", 0 if auxk_path == "gathers" else 10**6)
    full = reference()
    assert float(full[1]) == 0.0
    _same(m, _loss_and_grads(m, x), full, exact=auxk_path == "gathers")
    _same(m, _loss_and_grads(m, x, auxk_latents=none), full, exact=True)
    dead = torch.tensor([2, 9, 15, 21], device=DEVICE)
    m.tokens_since_fired[dead] = 1000
    full = reference()
    assert float(full[1]) > 0
    _same(m, _loss_and_grads(m, x), full, exact=auxk_path == "gathers")
    for extra in ([], [0, 5], [0, 1, 3, 4, 5, 6, 7, 8]):  # C = 4, 6, 12 against k_aux = 6
        cols = torch.cat([dead, torch.tensor(extra, dtype=torch.int64, device=DEVICE)])
        _same(m, _loss_and_grads(m, x, auxk_latents=cols[torch.randperm(cols.numel())].to(torch.int32)), full,
              exact=False)
    assert float(m(x, auxk_latents=none).auxk_loss) == 0.0  # an empty set skips AuxK: the caller's promise


def test_auxk_runs_dense_over_few_candidates(monkeypatch):
    """The rule: dense products when the candidate columns are at most AUXK_DENSE_RATIO times the
    picks a row, k_aux gathers a row (a second sparse_linear) above that."""
    m, x = _model(True, auxk_alpha=0.5, dead_tokens=100, k_aux=2), _x()
    m.tokens_since_fired[[2, 9]] = 1000
    calls = []
    monkeypatch.setattr(modules, "sparse_linear", lambda *a, **kw: calls.append(a[2].shape) or sparse_linear(*a, **kw))
    for cols, gathers in ((None, F > modules.AUXK_DENSE_RATIO * 2), (list(range(16)), False),
                          (list(range(modules.AUXK_DENSE_RATIO * 2 + 1)), True)):
        calls.clear()
        m(x, auxk_latents=None if cols is None else torch.tensor(cols, device=DEVICE)).loss.backward()
        assert len(calls) == 1 + gathers, (cols, calls)


@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
@pytest.mark.parametrize("encoder", ["sparse", "dense"])
@pytest.mark.parametrize("candidates", [False, True], ids=["all-latents", "auxk-latents"])
def test_module_compiles_fullgraph(hierarchical, encoder, candidates):
    """``torch.compile(model, fullgraph=True)``: the loss parts, the latents and every parameter's
    gradient match eager mode, with dead latents so that AuxK runs (over all latents, or over
    candidates given as ``auxk_latents``)."""
    import copy

    m, x = _model(hierarchical, encoder=encoder, auxk_alpha=0.5, dead_tokens=100, k_aux=6), _x()
    dead = torch.tensor([2, 9, 15, 21], device=DEVICE)
    m.tokens_since_fired[dead] = 1000
    kw = dict(auxk_latents=torch.cat([dead, torch.tensor([0, 5], device=DEVICE)])) if candidates else {}
    mc = copy.deepcopy(m)
    torch._dynamo.reset()
    want, got = m(x, **kw), torch.compile(mc, fullgraph=True)(x, **kw)
    assert want.auxk_loss.item() > 0
    assert torch.equal(got.indices, want.indices)
    for name in ("loss", "recon_loss", "auxk_loss", "vals"):
        assert_close(getattr(got, name), getattr(want, name).detach(), torch.float64, name)
    gw = torch.autograd.grad(want.loss, list(m.parameters()))
    gc = torch.autograd.grad(got.loss, list(mc.parameters()))
    for (name, _), a, b in zip(m.named_parameters(), gc, gw):
        assert_close(a, b, torch.float64, name)


@pytest.mark.parametrize("bad, err, msg", [
    (torch.zeros(2, 2, dtype=torch.int64), ValueError, r"auxk_latents must have 1 dimensions, got shape \(2, 2\)"),
    (torch.zeros(2), TypeError, "auxk_latents has dtype float32; expected one of int32, int64"),
    (torch.tensor([0, F]), IndexError, rf"auxk_latents holds {F}, outside \[0, {F}\)"),
    (torch.tensor([-1, 3]), IndexError, rf"auxk_latents holds -1, outside \[0, {F}\)"),
    (torch.tensor([2, 9, 2]), ValueError, "auxk_latents lists a latent more than once"),
])
def test_auxk_latents_bad_input(bad, err, msg):
    m = _model(False)
    sparsefuse.set_index_checks(True)
    try:
        with pytest.raises(err, match=msg):
            m(_x(), auxk_latents=bad.to(DEVICE))
    finally:
        sparsefuse.set_index_checks(None)


@pytest.mark.parametrize("auxk_path", ["gathers", "dense"])
@pytest.mark.parametrize("bad", [-3, F])
def test_auxk_latents_out_of_range_unchecked_give_nan(bad, auxk_path, monkeypatch):
    """With index checks off (the GPU default), a candidate id outside [0, F) makes AuxK's loss and
    the gradients it reaches NaN on either path, rather than reading another latent (a negative id
    would wrap onto latent F + id, which is dead here) or faulting."""
    monkeypatch.setattr(modules, "AUXK_DENSE_RATIO", 0 if auxk_path == "gathers" else 10**6)
    m, x = _model(True, auxk_alpha=0.5, dead_tokens=100, k_aux=6), _x()
    m.tokens_since_fired[[2, 9, 15, 21]] = 1000
    sparsefuse.set_index_checks(False)
    try:
        loss, auxk, grads = _loss_and_grads(m, x, auxk_latents=torch.tensor([2, 9, 15, bad], device=DEVICE))
    finally:
        sparsefuse.set_index_checks(None)
    assert loss.isnan() and auxk.isnan()
    assert dict(zip((n for n, _ in m.named_parameters()), grads))["W_dec"].isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("encoder", ["sparse", "dense"])
@pytest.mark.parametrize("cols", [8, 64], ids=["auxk-dense", "auxk-gathers"])
def test_step_with_auxk_candidates_makes_no_host_sync(encoder, cols):
    """A training step's forward(auxk_latents=...) and backward, on either AuxK path (8 candidates
    run dense, 64 as gathers: n = 4 picks a row), in fp32 and under bf16 autocast, with index checks
    off (the CUDA default): no host sync (the sync debug mode raises on one)."""
    m = TopKSAE(64, 256, 8, hierarchical=True, encoder=encoder, auxk_alpha=1 / 32, dead_tokens=100, k_aux=4,
                seed=0).cuda()
    m.tokens_since_fired[:cols:2] = 1000
    x = torch.randn(128, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    latents = torch.arange(cols, device="cuda")

    def steps():
        for autocast in (False, True):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = m(x, auxk_latents=latents)
            out.loss.backward()
        return out

    assert float(steps().auxk_loss) > 0  # AuxK ran; this first pass also compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_auxk_uses_only_dead_latents():
    m = _model(False, auxk_alpha=1.0, dead_tokens=100)
    x = _x()
    out = m(x)
    assert float(out.auxk_loss.detach()) == 0.0, "no dead latent: AuxK must be zero"
    dead = torch.zeros(F, dtype=torch.bool, device=DEVICE)
    dead[[1, 4, 7, 11, 20]] = True
    m.tokens_since_fired[dead] = 1000
    out = m(x)
    assert out.auxk_loss > 0
    out.auxk_loss.backward()
    touched_dec = m.W_dec.grad.abs().sum(1) > 0
    touched_enc = m.W_enc.grad.abs().sum(1) > 0
    assert touched_dec.any() and touched_enc.any()
    assert not (touched_dec & ~dead).any(), "AuxK moved a decoder row of a live latent"
    assert not (touched_enc & ~dead).any(), "AuxK moved an encoder row of a live latent"


def test_dead_clock():
    m = _model(False, dead_tokens=50)
    idx, vals = m.encode(_x())
    counts = m.fired_counts(idx, vals)
    assert float(counts.sum()) == float((vals > 0).sum())
    m.record_firing(counts, 40)
    m.record_firing(torch.zeros_like(counts), 40)
    assert torch.equal(m.dead_mask(), torch.ones(F, dtype=torch.bool, device=DEVICE) & (counts == 0))


def test_save_load_round_trip(tmp_path):
    m = _model(True, dtype=torch.float32, auxk_alpha=0.1, dead_tokens=77)
    m.tokens_since_fired[3] = 5
    path = str(tmp_path / "sae.safetensors")
    m.save(path)
    back = TopKSAE.load(path, device=DEVICE)
    assert back.config == m.config
    for (n, a), b in zip(m.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n
    x = _x(torch.float32)
    assert torch.equal(m(x).loss, back(x).loss)


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "other.safetensors")
    save_file({"w": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a sparsefuse TopKSAE checkpoint"):
        TopKSAE.load(path)


def test_fvu_curve():
    m, x = _model(False), _x(rows=40)
    curve = m.fvu_curve(x, batch_size=16)
    assert list(curve) == [1, 2, 4, 5]
    idx, vals = m.encode(x)
    recon = m.decode(idx, vals)
    want = float((x - recon).square().sum() / (x - x.mean(0)).square().sum())
    assert abs(curve[5] - want) <= 1e-9 * want


def test_fvu_curve_without_variance_is_nan():
    """One row, or equal rows, have no variance to divide by: FVU is undefined (NaN), not ~1e300."""
    m = _model(False)
    for x in (_x(rows=1), _x(rows=1).repeat(4, 1)):
        curve = m.fvu_curve(x)
        assert list(curve) == [1, 2, 4, 5] and all(v != v for v in curve.values()), curve
        # nor the forward's default variance (it was clamped to 1e-30: a loss of order 1e30); a
        # variance passed in still evaluates the row
        for hier in (False, True):
            assert torch.isnan(_model(hier)(x).recon_loss)
            assert torch.isfinite(_model(hier)(x, variance=1.0).recon_loss)


@pytest.mark.parametrize("ks", [[6], [0, 2], [2.0]])
def test_fvu_curve_rejects_budgets_outside_1_to_k(ks):
    """k' = 6 > K = 5 used to decode with K latents and report it as k' = 6."""
    m, x = _model(False), _x(rows=8)
    with pytest.raises(ValueError, match=r"ks must hold integers in \[1, k\] = \[1, 5\]"):
        m.fvu_curve(x, ks=ks)


def test_forward_and_helpers_refuse_bad_input():
    """A variance <= 0 made the loss negative (training would maximise the error) or inf, a [D]
    variance a [D]-shaped "loss"; fvu_curve(batch_size=-1) reported every FVU as 0 (perfect); the
    reference decoder wrapped index -1 onto the last row while the fused one raised; a wrong-width
    or integer x failed deep inside with messages that did not name it."""
    m, x = _model(False), _x(rows=8)
    for bad in (-1.0, 0.0, float("nan")):
        with pytest.raises(ValueError, match=f"variance must be a positive finite number, got {bad}"):
            m(x, variance=bad)
    with pytest.raises(ValueError, match=rf"variance must be a number or a 0-dim tensor, got shape \({D},\)"):
        m(x, variance=torch.ones(D, device=DEVICE))
    torch.testing.assert_close(m(x, variance=2.0).loss, m(x, variance=torch.tensor(2.0, device=DEVICE)).loss)
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"batch_size must be a positive int, got {bad}"):
            m.fvu_curve(x, batch_size=bad)
    idx, vals = m.encode(x)
    idx[0, 0] = -1
    sparsefuse.set_index_checks(True)  # on a GPU the range check is opt-in
    try:
        for decoder in ("fused", "reference"):
            with pytest.raises(IndexError, match=rf"indices holds -1, outside \[0, {F}\)"):
                _model(False, decoder).decode(idx, vals)
    finally:
        sparsefuse.set_index_checks(None)
    for bad, msg in ((x[:, :-1], rf"x has shape \(8, {D - 1}\); expected \[\*, {D}\]"),
                     (x[None], "x must have 2 dimensions"), (x.long(), "x has dtype int64")):
        with pytest.raises((ValueError, TypeError), match=msg):
            m(bad)
        with pytest.raises((ValueError, TypeError), match=msg):  # it reported a [B, 1, K] x as "indices"
            m.fvu_curve(bad)


@pytest.mark.parametrize("kw, msg", [
    (dict(k=30), "k must be between 1 and n_latents=24"),
    (dict(k=0), "k must be a positive int, got 0"),
    (dict(d_model=0), "d_model must be a positive int, got 0"),
    (dict(n_latents=-2), "n_latents must be a positive int, got -2"),
    (dict(k=3.0), "k must be a positive int, got 3.0"),  # failed later, in torch.topk
    (dict(decoder="triton"), "decoder must be one of"),
    (dict(encoder="fused"), "encoder must be one of"),
    (dict(k_aux=99), "k_aux must be between 1 and n_latents=24"),
    (dict(auxk_alpha=float("nan")), r"auxk_alpha must be finite and >= 0 \(0 turns AuxK off\), got nan"),
    (dict(auxk_alpha=-1.0), r"auxk_alpha must be finite and >= 0 \(0 turns AuxK off\), got -1.0"),
    (dict(auxk_alpha=float("inf")), r"auxk_alpha must be finite and >= 0 \(0 turns AuxK off\), got inf"),
])
def test_bad_arguments(kw, msg):
    args = dict(d_model=D, n_latents=F, k=K) | kw
    with pytest.raises(ValueError, match=msg):
        TopKSAE(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
def test_bf16_autocast_matches_reference_gpu(hierarchical):
    torch.manual_seed(0)
    x = torch.randn(512, 256, device="cuda")
    got = TopKSAE(256, 2048, 32, hierarchical=hierarchical, decoder="fused").cuda()
    want = TopKSAE(256, 2048, 32, hierarchical=hierarchical, decoder="reference", encoder="dense").cuda()
    outs = []
    for m in (got, want):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(x)
        out.loss.backward()
        outs.append(out)
    assert_close(outs[0].loss, outs[1].loss, torch.bfloat16, "loss")
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert_close(p.grad, q.grad, torch.bfloat16, f"grad {name}", scale=2)
    assert TOL[torch.bfloat16] > 0


# --- the in-place row ops behind normalize_decoder_ / remove_parallel_grad_ ---------------------


def _rows(F_, D_, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, grad = (torch.randn(F_, D_, generator=g, dtype=torch.float64) for _ in range(2))
    if F_ > 2:
        w[1] = 0  # a zero row stays zero and leaves its gradient alone
    return w.to(DEVICE, dtype), grad.to(DEVICE, dtype)


@pytest.mark.parametrize("F_,D_", [(1, 1), (5, 1), (7, 33), (3, 2500), (4, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_row_ops_match_fp64_reference(F_, D_, dtype):
    from sparsefuse.sae import reference
    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w, g = _rows(F_, D_, dtype)
    want_w, want_g = w.double().clone(), g.double().clone()
    reference.unit_rows_(want_w, None, 1e-12)
    reference.unit_rows_(w.double(), want_g, 1e-12)
    got_g = remove_parallel_component_(g.clone(), w)
    got_w = normalize_rows_(w.clone())
    assert got_w.dtype == dtype and got_g.dtype == dtype
    if F_ * D_:
        assert_close(got_w, want_w, dtype, "normalized rows")
        # relative to the input gradient: with D = 1 the projection leaves (rounding-level) zeros
        assert (got_g.double() - want_g).norm() <= TOL[dtype] * g.double().norm()
        assert (got_g * got_w).sum(1).abs().max() <= TOL[dtype] * g.norm()


@pytest.mark.parametrize("dtype, eps", [(torch.float32, 1e-3), (torch.float64, 1e-3), (torch.float64, 1e-60)],
                         ids=["fp32", "fp64", "fp64-eps-below-fp32"])
def test_row_ops_take_eps_in_the_accumulation_dtype(dtype, eps):
    """Rows shorter than eps are divided by eps itself: in float64, not by eps rounded to float32
    (which Triton makes of a Python float argument), nor by 0 where eps is below float32's range
    (the interpreter keeps such a value in float64; the GPU would not)."""
    from sparsefuse.sae import reference
    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.6, -0.8]], dtype=torch.float64) * torch.tensor([[eps / 10], [1], [1]])
    g = torch.tensor([[1.0, 0.0], [2.0, -1.0], [0.5, 0.25]], dtype=torch.float64)
    want_w, want_g = w.clone(), g.clone()
    reference.unit_rows_(want_w, None, eps)
    reference.unit_rows_(w, want_g, eps)
    w, g, want_w, want_g = w.to(DEVICE, dtype), g.to(DEVICE, dtype), want_w.to(DEVICE), want_g.to(DEVICE)
    got_g = remove_parallel_component_(g.clone(), w, eps)
    got_w = normalize_rows_(w.clone(), eps)
    assert got_w.isfinite().all() and got_g.isfinite().all()
    assert_close(got_w, want_w, dtype, "normalized rows")
    assert_close(got_g, want_g, dtype, "projected gradient")


def test_row_ops_are_seen_by_autograd():
    """The eager fast path calls the launcher directly; the version counter must still move, so a
    weight saved for backward and then renormalised is refused instead of giving a stale gradient."""
    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w, g = _rows(6, 9, torch.float32)
    p = torch.randn(6, 9, device=DEVICE, requires_grad=True)
    loss = (p * w).sum() + (p * g).sum()
    v_w, v_g = w._version, g._version
    normalize_rows_(w)
    remove_parallel_component_(g, w)
    assert w._version > v_w and g._version == v_g + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_row_ops_non_contiguous_in_place():
    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w, g = (t.t().contiguous().t() for t in _rows(6, 9, torch.float32))
    w0 = w.clone()
    remove_parallel_component_(g, w)
    normalize_rows_(w)
    assert not w.is_contiguous()
    torch.testing.assert_close(w, w0 / w0.norm(dim=1, keepdim=True).clamp_min(1e-12))
    assert (g * w).sum(1).abs().max() < 1e-5


def test_row_ops_opcheck_and_compile():
    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w, g = _rows(5, 7, torch.float32)
    torch.library.opcheck(torch.ops.sparsefuse.normalize_rows_.default, (w.clone(), 1e-12))
    torch.library.opcheck(torch.ops.sparsefuse.project_rows_.default, (g.clone(), w.clone(), 1e-12))

    def both(w, g):
        remove_parallel_component_(g, w)
        normalize_rows_(w)
        return w.sum() + g.sum()

    eager_w, eager_g, comp_w, comp_g = w.clone(), g.clone(), w.clone(), g.clone()
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(both, fullgraph=True)(comp_w, comp_g), both(eager_w, eager_g))
    torch.testing.assert_close(comp_w, eager_w)
    torch.testing.assert_close(comp_g, eager_g)


def test_row_ops_bad_input():
    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w, g = _rows(5, 7, torch.float32)
    with pytest.raises(ValueError, match=r"weight must have 2 dimensions"):
        normalize_rows_(w[0])
    with pytest.raises(TypeError, match=r"weight has dtype int64"):
        normalize_rows_(w.long())
    with pytest.raises(ValueError, match=r"grad has shape \(5, 6\); expected \[5, 7\]"):
        remove_parallel_component_(g[:, :6], w)
    with pytest.raises(ValueError, match=r"grad is on meta"):
        remove_parallel_component_(g.to("meta"), w)
    # a NaN eps made every row NaN, an infinite one every row 0, a negative one a zero row NaN
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        with pytest.raises(ValueError, match=f"eps must be a positive finite number, got {bad}"):
            normalize_rows_(w.clone(), eps=bad)
        with pytest.raises(ValueError, match=f"eps must be a positive finite number, got {bad}"):
            remove_parallel_component_(g.clone(), w, eps=bad)
    # what PyTorch's in-place ops refuse: the kernels rewrote a trainable leaf without complaint, and
    # raced on an expanded gradient, while the CPU reference path raised
    leaf = w.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"weight requires grad, but it is rewritten in place: call this under "
                                         r"torch.no_grad\(\)"):
        normalize_rows_(leaf)
    with torch.no_grad():
        torch.testing.assert_close(normalize_rows_(leaf), normalize_rows_(w.clone()))
    with pytest.raises(ValueError, match=r"grad has elements that share memory"):
        remove_parallel_component_(g[:1].expand(5, 7), w)
    with pytest.raises(ValueError, match=r"weight has elements that share memory"):
        normalize_rows_(w[:, :1].expand(5, 7))
    # grad and weight sharing part of one buffer: a program read a weight row that another had
    # rewritten (PyTorch refuses this too); the same tensor for both, or disjoint rows, are fine
    buf = torch.randn(6, 7, device=w.device)
    with pytest.raises(ValueError, match=r"grad and weight share memory without being the same tensor"):
        remove_parallel_component_(buf[1:], buf[:-1])
    with pytest.raises(ValueError, match=r"grad and weight share memory"):
        remove_parallel_component_(buf[:, ::2][:, :3], buf[:, 1::2])  # interleaved: refused, by byte range
    same = buf.clone()
    torch.testing.assert_close(remove_parallel_component_(same, same), remove_parallel_component_(buf.clone(),
                                                                                                buf.clone()))
    apart = buf.clone()
    remove_parallel_component_(apart[:3], apart[3:])
    torch.testing.assert_close(apart[:3], remove_parallel_component_(buf[:3].clone(), buf[3:].clone()))
    # tensors made under inference_mode: the registered ops refuse to rewrite them outside it (as
    # PyTorch's in-place ops do); the eager fast path, which skips the dispatcher, wrote them
    with torch.inference_mode():
        w_inf, g_inf = w.clone(), g.clone()
    with pytest.raises(RuntimeError, match=r"weight was made under torch.inference_mode\(\) and cannot be "
                                           r"rewritten in place outside it"):
        normalize_rows_(w_inf)
    with pytest.raises(RuntimeError, match=r"grad was made under torch.inference_mode\(\)"):
        remove_parallel_component_(g_inf, w_inf)  # a weight that is only read may be one
    with torch.inference_mode():
        torch.testing.assert_close(normalize_rows_(w_inf), normalize_rows_(w.clone()))


def test_row_ops_refuse_views_that_share_memory_without_being_the_same():
    """remove_parallel_component_ lets grad and weight be one view only when they are the same view:
    same address, shape, strides and dtype. One shared element (byte ranges that meet in a single
    element), a transposed view of the same square buffer, and a view of the same bytes in a wider
    dtype (each of its rows covers two rows of the other) are refused too; the kernels would read
    rows another program had already rewritten."""
    from sparsefuse.sae.ops import remove_parallel_component_

    msg = r"grad and weight share memory without being the same tensor"
    flat = torch.randn(13, device=DEVICE)
    with pytest.raises(ValueError, match=msg):  # element 6 is the last of grad and the first of weight
        remove_parallel_component_(flat[:7].view(1, 7), flat[6:].view(1, 7))
    sq = torch.randn(4, 4, device=DEVICE)
    with pytest.raises(ValueError, match=msg):
        remove_parallel_component_(sq, sq.t())
    storage = torch.zeros(16, device=DEVICE).untyped_storage()
    wide = torch.empty(0, device=DEVICE).set_(storage, 0, (4, 2), (2, 1))  # float32: all 32 bytes
    narrow = torch.empty(0, device=DEVICE, dtype=torch.float16).set_(storage, 0, (4, 2), (2, 1))  # the first 16
    wide.copy_(torch.randn(4, 2))
    with pytest.raises(ValueError, match=msg):
        remove_parallel_component_(narrow, wide)


def test_row_ops_refuse_a_bool_eps():
    """eps is a number, not a flag: True (a bool, which Python counts as the int 1) is refused as the
    other checked numbers refuse it; a NumPy float is a number and is taken."""
    import numpy as np

    from sparsefuse.sae.ops import normalize_rows_, remove_parallel_component_

    w, g = _rows(5, 7, torch.float32)
    with pytest.raises(ValueError, match="eps must be a positive finite number, got True"):
        normalize_rows_(w.clone(), eps=True)
    with pytest.raises(ValueError, match="eps must be a positive finite number, got True"):
        remove_parallel_component_(g.clone(), w, eps=True)
    torch.testing.assert_close(normalize_rows_(w.clone(), eps=np.float64(1e-12)), normalize_rows_(w.clone()))


@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
def test_training_steps_fused_equal_reference_module(hierarchical):
    """Three Adam steps (projection, renormalisation included): the fused module (fused decoder,
    sparse encoder gradient, fused row ops) ends with the reference module's weights."""
    got, want = _model(hierarchical, "fused"), _model(hierarchical, "reference")
    for m in (got, want):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(3):
            m(_x(seed=step)).loss.backward()
            m.remove_parallel_grad_()
            opt.step()
            opt.zero_grad()
            m.normalize_decoder_()
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        assert_close(p, q, torch.float64, name, scale=1e3)


# --- review fixes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_empty_batch_is_finite(hierarchical, encoder):
    """B = 0 (an empty data-parallel shard): losses 0 and zero gradients, not NaN, with AuxK on dead
    latents and with the default (batch) variance alike."""
    m = _model(hierarchical, dtype=torch.float32, encoder=encoder, dead_tokens=10)
    m.tokens_since_fired[::2] = 100
    for variance in (None, 2.0):
        out = m(_x(torch.float32, rows=0), variance)
        out.loss.backward()
        for name in ("loss", "recon_loss", "auxk_loss"):
            assert float(getattr(out, name)) == 0.0, f"{name} with variance={variance}"
        for name, p in m.named_parameters():
            assert torch.equal(p.grad, torch.zeros_like(p)), f"grad {name} with variance={variance}"
            p.grad = None


@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_input_dtype_other_than_parameters(encoder):
    """``x`` may have any float dtype (forward's docstring): float32 parameters take float64
    activations, the encoder running in the parameters' dtype, as ``fvu_curve`` already did."""
    m = _model(True, dtype=torch.float32, encoder=encoder, dead_tokens=10)
    m.tokens_since_fired[::3] = 100
    x = _x(torch.float32)
    want, got = m(x), m(x.double())
    assert torch.equal(got.indices, want.indices)
    for name in ("loss", "recon_loss", "auxk_loss"):
        assert_close(getattr(got, name), getattr(want, name), torch.float32, name)
    assert torch.equal(m.pre_acts(x.double()), m.pre_acts(x))


def test_bf16_parameters_take_fp32_input():
    """A bf16 module (the benchmark's) fed float32 activations: same code as bf16 activations of the
    same values (reference decoder and dense encoder: plain PyTorch, no interpreter in bfloat16)."""
    m = _model(False, "reference", dtype=torch.bfloat16)
    x = _x(torch.bfloat16)
    want, got = m(x), m(x.float())
    assert torch.equal(got.indices, want.indices) and torch.equal(got.vals, want.vals)
    assert_close(got.loss, want.loss, torch.bfloat16, "loss")


def test_default_k_aux_with_d_model_1():
    assert TopKSAE(1, 4, 1).config["k_aux"] == 1


# --- mutation audit: the parts the fused and reference modules share (AuxK, the dead clock, FVU) -------
# test_module_gradients_match_reference compares two modules that run the same forward(): a slip in
# the AuxK normalisation or weighting moves both alike. These check that code against the formulas
# of the module docstring, written out densely in float64.


@pytest.mark.parametrize("n_dead", [8, 2], ids=["many-dead", "fewer-dead-than-k_aux"])
@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_loss_with_auxk_matches_dense_math(encoder, n_dead):
    """With fewer dead latents than k_aux (5 here) AuxK also picks live ones, at activation 0: they
    must add nothing (the sparse encoder recomputes their activation, which is not 0)."""
    m, x = _model(False, encoder=encoder, auxk_alpha=0.25, dead_tokens=100), _x()
    with torch.no_grad():  # nonzero biases, so a dropped or misplaced bias shows
        m.b_dec.copy_(torch.linspace(-0.2, 0.3, D, dtype=torch.float64))
        m.b_enc.copy_(torch.linspace(-0.1, 0.1, F, dtype=torch.float64))
    dead = torch.zeros(F, dtype=torch.bool, device=DEVICE)
    dead[torch.arange(0, F, 3)[:n_dead]] = True
    m.tokens_since_fired[dead] = 1000
    out = m(x)
    pre = (x - m.b_dec) @ m.W_enc.T + m.b_enc
    vals, idx = pre.relu().topk(K, dim=1)
    x_hat = m.b_dec + (vals.unsqueeze(-1) * m.W_dec[idx]).sum(1)
    var = (x - x.mean(0)).square().mean()
    recon = (x_hat - x).square().mean() / var
    e = (x - x_hat).detach()
    aux_vals, aux_idx = (pre.relu() * dead).topk(m.config["k_aux"], dim=1)
    e_hat = (aux_vals.unsqueeze(-1) * m.W_dec[aux_idx]).sum(1)
    auxk = (e_hat - e).square().mean() / e.square().mean()
    assert auxk > 0
    assert_close(out.recon_loss, recon, torch.float64, "recon_loss")
    assert_close(out.auxk_loss, auxk, torch.float64, "auxk_loss")
    assert_close(out.loss, recon + 0.25 * auxk, torch.float64, "loss")
    got = torch.autograd.grad(out.loss, list(m.parameters()))
    want = torch.autograd.grad(recon + 0.25 * auxk, list(m.parameters()))
    for (name, _), a, b in zip(m.named_parameters(), got, want):
        assert_close(a, b, torch.float64, f"grad {name}", scale=50)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_auxk_residual_of_16bit_input_is_not_rounded(xdtype):
    """AuxK's target e = x - x_hat is formed in float32, as the reconstruction loss forms its own:
    a 16-bit x and the same values in float32 give the same losses (x_hat rounded to x's dtype first
    moved the AuxK loss by ~2% here). Plain PyTorch paths, so 16-bit arithmetic is real on CPU too."""
    m = _model(False, decoder="reference", dtype=torch.float32, auxk_alpha=0.25, dead_tokens=100)
    m.tokens_since_fired[::3] = 1000
    x = (_x(torch.float32) * 40).to(xdtype)  # large |x|: a 16-bit ulp of x_hat is far from small
    low, high = m(x), m(x.float())
    assert high.auxk_loss > 0
    for name in ("recon_loss", "auxk_loss"):
        assert_close(getattr(low, name), getattr(high, name), torch.float32, name)


def test_dead_clock_boundary():
    """Dead after more than ``dead_tokens`` tokens without firing: exactly ``dead_tokens`` is alive."""
    m = _model(False, dead_tokens=50)
    zeros = torch.zeros(F, device=DEVICE)
    m.record_firing(zeros, 50)
    assert not m.dead_mask().any()
    m.record_firing(zeros, 1)
    assert m.dead_mask().all()


def test_fired_counts_count_positive_activations_only():
    """A latent chosen with activation 0 (fewer than K positive pre-activations) did not fire."""
    m = _model(False)
    idx = torch.tensor([[0, 1, 2], [1, 3, 2]], device=DEVICE)
    vals = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.5, 0.0]], dtype=torch.float64, device=DEVICE)
    want = torch.zeros(F)
    want[[0, 1, 3]] = 1
    assert torch.equal(m.fired_counts(idx, vals).cpu(), want)


def test_fvu_curve_every_prefix():
    """FVU(k') decodes the k' largest activations (the prefix of the sorted code), for every k'."""
    m, x = _model(False), _x(rows=40)
    with torch.no_grad():
        m.b_dec.copy_(torch.linspace(-0.2, 0.3, D, dtype=torch.float64))
    curve = m.fvu_curve(x, ks=[1, 2, 3, 5], batch_size=16)
    m.requires_grad_(False)
    pre = ((x - m.b_dec) @ m.W_enc.T + m.b_enc).relu()
    vals, idx = pre.topk(K, dim=1)
    total = (x - x.mean(0)).square().sum()
    for kp, got in curve.items():
        recon = m.b_dec + (vals[:, :kp, None] * m.W_dec[idx[:, :kp]]).sum(1)
        want = float((x - recon).square().sum() / total)
        assert abs(got - want) <= 1e-9 * want, kp
    assert curve[1] > curve[2] > curve[3] > curve[5]


def test_pre_acts_subtract_the_decoder_bias():
    m, x = _model(False), _x()
    with torch.no_grad():
        m.b_dec.copy_(torch.linspace(-0.5, 0.5, D, dtype=torch.float64))
        m.b_enc.copy_(torch.linspace(-0.1, 0.1, F, dtype=torch.float64))
    want = ((x - m.b_dec) @ m.W_enc.T + m.b_enc).relu()
    assert_close(m.pre_acts(x), want, torch.float64, "pre_acts")
    idx, vals = m.encode(x)
    assert torch.equal(idx, want.topk(K, dim=1).indices)


@pytest.mark.parametrize("normalize", [True, False])
def test_initial_decoder_is_the_encoder_transposed(normalize):
    """Initialisation (the class docstring): decoder rows = encoder rows, scaled to unit norm."""
    m = TopKSAE(D, F, K, normalize_decoder=normalize, seed=3)
    w_enc, w_dec = m.W_enc.detach().double(), m.W_dec.detach().double()
    want = w_enc / w_enc.norm(dim=1, keepdim=True) if normalize else w_enc
    assert_close(w_dec, want, torch.float32, "W_dec")
    assert not m.b_dec.any() and not m.b_enc.any()


# --- mutation audit 2: ReLU with fewer than K positive pre-activations, eval mode, defaults, load dtype ---


@pytest.mark.parametrize("hierarchical", [False, True], ids=["topk", "hierarchical"])
@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_relu_when_fewer_than_k_latents_are_positive(encoder, hierarchical):
    """A negative encoder bias leaves some rows with fewer than K positive pre-activations: the
    chosen latents past them are 0 (ReLU, then top-k), not negative, in the code and in the loss."""
    m, x = _model(hierarchical, encoder=encoder, auxk_alpha=0.0), _x()
    with torch.no_grad():
        m.b_enc.fill_(-0.4)
    pre = (x - m.b_dec) @ m.W_enc.T + m.b_enc
    assert ((pre > 0).sum(1) < K).any(), "the test needs rows with fewer than K positive pre-activations"
    out = m(x)
    vals, idx = pre.relu().topk(K, dim=1)
    assert (out.vals >= 0).all() and (out.vals == 0).any()
    assert_close(out.vals.detach(), vals.detach(), torch.float64, "vals")
    prefix = (vals.unsqueeze(-1) * m.W_dec[idx]).cumsum(1) + m.b_dec - x.unsqueeze(1)
    err = prefix.square().mean((0, 2)) if hierarchical else prefix[:, -1].square().mean()
    want = (err.mean() if hierarchical else err) / (x - x.mean(0)).square().mean()
    assert_close(out.recon_loss, want, torch.float64, "recon_loss")
    got = torch.autograd.grad(out.loss, [m.W_enc, m.b_enc])
    ref = torch.autograd.grad(want, [m.W_enc, m.b_enc])
    for name, a, b in zip(("W_enc", "b_enc"), got, ref):
        assert_close(a, b, torch.float64, f"grad {name}", scale=50)


@pytest.mark.parametrize("encoder", ["sparse", "dense"])
def test_eval_mode_has_no_auxk(encoder):
    """AuxK is a training loss (forward runs it only in training mode): in eval mode, with dead
    latents, the loss is the reconstruction loss alone."""
    m, x = _model(False, encoder=encoder, auxk_alpha=0.5, dead_tokens=100), _x()
    m.tokens_since_fired[::3] = 1000
    assert m(x).auxk_loss > 0
    m.eval()
    out = m(x)
    assert float(out.auxk_loss) == 0.0
    assert torch.equal(out.loss, out.recon_loss)


@pytest.mark.parametrize("d_model, n_latents, want", [(D, F, D // 2), (64, 16, 16), (7, 40, 3)])
def test_default_k_aux_is_half_d_model(d_model, n_latents, want):
    """k_aux defaults to min(d_model // 2, n_latents) (the class docstring)."""
    assert TopKSAE(d_model, n_latents, 1).config["k_aux"] == want


def test_load_keeps_the_checkpoint_dtype(tmp_path):
    """A float64 checkpoint loads as float64 (not float32), with the same losses."""
    m, x = _model(False, dtype=torch.float64), _x()
    path = str(tmp_path / "sae.safetensors")
    m.save(path)
    back = TopKSAE.load(path, device=DEVICE)
    assert all(p.dtype == torch.float64 for p in back.parameters())
    assert torch.equal(m(x).loss, back(x).loss)


def test_auxk_latents_listed_twice_are_not_checked_with_index_checks_off():
    """Listing a candidate twice is caught only where index checks run (reading the ids is a host
    sync on a GPU): with them off the forward runs, as the docstring says, and AuxK stays finite."""
    m, x = _model(False, auxk_alpha=0.5, dead_tokens=100, k_aux=2), _x()
    m.tokens_since_fired[[2, 9]] = 1000
    sparsefuse.set_index_checks(False)
    try:
        out = m(x, auxk_latents=torch.tensor([2, 9, 2], device=DEVICE))
    finally:
        sparsefuse.set_index_checks(None)
    assert torch.isfinite(out.auxk_loss) and out.auxk_loss > 0


def test_k_may_equal_n_latents():
    """k = n_latents (every latent active) is allowed: the encoding then holds every latent once."""
    m = TopKSAE(D, 6, 6, seed=3).to(DEVICE, torch.float64)
    out = m(_x())
    assert sorted(out.indices[0].tolist()) == list(range(6)) and torch.isfinite(out.loss)
