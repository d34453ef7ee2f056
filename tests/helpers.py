"""Shared test helpers: the one tolerance table, comparisons against float64, NaN poisoning."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

#: Relative error bound ||got - want|| / ||want|| against a float64 reference, per input dtype.
#: bf16 rows only run on the GPU tier (the interpreter computes bf16 wrongly).
TOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 2e-2,
}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if torch.isnan(got).any() or torch.isnan(want).any():
        return float("inf") if not torch.equal(torch.isnan(got), torch.isnan(want)) else 0.0
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, name: str = "value", scale: float = 1.0):
    """Relative-norm comparison with the tolerance of ``dtype`` (times ``scale``); shapes must match."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all() or not torch.isfinite(want).all(), f"{name}: non-finite values"
    err = rel_err(got, want)
    assert err <= TOL[dtype] * scale, f"{name}: relative error {err:.3e} > {TOL[dtype] * scale:.1e} ({dtype})"


def copy_strided(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` with the same strides (``clone`` of a view with gaps is contiguous), so
    a test of non-contiguous inputs really passes them, and two runs never share storage."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t.detach())


def assert_compile_parity(step, inputs, *, rtol=1e-5, atol=1e-7, value_rtol=1e-6, value_atol=None):
    """``step(*inputs)`` (a scalar) and the gradients of every input match between eager mode and
    ``torch.compile(step, fullgraph=True)``; each side runs on its own copies of ``inputs``."""
    eager = [t.detach().clone().requires_grad_() for t in inputs]
    comp = [t.detach().clone().requires_grad_() for t in inputs]
    torch._dynamo.reset()
    le, lc = step(*eager), torch.compile(step, fullgraph=True)(*comp)
    le.backward()
    lc.backward()
    torch.testing.assert_close(lc, le, rtol=value_rtol, atol=atol if value_atol is None else value_atol)
    for a, b in zip(comp, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=rtol, atol=atol)


def need_gpu_memory(gib: float) -> None:
    """Skip the calling test without ``gib`` GiB of free GPU memory, counting what PyTorch's
    allocator holds but does not use (the large-tensor tests of the GPU tier)."""
    import pytest

    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def nan_filled_empty(monkeypatch):
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        if t.dtype.is_floating_point and not t.is_meta and t.numel():
            try:
                t.fill_(float("nan"))
            except RuntimeError:  # fake / inference tensors
                pass
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(real_new_empty(self, *a, **k)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking, for a spawned process group's rendezvous.
    The operating system picks it, so two pytest-xdist workers spawning groups at once do not
    collide on a fixed port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_spawned_worker() -> None:
    """Leave a spawned process-group worker once its results are saved and its group destroyed,
    skipping interpreter finalisation: gloo's background threads can abort the process (SIGABRT,
    "terminate called without an active exception") while it is torn down, which fails
    ``mp.spawn`` after the work itself succeeded (seen once locally, on a loaded 2-core machine; the
    cause is discussed in pytorch/pytorch#179291)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_without_interpreter(code: str) -> None:
    """Run ``code`` in a fresh Python without TRITON_INTERPRET (CPU tensors then take the ops'
    PyTorch reference path); it must print ``ok`` last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
