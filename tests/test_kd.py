"""Top-K distillation losses: topk_kd_loss, topk_kd_loss_from_logits, topk_kd_loss_from_hidden.

CPU tier: the Triton kernels under the interpreter (conftest), float32 and float64, small grids.
GPU tier (-m gpu): bfloat16 and float16, real vocabulary sizes, torch.compile.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import sparsefuse
from sparsefuse import compat
from sparsefuse.kd import reference as ref

from helpers import DEVICE, assert_close, need_gpu_memory

NORMS = ["topk", "full", "tail"]

# (N, K, V): K = 1; V and N not multiples of any block size; V = K (every token in the top-K).
SHAPES = [
    pytest.param(1, 1, 7, id="N1-K1-V7"),
    pytest.param(5, 3, 37, id="N5-K3-V37"),
    pytest.param(13, 6, 131, id="N13-K6-V131"),
    pytest.param(3, 5, 5, id="N3-K5-V5"),
]


def make(N, K, V, H=12, *, dtype=torch.float64, device=DEVICE, seed=0, dup=True, index_dtype=torch.int64):
    """Teacher slots with ~25 % masked (axolotl padding: id 0, log-prob -1e9), one fully masked token,
    a repeated id (``dup``; "tail" refuses one, so its tests pass dup=False), student logits / hidden
    states / LM head / labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)]) if K <= V else \
        torch.randint(0, V, (N, K), generator=g)
    t = torch.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64) * 2, -1) - 0.2
    m = torch.rand(N, K, generator=g) > 0.25
    m[:, 0] = True
    if N > 1:
        m[1] = False
    if dup and K > 1:
        ids[0, 1] = ids[0, 0]
    ids = torch.where(m, ids, torch.zeros_like(ids)).to(index_dtype)
    t = torch.where(m, t, torch.full_like(t, -1e9))
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.1
    labels = torch.randint(0, V, (N,), generator=g)
    labels[-1] = -100
    to = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return dict(ids=ids.to(device), t=to(t), m=m.to(device), z=to(z), h=to(h), w=to(w), b=to(b),
                labels=labels.to(device))


def grads(loss, params):
    return [loss] + list(torch.autograd.grad(loss, params))


def leaf(x):
    return x.detach().clone().requires_grad_()


def compare(got, want, dtype, names, scale=1.0):
    for a, b, n in zip(got, want, names):
        assert_close(a, b.to(a.dtype) if a.dtype != b.dtype and a.dim() == 0 else b, dtype, n, scale)


# --- values and gradients against the float64 reference ----------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,K,V", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_gathered(N, K, V, dtype, temperature):
    d = make(N, K, V, dtype=dtype)
    zk = leaf(d["z"].gather(1, d["ids"])[:, :K])
    got = grads(sparsefuse.topk_kd_loss(zk, d["t"], d["m"], temperature=temperature), [zk])
    z64 = leaf(zk.double())
    want = grads(ref.topk_kd_loss(z64, d["t"].double(), d["m"], temperature=temperature)[0], [z64])
    compare(got, want, dtype, ["loss", "grad"])


@pytest.mark.parametrize("normalize", NORMS)
@pytest.mark.parametrize("N,K,V", SHAPES)
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float64, 1.7)])
def test_from_logits(N, K, V, normalize, dtype, temperature):
    d = make(N, K, V, dtype=dtype, dup=normalize != "tail")
    z = leaf(d["z"])
    got = grads(sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize=normalize,
                                                    temperature=temperature), [z])
    z64 = leaf(d["z"].double())
    want = grads(ref.topk_kd_loss_from_logits(z64, d["ids"], d["t"].double(), d["m"], normalize=normalize,
                                              temperature=temperature)[0], [z64])
    compare(got, want, dtype, ["loss", "grad"])


@pytest.mark.parametrize("normalize", NORMS)
@pytest.mark.parametrize("ce_weight,bias,temperature", [(0.0, False, 1.0), (0.5, True, 1.0), (0.3, True, 2.0)])
@pytest.mark.parametrize("chunk_size", [4, None])
def test_from_hidden(normalize, ce_weight, bias, temperature, chunk_size):
    d = make(9, 4, 41, dtype=torch.float64, dup=normalize != "tail")
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"]) if bias else None
    params = [p for p in (h, w, b) if p is not None]
    kw = dict(normalize=normalize, temperature=temperature, lm_head_bias=b, labels=d["labels"], ce_weight=ce_weight)
    got = grads(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], chunk_size=chunk_size, **kw),
                params)
    want = grads(ref.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], **kw)[0], params)
    compare(got, want, torch.float64, ["loss", "grad_hidden", "grad_weight", "grad_bias"])


@pytest.mark.parametrize("N,K,V,H", [pytest.param(*p.values, 7, id=p.id) for p in SHAPES]
                         + [pytest.param(5, 4, 23, 300, id="N5-K4-V23-H300"),
                            pytest.param(5, 4, 23, 0, id="N5-K4-V23-H0")])
@pytest.mark.parametrize("normalize", NORMS)
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_from_hidden_shapes(N, K, V, H, normalize, ce_weight):
    """Through the fused LM head, loss and every gradient against float64: the odd shapes of the
    logits tests (N = 1 with K = 1, V = K, sizes off every block), and H = 300, which spans several
    H tiles (32 wide under the interpreter, 128 on a GPU; the other shapes fit one): the hidden
    kernels' loops over H, forward and backward ("topk" without cross-entropy takes the K-row
    gather kernel, the rest the vocabulary chunks). ("topk" at K = 1 has zero gradients: one slot
    normalised over itself.) H = 0: the logits are the bias alone (hidden.reshape(-1, 0) used to fail)."""
    d = make(N, K, V, H=H, dtype=torch.float64, dup=normalize != "tail")
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    labels = d["labels"].clone()
    labels[0] = V - 1  # make() ignores the last token's label: with N = 1 there would be none left
    kw = dict(normalize=normalize, temperature=1.5, lm_head_bias=b, labels=labels if ce_weight else None,
              ce_weight=ce_weight)
    got = grads(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], chunk_size=2, **kw), [h, w, b])
    want = grads(ref.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], **kw)[0], [h, w, b])
    compare(got, want, torch.float64, ["loss", "grad_hidden", "grad_weight", "grad_bias"])


@pytest.mark.parametrize("normalize", NORMS)
def test_rows_split_along_the_vocab(normalize):
    """Few rows and a long vocabulary: the backward splits each row over several programs along V
    (the interpreter's _ROW_MIN_PROGRAMS is 4, so N = 3 rows of V = 300 take two programs a row, and
    the hidden form's chunks of 2 and 1 rows two and three). The other CPU shapes run one program
    a row; the GPU tier's real vocabularies split."""
    from sparsefuse.kd import kernels as kd_kernels

    if sparsefuse._registry.INTERPRET:  # the split this test is for
        assert 3 < kd_kernels._ROW_MIN_PROGRAMS and 300 > kd_kernels._ROW_BLOCK_V
    d = make(3, 4, 300, H=6, dtype=torch.float64, dup=normalize != "tail")
    z = leaf(d["z"])
    got = grads(sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize=normalize,
                                                    temperature=1.5), [z])
    z64 = leaf(d["z"])
    want = grads(ref.topk_kd_loss_from_logits(z64, d["ids"], d["t"], d["m"], normalize=normalize,
                                              temperature=1.5)[0], [z64])
    compare(got, want, torch.float64, ["loss", "grad"])
    d = make(5, 4, 300, H=6, dtype=torch.float64, dup=normalize != "tail")
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    kw = dict(normalize=normalize, temperature=1.5, lm_head_bias=b, labels=d["labels"], ce_weight=0.5)
    got = grads(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], chunk_size=2, **kw), [h, w, b])
    want = grads(ref.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], **kw)[0], [h, w, b])
    compare(got, want, torch.float64, ["loss", "grad_hidden", "grad_weight", "grad_bias"])


def test_from_hidden_equals_from_logits():
    for normalize in NORMS:
        d = make(11, 5, 53, dtype=torch.float32, dup=normalize != "tail")
        h, w = leaf(d["h"]), leaf(d["w"])
        a = grads(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize=normalize,
                                                      temperature=1.5, chunk_size=4), [h, w])
        h2, w2 = leaf(d["h"]), leaf(d["w"])
        b = grads(sparsefuse.topk_kd_loss_from_logits(h2 @ w2.t(), d["ids"], d["t"], d["m"], normalize=normalize,
                                                      temperature=1.5), [h2, w2])
        compare(a, b, torch.float32, ["loss", "grad_hidden", "grad_weight"], scale=5)


# --- properties ---------------------------------------------------------------------------------


def test_identity_full_is_topk_minus_P_log_Q():
    """L_full = L_topk - P log Q per token (T = 1), with P the teacher mass and Q the student's."""
    d = make(13, 6, 131, dtype=torch.float64)
    _, full = sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], normalize="full",
                                                  return_per_token=True)
    _, topk = sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], normalize="topk",
                                                  return_per_token=True)
    P = torch.where(d["m"], d["t"].exp(), 0).sum(-1)
    q = torch.softmax(d["z"], -1).gather(1, d["ids"])
    Q = torch.where(d["m"], q, 0).sum(-1)
    has = d["m"].any(-1)
    want = torch.where(has, topk - P * Q.clamp_min(1e-300).log(), 0)
    assert_close(full, want, torch.float64, "full")


@pytest.mark.parametrize("seed", range(3))
def test_tail_is_nonnegative(seed):
    d = make(13, 6, 131, dtype=torch.float32, seed=seed, dup=False)
    t = d["t"] - 0.5 * torch.rand(d["t"].shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    _, tok = sparsefuse.topk_kd_loss_from_logits(d["z"] * 3, d["ids"], t, d["m"], normalize="tail",
                                                 return_per_token=True)
    assert (tok >= -1e-5).all(), tok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tail_when_the_student_puts_all_its_mass_on_the_slots(dtype):
    """V = K: Q = 1, so 1 - Q is clamped to the smallest normal number of the accumulation dtype, as
    in the reference (float64 once used float32's: a tail term of 17.1 instead of 141.4 per token)."""
    z = torch.randn(3, 1, dtype=dtype, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.long, device=DEVICE)
    t = torch.full((3, 1), 0.8, dtype=dtype, device=DEVICE).log()
    got = sparsefuse.topk_kd_loss_from_logits(z, ids, t, normalize="tail")
    want, _ = ref.topk_kd_loss_from_logits(z, ids, t, normalize="tail")
    assert_close(got, want, dtype, "loss")
    h, w = torch.randn(3, 4, dtype=dtype, device=DEVICE), torch.randn(1, 4, dtype=dtype, device=DEVICE)
    got = sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, normalize="tail")
    want, _ = ref.topk_kd_loss_from_hidden(h, w, ids, t, normalize="tail")
    assert_close(got, want, dtype, "hidden loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_tail_gradient_stays_bounded_at_the_extremes(dtype, form):
    """A student whose mass off the K slots underflows the dtype (log(1 - Q) still comes from
    lse_tail - lse_V), and K = V (no column off the slots: 1 - Q = 0 is taken as the smallest normal
    number, and the tail term passes no gradient, as under autograd in the reference). Both match the
    reference; (1 - P) / tiny once gave gradients of ~1e27 in float32, and zeros for K = V."""
    V, K = 40, 4
    big = 100.0 if dtype == torch.float32 else 750.0  # off-slot mass ~1e-42 / ~1e-324: exp underflows
    for gap, k in ((big, K), (0.0, V)):
        z = torch.zeros(2, V, dtype=torch.float64)
        z[:, :k] = gap + torch.arange(k, dtype=torch.float64) * 0.1  # the slots far above the rest
        ids = torch.arange(k).repeat(2, 1).to(DEVICE)
        t = torch.log_softmax(torch.randn(2, k, generator=torch.Generator().manual_seed(0),
                                          dtype=torch.float64), -1) + math.log(0.99)  # P = 0.99
        t = t.to(DEVICE, dtype)
        if form == "logits":
            x = leaf(z.to(DEVICE, dtype))
            args = (x, ids, t)
            ours, theirs = sparsefuse.topk_kd_loss_from_logits, ref.topk_kd_loss_from_logits
        else:  # hidden = the logits themselves through an identity LM head
            x = leaf(z.to(DEVICE, dtype))
            eye = torch.eye(V, dtype=dtype, device=DEVICE)
            args = (x, eye, ids, t)
            ours, theirs = sparsefuse.topk_kd_loss_from_hidden, ref.topk_kd_loss_from_hidden
        got = torch.autograd.grad(ours(*args, normalize="tail"), [x])[0]
        x_ref = leaf(x)
        want = torch.autograd.grad(theirs(*((x_ref,) + args[1:]), normalize="tail")[0], [x_ref])[0]
        assert got.abs().max() < 1, (gap, k, got.abs().max())
        assert_close(got, want, dtype, f"grad (gap {gap}, K {k})")


def _confident_student(dtype, gaps, V=40, K=4, P=0.9, seed=0):
    """Logits whose K slots (spread over the vocabulary) sit gaps[n] above the other columns, so the
    student's mass off its slots is about (V - K) * exp(-gap); a teacher with mass P on the slots."""
    g = torch.Generator().manual_seed(seed)
    N = len(gaps)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 0.5
    top = torch.tensor(gaps, dtype=torch.float64)[:, None] + torch.randn(N, K, generator=g, dtype=torch.float64) * 0.3
    z = z.scatter(1, ids, top)
    t = torch.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), -1) + math.log(P)
    return z.to(DEVICE, dtype), ids.to(DEVICE), t.to(DEVICE, dtype)


@pytest.mark.parametrize("form", ["logits", "hidden", "cpu-implementation"])
def test_tail_resolves_a_confident_students_off_slot_mass(form):
    """float32, a student far more confident than its teacher (mass off the slots 1e-2 down to 1e-42,
    where exp underflows, against the teacher's 0.1): the case where the tail term does its work.
    log(1 - Q) is lse_tail - lse_V, a logsumexp over the columns off the slots; 1 - exp(lse_K - lse_V)
    resolved nothing below an ulp of lse_V (~2e-6 here): a loss 4x off at 1.6e-7. And the slot
    columns' gradient q_k - p_k is not the difference of two terms of size r = (1 - P) / (1 - Q).
    Loss and gradient against float64 from the same float32 inputs."""
    z, ids, t = _confident_student(torch.float32, [6.0, 10.0, 14.0, 18.0, 20.0, 100.0])
    z64 = leaf(z.double())
    want_tok = ref.topk_kd_loss_from_logits(z64, ids, t.double(), normalize="tail")[1]
    (want_g,) = torch.autograd.grad(want_tok.sum(), [z64])
    x = leaf(z)
    if form == "logits":
        loss, tok = sparsefuse.topk_kd_loss_from_logits(x, ids, t, normalize="tail", reduction="sum",
                                                        return_per_token=True)
        (got_g,) = torch.autograd.grad(loss, [x])
    elif form == "hidden":  # the logits themselves through an identity LM head
        eye = torch.eye(z.shape[1], dtype=z.dtype, device=DEVICE)
        loss, tok = sparsefuse.topk_kd_loss_from_hidden(x, eye, ids, t, normalize="tail", reduction="sum",
                                                        return_per_token=True)
        (got_g,) = torch.autograd.grad(loss, [x])
    else:  # the ops' PyTorch implementation, which CPU tensors take without the interpreter
        m = torch.ones_like(ids, dtype=torch.bool)
        _, tok, scale, lse, A, corr = ref.kd_logits_fwd(z, ids, t, m, 2, 1.0, 0, None, 1.0)
        got_g = ref.kd_logits_bwd(torch.ones((), device=DEVICE), None, z, ids, m, lse, A, corr, scale, 2, 1.0)
    for n in range(z.shape[0]):  # row by row: every off-slot mass must be right, not only the largest
        assert_close(tok[n], want_tok[n], torch.float32, f"loss of row {n}")
        assert_close(got_g[n], want_g[n], torch.float32, f"gradient of row {n}")


def test_tail_refuses_repeated_unmasked_ids():
    """A repeated id counts its student mass twice in Q, which can pass 1 (1 - Q clamped: a loss of
    33.9 and gradients of 5e36 in float32 once). Checked with the index checks (on for CPU tensors)."""
    if DEVICE == "cuda":
        sparsefuse.set_index_checks(True)
    try:
        z = torch.tensor([[4.0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]], device=DEVICE)
        h, w = torch.randn(2, 3, device=DEVICE), torch.randn(6, 3, device=DEVICE)
        ids = torch.tensor([[1, 2], [0, 0]], device=DEVICE)
        t = torch.full((2, 2), 0.3, device=DEVICE).log()
        msg = (r"target_token_ids repeats id 0 among the unmasked slots of token 1 \(flattened\); "
               "normalize='tail' needs distinct ids")
        with pytest.raises(ValueError, match=msg):
            sparsefuse.topk_kd_loss_from_logits(z, ids, t, normalize="tail")
        with pytest.raises(ValueError, match=msg):
            sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, normalize="tail")
        # a repeat in a masked slot is padding; "topk" and "full" take repeated slots (they add up)
        m = torch.tensor([[True, True], [True, False]], device=DEVICE)
        assert torch.isfinite(sparsefuse.topk_kd_loss_from_logits(z, ids, t, m, normalize="tail"))
        for normalize in ("topk", "full"):
            assert torch.isfinite(sparsefuse.topk_kd_loss_from_logits(z, ids, t, normalize=normalize))
    finally:
        if DEVICE == "cuda":
            sparsefuse.set_index_checks(None)


@pytest.mark.parametrize("normalize", ["topk", "full"])
def test_from_hidden_float64_backward_rescale(normalize):
    """An incoming gradient of 1 + 2^-30 is not 1 in float64: the backward must apply it."""
    d = make(5, 3, 23, dtype=torch.float64)
    gl = torch.tensor(1 + 2**-30, dtype=torch.float64, device=DEVICE)
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    kw = dict(normalize=normalize, lm_head_bias=b)
    got = torch.autograd.grad(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], **kw), [h, w, b], gl)
    want = torch.autograd.grad(ref.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], **kw)[0], [h, w, b], gl)
    compare(got, want, torch.float64, ["grad_hidden", "grad_weight", "grad_bias"])


@pytest.mark.parametrize("normalize", NORMS)
def test_from_hidden_strided_bias(normalize):
    d = make(5, 3, 23, dtype=torch.float64, dup=normalize != "tail")
    b = leaf(torch.randn(2 * 23, dtype=torch.float64, device=DEVICE))
    h = leaf(d["h"])
    got = grads(sparsefuse.topk_kd_loss_from_hidden(h, d["w"], d["ids"], d["t"], d["m"], normalize=normalize,
                                                    lm_head_bias=b[::2]), [h, b])
    want = grads(ref.topk_kd_loss_from_hidden(h, d["w"], d["ids"], d["t"], d["m"], normalize=normalize,
                                              lm_head_bias=b[::2])[0], [h, b])
    compare(got, want, torch.float64, ["loss", "grad_hidden", "grad_bias"])


@pytest.mark.parametrize("normalize", NORMS)
def test_gradcheck_temperature(normalize):
    """fp64 finite differences of the returned loss (T**2 included) at T != 1: the gradient is the
    gradient of what is returned."""
    d = make(3, 2, 5, dup=normalize != "tail")
    z = leaf(d["z"])
    fn = lambda z: sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize=normalize,  # noqa: E731
                                                       temperature=2.3)
    assert torch.autograd.gradcheck(fn, (z,))
    zk = leaf(d["z"][:, :2])
    assert torch.autograd.gradcheck(lambda x: sparsefuse.topk_kd_loss(x, d["t"], d["m"], temperature=0.6), (zk,))


@pytest.mark.parametrize("normalize,ce_weight", [("tail", 0.4), ("full", 0.4), ("topk", 0.0)],
                         ids=["tail-ce", "full-ce", "topk-gather"])
def test_gradcheck_from_hidden(normalize, ce_weight):
    """Finite differences through the chunked row kernels, and through the gather kernel ("topk"
    without cross-entropy reads only the K weight rows of each token)."""
    d = make(3, 2, 6, H=3)
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    fn = lambda h, w, b: sparsefuse.topk_kd_loss_from_hidden(  # noqa: E731
        h, w, d["ids"], d["t"], d["m"], normalize=normalize, temperature=1.9, lm_head_bias=b,
        labels=d["labels"] if ce_weight else None, ce_weight=ce_weight, chunk_size=2)
    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_fully_masked_tokens_give_zero():
    d = make(5, 3, 37, dtype=torch.float32, dup=False)
    m = d["m"].clone()
    m[2] = False
    for normalize in NORMS:
        z = leaf(d["z"])
        loss, tok = sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], m, normalize=normalize,
                                                        return_per_token=True)
        (g,) = torch.autograd.grad(loss, z)
        assert tok[1] == 0 and tok[2] == 0 and torch.isfinite(tok).all()
        assert (g[1] == 0).all() and (g[2] == 0).all() and (g[0] != 0).any()
    z = torch.randn(3, 37, device=DEVICE)
    none = torch.zeros(3, 4, dtype=torch.bool, device=DEVICE)
    loss = sparsefuse.topk_kd_loss_from_logits(z, torch.zeros(3, 4, dtype=torch.long, device=DEVICE),
                                               torch.zeros(3, 4, device=DEVICE), none)
    assert loss == 0


def test_teacher_outputs_from_inference_mode():
    """What the README says of a teacher run under inference_mode: the gathered and logits forms
    save the targets for the backward, which PyTorch refuses; cloned targets and the hidden form work."""
    d = make(4, 3, 37, dtype=torch.float32, dup=False)
    with torch.inference_mode():
        ids, t = d["ids"].clone(), d["t"].clone()
    z = leaf(d["z"])
    for form in (lambda: sparsefuse.topk_kd_loss(z.gather(-1, ids.clone()), t),
                 lambda: sparsefuse.topk_kd_loss_from_logits(z, ids, t)):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            form().backward()
    sparsefuse.topk_kd_loss_from_logits(z, ids.clone(), t.clone()).backward()
    h = torch.randn(4, 5, device=DEVICE, requires_grad=True)
    w = torch.randn(37, 5, device=DEVICE, requires_grad=True)
    sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all() and torch.isfinite(z.grad).all()


def test_axolotl_padding_equals_dropping_the_slots():
    """Padded slots (id 0, log-prob -1e9, mask 0) change nothing: same loss as the unpadded K."""
    d = make(6, 4, 37, dtype=torch.float64, dup=False)
    m = torch.ones(6, 4, dtype=torch.bool, device=DEVICE)
    ids = torch.cat([d["ids"].clone(), torch.zeros(6, 3, dtype=torch.long, device=DEVICE)], 1)
    t = torch.cat([d["t"].clone(), torch.full((6, 3), -1e9, dtype=torch.float64, device=DEVICE)], 1)
    ids[:, :4] = torch.stack([torch.randperm(37, generator=torch.Generator().manual_seed(i))[:4]
                              for i in range(6)]).to(DEVICE)
    t[:, :4] = torch.log_softmax(d["z"][:, :4], -1)
    mp = torch.cat([m, torch.zeros(6, 3, dtype=torch.bool, device=DEVICE)], 1)
    for normalize in NORMS:
        a = sparsefuse.topk_kd_loss_from_logits(d["z"], ids, t, mp, normalize=normalize)
        b = sparsefuse.topk_kd_loss_from_logits(d["z"], ids[:, :4], t[:, :4], m, normalize=normalize)
        assert_close(a, b, torch.float64, normalize)


def test_reductions():
    d = make(13, 6, 131, dtype=torch.float64)
    args = (d["z"], d["ids"], d["t"], d["m"])
    s, tok = sparsefuse.topk_kd_loss_from_logits(*args, reduction="sum", return_per_token=True)
    mean = sparsefuse.topk_kd_loss_from_logits(*args, reduction="mean")
    n = int(d["m"].any(-1).sum())
    assert n < 13
    assert_close(s, tok.sum(), torch.float64, "sum")
    assert_close(mean, s / n, torch.float64, "mean")
    for items in (7, torch.tensor(7, device=DEVICE), torch.tensor(7.0, device=DEVICE)):
        got = sparsefuse.topk_kd_loss_from_logits(*args, num_items_in_batch=items)
        assert_close(got, s / 7, torch.float64, "num_items")


def test_float64_num_items_in_batch_is_not_rounded_to_float32():
    """A number num_items_in_batch reaches the reduction kernel as float64 for float64 inputs: as a plain
    float argument a compiled kernel takes it as fp32, and 1.1 rounded so is 2e-8 off, past float64's
    tolerance (the GPU tier sees that; the interpreter passes Python floats unrounded). Every form,
    against the float64 sum divided on the host."""
    d = make(5, 3, 37, dtype=torch.float64, dup=False)
    zk = d["z"][:, :3]
    forms = (lambda **kw: sparsefuse.topk_kd_loss(zk, d["t"], d["m"], **kw),
             lambda **kw: sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], **kw),
             lambda **kw: sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"], **kw),
             lambda **kw: sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"],
                                                              normalize="tail", **kw))
    for i, form in enumerate(forms):
        assert_close(form(num_items_in_batch=1.1), form(reduction="sum") / 1.1, torch.float64, f"form {i}")


def test_per_token_output_is_differentiable():
    d = make(5, 3, 37, dtype=torch.float64, dup=False)
    z = leaf(d["z"])
    w = torch.rand(5, dtype=torch.float64, device=DEVICE)
    loss, tok = sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize="tail",
                                                    return_per_token=True)
    (g,) = torch.autograd.grad(loss + (tok * w).sum(), z)
    z2 = leaf(d["z"])
    l2, t2 = ref.topk_kd_loss_from_logits(z2, d["ids"], d["t"], d["m"], normalize="tail")
    (g2,) = torch.autograd.grad(l2 + (t2 * w).sum(), z2)
    assert_close(g, g2, torch.float64, "grad")


def test_batched_shapes_and_int32_ids():
    d = make(12, 4, 37, dtype=torch.float32, index_dtype=torch.int32)
    z, ids, t, m = d["z"].reshape(3, 4, 37), d["ids"].reshape(3, 4, 4), d["t"].reshape(3, 4, 4), d["m"].reshape(3, 4, 4)
    loss, tok = sparsefuse.topk_kd_loss_from_logits(z, ids, t, m.int(), return_per_token=True)
    want, _ = ref.topk_kd_loss_from_logits(d["z"].double(), d["ids"], d["t"].double(), d["m"])
    assert tok.shape == (3, 4)
    assert_close(loss, want, torch.float32, "loss")


@pytest.mark.parametrize("normalize", ["topk", "full"])
def test_retain_graph_backward_twice_from_hidden(normalize):
    """Gradients are computed in the forward and rescaled in the backward: a second backward must
    be exact and leave the gradients returned by the first unchanged."""
    d = make(6, 3, 29, dtype=torch.float64)
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    loss = sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize=normalize, lm_head_bias=b,
                                               chunk_size=4)
    g1 = torch.autograd.grad(3 * loss, [h, w, b], retain_graph=True)
    first = [x.clone() for x in g1]
    g2 = torch.autograd.grad(loss, [h, w, b], retain_graph=True)
    g3 = torch.autograd.grad(2 * loss, [h, w, b])
    for x1, x0, x2, x3 in zip(g1, first, g2, g3):
        assert torch.equal(x1, x0)
        assert_close(x1, 3 * x2, torch.float64, "grad")
        assert_close(x3, 2 * x2, torch.float64, "grad")
    # .backward() accumulates into .grad, which may share storage with what the first backward
    # returned: a second and a third backward still add exact multiples
    for weight in (0.0, 3.0):
        h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
        loss = sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize=normalize,
                                                   lm_head_bias=b, chunk_size=4)
        loss.backward(retain_graph=True)
        first = [x.grad.clone() for x in (h, w, b)]
        (loss * weight).backward(retain_graph=True)
        for x, x0 in zip((h, w, b), first):
            assert_close(x.grad, (1 + weight) * x0, torch.float64, "accumulated grad")
        (loss * 2).backward()
        for x, x0 in zip((h, w, b), first):
            assert_close(x.grad, (3 + weight) * x0, torch.float64, "third accumulated grad")
    # .grad zeroed in place before a later backward (zero_grad(set_to_none=False)): where a .grad is
    # the tensor the first backward returned (autograd took it over; it did for hidden here), the
    # later backward is refused by name, else it is exact
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    loss = sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize=normalize, lm_head_bias=b,
                                               chunk_size=4)
    loss.backward(retain_graph=True)
    first = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad.zero_()
    try:
        loss.backward()
    except RuntimeError as e:
        assert "a later backward through a retained graph rescales the gradients the first backward" in str(e), e
    else:
        for x, x0 in zip((h, w, b), first):
            assert_close(x.grad, x0, torch.float64, "grad after zeroing")


def _fp16_head_case():
    """N = 32 tokens at hidden ~6000 whose teacher puts 0.9 on id 0 and the student ~1 on id 1: the
    true mean weight gradient at row 0 is about -5.4e3, its sum over the tokens at weight 1 -1.7e5."""
    N, H, V = 32, 4, 8
    g = torch.Generator().manual_seed(0)
    h = 6000 + 20 * torch.randn(N, H, generator=g)
    w = 0.01 * torch.randn(V, H, generator=g)
    w[0], w[1] = -0.01, 0.02
    b = 0.1 * torch.randn(V, generator=g)
    ids = torch.tensor([[0, 1]]).expand(N, 2).contiguous()
    t = torch.tensor([[0.9, 0.1]]).log().expand(N, 2).contiguous()
    return [x.to(DEVICE) for x in (h.half(), w.half(), b.half(), ids, t)]


@pytest.mark.parametrize("normalize,items", [("full", None), ("topk", None), ("full", 24.0), ("topk", "tensor")],
                         ids=["full-mean", "topk-mean", "full-items24", "topk-items-tensor"])
def test_from_hidden_float16_weight_and_bias_gradients_stay_in_range(normalize, items):
    """float16 gradients are computed at a per-token weight of 1 (the mean's 1/N would make grad_hidden
    subnormal); the weight gradient sums over the tokens and, at weight 1, went to -inf here. It and
    the bias gradient are stored scaled by a power of two; an incoming gradient of 3, then a second
    backward through the retained graph, check the factors the backward divides out."""
    h, w, b, ids, t = _fp16_head_case()
    num_items = torch.tensor(32.0, device=DEVICE) if items == "tensor" else items
    kw = dict(normalize=normalize, num_items_in_batch=num_items)
    params = [leaf(h), leaf(w), leaf(b)]
    loss = sparsefuse.topk_kd_loss_from_hidden(params[0], params[1], ids, t, lm_head_bias=params[2], **kw)
    got = torch.autograd.grad(3 * loss, params, retain_graph=True)
    again = torch.autograd.grad(loss, params)
    p64 = [leaf(x.double()) for x in (h, w, b)]
    want = torch.autograd.grad(ref.topk_kd_loss_from_hidden(p64[0], p64[1], ids, t.double(), lm_head_bias=p64[2],
                                                            **kw)[0], p64)
    assert want[1].abs().max() > 5000  # and its sum over the 32 tokens is past 65504
    names = ["grad_hidden", "grad_weight", "grad_bias"]
    compare(got, [3 * x for x in want], torch.float16, names)
    compare(again, want, torch.float16, names)


def test_later_backward_after_a_zero_incoming_gradient_raises():
    """The first backward scales the gradients computed in the forward in place; after an incoming
    gradient of 0 they are gone, and a later backward through the retained graph once returned NaN."""
    d = make(5, 3, 23, dtype=torch.float64)
    h = leaf(d["h"])
    loss = sparsefuse.topk_kd_loss_from_hidden(h, d["w"], d["ids"], d["t"], d["m"], normalize="topk")
    (g0,) = torch.autograd.grad(0 * loss, h, retain_graph=True)
    assert (g0 == 0).all()
    with pytest.raises(RuntimeError, match="a later backward through a retained graph cannot be computed: the first "
                                           "backward's incoming gradient was 0"):
        torch.autograd.grad(loss, h)


def test_from_hidden_per_token_loss_refuses_a_gradient():
    """The per-token loss of the hidden form is not differentiable; a gradient sent into it was once
    dropped silently. Eager: RuntimeError. Traced, the backward sees zeros for an unused output and
    cannot raise: a non-zero gradient there makes the returned gradients NaN."""
    d = make(5, 3, 23, dtype=torch.float64)

    def fn(h):
        return sparsefuse.topk_kd_loss_from_hidden(h, d["w"], d["ids"], d["t"], d["m"], normalize="topk",
                                                   return_per_token=True)

    h = leaf(d["h"])
    loss, tok = fn(h)
    with pytest.raises(RuntimeError, match=r"a gradient reached the per-token loss \(return_per_token=True\), "
                                           "which is not differentiable"):
        torch.autograd.grad(loss + tok.sum(), h)
    loss, tok = fn(h)
    (want,) = torch.autograd.grad(loss, h)  # unused: fine
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss, tok = compiled(h)
    (g,) = torch.autograd.grad(loss, h)
    assert_close(g, want, torch.float64, "compiled, per-token loss unused")
    loss, tok = compiled(h)
    (g,) = torch.autograd.grad(loss + tok.sum(), h)
    assert torch.isnan(g).all()


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_gathered_per_token_output_is_differentiable(temperature):
    """return_per_token=True: the gathered form's per-token loss is differentiable too, and a
    gradient reaching it adds to the loss's (the logits form has its own test)."""
    d = make(5, 3, 37, dtype=torch.float64)
    w = torch.rand(5, dtype=torch.float64, device=DEVICE)
    zk = leaf(d["z"][:, :3])
    loss, tok = sparsefuse.topk_kd_loss(zk, d["t"], d["m"], temperature=temperature, return_per_token=True)
    (g,) = torch.autograd.grad(loss + (tok * w).sum(), zk)
    z64 = leaf(d["z"][:, :3])
    l2, t2 = ref.topk_kd_loss(z64, d["t"], d["m"], temperature=temperature)
    (g2,) = torch.autograd.grad(l2 + (t2 * w).sum(), z64)
    assert_close(tok, t2, torch.float64, "per token")
    assert_close(g, g2, torch.float64, "grad")
    (g,) = torch.autograd.grad(sparsefuse.topk_kd_loss(zk, d["t"], d["m"], temperature=temperature,
                                                       return_per_token=True)[1].sum(), zk)
    (g2,) = torch.autograd.grad(ref.topk_kd_loss(z64, d["t"], d["m"], temperature=temperature)[1].sum(), z64)
    assert_close(g, g2, torch.float64, "grad of the per-token loss alone")


@pytest.mark.parametrize("normalize", ["topk", "full"])
def test_from_hidden_num_items_in_batch_divides_the_cross_entropy(normalize):
    """num_items_in_batch divides the cross-entropy term as well as the KD term (gradient
    accumulation); other tests use it without cross-entropy, or the cross-entropy with "mean"."""
    d = make(9, 4, 41, dtype=torch.float64)
    for items in (7, torch.tensor(7.0, device=DEVICE)):
        h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
        kw = dict(normalize=normalize, temperature=1.5, lm_head_bias=b, labels=d["labels"], ce_weight=0.5,
                  num_items_in_batch=items)
        got = grads(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], chunk_size=4, **kw),
                    [h, w, b])
        want = grads(ref.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], **kw)[0], [h, w, b])
        compare(got, want, torch.float64, ["loss", "grad_hidden", "grad_weight", "grad_bias"])


def test_cpu_implementations_of_the_gathered_op_and_the_reductions():
    """The ops' PyTorch implementations (the CPU path without the interpreter) against the kernels:
    the gathered forward and backward at T != 1 with a per-token gradient, and the hidden form's
    KD and cross-entropy weights for "mean" (labels ignored on more tokens than are fully masked,
    so the two counts differ), "sum" and num_items_in_batch (number and tensor)."""
    from sparsefuse.kd import kernels

    d = make(7, 3, 29, dtype=torch.float64)
    zk = d["z"][:, :3].contiguous()
    gl = torch.tensor(1.3, dtype=torch.float64, device=DEVICE)
    gt = torch.rand(7, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for reduction, items, items_v in ((1, None, 1.0), (0, None, 1.0), (2, None, 5.0)):
        a = kernels.topk_fwd(zk, d["t"], d["m"], 1.7, reduction, items, items_v)
        b = ref.kd_topk_fwd(zk, d["t"], d["m"], 1.7, reduction, items, items_v)
        for x, y, name in zip(a, b, ("loss", "tok", "scale")):
            assert_close(x, y, torch.float64, name)
        ga = kernels.topk_bwd(gl, gt, zk, d["t"], d["m"], a[2], 1.7)
        gb = ref.kd_topk_bwd(gl, gt, zk, d["t"], d["m"], b[2], 1.7)
        assert_close(ga, gb, torch.float64, "grad")
    labels = d["labels"].clone()
    labels[[0, 2]] = ref.IGNORE_INDEX  # 3 labels ignored, 1 token fully masked
    for reduction, items, items_v in ((1, None, 1.0), (0, None, 1.0), (2, None, 5.0),
                                      (2, torch.tensor(6.0, dtype=torch.float64, device=DEVICE), 1.0)):
        for normalize in (0, 1):
            args = (d["h"], d["w"], d["b"], d["ids"], d["t"], d["m"], labels, normalize, 1.3, reduction, items, items_v,
                    0.5, True, True, True, 0)
            got = kernels.hidden_fwd(*args)
            want = ref.kd_hidden_fwd(*args)
            for x, y, name in zip(got, want, ("loss", "tok", "grad_hidden", "grad_weight", "grad_bias")):
                assert_close(x, y, torch.float64, f"{name} ({reduction}, {normalize})")


@pytest.mark.parametrize("normalize", ["full", "tail"])
def test_from_hidden_float16_grad_hidden_with_a_tiny_reduction_weight(normalize):
    """float16 from hidden states with a per-token weight of 2^-18: the logits' gradient is computed
    at weight 1 in the float16 chunk and the weight is applied to grad_hidden in the backward. At the
    true weight the logits' gradients (~1e-7) are float16 subnormals and grad_hidden came out ~1.5%
    off; this way it is within float16 rounding."""
    N, H, V, K = 6, 4, 16, 3
    g = torch.Generator().manual_seed(0)
    h = (0.05 * torch.randn(N, H, generator=g)).half()
    w = (20 * torch.randn(V, H, generator=g)).half()
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    t = torch.log_softmax(torch.randn(N, K, generator=g), -1) - 0.3
    h, w, ids, t = (x.to(DEVICE) for x in (h, w, ids, t))
    items = 2.0**18
    hl = leaf(h)
    (gh,) = torch.autograd.grad(sparsefuse.topk_kd_loss_from_hidden(hl, w, ids, t, normalize=normalize,
                                                                    num_items_in_batch=items), hl)
    h64 = leaf(h.double())
    (want,) = torch.autograd.grad(ref.topk_kd_loss_from_hidden(h64, w.double(), ids, t.double(), normalize=normalize,
                                                               num_items_in_batch=items)[0], h64)
    assert want.abs().max() > 6.2e-5  # grad_hidden itself is a normal float16 number
    assert_close(gh, want, torch.float16, "grad_hidden")


# --- API, compile, opcheck, errors ---------------------------------------------------------------


def test_compat_kd_loss_triton_is_the_masked_sum():
    d = make(8, 4, 37, dtype=torch.float32)
    zk = d["z"][:, :4].reshape(2, 4, 4)
    t, m = d["t"].reshape(2, 4, 4), d["m"].reshape(2, 4, 4)
    want, _ = ref.topk_kd_loss(zk.double(), t.double(), m, reduction="sum")
    assert_close(compat.kd_loss_triton(zk, t, m), want, torch.float32, "sum")
    assert_close(compat.kd_loss_triton(zk, t, m, num_items_in_batch=5), want / 5, torch.float32, "items")


def test_module():
    d = make(5, 3, 37, dtype=torch.float32, dup=False)
    mod = sparsefuse.TopKKDLoss(normalize="tail", temperature=2.0)
    assert "tail" in repr(mod)
    want = sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], normalize="tail", temperature=2.0)
    assert_close(mod(d["z"], d["ids"], d["t"], d["m"]), want, torch.float32, "logits")
    got = mod(d["h"], d["ids"], d["t"], d["m"], lm_head_weight=d["w"])
    want = sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"], normalize="tail",
                                               temperature=2.0)
    assert_close(got, want, torch.float32, "hidden")
    zk = d["z"][:, :3]
    want, want_tok = sparsefuse.topk_kd_loss(zk, d["t"], d["m"], return_per_token=True)
    crit = sparsefuse.TopKKDLoss(normalize="topk")
    for got in (crit(zk, d["t"], d["m"]), crit(zk, d["t"], None, d["m"]),
                crit(zk, target_logprobs=d["t"], target_mask=d["m"])):
        assert_close(got, want, torch.float32, "gathered")
    assert_close(crit(zk, d["t"]), sparsefuse.topk_kd_loss(zk, d["t"]), torch.float32, "gathered, no mask")
    got, tok = sparsefuse.TopKKDLoss(normalize="topk", return_per_token=True)(zk, d["t"], d["m"])
    assert_close(got, want, torch.float32, "gathered")
    assert_close(tok, want_tok, torch.float32, "per token")
    got, tok = sparsefuse.TopKKDLoss(normalize="topk", return_per_token=True)(d["z"], d["ids"], d["t"], d["m"])
    want, want_tok = sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], normalize="topk",
                                                         return_per_token=True)
    assert_close(tok, want_tok, torch.float32, "per token, logits")
    # num_items_in_batch given per call reaches every form
    assert_close(crit(zk, d["t"], d["m"], num_items_in_batch=7),
                 sparsefuse.topk_kd_loss(zk, d["t"], d["m"], num_items_in_batch=7), torch.float32, "gathered, items")
    assert_close(mod(d["z"], d["ids"], d["t"], d["m"], num_items_in_batch=7),
                 sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], normalize="tail",
                                                     temperature=2.0, num_items_in_batch=7), torch.float32,
                 "logits, items")
    assert_close(mod(d["h"], d["ids"], d["t"], d["m"], lm_head_weight=d["w"], num_items_in_batch=7),
                 sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"], normalize="tail",
                                                     temperature=2.0, num_items_in_batch=7), torch.float32,
                 "hidden, items")
    with pytest.raises(ValueError, match="gathered logits support normalize='topk' only"):
        mod(zk, d["t"], d["m"])
    with pytest.raises(TypeError, match="target_token_ids has dtype float32"):
        crit(d["z"], d["ids"].float(), d["t"], d["m"])


def test_compile_fullgraph():
    d = make(6, 3, 37, dtype=torch.float32, dup=False)

    def fn(z, h, w):
        a = sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize="tail", temperature=1.5)
        b = sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], chunk_size=4)
        c = sparsefuse.topk_kd_loss(z[:, :3], d["t"], d["m"])
        return a + b + c

    params = [leaf(d["z"]), leaf(d["h"]), leaf(d["w"])]
    want = grads(fn(*params), params)
    params = [leaf(d["z"]), leaf(d["h"]), leaf(d["w"])]
    got = grads(torch.compile(fn, fullgraph=True)(*params), params)
    compare(got, want, torch.float32, ["loss", "grad_z", "grad_h", "grad_w"])


@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_compile_fullgraph_from_hidden_with_bias(normalize):
    """The LM-head bias branch (its fake, its gradient) under torch.compile(fullgraph=True), with and
    without the gather-only path ("topk" without cross-entropy)."""
    d = make(6, 3, 37, dtype=torch.float32, dup=False)

    def fn(h, w, b):
        return sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize=normalize,
                                                   lm_head_bias=b, chunk_size=4)

    params = [leaf(d["h"]), leaf(d["w"]), leaf(d["b"])]
    want = grads(fn(*params), params)
    params = [leaf(d["h"]), leaf(d["w"]), leaf(d["b"])]
    torch._dynamo.reset()
    got = grads(torch.compile(fn, fullgraph=True)(*params), params)
    assert want[3].abs().sum() > 0
    compare(got, want, torch.float32, ["loss", "grad_h", "grad_w", "grad_b"])


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_with_options_that_change(dynamic):
    """A temperature schedule and a per-step ``num_items_in_batch`` (gradient accumulation) change
    Python numbers between calls; Dynamo then makes them symbolic (from the first call with
    ``dynamic=True``), and the option checks must still trace. Each call matches eager mode."""
    d = make(6, 3, 37, dtype=torch.float32, dup=False)

    def fn(z, h, w, T, items, ce):
        a = sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize="tail", temperature=T,
                                                num_items_in_batch=items)
        b = sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], temperature=T, labels=d["labels"],
                                                ce_weight=ce, chunk_size=4)
        c = sparsefuse.topk_kd_loss(z[:, :3], d["t"], d["m"], temperature=T, num_items_in_batch=items)
        return a + b + c

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    for T, items, ce in ((1.0, 4, 0.5), (1.5, 5, 0.25), (2.0, 7.5, 0.0)):
        params = [leaf(d["z"]), leaf(d["h"]), leaf(d["w"])]
        want = grads(fn(*params, T, items, ce), params)
        params = [leaf(d["z"]), leaf(d["h"]), leaf(d["w"])]
        got = grads(compiled(*params, T, items, ce), params)
        compare(got, want, torch.float32, [f"loss T={T}", "grad_z", "grad_h", "grad_w"])


def test_opcheck():
    d = make(5, 3, 37, dtype=torch.float32, dup=False)
    m = d["m"]
    ops = torch.ops.sparsefuse
    zk = d["z"][:, :3].contiguous()
    loss, tok, scale = ops.kd_topk(zk, d["t"], m, 1.5, 1, None, 1.0)
    torch.library.opcheck(ops.kd_topk, (zk, d["t"], m, 1.5, 1, None, 1.0))
    torch.library.opcheck(ops.kd_topk_bwd, (torch.ones((), device=DEVICE), tok, zk, d["t"], m, scale, 1.5))
    z = d["z"]
    args = (z, d["ids"], d["t"], m, 2, 1.5, 2, torch.tensor(3.0, device=DEVICE), 1.0)
    torch.library.opcheck(ops.kd_logits, args)
    _, _, scale, lse, A, corr = ops.kd_logits(*args)
    torch.library.opcheck(ops.kd_logits_bwd, (torch.ones((), device=DEVICE), None, z, d["ids"], m, lse, A, corr, scale,
                                              2, 1.5))
    h, w = d["h"], d["w"]
    torch.library.opcheck(ops.kd_hidden, (h, w, None, d["ids"], d["t"], m, d["labels"], 1, 1.0, 1, None, 1.0, 0.5,
                                          False, False, False, 4), test_utils=("test_schema", "test_faketensor"))
    # with an LM-head bias and its gradient; then the in-place rescale of the forward's gradients
    args = (h, w, d["b"], d["ids"], d["t"], m, d["labels"], 2, 1.5, 1, None, 1.0, 0.5, True, True, True, 4)
    torch.library.opcheck(ops.kd_hidden, args, test_utils=("test_schema", "test_faketensor"))
    _, _, gh, gw, gb, applied = ops.kd_hidden(*args)
    torch.library.opcheck(ops.kd_hidden_bwd, (torch.tensor(0.7, device=DEVICE), gh, gw, gb, applied))


def test_opcheck_column_major_inputs():
    """The kernels return contiguous gradients whatever the inputs' layout; the fakes must say so
    (a fake that copied a column-major input's strides would mislead torch.compile)."""
    d = make(5, 3, 37, dtype=torch.float32, dup=False)
    m = d["m"]
    ops = torch.ops.sparsefuse
    cm = lambda x: x.t().contiguous().t()  # noqa: E731
    zk = cm(d["z"][:, :3])
    _, tok, scale = ops.kd_topk(zk, d["t"], m, 1.5, 1, None, 1.0)
    torch.library.opcheck(ops.kd_topk_bwd, (torch.ones((), device=DEVICE), tok, zk, d["t"], m, scale, 1.5))
    z = cm(d["z"])
    args = (z, d["ids"], d["t"], m, 2, 1.5, 2, torch.tensor(3.0, device=DEVICE), 1.0)
    _, _, scale, lse, A, corr = ops.kd_logits(*args)
    torch.library.opcheck(ops.kd_logits_bwd, (torch.ones((), device=DEVICE), None, z, d["ids"], m, lse, A, corr, scale,
                                              2, 1.5))
    h, w = cm(d["h"]), cm(d["w"])
    torch.library.opcheck(ops.kd_hidden, (h, w, None, d["ids"], d["t"], m, d["labels"], 1, 1.0, 1, None, 1.0, 0.5,
                                          True, True, False, 4), test_utils=("test_schema", "test_faketensor"))


def test_index_out_of_range_is_a_clear_error():
    """Checked by default on CPU tensors; on CUDA the check is opt-in (set_index_checks), so turn it on."""
    if DEVICE == "cuda":
        sparsefuse.set_index_checks(True)
    try:
        d = make(5, 3, 37, dtype=torch.float32)
        ids = d["ids"].clone()
        ids[3, 0] = 37
        with pytest.raises(IndexError, match=r"target_token_ids holds 37, outside \[0, 37\)"):
            sparsefuse.topk_kd_loss_from_logits(d["z"], ids, d["t"], d["m"])
        with pytest.raises(IndexError, match="target_token_ids"):
            sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], ids, d["t"], d["m"])
        ids[3, 0] = -5  # a masked slot may hold anything
        m = d["m"].clone()
        m[3, 0] = False
        assert torch.isfinite(sparsefuse.topk_kd_loss_from_logits(d["z"], ids, d["t"], m))
        labels = d["labels"].clone()
        labels[0] = 99
        with pytest.raises(IndexError, match="labels holds 99"):
            sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"], labels=labels,
                                                ce_weight=1.0)
    finally:
        if DEVICE == "cuda":
            sparsefuse.set_index_checks(None)


def test_index_out_of_range_without_checks_gives_nan():
    d = make(5, 3, 37, dtype=torch.float32)
    ids = d["ids"].clone()
    ids[3, 0] = 40
    sparsefuse.set_index_checks(False)
    try:
        loss = sparsefuse.topk_kd_loss_from_logits(d["z"], ids, d["t"], d["m"])
        assert torch.isnan(loss)
        # "topk" from hidden states: the token's loss and grad_hidden are NaN; the bad slot adds
        # nothing to the weight and bias gradients (the same as masking it out)
        h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
        kw = dict(normalize="topk", reduction="sum")
        loss, tok = sparsefuse.topk_kd_loss_from_hidden(h, w, ids, d["t"], d["m"], lm_head_bias=b,
                                                        return_per_token=True, **kw)
        gh, gw, gb = torch.autograd.grad(loss, [h, w, b])
        m = d["m"].clone()
        m[3, 0] = False
        h2, w2, b2 = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
        gh2, gw2, gb2 = torch.autograd.grad(sparsefuse.topk_kd_loss_from_hidden(h2, w2, ids, d["t"], m,
                                                                                lm_head_bias=b2, **kw), [h2, w2, b2])
    finally:
        sparsefuse.set_index_checks(None)
    assert torch.isnan(loss) and torch.isnan(tok[3]) and torch.isfinite(torch.cat([tok[:3], tok[4:]])).all()
    assert torch.isnan(gh[3]).all() and torch.equal(gh[:3], gh2[:3]) and torch.equal(gh[4:], gh2[4:])
    assert torch.equal(gw, gw2) and torch.equal(gb, gb2)


@pytest.mark.parametrize("normalize", NORMS)
def test_out_of_range_id_without_checks_kernels_match_reference(normalize):
    """Index checks off: a token with an unmasked id outside [0, V) gets a NaN loss and a NaN gradient
    row in every mode ("topk" once left its logits row finite, as if the slot were masked), and the
    ops' PyTorch implementations (reference.py) compute the same outputs (they once raised in gather).
    From hidden states: with "topk" and no cross-entropy the bad slot adds nothing to the weight and
    bias gradients; otherwise the NaN row reaches every column of them."""
    from sparsefuse.kd import kernels

    d = make(5, 3, 37, dtype=torch.float64, dup=normalize != "tail")
    ids = d["ids"].clone()
    ids[3, 0] = 40
    code = ref.NORMALIZE[normalize]
    one = torch.ones((), dtype=torch.float64, device=DEVICE)
    T = 1.3  # not exact in fp32: float64 kernels take their float arguments as float64 on every device
    sparsefuse.set_index_checks(False)
    try:
        logits, hidden = [], []
        for fwd, bwd, hid in ((kernels.logits_fwd, kernels.logits_bwd, kernels.hidden_fwd),
                              (ref.kd_logits_fwd, ref.kd_logits_bwd, ref.kd_hidden_fwd)):
            loss, tok, scale, lse, A, corr = fwd(d["z"], ids, d["t"], d["m"], code, T, 1, None, 1.0)
            logits.append((loss, tok, bwd(one, None, d["z"], ids, d["m"], lse, A, corr, scale, code, T)))
            hidden.append([hid(d["h"], d["w"], d["b"], ids, d["t"], d["m"], d["labels"], code, T, 1, None, 1.0,
                               ce, True, True, True, 0) for ce in (0.0, 0.5)])
    finally:
        sparsefuse.set_index_checks(None)
    loss, tok, g = logits[0]
    assert torch.isnan(loss) and torch.isnan(tok[3]) and torch.isnan(g[3]).all()
    assert torch.isfinite(torch.cat([g[:3], g[4:]])).all()
    for a, b in zip(logits[0] + sum(hidden[0], ()), logits[1] + sum(hidden[1], ())):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-12, equal_nan=True)
    gw, gb = hidden[0][0][3:5]  # without cross-entropy
    assert [bool(torch.isfinite(x).all()) for x in (gw, gb)] == [normalize == "topk"] * 2


def _kernels_and_reference(d, code, T=1.0):
    """(logits forms, hidden forms) from the kernels' and the references' forward and backward."""
    from sparsefuse.kd import kernels

    one = torch.ones((), dtype=d["z"].dtype, device=DEVICE)
    logits, hidden = [], []
    for fwd, bwd, hid in ((kernels.logits_fwd, kernels.logits_bwd, kernels.hidden_fwd),
                          (ref.kd_logits_fwd, ref.kd_logits_bwd, ref.kd_hidden_fwd)):
        loss, tok, scale, lse, A, corr = fwd(d["z"], d["ids"], d["t"], d["m"], code, T, 1, None, 1.0)
        logits.append((loss, tok, bwd(one, None, d["z"], d["ids"], d["m"], lse, A, corr, scale, code, T)))
        hidden.append(hid(d["h"], d["w"], d["b"], d["ids"], d["t"], d["m"], d["labels"], code, T, 1, None, 1.0,
                          0.5, True, True, True, 0))
    return logits, hidden


@pytest.mark.parametrize("normalize", NORMS)
def test_fully_masked_token_with_minus_inf_logits_gets_a_zero_gradient(normalize):
    """A token with no unmasked slot contributes 0 and gets a zero gradient, also when its logits row
    is all -inf (padding positions filled with -inf). The row kernel once multiplied its A = 0 by
    exp(-inf - -inf) = NaN and wrote a NaN gradient row ("full" and "tail"), where the ops' PyTorch
    implementation gave zeros; the other tokens are unaffected."""
    d = make(5, 3, 37, dtype=torch.float64, dup=normalize != "tail")
    assert not d["m"][1].any()  # make() masks token 1 whole
    d["z"] = d["z"].clone()
    d["z"][1] = -math.inf
    logits, _ = _kernels_and_reference(d, ref.NORMALIZE[normalize])
    loss, tok, g = logits[0]
    assert tok[1] == 0 and torch.isfinite(loss)
    assert torch.equal(g[1], torch.zeros_like(g[1]))
    assert torch.isfinite(g).all()
    for a, b in zip(logits[0], logits[1]):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-12)
    z = d["z"].clone().requires_grad_()
    (gz,) = torch.autograd.grad(
        sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize=normalize), [z])
    torch.testing.assert_close(gz, g, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("normalize", NORMS)
def test_non_finite_logit_off_the_slots_is_not_lost(normalize, bad):
    """A NaN or +inf student logit in a column that is not one of the token's slots left the sweep's
    running sum NaN, which the logsumexp read as "no column" (-inf): "full" gave a loss of -inf, and
    "tail" a finite loss with the bad logit gone from it. Now the token's logsumexp is NaN (+inf for
    +inf), as in the references: "full" +inf or NaN, "tail" NaN, "topk" (which never reads the
    column) unchanged. The same column of the LM head holding a NaN does it for every token."""
    d = make(5, 3, 37, dtype=torch.float64, dup=normalize != "tail")
    code = ref.NORMALIZE[normalize]
    col = next(c for c in range(37) if c not in d["ids"][3].tolist())
    d["z"] = d["z"].clone()
    d["z"][3, col] = float(bad)
    d["w"] = d["w"].clone()
    d["w"][col, 0] = float(bad)
    logits, hidden = _kernels_and_reference(d, code)
    tok = logits[0][1]
    if normalize == "topk":
        assert torch.isfinite(tok).all()
    elif normalize == "full" and bad == "inf":
        assert tok[3] == math.inf
    else:
        assert torch.isnan(tok[3])
    assert torch.isfinite(torch.cat([tok[:3], tok[4:]])).all()
    for a, b in zip(logits[0] + hidden[0], logits[1] + hidden[1]):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-12, equal_nan=True)


def test_topk_teacher_probability_overflow_keeps_off_slot_gradient_zero():
    """normalize="topk": a teacher log-prob of 100 overflows exp in float32, and A = P * 0 was NaN,
    which the backward spread over the token's whole logits row; "topk" passes no gradient off the
    slots, and the reference keeps those columns 0."""
    d = make(5, 3, 37, dtype=torch.float32)
    d["t"] = d["t"].clone()
    d["t"][2, 0] = 100.0
    d["m"] = torch.ones_like(d["m"])
    logits, _ = _kernels_and_reference(d, ref.NORMALIZE["topk"])
    g = logits[0][2]
    off = torch.ones(37, dtype=torch.bool, device=DEVICE)
    off[d["ids"][2]] = False
    assert torch.equal(g[2][off], torch.zeros_like(g[2][off]))
    torch.testing.assert_close(g, logits[1][2].to(g.dtype), equal_nan=True)


@pytest.mark.parametrize("normalize", NORMS)
def test_out_of_range_label_without_checks_poisons_the_token(normalize):
    """Index checks off (the CUDA default): a label outside [0, V) that is not -100 (padding with -1,
    say) made the loss NaN, but the kernels' gradients stayed finite (the cross-entropy term without
    its target column) and the reference raised in gather. Now that token's gradient row is NaN on
    both, so grad_hidden's row and every column of the weight and bias gradients are NaN, and the
    other tokens' grad_hidden rows are as with the label ignored. The reference function under
    autograd gives NaN gradients too."""
    from sparsefuse.kd import kernels

    d = make(5, 3, 37, dtype=torch.float64, dup=normalize != "tail")
    code = ref.NORMALIZE[normalize]
    for bad in (-1, 37):
        labels, ignored = d["labels"].clone(), d["labels"].clone()
        labels[2], ignored[2] = bad, -100
        sparsefuse.set_index_checks(False)
        try:
            out = [hid(d["h"], d["w"], d["b"], d["ids"], d["t"], d["m"], lab, code, 1.3, 2, None, 1.0, 0.5,
                       True, True, True, 0)
                   for hid in (kernels.hidden_fwd, ref.kd_hidden_fwd) for lab in (labels, ignored)]
            h, w = leaf(d["h"]), leaf(d["w"])
            gh_ref, gw_ref = torch.autograd.grad(
                ref.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize=normalize, labels=labels,
                                             ce_weight=0.5, reduction="sum")[0], [h, w])
        finally:
            sparsefuse.set_index_checks(None)
        for (loss, _, gh, gw, gb, _), (_, _, gh_ok, _, _, _) in (out[:2], out[2:]):
            assert torch.isnan(loss) and torch.isnan(gh[2]).all() and torch.isnan(gw).all() and torch.isnan(gb).all()
            rest = [0, 1, 3, 4]
            torch.testing.assert_close(gh[rest], gh_ok[rest], rtol=1e-9, atol=1e-12)
        for a, b in zip(out[0], out[2]):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-12, equal_nan=True)
        assert torch.isnan(gh_ref[2]).all() and torch.isnan(gw_ref).all()


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_tail_repeated_id_without_checks_poisons_the_token(T):
    """Index checks off (the CUDA default), "tail": a token whose unmasked ids repeat gets a NaN loss
    and a NaN gradient row, as for an id outside [0, V). Before, the kernels counted the repeated
    column twice in lse_K, so lse_V came out too large: a finite wrong loss and, at T = 1 (where the
    cross-entropy reuses lse_V), a wrong cross-entropy, while the reference computed another value.
    The other tokens are as without the repeat, and kernels and reference agree."""
    from sparsefuse.kd import kernels

    d = make(5, 3, 37, dtype=torch.float64, dup=False)
    ids, m = d["ids"].clone(), d["m"].clone()
    ids[3, 1], m[3, :2] = ids[3, 0], True
    one = torch.ones((), dtype=torch.float64, device=DEVICE)
    sparsefuse.set_index_checks(False)
    try:
        clean = kernels.logits_fwd(d["z"], d["ids"], d["t"], m, 2, T, 1, None, 1.0)[1]
        logits, hidden = [], []
        for fwd, bwd, hid in ((kernels.logits_fwd, kernels.logits_bwd, kernels.hidden_fwd),
                              (ref.kd_logits_fwd, ref.kd_logits_bwd, ref.kd_hidden_fwd)):
            loss, tok, scale, lse, A, corr = fwd(d["z"], ids, d["t"], m, 2, T, 1, None, 1.0)
            logits.append((loss, tok, bwd(one, None, d["z"], ids, m, lse, A, corr, scale, 2, T)))
            hidden.append(hid(d["h"], d["w"], d["b"], ids, d["t"], m, d["labels"], 2, T, 1, None, 1.0, 0.5,
                              True, True, True, 0))
    finally:
        sparsefuse.set_index_checks(None)
    loss, tok, g = logits[0]
    assert torch.isnan(loss) and torch.isnan(tok[3]) and torch.isnan(g[3]).all()
    rest = [0, 1, 2, 4]
    assert torch.isfinite(g[rest]).all()
    assert torch.equal(tok[rest], clean[rest])
    tok_h, grad_h = hidden[0][1], hidden[0][2]
    assert torch.isnan(tok_h[3]) and torch.isnan(grad_h[3]).all() and torch.isfinite(grad_h[rest]).all()
    for a, b in zip(logits[0] + hidden[0], logits[1] + hidden[1]):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-12, equal_nan=True)


def test_tail_with_no_student_mass_off_the_slots():
    """"tail" where every column off a token's slots holds a -inf logit (here a -inf LM-head bias: a
    vocabulary masked down to the teacher's ids), so lse_tail is -inf: 1 - Q is taken as the smallest
    normal number, and the tail term passes no gradient. The loss is then "full"'s plus
    (1 - P) (log(1 - P) - log tiny) and the gradient is "full"'s (P q_k - p_k at the slots, 0 at the -inf
    columns), against float64 autograd of the "full" reference; kernels and the ops' PyTorch
    implementations agree on every output. The backward divides the off-slot columns by lse_V here: by
    lse_tail = -inf, every -inf column's gradient would be NaN (-inf - -inf), and with the guard on
    1 - P gone the slot columns would carry (1 - P) q_k more."""
    N, K, V, H = 4, 3, 8, 5
    g = torch.Generator().manual_seed(0)
    cols = torch.tensor([1, 4, 6])
    ids = torch.stack([cols[torch.randperm(K, generator=g)] for _ in range(N)])
    t = torch.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), -1) + math.log(0.9)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.full((V,), -math.inf, dtype=torch.float64)
    b[cols] = torch.randn(K, generator=g, dtype=torch.float64)
    z = h @ w.t() + b
    d = dict(ids=ids, t=t, m=torch.ones(N, K, dtype=torch.bool), z=z, h=h, w=w, b=b, labels=ids[:, 0].clone())
    d = {k: v.to(DEVICE) for k, v in d.items()}
    logits, hidden = _kernels_and_reference(d, ref.NORMALIZE["tail"])
    for a, b_ in zip(logits[0] + hidden[0], logits[1] + hidden[1]):
        torch.testing.assert_close(a, b_.to(a.dtype), rtol=1e-9, atol=1e-12, equal_nan=True)
    zf = leaf(d["z"])
    full = ref.topk_kd_loss_from_logits(zf, d["ids"], d["t"], normalize="full", reduction="sum")[1]
    (want_g,) = torch.autograd.grad(full.sum(), [zf])
    om_p = 1 - d["t"].exp().sum(-1)
    want_tok = full.detach() + om_p * (om_p.log() - math.log(torch.finfo(torch.float64).tiny))
    x = leaf(d["z"])
    loss, tok = sparsefuse.topk_kd_loss_from_logits(x, d["ids"], d["t"], normalize="tail", reduction="sum",
                                                    return_per_token=True)
    (got_g,) = torch.autograd.grad(loss, [x])
    assert_close(tok, want_tok, torch.float64, "per-token loss")
    assert_close(got_g, want_g, torch.float64, "gradient")


def test_reference_topk_gradient_with_large_logits():
    """reference.kd_logits_bwd (the CPU implementation without the interpreter) gets lse = 0 for "topk";
    its dense term 0 * exp(z) overflowed float32 past z = 88 and made the row NaN."""
    d = make(5, 3, 37, dtype=torch.float32)
    z = d["z"] + 100
    _, _, scale, lse, A, corr = ref.kd_logits_fwd(z, d["ids"], d["t"], d["m"], 0, 1.0, 1, None, 1.0)
    g = ref.kd_logits_bwd(torch.ones((), device=DEVICE), None, z, d["ids"], d["m"], lse, A, corr, scale, 0, 1.0)
    z64 = leaf(z.double())
    (want,) = torch.autograd.grad(ref.topk_kd_loss_from_logits(z64, d["ids"], d["t"].double(), d["m"],
                                                               normalize="topk")[0], z64)
    assert_close(g, want, torch.float32, "grad")


def test_bad_inputs():
    d = make(5, 3, 37, dtype=torch.float32)
    z, ids, t, m = d["z"], d["ids"], d["t"], d["m"]
    with pytest.raises(ValueError, match="normalize must be one of"):
        sparsefuse.topk_kd_loss_from_logits(z, ids, t, m, normalize="kl")
    with pytest.raises(ValueError, match="temperature must be a positive"):
        sparsefuse.topk_kd_loss_from_logits(z, ids, t, m, temperature=0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        sparsefuse.topk_kd_loss(z[:, :3], t, m, reduction="none")
    with pytest.raises(ValueError, match="target_logprobs has shape"):
        sparsefuse.topk_kd_loss_from_logits(z, ids, t[:, :2], m)
    with pytest.raises(ValueError, match="logits has shape"):
        sparsefuse.topk_kd_loss_from_logits(z[:4], ids, t, m)
    with pytest.raises(TypeError, match="target_token_ids has dtype float32"):
        sparsefuse.topk_kd_loss_from_logits(z, ids.float(), t, m)
    with pytest.raises(TypeError, match="target_mask has dtype complex64"):  # was read as "non-zero"
        sparsefuse.topk_kd_loss_from_logits(z, ids, t, m.to(torch.complex64))
    for mask in (m.to(torch.uint8), m.int(), m.float()):  # 0/1 in any real dtype
        torch.testing.assert_close(sparsefuse.topk_kd_loss_from_logits(z, ids, t, mask),
                                   sparsefuse.topk_kd_loss_from_logits(z, ids, t, m))
    with pytest.raises(ValueError, match="student_logits_topk has shape"):
        sparsefuse.topk_kd_loss(z, t, m)
    with pytest.raises(TypeError, match="hidden has dtype float64 and lm_head_weight float32; they must match"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"].double(), d["w"], ids, t, m)
    with pytest.raises(TypeError, match="hidden has dtype int64; expected one of float16"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"].long(), d["w"], ids, t, m)
    with pytest.raises(ValueError, match="ce_weight is set but labels is None"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], ids, t, m, ce_weight=1.0)
    with pytest.raises(ValueError, match=r"hidden has shape \(5, 12\); expected \[\.\.\., 11\]"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"][:, :11], ids, t, m)
    with pytest.raises(ValueError, match=r"logits must have a vocabulary dimension V >= 1"):
        sparsefuse.topk_kd_loss_from_logits(z[:, :0], ids, t, m)
    with pytest.raises(ValueError, match=r"lm_head_weight must have at least one row \(V >= 1\)"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"][:0], ids, t, m)
    with pytest.raises(ValueError, match=r"labels has shape \(4,\); expected \[5\]"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], ids, t, m, labels=d["labels"][:4], ce_weight=1.0)
    with pytest.raises(TypeError, match="lm_head_bias has dtype float64; expected one of float32"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], ids, t, m, lm_head_bias=d["b"].double())


def test_more_slots_than_the_kernels_take():
    """Where the kernels run (CUDA, the interpreter), the logits and hidden-state forms refuse more
    than MAX_SLOTS teacher slots with a message that names the limit and the way out: their
    backward's [K, K] tile compiled for minutes at K = 1024 and failed at K = 8192 on an H200. The
    PyTorch reference path (CPU without the interpreter) has no such limit; MAX_SLOTS itself runs."""
    from sparsefuse.kd import ops as kd_ops

    K = kd_ops.MAX_SLOTS + 1
    d = make(2, K, K + 3, H=4, dtype=torch.float32)
    kernels_run = DEVICE != "cpu" or sparsefuse._registry.INTERPRET
    msg = (rf"target_token_ids has {K} slots per token; the logits and hidden-state forms take at most "
           rf"{K - 1} on the GPU \(their kernels compare every pair of slots\)\. Keep the teacher's top {K - 1}, "
           r"or gather the student's logits at the ids and use topk_kd_loss")
    for fn in (lambda: sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"]),
               lambda: sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"])):
        if kernels_run:
            with pytest.raises(ValueError, match=msg):
                fn()
        else:
            assert torch.isfinite(fn())
    assert torch.isfinite(sparsefuse.topk_kd_loss(d["z"][:, :K], d["t"], d["m"]))  # the gathered form: any K
    e = make(2, K - 1, K + 3, H=4, dtype=torch.float32)
    assert torch.isfinite(sparsefuse.topk_kd_loss_from_logits(e["z"], e["ids"], e["t"], e["m"]))


def test_module_under_compile():
    """TopKKDLoss picks its form from its arguments (a floating second argument means gathered
    log-probs): under torch.compile(fullgraph=True) each form gives eager mode's loss and gradients."""
    d = make(6, 3, 37, dtype=torch.float32, dup=False)
    tail, topk = sparsefuse.TopKKDLoss(normalize="tail", temperature=1.5), sparsefuse.TopKKDLoss(normalize="topk")

    def fn(z, h, w, b):
        return (tail(z, d["ids"], d["t"], d["m"]) + topk(z[:, :3], d["t"], d["m"])
                + tail(h, d["ids"], d["t"], d["m"], lm_head_weight=w, lm_head_bias=b))

    params = [leaf(d["z"]), leaf(d["h"]), leaf(d["w"]), leaf(d["b"])]
    want = grads(fn(*params), params)
    params = [leaf(d["z"]), leaf(d["h"]), leaf(d["w"]), leaf(d["b"])]
    torch._dynamo.reset()
    got = grads(torch.compile(fn, fullgraph=True)(*params), params)
    compare(got, want, torch.float32, ["loss", "grad_z", "grad_h", "grad_w", "grad_b"])


def test_module_refuses_options_of_the_hidden_form():
    """lm_head_bias, labels and ce_weight only act in the hidden-state form; elsewhere they were once
    ignored silently."""
    d = make(5, 3, 37, dtype=torch.float32)
    args = (d["z"], d["ids"], d["t"], d["m"])
    with pytest.raises(ValueError, match="TopKKDLoss: ce_weight=0.5 is used by the hidden-state form only; pass "
                                         "lm_head_weight"):
        sparsefuse.TopKKDLoss(ce_weight=0.5)(*args)
    with pytest.raises(ValueError, match="TopKKDLoss: labels is used by the hidden-state form only"):
        sparsefuse.TopKKDLoss()(*args, labels=d["labels"])
    with pytest.raises(ValueError, match="TopKKDLoss: lm_head_bias is used by the hidden-state form only"):
        sparsefuse.TopKKDLoss()(*args, lm_head_bias=d["b"])
    with pytest.raises(ValueError, match="TopKKDLoss: labels is used by the hidden-state form only"):
        sparsefuse.TopKKDLoss(normalize="topk")(d["z"][:, :3], d["t"], d["m"], labels=d["labels"])


def test_module_with_ce_weight_zero_takes_every_form():
    """TopKKDLoss(ce_weight=0) keeps the cross-entropy term off (a schedule that starts it later) and is
    not an option of the hidden form only: the gathered and logits forms take it as without ce_weight."""
    d = make(5, 3, 37, dtype=torch.float32, dup=False)
    zk = d["z"][:, :3]
    for ce_weight in (0, 0.0):
        crit = sparsefuse.TopKKDLoss(normalize="tail", ce_weight=ce_weight)
        assert torch.equal(crit(d["z"], d["ids"], d["t"], d["m"]),
                           sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], d["t"], d["m"], normalize="tail"))
        assert torch.equal(crit(d["h"], d["ids"], d["t"], d["m"], lm_head_weight=d["w"], labels=d["labels"]),
                           sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"],
                                                               normalize="tail"))
        crit = sparsefuse.TopKKDLoss(normalize="topk", ce_weight=ce_weight)
        assert torch.equal(crit(zk, d["t"], d["m"]), sparsefuse.topk_kd_loss(zk, d["t"], d["m"]))


def test_trainable_teacher_logprobs_are_refused():
    """The teacher is fixed: no gradient reaches target_logprobs (the reference would give one)."""
    d = make(5, 3, 37, dtype=torch.float32)
    t = leaf(d["t"])
    forms = (lambda t: sparsefuse.topk_kd_loss(d["z"][:, :3], t, d["m"]),
             lambda t: sparsefuse.topk_kd_loss_from_logits(d["z"], d["ids"], t, d["m"]),
             lambda t: sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], t, d["m"]))
    for form in forms:
        with pytest.raises(ValueError, match=r"target_logprobs requires grad, but the teacher is treated as fixed "
                                             r".*pass target_logprobs.detach\(\)"):
            form(t)
        with torch.no_grad():
            assert_close(form(t), form(t.detach()), torch.float32, "under no_grad")


def test_scalar_options_are_checked():
    np = pytest.importorskip("numpy")
    d = make(5, 3, 37, dtype=torch.float32)
    args = (d["z"], d["ids"], d["t"], d["m"])
    f = sparsefuse.topk_kd_loss_from_logits
    assert_close(f(*args, temperature=np.float32(2.0)), f(*args, temperature=2.0), torch.float32, "numpy T")
    for bad in (True, -1.0, float("inf"), float("nan"), "2"):
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            f(*args, temperature=bad)
    with pytest.raises(TypeError, match="temperature must be a Python number, not a tensor"):
        f(*args, temperature=torch.tensor(2.0))

    def hid(**kw):
        return sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"], labels=d["labels"], **kw)

    assert_close(hid(ce_weight=np.float64(0.5), chunk_size=np.int64(2)), hid(ce_weight=0.5), torch.float32, "numpy")
    for bad in (-0.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="ce_weight must be a non-negative finite number"):
            hid(ce_weight=bad)
    # labels without ce_weight added nothing, without a word; ce_weight=0 still turns the term off
    msg = "labels are given but ce_weight is not: pass ce_weight > 0 to add their cross-entropy"
    with pytest.raises(ValueError, match=re.escape(msg)):
        hid()
    with pytest.raises(ValueError, match=re.escape(msg)):
        sparsefuse.TopKKDLoss()(d["h"], d["ids"], d["t"], d["m"], lm_head_weight=d["w"], labels=d["labels"])
    assert torch.equal(hid(ce_weight=0), sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"]))
    with pytest.raises(TypeError, match="ce_weight must be a Python number, not a tensor"):
        hid(ce_weight=torch.tensor(0.5))
    with pytest.raises(ValueError, match="ce_weight must be a non-negative finite number"):
        sparsefuse.TopKKDLoss(ce_weight=float("nan"))
    # the module's other options are refused when it is built, not at its first call
    for kw, msg in ((dict(normalize="x"), "normalize must be one of ('topk', 'full', 'tail'), got 'x'"),
                    (dict(temperature=-1), "temperature must be a positive finite number, got -1"),
                    (dict(temperature=float("inf")), "temperature must be a positive finite number, got inf"),
                    (dict(reduction="none"), "reduction must be one of ('mean', 'sum'), got 'none'")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            sparsefuse.TopKKDLoss(**kw)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=r"chunk_size must be a positive integer or None \(automatic\)"):
            hid(chunk_size=bad, ce_weight=0.5)
        with pytest.raises(ValueError, match=r"chunk_size must be a positive integer or None \(automatic\)"):
            sparsefuse.TopKKDLoss(chunk_size=bad)  # was accepted, and refused at the first hidden-form call


def test_weight_grad_configs_share_one_block_e():
    """BLOCK_E sets the order in which the weight-gradient kernel sums a row's slots; autotuned, it
    made the gradient differ between processes (on an H200, BLOCK_E = 64 against 32: up to 3e-5). It
    is fixed (kernels._WG_BLOCK_E); the GPU configs vary the tile width and pipelining only. The GPU
    test below runs every config."""
    from sparsefuse.kd import kernels

    assert len(kernels.WG_GPU_CONFIGS) > 1
    assert all("BLOCK_E" not in c.kwargs for c in kernels.WG_GPU_CONFIGS)


def test_weight_grad_interleaved_tiles():
    """The LM-head weight gradient's vocab tiles interleave the ids (tile t holds t, t + n_tiles, ...),
    so the frequent small ids of a real teacher spread over many programs. Against index_add, with
    V not a multiple of the tile, frequent ids, masked slots, and ids outside [0, V) that must add
    nothing (index checks off)."""
    from sparsefuse.kd import kernels

    gen = torch.Generator().manual_seed(0)
    N, H, V, K = 29, 5, 37, 4
    ids = torch.randint(0, V, (N, K), generator=gen)
    ids[:, 0], ids[::2, 1] = 1, 0  # frequent ids
    ids[3, 2], ids[4, 2], ids[5, 2] = V, -1, 60  # out of range (60 is past every tile)
    mask = torch.rand(N, K, generator=gen) > 0.2
    h = torch.randn(N, H, generator=gen, dtype=torch.float64)
    g = torch.randn(N, K, generator=gen, dtype=torch.float64)
    ids, mask, h, g = (t.to(DEVICE) for t in (ids, mask, h, g))
    got = kernels.lm_weight_grad(ids, mask, g, h, V, torch.float64, alpha=2.0)
    keep = (mask & (ids >= 0) & (ids < V)).reshape(-1)
    rows = (g[..., None] * h[:, None, :]).reshape(-1, H)[keep]
    want = torch.zeros(V, H, dtype=torch.float64, device=DEVICE).index_add_(0, ids.reshape(-1)[keep], rows) * 2
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16],
                         ids=lambda d: str(d)[6:])
def test_weight_grad_of_16_bit_hidden_keeps_the_fp32_slot_gradients(dtype):
    """16-bit hidden states meet the fp32 slot gradients g on the matrix unit as g's 16-bit head plus
    its 16-bit remainder, so the products carry g to about 2^-22 (fp16) or 2^-16 (bf16) of itself.
    g = 1 + O(1e-3) has no 16-bit value: without the remainder each product is off by up to 2^-12
    (fp16) or 2^-9 (bf16) of itself. (bf16 only on a GPU: the interpreter's bf16 arithmetic is not
    exact.)"""
    from sparsefuse.kd import kernels

    gen = torch.Generator().manual_seed(0)
    N, H, V, K = 29, 5, 37, 4
    ids = torch.randint(0, V, (N, K), generator=gen)
    mask = torch.ones(N, K, dtype=torch.bool)
    h = torch.randn(N, H, generator=gen).to(dtype)
    g = 1 + 1e-3 * torch.randn(N, K, generator=gen)
    ids, mask, h, g = (t.to(DEVICE) for t in (ids, mask, h, g))
    got = kernels.lm_weight_grad(ids, mask, g, h, V, torch.float32).double()
    terms = g.double()[..., None] * h.double()[:, None, :]
    flat = ids.reshape(-1)
    want = torch.zeros(V, H, dtype=torch.float64, device=DEVICE).index_add_(0, flat, terms.reshape(-1, H))
    scale = torch.zeros(V, H, dtype=torch.float64, device=DEVICE).index_add_(0, flat, terms.abs().reshape(-1, H))
    err = ((got - want).abs() / scale.clamp_min(1e-30)).max().item()
    assert err < (2e-6 if dtype == torch.float16 else 1e-4), err


def test_missing_targets_are_named():
    d = make(5, 3, 37, dtype=torch.float32)
    z, ids, t, m = d["z"], d["ids"], d["t"], d["m"]
    with pytest.raises(TypeError, match="target_token_ids must be a tensor, got None"):
        sparsefuse.topk_kd_loss_from_logits(z, None, t, m)
    with pytest.raises(TypeError, match="target_token_ids must be a tensor, got None"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], None, t, m)
    with pytest.raises(TypeError, match="target_logprobs must be a tensor, got None"):
        sparsefuse.topk_kd_loss_from_logits(z, ids, None, m)
    with pytest.raises(TypeError, match="target_logprobs must be a tensor, got None"):
        sparsefuse.topk_kd_loss(z[:, :3], None, m)


def test_gathered_needs_a_k_dimension():
    with pytest.raises(ValueError, match=r"target_logprobs must end in a K >= 1 dimension, got shape \(3, 0\)"):
        sparsefuse.topk_kd_loss(torch.randn(3, 0), torch.randn(3, 0))
    with pytest.raises(ValueError, match=r"target_logprobs must end in a K >= 1 dimension, got shape \(\)"):
        sparsefuse.topk_kd_loss(torch.randn(()), torch.randn(()))


def test_num_items_in_batch_is_checked():
    d = make(5, 3, 37, dtype=torch.float32)
    args = (d["z"], d["ids"], d["t"], d["m"])
    with pytest.raises(ValueError, match=r"num_items_in_batch must hold one element, got shape \(2,\)"):
        sparsefuse.topk_kd_loss_from_logits(*args, num_items_in_batch=torch.tensor([3.0, 4.0], device=DEVICE))
    with pytest.raises(ValueError, match="num_items_in_batch is on meta but the other inputs are on"):
        sparsefuse.topk_kd_loss_from_logits(*args, num_items_in_batch=torch.tensor(3.0, device="meta"))
    for bad in (0, -2.0, float("nan"), float("inf"), True, "7"):
        with pytest.raises(ValueError, match="num_items_in_batch must be a positive finite number"):
            sparsefuse.topk_kd_loss(d["z"][:, :3], d["t"], d["m"], num_items_in_batch=bad)
    with pytest.raises(ValueError, match="reduction must be one of"):
        sparsefuse.topk_kd_loss_from_hidden(d["h"], d["w"], d["ids"], d["t"], d["m"], reduction="bogus",
                                            num_items_in_batch=7)
    one = torch.ones(1, 1, device=DEVICE)  # any one-element shape will do
    got = sparsefuse.topk_kd_loss_from_logits(*args, num_items_in_batch=7 * one)
    assert_close(got, sparsefuse.topk_kd_loss_from_logits(*args, num_items_in_batch=7), torch.float32, "items")


def test_cpu_reference_path_raises_the_same_index_error():
    """Without TRITON_INTERPRET, CPU tensors take the PyTorch reference: the ops range-check the ids
    and labels (and, for "tail", look for repeated ids) before either implementation runs, so the
    error is the documented IndexError (ValueError)."""
    code = r"""
import pytest, torch, sparsefuse, sparsefuse._registry as r
assert not r.INTERPRET
z, h, w = torch.randn(2, 5), torch.randn(2, 3), torch.randn(5, 3)
ids, t = torch.tensor([[0, 5], [1, 2]]), torch.zeros(2, 2)
with pytest.raises(IndexError, match=r"target_token_ids holds 5, outside \[0, 5\)"):
    sparsefuse.topk_kd_loss_from_logits(z, ids, t)
for normalize in ("topk", "full"):
    with pytest.raises(IndexError, match=r"target_token_ids holds 5, outside \[0, 5\)"):
        sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, normalize=normalize)
with pytest.raises(IndexError, match=r"labels holds 7, outside \[0, 5\)"):
    sparsefuse.topk_kd_loss_from_hidden(h, w, ids % 5, t, labels=torch.tensor([7, -100]), ce_weight=1.0)
for call in (lambda ids: sparsefuse.topk_kd_loss_from_logits(z, ids, t, normalize="tail"),
             lambda ids: sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, normalize="tail")):
    with pytest.raises(ValueError, match="target_token_ids repeats id 1 among the unmasked slots of token 1"):
        call(torch.tensor([[0, 3], [1, 1]]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_profile_runs(monkeypatch, capsys):
    """``python -m sparsefuse.kd.profile`` (GPU) calls kernels and launchers by name: run every stage
    once on tiny inputs, timing stubbed out, so a renamed kernel or a changed signature fails
    here (the row forward once took one output fewer than the launcher unpacks)."""
    from sparsefuse.kd import profile

    monkeypatch.setattr(profile, "do_bench", lambda fn, **kw: (fn(), 1.0)[1])
    profile.main(N=6, H=8, V=20, K=2, dtype=torch.float32, dev=DEVICE, iters=1)
    out = capsys.readouterr().out
    assert "failed" not in out and "ratio 5.000" in out and "host torch.empty x2" in out, out


# --- GPU tier -------------------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("normalize", NORMS)
@pytest.mark.parametrize("N,K,V", [(300, 64, 5003), (17, 128, 128256)])
def test_gpu_from_logits(N, K, V, normalize, dtype):
    d = make(N, K, V, dtype=dtype, device="cuda", dup=normalize != "tail")
    z = leaf(d["z"])
    got = grads(sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], normalize=normalize,
                                                    temperature=1.3), [z])
    z64 = leaf(d["z"].double())
    want = grads(ref.topk_kd_loss_from_logits(z64, d["ids"], d["t"].double(), d["m"], normalize=normalize,
                                              temperature=1.3)[0], [z64])
    compare(got, want, dtype, ["loss", "grad"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_gathered(dtype):
    d = make(8192, 64, 4096, dtype=dtype, device="cuda")
    zk = leaf(d["z"][:, :64].contiguous())
    got = grads(sparsefuse.topk_kd_loss(zk, d["t"], d["m"], temperature=2.0), [zk])
    z64 = leaf(zk.double())
    want = grads(ref.topk_kd_loss(z64, d["t"].double(), d["m"], temperature=2.0)[0], [z64])
    compare(got, want, dtype, ["loss", "grad"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("normalize,ce_weight", [("full", 0.0), ("tail", 0.5), ("topk", 0.0), ("topk", 0.5)])
def test_gpu_from_hidden(normalize, ce_weight, dtype):
    d = make(700, 64, 32011, H=256, dtype=dtype, device="cuda", dup=normalize != "tail")
    h, w, b = leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    kw = dict(normalize=normalize, temperature=1.5, lm_head_bias=b, labels=d["labels"], ce_weight=ce_weight)
    got = grads(sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], chunk_size=256, **kw), [h, w, b])
    p64 = [leaf(x.double()) for x in (d["h"], d["w"], d["b"])]
    kw["lm_head_bias"] = p64[2]
    want = grads(ref.topk_kd_loss_from_hidden(p64[0], p64[1], d["ids"], d["t"].double(), d["m"], **kw)[0], p64)
    compare(got, want, dtype, ["loss", "grad_hidden", "grad_weight", "grad_bias"], scale=2)


@pytest.mark.gpu
def test_gpu_compile_and_hidden_equals_logits():
    d = make(512, 64, 50000, H=128, dtype=torch.bfloat16, device="cuda", dup=False)
    fn = lambda h, w: sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], normalize="tail")  # noqa
    h, w = leaf(d["h"]), leaf(d["w"])
    a = grads(torch.compile(fn, fullgraph=True)(h, w), [h, w])
    h2, w2 = leaf(d["h"]), leaf(d["w"])
    b = grads(sparsefuse.topk_kd_loss_from_logits(h2 @ w2.t(), d["ids"], d["t"], d["m"], normalize="tail"), [h2, w2])
    compare(a, b, torch.bfloat16, ["loss", "grad_hidden", "grad_weight"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_weight_grad_is_bitwise_equal_across_configs(dtype, monkeypatch):
    """The LM-head weight gradient ("topk" from hidden states) is deterministic whichever config the
    autotuner picks: every config in kernels.WG_GPU_CONFIGS gives the same bits. About 650 slots per
    id make the sums long."""
    from sparsefuse import _launch
    from sparsefuse.kd import kernels

    gen = torch.Generator("cuda").manual_seed(0)
    N, H, V, K = 4096, 512, 1000, 8
    h = torch.randn(N, H, device="cuda", generator=gen).to(dtype)
    ids = torch.randint(0, 50, (N, K), device="cuda", generator=gen)
    mask = torch.rand(N, K, device="cuda", generator=gen) > 0.1
    g = torch.randn(N, K, device="cuda", generator=gen)  # dL/dz at the slots, float32 as in hidden_fwd
    outs = []
    for cfg in kernels.WG_GPU_CONFIGS:
        monkeypatch.setattr(kernels._kd_weight_grad_kernel, "configs", [cfg])  # one config: no tuning
        monkeypatch.setattr(_launch, "_TUNED", {})
        outs.append(kernels.lm_weight_grad(ids, mask, g, h, V, dtype))
    assert torch.isfinite(outs[0]).all() and (outs[0][:50] != 0).any(-1).all() and (outs[0][50:] == 0).all()
    for cfg, out in zip(kernels.WG_GPU_CONFIGS[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"{cfg} differs from {kernels.WG_GPU_CONFIGS[0]}"


# --- offsets past 2^31 (GPU tier; a tiny run of the same checks is in the CPU tier) ----------------
# Every kernel multiplies a row index by a row length in int64 (kernels.py, module doc). These
# inputs put rows of the logits, of the LM head and of the hidden states past 2^31 and past 2^32
# elements: a row offset wrapped in int32 would point before the tensor (past 2^31) or onto another
# row (past 2^32). Rows are independent random data, so a wrapped read gives another loss and
# gradient, and outputs start as NaN (conftest), so a wrapped write leaves its true row NaN.

_I31, _I32 = 2**31, 2**32


def _edge_rows(n, stride):
    """Row 0, n // 2, n - 1 and the rows on either side of where row * stride reaches 2^31 and 2^32."""
    rows = {0, n // 2, n - 1}
    for lim in (_I31, _I32):
        r = -(-lim // stride)  # first row that starts at or past lim
        rows |= {r - 1, r}
    return sorted(r for r in rows if 0 <= r < n)


def _teacher(N, K, V, dtype, gen, first=()):
    """ids [N, K] (slots 0.. hold the distinct ids in ``first``, always unmasked), log-probs, mask on
    gen's device. A slot repeating an earlier slot's id is masked: unmasked ids are distinct, as a
    teacher's are ("tail" requires it)."""
    dev = gen.device
    ids = torch.randint(0, V, (N, K), device=dev, generator=gen)
    if first:
        ids[:, :len(first)] = torch.tensor(first, device=dev)
    m = torch.rand(N, K, device=dev, generator=gen) > 0.25
    m[:, :max(1, len(first))] = True
    earlier = torch.ones(K, K, dtype=torch.bool, device=dev).tril(-1)  # [k, j]: j < k
    m &= ~((ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)
    t = torch.log_softmax(torch.randn(N, K, device=dev, generator=gen, dtype=torch.float64) * 2, -1) - 0.2
    return ids, torch.where(m, t, -1e9).to(dtype), m


def _randn(shape, dtype, gen, scale=1.0):
    x = torch.randn(shape, device=gen.device, dtype=dtype, generator=gen)
    return (x.mul_(scale) if scale != 1.0 else x).requires_grad_()  # in place: no second copy of a big tensor


def _check_logits_rows(N, K, V, normalize, dtype, device):
    """Full logits [N, V]: per-token loss and gradient of the rows in _edge_rows(N, V) against float64
    on those rows only; every gradient row finite (written)."""
    gen = torch.Generator(device).manual_seed(0)
    z = _randn((N, V), dtype, gen)
    ids, t, m = _teacher(N, K, V, dtype, gen, first=(V - 1,))  # slot 0 reads the far end of each row
    loss, tok = sparsefuse.topk_kd_loss_from_logits(z, ids, t, m, normalize=normalize, temperature=1.3,
                                                    reduction="sum", return_per_token=True)
    (g,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(tok).all() and torch.isfinite(g.sum(1, dtype=torch.float32)).all()
    rows = torch.tensor(_edge_rows(N, V), device=device)
    z64 = z.detach()[rows].double().requires_grad_()
    _, tok64 = ref.topk_kd_loss_from_logits(z64, ids[rows], t[rows].double(), m[rows], normalize=normalize,
                                            temperature=1.3, reduction="sum")
    (g64,) = torch.autograd.grad(tok64.sum(), z64)
    compare([tok[rows], g[rows]], [tok64, g64], dtype, ["per-token loss", "grad"])


def _check_hidden_wide_head(N, K, V, H, dtype, device):
    """LM head [V, H], "topk" from hidden (gathers W rows by id, writes every grad_weight row): every
    token's slots include the head rows in _edge_rows(V, H). Against float64 on the gathered rows
    only; grad_weight zero elsewhere. The incoming gradient 2.5 makes the backward rescale all V * H
    elements of grad_weight."""
    gen = torch.Generator(device).manual_seed(1)
    h = _randn((N, H), dtype, gen)
    w = _randn((V, H), dtype, gen, H**-0.5)
    ids, t, m = _teacher(N, K, V, dtype, gen, first=_edge_rows(V, H))
    loss = 2.5 * sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, m, normalize="topk", temperature=1.3)
    gh, gw = torch.autograd.grad(loss, [h, w])
    rows, sub_ids = torch.unique(ids, return_inverse=True)
    p64 = [leaf(h.double()), leaf(w.detach()[rows].double())]
    want = grads(2.5 * ref.topk_kd_loss_from_hidden(p64[0], p64[1], sub_ids, t.double(), m, normalize="topk",
                                                    temperature=1.3)[0], p64)
    compare([loss, gh, gw[rows]], want, dtype, ["loss", "grad_hidden", "grad_weight"], scale=2)
    assert torch.count_nonzero(gw.index_fill_(0, rows, 0)) == 0, "grad_weight rows without a slot"


def _check_hidden_long(N, K, V, H, dtype, device):
    """Hidden states [N, H], "topk" from hidden: only the tokens in _edge_rows(N, H) have unmasked slots,
    so the loss and grad_weight come from them alone (float64 reference on those rows); their
    grad_hidden rows are compared and every other row must be zero. The incoming gradient 2.5 makes
    the backward rescale all N * H elements of grad_hidden."""
    gen = torch.Generator(device).manual_seed(2)
    h = _randn((N, H), dtype, gen)
    w = _randn((V, H), dtype, gen, H**-0.5)
    ids, t, m = _teacher(N, K, V, dtype, gen)
    rows = torch.tensor(_edge_rows(N, H), device=device)
    keep = torch.zeros(N, dtype=torch.bool, device=device)
    keep[rows] = True
    m &= keep[:, None]
    loss = 2.5 * sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, m, normalize="topk", temperature=1.3,
                                                     reduction="sum")
    gh, gw = torch.autograd.grad(loss, [h, w])
    p64 = [leaf(h.detach()[rows].double()), leaf(w.double())]
    want = grads(2.5 * ref.topk_kd_loss_from_hidden(p64[0], p64[1], ids[rows], t[rows].double(), m[rows],
                                                    normalize="topk", temperature=1.3, reduction="sum")[0], p64)
    compare([loss, gh[rows], gw], want, dtype, ["loss", "grad_hidden", "grad_weight"], scale=2)
    # any() reduces to one flag; count_nonzero's int64 pass over 4.3e9 elements needed 32 GiB (OOM on an H100)
    assert not gh.index_fill_(0, rows, 0).any(), "grad_hidden rows of fully masked tokens"


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", ["topk", "tail"])
def test_gpu_from_logits_past_2_32(normalize):
    """z [28250, 152064] bf16 (Qwen2 vocabulary): 4.30e9 elements, rows from 14123 start past 2^31 and
    from 28245 past 2^32. About 17.2 GB (z and its gradient, 8.6 GB each)."""
    need_gpu_memory(20)
    _check_logits_rows(28250, 64, 152064, normalize, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_from_hidden_head_past_2_32():
    """LM head [262400, 16384] bf16: 4.30e9 elements, rows from 131072 start at or past 2^31 and from 262144
    past 2^32. About 21.5 GB (W and grad_weight, 8.6 GB each, and a 4.3 GB mask in the zero check)."""
    need_gpu_memory(24)
    _check_hidden_wide_head(64, 32, 262400, 16384, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_from_hidden_tokens_past_2_32():
    """hidden [524300, 8192] bf16: 4.30e9 elements, tokens from 262144 start at or past 2^31 and from
    524288 past 2^32. About 17 GB (hidden and grad_hidden, 8.6 GB each)."""
    need_gpu_memory(24)
    _check_hidden_long(524300, 8, 4096, 8192, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", NORMS)
@pytest.mark.parametrize("items", ["python", "tensor"])
def test_gpu_step_makes_no_host_sync(normalize, items):
    """Every form, forward and backward, with index checks at their default (off on CUDA): no host
    sync, so a distillation step can run ahead of the GPU or be captured in a CUDA graph.
    ``num_items_in_batch`` as a Python number and as a device tensor."""
    d = make(64, 8, 1000, H=32, dtype=torch.bfloat16, device="cuda", dup=normalize != "tail")
    z, h, w, b = leaf(d["z"]), leaf(d["h"]), leaf(d["w"]), leaf(d["b"])
    n = 300 if items == "python" else torch.tensor(300.0, device="cuda")

    def step():
        kw = dict(normalize=normalize, temperature=1.5, num_items_in_batch=n)
        loss = (sparsefuse.topk_kd_loss_from_logits(z, d["ids"], d["t"], d["m"], **kw)
                + sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], lm_head_bias=b,
                                                      labels=d["labels"], ce_weight=0.5, chunk_size=16, **kw)
                # without cross-entropy "topk" takes the gather kernel instead of the vocabulary chunks
                + sparsefuse.topk_kd_loss_from_hidden(h, w, d["ids"], d["t"], d["m"], lm_head_bias=b, **kw)
                + sparsefuse.topk_kd_loss(z[:, :8], d["t"], d["m"], temperature=1.5, num_items_in_batch=n))
        return torch.autograd.grad(loss, [z, h, w, b])

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(g).all() for g in got)


@pytest.mark.parametrize("check,args", [
    (_check_logits_rows, (7, 3, 37, "tail")),
    (_check_hidden_wide_head, (5, 6, 37, 12)),
    (_check_hidden_long, (9, 3, 11, 12)),
], ids=["logits", "hidden-head", "hidden-tokens"])
def test_offset_checks_small(check, args):
    """The checks of the GPU tests above at a tiny size, so that they stay runnable (no row here is
    past 2^31)."""
    check(*args, torch.float32, DEVICE)


@pytest.mark.parametrize("normalize", NORMS)
def test_empty_batch(normalize):
    """N = 0: loss 0 and zero (not NaN) gradients, so an empty shard cannot poison an all-reduce."""
    d = make(5, 3, 37, dtype=torch.float32)
    ids, t, m = d["ids"][:0], d["t"][:0], d["m"][:0]
    z, h, w = leaf(d["z"][:0]), leaf(d["h"][:0]), leaf(d["w"])
    loss = sparsefuse.topk_kd_loss_from_logits(z, ids, t, m, normalize=normalize)
    (gz,) = torch.autograd.grad(loss, z)
    assert loss == 0 and gz.shape == (0, 37)
    loss = sparsefuse.topk_kd_loss_from_hidden(h, w, ids, t, m, normalize=normalize)
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert loss == 0 and gh.shape == (0, 12) and (gw == 0).all()
    zk = leaf(d["z"][:0, :3])
    assert sparsefuse.topk_kd_loss(zk, t, m) == 0


# Rare paths the session 52 mutation pass over KD and VQ found untested (benchmarks/logs/mutation_session52_kd_vq.md).


def _kd_logits_kernels_and_reference(z, ids, t, m, normalize):
    """(tok, grad z) of the logits form from the kernels and from the reference, incoming gradient 1."""
    from sparsefuse.kd import kernels

    code = ref.NORMALIZE[normalize]
    one = torch.ones((), dtype=z.dtype, device=z.device)
    out = []
    for fwd, bwd in ((kernels.logits_fwd, kernels.logits_bwd), (ref.kd_logits_fwd, ref.kd_logits_bwd)):
        _, tok, scale, lse, A, corr = fwd(z, ids, t, m, code, 1.0, 1, None, 1.0)
        out.append((tok, bwd(one, None, z, ids, m, lse, A, corr, scale, code, 1.0)))
    return out


@pytest.mark.parametrize("normalize", ["full", "tail"])
def test_kd_unmasked_padding_slots_on_a_minus_inf_logits_row(normalize):
    """Padding positions whose student logits are all -inf and whose teacher slots are left unmasked:
    token 1 keeps real teacher log-probs (A != 0, lse = -inf: its loss and whole gradient row are NaN),
    token 2 has teacher log-probs of -inf (p = 0). Under "full" token 2 has A = P = 0, so the row
    kernel skips the dense term everywhere, its slot columns included, and its gradient row is 0 as
    in ``reference.dense_grad`` (the slot columns once added 0 * exp(-inf - -inf) = NaN). Token 3 (p =
    0 on a finite row) and token 0 (ordinary) are unaffected."""
    g = torch.Generator().manual_seed(3)
    N, K, V = 4, 3, 11
    z = torch.randn(N, V, generator=g, dtype=torch.float64).to(DEVICE)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)]).to(DEVICE)
    t = (torch.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), -1) - 0.2).to(DEVICE)
    m = torch.ones(N, K, dtype=torch.bool, device=DEVICE)
    z[1] = -math.inf
    z[2] = -math.inf
    t[2] = -math.inf
    t[3] = -math.inf
    (tok, gz), (tok_ref, gz_ref) = _kd_logits_kernels_and_reference(z, ids, t, m, normalize)
    torch.testing.assert_close(tok, tok_ref, rtol=1e-9, atol=1e-12, equal_nan=True)
    torch.testing.assert_close(gz, gz_ref, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert torch.isnan(gz[1]).all()
    assert torch.isfinite(gz[0]).all() and torch.isfinite(gz[3]).all()
    if normalize == "full":
        assert torch.equal(gz[2], torch.zeros_like(gz[2]))
