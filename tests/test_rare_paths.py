"""Rare paths of the index and overlap checks and of the SAE backwards: an int32 bound of 2^31 - 1,
aliased views that start past their buffer, fake tensors, non-finite gv parts, strided vals with
zero values, staged column chunks, negated weight views on the two-pass path, the padding's sort
keys, more entries than one key block, and an empty batch on the two-pass path.

The session 52 mutation pass over the code changed since e15eb58 found them untested
(``benchmarks/logs/mutation_session52_sae_kernels.md``): each test here failed with at least one
mutant applied that the rest of the suite let through.
CPU tier: the kernels under the interpreter, float32 / float64, small grids.
"""

import warnings

import pytest
import torch

import sparsefuse
from sparsefuse import _validate
from sparsefuse._validate import check_index_range
from sparsefuse.sae import kernels, ops
from sparsefuse.sae import reference as ref

from helpers import DEVICE, assert_close, copy_strided


def _make(B, K, F, D, dtype, seed=0):
    """(idx [B, K] int64, weight [F, D], vals [B, K] in (0, 1) sorted descending, bias [D], target [B, D])."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, F, (B, K), generator=g)
    vals = torch.rand(B, K, generator=g, dtype=torch.float64).sort(dim=1, descending=True).values
    weight = torch.randn(F, D, generator=g, dtype=torch.float64)
    bias = torch.randn(D, generator=g, dtype=torch.float64)
    target = torch.randn(B, D, generator=g, dtype=torch.float64)
    return idx.to(DEVICE), *(t.to(DEVICE, dtype) for t in (weight, vals, bias, target))


def _loss_and_grads(fn, idx, weight, vals, bias, target):
    """The loss and its gradients in weight, vals and bias; the parameters keep their strides."""
    params = [copy_strided(p).requires_grad_() for p in (weight, vals, bias)]
    loss = fn(idx, *params[:2], params[2], target)
    return [loss, *torch.autograd.grad(loss, params)]


def _compare(got, want, dtype, what):
    """Which entries are finite must agree (a +-inf of the reference may be NaN in ours, as in
    test_sae.py::test_zero_value_in_a_non_finite_row); the finite ones within dtype's tolerance."""
    for name, a, b in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, want):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"{what} {name}: non-finite entries differ"
        assert_close(a[finite], b[finite], dtype, f"{what} {name}")


def _two_pass(deterministic):
    """hierarchical_sae_loss through its two-pass ops (the forward, then a backward that sweeps again)."""
    return lambda *a: ops._hier_op(*a, deterministic)[0]


LOSSES = {
    "topk": sparsefuse.topk_sae_loss,
    "hierarchical-fused-deterministic": lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=True),
    "hierarchical-two-pass-deterministic": _two_pass(True),
}


def _reference(name):
    return ref.topk_sae_loss if name == "topk" else ref.hierarchical_sae_loss


# --- the index range check past int32 (sparsefuse/_validate.py) ------------------------------------


def test_index_range_check_at_the_largest_int32_bound_and_past_int32_for_int64():
    """The range test is skipped only where the bound cannot be held in the indices' dtype (it would
    wrap). A bound of 2^31 - 1 fits int32, so int32 index 2^31 - 1 must still be refused; an int64
    index past a bound of 2^31 or more must be refused too (the skip is for int32 only)."""
    old = _validate._check_indices
    sparsefuse.set_index_checks(True)
    try:
        top = torch.tensor([0, 2**31 - 1], dtype=torch.int32, device=DEVICE)
        with pytest.raises(IndexError, match="holds 2147483647, outside"):
            check_index_range("indices", top, 2**31 - 1)
        check_index_range("indices", top[:1], 2**31 - 1)
        for upper in (2**31, 2**32 + 1):
            big = torch.tensor([3, upper], dtype=torch.int64, device=DEVICE)
            check_index_range("indices", big[:1], upper)
            with pytest.raises(IndexError, match=f"holds {upper}, outside"):
                check_index_range("indices", big, upper)
        # through an op: a decoder of 2^31 rows and D = 0 holds no memory
        weight = torch.empty(2**31, 0, device=DEVICE)
        with pytest.raises(IndexError, match=f"holds {2**31}, outside"):
            sparsefuse.sae_decode(torch.tensor([[1, 2**31]], device=DEVICE), torch.rand(1, 2, device=DEVICE), weight)
    finally:
        sparsefuse.set_index_checks(old)


# --- the overlap check of vq_ema_update (sparsefuse/_validate.py: check_disjoint's fast path) -------


def _vq_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 4, generator=g)
    codes = torch.randint(0, 3, (12,), generator=g)
    cb = torch.randn(8, 4, generator=g)
    cs = torch.rand(8, generator=g) * 4
    es = cb * cs[:, None]
    cnt = torch.randint(0, 4, (8,), generator=g)
    return [t.to(DEVICE) for t in (x, codes, cb, cs, es, cnt)]


def test_ema_update_refuses_views_that_start_past_the_buffer_they_share():
    """The fast path compares storages, not the views' first elements: x taken from the codebook's
    rows 3..7, cluster_size from the middle of embed_sum, and counters from the middle of codes all
    start at another address than the tensor they alias, and must still be refused."""
    x, codes, cb, cs, es, cnt = _vq_state()
    msg = "share memory, but the op rewrites some of them in place while it reads the others"
    for args in ((cb[3:], codes[:5], cb, cs, es, cnt),
                 (x, codes, cb, es.view(-1)[4:12], es, cnt),
                 (x, codes, cb, cs, es, codes[2:10])):
        with pytest.raises(ValueError, match=msg):
            sparsefuse.vq_ema_update(*[a.clone() if a is x else a for a in args], semantics="laplace", threshold=1.0)


def test_ema_update_under_fake_tensors_reads_no_data_pointer():
    """Under FakeTensorMode the overlap check must not read the fakes' storage pointers (they are all
    0; PyTorch warns that reading one "will error"): the fast path is for plain tensors only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _vq_state()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*data pointer of FakeTensor")
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            x, codes, cb, cs, es, cnt = (mode.from_tensor(t) for t in real)
            sparsefuse.vq_ema_update(x, codes, cb, cs, es, cnt, semantics="active", restart_after_steps=2)


# --- the zero-value skip of the weight gradient's segmented sum (sparsefuse/sae/kernels.py) ---------


@pytest.mark.parametrize("path", ["feature_segments", "finish"])
def test_zero_values_stay_when_any_gv_part_is_not_finite(path):
    """An entry of value 0 leaves the segmented sum only if *every* gv part of it is finite. The
    non-finite parts sit in the first and middle of three parts (not only the last), so a check that
    kept only the last part's finiteness, or the first's, keeps the wrong entries."""
    B, K, F, P = 6, 2, 4, 3
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, F, (B, K), generator=g).to(DEVICE)
    vals = torch.zeros(B, K, dtype=torch.float64, device=DEVICE)
    vals[5, 1] = 0.5
    gv = torch.randn(P, B, K, generator=g, dtype=torch.float64).to(DEVICE)
    gv[0, 0, 0], gv[1, 1, 1], gv[0, 2, 0], gv[1, 3, 0] = float("inf"), float("nan"), float("-inf"), float("inf")
    if path == "feature_segments":
        seg, order, _ = kernels.feature_segments(idx, F, (vals, gv))
    else:
        colsum = torch.zeros(3, dtype=torch.float64, device=DEVICE)
        gc = torch.tensor(1.0, dtype=torch.float64, device=DEVICE)
        _, _, (seg, order, _) = kernels._finish_grads(gv, colsum, gc, vals, torch.float64, idx, F)
    kept = (vals != 0) | ~torch.isfinite(gv).all(0)
    assert int(kept.sum()) == 5
    got = sorted(order[int(seg[0]):int(seg[F])].tolist())
    assert got == kept.reshape(-1).nonzero().reshape(-1).tolist()


@pytest.mark.parametrize("name", list(LOSSES))
def test_strided_vals_with_zero_values(name):
    """vals as a transposed view (the loss saves vals as given for its backward), rows padded with
    zero values in their last slot. The zero test must read each entry's own value: read through
    the storage's order, the padding of one slot falls on entries of other slots, whose gradient
    rows would be left out."""
    B, K, F, D = 5, 3, 7, 6
    idx, weight, vals, bias, target = _make(B, K, F, D, torch.float64)
    vals[:, K - 1] = 0.0
    vals_t = vals.t().contiguous().t()
    assert not vals_t.is_contiguous() and torch.equal(vals_t, vals)
    got = _loss_and_grads(LOSSES[name], idx, weight, vals_t, bias, target)
    want = _loss_and_grads(_reference(name), idx, weight, vals, bias, target)
    _compare(got, want, torch.float64, name)


def test_zero_value_with_an_infinite_error_past_the_first_staged_chunk(monkeypatch):
    """Staged weight-gradient rows reduced one column chunk at a time (mode 3, bf16 on a GPU; float32
    stages here once _STAGE_DTYPES lists it): gv is whole only after the last chunk, so the zero
    skip may only use it when one chunk covers every column. Latent (1, 2) has value 0 and a feature
    of its own; target[1, 70] is infinite, in the second of two 64-column tiles. Its weight-gradient
    row must still bring 0 * inf = NaN into column 70. torch.empty gives zeros here (any contents are
    possible: the NaN the suite fills it with would hide an early read of the unwritten tiles)."""
    monkeypatch.setattr(kernels, "_STAGE_DTYPES", (torch.float32,))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(*a, **k))
    B, K, F, D = 3, 4, 5, 80
    assert kernels.hierarchical_plan(B, K, F, D, torch.float32, True, True) == (3, 1, 2)
    idx, weight, vals, bias, target = _make(B, K, F, D, torch.float32)
    idx[idx == F - 1] = 0
    idx[1, 2], vals[1, 2] = F - 1, 0.0
    target[1, 70] = float("inf")
    fn = lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=True)  # noqa: E731
    got = _loss_and_grads(fn, idx, weight, vals, bias, target)
    want = _loss_and_grads(ref.hierarchical_sae_loss, idx, *(t.double() for t in (weight, vals, bias, target)))
    assert torch.isnan(got[1][F - 1, 70]) and (got[1][F - 1, :70] == 0).all()
    _compare(got, want, torch.float32, "mode 3 in two chunks")


# --- a weight with its negative bit set, on the hierarchical two-pass path ---------------------------


def _neg_view(real):
    z = torch.complex(torch.zeros_like(real), -real)
    t = z.conj().imag
    assert t.is_neg() and torch.equal(t, real)
    return t


@pytest.mark.parametrize("deterministic", [False, True])
def test_hierarchical_two_pass_with_a_negated_weight_view(deterministic):
    """The loss without a gradient (hierarchical_loss_fwd) and the two-pass backward
    (hierarchical_loss_bwd) read the weight in place too: a lazily negated view must be read as its
    values, not as its storage (test_sae_unusual_inputs.py covers the fused path)."""
    B, K, F, D = 3, 4, 5, 6
    idx, w, vals, bias, target = _make(B, K, F, D, torch.float64)
    weight = _neg_view(w)
    want = ref.hierarchical_sae_loss(idx, w, vals, bias, target)
    with torch.no_grad():
        torch.testing.assert_close(sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target), want)
    v = vals.clone().requires_grad_()
    loss = ops._hier_op(idx, weight, v, bias, target, deterministic)[0]
    torch.testing.assert_close(loss, want)
    v64 = vals.clone().requires_grad_()
    (gv,) = torch.autograd.grad(loss, v)
    (gv64,) = torch.autograd.grad(ref.hierarchical_sae_loss(idx, w, v64, bias, target), v64)
    assert_close(gv, gv64, torch.float64, "grad_vals")


@pytest.mark.parametrize("name", ["topk", "hierarchical-fused-deterministic", "hierarchical-two-pass-deterministic"])
def test_every_segmented_weight_gradient_leaves_out_the_padding(monkeypatch, name):
    """Rows padded with zero values at index 0 (README, "Rows with fewer active latents"): every
    backward whose weight gradient is a segmented sum must hand it sort keys with the padding moved
    to key F, which owns no segment, so that feature 0 does not get B * pad entries to walk (12x
    the unpadded step on an H200 before the skip). The values cannot show this (a padded entry adds
    +0), so the keys the sum receives are checked: the TopK backward and the fused Hierarchical
    one write them in their finishing launch, the two-pass Hierarchical backward in its own pass."""
    B, K, pad, F, D = 6, 3, 4, 7, 5
    idx, weight, vals, bias, target = _make(B, K + pad, F, D, torch.float64)
    idx[:, K:], vals[:, K:] = 0, 0.0
    seen = []
    real = kernels.chunk_partials

    def spy(sorted_keys, *args):
        seen.append(sorted_keys.clone())
        return real(sorted_keys, *args)

    monkeypatch.setattr(kernels, "chunk_partials", spy)
    got = _loss_and_grads(LOSSES[name], idx, weight, vals, bias, target)
    want = _loss_and_grads(_reference(name), idx, weight, vals, bias, target)
    _compare(got, want, torch.float64, name)
    assert len(seen) == 1
    assert int((seen[0] == F).sum()) == B * pad and int((seen[0] == 0).sum()) == int((idx[:, :K] == 0).sum())


@pytest.mark.parametrize("name", ["decode", "hierarchical-two-pass-deterministic"])
def test_weight_gradient_of_more_entries_than_one_key_block(name):
    """B * K = 1050 entries: the sort keys of int64 indices are written by a pass of 1024-entry blocks
    (``_segment_keys_kernel``), so the entries past the first block need a second program."""
    B, K, F, D = 35, 30, 7, 3
    assert B * K > kernels._KEYS_BLOCK and B * K % kernels._KEYS_BLOCK
    idx, weight, vals, bias, target = _make(B, K, F, D, torch.float64)
    if name == "decode":
        w = weight.clone().requires_grad_()
        grad = torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
        (got,) = torch.autograd.grad(sparsefuse.sae_decode(idx, vals, w), w, grad)
        (want,) = torch.autograd.grad(ref.sae_decode(idx, vals, w), w, grad)
        assert_close(got, want, torch.float64, "decode grad_weight")
    else:
        got = _loss_and_grads(LOSSES[name], idx, weight, vals, bias, target)
        want = _loss_and_grads(_reference(name), idx, weight, vals, bias, target)
        _compare(got, want, torch.float64, name)


def test_two_pass_deterministic_backward_of_an_empty_batch():
    """B = 0 on the two-pass deterministic path (the registered op called as it is: the public
    function fuses this case): no gv exists to skip zero values with, and every gradient is zero."""
    idx, weight, vals, bias, target = _make(0, 3, 5, 4, torch.float64)
    got = _loss_and_grads(_two_pass(True), idx, weight, vals, bias, target)
    assert got[0].item() == 0.0
    for g, p in zip(got[1:], (weight, vals, bias)):
        assert g.shape == p.shape and torch.equal(g, torch.zeros_like(g))
