"""Rare paths of the KD and VQ code that changed since e15eb58 (and of older VQ kernel logic), pinned by
the session 52 mutation pass; ``benchmarks/logs/mutation_session52_kd_vq.md`` lists every mutant and
which of these tests catches it.

- KD row backward, unmasked padding slots on a row of -inf logits: the dense term is skipped where
  A = 0 (a "full" token whose unmasked slots all have teacher probability 0 gets a zero row, slot
  columns included), and only there (A != 0 with lse = -inf leaves the row NaN), as in the reference.
- VQ deterministic statistics with the last code, K - 1, holding whole chunks of sorted rows (the
  chunk kernel's key bound ``nkeys = K``).
- VQ cosine search and its backward with a zero codebook row (the norm clamps: no NaN score hides a
  tile of codes; zero gradient at the zero code).
- VQ quantize with index checks off and a code equal to K (the first past the end): a NaN row, not
  the memory after the codebook.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import DEVICE
from sparsefuse.kd import reference as kd_ref


def _kd_logits_kernels_and_reference(z, ids, t, m, normalize):
    """(tok, grad z) of the logits form from the kernels and from the reference, incoming gradient 1."""
    from sparsefuse.kd import kernels

    code = kd_ref.NORMALIZE[normalize]
    one = torch.ones((), dtype=z.dtype, device=z.device)
    out = []
    for fwd, bwd in ((kernels.logits_fwd, kernels.logits_bwd), (kd_ref.kd_logits_fwd, kd_ref.kd_logits_bwd)):
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


@pytest.mark.parametrize("num_codes", [1, 3])
def test_vq_deterministic_statistics_of_a_crowded_last_code(num_codes):
    """The deterministic statistics take each whole chunk of sorted rows that holds one code from the
    chunk kernel's partial sums; the chunk kernel sums the chunks of codes in [0, K). The last code,
    K - 1, holding whole chunks (130 rows at the default chunk of 64) must be summed like any other
    (test_vq's crowded-code test crowds a middle code)."""
    from sparsefuse.vq import batch_statistics
    from sparsefuse.vq import reference as vq_ref

    g = torch.Generator().manual_seed(5)
    B, D = 130, 5
    x = torch.randn(B, D, generator=g).to(DEVICE)
    codes = torch.full((B,), num_codes - 1, dtype=torch.int64)
    codes[:3] = torch.arange(3) % num_codes
    codes = codes.to(DEVICE)
    n, s = batch_statistics(x, codes, num_codes, deterministic=True)
    want_n, want_s = vq_ref.ema_accumulate(x[None].double(), codes[None], num_codes)
    assert torch.equal(n, want_n[0].float())
    torch.testing.assert_close(s, want_s[0].float(), rtol=1e-5, atol=1e-5)


def test_vq_cosine_search_with_a_zero_code():
    """A zero codebook row under ``cosine=True``: its norm is clamped (1e-24 in the search, 1e-12 in the
    backward), so its score is 0 (cos = 0, dist 2) instead of 0 / 0 = NaN. Unclamped, the NaN score
    broke the minimum of the zero code's tile of 16 codes (under the interpreter the rows nearest codes
    16, 18 and 19 got the zero code, and the rows that should get it got others).
    Rows in the negative orthant against a positive codebook pick the zero code (every other cos < 0),
    and ``dist``'s gradient there is 0 for the row and the code, as ``nearest_code``'s backward
    documents, not NaN."""
    from sparsefuse.vq import nearest_code
    from sparsefuse.vq import reference as vq_ref

    g = torch.Generator().manual_seed(7)
    K, D = 20, 4  # two code tiles of 16 under the interpreter; the zero code in the second
    codebook = torch.rand(K, D, generator=g) + 0.1
    codebook[17] = 0
    x = torch.cat([codebook[[16, 18, 19, 3]] * 2.0,  # best codes in and out of the zero code's tile
                   -(torch.rand(3, D, generator=g) + 0.1)])  # every cos < 0: the zero code
    x, codebook = x.to(DEVICE).requires_grad_(), codebook.to(DEVICE).requires_grad_()
    codes, dist = nearest_code(x, codebook, cosine=True)
    want_codes, want_dist = vq_ref.nearest_code(x.detach(), codebook.detach(), cosine=True)
    assert codes.tolist() == want_codes.tolist() == [16, 18, 19, 3, 17, 17, 17]
    torch.testing.assert_close(dist, want_dist, rtol=1e-5, atol=1e-5)
    gx, gc = torch.autograd.grad(dist.sum(), [x, codebook])
    assert torch.isfinite(gx).all() and torch.isfinite(gc).all()
    assert torch.equal(gx[4:], torch.zeros_like(gx[4:])) and torch.equal(gc[17], torch.zeros_like(gc[17]))


def test_vq_quantize_code_equal_to_k_without_index_checks():
    """With index checks off a code outside [0, K) is never dereferenced and its row of ``out`` is NaN;
    test_vq checks 1000 and -1, this the first code past the end, K itself. The codebook is the first
    K rows of a larger buffer, so reading row K would return a real (finite) row."""
    import sparsefuse
    from sparsefuse.vq import quantize

    g = torch.Generator().manual_seed(11)
    K, D = 5, 3
    buf = torch.randn(K + 1, D, generator=g).to(DEVICE)
    codebook = buf[:K]
    x = torch.randn(6, D, generator=g).to(DEVICE)
    codes = torch.tensor([0, 4, K, 2, 1, 3], device=DEVICE)
    sparsefuse.set_index_checks(False)
    try:
        out, loss = quantize(x, codes, codebook, 0.5)
    finally:
        sparsefuse.set_index_checks(None)
    ok = codes != K
    assert out[2].isnan().all() and loss.isnan()
    assert torch.equal(out[ok], codebook[codes[ok]])
