"""VQ codebook ops: EMA update (both semantics, levels, restarts), nearest-code search, modules.

CPU tier: the Triton kernels under the interpreter against ``sparsefuse.vq.reference`` run in
float64. GPU tier (``-m gpu``): every x dtype and the benchmark shapes.
"""

import copy
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import sparsefuse
from helpers import DEVICE, assert_close, assert_compile_parity, need_gpu_memory
from sparsefuse.compat import ema_update as compat_ema_update
from sparsefuse.vq import (ResidualVQ, VectorQuantizer, batch_statistics, nearest_code, quantize, reference,
                           vq_ema_update)


def make(B, K, D, *, L=None, dtype=torch.float32, device=DEVICE, seed=0, used=None):
    """Random state; ``used`` limits the codes drawn to the first ``used`` ids."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lead = () if L is None else (L,)
    x = torch.randn(*lead, B, D, generator=g)
    codes = torch.randint(0, used or K, (*lead, B), generator=g)
    codebook = torch.randn(*lead, K, D, generator=g)
    cs = torch.rand(*lead, K, generator=g) * 4
    es = codebook * cs[..., None] + 0.1 * torch.randn(*lead, K, D, generator=g)
    cnt = torch.randint(0, 4, (*lead, K), generator=g)
    return [t.to(device) for t in (x.to(dtype), codes, codebook, cs, es, cnt)]


def restart_options(semantics, threshold=1.5, restart_after=3, reset=None):
    """``vq_ema_update``'s restart options of one semantics (it refuses the other's)."""
    if semantics == "active":
        return dict(semantics=semantics, restart_after_steps=restart_after)
    return dict(semantics=semantics, threshold=threshold, reset_cluster_size=reset)


def run_both(x, codes, state, *, semantics, decay=0.9, threshold=1.5, restart_after=3, reset=None, seed=7,
             deterministic=False, eps=1e-5):
    """(fused state, float64 reference state) after one update from the same generator state; each
    semantics takes its own restart options (the reference ignores the other's)."""
    got = [t.clone() for t in state]
    dev = x.device
    vq_ema_update(x, codes, *got, decay=decay, **restart_options(semantics, threshold, restart_after, reset),
                  generator=torch.Generator(device=dev).manual_seed(seed), deterministic=deterministic, eps=eps)
    want = [t.double() if t.is_floating_point() else t.clone() for t in state]
    reference.ema_update(x.double(), codes, *want, decay=decay, active=semantics == "active", threshold=threshold,
                         reset=reset, restart_after=restart_after, eps=eps,
                         generator=torch.Generator(device=dev).manual_seed(seed))
    return got, want


def assert_state(got, want, dtype=torch.float32, scale=1.0):
    for name, a, b in zip(("codebook", "cluster_size", "embed_sum", "steps_since_active"), got, want):
        if b.is_floating_point():
            assert_close(a, b, dtype, name, scale=scale)
        else:
            assert torch.equal(a, b), f"{name} differs"


def assert_same(a, b, name="value"):
    """Two runs of the same update agree: bit for bit on CPU (the interpreter's atomics add in a
    fixed order); on CUDA the fp32 atomics' summation order varies between runs, so float tensors
    agree to the float32 tolerance there (integer ones still exactly)."""
    if DEVICE == "cpu" or not a.is_floating_point():
        assert torch.equal(a, b), f"{name} differs"
    else:
        assert_close(a, b, torch.float32, name)


SHAPES = [
    pytest.param(37, 11, 20, id="B37-K11-D20"),
    pytest.param(1, 3, 5, id="B1-K3-D5"),
    pytest.param(50, 1, 100, id="B50-K1-D100"),
    pytest.param(5, 50, 1, id="B5-K50-D1"),
    pytest.param(9, 5, 200, id="B9-K5-D200"),  # D past the 128-column tile: the kernels' D loops take two steps
]


@pytest.mark.parametrize("semantics", ["active", "laplace"])
@pytest.mark.parametrize("B,K,D", SHAPES)
def test_ema_update_matches_reference(semantics, B, K, D):
    x, codes, *state = make(B, K, D)
    got, want = run_both(x, codes, state, semantics=semantics)
    assert_state(got, want)


@pytest.mark.parametrize("semantics", ["active", "laplace"])
@pytest.mark.parametrize("decay", [0.0, 1.0, 0.5])
def test_ema_update_decay_extremes(semantics, decay):
    x, codes, *state = make(29, 7, 9)
    got, want = run_both(x, codes, state, semantics=semantics, decay=decay)
    assert_state(got, want)


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_ema_update_large_eps(semantics):
    """eps large enough to matter in float32: the Laplace smoothing (N_k + eps) / (sum N + K eps) * sum N,
    and with "active" the refresh S_k / max(N_k, eps) of used codes whose N_k falls below eps (at the
    default 1e-5 either term is below the float32 tolerance, so the other tests cannot see it)."""
    x, codes, *state = make(29, 7, 9)
    state[1][:3] = 0.05  # codes 0..2: N_k after the blend is 0.0475 + 0.05 n_k, below eps for n_k < 9
    got, want = run_both(x, codes, state, semantics=semantics, decay=0.95, eps=0.5)
    assert_state(got, want)


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_all_codes_active(semantics):
    K = 6
    x, _, *state = make(24, K, 5)
    codes = torch.arange(24, device=x.device) % K
    got, want = run_both(x, codes, state, semantics=semantics, threshold=0.5)
    assert_state(got, want)
    assert (got[3] == 0).all()


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_no_code_active(semantics):
    x, codes, *state = make(0, 5, 4)
    got, want = run_both(x, codes, state, semantics=semantics)
    assert_state(got, want)
    if semantics == "active":  # nothing blends: the state is untouched apart from the counters
        for a, b in zip(got[:3], state[:3]):
            assert torch.equal(a, b)
    assert torch.equal(got[3], state[3] + 1)


def test_restart_rows_are_distinct_rows_of_x():
    B, K, D = 9, 40, 6
    x, codes, *state = make(B, K, D, used=2)  # codes 2.. unused: with threshold 5 almost all are dead
    got, want = run_both(x, codes, state, semantics="laplace", threshold=5.0, reset=5.0)
    assert_state(got, want)
    dead = got[1] == 5.0
    rows = got[0][dead]
    assert dead.sum() > B
    first = rows[:B]  # the first B dead codes take B distinct rows
    match = (first[:, None, :] == x[None, :, :]).all(-1)
    assert torch.equal(match.sum(1), torch.ones(B, dtype=torch.long, device=x.device))
    assert torch.equal(match.sum(0), torch.ones(B, dtype=torch.long, device=x.device))
    # consistent buffers: the next refresh keeps the replacement near its row
    assert_close(got[2][dead], got[0][dead] * 5.0, torch.float32, "embed_sum of restarted codes")


def test_restart_survives_the_step():
    """A dead code's new vector is the row of x, not overwritten by the refresh of the same step."""
    x, codes, *state = make(16, 8, 4, used=1)
    got, _ = run_both(x, codes, state, semantics="laplace", threshold=100.0, reset=1.0)
    assert (got[0][1:, None, :] == x[None]).all(-1).any(1).all()


def test_generator_reproducible():
    x, codes, *state = make(12, 30, 4, used=3)
    det = DEVICE != "cpu"  # on CUDA the atomic sums' order varies between runs: compare the fixed-order path
    a, _ = run_both(x, codes, state, semantics="laplace", threshold=5.0, seed=3, deterministic=det)
    b, _ = run_both(x, codes, state, semantics="laplace", threshold=5.0, seed=3, deterministic=det)
    c, _ = run_both(x, codes, state, semantics="laplace", threshold=5.0, seed=4, deterministic=det)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], c[0])


def test_restart_rows_is_a_permutation():
    key = reference.draw_key(1, "cpu", torch.Generator().manual_seed(0))[0]
    for n in (1, 2, 3, 7, 64, 1000):
        v = reference.restart_rows(key, torch.arange(n), n)
        assert torch.equal(v.sort().values, torch.arange(n))


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_levels_equal_loop_of_single_levels(semantics):
    L, B, K, D = 3, 21, 9, 7
    x, codes, *state = make(B, K, D, L=L, used=5)
    got = [t.clone() for t in state]
    vq_ema_update(x, codes, *got, decay=0.8, **restart_options(semantics, 1.5, 3),
                  generator=torch.Generator(device=DEVICE).manual_seed(5))
    key = reference.draw_key(L, DEVICE, torch.Generator(device=DEVICE).manual_seed(5))
    for level in range(L):
        want = [t[level].double() if t.is_floating_point() else t[level].clone() for t in state]
        reference.ema_update(x[level].double(), codes[level], *want, decay=0.8, active=semantics == "active",
                             threshold=1.5, restart_after=3, key=key[level:level + 1])
        assert_state([t[level] for t in got], want)


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_key_words_path_matches_key_tensor(semantics):
    """The eager CUDA path passes the round keys as four integers; the kernel expands them per level
    exactly as reference.expand_words does."""
    from sparsefuse.vq import kernels

    L, B, K, D = 2, 9, 30, 5
    x, codes, *state = make(B, K, D, L=L, used=3)
    words = (123456789, 987654321, 5, 2**31 - 2)
    a = [t.clone() for t in state]
    b = [t.clone() for t in state]
    det = DEVICE != "cpu"  # on CUDA the atomic sums' order varies between runs: use the fixed-order path
    for st, key in ((a, words), (b, reference.expand_words(words, L, DEVICE))):
        stats = kernels.ema_accumulate(x, codes, st[1], st[3], det)
        kernels.ema_apply(x, st[0], st[1], st[2], st[3], stats, key, 0.9, 1e-5, 2.0, 2.0, 2,
                          semantics == "active", None, 0)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[0], state[0])


def test_restart_keys_are_built_on_the_device():
    """expand_words (the keys of a process-group update on CUDA) computes the keys on the device from
    the four Python ints: no host tensor is copied there (on CUDA a blocking copy every step). Built
    on meta here, under a mode that records every op given a host tensor (0-dim wrapped scalars
    aside, which reach a CUDA kernel as arguments)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class HostInputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            copy = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" and (t.dim() or copy)
                   for t in tree_leaves((args, kwargs))):
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    words = (123456789, 987654321, 5, 2**31 - 2)
    with HostInputs() as mode:
        key = reference.expand_words(words, 3, "meta")
    assert key.shape == (3, 4) and key.dtype == torch.int64
    assert not mode.seen, f"host tensors reached the device: {mode.seen}"
    want = [[(w ^ (level * reference.LEVEL_MUL)) & reference.HASH_MASK for w in words] for level in range(3)]
    assert reference.expand_words(words, 3, "cpu").tolist() == want


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_deterministic_statistics_match(semantics):
    x, codes, *state = make(33, 10, 12, used=6)
    got, want = run_both(x, codes, state, semantics=semantics, deterministic=True)
    assert_state(got, want)


@pytest.mark.parametrize("L", [None, 2])
def test_deterministic_statistics_crowded_code(monkeypatch, L):
    """A collapsing codebook: most rows on code 3. Its segment spans whole chunks of sorted rows
    (chunks of 4 here), summed ahead by the chunk kernel; the update still matches the reference."""
    from sparsefuse import _segsum

    monkeypatch.setattr(_segsum, "MIN_CHUNK", 4)
    x, codes, *state = make(29, 6, 5, L=L)
    codes[..., 2:25] = 3
    got, want = run_both(x, codes, state, semantics="active", deterministic=True)
    assert_state(got, want)


def test_batch_statistics():
    x, codes, *_ = make(31, 6, 5)
    n, s = batch_statistics(x, codes, 6)
    want_n, want_s = reference.ema_accumulate(x[None].double(), codes[None], 6)
    assert_close(n, want_n[0], torch.float32, "n")
    assert_close(s, want_s[0], torch.float32, "s")
    # one code (a k-means of one cluster): every row counts towards it
    n, s = batch_statistics(x, torch.zeros_like(codes), 1)
    assert_close(n, torch.full((1,), 31.0, device=DEVICE), torch.float32, "n of one code")
    assert_close(s, x.double().sum(0, keepdim=True), torch.float32, "s of one code")


def test_reference_statistics_of_float64_x_are_float64():
    """reference.ema_accumulate, the float64 oracle of the update tests (and the CPU path's statistics),
    sums float64 x in float64: here 1e8 + 1 - 1e8 is 1, where a float32 sum gives 0."""
    x = torch.tensor([[[1e8], [1.0], [-1e8], [2.0]]], dtype=torch.float64, device=DEVICE)
    codes = torch.tensor([[0, 0, 0, 1]], device=DEVICE)
    n, s = reference.ema_accumulate(x, codes, 3)
    assert n.dtype == s.dtype == torch.float64
    assert torch.equal(s, torch.tensor([[[1.0], [2.0], [0.0]]], dtype=torch.float64, device=DEVICE))
    assert torch.equal(n, torch.tensor([[3.0, 1.0, 0.0]], dtype=torch.float64, device=DEVICE))


def test_batch_statistics_bad_inputs():
    x, codes, *_ = make(7, 6, 5)
    with pytest.raises(TypeError, match="x must be a tensor, got None"):
        batch_statistics(None, codes, 6)
    with pytest.raises(TypeError, match="codes must be a tensor, got None"):
        batch_statistics(x, None, 6)
    with pytest.raises(ValueError, match=r"x must be \[B, D\] or \[L, B, D\]"):
        batch_statistics(x[:, 0], codes, 6)
    with pytest.raises(ValueError, match="codes has shape"):
        batch_statistics(x, codes[:5], 6)
    with pytest.raises(TypeError, match="codes has dtype float32"):
        batch_statistics(x, codes.float(), 6)
    with pytest.raises(ValueError, match="codes is on meta"):
        batch_statistics(x, codes.to("meta"), 6)
    with pytest.raises(ValueError, match="num_codes must be at least 1"):
        batch_statistics(x, codes, 0)
    for bad in (6.5, True, torch.tensor(6)):  # 6.5 failed inside torch.zeros
        with pytest.raises(ValueError, match=re.escape(f"num_codes must be an int, got {bad!r}")):
            batch_statistics(x, codes, bad)
    sparsefuse.set_index_checks(True)
    try:
        with pytest.raises(IndexError, match=r"codes holds 6, outside \[0, 6\)"):
            batch_statistics(x, torch.full_like(codes, 6), 6)
    finally:
        sparsefuse.set_index_checks(None)


def _workspace_views(ws, L, K, D):
    """(sums, counts slot the next update adds into) of an EMA workspace, which must both be zero."""
    LK, LKD = L * K, L * K * D
    nxt = LKD if ws.parity == 0 else LKD + 3 * LK
    return ws.buf[:LKD], ws.buf[nxt:nxt + LK]


@pytest.mark.parametrize("semantics", ["active", "laplace"])
@pytest.mark.parametrize("L", [None, 2], ids=["single", "L2"])
def test_consecutive_updates_reuse_the_zeroed_workspace(semantics, L):
    """Eager updates share one cached statistics buffer, which each update's apply kernel leaves
    zeroed (sums, and the counts slot of the next update, alternating between two): five steps on
    fresh batches match the float64 reference at every step."""
    from sparsefuse.vq import kernels

    kernels.clear_ema_workspaces()
    B, K, D = 23, 37, 6  # K > the interpreter's 16 codes per apply program: several programs a level
    _, _, *state = make(B, K, D, L=L)
    got = [t.clone() for t in state]
    want = [t.double() if t.is_floating_point() else t.clone() for t in state]
    ws = None
    for step in range(5):
        x, codes, *_ = make(B, K, D, L=L, seed=100 + step, used=K - 20 if step % 2 else None)
        vq_ema_update(x, codes, *got, decay=0.8, **restart_options(semantics, 1.0, 2),
                      generator=torch.Generator(device=DEVICE).manual_seed(step))
        reference.ema_update(x.double(), codes, *want, decay=0.8, active=semantics == "active", threshold=1.0,
                             restart_after=2, generator=torch.Generator(device=DEVICE).manual_seed(step))
        assert_state(got, want)
        now = kernels.ema_workspace(got[0], L or 1, K, D)
        assert ws is None or now is ws, "the update did not reuse its workspace"
        ws = now
        assert ws.parity == (step + 1) % 2 and not ws.dirty
        for part in _workspace_views(ws, L or 1, K, D):
            assert torch.count_nonzero(part) == 0


def test_interrupted_update_recovers_the_workspace(monkeypatch):
    """An update stopped between its two launches leaves partial sums in the workspace; the next
    update sees the dirty flag, re-zeroes it and is exact."""
    from sparsefuse.vq import kernels

    kernels.clear_ema_workspaces()
    B, K, D = 31, 7, 5
    x, codes, *state = make(B, K, D)
    got = [t.clone() for t in state]
    real_apply = kernels.ema_apply

    def failing_apply(*args, **kwargs):
        raise RuntimeError("interrupted between the launches")

    monkeypatch.setattr(kernels, "ema_apply", failing_apply)
    with pytest.raises(RuntimeError, match="interrupted"):
        vq_ema_update(x, codes, *got, decay=0.9, semantics="laplace", threshold=1.5)
    ws = kernels.ema_workspace(got[0], 1, K, D)
    assert ws.dirty and torch.count_nonzero(_workspace_views(ws, 1, K, D)[0]) > 0  # partial sums left behind
    for a, b in zip(got, state):
        assert torch.equal(a, b)  # accumulate alone changes no state
    monkeypatch.setattr(kernels, "ema_apply", real_apply)
    for semantics in ("laplace", "active"):
        got, want = run_both(x, codes, state, semantics=semantics)
        assert_state(got, want)
    assert not ws.dirty


def test_workspace_made_in_inference_mode_serves_later_updates():
    """A workspace first made under torch.inference_mode is a normal tensor, so an update outside
    that mode can still re-zero it in place (after an interruption) and stays exact."""
    from sparsefuse.vq import kernels

    kernels.clear_ema_workspaces()
    x, codes, *state = make(17, 5, 4)
    got = [t.clone() for t in state]
    want = [t.double() if t.is_floating_point() else t.clone() for t in state]
    for step in range(2):
        with torch.inference_mode(step == 0):
            vq_ema_update(x, codes, *got, decay=0.9, semantics="laplace", threshold=1.5,
                          generator=torch.Generator(device=DEVICE).manual_seed(step))
        reference.ema_update(x.double(), codes, *want, decay=0.9, threshold=1.5,
                             generator=torch.Generator(device=DEVICE).manual_seed(step))
        ws = kernels.ema_workspace(got[0], 1, 5, 4)
        assert not ws.buf.is_inference()
        ws.dirty = True  # as after an interrupted update: the next one re-zeroes it in place
        assert_state(got, want)


def test_batch_statistics_unaffected_by_the_workspace():
    """batch_statistics returns fresh buffers (never the update's workspace), before and after
    updates of the same shape, and the updates around it stay exact."""
    from sparsefuse.vq import kernels

    kernels.clear_ema_workspaces()
    B, K, D = 29, 6, 5
    x, codes, *state = make(B, K, D)
    got, want = run_both(x, codes, state, semantics="active")
    assert_state(got, want)
    ws = kernels.ema_workspace(got[0], 1, K, D)
    n, s = batch_statistics(x, codes, K)
    want_n, want_s = reference.ema_accumulate(x[None].double(), codes[None], K)
    assert_close(n, want_n[0], torch.float32, "n")
    assert_close(s, want_s[0], torch.float32, "s")
    assert n.untyped_storage().data_ptr() != ws.buf.untyped_storage().data_ptr()
    x2, codes2, *_ = make(B, K, D, seed=3)
    n2, s2 = batch_statistics(x2, codes2, K)
    assert_close(n, want_n[0], torch.float32, "n after a second call")
    assert_close(s, want_s[0], torch.float32, "s after a second call")
    assert not torch.equal(s2, s)
    got, want = run_both(x2, codes2, got, semantics="laplace")
    assert_state(got, want)


def test_compat_ema_update():
    x, codes, codebook, cs, es, cnt = make(19, 8, 6, used=4)
    a = [codebook.clone(), cs.clone(), es.clone(), cnt.clone()]
    b = [t.clone() for t in a]
    torch.manual_seed(0)
    compat_ema_update(x, codes, a[1], a[2], a[0], a[3], 0.9, 2)
    torch.manual_seed(0)
    vq_ema_update(x, codes, *b, decay=0.9, semantics="active", restart_after_steps=2)
    for name, u, v in zip(("codebook", "cluster_size", "embed_sum", "steps_since_active"), a, b):
        assert_same(u, v, name)


def test_ema_update_bad_inputs():
    x, codes, *state = make(8, 5, 4)
    # CPU tensors are checked by default, CUDA tensors only on request
    sparsefuse.set_index_checks(None if DEVICE == "cpu" else True)
    try:
        with pytest.raises(IndexError, match="codes holds 5"):
            vq_ema_update(x, torch.full_like(codes, 5), *[t.clone() for t in state])
        with pytest.raises(IndexError, match="codes holds -1"):
            vq_ema_update(x, torch.full_like(codes, -1), *[t.clone() for t in state])
    finally:
        sparsefuse.set_index_checks(None)
    with pytest.raises(ValueError, match="x has shape"):
        vq_ema_update(x[:, :3], codes, *state)
    with pytest.raises(ValueError, match="codes has shape"):
        vq_ema_update(x, codes[:3], *state)
    with pytest.raises(TypeError, match="codebook has dtype float64"):
        vq_ema_update(x, codes, state[0].double(), *state[1:])
    with pytest.raises(ValueError, match="x is on meta"):
        vq_ema_update(x.to("meta"), codes, *state)
    with pytest.raises(ValueError, match=re.escape("codebook must have at least one code, got shape (0, 4)")):
        vq_ema_update(x, codes, *[t[:0] for t in state])
    with pytest.raises(ValueError, match="semantics must be one of"):
        vq_ema_update(x, codes, *state, semantics="kmeans")
    with pytest.raises(ValueError, match="needs steps_since_active"):
        vq_ema_update(x, codes, *state[:3], semantics="active", restart_after_steps=2)
    with pytest.raises(ValueError, match="must be contiguous"):
        vq_ema_update(x, codes, state[0].T.contiguous().T, *state[1:])
    for decay in (1.5, -0.1, True):  # (a bool is no decay)
        with pytest.raises(ValueError, match=re.escape(f"decay must lie in [0, 1], got {decay}")):
            vq_ema_update(x, codes, *state, decay=decay)
    with pytest.raises(ValueError, match=re.escape("restart_after_steps must be below 2^24, got 16777216")):
        vq_ema_update(x, codes, *state, semantics="active", restart_after_steps=2**24)
    # eps = 0 with an empty batch made every codebook row NaN (0 / 0); a negative eps was taken as is
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=f"eps must be a positive finite number, got {eps}"):
            vq_ema_update(x[:0], codes[:0], *state, eps=eps)
    # a NaN reset size made every restarted code's N NaN (and with "laplace" every row); a negative
    # one left negative cluster sizes; a NaN threshold switched restarts off; 2.5 steps became 2
    for name, bad in (("threshold", float("nan")), ("threshold", -1.0), ("reset_cluster_size", float("nan")),
                      ("reset_cluster_size", -1.0), ("restart_after_steps", -1), ("restart_after_steps", float("inf"))):
        with pytest.raises(ValueError, match=re.escape(f"{name} must be a non-negative finite number, got {bad}")):
            vq_ema_update(x, codes, *[t.clone() for t in state], **{name: bad})
    with pytest.raises(ValueError, match=re.escape("restart_after_steps must be a whole number of steps, got 2.5")):
        vq_ema_update(x, codes, *state, semantics="active", restart_after_steps=2.5)
    # an option of the other semantics was ignored: "laplace" never restarted by age, "active" never
    # by threshold, and the caller was not told
    with pytest.raises(ValueError, match=re.escape("restart_after_steps applies to semantics='active'; 'laplace' "
                                                   "restarts a code whose cluster_size falls below threshold "
                                                   "(got restart_after_steps=2)")):
        vq_ema_update(x, codes, *state, semantics="laplace", threshold=1.0, restart_after_steps=2)
    for kw in (dict(threshold=1.0), dict(reset_cluster_size=0.0)):
        with pytest.raises(ValueError, match=re.escape("threshold and reset_cluster_size apply to "
                                                       "semantics='laplace'; 'active' restarts a code unused for "
                                                       "restart_after_steps steps (got threshold=")):
            vq_ema_update(x, codes, *state, semantics="active", restart_after_steps=2, **kw)
        with pytest.raises(ValueError, match="apply to semantics='laplace'"):
            VectorQuantizer(4, 8, semantics="active", **kw)
    with pytest.raises(ValueError, match="applies to semantics='active'"):
        VectorQuantizer(4, 8, restart_after_steps=3)
    # a tensor decay was read with float(): a host sync per step
    with pytest.raises(TypeError, match="decay must be a Python number, not a tensor"):
        vq_ema_update(x, codes, *state, decay=torch.tensor(0.9))
    for name in ("threshold", "reset_cluster_size", "restart_after_steps"):
        with pytest.raises(TypeError, match=f"{name} must be a Python number, not a tensor"):
            vq_ema_update(x, codes, *state, **{name: torch.tensor(1.0)})


def test_ema_update_refuses_aliased_tensors():
    """x passed as (a view of) the codebook, or two state buffers sharing memory, gave a wrong state
    without a word: the restart read rows of x the same call had rewritten (in an order that depends
    on the programs', a race on a GPU), and a codebook that is also embed_sum lost the EMA of the
    sums. Any two of x, codes and the state sharing memory now raise; views of separate buffers run."""
    x, codes, *state = make(40, 8, 4, used=3)
    cb, cs, es, cnt = state
    msg = "share memory, but the op rewrites some of them in place while it reads the others"
    for args in ((cb, codes[:8], cb, cs, es, cnt),  # x is the codebook
                 (cb[:5], codes[:5], cb, cs, es, cnt),  # x is a view of it
                 (x, codes, cb, cs, cb, cnt),  # codebook is embed_sum
                 (x, codes, cb, es.view(-1)[:8], es, cnt),  # cluster_size is part of embed_sum
                 (x, codes, cb, cs, es, codes[:8])):  # the counters are codes
        with pytest.raises(ValueError, match=msg):
            vq_ema_update(*[a.clone() if a is x else a for a in args], semantics="laplace", threshold=1.0)
    wide = torch.zeros(2, *cb.shape, device=DEVICE)  # disjoint views of one buffer are fine
    wide[0], wide[1] = cb, es
    got, want = [wide[0], cs.clone(), wide[1], cnt.clone()], [t.clone() for t in state]
    for s in (got, want):
        vq_ema_update(x, codes, *s, semantics="laplace", threshold=1.0,
                      generator=torch.Generator(device=DEVICE).manual_seed(2))
    assert_state(got, want)


@pytest.mark.parametrize("which", [0, 1, 2, 3])
def test_ema_update_refuses_state_that_requires_grad(which):
    """State held as a trainable Parameter: the CPU reference path raised PyTorch's in-place leaf
    error while the kernels rewrote it silently. Both now refuse it by name in grad mode, and both
    update it under torch.no_grad(), as PyTorch allows for any in-place op on a leaf."""
    x, codes, *state = make(8, 5, 4, used=2)
    names = ("codebook", "cluster_size", "embed_sum", "steps_since_active")
    got = [t.clone() for t in state]
    if which < 3:
        got[which].requires_grad_()
        with pytest.raises(ValueError, match=f"{names[which]} requires grad, but it is rewritten in place"):
            vq_ema_update(x, codes, *got, semantics="active", restart_after_steps=2)
    else:  # integer counters cannot require grad; the generic case is covered by the three above
        got[0].requires_grad_()
    want = [t.clone() for t in state]
    with torch.no_grad():
        vq_ema_update(x, codes, *got, semantics="active", restart_after_steps=2,
                      generator=torch.Generator(device=DEVICE).manual_seed(1))
    vq_ema_update(x, codes, *want, semantics="active", restart_after_steps=2,
                  generator=torch.Generator(device=DEVICE).manual_seed(1))
    assert_state(got, want)


def test_ema_update_refuses_vmap():
    """The update rewrites shared state in place, which has no per-sample meaning: under torch.vmap it
    raises NotImplementedError naming the transforms (it failed deep in the dispatcher: "Batching rule
    not implemented for sparsefuse::vq_ema_apply"), and the state is untouched."""
    x, codes, *state = make(8, 5, 4)
    before = [t.clone() for t in state]
    with pytest.raises(NotImplementedError, match=r"does not run under functorch transforms .*vmap"):
        torch.vmap(lambda xx: vq_ema_update(xx, codes, *state, threshold=1.0))(torch.stack([x, x]))
    for a, b in zip(state, before):
        assert torch.equal(a, b)


def test_ema_update_generator_device_checked():
    """A generator of another device type than the state is refused by name (a CPU generator with
    CUDA state used to fail inside the key draw: "CPU Generator does not use offset"). On a CPU-only
    machine the check is exercised with meta state; the GPU tier runs the CUDA case."""
    x, codes, *state = (t.to("meta") for t in make(8, 5, 4))
    with pytest.raises(ValueError, match="generator is on cpu but the codebook is on meta"):
        vq_ema_update(x, codes, *state, generator=torch.Generator())


def _assert_nan_and_close(got, want, name):
    """NaN exactly where ``want`` is NaN, the rest close to it (assert_close skips tensors with NaN)."""
    bad = want.isnan()
    assert torch.equal(got.isnan(), bad), f"{name}: NaN at {got.isnan().nonzero().tolist()}"
    assert_close(got[~bad], want[~bad], torch.float32, name)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_unchecked_out_of_range_codes_poison_with_nan(semantics, deterministic):
    """With index checks off, codes 7 and -1 (K = 4) poison codes 3 and 0: their batch count and
    sums are NaN, they count as used, and their cluster_size, embed_sum and codebook row are NaN;
    with "laplace" the NaN total also reaches every codebook row. Codes 1 (used) and 2 (unused)
    are exact in "active"; their N and S are exact in "laplace"."""
    from sparsefuse.vq import kernels

    B, K, D = 5, 4, 3
    x, _, *state = make(B, K, D)
    codes = torch.tensor([0, 1, 1, 7, -1], device=x.device)
    got = [t.clone() for t in state]
    sparsefuse.set_index_checks(False)
    try:
        vq_ema_update(x, codes, *got, decay=0.9, semantics=semantics, deterministic=deterministic)
    finally:
        sparsefuse.set_index_checks(None)
    # the documented behaviour: the reference given the valid rows' statistics, NaN for codes 0 and 3
    n, s = reference.ema_accumulate(x[None, :3].double(), codes[None, :3], K)
    n[:, [0, 3]], s[:, [0, 3]] = float("nan"), float("nan")
    want = [t[None].double() if t.is_floating_point() else t[None].clone() for t in state]
    reference.ema_apply(x[None].double(), *want, n, s, reference.draw_key(1, x.device), decay=0.9,
                        active=semantics == "active", eps=1e-5, threshold=0.0, reset=0.0, restart_after=0)
    for name, a, b in zip(("codebook", "cluster_size", "embed_sum"), got, want):
        _assert_nan_and_close(a, b[0], name)
    assert torch.equal(got[3], want[3][0])
    assert got[1][[0, 3]].isnan().all() and got[2][[0, 3]].isnan().all() and (got[3][[0, 3]] == 0).all()
    assert got[0].isnan().all() if semantics == "laplace" else got[0][[0, 3]].isnan().all()
    if not deterministic:  # the cached workspace is left clean for the next update
        ws = kernels.ema_workspace(got[0], 1, K, D)
        for part in _workspace_views(ws, 1, K, D):
            assert torch.count_nonzero(part) == 0


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_reset_cluster_size_differs_from_threshold(deterministic):
    """"laplace" restarts a dead code with N = reset_cluster_size and S = N * v, not N = threshold
    (the other tests pass reset equal to the threshold, or leave it None, so either one would do)."""
    x, codes, *state = make(9, 40, 6, used=2)  # codes 2.. unused: most of them dead at threshold 1.5
    got, want = run_both(x, codes, state, semantics="laplace", threshold=1.5, reset=4.0,
                         deterministic=deterministic)
    assert_state(got, want)
    dead = got[1] == 4.0
    assert dead.sum() >= 9 and not (got[1] == 1.5).any()
    assert_close(got[2][dead], got[0][dead] * 4.0, torch.float32, "embed_sum of restarted codes")


def test_deterministic_default_follows_torch_flag(monkeypatch):
    """deterministic=None takes torch.are_deterministic_algorithms_enabled(): with the flag on, the
    update and batch_statistics sum their statistics in the fixed-order path (on the interpreter both
    paths give the same numbers, so the choice is observed at the launcher)."""
    from sparsefuse.vq import kernels

    seen = []
    real = kernels.ema_accumulate

    def spy(x, codes, cluster_size, counters, deterministic, *args, **kwargs):
        seen.append(bool(deterministic))
        return real(x, codes, cluster_size, counters, deterministic, *args, **kwargs)

    monkeypatch.setattr(kernels, "ema_accumulate", spy)
    x, codes, *state = make(13, 6, 5)
    for flag in (True, False):
        seen.clear()
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(flag)
        try:
            vq_ema_update(x, codes, *[t.clone() for t in state], decay=0.9, semantics="laplace", threshold=1.5)
            batch_statistics(x, codes, 6)
        finally:
            torch.use_deterministic_algorithms(before)
        assert seen == [flag, flag], (flag, seen)


def test_cpu_reference_path_matches_the_reference_update():
    """Without TRITON_INTERPRET, CPU tensors take the ops' PyTorch implementations (reference.ema_accumulate,
    ema_apply and the op wiring in ops.py), which no in-process test reaches (conftest turns the
    interpreter on). Both semantics with restarts, reset_cluster_size unlike the threshold, one and
    two levels, against reference.ema_update in float64; quantize and nearest_code against their
    float64 oracles."""
    code = r"""
import torch, sparsefuse._registry as r
from sparsefuse.vq import reference, vq_ema_update, quantize, nearest_code
assert not r.INTERPRET
def close(a, b, name):
    err = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
    assert err < 2e-5, (name, err)
g = torch.Generator().manual_seed(0)
for L in (None, 2):
    lead = () if L is None else (L,)
    x = torch.randn(*lead, 9, 6, generator=g)
    codes = torch.randint(0, 3, (*lead, 9), generator=g)  # codes 3.. unused
    cb = torch.randn(*lead, 20, 6, generator=g)
    cs = torch.rand(*lead, 20, generator=g) * 4
    es = cb * cs[..., None]
    cnt = torch.randint(0, 4, (*lead, 20), generator=g)
    for semantics, kw in (("laplace", dict(threshold=1.5, reset_cluster_size=4.0)),
                          ("active", dict(restart_after_steps=2))):
        got = [t.clone() for t in (cb, cs, es, cnt)]
        vq_ema_update(x, codes, *got, decay=0.8, semantics=semantics, generator=torch.Generator().manual_seed(3), **kw)
        want = [t.double() if t.is_floating_point() else t.clone() for t in (cb, cs, es, cnt)]
        reference.ema_update(x.double(), codes, *want, decay=0.8, active=semantics == "active",
                             threshold=kw.get("threshold", 0.0), reset=kw.get("reset_cluster_size"),
                             restart_after=kw.get("restart_after_steps", 0), generator=torch.Generator().manual_seed(3))
        assert (got[3] == 0).sum() > (cnt == 0).sum(), "no restarts"
        for name, a, b in zip(("codebook", "cluster_size", "embed_sum"), got, want):
            close(a, b, (L, semantics, name))
        assert torch.equal(got[3], want[3]), (L, semantics)
x, c = torch.randn(11, 6, generator=g), torch.randn(5, 6, generator=g)
codes, dist = nearest_code(x, c)
want_codes, want_dist = reference.nearest_code_exact(x, c)
assert torch.equal(codes, want_codes)
close(dist, want_dist, "dist")
xg, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
out, loss = quantize(xg, codes, c, 0.3)
want_out, want_loss = reference.quantize(x64, codes, c.double(), 0.3)
close(out, want_out, "out")
close(loss, want_loss, "loss")
close(torch.autograd.grad(loss, xg)[0], torch.autograd.grad(want_loss, x64)[0], "grad_x")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_ema_update_float64_x():
    x, codes, *state = make(9, 5, 4, dtype=torch.float64)
    got, want = run_both(x, codes, state, semantics="laplace")
    assert_state(got, want)


def test_ema_ops_opcheck():
    x, codes, codebook, cs, es, cnt = make(13, 6, 5, used=3)
    x3, c2 = x[None], codes[None]
    acc_args = (x3, c2, cs[None].clone(), cnt[None].clone(), False, True)
    torch.library.opcheck(torch.ops.sparsefuse.vq_ema_accumulate.default, acc_args)
    stats = torch.ops.sparsefuse.vq_ema_accumulate(*acc_args)
    key = reference.draw_key(1, DEVICE, torch.Generator(device=DEVICE).manual_seed(0))
    # one process; DDP rank 0 of three ranks with different B (one empty); rank 1 of two
    ddp = []
    for sizes, rank in ((None, 0), (torch.tensor([13, 4, 0], device=DEVICE), 0),
                        (torch.tensor([5, 13], device=DEVICE), 1)):
        args = (x3, codebook[None].clone(), cs[None].clone(), es[None].clone(), cnt[None].clone(), stats, key,
                0.9, 1e-5, 1.5, 1.5, 2, False, sizes, rank)
        torch.library.opcheck(torch.ops.sparsefuse.vq_ema_apply.default, args)
        if sizes is not None:  # DDP: (candidate rows this rank holds for the dead codes, dead flags)
            ddp.append(torch.ops.sparsefuse.vq_ema_apply(*args))
    # DDP's tail: install the (summed) candidate rows of the dead codes; its result against the
    # reference's, for the rank that holds some (which one does depends on the device's random keys)
    cand, dead = max(ddp, key=lambda cd: float(cd[0][cd[1].bool()].abs().sum()))
    assert dead.any() and not dead.all() and cand[dead.bool()].abs().sum() > 0
    restart = (codebook[None].clone(), es[None].clone(), cand, dead, 1.5)
    torch.library.opcheck(torch.ops.sparsefuse.vq_ema_restart.default, restart)
    want = [t.clone() for t in restart[:2]]
    reference.ema_restart(*want, cand, dead, 1.5)
    torch.ops.sparsefuse.vq_ema_restart(*restart)
    assert_close(restart[0], want[0], torch.float32, "codebook")
    assert_close(restart[1], want[1], torch.float32, "embed_sum")
    # the restart keys: random, so only the schema and the fake are checked
    keys = torch.empty(2, 4, dtype=torch.int64, device=DEVICE)
    torch.library.opcheck(torch.ops.sparsefuse.vq_draw_key.default, (keys,), test_utils=("test_schema", "test_faketensor"))


def _compiled_update(x, codes, codebook, cs, es, cnt, generator=None):
    vq_ema_update(x, codes, codebook, cs, es, cnt, decay=0.9, semantics="laplace", threshold=5.0, generator=generator)
    return nearest_code(x, codebook)


def _check_compile_fullgraph_parity(device):
    """An update with restarts, then a search, under torch.compile(fullgraph=True) equals eager mode.
    The compiled update draws its restart keys from the default generator when the graph runs, as
    eager mode does, so the same seed restarts from the same rows (on CPU both drew them with
    torch.randint before; on CUDA eager mode reads the generator's Philox state and the compiled
    graph used Inductor's own randint: other rows)."""
    x, codes, *state = make(17, 6, 8, used=2, device=device)
    eager = [t.clone() for t in state]
    compiled = [t.clone() for t in state]
    torch.manual_seed(3)
    want = _compiled_update(x, codes, *eager)
    torch.manual_seed(3)
    got = torch.compile(_compiled_update, fullgraph=True)(x, codes, *compiled)
    assert_state(compiled, eager)
    assert (eager[0][:, None, :] == x[None]).all(-1).any(1).sum() >= 4  # unused codes restarted from rows of x
    assert torch.equal(got[0], want[0])
    assert_close(got[1], want[1], torch.float32, "dist")


def test_compile_fullgraph_parity():
    _check_compile_fullgraph_parity(DEVICE)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_with_numbers_that_change(dynamic):
    """decay, eps and the restart threshold passed per call (a schedule): Dynamo makes them
    symbolic once they change (from the first call with ``dynamic=True``) and the checks must
    still trace. Each compiled update equals eager mode from the same seed."""
    def step(x, codes, codebook, cs, es, cnt, decay, eps, threshold):
        vq_ema_update(x, codes, codebook, cs, es, cnt, decay=decay, eps=eps, semantics="laplace",
                      threshold=threshold)
        return nearest_code(x, codebook)

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    x, codes, *state = make(17, 6, 8, used=2)
    eager, comp = [t.clone() for t in state], [t.clone() for t in state]
    for decay, eps, threshold in ((0.9, 1e-5, 5.0), (0.8, 2e-5, 4.0), (0.95, 1e-3, 0.5)):
        torch.manual_seed(3)
        want = step(x, codes, *eager, decay, eps, threshold)
        torch.manual_seed(3)
        got = compiled(x, codes, *comp, decay, eps, threshold)
        assert_state(comp, eager)
        assert torch.equal(got[0], want[0])


def test_generator_under_compile():
    """generator= cannot enter a graph: with fullgraph=True the update says so by name (Dynamo failed
    inside the key draw with "Failed to convert args/kwargs to proxy"); without, Dynamo runs the
    update in eager mode, which draws the rows eager mode draws."""
    x, codes, *state = make(12, 30, 4, used=3)
    got = [t.clone() for t in state]
    # Dynamo wraps the op's ValueError in its Unsupported error, a RuntimeError (the docstring says so)
    with pytest.raises(RuntimeError, match="generator= cannot be traced by torch.compile"):
        torch.compile(_compiled_update, fullgraph=True)(x, codes, *got, torch.Generator(device=DEVICE))
    for a, b in zip(got, state):
        assert torch.equal(a, b)
    want = [t.clone() for t in state]
    _compiled_update(x, codes, *want, torch.Generator(device=DEVICE).manual_seed(1))
    torch.compile(_compiled_update)(x, codes, *got, torch.Generator(device=DEVICE).manual_seed(1))
    assert not torch.equal(want[0], state[0])
    for name, a, b in zip(("codebook", "cluster_size", "embed_sum", "steps_since_active"), got, want):
        assert_same(a, b, name)


# --- nearest-code search -----------------------------------------------------------------------------


SEARCH_SHAPES = [
    pytest.param(37, 50, 20, id="B37-K50-D20"),
    pytest.param(1, 1, 1, id="B1-K1-D1"),
    pytest.param(37, 3, 100, id="B37-K3-D100"),
    pytest.param(20, 70, 3, id="B20-K70-D3"),
]


def assert_search(x, c, codes, dist, cosine=False, tol=1e-5):
    """The chosen code is optimal up to rounding; where the float64 optimum wins by a margin, it is it."""
    d = reference.sqdist_matrix(x, c, cosine)
    want_dist, want_codes = d.min(1)
    scale = 1 + d.abs().max(1).values
    chosen = d.gather(1, codes[:, None].to(d.device))[:, 0]
    assert (chosen <= want_dist + tol * scale).all(), "a row did not get its nearest code"
    second = d.scatter(1, want_codes[:, None], float("inf")).min(1).values
    clear = (second - want_dist) > 10 * tol * scale
    assert torch.equal(codes[clear].cpu(), want_codes[clear].cpu())
    assert ((dist.double().to(d.device) - want_dist).abs() <= 10 * tol * scale).all(), "distances differ"


@pytest.mark.parametrize("cosine", [False, True], ids=["l2", "cos"])
@pytest.mark.parametrize("B,K,D", SEARCH_SHAPES)
def test_nearest_code_matches_brute_force(B, K, D, cosine):
    x, _, c, *_ = make(B, K, D)
    codes, dist = nearest_code(x, c, cosine=cosine)
    assert codes.dtype == torch.int64 and dist.dtype == torch.float32
    assert_search(x, c, codes, dist, cosine)


def test_nearest_code_int64_codebook_offsets(monkeypatch):
    """The search's int64 codebook offsets (OFF64, used where K * stride passes 2^31: the GPU test
    test_gpu_nearest_code_codebook_offsets_past_2_31) give the same result as the int32 ones."""
    from sparsefuse.vq import kernels

    x, _, c, *_ = make(37, 21, 12)
    c = torch.cat([c, c], dim=1)[:, :12]  # rows 24 elements apart
    want = nearest_code(x, c)
    monkeypatch.setattr(kernels, "_OFF64_FROM", 0)
    got = nearest_code(x, c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("precision", ["exact", "ieee", "fast"])
def test_nearest_code_ties_go_to_lowest_index(precision):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 16, generator=g)
    c = torch.cat([base, base, base[:2]]).to(DEVICE)  # every vector three or two times
    x = torch.cat([base, base + 0.01 * torch.randn(5, 16, generator=g)]).to(DEVICE)
    codes, _ = nearest_code(x, c, precision=precision)
    assert torch.equal(codes.cpu(), torch.arange(10) % 5)


@pytest.mark.parametrize("cosine", [False, True], ids=["l2", "cosine"])
def test_nearest_code_float64_ties_go_to_lowest_index(cosine):
    """float64 takes reference.nearest_code on every device (and so does any CPU input without the
    interpreter): its scores sum each product in one order, so copies of a row tie and the lowest
    wins. A BLAS product rounded the copies differently: a higher copy won in 43% of such batches."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, generator=g, dtype=torch.float64)
    c = torch.cat([base, base, base]).to(DEVICE)  # code k == code k + 3 == code k + 6, bit for bit
    for _ in range(40):
        x = torch.randn(10, 4, generator=g, dtype=torch.float64).to(DEVICE)
        codes, _ = nearest_code(x, c, cosine=cosine)
        assert int(codes.max()) < 3, codes


@pytest.mark.parametrize("precision", ["exact", "ieee", "fast"])
def test_nearest_code_ties_across_code_tiles_go_to_lowest_index(precision):
    """Copies of a code in different code tiles (code i and code 256 + i: tiles hold 16 codes under the
    interpreter and at most 128 on a GPU; the test above fits one tile): the earlier tile keeps the tie."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, 16, generator=g)
    far = 50 + torch.randn(251, 16, generator=g)  # never the nearest
    c = torch.cat([base, far, base]).to(DEVICE)  # code i and code 256 + i are equal
    x = torch.cat([base, base + 0.01 * torch.randn(5, 16, generator=g)]).to(DEVICE)
    codes, _ = nearest_code(x, c, precision=precision)
    assert torch.equal(codes.cpu(), torch.arange(10) % 5)


def assert_nan_rule(x, c, codes, dist, cosine=False, tol=1e-5):
    """The documented NaN rule, which the reference follows: a NaN score ranks first (lowest index)
    and gives dist NaN; rows without a NaN score are searched as usual."""
    want_codes, want_dist = reference.nearest_code(x.float(), c.float(), cosine)
    nan = want_dist.isnan()
    assert nan.any()
    assert torch.equal(dist.isnan(), nan), f"NaN distances at {dist.isnan().nonzero().flatten().tolist()}"
    assert torch.equal(codes[nan], want_codes[nan])
    if not nan.all():
        assert_search(x[~nan], c, codes[~nan], dist[~nan], cosine, tol)


@pytest.mark.parametrize("cosine", [False, True], ids=["l2", "cos"])
def test_nearest_code_nan_propagates(cosine):
    """A NaN row of x gets code 0 and dist NaN (dist was 0 on a GPU: tl.maximum(NaN, 0) is 0); NaN
    codebook rows are the code of every row, the lowest one (a GPU skipped them, the interpreter
    returned dist 0 for one)."""
    x, _, c, *_ = make(20, 37, 5)  # 37 codes: three of the interpreter's 16-code tiles
    x[[3, 17], 2] = float("nan")
    codes, dist = nearest_code(x, c, cosine=cosine)
    assert codes[[3, 17]].tolist() == [0, 0]
    assert_nan_rule(x, c, codes, dist, cosine)
    c[[35, 33], 1] = float("nan")  # NaN codes in the last tile
    codes, dist = nearest_code(x, c, cosine=cosine)
    assert dist.isnan().all()
    assert codes.tolist() == [0 if i in (3, 17) else 33 for i in range(20)]
    assert_nan_rule(x, c, codes, dist, cosine)


@pytest.mark.parametrize("precision", ["exact", "ieee", "fast"])
def test_nearest_code_dist_is_clamped_at_zero(precision):
    """dist = ||x||^2 + (||c||^2 - 2 x.c) cancels for a row next to its code far from the origin
    (about 1e4 here, an fp32 ulp of 1e-3): without the clamp a fifth of these rows got a negative
    squared distance (-0.005), whose square root is NaN."""
    g = torch.Generator().manual_seed(0)
    c = 30 + 3 * torch.randn(40, 16, generator=g)
    x = c[torch.randint(0, 40, (64,), generator=g)] + 1e-3 * torch.randn(64, 16, generator=g)
    codes, dist = nearest_code(x.to(DEVICE), c.to(DEVICE), precision=precision)
    assert (dist >= 0).all(), dist.min()
    if precision != "fast":  # one TF32 product: about 3 significant digits of |x|^2 ~ 1e4
        assert_search(x, c, codes, dist)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearest_code_cosine_dist_is_clamped_at_zero(dtype):
    """Rows along their code: 2 - 2 cos rounds to about -2e-7 in float32 (-4e-16 in float64) for a
    few of them; the distance is clamped at 0 as the Euclidean one is."""
    c = torch.randn(40, 16, generator=torch.Generator().manual_seed(0), dtype=dtype)
    codes, dist = nearest_code((c * 3).to(DEVICE), c.to(DEVICE), cosine=True)
    assert torch.equal(codes.cpu(), torch.arange(40))
    assert (dist >= 0).all() and dist.max() < 1e-5, dist


def test_nearest_code_float64_and_mixed():
    x, _, c, *_ = make(23, 9, 6)
    codes, dist = nearest_code(x.double(), c.double())
    assert dist.dtype == torch.float64
    assert_search(x, c, codes, dist, tol=1e-12)
    codes, dist = nearest_code(x.double(), c)
    assert_search(x, c, codes, dist, tol=1e-12)
    codes, dist = nearest_code(x, c.double())  # a float64 codebook makes it float64 too
    assert dist.dtype == torch.float64
    assert_search(x, c, codes, dist, tol=1e-12)


@pytest.mark.parametrize("how", ["argument", "torch-flag", "module"])
def test_nearest_code_deterministic_skips_the_autotuner(monkeypatch, how):
    """deterministic search launches the first configuration itself: the autotuner's pick is timed
    in each process, and its configurations sum the dot products in different orders (a near-tie
    could go either way from one run to the next). Same result as the tuned search here."""
    from sparsefuse.vq import kernels

    x, _, c, *_ = make(19, 7, 6)
    want = nearest_code(x, c)

    def no_tuning(*args, **kwargs):
        raise AssertionError("the autotuner ran in deterministic mode")

    monkeypatch.setattr(kernels, "launch_tuned", no_tuning)
    if how == "argument":
        got = nearest_code(x, c, deterministic=True)
    elif how == "torch-flag":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        got = nearest_code(x, c)
    else:
        m = VectorQuantizer(6, 7, deterministic=True).to(DEVICE).eval()
        m.codebook.copy_(c)
        got = nearest_code(x, c, deterministic=True)
        assert torch.equal(m(x)[1], got[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(AssertionError, match="the autotuner ran"):
        nearest_code(x, c, deterministic=False)


def test_nearest_code_opcheck():
    x, _, c, *_ = make(19, 7, 6)
    for cosine in (False, True):
        for deterministic in (False, True):
            torch.library.opcheck(torch.ops.sparsefuse.nearest_code.default, (x, c, cosine, "exact", deterministic))


def test_nearest_code_bad_inputs():
    x, _, c, *_ = make(8, 5, 4)
    with pytest.raises(ValueError, match="x has shape"):
        nearest_code(x[:, :3], c)
    with pytest.raises(ValueError, match="precision must be one of"):
        nearest_code(x, c, precision="half")
    with pytest.raises(TypeError, match="x has dtype int64"):
        nearest_code(x.long(), c)
    with pytest.raises(ValueError, match="x is on meta"):
        nearest_code(x.to("meta"), c)
    with pytest.raises(ValueError, match="at least one code"):
        nearest_code(x, c[:0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("cosine", [False, True], ids=["l2", "cos"])
def test_nearest_code_dist_is_differentiable(cosine, dtype):
    """dist had no gradient on the kernel path (a commitment term built on it silently added
    nothing) while the CPU reference recorded one. It now has the float64 gradient of the chosen
    distance, and the same values as without grad. A zero row of x and a zero code (the cosine
    distance's singular point, dist 2) get a zero gradient, not a 1e12-sized one."""
    x, _, c, *_ = make(37, 11, 20)
    x, c = x.to(dtype), c.to(dtype)
    x[5] = 0
    plain = nearest_code(x, c, cosine=cosine)
    xg, cg = x.clone().requires_grad_(), c.clone().requires_grad_()
    codes, dist = nearest_code(xg, cg, cosine=cosine)
    assert torch.equal(codes, plain[0]) and torch.equal(dist.detach(), plain[1])
    w = torch.randn(37, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    gx, gc = torch.autograd.grad((dist * w.to(dist.dtype)).sum(), (xg, cg))
    assert gx.dtype == dtype and gc.dtype == dtype
    x64, c64 = x.double().requires_grad_(), c.double().requires_grad_()
    want_x, want_c = torch.autograd.grad((reference.sqdist_matrix(x64, c64, cosine).gather(1, codes[:, None])[:, 0]
                                          * w).sum(), (x64, c64))
    keep = torch.ones(37, dtype=torch.bool, device=x.device)
    if cosine:  # the oracle's zero row: NaN gradient; ours 0, and dist 2 as the search defines it
        keep[5] = False
        assert dist[5].item() == 2 and not gx[5].any()
    tol, scale = (torch.float32, 50) if dtype == torch.float16 else (dtype, 1)
    assert_close(gx[keep], want_x[keep], tol, "grad_x", scale=scale)
    assert_close(gc, want_c, tol, "grad_codebook", scale=scale)
    if cosine:  # a zero code
        cz = cg.detach().clone()
        cz[codes[0]] = 0
        czg = cz.clone().requires_grad_()
        d0 = nearest_code(xg.detach(), czg, cosine=True)[1]
        g0 = torch.autograd.grad(d0.sum(), czg)[0]
        assert torch.isfinite(g0).all() and g0.abs().max() < 1e3


@pytest.mark.parametrize("cosine", [False, True], ids=["l2", "cos"])
def test_nearest_code_dist_gradcheck(cosine):
    """Finite differences of dist in x and in the codebook (the chosen codes do not move under the
    perturbation: random rows are far from a tie)."""
    x, _, c, *_ = make(9, 5, 6, dtype=torch.float64)
    inputs = (x.clone().requires_grad_(), c.double().requires_grad_())
    assert torch.autograd.gradcheck(lambda a, b: nearest_code(a, b, cosine=cosine)[1], inputs, eps=1e-6, atol=1e-7)


def test_nearest_code_dist_after_an_in_place_codebook_update():
    """The backward of dist reads the saved codebook: an EMA-style in-place update before it raises
    PyTorch's in-place error instead of differentiating against moved codes; a backward that does not
    reach dist (the usual codes-only search) is unaffected."""
    x, codes0, c, *_ = make(8, 5, 4)
    z = x.clone().requires_grad_()
    codes, dist = nearest_code(z, c)
    out, loss = quantize(z, codes, c)
    c.mul_(0.5)
    (out.sum() + loss).backward()
    codes, dist = nearest_code(z, c)
    c.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        dist.sum().backward()


@pytest.mark.parametrize("cosine", [False, True], ids=["l2", "cos"])
def test_nearest_code_gradient_registration_and_compile(cosine):
    """opcheck with inputs that require grad (its AOT test sums the int64 codes into a float and
    cannot run on this op: the compiled gradient is compared directly instead)."""
    x, _, c, *_ = make(19, 7, 6)
    torch.library.opcheck(torch.ops.sparsefuse.nearest_code.default,
                          (x.clone().requires_grad_(), c.clone().requires_grad_(), cosine, "exact", False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert_compile_parity(lambda xx, cc: nearest_code(xx, cc, cosine=cosine)[1].square().sum(), (x, c), atol=1e-6)


# --- straight-through quantisation ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,K,D", [(37, 11, 20), (1, 1, 1), (5, 3, 100)], ids=["B37-K11-D20", "B1-K1-D1", "B5-K3-D100"])
def test_quantize_matches_reference(B, K, D, dtype):
    x, codes, c, *_ = make(B, K, D, dtype=dtype)
    c = c.to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    out, loss = quantize(x1, codes, c, 0.3)
    want_out, want_loss = reference.quantize(x2, codes, c.double(), 0.3)
    assert_close(out, want_out, dtype, "out")
    assert_close(loss, want_loss, dtype, "loss")
    w = torch.randn(B, D, dtype=torch.float64, device=DEVICE)
    (g1,) = torch.autograd.grad((out * w.to(dtype)).sum() + 3 * loss, x1, retain_graph=True)
    (g2,) = torch.autograd.grad((want_out * w).sum() + 3 * want_loss, x2, retain_graph=True)
    assert_close(g1, g2, dtype, "grad_x")
    (g3,) = torch.autograd.grad(loss, x1)  # grad of out is None
    (g4,) = torch.autograd.grad(want_loss, x2)
    assert_close(g3, g4, dtype, "grad_x from the loss alone")


def test_quantize_gradcheck_opcheck_compile():
    x, codes, c, *_ = make(9, 4, 7, dtype=torch.float64)
    c = c.double()
    xg = x.clone().requires_grad_()
    # the loss is differentiable; out is a straight-through estimator (identity Jacobian by definition)
    assert torch.autograd.gradcheck(lambda t: quantize(t, codes, c, 0.7)[1], (xg,))
    torch.library.opcheck(torch.ops.sparsefuse.vq_quantize.default, (xg, codes, c, 0.7))
    # a column-major x: the kernels' outputs and gradients are contiguous, and so are the fakes'
    torch.library.opcheck(torch.ops.sparsefuse.vq_quantize.default, (x.t().contiguous().t().requires_grad_(), codes, c, 0.7))
    out, _ = torch.ops.sparsefuse.vq_quantize(x, codes, c, 0.7)  # the backward op alone, also for a column-major x
    for xx in (x, x.t().contiguous().t()):
        torch.library.opcheck(torch.ops.sparsefuse.vq_quantize_bwd.default,
                              (torch.randn_like(x), torch.tensor(0.3, dtype=x.dtype, device=DEVICE), xx, out, 0.7))
    xf = x.float().requires_grad_()
    got = torch.compile(lambda t: quantize(t, codes, c.float(), 0.7), fullgraph=True)(xf)
    want = quantize(xf, codes, c.float(), 0.7)
    for a, b in zip(got, want):
        assert_close(a, b, torch.float32)
    ga = torch.autograd.grad(got[0].sum() + got[1], xf)[0]
    assert_close(ga, 1 + 1.4 * (xf.detach() - c.float()[codes]) / xf.numel(), torch.float32, "straight-through")
    gb = torch.autograd.grad(want[0].sum() + want[1], xf)[0]
    assert_close(ga, gb, torch.float32, "compiled grad")


def test_quantize_bad_inputs():
    x, codes, c, *_ = make(8, 5, 4)
    with pytest.raises(ValueError, match="x has shape"):
        quantize(x[:, :2], codes, c)
    for bad in (float("nan"), -1.0):  # a NaN or negative "commitment" loss, without a word
        with pytest.raises(ValueError, match=f"beta must be a non-negative finite number, got {bad}"):
            quantize(x, codes, c, bad)
    with pytest.raises(TypeError, match="beta must be a Python number, not a tensor"):  # was a host sync
        quantize(x, codes, c, torch.tensor(0.5))
    with pytest.raises(TypeError, match="codes has dtype int32"):
        quantize(x, codes.int(), c)
    # CPU tensors are checked by default, CUDA tensors only on request; True checks everywhere
    for checks in ((None, True) if DEVICE == "cpu" else (True,)):
        sparsefuse.set_index_checks(checks)
        try:
            with pytest.raises(IndexError, match=r"codes holds 1000, outside \[0, 5\)"):
                quantize(x, torch.where(codes == codes[0], 1000, codes), c)
            with pytest.raises(IndexError, match=r"codes holds -1, outside \[0, 5\)"):
                quantize(x, torch.where(codes == codes[0], -1, codes), c)
        finally:
            sparsefuse.set_index_checks(None)


@pytest.mark.parametrize("bad", [1000, -1])
def test_quantize_unchecked_out_of_range_codes_poison_with_nan(bad):
    """With index checks off a bad code is never dereferenced: its row of out and of grad_x, and
    the loss, are NaN; the other rows are exact."""
    x, codes, c, *_ = make(8, 5, 4)
    codes[3] = bad
    xg = x.clone().requires_grad_()
    sparsefuse.set_index_checks(False)
    try:
        out, loss = quantize(xg, codes, c, 0.5)
    finally:
        sparsefuse.set_index_checks(None)
    (gx,) = torch.autograd.grad(out.sum() + loss, xg)
    ok = torch.arange(8, device=x.device) != 3
    assert out[3].isnan().all() and loss.isnan() and gx[3].isnan().all()
    assert torch.equal(out[ok].detach(), c[codes[ok]])
    assert torch.equal(gx[ok].isnan(), torch.zeros_like(gx[ok], dtype=torch.bool))


def test_quantize_loss_is_that_of_the_rounded_out():
    """16-bit x with an fp32 codebook: out is the row rounded to x's dtype, and the loss is
    beta * mean((x - out)^2) of that out (the backward's derivative), not of the unrounded row.
    The codebook sits just above float16 values (within half an ulp) and x - out = -out / 2, so
    the unrounded loss would be about 2^-10 too large (relative)."""
    B, K, D = 6, 3, 5
    _, codes, c, *_ = make(B, K, D, used=K)
    c16 = c.half()
    c32 = c16.float() * (1 + 2.0 ** -12)  # rounds back to c16
    x = (c16[codes].float() * 0.5).half().requires_grad_()
    for out, loss in (quantize(x, codes, c32, 0.7), reference.quantize_fwd(x.detach(), codes, c32, 0.7)):
        assert torch.equal(out.detach(), c16[codes])
        want = 0.7 * (x.detach().double() - out.detach().double()).square().mean()
        assert_close(loss, want, torch.float32, "loss")
    out, loss = quantize(x, codes, c32, 0.7)
    (gx,) = torch.autograd.grad(loss, x)
    assert_close(gx, 1.4 * (x.detach().double() - c16[codes].double()) / (B * D), torch.float16, "grad")


# --- modules ---------------------------------------------------------------------------------------------


def test_quantize_cpu_implementation_matches_the_kernels_in_float64():
    """The ops' PyTorch implementation of quantize (CPU tensors without the interpreter) computes the
    loss and the gradient in float64 for float64 inputs, as the kernels do; the subprocess test of that
    path checks float32 only."""
    from sparsefuse.vq import kernels

    x, codes, c, *_ = make(13, 5, 7, dtype=torch.float64)
    c = c.double()
    gout = torch.randn(13, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    gl = torch.tensor(1.3, dtype=torch.float64, device=DEVICE)
    got, want = kernels.quantize_fwd(x, codes, c, 0.3), reference.quantize_fwd(x, codes, c, 0.3)
    assert want[1].dtype == torch.float64
    for a, b, name in zip(got, want, ("out", "loss")):
        assert_close(a, b, torch.float64, name)
    assert_close(reference.quantize_bwd(gout, gl, x, got[0], 0.3), kernels.quantize_bwd(gout, gl, x, got[0], 0.3),
                 torch.float64, "grad_x")


def test_vector_quantizer_step():
    torch.manual_seed(0)
    vq = VectorQuantizer(6, 10, decay=0.9, threshold=0.5,
                         generator=torch.Generator(device=DEVICE).manual_seed(1)).to(DEVICE)
    x = torch.randn(4, 5, 6, device=DEVICE, requires_grad=True)
    state = [b.clone() for b in (vq.codebook, vq.cluster_size, vq.embed_sum, vq.steps_since_active)]
    out, codes, loss = vq(x)
    want_codes, _ = nearest_code(x.detach().reshape(-1, 6), state[0])
    assert torch.equal(codes.reshape(-1), want_codes)
    assert_close(out.detach(), state[0][codes], torch.float32, "quantized")
    assert_close(loss, 0.25 * (x.detach() - state[0][codes]).square().mean(), torch.float32, "loss")
    (gx,) = torch.autograd.grad(out.sum() + loss, x)
    assert_close(gx, 1 + 0.5 * (x.detach() - state[0][codes]) / x.numel(), torch.float32, "grad")
    vq_ema_update(x.detach().reshape(-1, 6), want_codes, *state, decay=0.9, threshold=0.5,
                  generator=torch.Generator(device=DEVICE).manual_seed(1))
    for name, a, b in zip(("codebook", "cluster_size", "embed_sum", "steps_since_active"), state,
                          (vq.codebook, vq.cluster_size, vq.embed_sum, vq.steps_since_active)):
        assert_same(a, b, name)
    vq.eval()
    before = vq.codebook.clone()
    vq(x)
    assert torch.equal(before, vq.codebook)


def test_vector_quantizer_kmeans_and_state_dict():
    torch.manual_seed(0)
    centres = torch.randn(4, 3) * 10
    x = (centres[torch.arange(64) % 4] + 0.1 * torch.randn(64, 3)).to(DEVICE)
    vq = VectorQuantizer(3, 4, kmeans_init=True, kmeans_iters=5,
                         generator=torch.Generator(device=DEVICE).manual_seed(0)).to(DEVICE)
    _, _, loss = vq(x)
    assert float(loss) < 0.25 * 0.1, "k-means did not find the clusters"
    clone = VectorQuantizer(3, 4, kmeans_init=True).to(DEVICE)
    clone.load_state_dict(vq.state_dict())
    assert bool(clone.initted)
    for a, b in zip(vq.state_dict().values(), clone.state_dict().values()):
        assert torch.equal(a, b)
    vq.eval()
    clone.eval()
    assert torch.equal(vq(x)[1], clone(x)[1])


def test_kmeans_init_needs_rows():
    """k-means on an empty batch is refused by name (it crashed with an IndexError); with B < K the
    starting centroids repeat rows (code k starts where code k - B does)."""
    from sparsefuse.vq.modules import _kmeans

    vq = VectorQuantizer(4, 3, kmeans_init=True).to(DEVICE)
    with pytest.raises(ValueError, match="x must have at least one row"):
        vq(torch.randn(0, 4, device=DEVICE))
    x = torch.randn(2, 4, device=DEVICE)
    c, _ = _kmeans(x, 5, 0, cosine=False, precision="exact", generator=torch.Generator(device=DEVICE).manual_seed(0),
                   process_group=None)
    assert torch.equal(c[2:4], c[:2]) and torch.equal(c[4], c[0])
    assert torch.equal((c[:2, None] == x[None]).all(-1).sum(0), torch.ones(2, dtype=torch.long, device=DEVICE))


def test_kmeans_empty_cluster_keeps_its_centroid():
    """With B < K code 2 starts where code 0 does; ties go to the lowest index, so code 2 gets no row
    and keeps its centroid through the iterations (it must not collapse to 0)."""
    from sparsefuse.vq.modules import _kmeans

    x = (torch.randn(2, 4, generator=torch.Generator().manual_seed(0)) + 3).to(DEVICE)
    c, n = _kmeans(x, 3, 2, cosine=False, precision="exact", generator=torch.Generator(device=DEVICE).manual_seed(0),
                   process_group=None)
    assert n.tolist() == [1.0, 1.0, 0.0]
    assert torch.equal(c[2], c[0])
    assert torch.equal((c[:2, None] == x[None]).all(-1).sum(0), torch.ones(2, dtype=torch.long, device=DEVICE))


def test_kmeans_init_keeps_an_empty_cluster_consistent():
    """kmeans_init_ sets N = max(count, 1) and S = N * centroid: an empty cluster (B < K here: code 2
    starts where code 0 does and gets no row) keeps N = 1 and S = its centroid, so the next refresh
    keeps it where it is (with N = S = 0 it would be refreshed to the origin)."""
    x = (torch.randn(2, 4, generator=torch.Generator().manual_seed(0)) + 3).to(DEVICE)
    vq = VectorQuantizer(4, 3, kmeans_init=True, kmeans_iters=2,
                         generator=torch.Generator(device=DEVICE).manual_seed(0)).to(DEVICE)
    vq.kmeans_init_(x)
    assert vq.cluster_size.tolist() == [1.0, 1.0, 1.0]
    assert torch.equal(vq.embed_sum, vq.codebook * vq.cluster_size[:, None])
    assert torch.equal(vq.codebook[2], vq.codebook[0]) and vq.codebook[2].abs().min() > 0


def test_kmeans_init_with_zero_iterations_seeds_from_rows():
    """kmeans_iters=0 is allowed (no Lloyd iteration): the codebook starts from distinct rows of the
    first training batch."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for m in (VectorQuantizer(4, 6, kmeans_init=True, kmeans_iters=0),
              ResidualVQ(1, 4, 6, kmeans_init=True, kmeans_iters=0)):
        m.to(DEVICE).kmeans_init_(x)
        rows = m.codebook.reshape(6, 4)
        assert bool(m.initted)
        assert ((rows[:, None, :] == x[None]).all(-1).sum(1) == 1).all()  # every code is one row of x
        assert len({tuple(r.tolist()) for r in rows}) == 6  # distinct rows (B >= K)


@pytest.mark.parametrize("levels", [None, 2], ids=["vq", "rvq"])
def test_module_rejects_a_wrong_last_dim_before_updating(levels):
    """x [3, 8] for dim 4 reshaped to [6, 4] and the codebook was updated before the output's view
    failed with a RuntimeError; now a ValueError names x, and the state is untouched."""
    m = (VectorQuantizer(4, 8, threshold=1.0) if levels is None else ResidualVQ(levels, 4, 8, threshold=1.0)).to(DEVICE)
    before = [b.clone() for b in m.buffers()]
    for bad in (torch.randn(3, 8, device=DEVICE), torch.tensor(1.0, device=DEVICE)):
        with pytest.raises(ValueError, match=re.escape(f"x has shape {tuple(bad.shape)}; expected [..., 4] (dim=4)")):
            m(bad)
    for a, b in zip(before, m.buffers()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("levels", [None, 2], ids=["vq", "rvq"])
def test_module_refuses_activation_checkpointing_in_training(levels, reentrant):
    """torch.utils.checkpoint reran a training-mode forward inside the backward, after its in-place
    EMA update: the rerun quantized with the updated codebook, and x's gradient came out 55-76% off
    (the reentrant form updated the codebook twice too). The rerun now raises, after one update;
    in eval mode the checkpointed module gives the plain gradients."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    vq = (VectorQuantizer(8, 5, decay=0.5) if levels is None else ResidualVQ(levels, 8, 5, decay=0.5)).to(DEVICE)
    x = torch.randn(6, 8, device=DEVICE)
    plain = copy.deepcopy(vq)
    plain(x)
    xb = x.clone().requires_grad_()
    _, _, loss = checkpoint(vq, xb, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match=f"{type(vq).__name__} in training mode cannot run inside a backward pass"):
        loss.backward()
    for a, b in zip(plain.buffers(), vq.buffers()):  # one update, as without checkpointing
        assert torch.equal(a, b)
    vq.eval()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (vq(xa)[0].square().sum() + vq(xa)[2]).backward()
    out, _, loss = checkpoint(vq, xb, use_reentrant=reentrant)
    (out.square().sum() + loss).backward()
    assert xa.grad.abs().sum() > 0
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)  # the bug: 55-76% off


def test_residual_vq_needs_a_level():
    """num_levels=0 built a module whose first forward died in a ZeroDivisionError."""
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=re.escape(f"num_levels must be a positive int, got {bad!r}")):
            ResidualVQ(bad, 4, 8)


@pytest.mark.parametrize("levels", [None, 2], ids=["vq", "rvq"])
def test_module_refuses_bad_options_when_built(levels):
    """dim=0 built a module whose first forward died in a reshape error, and a bad EMA option or
    precision was only refused at the first training step; each is a ValueError naming it now."""
    def build(*args, **kw):
        return VectorQuantizer(*args, **kw) if levels is None else ResidualVQ(levels, *args, **kw)

    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=re.escape(f"dim must be a positive int, got {bad!r}")):
            build(bad, 8)
        with pytest.raises(ValueError, match=re.escape(f"codebook_size must be a positive int, got {bad!r}")):
            build(4, bad)
    for kw, msg in ((dict(decay=2.0), "decay must lie in [0, 1], got 2.0"),
                    (dict(semantics="mean"), "semantics must be one of"),
                    (dict(eps=0.0), "eps must be a positive finite number, got 0.0"),
                    (dict(threshold=float("nan")), "threshold must be a non-negative finite number, got nan"),
                    (dict(reset_cluster_size=-1.0), "reset_cluster_size must be a non-negative finite number"),
                    (dict(restart_after_steps=2.5), "restart_after_steps must be a whole number of steps, got 2.5"),
                    (dict(precision="tf32"), "precision must be one of ('exact', 'ieee', 'fast'), got 'tf32'"),
                    # these two reached the loss (NaN, or negative) or skipped k-means, without a word
                    (dict(commitment_weight=float("nan")), "commitment_weight must be a non-negative finite number"),
                    (dict(commitment_weight=-1.0), "commitment_weight must be a non-negative finite number"),
                    (dict(kmeans_iters=-3), "kmeans_iters must be a non-negative int (0: the seeding rows only)"),
                    (dict(kmeans_iters=2.5), "kmeans_iters must be a non-negative int"),
                    (dict(kmeans_iters=True),
                     "kmeans_iters must be a non-negative int (0: the seeding rows only), got True")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            build(4, 8, **kw)
    with pytest.raises(TypeError, match="decay must be a Python number, not a tensor"):
        build(4, 8, decay=torch.tensor(0.9))
    build(4, 8, decay=1.0, eps=1e-3, threshold=0.5, reset_cluster_size=0.0, precision="fast")
    build(4, 8, semantics="active", restart_after_steps=3)


@pytest.mark.parametrize("levels", [None, 2], ids=["vq", "rvq"])
def test_module_step_under_compile_dynamic(levels):
    """A training step of the modules compiled with dynamic=True: the module's eps and decay reach
    the update as symbolic numbers (math.isfinite could not trace them). Same state and output as
    an eager copy of the module."""
    torch.manual_seed(0)
    m = (VectorQuantizer(4, 8, threshold=1.0) if levels is None else ResidualVQ(levels, 4, 8, threshold=1.0)).to(DEVICE)
    twin = copy.deepcopy(m)
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    for step in range(2):
        x = torch.randn(5 + step, 4, device=DEVICE)
        torch.manual_seed(step)
        want = twin(x)
        torch.manual_seed(step)
        got = compiled(x)
        for a, b in zip(got, want):
            assert_close(a, b, torch.float32, f"output, step {step}")
        for (name, a), b in zip(m.named_buffers(), twin.buffers()):
            assert_close(a, b, torch.float32, name) if a.is_floating_point() else assert_same(a, b, name)


@pytest.mark.parametrize("levels", [None, 2], ids=["VectorQuantizer", "ResidualVQ"])
def test_module_gradient_under_compile(levels):
    """A training step of the modules under torch.compile(fullgraph=True): codes, loss, the update
    and the gradients for x (of the loss, and of the straight-through output plus the loss) equal
    eager mode's. ResidualVQ's level losses were built from the codebook buffer, and the compiled
    backward recomputed them from the codebook after its in-place EMA update (a gradient 8% off)."""
    import copy

    torch.manual_seed(0)
    m = (VectorQuantizer(4, 6, decay=0.8) if levels is None else ResidualVQ(levels, 4, 6, decay=0.8)).to(DEVICE)
    m2 = copy.deepcopy(m)
    x = torch.randn(7, 4, device=DEVICE)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out1, c1, l1 = m(x1)
    torch._dynamo.reset()
    out2, c2, l2 = torch.compile(m2, fullgraph=True)(x2)
    assert torch.equal(c1, c2)
    assert_close(out2, out1, torch.float32, "output")
    assert_close(l2, l1, torch.float32, "loss")
    assert_close(m2.codebook, m.codebook, torch.float32, "updated codebook")
    g1, g2 = torch.autograd.grad(l1, x1, retain_graph=True)[0], torch.autograd.grad(l2, x2, retain_graph=True)[0]
    assert_close(g2, g1, torch.float32, "grad_x of the loss")
    w = torch.randn(out1.shape, device=DEVICE)
    g1, g2 = torch.autograd.grad((out1 * w).sum() + l1, x1)[0], torch.autograd.grad((out2 * w).sum() + l2, x2)[0]
    assert_close(g2, g1, torch.float32, "grad_x of output and loss")


def test_kmeans_init_passes_deterministic(monkeypatch):
    """The k-means statistics follow the module's deterministic flag (they took the global default)."""
    from sparsefuse.vq import modules

    seen = []
    real = modules.batch_statistics

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)

    monkeypatch.setattr(modules, "batch_statistics", spy)
    for m, calls in ((VectorQuantizer(4, 6, kmeans_init=True, kmeans_iters=2, deterministic=True), 2),
                     (ResidualVQ(2, 4, 6, kmeans_init=True, kmeans_iters=2, deterministic=True), 4)):
        seen.clear()
        m.to(DEVICE)(torch.randn(24, 4, device=DEVICE))
        assert seen == [True] * calls


def test_deterministic_modules_search_without_the_autotuner(monkeypatch):
    """deterministic=True reaches every nearest-code search of the modules, not only the training
    forward's: the k-means initialisation's and each ResidualVQ level's (they took the autotuner's pick,
    whose dot-product order can differ from process to process)."""
    from sparsefuse.vq import kernels

    def no_tuning(*args, **kwargs):
        raise AssertionError("the autotuner ran in deterministic mode")

    monkeypatch.setattr(kernels, "launch_tuned", no_tuning)
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for m in (VectorQuantizer(4, 6, kmeans_init=True, kmeans_iters=1, deterministic=True),
              ResidualVQ(2, 4, 6, kmeans_init=True, kmeans_iters=1, deterministic=True)):
        m.to(DEVICE)(x)  # k-means, then a training step
        m.eval()(x)
    with pytest.raises(AssertionError, match="the autotuner ran"):
        ResidualVQ(2, 4, 6).to(DEVICE).eval()(x)


def test_module_state_stays_float32_under_half():
    """.half() / .to(dtype) moved the fp32 EMA state to fp16 and the next step failed with "codebook
    has dtype float16"; the state now keeps float32 (and its values) and 16-bit x works."""
    vq = VectorQuantizer(4, 8, threshold=0.5).to(DEVICE)
    before = {k: v.clone() for k, v in vq.state_dict().items()}
    for convert in (lambda m: m.half(), lambda m: m.to(torch.float64), lambda m: m.to(DEVICE, torch.bfloat16)):
        convert(vq)
        for k, v in vq.state_dict().items():
            assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    x = torch.randn(5, 4, device=DEVICE).half()
    out, codes, _ = vq.half()(x)
    assert out.dtype == torch.float16 and codes.shape == (5,)
    assert vq.codebook.dtype == torch.float32 and not torch.equal(vq.codebook, before["codebook"])


def test_residual_vq_uses_one_multi_level_update():
    torch.manual_seed(0)
    rvq = ResidualVQ(3, 5, 7, decay=0.8, threshold=0.3,
                     generator=torch.Generator(device=DEVICE).manual_seed(2)).to(DEVICE)
    x = torch.randn(11, 5, device=DEVICE, requires_grad=True)
    state = [b.clone() for b in (rvq.codebook, rvq.cluster_size, rvq.embed_sum, rvq.steps_since_active)]
    out, codes, loss = rvq(x)
    assert codes.shape == (11, 3) and out.shape == x.shape
    resid, inputs, total = x.detach(), [], torch.zeros_like(x)
    for level in range(3):
        want, _ = nearest_code(resid, state[0][level])
        assert torch.equal(codes[:, level], want)
        inputs.append(resid)
        total = total + state[0][level][want]
        resid = resid - state[0][level][want]
    assert_close(out.detach(), total, torch.float32, "quantized")
    vq_ema_update(torch.stack(inputs), codes.T.contiguous(), *state, decay=0.8, threshold=0.3,
                  generator=torch.Generator(device=DEVICE).manual_seed(2))
    for a, b in zip(state, (rvq.codebook, rvq.cluster_size, rvq.embed_sum, rvq.steps_since_active)):
        if a.is_floating_point():
            assert_close(b, a, torch.float32)
        else:
            assert torch.equal(a, b)
    rvq2 = ResidualVQ(3, 5, 7, kmeans_init=True, kmeans_iters=3).to(DEVICE)
    rvq2(x)
    assert bool(rvq2.initted)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_residual_vq_loss_and_gradients(dtype):
    """The loss is commitment_weight times the mean over levels of mean((r_l - sg(q_l))^2), with
    r_l = x - sg(q_0 + ... + q_{l-1}), and its gradient reaches x; the output passes gradients
    straight through. Against a float64 autograd reference built from the returned codes (eval mode:
    no update). float64 input keeps float64 residuals and loss, as VectorQuantizer does (they were
    float32)."""
    L, D, K, beta = 3, 5, 7, 0.4
    with torch.random.fork_rng(devices=[]):  # the codebooks' initialisation, without touching the global state
        torch.manual_seed(0)
        rvq = ResidualVQ(L, D, K, commitment_weight=beta).to(DEVICE).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, D, generator=g).to(DEVICE, dtype).requires_grad_()
    wts = torch.randn(11, D, generator=g).to(DEVICE, dtype)
    out, codes, loss = rvq(x)
    assert out.dtype == dtype and loss.dtype == dtype
    (g,) = torch.autograd.grad((out * wts).sum() + loss, x)
    x64 = x.detach().double().requires_grad_()
    total = torch.zeros_like(x64)
    want_loss = 0.0
    for level in range(L):
        q = rvq.codebook[level].double()[codes[:, level]]
        want_loss = want_loss + ((x64 - total) - q).square().mean()
        total = total + q
    want_loss = want_loss * (beta / L)
    want_out = x64 + (total - x64).detach()
    (want_g,) = torch.autograd.grad((want_out * wts.double()).sum() + want_loss, x64)
    assert_close(out.detach(), want_out, dtype, "quantized")
    assert_close(loss, want_loss, dtype, "loss")
    assert_close(g, want_g, dtype, "grad_x")


def _residual_kmeans(x):
    """(a two-level ResidualVQ of 4 codes initialised by k-means on x, and [(codes, counts)] of each
    level's k-means on what the levels before leave over, run by hand with the same generator)."""
    from sparsefuse.vq.modules import _kmeans

    rvq = ResidualVQ(2, 3, 4, kmeans_init=True, kmeans_iters=3, deterministic=True,
                     generator=torch.Generator(device=DEVICE).manual_seed(5)).to(DEVICE)
    rvq.kmeans_init_(x)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    r, want = x, []
    for _ in range(2):
        c, n = _kmeans(r, 4, 3, cosine=False, precision="exact", generator=gen, process_group=None,
                       deterministic=True)
        want.append((c, n))
        r = r - c[nearest_code(r, c)[0]]
    return rvq, want


def test_residual_vq_kmeans_init_fits_each_level_on_the_residual():
    """Level l is initialised by k-means on what levels < l leave over, not on x."""
    g = torch.Generator().manual_seed(0)
    x = (10 * torch.randn(4, 3, generator=g)[torch.arange(40) % 4] + torch.randn(40, 3, generator=g)).to(DEVICE)
    rvq, want = _residual_kmeans(x)
    for level, (c, n) in enumerate(want):
        n = n.clamp_min(1)
        assert_close(rvq.codebook[level], c, torch.float32, f"codebook[{level}]")
        assert_close(rvq.cluster_size[level], n, torch.float32, f"cluster_size[{level}]")
        assert_close(rvq.embed_sum[level], c * n[:, None], torch.float32, f"embed_sum[{level}]")
    assert bool(rvq.initted)


def test_residual_vq_kmeans_init_keeps_float64_residuals():
    """float64 x: the k-means initialisation searches and takes residuals in float64, as the forward
    does. Here the points sit 1e5 from the origin, where float32 steps by 0.008, and spread 0.01 around
    their centres: x and its residuals taken in float32 were rounded to that step, which moved the
    centroids of both levels."""
    g = torch.Generator().manual_seed(0)
    x = 1e5 + 10 * torch.randn(4, 3, generator=g, dtype=torch.float64)[torch.arange(40) % 4]
    x = (x + 0.01 * torch.randn(40, 3, generator=g, dtype=torch.float64)).to(DEVICE)
    rvq, want = _residual_kmeans(x)
    for level, (c, _) in enumerate(want):
        assert_close(rvq.codebook[level], c.float(), torch.float32, f"codebook[{level}]")


def test_in_place_update_is_seen_by_autograd():
    """The eager path writes through the launchers, bypassing the dispatcher; it must still bump
    the version counters, so a codebook saved for backward and then updated is refused, not used
    stale."""
    x, codes, codebook, cs, es, cnt = make(9, 5, 4)
    p = torch.randn(5, 4, device=DEVICE, requires_grad=True)
    loss = (p * codebook).sum()  # saves codebook for the gradient of p
    versions = [t._version for t in (codebook, cs, es, cnt)]
    vq_ema_update(x, codes, codebook, cs, es, cnt, semantics="active", restart_after_steps=2)
    assert all(t._version > v for t, v in zip((codebook, cs, es, cnt), versions))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("which", ["codebook", "cluster_size", "embed_sum", "steps_since_active"])
def test_state_made_under_inference_mode_is_refused_outside_it(which):
    """PyTorch refuses to rewrite an inference tensor in place outside inference mode, and so does
    the registered op; the eager path, which launches without the dispatcher, wrote it."""
    x, codes, *state = make(9, 5, 4)
    names = ["codebook", "cluster_size", "embed_sum", "steps_since_active"]
    with torch.inference_mode():
        state[names.index(which)] = state[names.index(which)].clone()
    before = [t.clone() for t in state]
    with pytest.raises(RuntimeError, match=rf"{which} was made under torch.inference_mode\(\) and cannot be "
                                           r"rewritten in place outside it"):
        vq_ema_update(x, codes, *state, semantics="active", restart_after_steps=2)
    for t, b in zip(state, before):
        assert torch.equal(t, b)  # refused before anything was written
    with torch.inference_mode():
        vq_ema_update(x, codes, *state, semantics="active", restart_after_steps=2)
    assert not torch.equal(state[0], before[0])


def test_fake_tensors_take_the_registered_ops():
    """Under FakeTensorMode (export, shape propagation) nothing may reach a kernel or a reference:
    the update, the search and quantize go through the ops' fake implementations."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = make(9, 5, 4)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        x, codes, codebook, cs, es, cnt = (mode.from_tensor(t) for t in real)
        vq_ema_update(x, codes, codebook, cs, es, cnt, semantics="active", restart_after_steps=2)
        idx, dist = nearest_code(x, codebook)
        out, loss = quantize(x.requires_grad_(), idx, codebook)
        loss.backward()
    assert idx.shape == (9,) and idx.dtype == torch.int64 and dist.shape == (9,)
    assert out.shape == (9, 4) and x.grad.shape == (9, 4)


def test_module_repr_shows_its_options():
    """The modules printed as a bare ``VectorQuantizer()``."""
    assert repr(VectorQuantizer(4, 8, threshold=0.5)) == (
        "VectorQuantizer(dim=4, codebook_size=8, semantics='laplace', decay=0.99, threshold=0.5, cosine=False, "
        "precision='exact')")
    assert repr(ResidualVQ(3, 4, 8, semantics="active", restart_after_steps=5)).startswith(
        "ResidualVQ(num_levels=3, dim=4, codebook_size=8, semantics='active', decay=0.99, restart_after_steps=5")


def test_public_exports():
    assert sparsefuse.vq_ema_update is vq_ema_update and sparsefuse.nearest_code is nearest_code


# --- GPU tier ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("semantics", ["active", "laplace"])
@pytest.mark.parametrize("B,K,D", [(640, 256, 64), (16384, 1024, 128), (65536, 1024, 128), (32768, 4096, 256),
                                   (1000, 333, 77)])
def test_gpu_ema_update(B, K, D, semantics, dtype):
    x, codes, *state = make(B, K, D, dtype=dtype, used=K - K // 8)
    got, want = run_both(x, codes, state, semantics=semantics, threshold=1.0, restart_after=2)
    assert_state(got, want, scale=5)
    got_det, _ = run_both(x, codes, state, semantics=semantics, threshold=1.0, restart_after=2, deterministic=True)
    assert_state(got_det, want, scale=5)
    again, _ = run_both(x, codes, state, semantics=semantics, threshold=1.0, restart_after=2, deterministic=True)
    for a, b in zip(again, got_det):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("B,K,D", [(32768, 4096, 256), (4096, 1024, 256), (3000, 700, 200)])
def test_gpu_consecutive_updates_through_the_workspace(B, K, D, dtype):
    """Four eager updates in a row share the cached statistics buffer, alternating semantics, every
    one against the float64 reference. The apply kernel zeroes the sums it read; when that zeroing
    raced with the reads of other threads of the program (D = 256, half-precision x), the third
    update onwards lost part of its sums."""
    from sparsefuse.vq import kernels

    kernels.clear_ema_workspaces()
    _, _, *state = make(B, K, D, dtype=dtype)
    got = [t.clone() for t in state]
    want = [t.double() if t.is_floating_point() else t.clone() for t in state]
    for step, semantics in enumerate(["active", "laplace", "active", "laplace"]):
        x, codes, *_ = make(B, K, D, dtype=dtype, seed=10 + step, used=K - K // 8)
        vq_ema_update(x, codes, *got, decay=0.9, **restart_options(semantics, 1.0, 2),
                      generator=torch.Generator(device="cuda").manual_seed(step))
        reference.ema_update(x.double(), codes, *want, decay=0.9, active=semantics == "active", threshold=1.0,
                             restart_after=2, generator=torch.Generator(device="cuda").manual_seed(step))
        assert_state(got, want, scale=5)
        ws = kernels.ema_workspace(got[0], 1, K, D)
        for part in _workspace_views(ws, 1, K, D):
            assert torch.count_nonzero(part) == 0, f"step {step}: the workspace was left dirty"


@pytest.mark.gpu
@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_gpu_graph_capture_and_eager_updates(semantics):
    """A captured update allocates its own statistics inside the graph (no cached workspace):
    replays interleaved with eager updates of another state of the same shape on the same stream,
    and eager updates on a side stream, all match the reference at every step."""
    B, K, D = 4096, 256, 64
    x, codes, *state = make(B, K, D, used=200)
    kw = dict(decay=0.9, semantics=semantics, threshold=0.0, restart_after_steps=0)  # no restarts: keys unused
    graph_state, eager_state, side_state = ([t.clone() for t in state] for _ in range(3))
    want = [t.double() if t.is_floating_point() else t.clone() for t in state]

    def reference_step():
        reference.ema_update(x.double(), codes, *want, decay=0.9, active=semantics == "active", threshold=0.0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for st in (graph_state, eager_state, side_state):
            vq_ema_update(x, codes, *st, **kw)
    torch.cuda.current_stream().wait_stream(side)
    reference_step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vq_ema_update(x, codes, *graph_state, **kw)
    for _ in range(3):
        graph.replay()
        vq_ema_update(x, codes, *eager_state, **kw)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            vq_ema_update(x, codes, *side_state, **kw)
        torch.cuda.current_stream().wait_stream(side)
        reference_step()
        torch.cuda.synchronize()
        for st in (graph_state, eager_state, side_state):
            assert_state(st, want, scale=5)


@pytest.mark.gpu
def test_gpu_generator_device_checked():
    x, codes, *state = make(64, 16, 8)
    with pytest.raises(ValueError, match="generator is on cpu but the codebook is on cuda"):
        vq_ema_update(x, codes, *state, generator=torch.Generator())


@pytest.mark.gpu
@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_gpu_levels(semantics):
    L, B, K, D = 4, 4096, 512, 64
    x, codes, *state = make(B, K, D, L=L, used=400)
    got = [t.clone() for t in state]
    vq_ema_update(x, codes, *got, decay=0.9, **restart_options(semantics, 1.0, 2),
                  generator=torch.Generator(device="cuda").manual_seed(5))
    key = reference.draw_key(L, "cuda", torch.Generator(device="cuda").manual_seed(5))
    for level in range(L):
        want = [t[level].double() if t.is_floating_point() else t[level].clone() for t in state]
        reference.ema_update(x[level].double(), codes[level], *want, decay=0.9, active=semantics == "active",
                             threshold=1.0, restart_after=2, key=key[level:level + 1])
        assert_state([t[level] for t in got], want, scale=5)


GPU_SEARCH_MODES = [
    pytest.param(torch.float32, "exact", False, id="fp32-exact"),
    pytest.param(torch.float32, "exact", True, id="fp32-exact-cos"),
    pytest.param(torch.float32, "ieee", False, id="fp32-ieee"),
    pytest.param(torch.float32, "fast", False, id="fp32-fast"),
    pytest.param(torch.bfloat16, "exact", False, id="bf16"),
    pytest.param(torch.float16, "exact", True, id="fp16-cos"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision,cosine", GPU_SEARCH_MODES)
@pytest.mark.parametrize("B,K,D", [(65536, 4096, 256), (777, 333, 77)])
def test_gpu_nearest_code(B, K, D, cosine, precision, dtype):
    x, _, c, *_ = make(B, K, D, dtype=dtype)
    c = c.to(dtype)
    codes, dist = nearest_code(x, c, cosine=cosine, precision=precision)
    tol = 1e-5 if dtype == torch.float32 and precision != "fast" else 2e-3
    assert_search(x, c, codes, dist, cosine, tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision,cosine", GPU_SEARCH_MODES)
def test_gpu_nearest_code_nan_propagates(dtype, precision, cosine):
    """On a GPU a NaN row of x got dist 0 (tl.maximum(NaN, 0) is 0 there) and NaN codebook rows were
    skipped; both now follow the rule of the reference (see assert_nan_rule), in every tile."""
    x, _, c, *_ = make(1000, 333, 77, dtype=dtype)
    c = c.to(dtype)
    tol = 1e-5 if dtype == torch.float32 and precision != "fast" else 2e-3  # as in test_gpu_nearest_code
    x[[5, 600, 999], 10] = float("nan")
    codes, dist = nearest_code(x, c, cosine=cosine, precision=precision)
    assert (codes[[5, 600, 999]] == 0).all()
    assert_nan_rule(x, c, codes, dist, cosine, tol)
    c[[300, 200], 3] = float("nan")  # later tiles
    codes, dist = nearest_code(x, c, cosine=cosine, precision=precision)
    assert dist.isnan().all() and (codes[[5, 600, 999]] == 0).all()
    assert ((codes == 200).sum() == 997).item()
    assert_nan_rule(x, c, codes, dist, cosine, tol)


@pytest.mark.gpu
def test_gpu_compile_fullgraph_parity():
    _check_compile_fullgraph_parity("cuda")


@pytest.mark.gpu
def test_gpu_process_group_update_has_no_host_sync():
    """The process-group path drew its keys with a blocking host-to-device copy (torch.tensor(...)
    .to(device)) every step. A world-1 gloo group takes that path without collectives; CUDA's sync
    debug mode turns any synchronising call into an error."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x, codes, *state = make(4096, 256, 64, used=200)  # restarts: the keys are used
        kw = dict(decay=0.9, threshold=1.0, process_group=dist.group.WORLD)
        for generator in (torch.Generator(device="cuda").manual_seed(0), None):  # compile the kernels first
            vq_ema_update(x, codes, *state, generator=generator, **kw)
        torch.cuda.synchronize()
        sparsefuse.set_index_checks(False)  # a range check syncs by design (SPARSEFUSE_CHECK_INDICES=1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for generator in (torch.Generator(device="cuda").manual_seed(1), None):
                vq_ema_update(x, codes, *state, generator=generator, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            sparsefuse.set_index_checks(None)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_nearest_code_ties():
    base = torch.randn(300, 64, device="cuda")
    c = torch.cat([base] * 4)
    codes, _ = nearest_code(base, c)
    assert torch.equal(codes, torch.arange(300, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_quantize_and_step(dtype):
    x, codes, c, *_ = make(65536, 1024, 128, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.double().requires_grad_()
    out, loss = quantize(x1, codes, c, 0.25)
    want_out, want_loss = reference.quantize(x2, codes, c.to(dtype).double(), 0.25)
    assert_close(out, want_out, dtype, "out")
    assert_close(loss, want_loss, dtype, "loss")
    g1 = torch.autograd.grad(out.float().square().mean() + loss, x1)[0]
    g2 = torch.autograd.grad(want_out.square().mean() + want_loss, x2)[0]
    assert_close(g1, g2, dtype, "grad", scale=2)
    vq = VectorQuantizer(128, 1024, threshold=2.0).cuda()
    for _ in range(3):
        out, codes, loss = vq(x.float())
    assert torch.isfinite(vq.codebook).all() and torch.isfinite(loss)


# --- GPU tier: element offsets past 2^31 --------------------------------------------------------------------
# x of B * D = 2^31 + 2^19 bf16 / fp16 elements (4 GiB; the last 4096 rows lie past 2^31) starts 2^31
# elements into one buffer whose first 2^31 elements (the guard) hold known rows. A kernel that computed
# an element offset o >= 2^31 in int32 would wrap it to o - 2^32, i.e. buffer element o - 2^31: inside the
# guard, so a checked row would read a guard row (a different, recognisable one) instead of its own. Each
# case checks a handful of rows past 2^31 against float64, and every row past 2^31 against its known value.

_BIG_D = 128
_BIG_GUARD = 1 << 31
_BIG_ROWS = (_BIG_GUARD + (1 << 19)) // _BIG_D


@pytest.fixture
def big_gpu():
    """Skip without the ~17 GiB the largest of these cases takes; hand the memory back afterwards."""
    need_gpu_memory(20)
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _guarded(shape, dtype, guard_row, guard, device):
    """A contiguous tensor of ``shape`` that starts ``guard`` elements into one buffer whose first
    ``guard`` elements repeat ``guard_row`` (``[shape[-1]]``)."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.empty(guard + n, device=device, dtype=dtype)
    buf[:guard].view(-1, shape[-1]).copy_(guard_row)
    return buf[guard:].view(shape)


def _tail_rows(B, first, device):
    """A handful of row ids in [first, B): first rows past the boundary, the middle, the last."""
    return torch.tensor(sorted({first, first + 1, (first + B) // 2, B - 2, B - 1}), device=device)


def _others(B, first, rows, device):
    """Mask over rows [first, B) of those not in ``rows``."""
    m = torch.ones(B - first, dtype=torch.bool, device=device)
    m[rows - first] = False
    return m


def _run_big_nearest_code(dtype, cosine, B, D, guard, device):
    K = 64
    g = torch.Generator(device=device).manual_seed(0)
    c = torch.randn(K, D, device=device, generator=g).to(dtype)
    x = _guarded((B, D), dtype, c[0], guard, device)  # guard rows: code 0
    x.copy_(c[1])  # every row: code 1 ...
    first = guard // D
    rows = _tail_rows(B, first, device)
    want = torch.arange(2, 2 + len(rows), device=device)  # ... but the checked ones: codes 2, 3, ...
    x[rows] = (c[want].float() + 0.1 * torch.randn(len(rows), D, device=device, generator=g)).to(dtype)
    codes, dist = nearest_code(x, c, cosine=cosine)
    assert_search(x[rows], c, codes[rows], dist[rows], cosine, tol=2e-3)
    assert torch.equal(codes[rows], want)
    assert (codes[first:][_others(B, first, rows, device)] == 1).all()


def _run_big_quantize(B, D, guard, device):
    K, beta, bf16 = 64, 0.25, torch.bfloat16
    g = torch.Generator(device=device).manual_seed(1)
    cq = torch.randn(K, D, device=device, generator=g).to(bf16)
    c = cq.float()  # fp32 codebook of bf16 values: out is exact whatever the rounding
    x = _guarded((B, D), bf16, cq[0], guard, device)  # guard rows: code 0
    x.copy_(cq[1])  # every row is exactly code 1 (no loss) ...
    codes = torch.ones(B, dtype=torch.int64, device=device)
    first = guard // D
    rows = _tail_rows(B, first, device)
    want = torch.arange(2, 2 + len(rows), device=device)  # ... but the checked ones: near codes 2, 3, ...
    codes[rows] = want
    x[rows] = (c[want] + 0.5 * torch.randn(len(rows), D, device=device, generator=g)).to(bf16)
    x.requires_grad_()
    out, loss = quantize(x, codes, c, beta)
    others = _others(B, first, rows, device)
    assert torch.equal(out[rows], cq[want])
    assert (out[first:][others] == cq[1]).all()
    xr, qr = x.detach()[rows].double(), cq[want].double()
    assert_close(loss, beta * (xr - qr).square().sum() / (B * D), torch.float32, "loss")  # only they add to it
    # grad_out = x itself (no third big buffer), grad_loss = B * D: grad_x = x + 2 beta (x - out)
    (gx,) = torch.autograd.grad((out, loss), x, (x.detach(), torch.tensor(float(B * D), device=device)))
    assert_close(gx[rows], xr + 2 * beta * (xr - qr), bf16, "grad_x")
    assert torch.equal(gx[first:][others], x.detach()[first:][others])


def _run_big_strided_codebook(dtype, K, D, stride, guard, device):
    """A codebook [K, D] whose rows lie ``stride`` elements apart (stride < 2^31 but (K - 1) * stride
    >= 2^31), ``guard`` elements into one buffer whose guard holds another row. An int32 tile offset
    o_k * stride would wrap for the last code and read the guard: each row of x (its code's row plus
    noise) must find its own code."""
    g = torch.Generator(device=device).manual_seed(3)
    rows = torch.randn(K + 1, D, device=device, generator=g).to(dtype)
    buf = torch.empty(guard + (K - 1) * stride + D, device=device, dtype=dtype)
    buf[:guard].view(-1, D).copy_(rows[K])
    c = buf[guard:].as_strided((K, D), (stride, 1))
    c.copy_(rows[:K])
    x = (rows[:K].float() + 0.05 * torch.randn(K, D, device=device, generator=g)).to(dtype)
    codes, dist = nearest_code(x, c)
    assert torch.equal(codes, torch.arange(K, device=device))
    assert_search(x, c, codes, dist, tol=2e-3)


def _big_ema_reference(x, codes, state, key, decay, threshold):
    """Float64 reference of a laplace update (default eps, reset = threshold, no counters) of stacked
    x [L, B, D], without a float64 copy of x or a one-hot: (state, sums, dead, restart rows)."""
    cb, cs, es = (t.double() for t in state)
    L, K, D = cb.shape
    B = x.shape[1]
    n = torch.stack([torch.bincount(codes[i], minlength=K) for i in range(L)]).double()
    s = torch.zeros(L, K, D, dtype=torch.float64, device=x.device)
    step = 1 << 20
    for i in range(L):
        for j in range(0, B, step):
            s[i].index_add_(0, codes[i, j:j + step], x[i, j:j + step].double())
    dead = reference._blend_and_refresh(n, s, cb, cs, es, None, decay, False, 1e-5, threshold, 0)
    rank = dead.long().cumsum(1) - 1
    rows = reference.restart_rows(key[:, None, :], rank.clamp_min(0) % B, B)  # [L, K]
    v = torch.stack([x[i, rows[i]] for i in range(L)]).double()
    cb.copy_(torch.where(dead[..., None], v, cb))
    es.copy_(torch.where(dead[..., None], v * threshold, es))
    cs.copy_(torch.where(dead, torch.full_like(cs, threshold), cs))
    return (cb, cs, es), n, s, dead, rows


def _run_big_ema(L, deterministic, B, D, guard, device, K=4096, bulk=512):
    """Codes 0..4 take one checked row past the boundary each (last level), codes 8 .. 8 + bulk the
    other rows (row r: 8 + r % bulk), the rest are unused and restart (laplace, cluster size 0).
    Rows hold their id's bytes in dims 0..2, so every sum is an integer below 2^24 (exact in fp32
    in any order) and every row is recognisable; the guard holds -3."""
    bf16, decay, threshold = torch.bfloat16, 0.9, 0.5
    g = torch.Generator(device=device).manual_seed(2)
    x = _guarded((L, B, D), bf16, torch.full((D,), -3.0, device=device), guard, device)
    x.zero_()
    ids = torch.arange(B, device=device)
    for j in range(3):
        x[..., j] = ((ids >> (8 * j)) & 255).to(bf16)
    for i in range(L):
        x[i, :, 3] = i + 1
    codes = (8 + ids % bulk).expand(L, B).contiguous()
    first = guard // D - (L - 1) * B  # rows of the last level past the boundary
    rows = _tail_rows(B, first, device)
    codes[-1, rows] = torch.arange(len(rows), device=device)
    x[-1, rows] = torch.randn(len(rows), D, device=device, generator=g).to(bf16)
    cb = torch.randn(L, K, D, device=device, generator=g)
    cs = torch.zeros(L, K, device=device)
    cs[:, :8 + bulk] = 1.0
    state = [cb, cs, cb * cs[..., None]]
    # a generator seed that restarts some code of the last level from a row past the boundary
    n_dead = K - 8 - bulk
    for seed in range(64):
        key = reference.draw_key(L, device, torch.Generator(device=device).manual_seed(seed))
        if (reference.restart_rows(key[-1], torch.arange(n_dead, device=device), B) >= first).any():
            break
    else:
        pytest.fail("no seed restarts a code from a row past the boundary")
    want, n_want, s_want, dead, restart = _big_ema_reference(x, codes, state, key, decay, threshold)
    one = (lambda t: t[0]) if L == 1 else (lambda t: t)  # one level: the unstacked [B, D] path

    n, s = batch_statistics(one(x), one(codes), K, deterministic=deterministic)
    assert torch.equal(one(n_want).float(), n), "counts differ"
    assert torch.equal(one(s_want).float(), s), "sums differ"  # exact: integer sums, single rows

    got = [t.clone() for t in state]
    vq_ema_update(one(x), one(codes), *(one(t) for t in got), decay=decay, semantics="laplace", threshold=threshold,
                  generator=torch.Generator(device=device).manual_seed(seed), deterministic=deterministic)
    for name, a, b in zip(("codebook", "cluster_size", "embed_sum"), got, want):
        assert_close(a, b, torch.float32, name)
        assert_close(a[-1, :len(rows)], b[-1, :len(rows)], torch.float32, name + " of the checked rows' codes")
    hit = dead[-1] & (restart[-1] >= first)
    assert hit.any()
    assert torch.equal(got[0][-1][hit], x[-1, restart[-1][hit]].float()), "restart rows differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cosine", [(torch.bfloat16, False), (torch.float16, True)], ids=["bf16", "fp16-cos"])
def test_gpu_nearest_code_offsets_past_2_31(dtype, cosine, big_gpu):
    """x [2^24 + 2^12, 128] past 2^31 elements: 8 GiB with the guard."""
    _run_big_nearest_code(dtype, cosine, _BIG_ROWS, _BIG_D, _BIG_GUARD, "cuda")


@pytest.mark.gpu
def test_gpu_nearest_code_codebook_offsets_past_2_31(big_gpu):
    """bf16 codebook [5, 128] with rows 2^29 + 128 elements apart (the last at 2^31 + 512): 8 GiB."""
    _run_big_strided_codebook(torch.bfloat16, 5, _BIG_D, (1 << 29) + _BIG_D, _BIG_GUARD, "cuda")


@pytest.mark.gpu
def test_gpu_quantize_offsets_past_2_31(big_gpu):
    """Forward and backward, bf16 x [2^24 + 2^12, 128]: 8 GiB with the guard, out and grad_x 4 GiB each."""
    _run_big_quantize(_BIG_ROWS, _BIG_D, _BIG_GUARD, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "sorted"])
@pytest.mark.parametrize("L", [1, 2], ids=["one-level", "two-levels"])
def test_gpu_ema_update_offsets_past_2_31(L, deterministic, big_gpu):
    """batch_statistics and vq_ema_update (restarts included), bf16 x [L, B, 128] with L * B * 128 =
    2^31 + 2^19 (one level, or two whose second runs past 2^31): 8 GiB with the guard, ~10 GiB peak."""
    _run_big_ema(L, deterministic, _BIG_ROWS // L, _BIG_D, _BIG_GUARD, "cuda")


# Rare paths the session 52 mutation pass found untested (benchmarks/logs/mutation_session52_sae_kernels.md).


def test_ema_update_refuses_views_that_start_past_the_buffer_they_share():
    """The fast path compares storages, not the views' first elements: x taken from the codebook's
    rows 3..7, cluster_size from the middle of embed_sum, and counters from the middle of codes all
    start at another address than the tensor they alias, and must still be refused."""
    x, codes, cb, cs, es, cnt = make(12, 8, 4, used=3)
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

    real = make(12, 8, 4, used=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*data pointer of FakeTensor")
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            x, codes, cb, cs, es, cnt = (mode.from_tensor(t) for t in real)
            sparsefuse.vq_ema_update(x, codes, cb, cs, es, cnt, semantics="active", restart_after_steps=2)


# Rare paths the session 52 mutation pass over KD and VQ found untested (benchmarks/logs/mutation_session52_kd_vq.md).


@pytest.mark.parametrize("num_codes", [1, 3])
def test_vq_deterministic_statistics_of_a_crowded_last_code(num_codes):
    """The deterministic statistics take each whole chunk of sorted rows that holds one code from the
    chunk kernel's partial sums; the chunk kernel sums the chunks of codes in [0, K). The last code,
    K - 1, holding whole chunks (130 rows at the default chunk of 64) must be summed like any other
    (test_vq's crowded-code test crowds a middle code)."""
    g = torch.Generator().manual_seed(5)
    B, D = 130, 5
    x = torch.randn(B, D, generator=g).to(DEVICE)
    codes = torch.full((B,), num_codes - 1, dtype=torch.int64)
    codes[:3] = torch.arange(3) % num_codes
    codes = codes.to(DEVICE)
    n, s = batch_statistics(x, codes, num_codes, deterministic=True)
    want_n, want_s = reference.ema_accumulate(x[None].double(), codes[None], num_codes)
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
    g = torch.Generator().manual_seed(7)
    K, D = 20, 4  # two code tiles of 16 under the interpreter; the zero code in the second
    codebook = torch.rand(K, D, generator=g) + 0.1
    codebook[17] = 0
    x = torch.cat([codebook[[16, 18, 19, 3]] * 2.0,  # best codes in and out of the zero code's tile
                   -(torch.rand(3, D, generator=g) + 0.1)])  # every cos < 0: the zero code
    x, codebook = x.to(DEVICE).requires_grad_(), codebook.to(DEVICE).requires_grad_()
    codes, dist = nearest_code(x, codebook, cosine=True)
    want_codes, want_dist = reference.nearest_code(x.detach(), codebook.detach(), cosine=True)
    assert codes.tolist() == want_codes.tolist() == [16, 18, 19, 3, 17, 17, 17]
    torch.testing.assert_close(dist, want_dist, rtol=1e-5, atol=1e-5)
    gx, gc = torch.autograd.grad(dist.sum(), [x, codebook])
    assert torch.isfinite(gx).all() and torch.isfinite(gc).all()
    assert torch.equal(gx[4:], torch.zeros_like(gx[4:])) and torch.equal(gc[17], torch.zeros_like(gc[17]))


def test_vq_quantize_code_equal_to_k_without_index_checks():
    """With index checks off a code outside [0, K) is never dereferenced and its row of ``out`` is NaN;
    test_vq checks 1000 and -1, this the first code past the end, K itself. The codebook is the first
    K rows of a larger buffer, so reading row K would return a real (finite) row."""
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
