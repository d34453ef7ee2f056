"""Legitimate but unusual inputs the SAE ops once misread (found in review, session 50).

* A weight with its negative bit set (``z.conj().imag`` of a complex tensor: a lazily negated view,
  whose storage holds the values un-negated) was handed to the kernels as it was: they read the
  storage through the weight's strides, so every product with it took the wrong sign.
* The index range check compared int32 indices with a bound of 2^31 or more, which PyTorch wraps
  into int32 (``i >= 2**31`` compares with -2^31): every valid index was refused.

The last two tests close gaps the session 52 mutation pass found (the two-pass Hierarchical path
with a negated weight; the range check at an int32 bound of 2^31 - 1 and for int64 past 2^31;
``benchmarks/logs/mutation_session52_sae_kernels.md``).
"""

import pytest
import torch

import sparsefuse
from sparsefuse import _validate
from sparsefuse._validate import check_index_range
from sparsefuse.sae import reference as ref
from sparsefuse.sae.ops import _hier_op

from helpers import DEVICE, assert_close


def _neg_view(real: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``real`` whose negative bit is set: the conjugate's imaginary part of a complex
    tensor holding ``-real`` there (strided, as the imaginary part of a complex tensor is)."""
    z = torch.complex(torch.zeros_like(real), -real)
    t = z.conj().imag
    assert t.is_neg() and torch.equal(t, real)
    return t


def _hier_deterministic(*args):
    return sparsefuse.hierarchical_sae_loss(*args, deterministic=True)


LOSSES = {"topk": (sparsefuse.topk_sae_loss, ref.topk_sae_loss),
          "hierarchical": (sparsefuse.hierarchical_sae_loss, ref.hierarchical_sae_loss),
          "hierarchical-deterministic": (_hier_deterministic, ref.hierarchical_sae_loss)}


@pytest.mark.parametrize("op", ["decode", "sparse_linear", *LOSSES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_weight_with_its_negative_bit_set(op, dtype):
    """The value and the gradients that read the weight (vals', x's) equal those of the same weight
    without the bit, against float64."""
    g = torch.Generator().manual_seed(0)
    B, K, F, D = 3, 4, 5, 6
    idx = torch.randint(0, F, (B, K), generator=g).to(DEVICE)
    w = torch.randn(F, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    weight = _neg_view(w)
    vals = torch.rand(B, K, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    x = torch.randn(B, D, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    bias = torch.randn(D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    vals64, x64, w64 = (t.detach().double().requires_grad_() for t in (vals, x, w))
    if op == "decode":
        got, want = sparsefuse.sae_decode(idx, vals, weight, bias), ref.sae_decode(idx, vals64, w64, bias.double())
        inputs, inputs64 = vals, vals64
    elif op == "sparse_linear":
        got, want = sparsefuse.sparse_linear(x, weight, idx), ref.sparse_linear(x64, w64, idx)
        inputs, inputs64 = x, x64
    else:
        fn, fn_ref = LOSSES[op]
        got, want = fn(idx, weight, vals, bias, x.detach()), fn_ref(idx, w64, vals64, bias.double(), x64.detach())
        inputs, inputs64 = vals, vals64
    assert_close(got, want, dtype, f"{op} value")
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64).to(DEVICE)
    (gi,) = torch.autograd.grad(got, inputs, grad.to(got.dtype))
    (gi64,) = torch.autograd.grad(want, inputs64, grad)
    assert_close(gi, gi64, dtype, f"{op} gradient of the input multiplied with the weight")


def test_topk_of_rows_with_their_negative_bit_set():
    """The selection reads x's rows in place when they are unit-stride: a negated view must be read
    negated (torch._neg_view makes one; a contiguous negated view is otherwise rare)."""
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    xn = torch._neg_view(x)
    assert xn.is_neg() and xn.stride(-1) == 1
    values, indices = sparsefuse.topk(xn, 4)
    want = (-x).topk(4, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)


def test_int32_index_range_check_with_a_bound_past_int32():
    """Every int32 index is below a bound of 2^31 or more; negative ones are still refused."""
    idx = torch.tensor([0, 5, 2**31 - 1], dtype=torch.int32, device=DEVICE)
    old = _validate._check_indices  # the mode set now (None: the default)
    sparsefuse.set_index_checks(True)
    try:
        for upper in (2**31, 2**32 + 1):
            check_index_range("indices", idx, upper)
            with pytest.raises(IndexError, match="holds -1"):
                check_index_range("indices", torch.tensor([3, -1], dtype=torch.int32, device=DEVICE), upper)
        # through the ops: a decoder of 2^31 rows and D = 0 holds no memory
        weight = torch.empty(2**31, 0, device=DEVICE)
        vals = torch.rand(1, 2, device=DEVICE)
        i32 = idx[None, :2]
        assert sparsefuse.sae_decode(i32, vals, weight).shape == (1, 0)
        assert sparsefuse.topk_sae_loss(i32, weight, vals, None, torch.empty(1, 0, device=DEVICE)).item() == 0
        assert sparsefuse.hierarchical_sae_loss(i32, weight, vals, None, torch.empty(1, 0, device=DEVICE)).item() == 0
    finally:
        sparsefuse.set_index_checks(old)


@pytest.mark.parametrize("deterministic", [False, True])
def test_hierarchical_two_pass_with_a_negated_weight_view(deterministic):
    """The loss without a gradient (hierarchical_loss_fwd) and the two-pass backward
    (hierarchical_loss_bwd) read the weight in place too: a lazily negated view must be read as its
    values, not as its storage (the test above covers the fused path)."""
    B, K, F, D = 3, 4, 5, 6
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, F, (B, K), generator=g).to(DEVICE)
    vals, w, bias, target = (torch.randn(*s, generator=g, dtype=torch.float64).to(DEVICE)
                             for s in ((B, K), (F, D), (D,), (B, D)))
    weight = _neg_view(w)
    want = ref.hierarchical_sae_loss(idx, w, vals, bias, target)
    with torch.no_grad():
        torch.testing.assert_close(sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target), want)
    v = vals.clone().requires_grad_()
    loss = _hier_op(idx, weight, v, bias, target, deterministic)[0]
    torch.testing.assert_close(loss, want)
    v64 = vals.clone().requires_grad_()
    (gv,) = torch.autograd.grad(loss, v)
    (gv64,) = torch.autograd.grad(ref.hierarchical_sae_loss(idx, w, v64, bias, target), v64)
    assert_close(gv, gv64, torch.float64, "grad_vals")


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
