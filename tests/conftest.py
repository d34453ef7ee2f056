"""Test tiers and shared fixtures.

CPU tier (default, CI): Triton kernels run on CPU tensors through the interpreter, which must be
switched on before anything imports triton. GPU tier: ``pytest -m gpu`` on a CUDA machine.
"""

import os

# Compile every test graph afresh: Inductor's on-disk cache keys do not cover a custom op's fake
# implementation, so a graph compiled before a fake changed would be replayed with stale strides.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import nan_filled_empty  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every torch.empty / empty_like / new_empty float tensor starts as NaN, so an output element
    that a kernel forgets to write fails the comparison instead of passing by luck."""
    nan_filled_empty(monkeypatch)
