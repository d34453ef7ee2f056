"""sparsefuse.topk: the row top-k kernel (block maxima, then two radix selections) against torch.topk.

CPU tier: the kernel under the interpreter (conftest), every block width on small rows.
GPU tier (-m gpu): the SAE encoder's sizes in every dtype.
"""

import pytest
import torch

import sparsefuse
from sparsefuse._registry import INTERPRET
from sparsefuse.sae import kernels

from helpers import DEVICE, assert_compile_parity


BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}  # same-width ints


def rows(N, F, dtype, *, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, F, generator=g).to(device=device, dtype=dtype)


def documented_order(x, k):
    """int64 [..., k]: the columns sparsefuse.topk's kernel documents for x, computed on the CPU by
    two stable sorts: every NaN (any sign bit) first, then values descending, +0.0 before -0.0, and
    equal keys by ascending column."""
    xd = x.detach().cpu()
    nan = xd.isnan()
    value = torch.where(nan, float("inf"), xd.double())  # NaN ties +inf here, and wins on the next key
    rank = torch.where(nan, 2, (~xd.signbit()).long())  # NaN 2, then +0.0 (1) above -0.0 (0)
    by_rank = rank.sort(dim=-1, descending=True, stable=True).indices
    by_value = value.gather(-1, by_rank).sort(dim=-1, descending=True, stable=True).indices
    return by_rank.gather(-1, by_value)[..., :k]


def kernel_runs(x, k):
    """Whether sparsefuse.topk(x, k) takes the kernel (whose order among equal keys is documented)
    rather than torch.topk (which leaves it open)."""
    return (x.dtype in kernels._TOPK_KEYS and kernels.row_topk_block(x.shape[-1], k) != 0
            and (x.is_cuda or INTERPRET))


def assert_topk(x, k, values, indices, exact=None):
    """The values are torch.topk's on the CPU (NaN in the same places), each an entry of x at its
    index, the columns of a row distinct, and equal values (bit for bit) in ascending column order.
    (The CPU's torch.topk ranks every NaN first; CUDA's did not always rank a sign-bit NaN first.)
    Where the kernel ran (``exact``, by default :func:`kernel_runs`) the columns are exactly
    :func:`documented_order`'s, which also fixes which of the entries tied at the k-th place are
    taken."""
    if exact is None:
        exact = kernel_runs(x, k)
    if exact:
        assert torch.equal(indices.cpu(), documented_order(x, k)), "columns differ from the documented order"
    want = x.cpu().topk(k, dim=-1, sorted=True).values
    assert values.dtype == x.dtype and indices.dtype == torch.int64
    assert values.shape == want.shape == indices.shape
    assert torch.equal(values.isnan().cpu(), want.isnan())
    assert torch.equal(values.nan_to_num(0.0).cpu(), want.nan_to_num(0.0)), "values differ from torch.topk's"
    assert torch.equal(x.gather(-1, indices).nan_to_num(0.0), values.nan_to_num(0.0))
    flat = indices.reshape(-1, k)
    assert (flat.sort(-1).values.diff(dim=-1) > 0).all(), "a column taken twice"
    bits = values.reshape(-1, k).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()])
    same = bits[:, 1:] == bits[:, :-1]  # the same float, bit for bit (+0 and -0 are two keys)
    assert (flat.diff(dim=-1)[same] > 0).all(), "equal values out of column order"


SHAPES = [(1, 1, 1), (3, 5, 5), (4, 37, 3), (2, 64, 1), (5, 300, 20), (3, 1000, 7), (2, 2000, 64)]  # (N, F, k)


@pytest.mark.parametrize("N,F,k", SHAPES, ids=[f"N{n}-F{f}-k{k}" for n, f, k in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["fp32", "bf16", "fp16", "fp64"])
def test_matches_torch_topk(N, F, k, dtype):
    x = rows(N, F, dtype)
    values, indices = sparsefuse.topk(x, k)
    assert_topk(x, k, values, indices)
    if dtype == torch.float32:  # distinct values: the same columns as torch.topk
        assert torch.equal(indices, x.topk(k).indices)


@pytest.mark.parametrize("F,k,dtype", [(1000, 7, torch.float32), (37, 3, torch.float32), (64, 16, torch.bfloat16),
                                     (257, 2, torch.float16)])
def test_every_block_width(F, k, dtype):
    """Each block width that leaves at least k blocks, from one column a block to the last that
    fits: ragged last blocks, empty padding blocks, candidates past F. Other widths are refused."""
    x = rows(3, F, dtype, seed=F)
    C = 1
    while -(-F // C) >= k:
        assert_topk(x, k, x.gather(-1, idx := kernels.row_topk(x, k, block=C)), idx, exact=True)
        C *= 2
    assert C >= 8  # at least three widths tried
    for bad in (C, 3):
        with pytest.raises(ValueError, match=f"block must be a power of two leaving at least k = {k} blocks"):
            kernels.row_topk(x, k, block=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_winners_crowded_into_one_block(dtype):
    """The winners crowded into a block or two, far from the other blocks' maxima: the k-th largest
    entry lies well above the k-th largest block maximum (the lower end of the second selection's
    range), in another binade or across the sign, with more than k candidates above the bits that
    range shares; and a row whose winners span +inf and NaN."""
    F, k = 256, 8
    x = rows(4, F, dtype, seed=3) * 0.1
    x[0, 40:52] = 100 + torch.arange(12.0)  # 12 candidates above the range's shared bits, for 8 places
    x[1] = -100 - x[1].abs()
    x[1, 200:212] = -1 - torch.arange(12.0)
    x[2] = -1 - x[2].abs()
    x[2, 96:108] = 1 + torch.arange(12.0)
    x[3, 16:20] = float("inf")
    x[3, 20:24] = float("nan")
    for C in (0, 4, 8):
        values = x.gather(-1, idx := kernels.row_topk(x, k, block=C))
        assert_topk(x, k, values, idx, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_neighbouring_floats(dtype):
    """Floats one ulp apart, of both signs and both parities of the last bit: the key must reverse
    every magnitude bit of a negative float, the lowest included."""
    g = torch.Generator().manual_seed(5)
    base = torch.tensor([-1.0, -3.5, 0.75, 2.0, -0.1], dtype=dtype).view(BITS[dtype]).long()
    x = (base[:, None] + torch.randint(-3, 4, (5, 64), generator=g)).to(BITS[dtype]).view(dtype).to(DEVICE)
    for k in (1, 3, 10):
        for C in (0, 1, 4):  # (0: the default width)
            idx = kernels.row_topk(x, k, block=C)
            assert_topk(x, k, x.gather(-1, idx), idx, exact=True)
    y = torch.tensor([[-1.0078125, -1.0, -3.0, -2.0]], dtype=torch.bfloat16, device=DEVICE)  # bits 0xBF81, 0xBF80
    assert kernels.row_topk(y, 1).tolist() == [[1]]


@pytest.mark.parametrize("step", [2, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_read_in_several_steps(monkeypatch, step, dtype):
    """The block maxima are read _TOPK_STEP entries a step, and the CPU tier's rows fit in one step:
    a smaller step makes several, and steps narrower than a block (the step is raised to C)."""
    monkeypatch.setattr(kernels, "_TOPK_STEP", step)
    x = rows(3, 120, dtype, seed=7)
    x[1, 100:] = 50.0  # the winners in the last steps only
    for k in (1, 5):
        for C in (1, 4, 16):
            idx = kernels.row_topk(x, k, block=C)
            assert_topk(x, k, x.gather(-1, idx), idx, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scratch_slots_written_exactly(monkeypatch, dtype):
    """Each row writes exactly slots [0, k) of its own row of the pick and pack scratch, and nothing
    past the last row (the output cannot show this: the interpreter runs rows one after another, so
    a row writing into the next row's slots, or one slot too many, is overwritten before it is
    read). The first rows hold more entries tied at the maximum than k, in fewer than k blocks, so
    the second selection's range must reach up to the row maximum itself."""
    launch, calls = kernels.launch, []

    def guarded(fn, grid, args, meta, num_warps, *rest):
        x, blk, pick, pack, out, F, stride, k = args
        N = x.shape[0]
        # the marker: the dtype's least value, which no block id and no packed (key, column) takes
        big = [torch.full((N + 1, t.shape[1]), torch.iinfo(t.dtype).min, dtype=t.dtype, device=t.device)
               for t in (blk, pick, pack)]
        launch(fn, grid, (x, *(b[:N] for b in big), out, F, stride, k), meta, num_warps, *rest)
        marked = [b == torch.iinfo(b.dtype).min for b in big]
        for name, m in zip(("blk", "pick", "pack"), marked):
            assert m[N].all(), f"{name}: written past the last row"
        for name, m in zip(("pick", "pack"), marked[1:]):
            assert m[:N, k:].all() and not m[:N, :k].any(), f"{name}: not exactly slots [0, k)"
        calls.append(k)

    monkeypatch.setattr(kernels, "launch", guarded)
    x = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.75, 0.0, 0.0, 0.0]] * 2, dtype=dtype, device=DEVICE)
    assert kernels.row_topk(x, 2, block=4).tolist() == [[0, 1], [0, 1]]
    y = torch.randint(-3, 3, (4, 500)).to(device=DEVICE, dtype=dtype)
    for k, C in ((1, 0), (3, 4), (40, 0), (250, 1)):
        idx = kernels.row_topk(y, k, block=C)
        assert_topk(y, k, y.gather(-1, idx), idx, exact=True)
    assert calls == [2, 1, 3, 40, 250]


def test_default_block_width():
    """Fewest block maxima plus candidates within the caps; 0 (torch.topk) where none fits."""
    assert kernels.row_topk_block(65536, 64) == 32
    assert kernels.row_topk_block(65536, 16) == 64
    assert kernels.row_topk_block(5, 5) == 1
    assert kernels.row_topk_block(100_000, 5000) == 0  # 8192 candidates at C = 1 need 100000 blocks
    assert kernels.row_topk_block(2**31, 4) == 0
    assert kernels.row_topk_block(65536, 512) == 16 and kernels.row_topk_block(65536, 513) == 0  # k past 512


def test_too_many_winners_takes_torch_topk(monkeypatch):
    monkeypatch.setattr(kernels, "_TOPK_MAX_CANDIDATES", 16)
    x = rows(3, 300, torch.float32)
    assert kernels.row_topk_block(300, 20) == 0
    assert_topk(x, 20, *sparsefuse.topk(x, 20))


SIGN_NAN = {torch.float32: -0x400000, torch.bfloat16: -0x40, torch.float16: -0x200}  # NaN bits with the sign set


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_ties_nan_inf_and_signed_zeros(dtype):
    x = torch.randint(-3, 3, (6, 500)).to(device=DEVICE, dtype=dtype)  # every value repeated
    x[0, 7] = float("nan")
    bits = BITS[dtype]
    x[0, 400] = torch.tensor(SIGN_NAN[dtype], dtype=bits).view(dtype)
    assert x[0, 400].isnan() and x[0, 400].view(bits) < 0
    x[1] = float("-inf")
    x[2, ::3] = float("inf")
    x[3, ::5] = float("nan")
    x[4] = 0.0
    x[4, ::2] = -0.0
    x[5, :] = -1.0
    x[5, 499] = float("nan")
    for k in (1, 40, 250, 500):
        values, indices = sparsefuse.topk(x, k)
        assert_topk(x, k, values, indices)
    values, _ = sparsefuse.topk(x, 2)
    assert values[0].isnan().all() and values[5, 0].isnan() and values[5, 1] == -1
    _, indices = sparsefuse.topk(x[4:5], 250)
    assert torch.equal(indices[0], torch.arange(1, 500, 2, device=DEVICE))  # the +0 columns, above the -0 ones


def test_integer_k_types():
    x = rows(2, 50, torch.float32)
    np = pytest.importorskip("numpy")
    for k in (np.int64(4), torch.tensor(4)):
        assert torch.equal(sparsefuse.topk(x, k)[0], x.topk(4).values)


def test_shapes_strides_and_empty():
    x = rows(6, 40, torch.float32)
    for t in (x.t().contiguous().t(), x[:, ::2], x.reshape(2, 3, 40), x[:0], x[:, :1]):
        k = min(3, t.shape[-1])
        values, indices = sparsefuse.topk(t, k)
        want = t.topk(k, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(indices, want.indices)
    values, indices = sparsefuse.topk(torch.randn(7, device=DEVICE), 2)  # one row
    assert values.shape == indices.shape == (2,)


def test_gradient_is_torch_topk_gradient():
    x = rows(4, 300, torch.float32).requires_grad_()
    g = torch.randn(4, 9, device=DEVICE)
    (got,) = torch.autograd.grad(sparsefuse.topk(x, 9)[0], x, g)
    (want,) = torch.autograd.grad(x.topk(9).values, x, g)
    assert torch.equal(got, want)


def test_opcheck():
    torch.library.opcheck(torch.ops.sparsefuse.row_topk.default, (rows(3, 100, torch.float32), 5))


def test_torch_compile_fullgraph_parity():
    x = rows(5, 200, torch.float32)
    assert_compile_parity(lambda x: sparsefuse.topk(x, 6)[0].square().sum(), (x,), atol=0)


@pytest.mark.parametrize(
    "x,k,exc,match",
    [
        (torch.zeros(3, 4, dtype=torch.int64), 2, TypeError, r"x has dtype int64"),
        (torch.tensor(1.0), 1, ValueError, r"at least one dimension"),
        (torch.zeros(3, 0), 1, ValueError, r"x must have at least one entry in its last dimension.*shape \(3, 0\)"),
        (torch.zeros(3, 4), 0, ValueError, r"k must be an integer in \[1, 4\].*got 0"),
        (torch.zeros(3, 4), 5, ValueError, r"k must be an integer in \[1, 4\].*got 5"),
        (torch.zeros(3, 4), 2.0, ValueError, r"got 2.0"),
        (torch.zeros(3, 4), True, ValueError, r"got True"),
        (torch.zeros(3, 4), torch.tensor(2.0), ValueError, r"got tensor\(2\.\)"),
        ("x", 1, TypeError, r"x must be a tensor, got str"),
    ],
    ids=["int-dtype", "0-dim", "empty-last-dim", "k0", "k-above-F", "k-float", "k-bool", "k-float-tensor", "not-tensor"],
)
def test_bad_input_errors(x, k, exc, match):
    with pytest.raises(exc, match=match):
        sparsefuse.topk(x.to(DEVICE) if isinstance(x, torch.Tensor) else x, k)


# --- GPU tier ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("F,k", [(65536, 32), (65536, 64), (65536, 128), (24577, 64), (131072, 256), (65536, 512),
                                 (512, 512), (65536, 1152)])
def test_gpu_encoder_sizes(dtype, F, k):
    """The SAE encoder's selection at real sizes; k = 1152 (AuxK's default at D = 2304) takes
    torch.topk. A few NaN (both signs) and -inf entries included."""
    x = torch.randn(512, F, device="cuda", dtype=torch.float32).relu().to(dtype)
    x[0, 5] = float("nan")
    if kernels.row_topk_block(F, k):  # (torch.topk itself, the fallback, may rank this NaN lower on CUDA)
        bits = BITS[dtype]
        x[2, 9] = torch.tensor(SIGN_NAN[dtype], dtype=bits).view(dtype)
    x[1, :100] = float("-inf")
    assert_topk(x, k, *sparsefuse.topk(x, k))


@pytest.mark.gpu
def test_gpu_every_warp_count():
    x = torch.randn(256, 65536, device="cuda")
    for w in (1, 2, 4, 8, 16):
        assert_topk(x, 64, x.gather(-1, idx := kernels.row_topk(x, 64, num_warps=w)), idx, exact=True)
