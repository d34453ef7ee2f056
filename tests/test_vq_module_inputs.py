"""VQ modules and ops under unusual user input: ResidualVQ output rounding, k-means input width, generator type."""

import pytest
import torch

import sparsefuse


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("training", [False, True])
def test_residual_vq_quantized_is_the_decoded_codes(dtype, training):
    """``quantized`` is the sum of the chosen codebook rows, rounded once to x's dtype: what decoding
    the returned codes gives. ``x + (q - x).detach()`` rounded twice (one ulp off in most fp16
    rows, also off in fp32), and a compiled graph, which rounds once, disagreed with eager."""
    torch.manual_seed(0)
    rvq = sparsefuse.ResidualVQ(num_levels=3, dim=8, codebook_size=16).train(training)
    x = (torch.randn(64, 8) * 3).to(dtype).requires_grad_()
    codebook = rvq.codebook.clone()  # before the training step's update
    q, codes, loss = rvq(x)
    decoded = sum(codebook[level][codes[:, level]] for level in range(3)).to(dtype)
    assert torch.equal(q, decoded)
    # the straight-through gradient is still the identity
    g = torch.randn_like(q)
    (q * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("levels", [None, 2])
def test_kmeans_init_refuses_rows_of_another_width(levels):
    """``kmeans_init_`` regrouped any tensor into rows of ``dim`` (x [4, 6] at dim 3 became 8 rows
    of 3) and fitted the codebook to them silently; it now refuses another width by name, as
    ``forward`` does, and changes nothing."""
    torch.manual_seed(0)
    m = (sparsefuse.VectorQuantizer(dim=3, codebook_size=4, kmeans_init=True) if levels is None
         else sparsefuse.ResidualVQ(levels, dim=3, codebook_size=4, kmeans_init=True))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 3\]"):
        m.kmeans_init_(torch.randn(4, 6))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not m._initted
    m.kmeans_init_(torch.randn(2, 5, 3))  # leading dimensions are rows, as in forward
    assert m._initted


def test_generator_of_another_type_is_refused_by_name():
    """A seed passed as ``generator=1234`` failed with "'int' object has no attribute 'device'"
    (``vq_ema_update``) or inside ``torch.randperm`` (k-means); both now name the argument."""
    from sparsefuse.vq import vq_ema_update

    cb = torch.randn(4, 3)
    state = [cb, torch.ones(4), cb.clone(), torch.zeros(4, dtype=torch.int64)]
    before = [t.clone() for t in state]
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        vq_ema_update(torch.randn(5, 3), torch.zeros(5, dtype=torch.int64), *state, threshold=1.0, generator=1234)
    for a, b in zip(state, before):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        sparsefuse.VectorQuantizer(3, 4, kmeans_init=True, generator=1234)
