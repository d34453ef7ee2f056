"""sparse_linear: the K selected outputs of F.linear with a K-sparse backward (the SAE encoder side).

CPU tier: the Triton kernels under the interpreter (conftest), float32 and float64, small grids.
GPU tier (-m gpu): every dtype at real sizes, F*D > 2^31, bit-identity.
"""

import pytest
import torch

import sparsefuse
from sparsefuse.sae import reference as ref

from helpers import DEVICE, assert_close, assert_compile_parity, copy_strided

SHAPES = [  # (B, K, F, D); K = 50 > F = 5 repeats latents within a row
    pytest.param(1, 1, 5, 1, id="B1-K1-F5-D1"),
    pytest.param(3, 3, 5, 100, id="B3-K3-F5-D100"),
    pytest.param(13, 50, 5, 1, id="B13-K50-F5-D1"),
    pytest.param(37, 3, 64, 100, id="B37-K3-F64-D100"),
]


def make(B, K, F, D, dtype, *, device=DEVICE, index_dtype=torch.int64, bias=True, shift=True, seed=0):
    """(x, weight, indices, bias, x_shift)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, generator=g, dtype=torch.float64)
    weight = torch.randn(F, D, generator=g, dtype=torch.float64)
    b = torch.randn(F, generator=g, dtype=torch.float64) if bias else None
    s = torch.randn(D, generator=g, dtype=torch.float64) if shift else None
    idx = torch.randint(0, F, (B, K), generator=g).to(index_dtype)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return to(x), to(weight), idx.to(device), to(b), to(s)


def value_and_grads(fn, x, weight, idx, bias, shift, frozen=()):
    """The output and the grads wrt x, weight, bias, x_shift (those given and not ``frozen``) under
    a fixed random incoming gradient. The inputs are copies that keep their layout (a clone of a
    strided view with gaps would be contiguous)."""
    args = {n: None if t is None else copy_strided(t).requires_grad_(n not in frozen)
            for n, t in dict(x=x, weight=weight, bias=bias, shift=shift).items()}
    out = fn(args["x"], args["weight"], idx, args["bias"], args["shift"])
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
    params = [t for t in args.values() if t is not None and t.requires_grad]
    return [out] + list(torch.autograd.grad(out, params, grad_out))


def check_against_fp64(x, weight, idx, bias, shift, dtype, frozen=()):
    got = value_and_grads(sparsefuse.sparse_linear, x, weight, idx, bias, shift, frozen)
    want = value_and_grads(ref.sparse_linear, *(None if t is None else t.double() for t in (x, weight)), idx,
                           *(None if t is None else t.double() for t in (bias, shift)), frozen)
    names = [n for n, t in dict(x=x, weight=weight, bias=bias, shift=shift).items() if t is not None and n not in frozen]
    for name, a, b in zip(["value"] + [f"grad_{n}" for n in names], got, want):
        assert_close(a, b, dtype, f"sparse_linear {name}")
    params = [t for n, t in dict(x=x, weight=weight, bias=bias, shift=shift).items() if t is not None and n not in frozen]
    for g, p in zip(got[1:], params):
        assert g.dtype == p.dtype  # each gradient in its parameter's dtype


@pytest.mark.parametrize("B,K,F,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_fp64_reference(B, K, F, D, dtype):
    check_against_fp64(*make(B, K, F, D, dtype), dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shift", [True, False], ids=["shift", "noshift"])
def test_index_dtypes_and_optional_inputs(index_dtype, bias, shift):
    check_against_fp64(*make(5, 4, 7, 33, torch.float32, index_dtype=index_dtype, bias=bias, shift=shift),
                       torch.float32)


@pytest.mark.parametrize("frozen", [("x",), ("x", "weight"), ("x", "bias"), ("weight", "shift"), ("x", "weight", "bias")],
                         ids=lambda f: "frozen-" + "-".join(f))
def test_some_inputs_frozen(frozen):
    """Each subset of gradients on its own; with x frozen, grad_x_shift = -(grad_bias @ weight)."""
    check_against_fp64(*make(6, 3, 8, 20, torch.float64), torch.float64, frozen=frozen)


def test_frozen_x_shift_gradient_in_float16():
    """With x frozen, grad_x_shift = -(per-feature sums of grad) @ weight runs in float16 for a float16
    weight: sums past 65504 became inf where the gradient fits, while the x-trainable path was right.
    Every row picks features 0 and 2, so their sums are B times the incoming 3e4."""
    B, K, F, D = 4, 2, 3, 5
    x, weight, _, bias, shift = make(B, K, F, D, torch.float16)
    weight = weight * 0.05
    idx = torch.zeros(B, K, dtype=torch.int64, device=DEVICE)
    idx[:, 1] = 2
    grad = torch.full((B, K), 3e4, dtype=torch.float16, device=DEVICE)
    got = []
    for x_grad in (False, True):
        s = shift.clone().requires_grad_()
        out = sparsefuse.sparse_linear(x.clone().requires_grad_(x_grad), weight, idx, bias, s)
        got.append(torch.autograd.grad(out, [s], grad)[0])
    want = -(grad.double().sum(0) @ weight.double()[[0, 2]])
    for g in got:
        assert torch.isfinite(g).all() and g.abs().min() > 0
        assert_close(g, want, torch.float16, "grad_x_shift")


def test_frozen_x_shift_gradient_in_float16_of_a_zero_incoming_gradient():
    """The float16 grad_x_shift scales the per-feature sums by their largest magnitude: when every
    sum is 0 (a zero incoming gradient) it divides by 1 instead, so the gradient is 0, not 0 / 0."""
    x, weight, idx, bias, shift = make(4, 2, 3, 5, torch.float16)
    s = shift.clone().requires_grad_()
    out = sparsefuse.sparse_linear(x, weight, idx, bias, s)
    (got,) = torch.autograd.grad(out, [s], torch.zeros_like(out))
    assert got.dtype == torch.float16 and torch.equal(got, torch.zeros_like(got))


def test_frozen_x_shift_gradient_ignores_autocast(monkeypatch):
    """With x frozen, grad_x_shift is one torch.mv, and CUDA autocast lists mv: run under a bf16
    autocast (the backward inherits the forward's), it came back with bf16 error (3e-3 against
    float64 on an H100, where the README promises float32 arithmetic). The product now runs with
    autocast off for the tensors' device; CPU autocast does not list mv, so here the check is that
    autocast is off where mv runs (test_gpu_frozen_x_shift_gradient_under_autocast checks values)."""
    x, weight, idx, bias, shift = make(5, 3, 7, 6, torch.float32)
    seen, mv = [], torch.mv
    monkeypatch.setattr(torch, "mv", lambda *a: seen.append(torch.is_autocast_enabled(DEVICE)) or mv(*a))
    s = shift.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = sparsefuse.sparse_linear(x, weight, idx, bias, s)
        (got,) = torch.autograd.grad(out, [s], torch.ones_like(out))
    assert seen == [False], seen
    want = -(torch.ones(5, 3, dtype=torch.float64).flatten() @ weight.double()[idx.flatten()])
    assert_close(got, want, torch.float32, "grad_x_shift")


@pytest.mark.parametrize("shift", [True, False], ids=["shift", "noshift"])
def test_non_contiguous_inputs(shift):
    """noshift: x reaches the kernels as it is (x - x_shift would have made a contiguous copy)."""
    x, weight, idx, bias, shift = make(6, 4, 9, 20, torch.float32, shift=shift)
    x_nc = torch.cat([x, x], dim=1)[:, ::2]
    weight_t = weight.t().contiguous().t()  # column-major [F, D] view
    idx_nc = torch.cat([idx, idx], dim=1)[:, ::2]
    bias_nc = torch.cat([bias, bias])[::2]
    shift_nc = None if shift is None else torch.cat([shift, shift])[::2]
    assert not any(t.is_contiguous() for t in (x_nc, weight_t, idx_nc, bias_nc, shift_nc) if t is not None)
    check_against_fp64(x_nc, weight_t, idx_nc, bias_nc, shift_nc, torch.float32)


def _dense(x, w, i, b, s):
    return torch.nn.functional.linear(x - s, w, b).gather(1, i)


@pytest.mark.parametrize("wide", ["bias", "shift", "x"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-frozen"])
def test_one_float64_input_makes_the_arithmetic_float64(wide, x_grad):
    """Mixed dtypes: one float64 input among float32 ones gives float64 arithmetic throughout, as
    documented, including x - x_shift and grad_x_shift with x frozen (a matrix-vector product)."""
    x, weight, idx, bias, shift = make(6, 3, 7, 20, torch.float32)
    inputs = dict(x=x, weight=weight, bias=bias, shift=shift)
    inputs[wide] = inputs[wide].double()
    frozen = () if x_grad else ("x",)
    got = value_and_grads(sparsefuse.sparse_linear, inputs["x"], inputs["weight"], idx, inputs["bias"],
                          inputs["shift"], frozen)
    want = value_and_grads(ref.sparse_linear, *(inputs[n].double() for n in ("x", "weight")), idx,
                           *(inputs[n].double() for n in ("bias", "shift")), frozen)
    assert got[0].dtype == torch.float64
    names = ["value"] + [n for n in inputs if n not in frozen]
    for name, a, b in zip(names, got, want):  # each gradient is rounded to its input's dtype at the end
        assert_close(a, b, a.dtype, name if name == "value" else f"grad_{name}")


def test_matches_selected_entries_of_dense_linear():
    x, weight, idx, bias, shift = make(7, 5, 11, 30, torch.float64)
    torch.testing.assert_close(sparsefuse.sparse_linear(x, weight, idx, bias, shift), _dense(x, weight, idx, bias, shift))


def test_gradients_equal_dense_linear_through_gather():
    """The K-sparse backward is the dense backward when only the gathered entries carry gradient."""
    args = make(6, 3, 8, 12, torch.float64)
    for frozen in ((), ("x",)):
        got = value_and_grads(sparsefuse.sparse_linear, *args, frozen=frozen)
        for a, b in zip(got, value_and_grads(_dense, *args, frozen=frozen)):
            torch.testing.assert_close(a, b)


def test_precomputed_values_skip_the_forward_only():
    """``values`` is returned (a copy, in the output dtype) and the gradients are unchanged."""
    x, weight, idx, bias, shift = make(6, 3, 8, 12, torch.float64)
    own = sparsefuse.sparse_linear(x, weight, idx, bias, shift)
    given = own.float().clone()
    with_values = lambda *a: sparsefuse.sparse_linear(*a, values=given)  # noqa: E731
    got = value_and_grads(with_values, x, weight, idx, bias, shift)
    want = value_and_grads(sparsefuse.sparse_linear, x, weight, idx, bias, shift)
    assert got[0].dtype == torch.float64 and got[0].data_ptr() != given.data_ptr()
    torch.testing.assert_close(got[0], given.double())
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(torch.ops.sparsefuse.sparse_linear.default, (x, weight.requires_grad_(), idx, bias, shift,
                                                                       given))


def test_empty_batch():
    x, weight, idx, bias, shift = make(0, 3, 5, 8, torch.float32)
    got = value_and_grads(sparsefuse.sparse_linear, x, weight, idx, bias, shift)
    assert got[0].shape == (0, 3) and got[1].shape == (0, 8)
    for g in got[2:]:
        assert torch.equal(g, torch.zeros_like(g))
    for g in value_and_grads(sparsefuse.sparse_linear, x, weight, idx, bias, shift, frozen=("x",))[1:]:
        assert torch.equal(g, torch.zeros_like(g))


def test_non_finite_values_propagate():
    x, weight, idx, bias, shift = make(4, 3, 6, 5, torch.float32)
    x[2, 1] = float("inf")
    out = sparsefuse.sparse_linear(x, weight, idx, bias, shift)
    assert not torch.isfinite(out[2]).any() and torch.isfinite(out[[0, 1, 3]]).all()


def test_deterministic_bit_identical():
    args = make(40, 6, 7, 50, torch.float32)
    a = value_and_grads(sparsefuse.sparse_linear, *args)
    b = value_and_grads(sparsefuse.sparse_linear, *args)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


# --- registration: opcheck, gradcheck, torch.compile ------------------------------------------


@pytest.mark.parametrize("optional", [True, False], ids=["bias-shift", "none"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-frozen"])
def test_opcheck(optional, x_grad):
    x, weight, idx, b, s = make(3, 2, 4, 5, torch.float32, bias=optional, shift=optional)
    for t in (weight, b, s):
        if t is not None:
            t.requires_grad_()
    x.requires_grad_(x_grad)
    torch.library.opcheck(torch.ops.sparsefuse.sparse_linear.default, (x, weight, idx, b, s, None))


@pytest.mark.parametrize("need", ["shift-only", "bias-only", "weight-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_opcheck_partial_gradients(need, dtype):
    """The backward op's outputs have the fake's shapes and dtypes whichever gradients are asked
    for (a frozen bias with a trainable shift still needs the per-feature sums internally)."""
    x, weight, idx, b, s = make(3, 2, 4, 5, dtype)
    {"shift-only": s, "bias-only": b, "weight-only": weight}[need].requires_grad_()
    torch.library.opcheck(torch.ops.sparsefuse.sparse_linear.default, (x, weight, idx, b, s, None))
    grad = torch.randn(3, 2, device=DEVICE, dtype=dtype)
    flags = (False, need == "weight-only", need == "bias-only", need == "shift-only")
    torch.library.opcheck(torch.ops.sparsefuse.sparse_linear_bwd.default, (grad, x, idx, weight.detach(), s.detach(),
                                                                          *flags))


def test_opcheck_non_contiguous_values():
    x, weight, idx, b, s = make(3, 4, 6, 5, torch.float32)
    values = torch.randn(4, 3, device=DEVICE).t()  # [3, 4], strides (1, 3)
    weight.requires_grad_()
    torch.library.opcheck(torch.ops.sparsefuse.sparse_linear.default, (x, weight, idx, b, s, values))
    assert sparsefuse.sparse_linear(x, weight, idx, b, s, values=values).is_contiguous()


@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-frozen"])
def test_gradcheck_fp64(x_grad):
    """Finite differences for weight, bias and x_shift, and for x too when it takes a gradient (the
    frozen-x case has its own x_shift product in the backward)."""
    x, weight, idx, bias, shift = make(3, 3, 4, 5, torch.float64)
    params = [t.clone().requires_grad_() for t in (weight, bias, shift)]
    if x_grad:
        fn, inputs = (lambda x, w, b, s: sparsefuse.sparse_linear(x, w, idx, b, s)), [x.requires_grad_(), *params]
    else:
        fn, inputs = (lambda w, b, s: sparsefuse.sparse_linear(x, w, idx, b, s)), params
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_torch_compile_fullgraph_parity():
    x, weight, idx, bias, shift = make(5, 3, 6, 8, torch.float32)

    def step(x, w, b, s):
        return sparsefuse.sparse_linear(x, w, idx, b, s).square().sum()

    assert_compile_parity(step, (x, weight, bias, shift), atol=1e-6)


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(x=a["x"][0]), ValueError, r"x must have 2 dimensions"),
        (lambda a: a.update(x=a["x"][:, :3]), ValueError, r"x has shape \(4, 3\); expected \[\*, 5\]"),
        (lambda a: a.update(x=a["x"].long()), TypeError, r"x has dtype int64"),
        (lambda a: a.update(weight=a["weight"][None]), ValueError, r"weight must have 2 dimensions"),
        (lambda a: a.update(weight=a["weight"][:0]), ValueError, r"F >= 1"),
        (lambda a: a.update(indices=a["indices"][:2]), ValueError, r"indices has shape \(2, 3\); expected \[4, \*\]"),
        (lambda a: a.update(indices=a["indices"][:, :0]), ValueError, r"K >= 1"),
        (lambda a: a.update(indices=a["indices"].float()), TypeError, r"indices has dtype float32"),
        (lambda a: a.update(bias=a["bias"][:3]), ValueError, r"bias has shape \(3,\); expected \[6\]"),
        (lambda a: a.update(x_shift=a["x_shift"][:3]), ValueError, r"x_shift has shape \(3,\); expected \[5\]"),
        (lambda a: a.update(x_shift=a["x_shift"].int()), TypeError, r"x_shift has dtype int32"),
        (lambda a: a.update(values=a["x"][:, :2]), ValueError, r"values has shape \(4, 2\); expected \[4, 3\]"),
        (lambda a: a.update(x=a["x"].to("meta")), ValueError, r"x is on meta"),
        (lambda a: a.update(indices=a["indices"].to("meta")), ValueError, r"indices is on meta"),
        (lambda a: a.update(bias=a["bias"].to("meta")), ValueError, r"bias is on meta"),
        (lambda a: a.update(x_shift=a["x_shift"].to("meta")), ValueError, r"x_shift is on meta"),
        (lambda a: a.update(values=a["x"][:, :3].to("meta")), ValueError, r"values is on meta"),
        (lambda a: a["indices"].__setitem__((1, 2), 6), IndexError, r"indices holds 6, outside \[0, 6\)"),
        (lambda a: a["indices"].__setitem__((0, 0), -1), IndexError, r"indices holds -1, outside \[0, 6\)"),
    ],
    ids=["x-rank", "x-width", "x-dtype", "w-rank", "F0", "idx-rows", "K0", "idx-dtype", "bias-shape", "shift-shape",
         "shift-dtype", "values-shape", "device", "idx-device", "bias-device", "shift-device", "values-device",
         "idx-high", "idx-negative"],
)
def test_bad_input_errors(mutate, exc, match):
    x, weight, idx, bias, shift = make(4, 3, 6, 5, torch.float32)
    a = dict(x=x, weight=weight, indices=idx, bias=bias, x_shift=shift, values=None)
    mutate(a)
    sparsefuse.set_index_checks(True)  # on a GPU the range check is opt-in
    try:
        with pytest.raises(exc, match=match):
            sparsefuse.sparse_linear(**a)
    finally:
        sparsefuse.set_index_checks(None)


@pytest.mark.parametrize("bad", ["huge", "F"])
def test_unchecked_out_of_range_indices_poison_with_nan(bad):
    """With the host check off, a bad index never reads out of bounds: its output is NaN, and so is
    grad_x_shift, which sums over every entry. Index F (one past the last row) too: the weight is the
    first F rows of a larger buffer, so a kernel that let F through would read a finite row there."""
    x, weight, idx, bias, shift = make(4, 3, 6, 5, torch.float32)
    weight = torch.cat([weight, torch.ones_like(weight[:1])])[:6]
    idx[1, 1] = 6 if bad == "F" else 1_000_000
    sparsefuse.set_index_checks(False)
    try:
        out = sparsefuse.sparse_linear(x, weight, idx, bias, shift)
        # grad_x_shift depends on every entry: NaN whether x is frozen (the per-feature sums, which
        # leave the bad entry out, times the weight: it came back finite) or requires grad
        shift_grads = []
        for x_grad in (False, True):
            xs, s = x.clone().requires_grad_(x_grad), shift.clone().requires_grad_()
            sparsefuse.sparse_linear(xs, weight, idx, bias, s).sum().backward()
            shift_grads.append(s.grad)
    finally:
        sparsefuse.set_index_checks(None)
    assert torch.isnan(out[1, 1]) and torch.isfinite(out[0]).all()
    for g in shift_grads:
        assert torch.isnan(g).all()


def test_unchecked_huge_int64_index_adds_to_no_feature():
    """An int64 index past 2^32 (host check off) must not wrap onto a real feature in the weight
    and bias gradients (the sort narrows keys to int32)."""
    x, weight, idx, bias, shift = make(4, 3, 6, 5, torch.float32)
    good = idx.clone()
    idx[1, 1] = 2**32 + 3
    vals = torch.zeros(4, 3, device=DEVICE)
    sparsefuse.set_index_checks(False)
    try:
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        sparsefuse.sparse_linear(x, w, idx, b, shift, values=vals).sum().backward()
    finally:
        sparsefuse.set_index_checks(None)
    keep = torch.ones(4, 3, dtype=torch.bool, device=DEVICE)
    keep[1, 1] = False
    want_b = torch.zeros(6, device=DEVICE).index_add_(0, good[keep], torch.ones(int(keep.sum()), device=DEVICE))
    assert_close(b.grad, want_b.double(), torch.float32, "grad_bias")
    want_w = torch.zeros(6, 5, device=DEVICE).index_add_(0, good[keep], (x - shift)[:, None, :].expand(4, 3, 5)[keep])
    assert_close(w.grad, want_w.double(), torch.float32, "grad_weight")


# --- GPU tier ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,K,F,D", [
    pytest.param(512, 128, 65536, 2304, id="B512-K128-F65536-D2304"),
    pytest.param(37, 50, 5, 100, id="B37-K50-F5-D100"),
    pytest.param(333, 64, 4099, 777, id="B333-K64-F4099-D777"),
    # past one tile's latents: the row dot products asked for 64 warps from K = 8193
    pytest.param(5, 9000, 20000, 40, id="B5-K9000-F20000-D40"),
])
def test_gpu_matches_fp64_reference(dtype, B, K, F, D):
    check_against_fp64(*make(B, K, F, D, dtype), dtype)


@pytest.mark.gpu
def test_gpu_frozen_x_shift_gradient_under_autocast():
    """The values behind test_frozen_x_shift_gradient_ignores_autocast: float32 inputs, the forward
    and backward under a CUDA bf16 autocast, grad_x_shift against float64 at float32 tolerance."""
    x, weight, idx, bias, shift = make(256, 16, 512, 384, torch.float32, device="cuda")
    s = shift.clone().requires_grad_()
    grad = torch.randn(256, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = sparsefuse.sparse_linear(x, weight, idx, bias, s)
        (got,) = torch.autograd.grad(out, [s], grad)
    want = -(grad.double().flatten() @ weight.double()[idx.flatten()])
    assert got.dtype == torch.float32
    assert_close(got, want, torch.float32, "grad_x_shift")


@pytest.mark.gpu
def test_gpu_more_than_2_31_weight_elements():
    """F * D > 2^31: row offsets must be 64-bit; compared on the touched rows."""
    F, D, B, K = 1_100_000, 2000, 64, 32
    assert F * D > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(F - 5000, F, (B, K), device="cuda", generator=g)
    idx[:, 0] = torch.arange(B, device="cuda")
    weight = torch.randn(F, D, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(F, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(B, D, device="cuda", generator=g).to(torch.bfloat16)
    got = value_and_grads(sparsefuse.sparse_linear, x, weight, idx, bias, None)
    uniq, inv = torch.unique(idx, return_inverse=True)
    want = value_and_grads(ref.sparse_linear, x.double(), weight[uniq].double(), inv, bias[uniq].double(), None)
    assert_close(got[0], want[0], torch.bfloat16, "value")
    assert_close(got[1], want[1], torch.bfloat16, "grad_x")
    assert_close(got[2][uniq], want[2], torch.bfloat16, "grad_weight (touched rows)")
    assert_close(got[3][uniq], want[3], torch.bfloat16, "grad_bias (touched rows)")
    untouched = torch.ones(F, dtype=torch.bool, device="cuda")
    untouched[uniq] = False
    assert not got[2][untouched].any() and not got[3][untouched].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_deterministic_bit_identical(dtype):
    args = make(2048, 64, 8192, 512, dtype)
    a = value_and_grads(sparsefuse.sparse_linear, *args)
    b = value_and_grads(sparsefuse.sparse_linear, *args)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
