"""SAE decoder ops: sae_decode, topk_sae_loss, hierarchical_sae_loss.

CPU tier: the Triton kernels under the interpreter (conftest), float32 and float64, small grids.
GPU tier (-m gpu): every dtype, real sizes, F*D > 2^31, bit-identity (compute-sanitizer: test_sanitize.py).
"""

import subprocess
import sys

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparsefuse
from sparsefuse import compat
from sparsefuse.sae import kernels
from sparsefuse.sae import reference as ref

from helpers import DEVICE, TOL, assert_close, assert_compile_parity, copy_strided, run_without_interpreter

OPS = {
    "decode": (lambda i, w, v, b, t: sparsefuse.sae_decode(i, v, w, b), lambda i, w, v, b, t: ref.sae_decode(i, v, w, b)),
    "topk": (sparsefuse.topk_sae_loss, ref.topk_sae_loss),
    "hierarchical": (sparsefuse.hierarchical_sae_loss, ref.hierarchical_sae_loss),
}

# (B, K, F, D): the odd sizes from the issue; F = 5 with K = 50 forces repeated latents in a row.
SHAPES = [
    pytest.param(1, 1, 5, 1, id="B1-K1-F5-D1"),
    pytest.param(3, 3, 5, 100, id="B3-K3-F5-D100"),
    pytest.param(13, 50, 5, 1, id="B13-K50-F5-D1"),
    pytest.param(37, 3, 64, 100, id="B37-K3-F64-D100"),
    pytest.param(3, 50, 5, 100, id="B3-K50-F5-D100"),
]


def make(B, K, F, D, dtype, *, device=DEVICE, index_dtype=torch.int64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, F, (B, K), generator=g).to(index_dtype)
    vals = torch.rand(B, K, generator=g, dtype=torch.float64).sort(dim=1, descending=True).values
    weight = torch.randn(F, D, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64) if bias else None
    target = torch.randn(B, D, generator=g, dtype=torch.float64)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return idx.to(device), to(weight), to(vals), to(b), to(target)


def value_and_grads(fn, idx, weight, vals, bias, target):
    """The output (a loss, or the decode) and the grads wrt weight, vals, bias; a non-scalar output
    is back-propagated with a fixed random incoming gradient so every element matters. The parameters
    are copies that keep their layout (a clone of a strided view with gaps would be contiguous)."""
    params = [copy_strided(p).requires_grad_() for p in (weight, vals, bias) if p is not None]
    weight_, vals_ = params[0], params[1]
    bias_ = params[2] if bias is not None else None
    out = fn(idx, weight_, vals_, bias_, target)
    grad_out = None
    if out.dim():
        gen = torch.Generator().manual_seed(1)
        grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device=out.device, dtype=out.dtype)
    return [out] + list(torch.autograd.grad(out, params, grad_out))


def check_against_fp64(op, idx, weight, vals, bias, target, dtype, scale=1.0, fn=None):
    ours, refn = OPS[op]
    got = value_and_grads(fn or ours, idx, weight, vals, bias, target)
    want = value_and_grads(refn, idx, *(None if t is None else t.double() for t in (weight, vals, bias, target)))
    names = ["value", "grad_weight", "grad_vals", "grad_bias"]
    for name, a, b in zip(names, got, want):
        assert_close(a, b, dtype, f"{op} {name}", scale=scale)
    # each gradient comes back in its parameter's dtype
    assert got[1].dtype == weight.dtype and got[2].dtype == vals.dtype


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("B,K,F,D", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_fp64_reference(op, B, K, F, D, dtype):
    check_against_fp64(op, *make(B, K, F, D, dtype), dtype)


def _spy_launches(monkeypatch):
    """A list that records (kernel, grid) of every SAE kernel launch from now on."""
    from sparsefuse.sae import kernels

    launches = []
    real = kernels._launch

    def spy(fn, grid, *args, **meta):
        launches.append((fn, grid))
        return real(fn, grid, *args, **meta)

    monkeypatch.setattr(kernels, "_launch", spy)
    return launches


@pytest.mark.parametrize("device,entries,width", [("other", 0, 64), ("h100", 1, 64), ("h100", 0, 32)],
                         ids=["other-device", "h100-below-threshold", "h100-at-threshold"])
@pytest.mark.parametrize("B,K,F,D", [(7, 50, 5, 100), (3, 7, 300, 33), (5, 3, 40, 1)])
def test_hierarchical_fp32_atomic_backward_tile_width(B, K, F, D, device, entries, width, monkeypatch):
    """The fp32 atomic backward takes 32-column tiles on an H100 from B * K = _NARROW_MIN_ENTRIES and 64
    otherwise (the threshold is moved to this shape's B * K, or one past it): both widths match
    float64, with the grid the width implies (a partial last tile at D = 100 and 33, one tile at
    D = 1). The deterministic path keeps 64 columns."""
    from sparsefuse.sae import kernels

    monkeypatch.setattr(kernels, "_narrow_atomic_bwd", lambda dev: device == "h100")
    monkeypatch.setattr(kernels, "_NARROW_MIN_ENTRIES", B * K + entries)
    launches = _spy_launches(monkeypatch)
    tiles = lambda w: -(-D // min(w, max(16, 1 << (D - 1).bit_length())))  # noqa: E731
    check_against_fp64("hierarchical", *make(B, K, F, D, torch.float32), torch.float32)
    assert [grid for fn, grid in launches if fn is kernels._hierarchical_sae_bwd_kernel] == [(B, tiles(width))]
    launches.clear()
    check_against_fp64("hierarchical", *make(B, K, F, D, torch.float32), torch.float32,
                       fn=lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=True))
    assert [grid for fn, grid in launches if fn is kernels._hierarchical_sae_bwd_kernel] == [(B, tiles(64))]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("B,K,F,D,chunks,fits", [
    pytest.param(3, 50, 5, 100, 2, False, id="B3-K50-F5-D100-two-chunks"),
    pytest.param(37, 3, 40, 100, 2, False, id="B37-K3-F40-D100-two-chunks"),
    pytest.param(37, 3, 64, 100, 1, True, id="B37-K3-F64-D100-fits-narrow-last-tile"),
    pytest.param(4, 3, 300, 100, 1, True, id="B4-K3-F300-D100-fits"),
    pytest.param(8, 4, 16, 100, 1, True, id="B8-K4-F16-D100-fits-exactly"),  # B*K = 2F: the rows fill the buffer
    pytest.param(64, 8, 4, 64, 1, False, id="B64-K8-F4-D64-one-tile-too-big"),
])
def test_hierarchical_half_weight_staged_path(B, K, F, D, chunks, fits, deterministic, monkeypatch):
    """bf16 weights stage the B*K gradient rows in bf16, in column chunks bounded by the F x D fp32
    buffer atomics would need, and reduce them in a fixed order: always in deterministic mode, and
    by default only when all the rows fit in that buffer's bytes (B*K <= 2F; one D tile is not
    enough). Run in fp16 here (the interpreter's bf16 arithmetic is wrong): fp64-reference
    accuracy, the expected sweeps and segmented sums."""
    from sparsefuse.sae import kernels

    monkeypatch.setattr(kernels, "_STAGE_DTYPES", (torch.float16,))
    launches = _spy_launches(monkeypatch)
    loss = lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=deterministic)  # noqa: E731
    args = make(B, K, F, D, torch.float16)
    check_against_fp64("hierarchical", *args, torch.float16, fn=loss)
    staged = deterministic or fits
    bwd = [grid for fn, grid in launches if fn is kernels._hierarchical_sae_bwd_kernel]
    sums = [fn for fn, _ in launches if fn is kernels._sae_weight_grad_kernel]
    assert len(bwd) == (chunks if staged else 1) and sum(grid[1] for grid in bwd) == -(-D // 64)
    assert len(sums) == (len(bwd) if staged else 0)
    # one chunk (or the converted fp32 buffer): the forward ran the backward's sweep too
    fwd = [fn for fn, _ in launches if fn is kernels._hierarchical_sae_fwd_kernel]
    assert len(fwd) == (1 if staged and chunks > 1 else 0)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("B,K,F,D", [(2, 4, 3, 128), (2, 4, 64, 16)])
def test_hierarchical_fp16_large_errors_stay_finite(B, K, F, D, deterministic):
    """fp16 weights never hold unscaled gradient rows v_j E_j, which can pass 65504 when the
    gradient itself is small enough for fp16: every path matches the fp64 reference."""
    idx, weight, vals, bias, target = make(B, K, F, D, torch.float16)
    vals = torch.full_like(vals, 60.0)
    target = (target.float() * 300).half()
    loss = lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=deterministic)  # noqa: E731
    got = value_and_grads(loss, idx, weight, vals, bias, target)
    assert all(torch.isfinite(t).all() for t in got)
    check_against_fp64("hierarchical", idx, weight, vals, bias, target, torch.float16, fn=loss)


@pytest.mark.parametrize("op,deterministic", [("decode", False), ("topk", False), ("hierarchical", False),
                                               ("hierarchical", True)])
def test_float64_kernels_get_no_fp32_rounded_scalars(op, deterministic, monkeypatch):
    """Triton passes a Python float argument as fp32 on CUDA (the interpreter keeps fp64, so the
    fp64 comparisons above cannot see it): a scale like 2 / (B*D) must reach float64 kernels as a
    device tensor. Every float argument of every launch here must be exact in fp32."""
    from sparsefuse.sae import kernels

    floats = []
    real = kernels._launch

    def spy(fn, grid, *args, **meta):
        floats.extend((fn.__name__, a) for a in args if isinstance(a, float))
        return real(fn, grid, *args, **meta)

    monkeypatch.setattr(kernels, "_launch", spy)
    fn = OPS[op][0] if op != "hierarchical" else (
        lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=deterministic))
    check_against_fp64(op, *make(7, 3, 5, 37, torch.float64), torch.float64, fn=fn)
    inexact = [(name, a) for name, a in floats if float(torch.tensor(a, dtype=torch.float32)) != a]
    assert not inexact, inexact


HIER_FUSED_CASES = [  # (weight dtype, deterministic, what requires grad, fused forward expected)
    pytest.param(torch.float16, False, ("weight", "vals", "bias"), True, id="fp16-buffer-converted"),
    pytest.param(torch.float32, True, ("weight", "vals", "bias"), True, id="fp32-deterministic-staged"),
    pytest.param(torch.float32, False, ("vals", "bias"), True, id="fp32-frozen-decoder"),
    pytest.param(torch.float32, False, ("weight", "vals", "bias"), False, id="fp32-atomics-two-passes"),
    pytest.param(torch.float32, False, ("bias",), False, id="fp32-bias-only"),
    pytest.param(torch.float32, False, (), False, id="fp32-nothing-requires-grad"),
]


@pytest.mark.parametrize("dtype,deterministic,wanted,fused", HIER_FUSED_CASES)
def test_hierarchical_fused_forward(dtype, deterministic, wanted, fused, monkeypatch):
    """The forward runs the backward's sweep too (one launch, no separate forward kernel) exactly
    when a gradient is wanted and the backward has a pass that can scale it; the results match the
    fp64 reference either way, through a second backward of the same graph and with an incoming
    gradient other than 1."""
    from sparsefuse.sae import kernels

    idx, weight, vals, bias, target = make(37, 5, 11, 100, dtype)
    ours = dict(weight=weight, vals=vals, bias=bias)
    theirs = {k: t.double() for k, t in ours.items()}
    for k in wanted:
        ours[k].requires_grad_()
        theirs[k].requires_grad_()
    launches = _spy_launches(monkeypatch)
    loss = sparsefuse.hierarchical_sae_loss(idx, **ours, target=target, deterministic=deterministic) * -1.5
    fwd = [fn for fn, _ in launches if fn is kernels._hierarchical_sae_fwd_kernel]
    bwd = [fn for fn, _ in launches if fn is kernels._hierarchical_sae_bwd_kernel]
    assert (len(fwd), len(bwd)) == ((0, 1) if fused else (1, 0))

    want = ref.hierarchical_sae_loss(idx, **theirs, target=target.double()) * -1.5
    assert_close(loss, want, dtype, "value")
    if not wanted:
        return
    first = torch.autograd.grad(loss, [ours[k] for k in wanted], retain_graph=True)
    again = torch.autograd.grad(loss, [ours[k] for k in wanted])
    for name, a, b, w in zip(wanted, first, again, torch.autograd.grad(want, [theirs[k] for k in wanted])):
        if fused:  # the second backward only rescales what the forward left (the split one re-runs atomics)
            assert torch.equal(a, b), name
        else:
            assert_close(a, b, dtype, f"second grad_{name}")
        assert_close(a, w, dtype, f"grad_{name}")
        assert a.dtype == dtype


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_index_dtypes_and_optional_bias(op, index_dtype, bias):
    check_against_fp64(op, *make(5, 4, 7, 33, torch.float32, index_dtype=index_dtype, bias=bias), torch.float32)


@pytest.mark.parametrize("op", list(OPS))
def test_non_contiguous_inputs(op):
    idx, weight, vals, bias, target = make(6, 4, 9, 20, torch.float32)
    weight_t = weight.t().contiguous().t()  # column-major [F, D] view
    vals_nc = torch.cat([vals, vals], dim=1)[:, ::2]
    target_nc = torch.cat([target, target], dim=1)[:, ::2]
    idx_nc = torch.cat([idx, idx], dim=1)[:, ::2]
    assert not (weight_t.is_contiguous() or vals_nc.is_contiguous() or target_nc.is_contiguous())
    check_against_fp64(op, idx_nc, weight_t, vals_nc, bias, target_nc, torch.float32)


@pytest.mark.parametrize("op", list(OPS))
def test_empty_batch(op):
    """B = 0: decode returns [0, D]; losses return 0 with zero (finite) gradients."""
    idx, weight, vals, bias, target = make(0, 3, 5, 8, torch.float32)
    got = value_and_grads(OPS[op][0], idx, weight, vals, bias, target)
    assert got[0].sum().item() == 0.0
    assert got[2].shape == (0, 3)
    for g in (got[1], got[3]):
        assert torch.equal(g, torch.zeros_like(g))
    if op == "decode":
        assert sparsefuse.sae_decode(idx, vals, weight, bias).shape == (0, 8)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("B,D", [(0, 8), (4, 0)], ids=["B0", "D0"])
def test_hierarchical_empty_every_path(B, D, dtype, deterministic):
    """B = 0 or D = 0 through the split and the fused paths: loss 0, every gradient zero."""
    idx, weight, vals, bias, target = make(B, 3, 5, D, dtype)
    loss = lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=deterministic)  # noqa: E731
    got = value_and_grads(loss, idx, weight, vals, bias, target)
    assert got[0].item() == 0.0
    for g, p in zip(got[1:], (weight, vals, bias)):
        assert g.shape == p.shape and g.dtype == p.dtype and torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("op", ["topk", "hierarchical"])
def test_loss_dtype_and_frozen_decoder(op):
    idx, weight, vals, bias, target = make(4, 3, 6, 10, torch.float32)
    v = vals.clone().requires_grad_()
    loss = OPS[op][0](idx, weight, v, bias, target)  # weight does not require grad
    assert loss.dtype == torch.float32 and loss.dim() == 0
    (gv,) = torch.autograd.grad(loss, [v])
    want = torch.autograd.grad(OPS[op][1](idx, weight.double(), v.double(), bias.double(), target.double()), [v])[0]
    assert_close(gv, want, torch.float32, "grad_vals")


def test_hierarchical_is_mean_of_prefix_topk_losses():
    """The definition in the docs: the mean over k of the TopK loss of the first k latents."""
    idx, weight, vals, bias, target = make(7, 5, 11, 13, torch.float64)
    h = sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target)
    prefix = torch.stack([sparsefuse.topk_sae_loss(idx[:, :k], weight, vals[:, :k], bias, target) for k in range(1, 6)])
    torch.testing.assert_close(h, prefix.mean(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("op", list(OPS))
def test_rows_padded_with_zero_vals(op):
    """The README's recipe for rows with fewer latents (BatchTopK, JumpReLU): pad to a common K
    with vals 0 and index 0. The decode and the TopK loss, with their weight and bias gradients and
    the real slots' vals gradients, are those of the unpadded rows; the Hierarchical loss counts a
    padded slot as one more prefix equal to the row's full reconstruction."""
    B, K, pad, F, D = 5, 3, 4, 11, 13
    idx, weight, vals, bias, target = make(B, K, F, D, torch.float64)
    padded_idx = torch.cat([idx, idx.new_zeros(B, pad)], dim=1)
    padded_vals = torch.cat([vals, vals.new_zeros(B, pad)], dim=1)
    ours, _ = OPS[op]
    got = value_and_grads(ours, padded_idx, weight, padded_vals, bias, target)
    if op == "hierarchical":
        h = sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target)
        full = sparsefuse.topk_sae_loss(idx, weight, vals, bias, target)
        torch.testing.assert_close(got[0], (K * h + pad * full) / (K + pad), rtol=1e-12, atol=0)
        return
    want = value_and_grads(ours, idx, weight, vals, bias, target)
    for name, a, b in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, want):
        torch.testing.assert_close(a[:, :K] if name == "grad_vals" else a, b, rtol=1e-12, atol=1e-15, msg=name)


def _two_pass_hierarchical(*args, deterministic):
    """hierarchical_sae_loss through its two-pass ops (forward, then a backward that sweeps again),
    which it takes when the forward cannot run the backward's sweep ahead (not fusable)."""
    from sparsefuse.sae import ops

    return ops._hier_op(*args, deterministic)[0]


_ZERO_VALUE_CASES = [
    pytest.param("topk", False, torch.float32, id="topk-fp32"),
    pytest.param("hierarchical", False, torch.float32, id="hierarchical-atomic-fp32"),
    pytest.param("hierarchical", True, torch.float32, id="hierarchical-deterministic-fp32"),
    pytest.param("two-pass", True, torch.float32, id="two-pass-deterministic-fp32"),
    pytest.param("two-pass", False, torch.float32, id="two-pass-atomic-fp32"),
    pytest.param("topk", False, torch.bfloat16, id="topk-bf16", marks=pytest.mark.gpu),
    pytest.param("hierarchical", False, torch.bfloat16, id="hierarchical-staged-bf16", marks=pytest.mark.gpu),
    pytest.param("hierarchical", True, torch.bfloat16, id="hierarchical-deterministic-bf16", marks=pytest.mark.gpu),
    pytest.param("two-pass", True, torch.bfloat16, id="two-pass-deterministic-bf16", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("op,deterministic,dtype", _ZERO_VALUE_CASES)
def test_zero_value_in_a_non_finite_row(op, deterministic, dtype):
    """Every weight-gradient path leaves out latents whose value is 0 (the atomic backward skips
    their adds; the segmented sums leave them out of the sorted entries), which add +-0 unless
    their error holds a non-finite entry: there 0 * inf = NaN must still reach the weight gradient,
    as the reference gives it, in that column only. Latent 2 of row 1 (value 0) has a feature no
    other slot uses; target[1, 2] is infinite. Where the reference's gradient is +-inf ours may be
    NaN (the README: the suffix sums walk down from the row's total), so the comparison is of which
    entries are finite, and of the finite values."""
    B, K, F, D = 3, 4, 9, 5
    idx, weight, vals, bias, target = make(B, K, F, D, dtype)
    idx[idx == F - 1] = 0
    idx[1, 2], vals[1, 2] = F - 1, 0.0
    target[1, 2] = float("inf")
    fn = {"topk": sparsefuse.topk_sae_loss,
          "hierarchical": lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=deterministic),
          "two-pass": lambda *a: _two_pass_hierarchical(*a, deterministic=deterministic)}[op]
    got = value_and_grads(fn, idx, weight, vals, bias, target)
    want = value_and_grads(OPS["topk" if op == "topk" else "hierarchical"][1], idx,
                           *(t.double() for t in (weight, vals, bias, target)))
    assert torch.isnan(got[1][F - 1, 2]) and (got[1][F - 1, [0, 1, 3, 4]] == 0).all()
    for name, a, b in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, want):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), name
        assert_close(a[finite], b[finite], dtype, name)


@pytest.mark.parametrize("op", list(OPS))
def test_non_finite_values_propagate(op):
    idx, weight, vals, bias, target = make(4, 3, 6, 10, torch.float32)
    used = int(idx[1, 0])
    unused = sorted(set(range(6)) - set(idx.flatten().tolist()))
    w = weight.clone()
    w[used, 2] = float("inf")
    out = OPS[op][0](idx, w, vals, bias, target)
    assert not torch.isfinite(out).all()
    if op != "decode":  # the gradients too: column 2 of the error is inf, the other columns finite
        w, v, b = (t.clone().requires_grad_() for t in (w, vals, bias))
        gw, gv, gb = torch.autograd.grad(OPS[op][0](idx, w, v, b, target), (w, v, b))
        others = [d for d in range(gw.shape[1]) if d != 2]
        assert not torch.isfinite(gw[used, 2]) and not torch.isfinite(gb[2]) and not torch.isfinite(gv[1]).all()
        assert torch.isfinite(gw[:, others]).all() and torch.isfinite(gb[others]).all()
    if unused:  # a poisoned row nobody selects changes nothing
        w = weight.clone()
        w[unused[0]] = float("nan")
        torch.testing.assert_close(OPS[op][0](idx, w, vals, bias, target), OPS[op][0](idx, weight, vals, bias, target))
    if op != "decode":
        t = target.clone()
        t[0, 0] = float("nan")
        assert torch.isnan(OPS[op][0](idx, weight, vals, bias, t))


@pytest.mark.parametrize("op", list(OPS))
def test_deterministic_bit_identical(op):
    idx, weight, vals, bias, target = make(9, 6, 5, 40, torch.float32)
    runs = []
    for _ in range(2):
        runs.append(value_and_grads(lambda *a: OPS[op][0](*a, **({} if op == "decode" else {"deterministic": True})),
                                    idx, weight, vals, bias, target))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_use_deterministic_algorithms_selects_staged_path():
    idx, weight, vals, bias, target = make(9, 6, 5, 40, torch.float32)
    torch.use_deterministic_algorithms(True)
    try:
        a = value_and_grads(sparsefuse.hierarchical_sae_loss, idx, weight, vals, bias, target)
        b = value_and_grads(sparsefuse.hierarchical_sae_loss, idx, weight, vals, bias, target)
    finally:
        torch.use_deterministic_algorithms(False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    check_against_fp64("hierarchical", idx, weight, vals, bias, target, torch.float32)


@pytest.mark.parametrize("flag", [True, False])
def test_use_deterministic_algorithms_picks_the_backward_path(flag, monkeypatch):
    """deterministic=None follows torch.use_deterministic_algorithms: the staged rows (mode 2, gv
    as per-tile partials) when it is on, fp32 atomics when it is off. On the CPU the atomics repeat
    bit for bit anyway, so only the launches tell the two paths apart."""
    from sparsefuse.sae import kernels

    metas = []
    real = kernels._launch

    def spy(fn, grid, *args, **meta):
        if fn is kernels._hierarchical_sae_bwd_kernel:
            metas.append((meta["WEIGHT_GRAD"], meta["STAGED_GV"]))
        return real(fn, grid, *args, **meta)

    monkeypatch.setattr(kernels, "_launch", spy)
    idx, weight, vals, bias, target = make(4, 3, 5, 20, torch.float32)
    torch.use_deterministic_algorithms(flag)
    try:
        value_and_grads(sparsefuse.hierarchical_sae_loss, idx, weight, vals, bias, target)
    finally:
        torch.use_deterministic_algorithms(False)
    assert metas == [(2, True)] if flag else metas == [(1, False)]


@pytest.mark.parametrize("B,K,F,D", [(5, 3, 7, 300), (4, 64, 70, 200)])
def test_topk_column_group_parts_of_gv(B, K, F, D):
    """D > 128: the TopK gather runs several column groups, each with its part of gv. At K = 3 the
    backward sums the parts; at K = 64 they would outweigh half a residual, so the forward does."""
    from sparsefuse.sae import kernels

    assert (kernels.topk_gv_parts(K, D, 4) > 1) == (K == 3)
    idx, weight, vals, bias, target = make(B, K, F, D, torch.float32)
    check_against_fp64("topk", idx, weight, vals, bias, target, torch.float32)


@pytest.mark.parametrize("op", list(OPS) + ["sparse_linear"])
@pytest.mark.parametrize("K", [4, 9, 13])
@pytest.mark.parametrize("decode_tile", [4, 16])
def test_rows_of_more_latents_than_a_tile(op, K, decode_tile, monkeypatch):
    """K above _DECODE_TILE_MAX_K (4 here; 2048 on a GPU): the decode sums blocks of _MAX_BLOCK_K
    latents (4 here; 512) in launches of its own, and the TopK loss takes gv from the row dot
    products, which run a program per block of latents (at any K above _MAX_BLOCK_K). One tile for
    all K latents had asked a GPU for 64 warps at K > 8192. K = 4 is one whole block; 9 and 13 end in
    a partial one; with a decode tile of 16 the decode keeps them in one tile while the row dots
    (the decode's vals gradient, sparse_linear's forward) take blocks. Out-of-range ids (checks off)
    still poison with NaN."""
    from sparsefuse.sae import kernels

    monkeypatch.setattr(kernels, "_MAX_BLOCK_K", 4)
    monkeypatch.setattr(kernels, "_DECODE_TILE_MAX_K", decode_tile)
    assert (kernels.topk_gv_parts(K, 300, 4) == 1) == (K > decode_tile)  # one part of gv past one tile
    if op == "sparse_linear":
        g = torch.Generator().manual_seed(0)
        x, w, shift, fbias, g_out = (torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE)
                                     for shape in ((5, 37), (40, 37), (37,), (40,), (5, K)))
        idx = torch.randint(0, 40, (5, K), generator=g).to(DEVICE)
        results = []
        for fn in (lambda x, w, fb, s: sparsefuse.sparse_linear(x, w, idx, fb, s),
                   lambda x, w, fb, s: ((x - s) @ w.t() + fb).gather(1, idx)):
            params = [t.clone().requires_grad_() for t in (x, w, fbias, shift)]
            out = fn(*params)
            results.append([out, *torch.autograd.grad(out, params, g_out)])
        for name, a, b in zip(["out", "grad_x", "grad_weight", "grad_bias", "grad_shift"], *results):
            assert_close(a, b, torch.float64, f"sparse_linear {name}")
        return
    check_against_fp64(op, *make(5, K, 40, 37, torch.float64), torch.float64)
    check_against_fp64(op, *make(3, K, 7, 33, torch.float32, index_dtype=torch.int32), torch.float32)
    idx, weight, vals, bias, target = make(3, K, 40, 9, torch.float32)
    idx[1, K - 1] = 40
    sparsefuse.set_index_checks(False)
    try:
        out = OPS[op][0](idx, weight, vals, bias, target)
    finally:
        sparsefuse.set_index_checks(None)
    assert torch.isnan(out[1] if op == "decode" else out).all()
    if op == "decode":
        assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()


@pytest.mark.parametrize("K", [3, 9])
def test_float64_target_makes_the_arithmetic_float64_past_one_tile(K, monkeypatch):
    """A float64 target makes the TopK loss's arithmetic float64 however many latents a row has: with
    float32 weights and values (exact in float64) the loss and the target's gradient match the
    float64 reference to float64's tolerance (the other gradients come back in float32), on the
    one-tile path (K = 3) and past one tile (K = 9: the residual from blocks of latents, then the
    row dot products)."""
    from sparsefuse.sae import kernels

    monkeypatch.setattr(kernels, "_MAX_BLOCK_K", 4)
    monkeypatch.setattr(kernels, "_DECODE_TILE_MAX_K", 4)
    idx, weight, vals, bias, target = make(3, K, 7, 33, torch.float32)
    target = make(3, K, 7, 33, torch.float64, seed=1)[4]  # detail below float32's resolution
    leaves = [t.clone().requires_grad_() for t in (weight, vals, bias, target)]
    got = [sparsefuse.topk_sae_loss(idx, *leaves)]
    got += torch.autograd.grad(got[0], leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = [ref.topk_sae_loss(idx, *ref_leaves)]
    want += torch.autograd.grad(want[0], ref_leaves)
    assert got[0].dtype == torch.float64
    for name, a, b in zip(["loss", "grad_weight", "grad_vals", "grad_bias", "grad_target"], got, want):
        assert_close(a, b, torch.float64 if name in ("loss", "grad_target") else torch.float32, name)


@pytest.mark.parametrize("K", [3, 9])
def test_row_dot_products_take_one_program_per_block_of_latents(K, monkeypatch):
    """sparse_linear's forward and the decode's vals gradient run a program per (row, block of at most
    _MAX_BLOCK_K latents): K = 9 with blocks of 4 is three programs a row, not one tile of 16 (at
    K = 9000 on a GPU, one tile of 16384 latents)."""
    from sparsefuse.sae import kernels

    monkeypatch.setattr(kernels, "_MAX_BLOCK_K", 4)
    launches = _spy_launches(monkeypatch)
    idx, weight, vals, bias, _ = make(5, K, 40, 37, torch.float64)
    sparsefuse.sparse_linear(weight[:5].clone(), weight, idx)
    v = vals.clone().requires_grad_()
    sparsefuse.sae_decode(idx, v, weight).sum().backward()
    grids = [grid for fn, grid in launches if fn is kernels._sae_row_dot_kernel]
    assert grids == [(5, -(-K // 4))] * 2


@pytest.mark.parametrize("weighted", [True, False])
def test_weight_grad_feature_sums(weighted):
    """The segmented sum behind every weight gradient, with its per-feature sum of entry weights
    (``wsum``); without entry weights each entry weighs 1, so ``wsum`` counts the feature's entries."""
    from sparsefuse.sae import kernels

    idx, _, vals, _, target = make(6, 4, 5, 7, torch.float64)
    got_wsum = torch.empty(5, dtype=torch.float64, device=DEVICE)
    got = kernels.weight_grad(idx, target, vals if weighted else None, 5, torch.float64, wsum=got_wsum)
    w = vals if weighted else torch.ones_like(vals)
    flat = idx.reshape(-1)
    want = torch.zeros(5, 7, dtype=torch.float64, device=DEVICE).index_add_(
        0, flat, w.reshape(-1, 1) * target.repeat_interleave(4, dim=0))
    want_wsum = torch.zeros(5, dtype=torch.float64, device=DEVICE).index_add_(0, flat, w.reshape(-1))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_wsum, want_wsum)


def test_weight_grad_sums_each_feature_in_entry_order():
    """The fixed order of the segmented sum is the documented one, a stable sort by feature: each
    feature's entries in entry order. Unweighted fp32 rows of very different magnitudes (the sum
    rounds differently in any other order), segments shorter than a chunk (the plain walk): a
    sequential sum in entry order must match bit for bit."""
    from sparsefuse.sae import kernels

    B, K, F, D = 16, 4, 3, 8
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, F, (B, K), generator=g)
    rows = torch.randn(B, D, generator=g) * torch.logspace(-4, 4, B)[torch.randperm(B, generator=g)][:, None]
    # no segment holds a whole chunk: every entry is walked, in order
    assert int(idx.reshape(-1).bincount().max()) < kernels.chunk_size(B * K, B)
    got = kernels.weight_grad(idx.to(DEVICE), rows.to(DEVICE), None, F, torch.float32)
    want = torch.zeros(F, D)
    for e, f in enumerate(idx.reshape(-1).tolist()):
        want[f] += rows[e // K]
    assert torch.equal(got.cpu(), want)


def _dense_codes(idx, vals, F):
    return torch.zeros(idx.shape[0], F, dtype=vals.dtype, device=vals.device).scatter_add(1, idx, vals)


DENSE = {  # the ops written with torch's own dense layers: a definition independent of the references
    "decode": lambda i, w, v, b, t: _dense_codes(i, v, w.shape[0]) @ w + b,
    "topk": lambda i, w, v, b, t: torch.nn.functional.mse_loss(_dense_codes(i, v, w.shape[0]) @ w + b, t),
    "hierarchical": lambda i, w, v, b, t: torch.stack([
        torch.nn.functional.mse_loss(_dense_codes(i[:, :k], v[:, :k], w.shape[0]) @ w + b, t)
        for k in range(1, i.shape[1] + 1)]).mean(),
}


@pytest.mark.parametrize("op", list(OPS))
def test_matches_dense_torch_formula(op):
    """The loss normalisation (1/(B*D), 1/(B*K*D)) and every gradient, against the ops written with
    torch.nn.functional.mse_loss over a dense reconstruction, which shares no code (and so no
    mistake) with reference.py."""
    idx, weight, vals, bias, target = make(6, 4, 9, 11, torch.float64)
    got = value_and_grads(OPS[op][0], idx, weight, vals, bias, target)
    want = value_and_grads(DENSE[op], idx, weight, vals, bias, target)
    for name, a, b in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, want):
        assert_close(a, b, torch.float64, f"{op} {name}")


def test_cpu_reference_path_of_decode_and_linear_without_interpreter():
    """Without TRITON_INTERPRET, CPU tensors take reference.py's split forward / backward functions;
    test_cpu_reference_path_without_interpreter checks the two losses there, this checks the decode
    and sparse_linear (x trainable and frozen) against the autograd of the plain references."""
    code = (
        "import torch, sparsefuse, sparsefuse._registry as r; assert not r.INTERPRET\n"
        "from sparsefuse.sae import reference as ref\n"
        "g = torch.Generator().manual_seed(0)\n"
        "B, K, F, D = 5, 3, 7, 6\n"
        "idx = torch.randint(0, F, (B, K), generator=g)\n"
        "rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)\n"
        "def grads(fn, args, frozen=()):\n"
        "    ps = [a.clone().requires_grad_(i not in frozen) for i, a in enumerate(args)]\n"
        "    out = fn(*ps)\n"
        "    return [out, *torch.autograd.grad(out, [p for p in ps if p.requires_grad], rnd(*out.shape))]\n"
        "def same(ours, theirs, args, frozen=()):\n"
        "    state = g.get_state()\n"
        "    a = grads(ours, args, frozen)\n"
        "    g.set_state(state)\n"
        "    for x, y in zip(a, grads(theirs, args, frozen), strict=True):\n"
        "        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)\n"
        "same(lambda v, w, b: sparsefuse.sae_decode(idx, v, w, b), lambda v, w, b: ref.sae_decode(idx, v, w, b),\n"
        "     (rnd(B, K), rnd(F, D), rnd(D)))\n"
        "for frozen in ((), (0,)):\n"
        "    same(lambda x, w, b, s: sparsefuse.sparse_linear(x, w, idx, b, s),\n"
        "         lambda x, w, b, s: ref.sparse_linear(x, w, idx, b, s),\n"
        "         (rnd(B, D), rnd(F, D), rnd(F), rnd(D)), frozen)\n"
        "# the promoted dtype, as the fake (and the kernels) give it, not the float32 it is computed in\n"
        "assert sparsefuse.sae_decode(idx, rnd(B, K).half(), rnd(F, D).half(), rnd(D).half()).dtype == torch.float16\n"
        "# CPU bf16 autocast does not reach the references' einsums (the decode was off by 2e-2); eager\n"
        "# (the fast path) and through the dispatcher (torch.library.opcheck's path: the registered op)\n"
        "v, w, t, x = (rnd(*s).float() for s in ((B, K), (F, D), (B, D), (B, D)))\n"
        "calls = [lambda: sparsefuse.sae_decode(idx, v, w, None), lambda: sparsefuse.topk_sae_loss(idx, w, v, None, t),\n"
        "         lambda: sparsefuse.sparse_linear(x, w, idx), lambda: torch.ops.sparsefuse.sae_decode(idx, v, w, None)]\n"
        "for call in calls:\n"
        "    want = call()\n"
        "    with torch.autocast('cpu', dtype=torch.bfloat16):\n"
        "        got = call()\n"
        "    assert got.dtype == want.dtype and torch.equal(got, want), (got - want).abs().max()\n"
        "# x - x_shift in promote(x, x_shift), as the kernels and the dense F.linear(x - x_shift) form it:\n"
        "# in float16 1000 - 0.3 rounds to 999.5 (the reference formed it in float32: 999.7)\n"
        "xh, sh = torch.tensor([[1000., 0.]]).half(), torch.tensor([0.3, 0.]).half()\n"
        "w = torch.eye(2, requires_grad=True)\n"
        "out = sparsefuse.sparse_linear(xh, w, torch.zeros(1, 1, dtype=torch.long), None, sh)\n"
        "(gw,) = torch.autograd.grad(out.sum(), [w])\n"
        "assert out.item() == 999.5 and gw[0].tolist() == [999.5, 0.0], (out, gw)\n"
        "print('ok')\n"
    )
    run_without_interpreter(code)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("row_per_entry", [False, True])
def test_weight_grad_long_segments(monkeypatch, weighted, row_per_entry):
    """Dense latents: features 1 and 6 in every row fill whole chunks of sorted entries (chunks of 4
    here), which the chunk kernel sums ahead and the per-feature walk adds as partial sums; the
    features around them start and end mid-chunk. Checked against index_add, twice bit for bit."""
    from sparsefuse import _segsum
    from sparsefuse.sae import kernels

    monkeypatch.setattr(_segsum, "MIN_CHUNK", 4)
    B, K, F, D = 23, 3, 9, 7
    idx, _, vals, _, target = make(B, K, F, D, torch.float64)
    idx[:, 0], idx[:, 1] = 1, 6
    rows = target.repeat_interleave(K, dim=0) if row_per_entry else target
    assert kernels.chunk_size(B * K, rows.shape[0]) == (4 if row_per_entry else 8)
    runs = []
    for _ in range(2):
        wsum = torch.empty(F, dtype=torch.float64, device=DEVICE)
        runs.append((kernels.weight_grad(idx, rows, vals if weighted else None, F, torch.float64, wsum=wsum,
                                         row_per_entry=row_per_entry), wsum))
    w = vals if weighted else torch.ones_like(vals)
    flat = idx.reshape(-1)
    want = torch.zeros(F, D, dtype=torch.float64, device=DEVICE).index_add_(
        0, flat, w.reshape(-1, 1) * target.repeat_interleave(K, dim=0))
    want_wsum = torch.zeros(F, dtype=torch.float64, device=DEVICE).index_add_(0, flat, w.reshape(-1))
    torch.testing.assert_close(runs[0][0], want)
    torch.testing.assert_close(runs[0][1], want_wsum)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_weight_grad_takes_whole_chunks_only_from_their_partial_sums(monkeypatch):
    """The per-feature walk must add a whole single-feature chunk through its partial sum, never entry
    by entry (the skew fix: a dense latent's walk would be the step's critical path again), and the
    chunk kernel must leave chunks that hold several features untouched. After the partial sums are
    taken, the rows of every entry in a whole chunk turn NaN: the result must still be index_add's
    over the original rows, and the mixed chunks' partial sums must still be the NaN torch.empty
    gives them here (conftest). Features 0 and F - 1 fill chunks from the first sorted entry and up
    to the last, so whole chunks at both ends of the entries are covered. One row per entry (the
    staged layout), so that poisoning an entry's row touches no other entry; the walk is the same
    device function for the [B, D] layout."""
    from sparsefuse import _segsum
    from sparsefuse.sae import kernels

    monkeypatch.setattr(_segsum, "MIN_CHUNK", 4)
    B, K, F, D = 16, 3, 9, 5
    idx, _, vals, _, target = make(B, K, F, D, torch.float64)
    idx[:, 0], idx[:, 2] = 0, F - 1  # 16 entries each: whole chunks at the start and the end
    idx[:, 1] = torch.arange(B, device=DEVICE) % (F - 2) + 1
    rows = target.repeat_interleave(K, dim=0)
    seen = []

    def partials_then_poison(sorted_keys, order, weights, rows_, row_div, chunk, *args):
        part, wpart = _segsum.chunk_partials(sorted_keys, order, weights, rows_, row_div, chunk, *args)
        keys = sorted_keys.reshape(-1)
        n_whole = keys.numel() // chunk
        single = [bool((keys[c * chunk:(c + 1) * chunk] == keys[c * chunk]).all()) for c in range(n_whole)]
        for c in range(n_whole):
            if single[c]:
                rows_[order.reshape(-1)[c * chunk:(c + 1) * chunk] // row_div] = float("nan")
            else:
                assert part[0, c].isnan().all(), f"chunk {c} holds several features but got a partial sum"
        seen.append(single)
        return part, wpart

    monkeypatch.setattr(kernels, "chunk_partials", partials_then_poison)
    got = kernels.weight_grad(idx, rows.clone(), vals, F, torch.float64, row_per_entry=True)
    assert seen and seen[0][0] and seen[0][-1] and not all(seen[0])  # whole chunks at both ends, and mixed ones
    want = torch.zeros(F, D, dtype=torch.float64, device=DEVICE).index_add_(
        0, idx.reshape(-1), vals.reshape(-1, 1) * target.repeat_interleave(K, dim=0))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("weighted", [True, False])
def test_weight_grad_leaves_out_zero_values(monkeypatch, weighted):
    """``skip``: entries whose value is 0 and whose gv parts are all finite leave the sorted entries
    (their key becomes F, which owns no segment), so rows padded at one index make no crowded
    feature. Half of every row is padded at feature 0, which one real entry uses too. The rows of
    the skipped entries are 1e300: the gradient must not see them, and the chunk kernel must leave
    the chunks they fill alone (their partial sums stay torch.empty's NaN). Entry (5, 3) is padding
    too, but one of its gv parts is infinite, as where its error row holds an inf: it stays, and
    feature 0 gets NaN in that column only (weighted: 0 * inf; unweighted rows are staged v * E,
    where that product is already NaN)."""
    from sparsefuse import _segsum
    from sparsefuse.sae import kernels

    monkeypatch.setattr(_segsum, "MIN_CHUNK", 4)
    B, K, F, D = 16, 4, 7, 5
    idx, _, vals, _, target = make(B, K, F, D, torch.float64)
    idx = idx % (F - 1) + 1
    idx[:, 2:], vals[:, 2:] = 0, 0.0
    idx[0, 0] = 0
    gv = torch.randn(2, B, K, dtype=torch.float64, device=DEVICE)
    gv[1, 5, 3] = float("inf")
    rows = target.repeat_interleave(K, dim=0).reshape(B, K, D).clone()
    kept = vals != 0
    kept[5, 3] = True
    rows[~kept] = 1e300
    rows[5, 3, 1] = float("inf") if weighted else float("nan")
    rows = rows.reshape(B * K, D)
    seg, order, sorted_keys = kernels.feature_segments(idx, F, (vals, gv))
    assert int(seg[F]) == int(kept.sum()) and (sorted_keys[int(seg[F]):] == F).all()
    seen = []

    def partials(sorted_keys_, order_, *args):
        part, wpart = _segsum.chunk_partials(sorted_keys_, order_, *args)
        chunk = args[3]
        for c in range(sorted_keys_.numel() // chunk):
            if int(sorted_keys_[c * chunk]) == F:
                seen.append(c)
                assert part[0, c].isnan().all(), f"chunk {c} holds only skipped entries but got a partial sum"
        return part, wpart

    monkeypatch.setattr(kernels, "chunk_partials", partials)
    w = vals if weighted else None
    got = kernels.weight_grad(idx, rows, w, F, torch.float64, row_per_entry=True, skip=(vals, gv))
    assert seen  # whole chunks of skipped entries exist
    flat = kept.reshape(-1)
    ew = (vals if weighted else torch.ones_like(vals)).reshape(-1, 1)
    want = torch.zeros(F, D, dtype=torch.float64, device=DEVICE).index_add_(
        0, idx.reshape(-1)[flat], ew[flat] * rows[flat])
    assert want[0].isnan().tolist() == [False, True, False, False, False]
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("parts", [1, 3])
def test_finish_launch_writes_the_segment_keys(index_dtype, parts):
    """The backward's finishing launch (``_finish_grads``) writes the weight gradient's sort keys
    while it sums gv's parts: its segments must be those of ``feature_segments`` with
    ``skip=(vals, gv)``, and its grad_vals / grad_bias those of the sums. Zero values with every gv
    part finite leave; zero values with an inf, -inf or NaN part stay; out-of-range ids (index
    checks off) clamp to -1 and F, in no feature's segment."""
    from sparsefuse.sae import kernels

    B, K, F, D = 37, 3, 5, 6
    g = torch.Generator(device=DEVICE).manual_seed(3)
    idx = torch.randint(0, F, (B, K), device=DEVICE, generator=g).to(index_dtype)
    idx[0, 0], idx[1, 1] = -3, F + 2
    vals = torch.randn(B, K, dtype=torch.float64, device=DEVICE, generator=g)
    vals[::2, 1:] = 0.0
    gv = torch.randn(parts, B, K, dtype=torch.float64, device=DEVICE, generator=g)
    for (b, k), bad in zip([(2, 1), (4, 2), (6, 1)], ["inf", "-inf", "nan"]):
        gv[parts - 1, b, k] = float(bad)
    colsum = torch.randn(D, dtype=torch.float64, device=DEVICE, generator=g)
    gc = torch.tensor(0.25, dtype=torch.float64, device=DEVICE)
    grad_vals, grad_bias, (seg, order, sorted_keys) = kernels._finish_grads(
        gv, colsum, gc, vals.float(), torch.float16, idx, F)
    want_seg, want_order, want_keys = kernels.feature_segments(idx, F, (vals, gv))
    assert sorted_keys.dtype == want_keys.dtype == torch.int32
    assert torch.equal(sorted_keys, want_keys) and torch.equal(order, want_order) and torch.equal(seg, want_seg)
    kept = (vals != 0) | ~torch.isfinite(gv).all(0)
    assert int(seg[F]) - int(seg[0]) == int((kept & (idx >= 0) & (idx < F)).sum())
    assert sorted_keys.min() == -1 and int(seg[F]) < B * K  # the clamped ids, and the skipped entries past F
    assert grad_vals.dtype == torch.float32 and grad_bias.dtype == torch.float16
    torch.testing.assert_close(grad_vals, (gv.sum(0) * 0.25).float(), equal_nan=True)
    torch.testing.assert_close(grad_bias, (colsum * 0.25).half())


@pytest.mark.parametrize("op", ["decode", "topk", "hierarchical"])
def test_dense_latents_match_fp64_reference(monkeypatch, op):
    """Every op whose weight gradient is a segmented sum (deterministic mode for Hierarchical), with
    one latent in every row: the long segment goes through the chunk partial sums."""
    from sparsefuse import _segsum

    monkeypatch.setattr(_segsum, "MIN_CHUNK", 4)
    idx, weight, vals, bias, target = make(19, 4, 11, 30, torch.float32)
    idx[:, 2] = 5
    fn = lambda *a: OPS[op][0](*a) if op != "hierarchical" else sparsefuse.hierarchical_sae_loss(  # noqa: E731
        *a, deterministic=True)
    check_against_fp64(op, idx, weight, vals, bias, target, torch.float32, fn=fn)


def test_reference_decode_returns_the_promoted_dtype():
    """The reference computes in promote_types(vals, weight), as the op returns (a bf16 vals must not
    round an fp32 decoder to bf16)."""
    idx, weight, vals, bias, _ = make(3, 2, 4, 5, torch.float32)
    out = ref.sae_decode(idx, vals.bfloat16(), weight, bias)
    assert out.dtype == sparsefuse.sae_decode(idx, vals.bfloat16(), weight, bias).dtype == torch.float32
    assert_close(out, ref.sae_decode(idx, vals.bfloat16().double(), weight.double(), bias.double()),
                 torch.float32, "reference decode")


@pytest.mark.parametrize("op", list(OPS))
def test_backward_twice_through_one_graph(op):
    """retain_graph: a second backward gives the same gradients (nothing saved is consumed).
    Hierarchical's default weight gradient sums with fp32 atomics, and with F = 4 the rows collide,
    so on a GPU its two passes may differ in the last bits; deterministic mode must repeat exactly."""
    idx, weight, vals, bias, target = make(3, 2, 4, 5, torch.float32)
    atomic = op == "hierarchical" and DEVICE == "cuda"
    for kw in ({}, {"deterministic": True}) if op == "hierarchical" else ({},):
        w = weight.clone().requires_grad_()
        out = OPS[op][0](idx, w, vals, bias, target, **kw).sum()
        g1 = torch.autograd.grad(out, [w], retain_graph=True)[0]
        g2 = torch.autograd.grad(out, [w])[0]
        if atomic and not kw:
            torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(g1, g2)


def test_grad_output_scaling():
    """The incoming gradient scales every parameter gradient (no host-side shortcut for 1.0)."""
    idx, weight, vals, bias, target = make(5, 3, 6, 9, torch.float64)
    for op in ("topk", "hierarchical"):
        p = [t.clone().requires_grad_() for t in (weight, vals, bias)]
        g1 = torch.autograd.grad(OPS[op][0](idx, p[0], p[1], p[2], target), p)
        g3 = torch.autograd.grad(OPS[op][0](idx, p[0], p[1], p[2], target) * -2.5, p)
        for a, b in zip(g1, g3):
            torch.testing.assert_close(b, -2.5 * a, rtol=1e-12, atol=1e-15)


# --- registration: opcheck, gradcheck, torch.compile ------------------------------------------


@pytest.mark.parametrize("op", ["sae_decode", "topk_sae_loss", "hierarchical_sae_loss"])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_opcheck(op, layout):
    idx, weight, vals, bias, target = make(3, 2, 4, 5, torch.float32)
    if layout == "column-major":  # the fake gradients must have the real (contiguous) strides
        weight = weight.t().contiguous().t()
    weight.requires_grad_()
    vals.requires_grad_()
    bias.requires_grad_()
    args = {
        "sae_decode": (idx, vals, weight, bias),
        "topk_sae_loss": (idx, weight, vals, bias, target),
        "hierarchical_sae_loss": (idx, weight, vals, bias, target, False),
    }[op]
    torch.library.opcheck(getattr(torch.ops.sparsefuse, op).default, args)


@pytest.mark.parametrize("op", ["sae_decode_bwd", "topk_sae_loss_bwd", "hierarchical_sae_loss_bwd",
                                "hierarchical_sae_loss_bwd-deterministic"])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_opcheck_backward_ops(op, layout):
    """The backward ops on their own (the forward's opcheck reaches them only through its AOT test):
    schema, fakes (contiguous gradients whatever the weight's layout) and AOT dispatch."""
    idx, weight, vals, bias, target = make(3, 2, 4, 5, torch.float32)
    if layout == "column-major":
        weight = weight.t().contiguous().t()
    ops, g = torch.ops.sparsefuse, torch.tensor(0.7, device=DEVICE)
    if op == "sae_decode_bwd":
        args = (torch.randn(3, 5, device=DEVICE), idx, vals, weight, True)
    elif op == "topk_sae_loss_bwd":
        _, resid, gv = ops.topk_sae_loss(idx, weight, vals, bias, target)
        args = (g, idx, vals, weight, resid, gv, True, bias.dtype)
    else:
        deterministic = op.endswith("deterministic")
        _, etot = ops.hierarchical_sae_loss(idx, weight, vals, bias, target, deterministic)
        args = (g, idx, weight, vals, bias, target, etot, True, deterministic)
    torch.library.opcheck(getattr(ops, op.split("-")[0]).default, args)


@pytest.mark.parametrize("need_weight,deterministic", [(True, True), (True, False), (False, False)],
                         ids=["staged", "buffer", "no-weight-grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_opcheck_hierarchical_fused_ops(need_weight, deterministic, dtype):
    """The fused forward's op and the op that finishes its gradients, in each of their layouts."""
    idx, weight, vals, bias, target = make(3, 2, 4, 5, dtype)
    args = (idx, weight.requires_grad_(need_weight), vals.requires_grad_(), bias, target, need_weight, deterministic)
    torch.library.opcheck(torch.ops.sparsefuse.hierarchical_sae_loss_grads.default, args)
    _, etot, gv, stage = torch.ops.sparsefuse.hierarchical_sae_loss_grads(*args)
    mode = 0 if not need_weight else 2 if deterministic else 1
    torch.library.opcheck(torch.ops.sparsefuse.hierarchical_sae_loss_finish.default,
                          (torch.tensor(0.5, device=DEVICE), idx, vals.detach(), etot, gv, stage, 4, dtype, dtype, mode))


@pytest.mark.parametrize("op", list(OPS) + ["hierarchical-fused"])
def test_gradcheck_fp64(op):
    idx, weight, vals, bias, target = make(3, 3, 4, 5, torch.float64)
    params = [t.clone().requires_grad_() for t in (weight, vals, bias)]
    fn = lambda w, v, b: (_hier_deterministic if op == "hierarchical-fused" else OPS[op][0])(idx, w, v, b, target)  # noqa: E731
    # On a GPU the default hierarchical backward scatters with atomics (F = 4 here, so rows collide):
    # its last bits may differ between two backward calls, as documented, and gradcheck's
    # reentrancy check gets that much slack. Everywhere else the results must repeat exactly.
    nondet_tol = 1e-12 if op == "hierarchical" and DEVICE == "cuda" else 0.0
    assert torch.autograd.gradcheck(fn, params, eps=1e-6, atol=1e-7, nondet_tol=nondet_tol)


@pytest.mark.parametrize("case", ["decode-promoted-dtype", "topk-gv-column-groups", "topk-gv-column-groups-B0"])
def test_opcheck_fakes_match_real_outputs(case):
    """The fake implementations must give the real outputs' shapes and dtypes where they depend on
    more than B, K and D: the decode's promoted dtype (float32 vals with a float64 decoder give a
    float64 result), and TopK's forward keeping one part of gv per column group (D = 300, K = 3:
    three groups of 128 columns), which the shapes above (D <= 8) never reach; an empty batch too,
    whose zero outputs launch nothing but keep those shapes."""
    from sparsefuse.sae import kernels

    if case == "decode-promoted-dtype":
        idx, weight, vals, bias, _ = make(3, 2, 4, 5, torch.float32)
        weight = weight.double().requires_grad_()
        args = (idx, vals.requires_grad_(), weight, bias.requires_grad_())
        assert torch.ops.sparsefuse.sae_decode(*args).dtype == torch.float64
        torch.library.opcheck(torch.ops.sparsefuse.sae_decode.default, args)
    else:
        idx, weight, vals, bias, target = make(0 if case.endswith("B0") else 2, 3, 4, 300, torch.float32)
        assert kernels.topk_gv_parts(3, 300, 4) == 3
        args = (idx, weight.requires_grad_(), vals.requires_grad_(), bias.requires_grad_(), target)
        torch.library.opcheck(torch.ops.sparsefuse.topk_sae_loss.default, args)


def _hier_deterministic(*args):
    return sparsefuse.hierarchical_sae_loss(*args, deterministic=True)


@pytest.mark.parametrize("op", list(OPS) + ["hierarchical-fused"])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_torch_compile_fullgraph_parity(op, layout):
    """hierarchical-fused: deterministic mode, whose forward also runs the backward's sweep."""
    idx, weight, vals, bias, target = make(5, 3, 6, 8, torch.float32)
    if layout == "column-major":
        weight = weight.t().contiguous().t()
    fn = _hier_deterministic if op == "hierarchical-fused" else OPS[op][0]

    def step(w, v, b):
        out = fn(idx, w, v, b, target)
        return out.square().sum() if out.dim() else out

    assert_compile_parity(step, (weight, vals, bias))


@pytest.mark.parametrize("op", list(OPS))
def test_batch_size_is_dynamic_under_compile(op):
    """B is a runtime value in the fake implementations too: with dynamic shapes, one compiled
    forward + backward serves every batch size (B = 1 and 0 aside, which PyTorch specialises)."""
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()

    def step(idx, w, v, b, t):
        out = OPS[op][0](idx, w, v, b, t)
        return out.square().sum() if out.dim() else out

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for B in (5, 7, 11):  # none equal to K, F or D, which would share B's symbol
        args = make(B, 3, 6, 8, torch.float32)
        got = value_and_grads(compiled, *args)
        want = value_and_grads(step, *args)
        for name, a, b in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{op} {name} at B = {B}")
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for three batch sizes"


# --- bad input -----------------------------------------------------------------------------


def _good():
    return make(4, 3, 6, 5, torch.float32)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(indices=a["indices"][0]), ValueError, r"indices must have 2 dimensions"),
        (lambda a: a.update(indices=a["indices"].float()), TypeError, r"indices has dtype float32"),
        (lambda a: a.update(indices=a["indices"][:, :0]), ValueError, r"K >= 1"),
        (lambda a: a.update(weight=a["weight"][:0]), ValueError, r"F >= 1"),
        (lambda a: a.update(weight=a["weight"].long()), TypeError, r"weight has dtype int64"),
        (lambda a: a.update(weight=a["weight"][None]), ValueError, r"weight must have 2 dimensions"),
        (lambda a: a.update(vals=a["vals"][:, :2]), ValueError, r"vals has shape \(4, 2\); expected \[4, 3\]"),
        (lambda a: a.update(bias=a["bias"][:3]), ValueError, r"bias has shape \(3,\); expected \[5\]"),
        (lambda a: a.update(target=a["target"][:2]), ValueError, r"target has shape \(2, 5\); expected \[4, 5\]"),
        (lambda a: a.update(target=a["target"].to("meta")), ValueError, r"target is on meta"),
        (lambda a: a.update(vals=a["vals"].to("meta")), ValueError, r"vals is on meta"),
        (lambda a: a.update(indices=a["indices"].to("meta")), ValueError, r"indices is on meta"),
        (lambda a: a.update(bias=a["bias"].to("meta")), ValueError, r"bias is on meta"),
        (lambda a: a.update(vals=None), TypeError, r"vals must be a tensor"),
        (lambda a: a.update(target=None), TypeError, r"target must be a tensor"),
        (lambda a: a["indices"].__setitem__((1, 2), 6), IndexError, r"indices holds 6, outside \[0, 6\)"),
        (lambda a: a["indices"].__setitem__((0, 0), -1), IndexError, r"indices holds -1, outside \[0, 6\)"),
        (lambda a: a.update(vals=a["vals"].long()), TypeError, r"vals has dtype int64"),
        (lambda a: a.update(bias=a["bias"].int()), TypeError, r"bias has dtype int32"),
        (lambda a: a.update(target=a["target"].long()), TypeError, r"target has dtype int64"),
    ],
    ids=["rank", "idx-dtype", "K0", "F0", "w-dtype", "w-rank", "vals-shape", "bias-shape", "target-shape",
         "device", "vals-device", "idx-device", "bias-device", "none", "target-none", "idx-high", "idx-negative",
         "vals-dtype", "bias-dtype", "target-dtype"],
)
@pytest.mark.parametrize("op", ["topk", "hierarchical"])
def test_bad_input_errors(op, mutate, exc, match):
    idx, weight, vals, bias, target = _good()
    sparsefuse.set_index_checks(True)  # on a GPU the range check is opt-in
    a = dict(indices=idx, weight=weight, vals=vals, bias=bias, target=target)
    mutate(a)
    try:
        with pytest.raises(exc, match=match):
            OPS[op][0](a["indices"], a["weight"], a["vals"], a["bias"], a["target"])
    finally:
        sparsefuse.set_index_checks(None)


def test_decode_float64_bias_gradient_summed_in_float64():
    """fp32 vals and weight with a float64 bias: the forward adds the bias in float64, and its gradient
    (the column sums of the fp32 incoming gradient) must be summed in float64 too; it was summed in
    float32 and cast (5e-8 relative error at B = 4096)."""
    g = torch.Generator().manual_seed(0)
    B, K, F, D = 512, 1, 2, 3
    idx = torch.zeros(B, K, dtype=torch.int64, device=DEVICE)
    vals, weight = (torch.rand(*s, generator=g).to(DEVICE) for s in ((B, K), (F, D)))
    bias = torch.zeros(D, dtype=torch.float64, device=DEVICE, requires_grad=True)
    grad = (torch.rand(B, D, generator=g) * 1e3 + torch.rand(B, D, generator=g)).to(DEVICE)
    (got,) = torch.autograd.grad(sparsefuse.sae_decode(idx, vals, weight, bias), [bias], grad)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, grad.double().sum(0), rtol=1e-14, atol=0)


def test_bad_input_decode():
    idx, weight, vals, bias, _ = _good()
    with pytest.raises(ValueError, match=r"vals has shape"):
        sparsefuse.sae_decode(idx, vals[:1], weight, bias)
    idx[0, 0] = 99
    if idx.device.type == "cpu":  # checked by default where it costs no sync
        with pytest.raises(IndexError, match=r"indices holds 99"):
            sparsefuse.sae_decode(idx, vals, weight, bias)


@pytest.mark.parametrize("D", [5, 16])
def test_topk_loss_with_an_infinite_value_matches_the_reference(D):
    """An infinite vals entry: the TopK forward's columns past D (a tile of 16 at D = 5) held 0 * inf =
    NaN, which entered the loss and the other latents' gv, so the loss read NaN where the formula
    (and the reference) gives inf. The padded columns are now left out of both sums."""
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 2, 1], [2, 3, 0]], device=DEVICE)
    weight = torch.randn(4, D, generator=g).to(DEVICE)
    vals = (torch.rand(2, 3, generator=g) + 0.5).to(DEVICE)
    vals[1, 2] = float("inf")
    target = torch.randn(2, D, generator=g).to(DEVICE)
    got = value_and_grads(sparsefuse.topk_sae_loss, idx, weight, vals, None, target)
    want = value_and_grads(ref.topk_sae_loss, idx, weight, vals, None, target)
    assert got[0] == float("inf")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("bad", ["huge", "F"])
@pytest.mark.parametrize("op", list(OPS) + ["hierarchical-fused"])
def test_unchecked_out_of_range_indices_poison_with_nan(op, bad):
    """With the host check off, a bad index never reads out of bounds; what depends on it is NaN.
    The bound is exclusive: index F (one past the last row) is as bad as 10^6. The weight is the
    first F rows of a larger buffer, so a kernel that let F through would read a finite row there."""
    idx, weight, vals, bias, target = _good()
    F = weight.shape[0]
    weight = torch.cat([weight, torch.ones_like(weight[:1])])[:F]  # row F exists in memory, finite
    idx[1, 1] = F if bad == "F" else 1_000_000
    fn = _hier_deterministic if op == "hierarchical-fused" else OPS[op.split("-")[0]][0]
    sparsefuse.set_index_checks(False)
    try:
        got = value_and_grads(fn, idx, weight, vals, bias, target)
    finally:
        sparsefuse.set_index_checks(None)
    assert torch.isnan(got[0][1] if op == "decode" else got[0]).all()
    assert torch.isnan(got[2][1, 1])


@pytest.mark.gpu
def test_gpu_index_checks_default_off_and_on_demand():
    """On CUDA the default skips the (syncing) range check and poisons with NaN; True checks."""
    idx, weight, vals, bias, target = _good()
    idx[1, 1] = 6
    assert torch.isnan(sparsefuse.topk_sae_loss(idx, weight, vals, bias, target))
    sparsefuse.set_index_checks(True)
    try:
        with pytest.raises(IndexError, match=r"indices holds 6, outside \[0, 6\)"):
            sparsefuse.topk_sae_loss(idx, weight, vals, bias, target)
    finally:
        sparsefuse.set_index_checks(None)


def test_compat_aliases():
    idx, weight, vals, bias, target = _good()
    assert torch.equal(compat.triton_topk_sae_loss(idx, weight, vals, bias, target),
                       sparsefuse.topk_sae_loss(idx, weight, vals, bias, target))
    assert torch.equal(compat.triton_hierarchical_sae_loss(idx, weight, vals, bias, target),
                       sparsefuse.hierarchical_sae_loss(idx, weight, vals, bias, target))
    # the README names them sparsefuse.compat.*: reachable after a plain `import sparsefuse`
    run_without_interpreter("import sparsefuse\nsparsefuse.compat.triton_topk_sae_loss\n"
                             "sparsefuse.compat.kd_loss_triton\nsparsefuse.compat.ema_update\nprint('ok')")


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("layout", ["strided", "expanded"])
def test_non_contiguous_bias(op, layout):
    """A bias with a stride other than 1: every other element of a wider tensor, or one value
    expanded (stride 0). The kernels index it with unit stride, so it is made contiguous first (it
    was read as laid out: wrong values, and reads past a stride-0 bias's one element)."""
    idx, weight, vals, bias, target = make(5, 3, 7, 9, torch.float32)
    b = torch.stack([bias, -bias], 1)[:, 0] if layout == "strided" else bias[:1].expand(bias.shape[0])
    w, v = weight.clone().requires_grad_(), vals.clone().requires_grad_()
    w64, v64 = weight.double().requires_grad_(), vals.double().requires_grad_()
    got = OPS[op][0](idx, w, v, b, target)
    want = OPS[op][1](idx, w64, v64, b.double().contiguous(), target.double())
    g_out = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    assert_close(got, want, torch.float32, "value")
    for name, a, e in zip(["weight", "vals"], torch.autograd.grad(got, [w, v], g_out.to(got.dtype)),
                          torch.autograd.grad(want, [w64, v64], g_out)):
        assert_close(a, e, torch.float32, f"grad_{name}")


def test_cpu_reference_path_checks_indices_and_takes_d0_without_interpreter():
    """Without TRITON_INTERPRET, CPU tensors take reference.py's split functions: they check the
    index range as the kernels' launchers do (a -1 wrapped onto row F - 1 there), and D = 0 gives
    zero gradients (a reshape(-1, 0) failed)."""
    code = (
        "import torch, sparsefuse, sparsefuse._registry as r; assert not r.INTERPRET\n"
        "B, K, F = 3, 2, 4\n"
        "idx = torch.tensor([[0, 1], [2, -1], [3, 0]])\n"
        "w, v, b, t = torch.randn(F, 5), torch.rand(B, K), torch.randn(5), torch.randn(B, 5)\n"
        "calls = [lambda: sparsefuse.sae_decode(idx, v, w, b), lambda: sparsefuse.topk_sae_loss(idx, w, v, b, t),\n"
        "         lambda: sparsefuse.hierarchical_sae_loss(idx, w, v, b, t),\n"
        "         lambda: sparsefuse.sparse_linear(t, w, idx, torch.randn(F), b)]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except IndexError as e:\n"
        "        assert 'indices holds -1, outside [0, 4)' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no IndexError')\n"
        "idx = idx.clamp_min(0)\n"
        "w0, b0, t0 = torch.randn(F, 0, requires_grad=True), torch.randn(0), torch.randn(B, 0)\n"
        "v0 = v.clone().requires_grad_()\n"
        "for fn in (sparsefuse.topk_sae_loss, sparsefuse.hierarchical_sae_loss):\n"
        "    gw, gv = torch.autograd.grad(fn(idx, w0, v0, b0, t0), [w0, v0])\n"
        "    assert gw.shape == (F, 0) and not gv.any()\n"
        "out = sparsefuse.sae_decode(idx, v0, w0, b0)\n"
        "gw, gv = torch.autograd.grad(out.sum(), [w0, v0])\n"
        "assert gw.shape == (F, 0) and not gv.any()\n"
        "x0 = torch.randn(B, 0, requires_grad=True)\n"
        "gx, gw = torch.autograd.grad(sparsefuse.sparse_linear(x0, w0, idx).sum(), [x0, w0])\n"
        "assert gx.shape == (B, 0) and gw.shape == (F, 0)\n"
        "print('ok')\n"
    )
    run_without_interpreter(code)


def test_cpu_reference_path_without_interpreter():
    """Without TRITON_INTERPRET, CPU tensors take the exact PyTorch reference implementation."""
    code = (
        "import torch, sparsefuse, sparsefuse._registry as r; assert not r.INTERPRET\n"
        "from sparsefuse.bench.sae import check\n"
        "assert check()\n"
        "print('ok')\n"
    )
    run_without_interpreter(code)


def test_cpu_reference_path_poisons_unchecked_bad_indices():
    """Without TRITON_INTERPRET and with index checks off, the ops' PyTorch implementations treat an
    index outside [0, F) as the kernels do: NaN outputs and nothing added to the weight gradient.
    Index -1 used to wrap onto row F - 1 (a plausible loss) and F or 10^6 raised PyTorch's own error."""
    code = (
        "import torch, sparsefuse, sparsefuse._registry as r; assert not r.INTERPRET\n"
        "g = torch.Generator().manual_seed(0)\n"
        "B, K, F, D = 4, 3, 6, 5\n"
        "rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)\n"
        "idx0 = torch.randint(0, F - 1, (B, K), generator=g)  # row F - 1 is used by no entry\n"
        "sparsefuse.set_index_checks(False)\n"
        "for bad in (-1, F, 10**6):\n"
        "    idx = idx0.clone()\n"
        "    idx[1, 1] = bad\n"
        "    w, v, b, t = (x.requires_grad_() for x in (rnd(F, D), rnd(B, K), rnd(D), rnd(B, D)))\n"
        "    for name, out in (('decode', sparsefuse.sae_decode(idx, v, w, b)[1].sum()),\n"
        "                      ('topk', sparsefuse.topk_sae_loss(idx, w, v, b, t)),\n"
        "                      ('hierarchical', sparsefuse.hierarchical_sae_loss(idx, w, v, b, t)),\n"
        "                      ('linear', sparsefuse.sparse_linear(t, w, idx)[1, 1])):\n"
        "        assert torch.isnan(out), (name, bad)\n"
        "        gw, gv = torch.autograd.grad(out, [w, v] if name != 'linear' else [w, t])\n"
        "        assert torch.equal(gw[F - 1], torch.zeros(D, dtype=gw.dtype)), (name, bad, gw[F - 1])\n"
        "        assert torch.isnan(gv[1, 1] if name != 'linear' else gv[1]).all(), (name, bad)\n"
        "print('ok')\n"
    )
    run_without_interpreter(code)


def test_cpu_reference_path_sparse_linear_bias_with_unchecked_bad_indices():
    """Without TRITON_INTERPRET and with index checks off, sparse_linear's PyTorch implementation
    treats a bad index in the per-feature bias as the kernels do: its output is NaN and its entry
    adds nothing to the bias gradient. Plain indexing of the bias wrapped -1 onto feature F - 1 (a
    wrong bias gradient there) and raised PyTorch's own error for F and 10^6."""
    code = (
        "import torch, sparsefuse, sparsefuse._registry as r; assert not r.INTERPRET\n"
        "g = torch.Generator().manual_seed(0)\n"
        "B, K, F, D = 4, 3, 6, 5\n"
        "rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)\n"
        "idx0 = torch.randint(0, F - 1, (B, K), generator=g)  # feature F - 1 is used by no entry\n"
        "sparsefuse.set_index_checks(False)\n"
        "for bad in (-1, F, 10**6):\n"
        "    idx = idx0.clone()\n"
        "    idx[1, 1] = bad\n"
        "    x, w, b = (t.requires_grad_() for t in (rnd(B, D), rnd(F, D), rnd(F)))\n"
        "    out = sparsefuse.sparse_linear(x, w, idx, b)\n"
        "    keep = torch.ones(B, K, dtype=torch.bool)\n"
        "    keep[1, 1] = False\n"
        "    assert torch.isnan(out[1, 1]) and torch.isfinite(out[keep]).all(), (bad, out)\n"
        "    gb, = torch.autograd.grad(out[keep].sum(), [b])\n"
        "    want = torch.zeros(F, dtype=torch.float64).index_add_(0, idx[keep], torch.ones(int(keep.sum()), dtype=torch.float64))\n"
        "    assert torch.equal(gb, want), (bad, gb, want)\n"
        "print('ok')\n"
    )
    run_without_interpreter(code)


def test_bench_cli_without_gpu_runs_correctness_check():
    if torch.cuda.is_available():
        pytest.skip("the CLI times kernels when a GPU is present")
    out = subprocess.run([sys.executable, "-m", "sparsefuse", "bench", "sae"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "No CUDA GPU found" in out.stdout and "all checks passed" in out.stdout


# --- GPU tier ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,K,F,D", [
    pytest.param(512, 128, 65536, 2304, id="B512-K128-F65536-D2304"),
    pytest.param(37, 50, 5, 100, id="B37-K50-F5-D100"),
    pytest.param(1000, 3, 1000, 1, id="B1000-K3-F1000-D1"),
    pytest.param(333, 64, 4099, 777, id="B333-K64-F4099-D777"),
    pytest.param(64, 1000, 5000, 300, id="B64-K1000-F5000-D300"),
    # past _DECODE_TILE_MAX_K (decode blocks) and _MAX_BLOCK_K (row-dot blocks): one tile for all of a
    # row's latents asked for 64 warps from K = 8193
    pytest.param(5, 9000, 20000, 40, id="B5-K9000-F20000-D40"),
])
def test_gpu_matches_fp64_reference(op, dtype, B, K, F, D):
    check_against_fp64(op, *make(B, K, F, D, dtype), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("op", list(OPS))
def test_gpu_more_than_2_31_weight_elements(op, layout, dtype):
    """F * D > 2^31: row offsets, and for a column-major weight (a transposed view) column offsets,
    must be 64-bit. Compared on the touched rows only (the fp64 reference of the full dictionary
    would not fit comfortably). fp32 takes the hierarchical loss through the atomic scatter into
    the F x D gradient; bf16 (B*K <= 2F here) through the staged rows."""
    F, D, B, K = 1_100_000, 2000, 64, 32
    assert F * D > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(F - 5000, F, (B, K), device="cuda", generator=g)
    idx[:, 0] = torch.arange(B, device="cuda")  # also some rows near the start
    if layout == "row-major":
        weight = torch.randn(F, D, device="cuda", dtype=dtype, generator=g)
    else:
        weight = torch.randn(D, F, device="cuda", dtype=dtype, generator=g).t()
        assert weight.stride() == (1, F) and (D - 1) * F > 2**31
    vals = torch.rand(B, K, device="cuda", generator=g).to(dtype)
    bias = torch.randn(D, device="cuda", generator=g).to(dtype)
    target = torch.randn(B, D, device="cuda", generator=g).to(dtype)
    got = value_and_grads(OPS[op][0], idx, weight, vals, bias, target)
    uniq, inv = torch.unique(idx, return_inverse=True)
    want = value_and_grads(OPS[op][1], inv, weight[uniq].double(), vals.double(), bias.double(), target.double())
    assert_close(got[0], want[0], dtype, "value")
    assert_close(got[1][uniq], want[1], dtype, "grad_weight (touched rows)")
    untouched = torch.ones(F, dtype=torch.bool, device="cuda")
    untouched[uniq] = False
    assert not got[1][untouched].any()
    assert_close(got[2], want[2], dtype, "grad_vals")
    assert_close(got[3], want[3], dtype, "grad_bias")


_BD = 2**31 // 64 + 4099  # rows of 64 columns: B * D > 2^31
_BKD = 2**31 // (16 * 64) + 4099  # rows of 16 latents and 64 columns: B * K * D > 2^31 staged elements


@pytest.mark.gpu
@pytest.mark.parametrize("op,dtype,deterministic,B,K", [
    pytest.param("decode", torch.float32, False, _BD, 2, id="decode-fp32-BD"),
    pytest.param("topk", torch.float32, False, _BD, 2, id="topk-fp32-BD"),
    pytest.param("hierarchical", torch.float32, False, _BD, 2, id="hierarchical-fp32-BD"),
    pytest.param("hierarchical", torch.bfloat16, False, _BD, 2, id="hierarchical-bf16-BD"),
    pytest.param("hierarchical", torch.float32, True, _BKD, 16, id="hierarchical-fp32-deterministic-BKD"),
])
def test_gpu_more_than_2_31_batch_elements(op, dtype, deterministic, B, K):
    """B * D > 2^31 (the target, the residual, E_0, the decode's output and its incoming gradient), and
    for the deterministic hierarchical loss B * K * D > 2^31 staged gradient rows: every row offset
    must be 64-bit. The float64 reference runs a chunk of rows at a time; the chunk that holds the
    last rows (offsets past 2^31) is compared on its own too, so a wrapped offset cannot hide in a
    norm over all rows."""
    F, D, chunk = 65536, 64, 1 << 20
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, F, (B, K), device="cuda", generator=g, dtype=torch.int32)
    weight = torch.randn(F, D, device="cuda", generator=g).to(dtype).requires_grad_()
    vals = torch.rand(B, K, device="cuda", generator=g).sort(dim=1, descending=True).values.to(dtype).requires_grad_()
    bias = torch.randn(D, device="cuda", generator=g).to(dtype).requires_grad_()
    target = None if op == "decode" else torch.randn(B, D, device="cuda", generator=g).to(dtype)
    grad_out = torch.randn(B, D, device="cuda", generator=g) if op == "decode" else None
    kw = {"deterministic": True} if deterministic else {}
    if op == "decode":
        out = sparsefuse.sae_decode(idx, vals, weight, bias)
    else:
        out = OPS[op][0](idx, weight, vals, bias, target, **kw)
    got = [out.detach(), *torch.autograd.grad(out, (weight, vals, bias), grad_out)]
    del out

    w64, b64 = weight.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    loss64, gvals64 = 0.0, torch.empty(B, K, device="cuda", dtype=torch.float64)
    for s in range(0, B, chunk):
        e = min(s + chunk, B)
        v64 = vals.detach()[s:e].double().requires_grad_()
        if op == "decode":
            o64 = ref.sae_decode(idx[s:e], v64, w64, b64)
            assert_close(got[0][s:e], o64, dtype, f"decode rows {s}..{e}")
            o64.backward(grad_out[s:e].double())
        else:  # each chunk's mean, weighted by its share of the rows
            o64 = OPS[op][1](idx[s:e], w64, v64, b64, target[s:e].double()) * ((e - s) / B)
            o64.backward()
            loss64 += o64.detach()
        gvals64[s:e] = v64.grad
    tail = slice(B - chunk, B)
    assert_close(got[2][tail], gvals64[tail], dtype, "grad_vals (last rows)")
    if op != "decode":
        assert_close(got[0], loss64, dtype, "value")
    assert_close(got[1], w64.grad, dtype, "grad_weight")
    assert_close(got[2], gvals64, dtype, "grad_vals")
    assert_close(got[3], b64.grad, dtype, "grad_bias")


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_deterministic_bit_identical(op, dtype):
    args = make(2048, 64, 8192, 512, dtype)
    kw = {} if op == "decode" else {"deterministic": True}
    a = value_and_grads(lambda *x: OPS[op][0](*x, **kw), *args)
    b = value_and_grads(lambda *x: OPS[op][0](*x, **kw), *args)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    check_against_fp64(op, *args, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_cuda_graph_capture_of_forward_and_backward(op, dtype):
    """A forward + backward captures into one CUDA graph (capture fails on any host sync), and
    replays on new inputs copied into the captured ones give what an eager step gives on them: the
    float64 reference within tolerance, and bit for bit where the op is deterministic by default
    (the hierarchical loss scatters with atomics). bf16 takes the hierarchical loss through its
    fused forward and staged rows (B * K <= 2F here), fp32 through the atomic scatter."""
    B, K, F, D = 256, 32, 4096, 384
    static = list(make(B, K, F, D, dtype))  # idx, weight, vals, bias, target
    params = [static[i].requires_grad_() for i in (1, 2, 3)]
    grad_out = None
    if op == "decode":  # the incoming gradient value_and_grads gives a non-scalar output
        grad_out = torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grad_out = grad_out.to(device="cuda", dtype=dtype)

    def step():
        out = OPS[op][0](*static)
        out.backward(grad_out)
        return out.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None  # the captured backward allocates the grads in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (1, 2):
        new = make(B, K, F, D, dtype, seed=seed)
        with torch.no_grad():
            for dst, src in zip(static, new):
                dst.copy_(src)
        graph.replay()
        got = [out, *(p.grad for p in params)]
        eager = value_and_grads(OPS[op][0], *new)
        want = value_and_grads(OPS[op][1], new[0], *(t.double() for t in new[1:]))
        for name, a, b, c in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, eager, want):
            assert_close(a, c, dtype, f"{op} {name} (replay {seed})")
            if op != "hierarchical":
                assert torch.equal(a, b), f"{op} {name}: the replay differs from an eager step"


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_no_kernel_compiles_per_batch_size(op, dtype):
    """B reaches every kernel as a runtime integer: after one step at B = 345, steps at other batch
    sizes compile nothing. The launcher caches a compiled kernel per Triton specialisation, so its
    cache would grow if B (or B * K, B * D) were a constexpr. Triton also specialises an integer on
    being 1 or a multiple of 16: the sizes are odd with D = 100 and B * K > 1024 (no count of
    1024-entry blocks is 1), so no B-derived integer crosses those. F is large enough that bf16's
    hierarchical path stays the same (staged rows) at every B."""
    from sparsefuse import _launch

    if not _launch.FAST:
        pytest.skip("SPARSEFUSE_FAST_LAUNCH=0: launches bypass the launcher's cache")
    K, F, D = 3, 4096, 100
    value_and_grads(OPS[op][0], *make(345, K, F, D, dtype))
    compiled = len(_launch._CACHE)
    for B in (347, 349, 1001, 2001):
        value_and_grads(OPS[op][0], *make(B, K, F, D, dtype))
    assert len(_launch._CACHE) == compiled, f"{len(_launch._CACHE) - compiled} kernels compiled for new batch sizes"


def test_tolerance_table_covers_every_dtype():
    assert set(TOL) == {torch.float16, torch.bfloat16, torch.float32, torch.float64}


# --- a target that requires grad --------------------------------------------------------------

LOSSES = {"topk": sparsefuse.topk_sae_loss, "hierarchical": sparsefuse.hierarchical_sae_loss,
          "hierarchical-fused": _hier_deterministic}


@pytest.mark.parametrize("op", list(LOSSES))
@pytest.mark.parametrize("others", [True, False], ids=["with-params", "target-only"])
@pytest.mark.parametrize("wdtype,tdtype", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                           (torch.float32, torch.float16)])
@pytest.mark.parametrize("B,K,F,D", [pytest.param(3, 3, 5, 100, id="B3-K3-F5-D100"),
                                     pytest.param(37, 50, 5, 7, id="B37-K50-F5-D7"),
                                     pytest.param(0, 3, 5, 7, id="B0")])
def test_target_gradient_matches_fp64_reference(op, others, wdtype, tdtype, B, K, F, D):
    """The target used to get no gradient even when it required one (a silent zero, where
    F.mse_loss gives -2/n * g * r). Both losses now return it, in the target's dtype, with the
    parameters' gradients as before."""
    _check_target_gradient(op, others, wdtype, tdtype, B, K, F, D, expect_fused=True)


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(LOSSES))
@pytest.mark.parametrize("others", [True, False], ids=["with-params", "target-only"])
@pytest.mark.parametrize("wdtype,tdtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.bfloat16)])
def test_gpu_target_gradient_matches_fp64_reference(op, others, wdtype, tdtype):
    """Deterministic bf16 takes the staged rows over two column chunks here, not the fused forward."""
    _check_target_gradient(op, others, wdtype, tdtype, 333, 64, 4099, 777, expect_fused=wdtype != torch.bfloat16)


def _check_target_gradient(op, others, wdtype, tdtype, B, K, F, D, expect_fused):
    idx, weight, vals, bias, target = make(B, K, F, D, wdtype)
    target = target.to(tdtype)
    fn = LOSSES[op]
    if op == "hierarchical-fused" and others and expect_fused:  # the forward that also runs the backward's sweep
        assert sparsefuse.sae.ops._fuse_hierarchical(idx, weight.requires_grad_(), vals, bias, target, True)
        weight = weight.detach()
    g = torch.tensor(1.7, dtype=torch.float64, device=DEVICE)  # an incoming gradient other than 1
    leaves = [t.clone().requires_grad_() for t in ((weight, vals, bias, target) if others else (target,))]
    args = dict(zip(("weight", "vals", "bias", "target") if others else ("target",), leaves))
    call = dict(weight=weight, vals=vals, bias=bias, target=target) | args
    got = torch.autograd.grad(fn(idx, call["weight"], call["vals"], call["bias"], call["target"]) * g, leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_call = {k: v.double() for k, v in dict(weight=weight, vals=vals, bias=bias, target=target).items()}
    ref_call |= dict(zip(args, ref_leaves))
    refn = OPS[op.split("-")[0]][1]
    want = torch.autograd.grad(refn(idx, ref_call["weight"], ref_call["vals"], ref_call["bias"], ref_call["target"]) * g,
                               ref_leaves)
    for name, a, b, leaf in zip(args, got, want, leaves):
        assert a.dtype == leaf.dtype, name
        assert_close(a, b, tdtype if name == "target" else wdtype, f"{op} grad_{name}")
    if B:
        assert got[list(args).index("target")].abs().sum() > 0


@pytest.mark.parametrize("op", list(LOSSES))
def test_gradcheck_fp64_with_target(op):
    idx, weight, vals, bias, target = make(3, 3, 4, 5, torch.float64)
    params = [t.clone().requires_grad_() for t in (weight, vals, bias, target)]
    fn = lambda w, v, b, t: LOSSES[op](idx, w, v, b, t)  # noqa: E731
    nondet_tol = 1e-12 if op == "hierarchical" and DEVICE == "cuda" else 0.0  # as in test_gradcheck_fp64
    assert torch.autograd.gradcheck(fn, params, eps=1e-6, atol=1e-7, nondet_tol=nondet_tol)


@pytest.mark.parametrize("op", list(LOSSES))
def test_torch_compile_fullgraph_parity_with_target(op):
    idx, weight, vals, bias, target = make(5, 3, 6, 8, torch.float32)
    assert_compile_parity(lambda w, v, b, t: LOSSES[op](idx, w, v, b, t), (weight, vals, bias, target))


# Rare paths of the weight gradient's segmented sums that the session 52 mutation pass found untested
# (benchmarks/logs/mutation_session52_sae_kernels.md).


def _finite_close(got, want, dtype, what):
    """Which entries are finite must agree (a +-inf of the reference may be NaN in ours, as in
    test_zero_value_in_a_non_finite_row); the finite ones within dtype's tolerance."""
    for name, a, b in zip(["value", "grad_weight", "grad_vals", "grad_bias"], got, want):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"{what} {name}: non-finite entries differ"
        assert_close(a[finite], b[finite], dtype, f"{what} {name}")


SEGMENTED_LOSSES = {
    "topk": (sparsefuse.topk_sae_loss, ref.topk_sae_loss),
    "hierarchical-fused-deterministic": (_hier_deterministic, ref.hierarchical_sae_loss),
    "hierarchical-two-pass-deterministic": (lambda *a: _two_pass_hierarchical(*a, deterministic=True),
                                            ref.hierarchical_sae_loss),
}


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


@pytest.mark.parametrize("name", list(SEGMENTED_LOSSES))
def test_strided_vals_with_zero_values(name):
    """vals as a transposed view (the loss saves vals as given for its backward), rows padded with
    zero values in their last slot. The zero test must read each entry's own value: read through
    the storage's order, the padding of one slot falls on entries of other slots, whose gradient
    rows would be left out."""
    B, K, F, D = 5, 3, 7, 6
    idx, weight, vals, bias, target = make(B, K, F, D, torch.float64)
    vals[:, K - 1] = 0.0
    vals_t = vals.t().contiguous().t()
    assert not vals_t.is_contiguous() and torch.equal(vals_t, vals)
    got = value_and_grads(SEGMENTED_LOSSES[name][0], idx, weight, vals_t, bias, target)
    want = value_and_grads(SEGMENTED_LOSSES[name][1], idx, weight, vals, bias, target)
    _finite_close(got, want, torch.float64, name)


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
    idx, weight, vals, bias, target = make(B, K, F, D, torch.float32)
    idx[idx == F - 1] = 0
    idx[1, 2], vals[1, 2] = F - 1, 0.0
    target[1, 70] = float("inf")
    fn = lambda *a: sparsefuse.hierarchical_sae_loss(*a, deterministic=True)  # noqa: E731
    got = value_and_grads(fn, idx, weight, vals, bias, target)
    want = value_and_grads(ref.hierarchical_sae_loss, idx, *(t.double() for t in (weight, vals, bias, target)))
    assert torch.isnan(got[1][F - 1, 70]) and (got[1][F - 1, :70] == 0).all()
    _finite_close(got, want, torch.float32, "mode 3 in two chunks")


@pytest.mark.parametrize("name", ["topk", "hierarchical-fused-deterministic", "hierarchical-two-pass-deterministic"])
def test_every_segmented_weight_gradient_leaves_out_the_padding(monkeypatch, name):
    """Rows padded with zero values at index 0 (README, "Rows with fewer active latents"): every
    backward whose weight gradient is a segmented sum must hand it sort keys with the padding moved
    to key F, which owns no segment, so that feature 0 does not get B * pad entries to walk (12x
    the unpadded step on an H200 before the skip). The values cannot show this (a padded entry adds
    +0), so the keys the sum receives are checked: the TopK backward and the fused Hierarchical
    one write them in their finishing launch, the two-pass Hierarchical backward in its own pass."""
    B, K, pad, F, D = 6, 3, 4, 7, 5
    idx, weight, vals, bias, target = make(B, K + pad, F, D, torch.float64)
    idx[:, K:], vals[:, K:] = 0, 0.0
    seen = []
    real = kernels.chunk_partials

    def spy(sorted_keys, *args):
        seen.append(sorted_keys.clone())
        return real(sorted_keys, *args)

    monkeypatch.setattr(kernels, "chunk_partials", spy)
    got = value_and_grads(SEGMENTED_LOSSES[name][0], idx, weight, vals, bias, target)
    want = value_and_grads(SEGMENTED_LOSSES[name][1], idx, weight, vals, bias, target)
    _finite_close(got, want, torch.float64, name)
    assert len(seen) == 1
    assert int((seen[0] == F).sum()) == B * pad and int((seen[0] == 0).sum()) == int((idx[:, :K] == 0).sum())


@pytest.mark.parametrize("name", ["decode", "hierarchical-two-pass-deterministic"])
def test_weight_gradient_of_more_entries_than_one_key_block(name):
    """B * K = 1050 entries: the sort keys of int64 indices are written by a pass of 1024-entry blocks
    (``_segment_keys_kernel``), so the entries past the first block need a second program."""
    B, K, F, D = 35, 30, 7, 3
    assert B * K > kernels._KEYS_BLOCK and B * K % kernels._KEYS_BLOCK
    idx, weight, vals, bias, target = make(B, K, F, D, torch.float64)
    if name == "decode":
        w = weight.clone().requires_grad_()
        grad = torch.randn(B, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
        (got,) = torch.autograd.grad(sparsefuse.sae_decode(idx, vals, w), w, grad)
        (want,) = torch.autograd.grad(ref.sae_decode(idx, vals, w), w, grad)
        assert_close(got, want, torch.float64, "decode grad_weight")
    else:
        got = value_and_grads(SEGMENTED_LOSSES[name][0], idx, weight, vals, bias, target)
        want = value_and_grads(SEGMENTED_LOSSES[name][1], idx, weight, vals, bias, target)
        _finite_close(got, want, torch.float64, name)


def test_two_pass_deterministic_backward_of_an_empty_batch():
    """B = 0 on the two-pass deterministic path (the registered op called as it is: the public
    function fuses this case): no gv exists to skip zero values with, and every gradient is zero."""
    idx, weight, vals, bias, target = make(0, 3, 5, 4, torch.float64)
    got = value_and_grads(lambda *a: _two_pass_hierarchical(*a, deterministic=True), idx, weight, vals, bias, target)
    assert got[0].item() == 0.0
    for g, p in zip(got[1:], (weight, vals, bias)):
        assert g.shape == p.shape and torch.equal(g, torch.zeros_like(g))
