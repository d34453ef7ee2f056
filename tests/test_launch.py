"""The shared low-overhead launcher (``sparsefuse._launch.launch``).

CPU tier: under the interpreter it is ``kernel[grid](...)``. GPU tier: a cached launch must pick
the kernel Triton would have picked (dtype, 16-byte alignment, integer specialisation) and must
still call a profiler's launch hooks when some are installed.
"""

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from helpers import DEVICE
from sparsefuse._launch import launch


@triton.jit(do_not_specialize=["scale"])
def _axpb_kernel(x_ptr, y_ptr, n, scale, shift, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0).to(tl.float32)
    tl.store(y_ptr + o, (x * scale + shift).to(y_ptr.dtype.element_ty), mask=m)


def _run(x, scale, shift):
    y = torch.empty_like(x)
    n = x.numel()
    launch(_axpb_kernel, (triton.cdiv(n, 64),), (x, y, n, scale, shift), dict(BLOCK=64), 4)
    return y


def _cases():
    base = torch.randn(300, device=DEVICE)
    # dtypes, a view that is not 16-byte aligned, n = 1 and n divisible by 16, an int scale
    # past 32 bits (a do_not_specialize parameter still changes type), float shifts
    return [(base, 3, 0.5), (base.to(torch.bfloat16), 3, 0.5), (base[1:], 2, -1.0), (base[:1], 1, 0.0),
            (base[:32], 2**33, 0.0), (base[3:200].double(), -2, 0.25)]


def test_launch_matches_the_reference_formula():
    for x, scale, shift in _cases():
        want = (x.double() * scale + shift).to(x.dtype)
        torch.testing.assert_close(_run(x, scale, shift), want, rtol=1e-2, atol=1e-2 * abs(scale))


@pytest.mark.gpu
def test_gpu_cached_launches_pick_the_right_specialisation():
    """Each case twice in alternation: the second round goes through the launcher's cache."""
    for _ in range(2):
        for x, scale, shift in _cases():
            want = (x.double() * scale + shift).to(x.dtype)
            torch.testing.assert_close(_run(x, scale, shift), want, rtol=1e-2, atol=1e-2 * abs(scale))


@pytest.mark.gpu
def test_gpu_cached_launch_calls_installed_hooks():
    x = torch.randn(100, device="cuda")
    _run(x, 2, 1.0)  # compiled and cached
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _run(x, 2, 1.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    _run(x, 2, 1.0)
    torch.cuda.synchronize()
    assert seen == ["_axpb_kernel"]
